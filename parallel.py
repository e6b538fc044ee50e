"""Data parallelism over torch.distributed for the Shield's training and the ranking stages
(`torchrun --nproc-per-node N run.py train ...`): the process group from torchrun's environment (gloo on
the CPU, nccl on CUDA), each rank a share of every accumulation window's examples, the LoRA gradients
summed over the ranks before the clip and the step, so every rank takes the single-process step up to
float32 rounding. A plain `python run.py` has no WORLD_SIZE and runs as one rank: `Ranks()` alone, every
method a no-op.

One `Ranks` per command, made by `Ranks.join` when the command starts (runs.Run.open) and left by
`finish` when it ends or when the command says its sharded stage is over: no module state, so a library
function never ends a process group it did not start.

Deviations from one process:
- the window's gradient is summed in another order (each rank's share, then across the ranks), and
  AdamW carries that rounding into the weights (docs/COMMANDS.md: the measured figure and its command);
- each rank draws its own LoRA dropout masks (rank r > 0 from a stream seeded by the seed and r; a
  checkpoint keeps every rank's, so a resumed run draws the masks the uninterrupted one would): with
  dropout the run differs from one process's as another seed would.

Usage: ranks, device = Ranks.join("cpu"); ranks.mine(i, window_start); ...; ranks.sum_grads(params); ranks.finish()
"""
import datetime
import os

import torch
import torch.distributed as dist


# how long a rank waits in a collective (a gather, a window's gradients): torch's default, 10 minutes, would
# end a first run whose rank 0 downloads 0.6B weights while the others wait at their first all-reduce
TIMEOUT = datetime.timedelta(hours=2)
# how long a rank waits at barrier() while rank 0 works alone: an LLM stage, a hardening round's attack and
# measure, which take hours with real LLMs. A gloo group of its own carries these waits (Ranks.waiting)
WAIT = datetime.timedelta(days=7)


class Ranks:
    """This process's place among torchrun's ranks for one command: `rank` (kept after `finish`, so rank 0
    goes on as the main rank), `world` (1 once the group is left), and the collectives the jobs use.
    Ranks() is one process alone."""

    def __init__(self, rank=0, waiting=None, owned=True):
        self.rank = rank
        self.waiting = waiting              # the gloo group of barrier(); None: alone, or the group is left
        self.owned = owned                  # join started the default group (a caller's is the caller's to end)

    @classmethod
    def join(cls, device):
        """Join torchrun's process group when WORLD_SIZE > 1: nccl for a CUDA device, gloo on the CPU.
        -> (Ranks, the device this rank computes on: under torchrun with CUDA its LOCAL_RANK's GPU, whatever
        index `device` names, since every rank on one GPU would fail; else `device`)."""
        n = int(os.environ.get("WORLD_SIZE", "1"))
        if n == 1:
            return cls(), device
        cuda = str(device).startswith("cuda")
        if cuda:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.new_group(backend="gloo", timeout=WAIT), owned), device   # (a collective)

    @property
    def world(self):
        return dist.get_world_size() if self.waiting is not None else 1

    @property
    def is_main(self):
        """Rank 0: the one that writes the run's files and makes the LLM calls."""
        return self.rank == 0

    def barrier(self):
        """Wait for every rank, up to WAIT: most often the others wait while rank 0 works alone."""
        if self.waiting is not None:
            dist.barrier(group=self.waiting)

    def mine(self, pos, window_start):
        """Whether the example at `pos` of the window starting at `window_start` is this rank's (round robin)."""
        return (pos - window_start) % self.world == self.rank

    def sum_grads(self, params):
        """Sum every parameter's gradient over the ranks (a rank with no example in the window adds zeros),
        in one flat all-reduce: each rank then holds the single-process window's gradient, its float32
        additions in another order (one process adds the window's examples one by one)."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        i = 0
        for p in params:
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()

    def mean_stats(self, stats, keys, device="cpu"):
        """The window's per-example stats (a list of {key: float}, this rank's) -> {key: mean over every
        rank's examples}, in the order of `keys`."""
        if self.world == 1:
            return {k: sum(s[k] for s in stats) / len(stats) for k in keys}
        t = torch.tensor([sum(s[k] for s in stats) for k in keys] + [float(len(stats))], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t)
        return {k: float(t[i] / t[-1]) for i, k in enumerate(keys)}

    def gather(self, d):
        """Every rank's dict merged (all_gather_object) -> the same dict on every rank; d itself alone."""
        if self.world == 1:
            return dict(d)
        parts = [None] * self.world
        dist.all_gather_object(parts, d)
        return {k: v for part in parts for k, v in part.items()}

    def finish(self, failed=False):
        """Leave the process group (the command's sharded work is over: what follows runs on rank 0 alone, or
        the command ends); again, a no-op. Every rank first waits at a barrier: a rank that tears its
        connections down while a peer still reads the last collective's bytes makes gloo abort that peer.
        failed: this rank's command raised; it leaves at once, for its peers wait in another collective than
        that barrier (a window's all-reduce: two hours) and torchrun stops them when this rank exits."""
        if self.waiting is not None:
            if not failed:
                dist.barrier(group=self.waiting)
            dist.destroy_process_group(self.waiting)
            if self.owned:
                dist.destroy_process_group()
            self.waiting = None
