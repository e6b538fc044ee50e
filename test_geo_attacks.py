"""The seven GEO attack families (geo_attacks.py): each family's inputs and steps as its paper
publishes them, the published archive and rule formats, MAGEO's engine signal, GEO-SFE's gaps and
rollback, IF-GEO's request filter, the one gate every rewrite passes, opaque prompts and the surface
marker report. The offline engine (offline.py) plays the builder LLM in process.
Vendors with: geo_attacks.py, geo_jobs.py, geodef.py, llm_clients.py, transport.py, endpoints.py, accounting.py,
  offline.py, offline_target.py, offline_attackers.py, defenses.py, metrics.py, tfsg.py.
Run: python -m pytest -q test_geo_attacks.py
"""
import json
import math
import re

import pytest

import geo_attacks
import geo_jobs
import llm_clients
import offline

SOURCE = ("Canberra became the capital of Australia in 1913. It was chosen as a compromise between Sydney and "
          "Melbourne. The city was designed by Walter Burley Griffin and Marion Mahony Griffin, whose plan won "
          "an international competition. About 460,000 people live there today.\n\nParliament moved from "
          "Melbourne to Canberra in 1927, when the provisional Parliament House opened. The current building "
          "opened in 1988.")
QUERY = "why is canberra the capital of australia"


class Recorder:
    """The offline engine in process, recording every prompt it is sent (the builder LLM)."""

    def __init__(self):
        self.client = llm_clients.make_client("offline", handler=offline.respond)
        self.prompts = []

    def map(self, requests, **kw):
        self.prompts += [r["messages"][0]["content"] for r in requests]
        return self.client.map(requests, progress=False, **kw)


def run_family(name, n=2, **ctx_kw):
    rec = Recorder()
    ctx = geo_jobs.Ctx(rec, **ctx_kw)
    docs = [SOURCE] + [f"Other page {k} about Australian cities and their history, with no figures at all."
                       for k in range(9)]
    jobs = [geo_jobs.Job(QUERY, SOURCE + (f" Page {k}." if k else ""), 0, f"g{k}", docs, 0) for k in range(n)]
    return geo_attacks.FAMILIES[name]().run(ctx, jobs), rec


def inputs(rec):
    """The <input> blocks of the family's own prompts (the fidelity judge's left out)."""
    got = [json.loads(p[p.index("<input>") + 7:p.rindex("</input>")]) for p in rec.prompts]
    return [i for i in got if "fidelity_task" not in i]


@pytest.mark.parametrize("name", list(geo_attacks.FAMILIES))
def test_the_query_reaches_only_the_families_whose_papers_use_it(name):
    out, rec = run_family(name)
    assert all(t for t, _ in out), out
    uses = {"AgenticGEO", "MAGEO"}
    assert any(QUERY in p for p in rec.prompts) == (name in uses)


@pytest.mark.parametrize("name", list(geo_attacks.FAMILIES))
def test_no_prompt_names_a_family(name):
    _, rec = run_family(name)
    for p in rec.prompts:
        assert not any(n in p for n in geo_jobs.NAMES + ("geo_family",)), p[:200]
    assert all(i["rewrite_task"].startswith(geo_attacks.FAMILIES[name].code + ".") for i in inputs(rec))


@pytest.mark.parametrize("name, steps", [
    ("GEO", ["fluency", "statistics"]), ("AutoGEO", ["rewrite"]),
    ("RAID-GSEO", ["summary", "intent", "reflect", "plan", "rewrite"]),
    ("IF-GEO", ["mine"] + ["request"] * 5 + ["dedup", "conflicts", "blueprint", "revise"]),
    ("AgenticGEO", ["rank1", "apply1", "rank2", "apply2", "rank3", "apply3"])])
def test_each_family_makes_its_papers_calls_in_order(name, steps):
    out, rec = run_family(name, n=1)
    assert [i["rewrite_task"].split(".")[1] for i in inputs(rec)] == steps
    assert out[0][1]["calls"] == len(steps) == geo_attacks.FAMILIES[name].calls


@pytest.mark.parametrize("v, want", [(10 ** 400, 100.0), (-10 ** 400, 0.0), (float("nan"), 7), (float("inf"), 100.0),
                                     (True, 7), ("50", 7), (42, 42.0)])
def test_a_replys_number_is_clamped_whatever_its_size(v, want):
    """A judge's or an attacker's number (IF-GEO's probabilities, MAGEO's scores) past float's range is
    clamped like any other, not an OverflowError replayed from the cache at every resume."""
    assert geo_jobs.number(v, 0, 100, 7) == want


def test_the_prompt_digests_cover_an_archive_or_rules_read_instead_of_the_bundled_ones():
    bundled = geo_attacks.prompt_digests(["AgenticGEO", "AutoGEO", "GEO"])
    read = geo_attacks.prompt_digests(["AgenticGEO", "AutoGEO", "GEO"], archive=[{"strategy": "x"}], rules=["Be y."])
    assert read["AgenticGEO"] != bundled["AgenticGEO"] and read["AutoGEO"] != bundled["AutoGEO"]
    assert read["GEO"] == bundled["GEO"]


def test_agenticgeo_reads_the_published_archive_format(tmp_path):
    p = tmp_path / "strategies.json"
    p.write_text(json.dumps({"strategies": [
        {"genotype_id": "5d39", "strategy_type": "fluent", "short_prompt": "s", "full_prompt": "f",
         "scores": {"total_score": 1.17}, "fitness": 0.8, "genotype": {}},
        {"genotype_id": "0650", "strategy_type": "authoritative", "short_prompt": "s2", "full_prompt": "f2",
         "scores": {"total_score": 1.16}, "fitness": 1.0}]}))
    got = geo_attacks.read_archive(str(p))
    assert [s["genotype_id"] for s in got] == ["5d39", "0650"] and got[1]["full_prompt"] == "f2"
    p.write_text(json.dumps({"strategies": [{"genotype_id": "x", "strategy_type": "t", "prompt": "old"}]}))
    with pytest.raises(ValueError, match="strategy 0: short_prompt"):
        geo_attacks.read_archive(str(p))


def test_agenticgeo_chooses_its_strategies_per_document():
    out, rec = run_family("AgenticGEO", n=4)
    plans = {tuple(t["strategies"]) for _, t in out}
    assert len(plans) > 1                                    # the ranking reads the document, not a fixed plan
    for _, t in out:
        assert len(set(t["types"])) == len(t["types"]) == 3  # a type is used once
    ranks = [i for i in inputs(rec) if i["rewrite_task"].endswith("rank2")]
    assert all(len(i["strategies"]) == len(geo_attacks.AGENTIC_ARCHIVE) - 1 for i in ranks)


def test_agenticgeo_applies_the_full_prompt_of_the_critics_choice():
    out, rec = run_family("AgenticGEO", n=1)
    by_id = {s["genotype_id"]: s for s in geo_attacks.AGENTIC_ARCHIVE}
    applies = [i for i in inputs(rec) if ".apply" in i["rewrite_task"]]
    assert [i["strategy"] for i in applies] == [by_id[x]["full_prompt"] for x in out[0][1]["strategies"]]


def test_autogeo_reads_only_the_filtered_rules(tmp_path):
    p = tmp_path / "merged_rules.json"
    p.write_text(json.dumps({"merged_rules": ["A rule", "Answer the query first"], "filtered_rules": ["A rule"]}))
    assert geo_attacks.read_rules(str(p)) == ["A rule"]
    p.write_text(json.dumps({"rules": ["x"]}))
    with pytest.raises(ValueError, match="filtered_rules"):
        geo_attacks.read_rules(str(p))
    p.write_text(json.dumps(["A rule \ud800"]))                # refused here, not at the first request it reaches
    with pytest.raises(ValueError, match="not valid Unicode"):
        geo_attacks.read_rules(str(p))
    lone = {"genotype_id": "x", "strategy_type": "t", "short_prompt": "s", "full_prompt": "\udfff"}
    p.write_text(json.dumps([lone]))
    with pytest.raises(ValueError, match="not valid Unicode"):
        geo_attacks.read_archive(str(p))


def test_autogeo_sends_its_rules_in_the_files_order():
    _, rec = run_family("AutoGEO", n=1, rules=["b rule", "a rule"])
    assert inputs(rec)[0]["quality_guidelines"] == ["b rule", "a rule"]
    assert geo_attacks.AUTOGEO_RULES == sorted(geo_attacks.AUTOGEO_RULES)


def test_mageo_visibility_is_the_cited_word_share():
    answer = "Canberra was a compromise [1]. It was designed by the Griffins [2][1]. It has many people [3]."
    # sentence words: 4, 6, 4 (citations removed); doc 1 gets 4 + 6 / 2 = 7 of 14 words
    wlv = 7 / 14
    w = [math.exp(-(j + 1) / 3) for j in range(3)]
    dpa = (4 * w[0] + 3 * w[1]) / (4 * w[0] + 6 * w[1] + 4 * w[2])
    assert geo_attacks.visibility(answer, 1) == pytest.approx((wlv + dpa) / 2)
    assert geo_attacks.visibility(answer, 4) == 0.0


def test_mageo_scores_candidates_in_a_simulated_engine_over_the_group():
    out, rec = run_family("MAGEO", n=1)
    engine = [i for i in inputs(rec) if i["rewrite_task"] == "F3.engine"]
    assert engine and all(len(i["documents"]) == 10 and i["query"] == QUERY for i in engine)
    edits = [i for i in inputs(rec) if i["rewrite_task"] == "F3.edit"]
    assert all("query" not in i for i in edits)               # MAGEO's editor does not see the query
    t = out[0][1]
    assert t["signal"] == "engine" and 1 <= t["rounds"] <= geo_attacks.MAGEO_ROUNDS
    assert sum(i["rewrite_task"] == "F3.profile" for i in inputs(rec)) == 1


def test_mageo_stops_after_two_rounds_without_an_accepted_edit():
    out, _ = run_family("MAGEO", n=1)
    t = out[0][1]
    if not t["accepted_rounds"]:
        assert t["rounds"] == geo_attacks.MAGEO_PATIENCE and t["improved"] is False
    else:
        last = t["accepted_rounds"][-1]
        assert t["rounds"] in (last + geo_attacks.MAGEO_PATIENCE, geo_attacks.MAGEO_ROUNDS)


def test_mageo_picks_only_candidates_its_evaluator_scored_under_their_own_labels():
    """An evaluator that numbers the candidates from 0, or skips one: a label naming no candidate is no
    evaluation (clamped, it overwrote candidate 1's), and a candidate without one has passed no faithfulness
    check, so it is never picked; here nothing is, and nothing goes to the gate."""
    class ZeroBased(Recorder):
        def map(self, requests, **kw):
            out = super().map(requests, **kw)
            for k, r in enumerate(requests):
                if '"rewrite_task": "F3.evaluate"' in r["messages"][0]["content"]:
                    full = {"visibility": 10, "position": 10, "faithfulness": 10, "attribution": 10}
                    data = {"evaluations": [{"candidate": 0, **full}, {"candidate": 1, **full, "faithfulness": 2}]}
                    out[k] = llm_clients.Reply(json.dumps(data), data=data)
            return out
    rec = ZeroBased()
    ctx = geo_jobs.Ctx(rec)
    docs = [SOURCE] + [f"Other page {k} about Australian cities." for k in range(9)]
    out = geo_attacks.FAMILIES["MAGEO"]().run(ctx, [geo_jobs.Job(QUERY, SOURCE, 0, "g0", docs, 0)])
    assert out[0][1]["candidate_gate"] == [] and out[0][1]["accepted_rounds"] == []


def test_geo_sfe_runs_only_the_levels_with_a_gap():
    structured = ("# A\n\n## B\n\n### C\n\n" + ("**Key** words here. " * 55 + "\n\n") * 3
                  + "- one\n- two\n- three\n- four\n")
    gaps = geo_attacks.sfe_gaps(structured)
    assert gaps == {"macro": False, "meso": False, "micro": False}
    assert geo_attacks.sfe_gaps(SOURCE) == {"macro": True, "meso": True, "micro": True}


def test_geo_sfe_rolls_back_a_level_that_loses_meaning():
    assert geo_attacks.meaning_kept(SOURCE, "## Canberra\n\n" + SOURCE)
    assert not geo_attacks.meaning_kept(SOURCE, SOURCE.replace("1913", "1914"))
    assert not geo_attacks.meaning_kept(SOURCE, SOURCE[:120] + " 1913 1927 1988 460,000")


def test_if_geo_keeps_requests_of_priority_tau_or_more_in_priority_order():
    """§4.3.1's filter at §5.4's tau = 0.7 on weight x necessity (each scaled to 0-1); each request named by
    the latent query and the suggestion it came from."""
    out, rec = run_family("IF-GEO", n=1)
    dedup = [i for i in inputs(rec) if i["rewrite_task"] == "F6.dedup"][0]["requests"]
    assert dedup and all(r["priority"] >= geo_attacks.IF_PRIORITY == 0.7 for r in dedup)
    assert [r["priority"] for r in dedup] == sorted((r["priority"] for r in dedup), reverse=True)
    assert all(re.fullmatch(r"query\d+-suggestion\d+", r["id"]) for r in dedup)
    assert geo_attacks.priority(90, 80) == 0.72 and geo_attacks.priority(85, 80) == 0.68       # kept; dropped
    # a reply on 0-1 is scaled to the paper's 0-100; one of 0s and 1s is on 0-100 already (1% stays 1%)
    assert geo_attacks.percent([("a", 0.9), ("b", 1)]) == [("a", 90.0), ("b", 100.0)]
    assert geo_attacks.percent([("a", 1), ("b", 0)]) == [("a", 1), ("b", 0)]


@pytest.mark.parametrize("text, why", [("AutoGEO says: " + SOURCE, "names an attack family"),
                                       (SOURCE + ' {"rewritten_document": 1}', "holds prompt text"),
                                       (SOURCE.replace("1927", "1928"), "drops source numbers"),
                                       (SOURCE.replace("1927", "19270"), "drops source numbers"),   # not kept by
                                       (SOURCE.replace("1927", "1927.5"), "drops source numbers"),  # a longer one
                                       (SOURCE, "identical")])
def test_the_gate_names_why_it_refuses_a_rewrite(text, why):
    assert why in geo_jobs.refusal(SOURCE, text)


def test_every_family_is_judged_by_the_fidelity_judge():
    rec, judge = Recorder(), Recorder()
    ctx = geo_jobs.Ctx(rec, judge=judge)
    verdicts = geo_jobs.gate(ctx, [SOURCE, SOURCE], ["Put simply: " + SOURCE, SOURCE])
    assert verdicts == [None, "identical to the source"] and len(judge.prompts) == 1
    ctx = geo_jobs.Ctx(rec)                                # no judge given: the builder's LLM judges
    geo_jobs.gate(ctx, [SOURCE], ["Put simply: " + SOURCE])
    assert "fidelity_task" in rec.prompts[-1]


def test_digests_follow_the_prompts_not_the_docstrings(monkeypatch):
    before = geo_attacks.prompt_digests(["GEO", "MAGEO"])
    monkeypatch.setattr(geo_attacks.Geo, "__doc__", "edited")
    assert geo_attacks.prompt_digests(["GEO", "MAGEO"]) == before
    monkeypatch.setattr(geo_attacks, "MAGEO_PLAN", geo_attacks.MAGEO_PLAN + " More.")
    assert geo_attacks.prompt_digests(["GEO", "MAGEO"])["MAGEO"] != before["MAGEO"]
    assert geo_attacks.prompt_digests(["MAGEO"], "reranker") != geo_attacks.prompt_digests(["MAGEO"])


def test_replies_of_another_shape_are_refused_or_read_as_none_not_a_crash():
    """A builder's reply is cached: one that crashed the family crashed every rerun. AgenticGEO's ranking of a
    list (unhashable) is refused as a reply of another shape and asked again; RAID's reflection with "roles": 5
    is read as no roles; MAGEO's engine answer citing a number past int()'s 4,300 digits (the engine answers
    over the attacker's pages) cites nothing."""
    check = geo_attacks.FAMILIES["AgenticGEO"]().rank_check({"a1", "a2"})
    for bad in ({"ranking": [["a1"]]}, {"ranking": [{"a": 1}]}, {"ranking": ["a1", "a1"]}):
        with pytest.raises(ValueError, match="ranking"):
            check(bad)
    check({"ranking": ["a2", "a1"]})

    def reflect_roles_5(body):
        reply = offline.respond(body)
        if geo_attacks.RAID_REFLECT in body["messages"][0]["content"]:
            msg = reply["choices"][0]["message"]
            msg["content"] = json.dumps({**json.loads(msg["content"]), "roles": 5})
        return reply
    rec = Recorder()
    rec.client = llm_clients.make_client("offline", handler=reflect_roles_5)
    jobs = [geo_jobs.Job(QUERY, SOURCE, 0, "g0", [SOURCE, "Other page about Australian cities."], 0)]
    (text, trace), = geo_attacks.FAMILIES["RAID-GSEO"]().run(geo_jobs.Ctx(rec), jobs)
    assert text and trace["roles"] == []
    assert geo_attacks.visibility("Canberra is the capital [" + "1" * 5000 + "]. It grew [1].", 1) > 0
