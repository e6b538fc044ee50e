"""Plain-string SVG figures, no plotting library: grouped bars, line charts and heatmaps whose every
label is placed from an estimate of its width, wrapped to the room it has, never outside the canvas
and never over another label; every figure titles both its axes, and one of an offline or
simulation run carries a note under its title (figure_note).

Usage: svg = svg_bars("ASR by condition", ["a", "b"], ["ASR"], {("a", "ASR"): 20.0, ("b", "ASR"): 5.0},
                      xlabel="condition", ylabel="ASR (%)")
"""
import html
import math


def given(v):
    """A measured value: a finite number (not None, NaN or infinite). Tables print "-" and figures draw nothing
    where not."""
    return v is not None and math.isfinite(v)


def fmt(v, nd=2):
    """A value as a table or label prints it: nd decimals, \"-\" where it is not given."""
    return f"{v:.{nd}f}" if given(v) else "-"


# ----------------------------------------------------------------------------- layout
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
    """Words of `label` in lines no wider than `width` px: a line may break after any underscore or hyphen,
    and a piece still longer than a line is cut every line's width of characters."""
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


def svg_heatmap(title, rows, cols, values, *, xlabel, ylabel, note=None):
    """values[(row, col)] -> float (None or NaN: a grey cell labelled "-"); darker = higher; each cell
    labelled with its value. xlabel titles the columns (above their names), ylabel the rows (above their
    names, the header of that column, as in a table); note (figure_note) goes under the title."""
    cw = max([90] + [text_width(c) + 12 for c in cols])
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
            body.append(_text(left + j * cw + cw / 2, top + i * ch + 17, fmt(v)))
    return _svg(W, H, body)
