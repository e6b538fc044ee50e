"""The paper's seven GEO attack families as document rewriters, for building GEO-DefenseBench (paper
B.1.1): AgenticGEO, AutoGEO and MAGEO (seen in construction), GEO, GEO-SFE, IF-GEO and RAID-GSEO
(unseen). Each family follows the algorithm of its own paper, in our own prompts; the docstring of
each says the paper (arXiv id), the LLM calls per document and every deviation.

A family works on a batch of jobs (query, source document) through `Ctx.ask` (one LLM request per
job and step, `workers` at a time, every reply cached by the client) and returns, per job, the
rewrite (or None) and its trace (calls, strategies or rules used, rounds). Every prompt carries its
family and step in the JSON <input> block, the documents inside JSON strings: text never becomes
prompt structure, and the offline engine recognises each prompt by these markers.

Usage: geo_attacks.FAMILIES["AutoGEO"].run(ctx, [Job("q", "source text")]) -> [(text, trace)]
"""
import json
from dataclasses import dataclass, field

import attack
import llm_clients

FACTS = ("Keep every fact of the document: keep every number, add no claim the document does not support "
         "and contradict nothing in it.")


@dataclass
class Job:
    query: str
    source: str
    attempt: int = 0              # > 0: a retry after the fidelity gate refused a rewrite (another prompt)
    group_id: str = ""


@dataclass
class Ctx:
    """What the families share: the builder's LLM client and settings, and the resources of some families
    (AgenticGEO's archive, AutoGEO's rules, MAGEO's engine signal: the base reranker over the group)."""
    llm: object
    temperature: float = 0.0
    max_tokens: int = 4096
    workers: int = 8
    archive: list = None
    rules: list = None
    engine: object = None         # MAGEO: job -> geodef.Instance (the group's candidates, the source in place)
    ranker: object = None         # MAGEO: the base reranker's Ranker (runs.base_ranker)
    judge: object = None          # the fidelity judge's client (default: llm)
    calls: dict = field(default_factory=dict)

    def ask(self, family, step, instruction, fields_per_job, schema, check=None):
        """One request per job -> [parsed JSON or None (unusable after the re-ask)]."""
        prompts = [prompt(family, step, instruction, f, schema) for f in fields_per_job]
        reps = self.llm.map([{"messages": [{"role": "user", "content": p}], "temperature": self.temperature,
                              "max_tokens": self.max_tokens, "json": True, "check": check} for p in prompts],
                            workers=self.workers, desc=f"{family} {step}", invalid="return")
        self.calls[family] = self.calls.get(family, 0) + len(prompts)
        return [None if isinstance(r, llm_clients.ReplyInvalid) else r.data for r in reps]


def prompt(family, step, instruction, fields, schema):
    inp = {"geo_family": family, "step": step, **fields}
    return (f"{instruction}\n\nReturn only JSON of the form {schema}.\n\n<input>\n"
            f"{json.dumps(inp, ensure_ascii=False)}\n</input>")


def need_text(key):
    """A reply check: data[key] is a non-empty string (else ValueError: re-asked once)."""
    def check(d):
        if not isinstance(d, dict) or not isinstance(d.get(key), str) or not d[key].strip():
            raise ValueError(f"expected {{\"{key}\": \"...\"}} with text")
    return check


def need_list(key):
    def check(d):
        v = d.get(key) if isinstance(d, dict) else None
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
            raise ValueError(f"expected {{\"{key}\": [\"...\"]}}")
    return check


REWRITE = '{"rewritten_document": "..."}'


def job_fields(j, **more):
    return {"query": j.query, "document": j.source, "attempt": j.attempt, **more}


def text_of(d):
    return d["rewritten_document"] if isinstance(d, dict) and isinstance(d.get("rewritten_document"), str) else None


# ----------------------------------------------------------------------------- GEO (unseen)

GEO_STATISTICS = ("Rewrite the document adding quantitative statements and statistics that support its points, "
                  "taken from figures the document already gives.")
GEO_FLUENCY = "Rewrite the document so that it reads fluently and smoothly."


class Geo:
    """GEO (Aggarwal et al., KDD 2024, arXiv 2311.09735). Its paper tests nine single-prompt methods
    and reports the combination of Fluency Optimization and Statistics Addition as its best overall;
    `GEO` here is that combination, in one rewrite. 1 call per document. Deviation: the statistics
    come from the document's own figures (the benchmark keeps facts), where GEO lets the model add
    plausible ones."""
    name, calls = "GEO", "1"

    def run(self, ctx, jobs):
        out = ctx.ask(self.name, "rewrite", f"{GEO_FLUENCY} {GEO_STATISTICS} {FACTS}",
                      [job_fields(j) for j in jobs], REWRITE, need_text("rewritten_document"))
        return [(text_of(d), {"calls": 1, "methods": ["fluency_optimization", "statistics_addition"]}) for d in out]


# ----------------------------------------------------------------------------- AutoGEO (seen)

# Our own preference rules, of the kind AutoGEO extracts from generative engines' preferences
# (explanations of why an engine preferred one document over another, merged into rules).
AUTOGEO_RULES = [
    "State the direct answer to the likely question in the first two sentences.",
    "Organise the content under clear, descriptive headings.",
    "Present comparable items, steps or options as lists.",
    "Name the sources or bodies behind key statements where the document names them.",
    "Give concrete numbers with their units wherever the document has them.",
    "Define technical terms the first time they appear.",
    "Cover the main sub-questions a reader would ask next.",
    "Keep paragraphs short, one idea each.",
    "End with a short summary of the key points.",
    "Use neutral, precise wording instead of vague qualifiers.",
]


def read_rules(path):
    """--autogeo-rules: AutoGEO's merged_rules.json ({"rules": [...]}, or {engine or domain: [...]}) or a
    plain JSON list of rule strings -> list of strings."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("rules", [r for v in data.values() if isinstance(v, list) for r in v])
    rules = [r if isinstance(r, str) else (r.get("rule") or r.get("text")) if isinstance(r, dict) else None
             for r in data] if isinstance(data, list) else []
    rules = [r for r in rules if isinstance(r, str) and r.strip()]
    if not rules:
        raise ValueError(f"{path}: no rules (a list of strings, or {{\"rules\": [...]}})")
    return rules


class AutoGeo:
    """AutoGEO (Wu et al., ICLR 2026, arXiv 2510.11438): one rewrite that follows a list of
    preference rules learned from generative engines. 1 call per document. Deviation: our own rule
    list (AUTOGEO_RULES) unless --autogeo-rules loads the paper's merged_rules.json; its fine-tuned
    rewriter (AutoGEO_mini) is not used: the builder LLM rewrites under the rules."""
    name, calls = "AutoGEO", "1"

    def run(self, ctx, jobs):
        rules = ctx.rules or AUTOGEO_RULES
        out = ctx.ask(self.name, "rewrite", "Rewrite the document so that it follows every preference rule "
                      f"listed in the input, in order of importance. {FACTS}",
                      [job_fields(j, preference_rules=rules) for j in jobs], REWRITE, need_text("rewritten_document"))
        return [(text_of(d), {"calls": 1, "rules": len(rules)}) for d in out]


# ----------------------------------------------------------------------------- AgenticGEO (seen)

# Our own strategy archive, in the format of AgenticGEO's archive (id, type, prompt, fitness); its
# fitness orders strategies as the learned critic would (declared: the critic is not reproduced).
AGENTIC_ARCHIVE = [
    {"id": "s01", "type": "answer_first", "fitness": 0.82,
     "prompt": "Open with a two-sentence answer to the query, then give the supporting detail."},
    {"id": "s02", "type": "evidence", "fitness": 0.78,
     "prompt": "Attribute each key statement to the organisation or study the document names for it."},
    {"id": "s03", "type": "structure", "fitness": 0.74,
     "prompt": "Split the document into short sections with descriptive headings and bullet lists."},
    {"id": "s04", "type": "evidence", "fitness": 0.71,
     "prompt": "Put every figure the document gives into an explicit, quotable sentence."},
    {"id": "s05", "type": "authority", "fitness": 0.66,
     "prompt": "Write in a confident expert register, stating conclusions plainly."},
    {"id": "s06", "type": "coverage", "fitness": 0.63,
     "prompt": "Answer the follow-up questions a reader of the query would ask, using the document's facts."},
    {"id": "s07", "type": "answer_first", "fitness": 0.58,
     "prompt": "Add a one-line key takeaway at the top and a short summary at the end."},
    {"id": "s08", "type": "structure", "fitness": 0.55,
     "prompt": "Turn comparisons and steps into numbered lists or a compact table in text."},
]


def read_archive(path):
    """--agentic-archive: AgenticGEO's strategies.json (a list, or {"strategies": [...]}) of {id, type,
    prompt, fitness} -> list of dicts, checked."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("strategies") or data.get("archive") or []
    out = []
    for i, s in enumerate(data if isinstance(data, list) else []):
        if not isinstance(s, dict) or not isinstance(s.get("prompt"), str) or not s["prompt"].strip():
            raise ValueError(f"{path}: strategy {i}: a prompt (string) is required")
        fit = s.get("fitness", s.get("score", 0.0))
        out.append({"id": str(s.get("id", i)), "type": str(s.get("type", s.get("category", "general"))),
                    "prompt": s["prompt"], "fitness": float(fit) if isinstance(fit, (int, float)) else 0.0})
    if not out:
        raise ValueError(f"{path}: no strategies")
    return out


def agentic_plan(archive, steps=3):
    """The strategies applied in order: the fittest, then the fittest of each type not used yet."""
    ranked = sorted(archive, key=lambda s: (-s["fitness"], s["id"]))
    plan, types = [ranked[0]], {ranked[0]["type"]}
    for s in ranked[1:]:
        if len(plan) == steps:
            break
        if s["type"] not in types:
            plan.append(s)
            types.add(s["type"])
    return plan


class AgenticGeo:
    """AgenticGEO (Yuan et al., arXiv 2603.20213): a rewriting agent that draws strategies from an
    evolving archive. Here: the best strategy by archive fitness is applied, then the best strategy
    of a type not yet used, for 3 rewrite steps (fewer when the archive has fewer types): 3 calls per
    document. Deviations: the archive is ours (AGENTIC_ARCHIVE) unless --agentic-archive loads the
    original strategies.json; the learned critic that picks strategies is not reproduced (archive
    fitness ranks them); the archive does not evolve while the benchmark is built."""
    name, calls = "AgenticGEO", "3"

    def run(self, ctx, jobs):
        plan = agentic_plan(ctx.archive or AGENTIC_ARCHIVE)
        texts = [j.source for j in jobs]
        for k, s in enumerate(plan):
            live = [i for i, t in enumerate(texts) if t is not None]
            out = ctx.ask(self.name, f"step{k + 1}", f"Apply the content strategy given in the input to the document. "
                          f"{FACTS}", [job_fields(jobs[i], document=texts[i], source_document=jobs[i].source,
                                                  strategy=s["prompt"]) for i in live],
                          REWRITE, need_text("rewritten_document"))
            for i, d in zip(live, out):
                texts[i] = text_of(d)
        trace = {"calls": len(plan), "strategies": [s["id"] for s in plan]}
        return [(t, dict(trace)) for t in texts]


# ----------------------------------------------------------------------------- GEO-SFE (unseen)

SFE_LEVELS = [
    ("architecture", "Re-engineer the document's overall architecture: a title, an opening summary, sections in "
                     "a logical order and a closing recap."),
    ("sections", "Re-engineer its sections and chunks: each section self-contained, one topic per chunk, with a "
                 "descriptive heading that a retriever could match on its own."),
    ("sentences", "Re-engineer its sentences for emphasis: key statements first in their paragraph, short "
                  "declarative sentences, the most citable facts set in bold."),
]


class GeoSfe:
    """GEO-SFE (arXiv 2603.29979): structural feature engineering at three levels (document
    architecture, sections and chunks, sentence-level emphasis), content kept. One call per level,
    each on the previous level's output: 3 calls per document. Deviation: the paper's level-specific
    feature scoring is not reproduced; each level is one guided rewrite."""
    name, calls = "GEO-SFE", "3"

    def run(self, ctx, jobs):
        texts = [j.source for j in jobs]
        for level, how in SFE_LEVELS:
            live = [i for i, t in enumerate(texts) if t is not None]
            out = ctx.ask(self.name, level, f"{how} Change structure and emphasis only. {FACTS}",
                          [job_fields(jobs[i], document=texts[i], source_document=jobs[i].source) for i in live],
                          REWRITE, need_text("rewritten_document"))
            for i, d in zip(live, out):
                texts[i] = text_of(d)
        return [(t, {"calls": 3, "levels": [lv for lv, _ in SFE_LEVELS]}) for t in texts]


# ----------------------------------------------------------------------------- IF-GEO (unseen)


class IfGeo:
    """IF-GEO (Zhou et al., arXiv 2601.13938): diverge then converge. Diverge: the latent queries the
    document could serve (1 call) and one edit request per latent query (1 call); converge: the
    requests fused into one revision blueprint, conflicts resolved (1 call), then one edit guided by
    the blueprint (1 call): 4 calls per document. Deviation: the paper's conflict-aware scoring of
    requests is done by the LLM inside the fusion step."""
    name, calls = "IF-GEO", "4"

    def run(self, ctx, jobs):
        n = len(jobs)
        lq = ctx.ask(self.name, "latent_queries", "List up to five different search queries, related to the given "
                     "query, that this document could answer.", [job_fields(j) for j in jobs],
                     '{"latent_queries": ["..."]}', need_list("latent_queries"))
        queries = [d["latent_queries"][:5] if d else None for d in lq]
        live = [i for i in range(n) if queries[i]]
        rq = ctx.ask(self.name, "edit_requests",
                     "For each latent query, write one request for an edit that would make "
                     f"the document serve that query better. {FACTS}",
                     [job_fields(jobs[i], latent_queries=queries[i]) for i in live],
                     '{"edit_requests": ["..."]}', need_list("edit_requests"))
        reqs = [None] * n
        for i, d in zip(live, rq):
            reqs[i] = d["edit_requests"] if d else None
        live = [i for i in live if reqs[i]]
        bp = ctx.ask(self.name, "blueprint", "Fuse the edit requests into one revision blueprint: merge overlapping "
                     "requests, resolve conflicting ones in favour of the main query, order the edits.",
                     [job_fields(jobs[i], edit_requests=reqs[i]) for i in live],
                     '{"blueprint": "..."}', need_text("blueprint"))
        plans = [None] * n
        for i, d in zip(live, bp):
            plans[i] = d["blueprint"] if d else None
        live = [i for i in live if plans[i]]
        ed = ctx.ask(self.name, "edit", f"Revise the document following the revision blueprint. {FACTS}",
                     [job_fields(jobs[i], blueprint=plans[i]) for i in live], REWRITE, need_text("rewritten_document"))
        texts = [None] * n
        for i, d in zip(live, ed):
            texts[i] = text_of(d)
        return [(texts[i], {"calls": 4, "latent_queries": len(queries[i] or []), "edit_requests": len(reqs[i] or [])})
                for i in range(n)]


# ----------------------------------------------------------------------------- RAID-GSEO (unseen)

RAID_ROLES = ["a newcomer to the topic", "a practitioner who must act on the answer", "a sceptical fact-checker"]


class RaidGseo:
    """RAID G-SEO (Chen et al., arXiv 2508.11158): the search intent behind the query inferred by
    reflective refinement across informational roles (a draft of each role's intent, 1 call; a
    reflection that reconciles them into one refined intent, 1 call), then a rewrite targeted at
    that intent (1 call): 3 calls per document. Deviation: one reflection round (the paper iterates)."""
    name, calls = "RAID-GSEO", "3"

    def run(self, ctx, jobs):
        n = len(jobs)
        dr = ctx.ask(self.name, "role_intents", "For each informational role, state in one sentence what that reader "
                     "wants to learn from the query.", [job_fields(j, roles=RAID_ROLES) for j in jobs],
                     '{"role_intents": ["..."]}', need_list("role_intents"))
        drafts = [d["role_intents"] if d else None for d in dr]
        live = [i for i in range(n) if drafts[i]]
        rf = ctx.ask(self.name, "reflect", "Reflect on the role intents: what do they share, what does each miss? "
                     "State the one refined search intent behind the query.",
                     [job_fields(jobs[i], role_intents=drafts[i]) for i in live],
                     '{"intent": "..."}', need_text("intent"))
        intent = [None] * n
        for i, d in zip(live, rf):
            intent[i] = d["intent"] if d else None
        live = [i for i in live if intent[i]]
        ed = ctx.ask(self.name, "rewrite", f"Rewrite the document so that it serves the refined search intent "
                     f"directly. {FACTS}", [job_fields(jobs[i], intent=intent[i]) for i in live],
                     REWRITE, need_text("rewritten_document"))
        texts = [None] * n
        for i, d in zip(live, ed):
            texts[i] = text_of(d)
        return [(texts[i], {"calls": 3, "roles": len(RAID_ROLES)}) for i in range(n)]


# ----------------------------------------------------------------------------- MAGEO (seen)

MAGEO_PLAN = ("Plan edits that would make a generative search engine select and cite this document for the query: "
              "list up to four concrete edits, each naming what to change and why.")
MAGEO_EDIT = f"Carry out the edit plan on the current document and return two different candidate rewrites. {FACTS}"


class Mageo(attack.Attack):
    """MAGEO (Wu et al., ACL 2026, arXiv 2604.19516): a multi-agent loop. Each round a planner proposes
    edits (1 call) and an editor writes two candidates (1 call); an evaluator checks faithfulness and
    attribution (the attacker's fidelity gate: cheap checks, then the fidelity judge, 1 call per
    candidate that passes them); the best candidate is kept only if the engine signal improves; up to
    R rounds, stopping after 2 rounds without improvement (patience 2). At most R x (2 + 2) calls
    per document (R = 3: 12). Built on attack.Attack's loop and gate. Deviations: the engine signal
    is the base reranker's score of the document among the group's candidates (MAGEO re-scores it in
    a simulated engine's answer); when no round improves, the best faithful candidate is kept
    (trace: improved false) so that every group has a rewrite."""
    name, calls = "MAGEO", "<= 12"

    def __init__(self, ctx, ranker, rounds=3, patience=2):
        cfg = type("S", (), {"temperature": ctx.temperature, "max_tokens": ctx.max_tokens, "workers": ctx.workers})
        super().__init__(cfg, "base", ranker, ctx.llm, ctx.judge or ctx.llm, rounds, 2, 1 + 2 * rounds)
        self.ctx, self.patience = ctx, patience

    def _propose(self, live, cands, rnd):
        best = [cands[x.instance_id][attack.best_of(cands[x.instance_id], len(cands[x.instance_id]))]["text"]
                for x in live]                                  # each instance's current best
        plans = self.ctx.ask(self.name, "plan", MAGEO_PLAN, [
            {"query": x.query, "document": b, "source_document": x.source, "round": rnd, "attempt": x.attempt}
            for x, b in zip(live, best)], '{"plan": ["..."]}', need_list("plan"))
        edits = self.ctx.ask(self.name, "edit", MAGEO_EDIT, [
            {"query": x.query, "document": b, "source_document": x.source, "plan": (p or {}).get("plan", []),
             "round": rnd, "attempt": x.attempt} for x, b, p in zip(live, best, plans)],
            '{"candidates": ["...", "..."]}', need_list("candidates"))
        two = [((e or {}).get("candidates") or [])[:2] for e in edits]
        return [c + [None] * (2 - len(c)) for c in two]     # a missing candidate still spends its budget

    def run(self, ctx, jobs):
        insts = [self.ctx.engine(j) for j in jobs]          # each job as an instance: the source at its position
        cands = {x.instance_id: [] for x in insts}
        for x, (s, r) in zip(insts, self.score(insts)):
            cands[x.instance_id].append({"n": 0, "round": 0, "sid": "", "text": x.source, "accepted": True,
                                         "reason": "the source", "score": s, "rank": r})
        stale = {x.instance_id: 0 for x in insts}
        for rnd in range(1, self.rounds + 1):
            live = [x for x in insts if stale[x.instance_id] < self.patience]
            if not live:
                break
            before = {x.instance_id: max(c["score"] for c in cands[x.instance_id] if c["accepted"]) for x in live}
            self._gate_and_score(live, cands, self._propose(live, cands, rnd), rnd)
            for x in live:
                now = max(c["score"] for c in cands[x.instance_id] if c["accepted"])
                stale[x.instance_id] = 0 if now > before[x.instance_id] else stale[x.instance_id] + 1
        def judged(c):                  # a candidate the fidelity judge read (accepted, or refused by it)
            return c["reason"] == "accepted" or c["reason"].startswith(("fidelity", "contra"))
        out = []
        for x in insts:
            cs = cands[x.instance_id]
            ok = [c for c in cs[1:] if c["accepted"]]
            best = max(ok, key=lambda c: (c["score"], -c["n"])) if ok else None
            out.append((best["text"] if best else None,
                        {"calls": 2 * max(c["round"] for c in cs) + sum(1 for c in cs[1:] if judged(c)),
                         "rounds": max(c["round"] for c in cs), "candidates": len(cs) - 1,
                         "improved": bool(best and best["score"] > cs[0]["score"]),
                         "candidate_gate": [c["reason"] for c in cs[1:]]}))
        return out


FAMILIES = {"AgenticGEO": AgenticGeo(), "AutoGEO": AutoGeo(), "MAGEO": None, "GEO": Geo(), "GEO-SFE": GeoSfe(),
            "IF-GEO": IfGeo(), "RAID-GSEO": RaidGseo()}
CALLS = {"AgenticGEO": 3, "AutoGEO": 1, "MAGEO": 12, "GEO": 1, "GEO-SFE": 3, "IF-GEO": 4, "RAID-GSEO": 3}


def family(name, ctx=None):
    """The rewriter of family `name` (MAGEO is built per context: it needs the engine signal)."""
    return Mageo(ctx, ctx.ranker) if name == "MAGEO" else FAMILIES[name]


def prompt_digests(names):
    """SHA-1 (12 hex) of each family's code, its prompts, rules and archive included, and of the shared
    fact-keeping instruction: recorded in the benchmark's _meta so that a file says what wrote it."""
    import hashlib
    import inspect
    classes = {"MAGEO": Mageo, **{k: type(v) for k, v in FAMILIES.items() if v is not None}}
    extra = {"AgenticGEO": json.dumps(AGENTIC_ARCHIVE), "AutoGEO": json.dumps(AUTOGEO_RULES),
             "GEO-SFE": json.dumps(SFE_LEVELS), "RAID-GSEO": json.dumps(RAID_ROLES),
             "MAGEO": MAGEO_PLAN + MAGEO_EDIT, "GEO": GEO_FLUENCY + GEO_STATISTICS}
    out = {n: hashlib.sha1((inspect.getsource(classes[n]) + extra.get(n, "") + FACTS).encode()).hexdigest()[:12]
           for n in names}
    return out
