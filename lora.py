"""LoRA by hand (Hu et al. 2022), in PEFT's on-disk layout, plus NF4 storage for the frozen base and an
INT8 scoring path (the adapter merged, weights per channel, activations per token).

`LoRALinear` holds the frozen base nn.Linear (composition, no subclassing of the model) and adds
lora_A (r, in) and lora_B (out, r): y = base(x) + (dropout(x) @ A^T @ B^T) * alpha / r.
Init, scaling, dropout placement and file format follow PEFT (peft/tuners/lora/layer.py,
peft/utils/save_and_load.py), so PEFT and vLLM load our adapter unchanged and we load theirs.
Paper Table A.1: r 16, alpha 32, dropout 0.05 on q/k/v/o and gate/up/down projections; everything
else frozen; 4-bit base ("--quant nf4").

Deviations from PEFT:
- the LoRA product is computed in the activation dtype (bf16 over a bf16 base; PEFT casts the input
  to the adapter's float32); the parameters and their gradients stay float32. Identical in fp32.
- NF4 (QLoRA: bitsandbytes' code table, blocks of 64, float32 absmax, no double quantisation) is
  dequantised on the fly in pure PyTorch: it saves memory, not time.
Dropout is PEFT's: nn.Dropout on the LoRA input, one mask per module. speed.py binds a faster
forward that shares one mask between a model's layers reading the same input (declared there).

Usage: add_lora(model); ...train...; save_adapter(model, "runs/x/adapter", "Qwen/Qwen3-Reranker-0.6B")
"""
import contextlib
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PeftModel.base_model (LoraModel) .model (the *ForCausalLM)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (Hu et al. 2021, arXiv 2106.09685):
    y = base(x) + dropout(x) A^T B^T * alpha / r, with B = 0 at the start so the layer starts as base.

    Args:
        base: the frozen nn.Linear (or NF4Linear) whose output is corrected; its weights never train.
        r: the rank of the update (A is (r, in_features), B is (out_features, r)).
        alpha: the update's scale numerator; the update is multiplied by alpha / r.
        dropout: probability of zeroing each element of the update's input (PEFT's lora_dropout).
    """

    def __init__(self, base, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base                       # frozen nn.Linear (or NF4Linear)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        dev = base.weight.device if not isinstance(base, NF4Linear) else base.absmax.device
        # LoRA parameters in float32 even over a bf16/NF4 base: small, and Adam needs the precision.
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=dev))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=dev))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # a=sqrt(5): nn.Linear's default init, as PEFT
        if not 0 <= dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)          # probability of dropping each element of the LoRA input
        self.enabled, self.merged = True, False

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        """y = base(x) + dropout(x) A^T B^T * alpha/r (PEFT's LoRA Linear). x (..., in) -> (..., out)."""
        y = self.base(x)                                                     # (..., out)
        if not self.enabled or self.merged:
            return y
        x = F.dropout(x, self.dropout, self.training)                       # nn.Dropout, as PEFT
        # in the activation dtype (bf16 over a bf16 base, fp32 over fp32); the parameters stay float32
        # and get float32 gradients through the cast
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        return y + (x @ A.t() @ B.t()) * self.scaling                        # (..., r) -> (..., out)

    def delta(self):
        return (self.lora_B @ self.lora_A) * self.scaling                    # (out, in) = scaling * B A

    @torch.no_grad()
    def merge(self):
        """W += scaling * B @ A, exactly once (explicit; never done by eval())."""
        if self.merged:
            return
        if isinstance(self.base, NF4Linear):
            raise ValueError("cannot merge into an NF4 base: load the base in bf16/fp32 to merge")
        self.base.weight += self.delta().to(self.base.weight.dtype)
        self.merged = True


def lora_modules(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model, r=16, alpha=32, dropout=0.05, targets=TARGETS):
    """Replace every nn.Linear that a target names with LoRALinear(base); freeze all else. A target names a
    module as PEFT's list does: its full name, or a tail of it after a dot ("q_proj", "self_attn.q_proj",
    "model.layers.0.self_attn.q_proj"; transformers' names carry "model."). Returns the model (modified in place)."""
    model.requires_grad_(False)
    found = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"model.{name}.{child_name}" if name else f"model.{child_name}"
            named = any(full == t or full.endswith("." + t) for t in targets)
            if named and isinstance(child, (nn.Linear, NF4Linear)):
                # new modules start in train mode: follow the model's mode, else dropout fires in eval
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout).train(model.training))
                found += 1
    if not found:
        raise ValueError(f"add_lora: no nn.Linear named {targets} in the model")
    return model


def lora_config(model):
    """The LoRA settings of `model`, read from its LoRA layers (PEFT's adapter_config names), or None."""
    mods = lora_modules(model)
    if not mods:
        return None
    m = next(iter(mods.values()))
    short = sorted({name.rsplit(".", 1)[-1] for name in mods})
    every = len(mods) == sum(isinstance(c, (nn.Linear, NF4Linear, LoRALinear)) and n.rsplit(".", 1)[-1] in short
                             for n, c in model.named_modules())
    # the short names where they name exactly these layers; else the full names (an adapter loaded on a few)
    return {"r": m.r, "lora_alpha": m.alpha, "lora_dropout": m.dropout,
            "target_modules": short if every else sorted("model." + name for name in mods)}


@contextlib.contextmanager
def lora_disabled(model):
    """The frozen reference policy pi_0 from the same weights (as TRL does with a PEFT model)."""
    mods = list(lora_modules(model).values())
    if any(m.merged for m in mods):
        raise ValueError("lora_disabled on a merged model would not give the base policy")
    prev = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, p in zip(mods, prev):
            m.enabled = p


def merge_lora(model):
    """Fold every LoRA update into its base weight (W += scaling * B A); the LoRA layers stay, inert."""
    for m in lora_modules(model).values():
        m.merge()
    return model


def merge_and_unload(model):
    """merge_lora, then the plain base layers put back in place of the LoRA layers, so that the model's
    state dict has the checkpoint's keys again (PEFT's merge_and_unload). In place."""
    merge_lora(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, child_name, child.base)
    return model


def peft_key(name, part):
    """PEFT's file key of LoRA layer `name`'s `part` (lora_A / lora_B):
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight."""
    return f"{PEFT_PREFIX}model.{name}.{part}.weight"


def lora_state_dict(model):
    """Every LoRA layer's A and B under PEFT's key names (peft_key)."""
    return {peft_key(name, part): getattr(m, part).detach()
            for name, m in lora_modules(model).items() for part in ("lora_A", "lora_B")}


def load_lora_state_dict(model, state):
    """The inverse of lora_state_dict: every LoRA layer's A and B from `state` (PEFT key names; keys
    that are not LoRA tensors are ignored). A missing tensor raises KeyError naming it."""
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            m.lora_A.copy_(state[peft_key(name, "lora_A")])
            m.lora_B.copy_(state[peft_key(name, "lora_B")])
    return model


def save_adapter(model, out_dir, base_model_name_or_path, dtype=torch.float32):
    """adapter_config.json (standard PEFT keys only) + adapter_model.safetensors, each file written aside
    and renamed: each is whole or absent (the weights are renamed first, so a config never names
    weights that are not there)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    cfg = lora_config(model)
    if cfg is None:
        raise ValueError("save_adapter: the model has no LoRA layers (call add_lora first)")
    os.makedirs(out_dir, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
              "revision": None, "inference_mode": True, "r": cfg["r"], "lora_alpha": cfg["lora_alpha"],
              "lora_dropout": cfg["lora_dropout"], "target_modules": cfg["target_modules"], "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True, "use_rslora": False,
              "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}, "exclude_modules": None, "lora_bias": False}
    tensors = {k: v.to(dtype).contiguous() for k, v in lora_state_dict(model).items()}
    tmp = os.path.join(out_dir, f".tmp{os.getpid()}")
    try:
        save_file(tensors, tmp + ".safetensors", metadata={"format": "pt"})
        with open(tmp + ".json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    except (SafetensorError, OSError) as e:    # a full disk: no file left aside
        for p in (tmp + ".safetensors", tmp + ".json"):
            if os.path.exists(p):
                os.remove(p)
        raise OSError(f"{out_dir}: the adapter could not be written ({e})") from e
    os.replace(tmp + ".safetensors", os.path.join(out_dir, "adapter_model.safetensors"))
    os.replace(tmp + ".json", os.path.join(out_dir, "adapter_config.json"))
    return out_dir


class AdapterError(ValueError):
    """An adapter folder that cannot be loaded: its file and the key or field named."""


def read_adapter(adapter_dir):
    """An adapter folder's adapter_config.json, checked, and the path of its weights -> (config, its path,
    the weights' path): every field a LoRA this module loads needs, and the rank of the file's A matrices
    (read from the safetensors header, nothing loaded). AdapterError naming the file and field otherwise."""
    from safetensors import SafetensorError, safe_open
    cpath = os.path.join(adapter_dir, "adapter_config.json")
    wpath = os.path.join(adapter_dir, "adapter_model.safetensors")
    for p in (cpath, wpath):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: missing")
    try:
        with open(cpath, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, RecursionError) as e:
        raise AdapterError(f"{cpath}: not JSON ({str(e)[:100]})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cpath}: not a JSON object")
    # a number JSON allows but no adapter holds (alpha Infinity, 1e300, a 400-digit r) would merge into inf weights
    for field, ok in (("r", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16),
                      ("lora_alpha", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                       and 0 < v <= 1e6),
                      ("lora_dropout", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                       and 0 <= v < 1)):
        if not ok(cfg.get(field, 0.0 if field == "lora_dropout" else None)):
            raise AdapterError(f"{cpath}: {field}: {cfg.get(field)!r} is not a valid value")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{cpath}: peft_type: expected 'LORA', got {cfg.get('peft_type')!r}")
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{cpath}: rslora, DoRA and per-module rank/alpha patterns are not supported")
    for field in ("layers_to_transform", "exclude_modules", "modules_to_save"):
        if cfg.get(field):
            raise AdapterError(f"{cpath}: {field}: not supported (LoRA on every layer's named projections only)")
    if isinstance(cfg.get("target_modules"), str):
        raise AdapterError(f"{cpath}: target_modules: regex strings are not supported, give a list")
    # the file's A matrices are of rank r, read from its header before any layer is made: otherwise a 163-byte
    # adapter saying r 65536 makes the layers allocate 154 GiB at real width before a tensor is read
    try:
        with safe_open(wpath, framework="pt") as f:
            ranks = {(f.get_slice(k).get_shape() or [0])[0] for k in f.keys() if ".lora_A." in k}
    except (SafetensorError, OSError) as e:     # a file cut short, or not safetensors
        raise AdapterError(f"{wpath}: not a readable safetensors file ({str(e)[:100]})") from None
    if ranks != {cfg["r"]}:
        raise AdapterError(f"{wpath}: its lora_A matrices have ranks {sorted(ranks)}, adapter_config.json's r is "
                           f"{cfg['r']}")
    return cfg, cpath, wpath


def load_adapter(model, adapter_dir):
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, adding LoRA layers if it has none.
    Every key must match a LoRA module and every LoRA module must get its A and B. The two files are
    read by hand (JSON and safetensors, read_adapter) rather than through peft: the format is two small
    files, and this keeps lora.py free of any dependency but torch and safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    cfg, cpath, wpath = read_adapter(adapter_dir)
    targets = cfg.get("target_modules")
    if not lora_modules(model):            # (the layers are made from the list: a model that has them reads none)
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise AdapterError(f"{cpath}: target_modules: a list of module names is required")
        add_lora(model, r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                 targets=tuple(targets))
    mods = lora_modules(model)
    if any(m.merged for m in mods.values()):  # new A, B would be ignored, the old delta kept in W
        raise AdapterError(f"{adapter_dir}: cannot load into a model whose LoRA is merged (merge_lora): its base "
                         "weights hold the previous adapter; load the base model again")
    try:
        state = load_file(wpath)
    except (SafetensorError, OSError) as e:     # a file cut short, or not safetensors
        raise AdapterError(f"{wpath}: not a readable safetensors file ({str(e)[:100]})") from None
    seen = set()
    for key, t in state.items():
        k = key.removeprefix(PEFT_PREFIX).removeprefix("model.")
        for part in ("lora_A", "lora_B"):
            if k.endswith((f".{part}.weight", f".{part}.default.weight")):
                name = k[: k.rindex(f".{part}")]
                break
        else:
            raise AdapterError(f"{wpath}: {key}: not a LoRA A/B tensor")
        if name not in mods:
            raise AdapterError(f"{wpath}: {key}: no LoRA layer {name!r} in the model")
        p = getattr(mods[name], part)
        if tuple(p.shape) != tuple(t.shape):
            raise AdapterError(f"{wpath}: {key}: shape {tuple(t.shape)}, model has {tuple(p.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{wpath}: {key}: holds a value that is not a finite number")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        seen.add((name, part))
    missing = [f"{n}.{p}" for n in mods for p in ("lora_A", "lora_B") if (n, p) not in seen]
    if missing:
        raise AdapterError(f"{wpath}: missing LoRA tensors: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for m in mods.values():
        m.alpha, m.scaling = cfg["lora_alpha"], cfg["lora_alpha"] / cfg["r"]
    return model


# ----------------------------------------------------------------------------- NF4 (QLoRA) storage

# bitsandbytes get_4bit_type("nf4"): 16 sorted values, index 7 = 0 exactly (bitsandbytes functional.py, get_4bit_type).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0])


def nf4_quantize(w, blocksize=64):
    """w (any shape) -> (packed uint8 (ceil(n/2),), absmax float32 (n_blocks,)). Nearest code value
    per element of each 64-block scaled by its absmax; two 4-bit indices a byte, first in the high nibble."""
    flat = w.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = F.pad(flat, (0, pad)).view(-1, blocksize)                      # (n_blocks, 64)
    absmax = blocks.abs().amax(-1).clamp_min(1e-12)                         # (n_blocks,)
    scaled = (blocks / absmax[:, None]).clamp(-1, 1)
    mid = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    q = torch.bucketize(scaled, mid.to(scaled.device)).view(-1)[: n + (n % 2)].to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] << 4) | q[1::2], absmax


def nf4_dequantize(packed, absmax, shape, dtype, blocksize=64):
    idx = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(-1).long()   # (2 * bytes,)
    n = math.prod(shape)
    code = NF4_CODE.to(packed.device)[idx]
    pad = (-code.numel()) % blocksize
    vals = F.pad(code, (0, pad)).view(-1, blocksize) * absmax[: (code.numel() + pad) // blocksize, None]
    return vals.view(-1)[:n].view(shape).to(dtype)


class NF4Matmul(torch.autograd.Function):
    """y = x W^T for an NF4Linear's W, dequantised on the forward and again on the backward (dx = g W): left to
    autograd, each projection's dequantised W is kept for the backward, as much memory as a bf16 base. QLoRA
    keeps only the 4-bit state between the passes (bitsandbytes' MatMul4Bit); W is frozen, so no dW."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return F.linear(x, layer.weight.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.layer.weight.to(g.dtype), None


class NF4Linear(nn.Module):
    """Frozen linear layer stored as NF4; the weight is dequantised to the input dtype on each call (NF4Matmul)."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        packed, absmax = nf4_quantize(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", absmax)

    @property
    def weight(self):
        return nf4_dequantize(self.packed, self.absmax, (self.out_features, self.in_features), self.dtype)

    def forward(self, x):
        return NF4Matmul.apply(x, self)


def quantize_nf4(model, targets=TARGETS):
    """Swap the target nn.Linear layers (frozen base projections) for NF4Linear, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, NF4Linear(child))
    return model


# ----------------------------------------------------------------------------- INT8 scoring

# Symmetric int8 (|q| <= 127), for scoring only: each frozen projection's weight per output channel (the
# adapter merged into it first, in float32), each activation row (a token) at run time from its own
# largest value, as LLM.int8() and SmoothQuant quantize activations (Dettmers et al. 2022, arXiv
# 2208.07339; Xiao et al. 2023, arXiv 2211.10438), without their outlier handling. For x (M, K) and
# W (N, K): y = (q(x) q(W)^T) * s_x s_W^T, the integer product exact.
INT8_CHUNK = 1024     # 1024 products of two int8 values sum below 2**24: exact in float32


def int8_quantize(w):
    """w (rows, cols) -> (q int8 (rows, cols), scale float32 (rows, 1)): each row scaled by its absmax / 127."""
    w = w.detach().float()
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (w / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def int8_matmul_reference(xq, wq):
    """The integer product xq wq^T of int8 xq (M, K) and wq (N, K) -> (M, N) float64, exact (|sum| < 2**53)."""
    return xq.double() @ wq.double().t()


def int8_matmul(xq, wq, units=None):
    """int8_matmul_reference's value, as the hardware runs it fastest: torch._int_mm (int32 accumulation,
    exact: |sum| <= 127^2 K < 2^31 for K < 133,000) on CUDA and on CPUs with int8 units (`units`: VNNI or
    AMX-INT8, speed.CPU_INT8_UNITS) where K and N are multiples of 8 -> (M, N) int32; elsewhere float32
    GEMMs over K in chunks of INT8_CHUNK (each chunk's sum exact) summed in float64 -> (M, N) float64."""
    (M, K), N, cuda = xq.shape, wq.shape[0], xq.device.type == "cuda"
    if (cuda or (units and xq.device.type == "cpu")) and K % 8 == 0 and N % 8 == 0 and M:
        pad = max(0, 17 - M) if cuda else 0                      # CUDA's kernel: M > 16, K and N multiples of 8
        return torch._int_mm(F.pad(xq, (0, 0, 0, pad)), wq.t())[:M]
    x, w = xq.float(), wq.float()
    out = torch.zeros(M, N, dtype=torch.float64, device=xq.device)                       # (M, N)
    for lo in range(0, K, INT8_CHUNK):
        out += (x[:, lo:lo + INT8_CHUNK] @ w[:, lo:lo + INT8_CHUNK].t()).double()
    return out


class Int8Linear(nn.Module):
    """A frozen projection scored in int8 (weights per output channel, activations per token, both
    symmetric): x (..., in) -> (..., out) in x's dtype. weight: (out, in), the merged one for a Shield."""

    def __init__(self, weight, units=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        qw, scale = int8_quantize(weight)
        self.register_buffer("qweight", qw)                              # (out, in) int8
        self.register_buffer("scale", scale.t().contiguous())            # (1, out) float32
        self.units = units

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)                          # (M, in)
        xq, sx = int8_quantize(flat)                                    # (M, in) int8, (M, 1)
        y = int8_matmul(xq, self.qweight, self.units).float()                   # (M, out), exact sums
        y.mul_(sx).mul_(self.scale)     # in place: at 10 x 512 tokens y is tens of MB, each new one a pass
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def quantize_int8(model, units=None, targets=TARGETS):
    """Swap the target projections for Int8Linear in place, a LoRA layer's update merged into its base's
    weight in float32 first (W + scaling B A, as export merges it; the model then holds adapter_merged).
    Scoring only: nothing trains after. A projection with a bias is refused (Qwen3's have none)."""
    found = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in targets:
                continue
            if isinstance(child, LoRALinear):
                if isinstance(child.base, NF4Linear):
                    raise ValueError("cannot score an NF4 base in int8: load it in bf16/fp32 (--quant int8 does)")
                w = child.base.weight.float() + (child.delta().float() if child.enabled and not child.merged else 0)
                model.adapter_merged = True          # the Shield still: serve's identity reads this mark
            elif isinstance(child, nn.Linear):
                w = child.weight
            else:
                continue
            if getattr(getattr(child, "base", child), "bias", None) is not None:
                raise ValueError(f"{name}: a projection with a bias; Int8Linear has none")
            setattr(module, name, Int8Linear(w, units))
            found += 1
    if not found:
        raise ValueError(f"quantize_int8: no projection named {targets} in the model")
    return model
