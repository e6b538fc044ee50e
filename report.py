"""report.md and SVG figures for an evaluation run, laid out as the paper's tables and figures.

Plain string SVG, no plotting library. Table 1 (conditions x ASR/ASI/BER), Table 2 (ablation), the
per-method breakdown (Fig. 3: ASR, and (b) the Attack Influence Reduction from Non-Defense; unseen
methods dashed), the quality table (Table C.1), PPL-Filter diagnostics (Table B.2), and ASR/ASI by
library epoch (Fig. 5). A run on the tiny model or the offline engine says so first, in the report and
under each figure's title; every figure titles both its axes. Beside them:
every condition with its latency and cost per query, and what the injection defenses (defenses.py)
did, with their answer quality; on a benchmark with honest edits, each condition's and reranker's
honest penalty beside the attacks' (honest_cells, honest_lines).

Usage: write_report("runs/demo", summary)
"""
import html
import os


def given(v):
    """A measured value: neither None nor NaN. Tables print "-" and figures draw nothing where not."""
    return v is not None and v == v


def _f(v, nd=2):
    return f"{v:.{nd}f}" if given(v) else "-"


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- SVG figures
# Plain-string SVG. Text width is estimated (CHAR_W x font size per character, generous for the
# sans-serif fonts browsers use), and every label is placed from that estimate: wrapped to the room
# it has, never outside the canvas, never over another label (test_report.py checks both). Every
# figure names both its axes, and a figure of an offline or simulation run says so under its title.

CHAR_W = 0.62
# Paul Tol's "bright" scheme, then three of his "muted" and "vibrant" ones: ten series told apart
COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#332288", "#ee7733",
          "#999933"]
OFFLINE_FIGURE = "offline / simulation run: plumbing figures, not the paper's results"
NOTE_COLOR = "#cc3311"      # Paul Tol's "vibrant" red: the note is read before the data


def figure_note(notes):
    """The note a figure carries under its title: OFFLINE_FIGURE when the run has offline notes, else None."""
    return OFFLINE_FIGURE if notes else None


def text_width(s, size=11):
    return CHAR_W * size * len(s)


def wrap(label, width, size=11):
    """Words of `label` in lines no wider than `width` px (a word longer than that is cut at the
    underscore or hyphen nearest its middle, else hard)."""
    per = max(4, int(width // (CHAR_W * size)))
    words = []
    for w in label.replace("_", "_ ").replace("-", "- ").split():
        while len(w) > per:
            words.append(w[:per])
            w = w[per:]
        words.append(w)
    lines, cur = [], ""
    for w in words:
        join = cur + ("" if cur.endswith(("_", "-")) or not cur else " ") + w
        if cur and len(join) > per:
            lines.append(cur.rstrip())
            cur = w
        else:
            cur = join
    return lines + ([cur.rstrip()] if cur else [])


def nice_ticks(lo, hi, n=5):
    """Round tick values covering [lo, hi] (steps of 1, 2, 2.5 or 5 x 10^k), from the last tick at or
    below lo to the first at or above hi; a value within a millionth of a step of a tick is on it (a
    reduction of 100.00000000000001 % ends the axis at 100, not 125)."""
    import math
    span = max(hi - lo, 1e-9)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    eps = step * 1e-6
    ticks, k = [], math.floor((lo + eps) / step)
    while not ticks or ticks[-1] < hi - eps:
        ticks.append(round(k * step, 10))
        k += 1
    return ticks


def _svg(W, H, body):
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'font-family="sans-serif" font-size="11">\n<rect width="{W}" height="{H}" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>")


def _text(x, y, s, anchor="middle", size=11, extra=""):
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>{html.escape(s)}</text>'


def _upright(x, y, s):
    """Text turned -90 degrees, centred on (x, y): a y-axis title (its glyphs lie left of x)."""
    return _text(x, y, s, extra=f' transform="rotate(-90 {x:.1f} {y:.1f})"')


def _head(title, W, note):
    """The title and, for an offline or simulation run, the note under it -> (svg, baseline of the next row)."""
    body = [_text(W / 2, 20, title, size=13)]
    if note:
        body.append(_text(W / 2, 36, note, extra=f' fill="{NOTE_COLOR}"'))
    return body, 60 if note else 44


def _legend(series, W, y, markers=False, colors=None):
    """Legend rows inside the canvas, under the title: as many entries per row as fit. -> (svg, height)."""
    out, x, row_h = [], 60.0, 16
    for si, s in enumerate(series):
        w = 18 + text_width(s) + 16
        if x + w > W - 10 and x > 60:
            x, y = 60.0, y + row_h
        c = colors[si] if colors else COLORS[si % len(COLORS)]
        if markers:
            out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 14:.1f}" y2="{y - 4:.1f}" stroke="{c}" '
                       f'stroke-width="2"/><circle cx="{x + 7:.1f}" cy="{y - 4:.1f}" r="3" fill="{c}"/>')
        else:
            out.append(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="12" height="12" fill="{c}"/>')
        out.append(_text(x + 18, y, s, anchor="start"))
        x += w
    return out, y


def _y_axis(lo, hi, left, top, plot_h, plot_w, title):
    """Gridlines, ticks, tick labels for [lo, hi] and the axis title -> (svg, y(v) mapping)."""
    ticks = nice_ticks(lo, hi)
    lo, hi = min(ticks[0], lo), max(ticks[-1], hi)
    y = lambda v: top + plot_h * (hi - v) / (hi - lo)
    out = []
    for tv in ticks:
        out.append(f'<line x1="{left}" y1="{y(tv):.1f}" x2="{left + plot_w}" y2="{y(tv):.1f}" stroke="#ddd"/>')
        out.append(_text(left - 6, y(tv) + 4, f"{tv:g}", anchor="end"))
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#333"/>')
    out.append(_upright(14, top + plot_h / 2, title))
    return out, y


LABEL_SIZE = 9      # a bar's value label


def value_label(v):
    """A bar's value as its label: one decimal, a trailing ".0" dropped ("0", "12.5", "-33.3")."""
    s = f"{v:.1f}".removesuffix(".0")
    return "0" if s == "-0" else s


def _bar_label(cx, v, y, width, upright):
    """The value label of the bar centred at cx: beyond its end (above a bar up, below a bar down),
    upright (turned -90 degrees, centred on its own middle) when it is wider than the bar."""
    s, gap = value_label(v), 3
    if not upright:
        return _text(cx, y(v) - gap if v >= 0 else y(v) + gap + LABEL_SIZE * 0.8, s, size=LABEL_SIZE)
    w = text_width(s, LABEL_SIZE)
    cy = y(v) - gap - w / 2 if v >= 0 else y(v) + gap + w / 2
    x = cx + LABEL_SIZE / 2                       # the glyphs lie left of the turned baseline
    return _text(x, cy, s, size=LABEL_SIZE, extra=f' transform="rotate(-90 {x:.1f} {cy:.1f})"')


def svg_bars(title, groups, series, values, *, xlabel, ylabel, dashed=(), colors=None, note=None):
    """Grouped bars: groups on x, one bar per series (colors: one per series, default COLORS in
    order); values[(group, series)] -> float (None or NaN: no bar and no label). Every bar carries its
    value: a zero bar is a line on the zero line labelled "0", bars below zero hang from it with
    their labels beneath; labels lie flat when they fit the bar's width, else upright. The axis
    spans nice ticks over [min(0, lo), max(0, hi)]; xlabel and ylabel title the axes, note (figure_note)
    goes under the title."""
    ns = max(1, len(series))
    vals = [v for v in values.values() if given(v)]
    widest = max([text_width(value_label(v), LABEL_SIZE) for v in vals] + [0.0])
    # wide enough for every bar to hold an upright label (LABEL_SIZE + 4 px a bar, bars filling 80% of a group)
    W = max(640, 110 * len(groups) + 80, int(len(groups) * ns * (LABEL_SIZE + 4) / 0.8) + 80)
    left, right = 60, 20
    plot_w = W - left - right
    gw = plot_w / max(1, len(groups))
    bw = gw * 0.8 / ns
    upright = widest + 2 > bw
    room = (widest if upright else LABEL_SIZE) + 6         # beyond the longest bar, for its label
    labels = {g: wrap(g, gw - 8) + (["(unseen)"] if g in dashed else []) for g in groups}
    n_lines = max([len(v) for v in labels.values()] + [1])
    colors = colors or [COLORS[si % len(COLORS)] for si in range(ns)]
    head, row = _head(title, W, note)
    legend, ly = _legend(series, W, row, colors=colors)
    lo, hi = min(vals + [0.0]), max(vals + [0.0])
    hi = hi if hi > lo else lo + 1.0
    top, plot_h = ly + 22 + (room if hi > 0 else 0), 230
    below = top + plot_h + (room if lo < 0 else 0)          # where the group names start
    H = below + 14 * n_lines + 32
    body = head + legend
    axis, y = _y_axis(lo, hi, left, top, plot_h, plot_w, ylabel)
    body += axis
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + gw * 0.1
        for si, s in enumerate(series):
            v = values.get((g, s))
            if not given(v):
                continue
            y0, y1 = sorted((y(0.0), y(v)))
            if y1 - y0 < 1.5:                                # a zero bar: a line, told apart from no bar
                y0, y1 = y(0.0) - 0.75, y(0.0) + 0.75
            dash = ' stroke="#000" stroke-dasharray="3,2"' if g in dashed else ""
            tip = html.escape(f"{g} / {s}: {v:.2f}")
            body.append(f'<rect x="{x0 + si * bw:.1f}" y="{y0:.1f}" width="{max(bw - 1, 1):.1f}" '
                        f'height="{y1 - y0:.1f}" fill="{colors[si]}"{dash}><title>{tip}</title></rect>')
            body.append(_bar_label(x0 + si * bw + bw / 2, v, y, bw, upright))
        for li, line in enumerate(labels[g]):
            body.append(_text(left + gi * gw + gw / 2, below + 16 + 14 * li, line))
    body.append(_text(left + plot_w / 2, below + 22 + 14 * n_lines, xlabel))
    body.append(f'<line x1="{left}" y1="{y(0.0):.1f}" x2="{left + plot_w}" y2="{y(0.0):.1f}" stroke="#333"/>')
    return _svg(W, H, body)


LINE_LABEL_SIZE = 10    # a line chart's value label
LABEL_GAP = 2.0         # px between two value labels of one column
MARKER_R = 3.5          # a line chart's point
CLEAR = 1.5             # px between a value label and any marker


def _gap(py, j, h, lo, hi):
    """The highest and lowest label centres of gap j of a column whose points lie at py (sorted, px down):
    the gap above point j (below the last point when j == len(py)), CLEAR px off the markers around it."""
    off = MARKER_R + CLEAR + h / 2
    return (py[j - 1] + off if j else lo + h / 2), (py[j] - off if j < len(py) else hi - h / 2)


def _gap_centres(py, j, a, b, h, lo, hi):
    """Centres of labels a..b-1 (those of points py[a:b]) in gap j: the labels of points above the gap
    hang from its top, those of points below it stand on its bottom, in their points' order."""
    (top, bottom), step = _gap(py, j, h, lo, hi), h + LABEL_GAP
    down, up = max(0, min(b, j) - a), b - max(a, j)
    return [top + s * step for s in range(down)] + [bottom - (up - 1 - s) * step for s in range(up)]


def label_slots(ys, h, lo, hi):
    """Wanted centres of the value labels (h px tall) of points at heights `ys` (px, down) sharing one x,
    between lo and hi. The markers cut the column into gaps; each label goes in a gap, in its points'
    order, as many to a gap as fit LABEL_GAP apart and CLEAR off the markers, so no label covers another
    or a marker. Of those assignments, a dynamic programme over (gap, labels placed) picks the one whose
    labels lie nearest their points, above them on a tie. A column too crowded for any gets every label
    above its point, for place_labels to push apart."""
    order = sorted(range(len(ys)), key=lambda i: (ys[i], i))
    py, n, step = [ys[i] for i in order], len(ys), h + LABEL_GAP
    f, back = [0.0] + [float("inf")] * n, []       # f[i]: least cost of labels 0..i-1 in the gaps so far
    for j in range(n + 1):
        top, bottom = _gap(py, j, h, lo, hi)
        cap = int((bottom - top) // step) + 1 if bottom >= top else 0
        g, arg = [float("inf")] * (n + 1), [0] * (n + 1)
        for i in range(n + 1):
            for a in range(max(0, i - cap), i + 1):        # labels a..i-1 in gap j
                cs = _gap_centres(py, j, a, i, h, lo, hi)
                c = f[a] + sum(abs(y - py[k]) + (0.01 if k < j else 0.0) for k, y in zip(range(a, i), cs))
                if c < g[i]:
                    g[i], arg[i] = c, a
        f = g
        back.append(arg)
    want, i = [0.0] * n, n
    if f[n] == float("inf"):
        for k in range(n):
            want[order[k]] = py[k] - MARKER_R - CLEAR - h / 2
        return want
    for j in range(n, -1, -1):                              # walk the choices back: gap j held labels a..i-1
        a = back[j][i]
        for k, y in zip(range(a, i), _gap_centres(py, j, a, i, h, lo, hi)):
            want[order[k]] = y
        i = a
    return want


def place_labels(want, h, lo, hi, gap=LABEL_GAP):
    """Centres for labels h px tall wanted at centres `want` (label_slots'): in the order of `want`,
    boxes at least `gap` px apart, inside [lo, hi], as close to the wanted centres as that allows (least
    squares): the wanted ones themselves unless the column is too crowded for its room. Stacked, the
    k-th label from the top sits k steps below the first, so the offsets centre_k - k * step must not
    decrease: an isotonic fit, solved by pool-adjacent-violators, then clipped to the room (clipping
    keeps the offsets in order, so the boxes stay apart)."""
    step = h + gap
    first, last = lo + h / 2, hi - h / 2 - (len(want) - 1) * step
    if last < first:
        raise ValueError(f"{len(want)} labels {h} px tall need {len(want) * step - gap:.0f} px, have {hi - lo:.0f}")
    order = sorted(range(len(want)), key=lambda i: (want[i], i))
    pools = []                                   # [sum, count] of pooled offsets, their means increasing
    for k, i in enumerate(order):
        pools.append([want[i] - k * step, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            s, n = pools.pop()
            pools[-1][0] += s
            pools[-1][1] += n
    offsets = [min(max(s / n, first), last) for s, n in pools for _ in range(n)]
    out = [0.0] * len(want)
    for k, i in enumerate(order):
        out[i] = offsets[k] + k * step
    return out


def _segments(points):
    """Points (x index, ...) split where an index is missing: a line is broken where a value is."""
    out = []
    for p in points:
        if not out or p[0] != out[-1][-1][0] + 1:
            out.append([])
        out[-1].append(p)
    return out


def svg_lines(title, xs, series, *, xlabel, ylabel, note=None):
    """Line chart with markers and value labels: series name -> list of y over xs (None or NaN: no point,
    the line broken there). Each x's value labels are placed by label_slots and place_labels: off the
    markers, apart, between the legend and the band under the x axis (room for the label of a point on
    it); an x's column is wider than its widest label, so columns never meet. xlabel and ylabel title
    the axes, note (figure_note) goes under the title."""
    h = LINE_LABEL_SIZE
    texts = [f"{v:.1f}" for vs in series.values() for v in vs if given(v)]
    widest = max([text_width(s, h) for s in texts] + [text_width(x) for x in xs] + [0.0])
    left, right = 60, 30
    W = max(600, left + right + int(len(xs) * (widest + 8)) + 1)
    plot_w = W - left - right
    head, row = _head(title, W, note)
    legend, ly = _legend(list(series), W, row, markers=True)
    top, plot_h = ly + 22, max(230, len(series) * (h + LABEL_GAP))
    below = top + plot_h + h + 6                   # room for a label under a point on the axis; then the x labels
    H = below + 40
    ys = [v for vs in series.values() for v in vs if given(v)]
    axis, y = _y_axis(min(ys + [0.0]), max(ys + [1.0]), left, top, plot_h, plot_w, ylabel)
    step = plot_w / max(1, len(xs))
    xpos = lambda i: left + step * (i + 0.5)
    body = head + legend + axis
    for i, x in enumerate(xs):
        body.append(_text(xpos(i), below + 12, x))
    body.append(_text(left + plot_w / 2, below + 30, xlabel))
    columns = {}                                    # x index -> [(point y, text, colour)]
    for si, (name, vals) in enumerate(series.items()):
        c = COLORS[si % len(COLORS)]
        pts = [(i, xpos(i), y(v), v) for i, v in enumerate(vals) if given(v)]
        for seg in _segments(pts):
            points = " ".join(f"{a:.1f},{b:.1f}" for _, a, b, _ in seg)
            body.append(f'<polyline points="{points}" fill="none" stroke="{c}" stroke-width="2"/>')
        for i, a, b, v in pts:
            body.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="{MARKER_R}" '
                        f'fill="{c}"><title>{html.escape(f"{name}: {v:.2f}")}</title></circle>')
            columns.setdefault(i, []).append((b, f"{v:.1f}", c))
    for i, items in sorted(columns.items()):
        centres = place_labels(label_slots([b for b, _, _ in items], h, ly + 6, below), h, ly + 6, below)
        for (_, s, c), cy in zip(items, centres):          # on a white card: lines crossing it stay behind
            w = text_width(s, h)
            body.append(f'<rect x="{xpos(i) - w / 2:.1f}" y="{cy - h / 2:.1f}" width="{w:.1f}" height="{h}" '
                        f'fill="white" fill-opacity="0.85"/>')
            body.append(_text(xpos(i), cy + 0.3 * h, s, size=h, extra=f' fill="{c}"'))   # baseline: 0.3 h below
    body.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#333"/>')
    return _svg(W, H, body)


def write_report(run_dir, s):
    """report.md and figures/*.svg of one evaluated run from its summary `s`."""
    figs = os.path.join(run_dir, "figures")
    os.makedirs(figs, exist_ok=True)
    lines = _header_lines(run_dir, s) + _table_lines(s) + strength_lines(s) + cost_lines(s) + _method_lines(s, figs)
    lines += _appendix_lines(s, figs) + defense_lines(s)
    lines += rerank_stage_lines(s)
    lines += usage_lines(s.get("usage") or {})
    # the API refused a parameter (llm_clients.RequestShape.adapt)
    for who, changes in (s.get("adapted") or {}).items():
        lines.append(f"Requests to {who} adapted to its API: {'; '.join(changes)}.\n")
    with open(os.path.join(run_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def _title(run_dir, s, what):
    """A report's first lines: the offline/simulation banner when the run has notes, then its title."""
    banner = ["> **OFFLINE / SIMULATION RUN.** " + " ".join(s["notes"]) + "\n"] if s.get("notes") else []
    return banner + [f"# {what}: {os.path.basename(os.path.normpath(run_dir))}\n"]


def strength_lines(s):
    """Attack strength: does each family raise its source's citation on this target (Non-Defense)?"""
    st = s.get("attack_strength")
    if not st:
        return []
    lines = ["## Attack strength (Non-Defense)\n",
             "Citation of each family's rewrite minus the clean reference's citation of the same source, percentage "
             "points, 95% CI over query groups. A family whose interval holds 0 did not raise visibility on this "
             "target: its blocked rate says nothing about the defense.\n",
             "| family | gain | 95% CI | n | its paper reports |", "|---|---|---|---|---|"]
    for m, v in st.items():
        flag = " (CI holds 0)" if v["holds_zero"] else ""
        lines.append(f"| {m} | {v['gain']:+.1f}{flag} | [{v['ci'][0]:+.1f}, {v['ci'][1]:+.1f}] | {v['n']} | "
                     f"{v['paper'] or '-'} |")
    return lines + [""]


def _header_lines(run_dir, s):
    """The run's labels: offline notes, target, reranker, judge, which ranking built the library."""
    lines = _title(run_dir, s, "GEO Defender evaluation")
    lines.append(f"Target LLM: `{s['target_llm']}`; reranker: `{s['model']}`; test groups {s['test_groups']}, "
                 f"instances {s['test_instances']}; seen methods: {', '.join(s['seen_methods'])}.\n")
    if s.get("judge"):
        itself = (" (the target itself, the default; the paper judges every target with GPT-5.5: "
                  "`--judge openai:gpt-5.5`, or `--preset paper`)" if s["judge"] == s["target_llm"] else "")
        lines.append(f"Judge (ASI, pairwise quality): `{s['judge']}`{itself}.\n")
    if s.get("tfsg_library_ranking"):
        lines.append(f"The TFSG library was built on the {s['tfsg_library_ranking']} top-k; \"TFSG only\" applies "
                     "that same library to the base reranker's top-k.\n")
    if s.get("shared_roles"):
        lines.append(f"**Roles shared with the benchmark's construction** (--allow-shared-roles): "
                     f"{'; '.join(s['shared_roles'])}. Such a model measures attacks it made or steered.\n")
    return lines


def _table_lines(s):
    """Tables 1 and 2 (end to end, ablation)."""
    lines = []
    c = s["conditions"]
    main = [k for k in ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender") if k in c]
    lines.append("## Table 1: end-to-end comparison (ASR, ASI lower is better; BER higher)\n")
    lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n"],
                        [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"]), _f(c[k]["attack_in_context"]),
                          c[k]["n"]] for k in main]) + "\n")
    failed = {k: v.get("asi_judge_failed", 0) for k, v in c.items() if v.get("asi_judge_failed")}
    if failed:   # their ASI is over the instances the judge scored
        lines.append("ASI judge failures (every attempt unusable; left out of ASI): "
                     + ", ".join(f"{k} {n}" for k, n in failed.items()) + ".\n")
    abl = [k for k in ("Non-Defense", "Shield only", "TFSG only", "GEO Defender") if k in c]
    lines.append("## Table 2: module ablation\n")
    lines.append(_table(["Method", "ASR", "ASI", "BER"], [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"])]
                                                          for k in abl]) + "\n")
    deployed = [k for k in c if k.endswith("]") and k.startswith(("Non-Defense [", "TFSG only ["))]
    if deployed:   # eval --reranker: the same pipelines on a deployed reranker's top-k
        ref = [k for k in ("Non-Defense", "Shield only", "TFSG only", "GEO Defender") if k in c]
        lines.append("## Deployed rerankers (eval --reranker): the pipelines on each reranker's top-k\n")
        lines.append(_table(["Condition", "ASR", "ASI", "BER", "attack in top-k (%)", "n"],
                            [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"]), _f(c[k]["attack_in_context"]),
                              c[k]["n"]] for k in ref + deployed]) + "\n")
    return lines + sample_lines(s)


def sample_lines(s):
    """eval --samples N: each condition's ASR over the samples with both intervals, and per sample."""
    if not s.get("samples"):
        return []
    b = s["samples"]
    ci = lambda v: f"[{v[0]:.1f}, {v[1]:.1f}]"
    return [f"## Repeated samples: {b['n']} answers per instance\n",
            "Every condition answered each instance N times (each its own cached reply); the tables above "
            "average over them. 95% CIs of ASR: over query groups then samples within each (two-level "
            "bootstrap), beside the groups-only CI of each instance's mean, which leaves the answers' own "
            "variance out.\n",
            _table(["Condition", "ASR", "95% CI (groups, samples)", "95% CI (groups only)", "ASR per sample"],
                   [[k, _f(v["ASR"]), ci(v["ASR_ci"]), ci(v["ASR_ci_groups_only"]),
                     ", ".join(_f(a) for a in v["ASR_per_sample"])] for k, v in b["conditions"].items()]) + "\n"]


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
    measured = (f" Here {pair[0]}'s honest penalty is {gap[0] - gap[1]:+.2f} points from {pair[1]}'s."
                if None not in gap else "")
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
    rows = [[k, _f(c[k]["ASR"]), _f(c[k]["ASI"]), _f(c[k]["BER"]), _f(c[k]["attack_in_context"]), c[k]["n"]]
            + [_f(cost.get(k, {}).get(m), nd) for m, nd in (("sequential_calls", 2), ("llm_calls", 2),
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
    unknown = {k: q["usage_unknown"] for k, q in cost.items() if q.get("usage_unknown")}
    if unknown:
        lines.append("Records whose reply is no longer in the cache (left out of the cost): "
                     + ", ".join(f"{k} {n}" for k, n in unknown.items()) + ".\n")
    return lines


def _method_lines(s, figs):
    """Per GEO method (Fig. 3 (a) as ASR, (b) Attack Influence Reduction) with their figures."""
    lines, c = [], s["conditions"]
    seen = next(iter(s["methods"].values()))          # {method: {..., "seen"}}, the same for every condition
    methods = list(next(iter(s["methods"].values())).keys())
    lines.append("## Per GEO method (Fig. 3): ASR by condition; unseen methods marked *\n")
    lines.append(_table(["Condition"] + [m + ("" if seen[m]["seen"] else "*") for m in methods],
                        [[k] + [_f(s["methods"][k][m]["ASR"]) for m in methods] for k in s["methods"]]) + "\n")
    drops = {m: n for m, n in (s.get("family_drops") or {}).items() if n and m in methods}
    if drops:                   # each method over the test groups it rewrote
        lines.append("Test instances per method (groups where build-bench's gate refused every rewrite of a method "
                     "have none of it): " + ", ".join(f"{m} {seen[m].get('n', '-')} ({drops.get(m, 0)} groups "
                                                      "refused)" for m in methods) + ".\n")
    unseen = {m for m in methods if not seen[m]["seen"]}
    conds = list(s["methods"])
    note = figure_note(s.get("notes"))
    with open(os.path.join(figs, "per_method_asr.svg"), "w", encoding="utf-8") as f:
        f.write(svg_bars("ASR by GEO method (dashed outline: unseen)", methods, conds,
                         {(m, k): s["methods"][k][m]["ASR"] for m in methods for k in conds}, dashed=unseen,
                         xlabel="GEO method", ylabel="ASR (%)", note=note))
    with open(os.path.join(figs, "conditions.svg"), "w", encoding="utf-8") as f:
        f.write(svg_bars("ASR / ASI / BER by condition", list(c), ["ASR", "ASI", "BER"],
                         {(k, m): c[k][m] for k in c for m in ("ASR", "ASI", "BER")},
                         xlabel="condition", ylabel="ASR / ASI / BER (%)", note=note))
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
                            [[k] + [_f(air[m, k]) for m in methods] for k in others]) + "\n")
        with open(os.path.join(figs, "per_method_air.svg"), "w", encoding="utf-8") as f:
            f.write(svg_bars("Attack Influence Reduction by GEO method (dashed outline: unseen)", methods, others,
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
                              _f(q["comparable_or_better"]), _f(q["better"]), q["n"], q["defended_as_a"]]]
                            if q.get("n") else [["-", "-", "-", "-", 0, q["defended_as_a"]]]) + "\n")
        if q.get("judge_failed"):
            lines.append(f"Pairwise judge failures (left out of Table C.1): {q['judge_failed']}.\n")
    if s.get("quality_defenses"):
        qd = s["quality_defenses"]
        lines.append("## Table C.1 for the injection defenses: pairwise answer quality vs the clean reference\n")
        lines.append(_table(["Condition", "Mean change", "95% CI (query-cluster bootstrap)",
                             "Comparable or better (%)", "Better (%)", "n", "judge failed"],
                            [[k, f"{q['mean_change']:+.3f}", f"[{q['ci95'][0]:+.3f}, {q['ci95'][1]:+.3f}]",
                              _f(q["comparable_or_better"]), _f(q["better"]), q["n"], q["judge_failed"]]
                             if q.get("n") else [k, "-", "-", "-", "-", 0, q["judge_failed"]]
                             for k, q in qd.items()]) + "\n")
    if s.get("ppl_filter"):
        p = s["ppl_filter"]
        lines.append("## Table B.2: PPL-Filter diagnostics\n")
        lines.append(_table(["Statistic", "Value"], [
            ["threshold (PPL)", _f(p["threshold"])], ["test instances", p["test_instances"]],
            ["attack documents in base top-k", p["attack_in_base_topk"]],
            ["attack documents flagged", p["attack_flagged"]],
            ["attack documents in PPL-Filter top-k", p["attack_in_ppl_topk"]],
            ["attack removed from top-k", p["attack_removed"]],
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
                                                                 "ASI": [e[t]["ASI"] for t in xs]},
                              xlabel="TFSG library epoch", ylabel="ASR / ASI (%)", note=figure_note(s.get("notes"))))
        lines.append("![epochs](figures/epochs.svg)\n")
    if s.get("transfer"):
        lines.append("## Table C.2 row: libraries from other runs applied to this target\n")
        lines.append(_table(["Source library", "ASR", "ASI"], [[k, _f(v["ASR"]), _f(v["ASI"])]
                                                                for k, v in s["transfer"].items()]) + "\n")
    return lines


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
            ["kept phrases per query", _f(r["kept_phrases_per_query"])],
            ["attack documents in the top-k", r["attack_in_context"]],
            ["... whose isolated answer supports a kept phrase cited for", r["attack_supports_a_cited_phrase"]]])
            + "\n")
    return lines


def rerank_stage_lines(s):
    """The reranker-stage table (rerank-eval): exposure@k, attack rank, promotion, clean top-k kept,
    overall and for seen / unseen methods, with 95% cluster-bootstrap CIs."""
    stage, k = s.get("rerank_stage"), s.get("rerank_stage_k", 5)
    if not stage:
        return []
    ci = lambda b, m: (f"{b[m]:.2f} [{b[m + '_ci'][0]:.2f}, {b[m + '_ci'][1]:.2f}]" if m in b else "-")
    honest = any(v.get("honest") for v in stage.values())   # a benchmark with honest edits: two more columns
    rows = [[label, part, b.get("n", 0), ci(b, "exposure"), ci(b, "mean_attack_rank"), ci(b, "promotion"),
             ci(b, "clean_topk_kept")]
            + ((honest_cells(v.get("honest"), "attack_demotion") if part == "all" else ["", ""]) if honest else [])
            for label, v in stage.items() for part, b in (("all", v["overall"]), ("seen", v["seen"]),
                                                          ("unseen", v["unseen"])) if b.get("n")]
    return [f"## Reranker stage under GEO attack (no LLM): k = {k}\n",
            "Exposure@k: the attack document in the top k (%); attack rank: 1-based; promotion: the source "
            "document's rank in the clean list minus the attack's; clean kept: % of the base reranker's clean "
            "top-k a reranker keeps. 95% query-cluster bootstrap CIs.\n",
            _table(["Reranker", "Methods", "n", f"Exposure@{k} (%)", "Attack rank", "Promotion", "Clean kept (%)"]
                   + (["Honest penalty (%)", "Attack demoted (%)"] if honest else []), rows) + "\n"] \
        + (honest_lines(s, "rerank") if honest else [])


def write_rerank_report(run_dir, s):
    """rerank_report.md and figures/rerank_exposure.svg (exposure by GEO method, one bar per reranker)."""
    figs = os.path.join(run_dir, "figures")
    os.makedirs(figs, exist_ok=True)
    stage, k = s["rerank_stage"], s.get("rerank_stage_k", 5)
    labels = list(stage)
    methods = list(next(iter(stage.values()))["per_method"])
    unseen = {m for m in methods if not next(iter(stage.values()))["per_method"][m]["seen"]}
    with open(os.path.join(figs, "rerank_exposure.svg"), "w", encoding="utf-8") as f:
        f.write(svg_bars(f"Exposure@{k} by GEO method (dashed outline: unseen)", methods, labels,
                         {(m, lb): stage[lb]["per_method"][m].get("exposure") for m in methods for lb in labels},
                         dashed=unseen, xlabel="GEO method", ylabel=f"exposure@{k} (%)",
                         note=figure_note(s.get("notes"))))
    lines = _title(run_dir, s, "Reranker stage under GEO attack")
    lines += rerank_stage_lines(s)
    lines.append(_table(["Reranker"] + [m + ("*" if m in unseen else "") for m in methods],
                        [[lb] + [_f(stage[lb]["per_method"][m].get("exposure")) for m in methods]
                         for lb in labels]) + "\n")
    lines.append("Exposure@k (%) by GEO method; unseen methods marked *.\n")
    lines.append("![exposure](figures/rerank_exposure.svg)\n")
    lines += [f"Reranker `{lb}`: `{stage[lb]['spec']}`." for lb in labels] + [""]
    lines += usage_lines(s.get("usage") or {})
    with open(os.path.join(run_dir, "rerank_report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def write_attack_report(run_dir, s):
    """attack_report.md and figures/attack_<target>_<mode>.svg: exposure and ASR against the budget, one
    line per condition (B = 1 is the static attack), the gate's verdicts and the attacker's cost."""
    figs = os.path.join(run_dir, "figures")
    os.makedirs(figs, exist_ok=True)
    lines = _title(run_dir, s, "Adaptive GEO attacker")
    lines.append("Each budget's documents replace the static attack (B = 1 is the benchmark's own rewrite); "
                 "exposure: the attack document in the top k (%).\n")
    for target, modes in s.get("attack", {}).items():
        for mode, b in modes.items():
            xs = list(b["budgets"])
            conds = list(next(iter(b["budgets"].values()))["conditions"])
            aware = mode.split("-")[0]
            how = (" (diagnose-and-repair, AgentGEO: one targeted repair a candidate, small edits)"
                   if b.get("algorithm") == "repair" else "")
            lines.append(f"## Target `{target}` ({b['target']}), attacker {aware} of the library{how}\n")
            transfer = (" Optimised against the base reranker: the Shield conditions are the transfer case."
                        if target == "base" else "")
            lines.append(f"Attacker `{b['attacker']}`, fidelity judge `{b['judge']}`, {b['rounds']} rounds of "
                         f"{b['per_round']} candidates.{transfer}\n")
            lines.append(_table(["Budget"] + [f"{c} {m}" for c in conds for m in ("exposure", "ASR")],
                                [[f"B={x}"] + [_f(b["budgets"][x]["conditions"][c][m]) for c in conds
                                                for m in ("exposure", "ASR")] for x in xs]) + "\n")
            # exposure depends only on the ranking: one line for the base top-k, one for the Shield's
            ranked = {"base top-k (Non-Defense, TFSG only, injection defenses)": "Non-Defense",
                      "Shield top-k (Shield only, GEO Defender)": "Shield only"}
            plots = {"exposure": {k: [b["budgets"][x]["conditions"][c]["exposure"] for x in xs]
                                  for k, c in ranked.items() if c in conds},
                     "asr": {c: [b["budgets"][x]["conditions"][c]["ASR"] for x in xs] for c in conds}}
            ylabel = {"exposure": "exposure", "asr": "ASR"}
            for what, series in plots.items():
                name = f"attack_{target}_{mode}_{what}.svg"
                with open(os.path.join(figs, name), "w", encoding="utf-8") as f:
                    f.write(svg_lines(f"Adaptive attack on {target} ({mode}): {ylabel[what]} by budget",
                                      [f"B={x}" for x in xs], series, xlabel="attacker budget B (candidates)",
                                      ylabel=f"{ylabel[what]} (%)", note=figure_note(s.get("notes"))))
                lines.append(f"![{target} {mode} {what}](figures/{name})")
            lines.append("")
            total = sum(b["gate"].values())
            lines.append("Fidelity gate over the attacker's candidates: " + ", ".join(
                f"{k} {v} ({100 * v / total:.1f}%)" for k, v in b["gate"].items()) + ".\n")
            c = b["cost"]
            lines.append(f"Cost of this attack: {c['attacker']['calls']} attacker calls "
                         f"({c['attacker']['http_calls']} sent), "
                         f"{(c['judge'] or {}).get('calls', 0)} fidelity judge calls, {c['reranker_queries']} "
                         f"reranker queries, {c['candidates']} candidates.\n")
    lines += usage_lines(s.get("usage") or {})
    with open(os.path.join(run_dir, "attack_report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


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


def svg_heatmap(title, rows, cols, values, *, xlabel, ylabel, note=None):
    """values[(row, col)] -> float (None or NaN: a grey cell labelled "-"); darker = higher; each cell
    labelled with its value. xlabel titles the columns (above their names), ylabel the rows (above their
    names, the header of that column, as in a table); note (figure_note) goes under the title."""
    cw = max(90, max(text_width(c) for c in cols) + 12)
    left = max(150, max(text_width(r) for r in [*rows, ylabel]) + 20)
    ch = 26
    W = int(max(left + cw * len(cols) + 20, text_width(title, 13) + 20, text_width(note or "") + 20))
    head, row = _head(title, W, note)
    top = row + 30                                  # the columns' title, then their names, then the cells
    H = top + ch * len(rows) + 20
    vals = [v for v in values.values() if given(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    body = head + [_text(left + cw * len(cols) / 2, row + 4, xlabel), _text(left - 6, top - 8, ylabel, anchor="end")]
    for j, c in enumerate(cols):
        body.append(_text(left + j * cw + cw / 2, top - 8, c))
    for i, rname in enumerate(rows):
        body.append(_text(left - 6, top + i * ch + 17, rname, anchor="end"))
        for j, c in enumerate(cols):
            v = values.get((rname, c))
            t = 0.0 if not given(v) or hi == lo else (v - lo) / (hi - lo)
            fill = "#eee" if not given(v) else f"rgb({int(255 - 170 * t)},{int(255 - 120 * t)},255)"
            body.append(f'<rect x="{left + j * cw}" y="{top + i * ch}" width="{cw - 2}" height="{ch - 2}" '
                        f'fill="{fill}"/>')
            body.append(_text(left + j * cw + cw / 2, top + i * ch + 17, _f(v)))
    return _svg(W, H, body)


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
                     + ", ".join(f"{k}: {n} instances, {d[:10] if d else 'no digest recorded'}"
                                 for k, (d, n) in sets.items())
                     + "); their rows are not comparable and the averages mix them.\n")
    judges = {name: s.get("judge") for name, s in summaries.items()}
    if len(set(judges.values())) > 1:   # ASI and quality are the judge's numbers
        lines.append("> **DIFFERENT JUDGES.** These runs' ASI and answer quality were scored by different models ("
                     + ", ".join(f"{k}: {v or 'not recorded'}" for k, v in judges.items())
                     + "); their ASI and Table C.1 are not comparable.\n")
    lines.append("# GEO Defender across target LLMs\n")
    every = ("Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender", "Shield only", "TFSG only",
             "Spotlighting", "Sandwich Prompt", "PromptArmor", "RobustRAG")
    conds = [c for c in every if all(c in s["conditions"] for s in summaries.values())]
    head = ["Target LLM"] + [f"{c} {m}" for c in conds for m in ("ASR", "ASI", "BER")]
    rows = [[s["target_llm"]] + [_f(s["conditions"][c][m]) for c in conds for m in ("ASR", "ASI", "BER")]
            for s in summaries.values()]
    avg = ["Average"] + [_f(sum(s["conditions"][c][m] for s in summaries.values()) / len(summaries))
                         for c in conds for m in ("ASR", "ASI", "BER")]
    lines.append("## Table 1\n\n" + _table(head, rows + [avg]) + "\n")
    q = [(s["target_llm"], s["quality"]) for s in summaries.values() if s.get("quality", {}).get("n")]
    if q:
        quality_head = ["Target LLM", "Mean change", "95% CI", "Comparable or better (%)", "Better (%)"]
        quality_rows = [[t, f"{v['mean_change']:+.3f}", f"[{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]",
                         _f(v["comparable_or_better"]), _f(v["better"])] for t, v in q]
        lines.append("## Table C.1\n\n" + _table(quality_head, quality_rows) + "\n")
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
                         _table(["Source \\ Target"] + cols,
                                [[r] + [_f(vals.get((r, c))) for c in cols] for r in srcs]) + "\n")
            with open(os.path.join(out_dir, "figures", f"transfer_{metric.lower()}.svg"), "w", encoding="utf-8") as f:
                f.write(svg_heatmap(f"Transfer {metric} (source library x target LLM)", srcs, cols, vals,
                                    xlabel="target LLM", ylabel="source library", note=figure_note(notes)))
        lines.append("![transfer ASR](figures/transfer_asr.svg) ![transfer ASI](figures/transfer_asi.svg)\n")
    path = os.path.join(out_dir, "comparison.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
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
    st = r.get("stale")
    return {"fresh exposure": r["fresh"][top]["Shield only"]["exposure"],
            "fresh ASR": r["fresh"][top]["GEO Defender"]["ASR"],
            "stale exposure": st["Shield only"]["exposure"] if st else None,
            "stale ASR": st["GEO Defender"]["ASR"] if st else None,
            "static exposure": r["static"]["Shield only"]["exposure"],
            "static ASR": r["static"]["GEO Defender"]["ASR"],
            "clean top-k kept": r["clean_topk_kept"],
            "BER (GEO Defender)": r["static"]["GEO Defender"]["BER"],
            "BER (Shield only)": r["static"]["Shield only"]["BER"]}


def write_harden_report(run_dir, s):
    """harden_report.md and figures/harden_*.svg: by round, the fresh and stale attackers' exposure and ASR,
    the static families, utility (clean top-k kept, BER), the cross-play matrix and the cost."""
    b = s["harden"]
    figs = os.path.join(run_dir, "figures")
    os.makedirs(figs, exist_ok=True)
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
            + [_f(c[n]) for n in ("fresh exposure", "fresh ASR", "stale exposure", "stale ASR", "static exposure",
                                  "static ASR")]
            + [_f(c["clean top-k kept"], 1), _f(c["BER (GEO Defender)"]), r["cost"]["replies"],
               _f(r["cost"]["usd"], 4)]
            for r, c in zip(rounds, cells)]
    lines.append(_table(["Round", "Survivors", "Pool", f"Fresh B={top} exposure@{k}", f"Fresh B={top} ASR",
                         "Stale exposure", "Stale ASR", "Static exposure", "Static ASR", "Clean top-k kept",
                         "BER (static)", "LLM replies", "USD"], rows) + "\n")
    lines.append("Exposure: the attack document in the Shield's top-k (%); ASR: under GEO Defender (Shield top-k "
                 "and the round's library). Fresh: an attacker of its own seed at each round; stale: round 0's.\n")
    plot = lambda names: {n: [c[n] for c in cells] for n in names}
    for name, title, series, ylabel in (
            ("harden_attack.svg", f"Attackers by round (B={top})",
             plot(("fresh exposure", "stale exposure", "fresh ASR", "stale ASR")), f"exposure@{k} / ASR (%)"),
            ("harden_utility.svg", "Utility by round", plot(("clean top-k kept", "BER (GEO Defender)",
                                                             "BER (Shield only)")), "clean top-k kept / BER (%)")):
        with open(os.path.join(figs, name), "w", encoding="utf-8") as f:
            f.write(svg_lines(title, xs, series, xlabel="hardening round", ylabel=ylabel, note=note))
        lines.append(f"![{title}](figures/{name})")
    m = b["crossplay"]["exposure"]
    lines += ["", f"## Cross-play: exposure@{k} (%), defense round by attacker round\n",
              "Each round's test documents (its fresh attacker's best at the largest budget) rescored under every "
              "round's Shield; the diagonal is the fresh attacker of each round.\n",
              _table(["defense \\ attacker"] + [f"r{a}" for a in range(len(m))],
                     [[f"r{d}"] + [_f(v) for v in row] for d, row in enumerate(m)]) + "\n"]
    with open(os.path.join(figs, "harden_crossplay.svg"), "w", encoding="utf-8") as f:
        f.write(svg_heatmap(f"Cross-play exposure@{k} (%)", [f"defense r{d}" for d in range(len(m))],
                            [f"attacker r{a}" for a in range(len(m))],
                            {(f"defense r{d}", f"attacker r{a}"): v for d, row in enumerate(m)
                             for a, v in enumerate(row)},
                            xlabel="attacker round (its test documents)", ylabel="defense round (its Shield)",
                            note=note))
    lines.append("![Cross-play](figures/harden_crossplay.svg)\n")
    lines += usage_lines(s.get("usage") or {})
    with open(os.path.join(run_dir, "harden_report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
