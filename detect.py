"""Flag GEO manipulation where a page is indexed (run.py detect), scored against honest optimisation.

The Shield demotes a GEO rewrite inside one query's list; a search provider also wants the page flagged,
to demote it everywhere, review it or log it. A detector's cost is its false positives on pages optimised
honestly, and detectors of adversarial documents built on some attacks miss others (arXiv 2307.16816), so
this measures both: on the test split, every family's rewrites (seen and unseen apart) against the honest
edits and the unedited sources (build-bench --honest), each figure with a 95% CI over query groups.

Two detectors, neither fitted on the test split:
- shield_residual: m_base(q, d) - m_shield(q, d), how far the Shield pushes the page below the base
  reranker under its query (Eq. 2's residual, sign flipped); no training beyond the Shield's;
- text: query-blind and source-blind, a two-class multinomial naive Bayes over the page alone (word 1-
  and 2-grams, the surface markers build-bench counts, a coarse length bin; bench-audit's classifier
  on other features), fitted on the construction split: the seen families' rewrites against the sources
  and honest edits. A query-blind detector keeps no relevant page out for its query (arXiv 2307.16816
  warns of one that reads it).

Thresholds: each detector flags a page whose score exceeds the k-th smallest of its n scores on
construction honest edits no part of it was fitted on, k = ceil((1 - --fpr)(n + 1)) (split conformal: a new
honest edit exchangeable with those is flagged with probability (n + 1 - k)/(n + 1) <= --fpr; the plain
(1 - fpr) quantile bounds only the calibration pages' own rate, and misses the target on new pages when n is
small). With n < 1/fpr - 1 no k reaches the target: the largest score is taken, a warning logged, and the
bound 1/(n + 1) recorded beside n (the residual's; the text detector records none, below). For the residual
the calibration and test pages are scored by the same function, but the Shield kept the epoch whose loss
was lowest on its monitoring groups' sources (train.py), so those groups' honest edits are not quite
exchangeable with new ones; for the text detector the bound is
not proven (its calibration scores come from four out-of-fold fits, new pages' from the fit on all: the naive
cross-validation threshold, which cross-conformal and CV+ do not cover, as they score a new page with the
fold fits), so none is recorded and its held-out false-positive rate is the figure to read. The report says each.
The calibration pages: the text detector's out of fold (4 folds by query
group), the residual's on the Shield's monitoring groups (the Shield trains on the other construction groups'
sources as d+, which an honest edit nearly copies). The threshold is then applied unchanged to the test
split, so the reported false-positive rate there is a held-out one.

Figures per detector and family: ROC AUC against honest edits and against sources; TPR at 1% and 5% FPR
(the test negatives' own quantiles, the ROC curve's points); the held-out TPR and FPR at the threshold.

Usage: python run.py detect --name RUN [--fpr 0.05]
"""
import collections
import math
import os
import re

import numpy as np

import bench_audit
import figures
import geo_jobs
import geodef
import rankers
import rerank_clients
from settings import SettingsError
from store import atomic_write, log, read_json, write_json, write_jsonl

DETECTORS = ("shield_residual", "text")
FOLDS = 4                       # out-of-fold scores of the construction split for the text detector's threshold
FPRS = (0.01, 0.05)             # the ROC points reported
ROC_FPRS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ----------------------------------------------------------------------------- the text detector


def page_bag(text):
    """A page as a bag of string features: its word 1- and 2-grams, the surface markers it shows, and its
    length in coarse bins (the page alone: no query, no source)."""
    t = bench_audit.tokens(text)
    bag = collections.Counter(t)
    bag.update(" ".join(t[i:i + 2]) for i in range(len(t) - 1))
    bag.update({f"marker={k}": 3 for k, p in geo_jobs.SURFACE_MARKERS.items() if re.search(p, text)})
    bag[f"len={min(20, len(t) // 50)}"] += 3
    return bag


class TextDetector:
    """Naive Bayes log-odds of 'GEO rewrite' over 'honest page': score = x . w + b over the hashed bag x
    (bench_audit.hashed). w is stored for the buckets the training pages use; every other bucket has the
    same weight `rest` (Laplace smoothing alone)."""

    def __init__(self, weights, rest, bias):
        self.weights, self.rest, self.bias = weights, rest, bias

    @classmethod
    def fit(cls, geo, honest):
        """Fitted on pages `geo` (rewrites) and `honest` (sources and honest edits)."""
        X = np.stack([bench_audit.hashed(page_bag(t)) for t in geo + honest])            # (N, BUCKETS)
        prior, like = bench_audit.naive_bayes(X, ["geo"] * len(geo) + ["honest"] * len(honest), ["geo", "honest"])
        w = like[0] - like[1]                                                          # (BUCKETS,)
        used = np.flatnonzero(X.any(0))
        rest = float(np.median(np.delete(w, used))) if len(used) < len(w) else 0.0
        return cls({int(i): float(w[i]) for i in used}, rest, float(prior[0] - prior[1]))

    def score(self, text):
        x = bench_audit.hashed(page_bag(text))
        nz = np.flatnonzero(x)
        return self.bias + float(sum(x[i] * self.weights.get(int(i), self.rest) for i in nz))

    def to_json(self):
        return {"kind": "naive Bayes log-odds over hashed page features (detect.py)", "buckets": bench_audit.BUCKETS,
                "bias": self.bias, "rest": self.rest, "weights": {str(k): v for k, v in sorted(self.weights.items())}}

    @classmethod
    def from_json(cls, obj):
        return cls({int(k): v for k, v in obj["weights"].items()}, obj["rest"], obj["bias"])


def read_detector(obj, path):
    """A detector file's JSON (a run's detect/text_detector.json, or an export's copy) -> (TextDetector, its
    threshold), checked: SettingsError naming the file and field, before anything reads it."""
    if not isinstance(obj, dict):
        raise SettingsError(f"{path}: not a detector file (a JSON object, as `detect` writes it)")
    number = lambda v: rerank_clients._finite(v) is not None
    bad = [k for k in ("threshold", "bias", "rest") if not number(obj.get(k))]
    w = obj.get("weights")
    bucket = lambda k: re.fullmatch(r"[0-9]{1,9}", k) and int(k) < bench_audit.BUCKETS    # ("²" and "٣" are digits)
    bad += [] if isinstance(w, dict) and all(bucket(k) and number(v) for k, v in w.items()) else ["weights"]
    if bad:                                  # a NaN flags nothing; text fails every request (a 500)
        raise SettingsError(f"{path}: {', '.join(bad)}: finite numbers expected (weights by bucket), as `detect` "
                            "writes them")
    if obj.get("buckets") != bench_audit.BUCKETS:      # the weights index buckets of this hashing
        raise SettingsError(f"{path}: buckets: {obj.get('buckets')!r}, this code hashes into {bench_audit.BUCKETS}")
    return TextDetector.from_json(obj), obj["threshold"]


class Served:
    """A run's text detector at its threshold, as serve answers with it: POST /detect and return_detect."""

    def __init__(self, detector, threshold):
        self.detector, self.threshold = detector, threshold

    @classmethod
    def load(cls, path):
        """A detector file (a run's detect/text_detector.json, or an export's copy) -> Served; None for no file."""
        if path is None:
            return None
        return cls(*read_detector(read_json(path), path))

    def flags(self, texts):
        return [{"score": s, "flagged": s > self.threshold} for s in map(self.detector.score, texts)]

    def reply(self, texts):
        """POST /detect's reply: each document's score and flag, by index."""
        return {"object": "detect", "detector": "text", "threshold": self.threshold,
                "results": [{"index": i, **f} for i, f in enumerate(self.flags(texts))]}

    def annotate(self, out, texts):
        """A rerank or score reply with each result's `detect` beside its score, matched by index."""
        items = out if isinstance(out, list) else out.get("results") or out.get("data")
        for x in items:
            x["detect"] = self.flags([texts[x["index"]]])[0]
        return out


# ----------------------------------------------------------------------------- the pages


def pages(groups, families):
    """Every page of `groups` a detector is scored on -> [(group_id, query, kind, family, text)]: the source
    ("source"), its honest edit ("honest") and each family's rewrite ("geo") present."""
    out = []
    for g in groups:
        out.append((g.group_id, g.query, "source", None, g.docs[g.source_index]["text"]))
        if g.honest is not None:
            out.append((g.group_id, g.query, "honest", None, g.honest))
        out += [(g.group_id, g.query, "geo", f, g.attacks[f]) for f in families if f in g.attacks]
    return out


def check(run):
    """A benchmark without honest edits in both splits is refused, naming the build to run."""
    calibration_folds(run.data.construction)
    if not has_honest(run.data):
        raise SettingsError(f"{run.cfg.data.bench}: no honest edits in both its construction and test groups; detect "
                            "measures false positives on them. Build the file with them: python run.py build-bench "
                            "--honest --input ROWS --output FILE (the same flags as this build)")


def residuals(run, groups):
    """{(query, text): m_base - m_shield} over the pages of `groups`, both scored (and cached) by the run's
    rankers (rankers.load_rankers)."""
    base, shield = rankers.load_rankers(run, shield=True)
    lists = [geodef.clean_instance(g) for g in groups] + [geodef.honest_instance(g) for g in groups
                                                          if g.honest is not None]
    lists += geodef.expand(groups, sorted({f for g in groups for f in g.attacks}))
    for rk in (base, shield):
        rk.prepare(lists)
    key = rankers.doc_key
    return {(x.query, d): base.cache[key(x.query, d)] - shield.cache[key(x.query, d)] for x in lists for d in x.docs}


def calibration_folds(cons):
    """The construction groups `cons` dealt to FOLDS folds by query group, those sharing a query or a page
    (geodef.linked_groups) in one -> {group_id: fold}; fewer than two folds (nothing to fit another on) refused."""
    fold = bench_audit.group_folds([g.group_id for g in cons], FOLDS, geodef.linked_groups(cons))
    if len(set(fold.values())) < 2:
        raise SettingsError(f"--n-construction {len(cons)}: detect fits its text detector out of fold by construction "
                            "query group (groups sharing a query or a page as one), so it needs at least 2 such "
                            f"groups; these make {len(set(fold.values()))}")
    return fold


def out_of_fold(cons_pages, seen, fold):
    """The text detector's scores of the construction split's honest edits, each from a detector fitted on
    the other folds' groups (`fold`: calibration_folds) -> [score]."""
    out = []
    for k in sorted(set(fold.values())):
        train = [p for p in cons_pages if fold[p[0]] != k]
        det = TextDetector.fit([p[4] for p in train if p[2] == "geo" and p[3] in seen],
                               [p[4] for p in train if p[2] != "geo"])
        out += [det.score(p[4]) for p in cons_pages if fold[p[0]] == k and p[2] == "honest"]
    return out


# ----------------------------------------------------------------------------- the figures


def tpr_at(pos, neg, fpr):
    """TPR at the threshold the negatives' (1 - fpr) quantile sets (scores above it flagged), taken at a
    negative's own score ("higher"): at most `fpr` of the negatives are flagged, never one more."""
    if not len(pos) or not len(neg):
        return None
    return float(np.mean(np.asarray(pos) > np.quantile(neg, 1 - fpr, method="higher")))


def figures_of(recs, detector, family_of, n_boot, seed):
    """One detector's figures for the positives picked by family_of(record) -> True, with CIs over query
    groups (the groups resampled, each bringing its positives and negatives)."""
    by = collections.defaultdict(lambda: {"pos": [], "honest": [], "source": []})
    for r in recs:            # every group brings its negatives, whether or not it holds the family
        bucket = "pos" if r["kind"] == "geo" and family_of(r) else r["kind"] if r["kind"] != "geo" else None
        group = by[r["group_id"]]
        if bucket:
            group[bucket].append(r["scores"][detector])
    gids = sorted(by)
    if not any(by[g]["pos"] for g in gids):
        return None

    def of(ids):
        pos = [s for g in ids for s in by[g]["pos"]]
        if not pos:                       # a resample without the family: no figure
            return None
        hon, src = ([s for g in ids for s in by[g][k]] for k in ("honest", "source"))
        return [bench_audit.auc(pos, hon) if hon else None, bench_audit.auc(pos, src) if src else None,
                *(tpr_at(pos, hon, f) for f in FPRS), *(tpr_at(pos, src, f) for f in FPRS)]
    names = ["auc_honest", "auc_source"] + [f"tpr_at_{int(100 * f)}_fpr_{n}" for n in ("honest", "source")
                                             for f in FPRS]
    point = of(gids)
    rng = np.random.default_rng(seed)
    boots = [b for b in (of([gids[i] for i in rng.integers(0, len(gids), len(gids))]) for _ in range(n_boot))
             if b is not None]
    out = {"n": sum(len(by[g]["pos"]) for g in gids), "groups": sum(bool(by[g]["pos"]) for g in gids)}
    for j, name in enumerate(names):
        vals = [b[j] for b in boots if b[j] is not None]
        out[name] = None if point[j] is None else round(point[j], 4)
        out[name + "_ci"] = [round(float(np.quantile(vals, q)), 4) for q in (0.025, 0.975)] if vals else None
    pos = [r for r in recs if r["kind"] == "geo" and family_of(r)]
    out["flagged"] = round(100.0 * sum(r["flagged"][detector] for r in pos) / len(pos), 2)
    return out


def summarize(recs, seen, families, cals, fpr, n_boot, seed):
    """The detect block: per detector its threshold (`cals`: calibrated's), the held-out FPR on the test
    split's honest edits and sources, and the figures per family and for the seen and unseen families pooled."""
    out = {"fpr_target": fpr, "seen": list(seen), "detectors": {}}
    for d in DETECTORS:
        neg = lambda kind: [r for r in recs if r["kind"] == kind]
        rate = lambda rs: round(100.0 * sum(r["flagged"][d] for r in rs) / len(rs), 2) if rs else None
        block = {**cals[d], "held_out_fpr_honest": rate(neg("honest")),
                 "held_out_fpr_source": rate(neg("source")), "families": {}}
        for f in families:
            fig = figures_of(recs, d, lambda r, f=f: r["family"] == f, n_boot, seed)
            if fig:
                block["families"][f] = {"seen": f in seen, **fig}
        for side, want in (("seen", True), ("unseen", False)):
            block[side] = figures_of(recs, d, lambda r, w=want: (r["family"] in seen) == w, n_boot, seed)
        out["detectors"][d] = block
    return out


def roc_points(recs, detector, family_of):
    """TPR (%) against the test honest edits at each of ROC_FPRS."""
    pos = [r["scores"][detector] for r in recs if r["kind"] == "geo" and family_of(r)]
    neg = [r["scores"][detector] for r in recs if r["kind"] == "honest"]
    return [None if not pos or not neg else 100.0 if f >= 1 else 100.0 * tpr_at(pos, neg, f) if f > 0
            else 100.0 * float(np.mean(np.asarray(pos) > max(neg))) for f in ROC_FPRS]    # (FPR 100%: all flagged)


def has_honest(data):
    """Whether both splits hold honest edits (what a detector's held-out threshold needs)."""
    return all(any(g.honest is not None for g in gs) for gs in (data.construction, data.test))


def calibrated(scores, fpr, what="the threshold"):
    """Split conformal threshold (see the module docstring) -> {threshold, n_calib, fpr_bound}: the bound on
    the rate at which a new page exchangeable with the n calibration pages scores above the threshold."""
    n = len(scores)
    if not n:
        raise ValueError(f"{what}: no calibration page")
    k = math.ceil((1 - fpr) * (n + 1))
    if k > n:
        log(f"[detect] {what}: {n} calibration pages cannot hold an FPR of {fpr:g}: the largest score is taken "
            f"(expected FPR on new pages about {1 / (n + 1):.3g})")
        k = n
    return {"threshold": float(sorted(scores)[k - 1]), "n_calib": n, "fpr_bound": round((n + 1 - k) / (n + 1), 4)}


def fold_detection(data, trained, family, fpr, n_boot, seed):
    """holdout's detection side: the text detector fitted on the construction split's rewrites of `trained`
    only (the fold that never saw `family`), its threshold on the construction honest edits, scored on the
    test split -> {family's AUC against the test honest edits (CI), TPR at 5% FPR, % flagged at the
    threshold, the held-out FPR on honest edits, the threshold}."""
    families = list(data.meta.methods)
    cons_pages, test_pages = pages(data.construction, families), pages(data.test, families)
    det = TextDetector.fit([p[4] for p in cons_pages if p[2] == "geo" and p[3] in trained],
                           [p[4] for p in cons_pages if p[2] != "geo"])
    cal = calibrated(out_of_fold(cons_pages, trained, calibration_folds(data.construction)), fpr,
                     f"the fold without {family}")
    threshold = cal["threshold"]
    recs = [{"group_id": gid, "kind": kind, "family": fam, "scores": {"text": s}, "flagged": {"text": s > threshold}}
            for gid, _, kind, fam, t in test_pages for s in [det.score(t)]]
    fig = figures_of(recs, "text", lambda r: r["family"] == family, n_boot, seed) or {}
    hon = [r["flagged"]["text"] for r in recs if r["kind"] == "honest"]
    return {"auc_honest": fig.get("auc_honest"), "auc_honest_ci": fig.get("auc_honest_ci"),
            "tpr_at_5_fpr_honest": fig.get("tpr_at_5_fpr_honest"), "flagged": fig.get("flagged"),
            "held_out_fpr_honest": round(100.0 * sum(hon) / len(hon), 2), **cal}


# ----------------------------------------------------------------------------- the command


def detect(run):
    """`detect` on a trained run: both detectors scored on every page of both splits, thresholds on the
    construction split, figures on the test split -> the summary block; writes detect/ (summary.json,
    report.md, records.jsonl, text_detector.json, roc_<detector>.svg)."""
    cfg, data = run.cfg, run.data
    families = list(data.meta.methods)
    cons_pages, test_pages = pages(data.construction, families), pages(data.test, families)
    res = residuals(run, data.construction + data.test)
    text = TextDetector.fit([p[4] for p in cons_pages if p[2] == "geo" and p[3] in data.seen],
                            [p[4] for p in cons_pages if p[2] != "geo"])
    _, mon = run.shield_split(geodef.expand(data.construction, data.seen))
    unseen_by_shield = {x.group_id for x in mon}    # its monitoring groups: their sources were never its d+
    hon = [res[p[1], p[4]] for p in cons_pages if p[2] == "honest" and p[0] in unseen_by_shield]
    if not hon:
        log("[detect] no honest edit in the Shield's monitoring groups; the residual's threshold is set on every "
            "construction honest edit, whose sources the Shield trained on (its held-out FPR then runs high)")
    calib = {"shield_residual": hon or [res[p[1], p[4]] for p in cons_pages if p[2] == "honest"],
             "text": out_of_fold(cons_pages, data.seen, calibration_folds(data.construction))}
    cals = {d: calibrated(calib[d], cfg.detect.fpr, d) for d in DETECTORS}
    if not hon:                                        # pages whose sources the Shield trained on: no bound
        cals["shield_residual"]["fpr_bound"] = None
    # the text detector's calibration scores come from out-of-fold fits, new pages' from the fit on all: the
    # naive cross-validation threshold, for which no conformal bound is proven (the held-out rate is the figure)
    cals["text"]["fpr_bound"] = None
    thresholds = {d: cals[d]["threshold"] for d in DETECTORS}
    recs = [{"group_id": gid, "kind": kind, "family": fam, "seen": fam in data.seen if fam else None,
             "scores": s, "flagged": {d: s[d] > thresholds[d] for d in DETECTORS}}
            for gid, q, kind, fam, t in test_pages for s in [{"shield_residual": res[q, t], "text": text.score(t)}]]
    out = summarize(recs, data.seen, families, cals, cfg.detect.fpr, cfg.rerank.n_boot, cfg.folder.seed)
    folder = run.path("detect")
    write_jsonl(os.path.join(folder, "records.jsonl"), recs)
    write_json(os.path.join(folder, "text_detector.json"), {**text.to_json(), "threshold": thresholds["text"]})
    for d in DETECTORS:
        series = {"seen (pooled)": roc_points(recs, d, lambda r: r["family"] in data.seen),
                  "unseen (pooled)": roc_points(recs, d, lambda r: r["family"] not in data.seen)}
        atomic_write(os.path.join(folder, f"roc_{d}.svg"), figures.svg_lines(
            f"{d}: GEO rewrites flagged against honest edits (test split)", [f"{100 * f:g}" for f in ROC_FPRS],
            series, xlabel="FPR on honest edits (%)", ylabel="TPR (%)"))
    write_json(os.path.join(folder, "summary.json"), out)
    atomic_write(os.path.join(folder, "report.md"), report(out))
    log(f"[detect] wrote {folder}/summary.json, report.md, records.jsonl and the ROC figures")
    return out


def run_detectors(run):
    """The run's detectors from detect's files in the run folder, checked (read_detector; attack and harden
    read them before any paid call) -> ({detector: threshold}, the text detector); None when `detect` has not
    run there."""
    spath, tpath = run.path("detect", "summary.json"), run.path("detect", "text_detector.json")
    s, obj = read_json(spath), read_json(tpath)
    if not s or not obj:
        return None
    text, at = read_detector(obj, tpath)
    residual = ((s.get("detectors") if isinstance(s, dict) else None) or {}).get("shield_residual") or {}
    if rerank_clients._finite(residual.get("threshold") if isinstance(residual, dict) else None) is None:
        raise SettingsError(f"{spath}: detectors.shield_residual.threshold: a finite number expected, as `detect` "
                            "writes it")
    return {"text": at, "shield_residual": residual["threshold"]}, text


def thresholds(run):
    """The run's detectors' thresholds (run_detectors) -> {detector: threshold}; None without `detect`."""
    got = run_detectors(run)
    return got and got[0]


def flagged(run, docs, base, shield):
    """{detector: % of the attack documents of `docs` (instances) it flags at the run's threshold}; None
    when `detect` has not run there (attack's and harden's)."""
    got = run_detectors(run)
    if got is None:
        return None
    at, text = got
    for rk in (base, shield):
        rk.prepare(docs)
    score = {"text": lambda x: text.score(x.docs[x.attack_index]),
             "shield_residual": lambda x: base.scores(x)[x.attack_index] - shield.scores(x)[x.attack_index]}
    return {d: round(100.0 * sum(score[d](x) > at[d] for x in docs) / len(docs), 2) for d in DETECTORS}


def fmt(v, ci=None):
    return "-" if v is None else f"{100 * v:.1f}" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def table(out):
    """The per-family table of every detector as markdown."""
    rows = ["| detector | family | AUC vs honest | AUC vs sources | TPR @5% FPR honest | flagged at threshold (%) |",
            "|---|---|---|---|---|---|"]
    for d, b in out["detectors"].items():
        named = [(f + ("" if v["seen"] else "*"), v) for f, v in b["families"].items()]
        named += [(side, b[side]) for side in ("seen", "unseen") if b[side]]
        rows += [f"| {d} | {name} | {fmt(v['auc_honest'], v['auc_honest_ci'])} | {fmt(v['auc_source'])} | "
                 f"{fmt(v['tpr_at_5_fpr_honest'], v['tpr_at_5_fpr_honest_ci'])} | {v['flagged']:.1f} |"
                 for name, v in named]
    return "\n".join(rows)


def report(out):
    """detect/report.md."""
    none = {"text": "no FPR bound: calibrated on out-of-fold fits, applied to the fit on all",
            "shield_residual": "no FPR bound: the Shield trained on these sources"}
    bound = lambda d, b: none[d] if b["fpr_bound"] is None else \
        f"FPR bound {100 * b['fpr_bound']:.3g}%, its epoch chosen on these groups"
    held = "; ".join(f"{d}: threshold {b['threshold']:.3f} from {b['n_calib']} honest edits ({bound(d, b)}), "
                     f"{b['held_out_fpr_honest']}% of the test honest edits "
                     f"and {b['held_out_fpr_source']}% of the sources flagged" for d, b in out["detectors"].items())
    return (f"# GEO detection against honest optimisation (detect.py)\n\nThresholds chosen on the construction "
            f"split for {100 * out['fpr_target']:g}% FPR on new honest edits (the conformal order statistic), applied "
            f"unchanged to the test split (held out): {held}.\n\nPer family (unseen marked *; AUC and TPR in %, 95% "
            f"CIs over query groups; seen families: {', '.join(out['seen'])}):\n\n{table(out)}\n\nFigures: "
            "roc_shield_residual.svg, roc_text.svg (TPR against the test honest edits at each FPR). Offline builds "
            "are plumbing.\n")
