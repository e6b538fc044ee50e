"""Offline engine: a deterministic SIMULATION of the LLMs GEO Defender talks to (target, Analyzer, judges,
the benchmark builder's families, the adaptive attacker).

It answers every prompt the project sends by reading the prompt's own content (the JSON <input>
block, the numbered search results, the judge fields), never labels it was not shown. It is
plumbing: its numbers say nothing about real LLMs. The kind of a prompt comes from its <input>
keys, or, for the prompts without one (A.3.7/A.3.8 and the judges), from the template of the
function that writes it (`tfsg.standard_prompt`, `metrics.asi_prompt`, `metrics.pairwise_prompt`:
`prompt_kind`); anything else is refused with an error.

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
- benchmark builder rewrites: a method-specific, fact-keeping rewrite of the given document; the
  honest editor (build-bench --honest) re-cuts its paragraphs under a heading of its own words.

Every reply is a function of its request alone: no clock, no randomness, and no set's order (which
follows the process's hash seed) reaches a reply, so a killed run resumes to the same answers.

Usage: respond({"messages": [...]})  (a Chat Completions body -> its reply; in process as
       make_client("offline", handler=offline.respond), over loopback HTTP by offline_server.py)
"""
import hashlib
import json
import re
import zlib

import defenses
import metrics
import tfsg

ENGINE = "offline-engine"
CREATED = 0   # a reply's `created` (Unix seconds, an int in OpenAI's chat completion object): a constant, not the
              # clock, so that a reply is a function of its request alone
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
    # successes: keep the rules that were used, by number, then name ('R01' and 'R1', or two ids without a
    # number, would otherwise keep the set's order, which follows the hash seed)
    used = sorted({rid for c in succ for rid in c.get("used_rule_ids", [])},
                  key=lambda r: (int(r[1:]) if r[1:].isdigit() else 0, r))
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


# ----------------------------------------------------------------------------- injection defenses
# The prompts of defenses.py, each recognised exactly (its template, or its <input> key with the whole
# prompt rebuilt and compared) and played as simply as the rest of this engine: plumbing, never a
# measure of those defenses. Spotlighting and the Sandwich Prompt: the target answers without the
# weight it gives a document's claims about itself (authority markers); PromptArmor's remover quotes
# the sentences with promotional or authority markers; RobustRAG's isolated answer restates the
# question's terms and quotes the document's most relevant sentence, citing [1] ("I don't know." when
# no query term is in it); its keyword answer lists the kept phrases.

SYSTEM_JOIN = "\n\n[user message]\n\n"   # between the system messages and the user message the engine reads
PROMOTION = AUTHORITY + ["this page", "this guide", "this article", "keywords:", "by the numbers",
                         "for readers looking for", "also covers"]
DEFENSE_INPUTS = {"document_to_screen": "remover", "single_search_result": "isolated_answer",
                  "key_phrases": "keyword_answer"}


def with_system(messages, user):
    """The text the engine reads: the first user message `user`, after the system messages when
    there are any (the defenses put their rules there)."""
    system = [m.get("content") for m in messages if m.get("role") == "system"]
    if not all(isinstance(s, str) for s in system):
        raise ValueError("messages[].content: the offline engine takes a string")
    return "\n\n".join(system) + SYSTEM_JOIN + user if system else user


def chat_text(messages):
    """with_system for a message list the project writes (its first user message)."""
    return with_system(messages, next(m["content"] for m in messages if m["role"] == "user"))


def defense_input(inp, prompt):
    """-> (kind, inp) of a defense prompt with an <input> block, if rebuilding it from its input
    gives exactly `prompt`; ValueError otherwise (a prompt of another shape is not guessed at)."""
    kind = next(DEFENSE_INPUTS[k] for k in DEFENSE_INPUTS if k in inp)
    rebuilt = {"remover": lambda: defenses.remover_messages(inp.get("document_to_screen")),
               "isolated_answer": lambda: defenses.isolated_messages(inp.get("question"),
                                                                     inp.get("single_search_result")),
               "keyword_answer": lambda: defenses.keyword_messages(inp.get("question"), inp.get("key_phrases"))}[kind]
    if chat_text(rebuilt()) != prompt:
        raise ValueError(f"offline engine: {kind}: the prompt is not as defenses.py writes it")
    return kind, inp


def answer_unswayed(query, docs):
    """The target's answer with no weight on a document's claims about itself: the top three by the
    engine's attractiveness less its authority term."""
    def score(i):
        return attractiveness(query, docs[i - 1]) - 0.5 * min(features(docs[i - 1], query)["authority"], 4)
    cite = sorted(range(1, len(docs) + 1), key=lambda i: (-score(i), i))[:3]
    return {"answer": write_answer(query, docs, cite)}


def screen(doc):
    """PromptArmor's remover: the sentences (as written) that hold a promotional or authority marker."""
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", doc)
             if s.strip() and any(m in s.lower() for m in PROMOTION)]
    return {"manipulative": bool(found), "passages": found}


def isolated_answer(query, doc):
    """RobustRAG's answer from one document: its sentence most relevant to the query, after the
    query's terms, citing [1]; "I don't know." when the document holds no query term."""
    best = max(sentences(doc), key=lambda s: relevance(query, s), default=None)
    if best is None or relevance(query, doc) == 0:
        return {"answer": "I don't know."}
    terms = " ".join(w for w in words(query) if w not in STOP)
    best = re.sub(r"\s*\[[\d,\s\-–]+\]", "", best).rstrip(".")   # the document's own references are not ours
    return {"answer": f"On {terms}: {best} [1]."}


def keyword_answer(phrases):
    """RobustRAG's final answer from the kept phrases, three to a sentence (at most nine)."""
    if not phrases:
        return {"answer": "I don't know."}
    parts = [phrases[i:i + 3] for i in range(0, min(len(phrases), 9), 3)]
    return {"answer": " ".join("The sources agree on " + (", ".join(p[:-1]) + " and " if len(p) > 1 else "")
                               + p[-1] + "." for p in parts)}


def play_defense(kind, f):
    """A defense prompt's fields -> the engine's JSON reply."""
    if kind == "answer_spotlight":
        docs = [re.sub(r"^\[\d+\] ", "", line).replace(defenses.MARKER, " ") for line in f["results"].split("\n")]
        return answer_unswayed(f["query"], docs)
    if kind == "answer_sandwich":
        block = defenses.read_block("search_results", f["results"])
        return answer_unswayed(f["query"], [r["text"] for r in block])
    if kind == "remover":
        return screen(f["document_to_screen"])
    if kind == "isolated_answer":
        return isolated_answer(f["question"], f["single_search_result"])
    return keyword_answer(f["key_phrases"])


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


def _again(inp):
    return f" (revision {inp['attempt']})" if inp.get("attempt") else ""


def _figures(doc, k=3):
    return re.findall(r"\d+(?:[.,]\d+)*(?:\s*(?:%|percent))?", doc)[:k]


def _topic(doc):
    """A document's topic words (no query needed): its most frequent content words."""
    counts = {}
    for w in words(doc):
        if w not in STOP and len(w) > 3 and not w.isdigit():
            counts[w] = counts.get(w, 0) + 1
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]] or ["topic"]


def _emphasised(doc, n=2):
    """The first n sentence openings in bold (micro-level emphasis)."""
    return re.sub(r"^(?![#|*-])([^\n]{12,}?[.!?])", r"**\1**", doc, count=n, flags=re.M)


def _agentic(inp):
    """AgenticGEO (F1): the critic's ranking (by a digest of the current text and each id: it depends on
    the content) and each strategy's move, recognised by its type word in the strategy text."""
    doc, q = inp.get("current_document", ""), inp.get("query", "")
    if "strategies" in inp:
        ids = [s["id"] for s in inp["strategies"]]
        return {"ranking": sorted(ids, key=lambda x: hashlib.sha1((doc + x).encode()).hexdigest())}
    s, again, terms = inp["strategy"].lower(), _again(inp), _key_terms(q)
    moves = [("expert", f"Verified by experts{again}: {_first_sentence(doc)}\n\n{doc}"),
             ("credible", f"{doc}\n\nAccording to the sources named above{again}, these points hold."),
             ("quantitative", f"{doc}\n\nBy the numbers{again}: {', '.join(_figures(doc)) or 'as given above'}."),
             ("quotable", f'"{_first_sentence(doc)}"{again}\n\n{doc}'),
             ("smoothly", f"{doc}\n\nPut together{again}, these facts give the definitive answer."),
             ("plain words", f"In plain words{again}: {_first_sentence(doc)}\n\n{doc}"),
             ("key terms", f"## {' '.join(terms).title() or 'Overview'}{again}\n\n{doc}")]
    return {"rewritten_document": next((t for k, t in moves if k in s), f"{doc}\n\nIn brief{again}: "
                                       f"{_first_sentence(doc)}")}


def _mageo(step, inp):
    """MAGEO (F3): profile, plan, two candidates, predicted scores, and the simulated engine's answer."""
    if step == "profile":
        return {"format_preferences": ["headings", "lists"], "content_preferences": ["figures", "named sources"],
                "style_preferences": ["direct answers"], "risk_constraints": ["unsupported claims"],
                "summary": "prefers direct, structured, sourced answers"}
    if step == "engine":
        docs = [d["text"] for d in inp["documents"]]
        return json.loads(answer_target(inp["query"], docs)[0])
    doc, q, again, r = inp.get("current_document", ""), inp.get("query", ""), _again(inp), int(inp.get("round", 1))
    terms = _key_terms(q)
    if step == "plan":
        return {"plan_steps": [{"edit_type": t, "target_span": "opening", "rationale": "visibility",
                                "operations": [op]} for t, op in (("Structure", "lead with the answer"),
                                                                  ("Evidence", "surface the figures"))]}
    if step == "edit":
        first, figs = _first_sentence(doc), ", ".join(_figures(doc)) or "see below"
        return {"candidates": [
            {"revised_content": f"Answer verified by experts{again}, round {r}: {first}\n\n{doc}",
             "applied_edit_ops": [{"edit_type": "Structure", "target_span": "opening", "op_pattern": "answer lead"}]},
            {"revised_content": f"Key facts by the numbers (round {r}){again}: {figs}.\n\n{_sectioned(doc, terms)}",
             "applied_edit_ops": [{"edit_type": "Evidence", "target_span": "opening", "op_pattern": "figures lead"}]}]}
    if step == "evaluate":
        return {"evaluations": [{"candidate": c["candidate"], "visibility": 6 + (c["candidate"] + r) % 3,
                                 "position": 6, "faithfulness": 8, "attribution": 7} for c in inp["candidates"]]}
    raise ValueError(f"offline engine: unknown MAGEO step {step!r}")


def _ifgeo(step, inp):
    """IF-GEO (F6): latent queries from the document's topic words, one request each, the converge steps."""
    doc, again = inp.get("document", ""), _again(inp)
    if step == "mine":
        t = _topic(doc)
        return {"queries": [{"query": q, "probability": p} for q, p in
                            ((f"what is {t[0]}", 90), (f"{t[0]} {t[-1]} facts", 80), (f"how {t[0]} works", 75),
                             (f"{t[0]} figures", 70), (f"{t[0]} tips", 60))]}
    if step == "request":
        q = inp["latent_query"]
        return {"suggestions": [{"excerpt": _first_sentence(doc)[:60], "necessity": 70 + len(q) % 20,
                                 "suggestion": f"add a sentence that answers '{q}' from the document's facts"},
                                {"excerpt": "", "suggestion": "reword a passage", "necessity": 30}]}
    if step == "dedup":
        seen, out = {}, []
        for r in inp["requests"]:
            if r["suggestion"] not in seen:
                seen[r["suggestion"]] = r
                out.append({**r, "merged_ids": [r["id"]], "topic": r["latent_query"]})
        return {"requests": out}
    if step == "conflicts":
        return {"instructions": [{"id": r["id"], "excerpt": r.get("excerpt", ""), "suggestion": r["suggestion"]}
                                 for r in inp["requests"]]}
    if step == "blueprint":
        return {"revision_blueprint": [{"section_name": "end", "target_location": "after the last paragraph",
                                        "modification_intent": "cover the latent queries",
                                        "directives": [x["suggestion"] for x in inp["instructions"]],
                                        "format_note": "one line"}]}
    if step == "revise":
        asks = [re.search(r"'([^']+)'", d) for b in inp["revision_blueprint"] for d in b["directives"]]
        return {"rewritten_document": f"{doc}\n\nThis page also answers{again}: "
                                      + "; ".join(m.group(1) for m in asks if m) + "."}
    raise ValueError(f"offline engine: unknown IF-GEO step {step!r}")


def _raid(step, inp):
    """RAID G-SEO (F7): summary, intent, 4W reflection, plan and rewrite, from the content alone."""
    doc, t = inp.get("document", ""), _topic(inp.get("document", ""))
    if step == "summary":
        return {"summary": _first_sentence(doc)}
    if step == "intent":
        return {"primary_intent": f"understand {' '.join(t[:2])}"}
    if step == "reflect":
        return {"roles": [{"role": "newcomer", "needs": "basics", "mismatch": "jargon"},
                          {"role": "practitioner", "needs": "steps", "mismatch": "missing steps"}],
                "generalized_intent": f"understand and apply {' '.join(t[:2])}"}
    if step == "plan":
        return {"steps": [f"open with what a reader needs about {t[0]}", "make the steps explicit"]}
    if step == "rewrite":
        return {"rewritten_document": f"What you need to know about {' '.join(t[:2])}{_again(inp)}:\n\n{doc}\n\n"
                                      f"Next step: {_first_sentence(doc)}"}
    raise ValueError(f"offline engine: unknown RAID-GSEO step {step!r}")


def _honest(inp):
    """The honest editor (H1, build-bench --honest): the document under a heading of its own most frequent
    word, its paragraphs re-cut to at most two sentences each; no number, quotation, name or claim added
    (the attempt number is not written: it would be a new number)."""
    doc = inp["document"]
    paras = []
    for p in _paragraphs(doc):
        s = re.split(r"(?<=[.!?])\s+", " ".join(p.split()))
        paras += [" ".join(s[i:i + 2]) for i in range(0, len(s), 2)]
    return {"rewritten_document": f"## {_topic(doc)[0].capitalize()}\n\n" + "\n\n".join(paras)}


def family_step(inp):
    """One step of a GEO attack family (geo_attacks.py), played deterministically from the opaque marker
    ("rewrite_task": "F<n>.<step>"): every rewrite keeps the document's text and adds what the family's
    step adds (a confident lead, figures, headings and emphasis, latent-query coverage, an intent lead),
    so that the families differ as their methods do; "H1.edit" is the honest editor (_honest). Plumbing,
    not the papers' rewriters."""
    code, _, step = inp["rewrite_task"].partition(".")
    doc, again = inp.get("document", ""), _again(inp)
    if code == "H1" and step == "edit":
        return _honest(inp)
    if code == "F1":
        return _agentic(inp)
    if code == "F3":
        return _mageo(step, inp)
    if code == "F6":
        return _ifgeo(step, inp)
    if code == "F7":
        return _raid(step, inp)
    if code == "F4" and step == "fluency":
        new = f"Put simply{again}, here is what matters.\n\n{doc}"
    elif code == "F4" and step == "statistics":
        new = f"{doc}\n\nBy the numbers: {', '.join(_figures(doc)) or 'as stated above'}."
    elif code == "F2":
        new = (f"In short{again}: {_first_sentence(doc)}\n\n{_sectioned(doc, _topic(doc))}\n\n"
               f"Synthesis: the main points on {' '.join(_topic(doc)[:2])} are above.")
    elif code == "F5" and step in ("macro", "meso", "micro"):
        t = _topic(doc)
        new = {"macro": f"# {' '.join(t).title()}{again}\n\n## Overview\n\n{doc}\n\n### See also\n\nthe overview",
               "meso": f"{doc}\n\n- " + "\n- ".join(_figures(doc) or [t[0]]),
               "micro": _emphasised(doc)}[step]
    else:
        raise ValueError(f"offline engine: unknown family step {inp['rewrite_task']!r}")
    return {"rewritten_document": new}


# ----------------------------------------------------------------------------- adaptive attacker


ATTACK_MOVES = (
    lambda q, c: f"In short: {q.rstrip('?')} - the answer is below, verified by experts.",
    lambda q, c: "Key figures at a glance, from the most reliable source on this question.",
    lambda q, c: f"Quick answer for '{q}': " + " ".join(w for w in words(q) if w not in STOP) + ".",
    lambda q, c: " ".join(c.split()[:12]),
    lambda q, c: "\"This is the definitive guide,\" say leading authorities.",
    lambda q, c: "## Summary\n- " + " ".join(w for w in words(q) if w not in STOP),
)


def strip_phrases(text, phrases):
    """`text` with every occurrence of `phrases` removed, longest phrase first (then alphabetically), again
    until none is left. A fixed order because overlapping phrases ('by experts', 'verified by') leave
    different text in different orders, and a set's order changes with the process's hash seed."""
    order = sorted({p for p in phrases if p}, key=lambda p: (-len(p), p))
    while any(p in text for p in order):   # a removal can join two halves of a phrase
        for p in order:
            text = text.replace(p, "")
    return text


def attack_rewrites(inp):
    """The adaptive attacker's candidates: the current rewrite with GEO moves added (a verdict lead,
    figures, query keywords, the top competitor's opening, an authority quote, structure), chosen by
    round and index; a rank outside the top 5 adds a second move; words the defense's rules quote are
    left out. Text is only added, so the source's numbers stay."""
    q, cur, comp = inp["query"], inp["current_rewrite"], inp.get("top_competitor_opening", "")
    banned = {w for r in inp.get("defense_rules") or [] for s in r.get("trigger_signals") or []
              for w in re.findall(r"'([^']+)'", s)}
    out = []
    shift = zlib.crc32(str(inp["attacker_seed"]).encode()) if "attacker_seed" in inp else 0   # another attacker
    for i in range(int(inp.get("n_rewrites", 1))):
        k = int(inp.get("round", 1)) + i + shift
        lead = [ATTACK_MOVES[k % len(ATTACK_MOVES)](q, comp)]
        if int(inp.get("current_rank", 1)) > 5:
            lead.append(ATTACK_MOVES[(k + 3) % len(ATTACK_MOVES)](q, comp))
        out.append(strip_phrases(" ".join(lead), banned).strip() + "\n\n" + cur)
    return out


# the diagnose-and-repair attacker's failure modes (attack.REPAIR_MODES), in the order a rewrite tries them
REPAIRS = ("answer_buried", "query_terms_missing", "hard_to_extract", "weaker_than_competitor")


def _sentences(text):
    return [s for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip()]


def repair(mode, query, doc):
    """One repair of `doc` for a failure mode, moving, splitting or restating its own sentences (the
    query's words added only as a heading): every fact stays."""
    sents = _sentences(doc)
    q = set(words(query))
    best = max(sents, key=lambda s: (len(q & set(words(s))), -sents.index(s))) if sents else doc
    if mode == "answer_buried":
        rest = doc.replace(best, "", 1).strip()
        return f"{best}\n\n{rest}"
    if mode == "query_terms_missing":
        return f"## {query[:1].upper() + query[1:]}\n\n{doc}"
    if mode == "hard_to_extract":
        return doc.replace(best, re.sub(r",\s+", ". ", best), 1)
    return f"In short: {best}\n\n{doc}"


def repair_rewrites(inp):
    """The diagnose-and-repair attacker offline -> (failure mode, rewrites): the mode from the document's
    shape (the sentence sharing most words with the query not first: answer_buried; the query's words
    missing from the opening: query_terms_missing; else hard_to_extract), each rewrite one repair, the
    diagnosed one first (another attacker seed starts elsewhere)."""
    q, cur = inp["query"], inp["current_rewrite"]
    sents = _sentences(cur)
    qw = set(words(q))
    overlap = [len(qw & set(words(s))) for s in sents] or [0]
    opening = set(words(" ".join(sents[:1])))
    mode = ("answer_buried" if overlap.index(max(overlap)) > 0 else
            "query_terms_missing" if not qw <= opening else "hard_to_extract")
    shift = zlib.crc32(str(inp["attacker_seed"]).encode()) if "attacker_seed" in inp else 0
    first = REPAIRS.index(mode) + shift
    return mode, [repair(REPAIRS[(first + i) % len(REPAIRS)], q, cur) for i in range(int(inp.get("n_rewrites", 1)))]


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


# ----------------------------------------------------------------------------- dispatch


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
    # the defenses' system + user prompts (with_system), their documents captured whole
    "answer_spotlight": template_pattern(chat_text(defenses.spotlight_messages(Q, [D])).replace("[1] " + D, D),
                                         query=Q, results=D),
    "answer_sandwich": template_pattern(chat_text(defenses.sandwich_messages(Q, [D])).replace(
        defenses.results_block([D]), D), query=Q, results=D),
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
        if isinstance(inp.get("rewrite_task"), str):
            return "geo_family", inp
        if {"query", "method", "document"} <= set(inp):
            return "rewrite", inp
        if inp.get("attack_task") == "rewrite_for_ranking":
            return "adaptive_attack", inp
        if inp.get("attack_task") == "diagnose_and_repair":
            return "repair_attack", inp
        if inp.get("fidelity_task") == "source_vs_candidate":
            return "fidelity_judge", inp
        if DEFENSE_INPUTS.keys() & inp.keys():
            return defense_input(inp, prompt)
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
    if kind == "repair_attack":
        mode, rewrites = repair_rewrites(f)
        return json.dumps({"failure_mode": mode, "evidence": "offline shape check", "rewrites": rewrites}), None
    if kind == "fidelity_judge":
        return json.dumps(judge_fidelity(f["source_document"], f["candidate"])), None
    if kind == "cold_start":
        return json.dumps(analyze_cold_start(f)), None
    if kind == "evolution":
        return json.dumps(analyze_batch(f)), None
    if kind in ("answer_spotlight", "answer_sandwich") or kind in DEFENSE_INPUTS.values():
        return json.dumps(play_defense(kind, f), ensure_ascii=False), None
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
    prompt = with_system(msgs, prompt)
    text, reasoning = complete(prompt)
    msg = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    n_in, n_out = len(prompt) // 4, len(text) // 4
    return {"id": "offline", "object": "chat.completion", "created": CREATED, "model": ENGINE,
            "choices": [{"index": 0, "finish_reason": "stop", "message": msg}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
