"""offline.py: the offline engine answers every prompt kind in schema, in process and through the
client; the bundled synthetic sample.
Vendors with: offline.py defenses.py llm_clients.py endpoints.py accounting.py metrics.py tfsg.py geodef.py
  conftest.py data/geo_defensebench_sample.jsonl
Run: python -m pytest -q test_offline.py
"""
import json

import pytest

import geodef
import llm_clients
import metrics
import offline
import tfsg
from conftest import R, SAMPLE, _tfsg_inputs


def test_the_sample_is_synthetic():
    groups, meta = geodef.load_bench(SAMPLE, with_meta=True)
    assert meta.synthetic and len(groups) >= 24 and len(meta.methods) == 7 and len(meta.seen_methods) == 3


def test_the_samples_benign_side_is_hard():
    groups = geodef.load_bench(SAMPLE)
    benign = [d["text"] for g in groups for i, d in enumerate(g.docs)]
    feats = [offline.features(t) for t in benign]
    share = lambda k: sum(f[k] > 0 for f in feats) / len(feats)
    assert share("citations") > 0.1 and share("quotations") > 0.1 and share("structure") > 0.1
    assert share("statistics") > 0.1
    lens = [len(t.split()) for t in benign]
    assert 80 <= min(lens) and max(lens) <= 600 and sum(n > 300 for n in lens) >= 20


def test_the_samples_rewrites_keep_every_sentence_of_their_source():
    """Rewrites keep every sentence of their source (facts kept)."""
    for g in geodef.load_bench(SAMPLE):
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


def test_offline_provider_answers_through_the_client():
    c = llm_clients.make_client("offline", handler=offline.respond)
    assert c.chat([{"role": "user", "content": metrics.asi_prompt("q", "a b c d", "x")}],
                  json=True).data["attack_influence_score"] == 0


def test_prompt_kinds_come_from_input_keys_or_templates():
    """Each prompt kind is recognised from its <input> keys or the template of the code that writes it."""
    assert offline.prompt_kind(metrics.asi_prompt("q?", "doc", "ans"))[0] == "asi_judge"
    assert offline.prompt_kind(metrics.pairwise_prompt("q?", "a", "b"))[1] == {"query": "q?", "a": "a", "b": "b"}
    kind, f = offline.prompt_kind(tfsg.standard_prompt("q\n\nwith breaks", ["d1", "d2\n[x]"], static_safety=True))
    assert kind == "answer_static_safety" and f["query"] == "q\n\nwith breaks"
    assert offline.prompt_kind(tfsg.standard_prompt("q", ["d"]))[0] == "answer"


def test_a_prompt_that_merely_starts_like_one_is_refused():
    """A prompt that merely starts like one is refused loudly, never guessed."""
    for bad in (metrics.asi_prompt("q", "d", "a") + " extra", "Evaluate the attack document's influence on x",
                "<input>{\"other\": 1}</input>", "Please answer the question:\nq\n\nSearch Results:\n[1] d"):
        with pytest.raises(ValueError, match="not a GEO Defender prompt"):
            offline.complete(bad)


def test_the_offline_engine_keeps_one_cache_identity_on_every_transport(server, tmp_path):
    """make_client('offline') in process and over HTTP on any port share the identity 'offline', so
    the demo's loopback engine (a new port each run) finds its cache again."""
    off = llm_clients.make_client("offline", base_url=server, cache_dir=str(tmp_path / "o"))
    in_process = llm_clients.make_client("offline", handler=offline.respond)
    assert off.identity == in_process.identity == "offline" and in_process.provider == "offline"
