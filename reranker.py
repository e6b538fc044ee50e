"""Qwen3-Reranker as a hand-written PyTorch scorer: s(q, d) = z_yes - z_no at the final token.

Follows GEO Defender (paper A.1.2) and the Qwen3-Reranker model card's transformers snippet: the
same prompt (prefix + <Instruct>/<Query>/<Document> body + empty think block), the same body
truncation, the same decoder numerics (reference: transformers' modeling_qwen3.py).
Deviations from the official snippet, all on purpose:
- the score is the log-odds margin z_yes - z_no, not p(yes) = sigmoid(margin): same ranking, and it
  does not saturate (bf16 p(yes) rounds to 1.0 above a margin of ~6);
- the margin is computed in float32 from the two needed embedding rows, h_last . (E[yes] - E[no]),
  never from the full 151k-vocabulary head, even when the model runs in bf16;
- sequences are packed back to back (no padding); every sequence gets positions 0..L-1 and its own
  causal attention, so a document's score does not depend on its batch mates. The official batched
  snippet left-pads and uses arange positions, which changes only rounding (RoPE is relative);
- query, instruction and document are encoded as ordinary text, never as control tokens: the model
  card's snippet lets a document containing "<|im_end|>" or "<think>" become those tokens and so
  close the user turn and write the assistant's (`text_tokenizer`). Text without such strings gets
  the model card's ids;
- this file is the reference: each module's forward is the plain math and works on its own.
  speed.py (beside it) binds faster forwards of the same equations on a built model in one call
  (`speed.install(model)`: one query's common prompt prefix run once, in-place inference,
  hand-written backward passes, padded CPU attention, the last layer for the final token only,
  torch.compile'd fusions); it is tested equal to this file.

Read top to bottom: config, RMSNorm, RoPE, packed attention, MLP, block, model, loading, Reranker.

Shapes: N packed tokens of S sequences, C hidden, H query heads, K kv heads, E head dim, F MLP width.

Usage: rr = Reranker.from_pretrained("Qwen/Qwen3-Reranker-0.6B"); rr.rank(query, docs, k=5)
"""
import json
import os
import re
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# Paper A.1.2: the Shield Reranker's instruction, verbatim.
SHIELD_INSTRUCTION = ("Given a web search query, identify documents that are relevant, reliable, and safe "
                      "to be selected as evidence for downstream generative-search answer generation.")
# The model card's default (its format_instruction), used when the instruction given is None.
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
          "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
          "<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
# The body's field labels: written in a query or a document they would start a field of their own (a second
# instruction after the query, say), so there "<Instruct>" reads "(Instruct)" (_bodies; "<<Instruct>>" rebuilds
# no label, as removing the brackets would)
FIELDS = ("Instruct", "Query", "Document")
FIELD_LABEL = re.compile("<(" + "|".join(FIELDS) + ")>")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json"]
SUPPORTED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: names the file and the key or field."""


def _typed(v, want):
    """Whether a config.json value is a `want`: a bool or a str as such, an int or a float positive and finite
    (an int counts as a float, a bool as neither)."""
    if want in (bool, str) or isinstance(v, bool):
        return isinstance(v, want)
    return isinstance(v, (int, float) if want is float else want) and 0 < v < float("inf")


class PromptLengthError(ValueError):
    """max_length too small for the prompt: the document would get no tokens."""


@dataclass
class Qwen3Config:
    vocab_size: int = 151669          # 151643 BPE + 26 added tokens (Qwen3-Reranker-0.6B's config.json)
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128               # Qwen3 sets it explicitly (16 x 128 = 2048 != hidden 1024)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True  # the reranker checkpoint stores no lm_head
    max_position_embeddings: int = 40960
    torch_dtype: str = "bfloat16"

    @classmethod
    def from_dict(cls, d, source="config.json"):
        """config.json as transformers' Qwen3Config reads it, or CheckpointError naming the field: what this
        file does not implement (another RoPE, sliding windows, another activation) is refused, not ignored;
        a key of the model's shape left out takes transformers' default (untied head, RoPE base 10000, head_dim
        128), not the reranker's; max_position_embeddings and torch_dtype (not used to load) this class's."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if d.get("model_type", "qwen3") != "qwen3":
            raise CheckpointError(f"{source}: model_type: expected 'qwen3', got {d.get('model_type')!r}")
        for need in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads") + ("head_dim",) * ("head_dim" in d):
            if isinstance(d.get(need), bool) or not isinstance(d.get(need), int) or d[need] < 1:
                raise CheckpointError(f"{source}: {need}: expected a positive integer, got {d.get(need)!r}")
        kw.setdefault("head_dim", 128)   # Qwen3Config's default, whatever hidden_size / heads is
        if d["num_attention_heads"] % d["num_key_value_heads"] or kw["head_dim"] % 2:
            raise CheckpointError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads, and "
                                  "head_dim even (RoPE rotates pairs)")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}    # v4 layout, or v5's (with the base)
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        unsupported = {"rope_scaling": kind != "default" and f"{kind!r} RoPE",
                       "use_sliding_window": d.get("use_sliding_window") and "sliding-window attention",
                       "layer_types": any(t != "full_attention" for t in d.get("layer_types") or [])
                       and "a layer that is not full attention",
                       "hidden_act": d.get("hidden_act", "silu") != "silu" and f"activation {d.get('hidden_act')!r}"}
        for key, what in unsupported.items():
            if what:
                raise CheckpointError(f"{source}: {key}: {what} is not implemented here (only Qwen3's default)")
        kw.setdefault("rope_theta", rope.get("rope_theta", 10_000.0) if isinstance(rope, dict) else 10_000.0)
        kw.setdefault("tie_word_embeddings", False)
        if "torch_dtype" not in d and "dtype" in d:
            kw["torch_dtype"] = d["dtype"]
        for f in fields(cls):             # each value of its default's type (a null: this class's default)
            v = kw.get(f.name)
            if v is None and f.name in ("torch_dtype", "max_position_embeddings"):
                kw.pop(f.name, None)
            elif f.name in kw and not _typed(v, type(f.default)):
                want = type(f.default)
                raise CheckpointError(f"{source}: {f.name}: expected {'a positive ' * (want in (int, float))}"
                                      f"{want.__name__}, got {v!r}")
        return cls(**kw)

    @classmethod
    def from_json(cls, path):
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except (ValueError, RecursionError) as e:        # (UnicodeDecodeError included; nested too deeply)
                raise CheckpointError(f"{path}: not JSON ({str(e)[:100]})") from None
        return cls.from_dict(d, source=path)

    def to_dict(self):
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                "attention_bias": False, "rope_scaling": None, "use_sliding_window": False,
                "sliding_window": None, "bos_token_id": 151643, "eos_token_id": 151645, **d}


# ----------------------------------------------------------------------------- decoder


def rms_norm(x, weight, eps):
    """Qwen3RMSNorm: normalise in float32, cast back, then the weight. x (..., C)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)                        # (..., C)


def rope_cos_sin(pos, head_dim, theta, dtype):
    """pos (N,) int -> cos, sin (N, 1, E) in `dtype`; frequencies in float32 as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
    freqs = pos.float()[:, None] * inv_freq[None, :]       # (N, E/2)
    emb = torch.cat((freqs, freqs), dim=-1)                # (N, E)  NeoX halves, not interleaved
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotary position embedding (Su et al., arXiv 2104.09864) in transformers' half-split form:
    x (N, heads, E) -> x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


def packed_causal_sdpa(q, k, v, lens):
    """Causal GQA of packed sequences by SDPA, one sequence at a time: q (N, H, E), k and v (N, K, E)
    with the sequences back to back (lengths `lens`) -> (N, H, E). No sequence sees another."""
    out = torch.empty_like(q)                                                     # (N, H, E)
    start = 0
    for L in lens:
        # 4-D (1, heads, L, E); enable_gqa: kv head i serves query heads i*H/K .. (i+1)*H/K - 1
        qj, kj, vj = (t[start:start + L].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qj, kj, vj, is_causal=True, enable_gqa=True)   # (1, H, L, E)
        out[start:start + L] = o[0].transpose(0, 1)
        start += L
    return out


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.H, self.K, self.E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C = cfg.hidden_size
        self.q_proj = nn.Linear(C, self.H * self.E, bias=False)
        self.k_proj = nn.Linear(C, self.K * self.E, bias=False)
        self.v_proj = nn.Linear(C, self.K * self.E, bias=False)
        self.o_proj = nn.Linear(self.H * self.E, C, bias=False)
        self.q_norm = RMSNorm(self.E, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.E, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, lens):
        """x (N, C): sequences packed back to back (lengths `lens`) -> (N, C)."""
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.H, self.E)                                # (N, H, E)
        k = self.k_proj(x).view(N, self.K, self.E)                                # (N, K, E)
        v = self.v_proj(x).view(N, self.K, self.E)                                # (N, K, E)
        q = apply_rope(self.q_norm(q), cos, sin)                                  # per-head norm, then RoPE
        k = apply_rope(self.k_norm(k), cos, sin)
        o = packed_causal_sdpa(q, k, v, lens)                                     # (N, H, E)
        return self.o_proj(o.reshape(N, self.H * self.E))                         # (N, C)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, Fd = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, Fd, bias=False)
        self.up_proj = nn.Linear(C, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))      # SwiGLU: (N, F) -> (N, C)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, lens):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, lens)           # (N, C)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The decoder without the LM head. Submodule names mirror the checkpoint's `model.*` keys. Built as the
    skeleton a checkpoint's weights fill (load_qwen3 builds it on the meta device), so the embedding gets no
    init of its own: nn.Embedding's normal_ on the meta device imports torch._dynamo, which a process that
    only scores never needs otherwise (docs/PERF.md)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gradient_checkpointing = False

    def positions(self, ids, lens):
        """-> RoPE cos, sin (N, 1, E) of the packed rows (each sequence at 0..L-1) and the row of each
        sequence's last token (S,)."""
        pos = torch.cat([torch.arange(L, device=ids.device) for L in lens])      # (N,)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, self.embed_tokens.weight.dtype)
        return cos, sin, torch.tensor(lens, device=ids.device).cumsum(0) - 1

    def forward(self, ids, lens):
        """ids (N,) token ids of S sequences packed back to back (lengths `lens`) -> the final hidden
        state of each sequence's last token, (S, C) after the final norm."""
        x = self.embed_tokens(ids)                                                # (N, C)
        cos, sin, last = self.positions(ids, lens)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, lens, use_reentrant=False)
            else:
                x = layer(x, cos, sin, lens)
        return self.norm(x[last])                                                 # (S, C)


# ----------------------------------------------------------------------------- loading


def resolve_model_path(name_or_path, revision=None):
    """A local folder as is, else a hub id via huggingface-hub's snapshot_download (respects HF_HOME,
    HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN). Returns (folder, resolved commit sha or None)."""
    p = os.path.expanduser(str(name_or_path))
    if os.path.isdir(p):
        return p, None
    if os.path.exists(p) or p.startswith((".", "/")) or p.count("/") != 1:
        raise CheckpointError(f"{name_or_path}: not a model folder and not a hub id (owner/name)")
    from huggingface_hub import snapshot_download
    try:
        folder = snapshot_download(p, revision=revision, allow_patterns=HUB_FILES)
    except Exception as e:  # LocalEntryNotFoundError, connection errors, 401/404 ...
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        raise CheckpointError(
            f"{name_or_path}: cannot download or find it in the hub cache ({type(e).__name__}: {e})."
            f"{' HF_HUB_OFFLINE is set.' if offline else ''} Without hub access use a local folder, or "
            f"`--model tiny` for the offline random-weight checkpoint.") from None
    return folder, os.path.basename(os.path.normpath(folder))


def weight_files(folder):
    """The safetensors files load_qwen3 reads: those model.safetensors.index.json's weight_map names (in any
    subfolder, under any name), else model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map: missing or not an object of file names")
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
        # a hub repo's index naming ../ or /abs paths would read this machine's files; the names are checked, not
        # where links lead (the hub cache's shards are links into its blobs/ folder)
        inside = os.path.abspath(folder)
        for path in files:
            if os.path.commonpath([inside, os.path.abspath(path)]) != inside:
                raise CheckpointError(f"{index}: weight_map: {path} is outside the checkpoint's folder")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


LAYER_KEY = re.compile(r"model\.layers\.(\d{1,9})\.")


def weight_keys(folder):
    """Every tensor name the folder's weight files hold, from their headers (nothing loaded)."""
    from safetensors import safe_open
    keys = []
    for path in weight_files(folder):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: listed in the index but missing")
        try:
            with safe_open(path, framework="pt") as f:
                keys += f.keys()
        except Exception as e:      # safetensors' own error: a truncated file, a bad header
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return keys


def load_qwen3(folder, dtype=torch.bfloat16, device="cpu"):
    """config.json + safetensors -> (Qwen3Model in eval mode, config, head): head is an untied lm_head (V, C), a
    seq-cls export's score row (1, C), or None (tied to the embedding).
    Each tensor's stored dtype is read from the file and cast to `dtype`. No pickle."""
    from safetensors import safe_open
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing")
    cfg = Qwen3Config.from_json(cfg_path)
    with open(cfg_path, encoding="utf-8") as f:
        if "quantization_config" in json.load(f):     # export --quant int8 writes one (compressed-tensors W8A8)
            raise CheckpointError(f"{cfg_path}: a quantized checkpoint (quantization_config); this loader reads "
                                  "float weights: load the float export (serve --quant int8 quantizes it), or serve "
                                  "this one with vLLM or transformers + compressed-tensors")
    held = {int(m.group(1)) for key in weight_keys(folder) for m in [LAYER_KEY.match(key)] if m}
    if held != set(range(cfg.num_hidden_layers)):   # checked before the layers are built: each is Python objects
        raise CheckpointError(f"{cfg_path}: num_hidden_layers: {cfg.num_hidden_layers}, the weight files hold "
                              f"{len(held)} layers (indices {min(held, default=None)}..{max(held, default=None)})")
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    expected = {"model." + k: v.shape for k, v in model.state_dict().items()}
    state, lm_head, seq_cls, seen = {}, None, False, set()
    for path in weight_files(folder):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: listed in the index but missing")
        try:
            f = safe_open(path, framework="pt")
        except Exception as e:      # safetensors' own error: a truncated file, a bad header, an offset out of bounds
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        with f:
            for key in f.keys():
                if key in seen:
                    raise CheckpointError(f"{path}: {key}: also in another weight file")
                seen.add(key)
                stored = f.get_slice(key).get_dtype()
                if stored not in SUPPORTED_DTYPES:
                    raise CheckpointError(f"{path}: {key}: unsupported dtype {stored} (want BF16, F16 or F32)")
                if key in ("lm_head.weight", "score.weight"):   # score: a seq-cls export's one row, E[yes] - E[no]
                    lm_head, seq_cls = f.get_tensor(key), key == "score.weight"
                    continue
                if key not in expected:
                    raise CheckpointError(f"{path}: {key}: unexpected key for a Qwen3 decoder")
                t = f.get_tensor(key)
                if tuple(t.shape) != tuple(expected[key]):
                    raise CheckpointError(f"{path}: {key}: shape {tuple(t.shape)}, config says {tuple(expected[key])}")
                state[key[len("model."):]] = t.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - {"model." + k for k in state})
    if missing:
        raise CheckpointError(f"{folder}: missing keys: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state, assign=True)
    model.requires_grad_(False).eval()
    if lm_head is None and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{folder}: lm_head.weight: missing and tie_word_embeddings is false")
    if seq_cls:
        if tuple(lm_head.shape) != (1, cfg.hidden_size):
            raise CheckpointError(f"{folder}: score.weight: shape {tuple(lm_head.shape)}, want (1, {cfg.hidden_size})")
        return model, cfg, lm_head
    if lm_head is not None and tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{folder}: lm_head.weight: shape {tuple(lm_head.shape)}, config says "
                              f"{(cfg.vocab_size, cfg.hidden_size)}")
    tied = state["embed_tokens.weight"]
    if lm_head is not None and cfg.tie_word_embeddings and not torch.equal(lm_head.to(tied.dtype), tied):
        raise CheckpointError(f"{folder}: lm_head.weight differs from the embedding, and tie_word_embeddings is "
                              "true: which head scores is ambiguous")
    return model, cfg, (None if cfg.tie_word_embeddings else lm_head)


# ----------------------------------------------------------------------------- reranker


def text_tokenizer(tokenizer):
    """-> (a copy of `tokenizer` without its added tokens, the added tokens' ids).

    A `tokenizers.Tokenizer` matches its added tokens ("<|im_start|>", "<|im_end|>", "<think>", ...)
    anywhere in the input before BPE runs, special or not (`encode_special_tokens` covers only the
    special ones: Qwen3's <think> and </think> are added but not special). Attacker-written text
    encoded that way could close the user turn and write the assistant's answer itself. The copy
    has the same normaliser, pre-tokeniser and BPE model but no added tokens, so such strings become
    the ids of their characters; text without them encodes exactly as with the full tokenizer
    (added-token matching only splits the input where one occurs). The transformers equivalent,
    `split_special_tokens=True`, likewise leaves non-special added tokens matched."""
    from tokenizers import Tokenizer
    spec = json.loads(tokenizer.to_str())
    control = {t["id"] for t in spec.get("added_tokens") or []}
    spec["added_tokens"] = []
    spec["truncation"] = spec["padding"] = None      # as untruncated_tokenizer's
    return Tokenizer.from_str(json.dumps(spec)), control


def untruncated_tokenizer(path):
    """tokenizer.json as a `tokenizers.Tokenizer` that neither cuts nor pads: a file saved after a truncating
    or padding call keeps that setting, which from_file restores, and which would cut every prompt (the
    document gone, a margin scored on the instruction alone) where transformers passes its own per call."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path)
    tok.no_truncation()
    tok.no_padding()
    return tok


class Reranker:
    """Tokenizer + decoder + yes/no margin. `score_ids` is the one forward path (inference and training)."""

    def __init__(self, model, tokenizer, yes_no_ids, instruction=SHIELD_INSTRUCTION, max_length=8192,
                 token_budget=4096, name_or_path=None, revision=None, folder=None):
        self.model, self.tokenizer = model, tokenizer
        self.instruction = DEFAULT_INSTRUCTION if instruction is None else instruction   # as the card's format
        self.max_length, self.token_budget = max_length, token_budget
        self.name_or_path, self.revision = name_or_path, revision
        self.folder = folder   # where the files were read from: a hub id's snapshot folder, or the folder given
        self.yes_id, self.no_id = yes_no_ids
        self.prefix_ids = tokenizer.encode(PREFIX, add_special_tokens=False).ids
        self.suffix_ids = tokenizer.encode(SUFFIX, add_special_tokens=False).ids
        # query, instruction and document go through a copy without added tokens (see text_tokenizer)
        self.text_tokenizer, self.control_ids = text_tokenizer(tokenizer)
        if max_length <= len(self.prefix_ids) + len(self.suffix_ids):
            raise PromptLengthError(f"max_length {max_length} leaves no room for the query and document (the "
                                    f"prompt's fixed parts take {len(self.prefix_ids) + len(self.suffix_ids)} tokens)")
        self._lm_head = None  # an untied lm_head's yes/no rows, (2, C) (set by from_pretrained); else tied

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.bfloat16, device="cpu", instruction=SHIELD_INSTRUCTION,
                        max_length=8192, revision=None, token_budget=4096):
        """Faster forwards for the same math: speed.install(rr.model)."""
        folder, sha = resolve_model_path(name_or_path, revision)
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise CheckpointError(f"{tok_path}: missing (the reranker needs the fast tokenizer file)")
        tok = untruncated_tokenizer(tok_path)
        ids = []
        for word in ("yes", "no"):  # looked up, not hard-coded (Qwen3: yes 9693, no 2152)
            enc = tok.encode(word, add_special_tokens=False).ids
            if len(enc) != 1:
                raise CheckpointError(f"{tok_path}: '{word}' must be a single token, got ids {enc}")
            ids.append(enc[0])
        model, cfg, lm_head = load_qwen3(folder, dtype=dtype, device=device)
        # an id past the embedding is an IndexError at every request that holds it (on CUDA, an assert)
        if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
            raise CheckpointError(f"{tok_path}: {tok.get_vocab_size(with_added_tokens=True)} tokens, more than "
                                  f"config.json's vocab_size {cfg.vocab_size}")
        rr = cls(model, tok, ids, instruction=instruction, max_length=max_length, token_budget=token_budget,
                 name_or_path=str(name_or_path), revision=sha or revision, folder=folder)
        if lm_head is not None and len(lm_head) == 1:   # seq-cls: the row is w itself (w - 0 below)
            rr._lm_head = torch.cat([lm_head, torch.zeros_like(lm_head)]).to(device)    # (2, C)
        elif lm_head is not None:  # an untied head (tie_word_embeddings false): only its yes/no rows are needed
            rr._lm_head = lm_head[ids].to(device)                      # (2, C): yes, no
        return rr

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def yes_minus_no(self):
        """w = E[yes] - E[no] in float32, (C,): the margin is h_last . w (= z_yes - z_no). E is the tied
        embedding, or an untied lm_head's two rows (kept as `_lm_head`, (2, C))."""
        rows = self.model.embed_tokens.weight[[self.yes_id, self.no_id]] if self._lm_head is None else self._lm_head
        return (rows[0].float() - rows[1].float()).to(self.device)

    def _bodies(self, query, docs):
        """-> (token room for a body, each document's body encoded as ordinary text; the query's and the
        documents' own field labels in parentheses, FIELD_LABEL)."""
        room = self.max_length - len(self.prefix_ids) - len(self.suffix_ids)
        unlabel = lambda t: FIELD_LABEL.sub(r"(\1)", t)
        query = unlabel(query)                                  # once, not once a document
        bodies = [BODY.format(instruction=self.instruction, query=query, doc=unlabel(d)) for d in docs]
        return room, self.text_tokenizer.encode_batch(bodies, add_special_tokens=False)

    def tokenize(self, query, docs):
        """Model card's process_inputs: prefix + body (tail cut to fit max_length) + suffix, per doc.
        The body (instruction, query, document) is encoded as ordinary text: a document holding
        "<|im_end|>" or "<think>" gets the ids of those characters, never the control tokens, so it
        cannot close the user turn or write the assistant's (see text_tokenizer)."""
        if isinstance(docs, str):
            docs = [docs]
        # the body without a document first, once: a query that leaves the documents no room is refused before
        # it is copied into every document's body (a served request's megabyte query, times 1000 documents)
        room, (head,) = self._bodies(query, [""])
        head = len(head.ids)
        if head > room or (head == room and any(docs)):
            raise PromptLengthError(
                f"max_length {self.max_length} leaves the document no tokens: the prompt without it takes "
                f"{head + len(self.prefix_ids) + len(self.suffix_ids)} tokens (instruction and query included)")
        room, encs = self._bodies(query, docs)
        out = []
        for e in encs:
            if self.control_ids.intersection(e.ids):   # the tokenizer's BPE itself can build one: refuse
                raise ValueError(f"text encoded to a control token id {sorted(self.control_ids.intersection(e.ids))}")
            out.append(self.prefix_ids + e.ids[:room] + self.suffix_ids)
        return out

    def overflow(self, query, docs):
        """How many of `docs` `tokenize` cuts (their prompts exceed max_length; the tail is dropped)."""
        room, encs = self._bodies(query, docs)
        return sum(len(e.ids) > room for e in encs)

    def score_ids(self, ids, grad=False):
        """ids: list of S token-id lists -> float32 (S,) margins in input order. Sequences are sorted
        by length and packed into micro-batches of at most `token_budget` tokens (a longer one runs alone).
        An empty sequence has no last token to score: ValueError (tokenize never makes one)."""
        if any(len(x) == 0 for x in ids):
            raise ValueError(f"score_ids: sequence {next(i for i, x in enumerate(ids) if len(x) == 0)} is empty")
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = [None] * len(ids)
        w = self.yes_minus_no()
        batch, used = [], 0

        def flush():
            seqs = [ids[i] for i in batch]
            flat = torch.tensor([t for x in seqs for t in x], dtype=torch.long, device=self.device)   # (N,)
            h = self.model(flat, [len(x) for x in seqs])               # (S, C)
            m = h.float() @ w                                          # (S,) float32 margin
            for j, i in enumerate(batch):
                out[i] = m[j]

        with torch.set_grad_enabled(grad), torch.inference_mode(not grad):
            for i in order:
                if batch and used + len(ids[i]) > self.token_budget:
                    flush()
                    batch, used = [], 0
                batch.append(i)
                used += len(ids[i])
            if batch:
                flush()
            if not out:
                return torch.zeros(0)
            out = torch.stack(out)
        if not torch.isfinite(out).all():    # an overflow (float16 weights): a NaN would order nothing and be cached
            raise FloatingPointError(f"non-finite margins for {int((~torch.isfinite(out)).sum())} of {len(out)} "
                                     f"sequences (dtype {self.model.embed_tokens.weight.dtype}: try --dtype float32)")
        return out

    def score(self, query, docs, grad=False):
        return self.score_ids(self.tokenize(query, docs), grad=grad)

    def rank(self, query, docs, k=5):
        """Indices of the top-k documents, best first (ties keep input order)."""
        m = self.score(query, docs)
        return sorted(range(len(docs)), key=lambda i: (-float(m[i]), i))[:k]
