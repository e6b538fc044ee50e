"""The benchmark builder (build_bench.py, geo_attacks.py): the paper's recipe offline over real HTTP
(GEO-Bench rows with five sources, a Tavily-shaped loopback search, the offline engine playing the
seven families and the fidelity judge), composition, resume to the same bytes, dry run, inputs.
Needs: build_bench.py, geo_attacks.py, attack.py and the jobs they import, offline.py, data/make_sample.py.
Run: python -m pytest -q test_build_bench.py
"""
import importlib.util
import json
import os
import threading

import pytest

import build_bench
import geo_attacks
import geodef
import offline
import run
from conftest import HERE


@pytest.fixture(scope="module")
def geo_input(tmp_path_factory):
    """The synthetic GEO-Bench-shaped rows (five sources a row) and a loopback server answering the
    offline engine's chat and Tavily-shaped /search requests from the synthetic corpus."""
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(HERE, "data", "make_sample.py"))
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    rows, corpus = ms.geo_bench(str(tmp_path_factory.mktemp("geo")))
    srv = offline.make_server(0, corpus=offline.load_corpus(corpus))
    srv.daemon_threads = True
    srv.paths = []
    handle = srv.RequestHandlerClass.do_POST

    def record(h):
        srv.paths.append((h.path, h.headers.get("Authorization")))
        return handle(h)
    srv.RequestHandlerClass = type("Recorded", (srv.RequestHandlerClass,), {"do_POST": record})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield rows, f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.shutdown()
    srv.server_close()


def _argv(rows, url, out, runs_dir, *extra):
    return ["build-bench", "--input", rows, "--output", str(out), "--search", f"tavily:{url}", "--groups", "10",
            "--construction-groups", "3", "--llm", "offline", "--model", "tiny", "--runs-dir", str(runs_dir),
            "--name", "build", "--fidelity-judge", "offline", "--workers", "4", *extra]


def test_the_papers_recipe_offline(geo_input, tmp_path, monkeypatch):
    """Five sources a row + search -> ten candidates with the row's own source among them, the seven
    families under the paper's names, construction groups with the seen three only, the split asked
    for; train accepts the file; the key of Tavily never goes to another host."""
    rows, url, srv = geo_input
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-SECRET")
    comp = run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r"))
    assert comp == {"construction": {"groups": 3, "methods": 3, "instances": 9},
                    "test": {"groups": 7, "methods": 7, "instances": 49}}
    groups, meta = geodef.load_bench(str(tmp_path / "b.jsonl"), with_meta=True)
    assert meta.methods == list(geodef.PAPER_METHODS) and meta.seen_methods == list(geodef.PAPER_SEEN_METHODS)
    assert meta.raw["search"] == f"tavily:{url}" and meta.raw["n_docs"] == 10 and meta.raw["seed"] == 0
    src_rows = {r["id"]: r for r in build_bench.read_rows(rows)}
    for g in groups:
        row = src_rows[g.group_id]
        assert len(g.docs) == 10 and g.docs[g.source_index]["text"] == row["docs"][row["source_index"]]["text"]
        assert len({d["url"] for d in g.docs}) == 10
        want = geodef.PAPER_SEEN_METHODS if g.split == "construction" else geodef.PAPER_METHODS
        assert sorted(g.attacks) == sorted(want), g.group_id
        texts = list(g.attacks.values())
        assert len(set(texts)) == len(texts)                        # the families differ
    line = json.loads(open(tmp_path / "b.jsonl").read().splitlines()[1])
    assert line["trace"]["AgenticGEO"]["strategies"] and line["trace"]["AutoGEO"]["calls"] == 1
    assert all(auth is None for path, auth in srv.paths if path == "/search")    # tvly-SECRET stays home
    plan = run.main(["train", "--dry-run", "--bench", str(tmp_path / "b.jsonl"), "--model", "tiny",
                     "--runs-dir", str(tmp_path / "r"), "--name", "t", "--n-seed-cases", "3", "--batch-size", "3",
                     "--n-batches", "2"])
    assert plan["stages"]["target answers"]["requests"] > 0


def test_a_killed_build_reruns_to_the_same_bytes_and_dry_run_sends_nothing(geo_input, tmp_path, monkeypatch):
    rows, url, srv = geo_input
    run.main(_argv(rows, url, tmp_path / "ref.jsonl", tmp_path / "ref"))
    real, n = geo_attacks.Ctx.ask, [0]

    def dies(self, *a, **k):                # the build is killed in its fifth family step
        n[0] += 1
        if n[0] == 5:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(geo_attacks.Ctx, "ask", dies)
    with pytest.raises(KeyboardInterrupt):
        run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r"))
    assert not (tmp_path / "b.jsonl").exists()
    monkeypatch.setattr(geo_attacks.Ctx, "ask", real)
    run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r"))
    a, b = open(tmp_path / "ref.jsonl").read(), open(tmp_path / "b.jsonl").read()
    assert a.replace("ref.jsonl", "b.jsonl", 1) == b
    sent = len(srv.paths)
    plan = run.main(_argv(rows, url, tmp_path / "dry.jsonl", tmp_path / "dry", "--dry-run"))
    assert len(srv.paths) == sent and not (tmp_path / "dry").exists() and not (tmp_path / "dry.jsonl").exists()
    assert plan["instances"] == {"construction": 9, "test": 49} and plan["search_requests"] == 10
    assert plan["stages"]["IF-GEO"]["groups"] == 7 and plan["stages"]["MAGEO"]["groups"] == 10


def test_the_bundled_sample_is_what_the_builder_makes(tmp_path):
    """data/geo_defensebench_sample.jsonl is this builder's output on make_sample.py's input (the
    command in its docstring), byte for byte: the demo runs on what a user's build-bench writes."""
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(HERE, "data", "make_sample.py"))
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    rows, corpus = ms.geo_bench(str(tmp_path))
    out = tmp_path / "geo_defensebench_sample.jsonl"
    run.main(["build-bench", "--input", rows, "--search", f"offline:{corpus}", "--output", str(out), "--groups", "24",
              "--construction-groups", "12", "--llm", "offline", "--fidelity-judge", "offline", "--model", "tiny",
              "--dtype", "float32", "--synthetic", "--name", "sample", "--runs-dir", str(tmp_path / "r")])
    assert out.read_bytes() == open(os.path.join(HERE, "data", "geo_defensebench_sample.jsonl"), "rb").read()


def test_inputs_and_list_lengths(geo_input, tmp_path):
    """Without search, rows shorter than --docs are reported, not silently lost; --docs 5 is recorded
    and eval's --k must stay below it; AutoGEO's rows, a .json list, parquet without pyarrow and a
    hub split without source texts are handled with one-line errors."""
    rows, url, _ = geo_input
    argv = ["build-bench", "--input", rows, "--output", str(tmp_path / "b.jsonl"), "--groups", "6",
            "--construction-groups", "2", "--llm", "offline", "--runs-dir", str(tmp_path / "r"), "--name", "b",
            "--attacks", "GEO,AutoGEO", "--seen-methods", "GEO"]
    with pytest.raises(SystemExit,
                       match="no query group left, all 24 dropped .first: 5 non-empty documents < --docs 10"):
        run.main(argv)                   # five sources a row, ten asked: every row reported and dropped
    with pytest.raises(SystemExit, match="--docs 5: eval's top-k"):
        run.main(argv + ["--docs", "5"])
    run.main(argv + ["--docs", "5", "--k", "3"])
    groups, meta = geodef.load_bench(str(tmp_path / "b.jsonl"), with_meta=True)
    assert meta.n_docs == 5 and all(len(g.docs) == 5 for g in groups)
    with pytest.raises(SystemExit, match="--k 5: .* has 5 candidates"):
        run.main(["eval", "--dry-run", "--bench", str(tmp_path / "b.jsonl"), "--runs-dir", str(tmp_path / "r"),
                  "--name", "e", "--model", "tiny"])
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"q7": {"query": "how do tides work", "text_list": ["a", "b"], "target_id": 1}}))
    assert build_bench.read_rows(str(auto))[0] == {"id": "q7", "line": 1, "query": "how do tides work",
                                                   "docs": [{"url": "", "text": "a"}, {"url": "", "text": "b"}],
                                                   "source_index": 1}
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(SystemExit, match="needs pyarrow"):
            run.main(argv[:2] + [str(tmp_path / "x.parquet")] + argv[3:])
    with pytest.raises(SystemExit):           # no abbreviations: --out is not --output
        run.main(argv + ["--docs", "5", "--k", "3", "--out", str(tmp_path / "elsewhere.jsonl")])
    with pytest.raises(SystemExit, match="only GEO-Bench's test split has source texts"):
        run.main(argv[:2] + ["hf:GEO-Optim/geo-bench:train"] + argv[3:])
