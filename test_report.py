"""report.py: figures keep every label inside and apart, title both axes and say when a run is offline;
the harden figure draws what its table prints; the comparison across runs.
Run: python -m pytest -q test_report.py
"""
import os
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


AXES = [{"xlabel": "GEO method", "ylabel": "ASR (%)"}, {"xlabel": "group", "ylabel": "%"},
        {"xlabel": "TFSG library epoch", "ylabel": "ASR / ASI (%)"},
        {"xlabel": "target LLM", "ylabel": "source library"}]       # the axis titles of _figures(), in order


def _figures():
    """One figure of each kind on adversarial data (long names, many series, negatives, close lines)."""
    methods = ["structure_boost_with_a_very_long_name", "keyword_stuff", "authority_voice", "x",
               "full_agentic_rewrite"]
    series = evaluation.CONDITIONS                       # ten conditions: the width they need
    vals = {(m, s): (-1) ** i * 7.3 * (i + j) for i, m in enumerate(methods) for j, s in enumerate(series)}
    figs = [report.svg_bars("ASR by GEO method (dashed outline: unseen)", methods, series, vals,
                            dashed={"x", "keyword_stuff"}, **AXES[0]),
            report.svg_bars("few bars", ["A", "B"], ["ASR", "ASI"], {("A", "ASR"): 50.0, ("A", "ASI"): 1.0,
                                                                     ("B", "ASR"): 0.0, ("B", "ASI"): 99.0},
                            **AXES[1]),
            report.svg_lines("by epoch", ["E0", "E1", "E2", "E3", "E4"], {"ASR": [38.1, 10.7, 10.7, 10.9, 10.7],
                                                                        "ASI": [25.6, 10.8, 10.6, 10.7, 17.6]},
                             **AXES[2]),
            report.svg_heatmap("Transfer ASR (source library x target LLM)",
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
    return bars, zero, [t for t in root.iter(ns + "text") if t.get("font-size") == str(report.LABEL_SIZE)]


def test_negative_bars_hang_below_zero_with_their_labels():
    """A condition that strengthens an attack (a negative reduction) is drawn down from the zero line,
    its label beneath it, flat or upright, with many bars as with few."""
    for groups, series in ((["A"], ["S"]), (["A", "B", "C", "D", "E", "F", "G"], evaluation.CONDITIONS[1:])):
        vals = {(g, s): 40.0 for g in groups for s in series}
        vals[("A", series[0])] = -25.0
        bars, zero, texts = _bars(report.svg_bars("t", groups, series, vals, xlabel="x", ylabel="y"))
        y, h = bars[f"A / {series[0]}: -25.00"]
        assert abs(y - zero) < 0.01 and h > 10                               # from the zero line, downwards
        label = [t for t in texts if t.text == "-25"]
        assert len(label) == 1 and float(label[0].get("y")) > y + h - 0.01   # beneath the bar's end
        assert len([t for t in texts if t.text == "40"]) == len(vals) - 1    # every other bar labelled


def test_a_zero_bar_is_drawn_labelled_a_missing_one_is_not():
    vals = {("A", "S"): 0.0, ("B", "S"): float("nan"), ("C", "S"): 12.5}
    bars, zero, texts = _bars(report.svg_bars("t", ["A", "B", "C"], ["S"], vals, xlabel="x", ylabel="y"))
    assert set(bars) == {"A / S: 0.00", "C / S: 12.50"}                       # nothing drawn for the missing one
    assert bars["A / S: 0.00"][1] > 0                                         # a visible line on the zero line
    assert sorted(t.text for t in texts if t.text in ("0", "12.5")) == ["0", "12.5"]


def test_the_axis_ends_where_the_values_do():
    """Nice ticks over [min(0, lo), max(0, hi)]: a reduction of 100% computed as 100.00000000000001 ends
    the axis at 100 (not 125), a negative one opens it below zero."""
    asi = 6.845238095238096                                    # an ASI of the demo: 100 * asi / asi > 100
    vals = {("A", "S"): 100 * (asi - 0.0) / asi, ("B", "S"): -20.0}
    assert vals[("A", "S")] > 100
    svg = report.svg_bars("t", ["A", "B"], ["S"], vals, xlabel="x", ylabel="y")
    ticks = [float(t) for t in re.findall(r'text-anchor="end" font-size="11">([-0-9.]+)<', svg)]
    assert max(ticks) == 100 and min(ticks) == -25
    assert report.nice_ticks(0, 48.8) == [0, 10, 20, 30, 40, 50] and report.nice_ticks(-3, 0)[-1] == 0


def _apart(p, q):
    """Two boxes (x0, y0, x1, y1, ...) that do not overlap (touching edges do not)."""
    return p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1]


def test_place_labels_keeps_boxes_apart_in_order_and_inside():
    """One column's labels (label_slots, then place_labels) for equal and near-equal points, a cluster at
    the bottom edge, and more labels than fit around their points: boxes h tall, at least LABEL_GAP apart,
    in their wanted order, inside [lo, hi]; two points on one value get one label above, one below, both
    off the marker; a lone label stays where it is wanted."""
    h, lo, hi, r = 10, 0.0, 200.0, report.MARKER_R
    cases = [[100.0, 100.0], [100.0, 100.3], [100.0] * 6, [195.0, 196.0, 199.0], [5.0, 5.0, 5.0, 120.0, 121.0],
             [50.0 + 3 * i for i in range(12)], [10.0 + 12.5 * i for i in range(15)]]
    for ys in cases:
        want = report.label_slots(ys, h, lo, hi)
        got = report.place_labels(want, h, lo, hi)
        order = sorted(range(len(ys)), key=lambda i: (want[i], i))
        assert [got[i] for i in order] == sorted(got), ys                       # the wanted order kept
        for a, b in zip(order, order[1:]):
            assert got[b] - got[a] >= h + report.LABEL_GAP - 1e-9, ys           # apart
        assert all(lo - 1e-9 <= c - h / 2 and c + h / 2 <= hi + 1e-9 for c in got), ys
    up, down = report.place_labels(report.label_slots([100.0, 100.0], h, lo, hi), h, lo, hi)
    assert up + h / 2 <= 100.0 - r and down - h / 2 >= 100.0 + r                # off the shared marker
    assert report.place_labels([42.0], h, lo, hi) == [42.0]
    with pytest.raises(ValueError, match="need"):
        report.place_labels([5.0] * 30, h, lo, hi)


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
    figs = [report.svg_lines("equal", ["r0", "r1", "r2"], {"fresh exposure": [50.0, 30.0, 20.0],
                                                           "stale exposure": [50.0, 30.2, 20.0],
                                                           "fresh ASR": [10.7, 10.7, 0.0],
                                                           "stale ASR": [10.7, 10.9, 0.0]}, **kw),
            report.svg_lines("zeros", ["E0", "E1"], {"a": [0.0, 5.0], "b": [0.0, 5.0], "c": [0.0, 5.1]}, **kw),
            report.svg_lines("crowded", ["B=1", "B=3"], {c: [v, 40.0 - 3 * i] for i, (c, v) in enumerate(zip(
                evaluation.CONDITIONS[2:], [17.9, 14.3, 14.3, 10.7, 14.3, 14.3, 10.7, 7.1]))}, **kw),
            report.svg_lines("many", [f"E{i}" for i in range(20)], {"a": [100.0] * 20, "b": [99.9] * 20}, **kw)]
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
            assert (report.OFFLINE_FIGURE in texts) == expect, name


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
    assert "| B | +0.0 (CI holds 0) |" in text and "| A | +66.7 |" in text


def test_the_report_gives_each_method_its_own_count_where_a_family_was_refused(tmp_path):
    """A benchmark where build-bench's gate refused every rewrite of m2 on one group: the per-method section
    names each method's instances and refused groups; without refusals it says nothing of them."""
    s = _eval_summary([])
    for k in s["methods"]:
        s["methods"][k]["m1"]["n"], s["methods"][k]["m2"]["n"] = 4, 3
    report.write_report(str(tmp_path / "a"), s)
    assert "Test instances per method" not in (tmp_path / "a" / "report.md").read_text()
    report.write_report(str(tmp_path / "b"), {**s, "family_drops": {"m1": 0, "m2": 1}})
    assert "per method (groups where build-bench's gate refused every rewrite of a method have none of it): m1 4 " \
           "(0 groups refused), m2 3 (1 groups refused)." in (tmp_path / "b" / "report.md").read_text()


def test_a_harden_test_attacker_of_another_algorithm_is_out_of_distribution(tmp_path):
    s = _harden_summary([])
    s["harden"]["settings"] = {"algorithm": "mageo", "test_algorithm": "repair"}
    report.write_harden_report(str(tmp_path), s)
    assert "fresh test attacker diagnose-and-repair (AgentGEO): out of distribution" in \
        (tmp_path / "harden_report.md").read_text()
