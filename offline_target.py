"""The offline engine's target LLM (a SIMULATION, offline.py's): the surface features GEO amplifies,
query relevance, an experience library's rules applied to each search result, and the cited answer.

It scores each search result by query-word overlap plus the surface features GEO amplifies
(statistics, quotations, cited sources, authority phrasing, structure, keyword repetition) and cites
the top three, so that rewritten documents win as they do against real engines. The static safety
guidance halves the weight of polish features and slightly demotes results with obvious
self-promotion or keyword lists. With an experience library it applies each active rule (`decide`).
Every answer is a function of its input alone (offline.py's docstring says why).

Usage: answer_target(query, docs, rules)  -> (reply text, reasoning or None)
"""
import json
import re


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
        "statistics": len(re.findall(r"(?<!\d)\d+(?:\.\d+)?\s*(?:%|percent)|\b\d+ in \d+\b|by the numbers", low)),
        "quotations": len(re.findall(r"[\"“][^\"“”]{10,}[\"”]", text or "")),
        "citations": len(re.findall(r"\[\d+\]|according to|as documented by|peer-reviewed|studies", low)),
        "authority": sum(low.count(a) for a in AUTHORITY),
        "structure": len(re.findall(r"^[^\S\n]*(?:#{1,6} |- |\* )|\*\*", text or "", re.M)),
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


# a bracketed reference list ([3], [1, 2], [4; 5], [2-4]), as tfsg.cited and metrics.cited_indices read one
REFERENCE = re.compile(r"\s*\[\s*\d[\d\s,;\-–]*\]")


def write_answer(query, docs, cite):
    """One or two sentences from each cited result, each followed by its citation."""
    out = []
    for i in cite:
        for s in sentences(docs[i - 1])[:1]:
            s = REFERENCE.sub("", s)            # the document's own bracket references are not ours
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
