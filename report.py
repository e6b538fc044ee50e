"""report.md and SVG figures for an evaluation run, laid out as the paper's tables and figures.

The figures are figures.py's plain-string SVG. Table 1 (conditions x ASR/ASI/BER), Table 2 (ablation), the
per-method breakdown (Fig. 3: ASR, and (b) the Attack Influence Reduction from Non-Defense; unseen
methods dashed), the quality table (Table C.1), PPL-Filter diagnostics (Table B.2), and ASR/ASI by
library epoch (Fig. 5). A run on the tiny model or the offline engine says so first, in the report and
under each figure's title; every figure titles both its axes. Beside them:
every condition with its latency and cost per query, and what the injection defenses (defenses.py)
did, with their answer quality; on a benchmark with honest edits, each condition's and reranker's
honest penalty beside the attacks' (honest_cells, honest_lines).

Usage: write_report("runs/demo", summary)
"""
import os

from figures import COLORS, figure_note, fmt, svg_bars, svg_heatmap, svg_lines
from store import JSONFileError, atomic_write, read_json


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _counts(text, blocks, key):
    """`text`, then "name n" for each block whose `key` counts something, as one sentence; nothing when none does."""
    said = ", ".join(f"{k} {b[key]}" for k, b in blocks.items() if b.get(key))
    return [f"{text}{said}.\n"] if said else []


def write_report(run_dir, s):
    """report.md and figures/*.svg of one evaluated run from its summary `s`. A reranker-stage block (rerank-eval)
    measured on other test lists than this eval's is left out of its tables, and said."""
    figs = os.path.join(run_dir, "figures")
    other = [lb for lb, b in (s.get("rerank_stage") or {}).items()
             if s.get("test_set_sha1") and b.get("test_set_sha1") not in (None, s["test_set_sha1"])]
    if other:
        kept = {lb: b for lb, b in s["rerank_stage"].items() if lb not in other}
        s = {**{key: v for key, v in s.items() if key != "rerank_stage"}, **({"rerank_stage": kept} if kept else {})}
    lines = _header_lines(run_dir, s) + _table_lines(s) + strength_lines(s) + cost_lines(s) + _method_lines(s, figs)
    lines += _appendix_lines(s, figs) + defense_lines(s) + attacked_lines(s, figs) + rerank_stage_lines(s)
    lines += [f"Reranker-stage results measured on other test lists than this evaluation's, left out: "
              f"{', '.join(other)} (rerank-eval's rerank_report.md).\n"] if other else []
    lines += usage_lines(s.get("usage") or {})
    # the API refused a parameter (llm_clients.RequestShape.adapt)
    for who, changes in (s.get("adapted") or {}).items():
        lines.append(f"Requests to {who} adapted to its API: {'; '.join(changes)}.\n")
    atomic_write(os.path.join(run_dir, "report.md"), "\n".join(lines))


def _title(run_dir, s, what):
    """A report's first lines: the offline/simulation banner when the run has notes, then its title."""
    banner = ["> **OFFLINE / SIMULATION RUN.** " + " ".join(s["notes"]) + "\n"] if s.get("notes") else []
    return banner + [f"# {what}: {os.path.basename(os.path.normpath(run_dir))}\n"]


# what a family whose gain interval holds 0 is called, in eval's and holdout's tables
NOT_SHOWN = "not shown to raise visibility"


def strength_lines(s):
    """Attack strength: does each family raise its source's citation on this target (Non-Defense)?"""
    st = s.get("attack_strength")
    if not st:
        return []
    lines = ["## Attack strength (Non-Defense)\n",
             "Citation of each family's rewrite minus the clean reference's citation of the same source, percentage "
             "points, 95% CI over query groups. A family whose interval holds 0 was not shown to raise visibility on "
             "this target: its blocked rate says little about the defense. Attacked answers that failed, and "
             "groups whose clean reference failed, are left out of n (failed, no reference: how many).\n",
             "| family | gain | 95% CI | n | its paper reports (metric, method; comparable?) |",
             "|---|---|---|---|---|"]
    for m, v in st.items():
        flag = f" ({NOT_SHOWN}: CI holds 0)" if v["holds_zero"] else " (lowers it)" if v["ci"][1] < 0 else ""
        gone = [f"{w}: {v[k]}" for k, w in (("answer_failed", "failed"), ("no_reference", "no reference")) if v.get(k)]
        n = f"{v['n']} ({', '.join(gone)})" if gone else v["n"]
        lines.append(f"| {m} | {v['gain']:+.1f}{flag} | [{v['ci'][0]:+.1f}, {v['ci'][1]:+.1f}] | {n} | "
                     f"{v['paper'] or '-'} |")
    return lines + [""]


def _header_lines(run_dir, s):
    """The run's labels: offline notes, target, reranker, judge, which ranking built the library."""
    lines = _title(run_dir, s, "GEO Defender evaluation")
    lists = f" (lists at every K: {s['test_lists']})" if s.get("test_lists") else ""
    lines.append(f"Target LLM: `{s['target_llm']}`; reranker: `{s['model']}`; test groups {s['test_groups']}, "
                 f"instances {s['test_instances']}{lists}; seen methods: {', '.join(s['seen_methods'])}.\n")
    if s.get("judge"):
        itself = (" (the target itself, the default; the paper judges every target with GPT-5.5: "
                  "`--judge openai:gpt-5.5`, or `--preset paper`)" if s["judge"] == s["target_llm"] else "")
        lines.append(f"Judge (ASI, pairwise quality): `{s['judge']}`{itself}.\n")
    if s.get("tfsg_library_ranking"):
        lines.append(f"The TFSG library was built on the {s['tfsg_library_ranking']} top-k; \"TFSG only\" applies "
                     "that same library to the base reranker's top-k.\n")
    if s.get("builders"):
        lines.append(f"**Builders apart** (build-bench --test-llm): the construction split's rewrites by "
                     f"{s['builders']['construction']}, the test split's by {s['builders']['test']}.\n")
    if s.get("shared_roles"):
        lines.append(f"**Roles shared with the benchmark's construction** (--allow-shared-roles): "
                     f"{'; '.join(s['shared_roles'])}. Such a model measures attacks it made or steered.\n")
    return lines


def _table_lines(s):
    """Tables 1 and 2 (end to end, ablation)."""
    lines = []
    c = s["conditions"]
    rows = lambda ks: [[k, fmt(c[k]["ASR"]), fmt(c[k]["ASI"]), fmt(c[k]["BER"]), fmt(c[k]["attack_in_context"]),
                        c[k]["n"]] for k in ks]
    main = [k for k in ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender") if k in c]
    lines.append("## Table 1: end-to-end comparison (ASR, ASI lower is better; BER higher)\n")
    lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n"], rows(main)) + "\n")
    # answers that failed are recorded as citing nothing, the attack included: a defense's failures would read as
    # blocks; an ASI judge failure is counted at the judged in-context mean (evaluation.py), not left out
    lines += _counts("Answers that failed (every attempt unusable; each counted as citing nothing, the attack "
                     "included, and its ASI 0): ", c, "answer_failed")
    lines += _counts("Left out of BER, their group's clean reference answer having failed: ", c,
                     "ber_without_reference")
    lines += _counts("ASI judge failures (every attempt unusable; counted at the mean of the judged in-context "
                     "instances): ", c, "asi_judge_failed")
    abl = [k for k in ("Non-Defense", "Shield only", "TFSG only", "GEO Defender") if k in c]
    lines.append("## Table 2: module ablation\n")
    lines.append(_table(["Method", "ASR", "ASI", "BER"], [r[:4] for r in rows(abl)]) + "\n")
    deployed = [k for k in c if k.endswith("]") and k.startswith(("Non-Defense [", "TFSG only ["))]
    if deployed:   # eval --reranker: the same pipelines on a deployed reranker's top-k
        lines.append("## Deployed rerankers (eval --reranker): the pipelines on each reranker's top-k\n")
        lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n"], rows(abl + deployed))
                     + "\n")
    return lines + sample_lines(s)


def sample_lines(s):
    """eval --samples N: each condition's ASR over the samples with both intervals, and per sample."""
    if not s.get("samples"):
        return []
    b = s["samples"]
    ci = lambda v: f"[{v[0]:.1f}, {v[1]:.1f}]"
    # (reported CI, two-level check); a summary written before the groups-only interval was the reported one
    # holds them as ASR_ci_groups_only and ASR_ci
    old = lambda v: ("ASR_ci_groups_only", "ASR_ci") if "ASR_ci_groups_only" in v else ("ASR_ci", "ASR_ci_two_level")
    return [f"## Repeated samples: {b['n']} answers per instance\n",
            "Every condition answered each instance N times (each its own cached reply); Tables 1 and 2 and the "
            "per-method tables pool them (their n counts answers: instances x N), while Fig. 5, Table C.1, Table "
            "C.2's own row, the attack strength and the cost per query read the first sample only. 95% CI of "
            "ASR: over query groups, of each instance's mean over its samples (it carries the answers' variance "
            "with the groups'). Beside it, as a check, the two-level bootstrap (groups, then samples within each), "
            "which counts the answers' variance twice: conservative, wider.\n",
            _table(["Condition", "ASR", "95% CI", "95% CI, two-level (check)", "ASR per sample"],
                   [[k, fmt(v["ASR"]), *(ci(v[n]) for n in old(v)),
                     ", ".join(fmt(a) for a in v["ASR_per_sample"])] for k, v in b["conditions"].items()]) + "\n"]


def honest_cells(b, other):
    """A condition's or reranker's honest penalty and, beside it, the attacks' figure `other` (attack_loss,
    attack_demotion): each "value [CI], n" of its honest_penalty block, "-" where nothing is measurable."""
    def cell(key, n):
        if not b or b.get(key) is None:
            return "-"
        lo, hi = b[key + "_ci"]
        return f"{b[key]:.2f} [{lo:.1f}, {hi:.1f}], n={b[n]}"
    return [cell("honest_penalty", "source_cited" if other == "attack_loss" else "source_in_topk"),
            cell(other, "n_attack")]


def honest_lines(s, stage):
    """What the honest penalty means, its goal, and on this run the Shield's gap to the base (stage "eval":
    Shield only against Non-Defense; "rerank": the shield reranker against base)."""
    if stage == "eval":
        h = s["honest"]
        blocks, pair, where = h["conditions"], ("Shield only", "Non-Defense"), f"{h['groups']} of {h['test_groups']} "
        what = ("each condition also answers each such group's clean list and its honest list; honest penalty: of "
                "the groups whose source it cites on the clean list, the % whose honest edit it does not cite on "
                "the honest list; attack citation lost: the same for the attack rewrites of those groups")
    else:
        blocks = {v["spec"]: v["honest"] for v in s["rerank_stage"].values() if v.get("honest")}   # by spec: any label
        pair, where = ("shield", "base"), f"{next(iter(blocks.values()))['groups']} "
        what = ("honest penalty: of the groups whose source a reranker puts in its clean top k, the % whose "
                "honest edit it leaves out of the honest list's top k; attack demoted: the same for the attack "
                "rewrites of those groups")
    gap = [blocks.get(p, {}).get("honest_penalty") for p in pair]
    measured = (f" Here {pair[0]}'s honest penalty is {gap[0] - gap[1]:+.2f} points from {pair[1]}'s (a difference of "
                "two rates, each over the groups whose source that one kept, so not a paired gap: no CI; each rate's "
                "CI above is the closer guide)." if None not in gap else "")
    lines = [f"**Honest penalty** ({where}test groups have an honest edit, build-bench --honest: the source in "
             "clearer wording and structure, every fact kept, no number, quotation, name or authority wording "
             f"added). Does the defense punish honest optimisation? {what[0].upper() + what[1:]}; 95% query-cluster "
             "bootstrap CIs. A defense that separates manipulation from optimisation loses the attacks and keeps "
             "the honest edits. Goal on real models (a target, not a test): the Shield's honest penalty within 5 "
             f"points of the base reranker's while the attack's exposure falls as in the paper.{measured}\n"]
    refused = s["honest"].get("refusals") if stage == "eval" else None
    if refused:
        lines.append("The honest editor's refused attempts, by reason (build-bench's gate): "
                     + ", ".join(f"{k} {v}" for k, v in refused.items()) + ".\n")
    if s.get("notes"):
        lines.append("On the offline engine the honest editor is simulated too (offline.py re-cuts the source's "
                     "paragraphs under a heading of its own words): these honest figures are plumbing.\n")
    return lines


def cost_lines(s):
    """Every condition in one table: ASR, ASI, BER beside the latency and cost per query each adds."""
    c, cost = s["conditions"], s.get("cost") or {}
    if not cost:
        return []
    usd = lambda q: "-" if q.get("usd") is None else f"{q['usd']:.6f}"
    honest = (s.get("honest") or {}).get("conditions")     # a benchmark with honest edits: two more columns
    rows = [[k, fmt(c[k]["ASR"]), fmt(c[k]["ASI"]), fmt(c[k]["BER"]), fmt(c[k]["attack_in_context"]), c[k]["n"]]
            + [fmt(cost.get(k, {}).get(m), nd) for m, nd in (("sequential_calls", 2), ("llm_calls", 2),
                                                               ("prompt_tokens", 0), ("completion_tokens", 0))]
            + [usd(cost.get(k, {}))] + (honest_cells(honest.get(k), "attack_loss") if honest else []) for k in c]
    lines = ["## All conditions: metrics, latency and cost per query\n",
             "The paper's six conditions, then the injection defenses a provider would try first (defenses.py), "
             "which rank with the base reranker. Latency: LLM calls in a row per query (1 for one prompt; 2 for "
             "PromptArmor and RobustRAG, whose k remover or isolated calls run side by side before the answer); "
             "wall seconds are not measured (replies come concurrently, from batches or from the cache). Calls, "
             "tokens and USD per query are the target LLM's, the ASI judge apart, from the replies' usage (an "
             "injection defense's records carry theirs; a single-prompt condition's one reply is read back from the "
             "reply cache); USD at the full price of --prices (- without one). PromptArmor and RobustRAG send k + 1 "
             "calls per query.\n"]
    if s.get("notes"):
        lines.append("On the offline engine these figures are plumbing: its tokens are characters / 4 and its "
                     "answers a simulation (offline.py); they say nothing about the defenses or their cost.\n")
    lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n", "Latency (calls in a row)",
                         "LLM calls / query", "Prompt tokens / query", "Completion tokens / query", "USD / query"]
                        + (["Honest penalty (%)", "Attack citation lost (%)"] if honest else []), rows) + "\n")
    if honest:
        lines += honest_lines(s, "eval")
    return lines + _counts("Records whose reply is no longer in the cache (left out of the cost): ", cost,
                           "usage_unknown") + _counts("Replies whose tokens are unknown (an answer that "
                                                      "never parsed, a reply without usage; their calls counted, "
                                                      "left out of the token means, USD unknown): ", cost,
                                                      "unmetered_replies")


def _method_lines(s, figs):
    """Per GEO method (Fig. 3 (a) as ASR, (b) Attack Influence Reduction) with their figures."""
    lines, c = [], s["conditions"]
    seen = next(iter(s["methods"].values()))          # {method: {..., "seen"}}, the same for every condition
    methods = list(next(iter(s["methods"].values())).keys())
    lines.append("## Per GEO method (Fig. 3): ASR by condition; unseen methods marked *\n")
    lines.append(_table(["Condition"] + [m + ("" if seen[m]["seen"] else "*") for m in methods],
                        [[k] + [fmt(s["methods"][k][m]["ASR"]) for m in methods] for k in s["methods"]]) + "\n")
    drops = {m: n for m, n in (s.get("family_drops") or {}).items() if n and m in methods}
    samples = (s.get("samples") or {}).get("n", 1)               # the records pool every repeated sample
    each = lambda n: "-" if n is None else n // samples
    if drops:                   # each method over the test groups it rewrote
        lines.append("Test instances per method (groups where build-bench's gate refused every rewrite of a method "
                     "have none of it; the refusals count the groups of both splits): " + ", ".join(
                         f"{m} {each(seen[m].get('n'))} (refused on {drops.get(m, 0)} groups)" for m in methods)
                     + ".\n")
    unseen = {m for m in methods if not seen[m]["seen"]}
    conds = list(s["methods"])
    note = figure_note(s.get("notes"))
    atomic_write(os.path.join(figs, "per_method_asr.svg"), svg_bars(
        "ASR by GEO method (dashed outline: unseen)", methods, conds,
        {(m, k): s["methods"][k][m]["ASR"] for m in methods for k in conds}, dashed=unseen, xlabel="GEO method",
        ylabel="ASR (%)", note=note))
    atomic_write(os.path.join(figs, "conditions.svg"), svg_bars(
        "ASR / ASI / BER by condition", list(c), ["ASR", "ASI", "BER"],
        {(k, m): c[k][m] for k in c for m in ("ASR", "ASI", "BER")}, xlabel="condition",
        ylabel="ASR / ASI / BER (%)", note=note))
    lines.append("![per method](figures/per_method_asr.svg) ![conditions](figures/conditions.svg)\n")
    if "Non-Defense" in s["methods"]:
        # Fig. 3 (b): Attack Influence Reduction, the relative ASI reduction from Non-Defense per method
        # (panel (a), Attack Defense Success, is 100 - ASR of the table above)
        nd = s["methods"]["Non-Defense"]
        air = {(m, k): (100 * (nd[m]["ASI"] - s["methods"][k][m]["ASI"]) / nd[m]["ASI"]
                        if nd[m]["ASI"] else float("nan"))
               for m in methods for k in conds if k != "Non-Defense"}
        others = [k for k in conds if k != "Non-Defense"]
        lines.append("## Fig. 3 (b): Attack Influence Reduction (%), 100 (ASI_Non-Defense - ASI) / ASI_Non-Defense "
                     "per GEO method; higher is stronger; unseen methods marked *\n")
        lines.append(_table(["Condition"] + [m + ("" if nd[m]["seen"] else "*") for m in methods],
                            [[k] + [fmt(air[m, k]) for m in methods] for k in others]) + "\n")
        atomic_write(os.path.join(figs, "per_method_air.svg"), svg_bars(
            "Attack Influence Reduction by GEO method (dashed outline: unseen)", methods, others,
            air, dashed=unseen, colors=[COLORS[conds.index(k) % len(COLORS)] for k in others],
            xlabel="GEO method", ylabel="Attack Influence Reduction (%)", note=note))
        lines.append("![attack influence reduction](figures/per_method_air.svg)\n")
    return lines


def _appendix_lines(s, figs):
    """Table C.1 (pairwise quality), Table B.2 (PPL-Filter), Fig. 5 (epochs), Table C.2 row (transfer)."""
    lines = []
    if s.get("quality"):
        q = s["quality"]
        lines.append("## Table C.1: pairwise answer quality of GEO Defender vs the clean reference\n")
        lines.append(_table(["Mean change", "95% CI (query-cluster bootstrap)", "Comparable or better (%)",
                             "Better (%)", "n", "defended as A"],
                            [[f"{q['mean_change']:+.3f}", f"[{q['ci95'][0]:+.3f}, {q['ci95'][1]:+.3f}]",
                              fmt(q["comparable_or_better"]), fmt(q["better"]), q["n"], q["defended_as_a"]]]
                            if q.get("n") else [["-", "-", "-", "-", 0, q["defended_as_a"]]]) + "\n")
        if q.get("judge_failed"):
            lines.append(f"Pairwise judge failures (left out of Table C.1): {q['judge_failed']}.\n")
        if q.get("no_answer"):
            lines.append(f"Comparisons without an answer (the defended one or the clean reference failed; left out "
                         f"of Table C.1): {q['no_answer']}.\n")
    if s.get("quality_defenses"):
        qd = s["quality_defenses"]
        lines.append("## Table C.1 for the injection defenses: pairwise answer quality vs the clean reference\n")
        lines.append(_table(["Condition", "Mean change", "95% CI (query-cluster bootstrap)",
                             "Comparable or better (%)", "Better (%)", "n", "judge failed"],
                            [[k, f"{q['mean_change']:+.3f}", f"[{q['ci95'][0]:+.3f}, {q['ci95'][1]:+.3f}]",
                              fmt(q["comparable_or_better"]), fmt(q["better"]), q["n"], q["judge_failed"]]
                             if q.get("n") else [k, "-", "-", "-", "-", 0, q["judge_failed"]]
                             for k, q in qd.items()]) + "\n")
        if any(q.get("no_answer") for q in qd.values()):
            lines.append("Comparisons without an answer (left out of n): " + ", ".join(
                f"{k} {q['no_answer']}" for k, q in qd.items() if q.get("no_answer")) + ".\n")
    if s.get("ppl_filter"):
        p = s["ppl_filter"]
        lines.append("## Table B.2: PPL-Filter diagnostics\n")
        lines.append(_table(["Statistic", "Value"], [
            ["threshold (PPL)", fmt(p["threshold"])], ["test instances", p["test_instances"]],
            ["attack documents in base top-k", p["attack_in_base_topk"]],
            ["attack documents flagged", p["attack_flagged"]],
            ["attack documents in PPL-Filter top-k", p["attack_in_ppl_topk"]],
            ["attack removed from top-k", p["attack_removed"]], ["attack newly introduced", p["attack_introduced"]],
            ["benign flagged", f"{p['benign_flagged']}/{p['benign_total']}"]]) + "\n")
    if s.get("epochs"):
        e = s["epochs"]
        xs = list(e)
        lines.append("## Fig. 5: GEO Defender by library epoch\n")
        lines.append(_table(["Epoch", "ASR", "ASI", "BER"], [[t, fmt(e[t]["ASR"]), fmt(e[t]["ASI"]), fmt(e[t]["BER"])]
                                                            for t in xs]) + "\n")
        atomic_write(os.path.join(figs, "epochs.svg"), svg_lines(
            "GEO Defender by TFSG epoch", xs, {"ASR": [e[t]["ASR"] for t in xs], "ASI": [e[t]["ASI"] for t in xs]},
            xlabel="TFSG library epoch", ylabel="ASR / ASI (%)", note=figure_note(s.get("notes"))))
        lines.append("![epochs](figures/epochs.svg)\n")
    if s.get("transfer"):
        lines.append("## Table C.2 row: libraries from other runs applied to this target\n")
        lines.append(_table(["Source library", "ASR", "ASI"], [[k, fmt(v["ASR"]), fmt(v["ASI"])]
                                                                for k, v in s["transfer"].items()]) + "\n")
    return lines


def gap_text(g):
    """A paired gap (metrics.paired_gap) as "+x.x [lo, hi]", "-" where there is none; over one group, no CI."""
    if g["gap"] is None:
        return "-"
    ci = g.get("gap_ci")
    return f"{g['gap']:+.1f} " + (f"[{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "[one group: no CI]")


def ci_cell(b, m):
    """A metric of block b with its CI, "v [lo, hi]", or "-" when b lacks it."""
    return f"{b[m]:.2f} [{b[m + '_ci'][0]:.2f}, {b[m + '_ci'][1]:.2f}]" if m in b else "-"


def against_k(path, title, blocks, metric, ylabel, note, chance=None):
    """figures/<path>: `metric` of each series against the number of attacked documents a list holds, and with
    `chance` (a block key: chance_any_in_topk) the rate of a random top k, which rises with K alone.
    blocks: {series: {"K": block}}."""
    ks = sorted({kk for b in blocks.values() for kk in b}, key=int)
    series = {name: [b.get(kk, {}).get(metric) for kk in ks] for name, b in blocks.items()}
    if chance:
        series["chance (a random top k)"] = [next((b[kk].get(chance) for b in blocks.values() if kk in b), None)
                                             for kk in ks]
    atomic_write(path, svg_lines(title, ks, series, xlabel="attacked documents in the list (K)", ylabel=ylabel,
                                 note=note))


def attacked_lines(s, figs):
    """Every condition against K on a benchmark with several attacked documents a list (summary.json's
    by_attacked): the table and figures/attacked_asr.svg and attacked_exposure.svg."""
    b = s.get("by_attacked")
    if not b:
        return []
    note = figure_note(s.get("notes"))
    against_k(os.path.join(figs, "attacked_asr.svg"), "ASR against the number of attacked documents", b, "ASR",
              "ASR: any attacked document cited (%)", note)
    against_k(os.path.join(figs, "attacked_exposure.svg"), "Exposure against the number of attacked documents", b,
              "exposure", "any attacked document in the context (%)", note, chance="chance_any_in_topk")
    rows = [[c, kk, v["n"], ci_cell(v, "source_ASR"), ci_cell(v, "ASR"), ci_cell(v, "mean_ASR"),
             ci_cell(v, "source_exposure"), ci_cell(v, "exposure"), fmt(v.get("chance_any_in_topk")),
             ci_cell(v, "mean_exposure"), ci_cell(v, "topk_attack_share"), fmt(v.get("chance_topk_share")),
             ci_cell(v, "citation_share")]
            for c, per in b.items() for kk, v in per.items()]
    return ["## Against the number of attacked documents a list holds\n",
            "Each test list at K = 1.. the file's K attacked documents (the source's rewrite and the first K-1 "
            "further ones). The tables above are the paper's lists (K = 1). Here, per K: the source's rewrite "
            "cited and in the context; any attacked document cited and in the context, beside the chance that a "
            "random top k holds one (1 - C(n-K, k)/C(n, k)); each attacked document on average (a given "
            "document is in a random top k with chance k/n); the shares of the top k (beside a random top k's, "
            "K/n) and of the citations the attacked documents take (over the answers that cite something). 95% "
            "query-cluster bootstrap CIs; each K's n counts the answers (the instances, groups x families, with K "
            "attacked documents, times --samples), over the groups that reach every K. The Shield is trained on "
            "lists with one attacked document, as the paper trains it.\n",
            _table(["Condition", "K", "n", "Source cited (%)", "Any cited (%)", "Each cited (%)",
                    "Source in context (%)", "Any in context (%)", "Chance, any (%)", "Each in context (%)",
                    "Top-k share (%)", "Chance, share (%)", "Citation share (%)"], rows) + "\n",
            "![ASR against K](figures/attacked_asr.svg)\n",
            "![exposure against K](figures/attacked_exposure.svg)\n"]


def defense_lines(s):
    """What PromptArmor's remover cut and how RobustRAG's aggregation went (summary.json's defenses)."""
    d, lines = s.get("defenses") or {}, []
    if d.get("PromptArmor"):
        p = d["PromptArmor"]
        lines.append("## PromptArmor: what the remover cut\n")
        lines.append(_table(["Statistic", "Value"], [
            ["documents screened", p["documents"]], ["attack documents in the top-k", p["attack_in_context"]],
            ["attack documents cut from", p["attack_cut"]], ["attack documents emptied", p["attack_emptied"]],
            ["benign documents cut from (false positives)", p["benign_cut"]],
            ["quoted passages not found in the document", p["passages_not_found"]],
            ["characters cut", p["chars_removed"]]]) + "\n")
    if d.get("RobustRAG"):
        r = d["RobustRAG"]
        lines.append("## RobustRAG: keyword aggregation\n")
        lines.append(_table(["Statistic", "Value"], [
            ["queries", r["queries"]], ["answered \"I don't know.\" (every isolated answer abstained)",
                                        r["abstained_queries"]],
            ["isolated answers that abstained", f"{r['isolated_abstained']}/{r['isolated_answers']}"],
            ["kept phrases per query", fmt(r["kept_phrases_per_query"])],
            ["attack documents in the top-k", r["attack_in_context"]],
            ["... whose isolated answer supports a kept phrase (the answer cites it where it uses one)",
             r.get("attack_supports_a_kept_phrase", r.get("attack_supports_a_cited_phrase"))]]   # (its name before)
            # the measured ASR beside our keyword certificate (defenses.keyword_certified): the thresholded keyword
            # set unchanged, which bounds neither the citations nor the ASR
            + ([["ASR (%, measured)", fmt(r["ASR"])]] + [
                [f"keyword set unchanged by {kk} corrupted passage(s) (% of queries; ours, after RobustRAG's)", fmt(v)]
                for kk, v in r["certified"].items()] if "certified" in r else [])) + "\n")
    return lines


def rerank_stage_lines(s):
    """The reranker-stage table (rerank-eval): exposure@k, attack rank, promotion, clean top-k kept,
    overall and for seen / unseen methods, with 95% cluster-bootstrap CIs."""
    stage, k = s.get("rerank_stage"), s.get("rerank_stage_k", 5)
    if not stage:
        return []
    honest = any(v.get("honest") for v in stage.values())   # a benchmark with honest edits: two more columns
    rows = [[label, part, b.get("n", 0), ci_cell(b, "exposure"), ci_cell(b, "mean_attack_rank"),
             ci_cell(b, "promotion"), ci_cell(b, "clean_topk_kept")]
            + ((honest_cells(v.get("honest"), "attack_demotion") if part == "all" else ["", ""]) if honest else [])
            for label, v in stage.items() for part, b in (("all", v["overall"]), ("seen", v["seen"]),
                                                          ("unseen", v["unseen"])) if b.get("n")]
    return [f"## Reranker stage under GEO attack (no LLM): k = {k}\n",
            "Exposure@k: the attack document in the top k (%); attack rank: 1-based; promotion: the source "
            "document's rank in the clean list minus the attack's; clean kept: % of the base reranker's clean "
            "top-k a reranker keeps. 95% query-cluster bootstrap CIs.\n",
            _table(["Reranker", "Methods", "n", f"Exposure@{k} (%)", "Attack rank", "Promotion", "Clean kept (%)"]
                   + (["Honest penalty (%)", "Attack demoted (%)"] if honest else []), rows) + "\n"] \
        + rerank_strength_lines(stage, k) + rerank_by_k_lines(stage, k) + certificate_lines(stage, k) \
        + (honest_lines(s, "rerank") if honest else [])


def rerank_strength_lines(stage, k):
    """Each family's strength at the reranker stage under each reranker (rerank_eval.family_strength)."""
    said = lambda v: "" if v["raises"] else f" ({NOT_SHOWN}: CI holds 0)" if v["holds_zero"] else " (lowers it)"
    rows = [[label, m, f"{v['gain']:+.1f}" + said(v),
             f"[{v['ci'][0]:+.1f}, {v['ci'][1]:+.1f}]", v["n"]]
            for label, st in stage.items() for m, v in st.get("strength", {}).items()]
    if not rows:
        return []
    return [f"Attack strength at the reranker stage: exposure@{k} of each family's rewrite minus its source's on "
            "the same group's clean list, percentage points, 95% query-cluster bootstrap CI (the paper's lists, "
            "one attacked document).\n",
            _table(["Reranker", "Family", "Gain (points)", "95% CI", "n"], rows) + "\n"]


def rerank_by_k_lines(stage, k):
    """Each reranker against the number of attacked documents a list holds (rerank_stage's by_attacked)."""
    rows = [[label, kk, v["n"], ci_cell(v, "exposure"), ci_cell(v, "any_exposure"), fmt(v.get("chance_any_in_topk")),
             ci_cell(v, "mean_exposure"), ci_cell(v, "topk_attack_share"), fmt(v.get("chance_topk_share"))]
            for label, st in stage.items() for kk, v in st.get("by_attacked", {}).items()]
    if not rows:
        return []
    return [f"Against the number of attacked documents a list holds (the table above: K = 1, the paper's lists): "
            f"exposure@{k} of the source's rewrite, of any attacked document beside the chance that a random top "
            f"{k} holds one (1 - C(n-K, k)/C(n, k)), of each attacked document on average (a given document is "
            f"in a random top {k} with chance {k}/n), and the share of the top k they take beside a random top "
            f"k's (K/n); 95% query-cluster bootstrap CIs, each K's n the instances (groups x families) with K "
            "attacked documents.\n",
            _table(["Reranker", "K", "n", f"Source exposed@{k} (%)", f"Any exposed@{k} (%)", "Chance, any (%)",
                    f"Each exposed@{k} (%)", "Top-k share (%)", "Chance, share (%)"], rows) + "\n"]


def certificate_lines(stage, k):
    """rerank-eval --certify's tables: each local reranker's certificate block (rerank_eval.certify_summary)."""
    blocks = [(label, c) for label, st in stage.items() for c in [st.get("certificate")] if c]
    old = [label for label, c in blocks if "rewrite_certified" not in c]     # certified by an older version
    blocks = [(label, c) for label, c in blocks if "rewrite_certified" in c]
    note = [f"Certificates of {', '.join(old)} are in an older format: run rerank-eval --certify again.\n"] \
        if old else []
    if not blocks:
        return note
    radii = list(next(iter(blocks))[1]["rewrite_certified"])
    head = [f"r = {r}" for r in radii]
    cert = [[label, kind] + [fmt(c["certified"][kind][r]) for r in radii] for label, c in blocks
            for kind in c["certified"]]
    cert += [[label, "rewrite, inserted"] + [fmt(c["rewrite_certified"][r]) for r in radii] for label, c in blocks]
    kept = [[label] + [fmt(c["clean_kept_certified"][r]) for r in radii] for label, c in blocks]
    cost = [[label, c["samples"], f"{c['deletion_rate']:g}", f"{c['eps']:.3f}",
             f"{fmt(c['exposure'])} / {fmt(c['smoothed_exposure'])}",
             f"{fmt(c.get('clean_topk_kept'))} / {fmt(c.get('smoothed_clean_topk_kept'))}",
             f"{c['ndcg_smoothed_clean']:.3f}", fmt(c["rewrites_inside"]), c["inserted_median"],
             c["forward_passes"], f"{c['seconds']:.1f}"] for label, c in blocks]
    return [f"Certified top-{k} (rerank-eval --certify, randomized deletion, certify.py): % of attacked documents "
            f"that no edit of r words of the kind named can bring into the smoothed top {k}, at 95% confidence "
            "over each list: the source as the attacker finds it (its clean list), and the benchmark's rewrite "
            "against further insertions.\n",
            _table(["Reranker", "edit"] + head, cert) + "\n",
            f"% of clean top-{k} documents that no insertion of r words into the source can push out:\n",
            _table(["Reranker"] + head, kept) + "\n",
            "What the smoothing costs and takes: exposure and clean top-k kept, plain / smoothed; nDCG@k of the "
            "smoothed clean list against the plain one; % of the benchmark's rewrites whose own edit (inserted "
            "and deleted words along a longest common subsequence) lies inside their source's certificate; "
            "forward passes and seconds this run scored.\n",
            _table(["Reranker", "samples", "p_del", "eps", f"Exposure@{k} (%)", "Clean kept (%)", f"nDCG@{k}",
                    "Rewrites inside (%)", "Median inserted words", "Forward passes", "Seconds"], cost) + "\n"] + note


def write_rerank_report(run_dir, s):
    """rerank_report.md and figures/rerank_exposure.svg (exposure by GEO method, one bar per reranker)."""
    figs = os.path.join(run_dir, "figures")
    stage, k = s["rerank_stage"], s.get("rerank_stage_k", 5)
    labels = list(stage)
    methods = list(next(iter(stage.values()))["per_method"])
    unseen = {m for m in methods if not next(iter(stage.values()))["per_method"][m]["seen"]}
    atomic_write(os.path.join(figs, "rerank_exposure.svg"), svg_bars(
        f"Exposure@{k} by GEO method (dashed outline: unseen)", methods, labels,
        {(m, lb): stage[lb]["per_method"][m].get("exposure") for m in methods for lb in labels},
        dashed=unseen, xlabel="GEO method", ylabel=f"exposure@{k} (%)", note=figure_note(s.get("notes"))))
    lines = _title(run_dir, s, "Reranker stage under GEO attack")
    lines += rerank_stage_lines(s)
    lines.append(_table(["Reranker"] + [m + ("*" if m in unseen else "") for m in methods],
                        [[lb] + [fmt(stage[lb]["per_method"][m].get("exposure")) for m in methods]
                         for lb in labels]) + "\n")
    lines.append("Exposure@k (%) by GEO method; unseen methods marked *. A random top k of the n candidates holds "
                 "a given document with chance k/n (50% for 5 of 10).\n")
    lines.append("![exposure](figures/rerank_exposure.svg)\n")
    if any(stage[lb].get("by_attacked") for lb in labels):
        against_k(os.path.join(figs, "rerank_attacked.svg"), f"Exposure@{k} of any attacked document against K",
                  {lb: stage[lb]["by_attacked"] for lb in labels if stage[lb].get("by_attacked")}, "any_exposure",
                  f"any attacked document in the top {k} (%)", figure_note(s.get("notes")),
                  chance="chance_any_in_topk")
        lines.append("![exposure against K](figures/rerank_attacked.svg)\n")
    lines += [f"Reranker `{lb}`: `{stage[lb]['spec']}`." for lb in labels] + [""]
    lines += usage_lines(s.get("usage") or {})
    atomic_write(os.path.join(run_dir, "rerank_report.md"), "\n".join(lines))


def write_attack_report(run_dir, s):
    """attack_report.md and figures/attack_<target>_<mode>.svg: exposure and ASR against the budget, one
    line per condition (B = 1 is the static attack), the gate's verdicts and the attacker's cost."""
    figs = os.path.join(run_dir, "figures")
    lines = _title(run_dir, s, "Adaptive GEO attacker")
    lines.append("Each budget's documents replace the static attack (B = 1 is the attacker's start: the "
                 "benchmark's own rewrite, or the source itself where the section says so); exposure: the attack "
                 "document in the top k (%).\n")
    for target, modes in s.get("attack", {}).items():
        for mode, b in modes.items():
            xs = list(b["budgets"])
            conds = list(next(iter(b["budgets"].values()))["conditions"])
            aware = mode.split("-")[0]
            start = ("the source itself, unattacked" if b.get("start", "source") == "source" else
                     "the benchmark's rewrite")
            how = (f" (diagnose-and-repair, AgentGEO: one targeted repair a candidate, small edits; B = 1 is {start})"
                   if b.get("algorithm") == "repair" else "")
            lines.append(f"## Target `{target}` ({b['target']}), attacker {aware} of the library{how}\n")
            transfer = (" Optimised against the base reranker: the Shield conditions are the transfer case."
                        if target == "base" else "")
            lines.append(f"Attacker `{b['attacker']}`, fidelity judge `{b['judge']}`, {b['rounds']} rounds of "
                         f"{b['per_round']} candidates.{transfer}\n")
            lines.append(_table(["Budget"] + [f"{c} {m}" for c in conds for m in ("exposure", "ASR")],
                                [[f"B={x}"] + [fmt(b["budgets"][x]["conditions"][c][m]) for c in conds
                                                for m in ("exposure", "ASR")] for x in xs]) + "\n")
            lines += _counts("Answers that never came (cite nothing: counted as not citing the attack): ",
                             {f"{c} at B={x}": b["budgets"][x]["conditions"][c] for x in xs for c in conds},
                             "answer_failed")
            # exposure depends only on the ranking: one line for the base top-k, one for the Shield's
            ranked = {"base top-k (Non-Defense, TFSG only, injection defenses)": "Non-Defense",
                      "Shield top-k (Shield only, GEO Defender)": "Shield only"}
            plots = {"exposure": {k: [b["budgets"][x]["conditions"][c]["exposure"] for x in xs]
                                  for k, c in ranked.items() if c in conds},
                     "asr": {c: [b["budgets"][x]["conditions"][c]["ASR"] for x in xs] for c in conds}}
            ylabel = {"exposure": "exposure", "asr": "ASR"}
            for what, series in plots.items():
                name = f"attack_{target}_{mode}_{what}.svg"
                atomic_write(os.path.join(figs, name), svg_lines(
                    f"Adaptive attack on {target} ({mode}): {ylabel[what]} by budget", [f"B={x}" for x in xs], series,
                    xlabel="attacker budget B (candidates)", ylabel=f"{ylabel[what]} (%)",
                    note=figure_note(s.get("notes"))))
                lines.append(f"![{target} {mode} {what}](figures/{name})")
            caught = [(x, b["budgets"][x]["detected"]) for x in xs if "detected" in b["budgets"][x]]
            if caught:            # the run's detectors (detect) on the attacker's final documents
                lines.append("Flagged by the run's detectors at their thresholds (detect), % of the final "
                             "documents: " + "; ".join(f"B={x}: " + ", ".join(f"{d} {v:.1f}" for d, v in c.items())
                                                       for x, c in caught) + ".\n")
            lines.append("")
            total = sum(b["gate"].values())
            lines.append("Fidelity gate over the attacker's candidates: " + ", ".join(
                f"{k} {v} ({100 * v / total:.1f}%)" for k, v in b["gate"].items()) + ".\n")
            c = b["cost"]
            lines.append(f"Cost of this attack: {c['attacker']['calls']} attacker calls ({c['attacker']['http_calls']}"
                         " sent by the invocation that finished it: a resumed attack's earlier replies come from the "
                         "cache, and the run folder's usage below counts every invocation), "
                         f"{(c['judge'] or {}).get('calls', 0)} fidelity judge calls, "
                         + (f"{c['engine']['calls']} engine answers, " if c.get("engine") else "")
                         + f"{c['reranker_queries']} reranker queries, {c['candidates']} candidates.\n")
    lines += usage_lines(s.get("usage") or {})
    atomic_write(os.path.join(run_dir, "attack_report.md"), "\n".join(lines))


def usage_lines(u):
    """The run folder's LLM and reranker cost over all its invocations (summary.json's usage), a
    table by stage and model."""
    if not u.get("stages"):
        return []
    cols = [("prompt_tokens", "Prompt tokens"), ("completion_tokens", "Completion tokens"),
            ("documents", "Reranked documents"), ("search_units", "Search units")]
    cols = [(k, name) for k, name in cols if k in u["total"]]
    money = lambda c: "" if c is None else f"{c:.4f}"
    rows = [[stage, model, v["replies"]] + [v.get(k, "") for k, _ in cols] + [money(v["cost_usd"])]
            for stage, models in u["stages"].items() for model, v in models.items()]
    t = u["total"]
    rows.append(["total", "", t["replies"]] + [t.get(k, "") for k, _ in cols] + [money(t["cost_usd"])])
    return ["## Usage of this run folder (all invocations; cached replies cost nothing)\n",
            _table(["Stage", "Model", "Replies"] + [name for _, name in cols] + ["USD"], rows) + "\n"]


def read_summaries(run_dirs):
    """compare's runs -> {name: summary.json}, each named by its folder (by its path when two folders share a
    name: runs/x under two parents are both kept); a run without one refused naming the command."""
    names = [os.path.basename(os.path.normpath(r)) for r in run_dirs]       # runs/a/ is named a
    out = {}
    for r, name in zip(run_dirs, names):
        if not os.path.isfile(os.path.join(r, "summary.json")):
            raise FileNotFoundError(f"{r}/summary.json: missing; run `python run.py eval` for that run first")
        s = read_json(os.path.join(r, "summary.json"))
        if not isinstance(s, dict) or "conditions" not in s or "target_llm" not in s:    # rerank-eval's or attack's
            raise JSONFileError(f"{r}/summary.json: no evaluation in it; run `python run.py eval` for that run first")
        out[r if names.count(name) > 1 else name] = s
    return out


def write_comparison(out_dir, summaries):
    """Across runs (one per target LLM): Table 1 with an average row, Table C.1, and the transfer
    matrix of Table C.2 (rows: source library, columns: target) from each run's `transfer` results."""
    lines = []
    notes = sorted({n for s in summaries.values() for n in s.get("notes", [])})
    if notes:
        lines.append("> **OFFLINE / SIMULATION RUNS INCLUDED.** " + " ".join(notes) + "\n")
    # every K's lists (test_lists, or test_instances where the file has one level): what the digest covers
    sets = {name: (s.get("test_set_sha1"), s.get("test_lists") or s.get("test_instances"))
            for name, s in summaries.items()}
    if len(set(sets.values())) > 1:   # the averages and the transfer matrix would mix test sets (older: no digest)
        lines.append("> **DIFFERENT TEST SETS.** These runs were not evaluated on the same instances ("
                     + ", ".join(f"{k}: {n} instances, {d[:10] if d else 'no digest recorded'}"
                                 for k, (d, n) in sets.items())
                     + "); their rows are not comparable and the averages mix them.\n")
    ks = {name: s.get("k") for name, s in summaries.items()}
    if len(set(ks.values())) > 1:       # exposure, ASR and BER all depend on how many documents the LLM reads
        lines.append("> **DIFFERENT TOP-K.** These runs gave their LLMs different numbers of documents ("
                     + ", ".join(f"{name}: {k or 'not recorded'}" for name, k in ks.items())
                     + "); their rows are not comparable and the averages mix them.\n")
    judges = {name: s.get("judge") for name, s in summaries.items()}
    if len(set(judges.values())) > 1:   # ASI and quality are the judge's numbers
        lines.append("> **DIFFERENT JUDGES.** These runs' ASI and answer quality were scored by different models ("
                     + ", ".join(f"{k}: {v or 'not recorded'}" for k, v in judges.items())
                     + "); their ASI and Table C.1 are not comparable.\n")
    lines.append("# GEO Defender across target LLMs\n")
    targets = [s["target_llm"] for s in summaries.values()]
    label = {name: s["target_llm"] if targets.count(s["target_llm"]) == 1 else f"{s['target_llm']} ({name})"
             for name, s in summaries.items()}          # two runs of one target: told apart by their run
    every = ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender", "Shield only", "TFSG only",
             "Spotlighting", "Sandwich Prompt", "PromptArmor", "RobustRAG")
    conds = [c for c in every if all(c in s["conditions"] for s in summaries.values())]
    left = {name: [c for c in s["conditions"] if c not in conds] for name, s in summaries.items()}
    head = ["Target LLM"] + [f"{c} {m}" for c in conds for m in ("ASR", "ASI", "BER")]
    rows = [[label[name]] + [fmt(s["conditions"][c][m]) for c in conds for m in ("ASR", "ASI", "BER")]
            for name, s in summaries.items()]
    avg = ["Average"] + [fmt(sum(s["conditions"][c][m] for s in summaries.values()) / len(summaries))
                         for c in conds for m in ("ASR", "ASI", "BER")]
    lines.append("## Table 1\n\n" + _table(head, rows + [avg]) + "\n")
    if any(left.values()):     # a condition some runs lack has no average; a deployed one no column
        lines.append("Left out, not in every run (or deployed): " + "; ".join(
            f"{label[name]}: {', '.join(cs)}" for name, cs in left.items() if cs) + ".\n")
    q = [(label[name], s["quality"]) for name, s in summaries.items() if s.get("quality", {}).get("n")]
    if q:
        quality_head = ["Target LLM", "Mean change", "95% CI", "Comparable or better (%)", "Better (%)"]
        quality_rows = [[t, f"{v['mean_change']:+.3f}", f"[{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]",
                         fmt(v["comparable_or_better"]), fmt(v["better"])] for t, v in q]
        mean = lambda key: sum(v[key] for _, v in q) / len(q)            # the targets' mean, as Table 1's
        quality_rows.append(["Average", f"{mean('mean_change'):+.3f}", "-", fmt(mean("comparable_or_better")),
                             fmt(mean("better"))])
        lines.append("## Table C.1\n\n" + _table(quality_head, quality_rows) + "\n")
    # Table C.2: a row per source library, named by its run (a --transfer name names the run whose library it
    # is; a target label such as openai:gpt-5.5 is no --transfer name), a column per target
    cells = {(name if src == "(own)" else src, label[name]): v
             for name, s in summaries.items() for src, v in (s.get("transfer") or {}).items()}
    if cells:
        srcs = sorted({k[0] for k in cells})
        cols = list(label.values())
        for metric in ("ASR", "ASI"):
            vals = {k: v[metric] for k, v in cells.items()}
            lines.append(f"## Table C.2 ({metric}): rows = source library, columns = target\n\n" +
                         _table(["Source \\ Target"] + cols,
                                [[r] + [fmt(vals.get((r, c))) for c in cols] for r in srcs]) + "\n")
            atomic_write(os.path.join(out_dir, "figures", f"transfer_{metric.lower()}.svg"), svg_heatmap(
                f"Transfer {metric} (source library x target LLM)", srcs, cols, vals,
                xlabel="target LLM", ylabel="source library", note=figure_note(notes)))
        lines.append("![transfer ASR](figures/transfer_asr.svg) ![transfer ASI](figures/transfer_asi.svg)\n")
    path = os.path.join(out_dir, "comparison.md")
    atomic_write(path, "\n".join(lines))
    return path


HARDEN_THREAT = (
    "Threat model: the adaptive attacker of `attack` (one document's text, its facts kept by the fidelity gate, "
    "the deployed Shield as a score oracle, the TFSG library read unless `--unaware`) moves second; the "
    "provider moves third, retraining the Shield on the construction set plus the pool of every round's "
    "survivors (each beside its group's benign list) and growing the library by one update batch. The test "
    "groups are never attacked for training; each round is measured with a fresh attacker (a seed no training "
    "round used) and with the round-0 attacker (stale).")


ALGORITHM_NAMES = {"mageo": "MAGEO's loop", "repair": "diagnose-and-repair (AgentGEO)"}


def harden_cells(r, top):
    """One round's figures by name, as harden_report.md's table and its figures both read them: the fresh
    attacker at budget `top`, the stale one (None at round 0, which has none: "-" in the table, no point
    in the figure), the static families, and utility. Exposure under the Shield only, ASR under GEO Defender."""
    fresh, st, static = r["fresh"][top], r.get("stale"), r["static"]
    return {"fresh exposure": fresh["Shield only"]["exposure"], "fresh ASR": fresh["GEO Defender"]["ASR"],
            "stale exposure": st["Shield only"]["exposure"] if st else None,
            "stale ASR": st["GEO Defender"]["ASR"] if st else None,
            "static exposure": static["Shield only"]["exposure"], "static ASR": static["GEO Defender"]["ASR"],
            "clean top-k kept": r["clean_topk_kept"], "BER (GEO Defender)": static["GEO Defender"]["BER"],
            "BER (Shield only)": static["Shield only"]["BER"]}


def harden_detector_lines(rounds):
    """The run's detectors (detect) at their thresholds in each hardening round, with the round's Shield for
    the residual: % of the fresh attacker's final documents flagged per budget, and the FPR on the test honest
    edits; nothing for rounds measured without a detector."""
    caught = [(r["round"], r["detected"]) for r in rounds if r.get("detected")]
    if not caught:
        return []
    budgets = list(caught[0][1]["fresh"])
    names = list(caught[0][1]["fresh"][budgets[0]])
    return ["Detectors (detect, at the run's thresholds, each round's Shield for the residual): % of the fresh "
            "attacker's final documents flagged at each budget, and the FPR on the test honest edits (does it hold "
            "across rounds?).\n",
            _table(["round"] + [f"{d} B={x}" for d in names for x in budgets] + [f"{d} FPR honest" for d in names],
                   [[f"r{k}"] + [fmt(c["fresh"][x][d]) for d in names for x in budgets]
                    + [fmt((c["fpr_honest"] or {}).get(d)) for d in names] for k, c in caught]) + "\n"]


def write_harden_report(run_dir, s):
    """harden_report.md and figures/harden_*.svg: by round, the fresh and stale attackers' exposure and ASR,
    the static families, utility (clean top-k kept, BER), the cross-play matrix and the cost."""
    b = s["harden"]
    figs = os.path.join(run_dir, "figures")
    lines = _title(run_dir, {"notes": b.get("notes")}, "Hardening rounds") + [HARDEN_THREAT + "\n"]
    train_alg = b.get("settings", {}).get("algorithm", "mageo")
    test_alg = b.get("settings", {}).get("test_algorithm") or train_alg
    lines.append(f"Attacker algorithms: training rounds {ALGORITHM_NAMES[train_alg]}, fresh test attacker "
                 f"{ALGORITHM_NAMES[test_alg]}: "
                 + ("**in-distribution** (the test attacker runs the training rounds' algorithm with another seed, "
                    "the easy case for the defender; `--test-algorithm repair` tests another)."
                    if test_alg == train_alg else "out of distribution (an algorithm no training round used).") + "\n")
    rounds, k, note = b["rounds"], b["k"], figure_note(b.get("notes"))
    top = max(rounds[0]["fresh"], key=int)
    xs = [f"r{r['round']}" for r in rounds]
    cells = [harden_cells(r, top) for r in rounds]
    rows = [[r["round"], r.get("survivors", "-"), r.get("pool", "-")]
            + [fmt(c[n]) for n in ("fresh exposure", "fresh ASR", "stale exposure", "stale ASR", "static exposure",
                                  "static ASR")]
            + [fmt(c["clean top-k kept"], 1), fmt(c["BER (GEO Defender)"]), r["cost"]["replies"],
               fmt(r["cost"]["usd"], 4)]
            for r, c in zip(rounds, cells)]
    lines.append(_table(["Round", "Survivors", "Pool", f"Fresh B={top} exposure@{k}", f"Fresh B={top} ASR",
                         "Stale exposure", "Stale ASR", "Static exposure", "Static ASR", "Clean top-k kept",
                         "BER (static)", "LLM replies", "USD"], rows) + "\n")
    lines += _counts("Answers that never came (cite nothing: counted as not citing the attack): ", {
        f"r{r['round']} {part} {c}": blk for r in rounds for part, blocks in (
            (f"fresh B={top}", r["fresh"][top]), ("stale", r.get("stale") or {}), ("static", r["static"]))
        for c, blk in blocks.items()}, "answer_failed")
    lines.append("Exposure: the attack document in the Shield's top-k (%)"
                 + (f", against {fmt(b['chance_in_topk'])}% for a random top k" if "chance_in_topk" in b else "")
                 + "; ASR: under GEO Defender (Shield top-k and the round's library). Fresh: an attacker of its own "
                 "seed at each round; stale: round 0's."
                 + (f" Every round measures the same {b['test_instances']} instances of {b['test_groups']} test "
                    "groups; the table's figures are point estimates, their change from round 0 is read with its "
                    "interval below." if "test_groups" in b else "") + "\n")
    paired = [(r["round"], r["vs_round_0"]) for r in rounds if r.get("vs_round_0")]
    if paired:              # the same test groups every round: the change, paired per group, one CI a round
        lines.append(f"Fresh B={top} attacker against round 0's, paired per test group (95% CI over groups, one a "
                     "round): " + "; ".join(f"r{k} exposure {gap_text(v['exposure'])}, ASR {gap_text(v['ASR'])}"
                                            for k, v in paired) + ".\n")
    plot = lambda names: {n: [c[n] for c in cells] for n in names}
    for name, title, series, ylabel in (
            ("harden_attack.svg", f"Attackers by round (B={top})",
             plot(("fresh exposure", "stale exposure", "fresh ASR", "stale ASR")), f"exposure@{k} / ASR (%)"),
            ("harden_utility.svg", "Utility by round", {("static " + n if n.startswith("BER") else n): v for n, v in
                                                         plot(("clean top-k kept", "BER (GEO Defender)",
                                                               "BER (Shield only)")).items()},
             "clean top-k kept / static BER (%)")):
        atomic_write(os.path.join(figs, name), svg_lines(title, xs, series, xlabel="hardening round", ylabel=ylabel,
                                                         note=note))
        lines.append(f"![{title}](figures/{name})")
    m = b["crossplay"]["exposure"]
    lines += ["", f"## Cross-play: exposure@{k} (%), defense round by attacker round\n",
              "Each round's test documents (its fresh attacker's best at the largest budget) rescored under every "
              "round's Shield; the diagonal is the fresh attacker of each round.\n",
              _table(["defense \\ attacker"] + [f"r{a}" for a in range(len(m))],
                     [[f"r{d}"] + [fmt(v) for v in row] for d, row in enumerate(m)]) + "\n"]
    atomic_write(os.path.join(figs, "harden_crossplay.svg"), svg_heatmap(
        f"Cross-play exposure@{k} (%)", [f"defense r{d}" for d in range(len(m))],
        [f"attacker r{a}" for a in range(len(m))],
        {(f"defense r{d}", f"attacker r{a}"): v for d, row in enumerate(m) for a, v in enumerate(row)},
        xlabel="attacker round (its test documents)", ylabel="defense round (its Shield)", note=note))
    lines.append("![Cross-play](figures/harden_crossplay.svg)\n")
    lines += harden_detector_lines(b["rounds"])
    lines += usage_lines(s.get("usage") or {})
    atomic_write(os.path.join(run_dir, "harden_report.md"), "\n".join(lines))
