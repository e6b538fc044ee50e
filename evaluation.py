"""Evaluation (paper Experiments, B.2): the six conditions of Tables 1-2 on the test split, the clean
reference (B.1.3), the PPL-Filter baseline (B.2.2), the ASI and pairwise-quality judges (B.2.3,
B.2.4), the per-method, per-epoch and transfer breakdowns, and summary.json / report.md. Beside
them, the injection defenses a provider would try first (defenses.py: Spotlighting, Sandwich
Prompt, PromptArmor, RobustRAG) on the base top-k, with each condition's cost per query. On a
benchmark with honest edits (build-bench --honest), each condition's honest penalty (honest_audit):
does it stop citing a source once the source is honestly edited, as it stops citing its attacks?

Records are appended one per instance (results/*.jsonl), so an interrupted eval resumes; the
settings they were made with are pinned in results/settings.json.
Usage: summary, records = evaluate(runs.Run(cfg))
"""
import hashlib
import json
import math
import os
import re
import sys
from typing import Callable, NamedTuple

import numpy as np
from tqdm import tqdm

import accounting
import endpoints
import geodef
import gpt2
import defenses
import llm_clients
import metrics
import report
import rankers
import tfsg
import tiny
from accounting import estimate, price_plan
from rankers import documents_cut, load_rankers, sharded
from runs import NotTrainedError, offline_notes, shared_roles, test_set_digest, train_command, write_summary
from settings import SettingsError
from store import (changed_settings, check_record, file_sha1, log, naming, read_json, read_jsonl, write_json,
                   write_jsonl)


# ----------------------------------------------------------------------------- evaluation

PAPER_CONDITIONS = ["Non-Defense", "PPL-Filter", "Static Safety Prompt", "GEO Defender", "Shield only", "TFSG only"]
INJECTION_DEFENSES = list(defenses.PIPELINES)   # Spotlighting, Sandwich Prompt, PromptArmor, RobustRAG: base top-k
CONDITIONS = PAPER_CONDITIONS + INJECTION_DEFENSES   # --conditions all; 'paper': the first six
WITH_LIBRARY = ("GEO Defender", "TFSG only")    # conditions that prompt with the TFSG library
WITH_SHIELD = ("GEO Defender", "Shield only")   # conditions that rank with the Shield adapter
RERANKER_CONDITIONS = ("Non-Defense", "TFSG only")   # repeated with each eval --reranker's top-k


def ppl_filter(run, base, cons, test_insts):
    """B.2.2: GPT-2 perplexity; threshold = ppl_quantile of the construction groups' benign documents;
    flagged candidates moved after unflagged ones, base order kept within each part. A text of under two
    GPT-2 tokens has no perplexity: it is left out of the threshold's documents and never flagged."""
    # one cache file per scoring model: a perplexity is a property of the text AND the model
    cfg = run.cfg
    slug = re.sub(r'[^A-Za-z0-9._-]+', '_', cfg.eval.ppl_model)      # (+ a digest: "a b" and "a_b" are two)
    path = run.path("cache", f"ppl_{slug}_{hashlib.sha1(cfg.eval.ppl_model.encode()).hexdigest()[:8]}.json")
    cache = read_json(path, {})
    texts = {hashlib.sha1(d["text"].encode()).hexdigest(): d["text"] for g in cons for d in g.docs}
    for x in test_insts:
        for d in x.docs:
            texts.setdefault(hashlib.sha1(d.encode()).hexdigest(), d)
    todo = [k for k in texts if k not in cache]
    if todo:
        folder = cfg.eval.ppl_model
        if folder == "tiny":
            folder = tiny.make_tiny_gpt2(os.path.join(cfg.folder.runs_dir, "_tiny_gpt2"))
        lm = gpt2.GPT2.from_pretrained(folder)
        for k in tqdm(todo, desc="ppl", file=sys.stderr):
            cache[k] = lm.perplexity(texts[k])
        write_json(path, cache)
    ppl = lambda t: cache[hashlib.sha1(t.encode()).hexdigest()]
    calib = [v for v in (ppl(d["text"]) for g in cons for d in g.docs) if math.isfinite(v)]   # (< 2 tokens: none)
    if not calib:
        raise ValueError("PPL-Filter: no construction benign document has a perplexity (each under 2 GPT-2 tokens)")
    tau = float(np.quantile(calib, cfg.eval.ppl_quantile))
    orders, diag = {}, {"threshold": tau, "calibration_docs": len(calib), "test_instances": 0,
                        "attack_in_base_topk": 0, "attack_flagged": 0, "attack_in_ppl_topk": 0,
                        "attack_removed": 0, "attack_introduced": 0, "benign_flagged": 0, "benign_total": 0}
    for x in test_insts:
        bo = base.order(x)
        flagged = [ppl(x.docs[i]) > tau for i in range(len(x.docs))]
        o = [i for i in bo if not flagged[i]] + [i for i in bo if flagged[i]]
        orders[x.instance_id] = o
        if x.attack_index is not None and not x.co_attacks:     # the diagnostics: the paper's lists (K = 1)
            inb, inp = x.attack_index in bo[:cfg.data.k], x.attack_index in o[:cfg.data.k]
            diag["test_instances"] += 1
            diag["attack_in_base_topk"] += inb
            diag["attack_flagged"] += flagged[x.attack_index]
            diag["attack_in_ppl_topk"] += inp
            diag["attack_removed"] += inb and not inp
            diag["attack_introduced"] += inp and not inb
            diag["benign_flagged"] += sum(f for i, f in enumerate(flagged) if i not in x.attacked)
            diag["benign_total"] += len(flagged) - len(x.attacked)
    return orders, diag


def _messages(prompt):
    """A condition's prompt as chat messages: a string is one user message (the paper's conditions,
    whose requests and records stay as earlier versions made them); a list is sent as it is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _record(x, top, name, ans, reasoning):
    """One instance's record: the answer, its citations mapped to document ids, attack and benign cited
    (an attack: any attacked document of the list). A list with several attacked documents (--attacked K)
    adds how many there are, how many reached the context and were cited, and their share of the
    citations."""
    ids = [x.doc_ids[i] for i in top]
    cited_ids, halluc = metrics.map_citations(ans, ids)
    att = {x.doc_ids[i] for i in x.attacked}
    rec = {"instance_id": x.instance_id, "group_id": x.group_id, "method": x.method,
           "condition": name, "top_ids": ids, "attack_in_context": bool(att & set(ids)),
           "answer": ans, "reasoning": reasoning, "cited_ids": cited_ids, "hallucinated": halluc,
           "attack_cited": bool(att & set(cited_ids)), "benign_cited": sum(1 for c in cited_ids if c not in att)}
    if x.co_attacks:
        n_cited = sum(1 for c in cited_ids if c in att)
        rec.update(attacked=len(att), attacks_in_context=len(att & set(ids)), attacks_cited=n_cited,
                   attack_citation_share=n_cited / len(cited_ids) if cited_ids else None)   # no citations: no share
    return rec


def reply_usage(replies, sequential):
    """What answering one query took: LLM calls (a re-asked reply's attempts each), calls in a row (the
    latency), tokens (a cached reply carries the usage it was received with, its re-asks' included: the cost
    of the query, not of this invocation); with the count of replies that came without token counts
    ("unmetered"), whose tokens are unknown, not 0."""
    unmetered = sum(bool(r.usage.get("unmetered")) for r in replies)
    cached = sum(int(r.usage.get("cached_tokens", 0)) for r in replies)      # of the prompt tokens
    return {"llm_calls": sum(int(r.usage.get("attempts", 1)) for r in replies), "sequential_calls": sequential,
            **{k: sum(int(r.usage.get(k, 0) or 0) for r in replies) for k in ("prompt_tokens", "completion_tokens")},
            **({"cached_tokens": cached} if cached else {}), **({"unmetered": unmetered} if unmetered else {})}


def pipeline_records(decoding, workers, llm, name, part, tops, p, sample=0):
    """A defenses.Pipeline's records for a chunk of instances: every pre-step request of the chunk
    in one llm.map (one batch with --batch-api), then the answer requests in another, `workers` at a
    time, decoded as the target's LLMSettings `decoding` say. Each record adds what the defense kept and
    its usage. sample > 0: the whole pipeline's repeat of that index."""
    def ask(prompt):
        return {"messages": _messages(prompt), "temperature": decoding.temperature, "max_tokens": decoding.max_tokens,
                "json": True, **({"sample": sample} if sample else {})}
    docs = [[x.docs[i] for i in t] for x, t in zip(part, tops)]
    pre = [p.pre(x.query, d) for x, d in zip(part, docs)]
    flat = iter(llm.map([ask(m) for ms in pre for m in ms], workers=workers, desc=f"{name} {p.pre_step}",
                        invalid="return") if any(pre) else ())
    pre_replies = [[next(flat) for _ in ms] for ms in pre]
    # a pre-step reply that never parsed (a guard quoting past the token cap, a refusal) is no data: the
    # defense reads None (nothing quoted, an abstention), recorded; raised, one document stopped the condition
    bad = lambda r: isinstance(r, llm_clients.ReplyInvalid)
    finals = [p.final(x.query, d, [None if bad(r) else r.data for r in rs])
              for x, d, rs in zip(part, docs, pre_replies)]
    sent = [{**ask(m), "check": tfsg.answer_check} for m, _ in finals if m is not None]
    desc = name + (f" (sample {sample})" if sample else "")
    replies = iter(llm.map(sent, workers=workers, desc=desc, invalid="return") if sent else ())
    recs = []
    for x, t, rs, (m, kept) in zip(part, tops, pre_replies, finals):
        r = next(replies) if m is not None else None     # None: answered without a call (RobustRAG abstains)
        # every attempt unusable: no answer, recorded (it cites nothing) and counted
        failed = r if isinstance(r, llm_clients.ReplyInvalid) else None
        r = None if failed else r
        ans = r.data["answer"] if r is not None else "" if failed else kept.pop("answer")
        rec = _record(x, t, name, p.finish(ans, kept), r.reasoning if r is not None else None)
        if failed:
            rec["answer_failed"] = {"attempts": failed.attempts, "error": str(failed)[:300]}
            log(f"[eval] {name}: {x.instance_id}: no usable answer after {failed.attempts} attempts; recorded as "
                "answer-failed")
        done = [q for q in rs if not bad(q)] + ([r] if r is not None else [])
        usage = {"usage": reply_usage(done, sequential=bool(rs) + (m is not None))} if p.usage else {}
        pre_failed = [i for i, q in enumerate(rs) if bad(q)]
        lost = [rs[i] for i in pre_failed] + ([failed] if failed else [])
        if usage and lost:                # billed attempts whose tokens no reply carries: counted, cost unknown
            u = usage["usage"]
            u["llm_calls"] += sum(f.attempts for f in lost)
            u["unmetered"] = u.get("unmetered", 0) + len(lost)
        recs.append({**rec, **kept, **usage, **({"pre_failed": pre_failed} if pre_failed else {})})
    return recs


# A record's fields as _record and the ASI judge write them, read back when an interrupted run resumes: checked
# then, so that a line edited by hand is named, not counted wrong or failed on after the paid calls
RECORD_FIELDS = {"instance_id": str, "group_id": str, "method": (str, None), "condition": str, "top_ids": list,
                 "attack_in_context": bool, "answer": str, "cited_ids": list, "hallucinated": list,
                 "attack_cited": bool, "benign_cited": int}
ASI_FIELDS = {"asi": (int, None)}


def eval_condition(decoding, workers, llm, name, insts, topk_of, pipeline, path, judge, before_write=None,
                   judge_asi=True, sample=0):
    """Generate, parse citations and judge ASI for one condition; one JSONL record per instance,
    appended as it finishes, so an interrupted run resumes with the instances it lacks.
    pipeline: how the condition answers (a defenses.Pipeline: pre-steps, then the answer;
    defenses.one_prompt for a single prompt; pipeline_records). before_write: called with the records before they are
    appended (evaluate records its settings then). judge_asi False: no ASI judge and no ASI fields
    (the honest audit's lists hold no attack). sample > 0: the sample-th repeat of every answer (its
    own cached replies, its records marked with it; eval --samples). judge: the ASI judge's client (the
    target's when the run names no judge). decoding: the target's LLMSettings (the judge's max tokens too);
    workers: requests in flight."""
    done = {}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isfile(path):
        with open(path, "r+b") as f:        # a line cut by a kill: dropped (its instance is redone), so
            data = f.read()                 # that the next record does not start on its end
            f.truncate(data.rfind(b"\n") + 1)
        kept = read_jsonl(path, skip_bad=True)
        other = next((r for _, r in kept if isinstance(r, dict)
                      and (r.get("condition"), r.get("sample", 0)) != (name, sample)), None)
        if other is not None:          # another condition's records, never taken for this one's
            raise SettingsError(f"{path}: holds records of {other.get('condition')!r} (sample "
                                f"{other.get('sample', 0)}), not of {name!r} (sample {sample}); move the file aside")
        fields = RECORD_FIELDS | (ASI_FIELDS if judge_asi else {})
        done = {check_record(path, n, r, fields)["instance_id"]: r for n, r in kept}
    todo = [x for x in insts if x.instance_id not in done]
    chunk = max(workers * 4, 16)
    for s in range(0, len(todo), chunk):
        part = todo[s:s + chunk]
        tops = [topk_of(x) for x in part]
        recs = pipeline_records(decoding, workers, llm, name, part, tops, pipeline, sample)
        for rec in recs if sample else ():
            rec["sample"] = sample
        jreq = [] if not judge_asi else [(i, {"messages": [{"role": "user",
                                   "content": metrics.asi_prompt(x.query, judged_attack(x, rec), rec["answer"])}],
                     "temperature": 0, "max_tokens": decoding.max_tokens, "json": True, "check": metrics.parse_asi})
                for i, (x, rec) in enumerate(zip(part, recs))
                if rec["attack_in_context"] and "answer_failed" not in rec]     # (no answer: no influence)
        jrep = judge.map([q for _, q in jreq], workers=workers, desc=f"{name} ASI judge",
                         invalid="return") if jreq else []
        for rec in recs if judge_asi else ():
            rec["asi"], rec["asi_judge"] = 0, None    # attack not in context: 0 without a judge call (B.2.3)
        for (i, _), rep in zip(jreq, jrep):
            if isinstance(rep, llm_clients.ReplyInvalid):   # every attempt unusable: recorded, not scored
                recs[i]["asi"], recs[i]["asi_judge_failed"] = None, {"attempts": rep.attempts, "error": str(rep)}
                log(f"[eval] {name}: {part[i].instance_id}: ASI judge failed after {rep.attempts} attempts; "
                    "recorded as judge-failed")
                continue
            recs[i]["asi"] = metrics.parse_asi(rep.data)
            recs[i]["asi_judge"] = rep.data
        if before_write:
            before_write(recs)
        with naming(path), open(path, "a", encoding="utf-8") as f:
            for rec in recs:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                done[rec["instance_id"]] = rec
    return [done[x.instance_id] for x in insts]


def deployed_conditions(k, plan, deployed, local, others):
    """eval --reranker: the Non-Defense and TFSG only pipelines on each deployed reranker's top-k ->
    {"Non-Defense [LABEL]": Condition, ...}. local: the base and shield Rankers by kind; others: the
    endpoints' by label."""
    out = {}
    for label, spec in deployed:
        rk = local.get(spec.kind) or others[label]
        topk_of = lambda x, rk=rk: rk.order(x)[:k]
        out.update({f"{c} [{label}]": Condition(topk_of, plan[c].pipeline) for c in ("Non-Defense", "TFSG only")})
    return out


def answer_conditions(samples, conds, insts, plan, condition):
    """Every condition's records (`condition`: evaluate's, into results/) -> ({condition: records},
    {condition: [the records of sample i] for i in 1..N-1}): eval --samples N repeats each in
    results/<slug>.s<i>.jsonl; every figure but the tables' reads sample 0."""
    results = {c: condition(c, insts, plan[c], condition_slug(c)) for c in conds}
    repeats = {c: [condition(c, insts, plan[c], f"{condition_slug(c)}.s{i}", sample=i)
                   for i in range(1, samples)] for c in conds}
    return results, repeats


def bench_labels(run):
    """What the summary says of the benchmark beyond the figures: the roles the target or judge shares
    with its construction (--allow-shared-roles), the groups each family was refused on, and with the test
    split built by another LLM (build-bench --test-llm) the builder of each split."""
    cfg, raw = run.cfg, run.data.meta.raw
    out = {"shared_roles": shared_roles(cfg.data.bench, cfg.llm.llm, cfg.judge.judge),
           "family_drops": raw.get("family_drops"),
           "builders": {"construction": raw.get("builder_llm"), "test": raw["test_builder_llm"]}
           if raw.get("test_builder_llm") else None}
    return {k: v for k, v in out.items() if v}


def attacked_summary(insts, conds, every, k, n_boot, seed):
    """On a benchmark with several attacked documents a list (--attacked K): every condition against K
    -> {"by_attacked": {condition: {"K": the source's rewrite's own ASR and exposure (source_ASR,
    source_exposure), any attacked document's (ASR: any cited, exposure: any in the context), each
    attacked document's mean (mean_ASR, mean_exposure), the share of the top k they take and of the
    citations, in percent with CIs, and the chance rate of "any in the top k" (metrics.chance_any_in_topk)}}};
    {} on the paper's lists. every(condition): its records; k: the top-k; n_boot, seed: the bootstrap's."""
    if len(geodef.attacked_levels(insts)) < 2:
        return {}
    source = {x.instance_id: x.doc_ids[x.attack_index] for x in insts}

    def share(r):    # None (left out of the mean: no share) for an answer that cites nothing
        cited = len(r["cited_ids"])
        return 100.0 * r.get("attack_citation_share", r["attack_cited"] / cited) if cited else None
    cols = {"source_ASR": lambda r: 100.0 * (source[r["instance_id"]] in r["cited_ids"]),
            "source_exposure": lambda r: 100.0 * (source[r["instance_id"]] in r["top_ids"]),
            "ASR": lambda r: 100.0 * r["attack_cited"], "exposure": lambda r: 100.0 * r["attack_in_context"],
            "mean_ASR": lambda r: 100.0 * r.get("attacks_cited", r["attack_cited"]) / r.get("attacked", 1),
            "mean_exposure": lambda r: 100.0 * r.get("attacks_in_context", r["attack_in_context"])
                                       / r.get("attacked", 1),
            "topk_attack_share": lambda r: 100.0 * r.get("attacks_in_context", r["attack_in_context"]) / k,
            "citation_share": share}
    chance = (len(insts[0].docs), k)
    return {"by_attacked": {c: metrics.by_attacked(every(c), cols, n_boot, seed, chance) for c in conds}}


def sample_summary(by_condition, conds, n_boot, seed):
    """eval --samples N: per condition its ASR over every sample, each sample's ASR and its 95% CI: over
    query groups, of each instance's mean over its samples (metrics.cluster_bootstrap_ci), which carries
    the answers' own variance with the groups'. Beside it, as a check, the two-level bootstrap (groups,
    then samples within each: metrics.two_level_bootstrap_ci), which counts the answers' variance twice and
    is wider (conservative)."""
    out = {}
    for c, per_sample in zip(conds, by_condition):
        recs = [(i, r) for i, rs in enumerate(per_sample) for r in rs]
        vals = [100.0 * r["attack_cited"] for _, r in recs]
        mean = {}
        for i, r in recs:
            mean.setdefault(r["instance_id"], [r["group_id"], []])[1].append(100.0 * r["attack_cited"])
        out[c] = {"ASR": sum(vals) / len(vals),
                  "ASR_per_sample": [metrics.asr([r["attack_cited"] for r in rs]) for rs in per_sample],
                  "ASR_ci": list(metrics.cluster_bootstrap_ci(
                      [sum(v) / len(v) for _, v in mean.values()], [g for g, _ in mean.values()], n_boot, seed)),
                  "ASR_ci_two_level": list(metrics.two_level_bootstrap_ci(vals, [r["group_id"] for _, r in recs],
                                                                          [i for i, _ in recs], n_boot, seed))}
    return {"n": len(by_condition[0]), "conditions": out}


def summarize(recs, clean):
    """ASR, ASI, BER (B.2.3) of one condition's records. Only instances with the attack in context are
    judged (the rest score 0 without a call), so one whose every judge reply was unusable (counted in
    `asi_judge_failed`) counts at the mean score of the judged in-context ones: left out, it would leave
    the zeros their weight and bias ASI low. Every judge reply failed: ASI NaN (shown "-", as BER's). An
    instance whose answer request gave no usable reply cites nothing and is counted in `answer_failed`
    (present when some is)."""
    referenced = [r for r in recs if r["group_id"] in clean]       # (a group whose clean answer failed: none)
    b_clean = [clean[r["group_id"]]["benign_cited"] for r in referenced]
    judged = [r["asi"] for r in recs if r["asi"] is not None]
    inside = [r["asi"] for r in recs if r["attack_in_context"] and r["asi"] is not None
              and "answer_failed" not in r]              # (a failed answer's 0 was never the judge's)
    failed = len(recs) - len(judged)
    asi = (metrics.asi(judged + [sum(inside) / len(inside)] * failed) if inside else math.nan) if failed else \
        metrics.asi(judged)
    return {"ASR": metrics.asr([r["attack_cited"] for r in recs]), "ASI": asi,
            "BER": metrics.ber([r["benign_cited"] for r in referenced], b_clean), "n": len(recs),
            **({"ber_without_reference": n} if (n := len(recs) - len(referenced)) else {}),
            "asi_judge_failed": len(recs) - len(judged),
            **({"answer_failed": n} if (n := sum("answer_failed" in r for r in recs)) else {}),
            "attack_in_context": 100.0 * sum(r["attack_in_context"] for r in recs) / max(1, len(recs)),
            "hallucinated_citations": sum(len(r["hallucinated"]) for r in recs)}


def transfer_items(run):
    """--transfer "name=path,..." -> [(name, path, library)], each library file read and checked."""
    items = []
    for name, path in run.cfg.eval.transfer or ():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--transfer: {path}: no library file")
        try:
            lib = tfsg.load_library(path, run.limits)   # checked now, not after the other conditions
        except tfsg.LibraryError as e:
            raise SettingsError(f"--transfer {name}: {e}") from None
        items.append((name, path, lib))
    return items


def reranker_items(rerankers, conds=None):
    """eval --reranker LABEL=SPEC ... (the settings' parsed [(label, RerankSpec)], or None) -> those some
    condition of `conds` deploys ("Non-Defense [LABEL]", ...), all without `conds`."""
    return [(label, spec) for label, spec in rerankers or []
            if conds is None or any(deployed_label(c) == label for c in conds)]


def deployed_label(name):
    """'Non-Defense [co]' / 'TFSG only [co]' -> 'co' (a deployed reranker's condition), else None."""
    for c in RERANKER_CONDITIONS:
        if name.startswith(c + " [") and name.endswith("]"):
            return name[len(c) + 2:-1]
    return None


def eval_settings(run, conds, transfers):
    """The settings the values of results/*.jsonl depend on beyond the pinned ones: the judge (ASI,
    pairwise quality), the answers' token cap, for PPL-Filter its scoring model and quantile, for
    each --transfer name the SHA-1 of its library file, the run's own library's and Shield adapter's
    SHA-1 (with --quant int8, so said) for the conditions that use them, and for an injection defense
    its settings (defenses.Pipeline.settings). (Which conditions, methods and test groups are evaluated
    only selects records: not here.)"""
    cfg = run.cfg
    s = {"judge": cfg.judge.judge or cfg.llm.llm, "max_tokens": cfg.llm.max_tokens}
    lib, adapter = run.library_path(), run.path("adapter", "adapter_model.safetensors")
    if os.path.isfile(lib):                 # a library or adapter trained again: the old records are not its
        s["library"] = file_sha1(lib)[:12]
    if os.path.isfile(adapter):
        s["shield"] = file_sha1(adapter)[:12] + (" int8" if cfg.model.quant == "int8" else "")
    if "PPL-Filter" in conds:
        s.update(ppl_model=cfg.eval.ppl_model, ppl_quantile=cfg.eval.ppl_quantile,
                 ppl_calibration="documents with a perplexity")
    if "GEO Defender" in conds:                      # results/transfer_<name>.jsonl: that library's content
        for name, path, _ in transfers:
            s[f"transfer {name}"] = file_sha1(path)[:12]
    for label, spec in reranker_items(cfg.rerank.reranker, conds):   # a deployed reranker's records: its endpoint
        s[f"reranker {label}"] = str(spec)
    s.update({c: defenses.PIPELINES[c].settings for c in conds if c in defenses.PIPELINES
              and defenses.PIPELINES[c].settings})   # an injection defense's thresholds, marker, ...
    return s


def settings_of(name, recs, settings):
    """Which of `settings` (eval_settings) the records `recs` of condition `name` were made with: the
    token cap always, the judge when it was asked (attack in context), PPL-Filter's model for its
    records, a transfer library's digest for its records. Recorded as records are written, so a
    failed eval pins nothing its records do not depend on."""
    keep = {"max_tokens"} | ({"judge"} if any(r["attack_in_context"] for r in recs) else set())
    label = deployed_label(name)
    if name in WITH_LIBRARY or label and name.startswith("TFSG only"):
        keep.add("library")
    if name in WITH_SHIELD or label and settings.get(f"reranker {label}") == "shield":
        keep.add("shield")
    if name == "PPL-Filter":
        keep |= {"ppl_model", "ppl_quantile", "ppl_calibration"}
    if name.startswith("GEO Defender [") and name.endswith("]"):
        keep.add(f"transfer {name[len('GEO Defender ['):-1]}")
    if label:
        keep.add(f"reranker {label}")
    if name in defenses.PIPELINES:
        keep.add(name)
    return {k: v for k, v in settings.items() if k in keep}


def check_eval_settings(run, conds, transfers):
    """Results are resumed record by record, so an eval with another judge (or PPL model, library,
    adapter, ...) would silently reuse the records made with the old one: refused, naming both."""
    res = run.path("results")
    old = read_json(os.path.join(res, "settings.json"), {})
    changed = {k: v for k, v in eval_settings(run, conds, transfers).items() if k in old and old[k] != v}
    if changed:
        raise changed_settings(res, "its records were made", old, changed, f"Move {res} aside to evaluate again "
                               "(LLM replies stay cached in cache/), or use a new --name")


def eval_conditions(run, trained=True):
    """The conditions --conditions asks for and the --transfer libraries, checked before anything runs
    or is recorded: known names, valid libraries, settings that match the records already made, and
    (trained; `demo` trains first) what the conditions need from `train` (the final TFSG library, the
    Shield adapter) present. -> (conditions, transfer_items)."""
    cfg = run.cfg
    named = {"all": CONDITIONS, "paper": PAPER_CONDITIONS}
    conds = list(named.get(cfg.eval.conditions) or cfg.eval.conditions)
    for c in conds:
        if c not in CONDITIONS:
            raise SettingsError(f"--conditions: unknown {c!r}; known {CONDITIONS}, 'paper' (the first six) "
                                "or 'all'")
    transfers = transfer_items(run)
    deployed = rankers.check_specs(reranker_items(cfg.rerank.reranker))        # every endpoint's key present
    conds = conds + [f"{c} [{label}]" for label, _ in deployed for c in RERANKER_CONDITIONS
                     if c != "TFSG only" or os.path.isfile(run.library_path())]
    check_eval_settings(run, conds, transfers)
    if not trained:
        return conds, transfers
    lib, adapter = run.library_path(), run.path("shield_done.json")     # (the adapter is saved every epoch)
    missing = [(p, what, needs) for p, what, needs in ((lib, "TFSG library", WITH_LIBRARY),
                                                       (adapter, "finished Shield training", WITH_SHIELD))
               if not os.path.isfile(p)]
    needing = [c for c in conds if any(c in needs for _, _, needs in missing)]
    if needing:   # the stage that writes what is missing (both missing: the whole of train)
        stage = " --stage shield" if os.path.isfile(lib) else " --stage tfsg" if os.path.isfile(adapter) else ""
        rest = [c for c in CONDITIONS if not any(c in needs for _, _, needs in missing)]
        msg = (f"{' and '.join(f'{p}: no {what}' for p, what, _ in missing)}; run "
               f"`{train_command(cfg.folder, stage)}` first ({', '.join(needing)} need{'s' * (len(needing) == 1)} it)")
        raise NotTrainedError(msg + (f", or evaluate the others: --conditions \"{','.join(rest)}\"" if rest else ""))
    return conds, transfers


def ranking_stage(run, conds, deployed):
    """The local rankers eval needs, every list scored -> (base, shield or None). Under torchrun every
    rank runs it, each scoring whole queries of its share (rankers.sharded); the command then leaves the
    process group and rank 0 evaluates alone (run.py's eval). A plain run scores them all. PPL-Filter's
    GPT-2 is resolved first (downloaded, or refused), before the reranker scores every candidate."""
    data = run.data
    if "PPL-Filter" in conds and run.cfg.eval.ppl_model != "tiny":
        gpt2.resolve(run.cfg.eval.ppl_model)
    insts = geodef.expand(data.test, data.methods)
    cleans = [geodef.clean_instance(g) for g in data.test]
    base, shield = load_rankers(run, any(c in WITH_SHIELD for c in conds) or any(s == "shield" for _, s in deployed))
    sharded(run.ranks, base, insts + cleans)
    if shield:
        sharded(run.ranks, shield, insts)
    return base, shield


class Evaluated(NamedTuple):
    """What evaluate made: the summary (summary.json as written) and each condition's records (its
    first sample's, as results/<slug>.jsonl holds them)."""
    summary: dict
    records: dict


def evaluate(run, conditions=None, ranked=None):
    """All conditions of Table 1/2 on the test split, the clean reference, pairwise quality, method,
    epoch and transfer breakdowns -> results/*.jsonl, summary.json, report.md, figures/*.svg, and
    Evaluated(summary, {condition: records}). conditions: (conditions, transfer libraries), eval_conditions'
    answer when the caller has checked them (eval does, first; holdout names its two); ranked:
    ranking_stage's answer when the caller has run it (eval does, on every rank)."""
    cfg = run.cfg
    _, meta, cons, test, seen, methods = run.data
    insts = geodef.expand(test, methods)
    lists = geodef.expand(test, methods, paper=True)    # the paper's lists: what the epochs and transfers answer
    cleans = [geodef.clean_instance(g) for g in test]
    conds, transfers = conditions or eval_conditions(run)
    needs_lib = any(c in WITH_LIBRARY or deployed_label(c) and c.startswith("TFSG only") for c in conds)
    lib = tfsg.load_library(run.library_path(), run.limits) if needs_lib else None
    deployed = reranker_items(cfg.rerank.reranker, conds)
    base, shield = ranked or ranking_stage(run, conds, deployed)
    local = {"base": base, "shield": shield}
    others = rankers.make_rankers(run, [(lb, s) for lb, s in deployed if s.kind not in local], "eval")
    for label, rk in others.items():
        rk.prepare(insts)
    llm = run.llm(stage="eval")
    judge = run.llm(cfg.judge.judge, stage="eval") if cfg.judge.judge else llm   # one client: its adaptations recorded
    res = os.path.join(run.dir, "results")
    os.makedirs(res, exist_ok=True)
    settings = os.path.join(res, "settings.json")          # what the records below were made with
    wanted = eval_settings(run, conds, transfers)

    def record_settings(name, recs):                        # written with the records that depend on them
        new = settings_of(name, recs, wanted)
        old = read_json(settings, {})
        if any(old.get(k) != v for k, v in new.items()):
            write_json(settings, {**old, **new})

    def condition(name, insts, cond, file, asi=True, sample=0):  # one condition's records in results/<file>.jsonl
        return eval_condition(cfg.llm, cfg.request.workers, llm, name, insts, cond.topk, cond.pipeline,
                              os.path.join(res, file + ".jsonl"), judge, judge_asi=asi, sample=sample,
                              before_write=lambda recs: record_settings(name, recs))
    # clean reference (B.1.3): once per group, reused by its attack variants
    clean_recs = condition("clean reference", cleans, clean_reference(cfg.data.k, base), "clean_reference")
    clean = clean_answers(clean_recs)
    plan, ppl_diag = condition_plan(run, conds, base, shield, lib, cons, insts)
    plan.update(deployed_conditions(cfg.data.k, plan, deployed, local, others))
    results, repeats = answer_conditions(cfg.sample.samples, conds, insts, plan, condition)
    first = {c: metrics.paper_level(results[c]) for c in conds}     # the first sample on the paper's lists (K = 1)
    honest = honest_audit(run, conds, plan, [base, shield, *others.values()], cons, test, first, condition)
    every = lambda c: results[c] + [r for rs in repeats[c] for r in rs]     # every sample's records
    paper = lambda c: metrics.paper_level(every(c))     # the headline: lists with one attacked document
    summary = {"offline": run.offline, "target_llm": llm.label, "judge": judge.label, "model": cfg.model.model,
               "tfsg_library_ranking": "Shield" if cfg.tfsg.shield else "base reranker",
               "notes": offline_notes(run), "conditions": {c: summarize(paper(c), clean) for c in conds},
               "methods": {c: {m: {**summarize([r for r in paper(c) if r["method"] == m], clean), "seen": m in seen}
                               for m in methods} for c in conds},
               "ppl_filter": ppl_diag, "seen_methods": seen, "test_groups": len(test), "test_instances": len(lists),
               "test_set_sha1": test_set_digest(insts), "k": cfg.data.k,
               "documents_cut": documents_cut(base.rr, insts + cleans)}
    summary.update({"test_lists": len(insts)} if len(insts) > len(lists) else {})     # every K's lists (--attacked K)
    summary.update({"honest": honest} if honest else {})        # a benchmark with honest edits (build-bench --honest)
    summary.update(bench_labels(run))
    summary.update(attacked_summary(insts, conds, every, cfg.data.k, cfg.rerank.n_boot, cfg.folder.seed))
    if cfg.sample.samples > 1:
        summary["samples"] = sample_summary([[first[c], *map(metrics.paper_level, repeats[c])] for c in conds],
                                            conds, cfg.rerank.n_boot, cfg.folder.seed)
    if "Non-Defense" in conds:
        summary["attack_strength"] = attack_strength(first["Non-Defense"], clean, test, methods, cfg.rerank.n_boot,
                                                     cfg.folder.seed)
    if "GEO Defender" in conds:
        # pairwise quality of GEO Defender vs the clean reference (B.2.4); Fig. 5: GEO Defender with E0..E4
        summary["quality"] = pairwise_quality(run, judge, first["GEO Defender"], clean,
                                              {x.instance_id: x for x in insts}, res)
        summary["epochs"] = library_epochs(run, results["GEO Defender"], lists, plan["Shield only"].topk, clean,
                                           condition)
    summary.update(defense_summary(run, llm, judge, first, plan, insts, clean, res))
    if transfers and "GEO Defender" in conds:     # Table C.2 row: other targets' libraries, Shield fixed
        summary["transfer"] = transfer_rows(results["GEO Defender"], transfers, lists, plan["Shield only"].topk,
                                            clean, condition)
    summary.update(clients_summary((llm, judge)))
    summary = write_summary(run, "eval", summary)              # rerank-eval's, attack's and harden's blocks kept
    report.write_report(run.dir, summary)
    log(f"[eval] wrote {run.dir}/summary.json and {run.dir}/report.md")
    return Evaluated(summary, results)


def transfer_rows(own, transfers, lists, shield_topk, clean, condition):
    """Table C.2's row of this target: ASR and ASI of GEO Defender with each --transfer library (answered on
    the paper's `lists` through `condition`, one sample) and with its own (`own`, its first sample's
    records), each on the paper's lists."""
    row = lambda recs: {k: v for k, v in summarize(metrics.paper_level(recs), clean).items() if k in ("ASR", "ASI")}
    out = {"(own)": row(own)}
    for name, _, lt in transfers:
        out[name] = row(condition(f"GEO Defender [{name}]", lists, Condition(shield_topk, guided(lt)),
                                  f"transfer_{name}"))
    return out


def honest_audit(run, conds, plan, ranked_by, cons, test, results, condition):
    """Does the defense punish honest optimisation (#40)? Each condition on the clean list and on the
    honest list (geodef.honest_instance) of every test group with an honest edit, two records per
    group in results/<slug>.honest.jsonl (no ASI judge), then its honest_penalty. ranked_by: the
    rankers the conditions' top-k come from (the base first; None for one not loaded), to score the new
    lists; results: each condition's attack records on the paper's lists (one edited document against one
    attacked). None without honest edits (then nothing is scored, asked or written)."""
    cfg, groups = run.cfg, [g for g in test if g.honest is not None]
    if not groups:
        return None
    lists = [x for g in groups for x in (geodef.clean_instance(g), geodef.honest_instance(g))]
    for rk in filter(None, ranked_by):
        rk.prepare(lists)
    topk = {c: plan[c].topk for c in conds}
    if "PPL-Filter" in conds:           # the same threshold; the new lists' flagged candidates moved last
        orders, _ = ppl_filter(run, ranked_by[0], cons, lists)
        topk["PPL-Filter"] = lambda x: orders[x.instance_id][:cfg.data.k]
    out = {}
    for c in conds:
        recs = condition(c, lists, Condition(topk[c], plan[c].pipeline), condition_slug(c) + ".honest", asi=False)
        out[c] = honest_penalty(recs, results[c], groups, cfg.rerank.n_boot, cfg.folder.seed)
    refused = geodef.read_meta(cfg.data.bench).raw.get("honest_refusals")      # the editor's refused attempts
    return {"groups": len(groups), "test_groups": len(test), "conditions": out, **({"refusals": refused}
                                                                                  if refused else {})}


def honest_penalty(recs, attack_recs, groups, n_boot=10000, seed=0):
    """One condition's honest penalty: over the groups whose source it cites on the clean list, the % whose
    honest edit it does not cite on the honest list ("loses its citation"); beside it `attack_loss`,
    the same for the attack rewrites of those groups (% of their attack instances not cited). 95%
    query-cluster bootstrap CIs (metrics.cluster_bootstrap_ci); None where no source is cited. A group whose
    clean or honest answer failed, and an attack instance whose answer failed, is left out (an answer that
    never came cites nothing: not the defense's doing) and counted in `answer_failed` (present when some is)."""
    by = {r["instance_id"]: r for r in recs}
    src = {g.group_id: g.docs[g.source_index]["doc_id"] for g in groups}
    failed = {gid for gid in src if any("answer_failed" in by[f"{gid}:{side}"] for side in ("clean", "honest"))}
    kept = [gid for gid, d in src.items() if gid not in failed and d in by[f"{gid}:clean"]["cited_ids"]]
    lost = [100.0 * (f"{src[gid]}#honest" not in by[f"{gid}:honest"]["cited_ids"]) for gid in kept]
    cited_groups = set(kept)
    attacks = [r for r in attack_recs if r["group_id"] in cited_groups and "answer_failed" not in r]
    n_failed = len(failed) + sum(r["group_id"] in cited_groups and "answer_failed" in r for r in attack_recs)
    out = {"groups": len(groups), "source_cited": len(kept), "n_attack": len(attacks),
           "honest_cited": sum(f"{d}#honest" in by[f"{gid}:honest"]["cited_ids"] for gid, d in src.items()),
           **({"answer_failed": n_failed} if n_failed else {})}
    for name, vals, clusters in (("honest_penalty", lost, kept),
                                 ("attack_loss", [100.0 * (not r["attack_cited"]) for r in attacks],
                                  [r["group_id"] for r in attacks])):
        out[name] = sum(vals) / len(vals) if vals else None
        out[name + "_ci"] = list(metrics.cluster_bootstrap_ci(vals, clusters, n_boot=n_boot, seed=seed)) if vals \
            else None
    return out


# What each family's own paper reports as its visibility gain, with its metric and method, beside the measured
# strength (the citation rate of the rewrite minus the source's, in points, attack_strength). None is in our
# metric, so each row says why it is not comparable; a family without an entry publishes no figure over the
# unoptimised source that we could check.
PAPER_GAINS = {
    "GEO": "not comparable (another metric and method): Quotation Addition, GEO's best single method, raises "
           "Position-Adjusted Word Count, a share of the answer's words, from 19.3 to 27.2 (+41% relative; arXiv "
           "2311.09735, Table 1); our GEO family is Fluency + Statistics, measured as citation rate",
    "GEO-SFE": "not comparable (unstated unit): '17.3% citation improvements' over six engines (arXiv 2603.29979, "
               "abstract), relative or in points not said; ours is in points",
    "AutoGEO": "not comparable (another reference): up to +51% over the strongest baseline, not over the source "
               "(arXiv 2510.11438)",
}


def attack_strength(recs, clean, test, methods, n_boot, seed):
    """Does each family raise visibility on this target at all? Per family, the Non-Defense citation of
    its rewrite minus the clean reference's citation of the same source on the unattacked list of the
    same group, in percentage points, with a cluster-bootstrap CI over groups (metrics). A family whose
    interval holds 0 is flagged: it was not shown to work, so the defense blocking it says little. An attacked
    answer that failed is left out (it cites nothing, which is not the rewrite's doing) and counted in
    `answer_failed` (present when some is), as honest_penalty does; one whose group's clean reference failed
    has nothing to be compared with, and is counted in `no_reference`."""
    source = {g.group_id: g.docs[g.source_index]["doc_id"] for g in test}
    out = {}
    for m in methods:
        unreferenced = sum(r["method"] == m and r["group_id"] not in clean for r in recs)
        rs = [r for r in recs if r["method"] == m and r["group_id"] in clean]
        failed = sum("answer_failed" in r for r in rs)
        rs = [r for r in rs if "answer_failed" not in r]
        if not rs:
            continue
        vals = [float(r["attack_cited"]) - float(source[r["group_id"]] in clean[r["group_id"]]["cited_ids"])
                for r in rs]
        lo, hi = metrics.cluster_bootstrap_ci(vals, [r["group_id"] for r in rs], n_boot=n_boot, seed=seed)
        out[m] = {"gain": round(100.0 * sum(vals) / len(vals), 2), "ci": [round(100.0 * lo, 2), round(100.0 * hi, 2)],
                  "n": len(vals), "holds_zero": bool(lo <= 0 <= hi), "paper": PAPER_GAINS.get(m),
                  **({"answer_failed": failed} if failed else {}),
                  **({"no_reference": unreferenced} if unreferenced else {})}
    return out


def defense_summary(run, llm, judge, results, plan, insts, clean, res):
    """Beside the metrics: each condition's cost per query (`cost_per_query`), what PromptArmor and
    RobustRAG did (`defense_diagnostics`), and the injection defenses' pairwise answer quality against
    the clean reference (B.2.4's judge, as for GEO Defender), at the run's prices (Run.prices, or None).
    results: each condition's records on the paper's lists (K = 1), as Table 1 and GEO Defender's quality."""
    cfg, prices = run.cfg, run.prices
    by_id = {x.instance_id: x for x in insts}
    out = {"cost": {c: cost_per_query(cfg.llm, llm, recs, by_id, plan[c].pipeline, prices)
                    for c, recs in results.items()},
           "defenses": defense_diagnostics(results, by_id)}
    quality = {c: pairwise_quality(run, judge, results[c], clean, by_id, res, condition_slug(c))
               for c in results if c in defenses.PIPELINES}
    return {**out, **({"quality_defenses": quality} if quality else {})}


def clean_answers(recs):
    """The clean reference's records by group, a group whose clean answer failed left out: against an empty
    answer its groups' BER, answer quality and attack strength would read as a defense's doing."""
    return {r["group_id"]: r for r in recs if "answer_failed" not in r}


def clean_reference(k, base):
    """B.1.3's clean reference as a Condition: the base reranker's top-k of the clean list, answered with
    the Non-Defense prompt (A.3.7). One helper for every command that measures against it."""
    return Condition(lambda x: base.order(x)[:k], STANDARD)


def cost_per_query(decoding, llm, recs, by_id, pipeline, prices=None):
    """A condition's target-side cost per query (the ASI judge apart: an evaluation cost): LLM calls,
    calls in a row (the latency a defense adds: 1 for one prompt), prompt and completion tokens, and
    USD at the full price with --prices. decoding: the target's LLMSettings (temperature, max tokens), which
    key its reply cache. A defense's records carry their usage; a one-prompt condition's
    record (defenses.one_prompt: the paper's records) gets its one reply's usage from the reply cache,
    nothing sent; one no longer cached is left out and counted in `usage_unknown`. An answer that never parsed
    (answer_failed) was paid for all the same: its attempts count as calls, its tokens are unknown (unmetered),
    alike for every condition; the token means are over the queries whose replies all carried their usage,
    and USD is unknown once some did not."""
    rows, unknown = [], 0
    for r in recs:
        u = r.get("usage")
        if u is None and "answer_failed" in r:          # one prompt, every attempt unusable: no reply cached
            u = {"llm_calls": r["answer_failed"]["attempts"], "sequential_calls": 1, "prompt_tokens": 0,
                 "completion_tokens": 0, "unmetered": 1}
        elif u is None:
            x = by_id[r["instance_id"]]
            docs = [x.docs[x.doc_ids.index(i)] for i in r["top_ids"]]
            hit = llm.cache.get(llm.request_key(_messages(pipeline.final(x.query, docs, [])[0]), decoding.temperature,
                                                decoding.max_tokens, True)[0])
            if hit is None:
                unknown += 1
                continue
            u = reply_usage([hit], sequential=1)
        rows.append(u)
    metered = [u for u in rows if not u.get("unmetered")]     # every reply's tokens known
    mean = {k: sum(u[k] for u in over) / len(over) if over else None
            for k, over in (("llm_calls", rows), ("sequential_calls", rows), ("prompt_tokens", metered),
                            ("completion_tokens", metered))}
    cached = sum(u.get("cached_tokens", 0) for u in metered) / len(metered) if metered else 0
    mean.update({"cached_tokens": cached} if cached else {})
    unmetered = sum(u.get("unmetered", 0) for u in rows)        # replies without token counts: no price
    usd = accounting.price_of(llm.label, {**mean, "unmetered": unmetered}, prices) if prices and rows else None
    return {**mean, "usd": usd, "records": len(rows), "usage_unknown": unknown,
            **({"unmetered_replies": unmetered} if unmetered else {})}


def _attack_positions(rec, x):
    """1-based positions of the attacked documents in the record's top-k (empty: none there)."""
    return {rec["top_ids"].index(x.doc_ids[i]) + 1 for i in x.attacked if x.doc_ids[i] in rec["top_ids"]}


def judged_attack(x, rec):
    """The attacked document the ASI judge reads (B.2.3): the first of the list's attacked documents in
    the record's context, the source's rewrite first (a list with one: that one)."""
    return next(x.docs[i] for i in x.attacked if x.doc_ids[i] in rec["top_ids"])


def defense_diagnostics(results, by_id):
    """PromptArmor: documents screened, those the remover cut from (attack, benign: its false
    positives), attack documents emptied, quoted passages not in the document, characters cut.
    RobustRAG: queries answered "I don't know." without a final call, isolated answers that abstained,
    kept phrases per query, how often the attack document supports a kept phrase (one not made of the
    question's words alone: the answer cites the attack where it uses one), and our keyword certificate
    after RobustRAG's: % of queries whose thresholded phrases no K' = 1, 2, 3 corrupted passages can change
    (defenses.keyword_certified; it bounds neither the citations nor the ASR beside it). On a list with
    several attacked documents each of them counts as an attack."""
    out = {}
    if "PromptArmor" in results:
        d = dict.fromkeys(("documents", "attack_in_context", "attack_cut", "attack_emptied", "benign_cut",
                           "passages_not_found", "chars_removed"), 0)
        for r in results["PromptArmor"]:
            att = _attack_positions(r, by_id[r["instance_id"]])
            d["documents"] += len(r["top_ids"])
            d["attack_in_context"] += len(att)
            for e in r["promptarmor"]:
                d["attack_cut" if e["index"] in att else "benign_cut"] += bool(e["removed"])
                d["attack_emptied"] += e["index"] in att and e["emptied"]
                d["passages_not_found"] += len(e["not_found"])
                d["chars_removed"] += e["removed_chars"]
        out["PromptArmor"] = d
    if "RobustRAG" in results:
        recs = results["RobustRAG"]
        att = [_attack_positions(r, by_id[r["instance_id"]]) for r in recs]
        rr = [r["robustrag"] for r in recs]
        out["RobustRAG"] = {
            "queries": len(recs), "abstained_queries": sum(g["abstained"] for g in rr),
            "isolated_answers": sum(len(g["isolated"]) for g in rr),
            "isolated_abstained": sum(defenses.abstains(a) for g in rr for a in g["isolated"]),
            "kept_phrases_per_query": sum(len(g["support"]) for g in rr) / max(1, len(rr)),
            "attack_in_context": sum(bool(a) for a in att),
            "attack_supports_a_kept_phrase": sum(any(
                i in s for i in a for p, s in g["support"].items() if p not in g["question_phrases"])
                for a, g in zip(att, rr)),
            "ASR": metrics.asr([r["attack_cited"] for r in recs]),       # beside the certificate: measured
            "certified": {str(kk): 100.0 * sum(defenses.keyword_certified(g["isolated"], kk) for g in rr)
                          / max(1, len(rr)) for kk in (1, 2, 3)}}
    return out


def condition_slug(name):
    """A condition's records file name (endpoints.slug, which the reranker labels are checked by): "Non-Defense"
    -> non_defense, "Non-Defense [co]" -> non_defense_co."""
    return endpoints.slug(name)


class Condition(NamedTuple):
    """An evaluated condition: the top-k an instance is answered from, and how (a defenses.Pipeline)."""
    topk: Callable
    pipeline: defenses.Pipeline


STANDARD = defenses.one_prompt(tfsg.standard_prompt)          # A.3.7: Non-Defense's and the clean reference's


def guided(lib):
    """The experience-guided answer (A.3.6) with library `lib`, as a one-prompt pipeline."""
    return defenses.one_prompt(lambda query, docs: tfsg.guided_prompt(query, docs, lib))


def condition_plan(run, conds, base, shield, lib, cons, insts):
    """Each condition's Condition(top-k of an instance, pipeline) -> ({name: Condition}, PPL-Filter
    diagnostics or None). Shield conditions need `shield`, library ones `lib`; the injection defenses
    rank with the base reranker, as Non-Defense."""
    k = run.cfg.data.k
    base_k = lambda x: base.order(x)[:k]
    shield_k = (lambda x: shield.order(x)[:k]) if shield else None
    safety = defenses.one_prompt(lambda query, docs: tfsg.standard_prompt(query, docs, static_safety=True))
    plan = {"Non-Defense": Condition(base_k, STANDARD), "Static Safety Prompt": Condition(base_k, safety),
            "GEO Defender": Condition(shield_k, guided(lib)), "Shield only": Condition(shield_k, STANDARD),
            "TFSG only": Condition(base_k, guided(lib))}
    plan.update({name: Condition(base_k, defenses.PIPELINES[name]) for name in INJECTION_DEFENSES})
    ppl_diag = None
    if "PPL-Filter" in conds:
        orders, ppl_diag = ppl_filter(run, base, cons, insts)
        plan["PPL-Filter"] = Condition(lambda x: orders[x.instance_id][:k], STANDARD)
    return plan, ppl_diag


def clients_summary(clients):
    """summary.json's record of the clients: any parameter the APIs refused (write_summary adds the run
    folder's cost). This invocation's requests and cache hits go to the log, not into the summary (it must
    not depend on where a run was resumed)."""
    adapted = {c.label: c.adapted for c in dict.fromkeys(clients) if c.adapted}
    for c in dict.fromkeys(clients):
        log(f"[eval] this invocation, {c.label}: {c.stats['calls']} calls, {c.stats['http_calls']} sent, "
            f"{c.stats['cache_hits']} from the cache")
    return {"adapted": adapted} if adapted else {}


def records_done(path):
    """Records already in a results file (they cost nothing on a rerun)."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.endswith("\n"))


def plan_eval(run, conditions=None):
    """eval --dry-run: what the evaluation would send, stage by stage, and nothing sent. Answers and
    ASI judge calls are counted for the records the results files lack (the ASI judge only runs when
    the attack is in context: an upper bound); PromptArmor's and RobustRAG's k pre-step calls per
    record are their own stages; pairwise quality asks once per instance of GEO Defender and of each
    injection defense (cached replies cost nothing and are not subtracted); prompt sizes from the
    first k candidates. conditions: as evaluate takes them (default: the Run's checked ones)."""
    cfg, data = run.cfg, run.data
    insts = geodef.expand(data.test, data.methods)
    conds, transfers = conditions or getattr(run, "checked", None) or eval_conditions(run)
    res = os.path.join(cfg.folder.run_dir, "results")
    files = {"clean reference": (os.path.join(res, "clean_reference.jsonl"), len(data.test))}
    files.update({c: (os.path.join(res, condition_slug(c) + ".jsonl"), len(insts)) for c in conds})
    files.update({f"{c} sample {i}": (os.path.join(res, f"{condition_slug(c)}.s{i}.jsonl"), len(insts))
                  for c in conds for i in range(1, cfg.sample.samples)})              # eval --samples N
    if "GEO Defender" in conds:
        files.update({f"GEO Defender E{t}": (os.path.join(res, f"geo_defender_E{t}.jsonl"), len(insts))
                      for t in range(cfg.tfsg.n_batches + 1) if os.path.isfile(run.library_path(t))})
        files.update({f"GEO Defender [{n}]": (os.path.join(res, f"transfer_{n}.jsonl"), len(insts))
                      for n, _, _ in transfers})
    todo = sum(max(0, n - records_done(p)) for p, n in files.values())
    ctx = sum(sum(map(len, x.docs[:cfg.data.k])) for x in insts) / max(1, len(insts))
    att = sum(len(x.docs[x.attack_index]) for x in insts) / max(1, len(insts))
    stages = {"target answers": estimate(todo, ctx + 2500, 300), "ASI judge": estimate(todo, att + 2400, 80)}
    for c in (c for c in conds if c in defenses.PIPELINES and defenses.PIPELINES[c].pre_step):
        # PromptArmor and RobustRAG: k pre-step calls per record (one per document) before its answer
        todo_c = sum(max(0, len(insts) - records_done(p)) for k, (p, _) in files.items()
                     if k == c or k.startswith(f"{c} sample "))
        stages[f"{c} {defenses.PIPELINES[c].pre_step}"] = estimate(todo_c * cfg.data.k, ctx / cfg.data.k + 1300, 150)
    judged = ["GEO Defender"] * ("GEO Defender" in conds) + [c for c in conds if c in defenses.PIPELINES]
    if judged:
        stages["pairwise quality judge"] = estimate(len(insts) * len(judged), 2 * 1200 + 1500, 120)
    honest = plan_honest(cfg.data.k, data.test, conds, res, ctx, stages)
    judge = cfg.judge.judge or cfg.llm.llm
    model_of = lambda s: judge if "judge" in s else cfg.llm.llm
    return {"instances": len(insts), "records_to_make": todo, "stages": stages,
            "usd_at_most": price_plan(run.prices, stages, model_of),
            "usd_at_most_batch_api": price_plan(run.prices, stages, model_of, batch=True),
            "note": "upper bounds; records already made and LLM replies already cached cost nothing. PromptArmor "
                    "and RobustRAG multiply the target's calls: k + 1 per record (k remover or isolated calls, "
                    "then the answer), 2 in a row; their pre-step stages count the k", **honest}


def plan_honest(k, test, conds, res, ctx, stages):
    """eval --dry-run's honest audit (a benchmark with honest edits): per condition, 2 answers per group
    with an honest edit (its clean and honest lists; PromptArmor and RobustRAG k + 1 calls each), no
    ASI judge; the records results/<slug>.honest.jsonl lack. Adds its stages -> the plan's `honest_audit`
    entry ({} without honest edits)."""
    n = sum(g.honest is not None for g in test)
    if not n:
        return {}
    todo = {c: max(0, 2 * n - records_done(os.path.join(res, condition_slug(c) + ".honest.jsonl"))) for c in conds}
    stages["honest audit answers"] = estimate(sum(todo.values()), ctx + 2500, 300)
    for c in (c for c in conds if c in defenses.PIPELINES and defenses.PIPELINES[c].pre_step):
        stages[f"honest audit {c} {defenses.PIPELINES[c].pre_step}"] = estimate(todo[c] * k, ctx / k + 1300, 150)
    return {"honest_audit": {"groups": n, "records_to_make": sum(todo.values()),
                             "extra_calls_per_group_per_condition": "2 (the clean list and the honest list); "
                             "PromptArmor and RobustRAG 2 x (k + 1); no ASI judge"}}


def library_epochs(run, final, insts, shield_topk, clean, condition):
    """Fig. 5: ASR, ASI and BER of GEO Defender with each library epoch E0..E{n+1} found in the run
    (the final one's records are `final`; the others evaluated through `condition` on `insts`, the paper's
    lists), on the paper's lists as Table 1 (its first sample: the last epoch is Table 1's with one sample)."""
    epochs = {}
    last = run.cfg.tfsg.n_batches + 1
    for t in range(last + 1):
        p = run.library_path(t)
        if not os.path.isfile(p):
            continue
        lt = tfsg.load_library(p, run.limits)
        recs = final if t == last else condition(
            f"GEO Defender E{t}", insts, Condition(shield_topk, guided(lt)), f"geo_defender_E{t}")
        epochs[f"E{t}"] = {k: v for k, v in summarize(metrics.paper_level(recs), clean).items()
                           if k in ("ASR", "ASI", "BER")}
    return epochs


def pairwise_quality(run, judge, recs, clean, by_id, res, slug="geo_defender"):
    """B.2.4: the condition's answers against the clean reference, half of them shown first (rows in
    results/quality_<slug>.jsonl) -> Table C.1's figures; `defended_as_a` counts the comparisons the judge
    scored (of n), so a judge that fails more on one order shows in it."""
    cfg, n = run.cfg, len(recs)
    recs = [r for r in recs if r["group_id"] in clean and "answer_failed" not in r]   # two answers to compare
    a_first = metrics.balanced_order([r["instance_id"] for r in recs])
    reqs = []
    for r in recs:
        x = by_id[r["instance_id"]]
        ref = clean[r["group_id"]]["answer"]
        a, b = (r["answer"], ref) if a_first[r["instance_id"]] else (ref, r["answer"])
        reqs.append({"messages": [{"role": "user", "content": metrics.pairwise_prompt(x.query, a, b)}],
                     "temperature": 0, "max_tokens": cfg.llm.max_tokens, "json": True,
                     "check": metrics.parse_pairwise})
    reps = judge.map(reqs, workers=cfg.request.workers, desc="pairwise quality", invalid="return")
    deltas, rows, failed, clusters = [], [], 0, []
    for r, rep in zip(recs, reps):
        if isinstance(rep, llm_clients.ReplyInvalid):   # left out of Table C.1, counted
            failed += 1
            rows.append({"instance_id": r["instance_id"], "defended_is_a": a_first[r["instance_id"]],
                         "judge_failed": {"attempts": rep.attempts, "error": str(rep)}})
            continue
        v = metrics.parse_pairwise(rep.data)
        d = metrics.orient(v, a_first[r["instance_id"]])
        deltas.append(d)
        clusters.append(r["group_id"])
        rows.append({"instance_id": r["instance_id"], "defended_is_a": a_first[r["instance_id"]], "score_a_over_b": v,
                     "delta": d, "judge": rep.data})
    write_jsonl(os.path.join(res, f"quality_{slug}.jsonl"), rows)
    q = (metrics.quality_summary(deltas, clusters, n_boot=cfg.rerank.n_boot, seed=cfg.folder.seed) if deltas
         else {"n": 0})
    q["defended_as_a"] = sum(row["defended_is_a"] for row in rows if "judge_failed" not in row)   # of the n scored
    q["judge_failed"] = failed
    q.update({"no_answer": n - len(recs)} if n > len(recs) else {})      # its answer or the clean one failed
    return q
