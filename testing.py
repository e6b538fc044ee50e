"""Helpers and fakes for the tests: the bundled sample's path, a Qwen3 checkpoint written by
transformers, the scripted loopback LLM server (Script), LoRA set up for training, the transformers
reference margins, bench rows and library rules, an LLM client for a test server, raw HTTP to a server.
conftest.py holds the fixtures and imports what they need from here. This file imports nothing of the
project nor torch at its top (each helper imports what it needs), so that a building block's test file
runs with only that block, this file (and conftest.py if it takes a fixture) and what its docstring's
"Vendors with:" line names (test_vendoring.py checks it).
Use: from testing import SAMPLE, good_group
"""
import json
import os
import random
import shutil
import time
from http.server import BaseHTTPRequestHandler

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SAMPLE = os.path.join(HERE, "data", "geo_defensebench_sample.jsonl")
# Qwen2/Qwen3's pre-tokenizer split pattern (tokenizer.json's Split regex)
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# a string condition: evaluated when a CUDA test is collected, so this file imports no torch itself
CUDA = pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                          reason="needs CUDA (this CPU machine has none)")

# the API key the shield_server fixture (conftest.py) requires
AUTH = {"Authorization": "Bearer s3cret-key"}


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


class Script(BaseHTTPRequestHandler):
    """Loopback LLM server for tests: pops scripted (status, headers, body, delay) per request;
    with an empty script it delegates to the offline engine. Records every request body and header.
    The script and the records are class attributes: conftest.py's `server` fixture clears them."""
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
        send_json(self, payload, status, headers)

    def log_message(self, *a):
        pass


def send_json(handler, payload, status=200, headers=None):
    """A loopback handler's whole reply: `payload` as JSON (a str as it is) with its length and `headers`; a
    client that hung up is no error."""
    data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
    try:
        handler.send_response(status)
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


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
