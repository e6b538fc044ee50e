"""figures.py: every label inside the canvas and apart from every other, axes titled with gridlines and
markers, bars below zero, zero and missing bars told apart, label placement, PNG rendering.
Vendors with: figures.py (no torch)
Run: python -m pytest -q test_figures.py
"""
import re

import pytest

import figures

# ten condition names: the width a legend of the paper's conditions needs
CONDITIONS = ["Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender", "Shield only", "TFSG only",
              "Spotlighting", "Sandwich Prompt", "PromptArmor", "RobustRAG"]


def _text_boxes(svg):
    """(x0, y0, x1, y1, text) of every <text> of an SVG as figures.py places it (its width estimate)."""
    import re as _re
    import xml.etree.ElementTree as ET
    root = ET.fromstring(svg)
    W, H = float(root.get("width")), float(root.get("height"))
    boxes = []
    for el in root.iter("{http://www.w3.org/2000/svg}text"):
        s, size = el.text or "", float(el.get("font-size") or 11)
        x, y, w = float(el.get("x")), float(el.get("y")), figures.text_width(el.text or "", size)
        rot = _re.search(r"rotate\(-90", el.get("transform") or "")
        if rot:                                   # the y-axis unit: vertical
            boxes.append((x - size, y - w / 2, x, y + w / 2, s))
            continue
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[el.get("text-anchor") or "start"]
        boxes.append((x0, y - size * 0.8, x0 + w, y + size * 0.2, s))
    return W, H, boxes


AXES = [{"xlabel": "GEO method", "ylabel": "ASR (%)"}, {"xlabel": "group", "ylabel": "%"},
        {"xlabel": "TFSG library epoch", "ylabel": "ASR / ASI (%)"},
        {"xlabel": "target LLM", "ylabel": "source library"}]       # the axis titles of _figures(), in order


def _figures():
    """One figure of each kind on adversarial data (long names, many series, negatives, close lines)."""
    methods = ["structure_boost_with_a_very_long_name", "keyword_stuff", "authority_voice", "x",
               "full_agentic_rewrite"]
    series = CONDITIONS                       # ten conditions: the width they need
    vals = {(m, s): (-1) ** i * 7.3 * (i + j) for i, m in enumerate(methods) for j, s in enumerate(series)}
    figs = [figures.svg_bars("ASR by GEO method (dashed outline: unseen)", methods, series, vals,
                            dashed={"x", "keyword_stuff"}, **AXES[0]),
            figures.svg_bars("few bars", ["A", "B"], ["ASR", "ASI"], {("A", "ASR"): 50.0, ("A", "ASI"): 1.0,
                                                                     ("B", "ASR"): 0.0, ("B", "ASI"): 99.0},
                            **AXES[1]),
            figures.svg_lines("by epoch", ["E0", "E1", "E2", "E3", "E4"], {"ASR": [38.1, 10.7, 10.7, 10.9, 10.7],
                                                                        "ASI": [25.6, 10.8, 10.6, 10.7, 17.6]},
                             **AXES[2]),
            figures.svg_heatmap("Transfer ASR (source library x target LLM)",
                               ["openai:gpt-5.5", "anthropic:claude-opus-4.8"],
                               ["openai:gpt-5.5", "anthropic:claude-opus-4.8"],
                               {("openai:gpt-5.5", "openai:gpt-5.5"): 5.0}, **AXES[3])]
    return figs


def test_figure_labels_stay_inside_without_overlapping():
    """Labels wrapped instead of cut or overlapping, the legend inside: checked on adversarial data."""
    for svg in _figures():
        W, H, boxes = _text_boxes(svg)
        for x0, y0, x1, y1, s in boxes:
            assert 0 <= x0 and x1 <= W and 0 <= y0 and y1 <= H, (s, (x0, y0, x1, y1), (W, H))
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                p, q = boxes[a], boxes[b]
                apart = p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]
                assert apart, (p[4], q[4])


def test_figures_draw_axes_with_gridlines_units_markers():
    """Axes with ticks and gridlines, every bar labelled, the unit on the y axis, markers on lines."""
    figs = _figures()
    for svg in figs:
        assert 'stroke="#ddd"' in svg or "Transfer" in svg                # gridlines (not on the heatmap)
    assert "(unseen)" in figs[0] and "structure_" in figs[0] and "<circle" in figs[2]
    assert ">50<" in figs[1] and ">99<" in figs[1] and ">0<" in figs[1]   # every bar labelled, zero too
    assert any(s == "ASR (%)" for *_, s in _text_boxes(figs[0])[2])       # the unit on the y axis


def test_figures_render_to_png_where_cairosvg_is_installed(tmp_path):
    cairosvg = pytest.importorskip("cairosvg")
    figs = _figures()
    for i, svg in enumerate(figs):
        cairosvg.svg2png(bytestring=svg.encode(), write_to=str(tmp_path / f"f{i}.png"))
        assert (tmp_path / f"f{i}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bars(svg):
    """{title text: (y, height)} of an svg_bars figure's bars, the zero line's y, and its value labels
    (texts at the labels' size; the tick labels are larger)."""
    import xml.etree.ElementTree as ET
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg)
    bars = {r.find(ns + "title").text: (float(r.get("y")), float(r.get("height")))
            for r in root.iter(ns + "rect") if r.find(ns + "title") is not None}
    zero = float([ln for ln in root.iter(ns + "line") if ln.get("stroke") == "#333"][-1].get("y1"))
    return bars, zero, [t for t in root.iter(ns + "text") if t.get("font-size") == str(figures.LABEL_SIZE)]


def test_negative_bars_hang_below_zero_with_their_labels():
    """A condition that strengthens an attack (a negative reduction) is drawn down from the zero line,
    its label beneath it, flat or upright, with many bars as with few."""
    for groups, series in ((["A"], ["S"]), (["A", "B", "C", "D", "E", "F", "G"], CONDITIONS[1:])):
        vals = {(g, s): 40.0 for g in groups for s in series}
        vals[("A", series[0])] = -25.0
        bars, zero, texts = _bars(figures.svg_bars("t", groups, series, vals, xlabel="x", ylabel="y"))
        y, h = bars[f"A / {series[0]}: -25.00"]
        assert abs(y - zero) < 0.01 and h > 10                               # from the zero line, downwards
        label = [t for t in texts if t.text == "-25"]
        assert len(label) == 1 and float(label[0].get("y")) > y + h - 0.01   # beneath the bar's end
        assert len([t for t in texts if t.text == "40"]) == len(vals) - 1    # every other bar labelled


def test_a_zero_bar_is_drawn_labelled_a_missing_one_is_not():
    vals = {("A", "S"): 0.0, ("B", "S"): float("nan"), ("C", "S"): 12.5}
    bars, zero, texts = _bars(figures.svg_bars("t", ["A", "B", "C"], ["S"], vals, xlabel="x", ylabel="y"))
    assert set(bars) == {"A / S: 0.00", "C / S: 12.50"}                       # nothing drawn for the missing one
    assert bars["A / S: 0.00"][1] > 0                                         # a visible line on the zero line
    assert sorted(t.text for t in texts if t.text in ("0", "12.5")) == ["0", "12.5"]


def test_the_axis_ends_where_the_values_do():
    """Nice ticks over [min(0, lo), max(0, hi)]: a reduction of 100% computed as 100.00000000000001 ends
    the axis at 100 (not 125), a negative one opens it below zero."""
    asi = 6.845238095238096                                    # an ASI of the demo: 100 * asi / asi > 100
    vals = {("A", "S"): 100 * (asi - 0.0) / asi, ("B", "S"): -20.0}
    assert vals[("A", "S")] > 100
    svg = figures.svg_bars("t", ["A", "B"], ["S"], vals, xlabel="x", ylabel="y")
    ticks = [float(t) for t in re.findall(r'text-anchor="end" font-size="11">([-0-9.]+)<', svg)]
    assert max(ticks) == 100 and min(ticks) == -25
    assert figures.nice_ticks(0, 48.8) == [0, 10, 20, 30, 40, 50] and figures.nice_ticks(-3, 0)[-1] == 0


def _apart(p, q):
    """Two boxes (x0, y0, x1, y1, ...) that do not overlap (touching edges do not)."""
    return p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]


def test_place_labels_keeps_boxes_apart_in_order_and_inside():
    """One column's labels (label_slots, then place_labels) for equal and near-equal points, a cluster at
    the bottom edge, and more labels than fit around their points: boxes h tall, at least LABEL_GAP apart,
    in their wanted order, inside [lo, hi]; two points on one value get one label above, one below, both
    off the marker; a lone label stays where it is wanted."""
    h, lo, hi, r = 10, 0.0, 200.0, figures.MARKER_R
    cases = [[100.0, 100.0], [100.0, 100.3], [100.0] * 6, [195.0, 196.0, 199.0], [5.0, 5.0, 5.0, 120.0, 121.0],
             [50.0 + 3 * i for i in range(12)], [10.0 + 12.5 * i for i in range(15)]]
    for ys in cases:
        want = figures.label_slots(ys, h, lo, hi)
        got = figures.place_labels(want, h, lo, hi)
        order = sorted(range(len(ys)), key=lambda i: (want[i], i))
        assert [got[i] for i in order] == sorted(got), ys                       # the wanted order kept
        for a, b in zip(order, order[1:]):
            assert got[b] - got[a] >= h + figures.LABEL_GAP - 1e-9, ys           # apart
        assert all(lo - 1e-9 <= c - h / 2 and c + h / 2 <= hi + 1e-9 for c in got), ys
    up, down = figures.place_labels(figures.label_slots([100.0, 100.0], h, lo, hi), h, lo, hi)
    assert up + h / 2 <= 100.0 - r and down - h / 2 >= 100.0 + r                # off the shared marker
    assert figures.place_labels([42.0], h, lo, hi) == [42.0]
    with pytest.raises(ValueError, match="need"):
        figures.place_labels([5.0] * 30, h, lo, hi)


def _markers(svg):
    """(x0, y0, x1, y1) boxes of a line chart's point markers (those with a tooltip; legend ones have none)."""
    import xml.etree.ElementTree as ET
    ns = "{http://www.w3.org/2000/svg}"
    out = []
    for c in ET.fromstring(svg).iter(ns + "circle"):
        if c.find(ns + "title") is not None:
            x, y, r = float(c.get("cx")), float(c.get("cy")), float(c.get("r"))
            out.append((x - r, y - r, x + r, y + r))
    return out


def test_line_chart_value_labels_never_overlap_labels_or_markers():
    """The collisions of epochs.svg and harden_attack.svg: two series on equal or near-equal values at one
    x (a fresh and a stale attacker), three on the zero line, eight conditions crowded at B=1 (an attack
    figure of the demo), twenty columns of wide labels. No text box overlaps another or leaves the canvas,
    and no value label covers a point's marker."""
    kw = {"xlabel": "hardening round", "ylabel": "%"}
    figs = [figures.svg_lines("equal", ["r0", "r1", "r2"], {"fresh exposure": [50.0, 30.0, 20.0],
                                                           "stale exposure": [50.0, 30.2, 20.0],
                                                           "fresh ASR": [10.7, 10.7, 0.0],
                                                           "stale ASR": [10.7, 10.9, 0.0]}, **kw),
            figures.svg_lines("zeros", ["E0", "E1"], {"a": [0.0, 5.0], "b": [0.0, 5.0], "c": [0.0, 5.1]}, **kw),
            figures.svg_lines("crowded", ["B=1", "B=3"], {c: [v, 40.0 - 3 * i] for i, (c, v) in enumerate(zip(
                CONDITIONS[2:], [17.9, 14.3, 14.3, 10.7, 14.3, 14.3, 10.7, 7.1]))}, **kw),
            figures.svg_lines("many", [f"E{i}" for i in range(20)], {"a": [100.0] * 20, "b": [99.9] * 20}, **kw)]
    for svg in figs:
        W, H, boxes = _text_boxes(svg)
        for x0, y0, x1, y1, s in boxes:
            assert 0 <= x0 and x1 <= W and 0 <= y0 and y1 <= H, (s, (x0, y0, x1, y1), (W, H))
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                assert _apart(boxes[a], boxes[b]), (boxes[a], boxes[b])
        values = [bx for bx in boxes if re.fullmatch(r"-?\d+\.\d", bx[4])]
        assert len(values) == len(_markers(svg))                               # every point labelled
        for bx in values:
            for m in _markers(svg):
                assert _apart(bx, m), (bx, m)


def _parse(svg):
    """The <text> elements of an SVG."""
    import xml.etree.ElementTree as ET
    return list(ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"))


def test_every_figure_titles_both_axes():
    """Bars and lines: the x title lies flat below the plot and its labels, the y title upright at the
    left. The heatmap: the columns' title above their names, the rows' title heading their names."""
    for svg, axes in zip(_figures(), AXES):
        texts = _parse(svg)
        x = [t for t in texts if t.text == axes["xlabel"] and not t.get("transform")]
        y = [t for t in texts if t.text == axes["ylabel"]]
        assert len(x) == 1 and len(y) == 1, axes
        if "Transfer" in svg:
            names = [t for t in texts if t.text == "openai:gpt-5.5"]           # a column's name, a row's name
            col, row = sorted(names, key=lambda t: float(t.get("y")))
            assert float(x[0].get("y")) < float(col.get("y")) and y[0].get("y") == col.get("y")
            assert y[0].get("text-anchor") == "end" and y[0].get("x") == row.get("x")
        else:
            assert "rotate(-90" in y[0].get("transform") and float(y[0].get("x")) < 20
            assert float(x[0].get("y")) == max(float(t.get("y")) for t in texts)


def test_an_infinite_value_and_a_heatmap_without_columns_draw_without_error():
    """inf is no measured value (an overflowed ratio): drawn as NaN is, a gap labelled '-' (it raised
    OverflowError); a heatmap of no columns is drawn empty (max() of nothing raised)."""
    bars = figures.svg_bars("t", ["a", "b"], ["s"], {("a", "s"): float("inf"), ("b", "s"): 2.0}, xlabel="x",
                            ylabel="y")
    assert bars.startswith("<svg") and "inf" not in bars
    heat = figures.svg_heatmap("t", ["r"], ["c"], {("r", "c"): float("-inf")}, xlabel="x", ylabel="y")
    assert ">-<" in heat and "inf" not in heat
    assert figures.svg_heatmap("t", ["r"], [], {}, xlabel="x", ylabel="y").startswith("<svg")
