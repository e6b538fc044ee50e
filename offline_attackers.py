"""The offline engine's rewriters (a SIMULATION, offline.py's): the benchmark builder's GEO families
step by step (`family_step`, each family's prompts answered by a method-specific, fact-keeping rewrite),
the adaptive attacker's rewrites (`attack_rewrites`), the diagnose-and-repair attacker's small edits
(`repair_rewrites`) and the fidelity judge of a rewrite against its source (`judge_fidelity`). Each reply
is a function of its input alone: an attacker's seed shifts its choices, no clock or randomness does.

Usage: family_step(inp); attack_rewrites(inp); repair_rewrites(inp); judge_fidelity(source, candidate)
"""
import hashlib
import json
import re
import zlib

from offline_target import STOP, answer_target, sentences, words


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
    best = sents[max(range(len(sents)), key=lambda i: (len(q & set(words(sents[i]))), -i))] if sents else doc
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
