"""Any reranker under GEO attack (rerank_eval.py, rerank_clients.RerankClient): every API shape over real
HTTP, hostile endpoints, the reranker-stage evaluation against this project's own `serve` (the same
rankings as the in-process Shield), eval's deployed-reranker conditions, resume and caching.
Run: python -m pytest -q test_rerank_eval.py
"""
import contextlib
import io
import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import certify
import endpoints
import evaluation
import geodef
import llm_clients
import parallel
import rankers
import rerank_clients
import rerank_eval
import run
import runs
import serve
import settings


def fake_scores(query, docs):
    """A deterministic relevance: shared words with the query, ties broken by length."""
    q = set(query.lower().split())
    return [len(q & set(d.lower().split())) + 1e-3 * (len(d) % 97) for d in docs]


class FakeRerank(BaseHTTPRequestHandler):
    """Loopback rerank endpoint in every shape. `script` pops a behaviour per request ('ok' or a
    misbehaviour); every request's path, headers and body are recorded."""
    script, seen = [], []
    model = None                 # what GET /info says it serves (TEI's shape); None: no such route (404)
    info_status = 200            # another: /info failing (a 503 while the model loads)
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        ok = self.path == "/info" and FakeRerank.model is not None
        data = json.dumps({"model_id": FakeRerank.model, "max_input_length": 512} if ok else {"error": "no"}).encode()
        self.send_response(FakeRerank.info_status if ok else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeRerank.seen.append((self.path, dict(self.headers), body))
        how = FakeRerank.script.pop(0) if FakeRerank.script else "ok"
        docs = body.get("texts") or body.get("documents")
        s = fake_scores(body["query"], docs)
        order = sorted(range(len(docs)), key=lambda i: -s[i])
        if self.path == "/rerank" and "texts" in body:                                  # TEI
            out = [{"index": i, "score": s[i]} for i in order]
        elif self.path == "/v1/rerank-voyage":
            out = {"data": [{"index": i, "relevance_score": s[i]} for i in order], "usage": {"total_tokens": 42}}
        else:
            out = {"results": [{"index": i, "relevance_score": s[i]} for i in order],
                   "meta": {"billed_units": {"search_units": 1}}}
        status, headers, raw = 200, {}, None
        if how == "fewer":
            out["results"] = out["results"][:-1]
        elif how == "more":
            out["results"].append(dict(out["results"][0]))
        elif how == "twice":
            out["results"][1]["index"] = out["results"][0]["index"]
        elif how == "out_of_range":
            out["results"][0]["index"] = len(docs)
        elif how == "nan":
            raw = json.dumps(out).replace(str(out["results"][0]["relevance_score"]), "NaN", 1).encode()
        elif how == "string":
            out["results"][0]["relevance_score"] = "0.9"
        elif how == "echo":                  # the request's key sent back as a value
            out["results"][0]["index"] = self.headers.get("Authorization", "")
        elif how == "overflow":              # an integer past float's range, and usage of the wrong shape
            out["meta"] = "x"
            raw = json.dumps(out).replace(str(out["results"][0]["relevance_score"]), "1" + "0" * 400, 1).encode()
        elif how == "html":
            raw = b"<html><body>Bad gateway</body></html>"
        elif how == "429":
            status, headers, out = 429, {"Retry-After": "0"}, {"error": "slow down"}
        elif how == "500":
            status, out = 500, {"error": "oops"}
        elif how == "redirect":
            status, headers, out = 307, {"Location": "http://evil.example/v1/rerank"}, {}
        data = raw if raw is not None else json.dumps(out).encode()
        if how == "huge":
            self.send_response(200)
            self.send_header("Content-Length", str(50 << 20))
            self.end_headers()
            self.wfile.write(b"[" * 65536)
            return
        if how == "trickle":                 # the whole reply, from its status line, a byte every 0.2 s
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
            try:
                for b in head + data:
                    self.wfile.write(bytes([b]))
                    time.sleep(0.2)
            except OSError:                  # the client shut its socket
                pass
            self.close_connection = True
            return
        if how == "stall":
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:5])
            self.wfile.flush()
            time.sleep(3)
            return
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "text/html" if how == "html" else "application/json")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


# how often a server's loop looks for shutdown(): its default 0.5 s would hold every teardown that long
POLL = 0.05


@contextlib.contextmanager
def fake_server():
    """A FakeRerank server on a free port -> its base URL; shut at the end."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeRerank)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": POLL}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture()
def fake():
    FakeRerank.script, FakeRerank.seen, FakeRerank.model, FakeRerank.info_status = [], [], None, 200
    with fake_server() as url:
        yield url


Q, DOCS = "how long to boil an egg", ["boil the egg six minutes", "stock market news", "an egg needs long to boil"]


def test_the_self_hosted_key_goes_to_one_host_and_never_over_a_urls_credentials(fake, monkeypatch):
    """RERANK_API_KEY is one endpoint's key: it replaced the Basic credentials a URL carries, and every
    self-hosted spec of a command got it (another team's server, a third party's). A URL's user:password wins,
    and a key with self-hosted endpoints on two hosts is refused before anything is sent."""
    monkeypatch.setenv("RERANK_API_KEY", "rk-secret")
    with_basic = fake.replace("http://", "http://usr:pw@") + "/rerank"
    rerank_clients.make_reranker(with_basic).rerank(Q, DOCS)
    assert FakeRerank.seen[-1][1]["Authorization"].startswith("Basic ")
    mine, theirs = endpoints.parse_spec(fake), endpoints.parse_spec("tei:http://reranker.example.org/rerank")
    again = endpoints.parse_spec("tei:" + fake.replace("127.0.0.1", "localhost").rsplit(":", 1)[0] + ":9")
    assert rankers.check_specs([("mine", mine), ("again", again)])          # another port of this machine
    with pytest.raises(runs.SettingsError, match="RERANK_API_KEY.*reranker.example.org"):
        rankers.check_specs([("mine", mine), ("theirs", theirs)])
    monkeypatch.delenv("RERANK_API_KEY")
    assert rankers.check_specs([("mine", mine), ("theirs", theirs)])


def test_every_api_shape_over_http(fake, monkeypatch, tmp_path):
    """Cohere v2, Jina, Voyage, a generic endpoint (path, #model) and TEI: the request each API takes,
    the key only as a header, scores back in the documents' order, replies cached."""
    want = fake_scores(Q, DOCS)
    monkeypatch.setenv("RERANK_API_KEY", "rk-secret")
    c = rerank_clients.make_reranker(fake + "/v1/rerank#my-model", cache_dir=str(tmp_path / "c"))
    r = c.rerank(Q, DOCS)
    assert r.scores == pytest.approx(want) and r.usage == {"search_units": 1} and not r.cached
    path, headers, body = FakeRerank.seen[-1]
    assert path == "/v1/rerank" and body == {"model": "my-model", "query": Q, "documents": DOCS, "top_n": 3}
    assert headers["Authorization"] == "Bearer rk-secret"
    assert c.rerank(Q, DOCS).cached and len(FakeRerank.seen) == 1              # from the cache
    assert rerank_clients.make_reranker(fake).url == fake + "/rerank"          # the default path
    t = rerank_clients.make_reranker("tei:" + fake)
    assert t.rerank(Q, DOCS).scores == pytest.approx(want)
    assert FakeRerank.seen[-1][0] == "/rerank"
    assert FakeRerank.seen[-1][2] == {"query": Q, "texts": DOCS, "raw_scores": False}
    for provider, shape, var in (("cohere", "cohere", "COHERE_API_KEY"), ("jina", "jina", "JINA_API_KEY"),
                                 ("voyage", "voyage", "VOYAGE_API_KEY")):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv("CO_API_KEY", raising=False)
        with pytest.raises(llm_clients.LLMError, match=var):
            rerank_clients.make_reranker(f"{provider}:m")
        monkeypatch.setenv(var, "k-" + provider)
        hosted = rerank_clients.make_reranker(f"{provider}:m")
        assert hosted.shape == shape and hosted.url == endpoints.RERANK_PROVIDERS[provider]["url"]
        assert hosted.transport.headers()["Authorization"] == "Bearer k-" + provider
    assert rerank_clients.rerank_body("jina", "m", Q, DOCS)["return_documents"] is False
    v = rerank_clients.RerankClient(fake + "/v1/rerank-voyage", "m", "voyage")
    r = v.rerank(Q, DOCS)
    assert r.scores == pytest.approx(want) and r.usage == {"tokens": 42}
    assert "top_n" not in FakeRerank.seen[-1][2] and FakeRerank.seen[-1][2]["truncation"] is True
    for bad in ("nope:x", "ftp://host", "tei:nothing"):
        with pytest.raises(ValueError, match="reranker"):
            rerank_clients.make_reranker(bad)


@pytest.mark.parametrize("how,msg", [("fewer", "results: 2 results for 3 documents"),
                                     ("more", "results: 4 results for 3 documents"),
                                     ("twice", r"results\[1\].index: \d given twice"),
                                     ("out_of_range", r"results\[0\].index: expected an integer in 0..2, got 3"),
                                     ("nan", r"results\[0\].relevance_score: expected a finite number, got float"),
                                     ("string", r"results\[0\].relevance_score: expected a finite number, got str"),
                                     ("echo", r"results\[0\].index: expected an integer in 0..2, got str"),
                                     ("overflow", r"results\[0\].relevance_score: expected a finite number, got int"),
                                     ("html", "HTTP 200 with a body that is not JSON"),
                                     ("huge", "reply of 52428800 bytes refused"),
                                     ("redirect", "HTTP 307 redirect to evil.example refused")])
def test_hostile_endpoints_are_one_line_errors_never_a_ranking(fake, tmp_path, how, msg):
    c = rerank_clients.RerankClient(fake + "/v1/rerank", "m", api_key="rk-secret", cache_dir=str(tmp_path / "c"),
                                 max_retries=2)
    c.transport.sleep = lambda s: None
    FakeRerank.script = [how]
    with pytest.raises(llm_clients.LLMError, match=msg) as e:
        c.rerank(Q, DOCS)
    assert str(e.value).startswith(c.label) and "\n" not in str(e.value) and "rk-secret" not in str(e.value)
    assert len(FakeRerank.seen) == 1                                    # not retried: retrying cannot help
    assert not os.path.exists(tmp_path / "c") or not any(f for _, _, f in os.walk(tmp_path / "c"))   # nothing kept
    assert c.rerank(Q, DOCS).scores == pytest.approx(fake_scores(Q, DOCS))      # the next reply is fine


def test_rate_limits_server_errors_or_stalls_are_retried(fake):
    """429 and 500 are retried with the server's Retry-After; a stalled reply is retried too, and three
    stalls end in one error in bounded time (a 0.3 s timeout there: each stall waits it out)."""
    c = rerank_clients.RerankClient(fake + "/v1/rerank", "m", max_retries=2, timeout=1)
    delays = []
    c.transport.sleep = delays.append
    FakeRerank.script = ["429", "500"]
    assert c.rerank(Q, DOCS).scores == pytest.approx(fake_scores(Q, DOCS))
    assert len(FakeRerank.seen) == 3 and delays[0] == 0.0 and c.stats["retries"] == 2
    stalled = rerank_clients.RerankClient(fake + "/v1/rerank", "m", max_retries=2, timeout=0.3)
    stalled.transport.sleep = delays.append
    FakeRerank.script = ["stall", "stall", "stall"]
    t0 = time.monotonic()
    with pytest.raises(llm_clients.LLMError, match="after 3 attempts"):
        stalled.rerank(Q + "?", DOCS)
    assert time.monotonic() - t0 < 8


def test_the_timeout_bounds_a_reply_trickled_from_its_first_byte(fake):
    """`--timeout` bounds the whole rerank reply: one trickled a byte every 0.2 s, status line and headers
    included (~50 s in all), fails at the 1 s timeout with the error naming the endpoint."""
    c = rerank_clients.RerankClient(fake + "/v1/rerank", "m", max_retries=0, timeout=1)
    FakeRerank.script = ["trickle"]
    t0 = time.monotonic()
    with pytest.raises(llm_clients.LLMError, match=r"Timeout on http://127\.0\.0\.1:\d+/v1/rerank after 1 attempts"):
        c.rerank(Q, DOCS)
    assert time.monotonic() - t0 < 2


def test_a_failed_request_stops_the_others_in_flight(fake):
    c = rerank_clients.RerankClient(fake + "/v1/rerank", "m", max_retries=2, timeout=30)
    FakeRerank.script = ["stall", "stall", "stall", "html"]          # one fails while three stall
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with pytest.raises(llm_clients.LLMError, match="not JSON"):
        c.map([(Q + str(i), DOCS) for i in range(4)], workers=4)
    assert time.monotonic() - t0 < 2                                   # reported at once
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("ThreadPoolExecutor"):     # not the server's threads, which sleep out their stall
            t.join(timeout=3)                # the stalled workers end after the abort's grace, no retries
            assert not t.is_alive()
    assert len(FakeRerank.seen) == 4
    FakeRerank.script = []
    assert len(c.map([(Q + "again", DOCS)])) == 1 and len(FakeRerank.seen) == 5   # the next map is sent


def _run_copy(demo_run, tmp_path):
    """A copy of the demo run (trained adapter, library, results) and the tiny checkpoints beside it."""
    shutil.copytree(demo_run.parent, tmp_path / "o")
    return tmp_path / "o", "demo"


def test_rerank_eval_against_our_own_serve_equals_the_shield(demo_run, tmp_path):
    """This project's `serve` as a deployed reranker: every instance ranked exactly as the in-process
    Shield ranks it, in the Cohere and TEI shapes; eval's 'Non-Defense [it]' has Shield only's figures."""
    out, name = _run_copy(demo_run, tmp_path)
    cfg = settings.EvalConfig(**{**json.load(open(out / name / "config.json"))["config"], "runs_dir": str(out)})
    rr = runs.Run(cfg).shield()
    srv = serve.RerankServer(rr, port=0, log=False)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": POLL}, daemon=True).start()
    try:
        t0 = time.monotonic()
        stage = run.main(["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", "shield",
                          "--reranker", f"ours={srv.url}/v1/rerank", "--reranker", f"ourtei=tei:{srv.url}",
                          "--reranker", "base"])
        wall = time.monotonic() - t0
        recs = {lb: [json.loads(l) for l in open(out / name / "results" / f"rerank-{lb}.jsonl")]
                for lb in ("shield", "ours", "ourtei", "base")}
        assert len(recs["shield"]) > 0 and wall < 120
        for lb in ("ours", "ourtei"):
            assert [r["ranking"] for r in recs[lb]] == [r["ranking"] for r in recs["shield"]], lb
            assert [r["attack_rank"] for r in recs[lb]] == [r["attack_rank"] for r in recs["shield"]]
            assert stage[lb]["overall"]["exposure"] == stage["shield"]["overall"]["exposure"]
        r0 = recs["shield"][0]
        assert set(r0) >= {"instance_id", "ranking", "scores", "attack_rank"}
        assert r0["scores"] == sorted(r0["scores"], reverse=True)
        assert recs["base"][0]["clean_topk_kept"] == 1.0
        s = json.load(open(out / name / "summary.json"))
        for lb in ("shield", "ours"):
            blk = s["rerank_stage"][lb]
            assert set(blk["overall"]) >= {"exposure", "exposure_ci", "mean_attack_rank", "mean_attack_rank_ci",
                                           "promotion", "promotion_ci", "n"}
            assert all(set(v) >= {"exposure", "mean_attack_rank", "promotion",
                                  "seen"} for v in blk["per_method"].values())
            lo, hi = blk["overall"]["exposure_ci"]
            assert lo <= blk["overall"]["exposure"] <= hi
        assert "Reranker stage under GEO attack" in (out / name / "rerank_report.md").read_text()
        assert (out / name / "figures" / "rerank_exposure.svg").exists()
        assert "rerank:" in json.dumps(s["usage"]["stages"]["rerank-eval"])     # the endpoint's requests counted
        # end to end: Non-Defense over the served Shield is Shield only
        ev = evaluation.evaluate(runs.Run(settings.EvalConfig(**{**cfg.flat(),
                                                                 "reranker": [f"ours={srv.url}/v1/rerank"],
                                                                 "conditions": "Non-Defense,Shield only"}))).summary
        for key in ("ASR", "ASI", "BER"):
            assert ev["conditions"]["Non-Defense [ours]"][key] == ev["conditions"]["Shield only"][key]
        assert "TFSG only [ours]" in ev["conditions"]
        assert json.load(open(out / name / "results" / "settings.json"))["reranker ours"] == f"{srv.url}/v1/rerank"
        assert "Deployed rerankers" in (out / name / "report.md").read_text()
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_quant_int8_run_scores_both_local_rerankers_in_int8_once_each_passes_the_gate(demo_run, tmp_path,
                                                                                         monkeypatch, capsys):
    """A run made with --quant int8 (a copy of the demo with int8 in its record: training runs on the float base,
    so its adapter is the demo's) scores base and Shield as two int8 models, the Shield's adapter merged first,
    each once its ranks on the run's lists pass the gate (logged), into caches of their own: the float caches
    training wrote stay as they were; the Shield alone loads no base. Below the gate rerank-eval stops, naming
    the figures and --quant none."""
    import lora
    out, name = _run_copy(demo_run, tmp_path)
    record = json.load(open(out / name / "config.json"))
    record["config"]["quant"] = "int8"
    (out / name / "config.json").write_text(json.dumps(record))
    floats = {p.name: p.read_bytes() for p in (out / name / "cache").glob("scores_*.json")}
    # the random tiny models' scores nearly tie, so their figures sit near the real gate: set here
    monkeypatch.setattr(rankers, "INT8_GATE", {"kendall_tau": 0.9, "top5_agreement": 0.9})
    lists = rankers.gate_lists                 # the gate measured on 8 of the run's lists, not 32: plumbing
    monkeypatch.setattr(rankers, "gate_lists", lambda bench: lists(bench, 8))
    argv = ["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", "base", "--reranker", "shield"]
    stage = run.main(argv)
    assert capsys.readouterr().err.count("[int8] rank agreement with the float model: Kendall tau") == 2
    assert {p.name: p.read_bytes() for p in (out / name / "cache").glob("scores_*.json") if p.name in floats} == floats
    q8 = {p.name.replace("_int8", ""): json.load(open(p)) for p in (out / name / "cache").glob("scores_*_int8.json")}
    assert set(q8) == set(floats)                              # scores_base and the adapter's scores_shield_<sha1>
    cfg = settings.EvalConfig(**{**record["config"], "runs_dir": str(out)})
    rr = runs.Run(cfg).shield()
    lora.quantize_int8(rr.model)
    x = geodef.clean_instance(runs.Run(cfg).data.test[0])
    q8_shield = next(v for k, v in q8.items() if k.startswith("scores_shield"))
    want = rr.score(x.query, x.docs).tolist()
    assert [q8_shield[rankers.doc_key(x.query, d)] for d in x.docs] == pytest.approx(want, abs=1e-5)
    assert stage["shield"]["overall"]["n"] > 0
    run.main(argv[:-4] + ["--reranker", "shield"])             # the Shield alone: no base loaded, one gate
    assert capsys.readouterr().err.count("[int8] rank agreement with the float model") == 1
    monkeypatch.setattr(rankers, "INT8_GATE", {"kendall_tau": 1.01, "top5_agreement": 0.9})
    for p in (out / name / "cache").glob("scores_*_int8.json"):
        p.unlink()
    with pytest.raises(SystemExit, match=r"below the gate: Kendall tau 0\.\d+ \(gate 1\.01\).*--quant none"):
        run.main(argv)


def _rerank_eval_argv(out, name, fake):
    return ["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", f"fk={fake}/v1/rerank", "--workers",
            "1"]


def _request_key(body):
    return json.dumps(body, sort_keys=True)


def test_a_failed_rerank_eval_records_nothing_partial_and_resumes_from_the_cache(demo_run, tmp_path, fake):
    """rerank-eval on a copy of the demo run, its sixth reply one result short, fails: no partial
    records; the rerun sends only the requests that were not answered (one failed run for both)."""
    out, name = _run_copy(demo_run, tmp_path)
    FakeRerank.script = ["ok"] * 5 + ["fewer"]
    before = set(threading.enumerate())
    with pytest.raises(SystemExit, match=r"error: .*results: 9 results for 10 documents"):
        run.main(_rerank_eval_argv(out, name, fake))
    for t in set(threading.enumerate()) - before:    # a request in flight at the failure finishes (and is cached)
        if t.name.startswith("ThreadPoolExecutor"):
            t.join(timeout=10)
    answered = {_request_key(b) for i, (_, _, b) in enumerate(FakeRerank.seen) if i != 5}   # the 6th got "fewer"
    sent = len(FakeRerank.seen)
    assert not (out / name / "results" / "rerank-fk.jsonl").exists()
    run.main(_rerank_eval_argv(out, name, fake))
    first = (out / name / "results" / "rerank-fk.jsonl").read_text()
    n_lists = len(first.splitlines()) + len({json.loads(l)["group_id"] for l in first.splitlines()})
    resumed = [_request_key(b) for _, _, b in FakeRerank.seen[sent:]]
    assert not set(resumed) & answered and len(resumed) == n_lists - len(answered)   # nothing paid twice


def test_a_finished_rerank_eval_reruns_without_sending(demo_run, tmp_path, fake):
    out, name = _run_copy(demo_run, tmp_path)
    argv = _rerank_eval_argv(out, name, fake)
    run.main(argv)
    first = (out / name / "results" / "rerank-fk.jsonl").read_text()
    again = len(FakeRerank.seen)
    run.main(argv)
    assert len(FakeRerank.seen) == again and (out / name / "results" / "rerank-fk.jsonl").read_text() == first


def test_a_rerankers_block_measured_on_other_lists_is_not_kept_beside_the_new_ones(demo_run, tmp_path):
    """summary.json keeps an earlier run's reranker beside the new ones only when it was measured on the same
    test lists at the same k: base on two groups stood beside the Shield on all of them, as comparable."""
    out, name = _run_copy(demo_run, tmp_path)
    argv = ["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker"]
    run.main(argv + ["base", "--max-test-groups", "2"])
    run.main(argv + ["shield"])
    assert set(json.load(open(out / name / "summary.json"))["rerank_stage"]) == {"shield"}
    run.main(argv + ["base"])
    stage = json.load(open(out / name / "summary.json"))["rerank_stage"]
    assert set(stage) == {"base", "shield"} and stage["base"]["test_set_sha1"] == stage["shield"]["test_set_sha1"]


def test_a_stale_or_corrupted_score_file_is_one_line_naming_it_and_never_merged(demo_run, tmp_path):
    """A share file that is not one ({key: 1e9} would move exposure), nested too deeply, made by another
    ranker or benchmark or as a rank its layout lacks, or holding a key or score that is none, stops
    rerank-eval before anything is merged; so does a corrupted cache. A share of this ranker is merged."""
    out, name = _run_copy(demo_run, tmp_path)
    cache = out / name / "cache" / "scores_base.json"
    before, share = cache.read_bytes(), cache.with_name("scores_base.json.rank1")
    key, score = next(iter(json.loads(before).items()))
    share.write_text(json.dumps({key: 1e9}))
    with pytest.raises(SystemExit, match=r"^error: \S+/cache/scores_base.json.rank1: not a share file [^\n]*$"):
        run.main(["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", "base"])
    cfg = settings.EvalConfig(**{**json.load(open(out / name / "config.json"))["config"], "runs_dir": str(out)})
    base = rankers.make_rankers(runs.Run(cfg), rankers.parse_rerankers(["base"]), "test")["base"]
    made = lambda **kw: {"made_from": {**base.made_from, "rank": 1, "world": 2, **kw}, "scores": {key: score}}
    for text, why in [("[" * 100000, "nested too deeply"), ("null", "not a share file"),
                      (made(bench_sha1="0" * 40), "made with bench_sha1='0000"), (made(rank=0), r"rank=0 \(this run"),
                      (made(world=1), "world=1, which holds no rank 1"), ({**made(), "scores": [1.0]}, "got list"),
                      ({**made(), "scores": {"k": 1.0}}, "'k': 1.0: not a 40-hex"),
                      ({**made(), "scores": {key: float("inf")}}, "inf: not a 40-hex document key with a finite")]:
        share.write_text(text if isinstance(text, str) else json.dumps(text))
        with pytest.raises(rankers.ScoreCacheError, match=f"scores_base.json.rank1: .*{why}"):
            rankers.sharded(parallel.Ranks(), base, [])
    assert cache.read_bytes() == before
    for text, why in [("[]", "got list"), ("null", "got NoneType"), ('{"a": ' * 50000, "nested too deeply"),
                      (json.dumps({key: "0.5"}), "not a 40-hex"), ("\xff", "not JSON")]:
        cache.write_bytes(text.encode("latin-1"))
        with pytest.raises(rankers.ScoreCacheError, match=f"scores_base.json: .*{why}"):
            rankers.Ranker(base.rr, str(cache), "base")
    cache.write_bytes(before)
    share.write_text(json.dumps(made()))
    rankers.sharded(parallel.Ranks(), rankers.Ranker(base.rr, str(cache), "base", made_from=base.made_from), [])
    assert not share.exists() and json.loads(cache.read_bytes()) == json.loads(before)


def test_rerank_eval_refuses_bad_reranker_flags(demo_run, tmp_path, fake):
    out, name = _run_copy(demo_run, tmp_path)
    for bad, msg in ([f"x y={fake}"], "the label must be"), (["a=base", "a=shield"], "given twice"), \
                    (["q=nope:thing"], "unknown reranker"), (["co-1=base", "Co_1=shield"], "differ only in case"), \
                    (["x=base", "x-=shield"], "differ only in case"), (["co.s1=base"], r"'\.s<N>' and '\.honest'"), \
                    (["co.honest=base"], r"'\.s<N>' and '\.honest'"):
        with pytest.raises(SystemExit, match=msg):
            run.main(["rerank-eval", "--runs-dir", str(out), "--name",
                      name] + sum((["--reranker", b] for b in bad), []))
    with pytest.raises(SystemExit, match="at least one --reranker"):
        run.main(["rerank-eval", "--runs-dir", str(out), "--name", name])


@pytest.fixture(scope="module")
def with_passwords(demo_run, tmp_path_factory):
    """rerank-eval on a copy of the demo run against two endpoints (plain and tei:) of one FakeRerank
    server whose URLs hold a user and password, no labels given; run once for the tests below, which
    only read what it left -> (the copy, the run's name, the endpoint's port, the URL, what it printed
    (stdout + stderr), the requests the endpoint saw)."""
    out, name = _run_copy(demo_run, tmp_path_factory.mktemp("passwords"))
    FakeRerank.script, FakeRerank.seen = [], []
    printed = io.StringIO()
    with fake_server() as url, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        secret = url.replace("http://", "http://usr:PASSw0rd@")
        run.main(["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", f"{secret}/v1/rerank",
                  "--reranker", f"tei:{secret}", "--workers", "2"])
    return out, name, url.rsplit(":", 1)[1], secret, printed.getvalue(), list(FakeRerank.seen)


def test_default_rerank_labels_come_from_host_port_path(with_passwords):
    out, name, port, _, _, _ = with_passwords
    label = f"127.0.0.1-{port}-v1-rerank"
    assert (out / name / "results" / f"rerank-{label}.jsonl").exists()
    assert (out / name / "results" / f"rerank-127.0.0.1-{port}-rerank.jsonl").exists()


def test_url_passwords_never_reach_disk_or_output(with_passwords, tmp_path):
    """URL passwords (plain and tei:) appear in no file of the run folder and in no output."""
    out, name, _, secret, printed, _ = with_passwords
    assert "PASSw0rd" not in printed
    for root, _, files in os.walk(out / name):
        for f in files:
            assert b"PASSw0rd" not in open(os.path.join(root, f), "rb").read(), os.path.join(root, f)
    fresh = settings.EvalConfig(name="fresh", runs_dir=str(tmp_path),
                                reranker=[f"a={secret}/v1/rerank", f"tei:{secret}"],
                                base_url=secret + "/v1")
    runs.Run(fresh).record("rerank-eval")                     # a new run folder's record
    rec = json.load(open(tmp_path / "fresh" / "config.json"))["config"]
    assert [r.count("***@") for r in rec["reranker"]] == [1, 1] and rec["base_url"].count("***@") == 1
    assert "PASSw0rd" not in open(tmp_path / "fresh" / "config.json").read()


def test_a_model_field_is_sent_only_with_hash_model(with_passwords, fake):
    """Without #MODEL no model field is sent."""
    seen = with_passwords[5]
    assert seen and all("model" not in body for _, _, body in seen)          # no #MODEL: no model field
    c = rerank_clients.make_reranker(f"{fake}/v1/rerank#my-model")
    c.rerank(Q, DOCS)
    assert FakeRerank.seen[-1][2]["model"] == "my-model"


def test_each_rerank_endpoint_has_its_own_cache(with_passwords, tmp_path, fake):
    """A second loopback endpoint (another port) is asked itself, never answered from the first one's cache
    (on a copy of the run the first endpoint answered, its cache included)."""
    done, name = with_passwords[:2]
    shutil.copytree(done, tmp_path / "o")
    out = tmp_path / "o"
    sent = len(FakeRerank.seen)
    with fake_server() as url2:
        other = f"{url2}/v1/rerank"
        run.main(["rerank-eval", "--runs-dir", str(out), "--name", name, "--reranker", f"two={other}"])
        n_lists = len(open(out / name / "results" / "rerank-two.jsonl").read().splitlines())
        assert len(FakeRerank.seen) - sent >= n_lists        # asked itself: nothing from the first port's cache


def test_a_restarted_endpoint_serving_another_model_is_not_answered_from_the_cache(fake, tmp_path):
    """A TEI request names no model: the cache key carries what the endpoint's /info says it serves, so the
    same URL serving another model after a restart is asked again, never answered with the old one's scores;
    a cache entry that no longer holds numbers is asked again too."""
    ask = lambda: rerank_clients.make_reranker(f"tei:{fake}", cache_dir=str(tmp_path / "c")).rerank(Q, DOCS)
    FakeRerank.model = "bge-reranker-base"
    assert not ask().cached and ask().cached
    FakeRerank.model = "bge-reranker-v2-m3"
    assert not ask().cached
    for root, _, files in os.walk(tmp_path / "c"):
        for f in files:
            entry = json.load(open(os.path.join(root, f)))
            entry["scores"][0] = "x"
            json.dump(entry, open(os.path.join(root, f), "w"))
    assert not ask().cached
    FakeRerank.info_status = 503      # what it serves unknown for now: an error, never the URL's old scores
    with pytest.raises(llm_clients.LLMError, match="asking what the endpoint serves"):
        rerank_clients.make_reranker(f"tei:{fake}", cache_dir=str(tmp_path / "c"), max_retries=0).rerank(Q, DOCS)


def test_a_rerank_reply_lost_or_refused_after_it_was_billed_reaches_the_ledger(fake, tmp_path):
    """A reply lost after the request was sent (a stall past the timeout, then a retry) enters a lost row:
    the cost reads unknown rather than short; a reply refused for its shape was billed as a request."""
    import accounting
    ledger, prices = str(tmp_path / "u.jsonl"), {"rerank-v3.5": {"usd_per_1k_searches": 2.0}}
    c = rerank_clients.RerankClient(f"{fake}/v1/rerank", None, "cohere", label="cohere:rerank-v3.5", timeout=1,
                                    ledger=ledger, stage="rerank")
    FakeRerank.script = ["stall", "ok"]
    c.rerank(Q, DOCS)
    total = accounting.ledger_usage(ledger, prices)["total"]
    assert total["replies"] == 1 and total["lost"] == 1 and total["cost_usd"] is None
    FakeRerank.script = ["string"]
    with pytest.raises(llm_clients.LLMError, match="relevance_score"):
        c.rerank(Q + " again", DOCS)
    assert accounting.ledger_usage(ledger, prices)["total"]["replies"] == 2


def test_the_deletion_seed_is_drawn_once_a_run_and_kept(tmp_path):
    """rerank-eval --certify's deletion seed comes from the OS, not from --seed or the text: one draw a run
    folder, read back by a resumed run; another run folder, another draw."""
    s = rerank_eval.noise_seed(str(tmp_path / "noise_seed.json"))
    assert rerank_eval.noise_seed(str(tmp_path / "noise_seed.json")) == s
    assert json.load(open(tmp_path / "noise_seed.json")) == {"seed": s}
    assert rerank_eval.noise_seed(str(tmp_path / "other.json")) != s


def test_clean_top_k_kept_is_one_value_a_group():
    """Clean top-k kept depends on the group's clean list alone: a group with fewer families (a gate refused
    some) weighed less when each instance counted (66.7 where the groups' mean is 75.0)."""
    rec = lambda gid, m, kept: {"group_id": gid, "method": m, "exposed": False, "attack_rank": 6, "promotion": 0,
                                "clean_topk_kept": kept}
    recs = [rec("g0", "M1", 0.5), rec("g0", "M2", 0.5), rec("g1", "M1", 1.0)]
    out = rerank_eval.summarize_stage(recs, ["M1", "M2"], 50, 0)
    assert out["overall"]["clean_topk_kept"] == pytest.approx(75.0)


def test_a_sources_certificate_counts_once_not_once_per_family_that_rewrote_it():
    """The source's radius and its clean list's depend on the group, not the family: a group rewritten by
    three families and one rewritten by one weigh alike in "% of sources certified" and the clean kept %."""
    rec = lambda g, radius, kept: {"group_id": g, "attack_index": 2, "method": "m", "samples": 8, "eps": 0.1,
                                   "deletion_rate": 0.9, "source_radius": dict.fromkeys(certify.KINDS, radius),
                                   "rewrite_radius": {"inserted": None}, "kept_radius": [kept], "inside": False,
                                   "inserted": 3, "smoothed_exposed": False, "ndcg_smoothed_clean": 1.0}
    recs = [rec("g1", 50, 50)] * 3 + [rec("g2", None, None)]
    out = rerank_eval.certify_summary(recs, [{"exposed": False}] * 4, {"forward_passes": 1, "seconds": 1.0,
                                                                       "lists": 2})
    assert out["certified"]["inserted"]["1"] == 50.0 and out["clean_kept_certified"]["1"] == 50.0
    assert out["n"] == 4 and out["sources"] == 2


def test_certify_records_wires_each_list_to_its_bound_and_the_other_attacked_set_no_bar(tmp_path, monkeypatch):
    """certify_records on designed smoothed scores, far enough apart for the bound to certify (a stub stands in
    for the reranker's smoothing, which on the tiny random model ties every score and certifies nothing). The
    source is certified on the clean list, the rewrite on the attacked one; on a list with two attacked, the
    other attacked document (index 1, ĝ 0.90 on the clean list) sets no bar, since the attacker writes it
    too: the bar is the clean document at 0.50, so the source's radius shrinks from 20 to 5 (k = 1, p = 0.9),
    and no clean document counts as kept."""
    from types import SimpleNamespace as NS
    clean, attacked = [0.10, 0.90, 0.50], [0.20, 0.05, 0.50]
    monkeypatch.setattr(certify, "smoothed", lambda ranker, lists, *a: [
        clean if x.group_id == "clean" else attacked for x in lists])         # (the stub: no model runs)
    monkeypatch.setattr(rankers, "Ranker", lambda *a, **kw: NS(cache={}))
    monkeypatch.setattr(rerank_eval.speed, "short_documents", lambda model: contextlib.nullcontext())
    monkeypatch.setattr(rerank_eval, "noise_seed", lambda path: 7)
    cfg = NS(certify=NS(certify_samples=10 ** 9, deletion_rate=0.9), data=NS(k=1))
    run_ = NS(cfg=cfg, path=lambda *p: str(tmp_path.joinpath(*p)))
    rk = NS(path=str(tmp_path / "scores.json"), rr=NS(token_budget=4096, model=None), label="base",
            adapter_off=False, made_from=None, order=lambda c: [1, 2, 0])
    words = "the best source for travel guides"
    x = lambda co: NS(instance_id=f"g:M{len(co)}", group_id="g", method="M", attack_index=0, co_attacks=co,
                      attacked=[0, *co], source=words, docs=[words + " trusted", "other page", "third page"],
                      doc_ids=["a", "c", "b"], query="q")
    cleans = {"g": NS(group_id="clean", doc_ids=["a", "c", "b"], docs=[words, "other page", "third page"])}
    one, two = rerank_eval.certify_records(run_, rk, [x([]), x([1])], cleans, None)[0]
    eps = one["eps"]
    assert eps < 1e-3 and one["source_radius"]["inserted"] == certify.radius(clean, 0, 1, eps, 0.9, "inserted", 6)
    assert one["source_radius"]["inserted"] == 20 and two["source_radius"]["inserted"] == 5
    assert one["rewrite_radius"]["inserted"] == certify.radius(attacked, 0, 1, eps, 0.9, "inserted", 7)
    assert one["kept_radius"] == [certify.kept_radius(clean, 0, 1, 1, eps, 0.9)] and two["kept_radius"] == []
    assert (one["inserted"], one["deleted"]) == (1, 0) and one["inside"] and two["inside"]
    assert two["co_radius"] == [certify.radius(attacked, 1, 1, eps, 0.9, "inserted", 2)]
