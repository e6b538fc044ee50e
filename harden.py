"""The defender moves third: hardening rounds (`python run.py harden`), attacker and defender in turns
on a trained run, each round measured against an attacker that produced none of its training data.

Threat model. The attacker of attack.py (it controls one document's text, keeps its facts through the
fidelity gate, queries the deployed Shield as a score oracle and, unless --unaware, reads the TFSG
library) adapts to the defense; the provider answers by training on what got through. As in the
prompt-injection and jailbreak literature that closes this loop (ATM, arXiv 2405.18111; ARLAS, arXiv
2510.05442; ANLI's rounds, arXiv 1910.14599; RvB, arXiv 2601.19726 for training-free memories): the
defense trains on the pool of every round's survivors, not the last round alone (the latest alone
cycles); attacker and defender share no weights (the attacker is an LLM that is never tuned); each
survivor comes with its group's benign list, so the defense does not learn to distrust every
well-written page; the groups the rounds are tested on are never attacked for training; and each
round is tested with a fresh attacker whose seed no training round used.

Round k = 1..R:
1. attack: the attacker (attack.Attack: MAGEO's loop, the fidelity gate, seed "train-k") rewrites the
   construction instances (construction groups only, from each instance's benchmark rewrite) against
   the round k-1 defense, up to --budget candidates each;
2. harvest: every gate-passing candidate in the round k-1 Shield's top-k is a survivor (and, when the
   target also cites it under GEO Defender with the round k-1 library, a TFSG survivor): a new
   construction instance (method adaptive-r{k}); the pool is every round's survivors, checked to hold
   no test group; harden/round-k/survivors.jsonl;
3. update: the Shield retrained on the construction set plus the pool (Eqs. 1-5 unchanged, s_0 from the
   frozen base; warm started from round k-1's adapter unless --restart); TFSG one more Algorithm 1
   update batch (tfsg.update_library) on survivor cases mixed with their groups' benign lists;
   harden/round-k/adapter and harden/round-k/library. A round without survivors keeps the defense;
4. measure (test split, --eval-groups): a fresh attacker (seed "test-k"; --test-algorithm, default the
   training side's --algorithm, which the report then labels in-distribution) at --eval-budgets against the
   round-k defense, and the benchmark's static families: exposure@k, ASR/ASI/BER under GEO Defender,
   Shield only and TFSG only, the clean top-k the Shield keeps, calls and USD. Round 0 is train's
   defense, measured the same way; the round-0 attacker, kept, is each later round's stale attacker.
Cross-play: every round's test documents rescored under every round's Shield (no new attacker call):
the (R+1) x (R+1) exposure matrix, defense rounds by attacker rounds, fresh on the diagonal.

Each stage writes its files whole when it ends, and every LLM reply is cached: a killed command reruns
to the same files without paying twice.

Usage: python run.py harden --name gpt55 --rounds 3 --budget 16 --eval-budgets 1,4,16 --eval-groups 20
"""
import dataclasses
import gc
import hashlib
import os
import shutil

import detect
import geodef
import metrics
import report
import tfsg
from attack import Attack, best_of, evaluate_documents, rounds_for, with_doc
from accounting import estimate, price_plan
from evaluation import clean_answers, clean_reference, eval_condition, guided
from rankers import load_rankers
from runs import labels_of, offline_notes, write_summary
from settings import SettingsError
from store import changed_settings, check_record, log, read_json, read_jsonl, write_json, write_jsonl
from train import analyzer_prompt_chars, clean_reference_benign, tfsg_target, train_shield

MEASURED = ("GEO Defender", "Shield only", "TFSG only")


# ----------------------------------------------------------------------------- a round's defense and files


def round_dir(run, k):
    return run.path("harden", f"round-{k}")


def defense_of(run, k):
    """Round k's defense: (adapter folder, library file). Round 0 is train's."""
    if k == 0:
        return run.path("adapter"), run.library_path()
    return (os.path.join(round_dir(run, k), "adapter"),
            os.path.join(round_dir(run, k), "library", f"E{run.cfg.tfsg.n_batches + 1 + k}.json"))


def load_defense(run, k):
    """Round k's (base ranker, Shield ranker, library) over one loaded model."""
    adapter, lib = defense_of(run, k)
    base, shield = load_rankers(run, True, adapter)
    return base, shield, tfsg.load_library(lib, run.limits)


def attacked(cfg, path, insts, target, lib, budget, attacker, judge, seed, algorithm="mageo", llm=None):
    """The adaptive attacker's candidates for `insts` against `target` (attack.Attack, its `algorithm`),
    read from `path` when a finished stage wrote them -> {instance_id: [candidate records]}. llm: the
    target LLM, the repair attacker's engine with the round's Shield and library (GEO Defender)."""
    if os.path.isfile(path):
        return read_attack(path)
    rounds = rounds_for(budget, cfg.attacker.candidates_per_round)
    cands = Attack(cfg, "shield", target, attacker, judge, rounds, cfg.attacker.candidates_per_round, budget,
                   None if cfg.harden.unaware else lib, seed=seed, algorithm=algorithm,
                   engine=(llm, guided(lib)) if llm is not None else None).run(insts)
    write_jsonl(path, [{"instance_id": x.instance_id, **c} for x in insts for c in cands[x.instance_id]])
    return cands


# ----------------------------------------------------------------------------- harvest


def survivor_instance(x, cand, k):
    """A survivor as a construction instance: the group's list with the candidate in the attacked slot. Its
    ids name the round, the family it was attacked from and the candidate: unique within the pool."""
    tag = f"adaptive-r{k}.{x.method}.{cand['n']}"
    ids = list(x.doc_ids)
    ids[x.attack_index] = f"{ids[x.attack_index].split('#')[0]}#{tag}"
    return dataclasses.replace(with_doc(x, cand["text"]), instance_id=f"{x.group_id}:{tag}", doc_ids=ids,
                               method=f"adaptive-r{k}", split="construction")


def harvest(run, k, insts, cands, defense, llm, construction_groups):
    """Round k's survivors: gate-passing candidates in the round k-1 Shield's top-k, each marked whether
    the target still cites it under GEO Defender (round k-1 library; no ASI judge) -> survivor records."""
    cfg, (_, shield, lib) = run.cfg, defense
    found = [(x, c) for x in insts for c in cands[x.instance_id][1:] if c["accepted"] and c["rank"] <= cfg.data.k]
    bad = sorted({x.group_id for x, _ in found} - construction_groups)
    if bad:                    # never: the attacker saw construction groups only
        raise SettingsError(f"harden round {k}: groups {bad[:3]} among the survivors are not construction "
                            "groups; the pool takes construction groups only")
    surv = [survivor_instance(x, c, k) for x, c in found]
    shield.prepare(surv)
    path = os.path.join(round_dir(run, k), "cited.jsonl")
    recs = eval_condition(cfg.llm, cfg.request.workers, llm, "GEO Defender (survivors)", surv,
                          lambda y: shield.order(y)[:cfg.data.k], guided(lib), path, judge=llm, judge_asi=False)
    cited = {r["instance_id"]: r["attack_cited"] for r in recs}
    return [{"instance_id": y.instance_id, "group_id": y.group_id, "split": y.split, "method": y.method,
             "source_method": x.method, "candidate": c["n"], "shield_rank": c["rank"],
             "tfsg_cited": cited[y.instance_id], "text": c["text"]} for (x, c), y in zip(found, surv)]


# a survivors line's fields as harvest writes them, each of exactly this JSON type
SURVIVOR_FIELDS = {"instance_id": str, "group_id": str, "split": str, "method": str, "source_method": str,
                   "candidate": int, "shield_rank": int, "tfsg_cited": bool, "text": str}
# an attacker's candidate line (attack.Attack.run's record, its instance named) as the rounds read it back; an
# accepted one was scored (ACCEPTED_FIELDS), a refused one may hold no text, score or rank
CANDIDATE_FIELDS = {"instance_id": str, "n": int, "accepted": bool, "text": (str, None), "score": (float, None),
                    "rank": (int, None)}
ACCEPTED_FIELDS = {"text": str, "score": float, "rank": int}


def check_survivor(path, n, r):
    """Line n of a survivors file, checked against SURVIVOR_FIELDS before anything is trained on it -> r."""
    return check_record(path, n, r, SURVIVOR_FIELDS, "a survivor")


def read_survivors(path):
    """A round's survivors file -> its records, every line checked (check_survivor)."""
    return [check_survivor(path, n, r) for n, r in read_jsonl(path)]


def pool_instances(run, k):
    """Every round's survivors up to k, as construction instances; a line that is not a construction
    instance's survivor (a test group's, a family or field the benchmark lacks) is refused, naming it."""
    by_id = {x.instance_id: x for x in geodef.expand(run.data.construction, run.data.seen)}
    pool = []
    for j in range(1, k + 1):
        path = os.path.join(round_dir(run, j), "survivors.jsonl")
        for n, r in read_jsonl(path):
            got = r if isinstance(r, dict) else {}
            x = by_id.get(f"{got.get('group_id')}:{got.get('source_method')}")
            if x is None or got.get("split") != "construction":
                raise SettingsError(f"{path}, line {n}: not the survivor of a construction instance (group "
                                    f"{got.get('group_id')!r}); the pool takes construction groups only")
            check_survivor(path, n, r)
            pool.append(survivor_instance(x, {"n": r["candidate"], "text": r["text"]}, j))
    ids = [y.instance_id for y in pool]
    if len(set(ids)) != len(ids):
        raise SettingsError(f"harden rounds 1..{k}: a survivor appears twice in the pool")
    return pool


# ----------------------------------------------------------------------------- the defender's update


def update_library(run, k, survivors, defense, target, analyzer, clean):
    """One more Algorithm 1 update batch on round k's survivors (cited ones first) mixed with their groups'
    benign lists, half and half within --batch-size -> the round-k library."""
    cfg, data, (base, shield, lib) = run.cfg, run.data, defense
    _, path = defense_of(run, k)
    if os.path.isfile(path):
        return tfsg.load_library(path, run.limits)
    by_id = {x.instance_id: x for x in geodef.expand(data.construction, data.seen)}
    ranked = sorted(survivors, key=lambda r: (not r["tfsg_cited"], hashlib.sha1(
        f"{cfg.folder.seed}:{k}:{r['instance_id']}".encode()).hexdigest()))[:max(1, cfg.tfsg.batch_size // 2)]
    attacks = [survivor_instance(by_id[f"{r['group_id']}:{r['source_method']}"],
                                 {"n": r["candidate"], "text": r["text"]}, k) for r in ranked]
    groups = {g.group_id: g for g in data.construction}
    controls = [geodef.clean_instance(groups[gid]) for gid in dict.fromkeys(x.group_id for x in attacks)]
    if not attacks:            # nothing got through: the library stays as it is
        write_json(path, lib.to_dict())
        return lib
    ranker = shield if cfg.tfsg.shield else base
    ranker.prepare(attacks + controls)

    def case(x):
        top = ranker.order(x)[:cfg.data.k]
        if x.attack_index is not None and x.attack_index not in top:      # the survivor in context
            top = top[:-1] + [x.attack_index]
        return {"case_id": f"case-{hashlib.sha1(x.instance_id.encode()).hexdigest()[:8]}", "query": x.query,
                "docs": [x.docs[i] for i in top], "labels": labels_of(x, top),
                "b_clean": clean[x.group_id]["benign_cited"] if x.group_id in clean else None}
    batch = [case(x) for x in attacks + controls]           # each survivor beside its group's benign list
    interface = "reasoning" if cfg.tfsg.reasoning_interface else "structured"
    return tfsg.update_library(tfsg_target(target, cfg.request.workers, f"harden r{k} TFSG"), analyzer.chat, lib,
                               batch, cfg.tfsg.n_batches + 1 + k, os.path.dirname(path), interface,
                               tfsg.Controller(limits=run.limits), cfg.llm.temperature, cfg.llm.max_tokens)


# ----------------------------------------------------------------------------- measuring a round


def test_instances(eval_groups, data):
    """The test side's instances: the static attacks of the first --eval-groups test groups (0: all), on the
    paper's lists (one attacked document: a file built with --attacked K reads its levels in eval)."""
    groups = data.test[:eval_groups] if eval_groups else data.test
    return groups, geodef.expand(groups, data.methods, paper=True)


def best_documents(insts, cands, budget, tag):
    """Each instance with the best of its first `budget` candidates in the attacked slot."""
    return [with_doc(x, cands[x.instance_id][best_of(cands[x.instance_id], budget)]["text"], tag) for x in insts]


def measure(run, k, clients, clean):
    """Round k's defense against a fresh attacker at every --eval-budgets, the static families and (k > 0)
    the stale round-0 attacker -> the round's figures, kept in harden/round-k/measure.json, with what the
    run's detectors flag (detected) at the thresholds `detect` set last."""
    out, defense = read_json(os.path.join(round_dir(run, k), "measure.json")), None
    if out is None:
        out, defense = measured(run, k, clients, clean)
    now = detect.thresholds(run)
    if (out.get("detected") or {}).get("thresholds") != now:       # detect made or remade since: flag again
        out.pop("detected", None)
        out.update({"detected": detected(run, k, now, defense or load_defense(run, k))} if now else {})
        write_json(os.path.join(round_dir(run, k), "measure.json"), out)
    return out


def detected(run, k, now, defense):
    """What the run's detectors (detect, at thresholds `now`) flag of round k's fresh attacker at each budget
    and of the test groups' honest edits, under round k's `defense` (load_defense)."""
    groups, insts = test_instances(run.cfg.harden.eval_groups, run.data)
    cands = read_attack(os.path.join(round_dir(run, k), "attack-test.jsonl"))
    base, shield, _ = defense
    honest = [geodef.honest_instance(g) for g in groups if g.honest is not None]
    return {"fresh": {str(b): detect.flagged(run, best_documents(insts, cands, b, f"@r{k}-B{b}"), base, shield)
                      for b in run.cfg.harden.eval_budgets},
            "fpr_honest": detect.flagged(run, honest, base, shield) if honest else None, "thresholds": now}


def measured(run, k, clients, clean):
    """measure's figures of round k but the detectors', written to measure.json -> (them, round k's defense)."""
    cfg, data, path = run.cfg, run.data, os.path.join(round_dir(run, k), "measure.json")
    llm, judge, _, tester, _ = clients
    groups, insts = test_instances(cfg.harden.eval_groups, data)
    base, shield, lib = load_defense(run, k)
    budgets = cfg.harden.eval_budgets
    cands = attacked(cfg, os.path.join(round_dir(run, k), "attack-test.jsonl"), insts, shield, lib, max(budgets),
                     tester, judge, seed=f"test-{cfg.folder.seed}-{k}", llm=llm,
                     algorithm=cfg.harden.test_algorithm or cfg.attacker.algorithm)
    res = os.path.join(round_dir(run, k), "results")
    setup = (base, shield, lib, data.construction)
    docs = {b: best_documents(insts, cands, b, f"@r{k}-B{b}") for b in budgets}     # the fresh attacker's, per budget
    fresh = {str(b): evaluate_documents(run, llm, judge, docs[b], setup, clean, os.path.join(res, f"B{b}"), MEASURED)
             for b in budgets}
    out = {"round": k, "fresh": fresh,
           "static": evaluate_documents(run, llm, judge, insts, setup, clean, os.path.join(res, "static"), MEASURED),
           "clean_topk_kept": clean_kept(cfg.data.k, groups, base, shield)}
    if k:
        stale = read_attack(os.path.join(round_dir(run, 0), "attack-test.jsonl"))
        out["stale"] = evaluate_documents(run, llm, judge, best_documents(insts, stale, max(budgets), f"@r{k}-stale"),
                                          setup, clean, os.path.join(res, "stale"), MEASURED)
    out["gate"] = {"accepted": sum(c["accepted"] for cs in cands.values() for c in cs[1:]),
                   "candidates": sum(len(cs) - 1 for cs in cands.values())}
    write_json(path, out)
    return out, (base, shield, lib)


def against_round_zero(run, rounds, top):
    """Each later round's fresh attacker (budget `top`, under GEO Defender) against round 0's, paired per query
    group (every round measures the same test groups): the change of exposure and of ASR with its 95%
    cluster-bootstrap CI, one interval a round (never pooled over rounds), in each round's "vs_round_0"."""
    cfg, methods = run.cfg, run.data.methods
    path = lambda k: os.path.join(round_dir(run, k), "results", f"B{top}", "geo_defender.jsonl")
    recs = lambda k: [r for _, r in read_jsonl(path(k))]
    for r in rounds[1:]:
        if not (os.path.isfile(path(0)) and os.path.isfile(path(r["round"]))):    # records moved aside: no gap
            r["vs_round_0"] = None
            continue
        first, now = recs(0), recs(r["round"])
        r["vs_round_0"] = {name: metrics.paired_gap(cfg.rerank.n_boot, cfg.folder.seed,
                                                    metrics.by_group(now, methods, key=key),
                                                    metrics.by_group(first, methods, key=key))
                           for name, key in (("exposure", "attack_in_context"), ("ASR", "attack_cited"))}


def read_attack(path):
    """An attack stage's candidates file -> {instance_id: [candidate records]}, every line checked."""
    out = {}
    for n, r in read_jsonl(path):
        check_record(path, n, r, CANDIDATE_FIELDS, "a candidate")
        if r["accepted"]:
            check_record(path, n, r, ACCEPTED_FIELDS)
        out.setdefault(r["instance_id"], []).append(r)
    return out


def clean_kept(k, groups, base, shield):
    """% of the base top-k of each test group's clean list that the Shield keeps in its top-k (utility)."""
    cleans = [geodef.clean_instance(g) for g in groups]
    base.prepare(cleans)
    shield.prepare(cleans)
    kept = [len(set(base.order(x)[:k]) & set(shield.order(x)[:k])) / k for x in cleans]
    return 100.0 * sum(kept) / max(1, len(kept))


def crossplay(run, R):
    """Exposure@k of every round's test documents (the fresh attacker's best at the largest budget)
    under every round's Shield: rescoring only, no attacker call -> rows defense rounds, columns
    attacker rounds."""
    cfg = run.cfg
    _, insts = test_instances(cfg.harden.eval_groups, run.data)
    top = max(cfg.harden.eval_budgets)
    docs = [best_documents(insts, read_attack(os.path.join(round_dir(run, a), "attack-test.jsonl")), top,
                           f"@cross-a{a}") for a in range(R + 1)]
    matrix = []
    for d in range(R + 1):
        _, shield = load_rankers(run, True, defense_of(run, d)[0])
        row = []
        for ds in docs:
            shield.prepare(ds)
            row.append(100.0 * sum(x.attack_index in shield.order(x)[:cfg.data.k] for x in ds) / max(1, len(ds)))
        matrix.append(row)
    return matrix


# ----------------------------------------------------------------------------- the command


def check_settings(run):
    """The settings the rounds' files depend on, pinned in harden/settings.json when the first round
    starts: a rerun that changes one is refused once harden/ holds anything they produced (--rounds may grow:
    finished rounds are kept); a start that failed before producing anything (a refused key, say) pins nothing.
    -> (its path, the settings, the usage ledger's size when these rounds started: their cost is the ledger's lines
    after it, not a harden/ moved aside's)."""
    cfg, a = run.cfg, run.cfg.attacker
    keys = ("budget", "eval_budgets", "eval_groups", "candidates_per_round", "attacker", "test_attacker",
            "unaware", "restart", "judge", "max_tokens")
    now = {k: cfg.flat()[k] for k in keys} | {"eval_budgets": str(cfg.harden.eval_budgets)}    # as its flag's text
    if a.algorithm != "mageo" or (cfg.harden.test_algorithm or a.algorithm) != "mageo":   # not MAGEO's on both sides
        now.update(algorithm=a.algorithm, test_algorithm=cfg.harden.test_algorithm or a.algorithm, start=a.start,
                   edit_budget=a.edit_budget)         # the repair attacker's first document and budget
    if any(g.co_attacks for g in run.data.test):      # several attacked a list: rounds measure the paper's lists
        now["lists"] = "one attacked document"
    path, ledger = (os.path.join(cfg.folder.run_dir, f) for f in ("harden/settings.json", "usage.jsonl"))
    old = read_json(path)
    produced = [f for f in os.listdir(os.path.dirname(path)) if f != "settings.json"] if old is not None else []
    start = old.pop("ledger_from", 0) if produced else ledger_end(ledger)
    if produced and old != now:            # a record without the algorithms was made with MAGEO's on both sides
        mageo = {"algorithm": "mageo", "test_algorithm": "mageo"}
        was, asked = {**mageo, **old}, {**mageo, **now}
        if "repair" not in (was["algorithm"], was["test_algorithm"]):   # no repair side: its start and budget
            was = {**{k: asked[k] for k in ("start", "edit_budget") if k in asked}, **was}   # never applied
        raise changed_settings(path, "the rounds were made", was,
                               {k: asked[k] for k in sorted(asked) if was.get(k) != asked[k]},
                               "Use another --name, or move harden/ aside")
    return path, now, start


def ledger_end(path):
    """The byte after the usage ledger's last whole line: where the next reply's line starts (a line cut by a
    kill is cut off before the next is appended)."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        return f.read().rfind(b"\n") + 1


def round_clients(run, k):
    """Round k's LLM clients, each reply entered in the usage ledger under stage harden-r{k}: (target,
    judge, training attacker, test attacker, Analyzer)."""
    cfg, stage = run.cfg, f"harden-r{k}"
    llm = run.llm(stage=stage)
    judge = run.llm(cfg.judge.judge, stage=stage) if cfg.judge.judge else llm
    attacker = run.llm(cfg.attacker.attacker, stage=stage) if cfg.attacker.attacker else llm
    tester = run.llm(cfg.harden.test_attacker, stage=stage) if cfg.harden.test_attacker else attacker
    analyzer = run.llm(cfg.tfsg.analyzer, stage=stage) if cfg.tfsg.analyzer else llm
    return llm, judge, attacker, tester, analyzer


def clean_references(run, llm):
    """The clean reference (B.1.3) of the construction groups (b_clean of TFSG's cases) and of the test
    side's groups: base top-k, the A.3.7 answer -> ({group_id: record}, {group_id: record})."""
    cfg, data = run.cfg, run.data
    base = load_rankers(run, False)[0]
    cons = clean_reference_benign(run, llm, base, data.construction)
    groups, _ = test_instances(cfg.harden.eval_groups, data)
    insts = [geodef.clean_instance(g) for g in groups]
    base.prepare(insts)
    ref = clean_reference(cfg.data.k, base)
    recs = eval_condition(cfg.llm, cfg.request.workers, llm, "clean reference", insts, ref.topk, ref.pipeline,
                          run.path("harden", "clean_reference.jsonl"), judge=llm)
    return cons, clean_answers(recs)


def retraining(run, k):
    """Round k's retraining as every rank runs it (module docstring, step 3): once round k's survivors
    are written (under torchrun rank 0 writes them; the ranks meet at a barrier first), the Shield
    retrained on the construction set plus the pool, when there are survivors -> the survivors."""
    run.ranks.barrier()
    survivors = read_survivors(os.path.join(round_dir(run, k), "survivors.jsonl"))
    if survivors:
        train_shield(run, out=round_dir(run, k), extra=pool_instances(run, k),
                     init=None if run.cfg.harden.restart else defense_of(run, k - 1)[0])
    return survivors


def train_share(run):
    """A torchrun rank's part of harden (ranks other than 0): each round's retraining, in step with rank 0,
    which makes every LLM call and writes every file. Between two retrainings the ranks wait at a barrier
    while rank 0 measures the round and attacks the next (parallel.WAIT bounds it: 7 days)."""
    for k in range(1, run.cfg.harden.rounds + 1):
        retraining(run, k)


def attack_round(run, k, clients, clean_cons):
    """Round k's training side: attack, harvest, the defender's update (module docstring, steps 1-3)."""
    cfg, data = run.cfg, run.data
    llm, judge, attacker, _, analyzer = clients
    folder = round_dir(run, k)
    prev = load_defense(run, k - 1)
    cons = geodef.expand(data.construction, data.seen)
    cands = attacked(cfg, os.path.join(folder, "attack-train.jsonl"), cons, prev[1], prev[2], cfg.harden.budget,
                     attacker, judge, seed=f"train-{cfg.folder.seed}-{k}", algorithm=cfg.attacker.algorithm, llm=llm)
    path = os.path.join(folder, "survivors.jsonl")
    if not os.path.isfile(path):
        write_jsonl(path, harvest(run, k, cons, cands, prev, llm, {g.group_id for g in data.construction}))
    pool = pool_instances(run, k)
    log(f"[harden] round {k}: {len(read_survivors(path))} survivors, a pool of {len(pool)}")
    update_library(run, k, read_survivors(path), prev, llm, analyzer, clean_cons)   # from round k-1's defense,
    prev = None                                         # whose model goes before the retraining loads one (the
    gc.collect()                                        # speed paths' bound methods make it a reference cycle)
    adapter = defense_of(run, k)[0]
    survivors = retraining(run, k)
    if not survivors and not os.path.isdir(adapter):    # nothing got through: the Shield stays as it is
        tmp = f"{adapter}.tmp{os.getpid()}"
        shutil.copytree(defense_of(run, k - 1)[0], tmp)
        os.replace(tmp, adapter)
    return {"survivors": len(survivors), "tfsg_survivors": sum(r["tfsg_cited"] for r in survivors),
            "pool": len(pool), "candidates": sum(len(cs) - 1 for cs in cands.values())}


def harden(run):
    """Hardening rounds 1..R on a trained run (module docstring) -> summary.json's harden block."""
    cfg = run.cfg
    settings_path, pinned, start = check_settings(run)
    made = [k for k in range(1, cfg.harden.rounds + 1)
            if os.path.isfile(os.path.join(round_dir(run, k), "survivors.jsonl"))]
    pool_instances(run, len(made))        # the finished rounds' survivors files, checked before any call
    write_json(settings_path, {**pinned, "ledger_from": start})
    clean_cons, clean_test = clean_references(run, run.llm(stage="harden-r0"))
    rounds = [measure(run, 0, round_clients(run, 0), clean_test)]
    for k in range(1, cfg.harden.rounds + 1):
        clients = round_clients(run, k)
        trained = attack_round(run, k, clients, clean_cons)
        rounds.append({**measure(run, k, clients, clean_test), **trained})
    usage = run.usage(since=start)["stages"]
    for r in rounds:                   # a round's replies and their price (None without --prices), these rounds' own
        rows = list(usage.get(f"harden-r{r['round']}", {}).values())
        costs = [v["cost_usd"] for v in rows]
        r["cost"] = {"replies": sum(v["replies"] for v in rows),
                     "usd": None if None in costs else round(sum(costs), 6)}
    groups, insts = test_instances(cfg.harden.eval_groups, run.data)
    against_round_zero(run, rounds, max(cfg.harden.eval_budgets))
    block = {"settings": pinned, "rounds": rounds, "k": cfg.data.k, "notes": offline_notes(run),
             "test_groups": len(groups), "test_instances": len(insts),       # what every round measures
             "chance_in_topk": 100.0 * metrics.chance_any_in_topk(len(insts[0].docs), 1, cfg.data.k),
             "crossplay": {"rows": "defense round", "columns": "attacker round (its best at the largest budget)",
                           "exposure": crossplay(run, cfg.harden.rounds)}}
    summary = write_summary(run, "harden", {"harden": block})
    report.write_harden_report(cfg.folder.run_dir, summary)
    log(f"[harden] wrote {cfg.folder.run_dir}/harden_report.md and summary.json's harden block")
    return block


def check(run):
    """harden's own settings, checked before anything runs (a dry run's too): the test groups asked for,
    and the settings of the rounds already made (check_settings)."""
    if run.cfg.harden.eval_groups > len(run.data.test):
        raise SettingsError(f"--eval-groups {run.cfg.harden.eval_groups}: the benchmark has {len(run.data.test)} test "
                            "groups")
    check_settings(run)
    detect.thresholds(run)                  # the run's detector files, checked before the first paid call


def dry_run(run):
    """What `harden` would send, without sending anything: upper bounds per round (JSON re-asks
    included), prompt tokens at 4 characters a token, the price with --prices, full and batch."""
    cfg, data, hd = run.cfg, run.data, run.cfg.harden
    cons = geodef.expand(data.construction, data.seen)
    _, test = test_instances(cfg.harden.eval_groups, data)
    budgets = hd.eval_budgets
    doc = sum(len(x.docs[x.attack_index]) for x in cons + test) / max(1, len(cons + test))
    ctx = sum(sum(map(len, x.docs[:cfg.data.k])) for x in test) / max(1, len(test))
    rounds = lambda b: rounds_for(b, cfg.attacker.candidates_per_round)
    evaluated = len(test) * (len(budgets) + 2) * len(MEASURED)           # budgets, static, stale
    written = cfg.attacker.candidates_per_round * doc / 4
    # the judge sees at most every candidate the rounds write: one it fails on spends no budget (attack.spent)
    per_round = {"training attacker": estimate(2 * len(cons) * rounds(hd.budget), 3 * doc + 1200, written),
                 "test attacker": estimate(2 * len(test) * rounds(max(budgets)), 3 * doc + 1200, written),
                 "fidelity judge": estimate(2 * cfg.attacker.candidates_per_round * (
                     len(cons) * rounds(hd.budget) + len(test) * rounds(max(budgets))), 2 * doc + 600, 60),
                 "target answers": estimate(len(cons) * (hd.budget - 1) + cfg.tfsg.batch_size + evaluated,
                                            ctx + 2500, 400),
                 "ASI judge": estimate(2 * evaluated, doc + 2400, 80),
                 "Analyzer": estimate(1, analyzer_prompt_chars(run), 1500)}
    engine = (len(cons) * hd.budget if cfg.attacker.algorithm == "repair" else 0) + \
        (len(test) * max(budgets) if (hd.test_algorithm or cfg.attacker.algorithm) == "repair" else 0)
    if engine:              # the repair attacker's signal: the engine answers every candidate it scores
        per_round["repair engine answers"] = estimate(engine, ctx + 2500, 400)
    models = {"training attacker": cfg.attacker.attacker, "test attacker": hd.test_attacker or cfg.attacker.attacker,
              "fidelity judge": cfg.judge.judge, "ASI judge": cfg.judge.judge, "Analyzer": cfg.tfsg.analyzer}
    model = lambda s: models.get(s) or cfg.llm.llm          # each stage priced at its own client's model
    batched = price_plan(run.prices, {s: v for s, v in per_round.items() if s != "Analyzer"}, model, batch=True)
    alone = price_plan(run.prices, {"Analyzer": per_round["Analyzer"]}, model)
    return {"rounds": hd.rounds, "construction_instances": len(cons), "test_instances": len(test),
            "per_round": per_round, "usd_per_round": price_plan(run.prices, per_round, model),
            "usd_per_round_batch_api": None if batched is None or alone is None else batched + alone,
            "note": "upper bounds per round (round 0 measures only: no attacker on construction groups, no "
                    "update); under --batch-api each attacker round, its judges and the answers are batches, only the "
                    "Analyzer's call is synchronous"}


def round_table(block, budgets):
    """Exposure@k (Shield) and ASR (GEO Defender) by round, fresh attacker at each budget and stale, as text."""
    cols = [f"B={b}" for b in budgets] + ["static", "stale"]
    lines = [f"{'round':<7}" + "".join(f"{c + ' exp/ASR':>20}" for c in cols) + f"{'clean kept':>12}"]
    for r in block["rounds"]:
        cells = [r["fresh"][str(b)] for b in budgets] + [r["static"], r.get("stale")]
        lines.append(f"{r['round']:<7}" + "".join(
            f"{c['Shield only']['exposure']:>11.2f} /{c['GEO Defender']['ASR']:>6.2f}" if c else f"{'-':>20}"
            for c in cells) + f"{r['clean_topk_kept']:>12.1f}")
    return "\n".join(lines)
