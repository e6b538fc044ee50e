"""Data parallelism under torchrun (parallel.py): the Shield's training (train.fit) on two gloo processes,
killed after their first checkpoint and run again, ends with the single-process adapter (the same global
batch, float32) within 1e-6 over these 6 steps (6.7e-8 measured; longer runs drift further, docs/COMMANDS.md
has the demo preset's figure), rank 0 alone writing the run's files; rerank-eval's scores sharded over two
ranks give one process's records byte for byte.
Run: python -m pytest -q test_parallel.py
"""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

import parallel
import rankers
import reranker
import runs
import train
from safetensors.torch import load_file

from testing import HERE

# the paper's learning rate (Table A.1): the ranks' gradient sums differ from one process's only in the
# order of float32 additions, which AdamW's first steps carry into the weights in proportion to lr
ARGS = ["train", "--stage", "shield", "--model", "tiny", "--dtype", "float32", "--lora-dropout", "0",
        "--epochs", "2", "--grad-accum", "4", "--save-every", "2", "--lr", "1e-4", "--max-test-groups", "1",
        "--n-construction", "4", "--max-length", "256"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(runs_dir, name, args=ARGS):
    """`torchrun --nproc-per-node 2 run.py ARGS` in a session of its own (so a kill reaches every rank),
    its stderr in runs_dir/<name>.stderr (a file, not a pipe: a full pipe would stall the run)."""
    env, err = {**os.environ, "OMP_NUM_THREADS": "1"}, open(runs_dir / f"{name}.stderr", "w")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_port()), "run.py", *args,
                             "--runs-dir", str(runs_dir), "--name", name],
                            cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _kill_every_process_of(run_dir):
    """SIGKILL every process whose command line names `run_dir`'s parent and name: torchrun's agent and
    its ranks (which it may start in sessions of their own), as a machine failure would."""
    want, killed = [str(run_dir.parent), run_dir.name], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in args]
        if all(w in words for w in want) and int(pid) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
    deadline = time.time() + 30                          # gone, and their locks with them, before a rerun
    while any(map(_running, killed)) and time.time() < deadline:
        time.sleep(0.05)


def _running(pid):
    """Whether process `pid` still runs (a zombie has released everything it held)."""
    try:
        return "State:\tZ" not in open(f"/proc/{pid}/status").read()
    except OSError:
        return False


def _one(runs_dir, name, args=ARGS):
    """`python run.py ARGS` on one torch thread, started beside the ranks (its startup overlaps theirs);
    its stderr in runs_dir/<name>.stderr."""
    err = open(runs_dir / f"{name}.stderr", "w")
    return subprocess.Popen([sys.executable, "run.py", *args, "--runs-dir", str(runs_dir), "--name", name], cwd=HERE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=err)


def test_two_ranks_killed_and_resumed_end_with_the_single_process_adapter(tmp_path, small_bench):
    args = ARGS + ["--bench", small_bench]                 # 4 construction groups: 6 steps
    single = _one(tmp_path, "single", args)
    p = _torchrun(tmp_path, "two", args)
    ckpt = tmp_path / "two" / "checkpoint" / "state.safetensors"
    deadline = time.time() + 120
    while not ckpt.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _kill_every_process_of(tmp_path / "two")             # torchrun and every rank, mid-training
    p.wait()
    assert ckpt.exists() and not (tmp_path / "two" / "shield_done.json").exists()
    p = _torchrun(tmp_path, "two", args)
    err = (tmp_path / "two.stderr").read_text() if p.wait(timeout=300) == 0 else ""
    assert p.returncode == 0, (tmp_path / "two.stderr").read_text()[-2000:]
    assert "resuming at epoch" in err
    assert single.wait(timeout=300) == 0, (tmp_path / "single.stderr").read_text()[-2000:]
    a = load_file(tmp_path / "single" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    logged = [line for line in open(tmp_path / "two" / "train_log.jsonl") if '"event": "train"' in line]
    single = [line for line in open(tmp_path / "single" / "train_log.jsonl") if '"event": "train"' in line]
    assert len(logged) == len(single) > 2                      # each step logged once, by rank 0
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "single"))
    trained_by = lambda f: json.load(open(tmp_path / f / "shield_done.json"))["trained_by"]   # what finished training
    assert (trained_by("two")["ranks"], trained_by("single")["ranks"]) == (2, 1)
    assert trained_by("two")["torch"] == torch.__version__ and trained_by("two")["dtype"] == "torch.float32"


class TwoRanks(parallel.Ranks):
    """Rank `rank` of two, played in one process: a stand-in for the process group (labelled), whose
    gather adds what the other rank `sent`."""
    world = 2

    def __init__(self, rank, sent=None):
        super().__init__(rank)
        self.sent = sent if sent is not None else {}

    def gather(self, d):
        return {**d, **self.sent}


FAILING_RANK = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import runs, settings
with runs.Run.open(settings.EvalConfig(name="f", runs_dir={runs!r}), "x", record=None, lock=None,
                   distributed=True) as run:
    if run.ranks.rank == 1:
        raise RuntimeError("rank 1 fails")
    dist.all_reduce(torch.zeros(1))            # rank 0 waits in a collective, as in a training window
"""


def test_a_rank_that_fails_ends_the_run_instead_of_waiting_at_the_last_barrier(tmp_path):
    """A rank whose command raises leaves at once: at finish's barrier it would wait (days) while its peer
    waits in another collective (hours); exiting, torchrun stops the peer and the run ends failed."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK.format(here=str(HERE), runs=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(_port()), str(script)], cwd=tmp_path, env=env,
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"), start_new_session=True)
    try:
        assert p.wait(timeout=60) != 0 and "rank 1 fails" in (tmp_path / "err").read_text()
    finally:                                  # the agent and its ranks, which it may start in sessions of their own
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if str(script).encode() in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)


CALLERS_GROUP = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import parallel
dist.init_process_group("gloo")                # the caller's own group, made before the command joins
ranks, _ = parallel.Ranks.join("cpu")
ranks.finish()
t = torch.ones(1)
dist.all_reduce(t)                             # the caller's group still carries its collectives
print(f"rank {{dist.get_rank()}}: {{dist.is_initialized()}} {{t.item()}}")
dist.destroy_process_group()
"""


def test_finish_leaves_a_group_the_caller_made_to_the_caller(tmp_path):
    """A program that made its own process group and runs a command in it (Ranks.join joins it) keeps the group
    after the command's finish: finish ended it, so the caller's next collective failed."""
    script = tmp_path / "caller.py"
    script.write_text(CALLERS_GROUP.format(here=str(HERE)))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(_port()), str(script)], cwd=tmp_path, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(re.findall(r"rank \d: \w+ [\d.]+", p.stdout)) == ["rank 0: True 2.0", "rank 1: True 2.0"]


def test_a_resumed_rank_draws_its_dropout_masks_on_from_its_own_generator(tmp_path):
    """Each rank draws its own LoRA dropout masks: the checkpoint keeps every rank's generator (gathered),
    and a resumed rank draws on from its own (with rank 0's alone, every rank repeated rank 0's masks)."""
    model = torch.nn.Linear(2, 2)                  # no LoRA layer: the checkpoint holds the generators
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(1)
    theirs = torch.get_rng_state()                 # rank 1's generator, sent in the gather
    torch.manual_seed(0)
    rngs = train.rng_states(TwoRanks(0, sent={1: {"torch": theirs}}))
    ours_next = torch.rand(4)
    train._save_ckpt(str(tmp_path), model, opt, {"epoch": 0, "pos": 0, "step": 1, "best": None, "history": []},
                     str(tmp_path / "log"), rngs)
    torch.manual_seed(7)
    train._load_ckpt(str(tmp_path), model, opt, rank=1)
    their_next = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(their_next, torch.rand(4))
    train._load_ckpt(str(tmp_path), model, opt, rank=0)
    assert torch.equal(torch.rand(4), ours_next)


def test_a_rank_the_checkpoint_did_not_hold_keeps_its_own_generator(tmp_path):
    """A one-process run resumed under torchrun on two ranks: rank 1 has no saved generator and keeps the stream
    of its own that attach_lora seeded (it loaded rank 0's, and drew rank 0's dropout masks at every step)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(0)
    state = {"epoch": 0, "pos": 0, "step": 1, "best": None, "history": []}
    train._save_ckpt(str(tmp_path), model, opt, state, str(tmp_path / "log"), train.rng_states(TwoRanks(0)))
    rank0_next = torch.rand(4)
    torch.manual_seed(5)                                   # rank 1's own stream
    train._load_ckpt(str(tmp_path), model, opt, rank=1)
    drawn = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(4)) and not torch.equal(drawn, rank0_next)


def test_a_checkpoint_that_reads_but_holds_other_contents_names_its_file(tmp_path):
    """A checkpoint whose metadata or tensors are not what _save_ckpt writes (no generator, no counters, Adam
    moments of another shape) is a CheckpointError naming the file: it was a KeyError traceback, or moments
    of the wrong shape were taken and failed inside AdamW's step."""
    from safetensors.torch import save_file
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    train._save_ckpt(str(tmp_path), model, opt, {"epoch": 0, "pos": 0, "step": 1, "best": None, "history": []},
                     str(tmp_path / "log"), train.rng_states(TwoRanks(0)))
    file = str(tmp_path / "state.safetensors")
    whole, meta = load_file(file), json.loads(train.safe_open(file, "pt").metadata()["state"])
    for tensors, state in (({k: v for k, v in whole.items() if k != "rng.torch"}, meta),
                           ({**whole, "opt.0.exp_avg": torch.zeros(7)}, meta),
                           (whole, {k: v for k, v in meta.items() if k != "opt_steps"}),
                           (whole, {**meta, "pos": "zero"}),
                           (whole, {k: v for k, v in meta.items() if k != "history"})):
        save_file(tensors, file, metadata={"format": "pt", "state": json.dumps(state)})
        with pytest.raises(reranker.CheckpointError, match=r"state.safetensors: not a checkpoint"):
            train._load_ckpt(str(tmp_path), model, opt)


def test_a_checkpoint_write_a_kill_cut_short_leaves_no_file_behind(tmp_path):
    """The checkpoint is written aside and renamed; a kill mid-write left the aside file (a 121 MB one at the
    paper's rank, one more per kill): the next start removes it."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.safetensors.tmp999").write_bytes(b"cut")
    train.start_state(None, None, str(tmp_path / "checkpoint"), str(tmp_path / "log"), True, TwoRanks(0))
    assert os.listdir(tmp_path / "checkpoint") == []


@pytest.mark.parametrize("pos, rank, mine", [(0, 0, True), (1, 0, False), (1, 1, True), (6, 1, False)])
def test_each_rank_takes_every_other_example_of_a_window(pos, rank, mine):
    assert TwoRanks(rank).mine(pos, 4 if pos >= 4 else 0) is mine


def test_one_process_is_one_rank_and_every_collective_a_no_op():
    ranks, device = parallel.Ranks.join("cpu")          # no WORLD_SIZE: alone
    assert (ranks.rank, ranks.world, ranks.is_main, device) == (0, 1, True, "cpu")
    assert ranks.gather({"a": 1}) == {"a": 1} and ranks.mean_stats([{"x": 1.0}, {"x": 3.0}], ["x"]) == {"x": 2.0}
    ranks.barrier()
    ranks.finish()
    ranks.finish()                                      # leaving twice: still nothing to leave


def test_rerank_eval_and_evals_ranking_sharded_over_two_ranks_write_one_processs_records(demo_run, tmp_path):
    """Each rank scores whole queries of its share; rerank-eval's records, and eval's (its ranking stage
    sharded, the LLM stage on rank 0 alone), equal one process's byte for byte (both on one torch thread:
    the threads' count changes float sums)."""
    shutil.copytree(demo_run.parent / "_tiny_qwen3", tmp_path / "_tiny_qwen3")
    for name in ("one", "two"):
        shutil.copytree(demo_run, tmp_path / name, ignore=shutil.ignore_patterns("scores_*", "rerank-*", "*.jsonl",
                                                                                 "summary.json"))
    args = ["rerank-eval", "--reranker", "base", "--reranker", "shield"]
    with runs.run_lock(str(tmp_path / "two"), command="train"):     # a folder in use: no rank writes into it
        assert _torchrun(tmp_path, "two", args).wait(timeout=300) != 0
    assert "in use by pid" in (tmp_path / "two.stderr").read_text() and not list((tmp_path / "two").rglob("*.rank*"))
    one, p = _one(tmp_path, "one", args), _torchrun(tmp_path, "two", args)
    assert p.wait(timeout=300) == 0, (tmp_path / "two.stderr").read_text()[-2000:]
    assert one.wait(timeout=300) == 0, (tmp_path / "one.stderr").read_text()[-2000:]
    for f in ("results/rerank-base.jsonl", "results/rerank-shield.jsonl", "summary.json"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    for name in ("one", "two"):                          # eval scores its lists again: no score cache
        for f in (tmp_path / name / "cache").glob("scores_*"):
            f.unlink()
    args = ["eval", "--conditions", "Non-Defense,Shield only"]
    one, p = _one(tmp_path, "one", args), _torchrun(tmp_path, "two", args)
    assert p.wait(timeout=300) == 0, (tmp_path / "two.stderr").read_text()[-2000:]
    assert one.wait(timeout=300) == 0, (tmp_path / "one.stderr").read_text()[-2000:]
    for f in ("results/non_defense.jsonl", "results/shield_only.jsonl", "results/clean_reference.jsonl"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    caches = sorted(f.name for f in (tmp_path / "one" / "cache").glob("scores_*"))
    read = lambda name, f: json.loads((tmp_path / name / "cache" / f).read_text())    # the same floats, any order
    assert caches and all(read("one", f) == read("two", f) for f in caches)


def test_a_killed_sharded_scoring_keeps_each_ranks_share(tmp_path):
    """Under torchrun each rank keeps what it scored in its share file as it goes; after a kill the rerun
    reads every share and scores only what no rank had scored; the ended scoring writes the whole cache
    and removes the shares. The two ranks are played in one process (TwoRanks: a stand-in for the
    process group), the reranker by a stand-in scorer that counts its queries."""
    asked, fail_on = [], {"q3"}

    class Scorer:                                   # a stand-in reranker: a document's score is its length
        def score(self, q, docs):
            if q in fail_on:
                raise RuntimeError("killed")
            asked.append(q)
            return [float(len(d)) for d in docs]
    lists = [types.SimpleNamespace(query=f"q{i}", docs=[f"doc {i} {'x' * j}" for j in range(3)]) for i in range(4)]
    path = str(tmp_path / "scores_base.json")
    sent = {}
    ranker = lambda: rankers.Ranker(Scorer(), path, "base")
    with pytest.raises(RuntimeError):               # rank 1's share is q1, q3: killed on q3
        rankers.sharded(TwoRanks(1), ranker(), lists)
    assert asked == ["q1"] and not os.path.exists(path)
    assert json.loads(open(path + ".rank1").read())["made_from"] == {"rank": 1, "world": 2}   # what it was made by
    open(path + ".rank1.tmp999", "w").write('{"cut')   # a write the kill interrupted: not a share, never read
    fail_on.clear()
    r1 = ranker()
    rankers.sharded(TwoRanks(1), r1, lists)         # the rerun: q1 read from its share, q3 scored
    assert asked == ["q1", "q3"] and not os.path.exists(path)
    sent.update(r1.cache)
    rankers.sharded(TwoRanks(0, sent), ranker(), lists)   # rank 0 scores q0 and q2 only, then writes the cache
    assert asked == ["q1", "q3", "q0", "q2"] and not rankers.share_files(path)
    assert json.loads(open(path).read()) == {rankers.doc_key(x.query, d): float(len(d)) for x in lists for d in x.docs}
    extra = rankers.doc_key("q9", "doc 9")                    # a killed run's share, rerun in one process
    open(path + ".rank1", "w").write(json.dumps({"made_from": {"rank": 1, "world": 2}, "scores": {extra: 1.0}}))
    rankers.sharded(parallel.Ranks(), ranker(), lists)
    assert json.loads(open(path).read())[extra] == 1.0 and not os.path.exists(path + ".rank1")
