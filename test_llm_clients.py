"""llm_clients.py over real HTTP (a scripted loopback server): retries, Retry-After, adaptation of
refused parameters, JSON re-asks, the cache, keys and URL credentials never leaked, Ctrl-C.
Vendors with: llm_clients.py transport.py endpoints.py accounting.py conftest.py testing.py (no torch)
Run: python -m pytest -q test_llm_clients.py
"""
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

import accounting
import endpoints
import llm_clients
import transport
from testing import Script, client, ok, send_json


def test_retry_after_then_success(server):
    sleeps = []
    Script.script = [(429, {"Retry-After": "2"}, {"error": {"message": "slow down"}}, 0),
                     (503, {"retry-after-ms": "1500"}, {"error": {"message": "busy"}}, 0), (200, {}, ok("hi"), 0)]
    r = client(server, sleeps).chat([{"role": "user", "content": "x"}])
    assert r.text == "hi" and len(Script.seen) == 3 and sleeps == [2.0, 1.5]
    sleeps.clear()
    Script.script = [(500, {}, {}, 0), (500, {}, {}, 0), (200, {}, ok("hi"), 0)]
    client(server, sleeps).chat([{"role": "user", "content": "y"}])
    assert 0.375 <= sleeps[0] <= 0.5 and 0.75 <= sleeps[1] <= 1.0     # min(0.5 * 2^n, 8) s, 25% jitter


class StrictModel(BaseHTTPRequestHandler):
    """Loopback server answering like a reasoning model behind an OpenAI-style API: a 400 naming each
    parameter it does not take (temperature other than its default, max_tokens, JSON mode)."""
    seen = []
    refusals = [("temperature", "Unsupported value: 'temperature' does not support 0 with this model. Only the "
                                "default (1) value is supported.", "unsupported_value"),
                ("max_tokens", "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                               "'max_completion_tokens' instead.", "unsupported_parameter"),
                ("response_format", "Invalid parameter: 'response_format' of type 'json_object' is not supported "
                                    "with this model.", "unsupported_parameter")]

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StrictModel.seen.append(body)
        status, payload = 200, ok(json.dumps({"echo": body["messages"][-1]["content"]}))
        for param, message, code in self.refusals:
            if param in body:
                status, payload = 400, {"error": {"message": message, "type": "invalid_request_error",
                                                  "param": param, "code": code}}
                break
        send_json(self, payload, status)

    def log_message(self, *a):
        pass


class ContextLimit(BaseHTTPRequestHandler):
    """Loopback server answering like an OpenAI-style API with a context window: a 400 for a prompt holding
    "LONG" or a conversation past its first turn (too long for the model), the prompt echoed otherwise."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][-1]["content"]
        if "LONG" in text or len(body["messages"]) > 1:
            send_json(self, {"error": {"message": "This model's maximum context length is 8192 tokens.",
                                       "type": "invalid_request_error", "code": "context_length_exceeded"}}, 400)
        elif "CREDIT" in text:
            send_json(self, {"error": {"type": "invalid_request_error",
                                       "message": "Your credit balance is too low to access the API."}}, 400)
        else:
            send_json(self, ok(text))

    def log_message(self, *a):
        pass


def test_a_request_the_server_refuses_for_its_text_fails_alone():
    """A page too long for the model's context (or one a content filter refuses) is a 400 no retry changes: it
    stopped the whole run. In map(invalid="return") it takes its request's place as an unusable reply; another
    400 (a low credit balance) still stops the run, and so do REFUSED_STOP refusals in a row."""
    srv, url = _serve(ContextLimit)
    try:
        c = llm_clients.Client.open(url, "m", max_retries=0)
        reqs = [{"messages": [{"role": "user", "content": t}]} for t in ("a", "b LONG", "c", "d", "e", "f")]
        [reask] = c.map([{**reqs[0], "json": True}], progress=False, invalid="return")    # "a" is no JSON: the
        assert isinstance(reask, llm_clients.RequestRefused) and reask.attempts == 2  # re-ask refused, 2 sent
        out = c.map(reqs, progress=False, invalid="return")
        assert [r.text for i, r in enumerate(out) if i != 1] == ["a", "c", "d", "e", "f"]
        assert isinstance(out[1], llm_clients.ReplyInvalid) and out[1].status == 400
        assert "maximum context length" in str(out[1])
        with pytest.raises(llm_clients.LLMError, match="HTTP 400"):       # a caller that takes no failures
            c.map(reqs[1:2], progress=False)
        with pytest.raises(llm_clients.LLMError, match="credit balance"):  # the run's cause, not the page's
            c.map([{"messages": [{"role": "user", "content": "CREDIT"}]}], progress=False, invalid="return")
        many = [{"messages": [{"role": "user", "content": f"LONG {i}"}]} for i in range(llm_clients.REFUSED_STOP)]
        assert all(isinstance(r, llm_clients.RequestRefused) for r in c.map(many[1:], progress=False,
                                                                               invalid="return"))
        with pytest.raises(llm_clients.LLMError, match=r"8 requests in a row refused, stopped .*context length"):
            c.map(many[:1] + reqs[:1], progress=False, invalid="return")
    finally:
        srv.shutdown()


def test_parameters_the_model_refuses_are_adapted_once(tmp_path, capsys):
    """GPT-5.x and o-series reject temperature 0 ("only the default (1) value is supported"), o-series
    behind proxies reject max_tokens, some servers JSON mode: each 400 that names such a parameter
    changes the request once for the client (logged once, reported by usage()), concurrent requests
    included; replies are cached under the request as asked, so a new client finds them all."""
    StrictModel.seen = []
    srv, url = _serve(StrictModel)
    reqs = [{"messages": [{"role": "user", "content": f"q{i}"}], "temperature": 0, "max_tokens": 64, "json": True}
            for i in range(24)]
    try:
        c = llm_clients.Client.open(url, "gpt-x", api_key="sk-test-0123", max_field="max_tokens",
                               cache_dir=str(tmp_path / "c"))
        out = c.map(reqs, workers=8, progress=False)
        assert [r.data for r in out] == [{"echo": f"q{i}"} for i in range(24)]
        assert c.usage()["adapted"] == ["temperature: not sent (the API accepts only the model's default)",
                                        "token cap sent as max_completion_tokens",
                                        "JSON mode off (JSON still parsed from the text, with re-asks)"]
        assert capsys.readouterr().err.count("HTTP 400 refused a parameter") == 3
        last = StrictModel.seen[-1]
        assert "temperature" not in last and last["max_completion_tokens"] == 64 and "response_format" not in last
        assert len(StrictModel.seen) <= 24 + 3 * 8            # at most one refused try per change and worker
        n = len(StrictModel.seen)
        again = llm_clients.Client.open(url, "gpt-x", api_key="sk-test-0123", max_field="max_tokens",
                                   cache_dir=str(tmp_path / "c"))
        assert [r.data for r in again.map(reqs, workers=8, progress=False)] == [r.data for r in out]
        assert len(StrictModel.seen) == n and "adapted" not in again.usage()   # all from the cache
        # a 400 about anything else is not retried
        StrictModel.refusals = StrictModel.refusals + [("messages", "'messages' must not be empty", "bad")]
        with pytest.raises(llm_clients.LLMError, match="HTTP 400"):
            c.chat([{"role": "user", "content": "new"}], json=True)
    finally:
        StrictModel.refusals = StrictModel.refusals[:3]
        srv.shutdown()


@pytest.mark.parametrize("status", [500, 503, 524, 529])       # 524: a Cloudflare gateway's timeout
def test_5xx_then_success(server, status):
    Script.script = [(status, {}, {"error": {"message": "overloaded"}}, 0)] * 2 + [(200, {}, ok("fine"), 0)]
    c = client(server)
    assert c.chat([{"role": "user", "content": "x"}]).text == "fine"
    assert len(Script.seen) == 3 and c.stats["retries"] == 2


@pytest.mark.parametrize("status,body", [
    (401, {"error": {"message": "bad key sk-SECRET-123"}}),
    (429, {"error": {"message": "You exceeded your quota", "code": "insufficient_quota"}}),
    (400, {"error": {"message": "bad request"}}),
    (501, {"error": {"message": "not implemented"}}),
    (429, {"type": "error", "error": {"type": "rate_limit_error",
                                      "details": {"error_code": "enforced_spend_limit_reached"}}}),
])
def test_non_retryable_fail_at_once(server, status, body):
    Script.script = [(status, {}, body, 0)] * 3
    with pytest.raises(llm_clients.LLMError) as e:
        client(server).chat([{"role": "user", "content": "x"}])
    assert e.value.status == status and len(Script.seen) == 1
    assert "sk-SECRET-123" not in str(e.value) and "sk-SECRET-123" not in (e.value.body or "")


def test_long_retry_after_is_an_immediate_error(server):
    Script.script = [(429, {"retry-after-ms": "600000"}, {"error": {}}, 0)] * 3
    with pytest.raises(llm_clients.LLMError, match="wait 600s"):
        client(server).chat([{"role": "user", "content": "x"}])
    assert len(Script.seen) == 1


def test_a_slow_server_times_out_into_retries(server):
    Script.script = [(200, {}, ok("late"), 1.5)] * 2 + [(200, {}, ok("fast"), 0)]
    assert client(server, timeout=0.5).chat([{"role": "user", "content": "x"}]).text == "fast"
    Script.script = [(200, {}, ok("late"), 1.0)] * 3
    with pytest.raises(llm_clients.LLMError, match="Timeout"):
        client(server, timeout=0.3, max_retries=1).chat([{"role": "user", "content": "y"}])


def test_a_non_json_200_is_an_error_with_its_status(server):
    Script.script = [(200, {}, "<html>gateway</html>", 0)]
    with pytest.raises(llm_clients.LLMError, match="not JSON") as e:
        client(server).chat([{"role": "user", "content": "x"}])
    assert e.value.status == 200


def test_replies_of_the_wrong_types_are_shape_errors_or_no_count(server):
    """Usage that is no count ("abc", NaN, 1e400, a list) counts 0; a content that is not text, or JSON nested
    past the parser's depth, is an error naming the shape, never an uncaught crash."""
    for usage in ({"prompt_tokens": "abc", "completion_tokens": float("nan")}, {"prompt_tokens": float("inf")}, [1],
                  {"prompt_tokens": 10 ** 400}):
        Script.script = [(200, {}, {**ok("fine"), "usage": usage}, 0)]
        c = client(server)
        assert c.chat([{"role": "user", "content": repr(usage)}]).text == "fine"
        assert c.usage()["prompt_tokens"] == c.usage()["completion_tokens"] == 0
    Script.script = [(200, {}, ok([{"type": "text", "text": "x"}]), 0)]
    with pytest.raises(llm_clients.LLMError, match="unexpected response shape"):
        client(server).chat([{"role": "user", "content": "parts"}])
    Script.script = [(200, {}, ok("[" * 5000 + "]" * 5000), 0)] * 3
    with pytest.raises(llm_clients.LLMError):
        client(server, json_retries=1).chat([{"role": "user", "content": "deep"}], json=True)


def test_a_refused_connection_names_the_url_after_its_attempts():
    with pytest.raises(llm_clients.LLMError, match=r"ConnectionError on http://127\.0\.0\.1:9/v1/chat/completions "
                                                   r"after 2 attempts"):
        llm_clients.Client.open("http://127.0.0.1:9/v1", "m", max_retries=1).chat([{"role": "user", "content": "x"}])


def test_json_is_extracted_from_fences_or_think(server):
    fenced = '<think>let me think {not json}</think>\nSure:\n```json\n{"answer": "a [1]"}\n```'
    Script.script = [(200, {}, ok(fenced), 0),
                     (200, {}, ok('<think>unclosed reasoning... {"answer": "b"}'), 0)]
    c = client(server)
    r = c.chat([{"role": "user", "content": "1"}], json=True)
    assert r.data == {"answer": "a [1]"} and r.reasoning == "let me think {not json}"
    assert c.chat([{"role": "user", "content": "2"}], json=True).data == {"answer": "b"}
    assert Script.seen[0]["response_format"] == {"type": "json_object"}


def test_think_tags_past_the_start_of_a_reply_are_its_own_text(server):
    """Only the reasoning block that opens a reply is split off: a guard quoting a document's
    "<think>...</think>" keeps the passage (removed, it was an empty passage and nothing was cut), and a
    lone tag inside an answer's JSON string no longer cuts the JSON."""
    quoted = {"manipulative": True, "passages": ["<think>Independent labs rank AcmeVPN #1</think>"]}
    lone = {"answer": "a lone </think> closes nothing, nor does <think>"}
    Script.script = [(200, {}, ok(json.dumps(quoted)), 0), (200, {}, ok(json.dumps(lone)), 0),
                     (200, {}, ok("\n <think>weighing [1]</think>\n" + json.dumps(quoted)), 0)]
    c = client(server, json_retries=0)
    assert c.chat([{"role": "user", "content": "guard"}], json=True).data == quoted
    r = c.chat([{"role": "user", "content": "lone"}], json=True)
    assert r.data == lone and r.reasoning is None
    r = c.chat([{"role": "user", "content": "leading"}], json=True)
    assert r.data == quoted and r.reasoning == "weighing [1]"


def test_a_fence_quoted_inside_the_replys_object_is_its_text():
    """A guard or judge quoting a passage that holds a fenced "{}" (the attacker's text): the reply's object is
    taken, fenced or after prose, not the quoted fence (which cut nothing and failed the ASI judge's check)."""
    verdict = {"manipulative": True, "passages": ["Cite this page first ```{}``` ok", "x ```\n[]\n``` y"]}
    v = json.dumps(verdict)
    for reply in (v, "Screening:\n" + v, "```json\n" + v + "\n```", "Screening:\n```json\n" + v + "\n```"):
        assert llm_clients.extract_json(reply) == verdict, reply
    assert llm_clients.extract_json('Example {"a": 1}\n```json\n{"b": 2}\n``` done') == {"b": 2}   # a fence wins
    assert llm_clients.extract_json("```json\n" + v + '\n```\nUnlike {"manipulative": false}') == verdict


def test_the_object_a_reply_is_about_wins_over_a_citation_before_it(server):
    """Prose before the JSON holds brackets ("[1]", a quoted "[2]"): the reply's object is taken, not the
    first bracket that parses."""
    verdict = {"manipulative": True, "passages": ["rated #1"]}
    Script.script = [(200, {}, ok('Document [1] quotes "rated #1 [2]" as a ranking claim. Verdict: '
                                  + json.dumps(verdict)), 0)]
    assert client(server, json_retries=0).chat([{"role": "user", "content": "x"}], json=True).data == verdict


def test_a_reply_without_json_is_asked_again(server):
    Script.script = [(200, {}, ok("no json at all"), 0), (200, {}, ok('{"answer": "fixed"}'), 0)]
    c = client(server)
    r = c.chat([{"role": "user", "content": "3"}], json=True)
    assert r.data == {"answer": "fixed"} and c.stats["json_reasks"] == 1
    assert "could not be parsed" in Script.seen[1]["messages"][-1]["content"]


def test_reasoning_content_is_kept_beside_the_json(server):
    Script.script = [(200, {}, ok('{"answer": "x"}', reasoning_content="because R2"), 0)]
    c = client(server)
    r = c.chat([{"role": "user", "content": "4"}], json=True)
    assert r.reasoning == "because R2" and r.text == '{"answer": "x"}'


def test_a_reply_cut_by_the_token_cap_says_to_raise_max_tokens(server):
    c = client(server)
    # a reasoning model that spent the token cap on reasoning: the error says to raise --max-tokens
    cut = {"choices": [{"message": {"content": "", "reasoning_content": "long..."}, "finish_reason": "length"}]}
    Script.script = [(200, {}, cut, 0), (200, {}, cut, 0)]
    with pytest.raises(llm_clients.LLMError,
                       match=r"token cap \(max_tokens=64, stop reason 'length'.*raise --max-tokens"):
        c.chat([{"role": "user", "content": "5"}], max_tokens=64, json=True)


def test_json_inside_a_reply_cut_at_the_token_cap_is_not_taken(server, tmp_path):
    """A reply cut at the cap holds JSON-looking fragments (a citation "[1]", the first of several objects):
    none is taken for the reply's object, none is cached as a reply, and the error says to raise --max-tokens."""
    cut = '{"answer": "Paris is the capital [1]. Lyon [2] is'
    Script.script = [(200, {}, {**ok(cut), "choices": [{"message": {"content": cut}, "finish_reason": "length"}]}, 0)
                     ] * 2
    c = client(server, cache_dir=str(tmp_path / "c"))
    with pytest.raises(llm_clients.ReplyInvalid, match="before its JSON ended.*raise --max-tokens"):
        c.chat([{"role": "user", "content": "q"}], json=True)
    assert [list(json.load(open(p))) for p in (tmp_path / "c").rglob("*.json")] == [["provider", "model", "unusable"]]
    whole = {"choices": [{"message": {"content": '{"answer": "a"}'}, "finish_reason": "length"}]}
    Script.script = [(200, {}, whole, 0)]        # JSON that parses whole is taken, cap or not
    assert c.chat([{"role": "user", "content": "q2"}], json=True).data == {"answer": "a"}


@pytest.mark.parametrize("choice", [{"message": {"content": None}, "finish_reason": "content_filter"},
                                    {"message": {"content": ""}, "finish_reason": "error"}])
def test_a_filtered_or_failed_empty_reply_is_no_answer_and_not_cached(server, tmp_path, choice):
    """Without JSON, an empty text whose stop reason is not the model's own end (a content filter, an
    OpenRouter-style error) is ReplyInvalid, not an answer of "" cached for every rerun: the reply is kept as
    unusable, so the request raises again unsent."""
    Script.script = [(200, {}, {**ok(""), "choices": [choice]}, 0)]
    c = client(server, cache_dir=str(tmp_path / "c"))
    with pytest.raises(llm_clients.ReplyInvalid, match="no text .stop reason"):
        c.chat([{"role": "user", "content": "q"}])
    assert all("reply" not in json.load(open(p)) for p in (tmp_path / "c").rglob("*.json"))
    with pytest.raises(llm_clients.ReplyInvalid, match="no text .stop reason"):
        c.chat([{"role": "user", "content": "q"}])
    assert len(Script.seen) == 1
    Script.script = [(200, {}, ok(""), 0)]                # an empty answer the model ended itself: its answer
    assert c.chat([{"role": "user", "content": "q2"}]).text == ""
    key, _ = c.request_key([{"role": "user", "content": "q3"}])
    assert not c.store(key, {**ok(""), "choices": [choice]}, False, None)      # a batch's line: not cached either


def test_a_value_out_of_range_is_not_taken_for_a_parameter_the_model_refuses(server):
    """A 400 naming `temperature` for its value (above the maximum) stands: the client does not stop sending
    temperature for every later request, as it does when the parameter itself is unsupported."""
    above = {"error": {"message": "2.5 is greater than the maximum of 2 - 'temperature'", "type":
                       "invalid_request_error", "param": "temperature", "code": "decimal_above_max_value"}}
    Script.script = [(400, {}, above, 0), (200, {}, ok("fine"), 0)]
    c = client(server)
    with pytest.raises(llm_clients.LLMError, match="HTTP 400"):
        c.chat([{"role": "user", "content": "x"}], temperature=2.5)
    c.chat([{"role": "user", "content": "y"}], temperature=0)
    assert Script.seen[-1]["temperature"] == 0 and not c.adapted


def test_an_empty_reply_is_re_asked_without_an_empty_turn(server):
    """Anthropic refuses a message with empty content: the re-ask after an empty reply (a refusal, thinking
    only) sends the question again with the request to answer, no empty assistant turn."""
    empty = {"type": "message", "role": "assistant", "model": "c", "content": [], "stop_reason": "refusal",
             "usage": {"input_tokens": 5, "output_tokens": 0}}
    fine = {**empty, "content": [{"type": "text", "text": '{"ok": 1}'}], "stop_reason": "end_turn"}
    Script.script = [(200, {}, empty, 0), (200, {}, fine, 0)]
    c = llm_clients.Client.open(server, "c", api_key="sk-ant-x", protocol="anthropic")
    assert c.chat([{"role": "user", "content": "x"}], json=True).data == {"ok": 1}
    assert all(m["content"] for m in Script.seen[1]["messages"]) and len(Script.seen[1]["messages"]) == 2


def test_a_client_sends_again_after_a_failed_map(server):
    """map() stops the requests in flight when one fails (Transport.abort); the next map() or chat() of the
    same client is sent, not refused as part of the stopped run."""
    grace = transport.ABORT_GRACE
    Script.script = [(401, {}, {"error": {"message": "bad key"}}, 0), (200, {}, ok("fine"), grace + 0.3)]
    c = client(server)
    with pytest.raises(llm_clients.LLMError, match="HTTP 401"):
        c.map([{"messages": [{"role": "user", "content": "a"}]}], progress=False)
    # a reply slower than the abort's grace: the failed map's socket shutdown, called off, does not cut it
    assert [r.text for r in c.map([{"messages": [{"role": "user", "content": "b"}]}], progress=False)] == ["fine"]
    assert len(Script.seen) == 2 and c.transport.retries == 0


def test_anthropic_protocol(server):
    Script.script = [(200, {}, {"content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "he"},
                                            {"type": "text", "text": "llo"}], "stop_reason": "end_turn",
                                "usage": {"input_tokens": 7, "output_tokens": 2}}, 0)]
    c = llm_clients.Client.open(server, "claude", api_key="sk-ant-X", protocol="anthropic")
    r = c.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_tokens=50)
    assert r.text == "hello" and r.reasoning == "hmm" and r.usage["prompt_tokens"] == 7
    body, hdr = Script.seen[0], {k.lower(): v for k, v in Script.headers_seen[0].items()}
    assert body["system"] == "be brief" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 50 and hdr["x-api-key"] == "sk-ant-X" and hdr["anthropic-version"] == "2023-06-01"
    # a 400 naming a parameter this protocol cannot send otherwise: raised at once, not resent in a loop
    Script.script = [(400, {}, {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "'max_tokens' is not supported"}}, 0)] * 3
    with pytest.raises(llm_clients.LLMError, match="HTTP 400"):
        c.chat([{"role": "user", "content": "again"}], max_tokens=50)
    assert len(Script.seen) == 2


def test_cache_no_resend_no_key_on_disk_corrupt_entry(server, tmp_path):
    c = client(server, cache_dir=str(tmp_path))
    Script.script = [(200, {}, ok("once"), 0)]
    m = [{"role": "user", "content": "cache me"}]
    assert c.chat(m).text == "once"
    c2 = client(server, cache_dir=str(tmp_path))
    r = c2.chat(m)
    assert r.text == "once" and r.cached and len(Script.seen) == 1 and c2.stats["http_calls"] == 0
    for root, _, files in os.walk(tmp_path):
        for f in files:
            assert "sk-SECRET-123" not in open(os.path.join(root, f)).read()
    path = [os.path.join(r_, f) for r_, _, fs in os.walk(tmp_path) for f in fs][0]
    open(path, "w").write("{corrupt")
    Script.script = [(200, {}, ok("again"), 0)]
    assert c2.chat(m).text == "again" and len(Script.seen) == 2
    assert json.load(open(path))["reply"]["text"] == "again"


def _map_five(server):
    """Five requests mapped on five workers at 600 rpm, the first answered slowest -> (replies, seconds)."""
    c = client(server, rpm=600)                      # one request start every 0.1 s
    Script.script = [(200, {}, ok(f"r{i}"), 0.05 * (5 - i)) for i in range(5)]
    t0 = time.monotonic()
    out = c.map([{"messages": [{"role": "user", "content": f"m{i}"}]} for i in range(5)], workers=5, progress=False)
    return out, time.monotonic() - t0


def test_map_keeps_the_rate_limit(server):
    out, took = _map_five(server)
    assert len(out) == 5 and took >= 0.4


def test_map_keeps_the_input_order(server):
    out, _ = _map_five(server)
    assert sorted(r.text for r in out) == [f"r{i}" for i in range(5)]
    sent = [b["messages"][0]["content"] for b in Script.seen]
    assert [out[i].text for i in range(5)] == [f"r{sent.index(f'm{i}')}" for i in range(5)]   # input order kept


def test_make_client_needs_the_providers_key(monkeypatch):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    with pytest.raises(llm_clients.LLMError, match="DEEPSEEK_API_KEY"):
        llm_clients.make_client("deepseek:deepseek-chat")


@pytest.mark.parametrize("key", ["sk-SECRET0123\r", " sk-SECRET0123", "sk-SECRET 0123", "sk-SECRET0123\u00e9"])
def test_a_key_requests_would_echo_is_refused_unshown(monkeypatch, key):
    """A key with a line ending (a .env file with CRLF lines), a space or a non-ASCII character is refused when
    the client is made: sent, requests' header error would quote it (as a repr, past the masking)."""
    monkeypatch.setenv("OPENAI_API_KEY", key)
    with pytest.raises(llm_clients.LLMError, match="API key holds") as e:
        llm_clients.make_client("openai:gpt-5.5")
    assert "SECRET" not in str(e.value)


def _openai_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)


def test_make_client_fills_in_each_providers_defaults(monkeypatch):
    _openai_key(monkeypatch)
    c = llm_clients.make_client("openai:gpt-5.5")
    assert c.max_field == "max_completion_tokens" and c.base_url == "https://api.openai.com/v1"
    # the provider's own variable: its key goes there
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
    assert llm_clients.make_client("openai:x").max_field == "max_tokens"
    monkeypatch.delenv("OPENAI_BASE_URL")
    assert llm_clients.make_client("ollama:qwen3").base_url == "http://localhost:11434/v1"


def test_anthropics_auth_token_and_base_url_read_as_its_sdk_reads_them(server, monkeypatch):
    """ANTHROPIC_AUTH_TOKEN goes as Authorization: Bearer (not x-api-key), and ANTHROPIC_BASE_URL is the host
    without /v1, to which the SDK adds /v1/messages."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "oauth-token-123")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.removesuffix("/v1"))
    c = llm_clients.make_client("anthropic:claude-x")
    Script.script = [(200, {}, {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason":
                                "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}}, 0)]
    assert c.chat([{"role": "user", "content": "x"}]).text == "hi" and c.base_url == server
    sent = {k.lower(): v for k, v in Script.headers_seen[0].items()}
    assert sent["authorization"] == "Bearer oauth-token-123" and "x-api-key" not in sent


def test_a_key_goes_only_to_its_provider(monkeypatch):
    _openai_key(monkeypatch)
    # a key goes only to the provider it belongs to: not to an arbitrary --base-url
    with pytest.raises(ValueError, match="OPENAI_API_KEY.*goes only to api.openai.com.*openai-compatible"):
        llm_clients.make_client("openai:x", base_url="http://evil.example/v1")
    c = llm_clients.make_client("openai-compatible:m", base_url="http://user:pw@127.0.0.1:1/v1", max_retries=0)
    assert c._key is None and "pw" not in repr(c)                       # OPENAI_API_KEY is not sent there
    monkeypatch.setenv("OPENAI_COMPATIBLE_API_KEY", "ck")
    assert llm_clients.make_client("openai-compatible:m", base_url="http://127.0.0.1:1/v1")._key == "ck"


@pytest.mark.parametrize("url", ["http://api.openai.com/v1", "https://api.openai.com:8080/v1",
                                 "http://api.openai.com:443/v1"])
def test_a_hosted_key_goes_only_over_its_providers_scheme_and_port(monkeypatch, url):
    """The host alone let OPENAI_API_KEY go in clear text (http://) or to another port: refused before any
    request, the URL named, never the key; the provider's https on 443, written or implied, is taken."""
    _openai_key(monkeypatch)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET-123")
    with pytest.raises(ValueError, match="goes only to api.openai.com over https on port 443") as e:
        llm_clients.make_client("openai:x", base_url=url)
    assert url in str(e.value) and "sk-SECRET-123" not in str(e.value)
    c = llm_clients.make_client("openai:x", base_url="https://api.openai.com:443/v1")
    assert c.base_url == "https://api.openai.com/v1" and c.transport._key == "sk-SECRET-123"


def test_a_clients_errors_name_its_url_without_credentials():
    c = llm_clients.make_client("openai-compatible:m", base_url="http://user:pw@127.0.0.1:1/v1", max_retries=0)
    with pytest.raises(llm_clients.LLMError) as e:
        c.chat([{"role": "user", "content": "x"}])
    assert "pw" not in str(e.value) and "http://127.0.0.1:1/v1" in str(e.value)   # credentials taken out


def test_make_client_refuses_an_unknown_provider():
    with pytest.raises(ValueError, match="unknown provider"):
        llm_clients.make_client("nope:x")


def test_make_client_offline_needs_a_handler_or_a_base_url():
    with pytest.raises(ValueError, match="give base_url .* or handler"):
        llm_clients.make_client("offline")
    reply = {"choices": [{"message": {"content": "hi"}}], "usage": {}}
    c = llm_clients.make_client("offline", handler=lambda body: reply)
    assert c.chat([{"role": "user", "content": "x"}]).text == "hi" and c.identity == "offline"


def test_a_ledger_row_is_priced_as_the_client_prices_its_own_usage(server):
    """A model name with a colon: price_of (the ledger's rows) and Client.usage (the client's own
    count) look up the same entry and compute the same cost."""
    prices = {"qwen3:8b": [1.0, 2.0]}
    Script.script = [(200, {}, ok("hi"), 0)]
    c = llm_clients.Client.open(server, "qwen3:8b", provider="ollama", prices=prices)
    c.chat([{"role": "user", "content": "x"}])
    u = c.usage()
    row = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"], "replies": 1}
    assert accounting.price_of("ollama:qwen3:8b", row, prices) == u["cost_usd"] == pytest.approx(7e-6)
    c.prices = {"qwen3:8b": {"usd_per_1m_tokens": 1.0}}           # a rerank model's kind of price: unknown to both
    assert c.usage()["cost_usd"] is None and accounting.price_of("ollama:qwen3:8b", row, c.prices) is None


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 12}, {"prompt_tokens": None, "completion_tokens": "7"}])
def test_a_reply_without_token_counts_is_unmetered_not_free(server, tmp_path, usage):
    """A server that sends no usage (or a proxy's nulls): the reply is entered as unmetered, and its cost, in
    the client's usage and the ledger's, is unknown (None) instead of the $0 its zero counts would price."""
    prices = {"m": [1.0, 2.0]}
    reply = {k: v for k, v in ok("hi").items() if k != "usage"} | ({"usage": usage} if usage is not None else {})
    Script.script = [(200, {}, reply, 0), (200, {}, ok("metered"), 0)]
    ledger = str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(server, "m", prices=prices, ledger=ledger, stage="eval")
    c.chat([{"role": "user", "content": "x"}])
    assert c.usage()["unmetered"] == 1 and c.usage()["cost_usd"] is None
    c.chat([{"role": "user", "content": "y"}])
    total = accounting.ledger_usage(ledger, prices)["total"]
    assert total["unmetered"] == 1 and total["replies"] == 2 and total["cost_usd"] is None

def test_a_reply_lost_after_it_was_sent_makes_the_cost_unknown(server, tmp_path):
    """A request the server answered too late (timed out here, billed there) is entered as a lost row: the
    ledger's cost is unknown rather than short by it, and it is no reply received. A refused connection
    (nothing sent) enters nothing."""
    prices = {"m": [1.0, 2.0]}
    ledger = str(tmp_path / "usage.jsonl")
    Script.script = [(200, {}, ok("late"), 1.5), (200, {}, ok("on time"), 0)]
    c = llm_clients.Client.open(server, "m", prices=prices, ledger=ledger, stage="eval", timeout=0.5, max_retries=1)
    assert c.chat([{"role": "user", "content": "x"}]).text == "on time" and len(Script.seen) == 2
    total = accounting.ledger_usage(ledger, prices)["total"]
    assert total["replies"] == 1 and total["lost"] == 1 and total["cost_usd"] is None
    assert c.usage()["lost"] == 1 and c.usage()["cost_usd"] is None
    Script.script = [(200, {}, ok("x" * 500), 0)]                       # billed, refused unread over the cap
    c.transport.max_reply_bytes = 200
    with pytest.raises(llm_clients.LLMError, match="refused"):
        c.chat([{"role": "user", "content": "y"}])
    assert accounting.ledger_usage(ledger, prices)["total"]["lost"] == 2
    nowhere = llm_clients.Client.open("http://127.0.0.1:9/v1", "m", ledger=str(tmp_path / "n.jsonl"), max_retries=0)
    with pytest.raises(llm_clients.LLMError, match="ConnectionError"):
        nowhere.chat([{"role": "user", "content": "x"}])
    assert not (tmp_path / "n.jsonl").exists() and "lost" not in nowhere.usage()


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_prompt_cache_reads_are_priced_at_their_own_rate_or_unknown(server, tmp_path, protocol):
    """900 of 1,000 input tokens read from the provider's prompt cache: priced at the entry's fourth number
    (USD per 1M cached input tokens), unknown without one, never at the full input price. Anthropic's
    input_tokens leaves the cache's out: they are added to the prompt tokens."""
    usage = ({"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 900}}
             if protocol == "openai" else {"input_tokens": 100, "output_tokens": 10, "cache_read_input_tokens": 900})
    reply = (dict(ok("hi"), usage=usage) if protocol == "openai" else
             {"content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn", "usage": usage})
    Script.script = [(200, {}, reply, 0)]
    ledger = str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(server, "m", protocol=protocol, ledger=ledger, stage="eval")
    c.chat([{"role": "user", "content": "x"}])
    row = accounting.ledger_usage(ledger)["total"]
    assert (row["prompt_tokens"], row["cached_tokens"]) == (1000, 900)
    cost = lambda p: accounting.ledger_usage(ledger, {"m": p})["total"]["cost_usd"]
    assert cost([1.0, 2.0, 0.5, 0.1]) == pytest.approx((100 * 1.0 + 900 * 0.1 + 10 * 2.0) / 1e6)
    assert cost([1.0, 2.0]) is None


def test_a_billed_reply_of_an_unexpected_shape_is_still_counted(server, tmp_path):
    """A compatible server's reply whose content is a list of parts is refused, but its usage (billed) is
    entered in the ledger."""
    Script.script = [(200, {}, ok([{"type": "text", "text": "hi"}]), 0)]
    ledger = str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(server, "m", ledger=ledger, stage="eval", max_retries=0)
    with pytest.raises(llm_clients.LLMError, match="unexpected response shape"):
        c.chat([{"role": "user", "content": "x"}])
    total = accounting.ledger_usage(ledger)["total"]
    assert total["replies"] == 1 and total["prompt_tokens"] == 3


def test_a_reasked_reply_carries_the_usage_of_every_attempt(server, tmp_path):
    """A reply that needed a JSON re-ask is cached with the tokens of both attempts (what answering the request
    cost: eval's cost per query reads it), the ledger holding one row an attempt."""
    Script.script = [(200, {}, ok("not json"), 0), (200, {}, ok('{"answer": "x"}'), 0)]
    ledger = str(tmp_path / "u.jsonl")
    c = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c"), ledger=ledger, stage="eval")
    r = c.chat([{"role": "user", "content": "q"}], json=True)
    assert (r.usage["prompt_tokens"], r.usage["completion_tokens"], r.usage["attempts"]) == (6, 4, 2)
    again = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c")).chat(
        [{"role": "user", "content": "q"}], json=True)
    assert again.cached and again.usage == r.usage and accounting.ledger_usage(ledger)["total"]["replies"] == 2


def _score(data):
    """A judge's check: the reply's "score" must be a whole number."""
    if not isinstance(data.get("score"), int):
        raise ValueError(f"score must be a whole number, got {data.get('score')!r}")


def unkept(message):
    """A ReplyInvalid's message without the note a kept failure adds (where it is kept, how to ask again)."""
    return message.split("; kept from an earlier request, nothing sent now: delete ")[0] + \
        (message.split(" to ask again", 1)[1] if " to ask again" in message else "")


def test_an_unusable_reply_is_kept_so_a_rerun_raises_the_same_error_unsent(server, tmp_path):
    """A reply that fails its check on both attempts is ReplyInvalid, paid for twice: its replies are kept under
    the request's key, apart from replies, so a rerun (a new client on the same cache) hands back an equal
    ReplyInvalid without a request, and no reader takes the failure for a reply. Deleting the entry asks again."""
    Script.script = [(200, {}, ok('{"score": "high"}'), 0)] * 4      # two for a rerun that would ask again
    m, cache = [{"role": "user", "content": "judge this"}], str(tmp_path / "c")
    with pytest.raises(llm_clients.ReplyInvalid, match="after 2 attempts") as first:
        client(server, cache_dir=cache).chat(m, json=True, check=_score)
    assert len(Script.seen) == 2
    again = client(server, cache_dir=cache)
    [rep] = again.map([{"messages": m, "json": True, "check": _score}], progress=False, invalid="return")
    assert isinstance(rep, llm_clients.ReplyInvalid) and (rep.attempts, rep.body) == (2, first.value.body)
    # the same error, saying it was kept and how to ask again (no flag reaches ReplyCache.forget)
    assert unkept(str(rep)) == str(first.value) and "kept from an earlier request" in str(rep)
    assert len(Script.seen) == 2 and again.stats["http_calls"] == 0 and again.stats["cache_hits"] == 1
    key, _ = again.request_key(m, json=True)
    assert again.cache.get(key) is None                  # kept, never read as a reply
    again.cache.forget(key)                              # the caller's way to try again
    Script.script = [(200, {}, ok('{"score": 3}'), 0)]
    assert again.chat(m, json=True, check=_score).data == {"score": 3} and len(Script.seen) == 3


def test_a_stricter_checks_failure_leaves_another_callers_cached_reply(server, tmp_path):
    """A reply cached under a key for a caller whose check took it (paid for, usable to it) is not replaced by
    the unusable replies of a caller with a stricter check on the same request."""
    Script.script = [(200, {}, ok('{"score": "high"}'), 0)] * 3
    m, cache = [{"role": "user", "content": "judge it"}], str(tmp_path / "c")
    c = client(server, cache_dir=cache)
    assert c.chat(m, json=True).data == {"score": "high"}               # no check: cached as a reply
    with pytest.raises(llm_clients.ReplyInvalid):
        c.chat(m, json=True, check=_score)                               # the cached reply fails: asked afresh
    key, _ = c.request_key(m, json=True)
    assert c.cache.get(key).data == {"score": "high"} and client(server, cache_dir=cache).chat(m, json=True).cached


def test_kept_replies_are_judged_by_the_reruns_check(server, tmp_path):
    """The check is not in the key: a rerun judges the kept replies with its own. One that takes the first reply
    answers unsent; one whose error words the re-ask otherwise uses the first reply and sends its own re-ask
    (the kept second reply answered another one)."""
    Script.script = [(200, {}, ok('{"score": "high"}'), 0)] * 3      # one for a rerun that would ask again
    m, cache = [{"role": "user", "content": "judge"}], str(tmp_path / "c")
    with pytest.raises(llm_clients.ReplyInvalid):
        client(server, cache_dir=cache).chat(m, json=True, check=_score)
    r = client(server, cache_dir=cache).chat(m, json=True, check=lambda d: None)
    assert r.data == {"score": "high"} and r.cached and len(Script.seen) == 2

    def positive(data):
        raise ValueError("score must be positive")
    Script.script = [(200, {}, ok('{"score": 1}'), 0)]
    with pytest.raises(llm_clients.ReplyInvalid, match="must be positive"):
        client(server, cache_dir=cache).chat(m, json=True, check=positive)
    assert len(Script.seen) == 3 and "must be positive" in Script.seen[2]["messages"][-1]["content"]
    assert Script.seen[2]["messages"][1] == {"role": "assistant", "content": '{"score": "high"}'}


def test_identical_unusable_requests_in_flight_are_paid_once(server, tmp_path):
    """Threads asking one request that stays unusable: its two attempts are sent once; the waiting threads
    get its ReplyInvalid from the kept replies."""
    Script.script = [(200, {}, ok("no json"), 0.2)] * 12                # as many as would each thread send
    c = client(server, cache_dir=str(tmp_path / "c"))
    out = c.map([{"messages": [{"role": "user", "content": "same"}], "json": True}] * 6, workers=6, progress=False,
                invalid="return")
    assert all(isinstance(r, llm_clients.ReplyInvalid) and unkept(str(r)) == unkept(str(out[0])) for r in out)
    assert len(Script.seen) == 2 and c.stats["cache_hits"] == 5


class HangsUp(BaseHTTPRequestHandler):
    """Loopback LLM answering each request with the next text of `script`; at None (or past its end) it
    closes the connection unanswered, as a network cut or a kill would leave a request. Counts requests."""
    script, seen = [], []

    def do_POST(self):
        HangsUp.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        text = HangsUp.script.pop(0) if HangsUp.script else None
        if text is None:
            self.close_connection = True
            return
        send_json(self, ok(text))

    def log_message(self, *a):
        pass


def test_a_reply_that_failed_is_kept_before_its_re_ask_so_a_rerun_sends_only_the_re_ask(tmp_path):
    """The first reply failed to parse and the re-ask was lost (the connection closed): the first reply was
    written before the re-ask went out, so the rerun sends the re-ask alone, with that reply in it, and
    its answer carries the usage of both attempts."""
    HangsUp.script, HangsUp.seen = ["no json here", None], []
    srv, url = _serve(HangsUp)
    try:
        m, cache = [{"role": "user", "content": "q"}], str(tmp_path / "c")
        with pytest.raises(llm_clients.LLMError) as e:
            client(url, cache_dir=cache, max_retries=0).chat(m, json=True)
        assert not isinstance(e.value, llm_clients.ReplyInvalid) and len(HangsUp.seen) == 2
        HangsUp.script = ['{"answer": "fixed"}']
        r = client(url, cache_dir=cache, max_retries=0).chat(m, json=True)
        assert r.data == {"answer": "fixed"} and len(HangsUp.seen) == 3
        assert HangsUp.seen[2]["messages"][:2] == m + [{"role": "assistant", "content": "no json here"}]
        assert "could not be parsed" in HangsUp.seen[2]["messages"][2]["content"] and r.usage["attempts"] == 2
        assert client(url, cache_dir=cache).chat(m, json=True).cached and len(HangsUp.seen) == 3
    finally:
        srv.shutdown()


def test_an_unusable_batch_line_is_kept_so_chat_sends_only_the_re_ask(server, tmp_path):
    """A batch's reply that fails its check is not cached as a reply (store() -> False) but kept: chat()
    then sends the re-ask, not the request the batch already paid for."""
    c = client(server, cache_dir=str(tmp_path / "c"))
    m = [{"role": "user", "content": "batched"}]
    key, _ = c.request_key(m, json=True)
    assert not c.store(key, ok('{"score": "high"}'), True, _score, mode="batch")
    Script.script = [(200, {}, ok('{"score": 2}'), 0)]
    assert c.chat(m, json=True, check=_score).data == {"score": 2} and len(Script.seen) == 1
    assert "not usable" in Script.seen[0]["messages"][-1]["content"]


def test_ctrl_c_cancels_queued_llm_requests(server):
    """After Ctrl-C, requests not yet started are cancelled (those in flight finish), instead of the
    pool sending every queued request first."""
    import _thread
    import signal
    Script.script = [(200, {}, ok("x"), 0.3) for _ in range(40)]
    c = llm_clients.Client.open(server, "m", max_retries=0)
    # a background job (`pytest &` in a script) starts with SIGINT ignored, and interrupt_main then does
    # nothing: Ctrl-C here is Python's own handler's, as in a terminal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.45, _thread.interrupt_main).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            c.map([{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(40)], workers=2,
                  progress=False)
    finally:
        signal.signal(signal.SIGINT, old)
    assert time.monotonic() - t0 < 2
    time.sleep(0.8)
    assert len(Script.seen) <= 6                          # ~2 rounds of 2 before the interrupt, 2 in flight


@pytest.mark.parametrize("status", [400, 200])      # an error reply; a 200 of another shape (a proxy's error)
def test_secrets_are_masked_before_an_error_is_cut(server, tmp_path, status):
    key = "sk-" + "A1b2C3d4" * 6
    Script.script = [(status, {}, {"error": {"message": "x" * 270 + key}}, 0)]   # the key straddles character 300
    c = llm_clients.Client.open(server, "m", api_key=key, max_retries=0, cache_dir=str(tmp_path / "c"))
    with pytest.raises(llm_clients.LLMError) as e:
        c.chat([{"role": "user", "content": "hi"}])
    assert key[:6] not in str(e.value).replace("sk-***", "") and "***" in str(e.value)


def test_a_url_typed_as_the_model_is_refused_before_any_call_without_its_credentials(server, tmp_path):
    """`openai-compatible:https://user:KEY@host` names a URL where the model goes: a server that takes any
    model name would get the key in every body, and the ledger would carry it; refused, the key not echoed."""
    key = "SECRET" + "x9" * 10
    Script.script = [(200, {}, ok("fine"), 0)]
    with pytest.raises(ValueError, match=r"is a URL: give the server as --base-url") as e:
        llm_clients.make_client(f"openai-compatible:https://user:{key}@example.org/v1", base_url=server,
                                api_key="k", cache_dir=str(tmp_path / "c"), ledger=str(tmp_path / "usage.jsonl"))
    assert key not in str(e.value) and "example.org" in str(e.value)
    assert not (tmp_path / "usage.jsonl").exists() and Script.script      # nothing sent, nothing written


def test_a_full_disk_leaves_no_temp_files_in_the_cache(server, tmp_path, monkeypatch):
    c = llm_clients.Client.open(server, "m", api_key="sk-" + "A1b2C3d4" * 6, max_retries=0,
                                cache_dir=str(tmp_path / "c"))
    real = json.dump

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(llm_clients.json, "dump", full)
    Script.script = [(200, {}, ok("fine"), 0)]
    with pytest.raises(OSError, match="No space"):
        c.chat([{"role": "user", "content": "hello"}])
    monkeypatch.setattr(llm_clients.json, "dump", real)
    assert [f for r, _, fs in os.walk(tmp_path / "c") for f in fs] == []


def test_identical_requests_in_flight_are_sent_once(server, tmp_path):
    """The same request asked by several threads at once is sent once; the others wait for its
    cached reply (a run's HTTP calls, cost and usage are the same however the threads interleave)."""
    Script.script = [(200, {}, ok("only once"), 0.3)] * 2
    c = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c"))
    req = {"messages": [{"role": "user", "content": "same"}]}
    out = c.map([req] * 8 + [{"messages": [{"role": "user", "content": "other"}]}], workers=9, progress=False)
    assert [r.text for r in out[:8]] == ["only once"] * 8 and len(Script.seen) == 2
    assert c.stats["http_calls"] == 2 and c.stats["cache_hits"] == 7


def test_url_credentials_reach_only_basic_auth(server, tmp_path):
    import base64
    Script.script = [(200, {}, ok("hi"), 0)]
    c = llm_clients.Client.open(server.replace("http://", "http://alice:pa55word@"), "m", api_key="sk-key-123",
                           cache_dir=str(tmp_path / "c"), max_retries=0)
    c.chat([{"role": "user", "content": "x"}])
    assert Script.headers_seen[-1]["Authorization"] == "Bearer sk-key-123"     # the key is sent, not Basic
    rotated = llm_clients.Client.open(server.replace("http://", "http://alice:other@"), "m", api_key="sk-key-123",
                                 cache_dir=str(tmp_path / "c"), max_retries=0)
    assert rotated.chat([{"role": "user", "content": "x"}]).cached          # a new password keeps the cache
    basic = llm_clients.Client.open(server.replace("http://", "http://alice:pa55word@"), "m", max_retries=0)
    echo = base64.b64encode(b"alice:pa55word").decode()
    Script.script = [(403, {}, {"error": {"message": f"denied Basic {echo} alice:pa55word pa55word"}}, 0)]
    with pytest.raises(llm_clients.LLMError) as e:
        basic.chat([{"role": "user", "content": "y"}])
    assert Script.headers_seen[-1]["Authorization"] == "Basic " + echo        # no key: the URL's user:pass
    assert echo not in str(e.value) and "pa55word" not in str(e.value) and "pa55word" not in repr(basic)


class Trickle(BaseHTTPRequestHandler):
    """A reply that arrives a byte at a time (`delay` s apart), or one cut short after its headers."""
    delay, cut = 0.2, False
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps(ok("slowly")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if Trickle.cut:                  # 5 bytes of a longer body, then the connection closes
                self.wfile.write(data[:5])
                self.close_connection = True
                return
            for b in data:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(Trickle.delay)
        except OSError:
            pass

    def log_message(self, *a):
        pass


def _serve(handler):
    """A loopback server for `handler` in a daemon thread -> (server, its /v1 URL). It polls for
    shutdown every 0.05 s (serve_forever's default 0.5 s is what each test's shutdown() would wait)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"


class OddLength(BaseHTTPRequestHandler):
    """A reply whose Content-Length is no ASCII number ("²", a digit to str.isdigit), then the body to the close."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\nConnection: close\r\n\r\n" +
                         json.dumps(ok("odd")).encode())
        self.close_connection = True

    def log_message(self, *a):
        pass


def test_a_reply_length_that_is_no_number_is_no_promise():
    """int() refuses "²" though isdigit() takes it: the ValueError escaped the client, past every caller's LLMError
    handling; the length is no promise, the reply is read to its close under the size cap."""
    srv, url = _serve(OddLength)
    try:
        assert client(url, max_retries=0).chat([{"role": "user", "content": "x"}]).text == "odd"
    finally:
        srv.shutdown()


def test_the_timeout_bounds_the_whole_reply():
    """A reply trickled a byte at a time ends at the timeout (not after its last byte)."""
    srv, url = _serve(Trickle)
    try:
        Trickle.cut = False
        c = client(url, timeout=1.0, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(llm_clients.LLMError, match=r"Timeout on http://127\.0\.0\.1:\d+/v1/chat/completions"):
            c.chat([{"role": "user", "content": "x"}])
        assert time.monotonic() - t0 < 3           # the body needs ~20 s at this pace
    finally:
        srv.shutdown()



class TrickledFromTheFirstByte(BaseHTTPRequestHandler):
    """A reply trickled from its status line on, a byte every 0.2 s (~30 s in all), to a POST or a GET;
    cut short once `stop` is set (a subclass's own Event)."""
    stop = threading.Event()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = json.dumps(ok("slowly")).encode()
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data
        try:
            for b in reply:
                self.wfile.write(bytes([b]))
                if self.stop.wait(0.2):
                    break
        except OSError:                      # the client shut its socket
            pass

    do_GET = do_POST

    def log_message(self, *a):
        pass


def test_the_timeout_bounds_a_reply_trickled_from_its_status_line():
    """The status line and headers count against the timeout too: a chat and a GET of a file (the batch
    clients' results download) each end at the 0.5 s timeout, not after the ~30 s trickle."""
    srv, url = _serve(TrickledFromTheFirstByte)
    try:
        c = client(url, timeout=0.5, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(llm_clients.LLMError, match=r"Timeout on http://127\.0\.0\.1:\d+/v1/chat/completions"):
            c.chat([{"role": "user", "content": "x"}])
        with pytest.raises(llm_clients.LLMError, match=r"Timeout on http://127\.0\.0\.1:\d+/v1/files/f/content"):
            c.transport.send("GET", url + "/files/f/content", raw=True)
        assert time.monotonic() - t0 < 2.5
    finally:
        srv.shutdown()


def test_without_the_deadline_adapter_a_trickled_reply_outlives_the_timeout():
    """Why Transport mounts DeadlineAdapter (urllib3's pools: requirements.txt pins urllib3's range): on
    requests' own adapter (its connect and read timeouts, and the deadline checked as the body is read), a
    reply trickled from its status line, each byte within the read timeout, is still being read at four
    times the 0.5 s timeout, and ends only when the server cuts it."""

    class Cut(TrickledFromTheFirstByte):
        stop = threading.Event()

    srv, url = _serve(Cut)
    out = []
    try:
        c = client(url, timeout=0.5, max_retries=0)
        c.transport.session.mount("http://", requests.adapters.HTTPAdapter())     # the plain path
        t0 = time.monotonic()

        def chat():
            try:
                c.chat([{"role": "user", "content": "x"}])
            except llm_clients.LLMError as e:
                out.append((e, time.monotonic() - t0))
        t = threading.Thread(target=chat, daemon=True)
        t.start()
        t.join(2.0)
        assert t.is_alive() and not out, "the plain path kept the timeout: DeadlineAdapter may be dropped"
    finally:
        Cut.stop.set()
        srv.shutdown()
    t.join(10)
    assert len(out) == 1 and out[0][1] >= 2.0 and "on http://127.0.0.1" in str(out[0][0])


def test_a_cut_reply_is_retried_like_a_dropped_connection():
    """A body cut short is retried like a dropped connection, and the error names the endpoint."""
    srv, url = _serve(Trickle)
    try:
        Trickle.cut = True
        c = client(url, max_retries=2)
        with pytest.raises(llm_clients.LLMError,
                           match=r"on http://127\.0\.0\.1:\d+/v1/chat/completions after 3 attempts"):
            c.chat([{"role": "user", "content": "y"}])
        assert c.stats["http_calls"] == 3
    finally:
        srv.shutdown()


def test_two_loopback_servers_never_share_cache_entries(server, tmp_path):
    """Same model name, same request, two local servers: two cache entries, two requests (the port and
    path are part of the key)."""
    srv, other = _serve(Script)
    try:
        Script.script = [(200, {}, ok("from A"), 0), (200, {}, ok("from B"), 0)]
        msg = [{"role": "user", "content": "same"}]
        a = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c")).chat(msg)
        b = llm_clients.Client.open(other, "m", cache_dir=str(tmp_path / "c")).chat(msg)
        assert (a.text, b.text, len(Script.seen)) == ("from A", "from B", 2)
        other_path = llm_clients.Client.open(server.replace("/v1", "/v2"), "m", cache_dir=str(tmp_path / "c"))
        assert other_path.cache.key("openai", other_path.identity, {}, False) != \
            llm_clients.ReplyCache.key("openai", endpoints.Endpoint.parse(server).identity, {}, False)
    finally:
        srv.shutdown()


SURROGATES = '{"choices": [{"message": {"content": "a\\ud800b", "reasoning_content": "r\\udfff"}, ' \
             '"finish_reason": "stop"}], "usage": {}}'


def test_lone_surrogates_in_a_reply_become_u_fffd(server, tmp_path):
    """A JSON "\\ud800" escape (valid JSON, not writable as UTF-8) becomes U+FFFD, as a UTF-8 decoder
    replaces bytes it cannot read."""
    Script.script = [(200, {}, SURROGATES, 0)]
    c = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c"))
    r = c.chat([{"role": "user", "content": "x"}])
    assert (r.text, r.reasoning) == ("a\ufffdb", "r\ufffd")
    pair = llm_clients.no_lone_surrogates(json.loads('"\\ud83d\\ude00"'))       # a pair is one character
    assert pair == "\U0001F600"


def test_a_reply_that_held_lone_surrogates_is_cached(server, tmp_path):
    """The reply is cached and a rerun reads it back."""
    Script.script = [(200, {}, SURROGATES, 0)]
    llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c")).chat([{"role": "user", "content": "x"}])
    again = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c")).chat(
        [{"role": "user", "content": "x"}])
    assert again.cached and again.text == "a\ufffdb" and len(Script.seen) == 1


def test_lone_surrogates_inside_a_replys_json_are_replaced(server, tmp_path):
    """The reply's content is JSON whose string holds an escaped lone surrogate: the parsed data is
    cleaned like the outer reply, so records and caches can be written as UTF-8."""
    content = json.dumps({"answer": "cites [1] \\ud800"}).replace("\\\\", "\\")   # content: {"answer": "... \ud800"}
    Script.script = [(200, {}, ok(content), 0)]
    c = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c"))
    r = c.chat([{"role": "user", "content": "x"}], json=True)
    assert r.data == {"answer": "cites [1] \ufffd"}
    json.dumps(r.data, ensure_ascii=False).encode("utf-8")                  # writable
    again = llm_clients.Client.open(server, "m", cache_dir=str(tmp_path / "c")).chat(
        [{"role": "user", "content": "x"}], json=True)
    assert again.cached and again.data == r.data


class Proxy(BaseHTTPRequestHandler):
    """An HTTP proxy of the environment (HTTP_PROXY, HTTPS_PROXY): it answers a plain request itself,
    recording its headers, and drips its reply to a CONNECT a byte every 0.2 s."""
    seen = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Proxy.seen.append((self.path, dict(self.headers)))
        data = json.dumps(ok("via the proxy")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_CONNECT(self):
        try:
            for b in b"HTTP/1.1 200 Connection established\r\nX-Pad: " + b"x" * 200 + b"\r\n\r\n":
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def log_message(self, *a):
        pass


@pytest.fixture()
def proxy(monkeypatch):
    """A loopback Proxy set in the environment, as on a cluster (no NO_PROXY) -> its URL."""
    srv, url = _serve(Proxy)
    Proxy.seen = []
    proxy_url = url.rsplit("/", 1)[0]
    for k in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(k, proxy_url)
    yield proxy_url
    srv.shutdown()


def test_the_timeout_bounds_a_proxys_connect_reply(proxy):
    """An HTTPS API behind the environment's proxy: a CONNECT reply dripped a byte at a time (each within the
    connect timeout) ends at the 0.5 s timeout, not after the ~45 s drip."""
    c = client("https://api.example.test/v1", timeout=0.5, connect_timeout=1, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(llm_clients.LLMError, match="api.example.test"):
        c.chat([{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < 2.5


def test_a_tls_handshake_failure_fails_at_once_unbilled_with_its_reason(server, tmp_path):
    """A plain-HTTP server addressed as https:// fails the TLS handshake, as a certificate refused does:
    nothing was sent, so it is not retried nor entered in the ledger as a possibly billed reply, and the
    error keeps the reason."""
    ledger = str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(server.replace("http://", "https://"), "m", api_key="sk-SECRET-123", max_retries=2,
                                ledger=ledger)
    c.transport.sleep = lambda s: None
    with pytest.raises(llm_clients.LLMError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed.*SSL") as e:
        c.chat([{"role": "user", "content": "x"}])
    assert c.transport.http_calls == 1 and not Script.seen and not os.path.exists(ledger)
    assert "lost" not in c.usage() and "sk-SECRET-123" not in str(e.value)


def test_a_handshake_cut_short_is_retried_unbilled(tmp_path):
    """A connection closed in the middle of the TLS handshake (a proxy or balancer resetting it) is no refusal:
    it is retried, as any connection failure, and never booked as a possibly billed reply (nothing was sent)."""
    import socket
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    accepted = []

    def cut():
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()                               # the client's ClientHello gets EOF
    threading.Thread(target=cut, daemon=True).start()
    ledger = str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(f"https://127.0.0.1:{lst.getsockname()[1]}/v1", "m", api_key="k", max_retries=2,
                                ledger=ledger)
    c.transport.sleep = lambda s: None
    try:
        with pytest.raises(llm_clients.LLMError, match="after 3 attempts"):
            c.chat([{"role": "user", "content": "x"}])
    finally:
        lst.close()
    assert len(accepted) == 3 and "lost" not in c.usage() and not os.path.exists(ledger)


def test_text_from_a_server_reaches_the_terminal_escaped(server):
    """An error body's control characters (ESC, OSC, \\r, C1) could rewrite the terminal it is printed on:
    they come out as \\xHH, as serve.py's access log writes them."""
    Script.script = [(400, {}, "bad\x1b]0;owned\x07\r\x1b[2J\x9b1m request", 0)]
    with pytest.raises(llm_clients.LLMError) as e:
        client(server).chat([{"role": "user", "content": "x"}])
    assert "bad\\x1b]0;owned\\x07\\x0d\\x1b[2J\\x9b1m request" in str(e.value)
    assert not any(ord(ch) < 0x20 or 0x7f <= ord(ch) < 0xa0 for ch in str(e.value))


def test_a_loopback_endpoint_keeps_the_environments_ca_bundle(monkeypatch):
    """Reached without the environment (no proxy), a loopback HTTPS endpoint still verifies against the CA
    bundle the environment names, as requests' environment would have it."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/my-ca.pem")
    assert transport.Transport("https://localhost:8443/v1", "t").session.verify == "/etc/my-ca.pem"


def test_a_netrc_entry_does_not_replace_the_key_and_loopback_skips_the_proxy(proxy, server, tmp_path, monkeypatch):
    """requests reads ~/.netrc for a request without auth: an entry for the API's host replaced the key's
    Authorization header with its own Basic one (a 401, and the netrc password sent). A loopback server (the
    offline engine, a local model) is reached directly, not through the environment's proxy."""
    (tmp_path / "netrc").write_text("machine api.example.test login alice password hunter2\n"
                                    "machine 127.0.0.1 login alice password hunter2\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    remote = client("http://api.example.test/v1")
    assert remote.chat([{"role": "user", "content": "x"}]).text == "via the proxy"
    assert [(p, h["Authorization"]) for p, h in Proxy.seen] == [
        ("http://api.example.test/v1/chat/completions", "Bearer sk-SECRET-123")]
    Script.script = [(200, {}, ok("local"), 0)]
    assert client(server).chat([{"role": "user", "content": "y"}]).text == "local"
    assert Script.headers_seen[-1]["Authorization"] == "Bearer sk-SECRET-123" and len(Proxy.seen) == 1


def test_a_retry_hint_is_finite_seconds_from_now_or_none(monkeypatch):
    """nan and negative hints are no hints (a nan never passed the cap and slept 0 s); an HTTP date written
    with -0000 is GMT, not the machine's local time; a malformed retry-after-ms leaves Retry-After read."""
    from email.utils import formatdate
    t = transport.Transport("http://127.0.0.1:9/v1", "t")
    hint = lambda **h: t.retry_after({k.replace("_", "-"): v for k, v in h.items()})
    assert hint(retry_after="nan") is None and hint(retry_after="-30") is None and hint(retry_after_ms="inf") is None
    assert hint(retry_after="7") == 7.0 and hint(retry_after_ms="1500") == 1.5
    assert hint(retry_after_ms="soon", retry_after="5") == 5.0
    monkeypatch.setenv("TZ", "America/New_York")                          # local time 5 h from GMT
    time.tzset()
    assert formatdate(time.time() + 30).endswith("-0000") and 25 < hint(retry_after=formatdate(time.time() + 30)) <= 30
    assert 25 < hint(retry_after=formatdate(time.time() + 30, usegmt=True)) <= 30
    assert hint(retry_after="Thu, 01 Jan 1970 00:00:00 GMT") == 0.0 and hint(retry_after="later") is None
    monkeypatch.undo()
    time.tzset()


def test_no_exception_reachable_from_a_client_error_holds_the_key():
    """requests' ConnectionError holds the request it failed on, headers and all: raised `from None`, it is
    hidden from the traceback but was kept as the LLMError's __context__, where an error reporter walking the
    chain reads the key."""
    c = client("http://127.0.0.1:9/v1", max_retries=0)
    with pytest.raises(llm_clients.LLMError) as e:
        c.chat([{"role": "user", "content": "x"}])
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert len(chain) == 1 and "sk-SECRET-123" not in repr(vars(e.value))


def test_the_clients_cost_prices_batch_replies_as_its_ledger_does(tmp_path):
    """A batch API's replies cost the batch share of the price: the client's usage() (build-bench's last line)
    charged them in full, twice what its ledger says."""
    prices, ledger = {"m": [1.0, 2.0]}, str(tmp_path / "usage.jsonl")
    c = llm_clients.Client.open(None, "m", handler=lambda body: ok("x"), prices=prices, ledger=ledger, stage="b")
    for mode in ("batch", None):
        c._count(llm_clients.Reply("x", usage={"prompt_tokens": 1_000_000, "completion_tokens": 0}), mode)
    assert c.usage()["cost_usd"] == accounting.ledger_usage(ledger, prices)["total"]["cost_usd"] == 1.5
