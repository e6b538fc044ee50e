"""batch_clients.py over real HTTP: the offline engine's loopback server answering OpenAI's Files +
Batches and Anthropic's Message Batches. Equal to synchronous calls, batches in progress, expired
half done, failed lines, a kill while polling (the rerun asking fewer requests), results out of order,
refusals and creations failing for now, size limits; what is no answer (an id on two lines, unusable
lines); failed, lost and purged batches closed and sent again once, the lines they ran entered in the
ledger as lost; malformed statuses and listings; progress lines and the deadline; one manifest writer
for two runners; the engine's objects read by the official openai and anthropic SDKs, and its HTTP
framing; and `eval --batch-api` on the demo run giving the synchronous records at the batch price.
Needs: batch_clients.py, llm_clients.py, endpoints.py, accounting.py, offline_server.py, offline.py (and
what it imports); the SDK test the openai and anthropic packages (requirements-test.txt); the eval test
also the jobs and the demo run (conftest.py).
Run: python -m pytest -q test_batch_clients.py
"""
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

import accounting
import batch_clients
import llm_clients
import offline_server
import tfsg
from testing import HERE, _raw


# how often a server's loop looks for shutdown(): its default 0.5 s would hold every teardown that long
POLL = 0.05


@pytest.fixture()
def engine():
    srv = offline_server.make_server(0)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": POLL}, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def requests_(n, tag="q"):
    return [{"messages": [{"role": "user", "content": tfsg.standard_prompt(f"{tag} {i} boil eggs",
                                                                           [f"eggs boil {i} minutes", "stocks"])}]}
            for i in range(n)]


def batched(url, tmp_path, protocol="openai", model="m", logs=None, ledger=None, **kw):
    """A client whose map() goes through a BatchRunner on tmp_path's manifest; ledger: its usage ledger (stage
    "s"); kw: the runner's."""
    kw.setdefault("poll", 0.01)
    log = logs.append if logs is not None else lambda m: None
    manifest = str(tmp_path / "batches.json")
    return llm_clients.Client.open(url, model, protocol=protocol, cache_dir=str(tmp_path / "cache"), ledger=ledger,
                                   stage="s", batch=lambda c: batch_clients.BatchRunner(c, manifest, log=log, **kw))


def ledger_rows(ledger):
    """The usage ledger's rows of stage "s" by label."""
    return accounting.ledger_usage(ledger)["stages"].get("s", {})


def synchronous(url, reqs):
    return [r.text for r in llm_clients.Client.open(url, "m").map(reqs, progress=False)]


def manifest(tmp_path):
    return json.load(open(tmp_path / "batches.json"))["batches"]


def _one_batch(engine, tmp_path, protocol):
    """Six requests in one batch in progress for four polls -> (the client, its replies, the requests)."""
    srv, url = engine
    srv.batches.knobs["polls"] = 4
    reqs = requests_(6)
    c = batched(url, tmp_path, protocol)
    return c, c.map(reqs, progress=False), reqs


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_batches_equal_synchronous_calls(engine, tmp_path, protocol):
    """Results matched on custom_id (Anthropic's come back reversed), in progress for several polls."""
    srv, url = engine
    c, got, reqs = _one_batch(engine, tmp_path, protocol)
    want = synchronous(url, reqs)                     # the engine speaks OpenAI synchronously
    assert [r.text for r in got] == want and c.batch.stats["batches"] == 1
    assert srv.batches.batches["batch-1"]["polls"] >= 4


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_rerun_of_a_batched_stage_sends_nothing(engine, tmp_path, protocol):
    """Replies cached as chat() caches them; a rerun sends no request."""
    srv, url = engine
    _, _, reqs = _one_batch(engine, tmp_path, protocol)
    want = synchronous(url, reqs)
    again = batched(url, tmp_path, protocol)
    assert [r.text for r in again.map(reqs, progress=False)] == want
    assert again.stats["http_calls"] == 0 and srv.batches.created == 1


def test_expired_or_failed_lines_resubmit_exactly_what_is_missing(engine, tmp_path):
    srv, url = engine
    srv.batches.knobs.update(expire_after=4, fail_first=1)
    c = batched(url, tmp_path)
    got = c.map(requests_(8), progress=False)
    b1, b2 = srv.batches.batches["batch-1"], srv.batches.batches["batch-2"]
    assert b1["total"] == 8 and b2["total"] == 4 + 1      # 4 expired + 1 failed (500), nothing else
    assert c.batch.stats["retried"] == 5 and all(r.text for r in got)
    assert [b["status"] for b in manifest(tmp_path)] == ["expired", "completed"]


def test_size_limits_split_a_stage_into_several_batches(engine, tmp_path):
    srv, url = engine
    c = batched(url, tmp_path, limits=(2, 1 << 20))
    c.map(requests_(5), progress=False)
    assert srv.batches.created == 3 and [b["total"] for b in srv.batches.batches.values()] == [2, 2, 1]
    big = batched(url, tmp_path / "b", limits=(100, 3000))          # bytes: each line is ~1.2 KB
    big.map(requests_(5, "other"), progress=False)
    assert srv.batches.created == 3 + 3


def test_refused_batches_fail_or_fall_back_as_asked(engine, tmp_path):
    srv, url = engine
    srv.batches.knobs["reject"] = True
    with pytest.raises(batch_clients.BatchUnsupported, match="refused at creation"):
        batched(url, tmp_path).map(requests_(2), progress=False)
    srv.batches.knobs.update(reject=False, missing=True)
    with pytest.raises(batch_clients.BatchUnsupported, match="no batch endpoint"):
        batched(url, tmp_path / "x").map(requests_(2), progress=False)
    auto = batched(url, tmp_path / "y", auto=True)
    assert all(r.text for r in auto.map(requests_(2), progress=False)) and auto.stats["http_calls"] == 2 + 1


def test_a_kill_while_polling_resumes_the_same_batch(engine, tmp_path):
    """SIGKILL while the batch is in progress; the rerun collects the recorded batch instead of
    submitting the requests again."""
    srv, url = engine
    srv.batches.knobs["polls"] = 10 ** 6
    # the requests go in as JSON: the child imports only the clients, not this file (and torch through it)
    code = ("import sys, json, llm_clients, batch_clients\n"
            "c = llm_clients.Client.open(sys.argv[1], 'm', cache_dir=sys.argv[2] + '/cache', batch=lambda c: "
            "batch_clients.BatchRunner(c, sys.argv[2] + '/batches.json', poll=0.01, log=print))\n"
            "c.map(json.loads(sys.argv[3]), progress=False)\n")
    p = subprocess.Popen([sys.executable, "-c", code, url, str(tmp_path), json.dumps(requests_(4))], cwd=HERE,
                         stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = tmp_path / "batches.json"
        if m.exists() and json.load(open(m))["batches"] and json.load(open(m))["batches"][0]["id"]:
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    srv.batches.knobs["polls"] = 0
    c = batched(url, tmp_path)
    out = c.map(requests_(4), progress=False)
    assert srv.batches.created == 1 and all(r.text for r in out) and c.batch.stats["batches"] == 0


@pytest.mark.parametrize("recorded", [True, False])
def test_a_rerun_asking_fewer_requests_takes_every_line_of_the_resumed_batch(engine, tmp_path, recorded):
    """Killed while its batch of 8 runs, the stage is rerun with 4 of them: the batch's other 4 lines, billed,
    are counted, and cached as chat() caches them (JSON parsed where asked), so that a later map of those 4
    reads them instead of buying them again. A manifest entry without its JSON record (written before it was
    kept) cannot say how to cache them: they are counted only."""
    srv, url = engine
    srv.batches.knobs["polls"] = 10 ** 6
    reqs, ledger = [{**r, "json": i % 2 == 0} for i, r in enumerate(requests_(8))], str(tmp_path / "usage.jsonl")

    def killed(s):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        batched(url, tmp_path, ledger=ledger, sleep=killed).map(reqs, progress=False)
    if not recorded:
        m = batch_clients.Manifest.at(str(tmp_path / "batches.json"))
        m.update(m.data["batches"][0], json=None)
    srv.batches.knobs["polls"] = 0
    c = batched(url, tmp_path, ledger=ledger)
    c.map(reqs[:4], progress=False)
    assert ledger_rows(ledger)["openai:m [batch]"]["replies"] == 8 and srv.batches.created == 1
    later = c.map(reqs[4:], progress=False)
    want = llm_clients.Client.open(url, "m").map(reqs[4:], progress=False)
    assert [(r.text, r.data) for r in later] == [(r.text, r.data) for r in want] and later[0].data is not None
    assert srv.batches.created == (1 if recorded else 2)


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_batch_whose_creation_reply_was_lost_is_found_not_created_again(engine, tmp_path, protocol):
    """The server made the batch and the reply was lost: before asking again the runner looks for it (a
    second batch would be billed again), and collects it; a batch the manifest holds already (the stage's
    first, of the same size) is not taken for the second."""
    srv, url = engine
    srv.batches.knobs["lose_created"] = 2
    c = batched(url, tmp_path, protocol, limits=(3, 1 << 30))
    reqs = requests_(6)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 2 and [b["id"] for b in manifest(tmp_path)] == ["batch-1", "batch-2"]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("code", [429, 503])
def test_a_creation_failing_past_the_retries_raises_and_leaves_batching_on(engine, tmp_path, protocol, code):
    """A rate limit or a 5xx at creation, still there past the transport's retries, may pass: it is the
    LLMError it is, not BatchUnsupported, which under `auto` would send every later stage synchronously at
    twice the price; the next map batches (after looking for the batch the failed creation may have made)."""
    srv, url = engine
    c, reqs = batched(url, tmp_path, protocol, auto=True), requests_(3)
    send, down = c.transport.send, [True]

    def creation_down(method, u, *a, **kw):
        if down[0] and method == "POST" and u.endswith("batches"):
            raise llm_clients.LLMError(f"HTTP {code}", code)
        return send(method, u, *a, **kw)
    c.transport.send = creation_down
    with pytest.raises(llm_clients.LLMError, match=f"HTTP {code}") as e:
        c.map(reqs, progress=False)
    assert not isinstance(e.value, batch_clients.BatchUnsupported) and not c.batch.unsupported
    down[0] = False
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 1 and c.batch.stats["batches"] == 1


def test_a_server_without_batches_is_asked_once_per_stage_and_a_rerun_falls_back_again(engine, tmp_path):
    """A refused creation made nothing: its manifest entry is closed, so a rerun (its replies not cached)
    neither looks for it nor fails on a server that lists no batches."""
    srv, url = engine
    srv.batches.knobs["missing"] = True
    reqs = requests_(2)
    for _ in range(2):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        assert all(r.text for r in batched(url, tmp_path, auto=True).map(reqs, progress=False))
    assert [b["reason"] for b in manifest(tmp_path)] == ["refused at creation"] * 2


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_kill_before_the_batch_id_was_recorded_resumes_that_batch(engine, tmp_path, protocol, monkeypatch):
    """Killed between the creation and the manifest's record of its id: the rerun finds the batch the entry
    asked for and collects it instead of paying for another."""
    srv, url = engine
    record = batch_clients.Manifest.update

    def killed_at_the_id(self, entry, **fields):
        if fields.get("id"):
            raise KeyboardInterrupt
        record(self, entry, **fields)
    monkeypatch.setattr(batch_clients.Manifest, "update", killed_at_the_id)
    reqs = requests_(3)
    with pytest.raises(KeyboardInterrupt):
        batched(url, tmp_path, protocol).map(reqs, progress=False)
    monkeypatch.setattr(batch_clients.Manifest, "update", record)
    assert srv.batches.created == 1 and manifest(tmp_path)[0]["id"] is None
    c = batched(url, tmp_path, protocol)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 1 and c.batch.stats["batches"] == 0 and manifest(tmp_path)[0]["id"] == "batch-1"


# ----------------------------------------------------------------------------- what is no answer


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_an_id_on_two_lines_or_one_never_asked_is_no_answer(engine, tmp_path, protocol):
    """The output answers the first request twice (the second line with another text) and an id the
    batch never asked: neither is cached; the request goes into the next batch; one log line says so."""
    srv, url = engine
    stray = {"custom_id": "never-asked", "result": {"type": "succeeded", "message": {}},
             "response": {"status_code": 200, "body": {}}}
    srv.batches.knobs["tamper"] = lambda rows: rows + [json.loads(json.dumps(rows[0]).replace("eggs", "WRONG")),
                                                       stray]
    logs, reqs = [], requests_(3)
    got = batched(url, tmp_path, protocol, logs=logs).map(reqs, progress=False)
    assert [r.text for r in got] == synchronous(url, reqs)
    assert srv.batches.batches["batch-2"]["total"] == 1
    said = [m for m in logs if "more than one line" in m]
    assert len(said) == 1 and "batch-1" in said[0] and "1 requests" in said[0] and "1 lines for ids" in said[0]


@pytest.mark.parametrize("odd", [{"body": None}, {"body": {"choices": []}}, "not an object",
                                 {"status_code": "200"}])
def test_an_unusable_200_line_goes_the_synchronous_way(engine, tmp_path, odd):
    srv, url = engine

    def spoil(rows):
        r = rows[0]["response"]
        rows[0]["response"] = odd if isinstance(odd, str) else {**r, **odd, "body": odd.get("body", r["body"])}
        return rows
    srv.batches.knobs["tamper"] = spoil
    reqs = requests_(3)
    c = batched(url, tmp_path)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 1 and c.batch.stats["cached"] == 2


# ----------------------------------------------------------------------------- batches that cannot answer


def _failed_batch(engine, tmp_path):
    """Three requests whose first batch fails (the provider says why) -> (their replies, the log lines)."""
    srv, url = engine
    srv.batches.knobs["fail"] = "line 1: model 'm' does not exist"
    logs, reqs = [], requests_(3)
    return batched(url, tmp_path, logs=logs).map(reqs, progress=False), logs, reqs


def test_a_failed_batch_is_sent_again_once(engine, tmp_path):
    srv, url = engine
    got, _, reqs = _failed_batch(engine, tmp_path)
    assert [r.text for r in got] == synchronous(url, reqs) and srv.batches.created == 2
    first, second = manifest(tmp_path)
    assert first["collected"] and second["status"] == "completed"


def test_a_failed_batch_names_the_providers_reason(engine, tmp_path):
    _, logs, _ = _failed_batch(engine, tmp_path)
    said = next(m for m in logs if "batch-1 failed" in m)
    assert "model 'm' does not exist" in said and "3 requests go into a new batch" in said
    assert "does not exist" in manifest(tmp_path)[0]["reason"]


def test_refresh_takes_the_batchs_replies_instead_of_sending_them_again(engine, tmp_path):
    """refresh=True ignores what earlier runs cached, not what this run's batch just stored: map() answers
    from the batch's replies, with no synchronous request (each would be paid twice)."""
    srv, url = engine
    reqs, manifest_path, ledger = requests_(3), str(tmp_path / "batches.json"), str(tmp_path / "usage.jsonl")
    runner = lambda c: batch_clients.BatchRunner(c, manifest_path, poll=0.01, log=lambda m: 0)
    c = llm_clients.Client.open(url, "m", cache_dir=str(tmp_path / "cache"), refresh=True, ledger=ledger,
                                stage="s", batch=runner)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert list(accounting.ledger_usage(ledger)["stages"]["s"]) == ["openai:m [batch]"]    # no synchronous reply


def test_a_key_in_a_failed_batchs_reason_is_masked_before_it_is_cut(engine, tmp_path):
    """The provider's reason is cut to 200 characters per message: masked first, no part of a key echoed
    across the cut reaches the log or batches.json."""
    srv, url = engine
    key = "sk-" + "A1b2C3d4" * 6
    srv.batches.knobs["fail"] = "x" * 190 + " bad key " + key
    logs, manifest_path = [], str(tmp_path / "batches.json")
    runner = lambda c: batch_clients.BatchRunner(c, manifest_path, log=logs.append, poll=0.01)
    c = llm_clients.Client.open(url, "m", api_key=key, cache_dir=str(tmp_path / "cache"), batch=runner)
    c.map(requests_(2), progress=False)
    kept = open(manifest_path).read() + "\n".join(logs)
    assert "bad key" in kept and key[:6] not in kept.replace("sk-***", "")


def test_status_checks_that_fail_past_the_retries_are_asked_again(engine, tmp_path):
    """A provider outage longer than the transport's retries (three 500s in a row per status check) while a
    batch runs: the runner polls on and takes the batch's answers, instead of ending the run."""
    srv, url = engine
    logs, reqs = [], requests_(2)
    c = batched(url, tmp_path, logs=logs)
    c.transport.sleep = lambda s: None
    srv.batches.knobs["status_down"] = 4       # the first check's three attempts, and the next check's first
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 1 and c.batch.stats["cached"] == 2
    assert any("no status (" in m and "asking again" in m for m in logs)


def test_a_recorded_batch_the_server_no_longer_knows_is_replaced_by_a_new_one(engine, tmp_path):
    """batches.json records an open batch from another API key (HTTP 404): the rerun closes it with its
    reason and answers its requests in a new batch; nobody deletes the file by hand."""
    srv, url = engine
    reqs = requests_(3)
    keys = [llm_clients.Client.open(url, "m").request_key(**r)[0] for r in reqs]
    (tmp_path / "batches.json").write_text(json.dumps({"batches": [
        {"digest": "x", "custom_ids": keys, "id": "batch_from_another_key", "provider": "openai:m",
         "status": None, "collected": False}]}))
    c = batched(url, tmp_path)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    lost, new = manifest(tmp_path)
    assert lost["collected"] and "HTTP 404" in lost["reason"] and new["status"] == "completed"
    assert srv.batches.created == 1


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_batch_whose_results_were_purged_is_replaced_by_a_new_one(engine, tmp_path, protocol):
    srv, url = engine
    srv.batches.knobs["purge"] = True
    reqs = requests_(3)
    got = batched(url, tmp_path, protocol).map(reqs, progress=False)
    assert [r.text for r in got] == synchronous(url, reqs) and srv.batches.created == 2
    assert "HTTP 404" in manifest(tmp_path)[0]["reason"]


def test_results_over_the_size_cap_go_to_a_new_batch_once_then_synchronously(engine, tmp_path):
    srv, url = engine
    logs, reqs = [], requests_(3)
    c = batched(url, tmp_path, logs=logs)
    c.batch.results_cap = 1000                  # one reply (~300 bytes) fits, three output lines do not
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert srv.batches.created == 2 and all("size cap" in b["reason"] for b in manifest(tmp_path))
    assert any("batch-2" in m and "3 requests are sent synchronously" in m for m in logs)


# (the engine fails OpenAI batches only, and answers Anthropic's protocol by batch only: no synchronous way)
@pytest.mark.parametrize("protocol, how", [("openai", "purged"), ("anthropic", "purged"), ("openai", "over the cap"),
                                           ("openai", "failed")])
def test_a_lost_batch_enters_the_lines_it_ran_in_the_ledger(engine, tmp_path, protocol, how):
    """A batch whose 3 lines ran but whose results cannot be read (purged, over the size cap) is sent again:
    the first batch's billed lines are one ledger row, lost and unmetered (the cost unknown, not short); over
    the cap, the second batch's too, before the synchronous way. A batch that failed validation ran none:
    no such row."""
    srv, url = engine
    srv.batches.knobs.update(purge=how == "purged", fail="bad line" if how == "failed" else None)
    ledger, reqs = str(tmp_path / "usage.jsonl"), requests_(3)
    c = batched(url, tmp_path, protocol, ledger=ledger)
    c.batch.results_cap = 1000 if how == "over the cap" else c.batch.results_cap   # ~300 bytes a line, one fits
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs) and srv.batches.created == 2
    rows = ledger_rows(ledger)
    label = f"{protocol}:m [batch]"
    lost = {k: rows[label].get(k, 0) for k in ("lost", "unmetered")}
    assert lost == ({"lost": 0, "unmetered": 0} if how == "failed" else
                    {"lost": 3 * (1 + (how == "over the cap")), "unmetered": 1 + (how == "over the cap")})


def test_a_status_without_a_status_field_counts_as_lost(engine, tmp_path):
    srv, url = engine
    srv.batches.knobs["no_status"] = batch_clients.MALFORMED_POLLS
    reqs = requests_(2)
    got = batched(url, tmp_path).map(reqs, progress=False)
    assert [r.text for r in got] == synchronous(url, reqs) and srv.batches.created == 2
    assert "without a status field" in manifest(tmp_path)[0]["reason"]


# ----------------------------------------------------------------------------- progress and deadline


def virtual_time(limit):
    """(sleep, clock) over a virtual clock: polls take no real time; sleeping past `limit` fails the test
    (a runner that polls forever)."""
    now = [1000.0]

    def sleep(s):
        now[0] += s
        assert now[0] < 1000.0 + limit, "still polling past the deadline"
    return sleep, lambda: now[0]


def test_progress_is_logged_as_the_request_counts_change(engine, tmp_path):
    srv, url = engine
    srv.batches.knobs["polls"] = 4                 # 8 lines: 1, 3, 4, 6 completed at polls 1..4, then done
    logs = []
    batched(url, tmp_path, logs=logs).map(requests_(8), progress=False)
    shown = [m.split("batch-1 ")[1] for m in logs if "in_progress" in m]
    assert shown == [f"in_progress: {n}/8 completed, 0 failed" for n in (1, 3, 4, 6)]


def test_progress_of_a_stalled_batch_is_logged_every_few_polls(engine, tmp_path):
    srv, url = engine
    srv.batches.knobs["stall"] = 3
    sleep, clock = virtual_time(2 * 600)
    logs = []
    c = batched(url, tmp_path, logs=logs, poll=1.0, deadline=600, sleep=sleep, clock=clock)
    c.map(requests_(8), progress=False)
    polls = srv.batches.batches["batch-1"]["polls"]
    shown = [m for m in logs if "in_progress" in m]
    assert polls > 3 * batch_clients.PROGRESS_EVERY and 1 <= len(shown) <= polls // batch_clients.PROGRESS_EVERY + 1


def test_a_batch_that_never_ends_is_cancelled_at_its_deadline(engine, tmp_path):
    """The batch stalls with 3 of 8 lines done: at the deadline it is cancelled and recorded so, its 3
    replies are kept and the 5 others sent synchronously."""
    srv, url = engine
    srv.batches.knobs["stall"] = 3
    sleep, clock = virtual_time(2 * 90)
    logs, reqs = [], requests_(8)
    c = batched(url, tmp_path, logs=logs, poll=1.0, deadline=90, sleep=sleep, clock=clock)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert c.batch.stats["cached"] == 3 and srv.batches.created == 1
    assert [(b["status"], b["reason"]) for b in manifest(tmp_path)] == [("cancelled", "deadline")]
    assert any("batch-1 still running at its deadline" in m and "5 requests sent synchronously" in m for m in logs)


@pytest.mark.parametrize("protocol, ran", [("openai", 3), ("anthropic", 8)])
def test_a_cancelled_batch_is_waited_for_while_it_is_cancelling(engine, tmp_path, protocol, ran):
    """The provider takes 4 status checks to end a cancelled batch (OpenAI: up to 10 minutes): the lines
    it ran are still taken, not bought again synchronously (the engine answers Anthropic's protocol by
    batch only, so there every line has run)."""
    srv, url = engine
    srv.batches.knobs.update(stall=ran, cancelling=4)
    sleep, clock = virtual_time(90 + batch_clients.CANCEL_GRACE)
    reqs = requests_(8)
    c = batched(url, tmp_path, protocol, poll=1.0, deadline=90, sleep=sleep, clock=clock)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert c.batch.stats["cached"] == ran and srv.batches.created == 1
    assert [(b["status"], b["reason"]) for b in manifest(tmp_path)] == [(
        "ended" if protocol == "anthropic" else "cancelled", "deadline")]


def test_a_kill_while_cancelling_resumes_to_the_deadlines_outcome(engine, tmp_path):
    """Killed while the batch cancelled at its deadline is still cancelling; it has ended when the run is
    resumed (past its deadline): the lines it ran are taken and the rest go synchronously, as without the
    kill, not into a new batch."""
    srv, url = engine
    srv.batches.knobs.update(stall=3, cancelling=1)
    sleep, clock = virtual_time(90 + batch_clients.CANCEL_GRACE)

    def killed_while_cancelling(s):
        if any(b["state"] == "cancelling" for b in srv.batches.batches.values()):
            raise KeyboardInterrupt
        sleep(s)
    reqs = requests_(8)
    c = batched(url, tmp_path, poll=1.0, deadline=90, sleep=killed_while_cancelling, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        c.map(reqs, progress=False)
    logs = []
    c = batched(url, tmp_path, logs=logs, poll=1.0, deadline=90, sleep=sleep, clock=clock)
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs)
    assert c.batch.stats["cached"] == 3 and srv.batches.created == 1
    assert [(b["status"], b["reason"]) for b in manifest(tmp_path)] == [("cancelled", "deadline")]
    assert any("5 requests sent synchronously" in m for m in logs)


@pytest.mark.parametrize("after_cancel, lost", [("cancelling", 3), ("no status", 8)])
def test_a_batch_given_up_after_its_cancel_enters_the_lines_it_ran_as_lost(engine, tmp_path, after_cancel, lost):
    """Still cancelling CANCEL_GRACE after its cancel at the deadline, with 3 of its 8 lines run (or no status
    after the cancel: how many ran is unknown, so all 8 may have): its lines are not taken, the requests go
    synchronously, and the ledger holds the billed lines as lost, unmetered, so that the cost reads unknown
    rather than short."""
    srv, url = engine
    srv.batches.knobs.update(stall=3, cancelling=10 ** 6)
    sleep, clock = virtual_time(90 + batch_clients.CANCEL_GRACE + 60)
    logs, reqs, ledger = [], requests_(8), str(tmp_path / "usage.jsonl")
    c = batched(url, tmp_path, logs=logs, ledger=ledger, poll=1.0, deadline=90, sleep=sleep, clock=clock)
    if after_cancel == "no status":
        c.transport.sleep, send = (lambda s: None), c.transport.send

        def status_down_after_the_cancel(method, u, *a, **kw):
            if u.endswith("/cancel"):
                srv.batches.knobs["status_down"] = 10 ** 6
            return send(method, u, *a, **kw)
        c.transport.send = status_down_after_the_cancel
    got = c.map(reqs, progress=False)
    srv.batches.knobs["status_down"] = 0
    assert [r.text for r in got] == synchronous(url, reqs)
    assert c.batch.stats["cached"] == 0
    if after_cancel == "cancelling":
        assert any("batch-1 still cancelling 600 s after its cancel" in m for m in logs)
    assert any("8 requests sent synchronously" in m for m in logs)
    row = ledger_rows(ledger)["openai:m [batch]"]
    assert (row["lost"], row["unmetered"], row["replies"], row["cost_usd"]) == (lost, 1, 0, None)
    assert ledger_rows(ledger)["openai:m"]["replies"] == 8



def test_the_wait_on_a_cancelling_batch_is_logged(engine, tmp_path):
    """A batch cancelled at its deadline stays cancelling: the log says so as the wait starts (the batch,
    its state, the longest wait) and every few status checks while it lasts, as polling does."""
    srv, url = engine
    srv.batches.knobs.update(stall=3, cancelling=10 ** 6)
    sleep, clock = virtual_time(90 + batch_clients.CANCEL_GRACE + 60)
    logs = []
    c = batched(url, tmp_path, logs=logs, poll=1.0, deadline=90, sleep=sleep, clock=clock)
    c.map(requests_(8), progress=False)
    starts = [i for i, m in enumerate(logs) if "batch-1 cancelling: 3/8 completed, 0 failed: waiting up to 600 s "
              "for the cancel to end" in m]
    during = [i for i, m in enumerate(logs) if m.endswith("batch-1 cancelling: 3/8 completed, 0 failed")]
    gave_up = [i for i, m in enumerate(logs) if "batch-1 still cancelling 600 s after its cancel" in m]
    checks = srv.batches.batches["batch-1"]["cancel_checks"]
    assert len(starts) == 1 and len(gave_up) == 1 and starts[0] < min(during) and max(during) < gave_up[0]
    assert checks > 3 * batch_clients.PROGRESS_EVERY and 3 <= len(during) <= checks // batch_clients.PROGRESS_EVERY + 1


# ----------------------------------------------------------------------------- the manifest


def test_two_runners_on_one_manifest_record_every_batch(engine, tmp_path):
    """A target's and a judge's runner on the same run folder, polling at once: after each submission
    (where a kill could come) every batch submitted so far is in batches.json."""
    srv, url = engine
    srv.batches.knobs["polls"] = 3
    submitted, missing = [], []

    def log(m):
        if "submitted" in m:
            submitted.append(m.split()[3])
            known = set(submitted)       # before reading the file: the other runner may log one more meanwhile
            on_disk = {b["id"] for b in manifest(tmp_path)}
            missing.extend(known - on_disk)
    clients = [batched(url, tmp_path, model=name, limits=(2, 1 << 20)) for name in ("target", "judge")]
    for c in clients:
        c.batch.log = log
    threads = [threading.Thread(target=c.map, args=(requests_(6, c.model),), kwargs={"progress": False})
               for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(submitted) == 6 and not missing
    assert {b["id"] for b in manifest(tmp_path)} == set(srv.batches.batches)


def test_a_failed_manifest_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "batches.json").mkdir()           # the rename fails: a folder holds the file's place
    m = batch_clients.Manifest.at(str(tmp_path / "batches.json"))
    with pytest.raises(OSError):
        m.add({"custom_ids": ["k"], "id": None})
    assert os.listdir(tmp_path) == ["batches.json"]


# ----------------------------------------------------------------------------- the engine's batch APIs


def test_the_official_openai_sdk_runs_a_batch_on_the_engine(engine):
    """Unchanged SDK calls, every reply validated against the SDK's models: upload, create, retrieve
    until ended, list, read the output, cancel another."""
    openai = pytest.importorskip("openai")
    srv, url = engine
    sdk = openai.OpenAI(base_url=url, api_key="offline", max_retries=0, _strict_response_validation=True)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", **r}} for i, r in enumerate(requests_(2))]
    f = sdk.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    assert sdk.files.retrieve(f.id).filename == "in.jsonl"
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        b = sdk.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == 2 and b.completed_at >= b.created_at
    out = [json.loads(x) for x in sdk.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["r0", "r1"] and out[0]["response"]["status_code"] == 200
    other = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert sdk.batches.cancel(other.id).status == "cancelling"
    assert sdk.batches.retrieve(other.id).status == "cancelled"
    assert [x.id for x in sdk.batches.list(limit=1)] == [other.id, b.id]      # newest first, paged


def test_the_official_anthropic_sdk_runs_a_batch_on_the_engine(engine):
    anthropic = pytest.importorskip("anthropic")
    srv, url = engine
    sdk = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="offline", max_retries=0,
                              _strict_response_validation=True)        # the SDK adds /v1/messages/batches
    reqs = [{"custom_id": f"r{i}", "params": {"model": "m", "max_tokens": 100, **r}}
            for i, r in enumerate(requests_(2))]
    b = sdk.messages.batches.create(requests=reqs)
    while b.processing_status != "ended":
        b = sdk.messages.batches.retrieve(b.id)
    assert b.request_counts.succeeded == 2 and b.ended_at >= b.created_at
    results = {r.custom_id: r.result for r in sdk.messages.batches.results(b.id)}
    assert set(results) == {"r0", "r1"} and results["r0"].type == "succeeded"
    other = sdk.messages.batches.create(requests=reqs)
    assert sdk.messages.batches.cancel(other.id).processing_status == "canceling"
    assert sdk.messages.batches.retrieve(other.id).request_counts.canceled == 2
    assert [x.id for x in sdk.messages.batches.list(limit=1)] == [other.id, b.id]


def raw_batch(url, protocol, bodies):
    """A batch of chat bodies created and polled over plain HTTP until it ends -> its JSONL lines
    (Anthropic's results; OpenAI's output and error files), every status call answered 200."""
    if protocol == "anthropic":
        reqs = [{"custom_id": f"r{i}", "params": {"model": "m", "max_tokens": 100, **b}} for i, b in enumerate(bodies)]
        path = f"{url}/messages/batches/" + requests.post(f"{url}/messages/batches",
                                                          json={"requests": reqs}).json()["id"]
    else:
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "m", **b}}) + "\n" for i, b in enumerate(bodies))
        f = requests.post(f"{url}/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", lines)}).json()
        path = f"{url}/batches/" + requests.post(f"{url}/batches", json={
            "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()["id"]
    while True:
        r = requests.get(path)
        assert r.status_code == 200, r.text
        st = r.json()
        if st.get("processing_status") == "ended" or st.get("status") in batch_clients.ENDED:
            break
    urls = [st["results_url"]] if protocol == "anthropic" else \
        [f"{url}/files/{st[k]}/content" for k in ("output_file_id", "error_file_id") if st[k]]
    return [json.loads(x) for u in urls for x in requests.get(u).text.splitlines()]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_prompt_the_engine_cannot_answer_is_one_error_line(engine, protocol):
    srv, url = engine
    lines = raw_batch(url, protocol, requests_(1) + [{"messages": [{"role": "user", "content": "hello"}]}])
    by_id = {x["custom_id"]: x for x in lines}
    if protocol == "anthropic":
        assert by_id["r0"]["result"]["type"] == "succeeded" and by_id["r1"]["result"]["type"] == "errored"
    else:
        assert [by_id[k]["response"]["status_code"] for k in ("r0", "r1")] == [200, 400]


def test_a_burst_of_connections_waits_to_be_accepted():
    """100 connections opened before the server accepts any: each completes its handshake (a listen
    backlog of 5 would drop the rest) and is then served."""
    srv, socks = offline_server.make_server(0), []
    try:
        for _ in range(100):
            socks.append(socket.create_connection(srv.server_address[:2], timeout=1.0))
    finally:
        # shutdown() waits for it
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": POLL}, daemon=True).start()
    try:
        assert len(socks) == 100
        for s in socks:
            s.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert all(s.recv(12).startswith(b"HTTP/1.0 200") for s in socks)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("length", ["+{n}", "{n}_0"])
def test_content_length_is_digits_only(engine, length):
    srv, url = engine
    body = json.dumps(requests_(1)[0]).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Length: {length.format(n=len(body))}\r\n\r\n")
    status, _ = _raw(srv, head.encode() + body)
    assert status == 400


# ----------------------------------------------------------------------------- the eval job


def test_eval_batch_api_gives_the_synchronous_records_at_half_price(demo_run, tmp_path):
    """The demo run's evaluation again through the batch API: identical records and figures, the
    ledger's rows marked [batch], and the price halved."""
    import run
    shutil.copytree(demo_run.parent, tmp_path / "o")
    d = tmp_path / "o" / "demo"
    want = {f: open(d / "results" / f).read() for f in os.listdir(d / "results")
            if f.endswith(".jsonl") and not f.startswith("rerank-")}          # eval's records
    shutil.rmtree(d / "results")
    shutil.rmtree(d / "cache" / "llm")
    os.remove(d / "usage.jsonl")
    prices = tmp_path / "p.json"
    prices.write_text(json.dumps({"offline-engine": [1.0, 2.0]}))
    t0 = time.monotonic()
    run.main(["eval", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--batch-api", "on",
                  "--batch-poll", "0.01", "--prices", str(prices)])
    wall = time.monotonic() - t0
    got = {f: open(d / "results" / f).read() for f in os.listdir(d / "results") if f.endswith(".jsonl")}
    assert len(got) >= 8 and all(got[f] == want[f] for f in got)      # every condition, the clean reference
    manifest = json.load(open(d / "batches.json"))["batches"]
    stages = json.load(open(d / "summary.json"))["usage"]["stages"]["eval"]
    assert set(stages) == {"offline:offline-engine [batch]"} and len(manifest) >= 1
    row = stages["offline:offline-engine [batch]"]
    assert row["cost_usd"] == pytest.approx(0.5 * (row["prompt_tokens"] * 1 + row["completion_tokens"] * 2) / 1e6)
    print(f"batches {len(manifest)}, lines {sum(len(b['custom_ids']) for b in manifest)}, wall {wall:.1f} s")


def test_a_results_url_off_the_apis_scheme_and_host_loses_the_batch_not_the_key():
    """The key goes with the GET of an Anthropic results_url: one on another host, or on http for an https API,
    is refused as a batch that cannot answer (its requests sent again), and the refusal names no userinfo."""
    t = llm_clients.Transport("https://api.anthropic.com/v1", "anthropic:m", "anthropic", api_key="sk-ant-SECRET")
    api = batch_clients.AnthropicBatches(t, "anthropic:m")
    ok = "https://api.anthropic.com/v1/messages/batches/b1/results"
    assert api.result_urls({"state": "ended", "results_url": ok}) == [ok]
    for url in ("http://api.anthropic.com/v1/messages/batches/b1/results", "https://sk-ant-x@evil.example/r",
                "/v1/messages/batches/b1/results"):
        with pytest.raises(batch_clients._Lost, match="results_url elsewhere") as e:
            api.result_urls({"state": "ended", "results_url": url})
        assert "sk-ant" not in str(e.value)


def test_a_results_file_is_read_for_the_asked_ids_only():
    """Lines for ids never asked are counted and dropped as they are parsed; a line nested past the parser's
    depth is no record, not a crash (it wedged every rerun of the collection)."""
    deep = "[" * 100000 + "]" * 100000
    text = '{"custom_id": "a", "n": 1}\n' + '{"custom_id": "zz"}\n' * 3 + deep + '\n{"custom_id": "a", "n": 2}'
    assert batch_clients._jsonl(text, {"a"}) == ([{"custom_id": "a", "n": 1}, {"custom_id": "a", "n": 2}], 3)


@pytest.mark.parametrize("data", [{"message": "a dict, not a list"}, 7])
def test_a_status_with_malformed_errors_is_read_not_a_crash(engine, tmp_path, data):
    """A Batch object whose errors.data is not a list (a proxy's dict, an int) has no reasons: the batch is
    polled and taken as usual, where a TypeError escaped polling and crashed every rerun on the open entry."""
    srv, url = engine
    c, reqs = batched(url, tmp_path), requests_(2)
    send = c.transport.send

    def odd_errors(method, u, *a, **kw):
        got = send(method, u, *a, **kw)
        return {**got, "errors": {"object": "list", "data": data}} if u.endswith("/batches/batch-1") else got
    c.transport.send = odd_errors
    assert [r.text for r in c.map(reqs, progress=False)] == synchronous(url, reqs) and c.batch.stats["cached"] == 2
    t = llm_clients.Transport("https://api.openai.com/v1", "openai:m", "openai")
    st = batch_clients.OpenAIBatches(t, "openai:m").status({"status": "failed", "errors": {"data": data},
                                                             "output_file_id": {"id": "f"}, "error_file_id": 3})
    assert (st["why"], st["output"], st["errors"]) == ("the provider gave no reason", None, None)


def test_a_listed_batch_without_a_string_id_is_not_adopted():
    """`find` over a listing whose closer batch has an id that is a list, a dict or a number: skipped (a list or
    dict id raised TypeError on every rerun), the batch with a string id adopted."""
    made = "2025-01-01T00:00:00+00:00"
    tried = datetime.datetime.fromisoformat(made).timestamp()
    counts = {"processing": 2, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    odd = [{"id": bad, "created_at": made, "request_counts": counts, "input_file_id": "file-1"}
           for bad in (["x"], {"x": 1}, 7)]
    good = {"id": "b-2", "created_at": "2025-01-01T00:00:09+00:00", "request_counts": counts,
            "input_file_id": "file-1"}
    for protocol, api in (("anthropic", batch_clients.AnthropicBatches), ("openai", batch_clients.OpenAIBatches)):
        t = llm_clients.Transport(f"https://api.{protocol}.com/v1", f"{protocol}:m", protocol)
        t.send = lambda *a, **kw: {"data": odd + [good]}
        entry = {"custom_ids": ["k1", "k2"], "tried_at": tried, "input_file_id": "file-1"}
        assert api(t, f"{protocol}:m").find(entry, {"b-1"}) is good


def test_a_providers_reason_reaches_the_log_escaped(engine, tmp_path):
    """A batch's failure reason from the server holds control characters (ESC, OSC, \\r): the log line has them
    as \\xHH, as serve.py's access log writes them, so a server cannot retitle or clear the terminal."""
    srv, url = engine
    srv.batches.knobs["fail"] = "model \x1b]0;owned\x07\r\x1b[2J gone"
    logs = []
    batched(url, tmp_path, logs=logs).map(requests_(3), progress=False)
    said = next(m for m in logs if "batch-1 failed" in m)
    assert "model \\x1b]0;owned\\x07\\x0d\\x1b[2J gone" in said


def test_a_batch_line_is_resubmitted_only_for_a_reason_a_later_batch_can_help():
    """Each provider's per-line outcomes as its batch reference lists them: OpenAI's request_timeout (the model's
    call timed out) goes into another batch as its batch_expired and Anthropic's timeout_error do, not to the
    synchronous API at twice the price; a request the API refused (400) fails."""
    oa, an = batch_clients.OpenAIBatches.outcome, batch_clients.AnthropicBatches.outcome
    for code in ("batch_expired", "batch_cancelled", "request_timeout"):
        assert oa({"custom_id": "k", "response": None, "error": {"code": code, "message": "m"}})[0] == "retry"
    assert oa({"custom_id": "k", "response": {"status_code": 400, "body": {"error": {}}}})[0] == "fail"
    assert oa({"custom_id": "k", "response": {"status_code": 200, "body": {"id": "r"}}}) == ("ok", {"id": "r"})
    wrapped = {"type": "errored", "error": {"type": "error", "error": {"type": "timeout_error"}}}
    assert an({"custom_id": "k", "result": wrapped})[0] == "retry"
    assert an({"custom_id": "k", "result": {"type": "errored", "error": {"type": "invalid_request_error"}}})[0] == \
        "fail"


def test_an_anthropic_batch_is_read_as_its_reference_gives_it():
    """Message Batches count every request as processing until the whole batch has ended: counts read before
    that would say none ran (a batch given up while canceling entered nothing in the ledger, its billed lines
    bought again at a cost that read known); a batch ended after a cancel, or with a request expired, did not
    complete (its rest goes synchronously past the deadline), one ended on its own did."""
    status = batch_clients.AnthropicBatches(llm_clients.Transport("https://api.anthropic.com/v1", "anthropic:m",
                                                                   "anthropic"), "anthropic:m").status
    n = lambda **kw: {"request_counts": {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0,
                                         **kw}}
    assert status({"processing_status": "canceling", **n(processing=8)})["counts"] is None
    ended = status({"processing_status": "ended", **n(succeeded=3, errored=1, canceled=4)})
    assert ended["counts"] == (3, 5, 8) and ended["completed"]
    assert not status({"processing_status": "ended", "cancel_initiated_at": "2026-12-05T10:00:00Z",
                       **n(succeeded=3, canceled=5)})["completed"]
    assert not status({"processing_status": "ended", **n(succeeded=7, expired=1)})["completed"]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_batch_that_ended_on_its_own_is_no_late_batch_when_read_after_its_deadline(engine, tmp_path, protocol):
    """Killed while polling, resumed an hour later: the batch ended on its own long ago (Anthropic's "ended", as
    OpenAI's "completed"), with one line failed for a reason retrying helps. That line goes into a new batch at the
    batch price, not synchronously, and nothing says the batch was cancelled."""
    srv, url = engine
    now = [1000.0]
    srv.batches.knobs.update(polls=10 ** 6)

    def killed(s):
        raise KeyboardInterrupt
    reqs = requests_(4)
    with pytest.raises(KeyboardInterrupt):
        batched(url, tmp_path, protocol, poll=1.0, deadline=90, sleep=killed, clock=lambda: now[0]).map(
            reqs, progress=False)
    now[0] += 3600
    srv.batches.knobs.update(polls=0, fail_first=1)
    logs = []
    c = batched(url, tmp_path, protocol, logs=logs, poll=1.0, deadline=90, sleep=lambda s: None, clock=lambda: now[0])
    assert len(c.map(reqs, progress=False)) == 4
    assert srv.batches.created == 2 and [b["reason"] for b in manifest(tmp_path)] == [None, None]
    assert not any("at its deadline" in m or "synchronously" in m for m in logs)


def test_a_batch_made_after_the_creation_call_could_end_is_another_runs(engine, tmp_path, monkeypatch):
    """A run killed inside its creation call a day ago resumes: it looks for the batch that call may have made
    (a Message Batch names no input), but one of the same size made today is another run's. Adopted, it would
    be cancelled at this run's deadline, long past; it is left alone and the run makes its own."""
    srv, url = engine
    srv.batches.knobs["polls"] = 10 ** 6
    yesterday = lambda: time.time() - 86400

    def killed(*a, **kw):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(batch_clients.AnthropicBatches, "create", killed)
        with pytest.raises(KeyboardInterrupt):
            batched(url, tmp_path / "a", "anthropic", deadline=3600, clock=yesterday).map(requests_(4, "A"),
                                                                                          progress=False)
    with pytest.raises(KeyboardInterrupt):            # the other run: its batch made, then killed while polling
        batched(url, tmp_path / "b", "anthropic", sleep=killed).map(requests_(4, "B"), progress=False)
    srv.batches.knobs["polls"] = 0
    a = batched(url, tmp_path / "a", "anthropic", deadline=3600, sleep=lambda s: None)
    assert len(a.map(requests_(4, "A"), progress=False)) == 4
    assert srv.batches.created == 2 and srv.batches.batches["batch-1"]["state"] != "cancelling"
    assert [x["id"] for x in manifest(tmp_path / "a")] == [None, "batch-2"]      # (the killed call made none)
    # a creation call retried until today (its lookups between attempts recorded last_try) may have made it
    entry = {"tried_at": yesterday(), "last_try": time.time() - 5, "custom_ids": ["k"] * 4}
    assert a.batch.provider.find(entry, set())["id"] == "batch-1"
    assert a.batch.provider.find({**entry, "last_try": None}, set()) is None
