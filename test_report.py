"""report.py: figures keep every label inside and apart; the comparison across runs.
Run: python -m pytest -q test_report.py
"""
import re

import pytest

import evaluation
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
    s = {"a": summ("x:A", 10.0, {"(own)": {"ASR": 5.0, "ASI": 2.0}, "x:B": {"ASR": 7.0, "ASI": 3.0}}),
         "b": summ("x:B", 30.0, {"(own)": {"ASR": 6.0, "ASI": 4.0}, "x:A": {"ASR": 8.0, "ASI": 1.0}})}
    path = report.write_comparison(str(tmp_path), s)
    text = open(path).read()
    assert "| Average | 20.00 |" in text
    assert "| x:A | 5.00 | 8.00 |" in text and "| x:B | 7.00 | 6.00 |" in text     # rows: source, cols: target
    assert open(tmp_path / "figures" / "transfer_asr.svg").read().startswith("<svg")
    assert "DIFFERENT TEST SETS" not in text                   # neither run recorded a digest: nothing to compare
    for k, d in (("a", "1" * 40), ("b", "1" * 40)):
        s[k]["test_set_sha1"], s[k]["test_instances"] = d, 7
    assert "DIFFERENT TEST SETS" not in open(report.write_comparison(str(tmp_path), s)).read()
    s["b"]["test_set_sha1"] = "2" * 40                         # evaluated on other instances: flagged
    assert "DIFFERENT TEST SETS.** These runs were not evaluated on the same instances (a: 7 instances, 1111111111" \
        in open(report.write_comparison(str(tmp_path), s)).read()


def _text_boxes(svg):
    """(x0, y0, x1, y1, text) of every <text> of an SVG as report.py places it (its width estimate)."""
    import re as _re
    import xml.etree.ElementTree as ET
    root = ET.fromstring(svg)
    W, H = float(root.get("width")), float(root.get("height"))
    boxes = []
    for el in root.iter("{http://www.w3.org/2000/svg}text"):
        s, size = el.text or "", float(el.get("font-size") or 11)
        x, y, w = float(el.get("x")), float(el.get("y")), report.text_width(el.text or "", size)
        rot = _re.search(r"rotate\(-90", el.get("transform") or "")
        if rot:                                   # the y-axis unit: vertical
            boxes.append((x - size, y - w / 2, x, y + w / 2, s))
            continue
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[el.get("text-anchor") or "start"]
        boxes.append((x0, y - size * 0.8, x0 + w, y + size * 0.2, s))
    return W, H, boxes


def _figures():
    """One figure of each kind on adversarial data (long names, many series, negatives, close lines)."""
    methods = ["structure_boost_with_a_very_long_name", "keyword_stuff", "authority_voice", "x",
               "full_agentic_rewrite"]
    series = evaluation.CONDITIONS                       # ten conditions: the width they need
    vals = {(m, s): (-1) ** i * 7.3 * (i + j) for i, m in enumerate(methods) for j, s in enumerate(series)}
    figs = [report.svg_bars("ASR by GEO method (dashed outline: unseen)", methods, series, vals,
                            dashed={"x", "keyword_stuff"}),
            report.svg_bars("few bars", ["A", "B"], ["ASR", "ASI"], {("A", "ASR"): 50.0, ("A", "ASI"): 1.0,
                                                                     ("B", "ASR"): 0.0, ("B", "ASI"): 99.0}),
            report.svg_lines("by epoch", ["E0", "E1", "E2", "E3", "E4"], {"ASR": [38.1, 10.7, 10.7, 10.9, 10.7],
                                                                        "ASI": [25.6, 10.8, 10.6, 10.7, 17.6]}),
            report.svg_heatmap("Transfer ASR (source library x target LLM)",
                               ["openai:gpt-5.5", "anthropic:claude-opus-4.8"],
                               ["openai:gpt-5.5", "anthropic:claude-opus-4.8"],
                               {("openai:gpt-5.5", "openai:gpt-5.5"): 5.0})]
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
    assert any(s == "%" for *_, s in _text_boxes(figs[0])[2])             # the unit on the y axis


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
    return bars, zero, [t for t in root.iter(ns + "text") if t.get("font-size") == str(report.LABEL_SIZE)]


def test_negative_bars_hang_below_zero_with_their_labels():
    """A condition that strengthens an attack (a negative reduction) is drawn down from the zero line,
    its label beneath it, flat or upright, with many bars as with few."""
    for groups, series in ((["A"], ["S"]), (["A", "B", "C", "D", "E", "F", "G"], evaluation.CONDITIONS[1:])):
        vals = {(g, s): 40.0 for g in groups for s in series}
        vals[("A", series[0])] = -25.0
        bars, zero, texts = _bars(report.svg_bars("t", groups, series, vals))
        y, h = bars[f"A / {series[0]}: -25.00"]
        assert abs(y - zero) < 0.01 and h > 10                               # from the zero line, downwards
        label = [t for t in texts if t.text == "-25"]
        assert len(label) == 1 and float(label[0].get("y")) > y + h - 0.01   # beneath the bar's end
        assert len([t for t in texts if t.text == "40"]) == len(vals) - 1    # every other bar labelled


def test_a_zero_bar_is_drawn_labelled_a_missing_one_is_not():
    vals = {("A", "S"): 0.0, ("B", "S"): float("nan"), ("C", "S"): 12.5}
    bars, zero, texts = _bars(report.svg_bars("t", ["A", "B", "C"], ["S"], vals))
    assert set(bars) == {"A / S: 0.00", "C / S: 12.50"}                       # nothing drawn for the missing one
    assert bars["A / S: 0.00"][1] > 0                                         # a visible line on the zero line
    assert sorted(t.text for t in texts if t.text in ("0", "12.5")) == ["0", "12.5"]


def test_the_axis_ends_where_the_values_do():
    """Nice ticks over [min(0, lo), max(0, hi)]: a reduction of 100% computed as 100.00000000000001 ends
    the axis at 100 (not 125), a negative one opens it below zero."""
    asi = 6.845238095238096                                    # an ASI of the demo: 100 * asi / asi > 100
    vals = {("A", "S"): 100 * (asi - 0.0) / asi, ("B", "S"): -20.0}
    assert vals[("A", "S")] > 100
    svg = report.svg_bars("t", ["A", "B"], ["S"], vals)
    ticks = [float(t) for t in re.findall(r'text-anchor="end" font-size="11">([-0-9.]+)<', svg)]
    assert max(ticks) == 100 and min(ticks) == -25
    assert report.nice_ticks(0, 48.8) == [0, 10, 20, 30, 40, 50] and report.nice_ticks(-3, 0)[-1] == 0
