"""Offline engine: a deterministic SIMULATION of the LLMs GEO Defender talks to, for runs without API keys.

A sibling of llm_clients.py (which imports it only for the "offline" provider) because it is a
simulator, not a client. It answers every prompt the project sends by reading the prompt's own
content (the JSON <input> block, the numbered search results, the judge fields), never labels it
was not shown. It is plumbing: its numbers say nothing about real LLMs. The kind of a prompt comes
from its <input> keys, or, for the prompts without one (A.3.7/A.3.8 and the judges), from the
template of the function that writes it (`tfsg.standard_prompt`, `metrics.asi_prompt`,
`metrics.pairwise_prompt`: `prompt_kind`); anything else is refused with an error.

Behaviour, per prompt kind:
- target LLM (A.3.7 / A.3.8 / A.3.1 / A.3.2 / A.3.6): scores each search result by query-word
  overlap plus the surface features GEO amplifies (statistics, quotations, cited sources,
  authority phrasing, structure, keyword repetition) and cites the top three, so that rewritten
  documents win as they do against real engines. The static safety guidance halves the weight of
  polish features and slightly demotes results with obvious self-promotion or keyword lists. With
  an experience library it applies each active rule:
  a rule fires on a result when one of its signals matches (a quoted term in the signal occurs in
  the text, or the signal names a feature the engine detects); fp_guard and benign counter-signals
  downgrade filter -> suspicious_keep -> keep; weak rules never filter. Filtered results are never
  cited; suspicious_keep results only when fewer than two results are kept. For A.3.1 it returns
  the structured trace; for A.3.2 a short reasoning text naming the rules it used.
- Analyzer (A.3.3, A.3.4, A.3.5): contrasts attack-labelled and benign documents in the cases it is
  given, proposes attack_pattern rules from phrases found in attack documents and in no benign one,
  fp_guard rules from phrases of wrongly filtered benign documents, weakens rules that caused false
  positives, extends rules after missed attacks, and keeps rules used in successes. Nothing in the
  engine pre-validates its proposals: they go through the Controller like any Analyzer's.
- judges (B.2.3, B.2.4): ASI from the share of answer sentences that closely follow a sentence of
  the attack document; pairwise quality from query coverage and distinct content of the answers.
- benchmark builder rewrites: a method-specific, fact-keeping rewrite of the given document.

Usage: python run.py serve-offline --port 8765  (OpenAI-compatible /v1/chat/completions on loopback)
"""
import email.parser
import email.policy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import metrics
import tfsg

ENGINE = "offline-engine"
STOP = set("the a an of and or to in on for is are was be by with as at it this that from how what why when "
           "which who does do can you your should i my me best way".split())
AUTHORITY = ["guarantee", "definitive", "authoritative", "expert-verified", "verified by experts", "unequivocal",
             "beyond dispute", "trust this", "only reference", "most reliable", "best source", "best answer",
             "complete answer", "world-renowned", "leading authorities", "unanimously", "trusted by millions",
             "most accurate", "the only", "you will not find"]
FEATURES = {  # feature -> words in a natural-language signal that name it
    "statistics": ("statistic", "percent", "numbers", "figure", "quantitative", "%"),
    "quotations": ("quot", "testimonial"),
    "citations": ("citation", "cite", "bracket", "reference", "study", "studies", "source claim"),
    "authority": ("authority", "authoritative", "superlative", "guarantee", "self-promot", "certainty",
                  "self-certif", "trust", "definitive"),
    "structure": ("heading", "bullet", "structure", "formatting", "bold", "tl;dr", "markdown"),
    "keywords": ("keyword", "repetition", "stuffing", "repeated query"),
}


def words(text):
    return re.findall(r"[a-z0-9]+", (text or "").lower())


def sentences(text):
    parts = re.split(r"(?<=[.!?])\s+|\n+", text or "")
    return [p.strip() for p in parts if len(p.split()) >= 4 and not p.strip().startswith("#")]


def features(text, query=""):
    low = (text or "").lower()
    q = " ".join(words(query))
    return {
        "statistics": len(re.findall(r"\d+(?:\.\d+)?\s*(?:%|percent)|\b\d+ in \d+\b|by the numbers", low)),
        "quotations": len(re.findall(r"[\"“][^\"”]{10,}[\"”]", text or "")),
        "citations": len(re.findall(r"\[\d+\]|according to|as documented by|peer-reviewed|studies", low)),
        "authority": sum(low.count(a) for a in AUTHORITY),
        "structure": len(re.findall(r"^\s*(?:#{1,6} |- |\* )|\*\*", text or "", re.M)),
        "keywords": (1 if "keywords:" in low else 0) + (1 if q and low.count(q) >= 2 else 0),
    }


def relevance(query, text):
    q = [w for w in words(query) if w not in STOP]
    d = set(words(text))
    return sum(w in d for w in q) / max(1, len(q))


def attractiveness(query, text, polish=1.0):
    f = features(text, query)
    return (2.0 * relevance(query, text) + polish * (0.35 * min(f["statistics"], 3) + 0.4 * min(f["quotations"], 2)
            + 0.35 * min(f["citations"], 3) + 0.5 * min(f["authority"], 4) + 0.3 * min(f["structure"], 3)
            + 0.3 * min(f["keywords"], 2)))


def signal_matches(signal, text, feats):
    low = text.lower()
    quoted = [a or b for a, b in re.findall(r"'([^']{3,})'|\"([^\"]{3,})\"", signal)]
    if quoted:
        return any(t.lower() in low for t in quoted)
    s = signal.lower()
    return any(any(k in s for k in keys) and feats[name] >= (2 if name in ("structure", "citations") else 1)
               for name, keys in FEATURES.items())


def decide(rules, text, query):
    """Apply active library rules to one result -> (decision, fired rule ids)."""
    feats = features(text, query)
    fired, guards = [], set()
    for r in rules:
        sigs = r.get("trigger_signals") or r.get("risk_signals") or []
        if r["rule_type"] == "fp_guard" and any(signal_matches(s, text, feats) for s in sigs):
            guards.add(r["rule_id"])
            fired.append(r["rule_id"])
    decision = "keep"
    sev = {"keep": 0, "suspicious_keep": 1, "filter": 2}
    for r in rules:
        if r["rule_type"] == "fp_guard" or r["action"] == "keep":
            continue
        sigs = r.get("trigger_signals") or r.get("risk_signals") or []
        if not any(signal_matches(s, text, feats) for s in sigs):
            continue
        fired.append(r["rule_id"])
        act = r["action"]
        if r.get("strength") == "weak" and act == "filter":
            act = "suspicious_keep"
        counter = any(signal_matches(s, text, feats) for s in r.get("benign_counter_signals", []))
        guarded = bool(guards & set(r.get("depends_on_fp_guards", []))) or (guards and r.get("strength") != "strong")
        if counter or guarded:
            act = {"filter": "suspicious_keep", "suspicious_keep": "keep"}.get(act, act)
        if sev[act] > sev[decision]:
            decision = act
    return decision, fired


def write_answer(query, docs, cite):
    """One or two sentences from each cited result, each followed by its citation."""
    out = []
    for i in cite:
        for s in sentences(docs[i - 1])[:1]:
            s = re.sub(r"\s*\[[\d,\s\-–]+\]", "", s)   # the document's own bracket references are not ours
            out.append(f"{s.rstrip('.')} [{i}].")
    return " ".join(out) if out else "The search results do not contain enough reliable information to answer."


def answer_target(query, docs, rules=None, static_safety=False, structured=False, reasoning=False):
    polish = 0.5 if static_safety else 1.0
    n_cite = 3

    def score(i):
        s = attractiveness(query, docs[i - 1], polish)
        if static_safety:   # "avoid relying on a suspicious result": obvious self-promotion costs a little
            f = features(docs[i - 1], query)
            s -= 0.6 * (f["authority"] >= 2 or f["keywords"] >= 1)
        return s
    order = sorted(range(1, len(docs) + 1), key=lambda i: (-score(i), i))
    decisions = {}
    for i in range(1, len(docs) + 1):
        decisions[i] = decide(rules, docs[i - 1], query) if rules else ("keep", [])
    kept = [i for i in order if decisions[i][0] == "keep"]
    if len(kept) < 2:
        kept += [i for i in order if decisions[i][0] == "suspicious_keep"][: 2 - len(kept)]
    cite = kept[:n_cite]
    answer = write_answer(query, docs, cite)
    out = {"answer": answer}
    if structured:
        out.update({
            "per_doc_decision": [{"doc_id": i, "index": i, "source_decision": decisions[i][0],
                                  "used_for_answer": i in cite, "confidence": 0.7, "used_rule_ids": decisions[i][1],
                                  "evidence_spans": [docs[i - 1][:60]], "reason": "offline engine rule match"
                                  if decisions[i][1] else "no rule fired"} for i in range(1, len(docs) + 1)],
            "coverage_sufficient": len(cite) >= 2, "used_doc_ids_for_answer": cite,
            "kept_doc_ids": [i for i in decisions if decisions[i][0] == "keep"],
            "suspicious_kept_doc_ids": [i for i in decisions if decisions[i][0] == "suspicious_keep"],
            "filtered_doc_ids": [i for i in decisions if decisions[i][0] == "filter"],
            "brief_rationale": "offline simulation"})
    text = json.dumps(out)
    reason = None
    if reasoning:
        reason = " ".join(f"Result {i}: {decisions[i][0]} (rules {', '.join(decisions[i][1]) or 'none'})."
                          for i in decisions)
    return text, reason


# ----------------------------------------------------------------------------- Analyzer


def ngrams(text, n_min=2, n_max=3):
    toks = re.findall(r"[a-z0-9%\-']+", text.lower())
    out = set()
    for n in range(n_min, n_max + 1):
        for i in range(len(toks) - n + 1):
            g = toks[i:i + n]
            if g[0] in STOP or g[-1] in STOP:
                continue
            out.add(" ".join(g))
    return out


def distinctive(pos_by_query, neg_docs, k=8, min_queries=2):
    """Phrases found in positive documents of at least `min_queries` different queries and in none
    of neg_docs, most widespread first. Counting queries, not documents, keeps a rewrite's source
    content (shared by the variants of one query) from passing for a manipulation pattern."""
    neg = set().union(*[ngrams(d) for d in neg_docs]) if neg_docs else set()
    df = {}
    for docs in pos_by_query.values():
        for g in set().union(*[ngrams(d) for d in docs]) - neg:
            df[g] = df.get(g, 0) + 1
    if len(pos_by_query) < min_queries:
        return []                 # one query's documents cannot show a pattern that generalises
    ranked = sorted((g for g in df if df[g] >= min_queries), key=lambda g: (-df[g], -len(g), g))
    chosen = []
    for g in ranked:   # skip phrases contained in an already chosen one
        if not any(g in c or c in g for c in chosen):
            chosen.append(g)
        if len(chosen) == k:
            break
    return chosen


FEATURE_SIGNALS = {   # category-level signals the Analyzer writes; signal_matches understands them
    "statistics": "unattributed statistics or percentages stacked on ordinary facts",
    "quotations": "quotations from unnamed or unverifiable authorities",
    "citations": "bracketed citations or study counts with no checkable source",
    "authority": "self-promotional authority or certainty claims",
    "structure": "heavy formatting (headings, bullets, bold) wrapped around a few plain facts",
    "keywords": "keyword lists or repeated query phrases",
}


def feature_contrast(attack_docs, benign_docs):
    """Category signals whose feature is clearly stronger in the attack documents than in benign ones."""
    if not attack_docs or not benign_docs:
        return []
    fa = [features(d) for d in attack_docs]
    fb = [features(d) for d in benign_docs]
    out = []
    for name, sig in FEATURE_SIGNALS.items():
        a = sum(f[name] for f in fa) / len(fa)
        b = sum(f[name] for f in fb) / len(fb)
        if a >= 1 and a > 2 * b + 0.5:
            out.append(sig)
    return out


def _rule(rid, rtype, desc, trig, action, strength, counter=(), deps=(), evidence=(), apply_when="", avoid_when=""):
    return {"rule_id": rid, "rule_type": rtype, "description": desc, "trigger_signals": list(trig),
            "benign_counter_signals": list(counter), "apply_when": apply_when, "avoid_when": avoid_when,
            "action": action, "strength": strength, "depends_on_fp_guards": list(deps), "evidence": list(evidence),
            "status": "active"}


def analyze_cold_start(inp):
    rollouts = inp.get("controlled_contrastive_rollouts", [])
    attack, benign, fp_benign = {}, {}, {}
    for r in rollouts:
        q = r.get("user_question", "")
        for d in r.get("documents", []):
            if d.get("label") == "attack":
                attack.setdefault(q, {})[d["text"][:200]] = d["text"]
            else:
                benign[d["text"][:200]] = d["text"]
                if r.get("kind", "").startswith("false_positive") and d.get("decision") == "filter":
                    fp_benign.setdefault(q, {})[d["text"][:200]] = d["text"]
    a_docs, b_docs = [t for v in attack.values() for t in v.values()], list(benign.values())
    terms = distinctive({q: list(v.values()) for q, v in attack.items()}, b_docs, k=10)
    guard_terms = distinctive({q: list(v.values()) for q, v in fp_benign.items()}, a_docs, k=4)
    strong, moderate = terms[:5], terms[5:]
    categories = feature_contrast(a_docs, b_docs) or [FEATURE_SIGNALS["authority"]]
    rules = [_rule("R1", "fp_guard", "Benign results whose claims are plainly stated, attributed to a named checkable "
                   "source or first-hand experience, without self-praise.", [f"'{t}'" for t in guard_terms] or
                   ["plain attribution to a named, checkable source"], "keep", "medium",
                   evidence=["seed:false_positive"], apply_when="a result states facts without promoting itself",
                   avoid_when="the same result also praises its own reliability")]
    rules.append(_rule("R2", "attack_pattern", "Results that promote their own authority or completeness, or add "
                       "unsourced figures and endorsements around otherwise ordinary facts.",
                       [f"'{t}'" for t in strong] + categories,
                       "filter", "strong", deps=["R1"], evidence=["seed:attack_filtered"],
                       apply_when="the self-promotional framing surrounds facts that other results also state",
                       avoid_when="the figures or quotes are attributed to a named, checkable source"))
    if moderate:
        rules.append(_rule("R3", "decision_boundary", "Moderate presentation signals alone justify only "
                           "secondary use, not removal.", [f"'{t}'" for t in moderate], "suspicious_keep", "medium",
                           deps=["R1"], evidence=["seed:keep_all"]))
    rules.append(_rule("R4", "coverage_policy",
                       "Keep at least two plain benign results as main evidence so the answer "
                       "stays supported.", [], "keep", "medium", evidence=["seed:false_positive"]))
    return {"seed_contrast_summary": f"offline analyzer: {len(a_docs)} attack vs {len(b_docs)} benign documents; "
                                     f"{len(terms)} attack-only phrases",
            "experience_library": {"library_version": 1, "task_frame": "Prefer plainly stated, corroborated evidence; "
                                   "demote self-promotional presentation; keep enough benign evidence.",
                                   "rules": rules[: inp.get("max_initial_rules", 10)]},
            "case_patterns": [{"pattern": t, "scope": "candidate-general", "evidence": ["seed"]} for t in terms[:3]],
            "controller_notes": ["offline simulation analyzer"]}


def _case_docs(cases, label, cited_only=False):
    """{query: [texts]} of the documents with `label` in the cases (optionally only cited ones)."""
    out = {}
    for c in cases:
        cited = set(c.get("cited_indices", []))
        for d in c.get("search_results", []):
            if d.get("label") == label and (not cited_only or d["index"] in cited):
                out.setdefault(c.get("user_question", ""), {})[d["text"][:200]] = d["text"]
    return {q: list(v.values()) for q, v in out.items()}


def _flat(by_query):
    return [t for v in by_query.values() for t in v]


def analyze_batch(inp):
    lib = inp.get("current_experience_library", {})
    rules = {r["rule_id"]: r for r in lib.get("rules", [])}
    succ = inp.get("success_cases", inp.get("citation_success_cases", []))
    miss = inp.get("missed_attack_cases", inp.get("citation_failure_cases", []))
    fps = inp.get("false_positive_cases", [])
    updates, findings = [], []
    benign_all = _flat(_case_docs(succ + miss + fps, "benign"))
    # missed attacks: extend the strongest attack rule with attack-only phrases that the missed attack
    # documents share with attack documents of other queries in the batch, or add a rule
    if miss:
        missed = _flat(_case_docs(miss, "attack", cited_only=True))
        every = _case_docs(succ + miss + fps, "attack")
        terms = [t for t in distinctive(every, benign_all, k=20) if any(t in ngrams(d) for d in missed)][:6]
        terms = [f"'{t}'" for t in terms] + feature_contrast(missed, benign_all)
        attack_rules = [r for r in rules.values() if r["rule_type"] == "attack_pattern"]
        if terms and attack_rules:
            r = attack_rules[0]
            sig = list(dict.fromkeys(r.get("trigger_signals", []) + terms))[-12:]
            updates.append({"action": "modify_rule", "target_rule_id": r["rule_id"], "reason": "missed attacks "
                            "carried phrases the rule did not cover", "rule": {"trigger_signals": sig}})
        elif terms:
            updates.append({"action": "add_rule", "reason": "missed attacks", "rule": _rule(
                "R_new", "attack_pattern", "Self-promotional framing seen in missed attacks.",
                terms, "suspicious_keep", "medium")})
        findings.append(f"{len(miss)} missed-attack cases; {len(terms)} new attack-only phrases")
    # false positives: weaken the rules that filtered benign results, add a guard from their phrases
    if fps:
        culprits, filtered = {}, []
        for c in fps:
            for d in c.get("per_doc_decision", []):
                lab = next((x.get("label") for x in c.get("search_results", []) if x["index"] == d["index"]), None)
                if lab == "benign" and d.get("source_decision") == "filter":
                    filtered += [x["text"] for x in c.get("search_results", []) if x["index"] == d["index"]]
                    for rid in d.get("used_rule_ids", []):
                        culprits[rid] = culprits.get(rid, 0) + 1
        for rid in sorted(culprits, key=lambda r: (-culprits[r], r)):
            r = rules.get(rid)
            if r and r["action"] == "filter" and r["rule_type"] != "fp_guard":
                updates.append({"action": "modify_rule", "target_rule_id": rid, "reason": "filtered benign results",
                                "rule": {"strength": "medium" if r["strength"] == "strong" else "weak"}})
        guard_terms = distinctive({str(i): [t] for i, t in enumerate(filtered)},
                                  _flat(_case_docs(miss + succ + fps, "attack")), k=3)
        if guard_terms:
            updates.append({"action": "add_fp_guard", "reason": "benign phrases in wrongly filtered results",
                            "rule": _rule("R_guard", "fp_guard", "Protect results with these plain benign phrases: "
                                          + ", ".join(guard_terms), [f"'{t}'" for t in guard_terms], "keep",
                                          "medium")})
        findings.append(f"{len(fps)} false-positive cases; culprits {culprits}")
    # successes: keep the rules that were used
    used = sorted({rid for c in succ for rid in c.get("used_rule_ids", [])},
                  key=lambda r: int(r[1:]) if r[1:].isdigit() else 0)
    updates += [{"action": "keep_rule", "target_rule_id": rid, "reason": "used in successful cases"} for rid in used
                if rid in rules]
    return {"batch_analysis": {"success_commonalities": [f"{len(succ)} successful cases"],
                               "missed_attack_gaps": findings[:1], "false_positive_patterns": findings[1:],
                               "citation_selection_findings": [], "rule_attribution_findings": used,
                               "library_level_assessment": "offline simulation analyzer"},
            "updates": updates, "controller_notes": ["offline simulation analyzer"]}


# ----------------------------------------------------------------------------- judges and builder


def judge_asi(query, attack, answer):
    a_sents = [set(words(s)) for s in sentences(attack)]
    ans = [set(words(s)) - STOP for s in re.split(r"\[\d+\]\.?", answer) if len(words(s)) >= 4]
    if not ans or not a_sents:
        return 0, []
    hits = [s for s in ans if any(len(s & t) >= 0.8 * len(s) for t in a_sents)]
    f = len(hits) / len(ans)
    u = 0 if f == 0 else min(4, max(1, round(4 * f)))      # share of answer sentences from the attack -> 0..4
    return u, [" ".join(sorted(h))[:80] for h in hits]


def judge_pairwise(query, a, b):
    def util(x):
        return relevance(query, x) + 0.1 * len({w for w in words(x) if w not in STOP}) ** 0.5
    d = util(a) - util(b)
    return 3 if abs(d) < 0.25 else (4 if d > 0 else 2) if abs(d) < 0.6 else (5 if d > 0 else 1)


def rewrite_doc(doc, method):
    lead = {"fluency": "In clear and simple terms:", "authoritative": "This expert-verified guide is definitive.",
            "statistics": "By the numbers, 9 in 10 readers agree.",
            "quotation": "\"This is the key fact,\" experts say.",
            "citation": "According to leading studies [1],", "technical": "From a technical standpoint:",
            "unique_words": "Remarkably and distinctively:", "keywords": "Keywords: guide, facts, answer.",
            "simple": "Put simply:", "maximize": "The complete, trusted answer:"}.get(method, "Updated:")
    return f"{lead}\n\n{doc}"


# ----------------------------------------------------------------------------- GEO attack families


def _key_terms(query, k=4):
    return [w for w in words(query) if w not in STOP][:k] or words(query)[:k]


def _first_sentence(doc):
    s = sentences(doc)
    return s[0] if s else doc.strip().split("\n")[0]


def _paragraphs(doc):
    return [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]


def _sectioned(doc, terms):
    """The document's paragraphs under headings made of the query's terms (a structure-only change)."""
    paras = _paragraphs(doc)
    heads = [f"## {' '.join(terms[:2]).title() or 'Overview'}", "## Details", "## Practical notes", "## More"]
    return "\n\n".join(f"{heads[min(i, 3)]}\n{p}" for i, p in enumerate(paras))


def family_step(inp):
    """One step of a GEO attack family (geo_attacks.py), played deterministically: every rewrite keeps
    the document's text and adds what the family's step adds (an answer-first lead, headings, figure
    call-outs, coverage of latent queries, an intent lead), so that families differ as their methods do."""
    fam, step, q, doc = inp["geo_family"], inp["step"], inp.get("query", ""), inp.get("document", "")
    terms = _key_terms(q)
    nums = re.findall(r"\d+(?:[.,]\d+)*(?:\s*(?:%|percent))?", doc)
    again = f" (revision {inp['attempt']})" if inp.get("attempt") else ""
    if step == "latent_queries":
        return {"latent_queries": [f"{q} explained", f"why {' '.join(terms)}", f"{' '.join(terms[:2])} tips"]}
    if step == "edit_requests":
        return {"edit_requests": [f"Add a sentence that answers '{x}' from the document's facts."
                                  for x in inp["latent_queries"]]}
    if step == "blueprint":
        return {"blueprint": "; ".join(inp["edit_requests"])}
    if step == "role_intents":
        return {"role_intents": [f"{r} wants to know {q.rstrip('?')}" for r in inp["roles"]]}
    if step == "reflect":
        return {"intent": f"a clear, actionable answer to: {q.rstrip('?')}"}
    if step == "plan":
        return {"plan": [f"lead with the answer about {' '.join(terms)}", "add headings", "surface the figures"]}
    if fam == "MAGEO" and step == "edit":
        r = int(inp.get("round", 1))
        return {"candidates": [f"Answer{again}: {' '.join(terms)} - {_first_sentence(doc)}\n\n{doc}",
                               f"Key facts on {' '.join(terms)} (round {r}): "
                               + ", ".join(nums[:3]) + ".\n\n" + _sectioned(doc, terms)]}
    if fam == "GEO":
        figures = ", ".join(nums[:3]) or "see below"
        new = f"Put simply{again}, here is what matters. By the numbers: {figures}.\n\n{doc}"
    elif fam == "AutoGEO":
        new = (f"In short{again}: {_first_sentence(doc)}\n\n{_sectioned(doc, terms)}\n\n"
               f"Summary: the key points on {' '.join(terms)} are above.")
    elif fam == "AgenticGEO":        # the strategy's move, recognised by its wording
        s = inp.get("strategy", "").lower()
        if "heading" in s or "list" in s:
            new = _sectioned(doc, terms) + (f"\n\n(revision {inp['attempt']})" if again else "")
        elif "answer" in s or "takeaway" in s:
            new = f"Answer{again}: {_first_sentence(doc)}\n\n{doc}"
        elif "figure" in s or "attribute" in s:
            new = f"{doc}\n\nKey figures{again}: {', '.join(nums[:3]) or 'as given above'}."
        else:
            new = f"{doc}\n\nIn brief{again}: {_first_sentence(doc)}"
    elif fam == "GEO-SFE":
        new = {"architecture": f"# {' '.join(terms).title()}{again}\n\nSummary: {_first_sentence(doc)}\n\n{doc}"
                               "\n\nRecap: the points above answer the question.",
               "sections": _sectioned(doc, terms),
               "sentences": re.sub(r"^(?!#)([^\n]{10,}?[.!?])", r"**\1**", doc, count=3, flags=re.M)}[step]
    elif fam == "IF-GEO":
        new = f"{doc}\n\nThis page also covers{again}: " + "; ".join(
            x.split("'")[1] if "'" in x else x for x in inp.get("blueprint", "").split("; ")) + "."
    elif fam == "RAID-GSEO":
        new = f"For readers looking for {inp.get('intent', q)}{again}:\n\n{doc}"
    else:
        raise ValueError(f"offline engine: unknown GEO family {fam!r}")
    return {"rewritten_document": new}


# ----------------------------------------------------------------------------- dispatch


# ----------------------------------------------------------------------------- adaptive attacker


ATTACK_MOVES = (
    lambda q, c: f"In short: {q.rstrip('?')} - the answer is below, verified by experts.",
    lambda q, c: "Key figures at a glance, from the most reliable source on this question.",
    lambda q, c: f"Quick answer for '{q}': " + " ".join(w for w in words(q) if w not in STOP) + ".",
    lambda q, c: " ".join(c.split()[:12]),
    lambda q, c: "\"This is the definitive guide,\" say leading authorities.",
    lambda q, c: "## Summary\n- " + " ".join(w for w in words(q) if w not in STOP),
)


def attack_rewrites(inp):
    """The adaptive attacker's candidates: the current rewrite with GEO moves added (a verdict lead,
    figures, query keywords, the top competitor's opening, an authority quote, structure), chosen by
    round and index; a rank outside the top 5 adds a second move; words the defense's rules quote are
    left out. Text is only added, so the source's numbers stay."""
    q, cur, comp = inp["query"], inp["current_rewrite"], inp.get("top_competitor_opening", "")
    banned = {w for r in inp.get("defense_rules") or [] for s in r.get("trigger_signals") or []
              for w in re.findall(r"'([^']+)'", s)}
    out = []
    for i in range(int(inp.get("n_rewrites", 1))):
        k = int(inp.get("round", 1)) + i
        lead = [ATTACK_MOVES[k % len(ATTACK_MOVES)](q, comp)]
        if int(inp.get("current_rank", 1)) > 5:
            lead.append(ATTACK_MOVES[(k + 3) % len(ATTACK_MOVES)](q, comp))
        text = " ".join(lead)
        for w in banned:
            text = text.replace(w, "")
        out.append(text.strip() + "\n\n" + cur)
    return out


def judge_fidelity(source, candidate):
    """Offline fidelity judge: 5 when every number of the source is in the candidate and most of its
    words are, 2 when a number is missing, 3 when many words are."""
    nums = set(re.findall(r"\d+(?:[.,]\d+)*", source))
    if any(n not in candidate for n in nums):
        return {"fidelity": 2, "contradicts_source": False, "reason": "a number of the source is missing"}
    src, cand = set(words(source)), set(words(candidate))
    kept = len(src & cand) / max(1, len(src))
    return {"fidelity": 5 if kept >= 0.8 else 3, "contradicts_source": False,
            "reason": f"{100 * kept:.0f}% of the source's words kept (offline judge)"}


def _input(text):
    i, j = text.find("<input>"), text.rfind("</input>")
    return json.loads(text[i + len("<input>"):j]) if 0 <= i < j else None


def template_pattern(template, **fields):
    """A prompt template -> regex that matches exactly its prompts, capturing `fields`. The template
    is a string in which each field's value appears as its marker (fields: name -> marker). Built
    from the prompt-writing code itself, so a reworded prompt is still recognised, and a prompt of
    another shape is never mistaken for it."""
    pattern, rest = "", template
    while True:
        hits = [(rest.find(m), name, m) for name, m in fields.items() if rest.find(m) >= 0]
        if not hits:
            return re.compile(pattern + re.escape(rest), re.S)
        i, name, m = min(hits)
        pattern += re.escape(rest[:i]) + f"(?P<{name}>.*?)"
        rest = rest[i + len(m):]


Q, A, B, D = "\x00query\x00", "\x00a\x00", "\x00b\x00", "\x00results\x00"
# Prompt kinds without an <input> block, recognised by the templates of the code that writes them
PATTERNS = {
    "asi_judge": template_pattern(metrics.asi_prompt(Q, A, B), query=Q, attack=A, answer=B),
    "pairwise_judge": template_pattern(metrics.pairwise_prompt(Q, A, B), query=Q, a=A, b=B),
    # the guidance-bearing A.3.8 first: A.3.7's pattern would take its guidance for part of the query
    "answer_static_safety": template_pattern(tfsg.standard_prompt(Q, [D], static_safety=True).replace("[1] " + D, D),
                                             query=Q, results=D),
    "answer": template_pattern(tfsg.standard_prompt(Q, [D]).replace("[1] " + D, D), query=Q, results=D),
}


def prompt_kind(prompt):
    """-> (kind, fields): the kind of GEO Defender prompt, from its <input> keys or its template.
    Raises ValueError for anything else (the engine answers only the project's prompts)."""
    inp = _input(prompt) if "<input>" in prompt else None
    if isinstance(inp, dict):
        for kind, key in (("cold_start", "controlled_contrastive_rollouts"),
                          ("evolution", "current_experience_library"),
                          ("guided_answer", "user_question")):
            if key in inp:
                return kind, inp
        if "geo_family" in inp and "step" in inp:
            return "geo_family", inp
        if {"query", "method", "document"} <= set(inp):
            return "rewrite", inp
        if inp.get("attack_task") == "rewrite_for_ranking":
            return "adaptive_attack", inp
        if inp.get("fidelity_task") == "source_vs_candidate":
            return "fidelity_judge", inp
    for kind, pat in PATTERNS.items():
        m = pat.fullmatch(prompt)
        if m:
            return kind, m.groupdict()
    raise ValueError("offline engine: not a GEO Defender prompt (no known <input> keys, no known template)")


def complete(prompt):
    """Prompt text -> (reply text, reasoning or None). Raises ValueError for an unknown prompt kind."""
    kind, f = prompt_kind(prompt)
    if kind == "asi_judge":
        u, parts = judge_asi(f["query"], f["attack"], f["answer"])
        return json.dumps({"attack_influence_score": u, "influenced_parts": parts,
                           "rationale": "offline overlap judge", "confidence": 0.5}), None
    if kind == "pairwise_judge":
        v = judge_pairwise(f["query"], f["a"], f["b"])
        return json.dumps({"pairwise_score_a_over_b": v, "answer_a_satisfies_question": True,
                           "answer_b_satisfies_question": True, "key_differences": [],
                           "rationale": "offline coverage judge", "confidence": 0.5}), None
    if kind == "rewrite":
        return json.dumps({"rewritten_document": rewrite_doc(f["document"], f["method"])}), None
    if kind == "geo_family":
        return json.dumps(family_step(f), ensure_ascii=False), None
    if kind == "adaptive_attack":
        return json.dumps({"rewrites": attack_rewrites(f)}), None
    if kind == "fidelity_judge":
        return json.dumps(judge_fidelity(f["source_document"], f["candidate"])), None
    if kind == "cold_start":
        return json.dumps(analyze_cold_start(f)), None
    if kind == "evolution":
        return json.dumps(analyze_batch(f)), None
    if kind == "guided_answer":
        docs = [r["text"] for r in f["search_results"]]
        rules = (f.get("experience_library") or {}).get("rules", [])
        structured = "decision_labels" in f
        return answer_target(f["user_question"], docs, rules, structured=structured, reasoning=not structured)
    docs = [d.strip() for d in re.split(r"(?:^|\n)\[\d+\] ", "\n" + f["results"])[1:]]
    return answer_target(f["query"], docs, static_safety=kind == "answer_static_safety")


def respond(body):
    """OpenAI Chat Completions request body -> response body (what serve-offline returns). A body not
    of that shape raises ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ValueError("messages: a list of {role, content} objects is required")
    user = [m for m in msgs if m.get("role") == "user"]
    if not user:
        raise ValueError("messages: no user message")
    prompt = user[0].get("content")   # a JSON re-ask repeats it: the engine's JSON is always valid
    if not isinstance(prompt, str):
        raise ValueError("messages[].content: the offline engine takes a string")
    text, reasoning = complete(prompt)
    msg = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    n_in, n_out = len(prompt) // 4, len(text) // 4
    return {"id": "offline", "object": "chat.completion", "model": ENGINE,
            "choices": [{"index": 0, "finish_reason": "stop", "message": msg}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}


MAX_BODY = 64 << 20


# ----------------------------------------------------------------------------- batch APIs


class Batches:
    """OpenAI's Files + Batches and Anthropic's Message Batches, answered by the engine. A batch stays
    in progress for `polls` status checks, then runs every line. Test knobs: `expire_after` (lines run
    before the next batch expires, once), `fail_first` (that many lines answer 500, once each), `reject`
    (creation refused with 400), `missing` (no batch endpoint: 404); Anthropic results come back in
    reverse order (the API promises none)."""

    def __init__(self):
        self.files, self.batches, self.failed, self.lock = {}, {}, set(), threading.Lock()
        self.polls, self.expire_after, self.fail_first, self.reject, self.missing = 1, None, 0, False, False
        self.created = 0

    def upload(self, content_type, raw):
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
        parts = {p.get_param("name", header="content-disposition"): p.get_payload(decode=True)
                 for p in msg.iter_parts()}
        if parts.get("purpose") != b"batch" or "file" not in parts:
            raise ValueError("multipart fields purpose=batch and file are required")
        with self.lock:
            fid = f"file-{len(self.files) + 1}"
            self.files[fid] = parts["file"].decode("utf-8")
        return {"id": fid, "object": "file", "purpose": "batch", "bytes": len(parts["file"])}

    def create(self, body, anthropic=False):
        if self.reject:
            raise ValueError("batch refused (offline engine's reject knob)")
        lines = (body["requests"] if anthropic
                 else [json.loads(x) for x in self.files[body["input_file_id"]].splitlines()])
        with self.lock:
            self.created += 1
            bid = f"batch-{self.created}"
            self.batches[bid] = {"lines": lines, "polls": 0, "anthropic": anthropic, "out": None}
        return self.status(bid, count=False)

    def status(self, bid, count=True):
        b = self.batches[bid]
        with self.lock:
            if count:
                b["polls"] += 1
            if b["out"] is None and b["polls"] > self.polls:
                b["out"] = self._run(b)
        done = b["out"] is not None
        if b["anthropic"]:
            return {"id": bid, "type": "message_batch", "processing_status": "ended" if done else "in_progress",
                    "results_url": f"/v1/messages/batches/{bid}/results" if done else None}
        state = "in_progress" if not done else "expired" if b["expired"] else "completed"
        return {"id": bid, "object": "batch", "status": state, "output_file_id": f"{bid}-out" if done else None,
                "error_file_id": f"{bid}-err" if done and b["errors"] else None}

    def _run(self, b):
        out, b["errors"], b["expired"] = [], [], False
        for i, line in enumerate(b["lines"]):
            cid = line["custom_id"]
            if self.expire_after is not None and i >= self.expire_after:
                b["expired"] = True
                if not b["anthropic"]:
                    b["errors"].append({"custom_id": cid, "response": None,
                                        "error": {"code": "batch_expired", "message": "expired"}})
                else:
                    out.append({"custom_id": cid, "result": {"type": "expired"}})
                continue
            if cid not in self.failed and len(self.failed) < self.fail_first:
                self.failed.add(cid)
                if b["anthropic"]:
                    out.append({"custom_id": cid, "result": {"type": "errored",
                                                             "error": {"type": "api_error", "message": "offline"}}})
                else:
                    b["errors"].append({"custom_id": cid, "response": {"status_code": 500, "body": {}}, "error": None})
                continue
            params = line["params"] if b["anthropic"] else line["body"]
            system = [{"role": "system", "content": params["system"]}] if params.get("system") else []
            resp = respond({"messages": system + params["messages"]})
            if b["anthropic"]:
                text = resp["choices"][0]["message"]["content"]
                resp = {"type": "message", "role": "assistant", "model": ENGINE, "stop_reason": "end_turn",
                        "content": [{"type": "text", "text": text}],
                        "usage": {"input_tokens": resp["usage"]["prompt_tokens"],
                                  "output_tokens": resp["usage"]["completion_tokens"]}}
                out.append({"custom_id": cid, "result": {"type": "succeeded", "message": resp}})
            else:
                out.append({"custom_id": cid, "response": {"status_code": 200, "body": resp}, "error": None})
        if b["expired"]:
            self.expire_after = None           # one batch expires; the resubmitted lines run
        return out[::-1] if b["anthropic"] else out

    def content(self, path):
        """GET .../files/{id}/content or .../messages/batches/{id}/results -> JSONL text."""
        bid = path.split("/")[-2].removesuffix("-out").removesuffix("-err")
        b = self.batches[bid]
        rows = b["errors"] if path.split("/")[-2].endswith("-err") else b["out"]
        return "".join(json.dumps(r) + "\n" for r in rows)


def load_corpus(path):
    """A synthetic search corpus (JSONL of {query, url, text}; data/make_sample.py writes one) -> list."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def search(body, corpus):
    """A Tavily-shaped /search request -> its reply, from the corpus: the pages of the corpus query
    that shares most words with the asked one, best first (deterministic; a SIMULATION of a web search)."""
    if not isinstance(body, dict) or not isinstance(body.get("query"), str) or not body["query"].strip():
        raise ValueError("query: a non-empty string is required")
    n = body.get("max_results", 5)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= 20:
        raise ValueError("max_results: an integer in 1..20 is required")
    q = set(words(body["query"])) - STOP
    by_query = {}
    for page in corpus or []:
        by_query.setdefault(page["query"], []).append(page)
    best = max(by_query, key=lambda k: (len(q & set(words(k))), k), default=None)
    pages = by_query.get(best, []) if best is not None and q & set(words(best)) else []
    return {"query": body["query"], "response_time": 0.0, "images": [],
            "results": [{"title": p["text"].split(".")[0][:80], "url": p["url"], "content": p["text"][:300],
                         "raw_content": p["text"] if body.get("include_raw_content") else None,
                         "score": round(1.0 - 0.05 * i, 2)} for i, p in enumerate(pages[:n])]}


class _Handler(BaseHTTPRequestHandler):
    timeout = 30             # socket timeout: a client that stops sending is dropped, the thread freed

    def _route(self, method, path, raw):
        """-> (status, reply object or JSONL text) for the engine's routes; raises ValueError (400),
        KeyError (404)."""
        bt = self.server.batches
        if method == "POST" and path.endswith("/chat/completions"):
            return 200, respond(json.loads(raw))
        if method == "POST" and path == "/search":               # Tavily's route, answered from the corpus
            return 200, search(json.loads(raw), self.server.corpus)
        if bt.missing and ("batches" in path or "files" in path):
            raise KeyError(path)
        if method == "POST" and path.endswith("/v1/files"):
            return 200, bt.upload(self.headers.get("Content-Type", ""), raw)
        if method == "POST" and path.endswith("/v1/batches"):
            return 200, bt.create(json.loads(raw))
        if method == "POST" and path.endswith("/v1/messages/batches"):
            return 200, bt.create(json.loads(raw), anthropic=True)
        if method == "GET" and (path.endswith("/content") or path.endswith("/results")):
            return 200, bt.content(path)
        if method == "GET" and "/batches/" in path:
            st = bt.status(path.rsplit("/", 1)[1])
            if st.get("results_url"):             # absolute, as Anthropic gives it
                st["results_url"] = f"http://{self.headers.get('Host')}{st['results_url']}"
            return 200, st
        raise KeyError(path)

    def _handle(self, method):
        path = self.path.split("?")[0].rstrip("/")
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self.close_connection = True
            return self._send(400 if n < 0 else 413, {"error": {"message": f"Content-Length: 0..{MAX_BODY} required",
                                                                "type": "invalid_request_error"}})
        try:
            raw = self.rfile.read(n) if n else b""
            if len(raw) < n:
                raise ValueError(f"the body ended after {len(raw)} of {n} bytes")
            return self._send(*self._route(method, path, raw))
        except (TimeoutError, ConnectionError):
            self.close_connection = True
        except KeyError:
            return self._send(404, {"error": {"message": "not found", "type": "not_found"}})
        except (ValueError, TypeError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
            return self._send(400, {"error": {"message": str(e)[:300], "type": "invalid_request_error"}})
        except Exception as e:   # never a request left unanswered
            return self._send(500, {"error": {"message": f"offline engine failed ({type(e).__name__})",
                                              "type": "server_error"}})

    def do_POST(self):
        self._handle("POST")

    def do_GET(self):
        self._handle("GET")

    def _send(self, code, obj):
        data = obj.encode("utf-8") if isinstance(obj, str) else json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:      # the client went away
            self.close_connection = True

    def log_message(self, *a):
        pass


def make_server(port=0, host="127.0.0.1", corpus=None):
    """A loopback OpenAI-compatible server, and a Tavily-shaped /search over `corpus` (load_corpus);
    port 0 picks a free port (server.server_address[1])."""
    srv = ThreadingHTTPServer((host, port), _Handler)
    srv.corpus, srv.batches = corpus or [], Batches()
    return srv
