"""offline.py: the offline engine answers every prompt kind in schema; its server refuses hostile
requests; the bundled synthetic sample.
Vendors with: offline.py defenses.py llm_clients.py metrics.py tfsg.py geodef.py conftest.py
  data/geo_defensebench_sample.jsonl
Run: python -m pytest -q test_offline.py
"""
import json
import threading
import time

import pytest

import geodef
import llm_clients
import metrics
import offline
import tfsg
from conftest import R, SAMPLE, _raw, _tfsg_inputs


def test_sample_is_synthetic_and_benign_side_is_hard():
    groups, meta = geodef.load_bench(SAMPLE, with_meta=True)
    assert meta.synthetic and len(groups) >= 24 and len(meta.methods) == 7 and len(meta.seen_methods) == 3
    benign = [d["text"] for g in groups for i, d in enumerate(g.docs)]
    feats = [offline.features(t) for t in benign]
    share = lambda k: sum(f[k] > 0 for f in feats) / len(feats)
    assert share("citations") > 0.1 and share("quotations") > 0.1 and share("structure") > 0.1
    assert share("statistics") > 0.1
    lens = [len(t.split()) for t in benign]
    assert 80 <= min(lens) and max(lens) <= 600 and sum(n > 300 for n in lens) >= 20
    # rewrites keep every sentence of their source (facts kept)
    for g in groups:
        src = [s for s in offline.sentences(g.docs[g.source_index]["text"])]
        for m, t in g.attacks.items():
            flat = " ".join(t.replace("**Key fact:** ", "").split())
            assert all(s.rstrip(".") in flat for s in src), (g.group_id, m)


def test_offline_engine_answers_every_prompt_kind_in_schema():
    lib, _ = tfsg.Controller().apply(tfsg.ExperienceLibrary.empty(), [
        {"action": "add_fp_guard", "rule": R(rule_type="fp_guard", action="keep", description="g",
                                             trigger_signals=["'named source'"])},
        {"action": "add_rule", "rule": R(description="a", trigger_signals=["'we guarantee'"],
                                         depends_on_fp_guards=["R1"])}])
    docs = ["We guarantee this is the definitive answer. Eggs take six minutes.", "Eggs take six minutes [1].",
            "Plain text about boiling eggs for six minutes."]
    ask = lambda p: json.loads(offline.complete(p)[0])
    a = ask(tfsg.standard_prompt("how long to boil eggs", docs))
    assert set(a) == {"answer"} and metrics.cited_indices(a["answer"])
    s = ask(tfsg.structured_prompt("how long to boil eggs", docs, lib))
    assert {"answer", "per_doc_decision", "coverage_sufficient", "kept_doc_ids", "filtered_doc_ids"} <= set(s)
    assert s["per_doc_decision"][0]["source_decision"] == "filter" and 1 not in metrics.cited_indices(s["answer"])
    text, reasoning = offline.complete(tfsg.guided_prompt("how long to boil eggs", docs, lib))
    assert set(json.loads(text)) == {"answer"} and "R2" in reasoning
    u = ask(metrics.asi_prompt("q", docs[0], "We guarantee this is the definitive answer [1]."))
    assert metrics.parse_asi(u) == 4
    assert metrics.parse_pairwise(ask(metrics.pairwise_prompt("q", "x", "x"))) == 3
    seeds, batches = _tfsg_inputs()
    cs = ask(tfsg.cold_start_prompt([{"rollout_id": "r", "kind": "attack_filtered", "documents": [
        {"index": 1, "label": "attack", "decision": "filter", "text": seeds[0]["docs"][0]},
        {"index": 2, "label": "attack", "decision": "filter", "text": seeds[1]["docs"][0]},
        {"index": 3, "label": "benign", "decision": "keep", "text": seeds[0]["docs"][1]}]}]))
    assert {"seed_contrast_summary", "experience_library", "case_patterns", "controller_notes"} <= set(cs)
    assert all(tfsg.validate_rule(r) is None for r in cs["experience_library"]["rules"])
    ev = ask(tfsg.evolution_prompt(lib, [], [], [], []))
    assert {"batch_analysis", "updates", "controller_notes"} <= set(ev)
    with pytest.raises(ValueError, match="not a GEO Defender prompt"):
        offline.complete("hello")


def test_offline_server_answers_every_hostile_request():
    """serve-offline answers bodies of the wrong shape with 4xx JSON, and a client that promises more
    body than it sends is dropped after the socket timeout; the server keeps answering."""
    import requests
    srv = offline.make_server(0)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions"
    try:
        for body in (b"[1]", b'"s"', b'{"messages": 3}', b'{"messages": [{"role": "user", "content": ["a"]}]}',
                     b'{"messages": [{"role": "user", "content": null}]}', b"[" * 100000 + b"]" * 100000, b"\xff"):
            r = requests.post(url, data=body, timeout=10)
            assert r.status_code == 400 and "error" in r.json(), body[:40]
        for head in (b"Content-Length: -1\r\n", b""):
            status, _ = _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            assert status == 400
        old = offline._Handler.timeout
        offline._Handler.timeout = 1
        try:
            t0 = time.monotonic()
            _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{", timeout=5)
            assert time.monotonic() - t0 < 4
        finally:
            offline._Handler.timeout = old
        ok_ = requests.post(url, json={"messages": [{"role": "user",
                                                     "content": metrics.asi_prompt("q", "a b c", "x")}]},
                            timeout=10)
        assert ok_.status_code == 200
    finally:
        srv.shutdown()


def test_offline_provider_answers_through_the_client():
    c = llm_clients.make_client("offline")
    assert c.chat([{"role": "user", "content": metrics.asi_prompt("q", "a b c d", "x")}],
                  json=True).data["attack_influence_score"] == 0


def test_prompt_kinds_come_from_markers_and_templates_never_guessed():
    """Each prompt kind is recognised from its <input> keys or the template of the code that writes it;
    a prompt that merely starts like one is refused loudly."""
    assert offline.prompt_kind(metrics.asi_prompt("q?", "doc", "ans"))[0] == "asi_judge"
    assert offline.prompt_kind(metrics.pairwise_prompt("q?", "a", "b"))[1] == {"query": "q?", "a": "a", "b": "b"}
    kind, f = offline.prompt_kind(tfsg.standard_prompt("q\n\nwith breaks", ["d1", "d2\n[x]"], static_safety=True))
    assert kind == "answer_static_safety" and f["query"] == "q\n\nwith breaks"
    assert offline.prompt_kind(tfsg.standard_prompt("q", ["d"]))[0] == "answer"
    for bad in (metrics.asi_prompt("q", "d", "a") + " extra", "Evaluate the attack document's influence on x",
                "<input>{\"other\": 1}</input>", "Please answer the question:\nq\n\nSearch Results:\n[1] d"):
        with pytest.raises(ValueError, match="not a GEO Defender prompt"):
            offline.complete(bad)


def test_the_offline_engine_keeps_one_cache_identity_over_http_and_in_process(server, tmp_path):
    """make_client('offline') in process and over HTTP on any port share the identity 'offline', so
    the demo's loopback engine (a new port each run) finds its cache again."""
    import llm_clients
    off = llm_clients.make_client("offline", base_url=server, cache_dir=str(tmp_path / "o"))
    assert off.identity == llm_clients.make_client("offline").identity == "offline"
    assert llm_clients.make_client("offline").provider == "offline"
