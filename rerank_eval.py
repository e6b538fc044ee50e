"""Any reranker under GEO attack: the reranker stage of a generative search engine evaluated on its
own, with no LLM (`python run.py rerank-eval`), and deployed rerankers as end-to-end conditions
(`eval --reranker LABEL=SPEC`).

The paper (Sec. 4) says the Shield and TFSG "are modular and can be deployed independently or
jointly"; this file measures the first stage for any reranker a provider runs: the in-process base
and Shield rerankers of this project, or an endpoint (Cohere, Jina, Voyage, any Cohere/Jina/vLLM-
shaped /rerank, Text Embeddings Inference) through rerank_clients.RerankClient. The endpoint scores the
same document texts the in-process rerankers score; its prompt, if it has one, is its own.

Per test instance (an attacked candidate list) and its clean list (B.1.3), with k the context size:
- exposure@k: the attack document is in the reranker's top k (percent of instances);
- attack rank: its 1-based rank among the candidates;
- promotion: the source document's rank in the clean list minus the attack's rank in the attacked
  list (positive: the rewrite moved up);
- clean top-k kept: |top-k of the clean list ∩ the base reranker's top-k of it| / k, per query group
  (how much of the benign ranking a reranker keeps; needs `base` among the rerankers).
Each with a 95% CI from the query-cluster bootstrap (metrics.cluster_bootstrap_ci), overall, per
GEO method and for seen / unseen methods.

On a benchmark with honest edits (build-bench --honest), per reranker its honest penalty: over the
groups whose source is in its top k of the clean list, % whose honest edit (geodef.honest_instance)
is not in its top k of the honest list; beside it the attack demotion, the same for the attack
rewrites of those groups (% of attack instances whose source was in the clean top k but whose rewrite
is not). A defense that demotes attacks but not honest edits separates manipulation from optimisation.
The honest lists' records (the attack records' layout, method "honest", `attack_*` naming the honest
edit) go to results/rerank-<label>.honest.jsonl, so the attack records stay as they are.

Usage: python run.py rerank-eval --name demo --reranker base --reranker shield --reranker co=cohere:rerank-v3.5
"""
import copy
import os
import statistics
import time

import accounting
import certify
import geodef
import metrics
import rankers
import report
import speed
from runs import test_set_digest, with_notes, write_summary
from settings import SettingsError
from store import read_json, write_json, write_jsonl

SHORT_BUDGET = 8                    # deletion samples: a micro-batch's token budget x this (certify_records)


def instance_record(x, clean, ranker, base_clean_order, k):
    """One attacked instance under one reranker -> its record (see the module docstring)."""
    scores = ranker.scores(x)
    order = metrics.ranked(scores, x.doc_ids)
    attack_rank = order.index(x.attack_index) + 1
    clean_order = ranker.order(clean)
    source_rank = clean_order.index(x.attack_index) + 1       # the source document sits where the attack does
    rec = {"instance_id": x.instance_id, "group_id": x.group_id, "method": x.method,
           "ranking": [x.doc_ids[i] for i in order], "scores": [scores[i] for i in order],
           "attack_rank": attack_rank, "clean_source_rank": source_rank, "promotion": source_rank - attack_rank,
           "exposed": attack_rank <= k}
    if base_clean_order is not None:
        rec["clean_topk_kept"] = len(set(clean_order[:k]) & set(base_clean_order[:k])) / k
    if x.co_attacks:                      # several attacked documents (--attacked K): any of them, and their share
        n_top = len(set(order[:k]) & set(x.attacked))
        rec.update(attacked=len(x.attacked), attacks_in_topk=n_top, any_exposed=n_top > 0, topk_attack_share=n_top / k)
    return rec


def summarize_stage(recs, seen, n_boot, seed):
    """Records of one reranker -> {"overall", "per_method", "seen", "unseen"}, each a dict of the
    metrics (percent for exposure and clean top-k kept) with 95% cluster-bootstrap CIs."""
    def block(rs):
        if not rs:
            return {"n": 0}
        clusters = [r["group_id"] for r in rs]
        out = {"n": len(rs)}
        series = [("exposure", [100.0 * r["exposed"] for r in rs], clusters),
                  ("mean_attack_rank", [r["attack_rank"] for r in rs], clusters),
                  ("promotion", [r["promotion"] for r in rs], clusters)]
        # clean top-k kept is the group's clean list's: one value a group, however many families it holds
        kept = {r["group_id"]: 100.0 * r["clean_topk_kept"] for r in rs if "clean_topk_kept" in r}
        if len(kept) == len(set(clusters)):               # (every group's: a base to compare with)
            series.append(("clean_topk_kept", list(kept.values()), list(kept)))
        for name, vals, cl in series:
            out[name] = sum(vals) / len(vals)
            out[name + "_ci"] = list(metrics.cluster_bootstrap_ci(vals, cl, n_boot=n_boot, seed=seed))
        return out
    methods = list(dict.fromkeys(r["method"] for r in recs))
    return {"overall": block(recs),
            "per_method": {m: {**block([r for r in recs if r["method"] == m]), "seen": m in seen} for m in methods},
            "seen": block([r for r in recs if r["method"] in seen]),
            "unseen": block([r for r in recs if r["method"] not in seen])}


def family_strength(recs, k, n_boot, seed):
    """Does each family raise visibility at the reranker stage? Per family, over `recs` (the paper's lists:
    metrics.paper_level), exposure@k of its rewrite minus its source's on the same group's clean list, in
    points, with a 95% cluster-bootstrap CI over groups; a family whose interval holds 0 is not shown to
    raise visibility on this reranker, nor one whose interval lies below 0 (it lowers it) -> {family: {"gain",
    "ci", "n", "holds_zero", "raises"}}."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in recs):
        rs = [r for r in recs if r["method"] == m]
        vals = [100.0 * (r["exposed"] - (r["clean_source_rank"] <= k)) for r in rs]
        lo, hi = metrics.cluster_bootstrap_ci(vals, [r["group_id"] for r in rs], n_boot=n_boot, seed=seed)
        out[m] = {"gain": sum(vals) / len(vals), "ci": [lo, hi], "n": len(rs), "holds_zero": bool(lo <= 0 <= hi),
                  "raises": bool(lo > 0)}
    return out


def attacked_stage(recs, k, n_boot, seed):
    """One reranker against the number of attacked documents a list holds (--attacked K): exposure@k of
    the source's rewrite (exposure), of any attacked document (any_exposure) beside its chance rate
    (metrics.chance_any_in_topk), of each attacked document on average (mean_exposure), and the share of
    the top k they take, in percent with CIs -> metrics.by_attacked's."""
    return metrics.by_attacked(recs, {
        "exposure": lambda r: 100.0 * r["exposed"],
        "any_exposure": lambda r: 100.0 * r.get("any_exposed", r["exposed"]),
        "mean_exposure": lambda r: 100.0 * r.get("attacks_in_topk", r["exposed"]) / r.get("attacked", 1),
        "topk_attack_share": lambda r: 100.0 * r.get("topk_attack_share", r["exposed"] / k)}, n_boot, seed,
        chance=(len(recs[0]["ranking"]), k))


def honest_stage(honest_recs, attack_recs, k, n_boot, seed):
    """One reranker's honest penalty and, on the same groups, its attack demotion (module docstring), in
    percent with 95% cluster-bootstrap CIs; None where no source is in the clean top k."""
    groups = {r["group_id"] for r in honest_recs}
    kept = [r for r in honest_recs if r["clean_source_rank"] <= k]
    attacks = [r for r in attack_recs if r["group_id"] in groups and r["clean_source_rank"] <= k]
    out = {"groups": len(honest_recs), "source_in_topk": len(kept), "n_attack": len(attacks)}
    for name, rs in (("honest_penalty", kept), ("attack_demotion", attacks)):
        vals = [100.0 * (not r["exposed"]) for r in rs]
        out[name] = sum(vals) / len(vals) if vals else None
        out[name + "_ci"] = list(metrics.cluster_bootstrap_ci(vals, [r["group_id"] for r in rs], n_boot=n_boot,
                                                              seed=seed)) if vals else None
    return out


def check_items(rerankers):
    """rerank-eval's --reranker specs (parsed: [(label, RerankSpec)]), checked before anything runs (every
    endpoint's key present) -> [(label, RerankSpec)]."""
    if not rerankers:
        raise SettingsError("rerank-eval: give at least one --reranker [LABEL=]SPEC (base, shield, cohere:MODEL, "
                            "jina:MODEL, voyage:MODEL, http://HOST:PORT[/rerank], tei:http://HOST:PORT, "
                            "vllm-score:http://HOST:PORT)")
    return rankers.check_specs(rerankers)


def needs(items):
    """What rerank-eval needs from `train` for these rerankers (runs.NEEDS): the adapter when one is the Shield."""
    return ("adapter",) * any(spec.kind == "shield" for _, spec in items)


def dry_run(run, items):
    """rerank-eval --dry-run: what each reranker would score, nothing scored. A local reranker's forward
    passes at most (each distinct query and document once; its cache may hold some) and with --certify the
    smoothing's (--certify-samples deletion samples of each distinct document of the attack and clean lists);
    an endpoint's requests (one per list) and, with --prices holding {"usd_per_1k_searches": x}, their
    price."""
    cfg = run.cfg
    insts, cleans, honest = stage_lists(run.data)
    lists = insts + list(cleans.values()) + honest
    pairs = {(x.query, d) for x in lists for d in x.docs}
    smoothed = {(x.query, d) for x in insts + list(cleans.values()) for d in x.docs}
    n = cfg.certify.certify_samples
    out = {"lists": len(lists), "distinct_documents": len(pairs), "rerankers": {}}
    for label, spec in items:
        if spec.kind in rankers.LOCAL:
            out["rerankers"][label] = {"forward_passes_at_most": len(pairs)}
            if cfg.setting("certify", False):
                out["rerankers"][label].update(certify_forward_passes_at_most=n * len(smoothed),
                                                        certify_samples=n)
        else:
            price = (run.prices or {}).get(accounting.price_key(f"rerank:{spec}"), {})    # the ledger's own key
            per_1k = price.get("usd_per_1k_searches") if isinstance(price, dict) else None
            out["rerankers"][label] = {"requests": len(lists), "documents": sum(len(x.docs) for x in lists),
                                       "usd": None if per_1k is None else per_1k * len(lists) / 1000}
    return out


def noise_seed(path):
    """The run's deletion seed: the one `path` holds, else a fresh one (certify.fresh_seed) written there
    first, so that a resumed run reuses its scores (the only writer of that file)."""
    seed = (read_json(path) or {}).get("seed")
    if seed is None:
        seed = certify.fresh_seed()
        write_json(path, {"seed": seed})
    return seed


def certify_records(run, rk, insts, cleans, base_clean):
    """rerank-eval --certify under one local ranker (certify.py): per attack instance the smoothed scores of
    its list and of its clean list; the source's radius in its clean list and the rewrite's in its attacked
    list, per kind of edit; each clean top-k document's radius against insertions into the source; whether
    the real rewrite's edit lies inside the source's certificate; and what the smoothing costs -> [records].
    On a list with further attacked documents (co_attacks) the source's bar and the clean documents' places
    leave them out, since the attacker writes them too (certify.radius's skip)."""
    cfg, n, rate = run.cfg, run.cfg.certify.certify_samples, run.cfg.certify.deletion_rate
    d = cfg.data
    seed = noise_seed(run.path("cache", "noise_seed.json"))
    stem, ext = os.path.splitext(rk.path)            # the ranker's own cache, one per deletion rate and seed
    rr = copy.copy(rk.rr)                            # a budget that counts each sample's prompt prefix, which
    rr.token_budget *= SHORT_BUDGET                  # runs once a micro-batch (speed.short_documents)
    noised = rankers.Ranker(rr, f"{stem}.deleted-{rate:g}-{seed}{ext}", f"{rk.label} deleted",
                            adapter_off=rk.adapter_off, made_from=rk.made_from, chunk=512)
    groups = list(cleans)
    t0, passes = time.perf_counter(), len(noised.cache)
    with speed.short_documents(rr.model):
        g_attack = certify.smoothed(noised, insts, rate, n, seed)
        g_clean = dict(zip(groups, certify.smoothed(noised, [cleans[g] for g in groups], rate, n, seed)))
    cost = {"forward_passes": len(noised.cache) - passes, "seconds": time.perf_counter() - t0,
            "lists": len(insts) + len(groups)}          # every level's attacked lists and the clean ones
    eps = certify.epsilon(len(insts[0].docs), n)
    recs = []
    for x, g in zip(insts, g_attack):
        a, clean, co = x.attack_index, g_clean[x.group_id], set(x.co_attacks)    # co: the attacker's too
        radii = lambda g, a, text, skip: {kind: certify.radius(g, a, d.k, eps, rate, kind, len(text.split()), skip)
                                          for kind in certify.KINDS}
        clean_ids = cleans[x.group_id].doc_ids
        clean_top = metrics.ranked(clean, clean_ids)[:d.k]
        ins, dels = certify.edit_counts(x.source, x.docs[a])
        rec = {"instance_id": x.instance_id, "group_id": x.group_id, "method": x.method, "attack_index": a,
               "samples": n, "eps": eps,
               "deletion_rate": rate, "smoothed": g, "smoothed_clean": clean,
               "source_radius": radii(clean, a, x.source, co), "rewrite_radius": radii(g, a, x.docs[a], ()),
               "kept_radius": [certify.kept_radius(clean, a, j, d.k, eps, rate, co) for j in clean_top
                               if j != a and j not in co],
               "inserted": ins, "deleted": dels, "inside": certify.inside(clean, a, d.k, eps, rate, ins, dels, co),
               "smoothed_exposed": a in metrics.ranked(g, x.doc_ids)[:d.k],
               "ndcg_smoothed_clean": certify.ndcg(metrics.ranked(clean, clean_ids), rk.order(cleans[x.group_id]),
                                                   d.k)}
        if x.co_attacks:
            rec.update(attacked=len(x.attacked), co_radius=[radii(g, j, x.docs[j], ())["inserted"]
                                                            for j in x.co_attacks])
        if base_clean is not None:
            rec["smoothed_clean_topk_kept"] = len(set(clean_top) & set(base_clean[x.group_id][:d.k])) / d.k
        recs.append(rec)
    return recs, cost


def certify_summary(recs, plain, cost):
    """A ranker's certificate block: % of attacked documents (the source, as the attacker finds it; each
    source once) certified at each radius of certify.RADII per kind of edit, and of the rewrites against further
    insertions; % of clean top-k documents no insertion of that size into the source pushes out; the
    real rewrites inside their source's certificate; what the smoothing costs (exposure and clean top-k
    kept, smoothed beside plain; nDCG@k of the smoothed clean list against the plain one) and takes."""
    pct = lambda xs: 100.0 * sum(xs) / len(xs) if xs else None
    at = lambda r, key: r is not None and r >= key
    # a source's certificate and its clean list's depend on the group and position, not on the family that
    # rewrote it: each counts once, not once per family (a group whose rewrites failed would weigh less)
    sources = list({(x["group_id"], x["attack_index"]): x for x in recs}.values())
    kept = [k for r in sources for k in r["kept_radius"]]
    out = {"samples": recs[0]["samples"], "eps": recs[0]["eps"], "deletion_rate": recs[0]["deletion_rate"],
           "n": len(recs), "sources": len(sources),
           "certified": {kind: {str(r): pct([at(x["source_radius"][kind], r) for x in sources])
                                for r in certify.RADII} for kind in certify.KINDS},
           "rewrite_certified": {str(r): pct([at(x["rewrite_radius"]["inserted"], r)
                                              and all(at(c, r) for c in x.get("co_radius", ())) for x in recs])
                                 for r in certify.RADII},
           "clean_kept_certified": {str(r): pct([at(k, r) for k in kept]) for r in certify.RADII},
           "rewrites_inside": pct([x["inside"] for x in recs]),
           "inserted_median": statistics.median(x["inserted"] for x in recs),
           "exposure": pct([r["exposed"] for r in plain]),
           "smoothed_exposure": pct([r["smoothed_exposed"] for r in recs]),
           "ndcg_smoothed_clean": sum(r["ndcg_smoothed_clean"] for r in recs) / len(recs),
           "forward_passes": cost["forward_passes"], "seconds": cost["seconds"],
           "seconds_per_list": cost["seconds"] / cost["lists"]}
    if "smoothed_clean_topk_kept" in recs[0]:
        out["smoothed_clean_topk_kept"] = pct([r["smoothed_clean_topk_kept"] for r in recs])
        out["clean_topk_kept"] = pct([r["clean_topk_kept"] for r in plain if "clean_topk_kept" in r])
    return out


def stage_lists(data):
    """The lists the reranker stage scores -> (attack instances, {group_id: clean list}, honest lists)."""
    return (geodef.expand(data.test, data.methods), {g.group_id: geodef.clean_instance(g) for g in data.test},
            [geodef.honest_instance(g) for g in data.test if g.honest is not None])


def stage_rankers(run, items, stage="rerank-eval"):
    """Each --reranker's Ranker, the local ones' lists scored -> {label: Ranker}. Under torchrun every
    rank runs it, each scoring whole queries of its share (rankers.sharded); the command then leaves the
    process group and rank 0 goes on alone (rerank_stage). The endpoints are asked later, by rank 0."""
    insts, cleans, honest = stage_lists(run.data)
    by_label = rankers.make_rankers(run, items, stage)
    for label, spec in items:
        if spec.kind in rankers.LOCAL:
            rankers.sharded(run.ranks, by_label[label], insts + list(cleans.values()) + honest)
    return by_label


def rerank_stage(run, items, stage="rerank-eval", by_label=None):
    """Score every test instance and its clean list with each reranker; write results/rerank-<label>.jsonl
    (whole, once every list is scored: a failed endpoint records nothing) and summary.json's
    rerank_stage; with honest edits also results/rerank-<label>.honest.jsonl and each block's `honest`.
    by_label: stage_rankers' answer when the caller has run it. -> ({label: summary block}, {label: records})."""
    cfg, data = run.cfg, run.data
    d = cfg.data
    insts, cleans, honest = stage_lists(data)
    if by_label is None:
        by_label = stage_rankers(run, items, stage)
    for label, spec in items:
        if spec.kind not in rankers.LOCAL:
            by_label[label].prepare(insts + list(cleans.values()) + honest)
    base = next((by_label[lb] for lb, spec in items if spec.kind == "base"), None)
    res = os.path.join(cfg.folder.run_dir, "results")
    out, records, digest = {}, {}, test_set_digest(insts)
    for label, spec in items:
        rk = by_label[label]
        recs = [instance_record(x, cleans[x.group_id], rk, base.order(cleans[x.group_id]) if base else None, d.k)
                for x in insts]
        write_jsonl(os.path.join(res, f"rerank-{label}.jsonl"), recs)
        records[label] = recs
        paper = metrics.paper_level(recs)
        out[label] = {"spec": str(spec), "test_set_sha1": digest, "k": d.k,
                      **summarize_stage(paper, data.seen, cfg.rerank.n_boot, cfg.folder.seed)}
        out[label]["strength"] = family_strength(paper, d.k, cfg.rerank.n_boot, cfg.folder.seed)
        if len(geodef.attacked_levels(insts)) > 1:
            out[label]["by_attacked"] = attacked_stage(recs, d.k, cfg.rerank.n_boot, cfg.folder.seed)
        if cfg.setting("certify", False) and spec.kind in rankers.LOCAL and insts:     # rerank-eval --certify
            base_clean = {gid: base.order(c) for gid, c in cleans.items()} if base else None
            crecs, cost = certify_records(run, rk, insts, cleans, base_clean)
            write_jsonl(os.path.join(res, f"certify-{label}.jsonl"), crecs)
            level = metrics.paper_level                  # the paper's lists, then each further level
            out[label]["certificate"] = certify_summary(level(crecs), level(recs), cost)
            for lv in geodef.attacked_levels(insts)[1:]:
                out[label]["certificate"].setdefault("by_attacked", {})[str(lv)] = certify_summary(
                    level(crecs, lv), level(recs, lv), cost)
        if honest:
            hrecs = [instance_record(x, cleans[x.group_id], rk, None, d.k) for x in honest]
            write_jsonl(os.path.join(res, f"rerank-{label}.honest.jsonl"), hrecs)
            out[label]["honest"] = honest_stage(hrecs, metrics.paper_level(recs), d.k, cfg.rerank.n_boot,
                                                cfg.folder.seed)     # one edited document against one attacked
    summary = write_summary(run, "rerank-eval", {"rerank_stage": out, "rerank_stage_k": d.k},
                            merge=("rerank_stage",))       # another reranker's block of an earlier run is kept
    report.write_rerank_report(cfg.folder.run_dir, with_notes(run, summary))
    if "conditions" in summary:              # an evaluated run: its report gets the table too
        report.write_report(cfg.folder.run_dir, summary)
    return out, records


def stage_text(stage, k, run_dir):
    """rerank-eval's printout: the stage table, then where its report and records are."""
    return (stage_table(stage, k) + f"\n\nreport: {os.path.join(run_dir, 'rerank_report.md')}"
            f"\nrecords: {os.path.join(run_dir, 'results')}/rerank-<label>.jsonl")


def stage_table(stage, k):
    """The reranker-stage table as text (the demo and rerank-eval print it)."""
    honest = any("honest" in s for s in stage.values())     # a benchmark with honest edits: two more columns
    head = (f"{'reranker':<18}{'exposure@' + str(k):>13}{'95% CI':>16}{'attack rank':>13}{'promotion':>11}"
            f"{'clean kept':>12}" + (f"{'honest penalty':>16}{'attack demoted':>16}" if honest else ""))
    lines = [head]
    for label, s in stage.items():
        o = s["overall"]
        ci = o.get("exposure_ci") or [float("nan")] * 2
        kept = f"{o['clean_topk_kept']:.1f}" if "clean_topk_kept" in o else "-"
        h = s.get("honest") or {}
        pct = lambda v: "-" if v is None else f"{v:.1f}"
        lines.append(f"{label:<18}{o['exposure']:>13.2f}{f'[{ci[0]:.1f}, {ci[1]:.1f}]':>16}"
                     f"{o['mean_attack_rank']:>13.2f}{o['promotion']:>11.2f}{kept:>12}"
                     + (f"{pct(h.get('honest_penalty')):>16}{pct(h.get('attack_demotion')):>16}" if honest else ""))
    return "\n".join(lines)
