"""Hardening rounds (harden.py, `run.py harden`) on a copy of the reduced demo run, the offline engine
playing every LLM: which groups each attacker sees, the pool's guard, the defense a round without
survivors keeps, the cross-play matrix, the report, resume after a kill, the dry run.
Run: python -m pytest -q test_harden.py
"""
import json
import os
import shutil
import types

import pytest

import attack
import geodef
import harden
import offline
import run
import runs
import settings
import store
from testing import write_lines

ARGS = ["--rounds", "2", "--budget", "5", "--eval-budgets", "1,3", "--eval-groups", "2"]


def argv(out, *extra):
    return ["harden", "--runs-dir", str(out), "--name", "demo", *ARGS, *extra]


def near_copies_in_round_1(real):
    """The offline attacker, except on the training side: round 1's first call writes, as its first
    rewrite, a near-copy of the source headed by the query, which the small demo's Shield ranks 2nd in one
    construction group and 7th or lower in the others. So round 1 has survivors to harvest, retrain on and
    grow the library with: candidate 1 of each of that group's three families, few enough that the
    retraining is short. Every other training-side rewrite is what the gate refuses (too short), so round
    2 has none. The test side's fresh attackers are the offline engine's."""
    def attacker(inp):
        seed, n = str(inp.get("attacker_seed", "")), int(inp["n_rewrites"])
        if seed.startswith("train-") and seed.endswith("-1") and inp["round"] == 1:
            return [f"{inp['query']}\n\n{inp['source_document']}"] + [f"Short {i}." for i in range(1, n)]
        if seed.startswith("train-"):
            return [f"Short {i}." for i in range(n)]
        return real(inp)
    return attacker


def harden_copy(demo_run, dst):
    """The demo's runs folder copied to dst for a hardening run, its recorded epochs lowered to 1: each
    round's retraining then makes one pass over the demo's triples and the pool, which is all these tests
    look at (the demo's 6 epochs serve its tables)."""
    shutil.copytree(demo_run.parent, dst, dirs_exist_ok=True)
    path = str(dst / "demo" / "config.json")
    record = store.read_json(path)
    record["config"]["epochs"] = 1
    store.write_json(path, record)


RETRAINED = []     # the hardening run's train_shield calls: (folder, pool instance ids, warm start)


def retrain_call(kw):
    return kw["out"], [x.instance_id for x in kw["extra"]], kw["init"]


@pytest.fixture(scope="module")
def hardened(demo_run, tmp_path_factory):
    """One hardening run on a copy of the demo run (near_copies_in_round_1), the adaptive attacker's
    requests and the retraining calls recorded: -> (the run's parent folder, the harden block, [(attacker
    seed, group id)])."""
    out = tmp_path_factory.mktemp("h")
    harden_copy(demo_run, out)
    seen, real = [], near_copies_in_round_1(offline.attack_rewrites)
    mp = pytest.MonkeyPatch()

    def recording(inp):
        seen.append((inp.get("attacker_seed"), inp["query"]))
        return real(inp)
    mp.setattr(offline, "attack_rewrites", recording)
    train = harden.train_shield
    mp.setattr(harden, "train_shield", lambda run_, **kw: RETRAINED.append(retrain_call(kw)) or train(run_, **kw))
    try:
        block = run.main(argv(out))
    finally:
        mp.undo()
    groups, _ = geodef.load_bench(json.load(open(out / "demo" / "config.json"))["config"]["bench"], with_meta=True)
    by_query = {g.query: g.group_id for g in groups}
    return out, block, [(s, by_query[q]) for s, q in seen]


def test_under_torchrun_every_rank_retrains_each_round_as_rank_0_does(hardened, monkeypatch):
    """Ranks other than 0 run harden.train_share: each round, once rank 0 has written its survivors (a
    barrier), the train_shield call rank 0 makes (the round's folder, the pool, the warm start), so that
    the data-parallel steps meet. Played in one process after the hardening run (the Run's ranks are one
    process alone: its barrier does nothing): its calls equal the run's own."""
    out, _, _ = hardened
    calls = []
    monkeypatch.setattr(harden, "train_shield", lambda run_, **kw: calls.append(retrain_call(kw)))
    given = {"runs_dir": str(out), "name": "demo", "rounds": 2, "budget": 5, "eval_budgets": "1,3", "eval_groups": 2}
    harden.train_share(runs.Run(runs.resolve(settings.HardenConfig, given)))
    assert calls == RETRAINED and RETRAINED and RETRAINED[0][1]      # round 1 retrained on a pool


def split_of(out):
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
    data = runs.Run(cfg).data
    return {g.group_id for g in data.construction}, {g.group_id for g in data.test}


def test_training_attackers_see_construction_groups_only(hardened):
    out, _, seen = hardened
    cons, test = split_of(out)
    train = {g for s, g in seen if s.startswith("train-")}
    assert train and train <= cons and not train & test


def test_the_fresh_attacker_sees_test_groups_only(hardened):
    out, _, seen = hardened
    cons, test = split_of(out)
    fresh = {g for s, g in seen if s.startswith("test-")}
    assert fresh and fresh <= test and not fresh & cons


def test_no_training_seed_measures_a_round(hardened):
    _, _, seen = hardened
    seeds = {s for s, _ in seen}
    assert {s for s in seeds if s.startswith("train-")} and {s for s in seeds if s.startswith("test-")}
    assert len({s for s in seeds if s.startswith("test-")}) == 3          # rounds 0, 1, 2: a fresh attacker each


def test_survivors_are_construction_instances_in_the_pool(hardened):
    out, block, _ = hardened
    cons, _ = split_of(out)
    for k in (1, 2):
        for line in open(out / "demo" / "harden" / f"round-{k}" / "survivors.jsonl"):
            r = json.loads(line)
            assert r["group_id"] in cons and r["split"] == "construction" and r["method"] == f"adaptive-r{k}"
    assert block["rounds"][1]["survivors"] > 0
    assert block["rounds"][2]["pool"] == block["rounds"][1]["survivors"] + block["rounds"][2]["survivors"]


def test_survivors_of_one_group_and_candidate_number_stay_apart(hardened):
    """Two families' candidates n of one group both survive: each its own pool instance, trained on."""
    out, block, _ = hardened
    recs = [json.loads(x) for x in open(out / "demo" / "harden" / "round-1" / "survivors.jsonl")]
    by = {}
    for r in recs:
        by.setdefault((r["group_id"], r["candidate"]), set()).add(r["source_method"])
    assert any(len(m) > 1 for m in by.values())
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
    pool = harden.pool_instances(runs.Run(cfg), 1)
    assert len({x.instance_id for x in pool}) == len({x.doc_ids[x.attack_index] for x in pool}) == len(recs)


def test_the_shield_is_retrained_on_the_survivors(hardened):
    """Round 1 trains from round 0's adapter on the survivors, and ships the best of its start and its epochs
    on its monitoring split: round 0's adapter exactly when no epoch beat it."""
    out, _, _ = hardened
    r1 = out / "demo" / "harden" / "round-1"
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
    prev = harden.defense_of(runs.Run(cfg), 0)
    done = json.load(open(r1 / "shield_done.json"))
    assert done["steps"] > 0 and [h["epoch"] for h in done["history"]] == list(range(cfg.shield.epochs + 1))
    best = min(done["history"], key=lambda h: (h["loss"], -h["pref_accuracy"]))
    assert done["best"]["epoch"] == best["epoch"]
    same = (r1 / "adapter" / "adapter_model.safetensors").read_bytes() == \
        open(os.path.join(prev[0], "adapter_model.safetensors"), "rb").read()
    assert same == (best["epoch"] == 0)


def test_the_library_grows_on_the_survivors(hardened):
    out, _, _ = hardened
    r1 = out / "demo" / "harden" / "round-1"
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
    cases = json.load(open(r1 / "library" / f"E{cfg.tfsg.n_batches + 2}.cases.json"))
    cited = [json.loads(x) for x in open(r1 / "cited.jsonl")]            # GEO Defender's citations, no ASI judge
    assert cited and all("asi" not in r and "asi_judge" not in r for r in cited)
    # the survivors' cases (their attack in context) beside their groups' benign lists
    assert any("attack" in c["labels"] for c in cases) and any("attack" not in c["labels"] for c in cases)


def test_a_test_group_in_a_survivors_file_is_refused(hardened, tmp_path, monkeypatch):
    out, _, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    _, test = split_of(tmp_path / "o")
    path = tmp_path / "o" / "demo" / "harden" / "round-1" / "survivors.jsonl"
    path.write_text(json.dumps({"instance_id": "x", "group_id": sorted(test)[0], "split": "construction",
                                "source_method": "AutoGEO", "candidate": 1, "text": "t"}) + "\n")
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(tmp_path / "o"), "name": "demo"})
    with pytest.raises(runs.SettingsError, match=r"survivors.jsonl, line 1: not the survivor of a construction"):
        harden.pool_instances(runs.Run(cfg), 1)
    for stage in ("clean_references", "measure", "attacked"):           # a rerun: refused before any of them
        monkeypatch.setattr(harden, stage, lambda *a, **k: pytest.fail("a stage ran before the check"))
    with pytest.raises(SystemExit, match=r"round-1/survivors.jsonl, line 1: not the survivor"):
        run.main(argv(tmp_path / "o"))


SURVIVOR = {"instance_id": "q0013:adaptive-r1.AutoGEO.2", "group_id": "q0013", "split": "construction",
            "method": "adaptive-r1", "source_method": "AutoGEO", "candidate": 2, "shield_rank": 3,
            "tfsg_cited": False, "text": "Canberra is the capital of Australia."}


@pytest.mark.parametrize("line, says", [
    (json.dumps({k: v for k, v in SURVIVOR.items() if k != "tfsg_cited"}),
     "tfsg_cited must be true or false, got no such field"),
    (json.dumps({**SURVIVOR, "tfsg_cited": "yes"}), "tfsg_cited must be true or false, got a string"),
    (json.dumps({**SURVIVOR, "candidate": True}), "candidate must be an integer, got true or false"),
    ("[" * 100000 + "]" * 100000, "not JSON (nested too deeply)"),
    ("[1, 2]", "a survivor must be a JSON object, got a list"),
], ids=["no tfsg_cited", "tfsg_cited yes", "candidate true", "nested 100000 deep", "a list"])
def test_a_bad_survivors_line_is_one_error_naming_file_line_and_field(tmp_path, line, says):
    """Line 3 (after a good line and a blank one) of the wrong shape: a SettingsError, which run.py prints
    as one line without a traceback, naming the file, the line and the field."""
    path = tmp_path / "round-1" / "survivors.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(SURVIVOR) + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(runs.SettingsError) as e:
        harden.read_survivors(str(path))
    assert str(e.value) == f"{path}, line 3: {says}"
    assert isinstance(e.value, run.USER_ERRORS) and (e.value.__context__ is None or e.value.__suppress_context__)


def test_a_survivor_text_with_unicode_line_breaks_reads_back(tmp_path):
    """write_jsonl leaves U+2028 and U+0085 raw inside a string; reading ends lines at line feeds only."""
    path = tmp_path / "survivors.jsonl"
    rec = {**SURVIVOR, "text": "Canberra\u2028is the capital\x85of Australia."}
    store.write_jsonl(str(path), [rec, SURVIVOR])
    assert harden.read_survivors(str(path)) == [rec, SURVIVOR]


CANDIDATE = {"instance_id": "q0013:AutoGEO", "n": 1, "round": 1, "sid": "~1.0", "text": "Canberra leads.",
             "accepted": True, "reason": "accepted", "score": 2.5, "rank": 1}


@pytest.mark.parametrize("edit, says", [
    ({"score": None}, "score must be a number, got null"),
    ({"accepted": 1}, "accepted must be true or false, got an integer"),
    ({"n": "1"}, "n must be an integer, got a string"),
    ({"text": 7, "accepted": False}, "text must be a string or null, got an integer"),
], ids=["accepted unscored", "accepted 1", "n text", "text a number"])
def test_a_candidates_line_of_the_wrong_shape_is_named_before_a_round_reads_it(tmp_path, edit, says):
    """A finished attack stage's candidates are read back, not asked again: a line edited by hand is one
    error naming the file, line and field, not a crash in best_of; a refused candidate keeps a null text,
    score and rank (the attacker returned fewer rewrites)."""
    path = tmp_path / "attack-test.jsonl"
    refused = {**CANDIDATE, "n": 2, "text": None, "accepted": False, "score": None, "rank": None}
    store.write_jsonl(str(path), [CANDIDATE, refused])
    assert harden.read_attack(str(path)) == {"q0013:AutoGEO": [CANDIDATE, refused]}
    store.write_jsonl(str(path), [CANDIDATE, {**CANDIDATE, **edit}])
    with pytest.raises(runs.SettingsError) as e:
        harden.read_attack(str(path))
    assert str(e.value) == f"{path}, line 2: {says}"


def test_a_round_measures_the_papers_lists_of_a_file_with_several_attacked(tmp_path):
    """On a file built with --attacked K a round attacks and measures the lists with one attacked document
    (each (group, family) once), not every level pooled into one figure."""
    group = lambda gid, split, **kw: {
        "group_id": gid, "query": f"q {gid}", "split": split, "source_index": 2,
        "docs": [{"doc_id": f"{gid}-{i}", "text": f"doc {gid} {i} text"} for i in range(10)],
        "attacks": {"A": f"promoted doc {gid} 2", "B": f"boosted doc {gid} 2"}, **kw}
    rows = [{"_meta": {"methods": ["A", "B"], "seen_methods": ["A"], "attacked": 2}}, group("g0", "construction"),
            group("g1", "test", co_attacks=[{"index": 5, "method": "B", "text": "promoted doc g1 5"}])]
    cons, test = geodef.load_bench(write_lines(tmp_path, rows))
    _, insts = harden.test_instances(0, types.SimpleNamespace(test=[test], methods=["A", "B"]))
    assert [x.instance_id for x in insts] == ["g1:A", "g1:B"]


def test_a_round_without_survivors_keeps_the_defense(hardened):
    out, block, _ = hardened
    for k in (1, 2):
        if block["rounds"][k]["survivors"] == 0:
            cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
            prev = harden.defense_of(runs.Run(cfg), k - 1)[0]
            new = out / "demo" / "harden" / f"round-{k}" / "adapter" / "adapter_model.safetensors"
            assert new.read_bytes() == open(os.path.join(prev, "adapter_model.safetensors"), "rb").read()
            return
    pytest.fail("no round without survivors on this run")


def test_crossplay_is_square_with_each_rounds_fresh_attacker_on_the_diagonal(hardened):
    _, block, _ = hardened
    m = block["crossplay"]["exposure"]
    assert len(m) == 3 and all(len(row) == 3 for row in m)
    for k in range(3):
        assert m[k][k] == pytest.approx(block["rounds"][k]["fresh"]["3"]["Shield only"]["exposure"])


def test_the_report_says_offline(hardened):
    out, _, _ = hardened
    rep = (out / "demo" / "harden_report.md").read_text()
    assert rep.startswith("> **OFFLINE / SIMULATION RUN.**") and "Threat model" in rep and "Cross-play" in rep
    assert "fresh test attacker MAGEO's loop: **in-distribution**" in rep     # the default: one algorithm
    b = json.load(open(out / "demo" / "summary.json"))["harden"]             # exposure read against chance k/n
    assert b["chance_in_topk"] == pytest.approx(100 * b["k"] / 10) and f"against {b['chance_in_topk']:.2f}%" in rep
    assert f"the same {b['test_instances']} instances of {b['test_groups']} test groups" in rep
    later = [r for r in b["rounds"] if r["round"] > 0]                       # each round against round 0: paired
    assert later and all(set(r["vs_round_0"]) == {"exposure", "ASR"} for r in later)
    assert all(r["vs_round_0"]["exposure"]["groups"] == b["test_groups"] for r in later)
    assert "attacker against round 0's, paired per test group" in rep


def test_the_report_counts_the_answers_that_never_came(hardened, tmp_path):
    """A failed answer cites nothing, so it reads as a blocked attack in the ASR cells: the report says how many,
    by round, part and condition, as eval's and attack's reports do."""
    import copy
    import report
    out, _, _ = hardened
    s = copy.deepcopy(json.load(open(out / "demo" / "summary.json")))
    assert "never came" not in (out / "demo" / "harden_report.md").read_text()
    s["harden"]["rounds"][1]["fresh"]["3"]["GEO Defender"]["answer_failed"] = 3
    s["harden"]["rounds"][0]["static"]["Shield only"]["answer_failed"] = 1
    report.write_harden_report(str(tmp_path), s)
    assert ("Answers that never came (cite nothing: counted as not citing the attack): r0 static Shield only 1, "
            "r1 fresh B=3 GEO Defender 3.") in (tmp_path / "harden_report.md").read_text()


def test_a_fresh_harden_counts_only_its_own_replies(hardened, tmp_path):
    """harden/ moved aside, as the settings refusal advises: the new rounds' cost is the usage ledger's lines
    after they started (harden/settings.json's ledger_from), not the old rounds' replies under the same stages."""
    out, block, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(tmp_path / "o"), "name": "demo", "rounds": 2,
                                                "budget": 5, "eval_budgets": "1,3", "eval_groups": 2})     # ARGS
    r = runs.Run(cfg)
    old = json.load(open(tmp_path / "o" / "demo" / "harden" / "settings.json"))["ledger_from"]
    assert harden.check_settings(r)[2] == old                # the rounds' own start, on a rerun
    replies = sum(v["replies"] for v in r.usage(old)["stages"]["harden-r1"].values())
    assert replies == block["rounds"][1]["cost"]["replies"] > 0
    os.rename(tmp_path / "o" / "demo" / "harden", tmp_path / "o" / "demo" / "harden.old")
    start = harden.check_settings(r)[2]
    assert start == os.path.getsize(tmp_path / "o" / "demo" / "usage.jsonl") > old and r.usage(start)["stages"] == {}


def test_the_rounds_ledger_start_is_a_line_start(tmp_path):
    """A ledger whose last line a kill cut is cut off before the next reply is appended: the rounds' start is the
    byte after its last whole line, or their first reply's line would be read from its middle and skipped."""
    (tmp_path / "usage.jsonl").write_bytes(b'{"stage": "eval"}\n{"stage": "ev')
    assert harden.ledger_end(str(tmp_path / "usage.jsonl")) == len(b'{"stage": "eval"}\n')
    assert harden.ledger_end(str(tmp_path / "none.jsonl")) == 0


def test_harden_draws_its_figures(hardened):
    out, _, _ = hardened
    for f in ("harden_attack.svg", "harden_utility.svg", "harden_crossplay.svg"):
        assert (out / "demo" / "figures" / f).read_text().startswith("<svg")


def test_a_killed_batch_api_harden_reruns_to_the_synchronous_files(hardened, tmp_path, demo_run, monkeypatch):
    """Killed as round 1 starts measuring and rerun, a harden through the batch API ends with the files
    of the uninterrupted synchronous run, every harden stage's replies bought by batch."""
    out, _, _ = hardened
    harden_copy(demo_run, tmp_path / "o")
    real, n = harden.measure, [0]

    def dies(*a, **k):
        n[0] += 1
        if n[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(harden, "measure", dies)
    monkeypatch.setattr(offline, "attack_rewrites", near_copies_in_round_1(offline.attack_rewrites))
    # round 1's files are those of the 2-round run
    one_round = argv(tmp_path / "o") + ["--rounds", "1", "--batch-api", "on", "--batch-poll", "0.01"]
    with pytest.raises(KeyboardInterrupt):
        run.main(one_round)
    monkeypatch.setattr(harden, "measure", real)
    run.main(one_round)
    assert same_round_files(out / "demo" / "harden", tmp_path / "o" / "demo" / "harden") > 10
    stages = json.load(open(tmp_path / "o" / "demo" / "summary.json"))["usage"]["stages"]
    rows = {s: set(v) for s, v in stages.items() if s.startswith("harden")}
    # round 1's attacker, judges and answers by batch; only the Analyzer's one call is synchronous
    assert all("offline:offline-engine [batch]" in v for v in rows.values()) and rows


def same_round_files(ref, got):
    """How many files of `got`'s harden folder there are, each equal to `ref`'s (its Shield's training
    checkpoint and the pinned settings aside)."""
    compared = 0
    for root, _, files in os.walk(got):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), got)
            if rel.split(os.sep)[1:2] != ["checkpoint"] and rel != "settings.json":
                assert (got / rel).read_bytes() == (ref / rel).read_bytes(), rel
                compared += 1
    return compared


def test_eval_after_harden_keeps_the_harden_block(hardened, tmp_path):
    """summary.json has one writer (runs.write_summary): eval rewrites its own figures and keeps the
    blocks of harden and of the reranker stage."""
    out, _, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    before = json.load(open(tmp_path / "o" / "demo" / "summary.json"))
    run.main(["eval", "--runs-dir", str(tmp_path / "o"), "--name", "demo"])
    after = json.load(open(tmp_path / "o" / "demo" / "summary.json"))
    assert after["harden"] == before["harden"] and after["rerank_stage"] == before["rerank_stage"]
    assert after["conditions"] == before["conditions"]


def test_a_harden_dry_run_sends_and_writes_nothing(demo_run, tmp_path):
    shutil.copytree(demo_run.parent, tmp_path / "o")
    before = (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes()
    plan = run.main(argv(tmp_path / "o", "--dry-run"))
    assert not (tmp_path / "o" / "demo" / "harden").exists()
    assert (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes() == before
    # a JSON request asked at most twice; budget 5: 2 attacker rounds of 2 candidates; budgets 1,3: 1 round
    assert plan["per_round"]["training attacker"]["requests"] == 2 * plan["construction_instances"] * 2
    assert plan["per_round"]["test attacker"]["requests"] == 2 * plan["test_instances"] * 1
    assert plan["test_instances"] == 2 * 7


def test_changed_settings_are_refused_on_a_hardened_run(hardened, tmp_path):
    out, _, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    common = ["harden", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--rounds", "2", "--eval-budgets", "1,3",
              "--eval-groups", "2"]
    for dry in ([], ["--dry-run"]):       # the plan is refused as the run is
        with pytest.raises(SystemExit, match=r"the rounds were made with different budget \(budget=5\)"):
            run.main(common + ["--budget", "7"] + dry)
        with pytest.raises(SystemExit, match=r"different test_algorithm \(test_algorithm='mageo'\); this command "
                                              r"asks for test_algorithm='repair'"):
            run.main(common + ["--budget", "5", "--test-algorithm", "repair"] + dry)


def test_a_test_attacker_of_another_algorithm_is_recorded_and_labelled(demo_run, tmp_path):
    """--test-algorithm repair: the training rounds attack with MAGEO's loop, every fresh test attacker with
    the diagnose-and-repair loop from the source (its candidates carry their diagnosis and edit fraction), as
    attack's defaults; harden/settings.json pins both algorithms, the start and the edit budget, and
    the report calls the test attacker out of distribution."""
    harden_copy(demo_run, tmp_path / "o")
    run.main(["harden", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--rounds", "1", "--budget", "3",
              "--eval-budgets", "1,3", "--eval-groups", "2", "--test-algorithm", "repair"])
    h = tmp_path / "o" / "demo" / "harden"
    lines = lambda p: [json.loads(x) for x in open(p, encoding="utf-8")]
    for k in (0, 1):
        test = [c for c in lines(h / f"round-{k}" / "attack-test.jsonl") if c["n"] > 0]
        assert test and all(c["diagnosis"] in attack.REPAIR_MODES for c in test)
        first = [c for c in lines(h / f"round-{k}" / "attack-test.jsonl") if c["n"] == 0]
        assert first and all(c["reason"] == "the source" and c["edit_fraction"] == 0 for c in first)
    assert not any("diagnosis" in c for c in lines(h / "round-1" / "attack-train.jsonl"))
    pinned = json.load(open(h / "settings.json"))
    assert pinned["algorithm"] == "mageo" and pinned["test_algorithm"] == "repair"
    assert pinned["start"] == "source" and pinned["edit_budget"] == 0.1
    assert "diagnose-and-repair (AgentGEO): out of distribution" in (h.parent / "harden_report.md").read_text()


def test_a_repair_round_made_before_the_start_and_budget_were_pinned_is_refused(tmp_path):
    """harden/settings.json of a repair attacker from before --start and --edit-budget (it started from the
    benchmark's rewrite, 30% a step): a rerun, which would start from the source within 10%, is refused
    naming both, never mixed; a MAGEO-only record is refused naming the algorithm alone. A record beside
    nothing it produced (the first start failed before any file) is no reason to refuse."""
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(tmp_path), "name": "r", "test_algorithm": "repair"})
    run = types.SimpleNamespace(cfg=cfg, data=types.SimpleNamespace(test=[]))   # the settings and test groups
    _, now, _ = harden.check_settings(run)
    several = types.SimpleNamespace(cfg=cfg, data=types.SimpleNamespace(test=[types.SimpleNamespace(co_attacks=[1])]))
    assert "lists" not in now and harden.check_settings(several)[1]["lists"] == "one attacked document"
    old = {k: v for k, v in now.items() if k not in ("start", "edit_budget")}
    store.write_json(str(tmp_path / "r" / "harden" / "settings.json"), old)
    assert harden.check_settings(run)[1] == now        # a start that produced nothing (a refused key) pins nothing
    store.write_json(str(tmp_path / "r" / "harden" / "clean_reference.jsonl"), [])    # what the settings produced
    with pytest.raises(settings.SettingsError, match=r"different edit_budget, start \(edit_budget=None, start=None\)"):
        harden.check_settings(run)
    store.write_json(str(tmp_path / "r" / "harden" / "settings.json"), {**old, "test_algorithm": "mageo"})
    with pytest.raises(settings.SettingsError, match=r"different test_algorithm \(test_algorithm='mageo'\);"):
        harden.check_settings(run)


def test_a_harden_dry_run_prices_the_repair_attackers_engine_answers(demo_run, tmp_path):
    """--test-algorithm repair: every candidate the fresh attacker scores is answered by the engine, so the
    plan holds those answers (test instances x the largest budget); MAGEO's loop on both sides holds none."""
    shutil.copytree(demo_run.parent, tmp_path / "o")
    common = ["harden", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--rounds", "1", "--budget", "3",
              "--eval-budgets", "1,3", "--eval-groups", "2", "--dry-run"]
    plan = run.main(common + ["--test-algorithm", "repair"])
    assert plan["per_round"]["repair engine answers"]["requests"] == plan["test_instances"] * 3
    assert "repair engine answers" not in run.main(common)["per_round"]
