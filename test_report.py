"""report.py: its figures say when a run is offline and draw what its tables print (figures.py's own
checks: test_figures.py); attack strength, per-method counts, the harden labels; the comparison across runs.
Run: python -m pytest -q test_report.py
"""
import os
import re

import evaluation
import figures
import report


def test_compare_runs_transfer_matrix(tmp_path):
    import report
    def summ(target, asr, transfer):
        c = {k: {"ASR": asr, "ASI": asr / 2, "BER": 90.0, "n": 7, "attack_in_context": 50.0,
                 "hallucinated_citations": 0}
             for k in evaluation.CONDITIONS}
        return {"target_llm": target, "conditions": c, "notes": [], "transfer": transfer,
                "quality": {"mean_change": 0.1, "ci95": [-0.1, 0.2], "comparable_or_better": 80.0, "better": 20.0,
                            "n": 7}}
    # runs a (target x:A) and b (x:B), each evaluated with the other's library (--transfer b=..., a=...)
    s = {"a": summ("x:A", 10.0, {"(own)": {"ASR": 5.0, "ASI": 2.0}, "b": {"ASR": 7.0, "ASI": 3.0}}),
         "b": summ("x:B", 30.0, {"(own)": {"ASR": 6.0, "ASI": 4.0}, "a": {"ASR": 8.0, "ASI": 1.0}})}
    path = report.write_comparison(str(tmp_path), s)
    text = open(path).read()
    assert "| Average | 20.00 |" in text and "| Average | +0.100 | - | 80.00 | 20.00 |" in text      # Tables 1, C.1
    assert "| Source \\ Target | x:A | x:B |" in text                     # rows: source library's run, cols: target
    assert "| a | 5.00 | 8.00 |" in text and "| b | 7.00 | 6.00 |" in text
    assert open(tmp_path / "figures" / "transfer_asr.svg").read().startswith("<svg")
    assert "DIFFERENT TEST SETS" not in text and "Left out" not in text     # no digest recorded, the same counts
    s["b"]["test_instances"] = 700                             # an older summary (no digest): the counts differ
    assert "DIFFERENT TEST SETS" in open(report.write_comparison(str(tmp_path), s)).read()
    s["b"]["conditions"]["Non-Defense [co]"] = s["b"]["conditions"]["Non-Defense"]     # a deployed one
    del s["a"]["conditions"]["RobustRAG"]
    text = open(report.write_comparison(str(tmp_path), s)).read()
    assert "Left out, not in every run (or deployed): x:B: RobustRAG, Non-Defense [co]." in text
    assert "RobustRAG ASR" not in text
    s["a"]["conditions"]["RobustRAG"] = s["b"]["conditions"]["RobustRAG"]
    del s["b"]["conditions"]["Non-Defense [co]"]
    del s["b"]["test_instances"]
    for k, d in (("a", "1" * 40), ("b", "1" * 40)):
        s[k]["test_set_sha1"], s[k]["test_instances"] = d, 7
    assert "DIFFERENT TEST SETS" not in open(report.write_comparison(str(tmp_path), s)).read()
    s["b"]["test_instances"], s["b"]["test_lists"] = 3, 7      # an --attacked K file: its paper lists apart, the
    assert "DIFFERENT TEST SETS" not in open(report.write_comparison(str(tmp_path), s)).read()   # same instances
    del s["b"]["test_lists"]
    s["b"]["test_instances"] = 7
    s["b"]["test_set_sha1"] = "2" * 40                         # evaluated on other instances: flagged
    assert "DIFFERENT TEST SETS.** These runs were not evaluated on the same instances (a: 7 instances, 1111111111" \
        in open(report.write_comparison(str(tmp_path), s)).read()
    # the same instances at another top-k: exposure, ASR and BER are not comparable either
    s["b"]["test_set_sha1"], s["a"]["k"], s["b"]["k"] = "1" * 40, 5, 3
    text = open(report.write_comparison(str(tmp_path), s)).read()
    assert "DIFFERENT TOP-K.** These runs gave their LLMs different numbers of documents (a: 5, b: 3)" in text
    assert "DIFFERENT TEST SETS" not in text
    s["b"]["k"] = 5
    assert "DIFFERENT TOP-K" not in open(report.write_comparison(str(tmp_path), s)).read()
    # two runs of one target LLM: two columns, each run's own figures (keyed by target, one overwrote the other)
    s = {"a": summ("x:A", 10.0, {"(own)": {"ASR": 5.0, "ASI": 2.0}, "lib": {"ASR": 11.0, "ASI": 3.0}}),
         "b": summ("x:A", 30.0, {"(own)": {"ASR": 6.0, "ASI": 4.0}, "lib": {"ASR": 33.0, "ASI": 1.0}})}
    text = open(report.write_comparison(str(tmp_path), s)).read()
    assert "| Source \\ Target | x:A (a) | x:A (b) |" in text and "| lib | 11.00 | 33.00 |" in text
    assert "| a | 5.00 | - |" in text and "| x:A (a) | 10.00 |" in text
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "summary.json").write_text('{"target_llm": "x:A", "conditions": {}}')
    assert list(report.read_summaries([str(tmp_path / "runs" / "a") + "/"])) == ["a"]    # a trailing slash


def _parse(svg):
    """The <text> elements of an SVG."""
    import xml.etree.ElementTree as ET
    return list(ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"))


def _harden_summary(notes):
    """A three-round harden block: round 0 has no stale attacker; at round 2 the fresh and stale attackers
    reach equal exposure, and their ASRs differ by 0.2."""
    def cell(exposure, asr):
        return {"Shield only": {"exposure": exposure, "ASR": asr, "BER": 91.0},
                "GEO Defender": {"exposure": exposure, "ASR": asr, "BER": 92.5}}
    rounds = []
    for k, (fresh, stale) in enumerate([((40.0, 20.0), None), ((25.0, 10.7), (40.0, 20.0)),
                                        ((25.0, 10.7), (25.0, 10.9))]):
        r = {"round": k, "fresh": {"1": cell(50.0, 30.0), "3": cell(*fresh)}, "static": cell(12.5, 7.1),
             "clean_topk_kept": 90.0, "cost": {"replies": 10 * k, "usd": None}}
        if stale:
            r.update(stale=cell(*stale), survivors=3, pool=3 * k)
        rounds.append(r)
    return {"harden": {"rounds": rounds, "k": 5, "notes": notes,
                       "crossplay": {"exposure": [[40.0, 30.0, 20.0]] * 3}}}


def test_harden_figure_draws_a_point_where_the_table_prints_a_value(tmp_path):
    """harden_attack.svg and harden_report.md read the same cells: no stale point at round 0 (the table's
    "-"), and every point the table's value, round by round."""
    report.write_harden_report(str(tmp_path), _harden_summary([]))
    table = [ln.split(" | ") for ln in (tmp_path / "harden_report.md").read_text().splitlines()
             if re.match(r"\| \d+ \|", ln)]
    svg = (tmp_path / "figures" / "harden_attack.svg").read_text()
    rounds = {float(t.get("x")): t.text for t in _parse(svg) if re.fullmatch(r"r\d", t.text or "")}
    drawn = {(name, rounds[float(cx)]): v for cx, name, v in
             re.findall(r'<circle cx="([\d.]+)" cy="[\d.]+" r="[\d.]+" fill="#\w+"><title>([\w ]+): ([\d.]+)<', svg)}
    columns = {"fresh exposure": 3, "fresh ASR": 4, "stale exposure": 5, "stale ASR": 6}
    for row in table:
        for name, col in columns.items():
            assert drawn.get((name, f"r{row[0].strip('| ')}"), "-") == row[col], (name, row)
    assert ("stale exposure", "r0") not in drawn and ("stale exposure", "r1") in drawn


def _eval_summary(notes):
    """The smallest summary write_report draws its figures from: two conditions, two methods, epochs."""
    conds = {k: {"ASR": a, "ASI": a / 2, "BER": 90.0, "attack_in_context": 50.0, "n": 7}
             for k, a in (("Non-Defense", 20.0), ("GEO Defender", 5.0))}
    methods = {k: {m: {"ASR": v["ASR"], "ASI": v["ASI"], "seen": m == "m1"} for m in ("m1", "m2")}
               for k, v in conds.items()}
    return {"target_llm": "offline:sim", "model": "tiny", "test_groups": 2, "test_instances": 7,
            "seen_methods": ["m1"], "conditions": conds, "methods": methods, "notes": notes,
            "epochs": {"E0": {"ASR": 10.7, "ASI": 10.7, "BER": 90.0}, "E1": {"ASR": 5.0, "ASI": 5.0, "BER": 90.0}}}


def test_figures_of_an_offline_run_say_so_on_the_figure(tmp_path):
    """Every figure of an eval and a harden report on an offline run carries the note under its title;
    a run without notes carries none."""
    for notes, expect in ((["LLMs: the offline engine (offline.py), a SIMULATION."], True), ([], False)):
        out = tmp_path / str(expect)
        report.write_report(str(out), _eval_summary(notes))
        report.write_harden_report(str(out), _harden_summary(notes))
        names = sorted(os.listdir(out / "figures"))
        assert len(names) == 7, names                 # per_method_asr, conditions, per_method_air, epochs, 3 harden
        for name in names:
            texts = [t.text for t in _parse((out / "figures" / name).read_text())]
            assert (figures.OFFLINE_FIGURE in texts) == expect, name


def test_report_figures_are_byte_identical_on_rerun(tmp_path):
    """Label placement and every figure are deterministic: the same summary gives the same bytes."""
    for d in ("a", "b"):
        report.write_report(str(tmp_path / d), _eval_summary(["offline"]))
        report.write_harden_report(str(tmp_path / d), _harden_summary(["offline"]))
    for name in os.listdir(tmp_path / "a" / "figures"):
        assert (tmp_path / "a" / "figures" / name).read_bytes() == (tmp_path / "b" / "figures" / name).read_bytes()


def test_attack_strength_is_the_rewrites_citation_minus_the_sources_and_flags_a_ci_holding_zero():
    """Non-Defense records against the clean reference: a family always cited, whose source was cited in
    2 of 6 groups, gains 66.67 points; one cited exactly where its source was gains 0 and is flagged; the
    report prints both."""
    import geodef
    groups = [geodef.QueryGroup(f"g{i}", "q", [{"doc_id": f"g{i}-{j}", "text": "t"} for j in range(4)], 1,
                                {"A": "a", "B": "b"}) for i in range(6)]
    clean = {g.group_id: {"cited_ids": [f"{g.group_id}-1"] if i < 2 else []} for i, g in enumerate(groups)}
    recs = [{"method": "A", "group_id": g.group_id, "attack_cited": True} for g in groups]
    recs += [{"method": "B", "group_id": g.group_id, "attack_cited": i < 2} for i, g in enumerate(groups)]
    st = evaluation.attack_strength(recs, clean, groups, ["A", "B"], n_boot=200, seed=0)
    assert st["A"]["gain"] == 66.67 and not st["A"]["holds_zero"] and st["A"]["n"] == 6
    assert st["B"]["gain"] == 0.0 and st["B"]["ci"] == [0.0, 0.0] and st["B"]["holds_zero"]
    text = "\n".join(report.strength_lines({"attack_strength": st}))
    assert "| B | +0.0 (not shown to raise visibility: CI holds 0) |" in text and "| A | +66.7 |" in text
    # an attacked answer that failed cites nothing, which is not the rewrite's doing: left out and counted
    # (counted as 'not cited', family A's gain would fall to 50 points)
    recs[0] = dict(recs[0], attack_cited=False, answer_failed="no answer")
    st = evaluation.attack_strength(recs, clean, groups, ["A"], n_boot=200, seed=0)
    assert st["A"]["gain"] == 80.0 and st["A"]["n"] == 5 and st["A"]["answer_failed"] == 1
    assert "| A | +80.0 | [" in "\n".join(report.strength_lines({"attack_strength": st}))
    assert "| 5 (failed: 1) |" in "\n".join(report.strength_lines({"attack_strength": st}))
    # a group whose clean reference failed has nothing to compare with: left out too, and counted, not silently
    del clean["g5"]
    st = evaluation.attack_strength(recs, clean, groups, ["A"], n_boot=200, seed=0)
    assert st["A"]["n"] == 4 and st["A"]["no_reference"] == 1
    assert "| 4 (failed: 1, no reference: 1) |" in "\n".join(report.strength_lines({"attack_strength": st}))


def test_table_c1_says_how_many_comparisons_had_no_answer():
    """pairwise_quality leaves out a comparison whose defended answer or clean reference failed, counted in
    no_answer: the report says how many, for GEO Defender and for the injection defenses, or a defense whose
    answers fail on hard cases would read better than it is."""
    q = {"mean_change": 0.1, "ci95": [-0.2, 0.3], "comparable_or_better": 80.0, "better": 20.0, "n": 56,
         "defended_as_a": 28, "judge_failed": 0, "no_answer": 14}
    text = "\n".join(report._appendix_lines({"quality": q, "quality_defenses": {"RobustRAG": q}}, {}))
    assert "Comparisons without an answer (the defended one or the clean reference failed; left out of Table " \
           "C.1): 14." in text and "Comparisons without an answer (left out of n): RobustRAG 14." in text


def test_every_paper_figure_beside_the_attack_strength_says_why_it_is_not_ours():
    """Each family paper's figure names its metric and method; none is the citation rate in points that
    attack_strength measures, so each row opens with "not comparable" and its reason."""
    for family, said in evaluation.PAPER_GAINS.items():
        assert said.startswith("not comparable (") and "arXiv" in said, family


def test_the_report_gives_each_method_its_own_count_where_a_family_was_refused(tmp_path):
    """A benchmark where build-bench's gate refused every rewrite of m2 on one group: the per-method section
    names each method's instances and refused groups; without refusals it says nothing of them."""
    s = _eval_summary([])
    for k in s["methods"]:
        s["methods"][k]["m1"]["n"], s["methods"][k]["m2"]["n"] = 4, 3
    report.write_report(str(tmp_path / "a"), s)
    assert "Test instances per method" not in (tmp_path / "a" / "report.md").read_text()
    report.write_report(str(tmp_path / "b"), {**s, "family_drops": {"m1": 0, "m2": 1}})
    assert "per method (groups where build-bench's gate refused every rewrite of a method have none of it; the " \
           "refusals count the groups of both splits): m1 4 (refused on 0 groups), m2 3 (refused on 1 groups)." \
           in (tmp_path / "b" / "report.md").read_text()
    for k in s["methods"]:                       # eval --samples 2: the records pool both samples
        s["methods"][k]["m1"]["n"], s["methods"][k]["m2"]["n"] = 8, 6
    report.write_report(str(tmp_path / "c"), {**s, "family_drops": {"m1": 0, "m2": 1}, "samples": {
        "n": 2, "conditions": {}}})
    assert "m1 4 (refused on 0 groups), m2 3 (refused on 1 groups)." in (tmp_path / "c" / "report.md").read_text()


def test_a_harden_test_attacker_of_another_algorithm_is_out_of_distribution(tmp_path):
    s = _harden_summary([])
    s["harden"]["settings"] = {"algorithm": "mageo", "test_algorithm": "repair"}
    report.write_harden_report(str(tmp_path), s)
    assert "fresh test attacker diagnose-and-repair (AgentGEO): out of distribution" in \
        (tmp_path / "harden_report.md").read_text()


def test_the_report_names_each_splits_builder_when_they_differ(tmp_path):
    s = {"notes": [], "target_llm": "t", "model": "m", "test_groups": 1, "test_instances": 7, "seen_methods": ["A"],
         "builders": {"construction": "openai:gpt-5.5", "test": "anthropic:claude-opus-4-5"}}
    text = "".join(report._header_lines(str(tmp_path), s))
    assert "construction split's rewrites by openai:gpt-5.5, the test split's by anthropic:claude-opus-4-5" in text
    assert "Builders apart" not in "".join(report._header_lines(str(tmp_path), {**s, "builders": None}))


def test_exposure_against_k_is_drawn_beside_a_random_top_ks_rate(tmp_path):
    """Any attacked document in the top k rises with K by chance alone (50%, 77.8%, 91.7% for 5 of 10): the
    figure draws that rate as its own series, and the K table gives the share of a random top k (K/n)."""
    cols = {"exposure": 60.0, "any_exposure": 70.0, "mean_exposure": 10.0, "topk_attack_share": 10.0}
    block = lambda kk: {"n": 4, **cols, **{f"{c}_ci": [0.0, 100.0] for c in cols},
                        "chance_any_in_topk": {"1": 50.0, "3": 91.7}[kk],
                        "chance_topk_share": {"1": 10.0, "3": 30.0}[kk]}
    stage = {"base": {"by_attacked": {"1": block("1"), "3": block("3")}}}
    path = tmp_path / "k.svg"
    report.against_k(str(path), "t", {lb: st["by_attacked"] for lb, st in stage.items()}, "any_exposure", "y", None,
                     chance="chance_any_in_topk")
    svg = path.read_text()
    assert "chance (a random top k)" in svg and "base" in svg
    table = "\n".join(report.rerank_by_k_lines(stage, 5))
    row = next(ln for ln in table.splitlines() if ln.startswith("| base | 3 "))
    assert "Chance, share (%)" in table and row.rstrip(" |").endswith("| 30.00")


def test_a_summary_written_before_a_key_was_renamed_still_reports(demo_run):
    """rerank-eval rewrites report.md over an older eval's summary.json: RobustRAG's diagnostic under its
    earlier name (attack_supports_a_cited_phrase) is read, not a KeyError after the summary was written."""
    import json
    s = json.load(open(demo_run / "summary.json"))
    r = s["defenses"]["RobustRAG"]
    r["attack_supports_a_cited_phrase"] = r.pop("attack_supports_a_kept_phrase")
    text = "\n".join(report.defense_lines(s))
    n = r["attack_supports_a_cited_phrase"]
    assert f"supports a kept phrase (the answer cites it where it uses one) | {n} |" in text


def test_the_eval_report_leaves_out_a_reranker_stage_measured_on_other_test_lists(demo_run, tmp_path):
    """eval keeps rerank-eval's blocks in summary.json; one measured on other test lists (another
    --max-test-groups, say) is left out of the eval report's reranker tables and named, not printed beside a
    Table 1 over other instances."""
    import json
    s = json.load(open(demo_run / "summary.json"))
    assert set(s["rerank_stage"]) == {"base", "shield"}
    report.write_report(str(tmp_path), s)
    text = open(tmp_path / "report.md").read()
    assert "| shield | all |" in text and "measured on other test lists" not in text
    s["rerank_stage"]["shield"]["test_set_sha1"] = "0" * 40
    report.write_report(str(tmp_path), s)
    text = open(tmp_path / "report.md").read()
    assert "| shield | all |" not in text and "| base | all |" in text
    assert "measured on other test lists than this evaluation's, left out: shield" in text


def test_a_certificate_block_of_an_older_format_is_named_not_a_crash():
    """rerank-eval merges its stage over runs, so a label certified by an older version (no rewrite_certified)
    stays beside new ones; the report crashed with a KeyError after summary.json was written."""
    import report
    old = {"certificate": {"certified": {"insert": {"1": 50.0}}, "rewrites_inside_radius": 10.0}}
    assert "older format" in "".join(report.certificate_lines({"shield": old}, 5))
    new = {"certificate": {"certified": {"insert": {"1": 50.0}}, "rewrite_certified": {"1": 40.0},
                           "clean_kept_certified": {"1": 90.0}, "samples": 8, "deletion_rate": 0.9, "eps": 0.1,
                           "exposure": 40.0, "smoothed_exposure": 30.0, "ndcg_smoothed_clean": 0.9,
                           "rewrites_inside": 20.0, "inserted_median": 5, "forward_passes": 80, "seconds": 1.0}}
    both = "".join(report.certificate_lines({"base": new, "shield": old}, 5))      # beside a new one: named too
    assert "| base | rewrite, inserted | 40.00 |" in both and "Certificates of shield are in an older format" in both


def test_a_gap_over_one_group_is_printed_without_an_interval():
    """metrics.paired_gap over one common group has no CI (nothing to resample): printed as such, not [x, x]."""
    assert report.gap_text({"gap": 50.0, "gap_ci": None, "groups": 1}) == "+50.0 [one group: no CI]"
    assert report.gap_text({"gap": -2.0, "gap_ci": [-5.0, 1.0], "groups": 9}) == "-2.0 [-5.0, +1.0]"
    assert report.gap_text({"gap": None, "gap_ci": None, "groups": 0}) == "-"


def test_the_repeated_samples_section_says_which_figures_pool_the_samples():
    """eval --samples N: Tables 1 and 2 pool every sample, Fig. 5, C.1, C.2's own row, the strength and the cost
    read the first; the section says so rather than that every table above averages them."""
    v = {"ASR": 10.0, "ASR_ci": [5.0, 15.0], "ASR_ci_two_level": [4.0, 16.0], "ASR_per_sample": [9.0, 11.0]}
    text = "".join(report.sample_lines({"samples": {"n": 2, "conditions": {"Non-Defense": v}}}))
    assert "Tables 1 and 2 and the per-method tables pool them (their n counts answers: instances x N)" in text
    assert "Table C.1, Table C.2's own row, the attack strength and the cost per query read the first sample" in text
