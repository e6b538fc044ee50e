"""deploy-check (deploy_check.py): the demo's own Shield served by `serve` passes (Cohere, TEI and vLLM Score
shapes); loopback endpoints that make each known serving mistake are caught, each failing property named as
what it is and the cause by name, never another's; the long list fits the limit an endpoint advertises. The
mistaken endpoints are stand-ins (labelled): they score with the same Shield (or its base model), then
misreport or misbehave as a server with that bug would (the real bugs need vLLM, SGLang, llama.cpp or a GGUF
file, none of which runs here).
Run: python -m pytest -q test_deploy_check.py
"""
import contextlib
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import deploy_check
import detect
import endpoints
import lora
import rerank_clients
import run
import serve
import settings
from runs import Run


@pytest.fixture(scope="module")
def shield(demo_run):
    """The demo run's settings and its Shield, loaded once."""
    cfg = settings.EvalConfig(**{**json.load(open(demo_run / "config.json"))["config"],
                                 "runs_dir": str(demo_run.parent), "name": demo_run.name})
    return cfg, Run(cfg).shield()


class Remembered:
    """The Shield, its margins remembered per list and per LoRA state (`margins`): the Shield is
    deterministic, so each list is scored once for the module, whichever check or stand-in asks."""

    def __init__(self, rr):
        self.rr = rr

    def __getattr__(self, name):
        return getattr(self.rr, name)

    def score(self, query, docs):
        on = any(m.enabled for m in lora.lora_modules(self.rr.model).values())
        return margins(self.rr, query, docs, base=not on)


@pytest.fixture(scope="module")
def check(demo_run, shield):
    """check(spec, **settings) -> deploy_check's verdict on the demo run, its Shield loaded once."""
    given = {**json.load(open(demo_run / "config.json"))["config"], "runs_dir": str(demo_run.parent),
             "name": demo_run.name}

    def check_(spec, **kw):
        cfg = settings.DeployCheckConfig(**given, endpoint=spec, **kw)
        return deploy_check.deploy_check(Run(cfg), cfg.deploy.endpoint, rr=Remembered(shield[1]))
    return check_


def _serving(srv):
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@contextlib.contextmanager
def standin(reply, gets=None):
    """A loopback stand-in: POST bodies answered by reply(path, body) -> (status, JSON), GETs from `gets`
    ({path: JSON}, else 404); every request's method and path recorded in .seen -> its base URL."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            seen.append(("POST", self.path))
            self._send(*reply(self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

        def do_GET(self):
            seen.append(("GET", self.path))
            self._send(*((200, gets[self.path]) if self.path in (gets or {}) else (404, {"error": "no route"})))

        def log_message(self, *a):
            pass
    srv = _serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


_MARGINS = {}


def margins(rr, query, docs, base=False):
    """The Shield's margins (base: its base model's, the LoRA off) of docs, computed once per list."""
    key = (base, query, tuple(docs))
    if key not in _MARGINS:
        with lora.lora_disabled(rr.model) if base else contextlib.nullcontext():
            _MARGINS[key] = [float(m) for m in rr.score(query, docs)]
    return list(_MARGINS[key])


def _sigmoid(m):
    return 1 / (1 + math.exp(-m))


def _tokens(rr, doc):
    return len(rr.text_tokenizer.encode(doc, add_special_tokens=False).ids)


def scored(f, base=False):
    """A stand-in's reply: each document's margin m (the Shield's, or the base model's) as f(m, doc, rr), in
    Cohere's shape (TEI's for a body with `texts`)."""
    def reply(rr):
        def answer(path, body):
            docs = body.get("documents") or body["texts"]
            s = [f(m, d, rr) for m, d in zip(margins(rr, body["query"], docs, base), docs)]
            if "texts" in body:
                return 200, [{"index": i, "score": x} for i, x in enumerate(s)]
            return 200, {"results": [{"index": i, "relevance_score": x} for i, x in enumerate(s)]}
        return answer
    return reply


def honest(m, doc, rr):
    return _sigmoid(m)


def refusing(limit):
    """A stand-in's reply: honest, but a prompt over `limit` tokens refused (400)."""
    def reply(rr):
        def answer(path, body):
            docs = body.get("documents") or body["texts"]
            if any(len(rr.tokenize(body["query"], [d])[0]) > limit for d in docs):
                return 400, {"error": {"message": f"the input is longer than this model's {limit} tokens"}}
            return scored(honest)(rr)(path, body)
        return answer
    return reply


def failing(status, message):
    """A stand-in's reply: every request answered `status` with `message`."""
    return lambda rr: lambda path, body: (status, {"error": {"message": message}})


def sglang(rr):
    """SGLang's /v1/rerank reply: a bare list of {score, document, index, meta_info}, best first."""
    def answer(path, body):
        s = [_sigmoid(m) for m in margins(rr, body["query"], body["documents"])]
        return 200, sorted(({"score": x, "document": d, "index": i, "meta_info": None}
                            for i, (x, d) in enumerate(zip(s, body["documents"]))), key=lambda r: -r["score"])
    return answer


def listed(rr):
    """Cohere's shape with each relevance_score a one-item list."""
    def answer(path, body):
        return 200, {"results": [{"index": i, "relevance_score": [_sigmoid(m)]}
                                 for i, m in enumerate(margins(rr, body["query"], body["documents"]))]}
    return answer


# each stand-in: its reply, what the cause must say, and what it must not (another mistake's cause)
MISTAKES = {
    "sigmoid applied twice": (scored(lambda m, d, rr: _sigmoid(_sigmoid(m))), ["sigmoid applied twice"], []),
    "no chat template": (scored(lambda m, d, rr: _sigmoid(-m)), ["order differs: relevance", "no chat template"], []),
    "no chat template, the order kept": (scored(lambda m, d, rr: _sigmoid(m / 2 + 1)),
                                         ["beyond the tolerance 0.03: relevance", "the order kept"],
                                         ["order differs", "ranked above", "chat template"]),
    "the adapter missing": (scored(honest, base=True), ["adapter missing", "base model"], ["chat template"]),
    "every score 1.0": (scored(lambda m, d, rr: 1.0), ["constant: every score 1", "Qwen3-Embedding#144"], []),
    "the scoring suffix truncated": (scored(lambda m, d, rr: _sigmoid(-8.0) if _tokens(rr, d) > 1024 else _sigmoid(m)),
                                     ["beyond the tolerance 0.03: long", "suffix truncated"], ["chat template"]),
    "control tokens parsed": (scored(lambda m, d, rr: _sigmoid(9.0) if "<|im_end|>" in d else _sigmoid(m)),
                              ["control tokens parsed"], []),
    "the long list refused": (refusing(1024), ["refused: long (", "input limit below the long list"], []),
    "a request shape it does not take": (failing(422, "texts: field required"),
                                         ["refused: relevance, attack, long, control", "no request of this shape"],
                                         ["input limit"]),
    "a crashed server": (failing(500, "internal error"), ["transport: relevance", "not sent: attack", "crashed"],
                         ["input limit"]),
    "a redirect (http to https)": (failing(301, "moved"), ["redirect: relevance", "the address it redirects"],
                                   ["crashed"]),
    "SGLang's bare list": (sglang, ["shape: relevance", "bare JSON list, as SGLang's /v1/rerank"], ["input limit"]),
    "a list where one score is expected": (listed, ["shape: relevance", "a list where one score is expected"],
                                           ["input limit"]),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_server_making_a_known_mistake_is_caught_by_name(check, shield, mistake):
    reply, says, never = MISTAKES[mistake]
    with standin(reply(shield[1])) as (url, _):
        v = check(url)
    assert not v["pass"] and all(s in v["cause"] for s in says) and not any(s in v["cause"] for s in never), v["cause"]


def test_the_runs_own_shield_served_passes_in_every_shape(demo_run, check, shield):
    """The run's Shield behind `serve`, asked at a bare URL (the default path, /rerank), in TEI's shape and
    vLLM's Score API (/score with text_1 and text_2): each passes, its scores sigmoid(margin), the long list
    the default length a CPU engine serves (serve's /info says 8192, the demo's --max-length)."""
    srv = _serving(serve.RerankServer(shield[1], port=0, log=False))
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        made = []
        real = rerank_clients.make_reranker
        with pytest.MonkeyPatch.context() as mp:          # --rpm reaches the client (one list a request)
            mp.setattr(rerank_clients, "make_reranker", lambda *a, **k: made.append(k) or real(*a, **k))
            v = run.main(["deploy-check", "--runs-dir", str(demo_run.parent), "--name", demo_run.name, "--endpoint",
                          base, "--rpm", "6000"])
        assert made[-1]["rpm"] == 6000
        with pytest.raises(SystemExit):                   # the lists go in turn: no --workers to ignore
            run.main(["deploy-check", "--name", demo_run.name, "--endpoint", base, "--workers", "2"])
        for v in (v, check(f"tei:{base}"), check(f"vllm-score:{base}")):
            assert v["pass"] and v["map"] == "sigmoid" and v["max_error"] < 1e-4 and v["cause"] is None
            assert set(v["lists"]) == {"relevance", "attack", "long", "control"} and not v["notes"]
            assert v["long"]["tokens"] == deploy_check.LONG_TOKENS
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("api", ["vllm", "tei"])
def test_the_long_list_fits_the_limit_the_endpoint_advertises(check, shield, api):
    """An endpoint refusing prompts over 1024 tokens and saying so (vLLM: max_model_len in GET /v1/models;
    TEI: max_input_length in GET /info) passes: the long list fits under the limit, noted as below the
    Shield's --max-length. A bare URL is asked at /rerank (vLLM logs /v1/rerank as deprecated); --no-long
    leaves the long list out."""
    gets = ({"/v1/models": {"object": "list", "data": [{"id": "shield", "max_model_len": 1024}]}} if api == "vllm"
            else {"/info": {"model_id": "shield", "max_input_length": 1024}})
    with standin(refusing(1024)(shield[1]), gets) as (url, seen):
        v = check(url if api == "vllm" else f"tei:{url}")
        assert v["pass"] and v["long"]["tokens"] == 1024 - deploy_check.SEAM and "1024" in v["notes"][0]
        assert {p for m, p in seen if m == "POST"} == {"/rerank"}
        if api == "vllm":
            v = check(url, long=False)
            assert v["pass"] and set(v["lists"]) == {"relevance", "attack", "control"} and v["long"] is None


def test_a_limit_too_small_for_a_long_list_leaves_it_out_with_a_note(check, shield):
    """An endpoint advertising fewer tokens than a prompt takes without its document (TEI's max_input_length 9)
    is checked on the other lists, noted, not refused as if --long-tokens were too small."""
    with standin(refusing(9)(shield[1]), {"/info": {"model_id": "shield", "max_input_length": 9}}) as (url, _):
        v = check(f"tei:{url}")
    assert v["long"] is None and "long" not in v["lists"] and any("no long list" in n for n in v["notes"])


def test_the_comparison_on_known_numbers():
    """compare(): margins served raw pass under the identity map; a reordered list fails naming its order;
    scores that do not vary fail as constant even inside the tolerance (all near 1), naming no other cause."""
    local = {"relevance": [2.0, -1.0], "attack": [-1.0, 1.0], "long": [1.5, -1.0], "control": [0.5, 1.0]}
    assert deploy_check.compare(local, {k: [x + 0.01 for x in v] for k, v in local.items()})["map"] == "margin"
    v = deploy_check.compare(local, {**local, "attack": [1.0, -1.0]})
    assert not v["pass"] and not v["lists"]["attack"]["order_agrees"]
    assert v["cause"] == "order differs: attack; beyond the tolerance 0.15: attack (error 2.000)"
    # an identical model on another kernel: two near-tied documents swap, each score within the tolerance
    tied = {**local, "attack": [2.31, 2.30]}
    assert deploy_check.compare(tied, {**tied, "attack": [2.30, 2.31]})["pass"]
    # near a probability of 1 the sigmoid tolerance hides logits: two documents 2.5 apart swapped fail
    sure = {"relevance": [6.0, 3.5, -5.0, -6.0], "attack": [-1.0, 1.0], "long": [1.5, -1.0], "control": [0.5, 1.0]}
    probs = {k: [deploy_check.sigmoid(m) for m in v] for k, v in sure.items()}
    v = deploy_check.compare(sure, {**probs, "relevance": [0.985, 0.99] + probs["relevance"][2:]})
    assert v["lists"]["relevance"]["error"] < 0.03 and not v["pass"] and "order differs: relevance" in v["cause"]
    sure = {k: [m + 6 for m in v] for k, v in local.items()}                 # every sigmoid in 0.993..0.9997
    v = deploy_check.compare(sure, {k: [deploy_check.sigmoid(m) for m in v] for k, v in sure.items()})
    assert not v["pass"] and v["max_error"] < 1e-9 and v["cause"].startswith("constant: every score above 0.99")


def test_scores_within_the_tolerance_of_the_base_model_fail_as_the_adapter_missing():
    """Near 1 a probability hides logits apart: the base model's margins 2.5 above the Shield's serve within 0.03
    of sigmoid(Shield) on every list. The served scores fit the base as well as the Shield: a failure naming
    the adapter (it passed), while the Shield's own scores pass and the base is asked once."""
    shield = {"relevance": [6.0, -7.0], "attack": [4.0, 7.0], "control": [5.0, 6.5]}
    base = {"relevance": [7.0, -6.0], "attack": [6.5, 8.0], "control": [6.0, 7.5]}
    asked = []
    ask_base = lambda: asked.append(1) or base
    as_base = {k: [deploy_check.sigmoid(m) for m in v] for k, v in base.items()}
    assert deploy_check.compare(shield, as_base)["pass"]                  # what the tolerance alone says
    v = deploy_check.compare(shield, as_base, base=ask_base)
    assert not v["pass"] and "as close to the base model as to the Shield" in v["cause"]
    assert "adapter missing" in v["cause"] and asked == [1]
    v = deploy_check.compare(shield, {k: [deploy_check.sigmoid(m) for m in v] for k, v in shield.items()},
                             base=ask_base)
    assert v["pass"] and v["cause"] is None


def test_a_runs_detector_is_checked_on_the_endpoints_detect_route(demo_run, shield, tmp_path):
    """A run with a GEO detector (detect's text_detector.json) has the endpoint's POST /detect checked on
    the known lists' documents: the same detector passes; another threshold fails on its flags; a server
    without a detector fails naming the route. The reranker's own verdict is apart."""
    import shutil
    shutil.copytree(demo_run, tmp_path / "demo")
    det = detect.TextDetector.fit(["In summary, experts agree: **the best** guide.", "Key takeaways: top pick."],
                                  ["Store basil in water.", "Boil the eggs for six minutes."])
    given = {**json.load(open(demo_run / "config.json"))["config"], "runs_dir": str(tmp_path), "name": "demo"}
    probe = Run(settings.DeployCheckConfig(**given))
    texts = [d for _, docs in deploy_check.known_lists(probe.data, shield[1], 512).values() for d in docs]
    threshold = sorted(det.score(t) for t in texts)[len(texts) // 2]        # some flagged, some not
    (tmp_path / "demo" / "detect").mkdir()
    (tmp_path / "demo" / "detect" / "text_detector.json").write_text(json.dumps({**det.to_json(),
                                                                                 "threshold": threshold}))
    for served, says in ((detect.Served(det, threshold), None), (detect.Served(det, threshold + 1e3), "flags differ"),
                         (None, "/detect")):
        srv = _serving(serve.RerankServer(shield[1], port=0, log=False, detector=served))
        try:
            cfg = settings.DeployCheckConfig(**given, endpoint=f"http://127.0.0.1:{srv.server_address[1]}",
                                             long_tokens=512)
            v = deploy_check.deploy_check(Run(cfg), cfg.deploy.endpoint, rr=Remembered(shield[1]))
            assert v["pass"] == v["detect"]["pass"] == (says is None) and v["lists"]["relevance"]["order_agrees"]
            assert says is None or says in v["detect"]["why"] and "/detect" in v["cause"]
        finally:
            srv.shutdown()
            srv.server_close()


def test_a_served_detector_score_that_is_not_a_number_fails(monkeypatch, tmp_path):
    """/detect's scores are compared with max(), which skips a NaN that is not first: a detector serving NaN
    for a document (its flag right) passed."""
    from types import SimpleNamespace as NS
    det = detect.TextDetector({3: 0.5}, -0.1, 0.2)
    obj = {**det.to_json(), "threshold": 0.0}
    monkeypatch.setattr(deploy_check, "read_json", lambda path: obj)
    texts = ["one page", "another page", "a third page"]
    served = [{"index": i, "score": det.score(t) if i < 2 else float("nan"), "flagged": det.score(t) > 0}
              for i, t in enumerate(texts)]
    client = NS(transport=NS(send=lambda *a, **k: {"results": served}))
    monkeypatch.setattr(deploy_check.rerank_clients, "make_reranker", lambda *a, **k: client)
    spec = NS(kind="url", endpoint=endpoints.Endpoint.parse("http://127.0.0.1:9/v1/rerank"))
    run = NS(path=lambda *p: str(tmp_path.joinpath(*p)))
    v = deploy_check.detect_check(run, spec, {"l": ("q", texts)})
    assert not v["pass"] and "a finite number score" in v["why"]


def _detect_against(monkeypatch, tmp_path, reply, info=None):
    """detect_check against an endpoint whose POST /detect answers `reply` (an LLMError: raised) and GET /info
    `info`. A stand-in client (labelled: the reply shapes no real server sends), as in the test above."""
    from types import SimpleNamespace as NS

    def send(method, url, body=None):
        out = info if url.endswith("/info") else reply
        if isinstance(out, Exception) or out is None:
            raise out or deploy_check.LLMError("HTTP 404: no route", 404, "x")
        return out
    det = detect.TextDetector({3: 0.5}, -0.1, 0.2)
    monkeypatch.setattr(deploy_check, "read_json", lambda path: {**det.to_json(), "threshold": 0.0})
    monkeypatch.setattr(deploy_check.rerank_clients, "make_reranker", lambda *a, **k: NS(transport=NS(send=send)))
    spec = NS(kind="url", endpoint=endpoints.Endpoint.parse("http://127.0.0.1:9/v1/rerank"))
    texts = ["one page", "another page"]
    right = [{"index": i, "score": det.score(t), "flagged": det.score(t) > 0} for i, t in enumerate(texts)]
    return deploy_check.detect_check(NS(path=lambda *p: str(tmp_path.joinpath(*p))), spec, {"l": ("q", texts)}), right


def test_a_served_detector_reply_is_read_as_strictly_as_a_rerank_reply(monkeypatch, tmp_path):
    """Each document once, by an integer index in range, a finite number score and a boolean flag: a reply with
    an index twice (the last one kept), one out of range, string scores or integer flags passed."""
    v, right = _detect_against(monkeypatch, tmp_path, None)
    assert _detect_against(monkeypatch, tmp_path, {"results": right})[0]["pass"]
    for bad in ([right[0], right[0]], [right[0], {**right[1], "index": 7}],
                [right[0], {**right[1], "score": str(right[1]["score"])}], [right[0], {**right[1], "flagged": 1}],
                [right[0], {**right[1], "index": True}]):
        v = _detect_against(monkeypatch, tmp_path, {"results": bad})[0]
        assert v["pass"] is False and "a reply without" in v["why"]


def test_an_endpoint_that_is_not_ours_has_no_detect_route_to_check(monkeypatch, tmp_path):
    """vLLM, TEI or Infinity serving the Shield answer POST /detect 404: the run's detector is not checked there
    (it failed the whole check of a correctly served Shield); this project's serve without one still fails."""
    v = _detect_against(monkeypatch, tmp_path, None, info={"version": "1.5.0", "model_id": "shield"})[0]
    assert v["pass"] is None and "not checked" in v["why"]
    v = _detect_against(monkeypatch, tmp_path, None, info={"version": "geo-defender"})[0]
    assert v["pass"] is False and "/detect" in v["why"]
