"""Leave-one-family-out (holdout.py) on the bundled sample: a Shield trained without each held-out family
(and one with every family), each scored on the test split; the table recomputed from the folds' own
records; resume, pinning, the dry run and the refusals. The tiny random model: plumbing, not results."""
import itertools
import json

import numpy as np
import pytest

import holdout
import run
import train
from testing import SAMPLE


def argv(out, *extra, families="AutoGEO,MAGEO"):
    """holdout's command line; families: leave-one-out's --families (None: the seen-size regime's, which draws
    its own folds)."""
    return ["holdout", "--runs-dir", str(out), "--name", "h", "--preset", "tiny-demo", "--epochs", "1",
            *(["--families", families] if families else []), "--max-test-groups", "4", "--n-boot", "200",
            "--max-length", "256", *extra]


# the LLM stage on a TFSG schedule the folds' fewer construction instances fill
LLM_STAGE = ["--llm-stage", "--n-seed-cases", "2", "--batch-size", "3", "--n-batches", "1"]


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """holdout of AutoGEO on the bundled sample, its LLM stage too -> (run folder, summary, {fold: methods it
    trained on})."""
    out = tmp_path_factory.mktemp("holdout")
    trained, real = {}, train.prepare_triples

    def spy(fold, rr, cons, inst):            # the real preparation; the fold's training methods noted
        trained[fold.cfg.folder.name] = sorted({x.method for x in inst})
        return real(fold, rr, cons, inst)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "prepare_triples", spy)
        s = run.main(argv(out, *LLM_STAGE))
    return out / "h", s, trained


def records(run_dir, fold, label="shield"):
    path = run_dir / "holdout" / fold / "results" / f"rerank-{label}.jsonl"
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def mean(xs):
    return sum(xs) / len(xs)


def test_each_fold_trains_without_its_family_and_the_table_is_its_records(held):
    run_dir, s, trained = held
    assert trained == {"without-AutoGEO": ["AgenticGEO", "MAGEO"], "without-MAGEO": ["AgenticGEO", "AutoGEO"],
                       "all": ["AgenticGEO", "AutoGEO", "MAGEO"]}
    assert json.load(open(run_dir / "holdout" / "without-AutoGEO" / "config.json"))["config"]["seen_methods"] == \
        "AgenticGEO,MAGEO"
    row = s["folds"][0]
    wo, ref, base = records(run_dir, "without-AutoGEO"), records(run_dir, "all"), records(run_dir, "all", "base")
    matched = records(run_dir, "without-MAGEO")             # saw AutoGEO, on as many families as without-AutoGEO
    held_out = [r for r in wo if r["method"] == "AutoGEO"]
    assert len(held_out) == 4 and row["held_out"]["instances"] == 4
    assert row["held_out"]["shield_exposure"] == pytest.approx(100 * mean([r["exposed"] for r in held_out]))
    assert row["held_out"]["base_exposure"] == pytest.approx(
        100 * mean([r["exposed"] for r in base if r["method"] == "AutoGEO"]))
    assert row["all_exposure"] == pytest.approx(100 * mean([r["exposed"] for r in ref if r["method"] == "AutoGEO"]))
    assert row["seen_exposure"] == pytest.approx(
        100 * mean([r["exposed"] for r in matched if r["method"] == "AutoGEO"]))
    # gap vs seen: paired by group, the fold's Shield minus the size-matched one (without MAGEO), never "all"
    per = lambda rs: {r["group_id"]: 100 * r["exposed"] for r in rs if r["method"] == "AutoGEO"}
    a, b = per(wo), per(matched)
    assert row["gap_vs_seen"]["gap"] == pytest.approx(mean([a[g] - b[g] for g in a]))
    lo, hi = row["gap_vs_seen"]["gap_ci"]
    assert lo <= row["gap_vs_seen"]["gap"] <= hi and row["gap_vs_seen"]["groups"] == 4
    # the two Shields were trained on different data: their adapters differ
    adapters = [open(run_dir / "holdout" / f / "adapter" / "adapter_model.safetensors", "rb").read()
                for f in ("without-AutoGEO", "all")]
    assert adapters[0] != adapters[1]
    assert set(s["never_trained"]) == {"GEO", "GEO-SFE", "IF-GEO", "RAID-GSEO"}
    st = row["strength"]                  # AutoGEO's gain over its source on the base reranker, flagged if it holds 0
    held_base = [r for r in base if r["method"] == "AutoGEO"]
    assert st["gain"] == pytest.approx(mean([100 * (r["exposed"] - (r["clean_source_rank"] <= 5)) for r in held_base]))
    assert holdout.cells(row)[0] == "AutoGEO" + " *" * (not st["raises"]) and st["raises"] == (st["ci"][0] > 0)
    md = (run_dir / "holdout" / "report.md").read_text()
    assert "OFFLINE / SIMULATION RUN" in md and "| AutoGEO |" in md and "figures/holdout.svg" in md
    assert "plumbing figures" in (run_dir / "holdout" / "figures" / "holdout.svg").read_text()


def test_a_rerun_resumes_to_the_same_files(held, monkeypatch):
    run_dir, s, _ = held
    files = [run_dir / "holdout" / n for n in ("summary.json", "report.md", "figures/holdout.svg")]
    before = [f.read_bytes() for f in files]
    monkeypatch.setattr(train, "prepare_triples", lambda *a: pytest.fail("a finished fold trained again"))
    assert run.main(argv(run_dir.parent, *LLM_STAGE)) == s
    assert [f.read_bytes() for f in files] == before


def test_a_rerun_with_a_changed_setting_is_refused(held, monkeypatch):
    run_dir, _, _ = held
    monkeypatch.setattr(train, "prepare_triples", lambda *a: pytest.fail("a finished fold trained again"))
    with pytest.raises(SystemExit, match=r"config.json: this run was made with different lr .*Use a new --name"):
        run.main(argv(run_dir.parent, *LLM_STAGE, "--lr", "0.5"))


def test_every_folds_eval_settings_are_checked_before_any_fold_trains(held, monkeypatch):
    """--llm-stage at another --max-tokens with another family: the shared 'all' fold's eval records refuse it
    before the new fold is trained and evaluated (it was refused at 'all', the last fold, after that paid work)."""
    run_dir, _, _ = held
    monkeypatch.setattr(train, "prepare_triples", lambda *a: pytest.fail("a fold trained before the refusal"))
    with pytest.raises(SystemExit, match=r"holdout/all/results: its records were made with different max_tokens"):
        run.main(argv(run_dir.parent, *LLM_STAGE, "--max-tokens", "1000", families="AgenticGEO"))
    assert not (run_dir / "holdout" / "without-AgenticGEO").exists()


def test_the_answers_that_never_came_are_counted_per_fold(held, tmp_path):
    """A failed answer cites nothing, read as a blocked attack in the ASR: each fold's count is in the summary
    and the report, as eval's reports count them."""
    import copy
    run_dir, s, _ = held
    assert "answers_failed" not in s and "never came" not in (run_dir / "holdout" / "report.md").read_text()
    recs = {"GEO Defender": [{"answer_failed": {"attempts": 2}}, {}], "Shield only": [{}], "shield": [{}]}
    assert holdout.failed_answers(recs) == {"GEO Defender": 1}
    holdout.write_report(str(tmp_path), {**copy.deepcopy(s), "answers_failed": {"all": {"GEO Defender": 1}}})
    assert ("Answers that never came (cite nothing: counted as not citing the attack in the ASR): all GEO Defender "
            "1.") in (tmp_path / "report.md").read_text()


def test_a_seen_size_past_the_families_is_refused_as_a_sentence(tmp_path):
    with pytest.raises(SystemExit, match=r"--seen-size 9{20}: .* construction groups hold 3 families"):
        run.main(argv(tmp_path, "--seen-size", "9" * 20, "--dry-run", families=None))


def test_a_holdout_dry_run_writes_nothing(tmp_path):
    plan = run.main(argv(tmp_path, "--dry-run", "--families", "all"))
    assert list(plan["folds"]) == ["without-AgenticGEO", "without-AutoGEO", "without-MAGEO", "all"]
    assert plan["folds"]["without-MAGEO"]["trained_on"] == ["AgenticGEO", "AutoGEO"] and plan["llm_requests"] == 0
    assert not (tmp_path / "h").exists()


def test_leave_one_out_folds_train_on_as_many_instances(tmp_path):
    """A family whose rewrite failed on a construction group leaves its fold one instance more than the others:
    that fold keeps the smallest fold's count (its name says so), so each held-out family's gap vs seen
    compares Shields trained on as much data; the reference fold keeps every instance."""
    rows = [json.loads(x) for x in open(SAMPLE, encoding="utf-8")]
    first = next(r for r in rows[1:] if r["split"] == "construction")
    del first["attacks"]["AutoGEO"]
    first["failed"] = {"AutoGEO": "the build's fidelity gate refused every rewrite"}
    bench = tmp_path / "b.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    plan = run.main(argv(tmp_path, "--dry-run", "--families", "all", "--bench", str(bench)))["folds"]
    n = plan["without-AgenticGEO"]["instances"]
    assert list(plan) == ["without-AgenticGEO", f"without-AutoGEO-n{n}", "without-MAGEO", "all"]
    assert {p["instances"] for name, p in plan.items() if name != "all"} == {n}
    assert plan["all"]["instances"] == 3 * (n + 1) // 2 - 1          # C groups x 3 families, one rewrite failed


def test_a_family_whose_every_construction_rewrite_failed_is_neither_held_out_nor_seen(tmp_path):
    """A family the build's gate refused on every construction group trains no fold: counted as seen, the other
    folds read as having seen it and its own 'held out' fold compared two Shields that never saw it. It is left
    out of the construction families; and in the seen-size regime every subset drawn leaves an evaluated
    family unseen (one fold with none left the headline gap empty, silently)."""
    rows = [json.loads(x) for x in open(SAMPLE, encoding="utf-8")]
    for r in rows[1:]:
        if r["split"] == "construction":
            del r["attacks"]["MAGEO"]
            r["failed"] = {"MAGEO": "the build's fidelity gate refused every rewrite"}
    bench = tmp_path / "b.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    plan = run.main(argv(tmp_path, "--dry-run", "--families", "all", "--bench", str(bench)))["folds"]
    assert list(plan) == ["without-AgenticGEO", "without-AutoGEO", "all"]
    import runs                        # the summary's construction families are those folds train on
    import settings
    fold = runs.Run(settings.HoldoutConfig(bench=str(bench), runs_dir=str(tmp_path)))
    head = holdout.summary_head(fold, holdout.construction_families(fold, say=False))
    assert head["construction_families"] == ["AgenticGEO", "AutoGEO"]
    with pytest.raises(SystemExit, match=r"--seen-size 2: .*AgenticGEO, AutoGEO, MAGEO.*--methods"):
        run.main(argv(tmp_path, "--dry-run", "--seen-size", "2", "--methods", "AgenticGEO,MAGEO", families=None))


def test_a_family_without_construction_instances_or_given_twice_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--families GEO: \['GEO'\] have no construction instances .*"
                                         r"--construction-families all"):
        run.main(argv(tmp_path, "--families", "GEO"))
    with pytest.raises(SystemExit, match=r"--families AutoGEO,MAGEO,AutoGEO: AutoGEO given twice"):
        run.main(argv(tmp_path, "--dry-run", "--families", "AutoGEO,MAGEO,AutoGEO"))     # its fold would run twice


def test_the_llm_stage_builds_each_folds_library_and_measures_asr_end_to_end(held, tmp_path):
    """--llm-stage: each fold also builds its TFSG library on its trained families and evaluates Shield only
    and GEO Defender (eval's records in the fold); the ASR table is those records'. A schedule the folds'
    fewer construction instances cannot fill is refused before any training."""
    run_dir, s, _ = held
    row = s["folds"][0]
    h = run_dir / "holdout"
    for fold in ("without-AutoGEO", "without-MAGEO", "all"):
        assert (h / fold / "library" / "E2.json").is_file()
    for cond, slug in (("Shield only", "shield_only"), ("GEO Defender", "geo_defender")):
        recs = {f: [json.loads(x) for x in open(h / f / "results" / f"{slug}.jsonl")]
                for f in ("without-AutoGEO", "without-MAGEO", "all")}
        asr = lambda rs, ms: 100 * mean([r["attack_cited"] for r in rs if r["method"] in ms])
        assert row["asr"][cond]["held_out"] == pytest.approx(asr(recs["without-AutoGEO"], ["AutoGEO"]))
        assert row["asr"][cond]["seen"] == pytest.approx(asr(recs["without-MAGEO"], ["AutoGEO"]))
        assert row["asr"][cond]["all"] == pytest.approx(asr(recs["all"], ["AutoGEO"]))
        assert row["asr"][cond]["trained"] == pytest.approx(asr(recs["without-AutoGEO"], ["AgenticGEO", "MAGEO"]))
    assert "ASR (%) end to end" in (h / "report.md").read_text()
    plan = run.main(argv(tmp_path, *LLM_STAGE, "--dry-run"))
    assert plan["folds"]["all"]["train"]["target answers"]["requests"] >= 0 and "llm_requests" not in plan
    with pytest.raises(SystemExit, match=r"construction instances fill .* update batches"):
        run.main(argv(tmp_path, "--llm-stage", "--name", "big"))


def test_the_papers_regime_trains_equal_folds_on_seen_subsets_and_reads_unseen_minus_seen(tmp_path):
    """--seen-size 2 --subsets 2 on the sample's three construction families: two folds, each trained on two
    families and as many construction instances, each fold's unseen-minus-seen exposure its records' (paired
    per query group), the mean over folds that of the folds x groups matrix with a CI around it; the dry run
    lists the same folds; with --llm-stage the same of ASR under each condition, from the folds' eval
    records; a size the construction families cannot fill is refused."""
    args = argv(tmp_path, "--seen-size", "2", "--subsets", "2", *LLM_STAGE, families=None)
    plan = run.main(args + ["--dry-run"])["folds"]
    assert len(plan) == 2 and len({f["instances"] for f in plan.values()}) == 1
    s = run.main(args)
    r = s["regime"]
    assert [f["fold"] for f in r["folds"]] == list(plan) and all(len(f["seen"]) == 2 for f in r["folds"])
    matrix = []
    for f in r["folds"]:
        recs, base = records(tmp_path / "h", f["fold"]), records(tmp_path / "h", f["fold"], "base")
        was = {x["instance_id"]: x["exposed"] for x in base}            # each side: the Shield's change from the base
        per = lambda ms: {g: mean([100 * (x["exposed"] - was[x["instance_id"]]) for x in recs
                                   if x["group_id"] == g and x["method"] in ms])
                          for g in {x["group_id"] for x in recs}}
        u, seen = per(f["unseen"]), per(f["seen"])
        assert f["gap"]["gap"] == pytest.approx(mean([u[g] - seen[g] for g in u]))
        assert f["instances"] == plan[f["fold"]]["instances"]
        assert f["steps"] == plan[f["fold"]]["shield_optimizer_steps"]
        matrix.append([u[g] - seen[g] for g in sorted(u)])
    assert r["gap"] == pytest.approx(mean([mean(row) for row in matrix]))
    assert r["gap_ci"][0] <= r["gap"] <= r["gap_ci"][1] and r["spread"][0] <= r["gap"] <= r["spread"][1]
    assert "Seen and unseen families" in (tmp_path / "h" / "holdout" / "report.md").read_text()
    # the same family held out minus seen: B and C are each seen by one fold and held out by the other
    both = [m for m in {m for f in r["folds"] for m in f["seen"]} if all(m in f["seen"] for f in r["folds"])]
    expect = {}
    for m in sorted({m for f in r["folds"] for m in f["seen"]} - set(both)):
        side = {}
        for f in r["folds"]:
            recs, base = records(tmp_path / "h", f["fold"]), records(tmp_path / "h", f["fold"], "base")
            was = {x["instance_id"]: x["exposed"] for x in base}
            side[m in f["seen"]] = {g: mean([100 * (x["exposed"] - was[x["instance_id"]]) for x in recs
                                             if x["group_id"] == g and x["method"] == m])
                                    for g in {x["group_id"] for x in recs if x["method"] == m}}
        expect[m] = mean([side[False][g] - side[True][g] for g in side[False]])
    fam = r["same_family"]
    assert len(both) == 1 and fam["families"] == pytest.approx(expect) and len(expect) == 2
    assert fam["gap_ci"][0] <= fam["gap"] <= fam["gap_ci"][1]
    assert "the same family held out minus seen, mean over 2 families" in holdout.table(s)
    for cond, slug in (("Shield only", "shield_only"), ("GEO Defender", "geo_defender")):
        per_fold = []
        for f in r["folds"]:
            recs = [json.loads(x) for x in open(tmp_path / "h" / "holdout" / f["fold"] / "results" / f"{slug}.jsonl")]
            groups = {x["group_id"] for x in recs}
            by = lambda ms: {g: mean([100 * x["attack_cited"] for x in recs
                                      if x["group_id"] == g and x["method"] in ms]) for g in groups}
            u, seen = by(f["unseen"]), by(f["seen"])
            assert f["asr"][cond]["gap"]["gap"] == pytest.approx(mean([u[g] - seen[g] for g in u]))
            per_fold.append(mean([u[g] - seen[g] for g in sorted(u)]))
        assert r["asr"][cond]["gap"] == pytest.approx(mean(per_fold))
    with pytest.raises(SystemExit, match="--seen-size 4: .* hold 3 families"):
        run.main(argv(tmp_path, "--seen-size", "4", "--name", "y", "--dry-run", families=None))
    # a flag the chosen regime would ignore is refused before anything runs
    with pytest.raises(SystemExit, match="--seeds 2: not read without --seen-size"):
        run.main(argv(tmp_path, "--seeds", "2", "--name", "y", "--dry-run"))
    with pytest.raises(SystemExit, match="--families GEO: not read with --seen-size"):
        run.main(argv(tmp_path, "--seen-size", "2", "--name", "y", "--dry-run", families="GEO"))


def test_equal_size_keeps_n_of_the_seen_families_rewrites_drawn_with_the_seed():
    import geodef
    groups = [geodef.QueryGroup(f"g{i}", "q", [], 0, {"A": "a", "B": "b", "C": "c"}) for i in range(5)]
    kept = holdout.equal_size(groups, ("A", "B"), 7, seed=3)
    assert sum(m in g.attacks for g in kept for m in "AB") == 7 and all("C" in g.attacks for g in kept)
    assert kept == holdout.equal_size(groups, ("A", "B"), 7, seed=3)
    assert holdout.equal_size(groups, "AB", 10, 3) is groups                       # already that size


def test_a_subsets_seeds_are_one_row_of_the_interval_over_folds():
    """Seeds nested in a subset say nothing more about which families were seen: two seeds that agree exactly
    give the interval of one (resampled as folds of their own they narrowed it)."""
    rng = np.random.default_rng(0)
    base = {f"s{i}": {g: float(rng.normal(5 * i, 3)) for g in range(40)} for i in range(3)}
    one = holdout.over_folds(500, 0, base, {k: k for k in base})
    twice = {f"{k}-seed{j}": v for k, v in base.items() for j in range(2)}
    assert holdout.over_folds(500, 0, twice, {f: f.split("-")[0] for f in twice}) == one


def test_the_same_family_held_out_minus_seen_cancels_how_strong_each_family_is():
    """Four families, every pair a fold's seen subset: each family's change from the base is its own strength
    plus 5 when held out. Unseen minus seen mixes the strengths of different families; the same family held out
    minus seen reads 5 for each, and its interval's unit is the family (four rows, not six subsets)."""
    rng = np.random.default_rng(1)
    strength = {"A": -30.0, "B": -5.0, "C": -20.0, "D": 0.0}
    folds = [(seen, {m: {g: strength[m] + 5.0 * (m not in seen) + float(rng.normal(0, 0.1)) for g in range(30)}
                     for m in strength}) for seen in itertools.combinations("ABCD", 2)]
    fam = holdout.same_family(500, 0, folds)
    assert list(fam["families"]) == list("ABCD") and fam["groups"] == 30
    assert all(v == pytest.approx(5.0, abs=0.1) for v in fam["families"].values())
    assert fam["gap_ci"][0] <= fam["gap"] <= fam["gap_ci"][1] and fam["gap_ci"][1] - fam["gap_ci"][0] < 0.2
    assert holdout.same_family(500, 0, folds[:1])["gap"] is None               # one fold: no family on both sides
    for _, ch in folds:                        # a family without a group (build-bench left it out there)
        del ch["D"][0]
    fam = holdout.same_family(500, 0, folds)
    assert fam["groups"] == 29 and fam["gap"] == pytest.approx(np.mean(list(fam["families"].values())))
