"""bench_audit.py: the family classifier is cross-validated by group and tells apart what differs and
not what is alike; distances, surface markers, refusal rates; the exposure gain against a hand count;
the command writes its JSON and markdown.
Run: python -m pytest -q test_bench_audit.py
"""
import json

import numpy as np
import pytest

import bench_audit
import run
from testing import SAMPLE


def _bench(tmp_path, edit_of, families, n=12, honest=None):
    """A benchmark whose family f rewrites each source as edit_of[f](source, group number); a family of
    `families` without an edit_of has no instances (the gate refused it on every group); honest(source,
    group number): each group's honest edit."""
    lines = [{"_meta": {"methods": families, "seen_methods": families[:1], "synthetic": True}}]
    refused = {"failed": {f: "refused" for f in families if f not in edit_of}} if set(families) - set(edit_of) else {}
    for i in range(n):
        docs = [{"doc_id": f"g{i}-{j}", "url": f"https://e.org/{i}/{j}",
                 "text": f"Document {j} of group {i} says that item {i * 7 + j} costs {j + 1} units."}
                for j in range(10)]
        src = docs[3]["text"]
        lines.append({"group_id": f"g{i:02d}", "query": f"What does item {i * 7 + 3} cost?", "docs": docs,
                      "source_index": 3, "attacks": {f: edit_of[f](src, i) for f in families if f in edit_of},
                      **refused, **({"honest": honest(src, i), "split": "test"} if honest else {})})
    p = tmp_path / "b.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return str(p)


def test_folds_never_split_a_group():
    folds = bench_audit.group_folds(["b", "a", "c", "a", "d", "b"], 3)
    assert set(folds) == {"a", "b", "c", "d"} and folds == bench_audit.group_folds(["d", "c", "b", "a"], 3)
    # groups sharing a page (geodef.linked_groups) in one fold: a copy of one group's page would calibrate the
    # detector that scores the other's
    linked = bench_audit.group_folds(["a", "b", "c"], 3, {"a": {"a", "b"}, "b": {"a", "b"}, "c": {"c"}})
    assert linked["a"] == linked["b"] != linked["c"]


def test_every_edit_is_predicted_once():
    r = bench_audit.audit(SAMPLE)
    conf = np.array(r["classifier"]["confusion"])
    assert conf.shape == (7, 7) and conf.sum() == r["edits"]
    groups = bench_audit.geodef.load_bench(SAMPLE)
    assert [conf[i].sum() for i in range(7)] == [sum(f in g.attacks for g in groups) for f in r["families"]]
    (ss, su), (us, uu) = r["classifier"]["seen_vs_unseen"]
    assert ss + su == sum(conf[i].sum() for i, f in enumerate(r["families"]) if f in r["seen"])
    # chance: always naming the most frequent family (seen families edit every group, unseen ones the test
    # groups only), not one over the number of families
    assert r["classifier"]["chance"] == round(max(conf.sum(1)) / conf.sum(), 4) > 1 / 7


def test_the_classifier_tells_a_distinct_family_apart_and_not_two_alike(tmp_path):
    """A and B append the same kind of sentence; C adds a heading and a list: C is recognised, A and B
    are confused with each other (and never with C)."""
    same = lambda s, i: s + f" Experts agree this is the best choice for item {i}."
    edit_of = {"A": same, "B": lambda s, i: s + f" Experts agree this is the best choice for item {i}.",
               "C": lambda s, i: f"## Overview\n\n- {s}\n- Key takeaway: see item {i}."}
    r = bench_audit.audit(_bench(tmp_path, edit_of, ["A", "B", "C"]), folds=4)
    conf = np.array(r["classifier"]["confusion"])
    assert r["classifier"]["recall"]["C"] == 1.0 and conf[0, 2] == conf[1, 2] == 0
    assert r["distances"]["added_ngram_js"][0][1] == 0.0 and r["distances"]["added_ngram_js"][0][2] > 0.5
    assert r["surface_markers"]["C"]["heading"] == 100.0 and r["surface_markers"]["A"]["heading"] == 0.0
    null = r["classifier"]["null"]                  # shuffled within groups, the families are 1 in 3 at best
    assert null["permutations"] == 200 and null["mean"] < 0.5 < r["classifier"]["accuracy"] and null["p_value"] < 0.01


def test_the_divergence_reads_the_added_words_alone(tmp_path):
    """Two families that add the same sentence, one of them also cutting the source's first word: their
    added n-grams are one distribution (JS 0); the edit size, reported apart, tells them apart."""
    edit_of = {"A": lambda s, i: s + f" Trusted by experts {i}.",
               "B": lambda s, i: s.split(" ", 1)[1] + f" Trusted by experts {i}."}       # its first word cut
    r = bench_audit.audit(_bench(tmp_path, edit_of, ["A", "B"]), folds=4)
    d = r["distances"]
    assert d["added_ngram_js"][0][1] == 0.0 and d["edit_size"]["B"] > d["edit_size"]["A"]


def test_the_transfer_check_asks_whether_seen_cues_separate_unseen_rewrites_from_honest_edits(tmp_path):
    """Seen A and unseen B add promotional sentences; unseen C edits as the honest editor does (the same
    clarifying sentence). A detector of A against honest edits and sources catches B (AUC 1) and cannot
    tell C from an honest edit (AUC 0.5); without honest edits the check says so."""
    promo = lambda word: lambda s, i: s + f" {word} experts say item {i} is the most trusted choice, 95% agree."
    clarify = lambda s, i: s + f" In other words, item {i} has a price in units."
    edit_of = {"A": promo("Leading"), "B": promo("Top"), "C": clarify}
    r = bench_audit.audit(_bench(tmp_path, edit_of, ["A", "B", "C"], n=16, honest=clarify), folds=4)
    t = r["transfer"]
    assert set(t) == {"B", "C"} and t["B"]["auc"] == 1.0 and t["B"]["tpr_at_5_fpr"] == 1.0 and t["B"]["n"] == 16
    assert t["C"]["auc"] == 0.5 and t["C"]["auc_ci"][0] <= 0.5 <= t["C"]["auc_ci"][1]
    assert "Do the seen families' cues transfer" in bench_audit.markdown(r)
    assert bench_audit.audit(_bench(tmp_path, edit_of, ["A", "B", "C"]), folds=4)["transfer"] is None
    path = _bench(tmp_path, edit_of, ["A", "B", "C"], n=16, honest=clarify)          # honest edits, no seen family
    lines = open(path).read().split("\n")
    lines[0] = json.dumps({"_meta": {"methods": ["A", "B", "C"], "synthetic": True}})
    open(path, "w").write("\n".join(lines))
    md = bench_audit.markdown(bench_audit.audit(path, folds=4))
    assert "No seen families named in this file" in md and "No honest edits" not in md


def test_the_exposure_gain_is_the_top_k_share_of_the_rewrite_minus_the_sources():
    """A ranker that scores by the number of '!' in a document: the rewrite with five '!' enters the top
    1 of every list, the source never was there."""
    class Bangs:
        def score(self, query, docs):
            import torch
            return torch.tensor([float(d.count("!")) for d in docs])
    groups = [bench_audit.geodef.QueryGroup(f"g{i}", "q", [{"text": "!!" if j == 0 else "x", "doc_id": f"g{i}-{j}"}
                                                           for j in range(4)], 2, {"loud": "!!!!!", "quiet": "y"})
              for i in range(6)]
    e = bench_audit.exposure_gain(Bangs(), groups, ["loud", "quiet"], k=1, n_boot=200)
    assert e["loud"]["gain"] == 100.0 and e["loud"]["raises"] and e["quiet"]["gain"] == 0.0
    assert e["quiet"]["holds_zero"] and not e["quiet"]["raises"]


def test_the_exposure_gain_breaks_ties_as_the_pipeline_does():
    """A scorer that ties every document: the top k is the pipeline's tie-break by document id (metrics.ranked),
    the rewrite under its own id; counting only strictly higher scores put both source and rewrite in every
    top k (a gain of 0 whatever the ids)."""
    class Flat:
        def score(self, query, docs):
            import torch
            return torch.zeros(len(docs))
    groups = [bench_audit.geodef.QueryGroup(f"g{i}", "q", [{"text": "x", "doc_id": f"g{i}-{j}"} for j in range(4)], 2,
                                            {"F": "y"}) for i in range(40)]
    top1 = lambda ids: bench_audit.metrics.ranked([0.0] * 4, ids)[0] == 2
    want = [float(top1([f"g{i}-0", f"g{i}-1", f"g{i}-2#F", f"g{i}-3"])) -
            float(top1([f"g{i}-{j}" for j in range(4)])) for i in range(40)]
    got = bench_audit.exposure_gain(Flat(), groups, ["F"], k=1, n_boot=50)["F"]["gain"]
    assert got == round(100 * sum(want) / 40, 2)
    assert any(want)


def test_bench_audit_writes_its_json_and_markdown(tmp_path, capsys):
    r = run.main(["bench-audit", "--bench", SAMPLE, "--no-exposure", "--out", str(tmp_path / "a")])
    assert json.load(open(tmp_path / "a" / "bench_audit.json"))["classifier"] == r["classifier"]
    md = (tmp_path / "a" / "bench_audit.md").read_text()
    assert "SYNTHETIC BENCHMARK" in md and "Seen vs unseen" in md and "Drop rates" in md
    assert "accuracy" in capsys.readouterr().out
    assert json.load(open(tmp_path / "a" / "bench_audit.json"))["notes"] == []
    run.main(["bench-audit", "--bench", SAMPLE, "--model", "tiny", "--out", str(tmp_path / "t")])
    notes = json.load(open(tmp_path / "t" / "bench_audit.json"))["notes"]      # the tiny model's gains: plumbing
    assert notes == [bench_audit.TINY_NOTE] and "exposure_gain" in json.load(open(tmp_path / "t" / "bench_audit.json"))
    with pytest.raises(SystemExit, match=r"--folds 1 .at least 2"):
        run.main(["bench-audit", "--bench", SAMPLE, "--folds", "1"])


# two families: A appends a sentence, B adds a heading and a list
TWO_EDITS = {"A": lambda s, i: s + f" Experts agree on item {i}.", "B": lambda s, i: f"## Item {i}\n\n- {s}"}


def test_a_family_without_instances_is_not_a_class(tmp_path):
    """D is in the file's methods but no group rewrites with it: chance is a half (A and B), D's row is
    dashes, never None or 0%."""
    r = bench_audit.audit(_bench(tmp_path, TWO_EDITS, ["A", "B", "D"]), folds=4)
    assert r["classifier"]["chance"] == 0.5 and r["classifier"]["recall"]["D"] is None
    assert np.array(r["classifier"]["confusion"])[:, 2].sum() == 0 and "D" not in r["surface_markers"]
    md = bench_audit.markdown(r)
    assert "None" not in md and "| D | 0 | 0 | 0 | - |" in md and "| D | - | - | - |" in md


def test_one_query_group_is_too_few(tmp_path):
    """A file of one query group is refused, not audited at 0% accuracy."""
    with pytest.raises(bench_audit.SettingsError, match=r"b.jsonl: 1 query group.*too few.*at least 2"):
        bench_audit.audit(_bench(tmp_path, TWO_EDITS, ["A", "B"], n=1))


def test_a_fold_that_cannot_be_fitted_is_no_score_and_one_group_no_interval():
    """Honest edits in two groups that fall in one fold: that fold's detector has no honest class to learn,
    so its rows are unscored (they scored 0 and read as AUC 0.5 [0.5, 0.5], 'the cues do not transfer', which
    nothing measured); one group left is no interval, and an exposure gain over one group no verdict."""
    from types import SimpleNamespace as NS

    def grp(i, honest):
        src = f"Plain page number {i} about water. It says things in a calm tone."
        return NS(group_id=f"g{i}", query=f"q{i}", source_index=0, docs=[{"text": src, "doc_id": f"d{i}"}],
                  co_attacks=None, optimized=None,
                  attacks={"seen": src + " According to experts 95% agree, studies show.",
                           "unseen": src + " ## Summary\n- **Best** answer, trusted by 10,000 readers."},
                  honest=(src + " Updated with a clearer sentence.") if honest else None)
    everywhere = bench_audit.transfer_check([grp(i, True) for i in range(10)], ["seen", "unseen"], ["seen"])
    assert everywhere["unseen"]["auc"] == 1.0 and everywhere["unseen"]["n"] == 10
    gs = [grp(i, i in (0, 5)) for i in range(10)]
    folds = bench_audit.group_folds([g.group_id for g in gs], 5)
    assert folds["g0"] == folds["g5"]
    assert bench_audit.transfer_check(gs, ["seen", "unseen"], ["seen"]) == {}
    one = bench_audit.transfer_check([grp(i, i in (0, 1)) for i in range(10)], ["seen", "unseen"], ["seen"], folds=10)
    assert one["unseen"]["n"] == 2 and one["unseen"]["auc_ci"] is not None

    class Bangs:
        def score(self, query, docs):
            import torch
            return torch.tensor([float(d.count("!")) for d in docs])
    g = bench_audit.geodef.QueryGroup("g0", "q", [{"text": "!!" if j == 0 else "x", "doc_id": f"g0-{j}"}
                                                  for j in range(4)], 2, {"loud": "!!!!!"})
    e = bench_audit.exposure_gain(Bangs(), [g], ["loud"], k=1, n_boot=50)["loud"]
    assert e["gain"] == 100.0 and e["ci"] is None and not e["raises"]
    assert bench_audit._verdict(e) == "not shown (one group)"
