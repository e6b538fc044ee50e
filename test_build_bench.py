"""The benchmark builder (build_bench.py, geo_attacks.py): the paper's recipe offline over real HTTP
(GEO-Bench rows with five sources, a Tavily-shaped loopback search, the offline engine playing the
seven families and the fidelity judge), a fidelity judge whose replies stay unusable (the scripted loopback
server), composition, resume to the same bytes, dry run, inputs.
Needs: build_bench.py, geo_attacks.py, geo_jobs.py, attack.py and the jobs they import, offline_server.py, offline.py,
data/make_sample.py.
Run: python -m pytest -q test_build_bench.py
"""
import html
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading

import pytest

import accounting
import build_bench
import certify
import endpoints
import figures
import geo_attacks
import geo_jobs
import geodef
import offline_server
import run
import runs
import settings
from testing import HERE


@pytest.fixture(scope="module")
def geo_input(tmp_path_factory):
    """The synthetic GEO-Bench-shaped rows (five sources a row) and a loopback server answering the
    offline engine's chat and Tavily-shaped /search requests from the synthetic corpus."""
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(HERE, "data", "make_sample.py"))
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    rows, corpus = ms.geo_bench(str(tmp_path_factory.mktemp("geo")))
    srv = offline_server.make_server(0, corpus=offline_server.load_corpus(corpus))
    srv.daemon_threads = True
    srv.paths = []
    handle = srv.RequestHandlerClass.do_POST

    def record(h):
        srv.paths.append((h.path, h.headers.get("Authorization")))
        return handle(h)
    srv.RequestHandlerClass = type("Recorded", (srv.RequestHandlerClass,), {"do_POST": record})
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick teardown
    yield rows, f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.shutdown()
    srv.server_close()


def _argv(rows, url, out, runs_dir, *extra):
    return ["build-bench", "--input", rows, "--output", str(out), "--search", f"tavily:{url}", "--groups", "10",
            "--construction-groups", "3", "--llm", "offline", "--model", "tiny", "--runs-dir", str(runs_dir),
            "--name", "build", "--fidelity-judge", "offline", "--workers", "4", *extra]


@pytest.fixture(scope="module")
def built(geo_input, tmp_path_factory):
    """The build of _argv, with a Tavily key set, run once for the tests that read it -> (its output
    b.jsonl, what the command returned)."""
    rows, url, _ = geo_input
    d = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAVILY_API_KEY", "tvly-SECRET")
        comp = run.main(_argv(rows, url, d / "b.jsonl", d / "r"))
    return d / "b.jsonl", comp


def test_the_papers_recipe_offline(geo_input, built, tmp_path):
    """Five sources a row + search -> ten candidates with the row's own source among them, the seven
    families under the paper's names, construction groups with the seen three only, the split asked
    for; train accepts the file; the key of Tavily never goes to another host."""
    rows, url, srv = geo_input
    bench, comp = built
    assert comp == {"construction": {"groups": 3, "methods": 3, "instances": 9},
                    "test": {"groups": 7, "methods": 7, "instances": 49}}
    groups, meta = geodef.load_bench(str(bench), with_meta=True)
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
    line = json.loads(open(bench).read().splitlines()[1])
    assert line["trace"]["AgenticGEO"]["strategies"] and line["trace"]["AutoGEO"]["calls"] == 1
    assert all(auth is None for path, auth in srv.paths if path == "/search")    # tvly-SECRET stays home
    plan = run.main(["train", "--dry-run", "--bench", str(bench), "--model", "tiny",
                     "--runs-dir", str(tmp_path / "r"), "--name", "t", "--n-seed-cases", "3", "--batch-size", "3",
                     "--n-batches", "2"])
    assert plan["stages"]["target answers"]["requests"] > 0


def test_a_killed_build_reruns_to_the_same_bytes(geo_input, built, tmp_path, monkeypatch):
    """Killed in its fifth family step, the build writes nothing; rerun, it writes the bytes of the
    `built` build that was never killed (the same settings and key, a fresh runs folder)."""
    rows, url, srv = geo_input
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-SECRET")
    real, n = geo_jobs.Ctx.ask, [0]

    def dies(self, *a, **k):                # the build is killed in its fifth family step
        n[0] += 1
        if n[0] == 5:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(geo_jobs.Ctx, "ask", dies)
    with pytest.raises(KeyboardInterrupt):
        run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r"))
    assert not (tmp_path / "b.jsonl").exists()
    monkeypatch.setattr(geo_jobs.Ctx, "ask", real)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"b.jsonl.tmp{int(gone.stdout)}").write_text("{")       # a build killed while checking its file
    run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r"))
    a, b = open(built[0]).read(), open(tmp_path / "b.jsonl").read()
    assert a == b                           # both files are named b.jsonl, the name the metadata records
    assert not list(tmp_path.glob("b.jsonl.tmp*"))


def test_a_build_dry_run_sends_nothing(geo_input, tmp_path):
    rows, url, srv = geo_input
    sent = len(srv.paths)
    plan = run.main(_argv(rows, url, tmp_path / "dry.jsonl", tmp_path / "dry", "--dry-run"))
    assert len(srv.paths) == sent and not (tmp_path / "dry").exists() and not (tmp_path / "dry.jsonl").exists()
    assert plan["instances"] == {"construction": 9, "test": 49} and plan["search_requests"] == 10
    assert plan["stages"]["IF-GEO"]["groups"] == 7 and plan["stages"]["MAGEO"]["groups"] == 10



def test_the_dry_runs_judge_requests_bound_the_builds(tmp_path):
    """MAGEO's loop judges its candidates each round: the dry run's fidelity judge requests are an upper
    bound of what the build then asks the judge (its own model in the ledger)."""
    argv = ["build-bench", "--input", _rows(tmp_path, lambda rows: None), "--output", str(tmp_path / "b.jsonl"),
            "--groups", "4", "--construction-groups", "2", "--docs", "5", "--llm", "offline", "--fidelity-judge",
            "offline:judge", "--runs-dir", str(tmp_path / "r"), "--name", "b", "--attacks", "MAGEO,GEO",
            "--seen-methods", "MAGEO,GEO"]
    bound = run.main(argv + ["--dry-run"])["stages"]["fidelity judge"]["requests"]
    run.main(argv)
    asked = accounting.ledger_usage(str(tmp_path / "r" / "b" / "usage.jsonl"))["stages"]["build-bench"]
    assert 0 < asked["offline:judge"]["replies"] <= bound


def test_a_search_is_entered_in_the_ledger_before_it_is_cached(geo_input, tmp_path, monkeypatch):
    """A search is paid as it arrives: a kill between its reply and its cache entry leaves its ledger row."""
    _, url, _ = geo_input
    spec = settings.BuildConfig(search=f"tavily:{url}").build.search
    search = build_bench.SearchClient(spec, str(tmp_path / "cache"), str(tmp_path / "usage.jsonl"))

    def killed(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(search.cache, "put_raw", killed)
    with pytest.raises(KeyboardInterrupt):
        search.search("how do tides work", 5)
    assert accounting.ledger_usage(str(tmp_path / "usage.jsonl"))["total"]["search_units"] == 2


def test_a_build_dry_run_prices_each_stage_at_its_own_clients_model(geo_input, tmp_path):
    """The fidelity judge's stage at --fidelity-judge's price, the test split's rewrites at --test-llm's: a
    model the table lacks leaves its stage unpriced (None), never priced at the builder's rate."""
    rows, url, _ = geo_input
    prices = tmp_path / "p.json"
    prices.write_text(json.dumps({"offline": [1.0, 2.0], "judge-x": [3.0, 4.0]}))
    plan = run.main(_argv(rows, url, tmp_path / "dry.jsonl", tmp_path / "dry", "--dry-run", "--prices", str(prices),
                          "--fidelity-judge", "offline:judge-x", "--test-llm", "offline:other"))   # (the last wins)
    st = plan["stages"]
    judged = st["fidelity judge"]
    assert judged["usd"] == pytest.approx((3.0 * judged["prompt_tokens"] + 4.0 * judged["completion_tokens"]) / 1e6)
    assert st["GEO"]["usd"] is not None and st["GEO (test split)"]["usd"] is None


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


def _short_rows_argv(geo_input, tmp_path):
    """build-bench without search on rows of five sources: six groups, two families."""
    rows, url, _ = geo_input
    return ["build-bench", "--input", rows, "--output", str(tmp_path / "b.jsonl"), "--groups", "6",
            "--construction-groups", "2", "--llm", "offline", "--runs-dir", str(tmp_path / "r"), "--name", "b",
            "--attacks", "GEO,AutoGEO", "--seen-methods", "GEO"]


def test_mageos_reranker_scores_are_cached_under_what_made_them(geo_input, tmp_path):
    """build-bench records no settings, so its base scores went to scores_base.json, which a later train or eval
    of the name (whose config.json pins that file) read as its own whatever its model or length; and a rebuild
    at another length read them too. They are cached under a digest of what made them."""
    argv = _short_rows_argv(geo_input, tmp_path)
    argv[argv.index("GEO,AutoGEO")] = "GEO,MAGEO"
    argv += ["--docs", "5", "--mageo-signal", "reranker", "--model", "tiny", "--dtype", "float32"]
    run.main(argv + ["--max-length", "256"])
    run.main(argv + ["--max-length", "320", "--output", str(tmp_path / "b2.jsonl")])
    made = sorted(p.name for p in (tmp_path / "r" / "b" / "cache").iterdir() if p.name.startswith("scores_base"))
    assert len(made) == 2 and "scores_base.json" not in made


@pytest.fixture(scope="module")
def short_rows(geo_input, tmp_path_factory):
    """_short_rows_argv's build with --docs 5, run once for the tests that read it -> its output file."""
    d = tmp_path_factory.mktemp("short")
    run.main(_short_rows_argv(geo_input, d) + ["--docs", "5"])
    return d / "b.jsonl"


def test_rows_shorter_than_docs_are_reported_not_lost(geo_input, short_rows, tmp_path):
    """Without search, rows shorter than --docs are reported, not silently lost; --docs 5 (the
    short_rows build, the same command) is recorded."""
    argv = _short_rows_argv(geo_input, tmp_path)
    with pytest.raises(SystemExit,
                       match="0 query groups leave none for the test split after --construction-groups 2; 24 "
                             "rows dropped .first: 5 non-empty, distinct documents < --docs 10"):
        run.main(argv)                   # five sources a row, ten asked: every row reported and dropped
    assert not (tmp_path / "b.jsonl").exists()
    groups, meta = geodef.load_bench(str(short_rows), with_meta=True)
    assert meta.n_docs == 5 and all(len(g.docs) == 5 for g in groups)
    assert meta.raw["fidelity_judge"] == "offline:offline-engine"        # no --fidelity-judge: the builder judges
    assert set(meta.raw["surface_markers"]) == {"benign candidates", "sources", "GEO", "AutoGEO"}


def test_construction_families_all_lets_train_hold_any_family_out(geo_input, short_rows, tmp_path):
    """--construction-families all: the construction groups rewritten by every family, recorded in _meta
    (seen_methods stays the default training set); train may then take any of them as its seen families,
    which a build of the seen ones alone refuses before anything runs."""
    argv = _short_rows_argv(geo_input, tmp_path) + ["--docs", "5", "--construction-families", "all"]
    comp = run.main(argv)
    assert comp["construction"] == {"groups": 2, "methods": 2, "instances": 4}
    groups, meta = geodef.load_bench(str(tmp_path / "b.jsonl"), with_meta=True)
    assert meta.construction_methods == ["GEO", "AutoGEO"] and meta.seen_methods == ["GEO"]
    assert all(sorted(g.attacks) == ["AutoGEO", "GEO"] for g in groups)
    train = ["train", "--dry-run", "--model", "tiny", "--k", "3", "--n-construction", "2", "--seen-methods", "AutoGEO",
             "--runs-dir", str(tmp_path / "t"), "--n-seed-cases", "1", "--batch-size", "1", "--n-batches", "1"]
    assert run.main(train + ["--bench", str(tmp_path / "b.jsonl"), "--name", "all"])["shield_optimizer_steps"] > 0
    with pytest.raises(SystemExit, match=r"seen methods \['AutoGEO'\] have no construction instances .*"
                                         r"hold \['GEO'\]; build-bench --construction-families all"):
        run.main(train + ["--bench", str(short_rows), "--name", "seen"])
    with pytest.raises(SystemExit, match=r"--construction-families GEO-SFE: each among --attacks"):
        run.main(argv + ["--construction-families", "GEO-SFE", "--dry-run"])


def test_mageos_memory_never_crosses_splits(geo_input, tmp_path, monkeypatch):
    """MAGEO carries memory across the documents of one run: the build runs it on each split apart, so no
    construction edit can reach a test rewrite (B.1.2)."""
    runs, real = [], geo_attacks.Mageo.run

    def spy(self, ctx, jobs):
        runs.append({j.group_id for j in jobs})
        return real(self, ctx, jobs)
    monkeypatch.setattr(geo_attacks.Mageo, "run", spy)
    argv = _short_rows_argv(geo_input, tmp_path)
    argv[argv.index("--attacks") + 1:argv.index("--attacks") + 4] = ["GEO,MAGEO", "--seen-methods", "MAGEO"]
    run.main(argv + ["--docs", "5"])
    groups = geodef.load_bench(str(tmp_path / "b.jsonl"))
    split = {g.group_id: g.split for g in groups}
    assert len(runs) == 2 and [{split[g] for g in r} for r in runs] == [{"construction"}, {"test"}]


def test_a_family_refused_on_a_group_leaves_the_group_its_other_families(geo_input, short_rows, tmp_path,
                                                                         monkeypatch):
    """GEO's every rewrite refused on one test group and on one construction group: the test group is kept
    with AutoGEO alone (the reason in its line's `failed`, _meta.family_drops counting it), each family
    measured over the groups it rewrote; the construction group, whose only family is GEO, is dropped.
    Every other line is the bytes of the build where nothing was refused."""
    plain = [json.loads(line) for line in open(short_rows, encoding="utf-8")]
    test_gid = next(g["group_id"] for g in plain[1:] if g["split"] == "test")
    cons_gid = next(g["group_id"] for g in plain[1:] if g["split"] == "construction")
    real = geo_attacks.Geo.run

    def refused_there(self, ctx, jobs):
        return [("Short." if j.group_id in (test_gid, cons_gid) else t, tr)
                for j, (t, tr) in zip(jobs, real(self, ctx, jobs))]
    monkeypatch.setattr(geo_attacks.Geo, "run", refused_there)
    comp = run.main(_short_rows_argv(geo_input, tmp_path) + ["--docs", "5"])
    lines = [json.loads(line) for line in open(tmp_path / "b.jsonl", encoding="utf-8")]
    assert lines[0]["_meta"]["family_drops"] == {"GEO": 2, "AutoGEO": 0}
    by = {g["group_id"]: g for g in lines[1:]}
    assert cons_gid not in by and sorted(by[test_gid]["attacks"]) == ["AutoGEO"]
    assert by[test_gid]["failed"]["GEO"].startswith("GEO: every attempt refused")
    assert [g for g in plain[1:] if g["group_id"] not in (test_gid, cons_gid)] == \
        [g for g in lines[1:] if g["group_id"] != test_gid]
    n_test = sum(g["split"] == "test" for g in lines[1:])
    assert comp["test"]["instances"] == 2 * n_test - 1
    groups = geodef.load_bench(str(tmp_path / "b.jsonl"))
    test = [g for g in groups if g.split == "test"]
    insts = geodef.expand(test, ["GEO", "AutoGEO"])
    assert len(insts) == 2 * n_test - 1 and sum(x.method == "GEO" for x in insts) == n_test - 1


# a judge's reply cut at the token cap (a reasoning model at too low --max-tokens): no JSON, stop reason "length"
CUT = {"choices": [{"message": {"content": '{"fidelity": 5, "contradicts_so'}, "finish_reason": "length"}],
       "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def test_a_fidelity_judge_that_fails_is_no_refusal_and_stops_the_build(geo_input, tmp_path, server):
    """A fidelity judge whose every reply is cut at the token cap: a rewrite it fails on is not written again
    (the builder is asked for each group's first attempt only, where a refusal is asked twice), and once it has
    failed on most of at least geo_jobs.JUDGE_STOP requests (GEO's 2 construction groups, then its 4 test
    groups) the build stops with an error that names the judge and repeats its error's hint, before AutoGEO's
    rewrites are paid."""
    from testing import Script
    Script.script = [(200, {}, CUT, 0)] * 100
    argv = _short_rows_argv(geo_input, tmp_path) + ["--docs", "5", "--fidelity-judge", "openai-compatible:judge",
                                                    "--base-url", server]
    with pytest.raises(SystemExit, match=r"GEO fidelity: the fidelity judge openai-compatible:judge failed on 6 of "
                                         r"the 6 requests it was sent; stopped before more paid calls\. Its last "
                                         r"failure: fidelity judge failed after 2 attempts: .*raise --max-tokens"):
        run.main(argv)
    asked = accounting.ledger_usage(str(tmp_path / "r" / "b" / "usage.jsonl"))["stages"]["build-bench"]
    assert asked["offline:offline-engine"]["replies"] == 6 * geo_attacks.Geo.calls      # attempt 0 of each group
    assert asked["openai-compatible:judge"]["replies"] == len(Script.seen) == 6 * 2     # each request, its re-ask
    assert not (tmp_path / "b.jsonl").exists()


def test_a_rewrite_the_judge_fails_on_is_recorded_not_rewritten(geo_input, tmp_path, server, capsys):
    """The judge fails on one request (its first: --workers 1) and judges the rest: that group keeps its other
    family, with the judge's error and hint as the failed family's reason and one log line naming both; the
    builder was asked exactly what a build with a working judge asks (no second rewrite), and the build goes on."""
    from testing import Script
    argv = _short_rows_argv(geo_input, tmp_path) + ["--docs", "5", "--fidelity-judge", "openai-compatible:judge",
                                                    "--base-url", server, "--workers", "1",
                                                    "--construction-families", "all"]
    builder = lambda name: accounting.ledger_usage(str(tmp_path / "r" / name / "usage.jsonl"))["stages"][
        "build-bench"]["offline:offline-engine"]["replies"]
    run.main(argv + ["--name", "good", "--output", str(tmp_path / "good.jsonl")])      # the engine judges every one
    Script.script = [(200, {}, CUT, 0)] * 2                # the first request and its re-ask: the judge fails on it
    run.main(argv)
    lines = [json.loads(line) for line in open(tmp_path / "b.jsonl", encoding="utf-8")][1:]
    failed = [(g["group_id"], m, why) for g in lines for m, why in g.get("failed", {}).items()]
    assert len(failed) == 1 and len(lines) == 6
    gid, family, why = failed[0]
    assert why.startswith(f"{family}: fidelity judge failed after 2 attempts: openai-compatible:judge: reply is not "
                          "usable after 2 attempts") and "raise --max-tokens" in why
    err = capsys.readouterr().err
    assert f"[build-bench] {gid}: {family}: the fidelity judge failed on attempt 1's rewrite" in err
    assert builder("b") == builder("good")


def test_evals_k_must_stay_below_the_benchmarks_documents(short_rows, tmp_path):
    with pytest.raises(SystemExit, match="--k 5: .* has 5 candidates"):
        run.main(["eval", "--dry-run", "--bench", str(short_rows), "--runs-dir", str(tmp_path / "r"),
                  "--name", "e", "--model", "tiny", "--conditions", "Non-Defense"])   # needs no training


def test_autogeo_rows_in_a_json_list_are_read(tmp_path):
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"q7": {"query": "how do tides work", "text_list": ["a", "b"], "target_id": 1}}))
    assert build_bench.read_rows(str(auto))[0] == {"id": "q7", "line": 1, "path": str(auto),
                                                   "query": "how do tides work",
                                                   "docs": [{"url": "", "text": "a"}, {"url": "", "text": "b"}],
                                                   "source_index": 1}
    row = '{"query": "q", "text_list": ["a", "b"], "target_id": 0}'
    auto.write_text('{"q1": ' + row + ', "q1": ' + row.replace('"q"', '"another q"') + '}')   # json.load: the last
    with pytest.raises(geodef.BenchFormatError, match="key 'q1' given twice"):
        build_bench.read_rows(str(auto))


def test_inputs_that_cannot_be_read_are_one_line_errors(geo_input, tmp_path):
    """Parquet without pyarrow and a hub split without source texts are handled with one-line errors;
    no abbreviated flags."""
    argv = _short_rows_argv(geo_input, tmp_path)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(SystemExit, match="needs pyarrow"):
            run.main(argv[:2] + [str(tmp_path / "x.parquet")] + argv[3:])
    with pytest.raises(SystemExit):           # no abbreviations: --out is not --output
        run.main(argv + ["--docs", "5", "--out", str(tmp_path / "elsewhere.jsonl")])
    with pytest.raises(SystemExit, match="only GEO-Bench's test split has source texts"):
        run.main(argv[:2] + ["hf:GEO-Optim/geo-bench:train"] + argv[3:])


def test_a_build_left_without_a_test_group_is_refused_before_its_first_call(tmp_path):
    """Without search, rows with fewer candidates than --docs are dropped as the splits are composed, so the
    walk does not fill construction and run out of rows for test: the dry run counts what the build makes,
    and a build left without a test group is refused before any LLM call, not written to fail in `train`."""
    def short(rows):
        for r in rows[2:]:
            r["sources"], r["sugg_idx"] = r["sources"][:3], 0
    argv = ["build-bench", "--input", _rows(tmp_path, short), "--output", str(tmp_path / "b.jsonl"), "--groups", "4",
            "--construction-groups", "2", "--docs", "5", "--llm", "offline", "--runs-dir", str(tmp_path / "r"),
            "--name", "b", "--attacks", "GEO", "--seen-methods", "GEO"]
    for dry in (["--dry-run"], []):
        with pytest.raises(SystemExit, match="2 query groups leave none for the test split .* 10 rows dropped"):
            run.main(argv + dry)
    assert not (tmp_path / "b.jsonl").exists() and not (tmp_path / "r" / "b" / "usage.jsonl").exists()


def test_a_page_in_both_splits_is_found_by_its_url_as_by_its_text(tmp_path):
    """B.1.2: nothing of a group crosses splits. A page fetched again for another query (its text one line
    apart) is the same document: every row holding one URL, the construction row's, leaves no test group."""
    def shared(rows):
        for n, r in enumerate(rows):
            r["sources"][3]["url"] = "https://news.example/shared-page"
            r["sources"][3]["cleaned_text"] += f" Updated {n} hours ago."
    argv = ["build-bench", "--input", _rows(tmp_path, shared), "--output", str(tmp_path / "b.jsonl"), "--groups", "4",
            "--construction-groups", "1", "--docs", "5", "--llm", "offline", "--runs-dir", str(tmp_path / "r"),
            "--name", "b", "--attacks", "GEO", "--seen-methods", "GEO"]
    with pytest.raises(SystemExit, match=r"no test group before any rewrite: 1 made, \d+ rows dropped .first: shares "
                                         "a document with group"):
        run.main(argv)


def _rows(tmp_path, edit, name="rows.jsonl"):
    """make_sample's first 12 rows (five sources each) with `edit(rows)` applied -> the file's path."""
    rows = [json.loads(line) for line in open(_sample_rows(tmp_path))][:12]
    edit(rows)
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sample_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(HERE, "data", "make_sample.py"))
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    return ms.geo_bench(str(tmp_path / "in"))[0]


def _set(i, key, value):
    def edit(rows):
        rows[i][key] = value
    return edit


@pytest.mark.parametrize("edit, extra, msg", [
    (_set(3, "sugg_idx", 1.9), [], r"rows.jsonl:4: sugg_idx: expected an integer, got 1.9"),
    (_set(3, "sugg_idx", True), [], r"rows.jsonl:4: sugg_idx: expected an integer, got True"),
    (_set(3, "sugg_idx", "9" * 5000), [], r"rows.jsonl:4: sugg_idx: expected an integer, got '9999"),
    (_set(3, "sugg_idx", "\u0663"), [], r"rows.jsonl:4: sugg_idx: expected an integer, got '\u0663'"),
    (_set(3, "group_id", 1.5), [], r"rows.jsonl:4: group_id: expected a non-empty string or an integer"),
    (_set(2, "query", 42), [], r"rows.jsonl:3: query: expected a string, got int"),
    (_set(2, "query", "\u200b\u200d \ufeff"), [], r"rows.jsonl:3: query: empty \(only spaces or invisible"),
    (lambda rows: rows[5].update(query_id="x", query="a") or rows[7].update(query_id="x", query="b"), [],
     r"query id 'x' given twice: .*rows.jsonl:6 and .*rows.jsonl:8"),
    (lambda rows: None, ["--groups", "-5"], r"out of range: --groups -5"),
    (lambda rows: None, ["--construction-groups", "-1"], r"out of range: --construction-groups -1"),
    (lambda rows: None, ["--groups", "3"], r"--groups 3 --construction-groups 3: at least one"),
    (lambda rows: None, ["--agentic-archive", "{corrupt}"], r"--agentic-archive .*: "),
    (lambda rows: None, ["--autogeo-rules", "{corrupt}"], r"--autogeo-rules .*: "),
    (lambda rows: None, ["--output", "{folder}"], r"--output .*: a folder"),
    (lambda rows: rows.clear(), [], r"--input .*rows.jsonl: no rows"),
])
def test_every_input_check_runs_before_the_first_request(geo_input, tmp_path, edit, extra, msg):
    """Each refusal the inputs allow comes before any search or LLM request, in one line."""
    rows, url, srv = geo_input
    path = _rows(tmp_path, edit)
    (tmp_path / "corrupt.json").write_text("[" * 100000)
    extra = [x.format(corrupt=tmp_path / "corrupt.json", folder=tmp_path) for x in extra]
    sent = len(srv.paths)
    argv = _argv(path, url, tmp_path / "b.jsonl", tmp_path / "r", *extra)
    with pytest.raises(SystemExit, match=msg) as e:
        run.main(argv)
    assert "\n" not in str(e.value) and len(srv.paths) == sent
    with pytest.raises(SystemExit, match=msg):
        run.main(argv + ["--dry-run"])                     # the dry run makes the same checks


@pytest.mark.parametrize("spec, msg", [("tavily:ftp://x", "expected http"), ("tavily:http://h:99999", "port"),
                                       ("tavily:http://[::1", "expected http|Invalid IPv6"),
                                       ("google", "give tavily")])
def test_a_bad_search_spec_is_refused_in_the_dry_run(geo_input, tmp_path, spec, msg):
    rows, _, _ = geo_input
    argv = ["build-bench", "--input", rows, "--output", str(tmp_path / "b.jsonl"), "--search", spec,
            "--runs-dir", str(tmp_path / "r"), "--dry-run"]
    with pytest.raises(SystemExit, match=msg):
        run.main(argv)


@pytest.mark.parametrize("flags", [["--attacks", "GEO,GEO,MAGEO", "--seen-methods", "GEO"],
                                   ["--seen-methods", "GEO,GEO,MAGEO"]])
def test_a_family_named_twice_is_refused_before_any_rewrite(geo_input, tmp_path, flags):
    """The build's own _meta check refused such a file only after every rewrite was paid for (--seen-methods
    is refused as it is parsed, --attacks by the build's plan)."""
    rows, url, srv = geo_input
    sent = len(srv.paths)
    with pytest.raises(SystemExit, match=r"(\['GEO'\] named|GEO given) more than once"):
        run.main(_argv(rows, url, tmp_path / "b.jsonl", tmp_path / "r", *flags))
    assert len(srv.paths) == sent


def test_row_ids_that_clean_alike_stay_two_groups(tmp_path):
    long = "x" * 40
    rows = [{"id": i, "line": n, "path": "in", "query": f"q{n}", "docs": [], "source_index": None}
            for n, i in enumerate(["a b", "a-b", long + "1", long + "2"], 1)]
    kept, _ = build_bench.usable_rows(rows, search=False)
    gids = [r["group_id"] for r in kept]
    assert gids[1] == "a-b" and len(set(gids)) == 4 and all(len(g) <= 40 for g in gids)
    assert all(build_bench.group_id(i) == g for i, g in zip(["a b", "a-b", long + "1", long + "2"], gids))


def test_an_input_rows_id_and_urls_are_valid_unicode():
    """A lone surrogate in query_id or a source's url failed when the build wrote its file, after every rewrite."""
    row = {"query": "q", "sources": [{"url": "https://x", "cleaned_text": "a page"}], "sugg_idx": 0}
    assert build_bench.row_of(row, "in.jsonl", 3)["docs"][0]["url"] == "https://x"
    for bad, fld in (({"query_id": "\ud800"}, "query_id"), ({"sources": [{"url": "\udfff", "cleaned_text": "a"}]},
                                                            r"sources\[0\].url")):
        with pytest.raises(geodef.BenchFormatError, match=f"in.jsonl:3: {fld}: not valid Unicode"):
            build_bench.row_of({**row, **bad}, "in.jsonl", 3)


def test_a_rows_source_index_is_read_in_its_formats_spelling_or_refused():
    """AgenticGEO's MSdata rows name their source `suggest_id`; a source index of another format's spelling
    (docs with sugg_idx) is refused rather than ignored (the longest document would be rewritten in its
    place); a query id 0 is an id."""
    msdata = {"query_id": 0, "query": "meaning of name elia", "text_list": ["a", "b", "c"], "suggest_id": 2}
    row = build_bench.row_of(msdata, "in.json", 1)
    assert row["source_index"] == 2 and row["id"] == "0"
    for bad, msg in (({"docs": [{"text": "a"}], "sugg_idx": 0}, "sugg_idx: not a source index of rows with docs"),
                     ({**msdata, "target_id": 1}, "suggest_id: given beside target_id"),
                     ({**msdata, "query_id": ""}, "query_id: expected a non-empty string")):
        with pytest.raises(geodef.BenchFormatError, match=f"in.json:1: {msg}"):
            build_bench.row_of({"query": "q", **bad}, "in.json", 1)


def test_a_query_given_twice_is_built_once(tmp_path):
    rows = [{"id": f"q{n}", "line": n, "path": "in", "query": q, "docs": [], "source_index": None}
            for n, q in enumerate(["How do tides work", "how  do TIDES work", "why is the sky blue",
                                   "How do tides work?", "caf\u00e9 menu", "cafe\u0301 menu", "What is C++?",
                                   "What is C#?"], 1)]
    kept, dropped = build_bench.usable_rows(rows, search=False)
    assert [r["id"] for r in kept] == ["q1", "q3", "q5", "q7", "q8"]       # a query's end marks and Unicode form
    #                                                                          aside, never its words' own signs
    assert [(r["id"], why) for r, why in dropped] == [
        ("q2", "the same query as in:1"), ("q4", "the same query as in:1"), ("q6", "the same query as in:5")]


def test_a_source_without_text_is_dropped_before_its_search(geo_input, tmp_path):
    rows, url, srv = geo_input

    def empty_source(rows):
        rows[0]["sources"][rows[0]["sugg_idx"]]["cleaned_text"] = ""
        rows[0]["sources"][rows[0]["sugg_idx"]]["raw_text"] = "  "
    path = _rows(tmp_path, empty_source)
    kept, dropped = build_bench.usable_rows(build_bench.read_rows(path), search=True)
    assert len(kept) == 11 and "has no text" in dropped[0][1]


def test_repeated_documents_of_a_row_are_one_candidate(tmp_path):
    docs = [{"url": "", "text": t} for t in ["a b", "c", "A  b", "d", "e"]]
    out, pos = build_bench.own_candidates({"docs": docs, "source_index": 0}, 4)
    assert [d["text"] for d in out] == ["a b", "c", "d", "e"] and pos == 0


def test_a_search_result_spelling_a_control_token_is_no_candidate():
    """A web page about LLMs may spell <|endoftext|>: it is passed over, as a near-empty page is, or the built
    file would fail its own validation after every rewrite was paid for."""
    page = lambda i, extra="": {"url": f"https://e.x/{i}", "text": f"page {i} " + "word " * 50 + extra}
    row = {"id": "r", "docs": [page("src")], "source_index": 0}
    docs, pos = build_bench.candidates(row, [page(1, "<|endoftext|>"), page(2), page(3)], 3, 0)
    assert [d["url"] for d in docs if d["url"] != "https://e.x/src"] == ["https://e.x/2", "https://e.x/3"]


def test_the_sources_own_page_at_another_spelling_of_its_url_is_no_candidate():
    """GEO-Bench's source is a cleaned copy of a page the search finds again, under its URL spelt otherwise (http,
    no www., a trailing slash, a fragment, tracking parameters): left in, the untouched page stood beside its own
    rewrite as a benign competitor. A page without spaces (Japanese) is no near-empty page for its word count."""
    page = lambda url, text: {"url": url, "text": text + " word" * 50}
    row = {"id": "r", "docs": [page("https://www.example.com/basil?id=7", "the source")], "source_index": 0}
    again = [page(u, f"page {i}") for i, u in enumerate(["http://example.com/basil/?id=7&utm_source=x#top",
                                                         "https://example.com/basil?id=8", "https://other.org/basil"])]
    ja = {"url": "https://jp.example/k", "text": "バジルの保存方法" * 60}
    blob = {"url": "https://b.example/x", "text": "QUJD" * 200}         # one 800-character word: near-empty
    docs, _ = build_bench.candidates(row, again + [blob, ja], 4, 0)
    assert [d["url"] for d in docs if d is not row["docs"][0]] == [again[1]["url"], again[2]["url"], ja["url"]]
    assert build_bench.page("http://[x") == "http://[x" and build_bench.page("") == ""


def test_an_autogeo_folder_of_chunks_is_read_in_order(tmp_path):
    folder = tmp_path / "autogeo"
    folder.mkdir()
    for n in (10, 2, 1):
        (folder / f"datachunk_{n}.json").write_text(json.dumps(
            {f"id{n}": {"query": f"query {n}", "text_list": ["a", "b"], "target_id": 0}}))
    (folder / "README.md").write_text("not a chunk")
    assert [r["id"] for r in build_bench.read_rows(str(folder))] == ["id1", "id2", "id10"]


def test_a_json_file_with_a_byte_order_mark_is_read(tmp_path):
    p = tmp_path / "rows.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"query": "q", "docs": [{"text": "a"}]}]).encode())
    assert build_bench.read_rows(str(p))[0]["query"] == "q"


def test_a_malformed_corpus_is_a_line_error(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text(json.dumps({"query": "q", "url": "u", "text": "t"}) + "\n" + json.dumps({"url": "u", "text": "t"}))
    with pytest.raises(geodef.BenchFormatError, match="corpus.jsonl:2: query: expected a non-empty string"):
        offline_server.load_corpus(str(p))


def test_a_search_asks_at_most_tavilys_cap(geo_input, tmp_path):
    _, url, _ = geo_input
    sc = build_bench.SearchClient(endpoints.SearchSpec.parse(f"tavily:{url}"))
    sent = []
    sc.transport.post = lambda body: sent.append(body) or {"results": []}
    sc.search("q", 30)
    assert sent[0]["max_results"] == 20


@pytest.mark.parametrize("url", ["http://api.tavily.com", "https://api.tavily.com:8443", "http://api.tavily.com:443"])
def test_tavilys_key_goes_only_over_https_to_its_port(monkeypatch, url):
    """Tavily's host alone let TAVILY_API_KEY go in clear text (http://) or to another port: refused before
    any request, the URL named, never the key; https on 443, written or implied, takes it."""
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-SECRET-1")
    with pytest.raises(settings.SettingsError, match="goes only to https://api.tavily.com") as e:
        build_bench.SearchClient(endpoints.SearchSpec.parse(f"tavily:{url}"))
    assert url in str(e.value) and "tvly-SECRET-1" not in str(e.value)
    sc = build_bench.SearchClient(endpoints.SearchSpec.parse("tavily:https://api.tavily.com:443"))
    assert sc.transport._key == "tvly-SECRET-1" and sc.transport.base_url == "https://api.tavily.com"


def test_surface_rates_count_documents_with_each_marker():
    rates = geo_jobs.surface_rates(["# Title\n**bold** In summary, yes.", "plain text"])
    assert rates["heading"] == rates["bold"] == rates["summary phrase"] == 50.0 and rates["table"] == 0.0


def test_surface_markers_scan_an_attackers_page_in_linear_time():
    """A served page (POST /detect, rerank's return_detect) is an attacker's: runs of blank lines, indented
    blank lines or opening quote marks made each marker's search scan the rest of the page from every line
    (60,000 characters took ~30 s; a 2 MB body, hours)."""
    import time
    import detect
    for page in ("\n" * 60000, " \n" * 30000, "\u201c" * 60000, "|" + "\n|" * 30000):
        start = time.perf_counter()
        geo_jobs.surface_rates([page])
        detect.page_bag(page)
        assert time.perf_counter() - start < 2.0, repr(page[:4])


@pytest.fixture(scope="module")
def attacked_bench(geo_input, tmp_path_factory):
    """_short_rows_argv's build (--docs 5) with three attacked documents a test list and an optimised
    pool -> (its file, its folder)."""
    d = tmp_path_factory.mktemp("attacked")
    run.main(_short_rows_argv(geo_input, d) + ["--docs", "5", "--attacked", "3", "--pool", "optimized"])
    return d / "b.jsonl", d


def test_attacked_k_rewrites_further_candidates_and_the_optimized_pool_edits_the_rest(attacked_bench, short_rows,
                                                                                       geo_input, tmp_path):
    """Each test list: its source and 2 further candidates rewritten, each by a family drawn per group with
    the seed, each rewrite through the families' gate; every other candidate an honest edit through the
    honest gate; construction lines as the paper's; _meta says K and the pool; the dry run counts both."""
    path, _ = attacked_bench
    lines = [json.loads(x) for x in open(path, encoding="utf-8")]
    meta, groups = lines[0]["_meta"], lines[1:]
    assert (meta["attacked"], meta["pool"]) == (3, "optimized") and "attacked" not in json.loads(
        open(short_rows, encoding="utf-8").readline())["_meta"]              # the paper's build writes neither
    test = [g for g in groups if g["split"] == "test"]
    assert test and all("co_attacks" not in g and "optimized" not in g for g in groups if g["split"] != "test")
    picks = build_bench.co_attack_picks(test, ["GEO", "AutoGEO"], 3, 0)
    for g in test:
        co = g["co_attacks"]
        assert [(c["index"], c["method"]) for c in co] == picks[g["group_id"]]   # the seeded draw, in order
        assert all(c["text"] != g["docs"][c["index"]]["text"] and c["method"] in ("GEO", "AutoGEO") for c in co)
        assert sorted(map(int, g["optimized"])) == [i for i in range(5) if i != g["source_index"]]
    loaded = geodef.load_bench(str(path))
    assert geodef.attacked_levels(geodef.expand([g for g in loaded if g.split == "test"], ["GEO"])) == [1, 2, 3]
    plan = build_bench.dry_run(runs.Run(settings.BuildConfig(
        input=geo_input[0], output=str(tmp_path / "x.jsonl"), groups=6, construction_groups=2, llm="offline",
        attacks="GEO,AutoGEO", seen_methods="GEO", docs=5, attacked=3, pool="optimized")))
    n_test = plan["test"]
    assert (plan["stages"]["further attacks"]["groups"], plan["stages"]["pool honest edits"]["groups"]) == (
        2 * n_test, 4 * n_test)                        # K-1 rewrites and docs-1 edits a test list, priced


def test_rerank_eval_measures_every_level_and_certifies(attacked_bench):
    """rerank-eval on the K = 3 file: each level's records, the by-K block recomputed from them, and
    --certify's records and block (its figures recomputed from the certify records, the deletion seed
    drawn and kept in the run's cache); the dry run counts the smoothing's forward passes."""
    path, d = attacked_bench
    argv = ["rerank-eval", "--bench", str(path), "--model", "tiny", "--dtype", "float32", "--name", "rk",
            "--runs-dir", str(d / "r"), "--reranker", "base", "--k", "2", "--n-boot", "50", "--certify",
            "--certify-samples", "4", "--deletion-rate", "0.5"]
    plan = run.main(argv + ["--dry-run"])
    assert plan["rerankers"]["base"]["certify_forward_passes_at_most"] == 4 * plan["distinct_documents"]  # no honest
    stage = run.main(argv)["base"]
    report_md = (d / "r" / "rk" / "rerank_report.md").read_text()      # not evaluated: its own offline note
    assert "OFFLINE" in report_md and "tiny random-weight" in report_md
    assert html.escape(figures.OFFLINE_FIGURE) in (d / "r" / "rk" / "figures" / "rerank_exposure.svg").read_text()
    recs = [json.loads(x) for x in open(d / "r" / "rk" / "results" / "rerank-base.jsonl", encoding="utf-8")]
    for lv, block in stage["by_attacked"].items():
        rs = [r for r in recs if r.get("attacked", 1) == int(lv)]
        assert block["n"] == len(rs) and block["any_exposure"] == pytest.approx(
            100 * sum(r.get("any_exposed", r["exposed"]) for r in rs) / len(rs))
    one = [r for r in recs if r.get("attacked", 1) == 1]            # the headline: the paper's lists only
    assert stage["overall"]["n"] == len(one) < len(recs)
    assert stage["overall"]["exposure"] == pytest.approx(100 * sum(r["exposed"] for r in one) / len(one))
    for m, v in stage["strength"].items():             # each family's gain over its source, the paper's lists
        rs = [r for r in one if r["method"] == m]
        assert v["n"] == len(rs) and v["gain"] == pytest.approx(
            100 * sum(r["exposed"] - (r["clean_source_rank"] <= 2) for r in rs) / len(rs))
        assert v["holds_zero"] == (v["ci"][0] <= 0 <= v["ci"][1]) and v["raises"] == (v["ci"][0] > 0)
    n = len(recs[0]["ranking"])                              # a random top 2 of n candidates holds one of 3
    assert stage["by_attacked"]["3"]["chance_any_in_topk"] == pytest.approx(100 * (1 - math.comb(n - 3, 2) /
                                                                                  math.comb(n, 2)))
    k3 = [r for r in recs if r.get("attacked") == 3]
    assert k3 and all(r["attacks_in_topk"] == len({i for i in r["ranking"][:2] if "#" in i}) for r in k3)
    cert = [json.loads(x) for x in open(d / "r" / "rk" / "results" / "certify-base.jsonl", encoding="utf-8")]
    c = stage["certificate"]
    assert len(cert) == len(recs) and c["samples"] == 4 and all(len(r["smoothed"]) == 5 for r in cert)
    assert set(c["by_attacked"]) == {"2", "3"} and c["by_attacked"]["3"]["n"] == len(k3)
    cert = [r for r in cert if r.get("attacked", 1) == 1]      # the headline certificate: the paper's lists
    assert c["n"] == len(one) and c["exposure"] == stage["overall"]["exposure"]
    assert c["smoothed_exposure"] == pytest.approx(100 * sum(r["smoothed_exposed"] for r in cert) / len(cert))
    assert c["eps"] == pytest.approx(certify.epsilon(5, 4)) and c["forward_passes"] > 0
    lists = len(recs) + len({r["group_id"] for r in recs})          # every level's lists and the clean ones
    assert c["seconds_per_list"] == pytest.approx(c["seconds"] / lists) == c["by_attacked"]["3"]["seconds_per_list"]
    for kind in certify.KINDS:
        for r in certify.RADII:
            assert c["certified"][kind][str(r)] == pytest.approx(100 * sum(
                x["source_radius"][kind] is not None and x["source_radius"][kind] >= r for x in cert) / len(cert))
    assert c["rewrites_inside"] == pytest.approx(100 * sum(x["inside"] for x in cert) / len(cert))
    seed = json.load(open(d / "r" / "rk" / "cache" / "noise_seed.json"))["seed"]
    assert any(f"deleted-0.5-{seed}" in f for f in os.listdir(d / "r" / "rk" / "cache"))


def test_a_test_builder_apart_writes_the_test_split_and_is_a_role(geo_input, tmp_path):
    """--test-llm: the test split's rewrites (and honest edits) come from another builder than the
    construction split's: _meta names both, the usage ledger shows each split's requests under its
    builder (the offline engine's second builder quotes every paragraph: plumbing), and a target that is
    the test split's builder is refused by the roles check."""
    argv = _short_rows_argv(geo_input, tmp_path) + ["--docs", "5", "--test-llm", "offline:offline-engine-b",
                                                    "--honest"]
    run.main(argv)
    meta = json.loads(open(tmp_path / "b.jsonl", encoding="utf-8").readline())["_meta"]
    assert meta["builder_llm"] == "offline:offline-engine" and meta["test_builder_llm"] == "offline:offline-engine-b"
    assert meta["test_fidelity_judge"] == "offline:offline-engine-b"
    lines = [json.loads(x) for x in open(tmp_path / "b.jsonl", encoding="utf-8").read().splitlines()[1:]]
    quoted = lambda split: [t.startswith("> ") for g in lines if g["split"] == split for t in g["attacks"].values()]
    assert all(quoted("test")) and not any(quoted("construction"))       # the second builder's style (offline)
    models = [json.loads(x)["model"] for x in open(tmp_path / "r" / "b" / "usage.jsonl", encoding="utf-8")]
    assert models.count("offline:offline-engine") > 0 and models.count("offline:offline-engine-b") > 0
    bench = tmp_path / "roles.jsonl"
    lines = open(tmp_path / "b.jsonl", encoding="utf-8").read().splitlines()           # as written
    bench.write_text("\n".join([json.dumps({"_meta": {**meta, "test_builder_llm": "openai:gpt-5.5"}})] + lines[1:])
                     + "\n", encoding="utf-8")
    assert runs.shared_roles(str(bench), "openrouter:openai/gpt-5.5") == [
        "the target openrouter:openai/gpt-5.5 built the benchmark's test split"]


def test_a_pool_edit_that_copies_a_shown_text_leaves_its_candidate_as_it_was():
    """An honest edit of a pool candidate that copies another candidate, a further attack or another edit would
    make the file's own validation refuse the whole build after its paid rewrites (a list showing one text
    twice): that candidate stays as the search returned it; the other edits are kept."""
    group = {"docs": [{"text": f"page {i}"} for i in range(4)]}
    out = {"g": {"co_attacks": [{"index": 3, "text": "promoted page 3"}]}}
    edits = {"g@0": ("page  1", {}), "g@1": ("clearer page 1", {}), "g@2": ("clearer page 1", {}),
             "g@3": ("promoted page 3", {})}
    build_bench.add_optimized(out, {"g": group}, edits)
    assert out["g"]["optimized"] == {"1": "clearer page 1"}


def test_a_family_whose_own_candidates_the_judge_failed_on_is_not_rewritten():
    """MAGEO gates its own candidates: when the judge fails on every candidate of a group, MAGEO hands back no
    text, which the build read as a refusal and paid MAGEO's whole loop again (its retry, marked "attempt": 1).
    It is the judge's failure: the group's reason holds the judge's error, and MAGEO ran once for it."""
    import geo_attacks
    import geo_jobs
    import llm_clients
    import offline
    cut = {"choices": [{"message": {"content": '{"fidelity": 5, "contradicts_so'}, "finish_reason": "length"}]}
    judged = []

    def judge(body):         # the in-process engine as the judge, cut at the token cap on group g1's pages
        judged.append(body)
        return cut if " Page 1." in body["messages"][0]["content"] else offline.respond(body)
    sent = []

    def respond(body):
        sent.append(body["messages"][0]["content"])
        return offline.respond(body)
    builder = llm_clients.make_client("offline", handler=respond)
    ctx = geo_jobs.Ctx(builder, judge=llm_clients.make_client("offline", handler=judge))
    src = "Canberra became the capital of Australia in 1913, a compromise between Sydney and Melbourne."
    docs = [src] + [f"Other page {k} about Australian cities, with no figures at all." for k in range(9)]
    groups = [{"group_id": f"g{k}", "query": "why is canberra the capital", "source_index": 0,
               "docs": [{"text": src + f" Page {k}."}] + [{"text": d} for d in docs[1:]]} for k in range(8)]
    done, failed = build_bench.rewrite_family(ctx, geo_attacks.FAMILIES["MAGEO"](), groups)
    assert set(failed) == {"g1"} and len(done) == 7
    assert failed["g1"].startswith("MAGEO: fidelity judge failed after 2 attempts") and "raise --max-tokens" in \
        failed["g1"]
    mine = [p for p in sent if " Page 1." in p]
    assert mine and not any('"attempt": 1' in p for p in sent)      # no second attempt of MAGEO, for g1 or any
