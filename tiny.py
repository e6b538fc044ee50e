"""Tiny RANDOM-weight checkpoints the project writes itself, for offline runs and tests: a Qwen3
reranker (config.json, model.safetensors, tokenizer.json in the Hugging Face layout, with a small
byte-level BPE tokenizer trained here and Qwen3's control tokens) and a GPT-2 for the PPL-Filter.
Their scores and perplexities mean nothing: they exercise the real loading and scoring code where
the real weights cannot be downloaded.

Usage: folder = make_tiny_checkpoint("runs/_tiny_qwen3"); reranker.Reranker.from_pretrained(folder)
"""
import glob
import json
import os
import shutil

import torch

import reranker

# Training text for the tiny tokenizer: common English plus the prompt's own words, so that the
# byte-level BPE learns real merges. Deterministic; the tiny model's weights are random regardless.
TINY_CORPUS = """
the of and to in a is that for it as was with be by on not he this are or his from at which but have an they
you were her she there one all we their has been if more when will would who so no yes what about up out
them some could into only other then time these two may first than any its new like also people years year
over after most such made well many where through back much before good very should because each those
between under how both during while against without within along following across behind beyond percent
study research report data according survey results found university institute published journal review
experts analysis million billion average rate increase decrease health energy water climate city market
price cost system program school students children patients treatment risk use used using guide best
recommended official government national international century history science technology software
document query judge whether meets requirements based instruct provided note answer can only system user
assistant think relevant passages retrieve given web search identify reliable safe selected evidence
downstream generative answer generation source sources cited citation quote said according statistics
yes
no
Yes
No
""" * 3


# Qwen2/Qwen3's pre-tokenizer split pattern (tokenizer.json's Split regex)
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def tiny_tokenizer(vocab_size=2048):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = Regex(QWEN_SPLIT)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([TINY_CORPUS], trainer=trainer)
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False),
                    AddedToken("</think>", normalized=False, special=False)])
    return tok


def make_tiny_checkpoint(out_dir, seed=0, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, std=0.08):
    """Write a tiny Qwen3-architecture checkpoint with RANDOM weights (config.json, model.safetensors,
    tokenizer.json in the HF layout) and return its folder. Deterministic for a seed; an existing
    complete folder is reused. Plumbing for offline runs and tests: its scores mean nothing.
    std 0.08 (transformers initialises with 0.02): at 0.02 the ten candidates' margins differ by ~0.01,
    so any adapter reshuffles them; at 0.08 they spread by ~0.16 and a benign ordering exists to keep."""
    files = [os.path.join(out_dir, f) for f in ("config.json", "model.safetensors", "tokenizer.json")]
    if all(os.path.isfile(f) for f in files):
        return out_dir
    tok = tiny_tokenizer()
    cfg = reranker.Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=32768, torch_dtype="float32")
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):   # shapes only: no default init, so the global RNG is left untouched
        model = reranker.Qwen3Model(cfg)
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight"):   # near-one norms, so that the norm weights are exercised
            state["model." + k] = 1.0 + 0.1 * torch.randn(v.shape, generator=g)
        else:                           # N(0, std), see the docstring
            state["model." + k] = std * torch.randn(v.shape, generator=g)
    return written_whole(out_dir, state, tok, {**cfg.to_dict(), "bos_token_id": None, "eos_token_id": None,
                                               "_note": "tiny random-weight Qwen3 for offline plumbing; not a "
                                                        "trained model"})


def alive(pid):
    """Whether process `pid` runs (POSIX: signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                   # another user's: running
        pass
    return True


def left_by_the_dead(prefix):
    """Paths `prefix<pid>` (a temp file or folder of process pid) whose process is gone: what a kill left
    (POSIX; elsewhere none)."""
    return [p for p in glob.glob(glob.escape(prefix) + "*")
            if os.name == "posix" and (pid := p[len(prefix):]).isdigit() and not alive(int(pid))]


def written_whole(out_dir, state, tok, config):
    """out_dir holding model.safetensors (state), tokenizer.json (tok) and config.json, written in a folder
    beside it and moved in with the weights last: the folders are reused when all three are there, so a
    kill mid-write leaves a folder that is written again, never one with a file cut short."""
    from safetensors.torch import save_file
    for old in left_by_the_dead(out_dir + ".tmp"):               # a write a kill cut short
        shutil.rmtree(old, ignore_errors=True)
    tmp = out_dir + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})  # one key: safetensors writes metadata in hash order
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    os.makedirs(out_dir, exist_ok=True)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)
    return out_dir


def make_tiny_gpt2(out_dir, seed=0):
    """A tiny GPT-2 with RANDOM weights (config.json, model.safetensors, tokenizer.json) for offline runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if all(os.path.isfile(os.path.join(out_dir, f)) for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out_dir
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ("the of and to in a is that for it as was with be by on not this are or from at which have an "
              "they you were there one all we their has been if more when will would who so what about up out "
              "them some") * 4
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = {"model_type": "gpt2", "vocab_size": tok.get_vocab_size(), "n_embd": 32, "n_layer": 2, "n_head": 2,
           "n_positions": 256, "layer_norm_epsilon": 1e-5, "_note": "tiny random-weight GPT-2, offline plumbing"}
    g = torch.Generator().manual_seed(seed)
    import gpt2                  # only the PPL-Filter's checkpoint needs it: reranker's tests vendor without it
    m = gpt2.GPT2(cfg)
    state = {}
    for k, v in m.state_dict().items():
        if k.endswith("weight") and v.dim() == 2:                 # matrices: N(0, 0.02)
            t = 0.02 * torch.randn(v.shape, generator=g)
        elif k.endswith("weight") and (".ln" in k or k.startswith("ln_f")):   # layer-norm gains: 1
            t = torch.ones(v.shape)
        else:                                                       # biases: 0
            t = torch.zeros(v.shape)
        for a, b in ((".c_attn.", ".attn.c_attn."), (".c_proj.", ".attn.c_proj."), (".c_fc.", ".mlp.c_fc."),
                     (".mlp_proj.", ".mlp.c_proj.")):
            if a in k:
                k = k.replace(a, b)
                t = t.t() if k.endswith(".weight") else t            # store as HF Conv1D (in, out)
        state[k] = t.contiguous()
    return written_whole(out_dir, state, tok, cfg)
