"""offline_server.py: the offline engine's loopback server refuses hostile requests with 4xx JSON and
keeps answering; its errors and objects are the APIs' as the official openai and anthropic SDKs read them
(those tests need the SDKs, requirements-test.txt).
Vendors with: offline_server.py offline.py offline_target.py offline_attackers.py defenses.py metrics.py tfsg.py
  geodef.py endpoints.py testing.py
Run: python -m pytest -q test_offline_server.py
"""
import json
import threading
import time

import pytest
import requests

import metrics
import offline_server
import tfsg
from testing import _raw


def _start(srv):
    """Serve in a daemon thread, polling for shutdown every 0.05 s (serve_forever's default 0.5 s is what
    each test's shutdown() would wait) -> srv."""
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@pytest.fixture()
def engine():
    srv = _start(offline_server.make_server(0))
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _openai(url):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=url, api_key="offline", max_retries=0, _strict_response_validation=True)


def _chat(i):
    return {"model": "m", "messages": [{"role": "user", "content": tfsg.standard_prompt(f"boil eggs {i}",
                                                                                        ["eggs boil 6 minutes"])}]}


def test_offline_server_answers_every_hostile_request():
    """serve-offline answers bodies of the wrong shape with 4xx JSON, and a client that promises more
    body than it sends is dropped after the socket timeout (0.3 s here, well apart from the client's 5 s);
    the server keeps answering."""
    srv = _start(offline_server.make_server(0))
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions"
    try:
        for body in (b"[1]", b'"s"', b'{"messages": 3}', b'{"messages": [{"role": "user", "content": ["a"]}]}',
                     b'{"messages": [{"role": "user", "content": null}]}', b"[" * 100000 + b"]" * 100000, b"\xff"):
            r = requests.post(url, data=body, timeout=10)
            assert r.status_code == 400 and "error" in r.json(), body[:40]
        for head in (b"Content-Length: -1\r\n", b""):
            status, _ = _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n" + head + b"\r\n")
            assert status == 400
        r = requests.post(url, json={"messages": []}, headers={"Origin": "https://evil.example"}, timeout=10)
        assert r.status_code == 403                    # a web page's request: the engine is the local user's
        files = url.replace("/chat/completions", "/files/x/content")     # a rebound page's same-origin GET
        assert requests.get(files, headers={"Host": "evil.example"}, timeout=10).status_code == 403
        old_held = offline_server.MAX_HELD
        offline_server.MAX_HELD = 100
        try:
            srv.batches.keep_file("x" * 60, "a.jsonl", "batch")
            with pytest.raises(ValueError, match="at most 100"):
                srv.batches.keep_file("x" * 60, "b.jsonl", "batch")
            srv.batches.keep_file("x" * 60, "b_output.jsonl", "batch_output")    # a batch's outputs: always kept
        finally:
            offline_server.MAX_HELD = old_held
        for line, status in ((b"GET http://[x/", 400), (b"FOO http://[x/", 404)):   # a target urlsplit refuses
            assert _raw(srv, line + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")[0] == status
        old = offline_server._Handler.timeout
        offline_server._Handler.timeout = 0.3
        try:
            t0 = time.monotonic()
            _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{",
                 timeout=5)
            assert time.monotonic() - t0 < 4
        finally:
            offline_server._Handler.timeout = old
        ok_ = requests.post(url, json={"messages": [{"role": "user",
                                                     "content": metrics.asi_prompt("q", "a b c", "x")}]},
                            timeout=10)
        assert ok_.status_code == 200
    finally:
        srv.shutdown()


def test_errors_are_the_apis_error_objects(engine):
    """A bad id is OpenAI's 404 error object naming the path parameter and the id; an unknown cursor a 400
    naming `after` (not Python's "'x' is not in list"); Anthropic's routes answer in Anthropic's shape; a
    DELETE, PUT or OPTIONS on no route is a JSON 404 (not http.server's HTML 501); a prompt missing a field
    is a 400, not a 404."""
    srv, url = engine
    openai, sdk = _openai(url)
    for call, param, oid in ((lambda: sdk.files.retrieve("file-9"), "file_id", "file-9"),
                             (lambda: sdk.batches.retrieve("batch-9"), "batch_id", "batch-9")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.param == param and e.value.code is None and oid in e.value.message
        assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.batches.list(after="batch-9")
    assert e.value.param == "after" and "batch-9" in e.value.message and "not in list" not in e.value.message
    r = requests.get(f"{url}/messages/batches/batch-9", timeout=10)            # Anthropic's shape, no SDK needed
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": "No batch found with id 'batch-9'"}}
    r = requests.get(f"{url}/messages/batches", params={"after_id": "batch-9"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for method in ("DELETE", "PUT", "OPTIONS"):
        r = requests.request(method, f"{url}/batches/batch-1", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"Invalid URL ({method} /v1/batches/batch-1)"
    r = requests.delete(f"{url}/messages/batches/b", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    prompt = tfsg.json_block("input", {"rewrite_task": "F6.request", "document": "d"})
    r = requests.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": prompt}]}, timeout=10)
    assert r.status_code == 400 and "latent_query" in r.json()["error"]["message"]


def test_files_are_listed_and_deleted_through_the_sdk(engine):
    """files.list (newest first; asc, a purpose and pages of `limit` followed by `after`) and files.delete,
    every reply validated by the SDK's models; a deleted file is gone."""
    srv, url = engine
    openai, sdk = _openai(url)
    ids = [sdk.files.create(file=(f"in{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
    assert [f.id for f in sdk.files.list()] == ids[::-1]
    assert [f.id for f in sdk.files.list(order="asc", limit=1)] == ids            # paged: after the last id
    assert list(sdk.files.list(purpose="batch_output")) == []
    gone = sdk.files.delete(ids[1])
    assert gone.id == ids[1] and gone.deleted and gone.object == "file"
    assert [f.id for f in sdk.files.list()] == [ids[2], ids[0]]
    with pytest.raises(openai.NotFoundError):
        sdk.files.delete(ids[1])


def test_a_completion_carries_its_created_time(engine):
    """A chat completion has `created`, an int, as the SDK's strict models require."""
    srv, url = engine
    openai, sdk = _openai(url)
    done = sdk.chat.completions.create(**_chat(0))
    assert isinstance(done.created, int) and done.model == "offline-engine"


def test_a_batch_carries_model_and_usage(engine):
    """OpenAI's batch object has `model` and `usage` (the lines' tokens summed)."""
    srv, url = engine
    openai, sdk = _openai(url)
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": _chat(i)}) + "\n" for i in range(2))
    f = sdk.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.model == "offline-engine" and b.usage.total_tokens == 0
    while b.status != "completed":
        b = sdk.batches.retrieve(b.id)
    rows = [json.loads(x)["response"]["body"]["usage"] for x in sdk.files.content(b.output_file_id).text.splitlines()]
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in rows) > 0
    assert b.usage.total_tokens == sum(u["total_tokens"] for u in rows)
    assert b.usage.output_tokens_details.reasoning_tokens == 0


def test_a_reply_id_is_its_requests_digest_and_created_its_arrival_second(engine):
    """A chat reply's id differs between requests and repeats for the same request (so does its text);
    `created` is the second the request arrived, or the one make_server pins; an Anthropic batch's
    messages have ids of their own too."""
    srv, url = engine
    openai, sdk = _openai(url)
    t0 = int(time.time())
    a, b, again = (sdk.chat.completions.create(**_chat(i)) for i in (0, 1, 0))
    assert a.id != b.id and a.id == again.id and a.id.startswith("chatcmpl-")
    assert a.choices[0].message.content == again.choices[0].message.content
    assert t0 <= a.created <= again.created <= int(time.time())
    pinned = _start(offline_server.make_server(0, created=1234))
    try:
        r = requests.post(f"http://127.0.0.1:{pinned.server_address[1]}/v1/chat/completions", json=_chat(0),
                          timeout=10)
        assert r.json()["created"] == 1234 and r.json()["id"] == a.id
    finally:
        pinned.shutdown()
        pinned.server_close()
    anthropic = pytest.importorskip("anthropic")
    asdk = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="offline", max_retries=0,
                               _strict_response_validation=True)
    batch = asdk.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": {"max_tokens": 9, **_chat(i)}}
                                                   for i in range(2)])
    while batch.processing_status != "ended":
        batch = asdk.messages.batches.retrieve(batch.id)
    ids = {r.custom_id: r.result.message.id for r in asdk.messages.batches.results(batch.id)}
    assert len(set(ids.values())) == 2 and all(i.startswith("msg_") for i in ids.values())


def test_an_ended_message_batch_is_deleted_through_the_sdk(engine):
    """messages.batches.delete: refused (400) while the batch processes; once it has ended, the SDK's
    DeletedMessageBatch, and the batch and its results are gone (404) and out of the list."""
    anthropic = pytest.importorskip("anthropic")
    srv, url = engine
    sdk = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="offline", max_retries=0,
                              _strict_response_validation=True)
    b = sdk.messages.batches.create(requests=[{"custom_id": "r0", "params": {"max_tokens": 9, **_chat(0)}}])
    with pytest.raises(anthropic.BadRequestError, match="cancel it"):
        sdk.messages.batches.delete(b.id)
    while b.processing_status != "ended":
        b = sdk.messages.batches.retrieve(b.id)
    gone = sdk.messages.batches.delete(b.id)
    assert gone.id == b.id and gone.type == "message_batch_deleted"
    for call in (sdk.messages.batches.retrieve, sdk.messages.batches.results, sdk.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError):
            call(b.id)
    assert list(sdk.messages.batches.list()) == []


def test_a_batch_line_holding_unicode_line_separators_runs(engine):
    """A batch input line is read up to "\\n" alone (a trailing "\\r" dropped, empty lines skipped): U+2028,
    U+2029 and U+0085 written raw inside a JSON string (ensure_ascii=False, as batch_clients writes lines)
    stay inside their line."""
    srv, url = engine
    store, api = srv.batches, offline_server.OpenAIBatchAPI
    body = {"model": "m", "messages": [{"role": "user", "content": tfsg.standard_prompt(
        "boil eggs", ["eggs boil\u2028in 6 minutes\u2029at sea level\x85today"])}]}
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body},
                        ensure_ascii=False) for i in range(2)]
    fid = store.keep_file(lines[0] + "\n\n" + lines[1] + "\r\n", "in.jsonl", "batch")["id"]
    b = store.create({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}, api, "h")
    while b["status"] in offline_server.RUNNING:
        b = store.status(b["id"], api, "h")
    assert b["status"] == "completed" and b["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_an_upload_whose_file_part_is_multipart_is_a_400(engine):
    """A multipart upload whose `file` part is itself multipart (no bytes of its own) is refused with a 400
    naming the part, not a 500."""
    srv, url = engine
    body = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: multipart/mixed; boundary=C\r\n\r\n"
            b"--C\r\nContent-Type: text/plain\r\n\r\n{}\r\n--C--\r\n\r\n--B--\r\n")
    r = requests.post(f"{url}/files", data=body, headers={"Content-Type": "multipart/form-data; boundary=B"},
                      timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text


def test_a_line_the_engine_fails_on_is_an_error_row_and_running_batches_are_held_within_the_cap(engine, monkeypatch):
    """A line the engine raises RecursionError on (a body nested too deeply to encode; injected here) ends the
    batch with an error row for it (it escaped, and every status check raised it again: the batch never
    ended); each batch holds its parsed requests while it runs, so they count against MAX_HELD (six batches
    of one upload held six copies) and are let go when it ends."""
    srv, url = engine
    store, api = srv.batches, offline_server.OpenAIBatchAPI
    answer = offline_server.answer
    monkeypatch.setattr(offline_server, "answer", lambda body, at: answer(body, at) if body["messages"][0][
        "content"].find("eggs 1") < 0 else (_ for _ in ()).throw(RecursionError("too deep to encode")))
    text = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": _chat(i)}) for i in range(2))
    fid = store.keep_file(text, "in.jsonl", "batch")["id"]
    make = lambda: store.create({"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                 "completion_window": "24h"}, api, "h")
    b = make()
    for _ in range(20):
        if b["status"] not in offline_server.RUNNING:
            break
        b = store.status(b["id"], api, "h")
    assert b["status"] == "completed" and b["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    monkeypatch.setattr(offline_server, "MAX_HELD", 2 * len(text) - 1)   # one running batch's requests, not two
    second = make()
    with pytest.raises(ValueError, match="running batches' requests would reach"):
        make()
    while second["status"] in offline_server.RUNNING:
        second = store.status(second["id"], api, "h")
    make()                                                              # the ended batch's are let go
