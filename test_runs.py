"""What a run folder promises (runs.py, run.py): pinning, one writer, resume, sentences instead of
tracebacks, validated inputs, the whole run's usage.
Run: python -m pytest -q test_runs.py
"""
import argparse
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import re
import resource
import shlex
import shutil
import signal
import threading
import time
import traceback
import unittest.mock

import pytest
import torch

import bench
import build_bench
import evaluation
import accounting
import geodef
import llm_clients
import report
import reranker
import run
import runs
import settings
import store
import tfsg
import train
from testing import R, SAMPLE, good_group, write_lines


def _in_a_child(fn, *args, timeout=60):
    """fn(*args) in a forked child process -> ("returned", its value), ("exit", SystemExit's code) or
    ("raised", the traceback). A second process where the property needs one (a lock held elsewhere, a
    process-wide file size limit) without a fresh interpreter's seconds of imports; the child uses no
    torch (a fork after torch's thread pools started is not safe for torch work)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(("returned", fn(*args)))
        except SystemExit as e:
            send.send(("exit", e.code))
        except BaseException:
            send.send(("raised", traceback.format_exc()))
    p = ctx.Process(target=child)
    p.start()
    try:
        assert recv.poll(timeout), f"no answer from the child process within {timeout} s"
        return recv.recv()
    finally:
        p.kill()
        p.join()


def test_seen_methods_are_never_guessed(tmp_path):
    """Without _meta.seen_methods or --seen-methods the construction methods are an error naming the
    methods, except for the paper's seven, where the paper's seen set is used."""
    p = write_lines(tmp_path, [good_group(f"g{i}") for i in range(3)])
    groups, meta = geodef.load_bench(p, with_meta=True)
    with pytest.raises(geodef.BenchFormatError, match=r"_meta.seen_methods: missing.*\['A', 'B'\]"):
        geodef.seen_methods(meta, None, p)
    assert geodef.seen_methods(meta, ["B", "B"], p) == (["B"], "given")
    with pytest.raises(geodef.BenchFormatError, match=r"\['Z'\] are not among"):
        geodef.seen_methods(meta, ["Z"], p)
    paper = [{**good_group(f"g{i}"),
              "attacks": {m: f"{m} rewrite {i}" for m in geodef.PAPER_METHODS}} for i in range(3)]
    meta = geodef.load_bench(write_lines(tmp_path, paper, "paper.jsonl"), with_meta=True)[1]
    assert geodef.seen_methods(meta) == (["AgenticGEO", "AutoGEO", "MAGEO"], "the paper's seen methods")
    cfg = settings.EvalConfig(name="s", runs_dir=str(tmp_path), bench=p, n_construction=1)
    with pytest.raises(geodef.BenchFormatError, match="--seen-methods"):
        runs.Run(cfg).data
    assert runs.Run(cfg.replace(seen_methods="B")).data[4] == ["B"]
    with pytest.raises(geodef.BenchFormatError, match=r"seen_methods: \['A'\] listed more than once"):
        geodef.load_bench(write_lines(tmp_path, [{"_meta": {"seen_methods": ["A", "A"]}}, good_group()], "d.jsonl"))


def _no_model_loads(monkeypatch):
    """Run.reranker fails the test when called -> the list of the configs it was called with."""
    loaded = []
    monkeypatch.setattr(runs.Run, "reranker", lambda self: loaded.append(self.cfg) or pytest.fail("model loaded"))
    return loaded


def test_a_missing_key_stops_a_command_before_any_model_loads(tmp_path, monkeypatch):
    """A missing API key must stop `train` before the Shield stage loads a model or trains (the
    TFSG stage that needs the key comes after it)."""
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    loaded = _no_model_loads(monkeypatch)
    for argv in (["train", "--llm", "deepseek:deepseek-chat"], ["train", "--analyzer", "deepseek:deepseek-chat"],
                 ["eval", "--llm", "offline", "--judge", "deepseek:deepseek-chat"]):
        with pytest.raises(SystemExit, match="DEEPSEEK_API_KEY"):
            run.main(argv + ["--model", "tiny", "--name", "k", "--runs-dir", str(tmp_path)])
    assert not loaded and not os.path.exists(tmp_path / "k" / "adapter")


def test_a_target_or_judge_that_built_the_benchmark_is_refused_unless_allowed(tmp_path, monkeypatch):
    """_meta's builder, fidelity judge and MAGEO engine may not be the target or judge (compared by model
    name across providers), in every command that calls them, before any model loads or request goes;
    --allow-shared-roles lets it through and the report says so. (The offline engine plays every role of the
    bundled sample in every demo.)"""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("DEEPSEEK_API_KEY", "sk-test")
    lines = open(settings.SAMPLE, encoding="utf-8").read().splitlines()
    meta = json.loads(lines[0])
    meta["_meta"].update(builder_llm="openai:gpt-5.5", fidelity_judge="deepseek:judge-x")    # mageo_signal "engine"
    bench = tmp_path / "b.jsonl"
    bench.write_text("\n".join([json.dumps(meta)] + lines[1:]) + "\n")
    loaded = _no_model_loads(monkeypatch)
    common = ["--model", "tiny", "--runs-dir", str(tmp_path), "--bench", str(bench), "--dry-run"]
    judged = "the judge deepseek:judge-x judged its rewrites' fidelity"
    cases = ((["train", "--llm", "openai:GPT-5.5"], "the target openai:GPT-5.5 built the benchmark; "
                                                    "the target openai:GPT-5.5 was MAGEO's engine"),
             (["eval", "--llm", "openai:gpt-5-mini", "--judge", "deepseek:judge-x"], judged),
             (["attack", "--llm", "openai:gpt-5-mini", "--judge", "deepseek:judge-x"], judged),
             (["harden", "--llm", "deepseek:JUDGE-X"], "the target deepseek:JUDGE-X judged"),
             (["holdout", "--llm-stage", "--llm", "openai:gpt-5.5"], "the target openai:gpt-5.5 built"))
    # harden takes its benchmark from the trained run's record
    (tmp_path / "harden").mkdir()
    (tmp_path / "harden" / "config.json").write_text(json.dumps({"config": {"bench": str(bench), "model": "tiny"}}))
    for argv, said in cases:
        with pytest.raises(SystemExit, match=re.escape(said) + r".* \(its _meta\).*--allow-shared-roles"):
            run.main(argv + (common[2:4] + common[-1:] if argv[0] == "harden" else common) + ["--name", argv[0]])
    assert not loaded
    allowed = ["eval", "--conditions", "Non-Defense", *common]
    assert run.main(allowed + ["--llm", "openai:gpt-5.5", "--allow-shared-roles", "--name", "ok"])["stages"]
    assert not loaded
    s = {"notes": [], "target_llm": "openai:gpt-5.5", "model": "m", "test_groups": 1, "test_instances": 7,
         "seen_methods": ["A"], "shared_roles": runs.shared_roles(str(bench), "openai:gpt-5.5")}
    assert "**Roles shared with the benchmark's construction** (--allow-shared-roles): the target openai:gpt-5.5 " \
           "built the benchmark" in "".join(report._header_lines(str(tmp_path), s))


def test_a_routed_model_is_the_model_behind_the_route(tmp_path):
    """A router or self-hosted server names the upstream model as vendor/model (OpenRouter, vLLM's served
    names), with a variant after ':' (OpenRouter's :free): the roles check compares the model behind it."""
    lines = open(settings.SAMPLE, encoding="utf-8").read().splitlines()
    meta = json.loads(lines[0])
    meta["_meta"].update(builder_llm="openai:gpt-5.5", fidelity_judge="anthropic:claude-opus-4-5",
                         mageo_signal="model")
    bench = tmp_path / "b.jsonl"
    bench.write_text("\n".join([json.dumps(meta)] + lines[1:]) + "\n")
    for llm in ("openrouter:openai/gpt-5.5", "vllm:openai/gpt-5.5", "openrouter:openai/GPT-5.5:free",
                "openai-compatible:gpt-5.5"):
        assert runs.shared_roles(str(bench), llm) == [
            f"the target {llm} built the benchmark"], llm
    judge = "openrouter:anthropic/claude-opus-4.5"
    judged = runs.shared_roles(str(bench), "openai:gpt-5-mini", judge)
    assert judged == ["the judge openrouter:anthropic/claude-opus-4.5 judged its rewrites' fidelity"]
    assert runs.role_model("anthropic:claude-opus-4-5-20251101") == runs.role_model(judge)
    assert not runs.shared_roles(str(bench), "openrouter:openai/gpt-5-mini")
    assert runs.role_model("offline:x") is None
    assert runs.role_model("ollama:qwen3:8b") != runs.role_model("ollama:qwen3:32b")     # a tag names another model
    assert runs.role_model("ollama:llama3.1:latest") == runs.role_model("ollama:llama3.1")   # the default tag
    alias, dated = "anthropic:claude-3-7-sonnet-latest", "anthropic:claude-3-7-sonnet-20250219"
    assert runs.role_model(alias) == runs.role_model(dated)


def test_a_missing_ppl_model_is_named_before_the_reranker_loads(tmp_path, monkeypatch):
    """A missing PPL model must stop `eval` before the reranker loads."""
    loaded = _no_model_loads(monkeypatch)
    # a PPL-Filter model that cannot be had: named before the reranker scores every candidate
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="nobody/gpt2: not a folder and not downloadable"):
        run.main(["eval", "--llm", "offline", "--conditions", "Non-Defense,PPL-Filter", "--ppl-model", "nobody/gpt2",
                  "--model", "tiny", "--name", "p", "--runs-dir", str(tmp_path)])
    assert not loaded


def test_bench_without_its_race_peers_says_what_to_install(monkeypatch):
    # bench races peers from the test-only requirements: without them, say so instead of an ImportError
    real_find = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda m, *a: None if m == "peft" else real_find(m, *a))
    with pytest.raises(SystemExit, match=r"bench --what train races peft .*pip install -r requirements-test.txt"):
        run.main(["bench", "--what", "train", "--no-compile"])


def test_out_of_range_flags_are_named_up_front(tmp_path):
    with pytest.raises(SystemExit, match=r"--quant 'nf8' .one of none, nf4.*--epochs 0"):
        run.main(["train", "--epochs", "0", "--quant", "nf8", "--model", "tiny", "--runs-dir", str(tmp_path)])
    with pytest.raises(runs.SettingsError, match=r"--lora-dropout 1.0"):
        settings.EvalConfig(lora_dropout=1.0)
    if not torch.cuda.is_available():
        with pytest.raises(runs.SettingsError, match="--device cuda: no CUDA device"):
            settings.EvalConfig(device="cuda")


def test_splits_that_leave_a_stage_nothing_are_refused(tmp_path, small_bench, capsys):
    """A file whose split fields are all "test" (or all "construction"), a --n-construction that leaves no
    test group, and one construction group (nothing to monitor with) used to run on: an untrained
    adapter kept by empty metrics. Too few construction instances for TFSG's update batches built a
    library short of E4 while eval looked for E4 ("run train first"). Now each stops before anything
    is written, naming the file; the rerun with a usable setting goes ahead under the same name. Bad
    files and untrained runs: `error:` naming the file, no traceback, as the command line prints it
    (run.main's SystemExit: its message, exit status 1)."""
    rows = [json.loads(x) for x in open(small_bench, encoding="utf-8").read().splitlines() if x.strip()]
    meta, groups = rows[0], rows[1:]
    for split in ("test", "construction"):
        p = write_lines(tmp_path, [meta] + [dict(g, split=split) for g in groups], f"all_{split}.jsonl")
        with pytest.raises(ValueError, match=f"no group in '{'construction' if split == 'test' else 'test'}'"):
            geodef.split_groups(geodef.load_bench(p), 4)
    common = ["--model", "tiny", "--llm", "offline", "--runs-dir", str(tmp_path), "--name", "x"]
    with pytest.raises(SystemExit, match=r"all_test\.jsonl: the file's split fields put no group in 'construction'"):
        run.main(["train", "--bench", str(tmp_path / "all_test.jsonl")] + common)
    with pytest.raises(SystemExit, match=f"n_construction={len(groups)} leaves no test group"):
        run.main(["train", "--bench", small_bench, "--n-construction", str(len(groups))] + common)
    with pytest.raises(SystemExit, match=r"1 construction group\(s\) gave 3 and 0 instances"):
        run.main(["train", "--bench", small_bench, "--n-construction", "1"] + common)
    with pytest.raises(SystemExit, match=r"6 construction instances fill 6 seed cases and 0 of the 3 update batches"):
        run.main(["train", "--bench", small_bench, "--n-construction", "2"] + common)  # E4 would never be built
    assert not os.path.exists(tmp_path / "x")
    run.main(["train", "--bench", small_bench, "--n-construction", "2", "--stage", "shield", "--epochs", "1",
              "--max-test-groups", "1"] + common)      # one test group for the closing test-ranking report
    assert os.path.isfile(tmp_path / "x" / "adapter" / "adapter_model.safetensors")
    # evaluated after the Shield stage alone: the error names the stage still to run and the
    # conditions that can be evaluated already
    # the command said names the run folder as the refused command did: --runs-dir, not the default
    with pytest.raises(SystemExit, match=r"no TFSG library; run `python run.py train --name x --runs-dir "
                       + re.escape(shlex.quote(str(tmp_path))) + r" --stage tfsg` first \(GEO Defender, TFSG only "
                       r"need it\), or evaluate the others: "
                       r"--conditions \"Non-Defense,PPL-Filter,Static Safety Prompt,Shield only,Spotlighting,"
                       r"Sandwich Prompt,PromptArmor,RobustRAG\"$"):
        run.main(["eval", "--bench", small_bench, "--n-construction", "2"] + common)
    bad = write_lines(tmp_path, [meta, "{not json"], "bad.jsonl")
    for argv, said in [(["train", "--bench", bad] + common[:-1] + ["y"],
                        "bad.jsonl:2: (line): invalid JSON: Expecting property name enclosed in double quotes at "
                        "column 2"),
                       (["eval", "--name", "never", "--model", "tiny", "--llm", "offline",
                         "--runs-dir", str(tmp_path)],
                        f"no finished Shield training; run `python run.py train --name never --runs-dir "
                        f"{shlex.quote(str(tmp_path))}` first (GEO Defender, Shield only, TFSG only need it), or "
                        "evaluate the others: --conditions \"Non-Defense,PPL-Filter,Static Safety Prompt,"
                        "Spotlighting,Sandwich Prompt,PromptArmor,RobustRAG\"")]:
        with pytest.raises(SystemExit) as e:     # what the command line prints: this message, exit status 1
            run.main(argv)
        assert isinstance(e.value.code, str) and e.value.code.strip().endswith(said), e.value.code
        assert e.value.code.startswith("error: ") and "Traceback" not in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--conditions: unknown 'GEO defender'"):
        run.main(["eval", "--conditions", "GEO defender"] + common)


def test_eval_takes_the_trained_runs_settings(tmp_path, monkeypatch, small_bench):
    """`eval --name x` after `train --name x --llm ... --bench ...` evaluates what was trained (the
    README's real-use pair of commands) instead of refusing for settings it was not given again."""
    seen = []
    monkeypatch.setattr(run, "train_shield", lambda r, resume=True: seen.append(r.cfg))
    monkeypatch.setattr(run, "train_tfsg", lambda r: None)
    monkeypatch.setattr(run, "print_summary", lambda s: None)
    monkeypatch.setattr(run, "ranking_stage", lambda *_: None)
    monkeypatch.setattr(run, "evaluate", lambda r, *_: seen.append(r.cfg) or evaluation.Evaluated({}, {}))
    common = ["--name", "x", "--runs-dir", str(tmp_path)]
    run.main(["train", "--model", "tiny", "--llm", "openai-compatible:m", "--base-url", "http://127.0.0.1:9/v1",
              "--bench", small_bench, "--n-construction", "4", "--n-batches", "1", "--lr", "2e-3"] + common)
    for f in ("library/E2.json", "adapter/adapter_config.json", "shield_done.json"):   # what training would leave
        (tmp_path / "x" / f).parent.mkdir(exist_ok=True)
        (tmp_path / "x" / f).write_text("{}")
    run.main(["eval"] + common)
    trained, evaluated = seen
    for k in ("model", "llm", "base_url", "bench", "n_construction", "n_batches", "lr"):
        assert evaluated.flat()[k] == trained.flat()[k], k
    with pytest.raises(SystemExit, match="different llm"):     # a conflicting flag is still refused
        run.main(["eval", "--llm", "offline"] + common)
    for cmd in ("eval", "train"):                              # by the dry runs too: they run every check
        with pytest.raises(SystemExit, match="different llm"):
            run.main([cmd, "--dry-run", "--llm", "offline"] + common)
    with pytest.raises(SystemExit, match="different"):         # so is a preset asked for (tiny-demo: lr 1e-3)
        run.main(["train", "--preset", "tiny-demo"] + common)
    # every training setting the adapter, the library or the cached scores depend on is pinned
    with pytest.raises(SystemExit, match="different max_length, max_grad_norm, monitor_frac, max_initial_rules "
                                         r"\(max_length=8192, max_grad_norm=1.0, monitor_frac=0.2, "
                                         r"max_initial_rules=10\)"):
        run.main(["train", "--max-grad-norm", "2", "--monitor-frac", "0.3", "--max-length", "1024",
                  "--max-initial-rules", "5"] + common)
    # eval of a run not trained yet: refused before anything is recorded, so that the later
    # `train --name y --llm ...` is not refused for settings that a failed eval pinned
    with pytest.raises(SystemExit, match="no TFSG library"):
        run.main(["eval", "--name", "y", "--runs-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no finished Shield training"):
        run.main(["eval", "--name", "y", "--runs-dir", str(tmp_path), "--conditions", "Shield only"])
    assert not os.path.exists(tmp_path / "y" / "config.json")
    # a start that failed before producing anything (here: a hub model that cannot be fetched offline)
    # pins nothing: rerunning with a different --model, as the error suggests, is not refused
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(run, "train_shield", lambda r, resume=True: r.reranker() and   # then a file,
                        # as training leaves
                        store.write_json(os.path.join(r.dir, "checkpoint", "state.json"), {}))
    with pytest.raises(SystemExit, match="--model tiny"):
        run.main(["train", "--stage", "shield", "--name", "z", "--runs-dir", str(tmp_path), "--model", "nobody/none"])
    assert (tmp_path / "z" / "config.json").exists()
    run.main(["train", "--stage", "shield", "--name", "z", "--runs-dir", str(tmp_path), "--model", "tiny"])
    with pytest.raises(SystemExit, match="different model"):  # now the run has produced files: pinned
        run.main(["train", "--stage", "shield", "--name", "z", "--runs-dir", str(tmp_path), "--model", "nobody/none"])
    # a demo records `offline` (its engine's port is never stored): every command takes its settings
    store.write_json(str(tmp_path / "n" / "config.json"), {"config": {"llm": "offline", "ppl_model": "tiny",
                                                                      "model": "tiny"}, "command": "demo"})
    for cls in (settings.EvalConfig, settings.RerankEvalConfig, settings.AttackConfig):
        c = runs.resolve(cls, {"name": "n", "runs_dir": str(tmp_path)})
        assert (c.llm.llm, c.eval.ppl_model, c.model.model) == ("offline", "tiny", "tiny")
        with pytest.raises(dataclasses.FrozenInstanceError):    # settings stay as resolved; state is the Run's
            c.llm = "openai:gpt-5.5"
    # the paper preset is Table A.1, its 4-bit base included; the plain defaults keep bf16
    paper = runs.resolve(settings.TrainConfig, {"name": "p", "runs_dir": str(tmp_path)}, "paper")
    plain = runs.resolve(settings.TrainConfig, {"name": "p", "runs_dir": str(tmp_path)})
    assert (paper.model.quant, plain.model.quant) == ("nf4", "none")
    s = paper.shield
    assert (s.lora_r, s.lora_alpha, s.lora_dropout, s.lr, s.grad_accum, s.beta, s.lam_def, s.lam_util, s.lam_cons,
            s.monitor_frac) == (16, 32, 0.05, 1e-4, 8, 0.1, 1.1, 0.9, 0.15, 0.2)


def test_controller_limits_are_settings():
    """The sizes the paper does not state come from tfsg.Limits (run.py settings, recorded)."""
    rule = R(description="d" * 650, trigger_signals=["s"] * 14)
    assert "description has 650" in tfsg.validate_rule(rule)
    loose = tfsg.Limits(rule_description_chars=700, rule_max_signals=20)
    assert tfsg.validate_rule(rule, limits=loose) is None
    C = tfsg.Controller(limits=tfsg.Limits(max_active_rules=1, reject_duplicate_rules=False))
    lib, rep = C.apply(tfsg.ExperienceLibrary.empty(), [{"action": "add_rule", "rule": R(description="same")},
                                                       {"action": "add_rule", "rule": R(description="other")}])
    assert len(lib.active()) == 1 and "library is full (1 active rules)" in rep.rejected[0]["reason"]
    C2 = tfsg.Controller(limits=tfsg.Limits(reject_duplicate_rules=False))
    lib, rep = C2.apply(tfsg.ExperienceLibrary.empty(), [{"action": "add_rule", "rule": R(description="same")}] * 2)
    assert len(lib.active()) == 2
    case = {"case_id": "c", "query": "q", "outcome": "success", "docs": ["a" * 3000], "labels": ["benign"],
            "trace": {"answer": "", "cited": [], "per_doc_decision": [], "used_rule_ids": [], "reasoning": "r" * 5000}}
    v = tfsg._case_view(case, tfsg.Limits(analyzer_doc_chars=100, analyzer_reasoning_chars=50))
    assert len(v["search_results"][0]["text"]) == 100 and len(v["reasoning_content"]) == 50
    cfg = settings.EvalConfig(max_active_rules=7, analyzer_doc_chars=99)
    assert runs.Run(cfg).limits == tfsg.Limits(max_active_rules=7, analyzer_doc_chars=99)
    assert {"max_active_rules", "analyzer_doc_chars", "rule_item_chars"} <= set(settings.EvalConfig.pinned())


def test_edited_benchmark_is_refused_not_mixed(tmp_path, small_bench):
    """The benchmark's content is pinned with the run: the same path with other content is refused
    once the run has produced something (its results belong to the old content)."""
    bench = tmp_path / "b.jsonl"
    shutil.copy(small_bench, bench)
    cfg = settings.EvalConfig(name="e", runs_dir=str(tmp_path), bench=str(bench))
    runs.Run(cfg).record("train")
    rec = json.load(open(tmp_path / "e" / "config.json"))
    assert rec["bench_sha1"] == store.file_sha1(str(bench))
    runs.Run(cfg).record("eval")                               # unchanged: fine
    (tmp_path / "e" / "results").mkdir()
    (tmp_path / "e" / "results" / "x.jsonl").write_text("{}\n")
    bench.write_text(bench.read_text().replace('"query": "', '"query": "edited ', 1))
    with pytest.raises(runs.SettingsError,
                       match=r"b.jsonl: its content changed since this run used it \(SHA-1 [0-9a-f]{12}, now"):
        runs.Run(cfg).record("eval")


def _try_lock(run_dir):
    """run_lock on `run_dir` -> 'got it', or the refusal's message."""
    try:
        with runs.run_lock(run_dir):
            return "got it"
    except runs.RunInUse as e:
        return str(e)


def _hold_lock(run_dir, held):
    """Hold run_lock on `run_dir`, set `held`, and wait to be killed."""
    with runs.run_lock(run_dir):
        held.set()
        time.sleep(60)


def test_one_writer_per_run_folder(tmp_path, small_bench, capsys):
    """A second command on a run folder in use is refused at once, naming the holder; the lock dies
    with its process (no stale lock after a crash). The other processes are forked children (the
    lock is the operating system's, per process, as between commands), the real command runs here."""
    d = tmp_path / "r"
    with runs.run_lock(str(d), command="train"):
        kind, out = _in_a_child(_try_lock, str(d))
        assert kind == "returned" and "in use by pid" in out and "(train)" in out and "use another --name" in out
        # a real command on the same folder: refused before it writes anything, a sentence, no traceback
        with pytest.raises(SystemExit, match="in use by pid") as e:
            run.main(["demo", "--out", str(tmp_path), "--name", "r", "--bench", small_bench,
                      "--n-construction", "4", "--n-seed-cases", "3", "--batch-size", "3"])
        assert isinstance(e.value.code, str) and "Traceback" not in capsys.readouterr().err
        assert not os.path.exists(d / "config.json")
    assert _in_a_child(_try_lock, str(d)) == ("returned", "got it")
    with runs.run_lock(str(d), shared=True):      # a reader (serve, export) holds it: no gone writer is named
        kind, out = _in_a_child(_try_lock, str(d))
        assert kind == "returned" and "in use by another process" in out
    ctx = multiprocessing.get_context("fork")
    held = ctx.Event()
    killed = ctx.Process(target=_hold_lock, args=(str(d), held))
    killed.start()
    assert held.wait(60)
    assert "in use by pid" in _try_lock(str(d))
    killed.kill()
    killed.join()
    assert _in_a_child(_try_lock, str(d)) == ("returned", "got it")
    killed = ctx.Process(target=_hold_lock, args=(str(d), ctx.Event()))      # a writer killed leaves its name;
    killed.start()                                                          # a reader then holds the folder
    while "pid" not in (d / runs.LOCK).read_text():
        time.sleep(0.01)
    killed.kill()
    killed.join()
    with runs.run_lock(str(d), shared=True):
        kind, out = _in_a_child(_try_lock, str(d))
        assert kind == "returned" and "in use by another process (a reader" in out and "pid" not in out


def test_transfer_libraries_are_validated_up_front(tmp_path, demo_run):
    c = json.load(open(demo_run / "config.json"))["config"]
    cfg = lambda t: settings.EvalConfig(**{**c, "runs_dir": str(demo_run.parent), "transfer": t})
    for content, msg in [('{"a": 1}', "rules: an experience library is a JSON object"),
                         ("not json", "not a JSON library"),
                         ('{"rules": [{"rule_id": "R1"}]}', "not a valid library"), ("[]", "rules:")]:
        p = tmp_path / "lib.json"
        p.write_text(content)
        with pytest.raises(runs.SettingsError, match=f"--transfer x: .*{msg}"):
            evaluation.transfer_items(runs.Run(cfg(f"x={p}")))
    assert evaluation.transfer_items(runs.Run(cfg(f"x={demo_run / 'library' / 'E4.json'}")))[0][0] == "x"


def test_failed_eval_records_no_settings(demo_run, tmp_path, monkeypatch):
    """An eval whose judge cannot be reached records no judge in results/settings.json, so the next
    plain eval is not refused for records that do not exist. The demo's reranker and perplexity scores
    come along (its cache/ without the LLM replies), and the closed port is retried without backoff
    waits: neither is what the records hold."""
    _backoff_without_waiting(monkeypatch)
    for d in ("_tiny_qwen3", "_tiny_gpt2"):
        shutil.copytree(demo_run.parent / d, tmp_path / d)
    for d in ("adapter", "library"):
        shutil.copytree(demo_run / d, tmp_path / "f" / d)
    shutil.copytree(demo_run / "cache", tmp_path / "f" / "cache", ignore=shutil.ignore_patterns("llm"))
    c = json.load(open(demo_run / "config.json"))["config"]
    c.update(name="f", runs_dir=str(tmp_path), max_test_groups=1, conditions="Non-Defense", llm="offline",
             base_url=None)
    with pytest.raises(llm_clients.LLMError, match="ConnectionError on http://127.0.0.1:9/v1"):
        evaluation.evaluate(runs.Run(settings.EvalConfig(**{**c, "judge": "openai-compatible:gone",
                                           "base_url": "http://127.0.0.1:9/v1"}))).summary
    # the clean reference's records were written (no judge call: the attack is not in them): the
    # token cap is recorded, the judge that never scored a record is not
    assert json.load(open(tmp_path / "f" / "results" / "settings.json")) == {"max_tokens": c["max_tokens"]}
    s = evaluation.evaluate(runs.Run(settings.EvalConfig(**c))).summary
    assert s["judge"] == "offline:offline-engine"
    assert json.load(open(tmp_path / "f" / "results" / "settings.json"))["judge"] == "offline"


def test_a_prompt_length_that_leaves_no_room_for_the_document_is_an_error(tiny_dir):
    rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    fixed = len(rr.prefix_ids) + len(rr.suffix_ids)
    with pytest.raises(reranker.PromptLengthError, match="leaves no room"):
        reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32, max_length=fixed)
    rr.max_length = fixed + 20                            # the instruction alone is longer than 20 tokens
    with pytest.raises(reranker.PromptLengthError, match="leaves the document no tokens"):
        rr.tokenize("a query", ["a document " * 50])
    rr.max_length = 300
    assert rr.overflow("q", ["short", "long " * 500,
                             "long " * 400]) == 2 and len(rr.tokenize("q", ["long " * 500])[0]) == 300


def test_a_k_out_of_range_is_refused():
    with pytest.raises(runs.SettingsError, match="--k 10"):
        settings.EvalConfig(k=10)


def test_a_run_name_that_is_not_one_folder_is_refused():
    for name in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(runs.SettingsError, match="a run name is"):
            settings.EvalConfig(name=name)


def test_a_bad_run_name_is_refused_before_a_file_under_it_is_read(tmp_path, capsys):
    """eval takes its run's recorded settings from <runs-dir>/<name>/config.json: --name ../x is refused
    before that file (outside --runs-dir) is read or named."""
    (tmp_path / "x").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"config": {"base_url": "https://***@elsewhere"}}))
    with pytest.raises(runs.SettingsError, match="a run name is"):
        runs.resolve(settings.EvalConfig, {"runs_dir": str(tmp_path / "runs"), "name": "../x"})
    assert "config.json" not in capsys.readouterr().err


def test_a_hash_in_a_doc_id_is_refused(tmp_path):
    g = good_group()
    g["docs"][4]["doc_id"] = "g1-2#A"                     # would count as the attack's citation
    with pytest.raises(geodef.BenchFormatError, match=r":1: docs\[4\].doc_id: 'g1-2#A': '#' is reserved"):
        geodef.load_bench(write_lines(tmp_path, [g], "hash.jsonl"))


def test_lone_surrogates_in_a_bench_file_are_refused(tmp_path):
    p = tmp_path / "sur.jsonl"
    g = good_group()
    p.write_text(json.dumps(g).replace("doc g1 3 text", "doc \\ud800 3"), encoding="utf-8")
    with pytest.raises(geodef.BenchFormatError, match=r"docs\[3\].text: not valid Unicode text"):
        geodef.load_bench(str(p))


def test_compare_keeps_runs_of_the_same_folder_name(tmp_path):
    s = {"target_llm": "x:A", "notes": [],
         "conditions": {k: {"ASR": 1.0, "ASI": 1.0, "BER": 1.0} for k in evaluation.CONDITIONS}}
    for parent in ("p", "q"):
        os.makedirs(tmp_path / parent / "x")
        store.write_json(str(tmp_path / parent / "x" / "summary.json"), {**s, "target_llm": f"{parent}:A"})
    path = run.main(["compare", "--runs", f"{tmp_path / 'p' / 'x'},{tmp_path / 'q' / 'x'}", "--out",
                     str(tmp_path / "c")])
    text = open(path).read()
    assert "| p:A |" in text and "| q:A |" in text


def test_eval_takes_the_ppl_model_of_the_trained_run(tmp_path):
    store.write_json(str(tmp_path / "t" / "config.json"), {"command": "train", "config": {
        "model": "tiny", "ppl_model": "tiny", "judge": "offline", "base_url": "http://***@host/v1"}})
    # a base URL stored without its credentials is given again where a client is built, not replaced by the
    # provider's default URL; a command that builds none (rerank-eval) is not asked for it
    stored = runs.resolve(settings.EvalConfig, {"name": "t", "runs_dir": str(tmp_path), "bench": SAMPLE})
    with pytest.raises(runs.SettingsError, match=r"stored in config.json without its credentials; give --base-url"):
        runs.Run(stored).llm("vllm:m")
    rerank = runs.resolve(settings.RerankEvalConfig, {"name": "t", "runs_dir": str(tmp_path)})
    assert rerank.llm.base_url.host == "host"
    cfg = runs.resolve(settings.EvalConfig, {"name": "t", "runs_dir": str(tmp_path), "base_url": "http://u:p@host/v1"})
    assert (cfg.eval.ppl_model, cfg.judge.judge, cfg.llm.base_url.host) == ("tiny", "offline", "host")
    runs.Run(cfg.replace(base_url="http://user:pw@host/v1", bench=SAMPLE)).record("eval")
    assert json.load(open(tmp_path / "t" / "config.json"))["config"]["base_url"] == "http://***@host/v1"


def test_a_demo_rerun_with_settings_its_records_refuse_records_nothing(demo_run, small_bench, tmp_path):
    """demo runs eval's checks with training's before it records its settings: a rerun asking for another
    --max-tokens than its records were made with is refused with config.json as it was."""
    shutil.copytree(demo_run.parent, tmp_path / "o")
    before = (tmp_path / "o" / "demo" / "config.json").read_text()
    with pytest.raises(SystemExit, match="max_tokens"):        # demo_run's command (conftest.py), one flag more
        run.main(["demo", "--out", str(tmp_path / "o"), "--bench", small_bench, "--n-construction", "4",
                  "--n-seed-cases", "3", "--batch-size", "3", "--n-batches", "3", "--n-boot", "200",
                  "--max-tokens", "100"])
    assert (tmp_path / "o" / "demo" / "config.json").read_text() == before


def test_records_made_with_another_library_or_adapter_are_not_resumed(demo_run, tmp_path):
    """eval resumes its records one by one: after the library (or the Shield) is trained again, the records
    the old one made would be reused as its own; refused, naming what changed."""
    shutil.copytree(demo_run.parent, tmp_path / "o")
    run_dir = tmp_path / "o" / "demo"
    argv = ["eval", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--dry-run"]
    run.main(argv)                                                       # as evaluated: nothing refused
    epochs = [p for p in (run_dir / "library").glob("E*.json") if p.stem[1:].isdigit()]
    lib = max(epochs, key=lambda p: int(p.stem[1:]))                     # the final library
    lib.write_text(lib.read_text() + "\n")                              # another library's bytes
    with pytest.raises(SystemExit, match="library"):
        run.main(argv)


@pytest.mark.parametrize("text, msg", [
    ("{bad", ": not JSON"), ("[1, 2]", ": no settings object"),
    # values of another type, by hand: refused naming the record, not read as 1 or met as a TypeError later
    ('{"config": {"n_boot": "abc"}}', r" records n_boot: .*--n-boot 'abc' \(not a whole number\)"),
    ('{"config": {"k": true}}', r" records k: .*--k True \(not a whole number\)"),
    ('{"config": {"k": null}}', r" records k: .*--k None \(not a whole number\)"),
    ('{"config": {"judge": 5}}', r" records judge: .*--judge 5 \(not text\)"),
    # a spec's parser took any object as parsed already (true met .strip() later; a dict read as its keys)
    ('{"config": {"base_url": true, "llm": "vllm:m"}}', r" records base_url: --base-url True \(not text\)"),
    ('{"config": {"seen_methods": {"GEO": 1}}}', r" records seen_methods: --seen-methods \{'GEO': 1\} \(not text\)"),
    ('{"config": {"timeout": 1' + "0" * 400 + '}}', r" records timeout: .*\(not a finite number\)")])
def test_a_broken_record_is_one_line_naming_it(tmp_path, text, msg):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(text)
    with pytest.raises(runs.SettingsError, match=f"x/config.json{msg}"):
        runs.resolve(settings.EvalConfig, {"runs_dir": str(tmp_path), "name": "x"})


def test_the_offline_flag_reads_the_provider_of_every_llm_role(tmp_path):
    """config.json's `offline` says whether any LLM role is the offline engine, by its provider: a real model
    named my-offline-model is not, an offline judge is."""
    cfg = settings.EvalConfig(name="x", runs_dir=str(tmp_path), llm="vllm:my-offline-model",
                              model="Qwen/Qwen3-Reranker-0.6B")
    assert not runs.Run(cfg).offline and runs.Run(cfg.replace(judge="offline")).offline


def test_a_damaged_json_file_of_the_run_is_one_line_naming_it(tmp_path, capsys):
    """The demo reading a config.json cut short (a full disk, an edit by hand) exits with one line naming the
    file, not json's traceback without it."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text('{"config": {"n')
    with pytest.raises(SystemExit, match=r"error: .*demo/config\.json: not JSON"):
        run.main(["demo", "--out", str(tmp_path)])


def test_a_model_folder_whose_weights_changed_is_refused_by_the_runs_record(tmp_path):
    """The record keeps the local model folder's weights (files, sizes, times and their SHA-1): a folder
    rewritten with other weights is refused once the run has produced something (its cached scores would be
    stale); the same bytes written again (a new time) are the same weights."""
    import tiny
    folder = tiny.make_tiny_checkpoint(str(tmp_path / "m"), seed=0)
    cfg = settings.TrainConfig(name="t", runs_dir=str(tmp_path / "runs"), model=folder, bench=SAMPLE)
    runs.Run(cfg).record("train")
    (tmp_path / "runs" / "t" / "cache").mkdir()
    (tmp_path / "runs" / "t" / "cache" / "scores_base.json").write_text("{}")        # something produced
    weights = os.path.join(folder, "model.safetensors")
    os.utime(weights, ns=(0, 10 ** 9))                                               # the same bytes, a new time
    hashed, sha1 = [], hashlib.sha1
    with unittest.mock.patch("hashlib.sha1", lambda *a: hashed.append(1) or sha1(*a)):
        runs.Run(cfg).record("train")                  # checked and recorded, the bytes read once
        runs.Run(cfg).record("train")                  # the new time recorded: not read again
    assert len(hashed) == 1
    shutil.rmtree(folder)
    tiny.make_tiny_checkpoint(folder, seed=1)                                        # other weights, same folder
    with pytest.raises(runs.SettingsError, match="its weights changed since this run used them"):
        runs.Run(cfg).check_record()
    shutil.rmtree(folder)                                                            # the folder gone (moved)
    with pytest.raises(runs.SettingsError, match="no longer the folder this run used"):
        runs.Run(cfg).check_record()


def test_a_hub_models_commit_is_recorded_at_its_first_load_and_pinned(tmp_path, tiny_dir, monkeypatch):
    """A hub id without --revision resolves to the hub's main: the first load records its commit, and once the
    run has produced something a load that resolves another (a push since) is refused, naming --revision."""
    got = {"sha": "a" * 40}

    def load(*a, **k):
        rr = real(tiny_dir, dtype=torch.float32)
        rr.revision = got["sha"]
        return rr
    real = reranker.Reranker.from_pretrained
    monkeypatch.setattr(reranker.Reranker, "from_pretrained", load)
    cfg = settings.TrainConfig(name="t", runs_dir=str(tmp_path), model="Org/Reranker", bench=SAMPLE)
    got["sha"] = "0" * 40
    with runs.Run.open(cfg, "train") as run:                # a first attempt that makes nothing
        run.reranker()
    got["sha"] = "a" * 40
    with runs.Run.open(cfg, "train") as run:                # nothing made yet: the commit it loads is the run's
        run.reranker()
    assert store.read_json(str(tmp_path / "t" / "config.json"))["weights"] == {"revision": "a" * 40}
    (tmp_path / "t" / "results").mkdir()
    (tmp_path / "t" / "results" / "x.jsonl").write_text("")                          # something produced
    with runs.Run.open(cfg, "train") as run:                                         # recorded again: kept
        run.reranker()
    got["sha"] = "b" * 40
    with runs.Run.open(cfg, "train") as run, pytest.raises(runs.SettingsError, match=f"--revision {'a' * 40}"):
        run.reranker()


def test_a_train_record_keeps_the_settings_eval_recorded(tmp_path):
    """train rewrites config.json with its settings: eval's (the judge, n_boot), which train has no field for,
    stay, so a later eval takes them from the record instead of its defaults (refused by its own records)."""
    store.write_json(str(tmp_path / "t" / "config.json"), {"command": "eval", "config": {
        "model": "tiny", "judge": "offline:judge2", "n_boot": 500}})
    runs.Run(settings.TrainConfig(name="t", runs_dir=str(tmp_path), model="tiny", bench=SAMPLE)).record("train")
    cfg = runs.resolve(settings.EvalConfig, {"name": "t", "runs_dir": str(tmp_path)})
    assert (cfg.judge.judge, cfg.rerank.n_boot) == ("offline:judge2", 500)


def test_build_bench_never_destroys_an_existing_file(tmp_path, server):
    out = tmp_path / "bench.jsonl"
    out.write_text("precious\n")
    src = write_lines(tmp_path, [{"query": "q", "docs": ["only one"]}], "src.jsonl")
    from test_pipeline import bb_config
    with pytest.raises(runs.SettingsError, match="leave none for the test split"):
        build_bench.build_bench(runs.Run(bb_config(tmp_path, server, src, str(out))))
    assert out.read_text() == "precious\n" and [f for f in os.listdir(tmp_path) if ".tmp" in f] == []
    for rows, msg in [([{"query": "q", "docs": [1, 2]}], r"docs\[0\]: text and url must be strings"),
                      ([{"query": "q", "sources": "x"}], "sources: expected a list"),
                      ([{"query": "q", "docs": ["a\ud800"]}], r"docs\[0\]: not valid Unicode")]:
        p = tmp_path / "rows.jsonl"
        p.write_text("\n".join(json.dumps(r) for r in rows))
        with pytest.raises(geodef.BenchFormatError, match=msg):
            build_bench.read_rows(str(p))


def test_checkpoint_is_whole_or_absent(tmp_path, tmp_path_factory, small_bench, monkeypatch):
    """A kill while a checkpoint is written leaves the previous one whole: the resumed run trains to
    the same adapter as an uninterrupted one (the session's one uninterrupted run of these settings,
    test_pipeline.trained_shield)."""
    from safetensors.torch import load_file
    from test_pipeline import SHIELD_KW, trained_shield
    kw = dict(runs_dir=str(tmp_path), bench=small_bench, **SHIELD_KW)
    full = trained_shield(tmp_path_factory, small_bench)
    real, n = os.replace, {"k": 0}

    def dying(a, b):
        if str(b).endswith("state.safetensors"):
            n["k"] += 1
            if n["k"] == 2:                                       # the second checkpoint: killed mid-write
                raise KeyboardInterrupt
        return real(a, b)
    monkeypatch.setattr(run.os, "replace", dying)
    with pytest.raises(KeyboardInterrupt):
        train.train_shield(runs.Run(settings.EvalConfig(name="cut", **kw)))
    monkeypatch.setattr(run.os, "replace", real)
    assert os.listdir(tmp_path / "cut" / "checkpoint") == ["state.safetensors"] or \
        "state.safetensors" in os.listdir(tmp_path / "cut" / "checkpoint")
    train.train_shield(runs.Run(settings.EvalConfig(name="cut", **kw)))
    a = load_file(full / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_flags_or_files_are_sentences_not_tracebacks(tmp_path, small_bench):
    f = tmp_path / "afile"
    f.write_text("x")
    prices = tmp_path / "prices.json"
    prices.write_text("{bad")
    common = ["--runs-dir", str(tmp_path), "--name", "t", "--model", "tiny"]
    cases = [(["demo", "--out", str(f)], "a file, not a folder"),
             (["train", "--bench", str(tmp_path)] + common, "a folder, not a file"),
             (["train", "--device", "foo"] + common, "--device 'foo': not a torch device"),
             (["train", "--llm", "foo:bar", "--bench", small_bench] + common, "unknown provider 'foo'"),
             (["train", "--llm", "openai", "--bench", small_bench] + common, "give provider:model"),
             (["train", "--llm", "openai-compatible:m", "--bench", small_bench] + common, "needs base_url"),
             (["train", "--prices", str(prices), "--bench", small_bench] + common, "not JSON"),
             (["train", "--prices", str(tmp_path / "none.json"), "--bench", small_bench] + common, "no such file"),
             (["serve-offline", "--port", "70000"], "out of range")]
    # prices past float's range or past any price (an infinite cost), a batch share over 1, a file nested past the
    # parser's depth: named as --prices
    for i, text in enumerate(['{"m": [1e400, 10]}', '{"m": [1e308, 1e308]}', '{"m": [1, ' + "9" * 400 + "]}",
                              '{"m": [1.25, 10, 7]}', "[" * 100000 + "]" * 100000]):
        (tmp_path / f"p{i}.json").write_text(text)
        cases.append((["train", "--prices", str(tmp_path / f"p{i}.json"), "--bench", small_bench] + common,
                      r"^error: --prices "))
    for argv, msg in cases:
        with pytest.raises(SystemExit, match=msg):
            run.main(argv)


def test_a_busy_port_is_a_sentence_not_a_traceback():
    """serve-offline on a port another socket listens on ends with a sentence (SystemExit's message,
    exit status 1), not a traceback; in a forked child, so that a server that did start is killed."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        kind, said = _in_a_child(run.main, ["serve-offline", "--port", str(s.getsockname()[1])])
        assert kind == "exit" and isinstance(said, str) and "cannot listen" in said, said
    finally:
        s.close()


def test_hostile_bench_json_is_a_line_error(tmp_path):
    g = good_group()
    deep = "[" * 100000 + "]" * 100000
    for line, msg in [('{"group_id": ' + "1" * 5000 + "}", "4300"),
                      ('{"group_id": ' + deep + "}", "nested too deeply")]:
        p = write_lines(tmp_path, [json.dumps(g), line])
        with pytest.raises(geodef.BenchFormatError, match=rf"b\.jsonl:2: \(line\): invalid JSON: .*{msg}"):
            geodef.load_bench(p)


def test_metadata_must_be_the_first_line(tmp_path):
    g = good_group()
    meta = {"_meta": {"methods": sorted(g["attacks"])}}
    p = write_lines(tmp_path, [json.dumps(meta), json.dumps({"_meta": {"synthetic": True}}), json.dumps(g)])
    with pytest.raises(geodef.BenchFormatError, match=r":2: _meta: metadata must be the first line, and only there"):
        geodef.load_bench(p)


def test_hostile_library_json_meets_its_caps_first(tmp_path):
    deep = "[" * 100000 + "]" * 100000
    lib = tmp_path / "lib.json"
    lib.write_text('{"rules": ' + deep + "}")
    with pytest.raises(tfsg.LibraryError, match="nested too deeply"):
        tfsg.load_library(str(lib))
    rule = {"rule_id": "R1", "rule_type": "attack_pattern", "description": "d", "trigger_signals": ["s"],
            "action": "filter", "strength": "weak", "status": "removed"}
    lib.write_text(json.dumps({"rules": [rule] * (tfsg.MAX_LIBRARY_RULES + 1)}))
    t0 = time.monotonic()
    with pytest.raises(tfsg.LibraryError, match="at most 10000"):
        tfsg.load_library(str(lib))
    assert time.monotonic() - t0 < 2
    lib.write_text(" " * (tfsg.MAX_LIBRARY_BYTES + 1))
    with pytest.raises(tfsg.LibraryError, match="bytes"):
        tfsg.load_library(str(lib))


def test_resumed_run_reports_the_whole_runs_usage(demo_run, tmp_path):
    """summary.json's usage is the run folder's over all invocations (the usage ledger), so a rerun
    that takes everything from the cache reports the same cost as the run that paid it."""
    d = tmp_path / "demo"
    shutil.copytree(demo_run, d)
    first = json.load(open(d / "summary.json"))["usage"]
    assert first["total"]["replies"] > 0 and set(first["stages"]) == {"train", "eval"}
    stages = first["stages"].values()
    assert first["total"]["prompt_tokens"] == sum(v["prompt_tokens"] for m in stages for v in m.values())
    shutil.copytree(demo_run.parent / "_tiny_qwen3", tmp_path / "_tiny_qwen3")
    shutil.copytree(demo_run.parent / "_tiny_gpt2", tmp_path / "_tiny_gpt2")
    cfg = json.load(open(d / "config.json"))["config"]
    cfg.update(runs_dir=str(tmp_path))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"offline-engine": [1.0, 2.0]}))
    again = evaluation.evaluate(runs.Run(settings.EvalConfig(**{**cfg, "prices": str(prices)}))).summary
    assert {k: v for k, v in again["usage"]["total"].items() if k != "cost_usd"} == \
        {k: v for k, v in first["total"].items() if k != "cost_usd"}
    t = again["usage"]["total"]
    assert t["cost_usd"] == pytest.approx((t["prompt_tokens"] * 1 + t["completion_tokens"] * 2) / 1e6)
    assert f"| total |  | {t['replies']} |" in (d / "report.md").read_text()


def _demo_with_a_full_disk(argv, said):
    """run.main(argv) with the LLM reply cache failing as a full disk does after 20 replies; the
    SystemExit's message sent on `said`, then raised (a process ends on it). For a forked child: torch
    on one thread, as a fork keeps none of its parent's thread pool."""
    torch.set_num_threads(1)
    real, n = llm_clients.ReplyCache.put, [0]

    def full(self, key, reply, *a):
        n[0] += 1
        if n[0] > 20:
            raise OSError(28, "No space left on device")
        return real(self, key, reply, *a)
    llm_clients.ReplyCache.put = full
    try:
        run.main(argv)
    except SystemExit as e:
        said.send(str(e.code))
        raise


def test_demo_ends_within_seconds_after_an_error_in_the_llm_phase(demo_run, tmp_path):
    """A full disk while eval writes the LLM cache: the error is printed and the process ends (the
    loopback engine is closed, so queued requests fail at once instead of waiting out timeouts). The
    process is a forked child: it ends as an interpreter does (its threads joined, the executors'
    exit hooks run), without a fresh interpreter's seconds of imports."""
    shutil.copytree(demo_run.parent, tmp_path / "o")
    d = tmp_path / "o" / "demo"
    shutil.rmtree(d / "results")
    shutil.rmtree(d / "cache" / "llm")
    argv = ["demo", "--out", str(tmp_path / "o"), "--bench", json.load(open(d / "config.json"))["config"]["bench"],
            "--n-construction", "4", "--n-seed-cases", "3", "--batch-size", "3", "--n-batches", "3", "--n-boot", "200"]
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_demo_with_a_full_disk, args=(argv, send))
    t0 = time.monotonic()
    p.start()
    p.join(120)
    ended = p.exitcode is not None
    if not ended:
        p.kill()
        p.join()
    said = recv.recv() if recv.poll() else ""
    assert ended and p.exitcode != 0 and "No space left on device" in said, said
    assert time.monotonic() - t0 < 60


def test_run_folder_moved_with_its_benchmark_elsewhere_is_accepted(tmp_path, small_bench):
    """The benchmark is pinned by content: the same file at another path (a clone elsewhere) resumes;
    other content at the same path is still refused."""
    cfg = settings.EvalConfig(name="r", runs_dir=str(tmp_path), bench=small_bench)
    runs.Run(cfg).record("train")
    (tmp_path / "r" / "adapter").mkdir()
    (tmp_path / "r" / "adapter" / "x").write_text("made")
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(small_bench, moved)
    runs.Run(settings.EvalConfig(name="r", runs_dir=str(tmp_path), bench=str(moved))).record("train")
    moved.write_text(open(small_bench).read().replace("a", "b", 1))
    with pytest.raises(runs.SettingsError, match="different bench|content changed"):
        runs.Run(settings.EvalConfig(name="r", runs_dir=str(tmp_path), bench=str(moved))).record("train")


def _write_past_4096_bytes(d):
    """Each writer past a 4096-byte RLIMIT_FSIZE (this process's) -> its OSErrors as 'strerror filename'."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    said = []
    for write in (lambda: store.atomic_write(d + "/a.json", "x" * 10000),
                  lambda: store.append_jsonl(d + "/b.jsonl", {"x": "y" * 10000}),
                  lambda: accounting.append_ledger(d + "/u.jsonl", {"x": "y" * 10000}),
                  lambda: llm_clients.ReplyCache(d + "/c").put_raw("ab" * 32, {"x": "y" * 10000})):
        try:
            write()
        except OSError as e:
            said.append(f"{e.strerror} {e.filename}")
    return said


def test_a_write_past_the_file_size_limit_names_its_file(tmp_path):
    """write() on a full disk or past RLIMIT_FSIZE raises OSError without a file name; the one-line
    error names the file (atomic_write, record appends, the reply cache, the ledger). The limit is set
    in a forked child: it holds for the whole process."""
    kind, lines = _in_a_child(_write_past_4096_bytes, str(tmp_path))
    assert kind == "returned", lines
    assert len(lines) == 4 and all(l.startswith("File too large ") for l in lines), lines
    assert [l.split(" ", 3)[-1].rsplit("/", 1)[-1] for l in lines][:3] == ["a.json", "b.jsonl", "u.jsonl"]
    assert lines[3].endswith(".json") and "/c/ab/" in lines[3]


def test_every_flag_parses_to_its_fields_type():
    """A flag's type is its field's declared type: --timeout (default None) is a float, not a string."""
    args = run.parser().parse_args(["train", "--timeout", "5", "--k", "3", "--lr", "0.5"])
    assert args.timeout == 5.0 and isinstance(args.timeout, float)
    assert runs.resolve(settings.TrainConfig, run.given(args, settings.TrainConfig)).request.timeout == 5.0
    for f in settings.flags(settings.TrainConfig):
        if f.type in (int, float):
            v = getattr(run.parser().parse_args(["train", "--" + f.name.replace("_", "-"), "3"]), f.name)
            assert type(v) is f.type, f.name


def _backoff_without_waiting(monkeypatch):
    """Every Transport made from now on records its backoff waits instead of sleeping them (a refused
    connection is retried at once) -> the list of waits."""
    waits, made = [], llm_clients.Transport.__init__

    def init(self, *a, **k):
        made(self, *a, **k)
        self.sleep = waits.append
    monkeypatch.setattr(llm_clients.Transport, "__init__", init)
    return waits


@pytest.mark.parametrize("pw", ["p,w0rdZ", "p@ssw0rdZ", "p#w0rdZ", "p/w0rdZ", "p?w0rdZ", "p:w0rdZ"])
def test_no_password_shape_is_stored_or_printed(tmp_path, pw, capsys, monkeypatch):
    """A password with ',', '@', '#', '/', '?' or ':' reaches neither config.json nor any message, for
    --base-url, --reranker, tei: and tavily: specs: printable forms come from the parsed endpoint, and a
    URL that does not parse is printed without its userinfo. The rerank commands reach the closed port
    127.0.0.1:9 and retry without their backoff waits (seconds that only wait)."""
    _backoff_without_waiting(monkeypatch)
    url = f"http://usr:{pw}@127.0.0.1:9/v1"
    said = []
    for argv in (["eval", "--dry-run", "--llm", "openai-compatible:m", "--base-url", url],
                 ["rerank-eval", "--reranker", url + "/rerank"], ["rerank-eval", "--reranker", f"tei:{url}"],
                 ["rerank-eval", "--reranker", f"lab={url}"],
                 ["build-bench", "--input", SAMPLE, "--output", str(tmp_path / "b.jsonl"), "--search",
                  f"tavily:{url}", "--dry-run"]):
        try:
            run.main(argv + ["--runs-dir", str(tmp_path), "--name", "x"])
        except SystemExit as e:
            said.append(str(e))
        except Exception as e:           # any traceback would print the spec too
            said.append(repr(e))
    out = capsys.readouterr()
    assert "w0rdZ" not in "".join(said) + out.out + out.err, said
    try:
        cfg = settings.EvalConfig(name="c", runs_dir=str(tmp_path), base_url=url, reranker=[url, f"tei:{url}"])
    except runs.SettingsError:
        return
    runs.Run(cfg).record("eval")
    assert "w0rdZ" not in open(tmp_path / "c" / "config.json").read()


def test_no_secret_in_a_url_without_a_scheme_or_a_flag_error_is_printed(tmp_path, capsys):
    """A URL typed without '://' (--base-url, --reranker, tei:, --search), and any value argparse
    refuses (a flag the command does not take, a bad int, float or choice, an explicit argument to a
    switch, an unknown command) may hold a secret: none reaches a message. Flag names and a flag's
    choices still do."""
    spec = "usr:p@ssS3cret@127.0.0.1:1/v1"
    common = ["--runs-dir", str(tmp_path), "--name", "x"]
    said = []
    for argv in (["train", "--base-url", spec] + common, ["train", "--base-url", "http:/" + spec] + common,
                 ["train", "--base-url", "http//" + spec] + common, ["rerank-eval", "--reranker", spec] + common,
                 ["rerank-eval", "--reranker", "tei:" + spec] + common,
                 ["build-bench", "--search", "tavily:" + spec] + common,
                 ["train", "--api-key", "p@ssS3cret"], ["train", "--api-key=p@ssS3cret"],
                 ["train", "--epochs", "p@ssS3cret"], ["train", "--timeout", "p@ssS3cret"],
                 ["train", "--stage", "p@ssS3cret"], ["train", "--no-resume=p@ssS3cret"], ["p@ssS3cret"],
                 ["train", "--llm", spec] + common, ["train", "--llm", "openai:m@" + spec] + common):
        with pytest.raises(SystemExit) as e:
            run.main(argv)
        said.append(str(e.value.code))
    out = capsys.readouterr()
    printed = "\n".join(said) + out.out + out.err
    assert "S3cret" not in printed and "***@127.0.0.1:1/v1" in printed
    assert "unrecognized arguments: --api-key ***\n" in printed and "unrecognized arguments: --api-key=***" in printed
    assert "invalid choice: *** (choose from 'all', 'shield', 'tfsg')" in printed


def test_a_float_that_is_not_finite_is_refused_up_front(tmp_path):
    """--timeout inf passed `> 0` and failed at the first socket (OverflowError); every float setting
    refuses inf and nan."""
    with pytest.raises(SystemExit, match=r"--timeout inf \(not a finite number\)"):
        run.main(["train", "--timeout", "inf", "--bench", str(tmp_path / "none.jsonl"), "--runs-dir", str(tmp_path)])
    for name in ("temperature", "rpm", "lr", "beta", "lam_def", "max_grad_norm", "batch_deadline", "lora_dropout"):
        for v in (float("inf"), float("nan")):
            with pytest.raises(runs.SettingsError, match=f"--{name.replace('_', '-')} {v} .not a finite number"):
                settings.EvalConfig(**{name: v})


def test_a_wait_a_socket_cannot_take_is_refused_up_front():
    """A wait (timeout, batch poll) is at most MAX_WAIT seconds."""
    with pytest.raises(runs.SettingsError, match=r"--timeout 1e\+30 \(seconds, more than 0 and at most 86400\)"):
        settings.EvalConfig(timeout=1e30)
    with pytest.raises(runs.SettingsError, match="--batch-poll 1000000000.0"):
        settings.EvalConfig(batch_poll=1e9)
    assert settings.EvalConfig(timeout=86400.0, batch_poll=86400.0).request.timeout == settings.MAX_WAIT



def test_a_setting_that_sizes_memory_threads_or_a_sleep_is_bounded_up_front():
    """--samples 1000000 took 48 s and 2.4 GB in a dry run, --rpm 1e-300 died in time.sleep (OverflowError):
    every setting that sizes memory, threads or a wait is refused past its bound, naming it."""
    for kw, said in ((dict(samples=1_000_000), "--samples 1000000 (1 to 10000)"),
                     (dict(rpm=1e-300), "--rpm 1e-300 (0, or at least 0.000694"),
                     (dict(workers=100_000), "--workers 100000 (1 to 1024)"),
                     (dict(n_boot=10**9), "--n-boot 1000000000"), (dict(seed=-1), "--seed -1"),
                     (dict(batch_deadline=1e12), "--batch-deadline 1000000000000.0")):
        with pytest.raises(runs.SettingsError, match=re.escape(said)):
            settings.EvalConfig(**kw)
    for kw in (dict(max_body_bytes=1 << 40), dict(max_concurrent_requests=10**6), dict(max_queue=10**7),
               dict(max_documents=10**7)):
        with pytest.raises(runs.SettingsError, match="out of range"):
            settings.ServeConfig(**kw)
    top = settings.EvalConfig(samples=settings.MAX_SAMPLES, rpm=60 / settings.MAX_WAIT)
    assert top.sample.samples == settings.MAX_SAMPLES


CRED = "http://usr:S3cretZ@127.0.0.1:9/v1"


@functools.cache
def _commands():
    """{command: its argparse parser}."""
    return next(a for a in run.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def _every_flag_case(cmd, flag, tmp_path):
    """argv giving CRED to `flag` of `cmd`, with the other flags a command needs to get past its first check
    (a trained run, a benchmark), and --dry-run where the command has one, so nothing is sent."""
    base = {"runs-dir": str(tmp_path / "runs"), "name": "x", "bench": SAMPLE, "model": "tiny"}
    p = _commands()[cmd]
    have = {a.option_strings[0][2:] for a in p._actions if a.option_strings}
    argv = [cmd] + [w for k, v in base.items() if k in have and k != flag for w in ("--" + k, v)]
    if cmd in ("export", "compare") and flag != "out":
        argv += ["--out", str(tmp_path / "out")]
    if cmd == "compare" and flag != "runs":
        argv += ["--runs", str(tmp_path / "runs" / "x")]
    if "dry-run" in have:
        argv.append("--dry-run")
    return argv + [f"--{flag}={CRED}"]


def test_every_commands_help_lists_each_of_its_settings(capsys):
    """`run.py CMD --help` prints every flag of CMD's settings class and exits 0, a '%' in a setting's help
    (argparse %-formats help text) included; an attack command line parses the same with the parser built
    for its command alone as with the whole one."""
    for cmd, p in _commands().items():
        with pytest.raises(SystemExit) as e:
            run.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f" {cmd} [-h]" in out
        listed = set(re.findall(r"^  (--?[\w-]+)", out, re.M))
        assert {a.option_strings[0] for a in p._actions} <= listed, cmd
    argv = ["attack", "--name", "x", "--budgets", "1,3", "--edit-budget", "0.05", "--dry-run"]
    assert run.parser("attack").parse_args(argv) == run.parser().parse_args(argv)


def test_a_credential_url_in_any_flag_reaches_no_stream_or_file(tmp_path, capfd, monkeypatch):
    """Every flag of every command given a URL with a password (a pasted URL in the wrong flag, or in the
    right one): the password reaches no printed line and no file the command writes (config.json, the
    lock, caches, records). A server a command would start stops at its serve_forever, and the demo where
    its training starts (test guards: no test may block on a server or train ~100 demos); the rerank
    commands meet the closed port 127.0.0.1:9 without backoff."""
    import socketserver
    _backoff_without_waiting(monkeypatch)

    serving = socketserver.BaseServer.serve_forever

    def no_serving(self, *a, **k):       # a command's own server (serve, serve-offline) serves on the main thread
        if threading.current_thread() is not threading.main_thread():
            return serving(self, *a, **k)    # the offline engine a command starts for itself
        raise KeyboardInterrupt("serve_forever")

    def no_training(run_):
        raise KeyboardInterrupt("train_shield")
    monkeypatch.setattr(socketserver.BaseServer, "serve_forever", no_serving)
    monkeypatch.setattr(run, "train_shield", no_training)    # the demo (no --dry-run) stops where training starts
    monkeypatch.chdir(tmp_path)
    said, ran = [], 0
    for cmd, p in _commands().items():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0 or isinstance(a, argparse.BooleanOptionalAction):
                continue
            flag = a.option_strings[0][2:]
            argv = _every_flag_case(cmd, flag, tmp_path)
            try:
                run.main(argv)
            except SystemExit as e:
                said.append(str(e.code))
            except KeyboardInterrupt:
                pass
            except Exception as e:       # a traceback would print the value too
                said.append(f"{argv}: {e!r}")
            ran += 1
    out = capfd.readouterr()
    assert ran > 200
    leaks = [s for s in said if "S3cretZ" in s]
    assert not leaks, leaks[:5]
    assert "S3cretZ" not in out.out + out.err
    for root, dirs, files in os.walk(tmp_path):
        assert not [n for n in dirs + files if "S3cretZ" in n], root        # nor a folder or file name
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                assert b"S3cretZ" not in fh.read(), path


def test_a_folder_holding_only_a_failed_starts_record_takes_new_settings(demo_run, tmp_path):
    """A start that failed before producing anything (a model that could not be downloaded) leaves only
    config.json: rerank-eval (like attack, harden, holdout) and its --dry-run record the new settings over it
    instead of refusing every later command; once something is produced, a change is refused, dry run too."""
    (tmp_path / "r").mkdir()
    shutil.copy(demo_run / "config.json", tmp_path / "r" / "config.json")       # a start that failed
    argv = ["rerank-eval", "--runs-dir", str(tmp_path), "--name", "r", "--reranker", "base", "--max-length", "300",
            "--max-test-groups", "1"]
    run.main(argv + ["--dry-run"])
    run.main(argv)
    assert json.load(open(tmp_path / "r" / "config.json"))["config"]["max_length"] == 300
    for dry in (("--dry-run",), ()):
        with pytest.raises(SystemExit, match="different max_length"):
            run.main([a if a != "300" else "400" for a in argv] + list(dry))


def test_a_run_record_of_another_shape_is_refused_naming_it(tmp_path):
    """A config.json edited by hand ("bench_sha1": 7, a list, "config": 5) raised TypeError or AttributeError
    naming nothing; it is refused naming the file."""
    d = tmp_path / "x"
    d.mkdir()
    r = runs.Run(settings.EvalConfig(name="x", runs_dir=str(tmp_path)))
    for bad in ([1], {"config": 5}, {"config": {}, "bench_sha1": 7}):
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(settings.SettingsError, match="x/config.json: not a run record"):
            r.check_record()
    (d / "config.json").write_text(json.dumps({"config": {}, "bench_sha1": None}))
    assert r.check_record() == {"config": {}, "bench_sha1": None}


def test_a_flag_or_file_a_command_would_not_read_is_refused_up_front(tmp_path, small_bench, monkeypatch):
    """Refused before any model loads or anything is written: demo's --runs-dir (its folder is --out's: it
    trained into ./runs), attack's eval and sampling flags and holdout's --reranker (never read), compare of a
    run eval never summarized (a KeyError traceback), train --stage tfsg over a Shield not trained (after the
    model loaded), serve on a busy port (after the model loaded); train --dry-run --stage shield prices no LLM
    call and checks no TFSG schedule."""
    import socket
    common = ["--runs-dir", str(tmp_path), "--model", "tiny", "--bench", small_bench, "--n-construction", "4",
              "--n-seed-cases", "3", "--batch-size", "3"]
    for argv in (["attack", "--name", "a", "--samples", "7"], ["attack", "--name", "a", "--conditions", "paper"],
                 ["holdout", "--name", "h", "--reranker", "co=cohere:rerank-v3.5"],
                 ["demo", "--out", str(tmp_path / "o")]):                    # (common's --runs-dir)
        with pytest.raises(SystemExit) as e:
            run.main(argv + common)
        assert e.value.code == 2                                    # argparse: an unrecognized argument
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"rerank_stage": {}, "usage": {}}))
    with pytest.raises(SystemExit, match="summary.json: .*run `python run.py eval`"):
        run.main(["compare", "--runs", str(tmp_path / "r"), "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="shield_done.json: no finished Shield training"):
        run.main(["train", "--name", "t", "--stage", "tfsg"] + common)
    assert not (tmp_path / "_tiny_qwen3").exists()
    plan = run.main(["train", "--name", "t", "--stage", "shield", "--n-batches", "50", "--dry-run"] + common)
    assert plan["stages"]["target answers"]["requests"] == plan["stages"]["Analyzer"]["requests"] == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setattr(run, "shield_as_scored", lambda *a: pytest.fail("the model loaded"))   # (a probe)
        with pytest.raises(SystemExit, match="cannot listen"):
            run.main(["serve", "--model", "tiny", "--port", str(s.getsockname()[1])])
