"""Leave-one-family-out (`python run.py holdout`): does a Shield built on some GEO families hold on a
family it never saw?

The paper's central claim (Experiments, Fig. 3) is that a defense constructed on three seen families
(AgenticGEO, AutoGEO, MAGEO) generalises to four unseen ones. With one fixed split that claim rests on
one draw of which families are seen. This module runs the protocol of domain generalisation
(leave-one-domain-out, as in DomainBed, Gulrajani & Lopez-Paz 2021, arXiv 2007.01434), which asks a
weaker question of every family in turn: does a Shield trained on all the other families hold on one
more? It is not the paper's three-seen, four-unseen regime. Its gap vs seen compares with the folds
trained without another family G (each saw F, on as many families and instances), not with the reference
trained on every family, and its intervals cover the test groups only (one training seed, one set of
construction groups, no multiplicity correction across families). `--seen-size S` runs the paper's
regime instead (regime): folds trained on S-family subsets, on equal numbers of instances, under several
seeds, read as unseen minus seen with a CI over subsets and groups, and as each family held out minus the
same family seen with a CI over families and groups (same_family). Leave-one-out's protocol:

For each family F the construction groups hold (build-bench --construction-families all writes all
seven), a Shield is trained on the construction instances of every family but F (Eqs. 1-5, the run's
settings otherwise) and, with the same settings, one on every family ("all", a plain reference row). On
the test split, for each fold (test instances of every method, the reranker stage alone, no LLM):
- held out: F's exposure@k under the fold's Shield, beside the base reranker's;
- trained: the exposure@k of the families the fold's Shield trained on, beside the base's;
- gap vs seen: F's exposure under the Shield trained without F minus its mean exposure under the
  Shields trained without another held-out family G (each saw F, and trained on as many families and
  instances as the -F fold: folds() cuts each to the smallest fold's count), per query group, paired on
  the same instances: what not having seen F costs, size-matched. "all" trains on one family more and
  picks its epoch on a monitoring split that holds F, so no gap is computed against it; with one
  held-out family there is no matched reference and no gap vs seen;
- gap vs trained: the drop the fold's Shield makes on its trained families (base minus Shield, per
  group) minus the drop it makes on F: how much less it removes of a family it did not see.
Each gap has a 95% CI from the query-cluster bootstrap (metrics.cluster_bootstrap_ci); positive gaps
mean the held-out family gets through more.

Each fold is a run folder of its own, <run>/holdout/without-<F>[-n<count>] (and <run>/holdout/all): its
config.json pins its settings, its Shield trains and resumes as `train` does, its reranker records
and rerank_report.md are rerank-eval's. holdout/summary.json and holdout/report.md (with a figure) are
rewritten whole from the folds' records, so a killed holdout reruns to the same files.

With --llm-stage each fold also builds its TFSG library on its trained families' construction instances
(train's TFSG stage) and evaluates "Shield only" and "GEO Defender" end to end (eval's records in the
fold's results/): per F its ASR under the fold's defense, under the matched defenses (+F, as above), under
the all-families one and on the trained families, and the gap vs seen with its CI.

Usage: python run.py holdout --name gpt55      (a trained run's settings; or --bench and the rest)
"""
import dataclasses
import itertools
import os
import random

import numpy as np

import detect
import geodef
import figures
import metrics
import rerank_eval
from evaluation import check_eval_settings, evaluate
from metrics import by_group, paired_gap, rate
from rankers import parse_rerankers
from report import gap_text
from runs import offline_notes
from settings import SettingsError
from store import atomic_write, log, read_json, write_json
from train import plan_train, train_shield, train_tfsg

ALL = "all"                       # the reference fold: every construction family
DETECT_FPR = 0.05                 # the detection side's threshold: this FPR on the construction honest edits


def construction_families(run, say=True):
    """The construction families a fold can train on: those with an instance. A family the build's gate refused
    on every construction group trains no fold; counted as seen, every fold would read as having seen it."""
    cons, present = run.data.meta.construction(), {m for g in run.data.construction for m in g.attacks}
    empty = [m for m in cons if m not in present]
    if empty and say:
        log(f"[holdout] {', '.join(empty)}: no construction instance (every rewrite failed the build's gate): "
            "neither held out nor seen by any fold")
    return [m for m in cons if m not in empty]


def families(run):
    """The families to hold out in turn (--families; default every family the construction groups
    hold) and the construction families -> (held out, construction)."""
    cfg, h, cons = run.cfg, run.cfg.holdout, construction_families(run)
    if len(cons) < 2:
        raise SettingsError(f"{cfg.data.bench}: its construction groups hold one family ({cons}); nothing can be held "
                            "out. Build it with build-bench --construction-families all")
    if h.families == ALL:
        return list(cons), list(cons)
    asked = list(h.families)
    twice = sorted({m for m in asked if asked.count(m) > 1})
    if twice:                                        # each would run its fold again
        raise SettingsError(f"--families {h.families}: {', '.join(twice)} given twice; name each family once")
    absent = [m for m in asked if m not in cons]
    if absent:
        raise SettingsError(f"--families {h.families}: {absent} have no construction instances in {cfg.data.bench} "
                            f"(its construction groups hold {cons}; build-bench --construction-families all)")
    return asked, list(cons)


def fold_settings(cfg, name, trained):
    """A fold's settings: the run's, in the run folder <run>/holdout/<name>, trained on `trained`."""
    return cfg.replace(runs_dir=os.path.join(cfg.folder.run_dir, "holdout"), name=name, seen_methods=tuple(trained))


def folds(run):
    """[(fold name, held-out family or None, fold settings, its construction groups)]: one per held-out
    family, then 'all' (the run's groups). The held-out folds train on as many instances: a family whose
    rewrites failed on more groups leaves its fold more, so each keeps the smallest fold's count (equal_size;
    the count then in its name, without-F-n<count>, as a fold of another size is another fold). Each fold is
    checked here, before any training (check_fold)."""
    cfg, data = run.cfg, run.data
    held, cons = families(run)
    trained = {f: [m for m in cons if m != f] for f in held}
    size = min((len(geodef.expand(data.construction, t)) for t in trained.values()), default=0)
    out = []
    for f in held:
        cut = len(geodef.expand(data.construction, trained[f])) > size
        name = f"without-{f}" + (f"-n{size}" if cut else "")
        groups = equal_size(data.construction, trained[f], size, cfg.folder.seed) if cut else data.construction
        out.append((name, f, fold_settings(cfg, name, trained[f]), groups))
    out += [(ALL, None, fold_settings(cfg, ALL, cons), data.construction)]
    for _, _, fcfg, groups in out:
        check_fold(run, fcfg, groups)
    return out


def check_fold(run, fcfg, groups):
    """A fold's checks, made for every fold before the first trains: its Shield split, and with --llm-stage its
    TFSG schedule and the settings of the eval records it has (another --max-tokens, say: refused before any
    fold is paid for, not at the fold that holds them)."""
    fold = fold_run(run, fcfg, groups)
    inst = geodef.expand(groups, list(fcfg.seen.seen_methods))
    fold.shield_split(inst)
    if run.cfg.holdout.llm_stage:
        fold.tfsg_schedule(inst)
        check_eval_settings(fold, list(LLM_CONDITIONS), [])


LLM_CONDITIONS = ("Shield only", "GEO Defender")      # --llm-stage: the fold's defense end to end


def fold_run(run, fcfg, construction=None):
    """A fold's Run: the holdout's services and its benchmark as read once (the same groups and split),
    with the fold's settings and seen families; construction: its own construction groups (the paper's
    regime trains every fold on as many instances, equal_size)."""
    data = run.data._replace(seen=list(fcfg.seen.seen_methods))
    return run.with_settings(fcfg, data if construction is None else data._replace(construction=construction))


def run_fold(run, fcfg, llm_stage=False, construction=None):
    """Train the fold's Shield (resumable) and score the test split with it and the base; with llm_stage
    also build its TFSG library (train_tfsg) and evaluate LLM_CONDITIONS (evaluation.evaluate) -> {label:
    [instance records]} of the paper's lists (metrics.paper_level: the table pools instances):
    rerank_eval.instance_record's under "base" and "shield", eval's under each condition. run: the
    holdout's Run, whose benchmark every fold reads (read once)."""
    fold = fold_run(run, fcfg, construction)
    fold.record_or_check("holdout")
    train_shield(fold)
    _, out = rerank_eval.rerank_stage(fold, parse_rerankers(["base", "shield"]), stage="holdout")
    if llm_stage:
        train_tfsg(fold)
        conditions = (list(LLM_CONDITIONS), [])            # no transfer library, no deployed reranker
        check_eval_settings(fold, *conditions)
        out.update(evaluate(fold, conditions).records)
    return {label: metrics.paper_level(recs) for label, recs in out.items()}


def failed_answers(recs):
    """{condition: answers that never came} of one fold's --llm-stage records, where some did: each cites
    nothing, read as a blocked attack in the ASR (rate), as eval's reports count them."""
    return {c: n for c in LLM_CONDITIONS if (n := sum("answer_failed" in r for r in recs.get(c, ())))}


def failed_lines(s):
    failed = s.get("answers_failed") or {}
    return ["Answers that never came (cite nothing: counted as not citing the attack in the ASR): " + ", ".join(
        f"{fold} {c} {n}" for fold, cs in failed.items() for c, n in cs.items()) + ".\n"] if failed else []


def matched(others, family, label="shield", key="exposed"):
    """F's `key` under the folds `others` (each trained without another family G, so on F; the -F fold's
    size), per query group: the mean over G of each fold's group mean -> ({group_id: [value]}, the mean
    over G of each fold's rate); ({}, None) without another fold."""
    per = [{g: sum(v) / len(v) for g, v in by_group(recs[label], [family], key=key).items()} for recs in others]
    groups = set.intersection(*map(set, per)) if per else set()
    rates = [rate(recs[label], [family], key) for recs in others]
    return ({g: [sum(p[g] for p in per) / len(per)] for g in sorted(groups)},
            sum(rates) / len(rates) if rates and None not in rates else None)


def fold_row(k, boot, family, trained, recs, ref, others):
    """One held-out family's row of the table (see the module docstring). others: the records of the folds
    trained without another held-out family (the size-matched reference). k: the top-k; boot: the
    bootstrap's (size, seed)."""
    base, shield = recs["base"], recs["shield"]
    row = {"family": family, "trained_on": trained,
           "strength": rerank_eval.family_strength([r for r in base if r["method"] == family], k, *boot).get(family)}
    for name, ms in (("held_out", [family]), ("trained", trained)):
        rs = [r for r in shield if r["method"] in ms]
        ci = metrics.cluster_bootstrap_ci([100.0 * r["exposed"] for r in rs], [r["group_id"] for r in rs],
                                          *boot) if rs else None
        row[name] = {"instances": len(rs), "base_exposure": rate(base, ms),
                     "shield_exposure": rate(shield, ms), "shield_exposure_ci": list(ci) if ci else None}
    seen, row["seen_exposure"] = matched(others, family)
    row.update(all_exposure=rate(ref["shield"], [family]), matched_folds=len(others),
               gap_vs_seen=paired_gap(*boot, by_group(shield, [family]), seen))
    row["gap_vs_trained"] = paired_gap(*boot, by_group(shield, trained, base), by_group(shield, [family], base))
    for c in (c for c in LLM_CONDITIONS if c in recs):        # --llm-stage: ASR end to end
        seen_c, seen_rate = matched(others, family, c, "attack_cited")
        row.setdefault("asr", {})[c] = {
            "held_out": rate(recs[c], [family], "attack_cited"), "trained": rate(recs[c], trained, "attack_cited"),
            "seen": seen_rate, "all": rate(ref[c], [family], "attack_cited"),
            "gap_vs_seen": paired_gap(*boot, by_group(recs[c], [family], key="attack_cited"), seen_c)}
    return row


def flags_taken(run):
    """Refuses a flag the chosen regime would ignore: --subsets and --seeds without --seen-size, --families
    with it (the regime draws its own folds); and a detection side with nothing to calibrate on."""
    h = run.cfg.holdout
    ignored = ([f"--families {','.join(h.families)}"] if h.seen_size and h.families != "all" else []) + \
        ([f"--subsets {h.subsets}"] if not h.seen_size and h.subsets else []) + \
        ([f"--seeds {h.seeds}"] if not h.seen_size and h.seeds != 1 else [])
    if ignored:
        raise SettingsError(f"{' and '.join(ignored)}: not read {'with' if h.seen_size else 'without'} --seen-size "
                            "(leave-one-out takes --families; the seen-size regime --subsets and --seeds)")
    if detect.has_honest(run.data):         # the detection side's calibration, before any fold trains
        detect.calibration_folds(run.data.construction)


def holdout(run):
    """Every fold, then holdout/summary.json and holdout/report.md -> the summary."""
    cfg, data = run.cfg, run.data
    if cfg.holdout.seen_size:
        return regime(run)
    plan = folds(run)
    recs = {}
    for name, family, fcfg, groups in plan:
        log(f"[holdout] fold {name}: the Shield{' and library' if cfg.holdout.llm_stage else ''} trained on "
            f"{fcfg.seen.seen_methods}")
        recs[family] = run_fold(run, fcfg, cfg.holdout.llm_stage, groups)
    ref, boot = recs[None], (cfg.rerank.n_boot, cfg.folder.seed)
    rows = [fold_row(cfg.data.k, boot, family, list(fcfg.seen.seen_methods), recs[family], ref,
                     [recs[g] for _, g, _, _ in plan if g not in (None, family)])
            for name, family, fcfg, _ in plan if family is not None]
    if detect.has_honest(data):            # the detection side: the text detector of each fold, never given F
        for r in rows:
            r["detection"] = detect.fold_detection(data, r["trained_on"], r["family"], DETECT_FPR, *boot)
    seen = construction_families(run, say=False)
    failed = {name: n for name, family, _, _ in plan if (n := failed_answers(recs[family]))}
    summary = {**summary_head(run, seen), "folds": rows,
               "never_trained": {m: rate(ref["shield"], [m]) for m in data.methods if m not in seen},
               "all_families_exposure": rate(ref["shield"], seen), **({"answers_failed": failed} if failed else {})}
    out = os.path.join(cfg.folder.run_dir, "holdout")
    write_json(os.path.join(out, "summary.json"), summary)
    write_report(out, summary)
    return summary


def dry_run(run):
    """What holdout would train, score and send, nothing sent: per fold its families, its optimizer
    steps, whether its Shield is already trained, the test instances it scores, and with --llm-stage
    the requests its library and its two conditions would send (train's and eval's dry runs)."""
    cfg, data, h = run.cfg, run.data, run.cfg.holdout
    if h.seen_size:
        out = {}
        for name, seen, fcfg, groups in regime_folds(run):
            fold = fold_run(run, fcfg, groups)
            opt, _ = fold.shield_split(geodef.expand(groups, seen))
            out[name] = {"trained_on": list(seen), "seed": fcfg.folder.seed,
                         "instances": len(geodef.expand(groups, seen)),
                         "shield_optimizer_steps": cfg.shield.optimizer_steps(len(opt)),
                         "shield_trained": os.path.isfile(os.path.join(fcfg.folder.run_dir, "shield_done.json")),
                         **({"train": plan_train(fold)["stages"]} if h.llm_stage else {})}
        return {"folds": out, **({} if h.llm_stage else {"llm_requests": 0})}
    out, n = {}, len(data.test) * len(data.methods)
    for name, family, fcfg, groups in folds(run):
        fold, inst = fold_run(run, fcfg, groups), geodef.expand(groups, list(fcfg.seen.seen_methods))
        opt, _ = fold.shield_split(inst)
        out[name] = {"held_out": family, "trained_on": list(fcfg.seen.seen_methods), "instances": len(inst),
                     "shield_optimizer_steps": cfg.shield.optimizer_steps(len(opt)),
                     "shield_trained": os.path.isfile(os.path.join(fcfg.folder.run_dir, "shield_done.json")),
                     "test_instances_scored": n}
        if h.llm_stage:        # eval's requests at most: the clean reference, both conditions, E0..E4, quality
            answers = len(data.test) + n * (len(LLM_CONDITIONS) + cfg.tfsg.n_batches + 1)
            out[name]["train"] = plan_train(fold)["stages"]
            out[name]["eval_requests_at_most"] = {"target answers": answers, "ASI judge": answers,
                                                  "pairwise quality judge": n}
    return {"folds": out, **({} if h.llm_stage else {"llm_requests": 0})}


# ----------------------------------------------------------------------------- the paper's regime (--seen-size S)


def equal_size(groups, seen, n, seed):
    """The construction groups with only n of their rewrites of the `seen` families kept (group and family
    pairs drawn with the seed), so that every fold of the regime trains on as many instances."""
    pairs = [(g.group_id, m) for g in groups for m in seen if m in g.attacks]
    if len(pairs) == n:
        return groups
    keep = set(random.Random(seed).sample(pairs, n))
    return [dataclasses.replace(g, attacks={m: t for m, t in g.attacks.items() if m not in seen
                                            or (g.group_id, m) in keep}) for g in groups]


def regime_folds(run):
    """--seen-size S -> [(fold name, seen families, fold settings, its construction groups)]: every S-family
    subset of the construction families (or --subsets of them drawn with the seed), each trained under
    --seeds seeds (the run's seed, +1, ...), every fold on the smallest subset's number of construction
    instances (equal_size) and picking its epoch on a monitoring split of its own families. Each fold is
    checked here, before any training (check_fold)."""
    cfg, data, h = run.cfg, run.data, run.cfg.holdout
    cons = construction_families(run)
    subsets = list(itertools.combinations(cons, h.seen_size)) if h.seen_size <= len(cons) else []   # (C's ssize_t)
    if h.subsets and h.subsets < len(subsets):
        picked = set(random.Random(cfg.folder.seed).sample(range(len(subsets)), h.subsets))
        subsets = [a for i, a in enumerate(subsets) if i in picked]
    if not subsets or any(not [m for m in data.methods if m not in a] for a in subsets):
        raise SettingsError(f"--seen-size {h.seen_size}: {cfg.data.bench}'s construction groups hold {len(cons)} "
                            f"families with instances ({', '.join(cons)}) and every subset must leave an evaluated "
                            f"family unseen (--methods {', '.join(data.methods)})")
    size = min(len(geodef.expand(data.construction, a)) for a in subsets)
    out = []
    for a in subsets:
        groups = equal_size(data.construction, a, size, cfg.folder.seed)
        for j in range(h.seeds):
            name = f"seen-{'_'.join(a)}-n{size}-seed{j}"     # the size hangs on --subsets: a fold of another is new
            fcfg = fold_settings(cfg, name, a).replace(seed=cfg.folder.seed + j)
            check_fold(run, fcfg, groups)
            out.append((name, a, fcfg, groups))
    return out


def fold_group_bootstrap_ci(diffs, n_boot=10000, seed=0, level=0.95):
    """Percentile CI of the mean of `diffs` (S subsets x G query groups, each row a subset's folds averaged):
    rows and groups both resampled with replacement, so the interval carries the variance of which families are
    seen (a seed's variance inside a row) with the test groups'."""
    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, d.shape[0], size=(n_boot, d.shape[0]))
    cols = rng.integers(0, d.shape[1], size=(n_boot, d.shape[1]))
    means = np.array([d[r][:, c].mean() for r, c in zip(rows, cols)])
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def unseen_minus_seen(recs, seen, unseen, key="exposed", base=None):
    """One fold's records -> ({group_id: unseen mean minus seen mean of `key` x 100}, unseen by group, seen
    by group), over the groups that hold both. base: the same instances' base records; each side is then
    the Shield's change from the base (Shield minus base), so that families the base already exposes more
    (stronger ones) do not read as families the Shield failed to learn: seen and unseen are other families."""
    u, s = shield_side(recs, unseen, base, key), shield_side(recs, list(seen), base, key)
    return {g: sum(u[g]) / len(u[g]) - sum(s[g]) / len(s[g]) for g in sorted(set(u) & set(s))}, u, s


def shield_side(recs, methods, base=None, key="exposed"):
    """{group_id: [100 * rec[key]]} of the records of `methods`; with `base`, each the Shield's change from the
    base (Shield minus base; by_group's own drop reads base minus Shield)."""
    if base is None:
        return by_group(recs, methods, key=key)
    return {g: [-v for v in vs] for g, vs in by_group(recs, methods, base, key).items()}


def over_folds(n_boot, seed, diffs, subset_of):
    """{fold: {group_id: difference}} -> the mean over folds and their common groups, with the CI that
    resamples subsets and groups (fold_group_bootstrap_ci). A subset's folds (its --seeds) are averaged into
    one row first: seeds nested in a subset say nothing more about which families were seen, and resampled
    as folds of their own they would narrow the interval."""
    common = sorted(set.intersection(*(set(d) for d in diffs.values())))
    rows = {}
    for fold, d in diffs.items():
        rows.setdefault(subset_of[fold], []).append([d[g] for g in common])
    matrix = [np.mean(r, axis=0) for r in rows.values()]                 # (subsets, groups)
    return {"gap": float(np.mean(matrix)) if common else None, "groups": len(common),
            "gap_ci": list(fold_group_bootstrap_ci(matrix, n_boot, seed)) if common else None}


def changes(recs, families, base=None, key="exposed"):
    """One fold's records -> {family: {group_id: mean of `key` x 100}}; with `base` (the same instances' base
    records), the Shield's change from the base (Shield minus base) instead."""
    return {m: {g: sum(vs) / len(vs) for g, vs in shield_side(recs, [m], base, key).items()} for m in families}


def same_family(n_boot, seed, folds):
    """[(seen families, changes(...))] over the folds -> each family's held-out minus seen: its change when
    no fold's Shield saw it minus its change when the fold's did, per query group, over the families some fold
    sees and some other holds out. The family is the unit of this interval (fold_group_bootstrap_ci
    resamples families and groups): the folds' subsets share families, so the CI over subsets counts a
    family once per subset it is in; and a family is compared with itself, so how strong or easy it is
    cancels, where unseen minus seen compares different families."""
    per = {}
    for m in sorted({m for _, ch in folds for m in ch}):
        sides = [[ch[m] for seen, ch in folds if (m in seen) == s] for s in (False, True)]
        groups = set.intersection(*(set(c) for side in sides for c in side)) if all(sides) else set()
        if groups:
            per[m] = {g: np.mean([c[g] for c in sides[0]]) - np.mean([c[g] for c in sides[1]]) for g in groups}
    common = sorted(set.intersection(*(set(d) for d in per.values()))) if per else []
    matrix = [[d[g] for g in common] for d in per.values()]             # (families, groups)
    return {"gap": float(np.mean(matrix)) if common else None, "groups": len(common),    # (each family's over
            "families": {m: float(np.mean(row)) for m, row in zip(per, matrix)} if common else {},   # the same groups)
            "gap_ci": list(fold_group_bootstrap_ci(matrix, n_boot, seed)) if common else None}


def regime(run):
    """--seen-size S: every fold of regime_folds, then holdout/summary.json and report.md -> the summary:
    per fold its unseen-minus-seen exposure (paired per query group, CI over groups), and over the folds
    the mean gap with a CI over subsets and groups, and its spread over the subsets; with --llm-stage the
    same of ASR under LLM_CONDITIONS (each fold's library and eval records)."""
    cfg, data = run.cfg, run.data
    h, boot = cfg.holdout, (cfg.rerank.n_boot, cfg.folder.seed)
    rows, diffs, asr = [], {}, {c: {} for c in LLM_CONDITIONS}
    fam, fam_asr = [], {c: [] for c in LLM_CONDITIONS}                   # same_family's (seen, changes) per fold
    failed = {}
    for name, seen, fcfg, groups in regime_folds(run):
        log(f"[holdout] fold {name}: the Shield{' and library' if h.llm_stage else ''} trained on "
            f"{', '.join(seen)} (seed {fcfg.folder.seed})")
        recs = run_fold(run, fcfg, h.llm_stage, groups)
        failed.update({name: n} if (n := failed_answers(recs)) else {})
        unseen = [m for m in data.methods if m not in seen]
        diffs[name], u, s = unseen_minus_seen(recs["shield"], seen, unseen, base=recs["base"])
        fam.append((seen, changes(recs["shield"], data.methods, recs["base"])))
        rows.append({"fold": name, "seen": list(seen), "unseen": unseen, "seed": fcfg.folder.seed,
                     "instances": len(geodef.expand(groups, seen)),
                     "steps": read_json(os.path.join(fcfg.folder.run_dir, "shield_done.json"), {}).get("steps"),
                     "seen_exposure": rate(recs["shield"], seen), "unseen_exposure": rate(recs["shield"], unseen),
                     "base_seen_exposure": rate(recs["base"], seen),
                     "base_unseen_exposure": rate(recs["base"], unseen),
                     "gap": paired_gap(*boot, u, s)})
        for c in (c for c in LLM_CONDITIONS if c in recs):       # --llm-stage: ASR end to end
            asr[c][name], u, s = unseen_minus_seen(recs[c], seen, unseen, "attack_cited")
            fam_asr[c].append((seen, changes(recs[c], data.methods, key="attack_cited")))
            rows[-1].setdefault("asr", {})[c] = {"seen": rate(recs[c], seen, "attack_cited"),
                                                 "unseen": rate(recs[c], unseen, "attack_cited"),
                                                 "gap": paired_gap(*boot, u, s)}
    by_subset, subset_of = {}, {r["fold"]: ", ".join(r["seen"]) for r in rows}
    for r in rows:
        by_subset.setdefault(", ".join(r["seen"]), []).append(r["gap"]["gap"])
    subset_gaps = {k: sum(v) / len(v) for k, v in by_subset.items() if None not in v}
    summary = {**summary_head(run, construction_families(run, say=False)),
               "regime": {"seen_size": h.seen_size, "subsets": len(by_subset), "seeds": h.seeds, "folds": rows,
                          **over_folds(*boot, diffs, subset_of), "subset_gaps": subset_gaps,
                          "same_family": same_family(*boot, fam),
                          "spread": [min(subset_gaps.values()), max(subset_gaps.values())] if subset_gaps else None},
               **({"answers_failed": failed} if failed else {})}
    if h.llm_stage:
        summary["regime"]["asr"] = {c: {**over_folds(*boot, d, subset_of), "same_family": same_family(
            *boot, fam_asr[c])} for c, d in asr.items()}
    out = os.path.join(cfg.folder.run_dir, "holdout")
    write_json(os.path.join(out, "summary.json"), summary)
    write_report(out, summary)
    return summary


def regime_table(s):
    """--seen-size's table as text: per fold its seen families, instances, steps, exposures and gap."""
    r = s["regime"]
    lines = [f"exposure@{s['k']} (%) on the test split, trained on {r['seen_size']} families a fold; the gap: "
             "unseen minus seen of the Shield's change from the base"]
    lines += [f"{'seen families':<40}{'seed':>5}{'inst':>6}{'steps':>6}{'seen':>7}{'base':>6}{'unseen':>8}{'base':>6}"
              f"{'unseen - seen':>24}"]
    lines += [f"{', '.join(f['seen']):<40}{f['seed']:>5}{f['instances']:>6}{str(f['steps']):>6}"
              f"{pct(f['seen_exposure']):>7}{pct(f.get('base_seen_exposure')):>6}{pct(f['unseen_exposure']):>8}"
              f"{pct(f.get('base_unseen_exposure')):>6}{gap_text(f['gap']):>24}" for f in r["folds"]]
    if r["gap"] is not None:
        lines.append(f"mean over {len(r['folds'])} folds: {r['gap']:+.1f} [{r['gap_ci'][0]:+.1f}, "
                     f"{r['gap_ci'][1]:+.1f}] (CI over subsets and groups); spread over subsets {r['spread'][0]:+.1f} "
                     f".. {r['spread'][1]:+.1f}")
    lines.append(family_text(r.get("same_family")))
    for c, a in (r.get("asr") or {}).items():              # --llm-stage
        lines.append(f"ASR under {c}, unseen minus seen, mean over folds: " + ("-" if a["gap"] is None else
                     f"{a['gap']:+.1f} [{a['gap_ci'][0]:+.1f}, {a['gap_ci'][1]:+.1f}]") + " (CI over subsets "
                     "and groups); per fold " + ", ".join(gap_text(f["asr"][c]["gap"]) for f in r["folds"]))
        same = family_text(a.get("same_family"))
        lines += [f"ASR under {c}, {same}"] if same else []
    return "\n".join(line for line in lines if line)


def family_text(f):
    """same_family's line of the table ('' for a summary without it or with no family on both sides)."""
    if not f or f["gap"] is None:
        return ""
    return (f"the same family held out minus seen, mean over {len(f['families'])} families: {f['gap']:+.1f} "
            f"[{f['gap_ci'][0]:+.1f}, {f['gap_ci'][1]:+.1f}] (CI over families and groups); per family "
            + ", ".join(f"{m} {v:+.1f}" for m, v in f["families"].items()))


def summary_head(run, cons):
    """What every holdout summary opens with: the top-k, the benchmark and its construction families, the
    test groups, who built them, and the offline notes."""
    cfg, data, meta = run.cfg, run.data, run.data.meta
    built = meta.raw.get("builder_llm")     # the builder LLM of each split (_meta; test_builder_llm: --test-llm)
    return {"k": cfg.data.k, "bench": os.path.basename(cfg.data.bench), "test_groups": len(data.test),
            "construction_families": cons,
            "builders": {"construction": built, "test": meta.raw.get("test_builder_llm") or built},
            "notes": offline_notes(run)}


def pct(v):
    return "-" if v is None else f"{v:.1f}"


# a held-out family flagged "*": its rewrite's gain over its source on the base reranker is not above 0
FLAG_NOTE = ("\n* not shown to raise visibility: the family's exposure gain over its source on the base reranker "
             "has a 95% CI reaching 0 or below, so what a Shield does to it says little")


def cells(r):
    """One fold's row as text: F, base, Shield -F, Shield +F (size-matched), Shield all, the trained
    families, the two gaps."""
    flag = " *" if r.get("strength") and not r["strength"]["raises"] else ""
    return [r["family"] + flag, pct(r["held_out"]["base_exposure"]), pct(r["held_out"]["shield_exposure"]),
            pct(r["seen_exposure"]), pct(r.get("all_exposure")), pct(r["trained"]["shield_exposure"]),
            gap_text(r["gap_vs_seen"]), gap_text(r["gap_vs_trained"])]


def table(s):
    """The held-out table as text (run.py prints it); --seen-size's, regime_table."""
    if "regime" in s:
        return regime_table(s)
    widths = (14, 8, 11, 11, 11, 9, 22, 22)
    head = ("held out", "base", "Shield -F", "Shield +F", "Shield all", "trained", "gap vs seen", "gap vs trained")
    line = lambda cs: "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cs, widths)))
    rows = [line(head)] + [line(cells(r)) for r in s["folds"]]
    return f"exposure@{s['k']} (%) on the test split\n" + "\n".join(rows) + FLAG_NOTE * any(
        r.get("strength") and not r["strength"]["raises"] for r in s["folds"])


def write_report(out, s):
    """holdout/report.md and holdout/figures/holdout.svg: the table, its reading, the figure (--seen-size:
    its table and reading, no figure)."""
    k, note = s["k"], figures.figure_note(s["notes"])
    lines = (["> **OFFLINE / SIMULATION RUN.** " + " ".join(s["notes"]) + "\n"] if s["notes"] else [])
    if "regime" in s:
        r = s["regime"]
        lines += [f"# Seen and unseen families: {os.path.basename(os.path.dirname(os.path.normpath(out)))}\n",
                  f"Benchmark {s['bench']}, {s['test_groups']} test groups. Each fold's Shield trains on "
                  f"{r['seen_size']} of the construction families {', '.join(s['construction_families'])} "
                  f"({r['subsets']} subsets, {r['seeds']} seed(s) each), every fold on as many construction "
                  "instances, its epoch picked on a monitoring split of its own families (the paper's regime at "
                  f"3). Exposure@{k}: the attack document in the reranker's top {k} (%), of the families the fold "
                  "trained on (seen) and of the others (unseen), beside the base reranker's. Unseen - seen: of the "
                  "Shield's change from the base on each side (seen and unseen are different families, which the "
                  "base exposes differently), per query group, then over groups (95% CI over groups per fold). "
                  "ASR with --llm-stage is compared raw (no base condition runs in a fold). Over the folds: the "
                  + ("mean gap with a 95% CI resampling subsets (a subset's seeds averaged) and groups, and its "
                     "spread over the subsets. " if r["subsets"] > 1 else "mean gap with a 95% CI resampling groups "
                     "(one subset: every construction family seen, only the groups vary). ") +
                  "The same family held out minus seen: each family that some fold sees and another holds out, its "
                  "change when held out minus its change when seen, per group, then over families and groups, with "
                  "a 95% CI resampling families and groups (a family is compared with itself, and the subsets' "
                  "shared families are counted once). The per-fold intervals are not corrected for being read "
                  "together; the two means over folds are the figures to read.\n", "```", regime_table(s), "```\n"]
        lines += failed_lines(s)
        atomic_write(os.path.join(out, "report.md"), "\n".join(lines))
        return
    b = s.get("builders") or {}
    lines += [f"Rewrites built by {b.get('construction')} (construction split) and {b.get('test')} (test split).\n"] \
        if b.get("test") and b.get("test") != b.get("construction") else []
    lines += [f"# Leave-one-family-out: {os.path.basename(os.path.dirname(os.path.normpath(out)))}\n",
              f"Benchmark {s['bench']}, {s['test_groups']} test groups; construction families "
              f"{', '.join(s['construction_families'])}. Exposure@{k}: the attack document in the reranker's top "
              f"{k} (%). Shield -F: trained without the held-out family F; Shield +F: the mean over the Shields "
              "trained without another held-out family G, each of which saw F on as much data as Shield -F "
              "(size-matched; none with one held-out family); Shield all: trained on every construction family, "
              "a plain reference (one family more, its epoch picked on a split that holds F). Gap vs seen: Shield "
              "-F minus Shield +F on F's instances, per query group (what not seeing F costs); gap vs trained: the "
              "drop (base minus Shield) on the fold's trained families minus the drop on F. Positive gaps: the "
              "held-out family gets through more. A gap is the mean over the query groups both sides hold of each "
              "group's difference (every group weighs alike), the exposures beside it are over instances: it need "
              "not be the difference of its row's columns. 95% CIs over query groups only (one training seed, one "
              "set of construction groups); several families read at once, no multiplicity correction.\n"]
    head = ["Held out (F)", "Base", "Shield -F", "Shield +F (matched)", "Shield all", "Trained families (Shield -F)",
            "Gap vs seen", "Gap vs trained"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in s["folds"]] + [""]
    if any(r.get("strength") and not r["strength"]["raises"] for r in s["folds"]):
        lines += [FLAG_NOTE.strip() + ".\n"]
    if any("detection" in r for r in s["folds"]):          # a build with honest edits in both splits
        lines += [f"Detection (detect.py's text detector, each fold's fitted without F; threshold at "
                  f"{100 * DETECT_FPR:g}% FPR on the construction honest edits): F's rewrites against the test "
                  "honest edits, AUC with its 95% CI over query groups, TPR at 5% FPR, % flagged at the threshold, "
                  "and the held-out FPR.\n", "| Held out (F) | AUC | TPR @5% FPR | Flagged | FPR on honest edits |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['family']} | {detect.fmt(d['auc_honest'], d['auc_honest_ci'])} | "
                  f"{detect.fmt(d['tpr_at_5_fpr_honest'])} | {d['flagged']} | {d['held_out_fpr_honest']} |"
                  for r in s["folds"] for d in [r.get("detection")] if d] + [""]
    if any("asr" in r for r in s["folds"]):          # --llm-stage
        conds = list(s["folds"][0]["asr"])
        head = ["Held out (F)"] + [f"{c} ASR: {w}" for c in conds for w in (
            "-F on F", "+F on F (matched)", "all on F", "-F on trained", "gap vs seen")]
        lines += ["ASR (%) end to end: each fold's Shield and TFSG library (`--llm-stage`).\n",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join([r["family"]] + [x for c in conds for x in (
            pct(r["asr"][c]["held_out"]), pct(r["asr"][c]["seen"]), pct(r["asr"][c].get("all")),
            pct(r["asr"][c]["trained"]), gap_text(r["asr"][c]["gap_vs_seen"]))]) + " |" for r in s["folds"]] + [""]
        lines += failed_lines(s)
    if s["never_trained"]:
        lines.append("Families no fold trains on (no construction instances), under the all-families Shield: "
                     + ", ".join(f"{m} {pct(v)}" for m, v in s["never_trained"].items()) + ".\n")
    series = ["base", "Shield -F (held out)", "Shield +F (matched)", "Shield all"]
    values = {(r["family"], name): v for r in s["folds"] for name, v in zip(series, (
        r["held_out"]["base_exposure"], r["held_out"]["shield_exposure"], r["seen_exposure"], r.get("all_exposure")))}
    atomic_write(os.path.join(out, "figures", "holdout.svg"), figures.svg_bars(
        f"Each family held out: exposure@{k}", [r["family"] for r in s["folds"]], series, values,
        xlabel="held-out family (F)", ylabel=f"exposure@{k} (%)", note=note))
    lines.append("![Each family held out](figures/holdout.svg)\n")
    atomic_write(os.path.join(out, "report.md"), "\n".join(lines))
