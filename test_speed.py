"""speed.py: the speed paths equal the reference (reranker.py, lora.py): margins, gradients, a
training step, the hand backward passes, compiled fusions, the dropout sampler's law; CUDA cases.
Run: python -m pytest -q test_speed.py
"""
import copy
import functools
import os
import random

import pytest
import torch

import lora
import reranker
import speed
from testing import CUDA, _rel, fast, hf_margins, train_with_lora


@pytest.fixture(scope="module")
def real_width(real_width_base):
    """Real width (hidden 1024, 16/8 heads, head_dim 128, MLP 3072, vocab 151669), 2 layers (a full
    layer and the last one, which the speed path runs on the final tokens only), written by
    transformers -> (folder, three token lists, the yes/no ids, transformers' fp32 margins on the
    CPU, its head run on the last position only: hf_margins reads only that one, and the (3, 300,
    151669) logits of every position would cost most of this fixture)."""
    from tokenizers import Tokenizer
    import transformers
    folder = real_width_base
    hm = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = random.Random(0)
    ids = [[g.randrange(1000, 150000) for _ in range(n)] for n in (37, 120, 300)]
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    yes, no = (tok.encode(w, add_special_tokens=False).ids[0] for w in ("yes", "no"))
    return folder, ids, (yes, no), hf_margins(functools.partial(hm, logits_to_keep=1), ids, yes, no)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_parity_real_width_fp32(real_width, device):
    """Ours on `device` in fp32, eager and with the torch.compile'd elementwise path, against
    transformers' fp32 forward on the CPU."""
    folder, ids, yes_no, ref = real_width
    rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32, device=device)
    assert (rr.yes_id, rr.no_id) == yes_no
    torch.testing.assert_close(rr.score_ids(ids).cpu(), ref, rtol=1e-4, atol=1e-4)
    # the torch.compile'd elementwise path at real width, same references and tolerances
    speed.install(rr.model, compile=True)
    torch.testing.assert_close(rr.score_ids(ids).cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_parity_real_width_bf16(real_width, device):
    """Ours on `device`, bf16 weights, eager and compiled: our float32 margin over bf16 weights vs the
    fp32 reference. Stated tolerance: 0.05 + 5% of |m| (bf16 keeps 8 mantissa bits; 2 layers of
    rounding)."""
    folder, ids, yes_no, ref = real_width
    rb = reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16, device=device)
    assert (rb.yes_id, rb.no_id) == yes_no
    mb = rb.score_ids(ids).cpu()
    assert mb.dtype == torch.float32
    assert torch.all((mb - ref).abs() <= 0.05 + 0.05 * ref.abs()), (mb, ref)
    speed.install(rb.model, compile=True)
    mc = rb.score_ids(ids).cpu()
    assert torch.all((mc - ref).abs() <= 0.05 + 0.05 * ref.abs()), (mc, ref)


@CUDA
def test_cuda_matches_the_cpu(hf_tiny):
    """Runs only where CUDA is available: the same transformers-saved weights on CUDA (SDPA's fused
    attention and its own backward) and on the CPU (packed SDPA and the hand backward) give the same
    fp32 scores and LoRA gradients (dropout 0), eager and compiled; bf16 on CUDA within the bf16
    parity tolerance of the fp32 CPU scores."""
    folder, hm = hf_tiny
    docs = ["Paris is the capital of France. " * 3, "short", "A much longer document about eggs. " * 40]
    cpu = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    ids = cpu.tokenize("What is the capital of France?", docs)
    ref = cpu.score_ids(ids)
    torch.testing.assert_close(ref, hf_margins(hm, ids, cpu.yes_id, cpu.no_id), rtol=1e-4, atol=1e-5)
    grads, init = {}, None
    for name, compile_ in (("cpu", False), ("cuda", False), ("cuda_compiled", True)):
        rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32, device=name[:4])
        speed.install(rr.model, compile=compile_)
        torch.testing.assert_close(rr.score_ids(ids).cpu(), ref, rtol=1e-4, atol=1e-5)
        train_with_lora(rr, seed=3, dropout=0.0)
        speed.install(rr.model, compile=compile_)
        mods = lora.lora_modules(rr.model)
        with torch.no_grad():   # the CPU's LoRA init on every device (CUDA's RNG draws a different stream)
            init = init or {n: (m.lora_A.clone(), m.lora_B.clone()) for n, m in mods.items()}
            for n, m in mods.items():
                m.lora_A.copy_(init[n][0])
                m.lora_B.copy_(init[n][1])
        rr.score_ids(ids, grad=True).pow(2).sum().backward()
        grads[name] = {n: p.grad.cpu() for n, p in rr.model.named_parameters() if p.grad is not None}
    for name in ("cuda", "cuda_compiled"):
        assert grads[name].keys() == grads["cpu"].keys()
        for n in grads["cpu"]:
            assert _rel(grads[name][n], grads["cpu"][n]) < 1e-4, (name, n)
    mb = reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16, device="cuda").score_ids(ids).cpu()
    assert mb.dtype == torch.float32 and torch.all((mb - ref).abs() <= 0.05 + 0.05 * ref.abs()), (mb, ref)


def test_compiled_elementwise_matches_eager(hf_tiny, monkeypatch):
    """compile=True (torch.compile'd norms, q/k norm + RoPE, residual add + norm, SwiGLU) gives the
    eager scores and LoRA gradients: fp32 to rounding, bf16 within the parity test's tolerance."""
    folder, _ = hf_tiny
    docs = ["Paris is the capital of France. " * 3, "short", "A much longer document about eggs. " * 40]
    eager = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.float32))
    comp = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.float32), compile=True)
    assert all(m.kernels is speed.COMPILED for m in comp.model.modules() if hasattr(m, "kernels"))
    ids = eager.tokenize("What is the capital of France?", docs)
    torch.testing.assert_close(comp.score_ids(ids), eager.score_ids(ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comp.score_ids(ids[1:2]), eager.score_ids(ids[1:2]), rtol=1e-5, atol=1e-5)
    assert {speed.rms_norm, speed.norm_rope, speed.add_rms_norm, speed.swiglu} <= set(speed._FUSED)
    # training: same LoRA init and dropout masks (drawn eagerly from the same seed) -> same gradients,
    # also with gradient checkpointing on the compiled side
    grads = []
    for rr in (eager, comp):
        train_with_lora(rr, seed=3, dropout=0.05, checkpointing=rr is comp)
        speed.install(rr.model, compile=rr is comp)
        torch.manual_seed(4)
        rr.score_ids(ids, grad=True).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in rr.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * eager.model.cfg.num_hidden_layers
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 1e-4, n
    # bf16: the fused loops keep some intermediates in float32; same tolerance as the bf16 parity test
    eb = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16))
    cb = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16), compile=True)
    me, mc = eb.score_ids(ids), cb.score_ids(ids)
    assert torch.all((mc - me).abs() <= 0.05 + 0.05 * me.abs()), (mc, me)
    # no C++ compiler on the CPU: a clear error up front, not a failure deep inside inductor
    # (shutil.which mocked: this machine has g++)
    monkeypatch.setattr(speed.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        speed.install(eager.model, compile=True)


def test_int8_layers_take_the_kernel_set_eager_or_compiled(hf_tiny):
    """speed.quantize_int8 gives a sped-up model's Int8Linear layers its kernel set: the compiled quantizing
    and scaling loops give the reference forward's values exactly (the same float32 operations in the same
    order), and the model scores as the reference int8 model within float32 rounding's reach on which way
    an activation rounds to int8."""
    folder, _ = hf_tiny
    docs = ["Paris is the capital of France. " * 3, "short", "A much longer document about eggs. " * 40]
    ref = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    ids = ref.tokenize("What is the capital of France?", docs)
    lora.quantize_int8(ref.model, speed.CPU_INT8_UNITS)
    want = ref.score_ids(ids)                                           # the reference forwards
    x = torch.randn(37, ref.model.cfg.hidden_size)
    for kernels in (speed.EAGER, speed.COMPILED):
        rr = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.float32), compile=kernels is speed.COMPILED)
        speed.quantize_int8(rr.model)
        layer = rr.model.layers[0].mlp.up_proj
        assert isinstance(layer, lora.Int8Linear) and layer.kernels is kernels
        assert torch.equal(layer(x), lora.Int8Linear.forward(layer, x))
        torch.testing.assert_close(rr.score_ids(ids), want, rtol=0, atol=0.01)


PREFIX_DOCS = ["Paris is the capital of France. " * 3, "short", "short", "A much longer document about eggs. " * 40,
               "Ünïcödé: naïve café, 東京の水道水は安全です。"]


def _prefix_ids(folder):
    """One query's five documents (two of them equal), tokenized -> (the speed path sharing the prefix, ids)."""
    shared = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.float32))
    return shared, shared.tokenize("What is the capital of France?", PREFIX_DOCS)


def test_the_shared_prefix_is_run_once(hf_tiny):
    """One query's documents share the prompt up to the document; the speed path runs that prefix
    once, also with duplicate documents (prefix capped one short)."""
    folder, _ = hf_tiny
    assert speed.common_prefix_len([[1, 2, 3], [1, 2, 4]]) == 2
    assert speed.common_prefix_len([[1, 2, 3], [1, 2, 3]]) == 2      # each keeps its final token
    assert speed.common_prefix_len([[5], [5, 6]]) == 0
    assert speed.common_prefix_len([[1, 2], [3, 2]]) == 0
    shared, ids = _prefix_ids(folder)
    P = speed.common_prefix_len(ids)
    assert P > len(shared.prefix_ids) + 10                           # system prompt + instruction + query
    lens = [len(x) for x in ids]
    kept = speed.shared_prefix(torch.tensor(sum(ids, [])), lens)     # what the model runs: the prefix once
    assert kept[0] == P and kept[1].tolist() == ids[0] + sum((x[P:] for x in ids[1:]), [])
    assert kept[2] == [L - P for L in lens]


def test_shared_prefix_scores_are_exact(hf_tiny):
    """Scores equal transformers' and the unshared path."""
    folder, hm = hf_tiny
    shared, ids = _prefix_ids(folder)
    alone = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    speed.install(alone.model, share_prefix=False)
    ref = hf_margins(hm, ids, shared.yes_id, shared.no_id)
    torch.testing.assert_close(shared.score_ids(ids), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shared.score_ids(ids), alone.score_ids(ids), rtol=1e-5, atol=1e-6)


def test_shared_prefix_lora_gradients_are_exact(hf_tiny, monkeypatch):
    """LoRA gradients equal the unshared ones, also with gradient checkpointing, and with attention
    differentiated by autograd through SDPA (the CUDA path) instead of the hand backward."""
    folder, _ = hf_tiny
    _, ids = _prefix_ids(folder)
    grads = []
    # the last configuration runs attention the way it runs on CUDA (SDPA's own backward, autograd
    # through the per-sequence slices), here on the CPU
    cases = ((False, False, ("cpu",)), (True, False, ("cpu",)), (True, True, ("cpu",)), (True, False, ()))
    for share, ckpt, hand in cases:
        monkeypatch.setattr(speed, "HAND_BACKWARD", hand)
        rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
        train_with_lora(rr, seed=0, dropout=0.0, checkpointing=ckpt)
        speed.install(rr.model, share_prefix=share)
        s = rr.score_ids(ids, grad=True)
        (s * torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])).sum().backward()
        grads.append({n: p.grad.clone() for n, p in rr.model.named_parameters() if p.grad is not None})
    assert all(g.keys() == grads[0].keys() for g in grads) and grads[0]
    for g in grads[1:]:
        for n in grads[0]:
            assert _rel(g[n], grads[0][n]) < 1e-5, n


@pytest.mark.parametrize("cpu_bf16", [False, True])
@pytest.mark.parametrize("lens,P,block", [([5], 0, 2), ([300], 0, 128), ([256], 0, 64), ([40, 7, 130], 0, 32),
                                          ([40, 7, 130], 23, 32), ([1, 200, 3], 150, 64)])
def test_causal_attention_backward_matches_autograd(lens, P, block, cpu_bf16, monkeypatch):
    """The hand-written training attention over packed sequences (P shared prefix rows, then each
    sequence's own rows) against autograd through per-sequence SDPA on the sequences written out in
    full: equal in float32, and in bf16 within the error SDPA's own bf16 backward makes (vs float64).
    Its forward (packed_causal_attention, as at inference) runs SDPA on sequences padded to a multiple
    of 32 rows on the CPU (every length here but 256 is padded); in bf16 where BLOCKED_BF16_ATTENTION
    (cpu_bf16), blocked matmuls, whose error is that of transformers' eager attention (bf16 scores and
    probabilities), not SDPA's."""
    import torch.nn.functional as F
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", cpu_bf16)
    torch.manual_seed(0)
    H, K, E = 4, 2, 32
    N = P + sum(lens)
    base = [torch.randn(N, n, E, dtype=torch.float64) * 2 for n in (H, K, K)]         # q, k, v
    base.append(torch.randn(N, H, E, dtype=torch.float64))                               # the output's gradient

    def reference(q, k, v):
        """Each sequence as its own copy of prefix + own rows; outputs of the prefix rows kept once."""
        outs, start = [], P
        for j, L in enumerate(lens):
            rows = list(range(P)) + list(range(start, start + L))
            qj, kj, vj = (t[rows].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qj, kj, vj, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            outs.append(o if j == 0 else o[P:])
            start += L
        return torch.cat(outs)

    def eager(q, k, v):
        """As transformers' eager attention: scores in the model dtype, softmax in float32, rounded back."""
        outs, start = [], P
        for j, L in enumerate(lens):
            rows = list(range(P)) + list(range(start, start + L))
            qj, kj, vj = (t[rows].transpose(0, 1) for t in (q, k, v))                  # (heads, P+L, E)
            kj, vj = (t.repeat_interleave(H // K, dim=0) for t in (kj, vj))
            s = (qj @ kj.transpose(1, 2)) * E ** -0.5
            s = s.masked_fill(torch.ones(P + L, P + L, dtype=torch.bool).triu(1), float("-inf"))
            o = (torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ vj).transpose(0, 1)
            outs.append(o if j == 0 else o[P:])
            start += L
        return torch.cat(outs)

    def run(dtype, ours):
        """-> (output, (dq, dk, dv))"""
        q, k, v = (t.to(dtype).requires_grad_() for t in base[:3])
        o = speed.PackedCausalAttention.apply(q, k, v, lens, P, block) if ours else reference(q, k, v)
        return o, torch.autograd.grad(o, (q, k, v), base[3].to(dtype))

    exact_o, exact = run(torch.float64, False)
    assert _rel(run(torch.float64, True)[0], exact_o) < 1e-12          # forward: SDPA on padded rows
    ours_o, ours = run(torch.float32, True)
    sdpa_o, sdpa = run(torch.float32, False)
    assert _rel(ours_o, sdpa_o) < 1e-6
    for a, b in zip(ours, sdpa):
        assert _rel(a, b) < 1e-5
    (ours_o, ours), (sdpa_o, sdpa) = run(torch.bfloat16, True), run(torch.bfloat16, False)
    peer = eager(*(t.to(torch.bfloat16) for t in base[:3])) if cpu_bf16 else sdpa_o
    assert _rel(ours_o, exact_o) < 1.5 * _rel(peer, exact_o)
    for a, b, ref in zip(ours, sdpa, exact):
        assert _rel(a, ref) < max(3 * _rel(b, ref), 1e-2)
    # the backward after the blocked forward, which keeps its probabilities, equals the backward after
    # SDPA's, which recomputes them: same bits
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", not cpu_bf16)
    assert all(torch.equal(a, b) for a, b in zip(ours, run(torch.bfloat16, True)[1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocked_attention_forward_is_sdpas(dtype, monkeypatch):
    """blocked_causal_attention is packed_causal_sdpa's math: equal to it in float64 and float32 over
    packed sequences with a shared prefix, blocks that split sequences, and a block larger than any.
    Outside bf16 the dispatch keeps SDPA's results bit for bit, on a CPU with native bf16 too."""
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", True)
    torch.manual_seed(0)
    H, K, E, lens, P = 4, 2, 32, [40, 7, 130], 23
    q, k, v = (torch.randn(P + sum(lens), n, E, dtype=dtype) for n in (H, K, K))
    want = speed.packed_causal_sdpa(q, k, v, lens, P)
    assert torch.equal(speed.packed_causal_attention(q, k, v, lens, P), want)
    for block in (1, 16, 128, 512):
        assert _rel(speed.blocked_causal_attention(q, k, v, lens, P, block), want) < (1e-12 if dtype == torch.float64
                                                                                       else 1e-6)
    for lens, P in (([1], 0), ([1, 1, 3], 5), ([4, 0, 2], 3)):                 # a lone row, an empty sequence
        q, k, v = (torch.randn(P + sum(lens), n, E, dtype=dtype) for n in (H, K, K))
        assert _rel(speed.blocked_causal_attention(q, k, v, lens, P, 2), speed.packed_causal_sdpa(q, k, v, lens, P)) \
            < 1e-6


def test_bf16_attention_runs_the_kernel_the_cpu_is_given(monkeypatch):
    """In bf16 packed_causal_attention runs the blocked kernel where BLOCKED_BF16_ATTENTION, SDPA elsewhere;
    the flag is set for AVX-512 BF16 without AMX, read from /proc/cpuinfo's flags."""
    torch.manual_seed(0)
    lens, P = [40, 7, 130], 23
    q, k, v = (torch.randn(P + sum(lens), n, 32, dtype=torch.bfloat16) for n in (4, 2, 2))
    for on, kernel in ((True, speed.blocked_causal_attention), (False, speed.packed_causal_sdpa)):
        monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", on)
        assert torch.equal(speed.packed_causal_attention(q, k, v, lens, P), kernel(q, k, v, lens, P))
    flags = "flags\t\t: fpu sse2 avx2 avx512f {} avx512_vnni\n"
    assert speed.units(flags.format("avx512_bf16") * 2) == {"avx512_bf16"}
    assert speed.units(flags.format("amx_bf16 amx_tile avx512_bf16")) == {"amx_bf16", "avx512_bf16"}
    assert speed.units(flags.format("avx512_bf16x")) == set() == speed.units(flags.format(""))


@pytest.mark.parametrize("blocked", [False, True])
def test_final_token_attention_is_the_causal_attentions_last_rows(blocked, monkeypatch):
    """The last layer's attention, each sequence's final query only, is the final rows of the full packed
    causal attention: in float64 and float32 either way, in bf16 by the kernel the CPU is given (SDPA's
    rows within its own bf16 error, the blocked kernel's within 1.5x that of its full forward's rows)."""
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", blocked)
    torch.manual_seed(0)
    lens, P = [40, 7, 130, 1], 23
    last = [P + sum(lens[:j + 1]) - 1 for j in range(len(lens))]
    q, k, v = (torch.randn(P + sum(lens), n, 32, dtype=torch.float64) for n in (4, 2, 2))
    exact = speed.packed_causal_sdpa(q, k, v, lens, P)[last]
    assert _rel(speed.final_token_attention(q[last], k, v, lens, P), exact) < 1e-12
    assert _rel(speed.final_token_attention(*(t.float() for t in (q[last], k, v)), lens, P), exact) < 1e-6
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    full = speed.packed_causal_attention(q16, k16, v16, lens, P)[last]
    assert _rel(speed.final_token_attention(q16[last], k16, v16, lens, P), exact) < 1.5 * _rel(full, exact) + 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_short_documents_attention_is_the_packed_one(dtype, tol, monkeypatch):
    """Many short sequences under a long prefix, padded batches (small ones, so several) of their own
    queries over the prefix's keys and their own: every row equals the per-sequence path's, the final
    queries too; the prefix's rows are computed once."""
    monkeypatch.setattr(speed, "SHORT_BATCH_KEYS", 200)
    torch.manual_seed(0)
    lens, P = [5, 1, 17, 3, 9, 2, 12], 60
    last = [P + sum(lens[:j + 1]) - 1 for j in range(len(lens))]
    q, k, v = (torch.randn(P + sum(lens), n, 16, dtype=dtype) for n in (4, 2, 2))
    exact = speed.packed_causal_sdpa(q, k, v, lens, P)
    with torch.inference_mode():
        assert _rel(speed.short_documents_sdpa(q, k, v, lens, P), exact) < tol
        assert _rel(speed.short_documents_final(q[last], k, v, lens, P), exact[last]) < tol


def test_short_documents_scores_equal_the_plain_path(hf_tiny):
    """A query's deletion samples (certify.py) scored inside speed.short_documents equal the plain
    speed path's and transformers' margins; outside it the model's kernels are its own again."""
    import certify
    folder, hm = hf_tiny
    rr = fast(reranker.Reranker.from_pretrained(folder, dtype=torch.float32))
    text = " ".join(PREFIX_DOCS)
    ids = rr.tokenize("What is the capital of France?", certify.deletions(text, 0.7, 24, key="0:g:0"))
    plain = rr.score_ids(ids)
    kernels = rr.model.layers[0].self_attn.kernels
    with speed.short_documents(rr.model):
        assert rr.model.layers[1].self_attn.kernels.final is speed.short_documents_final
        short = rr.score_ids(ids)
    assert rr.model.layers[0].self_attn.kernels is kernels
    torch.testing.assert_close(short, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(short, hf_margins(hm, ids, rr.yes_id, rr.no_id), rtol=1e-4, atol=1e-5)


def test_the_blocked_forward_keeps_the_short_sequences_probabilities(monkeypatch):
    """The blocked forward saves each block's probabilities of the sequences of at most KEEP_MAX_KEYS keys
    (prefix included), SDPA's forward none; either way the backward gives the same bits (it recomputes
    the rest with the same function)."""
    monkeypatch.setattr(speed, "KEEP_MAX_KEYS", 100)
    torch.manual_seed(0)
    lens, P = [40, 7, 130], 23                          # 63 and 30 keys kept; 153 recomputed
    base = [torch.randn(P + sum(lens), n, 32, dtype=torch.bfloat16) for n in (4, 2, 2, 4)]
    saved, grads = {}, {}
    for blocked in (True, False):
        monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", blocked)
        q, k, v = (t.clone().requires_grad_() for t in base[:3])
        o = speed.PackedCausalAttention.apply(q, k, v, lens, P, 32)
        saved[blocked] = [tuple(t.shape) for t in o.grad_fn.saved_tensors[3:]]
        grads[blocked] = torch.autograd.grad(o, (q, k, v), base[3])
    assert saved[True] == [(2, 64, 32), (2, 62, 63), (2, 14, 30)] and saved[False] == []   # (K, G*n, b)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_kept_probabilities_under_gradient_checkpointing(hf_tiny, monkeypatch):
    """bf16 training on the blocked kernel, whose forward keeps its probabilities for the backward (as saved
    tensors, which checkpointing drops and recomputes): the same gradients, bit for bit, with and without
    gradient checkpointing."""
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", True)
    folder, _ = hf_tiny
    grads = []
    for ckpt in (False, True):
        rr = reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16)
        train_with_lora(rr, seed=0, dropout=0.0, checkpointing=ckpt)
        speed.install(rr.model)
        rr.score("q", ["some document", "another, longer document text " * 20], grad=True).sum().backward()
        grads.append({n: p.grad for n, p in rr.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


FAULTS = """
import resource, speed, torch
def call():                     # a call's activations, of several sizes: written, then freed
    xs = [torch.empty(n << 20, dtype=torch.uint8).fill_(1) for n in (40, 8, 24, 40)]
def faults():
    for _ in range(10):         # the heap settles into the pattern
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        call()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
off = faults()
print(off, speed.reuse_freed_memory(), faults())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or __import__("platform").libc_ver()[0] != "glibc",
                    reason="glibc on Linux only")
def test_freed_activations_are_reused_not_faulted_back_in():
    """reuse_freed_memory: under glibc's default thresholds calls that allocate and free the same tensors
    map the 40 MiB ones afresh every call; once it is set and the heap has settled, they fault (almost) no
    pages in. In a process of its own: the setting is process-wide."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.split()
    off, applied, on = int(out[0]), out[1] == "True", int(out[2])
    # at least one fault per 40 MiB tensor and call whatever the page size (4 KiB, 64 KiB, huge pages)
    assert applied and off >= 20 and 20 * on < off, out


def test_rmsnorm_backward_matches_autograd():
    """Hand-written RMSNorm backward = autograd through Qwen3RMSNorm's formula; input untouched."""
    def ref(x, w, eps=1e-6):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = (torch.randn(3, 7, 64) * 3).to(dtype).requires_grad_()
        w = (torch.rand(64) + 0.5).to(dtype).requires_grad_()
        g = torch.randn(3, 7, 64).to(dtype)
        x0 = x.detach().clone()
        y = speed.RMSNormFunction.apply(x, w, 1e-6)
        assert torch.equal(y, ref(x, w)) and torch.equal(x, x0)
        for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref(x, w), (x, w), g)):
            assert _rel(a, b) < tol


def test_dropout_masks_are_independent_bernoulli_draws():
    torch.manual_seed(0)
    p, n = 0.05, 2_000_000
    m = speed.dropout_mask((1000, 2000), p).view(-1)
    assert set(m.unique().tolist()) == {0.0, 1.0}
    drop = (m == 0).double()
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(drop.sum().item() - n * p) < 5 * sd                   # Bernoulli(p) rate
    pairs = (drop[1:] * drop[:-1]).sum().item()                       # neighbours independent: rate p^2
    assert abs(pairs - (n - 1) * p * p) < 5 * ((n - 1) * p * p) ** 0.5
    assert drop[:1000].sum() > 0 and drop[-1000:].sum() > 0           # no region left undrawn
    torch.manual_seed(1)
    a = speed.dropout_mask((7, 5), 0.3)
    torch.manual_seed(1)
    assert torch.equal(a, speed.dropout_mask((7, 5), 0.3))             # reproducible from the seed


def _lora_pair(base, p=0.3):
    """Two LoRA layers over `base` (B random, so the update shows), installed as one model."""
    model = torch.nn.ModuleList([lora.LoRALinear(base, r=2, alpha=4, dropout=p) for _ in range(2)])
    for mod in model:
        torch.nn.init.normal_(mod.lora_B)
    return speed.install(model)


def test_lora_train_forward_shares_one_mask_per_input():
    # LoRALinear in train mode: base(x) + (x * mask) A^T B^T * scaling / (1 - p), mask shared by a
    # model's layers reading the same input
    base = torch.nn.Linear(5, 3, bias=False)
    la, lb = _lora_pair(base)
    x = torch.randn(7, 5)
    torch.manual_seed(2)
    ya, yb = la(x), lb(x)
    torch.manual_seed(2)
    mask = speed.dropout_mask((7, 5), 0.3)
    for mod, y in ((la, ya), (lb, yb)):
        want = base(x) + (x * mask) @ mod.lora_A.t() @ mod.lora_B.t() * 2.0 / 0.7
        torch.testing.assert_close(y, want)
    with pytest.raises(ValueError):
        lora.LoRALinear(base, dropout=1.0)


def test_two_models_never_share_a_dropout_mask():
    """Each model holds its own DropoutCache: the second model's layer reading the first's input draws a
    mask of its own, and the first model's next layer still takes the first's mask (interleaved forwards,
    as two models trained in one process). A copy of a model starts with a cache of its own."""
    base = torch.nn.Linear(5, 3, bias=False)
    one, two = _lora_pair(base), _lora_pair(base)
    assert one.dropout_cache is one[0].dropout_cache is one[1].dropout_cache is not two.dropout_cache
    x = torch.randn(7, 5)
    torch.manual_seed(2)
    first, other = speed.dropout_mask((7, 5), 0.3), speed.dropout_mask((7, 5), 0.3)
    assert not torch.equal(first, other)
    torch.manual_seed(2)
    got = [one[0](x), two[0](x), one[1](x)]                           # the draws: first, other, none
    for mod, y, mask in ((one[0], got[0], first), (two[0], got[1], other), (one[1], got[2], first)):
        torch.testing.assert_close(y, base(x) + (x * mask) @ mod.lora_A.t() @ mod.lora_B.t() * 2.0 / 0.7)
    assert speed.install(one).dropout_cache is one[1].dropout_cache   # installed again: the same cache
    copied = copy.deepcopy(one)
    assert copied.dropout_cache is copied[0].dropout_cache is copied[1].dropout_cache is not one.dropout_cache


def test_one_input_at_two_dropout_rates_draws_a_mask_for_each():
    """The cache shares a mask between layers reading one input at one rate: a layer at another rate draws its
    own (it took the first layer's mask, rescaled by its own 1 / (1 - p))."""
    cache, x = speed.DropoutCache(), torch.ones(1000, 4)
    low, high = cache(x, 0.1), cache(x, 0.9)
    assert (low == 0).float().mean() < 0.3 and (high == 0).float().mean() > 0.7
    assert cache(x, 0.9) is high


def test_gradient_checkpointing_redraws_the_forwards_dropout_masks(hf_tiny):
    """With LoRA dropout, the recomputation under gradient checkpointing draws the masks the forward drew:
    the same gradients, bit for bit, as without checkpointing (and not those of dropout 0)."""
    folder, _ = hf_tiny
    grads = []
    for dropout, ckpt in ((0.3, False), (0.3, True), (0.0, False)):
        rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
        train_with_lora(rr, seed=0, dropout=dropout, checkpointing=ckpt)
        speed.install(rr.model)
        torch.manual_seed(5)
        rr.score("q", ["some document", "another, longer document text " * 4], grad=True).sum().backward()
        grads.append({n: p.grad for n, p in rr.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert not all(torch.equal(grads[0][n], grads[2][n]) for n in grads[0])


def test_speed_paths_equal_the_reference(hf_tiny):
    """speed.install changes how, not what: float32 margins, LoRA gradients and one SGD step of
    the installed model equal reranker.py's and lora.py's plain forwards (1e-5 relative; dropout 0,
    since the speed path shares masks across q/k/v where PEFT draws one per module). bf16 below."""
    folder, hm = hf_tiny
    docs = ["Paris is the capital of France. " * 3, "short", "A much longer document about eggs. " * 40]
    ref, quick = (reranker.Reranker.from_pretrained(folder, dtype=torch.float32) for _ in range(2))
    speed.install(quick.model)
    assert speed.installed(quick.model) is speed.EAGER and speed.installed(ref.model) is None
    ids = ref.tokenize("What is the capital of France?", docs)
    torch.testing.assert_close(quick.score_ids(ids), ref.score_ids(ids), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.score_ids(ids), hf_margins(hm, ids, ref.yes_id, ref.no_id), rtol=1e-4, atol=1e-5)
    params, opts = [], []
    for rr in (ref, quick):
        train_with_lora(rr, seed=3, dropout=0.0)
        if rr is quick:
            speed.install(rr.model)
        ps = [p for p in rr.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(ps, lr=0.5)          # (AdamW's first step is ~lr * sign(g): it hides nothing)
        m = rr.score_ids(ids, grad=True)
        (m.pow(2).sum() - m[0]).backward()
        params.append({n: p for n, p in rr.model.named_parameters() if p.requires_grad})
        opts.append(opt)
    assert params[0].keys() == params[1].keys()
    for n in params[0]:
        assert _rel(params[1][n].grad, params[0][n].grad) < 1e-5, n
    for opt in opts:
        opt.step()
    for n in params[0]:
        assert _rel(params[1][n].detach(), params[0][n].detach()) < 1e-5, n


def test_signed_sine_rope_is_the_reference_bit_for_bit():
    """speed's RoPE ([x2, x1] times the signed sine) gives reranker.apply_rope's bits (rotate_half)."""
    torch.manual_seed(0)
    cos, sin = reranker.rope_cos_sin(torch.arange(7), 16, 1e6, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 3, 16).to(dtype)
        c, s = cos.to(dtype), sin.to(dtype)
        want = reranker.apply_rope(x, c, s)
        assert torch.equal(speed.apply_rope_signed(x, c, speed.signed_sine(s)), want)
        with torch.no_grad():                                         # inference: in place
            assert torch.equal(speed.apply_rope_(x.clone(), c, speed.signed_sine(s)), want)


@pytest.mark.parametrize("blocked", [False, True])
def test_speed_paths_in_bf16(hf_tiny, blocked, monkeypatch):
    """bf16, as training runs, with attention by SDPA or by the blocked kernel (BLOCKED_BF16_ATTENTION).
    The installed model's inference margins: with SDPA, equal to reranker.py's (bitwise on the CPUs
    measured; allowed one bf16 step of the largest margin, 2^-8 relative, because the last layer's
    final-token-only GEMMs have other shapes, whose float32 accumulation may round differently on other
    CPUs); with the blocked kernel (transformers' eager numerics, not reranker.py's SDPA), as close to
    the float32 margins as reranker.py's bf16 margins are, to 1.5 times. Its LoRA gradients are as
    close to the float32 reference as reranker.py's own bf16 gradients are: over all LoRA parameters at
    most 1.75 times the reference's bf16 error plus 0.005, each parameter at most 3 times (the fused
    LoRA add and the hand backward round elsewhere than autograd), so that a speed path whose error
    doubles fails."""
    monkeypatch.setattr(speed, "BLOCKED_BF16_ATTENTION", blocked)
    folder, _ = hf_tiny
    docs = ["Paris is the capital of France. " * 3, "short", "A much longer document about eggs. " * 40]
    ref, quick = (reranker.Reranker.from_pretrained(folder, dtype=torch.bfloat16) for _ in range(2))
    speed.install(quick.model)
    ids = ref.tokenize("What is the capital of France?", docs)
    a, b = ref.score_ids(ids), quick.score_ids(ids)
    if blocked:
        m32 = reranker.Reranker.from_pretrained(folder, dtype=torch.float32).score_ids(ids)
        assert (b - m32).abs().max() <= 1.5 * (a - m32).abs().max() + 1e-4, (a, b, m32)
    else:
        assert (a - b).abs().max() <= 2 ** -8 * a.abs().max(), (a, b)
    grads = []   # float32 reference, bf16 reference, bf16 speed path
    for dtype, installed in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        rr = reranker.Reranker.from_pretrained(folder, dtype=dtype)
        train_with_lora(rr, seed=3, dropout=0.0)
        if installed:
            speed.install(rr.model)
        m = rr.score_ids(ids, grad=True)
        (m.pow(2).sum() - m[0]).backward()
        grads.append({n: p.grad.float() for n, p in rr.model.named_parameters() if p.requires_grad})
    exact, ref16, fast16 = grads
    assert exact.keys() == ref16.keys() == fast16.keys() and exact
    flat = lambda g: torch.cat([g[n].flatten() for n in exact])
    ref_err, fast_err = _rel(flat(ref16), flat(exact)), _rel(flat(fast16), flat(exact))
    assert fast_err <= 1.75 * ref_err + 0.005, (fast_err, ref_err)
    for n in exact:
        assert _rel(fast16[n], exact[n]) <= 3 * _rel(ref16[n], exact[n]) + 0.005, n
