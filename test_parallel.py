"""Data-parallel Shield training under torchrun (parallel.py, train.fit): two gloo processes on the tiny
model, killed after their first checkpoint and run again, end with the single-process adapter (the same
global batch, float32) within 1e-6; rank 0 alone wrote the run's files.
Run: python -m pytest -q test_parallel.py
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

import run
from conftest import HERE

# the paper's learning rate (Table A.1): the ranks' gradient sums differ from one process's only in the
# order of float32 additions, which AdamW's first steps carry into the weights in proportion to lr
ARGS = ["train", "--stage", "shield", "--model", "tiny", "--dtype", "float32", "--lora-dropout", "0",
        "--epochs", "2", "--grad-accum", "4", "--save-every", "2", "--lr", "1e-4"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(runs_dir, name):
    """`torchrun --nproc-per-node 2 run.py train ...` in a session of its own (so a kill reaches every rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_port()), "run.py", *ARGS,
                             "--runs-dir", str(runs_dir), "--name", name],
                            cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_two_ranks_killed_and_resumed_end_with_the_single_process_adapter(tmp_path):
    run.main([*ARGS, "--runs-dir", str(tmp_path), "--name", "single"])
    p = _torchrun(tmp_path, "two")
    ckpt = tmp_path / "two" / "checkpoint" / "state.safetensors"
    deadline = time.time() + 120
    while not ckpt.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)                    # every rank, mid-training
    p.wait()
    assert ckpt.exists() and not (tmp_path / "two" / "shield_done.json").exists()
    p = _torchrun(tmp_path, "two")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert "resuming at epoch" in err
    a = load_file(tmp_path / "single" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    logged = [line for line in open(tmp_path / "two" / "train_log.jsonl") if '"event": "train"' in line]
    single = [line for line in open(tmp_path / "single" / "train_log.jsonl") if '"event": "train"' in line]
    assert len(logged) == len(single) == 16                    # each step logged once, by rank 0
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "single"))


@pytest.mark.parametrize("pos, rank, mine", [(0, 0, True), (1, 0, False), (1, 1, True), (6, 1, False)])
def test_each_rank_takes_every_other_example_of_a_window(monkeypatch, pos, rank, mine):
    import parallel
    monkeypatch.setattr(parallel, "world", lambda: 2)
    monkeypatch.setattr(parallel, "rank", lambda: rank)
    assert parallel.mine(pos, 4 if pos >= 4 else 0) is mine
