"""Hardening rounds (harden.py, `run.py harden`) on a copy of the reduced demo run, the offline engine
playing every LLM: which groups each attacker sees, the pool's guard, the defense a round without
survivors keeps, the cross-play matrix, the report, resume after a kill, the dry run.
Run: python -m pytest -q test_harden.py
"""
import json
import os
import shutil

import pytest

import geodef
import harden
import offline
import run
import runs
import settings

ARGS = ["--rounds", "2", "--budget", "5", "--eval-budgets", "1,3", "--eval-groups", "2"]


def argv(out, *extra):
    return ["harden", "--runs-dir", str(out), "--name", "demo", *ARGS, *extra]


@pytest.fixture(scope="module")
def hardened(demo_run, tmp_path_factory):
    """One hardening run on a copy of the demo run, the adaptive attacker's requests recorded:
    -> (the run's parent folder, the harden block, [(attacker seed, group id)])."""
    out = tmp_path_factory.mktemp("h")
    shutil.copytree(demo_run.parent, out, dirs_exist_ok=True)
    seen, real = [], offline.attack_rewrites
    mp = pytest.MonkeyPatch()

    def recording(inp):
        seen.append((inp.get("attacker_seed"), inp["query"]))
        return real(inp)
    mp.setattr(offline, "attack_rewrites", recording)
    try:
        block = run.main(argv(out))
    finally:
        mp.undo()
    groups, _ = geodef.load_bench(json.load(open(out / "demo" / "config.json"))["config"]["bench"], with_meta=True)
    by_query = {g.query: g.group_id for g in groups}
    return out, block, [(s, by_query[q]) for s, q in seen]


def split_of(out):
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"})
    data = runs.load_data(cfg)
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
    assert block["rounds"][2]["pool"] == block["rounds"][1]["survivors"] + block["rounds"][2]["survivors"]


def test_a_test_group_in_a_survivors_file_is_refused(hardened, tmp_path):
    out, _, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    _, test = split_of(tmp_path / "o")
    path = tmp_path / "o" / "demo" / "harden" / "round-1" / "survivors.jsonl"
    path.write_text(json.dumps({"instance_id": "x", "group_id": sorted(test)[0], "split": "construction",
                                "source_method": "AutoGEO", "candidate": 1, "text": "t"}) + "\n")
    cfg = runs.resolve(settings.HardenConfig, {"runs_dir": str(tmp_path / "o"), "name": "demo"})
    with pytest.raises(runs.SettingsError, match=r"survivors.jsonl, line 1: survivor x is of a test group"):
        harden.pool_instances(cfg, runs.load_data(cfg), 1)


def test_a_round_without_survivors_keeps_the_defense(hardened):
    out, block, _ = hardened
    for k in (1, 2):
        if block["rounds"][k]["survivors"] == 0:
            prev = harden.defense_of(runs.resolve(settings.HardenConfig, {"runs_dir": str(out), "name": "demo"}),
                                     k - 1)[0]
            new = out / "demo" / "harden" / f"round-{k}" / "adapter" / "adapter_model.safetensors"
            assert new.read_bytes() == open(os.path.join(prev, "adapter_model.safetensors"), "rb").read()
            return
    pytest.skip("every round had survivors on this run")


def test_crossplay_is_square_with_each_rounds_fresh_attacker_on_the_diagonal(hardened):
    _, block, _ = hardened
    m = block["crossplay"]["exposure"]
    assert len(m) == 3 and all(len(row) == 3 for row in m)
    for k in range(3):
        assert m[k][k] == pytest.approx(block["rounds"][k]["fresh"]["3"]["Shield only"]["exposure"])


def test_the_report_says_offline_and_draws_both_figures(hardened):
    out, _, _ = hardened
    rep = (out / "demo" / "harden_report.md").read_text()
    assert rep.startswith("> **OFFLINE / SIMULATION RUN.**") and "Threat model" in rep and "Cross-play" in rep
    for f in ("harden_attack.svg", "harden_utility.svg", "harden_crossplay.svg"):
        assert (out / "demo" / "figures" / f).read_text().startswith("<svg")


def test_a_killed_harden_reruns_to_the_same_files(hardened, tmp_path, demo_run, monkeypatch):
    out, _, _ = hardened
    shutil.copytree(demo_run.parent, tmp_path / "o")
    real, n = harden.measure, [0]

    def dies(*a, **k):                      # killed as round 1 starts measuring
        n[0] += 1
        if n[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(harden, "measure", dies)
    one_round = argv(tmp_path / "o") + ["--rounds", "1"]       # round 1's files are those of the 2-round run
    with pytest.raises(KeyboardInterrupt):
        run.main(one_round)
    monkeypatch.setattr(harden, "measure", real)
    run.main(one_round)
    assert same_round_files(out / "demo" / "harden", tmp_path / "o" / "demo" / "harden") > 10


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


def test_harden_through_the_batch_api_makes_the_synchronous_files(hardened, tmp_path, demo_run):
    out, _, _ = hardened
    shutil.copytree(demo_run.parent, tmp_path / "o")
    run.main(argv(tmp_path / "o") + ["--rounds", "1", "--batch-api", "on", "--batch-poll", "0.1"])
    assert same_round_files(out / "demo" / "harden", tmp_path / "o" / "demo" / "harden") > 10
    stages = json.load(open(tmp_path / "o" / "demo" / "summary.json"))["usage"]["stages"]
    rows = {s: set(v) for s, v in stages.items() if s.startswith("harden")}
    # round 1's attacker, judges and answers by batch; only the Analyzer's one call is synchronous
    assert all("offline:offline-engine [batch]" in v for v in rows.values()) and rows


def test_a_harden_dry_run_sends_and_writes_nothing(demo_run, tmp_path):
    shutil.copytree(demo_run.parent, tmp_path / "o")
    before = (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes()
    plan = run.main(argv(tmp_path / "o", "--dry-run"))
    assert not (tmp_path / "o" / "demo" / "harden").exists()
    assert (tmp_path / "o" / "demo" / "usage.jsonl").read_bytes() == before
    assert plan["per_round"]["attacker"]["requests"] > 0 and plan["test_instances"] == 2 * 7


def test_changed_settings_are_refused_on_a_hardened_run(hardened, tmp_path):
    out, _, _ = hardened
    shutil.copytree(out, tmp_path / "o")
    with pytest.raises(SystemExit, match="the rounds were made with budget=5"):
        run.main(["harden", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--rounds", "2", "--budget", "7",
                  "--eval-budgets", "1,3", "--eval-groups", "2"])
