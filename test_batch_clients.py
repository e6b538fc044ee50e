"""batch_clients.py over real HTTP: the offline engine's loopback server answering OpenAI's Files +
Batches and Anthropic's Message Batches. Equal to synchronous calls, batches in progress, expired
half done, failed lines, a kill while polling, results out of order, refusals, size limits, and
`eval --batch-api` on the demo run giving the synchronous records at the batch price.
Needs: batch_clients.py, llm_clients.py, offline.py (and metrics.py, tfsg.py it imports); the eval
test also the jobs and the demo run (conftest.py).
Run: python -m pytest -q test_batch_clients.py
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

import batch_clients
import llm_clients
import offline
import tfsg
from conftest import HERE


@pytest.fixture()
def engine():
    srv = offline.make_server(0)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def requests_(n, tag="q"):
    return [{"messages": [{"role": "user", "content": tfsg.standard_prompt(f"{tag} {i} boil eggs",
                                                                           [f"eggs boil {i} minutes", "stocks"])}]}
            for i in range(n)]


def batched(url, tmp_path, protocol="openai", **kw):
    c = llm_clients.Client(url, "m", protocol=protocol, cache_dir=str(tmp_path / "cache"))
    c.batch = batch_clients.BatchRunner(c, str(tmp_path / "batches.json"), poll=0.01, log=lambda m: None, **kw)
    return c


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_batches_equal_synchronous_calls_and_reruns_send_nothing(engine, tmp_path, protocol):
    """Results matched on custom_id (Anthropic's come back reversed), in progress for several polls,
    replies cached as chat() caches them; a rerun sends no request."""
    srv, url = engine
    srv.batches.polls = 4
    reqs = requests_(6)
    c = batched(url, tmp_path, protocol)
    got = c.map(reqs, progress=False)
    want = llm_clients.Client(url, "m").map(reqs, progress=False)      # the engine speaks OpenAI synchronously
    assert [r.text for r in got] == [r.text for r in want] and c.batch.stats["batches"] == 1
    assert srv.batches.batches["batch-1"]["polls"] >= 4
    again = batched(url, tmp_path, protocol)
    assert [r.text for r in again.map(reqs, progress=False)] == [r.text for r in want]
    assert again.stats["http_calls"] == 0 and srv.batches.created == 1


def test_expired_half_done_and_failed_lines_resubmit_exactly_what_is_missing(engine, tmp_path):
    srv, url = engine
    srv.batches.expire_after, srv.batches.fail_first = 4, 1
    c = batched(url, tmp_path)
    got = c.map(requests_(8), progress=False)
    b1, b2 = srv.batches.batches["batch-1"], srv.batches.batches["batch-2"]
    assert len(b1["lines"]) == 8 and len(b2["lines"]) == 4 + 1      # 4 expired + 1 failed (500), nothing else
    assert c.batch.stats["retried"] == 5 and all(r.text for r in got)
    manifest = json.load(open(tmp_path / "batches.json"))
    assert [b["status"] for b in manifest["batches"]] == ["expired", "completed"]


def test_size_limits_split_a_stage_into_several_batches(engine, tmp_path):
    srv, url = engine
    c = batched(url, tmp_path, limits=(2, 1 << 20))
    c.map(requests_(5), progress=False)
    assert srv.batches.created == 3 and [len(b["lines"]) for b in srv.batches.batches.values()] == [2, 2, 1]
    big = batched(url, tmp_path / "b", limits=(100, 3000))          # bytes: each line is ~1.2 KB
    big.map(requests_(5, "other"), progress=False)
    assert srv.batches.created == 3 + 3


def test_refused_batches_fail_or_fall_back_as_asked(engine, tmp_path):
    srv, url = engine
    srv.batches.reject = True
    with pytest.raises(batch_clients.BatchUnsupported, match="refused at creation"):
        batched(url, tmp_path).map(requests_(2), progress=False)
    srv.batches.reject, srv.batches.missing = False, True
    with pytest.raises(batch_clients.BatchUnsupported, match="no batch endpoint"):
        batched(url, tmp_path / "x").map(requests_(2), progress=False)
    auto = batched(url, tmp_path / "y", auto=True)
    assert all(r.text for r in auto.map(requests_(2), progress=False)) and auto.stats["http_calls"] == 2 + 1


def test_a_kill_while_polling_resumes_the_same_batch(engine, tmp_path):
    """SIGKILL while the batch is in progress; the rerun collects the recorded batch instead of
    submitting the requests again."""
    srv, url = engine
    srv.batches.polls = 10 ** 6
    code = ("import sys, json, llm_clients, batch_clients, test_batch_clients as t\n"
            "c = llm_clients.Client(sys.argv[1], 'm', cache_dir=sys.argv[2] + '/cache')\n"
            "c.batch = batch_clients.BatchRunner(c, sys.argv[2] + '/batches.json', poll=0.01, log=print)\n"
            "c.map(t.requests_(4), progress=False)\n")
    p = subprocess.Popen([sys.executable, "-c", code, url, str(tmp_path)], cwd=HERE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = tmp_path / "batches.json"
        if m.exists() and json.load(open(m))["batches"] and json.load(open(m))["batches"][0]["id"]:
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    srv.batches.polls = 0
    c = batched(url, tmp_path)
    out = c.map(requests_(4), progress=False)
    assert srv.batches.created == 1 and all(r.text for r in out) and c.batch.stats["batches"] == 0


def test_eval_batch_api_gives_the_synchronous_records_at_half_price(demo_run, tmp_path):
    """The demo run's evaluation again through the batch API: identical records and figures, the
    ledger's rows marked [batch], and the price halved."""
    import run
    shutil.copytree(demo_run.parent, tmp_path / "o")
    d = tmp_path / "o" / "demo"
    want = {f: open(d / "results" / f).read() for f in os.listdir(d / "results")
            if f.endswith(".jsonl") and not f.startswith("rerank-")}          # eval's records
    shutil.rmtree(d / "results")
    shutil.rmtree(d / "cache" / "llm")
    os.remove(d / "usage.jsonl")
    prices = tmp_path / "p.json"
    prices.write_text(json.dumps({"offline-engine": [1.0, 2.0]}))
    t0 = time.monotonic()
    run.main(["eval", "--runs-dir", str(tmp_path / "o"), "--name", "demo", "--batch-api", "on",
                  "--batch-poll", "0.1", "--prices", str(prices)])
    wall = time.monotonic() - t0
    got = {f: open(d / "results" / f).read() for f in os.listdir(d / "results") if f.endswith(".jsonl")}
    assert len(got) >= 8 and all(got[f] == want[f] for f in got)      # every condition, the clean reference
    manifest = json.load(open(d / "batches.json"))["batches"]
    stages = json.load(open(d / "summary.json"))["usage"]["stages"]["eval"]
    assert set(stages) == {"offline:offline-engine [batch]"} and len(manifest) >= 1
    row = stages["offline:offline-engine [batch]"]
    assert row["cost_usd"] == pytest.approx(0.5 * (row["prompt_tokens"] * 1 + row["completion_tokens"] * 2) / 1e6)
    print(f"batches {len(manifest)}, lines {sum(len(b['custom_ids']) for b in manifest)}, wall {wall:.1f} s")
