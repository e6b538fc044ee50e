"""The paper's seven GEO attack families as document rewriters, for building GEO-DefenseBench (paper
B.1.1): AgenticGEO, AutoGEO and MAGEO (seen in construction), GEO, GEO-SFE, IF-GEO and RAID-GSEO
(unseen). What they share (the job and context, the JSON prompt, the fidelity gate every rewrite passes)
is geo_jobs.py's. Beside them, not an attack and not in FAMILIES: the honest editor (honest.py),
clearer wording and structure with nothing GEO adds, on which eval and rerank-eval measure whether a
defense punishes honest optimisation.

Each family is the algorithm of its own paper and its authors' code where public (inputs, goal,
steps, selection), in our own prompts; its docstring cites the paper, gives its LLM calls per
document and lists every deviation. What all families share, and how it departs from the papers:
- The benchmark's rewrites keep the source's facts (B.1.1): every prompt says so (FACTS) and the gate
  checks it, where several papers allow invented statistics, quotes or sources.
- Every reply is JSON (the documents travel inside JSON strings of an <input> block, so no document
  text becomes prompt structure); the papers' rewriters reply in free text.
- The builder's LLM at the run's temperature (0 by default, cached) plays every model of every paper.
- Prompts are marked opaquely ("rewrite_task": "F3.plan"): no family's name reaches the model, and a
  rewrite that names a family or spells a prompt key is refused by the gate.
- Only AgenticGEO and MAGEO see the user's query, as their papers' rewriters do; the others work from
  the document alone, as theirs do.

A family works on a batch of jobs through `Ctx.ask` (one request per job and step, `workers` at a time,
every reply cached by the client) and returns, per job, the rewrite (or None) and its trace.

Usage: FAMILIES["AutoGEO"]().run(geo_jobs.Ctx(llm), [geo_jobs.Job("q", "source text")]) -> [(text, trace)]
"""
import hashlib
import json
import math
import re

import geodef
from geo_jobs import (FACTS, FIDELITY_INSTRUCTION, FIDELITY_THRESHOLD, MAX_RATIO, MIN_RATIO, NEEDS_REWRITE, REWRITE,
                      attempt_of, cheap_gate, gate, judged, needs, number, strings)

# ----------------------------------------------------------------------------- GEO (unseen)

GEO_GOAL = ("You help the owner of a web page raise its visibility in the answers of generative search engines, "
            "which answer from several sources and cite the ones they use.")
GEO_FLUENCY = ("Rewrite the document so that it reads more fluently: smooth transitions, clear sentences, "
               "the same content and the same length.")
GEO_STATISTICS = ("Make the document more quantitative: wherever a statement is qualitative and the document "
                  "gives a figure for it, state the figure there, so that its points read as measured facts.")


class Geo:
    """GEO (Aggarwal et al., KDD 2024, arXiv 2311.09735): nine single-prompt rewriting methods, each a map
    of the source text alone, independent of any query (§2.2.2). Table 1's best single method is
    Quotation Addition (on both visibility metrics); Fluency Optimization + Statistics Addition is the
    best pair among the top four methods, on Position-Adjusted Word Count, over a 200-query subset
    (§5.3, Fig. 4). The benchmark's GEO family is that pair: Fluency, then Statistics on its output.
    2 calls per document. No query. Deviations:
    - the pair is applied in sequence (the paper does not say how a pair was applied);
    - Statistics Addition states the document's own figures: GEO's code asks for positive, compelling
      statistics "even if hypothetical", which the benchmark's fact-keeping forbids;
    - the builder's LLM and JSON replies (GEO: gpt-3.5-turbo, a fenced block of text)."""
    name, code, calls = "GEO", "F4", 2

    def prompts(self):
        return [GEO_GOAL, GEO_FLUENCY, GEO_STATISTICS]

    def run(self, ctx, jobs):
        texts = {i: j.source for i, j in enumerate(jobs)}
        for step, how in (("fluency", GEO_FLUENCY), ("statistics", GEO_STATISTICS)):
            out = ctx.ask(self, step, f"{GEO_GOAL} {how} {FACTS}",
                          {i: {"document": t, **attempt_of(jobs[i])} for i, t in texts.items()}, REWRITE,
                          NEEDS_REWRITE)
            texts = {i: d["rewritten_document"] for i, d in out.items()}
        return [(texts.get(i), {"calls": 2, "methods": ["fluency_optimization", "statistics_addition"]})
                for i in range(len(jobs))]


# ----------------------------------------------------------------------------- AutoGEO (seen)

# Our own rules, of the kind AutoGEO extracts from engines' preferences (explanations of why an engine
# preferred one document, merged and filtered of anything query-specific), in alphabetical order as
# AutoGEO's rule files are. The published rules reach a build only from a file (--autogeo-rules).
AUTOGEO_RULES = sorted([
    "Attribute key statements to the organisations, studies or experts the document already names.",
    "Define technical terms the first time they appear.",
    "Group related points under clear, descriptive section headings.",
    "Keep paragraphs short, each on one idea.",
    "Present comparable items, steps or options as lists.",
    "Put the most important information at the start of the document and of each section.",
    "Give concrete figures with their units wherever the document has them.",
    "Use neutral, precise and confident wording instead of vague qualifiers.",
    "Make each section understandable on its own, without the rest of the page.",
    "Close with a short synthesis of the document's main points.",
])
AUTOGEO_GOAL = ("You own the web document in the input. A generative engine uses it, among other sources, to answer "
                "users, and cites the lines it uses. Rewrite it to maximise its visibility and impact in the "
                "engine's answers, so that it is quoted and cited more. Follow every quality guideline in the input "
                "strictly; any other technique that raises its relevance, authority or impact is allowed.")


def unicode_text(data):
    """A resource file's value, its strings valid Unicode (JSON escapes allow a lone surrogate, "\\ud800", which no
    request body can carry: refused here, before the build's searches and LLM calls, not at the first request)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string that is not valid Unicode (a lone surrogate such as \\ud800)") from None
    return data


def read_rules(path):
    """--autogeo-rules: AutoGEO's merged_rules.json ({"merged_rules": [...], "filtered_rules": [...]}, of
    which AutoGEO rewrites with `filtered_rules` only) or a JSON list of rule strings -> the list, in
    the file's order."""
    with open(path, encoding="utf-8-sig") as f:
        data = json.load(f)
    if isinstance(data, dict):
        if "filtered_rules" not in data:
            raise ValueError("expected AutoGEO's merged_rules.json ({\"filtered_rules\": [...]}) or a list of rules")
        data = data["filtered_rules"]
    rules = strings(data)
    if not rules or not isinstance(data, list) or len(rules) != len(data):
        raise ValueError("the rules must be a non-empty list of strings")
    return unicode_text(rules)


class AutoGeo:
    """AutoGEO (Wu et al., ICLR 2026, arXiv 2510.11438; code cxcscmu/AutoGEO): one rewrite of the document
    alone (no query, no competitors) under the preference rules AutoGEO learned from an engine, framed as
    maximising the document's visibility and citation. 1 call per document. No query. Deviations:
    - our own rules (AUTOGEO_RULES) unless --autogeo-rules gives AutoGEO's merged_rules.json (its
      `filtered_rules`, in the file's order: alphabetical, no importance order);
    - the builder's LLM rewrites under the rules (AutoGEO_API: gemini-2.5-pro; AutoGEO_Mini, its
      fine-tuned Qwen3-1.7B, is not used);
    - the facts are kept (AutoGEO's prompt allows any technique that raises impact)."""
    name, code, calls = "AutoGEO", "F2", 1

    def prompts(self):
        return [AUTOGEO_GOAL, *AUTOGEO_RULES]

    def run(self, ctx, jobs):
        rules = ctx.rules or AUTOGEO_RULES
        out = ctx.ask(self, "rewrite", f"{AUTOGEO_GOAL} {FACTS}",
                      {i: {"document": j.source, "quality_guidelines": rules, **attempt_of(j)}
                       for i, j in enumerate(jobs)}, REWRITE, NEEDS_REWRITE)
        return [(out[i]["rewritten_document"] if i in out else None, {"calls": 1, "rules": len(rules)})
                for i in range(len(jobs))]


# ----------------------------------------------------------------------------- AgenticGEO (seen)


def strategy(gid, kind, short, full, score):
    return {"genotype_id": gid, "strategy_type": kind, "short_prompt": short, "full_prompt": full,
            "scores": {"total_score": score}}


# Our own archive, in the published format of AgenticGEO's evolved/archive/strategies.json (one strategy
# per published strategy type; the file's order is its total_score order). The published strategies
# reach a build only from a file (--agentic-archive).
AGENTIC_ARCHIVE = [
    strategy("a1", "authoritative", "Confident, expert register; conclusions stated plainly.",
             "Objective: make the document read as the work of a confident expert. Constraints: keep every fact; "
             "state conclusions plainly instead of hedging; prefer active voice. Style: assured, precise.", 1.18),
    strategy("a2", "citing_credible", "Attribute claims to the bodies the document names.",
             "Objective: make each key statement traceable to a credible origin. Constraints: attribute statements "
             "only to organisations, studies or people the document itself names; invent no source. Style: "
             "attribution woven into the sentence (\"according to ...\").", 1.17),
    strategy("a3", "stats_optimization", "Put the document's figures forward.",
             "Objective: make the content quantitative. Constraints: surface every figure the document gives in "
             "the sentence it supports, with its unit; add no new number. Style: crisp, data-led sentences.", 1.17),
    strategy("a4", "more_quotes", "Quotable sentences from the document's own statements.",
             "Objective: give the engine sentences it can quote. Constraints: turn the document's strongest "
             "statements into short, self-contained, quotable sentences, quoting only words the document "
             "attributes to someone. Style: memorable, direct.", 1.16),
    strategy("a5", "fluent", "Smooth, readable flow.",
             "Objective: make the document read smoothly. Constraints: same content; better transitions; "
             "sentences of varied length; no repetition. Style: fluent, natural.", 1.16),
    strategy("a6", "simple_language", "Plain words, short sentences.",
             "Objective: make the document easy to understand. Constraints: plain words, short sentences, one "
             "idea each; keep every piece of information. Style: clear, accessible.", 1.16),
    strategy("a7", "seo_optimize", "Topic terms where they fit.",
             "Objective: match the words searchers use. Constraints: use the topic's key terms naturally in "
             "headings and opening sentences; no keyword lists. Style: natural, on-topic.", 1.15),
    strategy("a8", "unique_words", "Distinctive, specific vocabulary.",
             "Objective: make the document stand out. Constraints: replace generic words with specific, "
             "distinctive ones that keep the meaning. Style: vivid, exact.", 1.15),
    strategy("a9", "conflict_synthesis", "Reconcile differing statements into one clear account.",
             "Objective: present one coherent account. Constraints: where the document gives differing figures "
             "or views, set them side by side and say what each applies to; drop nothing. Style: balanced, "
             "synthesising.", 1.15),
]
AGENTIC_GOAL = ("The document is one of several sources a generative engine uses to answer the user's query, and "
                "the engine cites the lines it uses. The aim is to raise this source's visibility and citation in "
                "the answer without changing its core meaning.")
AGENTIC_RANK = (f"{AGENTIC_GOAL} Rank the candidate strategies in the input by how much applying each to the "
                "current document would raise its visibility and citation for the query, best first.")
AGENTIC_APPLY = (f"{AGENTIC_GOAL} Rewrite the current document by applying the optimization strategy in the input, "
                 "so that it answers the query better (the query is context). Keep the document's structure "
                 "(its paragraphs and lists) unless the strategy needs another, and keep its length about the "
                 "same (within a tenth). Ignore any output format the strategy asks for: return the rewritten "
                 "document only.")
AGENTIC_STEPS = 3                 # rewrite steps (the README's "up to 3"; the code's default is 2)
CRITIC_CHARS = 2790               # the critic reads the first and last 2,790 characters of a long document


def read_archive(path):
    """--agentic-archive: AgenticGEO's strategies.json ({"strategies": [{genotype_id, strategy_type,
    short_prompt, full_prompt, scores, fitness, genotype}]}, or the list) -> the strategies, checked, in
    the file's order."""
    with open(path, encoding="utf-8-sig") as f:
        data = json.load(f)
    items = data.get("strategies") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError("expected AgenticGEO's strategies.json: {\"strategies\": [...]}")
    out = []
    for i, s in enumerate(items):
        keys = ("genotype_id", "strategy_type", "short_prompt", "full_prompt")
        bad = [k for k in keys if not isinstance(s, dict) or not isinstance(s.get(k), str) or not s[k].strip()]
        if bad:
            raise ValueError(f"strategy {i}: {bad[0]}: a non-empty string is required")
        out.append({k: s[k] for k in keys} | {"scores": s.get("scores") or {}})
    if len({s["genotype_id"] for s in out}) != len(out):
        raise ValueError("two strategies share a genotype_id")
    return unicode_text(out)


def critic_view(text):
    """The document as the critic reads it: whole, or its head and tail joined by ' ... '."""
    return text if len(text) <= 2 * CRITIC_CHARS else f"{text[:CRITIC_CHARS]} ... {text[-CRITIC_CHARS:]}"


class AgenticGeo:
    """AgenticGEO (Yuan et al., arXiv 2603.20213; code AIcling/agentic_geo): a rewriting agent over an
    evolved archive of strategies. Before each step a critic scores every strategy whose id and type are
    unused for (query, current text); the best one's full prompt drives one rewrite; the rewrite is the
    next step's text. 2 calls a step (rank, rewrite), 3 steps: 6 calls per document. Query: yes (the
    critic and the rewriter read it). Deviations:
    - the builder's LLM ranks the candidates in place of the learned critic (Qwen2.5-1.5B with a value
      head); an unusable ranking falls back to the archive's order;
    - our archive (AGENTIC_ARCHIVE, the published format and strategy types, our words) unless
      --agentic-archive gives the published strategies.json;
    - 3 steps, as the project's README states (the code's default is 2, and the released code stops
      after one step: the multi-step branch reads selector attributes that are never set);
    - the rewriter keeps structure and length (the released rewriter's keep-structure rule, and the
      length policy, the same or within 10%, that every published strategy carries) in its instruction;
      our archive's strategies carry no policy of their own, and the gate allows lengths 0.5-4x;
    - the facts are kept (the published instruction lets a strategy allow invented facts); JSON replies."""
    name, code, calls = "AgenticGEO", "F1", 2 * AGENTIC_STEPS

    def prompts(self):
        return [AGENTIC_RANK, AGENTIC_APPLY, json.dumps(AGENTIC_ARCHIVE), str(AGENTIC_STEPS)]

    def rank_check(self, ids):
        def check(d):
            r = d.get("ranking") if isinstance(d, dict) else None
            if not isinstance(r, list) or not r or not all(isinstance(x, str) and x in ids for x in r) \
                    or len(set(r)) != len(r):
                raise ValueError(f"expected {{\"ranking\": [ids]}} with ids from {sorted(ids)[:12]}, each once")
        return check

    def run(self, ctx, jobs):
        archive = ctx.archive or AGENTIC_ARCHIVE
        texts = {i: j.source for i, j in enumerate(jobs)}
        used = {i: [] for i in texts}
        fallbacks = {i: 0 for i in texts}
        for step in range(1, AGENTIC_STEPS + 1):
            cands = {i: [s for s in archive if s["strategy_type"] not in {u["strategy_type"] for u in used[i]}]
                     for i in texts}
            live = {i: c for i, c in cands.items() if c}
            picks = self._pick(ctx, jobs, texts, live, step)
            for i, s in picks.items():
                fallbacks[i] += s is None
            picks = {i: s or live[i][0] for i, s in picks.items()}
            out = ctx.ask(self, f"apply{step}", f"{AGENTIC_APPLY} {FACTS}",
                          {i: {"query": jobs[i].query, "current_document": texts[i], "strategy": s["full_prompt"],
                               **attempt_of(jobs[i])} for i, s in picks.items()}, REWRITE, NEEDS_REWRITE)
            finished = {i: t for i, t in texts.items() if i not in picks}     # no strategy type left
            texts = {**finished, **{i: d["rewritten_document"] for i, d in out.items()}}
            for i in out:
                used[i].append(picks[i])
        return [(texts.get(i), {"calls": 2 * len(used[i]), "strategies": [s["genotype_id"] for s in used[i]],
                                "types": [s["strategy_type"] for s in used[i]], "ranking_fallbacks": fallbacks[i]})
                for i in range(len(jobs))]

    def _pick(self, ctx, jobs, texts, live, step):
        """The critic's choice per job: the best-ranked candidate strategy, or None (unusable ranking)."""
        fields = {i: {"query": jobs[i].query, "current_document": critic_view(texts[i]),
                      "strategies": [{"id": s["genotype_id"], "type": s["strategy_type"], "summary": s["short_prompt"]}
                                     for s in c], **attempt_of(jobs[i])} for i, c in live.items()}
        ids = {s["genotype_id"] for c in live.values() for s in c}
        got = ctx.ask(self, f"rank{step}", AGENTIC_RANK, fields, '{"ranking": ["id", "..."]}', self.rank_check(ids))
        picks = {}
        for i, c in live.items():
            by_id = {s["genotype_id"]: s for s in c}
            first = next((x for x in (got.get(i) or {}).get("ranking", []) if x in by_id), None)
            picks[i] = by_id.get(first)
        return picks


# ----------------------------------------------------------------------------- GEO-SFE (unseen)

# GEO-SFE's data-driven targets (§IV.D, principles P1-P4): hierarchy depth 3-5, paragraphs of 150-300
# words, a structured share (lists, tables) of 0.25-0.35, emphasis on 5-10% of the content.
SFE_TARGETS = {"depth": (3, 5), "paragraph_words": (150, 300), "structured": (0.25, 0.35), "emphasis": (0.05, 0.10)}
SFE_KEEP = 0.85                   # meaning check: share of the last valid text's content words kept
SFE_GOAL = ("You engineer the structure of a web document so that generative engines select and cite it more, "
            "changing its structure and emphasis, never its meaning.")
SFE_LEVELS = {
    "macro": ("Restructure the document's hierarchy: headings of 3 to 5 levels where the content allows, sections "
              "of balanced size (merge closely related sections, split one that covers several topics), and short "
              "cross-references between related sections."),
    "meso": ("Restructure its paragraphs: 150 to 300 words each (split long ones at topic shifts, merge short "
             "related ones), and turn suitable prose (steps, options, comparisons, figures) into lists or tables "
             "until about 25 to 35% of the content is structured."),
    "micro": ("Add emphasis: in the 5 to 10% most important sentences, set the key terms in bold where they open the "
              "sentence or a section and in italics elsewhere, and simplify any sentence that is hard to read."),
}


def words_of(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def structure_features(text):
    """GEO-SFE's structural features of a Markdown-ish text: heading depth, paragraph lengths in words,
    the share of lines in lists or tables, and the share of words set in bold or italics."""
    lines = [x for x in text.splitlines() if x.strip()]
    depth = max((len(m.group(1)) for x in lines if (m := re.match(r"\s*(#{1,6})\s", x))), default=0)
    paras = [len(p.split()) for p in re.split(r"\n\s*\n", text)     # prose paragraphs: no headings, lists, tables
             if p.strip() and not re.match(r"\s*(#|[-*+]\s|\d+[.)]\s|\|)", p)]
    structured = sum(1 for x in lines if re.match(r"\s*([-*+]|\d+[.)]|\|)\s", x)) / max(1, len(lines))
    emphasised = sum(len(m.split()) for m in re.findall(r"\*\*([^*]+)\*\*|\*([^*]+)\*", text) for m in m if m)
    return {"depth": depth, "paragraph_words": paras, "structured": structured,
            "emphasis": emphasised / max(1, len(text.split()))}


def sfe_gaps(text):
    """Which levels a text needs (GEO-SFE Alg. 2 runs a level only when its gap to the targets is
    over a threshold): macro when the heading depth is below the target, meso when most paragraphs
    are outside 150-300 words or the structured share is below 0.25, micro when the emphasis is below
    5% of the words. (The paper's thresholds are not published; these are ours.)"""
    f = structure_features(text)
    lo, hi = SFE_TARGETS["paragraph_words"]
    outside = sum(1 for n in f["paragraph_words"] if not lo <= n <= hi) / max(1, len(f["paragraph_words"]))
    return {"macro": f["depth"] < SFE_TARGETS["depth"][0],
            "meso": outside > 0.5 or f["structured"] < SFE_TARGETS["structured"][0],
            "micro": f["emphasis"] < SFE_TARGETS["emphasis"][0]}


def meaning_kept(before, after):
    """Our stand-in for GEO-SFE's semantic checks (BGE-M3 similarity, LDA topic divergence): every number
    kept and at least SFE_KEEP of the content words of `before` still in `after`."""
    if cheap_gate(before, after) is not None:
        return False
    old, new = set(words_of(before)), set(words_of(after))
    return len(old & new) >= SFE_KEEP * len(old)


class GeoSfe:
    """GEO-SFE (Yu, Yang, Ding, Sato, arXiv 2603.29979): structural feature engineering at three levels, in
    order: macro (heading hierarchy, section balance, internal links), meso (paragraph chunking to 150-300
    words, prose turned into lists and tables), micro (bold and italic emphasis on key terms of the top
    sentences, readability). A level runs only when the document's gap to its targets is large (Alg. 2);
    after each level the meaning is checked and a failed level rolled back; a failed macro level ends
    the run. At most 3 calls per document (one per level that runs). No query (its transforms take
    none). Deviations:
    - the paper's transforms are algorithmic (no LLM, no prompts are given); here each level is one
      LLM rewrite told the level's targets;
    - the gap test is ours (sfe_gaps): one feature per level against a threshold of ours, not Alg. 2's L2
      distance of z-scored feature vectors against per-level thresholds (unpublished); on text without
      Markdown every level's feature is absent, so every plain-text source runs all three levels, and
      levels are skipped only for sources already in Markdown;
    - the meaning check is lexical (meaning_kept) where the paper uses BGE-M3 similarity and LDA topic
      divergence;
    - no engine-weighted selection among versions (the paper's V = sum over architectures of their
      visibility) and no citation predictor;
    - GEO-Bench's cleaned text has no markup for the features to read; they are read from Markdown."""
    name, code, calls = "GEO-SFE", "F5", 3

    def prompts(self):
        return [SFE_GOAL, *SFE_LEVELS.values(), json.dumps(SFE_TARGETS), str(SFE_KEEP)]

    def run(self, ctx, jobs):
        texts = {i: j.source for i, j in enumerate(jobs)}
        trace = {i: {"calls": 0, "levels": [], "rolled_back": []} for i in texts}
        live = set(texts)
        for level, how in SFE_LEVELS.items():
            todo = [i for i in sorted(live) if sfe_gaps(texts[i])[level]]
            out = ctx.ask(self, level, f"{SFE_GOAL} {how} {FACTS}",
                          {i: {"document": texts[i], **attempt_of(jobs[i])} for i in todo}, REWRITE, NEEDS_REWRITE)
            for i in todo:
                trace[i]["calls"] += 1
                new = out.get(i, {}).get("rewritten_document")
                if new is not None and meaning_kept(texts[i], new):
                    texts[i] = new
                    trace[i]["levels"].append(level)
                else:                   # rolled back to the last valid text; a failed macro ends the run
                    trace[i]["rolled_back"].append(level)
                    if level == "macro":
                        live.discard(i)
        return [(texts[i] if trace[i]["levels"] else None, trace[i]) for i in range(len(jobs))]


# ----------------------------------------------------------------------------- IF-GEO (unseen)

IF_QUERIES, IF_SUGGESTIONS = 5, 5    # latent queries mined, suggestions per query at most (§5.4)
IF_PRIORITY = 0.7                    # tau: requests whose priority w x s is below it are dropped (§5.4)
IF_GOAL = ("The document should be selected and cited by generative engines for the many different queries it "
           "can serve, not for one.")
IF_MINE = (f"{IF_GOAL} Infer, from the document alone, {IF_QUERIES} realistic and different search queries that "
           "would lead users to it, each on a different facet of its central topic (no paraphrases of one "
           "another), with a popularity score from 0 to 100.")
IF_REQUEST = (f"{IF_GOAL} For the latent query in the input, judge how well the document answers it and give up to "
              f"{IF_SUGGESTIONS} specific edit suggestions, each anchored to a short excerpt of the document that it "
              "changes, saying how to change it (add detail, clarify, restructure, simplify), with a necessity "
              "score from 0 to 100.")
IF_DEDUP = ("Merge duplicate edit requests: two requests merge only when they are about the same topic and the "
            "same place in the document (never requests on distant paragraphs); a merged request keeps the "
            "highest necessity and lists the ids it merges. Give each request a short topic tag.")
IF_CONFLICTS = ("Resolve conflicting edit requests (mutually exclusive changes to the same excerpt or topic): when "
                "their priorities differ clearly keep the higher one; when they are close, write one compromise "
                "instruction that serves both. Combine compatible requests on the same excerpt into one.")
IF_BLUEPRINT = ("Turn the checked instructions into a revision blueprint ordered by the document's structure: "
                "assign each instruction to the section it changes, group the instructions of one section into "
                "one plan item, and give an insertion point for any new section.")
IF_REVISE = (f"{IF_GOAL} Revise the document by carrying out every directive of the revision blueprint. Return the "
             "whole document: leave every section the blueprint does not mention exactly as it is, summarise "
             "nothing, use Markdown, and change the tone only where the blueprint asks.")


def percent(scored):
    """[(item, score)] asked on 0-100 -> the same, read as fractions when every score of the reply is at
    most 1 and one lies strictly between 0 and 1 (a model answering the "probability" key on 0-1): scaled to
    0-100, so tau filters what the paper's scale means. Only 0s and 1s read as percent: 1% is no 100%."""
    if scored and all(s <= 1 for _, s in scored) and any(0 < s < 1 for _, s in scored):
        return [(x, 100.0 * s) for x, s in scored]
    return scored


def priority(weight, necessity):
    """IF-GEO's global priority of a request (§4.3.1, Eq. 5): its latent query's weight times its necessity,
    each read on 0-100 and scaled to 0-1, the scale on which §5.4's tau = 0.7 is a threshold (App. C
    reports the weights as probabilities)."""
    return round(weight / 100 * necessity / 100, 4)


class IfGeo:
    """IF-GEO (Zhou et al., arXiv 2601.13938): diverge, then converge. Diverge: latent queries mined from
    the document alone, with weights (1 call), then per latent query the edit requests it needs, each
    with an excerpt anchor and a necessity (Nq calls). Converge: requests filtered and prioritised
    (weight x necessity), de-duplicated (1 call), conflicts resolved by priority (1 call), a
    section-mapped revision blueprint (1 call), one revision that leaves unmentioned sections unchanged
    (1 call). 10 calls per document (Nq = 5). No query. Deviations:
    - requests whose priority (weight x necessity, each scaled to 0-1) is under tau = 0.7 (§5.4's
      default for §4.3.1's filter) are dropped in code, and priorities order the rest; a document left
      with no request is not rewritten (the family is refused on its group). App. B's "necessity under
      60" is a sentence of its dedup prompt, implied here by tau (w <= 1 needs s >= 70); a reply whose
      scores are all at most 1 is read as fractions (percent): the scale the prompt asks for is 0-100;
    - the builder's LLM at the run's temperature (the paper: GPT-4o-mini at 0.2);
    - the facts are kept (the paper's directives may add content)."""
    name, code, calls = "IF-GEO", "F6", IF_QUERIES + 5

    def prompts(self):
        return [IF_MINE, IF_REQUEST, IF_DEDUP, IF_CONFLICTS, IF_BLUEPRINT, IF_REVISE, str(IF_PRIORITY)]

    def run(self, ctx, jobs):
        n = len(jobs)
        docs = {i: {"document": j.source, **attempt_of(j)} for i, j in enumerate(jobs)}
        mined = ctx.ask(self, "mine", IF_MINE, docs,
                        '{"queries": [{"query": "...", "probability": 0}]}', needs("queries", list))
        latent = {i: percent([(q["query"], number(q.get("probability"), 0, 100, 0)) for q in d["queries"]
                              if isinstance(q, dict) and isinstance(q.get("query"), str)
                              and q["query"].strip()][:IF_QUERIES])
                  for i, d in mined.items()}
        asks = {(i, k): {"document": jobs[i].source, "latent_query": q, **attempt_of(jobs[i])}
                for i, qs in latent.items() for k, (q, _) in enumerate(qs)}
        got = ctx.ask(self, "request", IF_REQUEST, asks,
                      '{"suggestions": [{"excerpt": "...", "suggestion": "...", "necessity": 0}]}',
                      needs("suggestions", list))
        pool = {i: [] for i in latent}
        for (i, k), d in sorted(got.items()):
            asked = [s for s in d["suggestions"][:IF_SUGGESTIONS]]
            needs_ = dict(percent([(j, number(s.get("necessity"), 0, 100, 0)) for j, s in enumerate(asked)
                                   if isinstance(s, dict)]))
            for j, s in enumerate(asked):
                if isinstance(s, dict) and isinstance(s.get("suggestion"), str) and s["suggestion"].strip():
                    need = needs_[j]
                    if priority(latent[i][k][1], need) >= IF_PRIORITY:      # its id: latent query k, suggestion j
                        pool[i].append({"id": f"query{k + 1}-suggestion{j + 1}", "latent_query": latent[i][k][0],
                                        "excerpt": str(s.get("excerpt") or ""), "suggestion": s["suggestion"],
                                        "necessity": need, "priority": priority(latent[i][k][1], need)})
        pool = {i: sorted(p, key=lambda r: -r["priority"]) for i, p in pool.items() if p}
        items = ctx.ask(self, "dedup", IF_DEDUP, {i: {"requests": p, **attempt_of(jobs[i])} for i, p in pool.items()},
                        '{"requests": [{"id": "...", "merged_ids": ["..."], "topic": "...", "excerpt": "...", '
                        '"suggestion": "...", "necessity": 0}]}', needs("requests", list))
        for i, d in items.items():        # a merged request's priority: the highest of those it merges
            best = {r["id"]: r["priority"] for r in pool[i]}
            for r in d["requests"]:
                if isinstance(r, dict):
                    r["priority"] = max([best.get(x, 0) for x in strings(r.get("merged_ids")) + [r.get("id")]
                                         if isinstance(x, str)] or [0])
        checked = ctx.ask(self, "conflicts", IF_CONFLICTS,
                          {i: {"requests": d["requests"], **attempt_of(jobs[i])} for i, d in items.items()},
                          '{"instructions": [{"id": "...", "excerpt": "...", "suggestion": "..."}]}',
                          needs("instructions", list))
        plans = ctx.ask(self, "blueprint", IF_BLUEPRINT,
                        {i: {"document": jobs[i].source, "instructions": d["instructions"], **attempt_of(jobs[i])}
                         for i, d in checked.items()},
                        '{"revision_blueprint": [{"section_name": "...", "target_location": "...", '
                        '"modification_intent": "...", "directives": ["..."], "format_note": "..."}]}',
                        needs("revision_blueprint", list))
        out = ctx.ask(self, "revise", f"{IF_REVISE} {FACTS}",
                      {i: {"document": jobs[i].source, "revision_blueprint": d["revision_blueprint"],
                           **attempt_of(jobs[i])} for i, d in plans.items()}, REWRITE, NEEDS_REWRITE)
        return [(out[i]["rewritten_document"] if i in out else None,
                 {"calls": 1 + len(latent.get(i, [])) + sum(i in x for x in (items, checked, plans, out)),
                  "latent_queries": [q for q, _ in latent.get(i, [])], "requests_kept": len(pool.get(i, [])),
                  "blueprint_items": len(plans.get(i, {}).get("revision_blueprint", []))}) for i in range(n)]


# ----------------------------------------------------------------------------- RAID-GSEO (unseen)

RAID_GOAL = ("You optimise a web document so that generative engines select and cite it more, improving its "
             "visibility and its value to readers while keeping its core meaning and key information. The user "
             "query that will retrieve it is unknown: infer intent from the content.")
RAID_SUMMARY = (f"{RAID_GOAL} Summarise the document concisely: its key information and main points, without "
                "incidental detail or style, so that someone who has not read it can follow it.")
RAID_INTENT = f"{RAID_GOAL} From the document and its summary, state the primary search intent it serves."
RAID_REFLECT = (f"{RAID_GOAL} Reflect on the primary intent in four steps. Who: infer one to three kinds of readers "
                "most likely to search for this content. What: each one's core needs, given their background and "
                "knowledge. Why: where the primary intent misses those needs, and why. How: rewrite the intent as "
                "one generalised intent covering every reader's core needs while keeping its focus (unchanged if "
                "it is already precise and sufficient).")
RAID_PLAN = (f"{RAID_GOAL} Plan the optimisation as an ordered list of concrete steps that raise the document's "
             "visibility and engagement. The primary intent takes priority; use the generalised intent only for "
             "minor adjustments.")
RAID_REWRITE = f"{RAID_GOAL} Rewrite the document by carrying out the optimisation steps in the input, in order."


class RaidGseo:
    """RAID G-SEO (Chen et al., arXiv 2508.11158): role-augmented intent-driven optimisation with the user
    query hidden from the content creator (§III-A): a summary (1 call), the primary intent inferred from
    document and summary (1 call), one 4W reflection (who: 1-3 inferred roles; what: their needs; why:
    the gaps; how: one generalised intent) (1 call), a step plan led by the primary intent (1 call) and
    the rewrite that carries out the steps (1 call). 5 calls per document. No query. Deviations:
    - the builder's LLM, greedy at temperature 0 as the paper's decoding (the paper: GLM-4-9B);
    - the plan follows the paper's published core prompt (Table I: the primary intent first, the
      generalised one for minor adjustments); its §III-B says the planner is prompted with the refined
      (generalised) intent, and both intents are in the plan's input here;
    - the facts are kept (the paper's plans may enrich content); JSON replies."""
    name, code, calls = "RAID-GSEO", "F7", 5

    def prompts(self):
        return [RAID_SUMMARY, RAID_INTENT, RAID_REFLECT, RAID_PLAN, RAID_REWRITE]

    def run(self, ctx, jobs):
        src = {i: {"document": j.source, **attempt_of(j)} for i, j in enumerate(jobs)}
        summ = ctx.ask(self, "summary", RAID_SUMMARY, src, '{"summary": "..."}', needs("summary"))
        intent = ctx.ask(self, "intent", RAID_INTENT,
                         {i: {**src[i], "summary": d["summary"]} for i, d in summ.items()},
                         '{"primary_intent": "..."}', needs("primary_intent"))
        refl = ctx.ask(self, "reflect", RAID_REFLECT,
                       {i: {**src[i], "summary": summ[i]["summary"], "primary_intent": d["primary_intent"]}
                        for i, d in intent.items()},
                       '{"roles": [{"role": "...", "needs": "...", "mismatch": "..."}], "generalized_intent": "..."}',
                       needs("generalized_intent"))
        plan = ctx.ask(self, "plan", RAID_PLAN,
                       {i: {**src[i], "primary_intent": intent[i]["primary_intent"],
                            "generalized_intent": d["generalized_intent"]} for i, d in refl.items()},
                       '{"steps": ["..."]}', needs("steps", list))
        out = ctx.ask(self, "rewrite", f"{RAID_REWRITE} {FACTS}",
                      {i: {**src[i], "steps": strings(d["steps"])} for i, d in plan.items()}, REWRITE, NEEDS_REWRITE)
        roles = {i: d.get("roles") if isinstance(d.get("roles"), list) else [] for i, d in refl.items()}  # (any type)
        return [(out[i]["rewritten_document"] if i in out else None,
                 {"calls": sum(i in x for x in (summ, intent, refl, plan, out)),
                  "roles": [r.get("role") for r in roles.get(i, []) if isinstance(r, dict)][:3],
                  "steps": len(strings(plan.get(i, {}).get("steps")))}) for i in range(len(jobs))]


# ----------------------------------------------------------------------------- MAGEO (seen)

MAGEO_ROUNDS, MAGEO_PATIENCE = 10, 2     # rounds at most; stop after 2 rounds without an accepted edit
MAGEO_CANDIDATES, MAGEO_MEMORY = 2, 5    # candidates the editor writes a round; past edits shown the planner
MAGEO_EPSILON = 0.01                     # an edit is accepted when the engine signal rises by more than this
MAGEO_FAITHFULNESS = 6                   # the evaluator's predicted faithfulness (1-10) a candidate needs
MAGEO_GOAL = ("A generative search engine answers the user's query from retrieved web documents and cites the "
              "sources of every sentence. The aim is to make the target document more visible in that answer "
              "(cited more, and earlier) while keeping its attribution faithful.")
MAGEO_ENGINE = ("The engine retrieves about ten web documents for a query, answers from them in prose, and ends each "
                "sentence with the numbers of the documents it used, as [1] or [2][3].")
MAGEO_PROFILE = ("Describe the preferences of the generative engine in the input as a profile for editors: the "
                 "formats, content and style it favours, and the risks it penalises.")
MAGEO_PLAN = (f"{MAGEO_GOAL} Plan a few high-level revision steps for the current document, learning from the "
              "successful past edits in the input and following the engine's preference profile. Do not rewrite "
              "the document.")
MAGEO_EDIT = ("Carry out the revision plan on the current document and write {k} diverse candidate versions that "
              "stay faithful to it but try different structure, evidence and style; for each, list the edit "
              "operations applied.")
MAGEO_EVALUATE = (f"{MAGEO_GOAL} Predict for each candidate, from 1 to 10: its visibility in the engine's cited "
                  "answer to the query, how early it would be cited, its faithfulness to the current document, and "
                  "the accuracy of its attributions. Penalise weak attribution and poor faithfulness.")
MAGEO_ANSWER = ("Answer the user's query using only the numbered documents in the input. End every sentence with "
                "the numbers of the documents it is based on, as [1] or [2][3]. Cite only documents that support "
                "the sentence.")
PLAN_SCHEMA = ('{"plan_steps": [{"edit_type": "Structure|Evidence|Safety|Style|Formatting", "target_span": "...", '
               '"rationale": "...", "operations": ["..."]}]}')
EDIT_SCHEMA = ('{"candidates": [{"revised_content": "...", "applied_edit_ops": [{"edit_type": "...", '
               '"target_span": "...", "op_pattern": "..."}]}]}')
EVAL_SCHEMA = ('{"evaluations": [{"candidate": 1, "visibility": 5, "position": 5, "faithfulness": 5, '
               '"attribution": 5}]}')


def visibility(answer, index):
    """MAGEO's citation visibility of document `index` (1-based) in an answer: each sentence's words are
    shared equally among the documents it cites; WLV is the document's share of cited words, DPA the
    same with sentence j weighted exp(-(j+1)/n), earlier first; both normalised over the cited
    documents -> (WLV + DPA) / 2, 0 when the document is not cited."""
    sents = [s for s in re.split(r"(?<=[.!?;])\s+|\n+", answer or "") if s.strip()]
    wlv, dpa = {}, {}
    for j, s in enumerate(sents):
        ids = list(dict.fromkeys(int(x) for x in re.findall(r"\[(\d{1,6})\]", s)))   # (int() refuses 4,300 digits)
        n_words = len(re.findall(r"\w+", re.sub(r"\[\d+\]", " ", s)))
        for i in ids:
            share = n_words / len(ids)
            wlv[i] = wlv.get(i, 0.0) + share
            dpa[i] = dpa.get(i, 0.0) + share * math.exp(-(j + 1) / len(sents))
    if not wlv.get(index):
        return 0.0
    return (wlv[index] / sum(wlv.values()) + dpa[index] / sum(dpa.values())) / 2


def predicted(e):
    """The evaluator's predicted score of a candidate (mean of its four 1-10 predictions)."""
    return sum(number(e.get(k), 1, 10, 1) for k in ("visibility", "position", "faithfulness", "attribution")) / 4


class Mageo:
    """MAGEO (Wu et al., ACL 2026, arXiv 2604.19516; code Wu-beining/MAGEO): multi-agent optimisation with
    a simulated engine. Once per build a preference agent turns the engine's description into a profile
    (1 call, shared). The source is scored in the simulated engine (1 call). Each round: a planner
    plans edits from the query, the current document, the profile and the best past edits in memory
    (1 call); an editor writes 2 candidates from the plan, without the query (1 call); an evaluator
    predicts their scores (1 call); the best predicted candidate that passes the faithfulness check
    and the gate is scored in the engine (1 call, plus 1-2 judge calls), and accepted when its
    visibility rises by more than 0.01, its edit then stored in memory. Up to 10 rounds, stopping after
    2 rounds without an accepted edit. At most 2 + 10 x 6 = 62 calls per document. Query: yes (planner,
    evaluator, engine). Engine signal: the answer of a generative engine over the group's candidates,
    the candidate in place, scored by MAGEO's citation visibility (word share and position-weighted
    share). Deviations:
    - the signal is the citation visibility alone; MAGEO's DSV-CF adds six dimensions judged on the
      document alone, which the evaluator's prediction stands for in selection only;
    - the target is not marked in the engine's context (MAGEO's engine prompt marks it with '*');
    - the engine's description stands in for the engine statistics MAGEO's profile reads (its released
      runs pass zeros);
    - memory: the accepted edits of earlier rounds of every document of one split of the build (one
      engine), the best 5 by gain; MAGEO keeps memory across documents in the order they are optimised,
      and build-bench runs each split apart so that no construction edit reaches a test rewrite (B.1.2);
    - the gate (cheap checks and the fidelity judge against the original source) comes before the
      engine; MAGEO checks predicted faithfulness against the current version only, and refuses a
      candidate whose faithfulness or attribution drops by more than its epsilon 0.01: here that epsilon
      is the margin the signal must rise by, and the judge stands for the drop check;
    - when no round is accepted, the first candidate that passed the gate is kept (trace: improved
      false) so that every group has a rewrite; MAGEO returns the source;
    - signal "reranker" (--mageo-signal reranker): the base reranker's score of the document among the
      group's candidates instead of the engine, a declared option (it hill-climbs on the model the
      benchmark then measures)."""
    name, code, calls = "MAGEO", "F3", 2 + MAGEO_ROUNDS * 6

    def __init__(self, signal="engine"):
        if signal not in ("engine", "reranker"):
            raise ValueError(f"MAGEO's signal must be 'engine' or 'reranker', got {signal!r}")
        self.signal = signal

    def prompts(self):
        return [MAGEO_GOAL, MAGEO_ENGINE, MAGEO_PROFILE, MAGEO_PLAN, MAGEO_EDIT, MAGEO_EVALUATE, MAGEO_ANSWER,
                PLAN_SCHEMA, EDIT_SCHEMA, EVAL_SCHEMA, self.signal,
                json.dumps([MAGEO_ROUNDS, MAGEO_PATIENCE, MAGEO_CANDIDATES, MAGEO_MEMORY, MAGEO_EPSILON])]

    def profile(self, ctx):
        got = ctx.ask(self, "profile", MAGEO_PROFILE, {0: {"engine": MAGEO_ENGINE}},
                      '{"format_preferences": ["..."], "content_preferences": ["..."], "style_preferences": ["..."], '
                      '"risk_constraints": ["..."], "summary": "..."}', needs("summary"))
        return got.get(0, {"summary": MAGEO_ENGINE})

    def engine(self, ctx, jobs, texts):
        """{job index: text} -> {job index: the signal of the text at the source's place in its group}."""
        if self.signal == "reranker":
            insts = {i: geodef.Instance(f"{jobs[i].group_id}@mageo{jobs[i].attempt}", jobs[i].group_id,
                                        jobs[i].query, self._docs(jobs[i], t),
                                        [f"{jobs[i].group_id}-{k}" for k in range(len(jobs[i].docs))],
                                        jobs[i].position, "MAGEO") for i, t in texts.items()}
            ctx.ranker.prepare(list(insts.values()))
            return {i: ctx.ranker.scores(x)[x.attack_index] for i, x in insts.items()}
        answers = ctx.ask(self, "engine", MAGEO_ANSWER, {i: {
            "query": jobs[i].query, "documents": [{"index": k + 1, "text": d}
                                                  for k, d in enumerate(self._docs(jobs[i], t))]}
            for i, t in texts.items()}, '{"answer": "..."}', needs("answer"))
        return {i: visibility(answers[i]["answer"], jobs[i].position + 1) if i in answers else 0.0 for i in texts}

    @staticmethod
    def _docs(job, text):
        docs = list(job.docs)
        docs[job.position] = text
        return docs

    def run(self, ctx, jobs):
        profile = self.profile(ctx)
        cur = {i: j.source for i, j in enumerate(jobs)}
        score = self.engine(ctx, jobs, cur)
        first = dict(score)
        trace = {i: {"calls": 2, "rounds": 0, "accepted_rounds": [], "candidate_gate": []} for i in cur}
        stale, memory, fallback = {i: 0 for i in cur}, [], {}
        for rnd in range(1, MAGEO_ROUNDS + 1):
            live = [i for i in cur if stale[i] < MAGEO_PATIENCE]
            if not live:
                break
            past = sorted(memory, key=lambda m: -m["gain"])[:MAGEO_MEMORY]
            cands, plans = self._propose(ctx, jobs, cur, live, profile, past, rnd)
            picked = self._select(ctx, jobs, cur, cands, trace, fallback)
            got = self.engine(ctx, jobs, {i: c["revised_content"] for i, c in picked.items()})
            for i in live:
                trace[i]["rounds"] = rnd
                trace[i]["calls"] += 3 + (i in picked)
                if i in picked and got[i] > score[i] + MAGEO_EPSILON:
                    memory.append({"round": rnd, "gain": round(got[i] - score[i], 4), "plan_steps": plans.get(i),
                                   "applied_edit_ops": picked[i].get("applied_edit_ops")})
                    cur[i], score[i], stale[i] = picked[i]["revised_content"], got[i], 0
                    trace[i]["accepted_rounds"].append(rnd)
                else:
                    stale[i] += 1
        out = []
        for i, j in enumerate(jobs):
            improved = cur[i] != j.source
            trace[i].update(improved=improved, signal=self.signal, score_before=round(first[i], 4),
                            score_after=round(score[i], 4))
            out.append((cur[i] if improved else fallback.get(i), trace[i]))
        return out

    def _propose(self, ctx, jobs, cur, live, profile, past, rnd):
        """The planner's and the editor's round -> ({i: [candidate dicts]}, {i: plan steps})."""
        plans = ctx.ask(self, "plan", MAGEO_PLAN, {i: {
            "query": jobs[i].query, "current_document": cur[i], "preference_profile": profile,
            "memory": past, "round": rnd, **attempt_of(jobs[i])} for i in live}, PLAN_SCHEMA,
            needs("plan_steps", list))
        edits = ctx.ask(self, "edit", MAGEO_EDIT.format(k=MAGEO_CANDIDATES), {i: {
            "current_document": cur[i], "plan_steps": d["plan_steps"], "preference_profile": profile,
            "round": rnd, **attempt_of(jobs[i])} for i, d in plans.items()}, EDIT_SCHEMA, needs("candidates", list))
        cands = {i: [c for c in d["candidates"] if isinstance(c, dict) and isinstance(c.get("revised_content"), str)
                     and c["revised_content"].strip()][:MAGEO_CANDIDATES] for i, d in edits.items()}
        return {i: c for i, c in cands.items() if c}, {i: d["plan_steps"] for i, d in plans.items()}

    def _select(self, ctx, jobs, cur, cands, trace, fallback):
        """The evaluator's predictions, then per job the best predicted candidate that is predicted
        faithful and passes the gate -> {i: candidate}. The first gate-passing candidate of a job is
        kept as its fallback."""
        evals = ctx.ask(self, "evaluate", MAGEO_EVALUATE, {i: {
            "query": jobs[i].query, "current_document": cur[i],
            "candidates": [{"candidate": k + 1, "text": c["revised_content"]} for k, c in enumerate(cs)],
            **attempt_of(jobs[i])} for i, cs in cands.items()}, EVAL_SCHEMA, needs("evaluations", list))
        order = {}
        for i, cs in cands.items():
            seen = {}                 # candidate index -> its evaluation; a label that names none is no evaluation
            for e in (evals.get(i) or {}).get("evaluations", []):
                k = e.get("candidate") if isinstance(e, dict) else None
                if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= len(cs):
                    seen[k - 1] = e
            # only an evaluated candidate may be picked: one the evaluator skipped has passed no faithfulness check
            ok = [k for k, e in seen.items() if number(e.get("faithfulness"), 1, 10, 1) >= MAGEO_FAITHFULNESS]
            order[i] = sorted(ok, key=lambda k: (-predicted(seen[k]), k))
        picked = {}
        for turn in range(MAGEO_CANDIDATES):  # the next best candidate of the jobs whose earlier one was refused
            todo = [i for i in order if i not in picked and turn < len(order[i])]
            texts = [cands[i][order[i][turn]]["revised_content"] for i in todo]
            for i, why in zip(todo, gate(ctx, [jobs[i].source for i in todo], texts, "MAGEO fidelity")):
                trace[i]["candidate_gate"].append(why or "accepted")
                trace[i]["calls"] += judged(why)
                if why is None:
                    picked[i] = cands[i][order[i][turn]]
                    fallback.setdefault(i, picked[i]["revised_content"])
        return picked


# ----------------------------------------------------------------------------- the registry

FAMILIES = {"AgenticGEO": AgenticGeo, "AutoGEO": AutoGeo, "MAGEO": Mageo, "GEO": Geo, "GEO-SFE": GeoSfe,
            "IF-GEO": IfGeo, "RAID-GSEO": RaidGseo}


def rewriter(family, mageo_signal="engine"):
    """A family's rewriter: MAGEO's with its signal (engine or reranker), the others as they are."""
    return FAMILIES[family](mageo_signal) if family == "MAGEO" else FAMILIES[family]()


def prompt_digests(names, mageo_signal="engine", archive=None, rules=None):
    """SHA-1 (12 hex) of what each family's model reads: its prompts, schemas, bundled archive or rules
    and parameters, and the shared fact-keeping instruction and gate; the archive or rules a build read
    instead (--agentic-archive, --autogeo-rules), when given. Recorded in the benchmark's _meta (with the
    code version beside it) so that a file says what wrote it; a docstring edit leaves it."""
    shared = [FACTS, FIDELITY_INSTRUCTION, str(FIDELITY_THRESHOLD), str((MIN_RATIO, MAX_RATIO))]
    given = {"AgenticGEO": archive, "AutoGEO": rules}
    out = {}
    for n in names:
        fam = rewriter(n, mageo_signal)
        read = [json.dumps(given[n], sort_keys=True)] if given.get(n) is not None else []
        out[n] = hashlib.sha1(json.dumps([fam.code, *fam.prompts(), *read, *shared]).encode()).hexdigest()[:12]
    return out
