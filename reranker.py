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
- in the last layer only the final token's query, attention output and MLP are computed;
- the tokens a micro-batch's sequences have in common at the start (one query's prompts share the
  system prompt, instruction and query: ~86 tokens) are computed once, not once per document
  (`share_prefix`, on by default): each sequence still attends to the whole prefix at positions
  0..P-1, so the margins are the same math;
- query, instruction and document are encoded as ordinary text, never as control tokens: the model
  card's snippet lets a document containing "<|im_end|>" or "<think>" become those tokens and so
  close the user turn and write the assistant's (`text_tokenizer`). Text without such strings gets
  the model card's ids;
- for training, RMSNorm and (on the CPU) causal attention have hand-written backward passes, and
  `compile=True` runs the elementwise work as torch.compile'd fusions: the same equations, kept
  together at the end of the file ("CPU and speed paths").

Read top to bottom: config, RMSNorm, RoPE, packed attention, MLP, block, model, loading, Reranker.

Shapes: N packed tokens of S sequences, C hidden, H query heads, K kv heads, E head dim, F MLP width.

Usage: rr = Reranker.from_pretrained("Qwen/Qwen3-Reranker-0.6B"); rr.rank(query, docs, k=5)
"""
import json
import operator
import os
import shutil
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# Paper A.1.2: the Shield Reranker's instruction, verbatim.
SHIELD_INSTRUCTION = ("Given a web search query, identify documents that are relevant, reliable, and safe "
                      "to be selected as evidence for downstream generative-search answer generation.")
# Model card default (README), used when no instruction is given.
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
          "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
          "<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json"]
SUPPORTED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: names the file and the key or field."""


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
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if d.get("model_type", "qwen3") != "qwen3":
            raise CheckpointError(f"{source}: model_type: expected 'qwen3', got {d.get('model_type')!r}")
        for need in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if need not in d:
                raise CheckpointError(f"{source}: {need}: missing")
        if "head_dim" not in d:  # transformers' fallback
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("rope_scaling") not in (None, {}) and (d["rope_scaling"] or {}).get("rope_type", "default") != "default":
            raise CheckpointError(f"{source}: rope_scaling: only the default RoPE is implemented, got {d['rope_scaling']}")
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):  # transformers v5 layout
            kw["rope_theta"] = d["rope_parameters"].get("rope_theta", cls.rope_theta)
        if "torch_dtype" not in d and "dtype" in d:
            kw["torch_dtype"] = d["dtype"]
        return cls(**kw)

    @classmethod
    def from_json(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), source=path)

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
    kernels = None  # the Kernels the model was built with (Qwen3Model sets them)

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.kernels.rms_norm(x, self.weight, self.eps)            # (..., C)


def rope_cos_sin(pos, head_dim, theta, dtype):
    """pos (N,) int -> cos, sin_signed (N, 1, E) in `dtype`; frequencies in float32 as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
    freqs = pos.float()[:, None] * inv_freq[None, :]       # (N, E/2)
    emb = torch.cat((freqs, freqs), dim=-1)                # (N, E)  NeoX halves, not interleaved
    sin = emb.sin().to(dtype)
    sin_signed = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2:]), dim=-1)   # for apply_rope
    return emb.cos().to(dtype)[:, None, :], sin_signed[:, None, :]


def apply_rope(x, cos, sin_signed):
    """x (N, heads, E): x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1], computed as
    [x2, x1] * [-sin1, sin2] (sin_signed, bit-identical: negation is exact). In inference x is
    overwritten (it is a fresh projection output)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)                 # [x2, x1]
    if torch.is_grad_enabled():
        return x * cos + swapped * sin_signed
    return x.mul_(cos).add_(swapped.mul_(sin_signed))


def seq_rows(t, P, start, L):
    """One sequence's rows of a packed (N, ...) tensor: the P shared prefix rows 0..P-1, then its own
    rows start..start+L-1 -> (P+L, ...). A view when they are adjacent (P = 0, or the first sequence)."""
    if P == 0 or start == P:
        return t[start - P:start + L]
    return torch.cat([t[:P], t[start:start + L]])


def packed_causal_sdpa(q, k, v, lens, P=0):
    """Causal GQA of packed sequences by SDPA, one sequence at a time. q (N, H, E), k and v (N, K, E):
    P shared prefix rows, then each sequence's own rows (lengths `lens`) -> (N, H, E). Each sequence
    attends over prefix + own rows; the prefix queries ride along so that one square causal mask
    serves, and their output rows are kept once (sequence 0): P*P/2 extra scores per other sequence.
    On the CPU a sequence whose length is not a multiple of CPU_SDPA_PAD is first copied into a
    head-major buffer padded with zero rows up to one (see there); causal, so no real query sees a
    padding key, and the padding queries' outputs are dropped."""
    out = torch.empty_like(q)                                                     # (N, H, E)
    cpu = q.device.type == "cpu"
    start = P
    for j, L in enumerate(lens):
        # 4-D (1, heads, P+L, E): 3-D inputs send CPU SDPA to its slow math path (7x slower, measured);
        # enable_gqa: kv head i serves query heads i*H/K .. (i+1)*H/K - 1 (repeat_interleave)
        if cpu and (P + L) % CPU_SDPA_PAD:
            n = -(-(P + L) // CPU_SDPA_PAD) * CPU_SDPA_PAD
            qj, kj, vj = (seq_heads(t, P, start, L, n) for t in (q, k, v))     # (1, heads, n, E)
        else:
            qj, kj, vj = (seq_rows(t, P, start, L).transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qj, kj, vj, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        if j == 0:
            out[:start + L] = o[:start + L]                                       # with the prefix rows
        else:
            out[start:start + L] = o[P:P + L]                                     # (L, H, E)
        start += L
    return out


class Attention(nn.Module):
    kernels = None

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

    def forward(self, x, cos, sin, lens, last=None, prefix=0):
        """x (N, C) packed: `prefix` rows shared by every sequence, then each sequence's own rows
        (lengths `lens`); last: (S,) row index of each sequence's final token, or None. With `last`,
        only those S queries are computed: returns (S, C), else (N, C)."""
        N, P = x.shape[0], prefix
        xq = x if last is None else x[last]                                       # (N or S, C)
        cq, sq = (cos, sin) if last is None else (cos[last], sin[last])
        q = self.q_proj(xq).view(-1, self.H, self.E)                              # (N|S, H, E)
        k = self.k_proj(x).view(N, self.K, self.E)                                # (N, K, E)
        v = self.v_proj(x).view(N, self.K, self.E)                                # (N, K, E)
        q = self.kernels.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cq, sq)  # per-head norm, then RoPE
        k = self.kernels.norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        if last is None:
            o = self.kernels.attention(q, k, v, lens, P)                          # (N, H, E)
            return self.o_proj(o.view(N, self.H * self.E))                        # (N, C)
        outs, start = [], P
        for j, L in enumerate(lens):                                              # final query sees all keys
            kj, vj = (seq_rows(t, P, start, L).transpose(0, 1)[None] for t in (k, v))  # (1, K, P+L, E)
            o = F.scaled_dot_product_attention(q[j:j + 1].transpose(0, 1)[None], kj, vj, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(-1, self.H * self.E))        # (1, H*E)
            start += L
        return self.o_proj(torch.cat(outs))                                       # (S, C)


class MLP(nn.Module):
    kernels = None

    def __init__(self, cfg):
        super().__init__()
        C, Fd = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, Fd, bias=False)
        self.up_proj = nn.Linear(C, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, C, bias=False)

    def forward(self, x):
        return self.down_proj(self.kernels.swiglu(self.gate_proj(x), self.up_proj(x)))   # (N, F) -> (N, C)


class Block(nn.Module):
    kernels = None

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, lens, last=None, prefix=0):
        h = self.self_attn(self.input_layernorm(x), cos, sin, lens, last, prefix)
        x = x if last is None else x[last]                         # (N|S, C)
        norm = self.post_attention_layernorm
        x, n = self.kernels.add_rms_norm(x, h, norm.weight, norm.eps)   # x + h, and its norm
        return self.kernels.add(x, self.mlp(n))                          # the second residual


class Qwen3Model(nn.Module):
    """The decoder without the LM head. Submodule names mirror the checkpoint's `model.*` keys."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gradient_checkpointing = False
        self.use_kernels(EAGER)

    def use_kernels(self, kernels):
        """Every module computes its elementwise and attention work with `kernels` (EAGER, COMPILED)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP, Block)):
                m.kernels = kernels
        return self

    def compile_elementwise(self, on=True):
        """Run the elementwise pieces (norms, q/k norm + RoPE, residual add + norm, SwiGLU) as
        torch.compile'd fusions (COMPILED); matmuls, attention and LoRA are unchanged."""
        if on and self.embed_tokens.weight.device.type == "cpu" and not cpp_compiler_available():
            raise RuntimeError("compile=True needs a C++ compiler on the CPU (torch.compile's inductor "
                               "backend builds its kernels with $CXX, else g++): install one or run without it")
        return self.use_kernels(COMPILED if on else EAGER)

    def forward(self, ids, lens, prefix=0):
        """ids (N,) packed token ids: `prefix` tokens shared by all S sequences (stored once), then each
        sequence's own tokens, lengths `lens` -> final hidden state of each sequence's last token,
        (S, C) after the final norm. Causal attention makes the prefix's states independent of what
        follows, so sharing it is exact: sequence j is prefix + its own tokens at positions 0..P+L_j-1."""
        x = self.embed_tokens(ids)                                                # (N, C)
        pos = torch.cat([torch.arange(prefix, device=ids.device)]                 # (N,) 0..P-1, then
                        + [torch.arange(prefix, prefix + L, device=ids.device) for L in lens])  # P..P+L-1 each
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        last = prefix + torch.tensor(lens, device=ids.device).cumsum(0) - 1       # (S,)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            li = last if i == n - 1 else None
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, lens, li, prefix, use_reentrant=False)
            else:
                x = layer(x, cos, sin, lens, li, prefix)
        return self.norm(x)                                                       # (S, C)


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


def _safetensors_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map: missing or not an object")
        return sorted({os.path.join(folder, v) for v in weight_map.values()})
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_qwen3(folder, dtype=torch.bfloat16, device="cpu"):
    """config.json + safetensors -> (Qwen3Model in eval mode, config, lm_head rows or None).
    Each tensor's stored dtype is read from the file and cast to `dtype`. No pickle."""
    from safetensors import safe_open
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing")
    cfg = Qwen3Config.from_json(cfg_path)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    expected = {"model." + k: v.shape for k, v in model.state_dict().items()}
    state, lm_head = {}, None
    for path in _safetensors_files(folder):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: listed in the index but missing")
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                stored = f.get_slice(key).get_dtype()
                if stored not in SUPPORTED_DTYPES:
                    raise CheckpointError(f"{path}: {key}: unsupported dtype {stored} (want BF16, F16 or F32)")
                if key == "lm_head.weight":
                    lm_head = f.get_tensor(key)
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
    if lm_head is None and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{folder}: lm_head.weight: missing and tie_word_embeddings is false")
    model.load_state_dict(state, assign=True)
    model.requires_grad_(False).eval()
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
    return Tokenizer.from_str(json.dumps(spec)), control


def common_prefix_len(seqs):
    """Length of the longest common prefix of token-id lists, capped one short of the shortest, so
    that every sequence keeps its own final token (the one that is scored)."""
    n = min(len(x) for x in seqs) - 1
    first = seqs[0]
    for x in seqs[1:]:
        n = next((i for i in range(n) if x[i] != first[i]), n)
    return max(n, 0)


class Reranker:
    """Tokenizer + decoder + yes/no margin. `score_ids` is the one forward path (inference and training)."""

    def __init__(self, model, tokenizer, yes_no_rows, instruction=SHIELD_INSTRUCTION, max_length=8192,
                 token_budget=4096, name_or_path=None, revision=None, share_prefix=True):
        self.model, self.tokenizer = model, tokenizer
        self.share_prefix = share_prefix  # run a micro-batch's common token prefix once (see score_ids)
        self.instruction, self.max_length, self.token_budget = instruction, max_length, token_budget
        self.name_or_path, self.revision = name_or_path, revision
        self.yes_id, self.no_id = yes_no_rows
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
                        max_length=8192, revision=None, token_budget=4096, compile=False, share_prefix=True):
        """compile: fuse the elementwise work with torch.compile (Qwen3Model.compile_elementwise).
        share_prefix: see score_ids."""
        from tokenizers import Tokenizer
        folder, sha = resolve_model_path(name_or_path, revision)
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise CheckpointError(f"{tok_path}: missing (the reranker needs the fast tokenizer file)")
        tok = Tokenizer.from_file(tok_path)
        ids = []
        for word in ("yes", "no"):  # looked up, not hard-coded (Qwen3: yes 9693, no 2152)
            enc = tok.encode(word, add_special_tokens=False).ids
            if len(enc) != 1:
                raise CheckpointError(f"{tok_path}: '{word}' must be a single token, got ids {enc}")
            ids.append(enc[0])
        model, cfg, lm_head = load_qwen3(folder, dtype=dtype, device=device)
        if compile:
            model.compile_elementwise()
        rr = cls(model, tok, ids, instruction=instruction, max_length=max_length, token_budget=token_budget,
                 name_or_path=str(name_or_path), revision=sha or revision, share_prefix=share_prefix)
        if lm_head is not None:  # an untied head (tie_word_embeddings false): only its yes/no rows are needed
            rr._lm_head = lm_head[ids].to(device)                      # (2, C): yes, no
        return rr

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def head(self):
        """w = E[yes] - E[no] in float32, (C,): the margin is h_last . w (= z_yes - z_no). E is the tied
        embedding, or an untied lm_head's two rows (kept as `_lm_head`, (2, C))."""
        rows = self._lm_head
        if rows is None:
            rows = self.model.embed_tokens.weight[[self.yes_id, self.no_id]]
        return (rows[0].float() - rows[1].float()).to(self.device)

    def _bodies(self, query, docs):
        """-> (token room for a body, each document's body encoded as ordinary text)."""
        room = self.max_length - len(self.prefix_ids) - len(self.suffix_ids)
        bodies = [BODY.format(instruction=self.instruction, query=query, doc=d) for d in docs]
        return room, self.text_tokenizer.encode_batch(bodies, add_special_tokens=False)

    def tokenize(self, query, docs):
        """Model card's process_inputs: prefix + body (tail cut to fit max_length) + suffix, per doc.
        The body (instruction, query, document) is encoded as ordinary text: a document holding
        "<|im_end|>" or "<think>" gets the ids of those characters, never the control tokens, so it
        cannot close the user turn or write the assistant's (see text_tokenizer)."""
        if isinstance(docs, str):
            docs = [docs]
        room, encs = self._bodies(query, docs)
        if any(len(e.ids) > room for e in encs):   # a cut: it must leave the document some tokens
            head = len(self._bodies(query, [""])[1][0].ids)
            if head >= room:
                raise PromptLengthError(
                    f"max_length {self.max_length} leaves the document no tokens: the prompt without it takes "
                    f"{head + len(self.prefix_ids) + len(self.suffix_ids)} tokens (instruction and query included)")
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

        With share_prefix, a micro-batch's longest common token prefix (the system prompt, instruction
        and query when the documents answer one query: ~86 tokens with Qwen3's vocabulary) runs once
        instead of once per document; every sequence keeps at least its final token. The margins are
        the same math (causal attention); in training with LoRA dropout the shared rows draw one mask
        for the whole micro-batch, where separate forwards would draw one per document."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = [None] * len(ids)
        w = self.head()
        batch, used = [], 0

        def flush():
            seqs = [ids[i] for i in batch]
            P = common_prefix_len(seqs) if self.share_prefix and len(seqs) > 1 else 0
            lens = [len(x) - P for x in seqs]
            flat = torch.tensor(seqs[0][:P] + [t for x in seqs for t in x[P:]], dtype=torch.long, device=self.device)
            h = self.model(flat, lens, prefix=P)                       # (S, C)
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
            return torch.stack(out)

    def score(self, query, docs, grad=False):
        return self.score_ids(self.tokenize(query, docs), grad=grad)

    def rank(self, query, docs, k=5):
        """Indices of the top-k documents, best first (ties keep input order)."""
        m = self.score(query, docs)
        return sorted(range(len(docs)), key=lambda i: (-float(m[i]), i))[:k]


# =============================================================================
# CPU and speed paths. Same equations as the modules above, chosen once when the model is built
# or by the device: a hand-written RMSNorm backward, the packed causal attention backward used on
# the CPU, the CPU SDPA length padding, and torch.compile'd elementwise fusions (compile=True).
# Measurements behind each choice: docs/PERF.md.
# =============================================================================


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
    sequence's own rows, lengths `lens`) -> (N, H, E). Forward: SDPA per sequence (fused, exact),
    written straight into one packed output. Backward by hand, per sequence, over blocks of `block`
    query rows, each against only the keys it can see (0 .. its last row): about half the work of a
    dense backward, and the probabilities are recomputed, not stored. The gradients land directly in
    packed (N, ...) buffers: slicing the packed tensors per sequence and letting autograd undo it
    would zero-fill and add a full-size gradient for every sequence and each of q, k, v.
    On a 2-core CPU: ~16 ms at L=512 (16/8 heads, bf16) against 28-32 ms for SDPA's forward +
    backward, whose CPU backward takes 5-8x its forward.
    Numerics of the backward: scores and probabilities in the model dtype (bf16 as transformers'
    eager attention keeps them; softmax accumulates in float32); exact in float32."""

    @staticmethod
    def forward(ctx, q, k, v, lens, P=0, block=128):
        ctx.save_for_backward(q, k, v)
        ctx.lens, ctx.P, ctx.block = lens, P, block
        return packed_causal_sdpa(q, k, v, lens, P)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        P, block = ctx.P, ctx.block
        N, H, E = q.shape
        K = k.shape[1]
        G, scale = H // K, E ** -0.5
        dq = torch.empty_like(q)                                                  # every row written once
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)                         # prefix rows: summed over sequences
        start = P
        for j, L in enumerate(ctx.lens):
            # local frame: keys 0..P+L-1 (prefix, then own); queries from r0 (the prefix's queries
            # count only once, in sequence 0), held at packed rows lo..lo+R-1
            r0, lo = (0, 0) if j == 0 else (P, start)
            R = P + L - r0
            # query head h = i*G + g reads kv head i (repeat-interleave order): group query heads by kv head
            qg = q[lo:lo + R].permute(1, 0, 2).reshape(K, G, R, E)                # (K, G, R, E)
            dog = do[lo:lo + R].permute(1, 0, 2).reshape(K, G, R, E)
            # made contiguous once per sequence: bmm still copies each block's k0[:, :b] etc. into a
            # dense operand, but from these rows rather than from the packed layout (same bits, this
            # backward up to 1.1x faster)
            k0 = seq_rows(k, P, start, L).transpose(0, 1).contiguous()            # (K, P+L, E)
            v0 = seq_rows(v, P, start, L).transpose(0, 1).contiguous()
            dqg = torch.empty_like(qg)
            dkl = torch.zeros(K, P + L, E, dtype=k.dtype, device=k.device)
            dvl = torch.zeros_like(dkl)
            for a in range(r0, P + L, block):
                b = min(a + block, P + L)                                         # rows a..b-1 see keys 0..b-1
                n = b - a
                qb = qg[:, :, a - r0:b - r0].reshape(K, G * n, E)                 # (K, G*n, E)
                dob = dog[:, :, a - r0:b - r0].reshape(K, G * n, E)
                bias = torch.zeros(n, b, dtype=q.dtype, device=q.device)          # causal mask as -inf bias
                bias[:, a:] = torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
                s = torch.baddbmm(bias.repeat(G, 1), qb, k0[:, :b].transpose(1, 2), alpha=scale)  # (K, G*n, b)
                p = torch.softmax(s, dim=-1)                                      # P
                dvl[:, :b].baddbmm_(p.transpose(1, 2), dob)                       # dV = P^T dO
                dp = torch.bmm(dob, v0[:, :b].transpose(1, 2))                    # dP = dO V^T, (K, G*n, b)
                # softmax backward dS = P * (dP - rowsum(P * dP)), times the scores' 1/sqrt(E)
                ds = dp.sub_(torch.linalg.vecdot(p, dp).unsqueeze(-1)).mul_(p).mul_(scale)
                dqg[:, :, a - r0:b - r0] = torch.bmm(ds, k0[:, :b]).view(K, G, n, E)  # dQ = dS K
                dkl[:, :b].baddbmm_(ds.transpose(1, 2), qb)                       # dK = dS^T Q
            dq[lo:lo + R] = dqg.view(H, R, E).transpose(0, 1)
            for d, dl in ((dk, dkl), (dv, dvl)):                                  # back to packed rows
                dl = dl.transpose(0, 1)                                           # (P+L, K, E)
                d[:P] += dl[:P]
                d[start:start + L] += dl[P:]
            start += L
        return dq, dk, dv, None, None, None


# CPU SDPA (torch 2.13's flash kernel, bf16, head_dim 128) runs several times slower at lengths that
# are not a multiple of 32 (e.g. 361 tokens: 12 ms, padded to 384: 2.7 ms), so on the CPU a sequence
# is copied into a zero-padded head-major buffer of such a length (causal: no real query sees the
# padding); lengths that are already multiples are used as they are.
CPU_SDPA_PAD = 32


def seq_heads(t, P, start, L, n):
    """One sequence's rows of a packed (N, heads, E) tensor, as seq_rows, copied into a contiguous
    head-major (1, heads, n, E) buffer whose rows P+L..n-1 are zero."""
    buf = t.new_empty(1, t.shape[1], n, t.shape[2])
    buf[0, :, :P] = t[:P].transpose(0, 1)
    buf[0, :, P:P + L] = t[start:start + L].transpose(0, 1)
    buf[0, :, P + L:] = 0
    return buf


# ----------------------------------------------------------------------------- fused elementwise path
# Plain-torch forms of the elementwise pieces. With compile=True each is torch.compile'd (dynamic
# shapes, so one compilation serves every packed length) into one fused loop for the forward and one
# for the backward. Eager PyTorch runs each op as its own pass over memory: on a 2-core CPU about a
# quarter of scoring time and a third of a training step (profiles, bf16; docs/PERF.md).

def norm_rope(x, weight, eps, cos, sin_signed):
    """Per-head q/k RMSNorm followed by RoPE, as one function. x (N, heads, E); cos, sin (N, 1, E)."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin_signed)


def add_rms_norm(x, h, weight, eps):
    """The residual add and the post-attention norm: returns (x + h, rms_norm(x + h)). (N, C) each."""
    x = x + h
    return x, rms_norm(x, weight, eps)


def swiglu(g, u):
    """SwiGLU's elementwise part, silu(gate) * up. (N, F)."""
    return F.silu(g) * u


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
    return apply_rope(rms_norm_eager(x, weight, eps), cos, sin_signed)


def add_rms_norm_eager(x, h, weight, eps):
    """add_rms_norm; at inference the sum reuses h's memory (h is a fresh attention output)."""
    x = x + h if torch.is_grad_enabled() else h.add_(x)
    return x, rms_norm_eager(x, weight, eps)


def swiglu_eager(g, u):
    """swiglu; at inference in place in g."""
    return F.silu(g) * u if torch.is_grad_enabled() else F.silu(g, inplace=True).mul_(u)


def residual_add(x, y):
    """x + y; at inference in place in x."""
    return x + y if torch.is_grad_enabled() else x.add_(y)


def attention_packed(q, k, v, lens, P):
    """Packed causal attention: in training on HAND_BACKWARD devices with the hand backward, else
    SDPA (autograd takes its own backward)."""
    if torch.is_grad_enabled() and q.requires_grad and q.device.type in HAND_BACKWARD:
        return PackedCausalAttention.apply(q, k, v, lens, P)
    return packed_causal_sdpa(q, k, v, lens, P)


@dataclass(frozen=True)
class Kernels:
    """The decoder's non-matmul work, one function each, chosen once for the whole model."""
    rms_norm: object        # (x, weight, eps) -> norm(x)
    norm_rope: object       # (x, weight, eps, cos, sin_signed) -> RoPE(norm(x)), per head
    add_rms_norm: object    # (x, h, weight, eps) -> (x + h, norm(x + h))
    swiglu: object          # (gate, up) -> silu(gate) * up
    add: object             # (x, y) -> x + y
    attention: object       # (q, k, v, lens, P) -> packed causal attention output


EAGER = Kernels(rms_norm_eager, norm_rope_eager, add_rms_norm_eager, swiglu_eager, residual_add, attention_packed)
# torch.compile'd on first use (`fused`): the plain functions as one loop each; attention as EAGER
COMPILED = Kernels(lambda *a: fused(rms_norm)(*a), lambda *a: fused(norm_rope)(*a),
                   lambda *a: fused(add_rms_norm)(*a), lambda *a: fused(swiglu)(*a), operator.add, attention_packed)
