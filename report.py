"""report.md and SVG figures for an evaluation run, laid out as the paper's tables and figures.

A sibling of run.py (the design card's list has no place for plotting): plain string SVG, no plotting
library. Table 1 (conditions x ASR/ASI/BER), Table 2 (ablation), the per-method breakdown (Fig. 3:
ASR, and (b) the Attack Influence Reduction from Non-Defense; unseen methods dashed), the quality
table (Table C.1), PPL-Filter diagnostics (Table B.2), and ASR/ASI by library epoch (Fig. 5). A run
on the tiny model or the offline engine says so first.

Usage: write_report("runs/demo", summary)
"""
import html
import os


def _f(v, nd=2):
    return "-" if v is None or v != v else f"{v:.{nd}f}"


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def svg_bars(title, groups, series, values, ylabel="%", dashed=()):
    """Grouped bars: groups on x, one bar per series; values[(group, series)] -> float."""
    W, H, left, top, bottom = 760, 340, 50, 30, 70
    colors = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377"]
    vmax = max([v for v in values.values() if v == v] + [1.0])
    gw = (W - left - 20) / max(1, len(groups))
    bw = gw * 0.8 / max(1, len(series))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{H - bottom}" x2="{W - 10}" y2="{H - bottom}" stroke="#333"/>',
             f'<text x="12" y="{top + 10}">{html.escape(ylabel)}</text>']
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + gw * 0.1
        for si, s in enumerate(series):
            v = values.get((g, s), 0.0)
            v = 0.0 if v != v else v
            h = (H - top - bottom) * max(0.0, v) / vmax      # a negative value: no bar (its tooltip and table say it)
            dash = ' stroke="#000" stroke-dasharray="3,2"' if g in dashed else ""
            parts.append(f'<rect x="{x0 + si * bw:.1f}" y="{H - bottom - h:.1f}" width="{bw - 1:.1f}" height="{h:.1f}" '
                         f'fill="{colors[si % len(colors)]}"{dash}><title>{html.escape(f"{g} / {s}: {v:.2f}")}</title></rect>')
        parts.append(f'<text x="{x0 + gw * 0.4:.1f}" y="{H - bottom + 14}" text-anchor="middle">'
                     f'{html.escape(g[:18])}{" (unseen)" if g in dashed else ""}</text>')
    for si, s in enumerate(series):
        parts.append(f'<rect x="{left + si * 130}" y="{H - 22}" width="10" height="10" fill="{colors[si % len(colors)]}"/>'
                     f'<text x="{left + si * 130 + 14}" y="{H - 13}">{html.escape(s)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def svg_lines(title, xs, series):
    """Line chart: series name -> list of y over xs."""
    W, H, left, top, bottom = 560, 300, 50, 30, 60
    colors = ["#4477aa", "#ee6677", "#228833"]
    ys = [v for s in series.values() for v in s if v == v]
    vmax = max(ys + [1.0])
    step = (W - left - 30) / max(1, len(xs) - 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{H - bottom}" x2="{W - 20}" y2="{H - bottom}" stroke="#333"/>']
    for i, x in enumerate(xs):
        parts.append(f'<text x="{left + i * step:.1f}" y="{H - bottom + 14}" text-anchor="middle">{html.escape(x)}</text>')
    for si, (name, vals) in enumerate(series.items()):
        pts = " ".join(f"{left + i * step:.1f},{H - bottom - (H - top - bottom) * (v if v == v else 0) / vmax:.1f}"
                       for i, v in enumerate(vals))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{colors[si % 3]}" stroke-width="2"/>')
        parts.append(f'<text x="{left + si * 120}" y="{H - 15}" fill="{colors[si % 3]}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_report(run_dir, s):
    figs = os.path.join(run_dir, "figures")
    os.makedirs(figs, exist_ok=True)
    lines = []
    if s.get("notes"):
        lines.append("> **OFFLINE / SIMULATION RUN.** " + " ".join(s["notes"]) + "\n")
    lines.append(f"# GEO Defender evaluation: {os.path.basename(os.path.normpath(run_dir))}\n")
    lines.append(f"Target LLM: `{s['target_llm']}`; reranker: `{s['model']}`; test groups {s['test_groups']}, "
                 f"instances {s['test_instances']}; seen methods: {', '.join(s['seen_methods'])}.\n")
    if s.get("judge"):
        lines.append(f"Judge (ASI, pairwise quality): `{s['judge']}`"
                     + (" (the target itself, the default; the paper judges every target with GPT-5.5: "
                        "`--judge openai:gpt-5.5`, or `--preset paper`)" if s["judge"] == s["target_llm"] else "") + ".\n")
    if s.get("tfsg_library_ranking"):
        lines.append(f"The TFSG library was built on the {s['tfsg_library_ranking']} top-k; \"TFSG only\" applies that "
                     "same library to the base reranker's top-k.\n")
    c = s["conditions"]
    main = [k for k in ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender") if k in c]
    lines.append("## Table 1: end-to-end comparison (ASR, ASI lower is better; BER higher)\n")
    lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n"],
                        [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"]), _f(c[k]["attack_in_context"]), c[k]["n"]]
                         for k in main]) + "\n")
    failed = {k: v.get("asi_judge_failed", 0) for k, v in c.items() if v.get("asi_judge_failed")}
    if failed:   # their ASI is over the instances the judge scored
        lines.append("ASI judge failures (every attempt unusable; left out of ASI): "
                     + ", ".join(f"{k} {n}" for k, n in failed.items()) + ".\n")
    abl = [k for k in ("Non-Defense", "Shield only", "TFSG only", "GEO Defender") if k in c]
    lines.append("## Table 2: module ablation\n")
    lines.append(_table(["Method", "ASR", "ASI", "BER"], [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"])]
                                                          for k in abl]) + "\n")
    methods = list(next(iter(s["methods"].values())).keys())
    lines.append("## Per GEO method (Fig. 3): ASR by condition; unseen methods marked *\n")
    lines.append(_table(["Condition"] + [m + ("" if s["methods"][main[0]][m]["seen"] else "*") for m in methods],
                        [[k] + [_f(s["methods"][k][m]["ASR"]) for m in methods] for k in s["methods"]]) + "\n")
    unseen = {m for m in methods if not s["methods"][main[0]][m]["seen"]}
    conds = list(s["methods"])
    with open(os.path.join(figs, "per_method_asr.svg"), "w", encoding="utf-8") as f:
        f.write(svg_bars("ASR by GEO method (dashed outline: unseen)", methods, conds,
                         {(m, k): s["methods"][k][m]["ASR"] for m in methods for k in conds}, dashed=unseen))
    with open(os.path.join(figs, "conditions.svg"), "w", encoding="utf-8") as f:
        f.write(svg_bars("ASR / ASI / BER by condition", list(c), ["ASR", "ASI", "BER"],
                         {(k, m): c[k][m] for k in c for m in ("ASR", "ASI", "BER")}))
    lines.append("![per method](figures/per_method_asr.svg) ![conditions](figures/conditions.svg)\n")
    if "Non-Defense" in s["methods"]:
        # Fig. 3 (b): Attack Influence Reduction, the relative ASI reduction from Non-Defense per method
        # (panel (a), Attack Defense Success, is 100 - ASR of the table above)
        nd = s["methods"]["Non-Defense"]
        air = {(m, k): (100 * (nd[m]["ASI"] - s["methods"][k][m]["ASI"]) / nd[m]["ASI"] if nd[m]["ASI"] else float("nan"))
               for m in methods for k in conds if k != "Non-Defense"}
        others = [k for k in conds if k != "Non-Defense"]
        lines.append("## Fig. 3 (b): Attack Influence Reduction (%), 100 (ASI_Non-Defense - ASI) / ASI_Non-Defense "
                     "per GEO method; higher is stronger; unseen methods marked *\n")
        lines.append(_table(["Condition"] + [m + ("" if nd[m]["seen"] else "*") for m in methods],
                            [[k] + [_f(air[m, k]) for m in methods] for k in others]) + "\n")
        with open(os.path.join(figs, "per_method_air.svg"), "w", encoding="utf-8") as f:
            f.write(svg_bars("Attack Influence Reduction by GEO method (dashed outline: unseen)", methods, others,
                             air, dashed=unseen))
        lines.append("![attack influence reduction](figures/per_method_air.svg)\n")
    if s.get("quality"):
        q = s["quality"]
        lines.append("## Table C.1: pairwise answer quality of GEO Defender vs the clean reference\n")
        lines.append(_table(["Mean change", "95% CI (query-cluster bootstrap)", "Comparable or better (%)", "Better (%)",
                             "n", "defended as A"],
                            [[f"{q['mean_change']:+.3f}", f"[{q['ci95'][0]:+.3f}, {q['ci95'][1]:+.3f}]",
                              _f(q["comparable_or_better"]), _f(q["better"]), q["n"], q["defended_as_a"]]]
                            if q.get("n") else [["-", "-", "-", "-", 0, q["defended_as_a"]]]) + "\n")
        if q.get("judge_failed"):
            lines.append(f"Pairwise judge failures (left out of Table C.1): {q['judge_failed']}.\n")
    if s.get("ppl_filter"):
        p = s["ppl_filter"]
        lines.append("## Table B.2: PPL-Filter diagnostics\n")
        lines.append(_table(["Statistic", "Value"], [
            ["threshold (PPL)", _f(p["threshold"])], ["test instances", p["test_instances"]],
            ["attack documents in base top-k", p["attack_in_base_topk"]], ["attack documents flagged", p["attack_flagged"]],
            ["attack documents in PPL-Filter top-k", p["attack_in_ppl_topk"]], ["attack removed from top-k", p["attack_removed"]],
            ["attack newly introduced", p["attack_introduced"]],
            ["benign flagged", f"{p['benign_flagged']}/{p['benign_total']}"]]) + "\n")
    if s.get("epochs"):
        e = s["epochs"]
        xs = list(e)
        lines.append("## Fig. 5: GEO Defender by library epoch\n")
        lines.append(_table(["Epoch", "ASR", "ASI", "BER"], [[t, _f(e[t]["ASR"]), _f(e[t]["ASI"]), _f(e[t]["BER"])]
                                                            for t in xs]) + "\n")
        with open(os.path.join(figs, "epochs.svg"), "w", encoding="utf-8") as f:
            f.write(svg_lines("GEO Defender by TFSG epoch", xs, {"ASR": [e[t]["ASR"] for t in xs],
                                                                 "ASI": [e[t]["ASI"] for t in xs]}))
        lines.append("![epochs](figures/epochs.svg)\n")
    if s.get("transfer"):
        lines.append("## Table C.2 row: libraries from other runs applied to this target\n")
        lines.append(_table(["Source library", "ASR", "ASI"], [[k, _f(v["ASR"]), _f(v["ASI"])]
                                                                for k, v in s["transfer"].items()]) + "\n")
    u = s.get("usage") or {}
    lines.append(f"LLM usage (this eval): {u.get('calls', 0)} calls, {u.get('http_calls', 0)} sent, "
                 f"{u.get('cache_hits', 0)} from cache, {u.get('prompt_tokens', 0)} prompt / "
                 f"{u.get('completion_tokens', 0)} completion tokens"
                 + (f", ${u['cost_usd']:.4f}" if u.get("cost_usd") is not None else "") + ".\n")
    for who, uu in (("target", u), ("judge", s.get("judge_usage") or {})):
        if uu.get("adapted"):   # the API refused a parameter: what was sent instead (llm_clients._adapt)
            lines.append(f"Requests to the {who} ({uu.get('model')}) adapted to its API: {'; '.join(uu['adapted'])}.\n")
    with open(os.path.join(run_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def svg_heatmap(title, rows, cols, values):
    """values[(row, col)] -> float or None; darker = higher."""
    cw, ch, left, top = 90, 26, 150, 60
    W, H = left + cw * len(cols) + 20, top + ch * len(rows) + 20
    vals = [v for v in values.values() if v is not None and v == v]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>']
    for j, c in enumerate(cols):
        parts.append(f'<text x="{left + j * cw + cw / 2}" y="{top - 8}" text-anchor="middle">{html.escape(c[:14])}</text>')
    for i, rname in enumerate(rows):
        parts.append(f'<text x="{left - 6}" y="{top + i * ch + 17}" text-anchor="end">{html.escape(rname[:22])}</text>')
        for j, c in enumerate(cols):
            v = values.get((rname, c))
            t = 0.0 if v is None or hi == lo else (v - lo) / (hi - lo)
            fill = "#eee" if v is None else f"rgb({int(255 - 170 * t)},{int(255 - 120 * t)},255)"
            parts.append(f'<rect x="{left + j * cw}" y="{top + i * ch}" width="{cw - 2}" height="{ch - 2}" fill="{fill}"/>'
                         f'<text x="{left + j * cw + cw / 2}" y="{top + i * ch + 17}" text-anchor="middle">{_f(v)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_comparison(out_dir, summaries):
    """Across runs (one per target LLM): Table 1 with an average row, Table C.1, and the transfer
    matrix of Table C.2 (rows: source library, columns: target) from each run's `transfer` results."""
    os.makedirs(os.path.join(out_dir, "figures"), exist_ok=True)
    lines = []
    notes = sorted({n for s in summaries.values() for n in s.get("notes", [])})
    if notes:
        lines.append("> **OFFLINE / SIMULATION RUNS INCLUDED.** " + " ".join(notes) + "\n")
    sets = {name: (s.get("test_set_sha1"), s.get("test_instances")) for name, s in summaries.items()}
    if len({d for d, _ in sets.values()}) > 1:  # the averages and the transfer matrix would mix test sets
        lines.append("> **DIFFERENT TEST SETS.** These runs were not evaluated on the same instances ("
                     + ", ".join(f"{k}: {n} instances, {d[:10] if d else 'no digest (older run)'}"
                                 for k, (d, n) in sets.items())
                     + "); their rows are not comparable and the averages mix them.\n")
    judges = {name: s.get("judge") for name, s in summaries.items()}
    if len(set(judges.values())) > 1:   # ASI and quality are the judge's numbers
        lines.append("> **DIFFERENT JUDGES.** These runs' ASI and answer quality were scored by different models ("
                     + ", ".join(f"{k}: {v or 'not recorded (older run)'}" for k, v in judges.items())
                     + "); their ASI and Table C.1 are not comparable.\n")
    lines.append("# GEO Defender across target LLMs\n")
    conds = [c for c in ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender", "Shield only", "TFSG only")
             if all(c in s["conditions"] for s in summaries.values())]
    head = ["Target LLM"] + [f"{c} {m}" for c in conds for m in ("ASR", "ASI", "BER")]
    rows = [[s["target_llm"]] + [_f(s["conditions"][c][m]) for c in conds for m in ("ASR", "ASI", "BER")]
            for s in summaries.values()]
    avg = ["Average"] + [_f(sum(s["conditions"][c][m] for s in summaries.values()) / len(summaries))
                         for c in conds for m in ("ASR", "ASI", "BER")]
    lines.append("## Table 1\n\n" + _table(head, rows + [avg]) + "\n")
    q = [(s["target_llm"], s["quality"]) for s in summaries.values() if s.get("quality", {}).get("n")]
    if q:
        lines.append("## Table C.1\n\n" + _table(["Target LLM", "Mean change", "95% CI", "Comparable or better (%)", "Better (%)"],
                     [[t, f"{v['mean_change']:+.3f}", f"[{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]",
                       _f(v["comparable_or_better"]), _f(v["better"])] for t, v in q]) + "\n")
    targets = {name: s["target_llm"] for name, s in summaries.items()}
    cells = {}
    for name, s in summaries.items():
        for src, v in (s.get("transfer") or {}).items():
            cells[(targets[name] if src == "(own)" else src, targets[name])] = v
    if cells:
        srcs = sorted({k[0] for k in cells})
        cols = list(targets.values())
        for metric in ("ASR", "ASI"):
            vals = {k: v[metric] for k, v in cells.items()}
            lines.append(f"## Table C.2 ({metric}): rows = source library, columns = target\n\n" +
                         _table(["Source \\ Target"] + cols, [[r] + [_f(vals.get((r, c))) for c in cols] for r in srcs]) + "\n")
            with open(os.path.join(out_dir, "figures", f"transfer_{metric.lower()}.svg"), "w", encoding="utf-8") as f:
                f.write(svg_heatmap(f"Transfer {metric} (source library x target LLM)", srcs, cols, vals))
        lines.append("![transfer ASR](figures/transfer_asr.svg) ![transfer ASI](figures/transfer_asi.svg)\n")
    path = os.path.join(out_dir, "comparison.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path
