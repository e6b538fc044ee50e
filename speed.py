"""Speed paths for reranker.py and lora.py: the same equations, faster. Nothing in the building
blocks imports this file; the jobs install it on a built model in one call, as liger-kernel patches
transformers' module forwards:

    rr = reranker.Reranker.from_pretrained(...); lora.add_lora(rr.model); speed.install(rr.model)

`install` binds a faster forward on each RMSNorm, Attention, MLP, Block, Qwen3Model and LoRALinear
of the model (call it again after adding LoRA layers; it is idempotent). A call then goes: the
module's bound forward -> `module.kernels.<piece>` (EAGER or COMPILED, chosen once by install) ->
the piece, whose eager form picks its training or in-place inference variant by grad mode.
What it changes, and what it does not:
- the same margins and gradients as reranker.py and lora.py up to float rounding (tested: 1e-5
  relative in float32 on margins, gradients and a training step; bf16 margins and gradients
  within stated tolerances; test_speed.py);
- the tokens a micro-batch's sequences have in common at the start (one query's prompts share the
  system prompt, instruction and query: ~86 tokens with Qwen3's vocabulary) run once, not once per
  document (`share_prefix`, on by default): each sequence still attends to the whole prefix at
  positions 0..P-1, so the margins are the same math (causal attention);
- RoPE multiplies the halves swapped ([x2, x1]) by a signed sine ([-sin1, sin2]) instead of
  building rotate_half(x) = [-x2, x1]: one negation fewer per call, bit-identical (negation is exact);
- inference works in place on fresh activations; training uses a hand-written RMSNorm backward and,
  on the CPU, a hand-written packed causal attention backward (visits only visible keys; reuses the
  blocked forward's probabilities, recomputes those SDPA's forward does not keep); CPU SDPA gets
  sequence lengths padded to a multiple of 32;
- in bf16 on a CPU with AVX-512 BF16 and no AMX, attention's forward (the last layer's final tokens
  too) runs as blocked matmuls (blocked_causal_attention, final_token_attention), the kernels those
  units run, instead of torch's CPU flash attention: the numerics of transformers' eager attention
  (bf16 scores and probabilities) rather than SDPA's float32 ones; float32, AMX CPUs and other
  devices keep SDPA, bit for bit;
- the last layer computes only each sequence's final token (the only row the margin reads);
- compile=True runs the elementwise work (norms, q/k norm + RoPE, residual add + norm, SwiGLU; in
  int8, quantizing each projection's input and scaling its integer product) as torch.compile'd
  fusions (needs a C++ compiler on the CPU);
- LoRA dropout: a model's layers that read the same input (q/k/v; gate/up) share one mask (the
  model's DropoutCache: two models share none), drawn as geometric gaps between dropped positions
  (nn.Dropout's Bernoulli law from ~p*n random numbers), and the shared prefix rows draw one mask
  for the whole micro-batch. The law of each mask is PEFT's; the sharing is a declared deviation
  (PEFT draws one per module and per sequence), so with dropout > 0 training draws other masks than
  the reference.
- `reuse_freed_memory()` is not installed: it sets glibc's malloc for the whole process, so the
  application calls it (run.py does).
Why each path is faster, with measurements: docs/PERF.md.

Usage: speed.install(rr.model, compile=False)
"""
import contextlib
import ctypes
import dataclasses
import math
import os
import platform
import re
import shutil
import sys
import types
import weakref
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import lora
import reranker
from reranker import rms_norm, rope_cos_sin


# ----------------------------------------------------------------------------- RoPE, signed sine


def signed_sine(sin):
    """sin (..., E) -> [-sin1, sin2]: with it RoPE's rotate_half(x) * sin is [x2, x1] * signed sine."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


def apply_rope_signed(x, cos, sin_signed):
    """reranker.apply_rope with the signed sine: x (N, heads, E) -> x * cos + [x2, x1] * sin_signed."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)                     # [x2, x1]
    return x * cos + swapped * sin_signed


# ----------------------------------------------------------------------------- shared prompt prefix


def common_prefix_len(seqs):
    """Length of the longest common prefix of token-id lists, capped one short of the shortest, so
    that every sequence keeps its own final token (the one that is scored)."""
    n = min(len(x) for x in seqs) - 1
    first = seqs[0]
    for x in seqs[1:]:
        n = next((i for i in range(n) if x[i] != first[i]), n)
    return max(n, 0)


def shared_prefix(ids, lens):
    """ids (N,) of S sequences packed back to back (lengths `lens`) -> (P, ids, own lengths): the
    sequences' common first P tokens kept once at the front (the first sequence's), every other
    sequence's copy dropped. P = 0 for a single sequence."""
    flat = ids.tolist()
    starts = list(accumulate([0] + lens[:-1]))
    P = common_prefix_len([flat[s:s + L] for s, L in zip(starts, lens)]) if len(lens) > 1 else 0
    if P == 0:
        return 0, ids, lens
    keep = torch.ones(len(flat), dtype=torch.bool)
    for s in starts[1:]:
        keep[s:s + P] = False
    return P, ids[keep.to(ids.device)], [L - P for L in lens]


def sequence_rows(t, prefix, start, length):
    """One sequence's rows of a packed (N, ...) tensor whose first `prefix` rows are shared: rows
    0..prefix-1, then its own rows start..start+length-1 -> (prefix+length, ...). A view when the
    two are adjacent (no prefix, or the first sequence)."""
    if prefix == 0 or start == prefix:
        return t[start - prefix:start + length]
    return torch.cat([t[:prefix], t[start:start + length]])


def positions(model, lens, prefix, device):
    """RoPE cos and signed sine (N, 1, E) of rows packed as `prefix` shared rows (positions 0..P-1),
    then each sequence's own rows (P..P+L-1); and each sequence's final row (S,)."""
    pos = torch.cat([torch.arange(prefix, device=device)]
                    + [torch.arange(prefix, prefix + L, device=device) for L in lens])      # (N,)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta, model.embed_tokens.weight.dtype)
    return cos, signed_sine(sin), prefix + torch.tensor(lens, device=device).cumsum(0) - 1


# ----------------------------------------------------------------------------- packed attention


# CPU SDPA (torch 2.13's flash kernel) runs several times slower at lengths that are not a multiple
# of 32, so on the CPU a sequence is copied into a zero-padded head-major buffer of such a length
# (causal: no real query sees the padding); lengths that are already multiples are used as they are.
CPU_SDPA_PAD = 32


def seq_heads(t, P, start, L, n):
    """One sequence's rows of a packed (N, heads, E) tensor, as sequence_rows, copied into a contiguous
    head-major (1, heads, n, E) buffer whose rows P+L..n-1 are zero."""
    buf = t.new_empty(1, t.shape[1], n, t.shape[2])
    buf[0, :, :P] = t[:P].transpose(0, 1)
    buf[0, :, P:P + L] = t[start:start + L].transpose(0, 1)
    buf[0, :, P + L:] = 0
    return buf


def packed_causal_sdpa(q, k, v, lens, P=0):
    """reranker.packed_causal_sdpa with a shared prefix and the CPU's length padding. q (N, H, E), k
    and v (N, K, E): P shared prefix rows, then each sequence's own rows (lengths `lens`) -> (N, H, E).
    Each sequence attends over prefix + own rows; the prefix queries ride along so that one square
    causal mask serves, and their output rows are kept once (sequence 0). On the CPU a sequence
    whose length is not a multiple of CPU_SDPA_PAD is first copied into a head-major buffer padded
    with zero rows up to one: causal, so no real query sees a padding key, and the padding queries'
    outputs are dropped."""
    out = torch.empty_like(q)                                                     # (N, H, E)
    start = P
    for j, L in enumerate(lens):
        if q.device.type == "cpu" and (P + L) % CPU_SDPA_PAD:
            n = -(-(P + L) // CPU_SDPA_PAD) * CPU_SDPA_PAD
            qj, kj, vj = (seq_heads(t, P, start, L, n) for t in (q, k, v))     # (1, heads, n, E)
        else:
            qj, kj, vj = (sequence_rows(t, P, start, L).transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qj, kj, vj, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        if j == 0:
            out[:start + L] = o[:start + L]                                       # with the prefix rows
        else:
            out[start:start + L] = o[P:P + L]                                     # (L, H, E)
        start += L
    return out


class SequenceGroups(NamedTuple):
    """One sequence of a packed attention, in the blocked kernels' layout: its queries held at packed
    rows lo..lo+R-1 (local rows r0..P+L-1: the prefix's queries count once, in sequence 0), grouped by
    kv head (query head h = i*G + g reads kv head i, repeat-interleave order), and its keys and values
    0..P+L-1 (prefix, then own) head-major and contiguous; its own rows are packed rows start..start+L-1."""
    lo: int
    R: int
    r0: int
    start: int
    L: int
    qg: torch.Tensor              # (K, G, R, E)
    k0: torch.Tensor              # (K, P+L, E)
    v0: torch.Tensor              # (K, P+L, E)


def by_kv_head(t, lo, R, K):
    """Rows lo..lo+R-1 of a packed (N, H, E) query-shaped tensor, its heads grouped by kv head -> (K, G, R, E)."""
    return t[lo:lo + R].permute(1, 0, 2).reshape(K, t.shape[1] // K, R, t.shape[2])


def sequence_groups(q, k, v, lens, P):
    """The sequences of a packed attention (q (N, H, E), k and v (N, K, E)), each as SequenceGroups."""
    start = P
    for j, L in enumerate(lens):
        r0, lo = (0, 0) if j == 0 else (P, start)
        R = P + L - r0
        qg = by_kv_head(q, lo, R, k.shape[1])
        k0, v0 = (sequence_rows(t, P, start, L).transpose(0, 1).contiguous() for t in (k, v))
        yield SequenceGroups(lo, R, r0, start, L, qg, k0, v0)
        start += L


def first_rows(t, b):
    """The first b rows of a contiguous (K, L, E) tensor, contiguous: (K, b, E), t itself when b = L. A
    batched GEMM given the strided slice t[:, :b] transposed copies it into a transposed layout first,
    slower than this plain copy."""
    return t if b == t.shape[1] else t[:, :b].contiguous()


def block_probabilities(qb, kb, a, b, G, scale):
    """The attention probabilities of query rows a..b-1 (qb (K, G*n, E), G query heads per kv head)
    over the keys they can see, 0..b-1 (kb (K, b, E), contiguous: first_rows of the sequence's keys):
    softmax(Q K^T / sqrt(E) + causal mask) -> (K, G*n, b). The scores and probabilities stay in the
    model dtype (bf16, as transformers' eager attention keeps them; softmax accumulates in float32);
    each row sees all its keys at once, so the softmax is exact, not an online rescaling."""
    n = b - a
    bias = torch.zeros(n, b, dtype=qb.dtype, device=qb.device)                   # causal mask as -inf bias
    bias[:, a:] = torch.full((n, n), float("-inf"), dtype=qb.dtype, device=qb.device).triu(1)
    return torch.softmax(torch.baddbmm(bias.repeat(G, 1), qb, kb.transpose(1, 2), alpha=scale), dim=-1)


# The blocked forward keeps a sequence's probabilities for the hand backward when it has at most this many
# keys (P + L): then they take at most H * KEEP_MAX_KEYS / 2 values a token and layer (16 KiB in bf16 at
# 16 heads, about half of what a layer saves a token anyway); a longer sequence's are recomputed.
KEEP_MAX_KEYS = 1024


def kept(P, L):
    """Whether the blocked forward keeps the probabilities of a sequence of P + L keys (KEEP_MAX_KEYS)."""
    return P + L <= KEEP_MAX_KEYS


def blocked_causal_attention(q, k, v, lens, P=0, block=128, keep=None):
    """packed_causal_sdpa as blocked matmuls: per sequence, each block of `block` query rows meets only
    the keys it can see, O = softmax(Q K^T / sqrt(E) + causal mask) V, two batched GEMMs a block (over
    kv heads, each with its G query heads stacked). The GEMMs are what the CPU's matrix units run
    (AMX, AVX-512 BF16); on AVX-512 BF16 without AMX torch's CPU flash attention runs bf16 at a
    third of that rate or less (docs/PERF.md).
    q (N, H, E), k and v (N, K, E), packed as packed_causal_sdpa takes them -> (N, H, E). `keep`, a
    list, receives the probabilities (K, G*n, b) of each block of the sequences `kept` selects, in
    order (sequence_groups', then by rows), for the hand backward."""
    K, E = k.shape[1], q.shape[2]
    G, scale = q.shape[1] // K, E ** -0.5
    out = torch.empty_like(q)                                                     # (N, H, E)
    for s in sequence_groups(q, k, v, lens, P):
        og = torch.empty_like(s.qg)                                               # (K, G, R, E)
        for a in range(s.r0, P + s.L, block):
            b = min(a + block, P + s.L)
            n = b - a
            qb = s.qg[:, :, a - s.r0:b - s.r0].reshape(K, G * n, E)               # (K, G*n, E)
            p = block_probabilities(qb, first_rows(s.k0, b), a, b, G, scale)      # (K, G*n, b)
            if keep is not None and kept(P, s.L):
                keep.append(p)
            og[:, :, a - s.r0:b - s.r0] = torch.bmm(p, first_rows(s.v0, b)).view(K, G, n, E)   # P V
        out[s.lo:s.lo + s.R] = og.view(q.shape[1], s.R, E).transpose(0, 1)
    return out


BF16_UNITS = ("amx_bf16", "avx512_bf16")                  # x86 units that multiply bf16 natively
INT8_UNITS = ("amx_int8", "avx512_vnni", "avx_vnni")      # x86 int8 dot products (VNNI) or tiles (AMX)


def units(cpuinfo, names=BF16_UNITS):
    """The units of `names` that /proc/cpuinfo's text (its flags lines) names: a subset of names."""
    return set(re.findall(r"\b(" + "|".join(names) + r")\b", cpuinfo))


def cpu_units(names):
    """units of this CPU; None off x86 Linux, where the flags are not read (ARM names its units
    otherwise)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return units(f.read(), names)
    except OSError:
        return None


# Without a bf16 unit an x86 CPU runs bf16 matmuls at a few GFLOP/s; without an int8 one, torch's int8
# GEMM (torch._int_mm) runs a plain loop, slower than float32 (lora.int8_matmul).
CPU_BF16_UNITS, CPU_INT8_UNITS = cpu_units(BF16_UNITS), cpu_units(INT8_UNITS)
# bf16 attention's forward as blocked matmuls where they were measured faster than torch's CPU flash
# attention: AVX-512 BF16 without AMX (docs/PERF.md). With AMX that kernel runs AMX micro-kernels of its
# own and is the faster of the two (docs/PERF.md); `bench --what train` times both on any CPU.
BLOCKED_BF16_ATTENTION = CPU_BF16_UNITS == {"avx512_bf16"}


def runs_blocked(q):
    """Whether attention on q runs the blocked kernel: bf16 on the CPU, where BLOCKED_BF16_ATTENTION."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and BLOCKED_BF16_ATTENTION


def packed_causal_attention(q, k, v, lens, P=0, block=128, keep=None):
    """Packed causal attention's forward by the kernel this device runs fastest: bf16 where
    BLOCKED_BF16_ATTENTION, blocked_causal_attention (`block` rows a block; `keep` receives its
    probabilities); elsewhere SDPA (packed_causal_sdpa), whose float32 results it keeps bit for bit,
    and `keep` stays empty."""
    if runs_blocked(q):
        return blocked_causal_attention(q, k, v, lens, P, block, keep)
    return packed_causal_sdpa(q, k, v, lens, P)


def final_token_attention(q, k, v, lens, P=0):
    """Each sequence's final query against all its keys, the last layer's attention at inference.
    q (S, H, E): sequence j's final row; k and v (N, K, E), packed as packed_causal_sdpa takes them
    -> (S, H, E). One query row sees every key, so no mask. In bf16 where BLOCKED_BF16_ATTENTION the
    blocked kernel's math for that one row (scores and probabilities in bf16); elsewhere one SDPA call
    per sequence, without mask or padding."""
    K, E = k.shape[1], q.shape[2]
    G = q.shape[1] // K
    blocked = runs_blocked(q)
    out, start = torch.empty_like(q), P
    for j, L in enumerate(lens):
        kj, vj = (sequence_rows(t, P, start, L).transpose(0, 1) for t in (k, v))      # (K, P+L, E)
        if blocked:
            p = block_probabilities(q[j].view(K, G, E), kj.contiguous(), P + L - 1, P + L, G, E ** -0.5)  # (K, G, P+L)
            out[j] = torch.bmm(p, vj.contiguous()).view(-1, E)                         # (K, G, E) -> (H, E)
        else:
            out[j] = F.scaled_dot_product_attention(q[j][None, :, None], kj[None], vj[None], enable_gqa=True)[0, :, 0]
        start += L
    return out


# ----------------------------------------------------------------------------- many short documents

# Randomized deletion (certify.py) scores thousands of short documents under one long prompt prefix
# (~270 tokens of instruction and query before a ~20-token sample). The per-sequence paths above run
# the prefix's queries again for every sequence, one SDPA call each. Here the prefix attends to itself
# once, and the sequences' own queries go in padded batches, one SDPA call a batch, over the prefix's
# keys and their own under a mask.
SHORT_BATCH_KEYS = 1 << 14            # keys a padded batch holds at most (sequences x (prefix + longest))


def prefixed(t, P, starts, lens):
    """Each sequence's keys (or queries) of a packed (N, heads, E) tensor: the P prefix rows, then its own
    rows padded with its last one -> ((B, heads, P + Lmax, E), own rows (B, Lmax))."""
    i = torch.arange(max(lens), device=t.device)
    rows = torch.stack([s + i.clamp(max=L - 1) for s, L in zip(starts, lens)])     # (B, Lmax)
    pre = torch.arange(P, device=t.device).expand(len(lens), P)
    return t[torch.cat([pre, rows], 1)].transpose(1, 2), rows


def short_documents_sdpa(q, k, v, lens, P=0):
    """packed_causal_sdpa for many short sequences under a shared prefix: the prefix's queries over the
    prefix (causal, once), then every sequence's own queries in padded batches. Own query l sees the prefix
    and own keys 0..l; a padded key lies right of every real query's limit and a padded query's output is
    dropped, so one (Lmax, P + Lmax) mask serves a batch. q (N, H, E), k and v (N, K, E) -> (N, H, E)."""
    if torch.is_grad_enabled() or P == 0:
        return attention_packed(q, k, v, lens, P)
    out = torch.empty_like(q)
    out[:P] = packed_causal_sdpa(q[:P], k[:P], v[:P], [P], 0)
    starts = list(accumulate(lens[:-1], initial=P))
    step = max(1, SHORT_BATCH_KEYS // (P + max(lens)))
    for c in range(0, len(lens), step):
        Ls, st = lens[c:c + step], starts[c:c + step]
        (kb, rows), (vb, _) = (prefixed(t, P, st, Ls) for t in (k, v))            # (B, K, P+Lm, E)
        Lm = rows.shape[1]
        l, col = torch.arange(Lm, device=q.device), torch.arange(P + Lm, device=q.device)
        seen = (col[None] < P) | (col[None] - P <= l[:, None])                   # (Lm, P+Lm)
        o = F.scaled_dot_product_attention(q[rows].transpose(1, 2), kb, vb, attn_mask=seen, enable_gqa=True)
        real = l[None] < torch.tensor(Ls, device=q.device)[:, None]               # (B, Lm)
        out[rows[real]] = o.transpose(1, 2)[real]                                 # (rows, H, E)
    return out


def short_documents_final(q, k, v, lens, P=0):
    """final_token_attention for many short sequences: each sequence's final query over the prefix's keys
    and its own in padded batches, the padding masked. q (S, H, E) -> (S, H, E)."""
    if torch.is_grad_enabled() or P == 0:
        return final_token_attention(q, k, v, lens, P)
    out = torch.empty_like(q)
    starts = list(accumulate(lens[:-1], initial=P))
    step = max(1, SHORT_BATCH_KEYS // (P + max(lens)))
    for c in range(0, len(lens), step):
        Ls, st = lens[c:c + step], starts[c:c + step]
        (kb, rows), (vb, _) = (prefixed(t, P, st, Ls) for t in (k, v))            # (B, K, P+Lm, E)
        B, Lm = rows.shape
        col = torch.arange(P + Lm, device=q.device)[None]
        seen = col - P < torch.tensor(Ls, device=q.device)[:, None]               # (B, P+Lm)
        o = F.scaled_dot_product_attention(q[c:c + B, :, None], kb, vb, attn_mask=seen[:, None, None],
                                           enable_gqa=True)                       # (B, H, 1, E)
        out[c:c + B] = o[:, :, 0]
    return out


@contextlib.contextmanager
def short_documents(model):
    """Within: `model`'s attention runs short_documents_sdpa and short_documents_final (inference only;
    the same math as the per-sequence paths, tested equal). A model without the fast forwards is left
    as it is."""
    mods = [m for m in model.modules() if isinstance(m, reranker.Attention) and hasattr(m, "kernels")]
    old = [m.kernels for m in mods]
    for m in mods:
        m.kernels = dataclasses.replace(m.kernels, attention=short_documents_sdpa, final=short_documents_final)
    try:
        yield model
    finally:
        for m, kn in zip(mods, old):
            m.kernels = kn


# ----------------------------------------------------------------------------- hand-written backward passes


class RMSNormFunction(torch.autograd.Function):
    """Qwen3RMSNorm with a hand-written backward: y = w * bf16(x r), r = (mean(x^2) + eps)^(-1/2).
    Autograd through the float32 upcast keeps several (N, C) float32 copies and spends ~10 passes
    over them; here only x and r (N, 1) are kept. The bf16 rounding counts as identity in the
    backward, as it does for autograd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)              # (..., 1) float32
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, r = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[1]:
            xhat = (x.float() * r).to(x.dtype)
            gw = (g * xhat).float().reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gh = (g * weight).float()                                             # dL/dx_hat, (..., C)
        xf = x.float()
        xhat = xf.mul_(r) if xf is not x else xf * r                          # x_hat = x r (never overwrite x)
        # dx_hat_i/dx_j = r delta_ij - x_hat_i x_hat_j r / C  =>  dL/dx = r (gh - x_hat mean(gh x_hat))
        coef = torch.linalg.vecdot(gh, xhat).unsqueeze(-1).div_(x.shape[-1])  # (..., 1)
        gx = gh.sub_(xhat.mul_(coef)).mul_(r)
        return gx.to(x.dtype), gw, None


# Devices whose training attention uses PackedCausalAttention's hand backward; elsewhere (CUDA) SDPA's
# own fused backward is used through autograd.
HAND_BACKWARD = ("cpu",)


class PackedCausalAttention(torch.autograd.Function):
    """Causal grouped-query attention over packed sequences, for training on the CPU.
    q (N, H, E), k and v (N, K, E), packed as in Attention.forward (P shared prefix rows, then each
    sequence's own rows, lengths `lens`) -> (N, H, E). Forward: packed_causal_attention (SDPA per
    sequence, or bf16 blocked matmuls of `block` query rows), written straight into one packed output.
    Backward by hand, per sequence, over blocks of `block` query rows, each against only the keys it
    can see (0 .. its last row): about half the work of a dense backward. The probabilities are
    recomputed (FlashAttention's choice: SDPA's forward keeps only its output) or, for the sequences
    of at most KEEP_MAX_KEYS keys after the blocked forward, kept from it as saved tensors (gradient
    checkpointing drops them as it drops the rest): about H (L P + L^2/2 + L block/2) values a
    sequence, 15 MiB a layer at 3 x 512 tokens and 16 heads in bf16, which spares each block a GEMM
    and a softmax. The gradients land directly in packed (N, ...) buffers: slicing the packed tensors
    per sequence and letting autograd undo it would zero-fill and add a full-size gradient for every
    sequence and each of q, k, v. Once differentiable: the kept probabilities carry no graph.
    Numerics of the backward: scores and probabilities in the model dtype (bf16 as transformers'
    eager attention keeps them; softmax accumulates in float32), and dK, dV summed over a sequence's blocks
    in it too (one rounding a block, where one dense GEMM rounds once); exact in float32."""

    @staticmethod
    def forward(ctx, q, k, v, lens, P=0, block=128):
        probs = []
        out = packed_causal_attention(q, k, v, lens, P, block, probs)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.lens, ctx.P, ctx.block = lens, P, block
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, *probs = ctx.saved_tensors
        P, block = ctx.P, ctx.block
        K, E = k.shape[1], q.shape[2]
        G, scale = q.shape[1] // K, E ** -0.5
        dq = torch.empty_like(q)                                                  # every row written once
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)                         # prefix rows: summed over sequences
        saved = iter(probs)                              # the blocked forward's, in its order; none after SDPA's
        for s in sequence_groups(q, k, v, ctx.lens, P):
            dog = by_kv_head(do, s.lo, s.R, K)                                    # dO grouped as Q is
            # k0, v0 contiguous once per sequence (K, P+L, E); each block reads its first b rows (first_rows)
            dqg = torch.empty_like(s.qg)
            dkl, dvl = torch.zeros_like(s.k0), torch.zeros_like(s.v0)             # (K, P+L, E)
            for a in range(s.r0, P + s.L, block):
                b = min(a + block, P + s.L)                                       # rows a..b-1 see keys 0..b-1
                n = b - a
                qb = s.qg[:, :, a - s.r0:b - s.r0].reshape(K, G * n, E)           # (K, G*n, E)
                dob = dog[:, :, a - s.r0:b - s.r0].reshape(K, G * n, E)
                kb = first_rows(s.k0, b)                                          # (K, b, E)
                p = next(saved) if probs and kept(P, s.L) else block_probabilities(qb, kb, a, b, G, scale)
                dvl[:, :b].baddbmm_(p.transpose(1, 2), dob)                       # dV = P^T dO
                dp = torch.bmm(dob, first_rows(s.v0, b).transpose(1, 2))          # dP = dO V^T, (K, G*n, b)
                # softmax backward dS = P * (dP - rowsum(P * dP)), times the scores' 1/sqrt(E)
                ds = dp.sub_(torch.linalg.vecdot(p, dp).unsqueeze(-1)).mul_(p).mul_(scale)
                dqg[:, :, a - s.r0:b - s.r0] = torch.bmm(ds, kb).view(K, G, n, E)  # dQ = dS K
                dkl[:, :b].baddbmm_(ds.transpose(1, 2), qb)                       # dK = dS^T Q
            dq[s.lo:s.lo + s.R] = dqg.view(q.shape[1], s.R, E).transpose(0, 1)
            for g, gl in ((dk, dkl), (dv, dvl)):                                  # back to packed rows
                gl = gl.transpose(0, 1)                                           # (P+L, K, E)
                g[:P] += gl[:P]
                g[s.start:s.start + s.L] += gl[P:]
        assert next(saved, None) is None, "the backward read fewer probabilities than the forward kept"
        return dq, dk, dv, None, None, None


# ----------------------------------------------------------------------------- fused elementwise path
# Plain-torch forms of the elementwise pieces. With compile=True each is torch.compile'd (dynamic
# shapes, so one compilation serves every packed length) into one fused loop for the forward and one
# for the backward. Eager PyTorch runs each op as its own pass over memory (docs/PERF.md).

def norm_rope(x, weight, eps, cos, sin_signed):
    """Per-head q/k RMSNorm followed by RoPE, as one function. x (N, heads, E); cos, sin (N, 1, E)."""
    return apply_rope_signed(rms_norm(x, weight, eps), cos, sin_signed)


def add_rms_norm(x, h, weight, eps):
    """The residual add and the post-attention norm: returns (x + h, rms_norm(x + h)). (N, C) each."""
    x = x + h
    return x, rms_norm(x, weight, eps)


def swiglu(g, u):
    """SwiGLU's elementwise part, silu(gate) * up. (N, F)."""
    return F.silu(g) * u


def int8_scale(y, sx, sw, dtype):
    """Int8Linear's epilogue: the exact integer product y (M, N) -> y s_x s_W^T in `dtype`; s_x (M, 1), s_W
    (1, N) float32."""
    return (y.float() * sx * sw).to(dtype)


_FUSED = {}


def cpp_compiler_available():
    """Whether torch.compile can build CPU kernels here: inductor calls $CXX, else g++ (clang++ on macOS)."""
    return shutil.which(os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")) is not None


def fused(fn):
    """torch.compile(fn, dynamic=True), compiled once per function on first use (needs a C++ compiler
    on the CPU, Triton on CUDA: what torch.compile's inductor backend needs)."""
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn, dynamic=True)
    return _FUSED[fn]


# ----------------------------------------------------------------------------- kernel sets


def apply_rope_(x, cos, sin_signed):
    """apply_rope_signed, in place at inference (x is a fresh projection output)."""
    if torch.is_grad_enabled():
        return apply_rope_signed(x, cos, sin_signed)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x.mul_(cos).add_(swapped.mul_(sin_signed))


def rms_norm_eager(x, weight, eps):
    """rms_norm with the hand backward when a gradient is needed, in place at inference."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps)
    if x.dtype == torch.float32:                                          # x.float() is x: do not overwrite it
        return rms_norm(x, weight, eps)
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)              # (..., 1) float32
    # bf16/f16 without gradient: same roundings, fewer large allocations (they dominate on CPU)
    return xf.mul_(r).to(x.dtype).mul_(weight)


def norm_rope_eager(x, weight, eps, cos, sin_signed):
    return apply_rope_(rms_norm_eager(x, weight, eps), cos, sin_signed)


def add_rms_norm_eager(x, h, weight, eps):
    """add_rms_norm; at inference the sum reuses h's memory (h is a fresh attention output)."""
    x = x + h if torch.is_grad_enabled() else h.add_(x)
    return x, rms_norm_eager(x, weight, eps)


def swiglu_eager(g, u):
    """swiglu; at inference in place in g."""
    return F.silu(g) * u if torch.is_grad_enabled() else F.silu(g, inplace=True).mul_(u)


def int8_scale_(y, sx, sw, dtype):
    """int8_scale, in place in the product's float32 copy (it is tens of MB at 10 x 512 tokens)."""
    return y.float().mul_(sx).mul_(sw).to(dtype)


def residual_add(x, y):
    """x + y; at inference in place in x."""
    return x + y if torch.is_grad_enabled() else x.add_(y)


def attention_packed(q, k, v, lens, P):
    """Packed causal attention: in training on HAND_BACKWARD devices with the hand backward, else
    packed_causal_attention's forward (autograd takes SDPA's own backward)."""
    if torch.is_grad_enabled() and q.requires_grad and q.device.type in HAND_BACKWARD:
        return PackedCausalAttention.apply(q, k, v, lens, P)
    return packed_causal_attention(q, k, v, lens, P)


@dataclass(frozen=True)
class Kernels:
    """The decoder's non-matmul work, one function each, chosen once for the whole model."""
    rms_norm: object        # (x, weight, eps) -> norm(x)
    norm_rope: object       # (x, weight, eps, cos, sin_signed) -> RoPE(norm(x)), per head
    add_rms_norm: object    # (x, h, weight, eps) -> (x + h, norm(x + h))
    swiglu: object          # (gate, up) -> silu(gate) * up
    add: object             # (x, y) -> x + y
    attention: object       # (q, k, v, lens, P) -> packed causal attention output
    final: object           # (q, k, v, lens, P) -> each sequence's final query's attention output
    int8_quantize: object   # (x (M, K)) -> (int8 (M, K), row scales (M, 1)): lora.int8_quantize
    int8_scale: object      # (y, s_x, s_W, dtype) -> y s_x s_W^T in dtype


EAGER = Kernels(rms_norm_eager, norm_rope_eager, add_rms_norm_eager, swiglu_eager, residual_add, attention_packed,
                final_token_attention, lora.int8_quantize, int8_scale_)
# torch.compile'd on first use (`fused`): the plain functions as one loop each; attention and the int8 GEMM as EAGER
COMPILED = Kernels(lambda *a: fused(rms_norm)(*a), lambda *a: fused(norm_rope)(*a),
                   lambda *a: fused(add_rms_norm)(*a), lambda *a: fused(swiglu)(*a), torch.add, attention_packed,
                   final_token_attention, lambda *a: fused(lora.int8_quantize)(*a), lambda *a: fused(int8_scale)(*a))


# ----------------------------------------------------------------------------- fast forwards


def rmsnorm_forward(self, x):
    return self.kernels.rms_norm(x, self.weight, self.eps)


def attention_forward(self, x, cos, sin, lens, prefix=0, last=None):
    """Attention.forward; with `last` ((S,) final-token rows) only those S queries: -> (S, C)."""
    xq, cq, sq = (x, cos, sin) if last is None else (x[last], cos[last], sin[last])   # (N or S, ...)
    q = self.q_proj(xq).view(-1, self.H, self.E)                              # (N|S, H, E)
    k, v = (proj(x).view(-1, self.K, self.E) for proj in (self.k_proj, self.v_proj))   # (N, K, E) each
    q = self.kernels.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cq, sq)
    k = self.kernels.norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
    o = (self.kernels.attention if last is None else self.kernels.final)(q, k, v, lens, prefix)   # (N|S, H, E)
    return self.o_proj(o.view(-1, self.H * self.E))                           # (N|S, C)


def mlp_forward(self, x):
    return self.down_proj(self.kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


def block_forward(self, x, cos, sin, lens, prefix=0, last=None):
    h = self.self_attn(self.input_layernorm(x), cos, sin, lens, prefix, last)
    x = x if last is None else x[last]                                        # (N|S, C)
    norm = self.post_attention_layernorm
    x, n = self.kernels.add_rms_norm(x, h, norm.weight, norm.eps)            # x + h, and its norm
    return self.kernels.add(x, self.mlp(n))


def model_forward(self, ids, lens):
    """Qwen3Model.forward: ids (N,) of S sequences packed back to back (lengths `lens`) -> (S, C).
    The sequences' common first tokens run once (share_prefix), and the last layer computes the
    final tokens only."""
    P, ids, lens = shared_prefix(ids, lens) if self.share_prefix else (0, ids, lens)
    x = self.embed_tokens(ids)                                                # (N, C)
    cos, sin, last = positions(self, lens, P, ids.device)
    for i, layer in enumerate(self.layers):
        li = last if i == len(self.layers) - 1 else None
        if self.gradient_checkpointing and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, lens, P, li, use_reentrant=False)
        else:
            x = layer(x, cos, sin, lens, P, li)
    return self.norm(x)                                                       # (S, C)


# ----------------------------------------------------------------------------- LoRA dropout


def dropout_mask(shape, p, dtype=torch.float32, device="cpu"):
    """A 0/1 keep-mask of `shape`: each element 0 with probability p, independently (nn.Dropout's law,
    without its 1/(1-p) rescale). Drawn as the gaps between dropped positions, which in a Bernoulli(p)
    process are i.i.d. Geometric(p) on {1, 2, ...}: about p*n random numbers instead of n."""
    n = math.prod(shape)
    mask = torch.ones(n, dtype=dtype, device=device)
    last = -1                                                       # flat index of the last dropped element
    while last < n:
        k = int(n * p + 6 * math.sqrt(n * p + 1)) + 16              # enough gaps to pass n almost always
        gaps = torch.empty(k, dtype=torch.float64, device=device).geometric_(p)
        pos = last + gaps.cumsum(0).long()                          # (k,) increasing dropped positions
        mask[pos[pos < n]] = 0
        last = int(pos[-1])                                         # < n: rare, draw more gaps from there
    return mask.view(shape)


class DropoutCache:
    """One model's last (input, dropped input) pair: q/k/v (and gate/up) read the same tensor, so they
    share one dropped copy. `install` gives each model one, held by the model and its LoRA layers, so two
    models never share a mask. The input is held weakly (only its identity matters); the dropped copy
    strongly, so that whether a mask is shared never depends on what autograd keeps alive (under
    gradient checkpointing the recomputation must draw exactly the masks the forward drew)."""

    def __init__(self):
        self.src, self.p, self.dropped = lambda: None, None, None

    def __call__(self, x, p):
        """x with a 0/1 keep-mask applied: the cached copy when x and the rate p are the last seen, else a new
        draw (two layers of one input at different rates draw their own masks)."""
        if self.src() is not x or self.p != p:
            self.dropped = x * dropout_mask(x.shape, p, x.dtype, x.device)          # 0/1 mask: exact
            self.src, self.p = weakref.ref(x), p
        return self.dropped

    def __reduce__(self):      # a copied or pickled model starts with an empty cache of its own
        return DropoutCache, ()


def int8_forward(self, x):
    """Int8Linear.forward with its quantizing and scaling passes from the kernel set (one loop each when
    compiled; the integer GEMM, lora.int8_matmul, as it is)."""
    flat = x.reshape(-1, self.in_features)                              # (M, in)
    xq, sx = self.kernels.int8_quantize(flat)                           # (M, in) int8, (M, 1)
    y = lora.int8_matmul(xq, self.qweight, self.units)                  # (M, out), exact sums
    return self.kernels.int8_scale(y, sx, self.scale, x.dtype).view(*x.shape[:-1], self.out_features)


def quantize_int8(model):
    """lora.quantize_int8 with this CPU's int8 units (CPU_INT8_UNITS), in place; on a model with the speed
    paths its Int8Linear layers then take them too (the model's kernel set, compiled or eager)."""
    lora.quantize_int8(model, CPU_INT8_UNITS)
    if installed(model) is not None:
        install(model, compile=installed(model) is COMPILED, share_prefix=model.share_prefix)
    return model


def lora_forward(self, x):
    """LoRALinear.forward with the shared geometric-gap dropout mask; the rescale 1/(1-p) is applied to
    the (N, r) product, and the add fused into the second GEMM (addmm)."""
    y = self.base(x)                                                     # (N, out)
    if not self.enabled or self.merged:
        return y
    scaling = self.scaling
    if self.training and self.dropout > 0:
        x = self.dropout_cache(x, self.dropout)                         # shared by this model's layers
        scaling = scaling / (1 - self.dropout)
    A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    h = (x @ A.t()) * scaling                                            # (N, r)
    return torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), B.t()).view(y.shape)


# ----------------------------------------------------------------------------- process-wide: freed memory

# glibc's mallopt parameters (<malloc.h>)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def reuse_freed_memory(mmap_threshold=64 << 20, trim_threshold=128 << 20):
    """Keep the memory a call frees for the next call, with glibc's malloc; process-wide, so only an
    entry point opts in (run.py's __main__, bench.py's fresh processes first thing; no library code).
    torch takes every CPU tensor from malloc, and glibc gives large freed blocks back to the kernel
    (munmap, or by trimming the top of its heap) by its dynamic thresholds: the next call's activations
    then fault fresh zeroed pages back in, page by page (tens of thousands of minor faults a scoring
    call at real width, docs/PERF.md).
    With fixed thresholds, blocks under `mmap_threshold` come from the heap, and up to `trim_threshold`
    bytes stay free at its top. Leaves malloc alone off glibc and where the environment already tunes
    it (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, glibc.malloc tunables) -> whether it set both."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt                                  # the process's own libc
    except (AttributeError, OSError, ValueError):                           # no confstr, no such name, no libc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Some glibc versions refuse an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2). The trim threshold is
    # set only once an mmap threshold is: setting it alone fixes the mmap threshold at its 128 KiB start.
    if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) or mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, 32 << 20))):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


# ----------------------------------------------------------------------------- install

FORWARDS = {reranker.RMSNorm: rmsnorm_forward, reranker.Attention: attention_forward, reranker.MLP: mlp_forward,
            reranker.Block: block_forward, reranker.Qwen3Model: model_forward, lora.LoRALinear: lora_forward,
            lora.Int8Linear: int8_forward}


def install(model, compile=False, share_prefix=True):
    """Bind the fast forwards on every module of `model` (a reranker.Qwen3Model, LoRA attached or not)
    whose type has one; EAGER kernels, or COMPILED with compile=True; `share_prefix` runs a
    micro-batch's common prompt prefix once (model.share_prefix); the model and its LoRA layers hold one
    DropoutCache (model.dropout_cache). Idempotent; returns the model."""
    if compile and next(model.parameters()).device.type == "cpu" and not cpp_compiler_available():
        raise RuntimeError("compile=True needs a C++ compiler on the CPU (torch.compile's inductor "
                           "backend builds its kernels with $CXX, else g++): install one or run without it")
    kernels = COMPILED if compile else EAGER
    cache = getattr(model, "dropout_cache", None) or DropoutCache()        # kept when installed again
    model.dropout_cache = cache
    for m in model.modules():
        fn = FORWARDS.get(type(m))
        if fn is not None:
            m.forward = types.MethodType(fn, m)
            m.kernels = kernels
        if isinstance(m, lora.LoRALinear):
            m.dropout_cache = cache
    if isinstance(model, reranker.Qwen3Model):
        model.share_prefix = share_prefix
    return model


def installed(model):
    """The Kernels installed on `model`, or None (the reference forwards)."""
    return getattr(model, "kernels", None)
