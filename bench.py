"""Speed benchmarks (`python run.py bench --what ...`): our scorer and training step against
transformers and PEFT on the same weights and ids, round-robin in one process, with two floors that
run only the matrix work of our call (how close to the machine); memory in fresh processes; NF4;
the LLM client; the rerank server against direct scoring; the CPU engines in bench_engines.py.
Method and figures: docs/PERF.md.

Usage: python run.py bench --what score --repeat 5
"""
import functools
import importlib.util
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests
import tokenizers
import torch
import torch.nn as nn
import torch.nn.functional as F

import bench_engines
import llm_clients
import lora
import reranker
import serve
import speed
import tiny
from settings import SettingsError
from store import log


# ----------------------------------------------------------------------------- benchmarks


def load_ours(folder, compile=False, share_prefix=True, **kw):
    """Our reranker as the jobs run it: reranker.py with the speed paths installed (speed.install)."""
    rr = reranker.Reranker.from_pretrained(folder, **kw)
    speed.install(rr.model, compile=compile, share_prefix=share_prefix)
    return rr


def bench_folder(m, b):
    """A random real-width Qwen3 checkpoint (hidden 1024, 16/8 heads, MLP 3072, vocab 151669,
    --layers layers), initialised and saved by transformers; made once under --out."""
    import transformers
    folder = os.path.join(b.out, f"bench_qwen3_{b.layers}l")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        torch.manual_seed(0)
        config = transformers.Qwen3Config(vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                                          num_hidden_layers=b.layers, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                                          max_position_embeddings=40960)
        model = transformers.Qwen3ForCausalLM(config).to(getattr(torch, m.dtype))
        model.save_pretrained(folder, safe_serialization=True)
        tok = tiny.make_tiny_checkpoint(folder + "_tok")
        shutil.copy(os.path.join(tok, "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    return folder


def left_padded(ids, pad_id=151643):
    """Token-id lists -> (ids (B, T), attention mask (B, T)) left-padded with <|endoftext|>, as the
    model card's snippet batches them for transformers."""
    T = max(map(len, ids))
    out, mask = torch.full((len(ids), T), pad_id), torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, T - len(x):], mask[i, T - len(x):] = torch.tensor(x), 1
    return out, mask


def best_time(fn, repeat):
    """Seconds of the fastest of `repeat` timed calls after one warm-up call."""
    return race({"fn": fn}, repeat)["fn"]


def race(fns, repeat, rounds=None, say=None):
    """Best seconds of each function, timed round-robin (one call of each per round, after a warm-up
    round), so that a machine whose speed drifts during the run slows every contender alike. The
    order rotates every round, so that no contender always runs first or last (a rotation keeps who
    runs right before whom). If a list `rounds` is given, each round's {name: seconds} is appended to it
    (for paired ratios). `say(name, round, seconds)` hears of every call as it ends (round 0: the
    warm-up), so that a slow machine shows each contender's figure long before the race ends."""
    say = say or (lambda name, r, seconds: None)
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        say(k, 0, time.perf_counter() - t0)
    best = {k: float("inf") for k in fns}
    names = list(fns)
    for r in range(repeat):
        times = {}
        for k in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[k]
            t0 = time.perf_counter()
            fn()
            times[k] = time.perf_counter() - t0
            best[k] = min(best[k], times[k])
            say(k, r + 1, times[k])
        if rounds is not None:
            rounds.append(times)
    return best


def progress(workload, docs, repeat):
    """race's `say` for bench: each call's seconds and documents per second on stderr, as measured."""
    return lambda k, r, s: log(f"[bench] {workload}/{k} {'warm-up' if r == 0 else f'round {r}/{repeat}'}: "
                               f"{s:.3f} s, {docs / s:.2f} docs/s")


def paired_ratio(rounds, peer, ours="ours"):
    """Median over rounds of peer seconds / our seconds, each pair timed back to back: steadier than
    the ratio of best times when the machine's speed changes between rounds."""
    return statistics.median(r[peer] / r[ours] for r in rounds)


def mixed_lengths(n=10, seed=1):
    """The mixed workload: n document lengths drawn uniformly from 100..1000 tokens."""
    rng = random.Random(seed)
    return [rng.randint(100, 1000) for _ in range(n)]


def workloads(b):
    """{name: document lengths} of the workloads --workloads names: mixed (mixed_lengths), fixed (10 x --seq)."""
    return {name: mixed_lengths() if name == "mixed" else [b.seq] * 10 for name in b.workloads}


def random_ids(lens, seed=0, prefix=0):
    """Random token ids of the given lengths; with `prefix`, the first `prefix` tokens (at most L - 1)
    are the same in every sequence, as in one query's reranker prompts (system prompt, instruction and
    query before the document: 86 tokens with Qwen3's vocabulary, the Shield instruction and the
    sample's median query)."""
    rng = random.Random(seed)
    common = [rng.randrange(1000, 150000) for _ in range(prefix)]
    out = []
    for L in lens:
        P = min(prefix, L - 1)
        out.append(common[:P] + [rng.randrange(1000, 150000) for _ in range(L - P)])
    return out


def matmul_gflops(dtype, repeat=10, device="cpu"):
    """The machine's measured matmul rate (2048^3, best of `repeat`), GFLOP/s."""
    a, b = (torch.randn(2048, 2048, dtype=dtype, device=device) for _ in range(2))
    return 2 * 2048 ** 3 / best_time(synced(lambda: a @ b, device), repeat) / 1e9


def random_operands(dtype, device):
    """shape -> one contiguous random tensor per shape, made once and reused, as a layer's activations
    would be (the floors' operands: allocated outside the timing)."""
    bufs = {}

    def operand(*shape):
        if shape not in bufs:
            bufs[shape] = torch.randn(*shape, dtype=dtype, device=device)
        return bufs[shape]
    return operand


def gemm_floor(rr, ids, grad=False):
    """A function that runs only the frozen projection GEMMs of one `rr.score_ids(ids, grad)` call:
    the same weights and, per micro-batch, the same rows (the last layer's q/o/MLP on the final tokens
    only), and nothing else (no attention, norms, RoPE, embedding, LoRA, copies). With grad, each whose
    input needs a gradient is followed by its input-gradient GEMM as in the backward (dY (n, out) @ W
    -> (n, in); frozen weights get no gradient, and layer 0's q/k/v read the frozen embedding, so
    autograd skips theirs). Timed in the same race as the contenders, it is a lower bound on this
    machine at that moment for any implementation that runs these GEMMs with oneDNN: a peer's time
    over the floor's is the most that removing all of our other work could reach against that peer
    (the peers run at least these GEMMs: transformers on padded rows and every layer's rows in full)."""
    gemms = []  # (weight (out, in), rows, whether the backward needs the input's gradient), call order
    hooks = [m.register_forward_hook(lambda m, a, out: gemms.append((m.weight, a[0].shape[0], a[0].requires_grad)))
             for m in rr.model.modules() if isinstance(m, nn.Linear)]
    try:
        rr.score_ids(ids, grad=grad)  # (with grad, the graph it builds is dropped unused)
    finally:
        for h in hooks:
            h.remove()
    w0 = rr.model.embed_tokens.weight
    operand = random_operands(w0.dtype, w0.device)

    def run():
        with torch.inference_mode():
            for w, n, needs_dx in gemms:
                F.linear(operand(n, w.shape[1]), w)                   # (n, in) @ W^T -> (n, out)
                if grad and needs_dx:
                    torch.mm(operand(n, w.shape[0]), w)               # dY (n, out) @ W -> (n, in)
    run()  # allocate the operands outside the timing
    run.gemms = gemms
    return run


def matmul_floor(rr, ids):
    """A training step's floor with everything that multiplies matrices: `gemm_floor(rr, ids, grad=True)`
    plus LoRA's own matmuls and the causal attention, replayed on random operands of the shapes one
    `rr.score_ids(ids, grad=True)` call uses, and nothing elementwise (no norms, RoPE, SwiGLU, dropout
    masks, residual adds, casts or copies beyond what the attention kernels do inside).
    Per LoRA call on n rows: forward x A^T (n, r) and h B^T added to the output (n, out); backward
    dh = dY B, dB = dY^T h, dA = dh^T x, and dx = dh A where the input needs a gradient.
    Attention: the packed causal attention of every layer but the last (SDPA forward, then on the CPU
    our hand backward, elsewhere SDPA's own): the fastest attention found in torch on this CPU; the
    last layer's S single-query attentions are left out (a few rows; leaving work out keeps it a floor).
    Timed in the race, a peer's time over this one's is the most any implementation using these
    kernels could reach against that peer on this machine at that moment."""
    gemm = gemm_floor(rr, ids, grad=True)
    loras, atts = [], []  # (module, rows, needs dx); (rows, heads, kv heads, head dim, lens, prefix)

    def on_attn(m, a, out):
        x, lens, prefix, last = a[0], a[3], a[4], a[5]         # speed.attention_forward's arguments
        if last is None:
            atts.append((x.shape[0], m.H, m.K, m.E, list(lens), prefix))
    hooks = [m.register_forward_hook(lambda m, a, out: loras.append((m, a[0].shape[0], a[0].requires_grad)))
             for m in rr.model.modules() if isinstance(m, lora.LoRALinear)]
    hooks += [m.register_forward_hook(on_attn) for m in rr.model.modules() if isinstance(m, reranker.Attention)]
    try:
        rr.score_ids(ids, grad=True)
    finally:
        for h in hooks:
            h.remove()
    w = rr.model.embed_tokens.weight
    dt, dev = w.dtype, w.device
    operand = random_operands(dt, dev)
    # LoRA's factors in the activation dtype, as LoRALinear.forward computes them
    factors = [(m.lora_A.detach().to(dt), m.lora_B.detach().to(dt), n, needs_dx) for m, n, needs_dx in loras]
    qkv = [tuple(torch.randn(N, h, E, dtype=dt, device=dev, requires_grad=True) for h in (H, K, K)) + (lens, P)
           for N, H, K, E, lens, P in atts]
    hand = dev.type in speed.HAND_BACKWARD

    def lora_matmuls():
        with torch.inference_mode():
            for A, B, n, needs_dx in factors:
                out, i = B.shape[0], A.shape[1]
                x, y, dy = operand(n, i), operand(n, out), operand(n, out)
                h = x @ A.t()                                             # (n, r)
                torch.addmm(y, h, B.t())                                  # (n, out)
                dh = dy @ B                                               # (n, r)
                dy.t() @ h                                                # dB (out, r)
                dh.t() @ x                                                # dA (r, in)
                if needs_dx:
                    dh @ A                                                # (n, in)

    def attention():
        for q, k, v, lens, P in qkv:
            o = (speed.PackedCausalAttention.apply(q, k, v, lens, P) if hand
                 else speed.packed_causal_sdpa(q, k, v, lens, P))     # (N, H, E)
            o.backward(operand(*o.shape))
            q.grad = k.grad = v.grad = None

    def run():
        gemm()
        lora_matmuls()
        attention()
    run()  # allocate the operands outside the timing
    run.loras, run.attentions, run.qkv = loras, atts, qkv
    run.parts = {"gemm": gemm, "lora": lora_matmuls, "attention": attention}
    return run


def attention_flops(atts):
    """Multiply-add FLOPs of exact causal attention, forward and backward, for the packed attentions
    `matmul_floor` records: each query at position t meets its t+1 visible keys; per visible
    (query, key) pair and head 2E FLOPs for each of QK^T and PV forward, and for each of the
    backward's S recomputation, dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q: 14 H E per pair.
    The prefix's queries count once (sequence 0), as `packed_causal_sdpa` keeps them."""
    flops = 0
    for N, H, K, E, lens, P in atts:
        for j, L in enumerate(lens):
            first = 0 if j == 0 else P                                    # first query position
            pairs = sum(t + 1 for t in range(first, P + L))
            flops += 14 * H * E * pairs
    return flops


def synced(fn, device):
    """fn, waiting for the device to finish before returning (CUDA runs asynchronously: without
    this a timer would measure only the kernel launches). It keeps fn's attributes (matmul_floor's parts)."""
    if torch.device(device).type != "cuda":
        return fn

    @functools.wraps(fn)
    def run():
        out = fn()
        torch.cuda.synchronize(device)
        return out
    return run


def cuda_step_peaks(fns, device):
    """On CUDA: MiB that one call of each function allocates above what is resident before it (its
    activations, gradients and workspace; the weights of every contender stay resident throughout)."""
    out = {}
    for k, fn in fns.items():
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        out[k] = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    return out


def bench_score(m, b):
    """tokens/s of our scorer vs transformers (logits_to_keep=1, sdpa, one left-padded batch) and the
    model card snippet (full logits), same random real-width weights and ids; plus the GEMM floor of
    our call (`gemm_floor`: the ceiling of any ratio against each peer) and the matmul rate in the dtype."""
    import transformers
    dtype, dev = getattr(torch, m.dtype), m.device
    folder = bench_folder(m, b)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    rr = load_ours(folder, dtype=dtype, device=dev)
    rc = load_ours(folder, dtype=dtype, device=dev, compile=True) if m.compile else None
    work = workloads(b)
    results = {}
    if rc is not None:  # compilation happens on the first call: timed here, outside the race
        t0 = time.perf_counter()
        rc.score_ids(random_ids(next(iter(work.values())), prefix=b.prefix))
        results["compile_first_call_s"] = time.perf_counter() - t0
    for name, lens in work.items():
        ids = random_ids(lens, prefix=b.prefix)
        pad, mask = (t.to(dev) for t in left_padded(ids))

        def transformers_keep1():
            with torch.inference_mode():
                return hf(input_ids=pad, attention_mask=mask, logits_to_keep=1, use_cache=False).logits

        def snippet():
            with torch.inference_mode():
                return hf(input_ids=pad, attention_mask=mask).logits[:, -1, :]

        cands = {"ours": lambda: rr.score_ids(ids), "transformers": transformers_keep1}
        if rc is not None:
            cands["ours_compiled"] = lambda: rc.score_ids(ids)
        if b.prefix:
            cands["ours_unshared"] = lambda: unshared(rr, ids)
        if name == "fixed":
            cands["model_card_snippet"] = snippet
        cands["gemm_floor"] = gemm_floor(rr, ids)
        cands = {k: synced(fn, dev) for k, fn in cands.items()}
        if torch.device(dev).type == "cuda":
            for k, mib in cuda_step_peaks(cands, dev).items():
                results[f"{name}/{k}_cuda_call_peak_MiB"] = mib
        rounds = []
        for k, t in race(cands, b.repeat, rounds, progress(name, len(lens), b.repeat)).items():
            results[f"{name}/{k}"] = sum(lens) / t                              # tokens per second
            results[f"{name}/{k}_docs_per_s"] = len(lens) / t                  # the unit providers compare
        peers = {"transformers": "transformers", **({"model_card_snippet": "snippet"} if name == "fixed" else {})}
        for ours in [k for k in cands if k.startswith("ours")]:
            for peer, tag in peers.items():
                results[f"{name}/{ours}_vs_{tag}"] = results[f"{name}/{ours}"] / results[f"{name}/{peer}"]
                results[f"{name}/{ours}_vs_{tag}_paired_median"] = paired_ratio(rounds, peer, ours)
        for peer, tag in peers.items():  # the most a zero-overhead implementation could reach (see gemm_floor)
            results[f"{name}/ceiling_vs_{tag}_paired_median"] = paired_ratio(rounds, peer, "gemm_floor")
        for ours in [k for k in cands if k.startswith("ours")]:
            results[f"{name}/{ours}_over_gemm_floor_paired_median"] = paired_ratio(rounds, ours, "gemm_floor")
        for k in ("ours", "transformers", "gemm_floor"):       # freed memory the allocator maps back in
            results[f"{name}/{k}_minor_faults_per_call"] = minor_faults(cands[k])
        if rc is not None:
            results[f"{name}/ours_compiled_vs_ours_paired_median"] = paired_ratio(rounds, "ours", "ours_compiled")
        if b.prefix:
            results[f"{name}/ours_vs_ours_unshared_paired_median"] = paired_ratio(rounds, "ours_unshared")
    results["matmul_gflops"] = matmul_gflops(dtype, device=dev)
    if b.against:
        bench_engines.engine_race(m, b, folder, rr, work, results, rc)
    return results


def unshared(rr, ids):
    """Our scorer with prefix sharing off: every document's prompt runs in full."""
    was, rr.model.share_prefix = rr.model.share_prefix, False
    try:
        return rr.score_ids(ids)
    finally:
        rr.model.share_prefix = was


def in_fresh_process(fn, *args):
    """fn(*args, queue) run in a new interpreter (spawn); returns the one value it puts on the queue. A process
    that ends without one (an exception, printed by the child; a kill) is a RuntimeError, never a wait."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=1)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"bench: {fn.__name__} ended without an answer (exit code {p.exitcode})") from None
    p.join()
    return out


def minor_faults(fn):
    """The minor page faults of one fn() call in this process (pages the kernel maps in afresh, zeroed:
    freed memory handed back and touched again; speed.reuse_freed_memory); None where not counted."""
    try:
        import resource                  # Unix only: imported here so that run.py starts on every OS
    except ImportError:
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def peak_rss_mib():
    """This process's peak resident memory in MiB: VmHWM, which starts afresh at exec (ru_maxrss does
    not: a child spawned by a big parent would report at least the parent's size)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource                      # Unix only: imported here so that run.py starts on every OS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_rss_child(kind, folder, lens, prefix, dtype_name, q):
    """Runs one contender once in a fresh process and reports its peak resident memory (MiB)."""
    speed.reuse_freed_memory()   # entry point of this fresh (spawned) process: malloc as in run.py's __main__
    dtype = getattr(torch, dtype_name)
    ids = random_ids(lens, prefix=prefix)
    if kind.startswith("ours"):
        load_ours(folder, dtype=dtype, compile=kind == "ours_compiled").score_ids(ids)
    else:
        import transformers
        hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
        pad, mask = left_padded(ids)
        with torch.inference_mode():
            hf(input_ids=pad, attention_mask=mask, logits_to_keep=1, use_cache=False)
    q.put(peak_rss_mib())


def bench_memory(m, b):
    """Peak resident memory of one scoring call (weights included), ours vs transformers, each in a
    fresh process, on the workloads of `bench --what score`."""
    folder = bench_folder(m, b)
    res = {}
    for name, lens in workloads(b).items():
        kinds = ("ours", "ours_compiled", "transformers") if m.compile else ("ours", "transformers")
        for kind in kinds:
            res[f"{name}/{kind}_peak_MiB"] = in_fresh_process(_peak_rss_child, kind, folder, lens, b.prefix, m.dtype)
        for kind in kinds[:-1]:
            peer = res[f"{name}/transformers_peak_MiB"]
            res[f"{name}/{kind}_over_transformers"] = res[f"{name}/{kind}_peak_MiB"] / peer
    return res


def _train_steps(folder, dtype, ids, kinds=("ours", "peft"), device="cpu"):
    """The micro-step of `bench --what train` for each contender: forward + backward of the yes/no
    margin through LoRA (r 16, alpha 32, dropout 0.05) on all 7 projections, same weights and ids."""
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    yes, no = (tok.encode(w, add_special_tokens=False).ids[0] for w in ("yes", "no"))
    steps = {}
    if "peft" in kinds:
        import peft
        import transformers
        hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
        pm = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                                     target_modules=list(lora.TARGETS)))
        x = torch.tensor(ids, device=device)

        def peft_step():
            lg = pm(input_ids=x, logits_to_keep=1).logits[:, -1, :].float()
            (lg[:, yes] - lg[:, no]).sum().backward()
        steps["peft"] = peft_step
    for kind in [k for k in kinds if k.startswith("ours")]:
        rr = load_ours(folder, dtype=dtype, device=device, compile=kind == "ours_compiled",
                       share_prefix=kind != "ours_unshared")
        assert (rr.yes_id, rr.no_id) == (yes, no)
        lora.add_lora(rr.model)
        speed.install(rr.model, compile=kind == "ours_compiled", share_prefix=kind != "ours_unshared")
        rr.model.train()
        steps[kind] = lambda rr=rr: rr.score_ids(ids, grad=True).sum().backward()
        if kind == "ours" and "gemm_floor" in kinds:
            steps["gemm_floor"] = gemm_floor(rr, ids, grad=True)
        if kind == "ours" and "matmul_floor" in kinds:
            steps["matmul_floor"] = matmul_floor(rr, ids)
    return steps


def _peak_rss_train_child(kind, folder, ids, dtype_name, q):
    """One training micro-step of one contender in a fresh process -> its peak resident memory (MiB)."""
    speed.reuse_freed_memory()   # entry point of this fresh (spawned) process: malloc as in run.py's __main__
    _train_steps(folder, getattr(torch, dtype_name), ids, (kind,))[kind]()
    q.put(peak_rss_mib())


def bench_train(m, b):
    """One micro-step (3 documents x seq tokens, forward+backward through LoRA on all 7 projections)
    at real width: ours vs transformers + peft on the same weights and ids; tokens/s timed round-robin
    in one process, peak memory (weights included) of one step in a fresh process each (on CUDA: one
    step's allocation peak above the resident weights, in this process); plus the GEMM floor of our
    step (`gemm_floor`: frozen projections forward and input gradients only; `matmul_floor`: those plus
    LoRA's matmuls and the attention) and the matmul rate."""
    dtype, dev = getattr(torch, m.dtype), m.device
    cuda = torch.device(dev).type == "cuda"
    folder = bench_folder(m, b)
    ids = random_ids([b.seq] * 3, prefix=b.prefix)
    kinds = ("ours",) + ("ours_compiled",) * bool(m.compile) + ("ours_unshared",) * bool(b.prefix) + ("peft",)
    res, rounds = {}, []
    if not cuda:  # peak RSS, weights included, each in a fresh process
        for kind in kinds:
            res[f"{kind}_peak_MiB"] = in_fresh_process(_peak_rss_train_child, kind, folder, ids, m.dtype)
    steps = {k: synced(fn, dev) for k, fn in _train_steps(folder, dtype, ids, kinds + ("gemm_floor", "matmul_floor"),
                                                          dev).items()}
    if m.compile:  # compilation happens on the first call: timed here, outside the race
        t0 = time.perf_counter()
        steps["ours_compiled"]()
        res["compile_first_call_s"] = time.perf_counter() - t0
    if cuda:  # one step's allocations above the resident weights, all contenders in this process
        for k, mib in cuda_step_peaks(steps, dev).items():
            res[f"{k}_cuda_step_peak_MiB"] = mib
    for k, t in race(steps, b.repeat, rounds).items():
        res[f"{k}_tok_s"], res[f"{k}_s_per_step"] = 3 * b.seq / t, t
    mem = "cuda_step_peak_MiB" if cuda else "peak_MiB"
    for k in kinds[:-1]:
        res[f"{k}_over_peft_memory"] = res[f"{k}_{mem}"] / res[f"peft_{mem}"]
        res[f"{k}_vs_peft"] = res[f"{k}_tok_s"] / res["peft_tok_s"]
        res[f"{k}_vs_peft_paired_median"] = paired_ratio(rounds, "peft", k)
        res[f"{k}_over_gemm_floor_paired_median"] = paired_ratio(rounds, k, "gemm_floor")
        res[f"{k}_over_matmul_floor_paired_median"] = paired_ratio(rounds, k, "matmul_floor")
    res["ceiling_vs_peft_paired_median"] = paired_ratio(rounds, "peft", "gemm_floor")  # see gemm_floor
    res["matmul_ceiling_vs_peft_paired_median"] = paired_ratio(rounds, "peft", "matmul_floor")  # see matmul_floor
    if m.compile:
        res["ours_compiled_vs_ours_paired_median"] = paired_ratio(rounds, "ours", "ours_compiled")
    if b.prefix:
        res["ours_vs_ours_unshared_paired_median"] = paired_ratio(rounds, "ours_unshared")
    res["matmul_gflops"] = matmul_gflops(dtype, device=dev)
    # the matmul floor's parts, each timed alone after the race (best of 3), and what the attention
    # would take at the measured matmul rate: exact causal FLOPs, no kernel overhead
    for part, fn in steps["matmul_floor"].parts.items():
        res[f"matmul_floor_{part}_s"] = best_time(synced(fn, dev), 3)
    gflop = attention_flops(steps["matmul_floor"].attentions) / 1e9
    res["attention_gflop_per_step"] = gflop
    res["attention_at_matmul_rate_s"] = gflop / res["matmul_gflops"]
    if not cuda:
        res.update(attention_forwards(steps["matmul_floor"].qkv))
    return res


def attention_forwards(qkv, repeat=3):
    """The step's packed causal attention forwards (`matmul_floor`'s random operands `qkv`) by each CPU
    kernel, best of `repeat` -> {attention_forward_sdpa_s, attention_forward_blocked_s}: which one
    speed.packed_causal_attention should run in this dtype on this CPU (speed.BLOCKED_BF16_ATTENTION)."""
    ops = [(q.detach(), k.detach(), v.detach(), lens, P) for q, k, v, lens, P in qkv]
    kernels = {"sdpa": speed.packed_causal_sdpa, "blocked": speed.blocked_causal_attention}
    with torch.inference_mode():
        return {f"attention_forward_{name}_s": best_time(lambda: [fn(*o) for o in ops], repeat)
                for name, fn in kernels.items()}


def bench_nf4(m, b):
    """Frozen-base memory and scoring speed: our scorer with projections in the bench's dtype (bf16 by default)
    vs NF4 projections (dequantised on the fly), same random real-width weights and ids."""
    dtype = getattr(torch, m.dtype)
    folder = bench_folder(m, b)
    ids = random_ids([b.seq] * 10, prefix=b.prefix)
    res, base = {}, {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(m.dtype, m.dtype)
    for name in (base, "nf4"):
        rr = reranker.Reranker.from_pretrained(folder, dtype=dtype)
        if name == "nf4":
            lora.quantize_nf4(rr.model)
        proj = sum(p.numel() * p.element_size() for n, p in list(rr.model.named_parameters()) +
                   list(rr.model.named_buffers()) if any(t in n for t in lora.TARGETS))
        res[f"{name}_projection_MiB"] = proj / 2 ** 20
        res[f"{name}_tok_s"] = sum(map(len, ids)) / best_time(lambda: rr.score_ids(ids), b.repeat)
    res[f"memory_ratio_nf4_over_{base}"] = res["nf4_projection_MiB"] / res[f"{base}_projection_MiB"]
    res[f"speed_ratio_nf4_over_{base}"] = res["nf4_tok_s"] / res[f"{base}_tok_s"]
    return res


def bench_llm(m, b):
    """200 calls on 16 workers against a loopback server with a fixed 200 ms latency, then the same
    200 from the cache (zero HTTP calls). Fixed: m and b (every contest's settings) are not read."""

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(0.2)
            data = json.dumps({"choices": [{"message": {"content": body["messages"][0]["content"]},
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 5, "completion_tokens": 5}}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as d:
        c = llm_clients.Client.open(f"http://127.0.0.1:{srv.server_address[1]}/v1", "bench", cache_dir=d)
        reqs = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(200)]
        t0 = time.perf_counter(); c.map(reqs, workers=16, progress=False); t1 = time.perf_counter() - t0
        before = c.stats["http_calls"]
        t0 = time.perf_counter(); c.map(reqs, workers=16, progress=False); t2 = time.perf_counter() - t0
        ideal = math.ceil(200 / 16) * 0.2                   # 13 waves of 16 blocking calls: no client does better
        res = {"first_pass_s": t1, "ideal_s": ideal, "ratio_to_ideal": t1 / ideal,
               "cached_pass_s": t2, "cached_http_calls": c.stats["http_calls"] - before}
    srv.shutdown()
    return res


def bench_documents(rr, n, lo, hi, seed):
    """n documents of lo..hi tokens each (drawn uniformly): random English words, cut to length."""
    rng = random.Random(seed)
    words = tiny.TINY_CORPUS.split()
    docs = []
    for _ in range(n):
        ids = rr.text_tokenizer.encode(" ".join(rng.choice(words) for _ in range(hi))).ids
        docs.append(rr.text_tokenizer.decode(ids[:rng.randint(lo, hi)]))
    return docs


def bench_serve(m, b):
    """`--clients` concurrent clients, each sending `--requests` requests of one query with ten
    documents of 100-1000 tokens to the rerank server (loopback HTTP, keep-alive), against the same
    requests scored directly in-process (`Reranker.score`, one request after another), in one run:
    requests/s, p50/p99 latency of each, and the server's throughput over direct scoring."""
    dtype = getattr(torch, m.dtype)
    rr = load_ours(bench_folder(m, b), dtype=dtype)
    n_req = b.clients * b.requests
    reqs = [{"query": f"query {i} about water safety", "documents": bench_documents(rr, 10, 100, 1000, seed=i)}
            for i in range(n_req)]
    srv = serve.RerankServer(rr, port=0, log=False, max_queue=4 * b.clients)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = srv.url + "/v1/rerank"

    def direct():
        lat = []
        t0 = time.perf_counter()
        for r in reqs:
            t = time.perf_counter()
            rr.score(r["query"], r["documents"])
            lat.append(time.perf_counter() - t)
        return time.perf_counter() - t0, lat

    def served():
        lat = [None] * n_req

        def client(c):
            with requests.Session() as s:
                for j in range(b.requests):
                    i = c * b.requests + j
                    t = time.perf_counter()
                    resp = s.post(url, json=reqs[i], timeout=3600)
                    resp.raise_for_status()
                    lat[i] = time.perf_counter() - t
        t0 = time.perf_counter()
        with ThreadPoolExecutor(b.clients) as ex:
            list(ex.map(client, range(b.clients)))
        return time.perf_counter() - t0, lat

    rr.score(reqs[0]["query"], reqs[0]["documents"])      # warm-up
    tokens = [sum(map(len, rr.tokenize(r["query"], r["documents"]))) for r in reqs]
    res = {"clients": b.clients, "requests": n_req, "layers": b.layers, "tokens_per_request": statistics.mean(tokens)}
    ratios = []
    for rnd in range(b.repeat):   # alternating order, as race() does
        order = (("direct", direct), ("served", served)) if rnd % 2 == 0 else (("served", served), ("direct", direct))
        times = {}
        for name, fn in order:
            total, lat = fn()
            times[name] = total
            for k, v in (("req_s", n_req / total), ("p50_s", statistics.median(lat)), ("p99_s", p99(lat))):
                best = max if k == "req_s" else min                  # the best round of each figure
                res[f"{name}_{k}"] = best(res.get(f"{name}_{k}", v), v)
        ratios.append(times["direct"] / times["served"])
    res["served_over_direct_throughput_paired_median"] = statistics.median(ratios)
    res["served_over_direct_throughput_best"] = res["served_req_s"] / res["direct_req_s"]
    res["scoring_batches"] = srv.batcher.batches
    res.update(connection_latency(url))
    srv.shutdown()
    srv.server_close()
    return res


def connection_latency(url, n=100):
    """p50 / p99 of a small rerank request (two short documents) sent one after another on one
    kept-alive connection (what SDK clients with a session do) and on a fresh connection each."""
    body = {"query": "q", "documents": ["a short document", "another one"]}
    out = {}
    for name, fresh in (("kept_alive", False), ("fresh_connection", True)):
        lat = []
        with requests.Session() as s:
            for _ in range(n):
                t = time.perf_counter()
                (requests.post if fresh else s.post)(url, json=body, timeout=60).raise_for_status()
                lat.append(time.perf_counter() - t)
        out[f"small_request_{name}_p50_ms"] = round(1000 * statistics.median(lat), 2)
        out[f"small_request_{name}_p99_ms"] = round(1000 * p99(lat), 2)
    return out


def p99(xs):
    """The 99th percentile by nearest rank: the smallest value with at least 99% of them at or below it (of
    100 latencies the 99th, not the largest)."""
    return sorted(xs)[math.ceil(0.99 * len(xs)) - 1]


def run_bench(cfg):
    """bench's command: the contest --what names, its peers checked installed first -> its figures. Without
    a C++ compiler (--compile's default then) the compiled contender is left out."""
    b = cfg.bench
    if cfg.model.compile is None:
        cfg = cfg.replace(compile=speed.cpp_compiler_available())
        if not cfg.model.compile:
            print("bench: no C++ compiler found, so the compiled contender is left out", file=sys.stderr)
    if b.what not in ("score", "train", "serve") and cfg.model.device != "cpu":
        raise SettingsError(f"bench --what {b.what} runs on the CPU only; --device takes score and train")
    if b.what in ("score", "memory", "train", "nf4", "serve"):   # the peers and the random checkpoint's writer
        missing = [m for m in ("transformers",) + ("peft",) * (b.what == "train")
                   if importlib.util.find_spec(m) is None]
        missing += [m for e in b.against or () for m in bench_engines.ENGINE_MODULES[e]
                    if importlib.util.find_spec(m) is None and m not in missing]
        if missing:
            raise SettingsError(f"bench --what {b.what} races {' and '.join(missing)} (not runtime dependencies):"
                                " pip install -r requirements-test.txt")
    if b.against and (b.what != "score" or cfg.model.device != "cpu"):
        raise SettingsError("bench --against races CPU engines at --what score on --device cpu")
    return {"score": bench_score, "memory": bench_memory, "train": bench_train, "llm": bench_llm,
            "nf4": bench_nf4, "serve": bench_serve}[b.what](cfg.model, b)
