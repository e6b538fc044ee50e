"""lora.py: LoRA against PEFT (B = 0 equals the base, merged equals unmerged, adapters both ways),
only LoRA trains, NF4 storage, PEFT's dropout, gradient checkpointing.
Vendors with: lora.py reranker.py tiny.py conftest.py testing.py
Run: python -m pytest -q test_lora.py
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora
import reranker
from testing import CUDA, hf_margins, train_with_lora


def _lora_model(tiny_dir, b_zero=False):
    """The tiny reranker with LoRA added (B drawn from N(0, 0.05) unless b_zero) -> (reranker, ids, the
    base's scores before LoRA was added)."""
    rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = rr.tokenize("q", ["doc one", "another document here"])
    base = rr.score_ids(ids)
    lora.add_lora(rr.model)
    if not b_zero:
        with torch.no_grad():
            for m in lora.lora_modules(rr.model).values():
                m.lora_B.normal_(0, 0.05)
    return rr, ids, base


def _merged(tiny_dir):
    """_lora_model merged into its weights -> (reranker, ids, base scores, the adapted scores before merging)."""
    rr, ids, base = _lora_model(tiny_dir)
    adapted = rr.score_ids(ids)
    rr.model.eval()
    lora.merge_lora(rr.model)
    return rr, ids, base, adapted


def test_lora_with_b_zero_equals_the_base(tiny_dir):
    rr, ids, base = _lora_model(tiny_dir, b_zero=True)
    torch.testing.assert_close(rr.score_ids(ids), base)              # B = 0


def test_lora_disabled_gives_the_base_policy(tiny_dir):
    rr, ids, base = _lora_model(tiny_dir)
    adapted = rr.score_ids(ids)
    assert (adapted - base).abs().max() > 1e-3
    with lora.lora_disabled(rr.model):
        torch.testing.assert_close(rr.score_ids(ids), base)          # pi_0 from the same weights


def test_merging_keeps_the_adapted_scores(tiny_dir):
    rr, ids, _, adapted = _merged(tiny_dir)
    torch.testing.assert_close(rr.score_ids(ids), adapted, rtol=1e-5, atol=1e-5)
    lora.merge_lora(rr.model)                                        # idempotent
    torch.testing.assert_close(rr.score_ids(ids), adapted, rtol=1e-5, atol=1e-5)


def test_a_merged_model_refuses_to_disable_lora_or_load_an_adapter(tiny_dir, tmp_path):
    rr, _, _, _ = _merged(tiny_dir)
    with pytest.raises(ValueError, match="merged"):                  # the old delta would stay in W
        with lora.lora_disabled(rr.model):
            pass
    lora.save_adapter(rr.model, str(tmp_path / "adapter"), "tiny")
    with pytest.raises(ValueError, match="merged"):                  # new A, B would be silently ignored
        lora.load_adapter(rr.model, str(tmp_path / "adapter"))


def test_a_merged_model_still_saves_its_adapter(tiny_dir, tmp_path):
    rr, ids, _, adapted = _merged(tiny_dir)
    lora.save_adapter(rr.model, str(tmp_path / "adapter"), "tiny")   # A and B are still the adapter's
    fresh = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    lora.load_adapter(fresh.model, str(tmp_path / "adapter"))
    torch.testing.assert_close(fresh.score_ids(ids), adapted, rtol=1e-5, atol=1e-5)


def test_only_lora_gets_gradients(tiny_dir):
    rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    lora.add_lora(rr.model)
    with torch.no_grad():
        for m in lora.lora_modules(rr.model).values():
            m.lora_B.normal_(0, 0.05)
    rr.score("q", ["a", "bb"], grad=True).sum().backward()
    names = [n for n, p in rr.model.named_parameters() if p.grad is not None]
    assert names and all(".lora_A" in n or ".lora_B" in n for n in names)
    assert len(names) == 2 * 7 * rr.model.cfg.num_hidden_layers


def test_peft_round_trip_both_ways(tmp_path, hf_tiny):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    folder, _ = hf_tiny
    rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    ids = rr.tokenize("what is rust?", ["Rust is iron oxide.", "Cats purr at 25 to 150 hertz."])
    # ours -> PEFT
    lora.add_lora(rr.model)
    with torch.no_grad():
        for m in lora.lora_modules(rr.model).values():
            m.lora_B.normal_(0, 0.05)
    rr.model.eval()
    ours = rr.score_ids(ids)
    lora.save_adapter(rr.model, str(tmp_path / "ours"), "Qwen/Qwen3-Reranker-0.6B")
    cfg = json.load(open(tmp_path / "ours" / "adapter_config.json"))
    assert cfg["base_model_name_or_path"] == "Qwen/Qwen3-Reranker-0.6B" and cfg["peft_type"] == "LORA"
    base = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from safetensors.torch import load_file
    state = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules")
    pm = peft.get_peft_model(base, peft.LoraConfig(**{k: cfg[k] for k in keys}))
    res = peft.set_peft_model_state_dict(pm, state)
    assert not res.unexpected_keys and not [k for k in res.missing_keys if "lora_" in k]
    pm.eval()
    torch.testing.assert_close(hf_margins(pm, ids, rr.yes_id, rr.no_id), ours, rtol=1e-4, atol=1e-5)
    pm2 = peft.PeftModel.from_pretrained(transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                         str(tmp_path / "ours")).eval()
    torch.testing.assert_close(hf_margins(pm2, ids, rr.yes_id, rr.no_id), ours, rtol=1e-4, atol=1e-5)
    # PEFT -> ours
    torch.manual_seed(3)
    pm3 = peft.get_peft_model(transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32),
                              peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(lora.TARGETS),
                                              init_lora_weights=False)).eval()
    pm3.save_pretrained(str(tmp_path / "theirs"))
    ref = hf_margins(pm3, ids, rr.yes_id, rr.no_id)
    r2 = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    lora.load_adapter(r2.model, str(tmp_path / "theirs"))
    r2.model.eval()
    torch.testing.assert_close(r2.score_ids(ids), ref, rtol=1e-4, atol=1e-5)
    # target_modules as PEFT matches a list: a tail after a dot, or a full name (here on a few projections only)
    pm4 = peft.get_peft_model(transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32),
                              peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
                                  "self_attn.q_proj", "mlp.down_proj", "model.layers.0.self_attn.v_proj"])).eval()
    pm4.save_pretrained(str(tmp_path / "tails"))
    r3 = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    lora.load_adapter(r3.model, str(tmp_path / "tails"))
    assert len(lora.lora_modules(r3.model)) == 2 * rr.model.cfg.num_hidden_layers + 1
    r3.model.eval()
    torch.testing.assert_close(r3.score_ids(ids), hf_margins(pm4, ids, rr.yes_id, rr.no_id), rtol=1e-4, atol=1e-5)
    lora.save_adapter(r3.model, str(tmp_path / "again"), "Qwen/Qwen3-Reranker-0.6B")   # saved, it names the same few
    r4 = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    lora.load_adapter(r4.model, str(tmp_path / "again"))
    r4.model.eval()
    assert set(lora.lora_modules(r4.model)) == set(lora.lora_modules(r3.model))
    torch.testing.assert_close(r4.score_ids(ids), r3.score_ids(ids))
    assert json.load(open(tmp_path / "ours" / "adapter_config.json"))["target_modules"] == sorted(lora.TARGETS)


def test_nf4_round_trip_bound(tiny_dir):
    assert lora.NF4_CODE[7] == 0
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 130, generator=g)                   # 12480 values, not a multiple of 64
    packed, absmax = lora.nf4_quantize(w)
    back = lora.nf4_dequantize(packed, absmax, w.shape, torch.float32)
    assert packed.dtype == torch.uint8 and packed.numel() == w.numel() // 2
    blocks = torch.nn.functional.pad(w.reshape(-1), (0, (-w.numel()) % 64)).view(-1, 64).abs().amax(-1)
    err = (back - w).abs().reshape(-1)
    per = torch.nn.functional.pad(err, (0, (-err.numel()) % 64)).view(-1, 64).amax(-1)
    half_gap = ((lora.NF4_CODE[1:] - lora.NF4_CODE[:-1]) / 2).max()
    assert torch.all(per <= half_gap * blocks + 1e-6)        # nearest-code rounding bound, per block
    assert (back - w).abs().mean() < 0.1
    rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = rr.tokenize("q", ["some text about eggs"])
    base = rr.score_ids(ids)
    lora.quantize_nf4(rr.model)
    lora.add_lora(rr.model)
    q = rr.score_ids(ids)
    assert torch.isfinite(q).all() and (q - base).abs().max() < 0.5


def test_nf4_keeps_only_its_4bit_state_for_the_backward():
    """QLoRA's point: between the forward and the backward an NF4 projection holds its packed codes, not its
    dequantised weight (autograd kept the (out, in) weight of every projection: a bf16 base's memory). The
    input's gradient is the dequantised weight's."""
    g = torch.Generator().manual_seed(0)
    layer = lora.NF4Linear(torch.nn.Linear(130, 96, bias=False))
    x = torch.randn(5, 130, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = layer(x)
    assert 96 * 130 not in saved                                     # the weight, in either layout
    dy = torch.randn(5, 96, generator=g)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ layer.weight)
    torch.testing.assert_close(y, x.detach() @ layer.weight.t())


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_gradient_checkpointing_same_gradients(tiny_dir, dropout):
    """With dropout, the recomputation must redraw exactly the forward's masks (this once failed:
    mask sharing depended on what autograd kept alive, which checkpointing changes)."""
    grads = []
    for ckpt in (False, True):
        rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
        train_with_lora(rr, seed=0, dropout=dropout, checkpointing=ckpt)
        torch.manual_seed(1)
        rr.score("q", ["some document", "another, longer document text"], grad=True).sum().backward()
        grads.append({n: p.grad.clone() for n, p in rr.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n])


def test_a_block_built_alone_runs_its_plain_forward():
    """A Block (and each of its parts) built on its own runs its plain forward."""
    cfg = reranker.Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    block = reranker.Block(cfg)
    x = torch.randn(9, 16)
    cos, sin = reranker.rope_cos_sin(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4]), 8, 1e6, torch.float32)
    y = block(x, cos, sin, [4, 5])
    # sequence 2 alone gives the same rows: packing keeps sequences apart
    cos2, sin2 = reranker.rope_cos_sin(torch.arange(5), 8, 1e6, torch.float32)
    torch.testing.assert_close(y[4:], block(x[4:], cos2, sin2, [5]), rtol=1e-5, atol=1e-6)


def test_the_reference_lora_dropout_is_peft_s():
    """The reference LoRA layer draws nn.Dropout's mask per module, as PEFT does."""
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 3, bias=False)
    la = lora.LoRALinear(base, r=2, alpha=4, dropout=0.3)
    torch.nn.init.normal_(la.lora_B)
    xin = torch.randn(5, 6)
    torch.manual_seed(7)
    got = la(xin)
    torch.manual_seed(7)
    want = base(xin) + torch.nn.functional.dropout(xin, 0.3, True) @ la.lora_A.t() @ la.lora_B.t() * 2.0
    torch.testing.assert_close(got, want)


def test_int8_matmul_is_the_exact_integer_product_on_every_path():
    """Both kernels give the reference's integers exactly: float32 GEMMs over K in chunks of 1024 (no int8
    units) and torch._int_mm (VNNI/AMX, CUDA), K over four chunks of positive values, whose sums pass 2**24;
    each value within half a step of its row's scale."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.rand(37, 5000, generator=g) * 3, torch.rand(304, 5000, generator=g)     # K, N: multiples of 8
    xq, sx = lora.int8_quantize(x)
    wq, sw = lora.int8_quantize(w)
    assert xq.dtype == torch.int8 and xq.abs().max() == 127 and sx.shape == (37, 1)
    assert ((xq.float() * sx - x).abs() <= sx / 2 + 1e-6).all()            # round to nearest, per row
    ref = lora.int8_matmul_reference(xq, wq)
    assert ref.abs().max() > 2 ** 24                                        # float32 over the whole K would round
    kernel = lora.int8_matmul(xq, wq, {"avx512_vnni"})                      # int32 from torch._int_mm
    assert torch.equal(lora.int8_matmul(xq, wq), ref)
    assert kernel.dtype == torch.int32 and torch.equal(kernel.double(), ref)
    assert not torch.equal((xq.float() @ wq.float().t()).double(), ref)     # why the chunks
    odd = wq[:301]                                  # N not a multiple of 8: _int_mm's rule, so the chunks run
    assert torch.equal(lora.int8_matmul(xq, odd, {"avx512_vnni"}), lora.int8_matmul_reference(xq, odd))


@CUDA
def test_int8_on_cuda_is_the_cpu_int8(tiny_dir):
    """Runs only where CUDA is available: torch._int_mm on CUDA gives the reference's integers (fewer rows
    than its kernel takes padded to 17), and the int8 Shield scored on CUDA gives the CPU int8 margins
    within the bf16 parity tolerance (the float parts between the int8 products round differently)."""
    g = torch.Generator().manual_seed(0)
    w = lora.int8_quantize(torch.rand(304, 5000, generator=g))[0]
    for m in (5, 37):
        xq = lora.int8_quantize(torch.rand(m, 5000, generator=g) * 3)[0]
        got = lora.int8_matmul(xq.cuda(), w.cuda()).cpu()
        assert got.shape == (m, 304) and torch.equal(got.double(), lora.int8_matmul_reference(xq, w))
    rr, ids, _ = _lora_model(tiny_dir)
    rr.model.eval()
    lora.quantize_int8(rr.model)
    cpu = rr.score_ids(ids)
    rr.model.to("cuda")                                         # the int8 weights and scales move with it
    assert rr.model.layers[0].mlp.up_proj.qweight.is_cuda
    assert (rr.score_ids(ids).cpu() - cpu).abs().max() <= 0.05 + 0.05 * cpu.abs().max()


def test_int8_shield_merges_the_adapter_first_and_keeps_its_ranks(tiny_dir):
    """quantize_int8 scores W + scaling B A in int8: close to the float Shield, far from the base without the
    adapter, and marked as the Shield for serve (adapter_merged)."""
    rr, ids, base = _lora_model(tiny_dir)
    rr.model.eval()
    adapted = rr.score_ids(ids)
    lora.quantize_int8(rr.model)
    assert not lora.lora_modules(rr.model) and rr.model.adapter_merged
    assert isinstance(rr.model.layers[0].self_attn.q_proj, lora.Int8Linear)
    q = rr.score_ids(ids)
    assert (q - adapted).abs().max() < 0.05 < (adapted - base).abs().max()
    with pytest.raises(ValueError, match="no projection named"):
        lora.quantize_int8(torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False)))
    with pytest.raises(ValueError, match="NF4"):
        nf4 = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
        lora.add_lora(lora.quantize_nf4(nf4.model))
        lora.quantize_int8(nf4.model)


def test_an_adapter_that_cannot_load_names_its_file_and_field(tiny_dir, tmp_path, monkeypatch):
    """A config cut short, a field missing or null, weights cut short: AdapterError naming the file and field
    (run.py reports it as a user error) rather than a bare KeyError or TypeError; a write that fails (a full
    disk) leaves no file aside and names the folder."""
    rr, _, _ = _lora_model(tiny_dir)
    good = tmp_path / "good"
    lora.save_adapter(rr.model, str(good), "tiny")
    cfg = json.loads((good / "adapter_config.json").read_text())
    fresh = lambda: reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32).model
    for name, config, says in (("cut", "{", "adapter_config.json: not JSON"),
                               ("no_r", {k: v for k, v in cfg.items() if k != "r"}, "adapter_config.json: r:"),
                               ("null_dropout", {**cfg, "lora_dropout": None}, "adapter_config.json: lora_dropout:"),
                               ("no_targets", {**cfg, "target_modules": None},
                                "adapter_config.json: target_modules:"),
                               # numbers JSON allows that merge into inf weights (export wrote them as a model)
                               ("inf_alpha", '{"r": 4, "lora_alpha": Infinity}', "adapter_config.json: lora_alpha:"),
                               ("huge_alpha", {**cfg, "lora_alpha": 1e300}, "adapter_config.json: lora_alpha:"),
                               ("huge_r", {**cfg, "r": 10 ** 400}, "adapter_config.json: r:"),
                               # a rank the file's matrices do not have: refused from the header, before the layers
                               # are made (at real width r 65536 is 154 GiB of LoRA matrices)
                               ("other_r", {**cfg, "r": 65536}, "adapter_model.safetensors: its lora_A matrices "
                                                                f"have ranks \\[{cfg['r']}\\], adapter_config.json's "
                                                                "r is 65536")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        (bad / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        with pytest.raises(lora.AdapterError, match=f"{name}/{says}"):
            lora.load_adapter(fresh(), str(bad))
    listless = tmp_path / "listless"                    # a model with LoRA layers already reads no target list
    listless.mkdir()
    (listless / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": None}))
    (listless / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    with_layers = fresh()
    lora.add_lora(with_layers, r=cfg["r"], alpha=cfg["lora_alpha"], targets=tuple(cfg["target_modules"]))
    lora.load_adapter(with_layers, str(listless))
    nan = tmp_path / "nan"                              # a weight no finite margin comes from
    nan.mkdir()
    (nan / "adapter_config.json").write_text(json.dumps(cfg))
    state = load_file(str(good / "adapter_model.safetensors"))
    save_file({k: v.fill_(float("nan")) if i == 0 else v for i, (k, v) in enumerate(state.items())},
              str(nan / "adapter_model.safetensors"))
    with pytest.raises(lora.AdapterError, match="nan/adapter_model.safetensors: .* not a finite number"):
        lora.load_adapter(fresh(), str(nan))
    (good / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes()[:100])
    with pytest.raises(lora.AdapterError, match="good/adapter_model.safetensors: not a readable safetensors"):
        lora.load_adapter(fresh(), str(good))

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(OSError, match="full: the adapter could not be written"):
        lora.save_adapter(rr.model, str(tmp_path / "full"), "tiny")
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == []
