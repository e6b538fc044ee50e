"""GPT-2 by hand, for the PPL-Filter baseline (paper B.2.2): perplexity with a sliding window.

Loads openai-community/gpt2 (or any GPT-2 folder) from safetensors (tiny.py writes a random-weight
one for offline runs).
PPL(x) = exp(-1/(L-1) * sum_{l=2..L} log p(x_l | x_<l)); documents longer than the 1024-token
context are scored with a sliding window of stride 512: every token is predicted once, with up
to 1024 - 512 tokens of left context carried over (the transformers perplexity recipe).

Shapes: T tokens, C hidden, H heads, E head dim.
Usage: lm = GPT2.from_pretrained("openai-community/gpt2"); lm.perplexity("some text")
"""
import json
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H, eps):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=eps), nn.LayerNorm(C, eps=eps)
        # HF Conv1D weights are (in, out): transposed at load
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):                                                  # x (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, E)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))  # gelu_new


class GPT2(nn.Module):
    def __init__(self, cfg, tokenizer=None):
        super().__init__()
        C, self.n_ctx = cfg["n_embd"], cfg.get("n_positions", 1024)
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        self.wte, self.wpe = nn.Embedding(cfg["vocab_size"], C), nn.Embedding(self.n_ctx, C)
        self.h = nn.ModuleList(Block(C, cfg["n_head"], eps) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(C, eps=eps)
        self.tokenizer = tokenizer

    def forward(self, ids):                                               # ids (B, T) -> logits (B, T, V)
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()                          # tied LM head

    @classmethod
    def from_pretrained(cls, name_or_path, dtype=torch.float32):
        from safetensors import safe_open
        from tokenizers import Tokenizer
        folder = resolve(name_or_path)
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        for k in ("vocab_size", "n_embd", "n_head", "n_layer") + ("n_positions",) * ("n_positions" in cfg):
            if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int) or cfg[k] < 1:
                raise ValueError(f"{folder}/config.json: {k}: expected a positive integer, got {cfg.get(k)!r}")
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            held = {int(m.group(1)) for k in f.keys() for m in [re.match(r"(?:transformer\.)?h\.(\d{1,9})\.", k)] if m}
        if held != set(range(cfg["n_layer"])):      # checked before the layers are made
            raise ValueError(f"{folder}/config.json: n_layer {cfg['n_layer']}, the weights hold {len(held)} layers")
        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        tok.no_truncation()                 # a saved truncation or padding would cut or pad every text
        tok.no_padding()
        with torch.device("meta"):          # the weights are assigned from the file: nothing allocated first
            model = cls(cfg, tok)
        state = {}
        rename = {".attn.c_attn.": ".c_attn.", ".attn.c_proj.": ".c_proj.", ".mlp.c_fc.": ".c_fc.",
                  ".mlp.c_proj.": ".mlp_proj."}
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            for key in f.keys():
                k = key[len("transformer."):] if key.startswith("transformer.") else key
                if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
                    continue                                          # causal-mask buffers; tied head
                t = f.get_tensor(key)
                for a, b in rename.items():
                    if a in k:
                        k = k.replace(a, b)
                        if k.endswith(".weight"):
                            t = t.t()                                 # Conv1D (in, out) -> Linear (out, in)
                state[k] = t.to(dtype)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"{folder}: GPT-2 weights do not match: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}")
        return model.requires_grad_(False).eval()

    def encode(self, text):
        """Text -> ids as ordinary text: "<|endoftext|>" written in a document is six pieces of text,
        not GPT-2's end-of-text token (which would restart the context inside the document). The
        tokenizer's added tokens are dropped from a copy (`tokenizers` matches them before BPE)."""
        if getattr(self, "_text_src", None) is not self.tokenizer:   # built once per tokenizer
            from tokenizers import Tokenizer
            spec = json.loads(self.tokenizer.to_str())
            self._control = {t["id"] for t in spec.get("added_tokens") or []}
            spec["added_tokens"] = []
            spec["truncation"] = spec["padding"] = None
            self._text_tok, self._text_src = Tokenizer.from_str(json.dumps(spec)), self.tokenizer
        ids = self._text_tok.encode(text, add_special_tokens=False).ids
        if self._control.intersection(ids):
            raise ValueError(f"text encoded to a control token id {sorted(self._control.intersection(ids))}")
        return ids

    @torch.inference_mode()
    def perplexity(self, text, stride=512):
        """Sliding-window perplexity (transformers' recipe): windows of n_ctx tokens `stride` apart, each token
        scored once, with at least n_ctx - stride tokens of context past the first window. The stride is at
        most half the context, so that each such token has at least half a context before it (the tiny GPT-2's
        256 positions; real GPT-2's 1024 take the default 512 as it is)."""
        ids = self.encode(text)
        if len(ids) < 2:
            return float("nan")
        stride = min(stride, self.n_ctx // 2)
        nll, n, prev_end = 0.0, 0, 0
        for begin in range(0, len(ids), stride):
            end = min(begin + self.n_ctx, len(ids))
            window = torch.tensor([ids[begin:end]])
            logp = F.log_softmax(self(window)[0].float(), -1)            # (T, V)
            first = max(prev_end, begin + 1)                              # score each token once, never token 1
            for pos in range(first, end):
                nll -= float(logp[pos - begin - 1, ids[pos]])
                n += 1
            prev_end = end
            if end == len(ids):
                break
        return math.exp(nll / n)


def resolve(name_or_path):
    """A local folder as is, else a hub id via huggingface-hub (respects HF_HOME, HF_HUB_OFFLINE) ->
    the folder, checked to hold config.json, model.safetensors and tokenizer.json."""
    folder = name_or_path
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download
        try:
            folder = snapshot_download(name_or_path,
                                       allow_patterns=["config.json", "model.safetensors", "tokenizer.json"])
        except Exception as e:
            raise FileNotFoundError(f"{name_or_path}: not a folder and not downloadable ({type(e).__name__}); "
                                    "use --ppl-model tiny offline") from None
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.isfile(os.path.join(folder, f)):
            raise FileNotFoundError(f"{os.path.join(folder, f)}: missing")
    return folder
