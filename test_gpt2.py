"""gpt2.py: parity with transformers' GPT-2; <|endoftext|> in a document stays text.
Vendors with: gpt2.py tiny.py reranker.py
Run: python -m pytest -q test_gpt2.py
"""
import json
import math
import os
import shutil

import pytest
import torch

import gpt2
import tiny


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """The tiny GPT-2 folder (tiny.py), written once for the module: tests load it and change only what
    they loaded."""
    return tiny.make_tiny_gpt2(str(tmp_path_factory.mktemp("gpt2") / "tiny"))


def test_gpt2_document_text_never_becomes_end_of_text(tiny_gpt2):
    """A document holding "<|endoftext|>" is scored as that text: the token would restart GPT-2's
    context inside the document and change its perplexity."""
    from tokenizers import AddedToken
    lm = gpt2.GPT2.from_pretrained(tiny_gpt2)
    plain = lm.encode("a <|endoftext|> b")
    eot = lm.tokenizer.get_vocab_size()
    lm.tokenizer.add_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])   # as GPT-2's own
    assert eot in lm.tokenizer.encode("a <|endoftext|> b").ids                                # the threat
    assert lm.encode("a <|endoftext|> b") == plain and eot not in plain
    assert lm.tokenizer.decode(plain) == "a <|endoftext|> b"
    assert math.isfinite(lm.perplexity("eggs <|endoftext|> boil for six minutes <|endoftext|>"))


def test_gpt2_parity_with_transformers(tmp_path, tiny_gpt2):
    """Logits equal transformers' GPT-2 on the same saved weights; the sliding-window perplexity equals
    the token-by-token definition. The text is 103 tokens, three windows of the 64-token context at
    stride 32 (a first, a middle and a last, shorter one): each window kind and both carry-overs once,
    at one forward per token for the definition."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_gpt2
    cfg = json.load(open(os.path.join(folder, "config.json")))
    torch.manual_seed(0)
    hm = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=cfg["vocab_size"], n_embd=48, n_layer=2,
                                                              n_head=4, n_positions=64)).eval()
    hm.save_pretrained(tmp_path / "hf", safe_serialization=True)
    shutil.copy(os.path.join(folder, "tokenizer.json"), tmp_path / "hf")
    ours = gpt2.GPT2.from_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, cfg["vocab_size"], (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hm(ids).logits, rtol=1e-4, atol=1e-4)
    # sliding window: perplexity of a text longer than the context equals the token-by-token definition
    text = "the of and to in a is that for it as was with be by on not " * 6
    tok = ours.tokenizer.encode(text).ids
    assert 96 < len(tok) < 128                               # windows at 0, 32 and 64, the last one cut
    nll = 0.0
    for pos in range(1, len(tok)):
        lo = 0 if pos < 64 else ((pos - 64) // 32 + 1) * 32
        with torch.no_grad():
            lp = torch.log_softmax(ours(torch.tensor([tok[lo:pos + 1]]))[0, -2], -1)
        nll -= float(lp[tok[pos]])
    want = math.exp(nll / (len(tok) - 1))
    assert abs(ours.perplexity(text, stride=32) - want) < 1e-3 * want
    # the default stride (512) past this model's context: at most half the context, no token left unscored
    assert ours.perplexity(text) == ours.perplexity(text, stride=32)


def test_a_tiny_checkpoint_cut_short_by_a_kill_is_written_again(tmp_path, monkeypatch):
    """The tiny checkpoints are reused when their files are there: a kill while one was written left every
    file there, one of them cut short, and each later run crashed on it. Written beside and moved in whole,
    the folder a kill leaves is written again, and the aside folder it left is removed once its process is gone;
    the layer norms start as transformers' do (gains 1, biases 0)."""
    def killed(*a, **k):
        raise KeyboardInterrupt
    for make, name in ((tiny.make_tiny_gpt2, "gpt2"), (tiny.make_tiny_checkpoint, "qwen3")):
        out = str(tmp_path / name)
        with monkeypatch.context() as m:
            m.setattr(json, "dump", killed)
            with pytest.raises(KeyboardInterrupt):
                make(out)
        make(out)
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            assert json.load(f)["_note"]
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()                                               # a pid whose process has ended
    left = tmp_path / f"q.tmp{gone.pid}"                      # what a kill mid-write left, under another pid
    left.mkdir()
    tiny.make_tiny_checkpoint(str(tmp_path / "q"))
    assert not left.exists() and (tmp_path / "q" / "model.safetensors").exists()
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "gpt2" / "model.safetensors"))
    norms = {k: v for k, v in state.items() if ".ln" in k or "ln_f" in k}
    assert all(bool((v == (1 if k.endswith("weight") else 0)).all()) for k, v in norms.items()) and len(norms) == 10


def test_a_gpt2_folder_is_read_as_it_says_or_refused_before_it_costs(tmp_path, tiny_gpt2):
    """The PPL filter's GPT-2 folder is read as reranker.py reads a Qwen3 one: a tokenizer.json saved with
    truncation cuts no text (the perplexity is the whole text's), and a config asking for more layers than the
    weights hold is refused before any is made (they were allocated and initialised first)."""
    text = "eggs boil for six minutes, then cool in cold water before you peel them " * 3
    want = gpt2.GPT2.from_pretrained(tiny_gpt2).perplexity(text)
    cut = tmp_path / "cut"
    shutil.copytree(tiny_gpt2, cut)
    spec = json.loads((cut / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0}
    (cut / "tokenizer.json").write_text(json.dumps(spec))
    assert gpt2.GPT2.from_pretrained(str(cut)).perplexity(text) == pytest.approx(want)
    cfg = json.loads((cut / "config.json").read_text())
    (cut / "config.json").write_text(json.dumps({**cfg, "n_layer": 10 ** 6}))
    with pytest.raises(ValueError, match="n_layer 1000000, the weights hold"):
        gpt2.GPT2.from_pretrained(str(cut))
