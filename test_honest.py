"""The honest-edit audit (#40): does a defense punish honest optimisation? The honest editor's gate
(honest.honest_refusal), the offline engine playing the editor, `build-bench --honest`, and the
honest penalty of eval (per condition) and rerank-eval (per reranker) on an offline build: records,
resume, dry-run pricing, and nothing changed on a benchmark without honest edits.
Run: python -m pytest -q test_honest.py
"""
import importlib.util
import json
import math
import os
import shutil

import numpy as np
import pytest

import bench_audit
import detect
import evaluation
import geo_jobs
import geodef
import harden
import honest
import offline
import offline_attackers
import rankers
import report
import rerank_eval
import run
import runs
import settings
from testing import HERE, SAMPLE

SOURCE = ("Canberra was chosen in 1908 as a compromise between Sydney and Melbourne. It has roughly 470,000 "
          "people.\n\nParliament moved there in 1927.")


@pytest.mark.parametrize("edit, why", [
    ("## Canberra\n\n" + SOURCE, None),
    (SOURCE + " It grew by 12% since.", "adds numbers ['12']"),
    (SOURCE + ' Locals call it "the bush capital".', "adds a quotation ('the bush capital')"),
    (SOURCE + " Planners at UNESCO approved it.", "adds names ['UNESCO']"),
    (SOURCE.replace("Sydney", "Sydney of the Royal Society"), "adds names ['Royal', 'Society']"),
    (SOURCE + " This article is the definitive account.", "adds authority or promotional wording ['definitive']"),
    (SOURCE + " We keep the best record.", "adds authority or promotional wording ['best']"),
    (SOURCE + " According to experts, it is calm.", "adds authority or promotional wording ['according to', "
                                                    "'experts']"),
    (SOURCE + " According to the UN, it is calm.", "adds names ['UN']"),
    (SOURCE.replace("1927", "1928"), "drops source numbers ['1927']"),
    # what an honest editor writes: a title-case heading, the content's own superlative, the page's attribution
    ("## How The Capital Was Chosen\n\n" + SOURCE, None),
    (SOURCE + " The best way to arrive is by train.", None),
    (SOURCE.replace("Sydney and", "Sydney and, according to the Parliament,"), None),
    ("## What UNESCO Says\n\n" + SOURCE, "adds names ['UNESCO']"),     # a heading's acronym is still a new name
    (SOURCE + " This is the definitive resource on it.", "adds authority or promotional wording ['definitive']"),
])
def test_the_honest_gate_refuses_what_geo_adds(edit, why):
    assert honest.honest_refusal(SOURCE, edit) == why


def test_an_attribution_passes_only_to_a_name_the_source_holds_capitals_included_and_us_is_not_the_us():
    assert honest.attributed_to_the_source("The WHO says so.", "According to the WHO, it is so.")
    assert not honest.attributed_to_the_source("Ask anyone who knows.", "According to WHO, it is so.")
    assert not honest.attributed_to_the_source("The WHO says so.", "According to research, it is so.")
    us = SOURCE + " It lies far from the US."                              # "US", the country, is no "us"
    assert honest.honest_refusal(us, us + " The leading capitals in the US differ.") is None

def test_the_offline_honest_editor_passes_its_gate_on_every_sample_source():
    for line in open(SAMPLE, encoding="utf-8").read().splitlines()[1:]:
        g = json.loads(line)
        src = g["docs"][g["source_index"]]["text"]
        out = offline.family_step({"rewrite_task": "H1.edit", "document": src})["rewritten_document"]
        assert honest.honest_refusal(src, out) is None, g["group_id"]
        assert offline.judge_fidelity(src, out)["fidelity"] >= geo_jobs.FIDELITY_THRESHOLD


# ----------------------------------------------------------------------------- an offline build with --honest


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """make_sample's GEO-Bench-shaped rows and search corpus -> (rows path, corpus path)."""
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(HERE, "data", "make_sample.py"))
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    return ms.geo_bench(str(tmp_path_factory.mktemp("geo")))


def _build(rows, out, runs_dir, *extra, groups=16, construction=4):
    """build-bench over the rows with the offline engine and search: by default 16 groups of which 4
    construction. The honest audit measures the test split, so it keeps the 12 test groups of the bundled
    sample's recipe (24 groups, 12 construction); its construction groups train the Shield and TFSG and
    choose detect's thresholds, and 4 fill the demo's TFSG schedule (3 seed cases, 3 batches of 3) as they
    do for the demo run."""
    return run.main(["build-bench", "--input", rows[0], "--search", f"offline:{rows[1]}", "--output", str(out),
                     "--groups", str(groups), "--construction-groups", str(construction),
                     "--llm", "offline", "--fidelity-judge", "offline", "--model", "tiny", "--dtype", "float32",
                     "--synthetic", "--name", "hb", "--runs-dir", str(runs_dir), *extra])


@pytest.fixture(scope="module")
def honest_bench(rows, tmp_path_factory):
    d = tmp_path_factory.mktemp("hb")
    _build(rows, d / "honest.jsonl", d / "r", "--honest")
    return d


@pytest.fixture(scope="module")
def honest_run(honest_bench, tmp_path_factory):
    """The demo (train, eval, the reranker stage) on the honest build -> its run folder. The Shield trains
    2 epochs, not the tiny demo's 6: the audit's records and figures are computed the same way on whichever
    Shield the run trained (the report calls them plumbing), and two epochs take a third of the steps."""
    out = tmp_path_factory.mktemp("honest_demo")
    run.main(["demo", "--out", str(out), "--bench", str(honest_bench / "honest.jsonl"), "--n-seed-cases", "3",
              "--batch-size", "3", "--n-batches", "3", "--n-boot", "200", "--epochs", "2", "--max-length", "256"])
    return out / "demo"


def _lines(path):
    return [json.loads(x) for x in open(path, encoding="utf-8").read().splitlines()]


def test_build_bench_honest_gives_each_group_an_edit_with_its_trace(honest_bench):
    """Every group, construction ones too (detect chooses its thresholds on those), gets an honest edit."""
    lines = _lines(honest_bench / "honest.jsonl")
    meta = lines[0]["_meta"]
    assert meta["honest"] is True and meta["honest_digest"] == honest.HonestEdit().digest()
    assert meta["honest_edits"] == 16 and "honest edits" in meta["surface_markers"]     # 4 construction, 12 test
    assert meta["honest_edit_rate"] == 100.0 and meta["honest_refusals"] == {}
    assert {g["split"] for g in lines[1:]} == {"construction", "test"}
    for g in lines[1:]:
        assert g["honest_trace"]["gate"][-1] == "accepted"
        assert honest.honest_refusal(g["docs"][g["source_index"]]["text"], g["honest"]) is None


def test_build_bench_honest_changes_nothing_else(rows, honest_bench):
    lines = _lines(honest_bench / "honest.jsonl")
    _build(rows, honest_bench / "plain.jsonl", honest_bench / "r")            # the same build without --honest
    plain = _lines(honest_bench / "plain.jsonl")
    assert "honest" not in plain[0]["_meta"]
    assert [{k: v for k, v in g.items() if k not in ("honest", "honest_trace")} for g in lines[1:]] == plain[1:]


def test_a_refused_honest_edit_leaves_its_group_without_one(rows, tmp_path, monkeypatch):
    """Every attempt adds a number: refused twice, recorded in the trace, the group kept with its attacks.
    4 groups (one of them a construction group), each refused alike, so a few show it."""
    monkeypatch.setattr(offline_attackers, "_honest",
                        lambda inp: {"rewritten_document": inp["document"] + "\n\nUpdated 2031."})
    _build(rows, tmp_path / "b.jsonl", tmp_path / "r", "--honest", groups=4, construction=1)
    groups, meta = geodef.load_bench(str(tmp_path / "b.jsonl"), with_meta=True)
    assert len(groups) == 4 and all(g.honest is None for g in groups) and meta.raw["honest_edits"] == 0
    assert meta.raw["honest_edit_rate"] == 0.0 and meta.raw["honest_refusals"] == {"adds numbers": 8}   # 4 x 2
    trace = next(g for g in _lines(tmp_path / "b.jsonl")[1:] if g["split"] == "test")["honest_trace"]
    assert trace["attempts"] == 2 and "adds numbers ['2031']" in trace["refused"]


def test_the_report_names_the_honest_editors_refusals():
    s = {"honest": {"groups": 3, "test_groups": 4, "conditions": {}, "refusals": {"adds names": 2, "fidelity": 1}}}
    text = "".join(report.honest_lines(s, "eval"))
    assert "3 of 4 test groups have an honest edit" in text
    assert "refused attempts, by reason (build-bench's gate): adds names 2, fidelity 1." in text
    # the Shield's penalty beside the base's: two rates over different groups, said so (no CI for it)
    s["honest"]["conditions"] = {"Shield only": {"honest_penalty": 12.5}, "Non-Defense": {"honest_penalty": 10.0}}
    text = "".join(report.honest_lines(s, "eval"))
    assert "Here Shield only's honest penalty is +2.50 points from Non-Defense's (a difference of two rates" in text
    assert "not a paired gap: no CI" in text


def test_a_build_dry_run_prices_the_honest_edits(rows, tmp_path):
    plan = _build(rows, tmp_path / "dry.jsonl", tmp_path / "r", "--honest", "--dry-run")
    assert plan["stages"]["honest edit"]["groups"] == 16 and plan["stages"]["honest edit"]["requests"] == 64
    assert "honest edit" not in _build(rows, tmp_path / "dry.jsonl", tmp_path / "r", "--dry-run")["stages"]


def _honest_groups(run_dir):
    cfg = json.load(open(run_dir / "config.json"))["config"]
    return [g for g in geodef.load_bench(cfg["bench"]) if g.split == "test"]


def test_eval_answers_each_condition_on_the_clean_and_honest_lists(honest_run):
    s = json.load(open(honest_run / "summary.json"))
    test = _honest_groups(honest_run)
    assert s["honest"]["groups"] == s["honest"]["test_groups"] == len(test) == 12
    for c in s["conditions"]:
        recs = _lines(honest_run / "results" / f"{c.lower().replace(' ', '_').replace('-', '_')}.honest.jsonl")
        assert sorted(r["instance_id"] for r in recs) == sorted(f"{g.group_id}:{w}" for g in test
                                                                for w in ("clean", "honest")), c
        assert all("asi" not in r for r in recs) and {r["condition"] for r in recs} == {c}


def test_eval_honest_penalty_is_the_share_of_cited_sources_whose_edit_loses_its_citation(honest_run, capsys):
    s = json.load(open(honest_run / "summary.json"))
    test = {g.group_id: g for g in _honest_groups(honest_run)}
    for c, slug in (("Non-Defense", "non_defense"), ("Shield only", "shield_only"), ("RobustRAG", "robustrag")):
        by = {r["instance_id"]: r for r in _lines(honest_run / "results" / f"{slug}.honest.jsonl")}
        src = {gid: g.docs[g.source_index]["doc_id"] for gid, g in test.items()}
        cited = [gid for gid in test if src[gid] in by[f"{gid}:clean"]["cited_ids"]]
        lost = [src[gid] + "#honest" not in by[f"{gid}:honest"]["cited_ids"] for gid in cited]
        attacks = [r for r in _lines(honest_run / "results" / f"{slug}.jsonl") if r["group_id"] in cited]
        b = s["honest"]["conditions"][c]
        assert b["source_cited"] == len(cited) > 0 and b["n_attack"] == len(attacks) == 7 * len(cited)
        assert b["honest_penalty"] == (pytest.approx(100 * sum(lost) / len(lost)) if lost else None)
        assert b["attack_loss"] == pytest.approx(100 * sum(not r["attack_cited"] for r in attacks) / len(attacks))
    run.print_summary(s)
    table = capsys.readouterr().out.splitlines()
    assert next(line for line in table if line.startswith("condition")).endswith("honest penalty")
    row = next(line for line in table if line.startswith("Shield only"))
    h = s["honest"]["conditions"]["Shield only"]["honest_penalty"]
    assert row.split()[-1] == ("-" if h is None else f"{h:.2f}")
    rep = (honest_run / "report.md").read_text()
    assert "Honest penalty (%)" in rep and "Attack citation lost (%)" in rep
    assert "within 5 points of the base reranker's" in rep and "these honest figures are plumbing" in rep


def test_the_reranker_stage_reports_the_honest_penalty_beside_the_attacks_demotion(honest_run):
    s = json.load(open(honest_run / "summary.json"))
    k = s["rerank_stage_k"]
    for label in ("base", "shield"):
        hrecs = _lines(honest_run / "results" / f"rerank-{label}.honest.jsonl")
        recs = _lines(honest_run / "results" / f"rerank-{label}.jsonl")
        assert {r["method"] for r in hrecs} == {"honest"} and "honest" not in {r["method"] for r in recs}
        kept = [r for r in hrecs if r["clean_source_rank"] <= k]
        att = [r for r in recs if r["clean_source_rank"] <= k]
        h = s["rerank_stage"][label]["honest"]
        assert h["source_in_topk"] == len(kept) > 0 and h["n_attack"] == len(att)
        assert h["honest_penalty"] == pytest.approx(100 * sum(r["attack_rank"] > k for r in kept) / len(kept))
        assert h["attack_demotion"] == pytest.approx(100 * sum(r["attack_rank"] > k for r in att) / len(att))
    assert "honest penalty" in rerank_eval.stage_table(s["rerank_stage"], k).splitlines()[0]
    assert "Attack demoted (%)" in (honest_run / "rerank_report.md").read_text()


def test_honest_records_resume_and_a_finished_eval_sends_nothing(honest_run, tmp_path):
    """A cut honest file and a missing one are remade to the same bytes, every reply from the cache."""
    shutil.copytree(honest_run.parent, tmp_path / "o")
    res = tmp_path / "o" / "demo" / "results"
    old = {p.name: p.read_bytes() for p in res.glob("*.honest.jsonl")}
    cut = old["non_defense.honest.jsonl"]
    (res / "non_defense.honest.jsonl").write_bytes(cut[:cut.index(b"\n", len(cut) // 2) + 40])   # killed mid-record
    os.remove(res / "shield_only.honest.jsonl")
    ledger = (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes()
    run.main(["eval", "--runs-dir", str(tmp_path / "o"), "--name", "demo"])
    assert {p.name: p.read_bytes() for p in res.glob("*.honest.jsonl")} == old
    assert (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes() == ledger


def test_the_eval_dry_run_prices_the_honest_audit(honest_run, tmp_path):
    shutil.copytree(honest_run.parent, tmp_path / "o")
    for p in (tmp_path / "o" / "demo" / "results").glob("*.honest.jsonl"):
        os.remove(p)
    plan = run.main(["eval", "--dry-run", "--runs-dir", str(tmp_path / "o"), "--name", "demo"])
    n_conds = len(json.load(open(honest_run / "summary.json"))["conditions"])
    assert plan["honest_audit"]["records_to_make"] == 2 * 12 * n_conds
    assert plan["stages"]["honest audit answers"]["requests"] == 2 * 12 * n_conds
    assert plan["stages"]["honest audit PromptArmor remover"]["requests"] == 2 * 12 * 5


def test_without_honest_edits_eval_and_the_reranker_stage_are_as_before(demo_run):
    s = json.load(open(demo_run / "summary.json"))
    assert "honest" not in s and not any("honest" in v for v in s["rerank_stage"].values())
    assert not list((demo_run / "results").glob("*.honest.jsonl"))
    assert "Honest penalty" not in (demo_run / "report.md").read_text()
    assert "honest" not in rerank_eval.stage_table(s["rerank_stage"], 5)


# ----------------------------------------------------------------------------- detect


def test_detect_scores_every_test_page_with_thresholds_held_out(honest_run, tmp_path):
    """detect on the honest build: both detectors score every test page; the residual's threshold is the
    split conformal order statistic of the honest edits of the Shield's monitoring groups (recomputed from the
    run's score caches), the test FPR is the share of test honest edits above it, and a family's AUC and TPR are those
    of its records against every test honest edit."""
    shutil.copytree(honest_run.parent, tmp_path / "o")
    d = tmp_path / "o" / "demo"
    out = run.main(["detect", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--n-boot", "50", "--fpr", "0.1"])
    recs = _lines(d / "detect" / "records.jsonl")
    test = _honest_groups(d)
    assert len(recs) == sum(2 + len(g.attacks) for g in test)                 # source, honest edit, rewrites
    cfg = json.load(open(d / "config.json"))["config"]
    groups = geodef.load_bench(cfg["bench"])
    cons = [g for g in groups if g.split == "construction"]
    cache = lambda name: json.load(open(d / "cache" / name))
    base = cache("scores_base.json")
    shield = cache(next(f for f in os.listdir(d / "cache") if f.startswith("scores_shield_")))
    key = lambda g, t: rankers.doc_key(g.query, t)
    seen = geodef.load_bench(cfg["bench"], with_meta=True)[1].seen_methods      # the build's seen families
    _, mon = geodef.monitoring_split(geodef.expand(cons, seen), cfg["monitor_frac"], cfg["seed"])
    monitored = {x.group_id for x in mon}
    calib = [base[key(g, g.honest)] - shield[key(g, g.honest)] for g in cons if g.group_id in monitored]
    assert calib and len(calib) < len(cons)                  # the groups the Shield never trained on
    b = out["detectors"]["shield_residual"]
    k = min(math.ceil(0.9 * (len(calib) + 1)), len(calib))
    assert b["threshold"] == pytest.approx(sorted(calib)[k - 1]) and b["n_calib"] == len(calib)
    # the text detector is calibrated on out-of-fold fits and scores new pages with the fit on all: no bound
    assert out["detectors"]["text"]["fpr_bound"] is None and b["fpr_bound"] == round(1 - k / (len(calib) + 1), 4)
    hon = [r for r in recs if r["kind"] == "honest"]
    for name, block in out["detectors"].items():
        assert block["held_out_fpr_honest"] == pytest.approx(100 * sum(r["scores"][name] > block["threshold"]
                                                                       for r in hon) / len(hon), abs=0.01)
        for fam, v in block["families"].items():
            pos = [r["scores"][name] for r in recs if r["family"] == fam]
            assert v["seen"] == (fam in out["seen"]) and v["n"] == len(pos)
            assert v["auc_honest"] == pytest.approx(bench_audit.auc(pos, [r["scores"][name] for r in hon]), abs=1e-4)
    served = detect.Served.load(run.detector_file(str(d)))          # what serve answers /detect with
    det, threshold = served.detector, served.threshold
    r = hon[0]
    g = next(g for g in test if g.group_id == r["group_id"])
    assert threshold == out["detectors"]["text"]["threshold"]
    assert det.score(g.honest) == pytest.approx(r["scores"]["text"])
    r = runs.Run(runs.resolve(settings.DetectConfig, {"runs_dir": str(tmp_path / "o"), "name": "demo"}))
    docs = geodef.expand(r.data.test, r.data.methods)        # what attack measures on its final documents
    geo = [x for x in recs if x["kind"] == "geo"]
    share = lambda name: pytest.approx(100 * sum(x["flagged"][name] for x in geo) / len(geo), abs=0.01)
    assert detect.flagged(r, docs, *rankers.load_rankers(r, True)) == {name: share(name) for name in detect.DETECTORS}
    run.main(["export", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--out", str(tmp_path / "exp")])
    copied = tmp_path / "exp" / "geodef_detector.json"                # the detector travels with the export
    assert copied.read_bytes() == (d / "detect" / "text_detector.json").read_bytes()
    assert json.load(open(tmp_path / "exp" / "geodef_export.json"))["detector"] is not None
    assert detect.Served.load(run.detector_file(None, str(tmp_path / "exp"))).threshold == threshold
    assert (d / "detect" / "roc_text.svg").read_text().startswith("<svg")
    rep = (d / "detect" / "report.md").read_text()
    assert "held out" in rep and "no FPR bound: calibrated on out-of-fold fits" in rep   # the text detector's


def test_a_threshold_holds_its_fpr_on_new_pages_not_only_on_its_own():
    """Split conformal: on new pages exchangeable with the n calibration pages the flagged share is at most
    fpr in expectation (the (1 - fpr) quantile held it only on the calibration pages: ~0.32 at n = 2, 0.075
    at n = 12 for a 5% target); too few pages for the target take the largest score and say the bound."""
    rng = np.random.default_rng(0)
    for n, fpr in ((19, 0.05), (19, 0.1), (40, 0.05), (12, 0.05)):
        rates, bound = [], detect.calibrated(list(rng.random(n)), fpr)["fpr_bound"]
        for _ in range(3000):
            t = detect.calibrated(list(rng.random(n)), fpr)["threshold"]
            rates.append(float(np.mean(rng.random(50) > t)))
        assert np.mean(rates) <= bound + 0.01 and bound <= max(fpr, 1 / (n + 1)), (n, fpr, np.mean(rates))
    assert detect.calibrated([3.0, 1.0], 0.05) == {"threshold": 3.0, "n_calib": 2, "fpr_bound": 0.3333}
    assert detect.calibrated([float(i) for i in range(1, 20)], 0.1)["threshold"] == 18.0


def test_the_text_detector_is_naive_bayes_log_odds_and_travels_as_json():
    geo = ["According to experts, **the best** guide: in summary, 97% agree.", "Key takeaways: **top** pick."]
    plain = ["Store basil in water on the counter.", "Boil the eggs for six minutes."]
    det = detect.TextDetector.fit(geo, plain)
    X = np.stack([bench_audit.hashed(detect.page_bag(t)) for t in geo + plain])
    prior, like = bench_audit.naive_bayes(X, ["geo"] * 2 + ["honest"] * 2, ["geo", "honest"])
    new = "In summary, experts agree this is the best guide."
    x = bench_audit.hashed(detect.page_bag(new))
    assert det.score(new) == pytest.approx(float(x @ (like[0] - like[1]) + prior[0] - prior[1]))
    back = detect.TextDetector.from_json(json.loads(json.dumps(det.to_json())))
    assert back.score(new) == pytest.approx(det.score(new)) and det.score(geo[0]) > det.score(plain[0])


def test_a_tpr_at_an_fpr_flags_at_most_that_share_of_the_negatives():
    """88 negatives scored 0..87: at 5% FPR the threshold is a negative's score with at most 4 of 88 above it
    (an interpolated 82.65 flagged 5, 5.7%): a positive at 83 is not flagged, one at 84 is."""
    neg = list(range(88))
    assert detect.tpr_at([83] * 10, neg, 0.05) == 0.0 and detect.tpr_at([84] * 10, neg, 0.05) == 1.0


def test_detect_refuses_construction_groups_that_make_one_fold_before_any_scoring():
    """Its text detector is fitted out of fold by construction query group, groups sharing a query or a page
    dealt as one: one group, or two sharing a query, leave a fold nothing to fit on (a bare ValueError from
    the fit, after the rankers had scored every page)."""
    from types import SimpleNamespace
    g = lambda gid, q: geodef.QueryGroup(gid, q, [{"doc_id": f"{gid}-0", "text": f"page {gid}"}], 0,
                                         {"A": f"rewrite {gid}"}, "construction")
    for cons in ([g("g1", "q1")], [g("g1", "same q"), g("g2", "same q")]):
        run_ = SimpleNamespace(data=SimpleNamespace(construction=cons), cfg=SimpleNamespace(data=SimpleNamespace(
            bench="b.jsonl")))
        with pytest.raises(settings.SettingsError, match="at least 2 such groups; these make 1"):
            detect.check(run_)


def test_detect_refuses_a_build_without_honest_edits(demo_run):
    with pytest.raises(SystemExit, match="build-bench --honest"):
        run.main(["detect", "--runs-dir", str(demo_run.parent), "--name", "demo"])


def test_holdouts_detection_side_never_fits_on_the_held_out_family(honest_bench, monkeypatch):
    """holdout's detection column: the fold's text detector is fitted on the construction rewrites of its
    trained families only, and its AUC is that detector's on F's test rewrites against the test honest edits."""
    groups = geodef.load_bench(str(honest_bench / "honest.jsonl"))
    data = runs.BenchData(groups, geodef.load_bench(str(honest_bench / "honest.jsonl"), with_meta=True)[1],
                          [g for g in groups if g.split == "construction"], [g for g in groups if g.split == "test"],
                          ["AutoGEO", "MAGEO"], None)
    fitted, real = [], detect.TextDetector.fit.__func__
    monkeypatch.setattr(detect.TextDetector, "fit", classmethod(lambda cls, geo, hon: fitted.append(geo) or
                                                                real(cls, geo, hon)))
    out = detect.fold_detection(data, ["AutoGEO", "MAGEO"], "AgenticGEO", 0.05, 50, 0)
    held = {g.attacks["AgenticGEO"] for g in groups if "AgenticGEO" in g.attacks}
    assert fitted and not any(t in held for geo in fitted for t in geo)
    det = real(detect.TextDetector, fitted[0], [t for g in data.construction for t in
                                                 (g.docs[g.source_index]["text"], g.honest) if t is not None])
    pos = [det.score(g.attacks["AgenticGEO"]) for g in data.test]
    neg = [det.score(g.honest) for g in data.test if g.honest is not None]
    assert out["auc_honest"] == pytest.approx(bench_audit.auc(pos, neg), abs=1e-4)


def test_harden_measures_the_detectors_on_a_rounds_attacker_and_honest_edits(honest_run, tmp_path):
    """After detect, a hardening round's measure carries the run's detectors: % of the fresh attacker's
    final documents flagged per budget, and the FPR on the test honest edits with the round's Shield, which
    in round 0 (the run's own Shield) is detect's own on the same groups; the report's table shows them."""
    shutil.copytree(honest_run.parent, tmp_path / "o")
    d = tmp_path / "o" / "demo"
    run.main(["detect", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--n-boot", "50"])
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(tmp_path / "o"), "name": "demo", "budget": 3,
                                               "eval_budgets": "1,2", "eval_groups": 2})
    with runs.Run.open(cfg, "harden", llms=True, engine=True) as r:              # round 0 alone: no retraining
        _, clean = harden.clean_references(r, r.llm(stage="harden-r0"))
        r0 = harden.measure(r, 0, harden.round_clients(r, 0), clean)["detected"]
    assert set(r0["fresh"]) == {"1", "2"} and all(set(v) == set(detect.DETECTORS) for v in r0["fresh"].values())
    eval_groups = {g.group_id for g in _honest_groups(d)[:2]}
    hon = [r for r in _lines(d / "detect" / "records.jsonl") if r["kind"] == "honest" and r["group_id"] in eval_groups]
    assert r0["fpr_honest"] == {name: pytest.approx(100 * sum(r["flagged"][name] for r in hon) / len(hon), abs=0.01)
                                for name in detect.DETECTORS}
    text = "".join(report.harden_detector_lines([{"round": 0, "detected": r0}]))
    assert "FPR honest" in text and "r0" in text
    # detect run again at another FPR: the round's kept figures are flagged again at the new thresholds, not
    # shown beside later rounds' as one detector
    run.main(["detect", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--n-boot", "50", "--fpr", "0.9"])
    with runs.Run.open(cfg, "harden", llms=True, engine=True) as r:
        again = harden.measure(r, 0, harden.round_clients(r, 0), clean)["detected"]
    now = json.load(open(d / "detect" / "summary.json"))["detectors"]
    assert again["thresholds"] == {name: now[name]["threshold"] for name in detect.DETECTORS} != r0["thresholds"]
    hon = [r for r in _lines(d / "detect" / "records.jsonl") if r["kind"] == "honest" and r["group_id"] in eval_groups]
    assert again["fpr_honest"] == {name: pytest.approx(100 * sum(r["flagged"][name] for r in hon) / len(hon),
                                                       abs=0.01) for name in detect.DETECTORS}


def test_a_detector_file_that_is_not_as_detect_writes_it_is_refused_by_name(tmp_path):
    """serve loads the run's (or an export's) detector file: one cut short, without a field, with a threshold
    of text (every /detect a 500) or NaN (nothing flagged), or hashed into other buckets, is an error naming
    the file and field before the model loads, not a traceback or a detector that never flags."""
    det = detect.TextDetector({3: 0.5}, -0.1, 0.2)
    good = {**det.to_json(), "threshold": 1.0}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(good))
    assert detect.Served.load(str(path)).flags(["a page"])[0]["flagged"] in (True, False)
    for change, says in (({"threshold": "1"}, "threshold"), ({"threshold": float("nan")}, "threshold"),
                         ({"bias": None}, "bias"), ({"weights": {"3": "x"}}, "weights"),
                         ({"buckets": good["buckets"] * 2}, "buckets"), ({"weights": {"\u00b2": 0.5}}, "weights"),
                         ({"weights": {"\u0663": 0.5}}, "weights"), ({"weights": {"99999999": 0.5}}, "weights")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(detect.SettingsError, match=f"d.json: {says}"):
            detect.Served.load(str(path))
    path.write_text(json.dumps(good)[:20])
    with pytest.raises(ValueError, match="d.json: not JSON"):
        detect.Served.load(str(path))


def test_attack_and_harden_read_the_runs_detector_files_checked(tmp_path):
    """A run's detect/text_detector.json without its threshold (an older or hand-edited file) was read bare at the
    end of an attack, after its paid calls (a KeyError): attack and harden check it first (detect.thresholds)."""
    from types import SimpleNamespace as NS
    r = NS(path=lambda *p: str(tmp_path.joinpath(*p)))
    assert detect.thresholds(r) is None                                 # no detect: nothing to read
    (tmp_path / "detect").mkdir()
    summary = {"detectors": {"shield_residual": {"threshold": 0.5}}}
    (tmp_path / "detect" / "summary.json").write_text(json.dumps(summary))
    det = detect.TextDetector({3: 0.5}, -0.1, 0.2)
    (tmp_path / "detect" / "text_detector.json").write_text(json.dumps(det.to_json()))
    with pytest.raises(detect.SettingsError, match="text_detector.json: threshold"):
        detect.thresholds(r)
    (tmp_path / "detect" / "text_detector.json").write_text(json.dumps({**det.to_json(), "threshold": 1.0}))
    assert detect.thresholds(r) == {"text": 1.0, "shield_residual": 0.5}


def test_the_roc_point_at_fpr_100_flags_every_document():
    recs = [{"kind": "honest", "scores": {"text": s}} for s in (0.0, 1.0, 2.0)]
    recs += [{"kind": "geo", "scores": {"text": s}} for s in (0.0, 3.0)]
    pts = dict(zip(detect.ROC_FPRS, detect.roc_points(recs, "text", lambda r: True)))
    assert pts[1.0] == 100.0 and pts[0.0] == 50.0


def test_an_answer_that_never_came_is_no_lost_citation():
    """The honest penalty reads a citation not given as the defense's doing: a group whose honest (or clean)
    answer failed is left out, as is an attack instance whose answer failed, and counted."""
    groups = [geodef.QueryGroup(f"g{i}", "q", [{"text": "a", "doc_id": f"g{i}-0"}, {"text": "b", "doc_id": f"g{i}-1"}],
                                0, {}) for i in range(3)]
    rec = lambda gid, side, cited, failed=False: {"instance_id": f"{gid}:{side}", "cited_ids": cited,
                                                  **({"answer_failed": {"why": "x"}} if failed else {})}
    recs = [rec(f"g{i}", "clean", [f"g{i}-0"]) for i in range(3)]
    recs += [rec("g0", "honest", ["g0-0#honest"]), rec("g1", "honest", ["g1-0#honest"]),
             rec("g2", "honest", [], True)]
    attacks = [{"group_id": "g0", "attack_cited": False},
               {"group_id": "g1", "attack_cited": False, "answer_failed": {}}]
    out = evaluation.honest_penalty(recs, attacks, groups, n_boot=50)
    assert out["source_cited"] == 2 and out["honest_penalty"] == 0.0 and out["answer_failed"] == 2
    assert out["n_attack"] == 1 and out["attack_loss"] == 100.0
