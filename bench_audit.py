"""Are the benchmark's families told apart? An audit of a GEO-DefenseBench file before a seen/unseen
table is built on it.

The paper's central claim (Sec. 5, Table 1) is that a defense built on three seen families holds on
four unseen ones. That claim means something only if the unseen families differ from the seen ones in
what they do to a document, and if each family raises a document's visibility at all. This audit
measures both on the file itself, with no LLM:

- a family classifier on the edits (what a rewrite adds to its source: word 1- and 2-grams, edit size,
  length ratio, surface markers), a multinomial naive Bayes cross-validated by query group, so no
  group's edits are both trained on and scored; its confusion matrix, and the same collapsed to seen
  against unseen. A family the classifier cannot tell from a seen one is an unseen template over seen
  operations. Beside its accuracy, a permutation null: the same cross-validation with the family labels
  shuffled within each query group (PERMUTATIONS times), and the p-value of the observed accuracy;
- pairwise distances between families: Jensen-Shannon divergence of their added word n-grams alone,
  with the mean edit size and mean length ratio apart (and the markers in their own table);
- the question a seen/unseen table rests on, with honest edits in the file (build-bench --honest): do
  the cues that separate the seen families' rewrites from honest pages separate the unseen families'
  too? A detector (the same naive Bayes, two classes) trained on the seen families' rewrites against the
  honest edits and the unedited sources of the other folds' groups scores each held-out group's
  rewrites and honest edit; per unseen family its ROC AUC against the honest edits and its TPR at 5% FPR
  (the threshold the honest edits' 95th percentile), with 95% CIs over query groups;
- surface-marker rates (headings, bold, lists, summary phrases, ...) of each family against the benign
  candidates and the sources (geo_jobs.SURFACE_MARKERS);
- refusal rates per family from the build traces (a first attempt the fidelity gate refused);
  dropped groups are not written to the file (build-bench's log names them), so drop rates are not
  recoverable here and are reported as such;
- the base reranker's exposure gain per family: P(rewrite in the top-k) - P(source in the top-k) on
  the same list, with a cluster-bootstrap CI over query groups (metrics.cluster_bootstrap_ci). A family
  whose interval holds 0 is not shown to raise visibility on this ranker, and a blocked rate says little.

Deviations: the classifier is deliberately simple (naive Bayes over hashed features, numpy only), so a
high accuracy is a lower bound on how separable the families are, and a low one is evidence, not proof,
that they overlap. Scores are pointwise (reranker.py scores each (query, document) pair alone), so a
list with the source replaced is scored by scoring the rewrite once.

Usage: python run.py bench-audit --bench FILE [--model tiny | --no-exposure] [--k 5] [--folds 5] [--out DIR]
"""
import collections
import difflib
import os
import re
import zlib

import numpy as np

import geo_jobs
import geodef
import metrics
import tiny
from rankers import as_scored
from runs import TINY_NOTE, Run
from settings import SettingsError
from store import atomic_write, log, write_json

BUCKETS = 1 << 15          # hashed feature space of the classifier
PERMUTATIONS = 200         # shuffled-label cross-validations of the permutation null
TOKEN = re.compile(r"\w+|[^\w\s]")


# ----------------------------------------------------------------------------- what an edit adds


def tokens(text):
    return TOKEN.findall(text.lower())


def added_ngrams(source, rewrite, n_max=2):
    """The word 1..n_max-grams the rewrite holds more often than its source (multiset difference)."""
    s, r = tokens(source), tokens(rewrite)
    out = collections.Counter()
    for n in range(1, n_max + 1):
        grams = lambda t: collections.Counter(" ".join(t[i:i + n]) for i in range(len(t) - n + 1))
        out.update(grams(r) - grams(s))
    return out


def edit_size(source, rewrite):
    """1 - difflib's similarity ratio over word tokens: 0 for no change, 1 for nothing kept."""
    return 1.0 - difflib.SequenceMatcher(None, tokens(source), tokens(rewrite), autojunk=False).ratio()


def length_ratio(source, rewrite):
    return len(tokens(rewrite)) / max(1, len(tokens(source)))


def markers_added(source, rewrite):
    """Surface markers the rewrite shows and its source does not."""
    return [k for k, p in geo_jobs.SURFACE_MARKERS.items() if re.search(p, rewrite) and not re.search(p, source)]


def edit_features(source, rewrite):
    """One edit as a bag of string features: added n-grams, binned edit size and length ratio, added
    markers. The bins are coarse on purpose: the classifier should key on what is done, not on noise."""
    bag = collections.Counter({f"+{g}": c for g, c in added_ngrams(source, rewrite).items()})
    bag[f"edit={min(9, int(10 * edit_size(source, rewrite)))}"] += 3
    bag[f"len={min(12, int(4 * length_ratio(source, rewrite)))}"] += 3
    bag.update({f"marker={m}": 3 for m in markers_added(source, rewrite)})
    return bag


def hashed(bag):
    """A bag of string features -> a count vector of BUCKETS (crc32: the same in every process)."""
    v = np.zeros(BUCKETS)
    for f, c in bag.items():
        v[zlib.crc32(f.encode("utf-8")) % BUCKETS] += c
    return v


# ----------------------------------------------------------------------------- the classifier


def group_folds(group_ids, k, linked=None):
    """Each group to one of k folds: sorted ids dealt round-robin (deterministic, groups never split); with
    `linked` (geodef.linked_groups), groups sharing a query or a shown text dealt as one."""
    root = {g: min((linked or {}).get(g, {g})) for g in group_ids}
    place = {r: i for i, r in enumerate(sorted(set(root.values())))}
    return {g: place[r] % k for g, r in root.items()}


def naive_bayes(X, y, classes, alpha=1.0, buckets=None):
    """Multinomial naive Bayes fitted on count rows X (N, V) with labels y -> (log priors (C,),
    log likelihoods (C, V)); Laplace smoothing alpha over `buckets` features (default V: X may hold only
    the columns some row uses, the others' smoothing still counted)."""
    prior = np.array([np.mean([t == c for t in y]) for c in classes])
    counts = np.stack([X[[t == c for t in y]].sum(0) for c in classes]) + alpha      # (C, V)
    total = counts.sum(1, keepdims=True) + alpha * ((buckets or X.shape[1]) - X.shape[1])
    return np.log(np.maximum(prior, 1e-12)), np.log(counts / total)


def used_columns(bags):
    """The hashed rows of `bags` restricted to the columns some row uses -> (N, V'): naive Bayes scores a
    row by its own columns only, so the rest change nothing but the smoothing (naive_bayes' buckets)."""
    X = np.stack([hashed(b) for b in bags])
    return X[:, X.any(0)]


def cross_validated_confusion(edits, families, folds=5, X=None, fold_of=None):
    """edits: [(group_id, family, feature bag)] -> confusion counts (F, F), rows true, columns predicted,
    each edit predicted by a model fitted on the other folds' groups only. The classes are the families
    with edits: one with none has no likelihood to fit, and a uniform one would win on unseen n-grams.
    X, fold_of: used_columns of the bags and group_folds of their groups, when the caller has them (the
    permutation null reuses both)."""
    fold_of = fold_of or group_folds([g for g, _, _ in edits], folds)
    X = used_columns([b for _, _, b in edits]) if X is None else X
    y = [f for _, f, _ in edits]
    classes = [f for f in families if f in y]
    conf = np.zeros((len(families), len(families)), dtype=int)
    for k in sorted(set(fold_of.values())):
        test = [fold_of[g] == k for g, _, _ in edits]
        train = [not t for t in test]
        if not any(train):
            continue
        prior, like = naive_bayes(X[train], [t for t, keep in zip(y, train) if keep], classes, buckets=BUCKETS)
        pred = (X[test] @ like.T + prior).argmax(1)                                  # (N_test,)
        for t, p in zip([t for t, keep in zip(y, test) if keep], pred):
            conf[families.index(t), families.index(classes[p])] += 1
    return conf


def permutation_null(edits, families, folds, observed, n=PERMUTATIONS, seed=0, fold_of=None):
    """The classifier's accuracy under the null that families are interchangeable within a query group:
    the family labels shuffled within each group (so each group keeps its families, and the group folds
    stay as they are), cross-validated again n times -> {"mean", "p95", "p_value"}; p_value: the share of
    shuffles (the observed one counted in) at least as accurate as `observed`."""
    rng, X = np.random.default_rng(seed), used_columns([b for _, _, b in edits])
    by_group = collections.defaultdict(list)
    for i, (g, _, _) in enumerate(edits):
        by_group[g].append(i)
    accs = []
    for _ in range(n):
        labels = [f for _, f, _ in edits]
        for idx in by_group.values():
            for i, j in zip(idx, rng.permutation(idx)):
                labels[i] = edits[j][1]
        shuffled = [(g, f, b) for (g, _, b), f in zip(edits, labels)]
        conf = cross_validated_confusion(shuffled, families, folds, X, fold_of)
        accs.append(np.trace(conf) / conf.sum())
    accs = np.array(accs)
    return {"permutations": n, "mean": round(float(accs.mean()), 4), "p95": round(float(np.quantile(accs, 0.95)), 4),
            "p_value": round(float((1 + np.sum(accs >= observed - 1e-12)) / (1 + n)), 4)}


def auc(pos, neg):
    """ROC AUC of scores: P(a positive scores above a negative), ties half (Mann-Whitney)."""
    pos, neg = np.asarray(pos, dtype=float)[:, None], np.asarray(neg, dtype=float)[None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def transfer_check(groups, families, seen, folds=5, n_boot=2000, seed=0):
    """Do the cues that separate seen rewrites from honest pages transfer to unseen families (module
    docstring)? Cross-validated by query group: a two-class naive Bayes fitted on the other folds' seen
    rewrites (positive) against their honest edits and unedited sources (negative) scores the fold's
    rewrites and honest edits (log-odds). -> {family: {"auc", "auc_ci", "tpr_at_5_fpr", "tpr_ci", "n"}} for
    each family outside `seen`, or None without honest edits."""
    hon = [g for g in groups if g.honest is not None]
    if not hon or not seen:
        return None
    src = lambda g: g.docs[g.source_index]["text"]
    rows = [(g.group_id, "geo", f, edit_features(src(g), g.attacks[f])) for g in groups for f in families
            if f in g.attacks]
    rows += [(g.group_id, "honest", "honest", edit_features(src(g), g.honest)) for g in hon]
    rows += [(g.group_id, "honest", "source", edit_features(src(g), src(g))) for g in hon]
    X = used_columns([b for *_, b in rows])
    fold_of = group_folds([g for g, *_ in rows], folds, geodef.linked_groups(groups))
    score = np.full(len(rows), np.nan)             # NaN: a row of a fold whose others hold one class (not scored)
    for k in sorted(set(fold_of.values())):
        test = np.array([fold_of[g] == k for g, *_ in rows])
        train = ~test & np.array([kind == "honest" or f in seen for _, kind, f, _ in rows])
        labels = [kind for (_, kind, _, _), t in zip(rows, train) if t]
        if len(set(labels)) < 2:
            continue
        prior, like = naive_bayes(X[train], labels, ["geo", "honest"], buckets=BUCKETS)
        logp = X[test] @ like.T + prior                                             # (N_test, 2)
        score[test] = logp[:, 0] - logp[:, 1]
    negs = {g: s for (g, _, f, _), s in zip(rows, score) if f == "honest" and not np.isnan(s)}
    out = {}
    for fam in (f for f in families if f not in seen):
        pos = {g: s for (g, _, f, _), s in zip(rows, score) if f == fam and g in negs and not np.isnan(s)}
        if not pos:
            continue
        gids = sorted(pos)

        def figures(ids):
            p, n = [pos[g] for g in ids], [negs[g] for g in ids]
            return auc(p, n), float(np.mean(np.array(p) > np.quantile(n, 0.95, method="higher")))
        a, t = figures(gids)
        rng = np.random.default_rng(seed)
        boots = [figures([gids[i] for i in rng.integers(0, len(gids), len(gids))]) for _ in range(n_boot)]
        ci = lambda j: [round(float(np.quantile([b[j] for b in boots], q)), 4) for q in (0.025, 0.975)] \
            if len(gids) > 1 else None                                       # one group: nothing to resample
        out[fam] = {"auc": round(a, 4), "auc_ci": ci(0), "tpr_at_5_fpr": round(t, 4), "tpr_ci": ci(1), "n": len(gids)}
    return out


def seen_unseen(conf, families, seen):
    """The confusion collapsed to seen vs unseen: 2 x 2, rows true, columns predicted."""
    side = [0 if f in seen else 1 for f in families]
    out = np.zeros((2, 2), dtype=int)
    for i, a in enumerate(side):
        for j, b in enumerate(side):
            out[a, b] += conf[i, j]
    return out


# ----------------------------------------------------------------------------- distances and rates


def js_divergence(p, q):
    """Jensen-Shannon divergence (bits, 0..1) of two Counters read as distributions."""
    keys = sorted(set(p) | set(q))
    a = np.array([p[k] for k in keys], dtype=float)
    b = np.array([q[k] for k in keys], dtype=float)
    if not a.sum() or not b.sum():
        return None
    a, b = a / a.sum(), b / b.sum()
    m = (a + b) / 2
    kl = lambda x: float(np.sum(x[x > 0] * np.log2(x[x > 0] / m[x > 0])))
    return round((kl(a) + kl(b)) / 2, 4)


def refusal_rates(raw_groups, families):
    """Share of each family's kept rewrites whose first attempt the fidelity gate refused (build traces);
    None where the file holds no trace for the family."""
    out = {}
    for f in families:
        traces = [g.get("trace", {}).get(f) for g in raw_groups if f in g.get("attacks", {})]
        traces = [t for t in traces if isinstance(t, dict)]
        out[f] = round(100.0 * sum(t.get("attempts", 1) > 1 for t in traces) / len(traces), 1) if traces else None
    return out


def exposure_gain(rr, groups, families, k, n_boot=2000, seed=0):
    """Per family: P(rewrite in the base top-k) - P(source in the base top-k) on the same list, and its
    cluster-bootstrap CI over groups. Scores are pointwise, so the rewrite is scored once per list; ties are
    broken as the pipeline breaks them (metrics.ranked, by document id: the rewrite's is the source's + '#F')."""
    out = {}
    per = {f: ([], []) for f in families}                  # family -> (per-group gain, group ids)
    for g in groups:
        scores = rr.score(g.query, [d["text"] for d in g.docs]).tolist()
        ids, at = [d["doc_id"] for d in g.docs], g.source_index

        def in_topk(s, doc_id):                            # the list with this document in the source's place
            order = metrics.ranked(scores[:at] + [s] + scores[at + 1:], ids[:at] + [doc_id] + ids[at + 1:])
            return order.index(at) < k
        clean_in = in_topk(scores[at], ids[at])
        names = [f for f in families if f in g.attacks]
        for f, s in zip(names, rr.score(g.query, [g.attacks[f] for f in names]).tolist() if names else []):
            per[f][0].append(float(in_topk(s, f"{ids[at]}#{f}")) - float(clean_in))
            per[f][1].append(g.group_id)
    for f, (vals, gids) in per.items():
        if not vals:
            out[f] = None
            continue
        mean = 100.0 * sum(vals) / len(vals)
        if len(set(gids)) < 2:                             # one group: nothing to resample, no interval, no verdict
            out[f] = {"gain": round(mean, 2), "ci": None, "n": len(vals), "holds_zero": True, "raises": False}
            continue
        lo, hi = metrics.cluster_bootstrap_ci(vals, gids, n_boot=n_boot, seed=seed)
        out[f] = {"gain": round(mean, 2), "ci": [round(100.0 * lo, 2), round(100.0 * hi, 2)], "n": len(vals),
                  "holds_zero": lo <= 0 <= hi, "raises": lo > 0}
    return out


# ----------------------------------------------------------------------------- the audit


def audit(bench, rr=None, k=5, folds=5, n_boot=2000):
    """The whole audit of one benchmark file -> a JSON-able dict (module docstring)."""
    groups, meta = geodef.load_bench(bench, with_meta=True)
    raw = [obj for _, obj in geodef.read_jsonl(bench) if "_meta" not in obj]
    families = list(meta.methods)
    seen = [f for f in families if f in (meta.seen_methods or [])]
    edits = [(g.group_id, f, edit_features(g.docs[g.source_index]["text"], g.attacks[f]))
             for g in groups for f in families if f in g.attacks]
    n_groups = len({g for g, _, _ in edits})
    if n_groups < 2:                  # one group: no fold has another group's edits to train on
        raise SettingsError(f"{bench}: {n_groups} query group(s) with edits, too few to audit: the family "
                            "classifier is cross-validated by group and needs at least 2")
    # groups sharing a query or a page in one fold, the same folds for every shuffle of the null
    fold_of = group_folds([g for g, _, _ in edits], folds, geodef.linked_groups(groups))
    conf = cross_validated_confusion(edits, families, folds, fold_of=fold_of)
    total = int(conf.sum())
    added = {f: sum((collections.Counter({k: v for k, v in b.items() if k.startswith("+")})     # n-grams alone
                     for _, ff, b in edits if ff == f), collections.Counter()) for f in families}
    size = {f: [edit_size(g.docs[g.source_index]["text"], g.attacks[f]) for g in groups if f in g.attacks]
            for f in families}
    ratio = {f: [length_ratio(g.docs[g.source_index]["text"], g.attacks[f]) for g in groups if f in g.attacks]
             for f in families}
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None
    benign = [d["text"] for g in groups for i, d in enumerate(g.docs) if i != g.source_index]
    out = {"bench": os.path.abspath(bench), "synthetic": bool(meta.synthetic), "families": families,
           "seen": seen, "groups": len(groups), "edits": len(edits),
           "classifier": {"model": "multinomial naive Bayes, hashed added 1-2-grams + binned edit size, length "
                                   "ratio, added markers", "folds": folds,
                          "cross_validated_by": "query group (groups sharing a query or a page as one)",
                          "confusion": conf.tolist(), "accuracy": round(float(np.trace(conf)) / total, 4),
                          # always naming the most frequent family (seen ones edit every group, unseen ones
                          # the test groups only: 1 / families would understate it)
                          "chance": round(max(collections.Counter(f for _, f, _ in edits).values()) / len(edits), 4),
                          "recall": {f: round(conf[i, i] / conf[i].sum(), 4) if conf[i].sum() else None
                                     for i, f in enumerate(families)},
                          "seen_vs_unseen": seen_unseen(conf, families, seen).tolist() if seen else None,
                          "null": permutation_null(edits, families, folds, float(np.trace(conf)) / total,
                                                   fold_of=fold_of)},
           "transfer": transfer_check(groups, families, seen, folds, n_boot),
           "distances": {"added_ngram_js": [[js_divergence(added[a], added[b]) for b in families] for a in families],
                         "edit_size": {f: mean(size[f]) for f in families},
                         "length_ratio": {f: mean(ratio[f]) for f in families}},
           "surface_markers": {"benign candidates": geo_jobs.surface_rates(benign),
                               "sources": geo_jobs.surface_rates(g.docs[g.source_index]["text"] for g in groups),
                               **{f: geo_jobs.surface_rates(g.attacks[f] for g in groups if f in g.attacks)
                                  for f in families if size[f]}},
           "refusal_rate": refusal_rates(raw, families),
           "drop_rate": None, "drop_rate_note": "dropped groups are not written to the file; build-bench's log "
                                                "names each one and why"}
    if rr is not None:
        out["exposure_gain"] = {"k": k, "ranker": "base reranker", "per_family": exposure_gain(rr, groups, families,
                                                                                            k, n_boot)}
    return out


def write_audit(result, out_dir, offline_note=None):
    """bench_audit.json and bench_audit.md in out_dir, each with the offline note (the tiny model's exposure
    figures are plumbing) -> the markdown's path."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "bench_audit.json"), {**result, "notes": [offline_note] if offline_note else []})
    path = os.path.join(out_dir, "bench_audit.md")
    atomic_write(path, markdown(result, offline_note))
    return path


def markdown(r, offline_note=None):
    fams, c = r["families"], r["classifier"]
    short = [f[:10] for f in fams]
    lines = [f"# Benchmark audit: {os.path.basename(r['bench'])}", ""]
    if offline_note or r["synthetic"]:
        lines += [f"> **{offline_note or 'SYNTHETIC BENCHMARK'}**: plumbing figures, not findings about the "
                  "families on real models.", ""]
    lines += [f"{r['groups']} groups, {r['edits']} edits; seen: {', '.join(r['seen']) or 'none recorded'}.", "",
              f"## Family classifier ({c['folds']}-fold, by query group)", "",
              f"Accuracy {100 * c['accuracy']:.1f}% (chance {100 * c['chance']:.1f}%, naming the most frequent "
              f"family every time; with the family labels "
              f"shuffled within each query group, {c['null']['permutations']} times: mean "
              f"{100 * c['null']['mean']:.1f}%, 95th percentile {100 * c['null']['p95']:.1f}%, p = "
              f"{c['null']['p_value']:.3f}). Rows: true family; columns: predicted.", "",
              "| | " + " | ".join(short) + " | recall |", "|---" * (len(fams) + 2) + "|"]
    for f, row in zip(fams, c["confusion"]):
        lines.append(f"| {f} | " + " | ".join(map(str, row)) + f" | {_or_dash(c['recall'][f], '{:.0%}')} |")
    if c["seen_vs_unseen"]:
        (ss, su), (us, uu) = c["seen_vs_unseen"]
        lines += ["", f"Seen vs unseen: seen edits taken for seen {ss}, for unseen {su}; unseen edits taken for "
                      f"seen {us}, for unseen {uu}."]
    d = r["distances"]
    lines += ["", "## Distances between families", "", "Jensen-Shannon divergence of added word 1-2-grams alone "
              "(0: the same additions, 1: disjoint; edit size and markers apart below):", "",
              "| | " + " | ".join(short) + " |", "|---" * (len(fams) + 1) + "|"]
    lines += [f"| {f} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in row) + " |"
              for f, row in zip(fams, d["added_ngram_js"])]
    lines += ["", "| family | mean edit size | mean length ratio | refusal rate (%) |", "|---|---|---|---|"]
    lines += [f"| {f} | {_or_dash(d['edit_size'][f])} | {_or_dash(d['length_ratio'][f])} | "
              f"{_or_dash(r['refusal_rate'][f])} |" for f in fams]
    sm = r["surface_markers"]
    keys = list(next(iter(sm.values())))
    lines += ["", "## Surface markers (% of documents)", "", "| | " + " | ".join(keys) + " |",
              "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{rates[k]:g}" for k in keys) + " |" for name, rates in sm.items()]
    if "exposure_gain" in r:
        e = r["exposure_gain"]
        lines += ["", f"## Exposure gain on the {e['ranker']} (top-{e['k']}, percentage points, 95% CI over groups)",
                  "", "| family | gain | CI | n | raises visibility |", "|---|---|---|---|---|"]
        for f, v in e["per_family"].items():
            lines.append(f"| {f} | - | - | 0 | - |" if v is None else
                         f"| {f} | {v['gain']:+.1f} | {_ci(v['ci'], '+.1f')} | {v['n']} | {_verdict(v)} |")
    t = r.get("transfer")
    lines += ["", "## Do the seen families' cues transfer to the unseen ones?", ""]
    why = ("No seen families named in this file (_meta.seen_methods): nothing to train a detector on."
           if not r.get("seen") else "No honest edits in this file: build it with `build-bench --honest` to ask "
           "whether a detector of the seen families' rewrites against honest pages separates the unseen families too.")
    lines += [why] if t is None else [
        "A detector of the seen families' rewrites against honest edits and unedited sources (naive Bayes, "
        "cross-validated by query group) scores each unseen family's rewrites against the honest edits of the same "
        "groups. 95% CIs over query groups.", "", "| unseen family | ROC AUC | CI | TPR at 5% FPR | CI | groups |",
        "|---|---|---|---|---|---|"] + [
        f"| {f} | {v['auc']:.2f} | {_ci(v['auc_ci'], '.2f')} | {v['tpr_at_5_fpr']:.2f} | {_ci(v['tpr_ci'], '.2f')} | "
        f"{v['n']} |" for f, v in t.items()]
    lines += ["", f"Drop rates: {r['drop_rate_note']}.", ""]
    return "\n".join(lines)


def _verdict(v):
    return ("yes" if v["raises"] else "not shown (one group)" if v["ci"] is None else "not shown (CI holds 0)"
            if v["holds_zero"] else "no: it lowers it")


def _ci(ci, spec):
    return "- (one group)" if ci is None else f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"


def _or_dash(v, form="{:g}"):
    """A table cell: '-' for a figure that has nothing to measure (None)."""
    return "-" if v is None else form.format(v)


def run_audit(cfg, out_dir):
    """bench-audit under its settings (AuditSettings; the reranker with --exposure: --model, 'tiny' made in
    out_dir) -> (result, markdown path)."""
    if cfg.model.model == "none":
        raise SettingsError("bench-audit --model none: --no-exposure audits without a reranker")
    rr, note = None, None
    if cfg.audit.exposure:
        tiny_model = cfg.model.model == "tiny"
        folder = (tiny.make_tiny_checkpoint(os.path.join(out_dir, "_tiny_qwen3"), seed=0) if tiny_model
                  else cfg.model.model)
        note = TINY_NOTE if tiny_model else None
        run = Run(cfg.replace(model=folder))
        rr = as_scored(run, run.reranker())              # --quant int8: gated on the audited file's lists
    result = audit(cfg.data.bench, rr, k=cfg.data.k, folds=cfg.audit.folds)
    path = write_audit(result, out_dir, note)
    log(f"[bench-audit] wrote {path} and bench_audit.json")
    return result, path

