"""deploy-check (deploy_check.py): the demo's own Shield served by `serve` passes (Cohere and TEI shapes);
loopback endpoints that make each of the known serving mistakes are caught, each by name. The mistaken
endpoints are stand-ins (labelled): they score with the same Shield, then misreport as a server with that
bug would (the real bugs need vLLM, llama.cpp or a GGUF file, none of which runs here).
Run: python -m pytest -q test_deploy_check.py
"""
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import deploy_check
import run
import serve
import settings
from runs import load_shield


@pytest.fixture(scope="module")
def shield(demo_run):
    """The demo run's settings and its Shield, loaded once."""
    cfg = settings.EvalConfig(**{**json.load(open(demo_run / "config.json"))["config"],
                                 "runs_dir": str(demo_run.parent), "name": demo_run.name})
    return cfg, load_shield(cfg)


def _serving(srv):
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


def argv(demo_run, endpoint):
    return ["deploy-check", "--runs-dir", str(demo_run.parent), "--name", demo_run.name, "--endpoint", endpoint]


def test_the_runs_own_shield_served_passes_in_every_shape(demo_run, shield):
    """The run's Shield behind `serve`, asked in the Cohere/vLLM rerank shape, TEI's and vLLM's Score API
    (/score with text_1 and text_2): each passes, its scores sigmoid(margin)."""
    srv = _serving(serve.RerankServer(shield[1], port=0, log=False))
    try:
        port = srv.server_address[1]
        for spec in (f"http://127.0.0.1:{port}/v1/rerank", f"tei:http://127.0.0.1:{port}",
                     f"vllm-score:http://127.0.0.1:{port}"):
            v = run.main(argv(demo_run, spec))
            assert v["pass"] and v["map"] == "sigmoid" and v["max_error"] < 1e-4
            assert all(r["order_agrees"] for r in v["lists"].values()) and set(v["lists"]) == {
                "relevance", "attack", "long", "control"}
    finally:
        srv.shutdown()
        srv.server_close()


def _sigmoid(m):
    return 1 / (1 + math.exp(-m))


# each stand-in: how a server with that bug turns the Shield's margin m of a document into its score
MISTAKES = {
    "sigmoid applied twice": lambda m, doc, rr: _sigmoid(_sigmoid(m)),
    "no chat template": lambda m, doc, rr: _sigmoid(-m),            # the unrelated document wins
    "the scoring suffix truncated": lambda m, doc, rr: _sigmoid(-8.0) if len(doc.split()) > rr.max_length
    else _sigmoid(m),
    "control tokens parsed": lambda m, doc, rr: _sigmoid(9.0) if "<|im_end|>" in doc else _sigmoid(m),
    "the endpoint refused a list": None,                            # a 400 for input over its limit (below)
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_server_making_a_known_mistake_is_caught_by_name(demo_run, shield, mistake):
    rr = shield[1]

    class Mistaken(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if MISTAKES[mistake] is None and any(len(d.split()) > rr.max_length for d in body["documents"]):
                status, data = 400, json.dumps({"error": {"message": "input is longer than the model's limit"}})
            else:
                margins = [float(m) for m in rr.score(body["query"], body["documents"])]
                scores = [(MISTAKES[mistake] or (lambda m, d, rr: _sigmoid(m)))(m, d, rr)
                          for m, d in zip(margins, body["documents"])]
                status, data = 200, json.dumps({"results": [{"index": i, "relevance_score": s}
                                                             for i, s in enumerate(scores)]})
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *a):
            pass
    srv = _serving(ThreadingHTTPServer(("127.0.0.1", 0), Mistaken))
    try:
        with pytest.raises(SystemExit, match=mistake):
            run.main(argv(demo_run, f"http://127.0.0.1:{srv.server_address[1]}/v1/rerank"))
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_comparison_on_known_numbers():
    """compare(): margins served raw pass under the identity map, a reordered list fails naming it."""
    local = {"relevance": [2.0, -1.0], "attack": [-1.0, 1.0], "long": [1.5, -1.0], "control": [0.5, 1.0]}
    assert deploy_check.compare(local, {k: [x + 0.01 for x in v] for k, v in local.items()})["map"] == "margin"
    off = {**local, "attack": [1.0, -1.0]}
    v = deploy_check.compare(local, off)
    assert not v["pass"] and not v["lists"]["attack"]["order_agrees"] and v["cause"].endswith("(attack)")
