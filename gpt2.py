"""GPT-2 by hand, for the PPL-Filter baseline (paper B.2.2): perplexity with a sliding window.

A sibling file because PPL-Filter is a baseline with its own language model, not part of GEO
Defender. Loads openai-community/gpt2 (or any GPT-2 folder) from safetensors; `make_tiny_gpt2`
writes a tiny random-weight GPT-2 for offline runs (its perplexities mean nothing).
PPL(x) = exp(-1/(L-1) * sum_{l=2..L} log p(x_l | x_<l)); documents longer than the 1024-token
context are scored with a sliding window of stride 512: every token is predicted once, with up
to 1024 - 512 tokens of left context carried over (the transformers perplexity recipe).

Shapes: T tokens, C hidden, H heads, E head dim.
Usage: lm = GPT2.from_pretrained("openai-community/gpt2"); lm.perplexity("some text")
"""
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H, eps):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=eps), nn.LayerNorm(C, eps=eps)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)   # HF Conv1D weights are (in, out): transposed at load
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
        model = cls(cfg, Tokenizer.from_file(os.path.join(folder, "tokenizer.json")))
        state = {}
        rename = {".attn.c_attn.": ".c_attn.", ".attn.c_proj.": ".c_proj.", ".mlp.c_fc.": ".c_fc.", ".mlp.c_proj.": ".mlp_proj."}
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
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: GPT-2 weights do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
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
            self._text_tok, self._text_src = Tokenizer.from_str(json.dumps(spec)), self.tokenizer
        ids = self._text_tok.encode(text, add_special_tokens=False).ids
        if self._control.intersection(ids):
            raise ValueError(f"text encoded to a control token id {sorted(self._control.intersection(ids))}")
        return ids

    @torch.inference_mode()
    def perplexity(self, text, stride=512):
        ids = self.encode(text)
        if len(ids) < 2:
            return float("nan")
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
            folder = snapshot_download(name_or_path, allow_patterns=["config.json", "model.safetensors", "tokenizer.json"])
        except Exception as e:
            raise FileNotFoundError(f"{name_or_path}: not a folder and not downloadable ({type(e).__name__}); "
                                    "use --ppl-model tiny offline") from None
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.isfile(os.path.join(folder, f)):
            raise FileNotFoundError(f"{os.path.join(folder, f)}: missing")
    return folder


def make_tiny_gpt2(out_dir, seed=0):
    """A tiny GPT-2 with RANDOM weights (config.json, model.safetensors, tokenizer.json) for offline runs."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if all(os.path.isfile(os.path.join(out_dir, f)) for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ("the of and to in a is that for it as was with be by on not this are or from at which have an they "
              "you were there one all we their has been if more when will would who so what about up out them some") * 4
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = {"model_type": "gpt2", "vocab_size": tok.get_vocab_size(), "n_embd": 32, "n_layer": 2, "n_head": 2,
           "n_positions": 256, "layer_norm_epsilon": 1e-5, "_note": "tiny random-weight GPT-2, offline plumbing"}
    g = torch.Generator().manual_seed(seed)
    m = GPT2(cfg)
    state = {}
    for k, v in m.state_dict().items():
        t = 0.02 * torch.randn(v.shape, generator=g) if k.endswith("weight") and v.dim() == 2 else \
            (torch.ones(v.shape) if ".ln" in k or k.startswith("ln_f") and k.endswith("weight") else torch.zeros(v.shape))
        for a, b in ((".c_attn.", ".attn.c_attn."), (".c_proj.", ".attn.c_proj."), (".c_fc.", ".mlp.c_fc."),
                     (".mlp_proj.", ".mlp.c_proj.")):
            if a in k:
                k = k.replace(a, b)
                t = t.t() if k.endswith(".weight") else t            # store as HF Conv1D (in, out)
        state[k] = t.contiguous()
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return out_dir
