"""GEO-DefenseBench data and the Shield Reranker objective (paper: "Shield Reranker", Eqs. 1-5; A.1; B.1).

Data: the JSON Lines format of the README's "Your own benchmark" (one query group per line: query, 10 ordered candidate
documents, the source document's index, one rewrite per GEO method, optional split), a validating
loader, the query-group split (B.1.2), instance expansion (B.1.1, B.1.3), the TFSG construction
schedule (A.2.2) and the Shield preference triples (A.1.1).
Math: pure functions of score tensors; shapes (..., D) over the candidate axis, (N,) per example;
every function returns per-example values and the caller reduces.

Deviations / choices the paper leaves open:
- d_b (A.1.1 "another query-relevant benign document from the same candidate list") is the benign
  candidate of the attack-injected list, other than the attack position, with the highest FROZEN
  base-reranker score: the most relevant other benign evidence by pi_0.
- Training uses only the three scored documents (d+, d_a, d_b). Eq. 1's normaliser over D(q) adds
  the same constant to every residual of one query and policy, so it cancels in Eqs. 3 and 4
  (test_geodef.py proves values and gradients equal with all 10 candidates).
- A file line `{"_meta": {...}}` (first line only) carries metadata: `methods` (every group must
  have each), `seen_methods` (the construction methods; never guessed: see `seen_methods`),
  `construction_methods` (when the construction groups hold more families than the seen ones, so
  that a Shield can be trained with any family held out), `synthetic`.
- A group line may carry `honest` (build-bench --honest): an honest edit of the source, not an
  attack; `honest_instance` puts it in the clean list, where eval and rerank-eval measure the honest
  penalty. Files without it load as before.
- Several attacked documents a list (build-bench --attacked K; _meta.attacked): a test line's
  `co_attacks` lists K-1 further candidates, each rewritten by one family ({index, method, text}), and
  `optimized` ({index: text}, _meta.pool "optimized") an honest edit of every other candidate. A group
  is then evaluated at every level 1..K (`attack_instance(g, m, level)`: the source and the first
  level-1 co-attacks), so exposure and ASR are measured against K on the same lists. The paper's
  lists hold one attacked document; files without these fields load and expand as before.

Usage: groups = load_bench("data/geo_defensebench_sample.jsonl"); split = split_groups(groups)
"""
import collections
import hashlib
import json
import random
import re
import unicodedata
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

N_DOCS = 10
# The paper's seven GEO methods; the three used for construction ("seen", Experiments / Fig. 3).
PAPER_METHODS = ("AgenticGEO", "AutoGEO", "MAGEO", "GEO", "GEO-SFE", "IF-GEO", "RAID-GSEO")
PAPER_SEEN_METHODS = ("AgenticGEO", "AutoGEO", "MAGEO")


# Chat-template control tokens spelled as text: <|im_start|>, <|im_end|>, <|endoftext|> (Qwen), <|eot_id|>,
# <|start_header_id|> (Llama 3), <｜Assistant｜> (DeepSeek's full-width bars), <start_of_turn> (Gemma),
# [INST] and <<SYS>> (Llama 2, Mistral), [SYSTEM_PROMPT] and the tool markers (Mistral), [gMASK] and <sop>
# (GLM), and Qwen3's added <think>, <tool_call>, <tool_response> (and their closing forms). An attacker's
# rewrite holding one would reach a self-hosted target LLM's prompt, where a tokenizer that matches added
# tokens in text (Hugging Face tokenizers does) makes it the token itself. Llama 2's <s> and </s> are left
# out: HTML's strikethrough spells them in ordinary pages.
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_.:-]{1,48}\|>|<｜[^｜<>\s]{1,48}｜>|</?(?:start|end)_of_turn>"
                           r"|</?(?:think|tool_call|tool_response)>|<sop>|\[gMASK\]|<</?SYS>>"
                           r"|\[/?(?:INST|SYSTEM_PROMPT|TOOL_CALLS|AVAILABLE_TOOLS|TOOL_RESULTS)\]")


def control_tokens(text):
    """The chat control tokens `text` spells out, in order of first appearance (none: [])."""
    return list(dict.fromkeys(CONTROL_TOKEN.findall(text)))


class BenchFormatError(ValueError):
    """A benchmark file that does not validate: `file:line: field: what is wrong`."""


@dataclass
class QueryGroup:
    group_id: str
    query: str
    docs: list            # N_DOCS dicts {doc_id, url, text}, in retrieval order
    source_index: int     # 0-based index of the document the GEO methods rewrote
    attacks: dict         # method name -> rewritten text of docs[source_index]
    split: str = None     # "construction" | "test" | None (then split_groups decides)
    line: int = 0
    honest: str = None    # an honest edit of docs[source_index] (build-bench --honest), or None
    failed: dict = None   # method -> why build-bench's gate refused its every rewrite: the group has none of it
    co_attacks: list = None   # [(index, method, text)]: further candidates rewritten (build-bench --attacked K)
    optimized: dict = None    # {index: text}: honest edits of the other candidates (build-bench --pool optimized)


@dataclass
class Instance:
    """One candidate list shown to the pipeline. `docs` is all a prompt may see; the labels
    (attack_index, method, split, group_id) travel beside it and never into prompt text."""
    instance_id: str
    group_id: str
    query: str
    docs: list            # N_DOCS texts
    doc_ids: list         # N_DOCS ids; the attack document gets "<source doc_id>#<method>"
    attack_index: int = None   # position of the GEO rewrite, None for the clean instance
    method: str = None
    split: str = None
    source: str = None    # the clean document the rewrite replaced (what an attacker must stay faithful to)
    co_attacks: tuple = ()  # positions of the further attacked documents (a list with several; labels too)

    @property
    def attacked(self):
        """Positions of every attacked document: the source's rewrite first."""
        return () if self.attack_index is None else (self.attack_index, *self.co_attacks)


@dataclass
class BenchMeta:
    methods: list = field(default_factory=list)
    seen_methods: list = field(default_factory=list)
    synthetic: bool = False
    raw: dict = field(default_factory=dict)
    n_docs: int = N_DOCS      # candidates per list (_meta.n_docs; the paper's ten by default)
    # the families rewritten in the construction groups (_meta.construction_methods, written by
    # build-bench --construction-families): absent, the seen ones (B.1: 12 x 3), else every method
    construction_methods: list = field(default_factory=list)
    attacked: int = 1         # attacked documents a test list holds at most (_meta.attacked; build-bench --attacked)
    pool: str = "search"      # "optimized": every other candidate honestly edited (_meta.pool; --pool optimized)

    def construction(self):
        """The methods every construction group holds: those a Shield may be trained on."""
        return self.construction_methods or self.seen_methods or self.methods


def _fail(path, line, fld, msg):
    if not fld.isprintable() or len(fld) > 80:     # a key the file wrote: the error stays one bounded line
        fld = repr(fld[:80])
    raise BenchFormatError(f"{path}:{line}: {fld}: {msg}")


def check_unicode(text, path, line, fld):
    """Text that cannot be written as UTF-8 (a lone surrogate such as "\\ud800", which JSON escapes
    allow) would fail far later, in the tokenizer or an HTTP request."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        _fail(path, line, fld, f"not valid Unicode text (character {e.start}: lone surrogate {text[e.start]!r})")


def check_text(text, path, line, fld):
    """check_unicode, and no chat control token spelled out: a benchmark's texts reach the target LLM's
    prompt, where a self-hosted template reads one as structure."""
    check_unicode(text, path, line, fld)
    found = control_tokens(text)
    if found:
        _fail(path, line, fld, f"holds chat control tokens {found[:3]}")


def _need(obj, key, typ, path, line, prefix=""):
    if key not in obj:
        _fail(path, line, prefix + key, "missing")
    v = obj[key]
    if typ is int and isinstance(v, bool) or not isinstance(v, typ):
        _fail(path, line, prefix + key, f"expected {typ.__name__}, got {type(v).__name__}")
    return v


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs):
    """A JSON object's pairs -> dict; a key given twice raises (json.loads would keep the later one)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


def read_jsonl(path):
    """Yield (line number, object) for each non-blank line of a JSONL file; a line that is not a JSON
    object raises BenchFormatError naming the file and line."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError as e:
        at = e.start + 3 * data.startswith(b"\xef\xbb\xbf")    # e.start counts past the byte-order mark
        line, col = data.count(b"\n", 0, at) + 1, at - data.rfind(b"\n", 0, at)
        _fail(path, line, "(line)", f"not UTF-8: byte 0x{data[at]:02x} (byte {col} of the line); "
                                    "save the file as UTF-8")
    # split on "\n" only: str.splitlines() also breaks at U+2028, U+0085, ..., which JSON strings may
    # hold unescaped (json.dumps(..., ensure_ascii=False) writes them raw); a CRLF's "\r" is JSON whitespace
    for n, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            _fail(path, n, "(line)", f"invalid JSON: key {e.args[0]!r} given twice in one object")
        except json.JSONDecodeError as e:
            _fail(path, n, "(line)", f"invalid JSON: {e.msg} at column {e.colno}")
        except RecursionError:
            _fail(path, n, "(line)", "invalid JSON: nested too deeply")
        except ValueError as e:          # an integer of more than 4300 digits (int_max_str_digits)
            _fail(path, n, "(line)", f"invalid JSON: {str(e).split(';')[0]}")
        if not isinstance(obj, dict):
            _fail(path, n, "(line)", f"expected a JSON object, got {type(obj).__name__}")
        yield n, obj


def load_bench(path, n_docs=N_DOCS, with_meta=False):
    """Read and validate a GEO-DefenseBench JSONL file -> list[QueryGroup] (and BenchMeta)."""
    groups, meta, seen_ids, meta_line, has_meta = [], BenchMeta(), {}, 1, False
    for n, obj in read_jsonl(path):
        if "_meta" in obj:
            if groups or has_meta:   # a second _meta would silently replace the first
                _fail(path, n, "_meta", "metadata must be the first line, and only there")
            if len(obj) > 1:         # a group written on it would be dropped unread
                _fail(path, n, "_meta", f"the metadata line holds _meta alone, not {sorted(obj)[:5]}"[:200])
            meta_line, has_meta, meta = n, True, _read_meta(obj, path, n)
            n_docs = meta.raw.get("n_docs", n_docs)       # a list length the builder was asked for (--docs)
            if isinstance(n_docs, bool) or not isinstance(n_docs, int) or not 2 <= n_docs <= N_DOCS:
                _fail(path, n, "_meta.n_docs", f"an integer in 2..{N_DOCS}, got {n_docs!r}")
            meta.n_docs = n_docs
            if meta.attacked >= n_docs:
                _fail(path, n, "_meta.attacked", f"{meta.attacked}: a list of {n_docs} candidates holds at most "
                                                 f"{n_docs - 1} attacked documents")
            continue
        g = _read_group(obj, path, n, n_docs, meta)
        if g.group_id in seen_ids:
            _fail(path, n, "group_id", f"duplicate {g.group_id!r} (first on line {seen_ids[g.group_id]})")
        seen_ids[g.group_id] = n
        groups.append(g)
    if not groups:
        raise BenchFormatError(f"{path}: no query groups")
    has = [g.split is not None for g in groups]
    if any(has) and not all(has):
        g = groups[has.index(False)]
        _fail(path, g.line, "split", "some lines have a split and this one has none: give all or none")
    if all(has):
        check_no_leakage(groups, path)
    if not meta.methods:  # no _meta.methods: every method some group has, and every group not of the
        # construction split needs each (a construction group holds the seen ones; `failed` ones are absent)
        meta.methods = sorted({m for g in groups for m in (*g.attacks, *(g.failed or {}))})
        for g in groups:
            missing = [m for m in meta.methods if g.split != "construction" and m not in g.attacks
                       and m not in (g.failed or {})]
            if missing:
                _fail(path, g.line, "attacks", f"missing methods {missing} that other groups have; every group "
                                               "needs every method (or its reason under `failed`)")
        unknown = [m for m in meta.seen_methods if m not in meta.methods]
        if unknown:
            _fail(path, meta_line, "_meta.seen_methods", f"{unknown} not among the groups' methods {meta.methods}")
    return (groups, meta) if with_meta else groups


def read_meta(path):
    """The `_meta` line of a benchmark file alone (its first line; BenchMeta() when it has none), for
    checks that need no group, such as who built the file."""
    # its first line that is not blank, as load_bench reads it (a byte-order mark is no text); a line that does not
    # decode or parse is load_bench's to report
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        obj = json.loads(first)
    except (ValueError, RecursionError):
        return BenchMeta()
    return _read_meta(obj, path, 1) if isinstance(obj, dict) and "_meta" in obj else BenchMeta()


# _meta's fields the reports print: labels (a builder model, a judge, a search service) and counts by name
META_LABELS = ("builder_llm", "test_builder_llm", "fidelity_judge", "test_fidelity_judge", "mageo_engine", "search")
META_COUNTS = ("family_drops", "honest_refusals")
LABEL = re.compile(r"[^\x00-\x1f\x7f<>|`\u2028\u2029\ud800-\udfff]{0,300}")     # (a lone surrogate: no UTF-8)


def _read_meta(obj, path, n):
    """The `_meta` line -> BenchMeta (methods and seen_methods: lists of distinct names)."""
    m = _need(obj, "_meta", dict, path, n)
    for key in ("methods", "seen_methods", "construction_methods"):
        v = m.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            _fail(path, n, f"_meta.{key}", f"expected a list of method names, got {v!r}")
        dup = sorted(x for x, c in collections.Counter(v).items() if c > 1)      # (linear: a hostile line is long)
        if dup:   # a repeated seen method would repeat its construction instances
            _fail(path, n, f"_meta.{key}", f"{dup} listed more than once")
    methods = set(m.get("methods", []))
    for key in ("seen_methods", "construction_methods"):
        unknown = [x for x in m.get(key, []) if methods and x not in methods]
        if unknown:
            _fail(path, n, f"_meta.{key}", f"{unknown} not in _meta.methods {m['methods']}")
    cons = m.get("construction_methods", [])
    known = set(cons)
    unknown = [x for x in m.get("seen_methods", []) if cons and x not in known]
    if unknown:
        _fail(path, n, "_meta.seen_methods", f"{unknown} not in _meta.construction_methods {cons}")
    for key in META_LABELS:         # models and services: printed into reports as they are
        v = m.get(key)
        if v is not None and not (isinstance(v, str) and LABEL.fullmatch(v)):
            _fail(path, n, f"_meta.{key}", f"a model label (one line of at most 300 characters, no < > | or `, valid "
                                           f"Unicode), got "
                                           f"{str(v)[:80]!r}")
    for key in META_COUNTS:
        v = m.get(key)
        if v is not None and not (isinstance(v, dict) and all(
                isinstance(k, str) and LABEL.fullmatch(k) and isinstance(c, int) and not isinstance(c, bool) and c >= 0
                for k, c in v.items())):
            _fail(path, n, f"_meta.{key}", f"counts by name {{name: whole number}}, got {str(v)[:80]!r}")
    attacked, pool = m.get("attacked", 1), m.get("pool", "search")
    if isinstance(attacked, bool) or not isinstance(attacked, int) or not 1 <= attacked <= N_DOCS - 1:
        _fail(path, n, "_meta.attacked", f"an integer in 1..{N_DOCS - 1}, got {attacked!r}")
    if pool not in ("search", "optimized"):
        _fail(path, n, "_meta.pool", f"'search' or 'optimized', got {pool!r}")
    return BenchMeta(methods=list(m.get("methods", [])), seen_methods=list(m.get("seen_methods", [])),
                     synthetic=bool(m.get("synthetic", False)), raw=m, construction_methods=list(cons),
                     attacked=attacked, pool=pool)


# The fields a query-group line may hold (build-bench writes them all); a key starting with "_" is the
# file's own note. Any other is refused: a misspelled "Split" would otherwise leave the split to the shuffle.
LINE_KEYS = ("group_id", "query", "docs", "source_index", "attacks", "trace", "failed", "split", "honest",
             "honest_trace", "co_attacks", "optimized")


def _read_group(obj, path, n, n_docs, meta):
    """One query-group line -> QueryGroup, every field checked (file:line: field: what is wrong)."""
    unknown = [k for k in obj if k not in LINE_KEYS and not k.startswith("_")]
    if unknown:
        _fail(path, n, unknown[0], f"not a field of a query-group line (known: {', '.join(LINE_KEYS)}; a key "
                                   "starting with '_' is a note)")
    gid = _need(obj, "group_id", str, path, n)
    if not gid.strip():
        _fail(path, n, "group_id", "empty")
    check_unicode(gid, path, n, "group_id")          # ids reach every record: checked as the texts are
    if ":" in gid:                                    # instance ids are group:method[:K]: no two may meet
        _fail(path, n, "group_id", f"{gid!r} holds ':', which instance ids use (<group>:<method>)")
    query = _need(obj, "query", str, path, n)
    if not query.strip():
        _fail(path, n, "query", "empty")
    check_text(query, path, n, "query")
    docs = _read_docs(obj, path, n, n_docs)
    src = _need(obj, "source_index", int, path, n)
    if not 0 <= src < n_docs:
        _fail(path, n, "source_index", f"{src} out of range 0..{n_docs - 1}")
    source_norm = " ".join(docs[src]["text"].split())
    attacks, failed = _read_attacks(obj, path, n, source_norm)
    unknown = [m for m in attacks if meta.methods and m not in meta.methods]
    if unknown:                     # a rewrite no evaluation reads
        _fail(path, n, "attacks", f"{unknown} not in _meta.methods {meta.methods}"[:300])
    split = obj.get("split")
    if split is not None and split not in ("construction", "test"):
        _fail(path, n, "split", f"expected 'construction' or 'test', got {split!r}")
    # a construction group needs only its families (Table B.1: 12 x 3, the seen ones), a test group every
    # method; a method the build's gate refused on this group (`failed`) is absent, with its reason
    need = meta.construction() if split == "construction" else meta.methods
    missing = [m for m in need if m not in attacks and m not in failed]
    if missing:
        key = ("construction_methods" if need is meta.construction_methods else
               "seen_methods" if need is meta.seen_methods else "methods")
        _fail(path, n, "attacks", f"missing methods {missing} listed in _meta.{key}")
    honest = _read_honest(obj, path, n, source_norm) if "honest" in obj else None
    trace = obj.get("trace", {})                 # build-bench's, per method: bench-audit reads its attempts
    attempts = lambda a: isinstance(a, int) and not isinstance(a, bool) and a >= 1
    if not isinstance(trace, dict) or not all(isinstance(t, dict) and attempts(t.get("attempts", 1))
                                              for t in trace.values()):
        _fail(path, n, "trace", "expected {method: {\"attempts\": a whole number >= 1, ...}}, as build-bench "
                                f"writes it, got {str(trace)[:80]!r}")
    others = {" ".join(d["text"].split()): i for i, d in enumerate(docs) if i != src}
    for fld, t in [(f"attacks.{m}", t) for m, t in attacks.items()] + ([("honest", honest)] if honest else []):
        i = others.get(" ".join(t.split()))
        if i is not None:                      # the list would show one text twice: Eq. 4 then pulls apart a tie
            _fail(path, n, fld, f"a copy of docs[{i}]: the list would show one text twice")
    co = _read_co_attacks(obj, path, n, docs, src, meta) if "co_attacks" in obj else None
    attack_at = {" ".join(t.split()): f"attacks.{m}" for m, t in attacks.items()}
    shown = dict(attack_at)
    for j, (i, _, t) in enumerate(co or ()):       # a list of the K levels shows each co-attack beside the rest
        seen, norm = {**{k: f"docs[{x}]" for k, x in others.items() if x != i}, **shown}, " ".join(t.split())
        if norm in seen:
            _fail(path, n, f"co_attacks[{j}].text", f"a copy of {seen[norm]}: a list would show one text twice")
        shown[norm] = f"co_attacks[{j}].text"
    opt = _read_optimized(obj, path, n, docs, src, meta) if "optimized" in obj else None
    if opt:                 # the pool's edits stand in for their candidates, beside every other text a list shows
        seen = {**{k: f"docs[{x}]" for k, x in others.items() if x not in opt}, source_norm: f"docs[{src}]",
                **attack_at,
                **({" ".join(honest.split()): "honest"} if honest else {})}
        co_at = {" ".join(t.split()): (x, f"co_attacks[{j}].text") for j, (x, _, t) in enumerate(co or ())}
        for i, t in opt.items():
            norm = " ".join(t.split())
            copied = seen.get(norm) or (co_at[norm][1] if co_at.get(norm, (i,))[0] != i else None)
            if copied:
                _fail(path, n, f"optimized.{i}", f"a copy of {copied}: a list would show one text twice")
            seen[norm] = f"optimized.{i}"
    for fld, v in (("co_attacks", co), ("optimized", opt)):
        if v and split != "test":        # a drawn split could put them in construction, where the Shield trains
            _fail(path, n, fld, "only on a test line (split \"test\"): construction groups hold one attacked "
                                "document and the search's pool, as the Shield trains on them")
    return QueryGroup(gid, query, docs, src, dict(attacks), split, n, honest, dict(failed) or None, co, opt)


def _read_docs(obj, path, n, n_docs):
    """A group's `docs`: n_docs objects, each a doc_id (unique in the group, no '#') and a non-empty text
    no earlier candidate repeats, a url optional -> the list."""
    docs = _need(obj, "docs", list, path, n)
    if len(docs) != n_docs:
        _fail(path, n, "docs", f"must hold {n_docs} items, got {len(docs)}")
    texts = set()
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            _fail(path, n, f"docs[{i}]", f"expected object, got {type(d).__name__}")
        did = _need(d, "doc_id", str, path, n, f"docs[{i}].")
        check_unicode(did, path, n, f"docs[{i}].doc_id")
        if "#" in did:   # attack documents get "<source doc_id>#<method>": a benign one must not look like one
            _fail(path, n, f"docs[{i}].doc_id", f"{did!r}: '#' is reserved for attack document ids")
        t = _need(d, "text", str, path, n, f"docs[{i}].")
        check_text(t, path, n, f"docs[{i}].text")
        if not t.strip():
            _fail(path, n, f"docs[{i}].text", "empty")
        if " ".join(t.split()) in texts:
            _fail(path, n, f"docs[{i}].text", "duplicate of an earlier document in this group")
        texts.add(" ".join(t.split()))
        if "url" in d and not isinstance(d["url"], str):
            _fail(path, n, f"docs[{i}].url", f"expected str, got {type(d['url']).__name__}")
        check_unicode(d.get("url", ""), path, n, f"docs[{i}].url")
    if len({d["doc_id"] for d in docs}) != n_docs:
        _fail(path, n, "docs", "doc_id values must be unique within the group")
    return docs


METHOD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def _read_attacks(obj, path, n, source_norm):
    """A group's `attacks` ({method: rewrite}, each non-empty and not its source, whose normalized text
    is `source_norm`) and `failed` ({method: why the build's gate refused it}, none of them rewritten
    too) -> (attacks, failed)."""
    attacks = _need(obj, "attacks", dict, path, n)
    if not attacks:
        _fail(path, n, "attacks", "no rewrites")
    for m, t in attacks.items():
        check_unicode(m, path, n, "attacks (a method's name)")
        if not METHOD_NAME.fullmatch(m) or m in ("clean", "honest"):   # its instance id: <group>:<method>
            _fail(path, n, f"attacks.{m}", "a method's name is letters, digits, '.', '_', '+' and '-', and not "
                                           "'clean' or 'honest' (the ids of a group's other lists)")
        if not _need(attacks, m, str, path, n, "attacks.").strip():
            _fail(path, n, f"attacks.{m}", "empty rewrite")
        check_text(t, path, n, f"attacks.{m}")
        if " ".join(t.split()) == source_norm:
            _fail(path, n, f"attacks.{m}", "rewrite is identical to its source document")
    failed = obj.get("failed", {})
    if not isinstance(failed, dict) or not all(isinstance(v, str) for v in failed.values()):
        _fail(path, n, "failed", f"expected {{method: why}}, got {failed!r}"[:200])
    both = [m for m in failed if m in attacks]
    if both:
        _fail(path, n, "failed", f"{both} have a rewrite in attacks too")
    return attacks, failed


def _read_co_attacks(obj, path, n, docs, src, meta):
    """The optional `co_attacks` (build-bench --attacked K): [{index, method, text}], each a candidate
    other than the source, once, rewritten by one of the file's methods -> [(index, method, text)]."""
    v = obj["co_attacks"]
    if not isinstance(v, list):
        _fail(path, n, "co_attacks", f"expected a list, got {type(v).__name__}")
    out = []
    for j, c in enumerate(v):
        if not isinstance(c, dict):
            _fail(path, n, f"co_attacks[{j}]", f"expected object, got {type(c).__name__}")
        i = _need(c, "index", int, path, n, f"co_attacks[{j}].")
        if not 0 <= i < len(docs) or i == src or i in [o[0] for o in out]:
            _fail(path, n, f"co_attacks[{j}].index", f"{i}: a candidate index in 0..{len(docs) - 1}, not the "
                                                      "source_index and not listed before")
        m = _need(c, "method", str, path, n, f"co_attacks[{j}].")
        if not METHOD_NAME.fullmatch(m):                      # (a doc id carries it: <doc>#<method>)
            _fail(path, n, f"co_attacks[{j}].method", "a method's name is letters, digits, '.', '_', '+' and '-'")
        if meta.methods and m not in meta.methods:
            _fail(path, n, f"co_attacks[{j}].method", f"{m!r} not in _meta.methods {meta.methods}")
        t = _need(c, "text", str, path, n, f"co_attacks[{j}].")
        check_text(t, path, n, f"co_attacks[{j}].text")
        if not t.strip() or " ".join(t.split()) == " ".join(docs[i]["text"].split()):
            _fail(path, n, f"co_attacks[{j}].text", "empty, or identical to the candidate it rewrites")
        out.append((i, m, t))
    if len(out) > meta.attacked - 1:
        _fail(path, n, "co_attacks", f"{len(out)} further attacked documents; _meta.attacked {meta.attacked} allows "
                                     f"{meta.attacked - 1}")
    return out


def _read_optimized(obj, path, n, docs, src, meta):
    """The optional `optimized` (build-bench --pool optimized): {index: honest edit} of candidates other
    than the source; text that spells no chat control token -> {int index: text}."""
    v = obj["optimized"]
    if meta.pool != "optimized":
        _fail(path, n, "optimized", "honest edits of the pool need _meta.pool \"optimized\"")
    if not isinstance(v, dict):
        _fail(path, n, "optimized", f"expected {{index: text}}, got {type(v).__name__}")
    out = {}
    for k, t in v.items():
        i = int(k) if re.fullmatch(r"0|[1-9][0-9]{0,2}", k) else None      # one spelling per index: no "01"
        if i is None or not 0 <= i < len(docs) or i == src:
            _fail(path, n, f"optimized.{k}", f"a candidate index in 0..{len(docs) - 1} other than the source_index")
        if not isinstance(t, str) or not t.strip():
            _fail(path, n, f"optimized.{k}", "expected the candidate's edited text")
        check_text(t, path, n, f"optimized.{k}")
        out[i] = t
    return out


def _read_honest(obj, path, n, source_norm):
    """The optional `honest` field (build-bench --honest): an honest edit of the source, text that is
    not the source and spells no chat control token (it reaches the target LLM's prompt as a document)."""
    t = _need(obj, "honest", str, path, n)
    if not t.strip():
        _fail(path, n, "honest", "empty edit")
    check_text(t, path, n, "honest")
    if " ".join(t.split()) == source_norm:
        _fail(path, n, "honest", "edit is identical to its source document")
    return t


def seen_methods(meta, given=None, path="(bench)"):
    """The GEO methods construction uses (B.1: three "seen" methods): `given` (a list, e.g. from the
    command line), else the file's `_meta.seen_methods`, else, for a file with exactly the paper's
    seven methods, the paper's seen set. Anything else is an error: a guessed set would build the
    Shield and TFSG on methods the report then calls unseen. -> (methods, where they came from)."""
    if given:
        unknown = [m for m in given if m not in meta.methods]
        if unknown:
            raise BenchFormatError(f"{path}: seen methods {unknown} are not among the benchmark's methods "
                                   f"{meta.methods}")
        absent = [m for m in given if m not in meta.construction()]
        if absent:
            raise BenchFormatError(f"{path}: seen methods {absent} have no construction instances (its construction "
                                   f"groups hold {meta.construction()}; build-bench --construction-families all "
                                   "rewrites them for every family)")
        return list(dict.fromkeys(given)), "given"
    if meta.seen_methods:
        return list(meta.seen_methods), "_meta.seen_methods"
    if sorted(meta.methods) == sorted(PAPER_METHODS):
        return list(PAPER_SEEN_METHODS), "the paper's seen methods"
    raise BenchFormatError(f"{path}: _meta.seen_methods: missing; name the methods construction uses "
                           f"(--seen-methods, or a first line {{\"_meta\": {{\"seen_methods\": [...]}}}}) "
                           f"among {meta.methods}")


# The marks that end or quote a query, not part of its words ("C++", "C#" and ".NET" keep theirs)
_QUERY_MARKS = str.maketrans(dict.fromkeys(',;:!?¿¡"“”„«»‘’…、，。！？；：「」『』', " "))


def query_key(q):
    """A query as B.1.2 compares queries across splits: Unicode-normalised (NFKC), case-folded, without the
    marks that end or quote it, a final full stop or the runs of spaces ("What is GEO?" is "what is geo")."""
    return " ".join(unicodedata.normalize("NFKC", q).casefold().translate(_QUERY_MARKS).split()).rstrip(". ")


def shown_texts(g):
    """A group's query and every text a list of it may show (its candidates, rewrites, honest edit, further
    attacked and optimised candidates), normalised -> [(kind, SHA-1)]: what B.1.2 keeps to one split."""
    texts = [d["text"] for d in g.docs] + list(g.attacks.values()) + ([g.honest] if g.honest else []) + \
        [t for _, _, t in g.co_attacks or ()] + list((g.optimized or {}).values())
    keys = [("query", query_key(g.query))] + [("document", " ".join(t.split())) for t in texts]
    return [(kind, hashlib.sha1(k.encode()).hexdigest()) for kind, k in keys]


def check_no_leakage(groups, path="(groups)"):
    """B.1.2: no query and no text a list shows may appear in both splits (a rewrite of a construction source
    reappearing as a test candidate is a leak too)."""
    seen = {}
    for g in groups:
        for kind, h in dict.fromkeys(shown_texts(g)):
            other = seen.get((kind, h))
            if other and other[0] != g.split:
                _fail(path, g.line, "split", f"the same {kind} is in split {other[0]!r} "
                                             f"(group {other[1]}) and {g.split!r} (group {g.group_id})")
            seen.setdefault((kind, h), (g.split, g.group_id))


def linked_groups(groups):
    """group_id -> the set of groups sharing a query or a shown text with it, directly or through others
    (shown_texts): what a drawn split keeps on one side."""
    parent = {g.group_id: g.group_id for g in groups}

    def root(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a
    first = {}
    for g in groups:
        for key in shown_texts(g):
            parent[root(g.group_id)] = root(first.setdefault(key, g.group_id))
    members = {}
    for gid in parent:
        members.setdefault(root(gid), set()).add(gid)
    return {gid: members[root(gid)] for gid in parent}


def split_groups(groups, n_construction=12, seed=0):
    """Query-group split (B.1.2). Uses the file's `split` fields when present, else a seeded shuffle of
    the group ids: the first n_construction are construction (each with the groups it shares a query or a
    shown text with, linked_groups: so at least n_construction), the rest test. -> (construction, test)."""
    if all(g.split for g in groups):
        cons, test = [g for g in groups if g.split == "construction"], [g for g in groups if g.split == "test"]
        for side, name in ((cons, "construction"), (test, "test")):
            if not side:  # training or evaluation would silently run on nothing
                raise ValueError(f"the file's split fields put no group in {name!r} (all {len(groups)} are "
                                 f"{groups[0].split!r}); the pipeline needs both")
        return cons, test
    if n_construction >= len(groups):
        raise ValueError(f"n_construction={n_construction} leaves no test group ({len(groups)} groups in all)")
    ids = sorted(g.group_id for g in groups)
    random.Random(seed).shuffle(ids)
    linked, cons = linked_groups(groups), set()
    for gid in ids:              # a group joins with every group it shares a text with (B.1.2 across the split)
        if len(cons) >= n_construction:
            break
        cons |= linked[gid]
    if len(cons) == len(groups):
        raise ValueError(f"the {len(groups)} groups share queries or texts so that no split leaves a test group "
                         "apart from the construction groups: give the file split fields")
    # copies: the caller's groups keep their (absent) split
    return ([replace(g, split="construction") for g in groups if g.group_id in cons],
            [replace(g, split="test") for g in groups if g.group_id not in cons])


def attack_instance(g, method, level=1):
    """B.1.1: docs[source_index] replaced IN PLACE by the method's rewrite (nine benign + one attack).
    level > 1 (a file built with --attacked K): the group's first level-1 co-attacks replace their
    candidates too, each id "<doc_id>#<its method>", and the instance id ends ":K<level>"; with an
    optimized pool every other candidate shows its honest edit (its id unchanged: the same page)."""
    docs, ids = _pool_texts(g), [d["doc_id"] for d in g.docs]
    docs[g.source_index], ids[g.source_index] = g.attacks[method], f"{ids[g.source_index]}#{method}"
    co = (g.co_attacks or [])[:level - 1]
    for i, m, text in co:
        docs[i], ids[i] = text, f"{ids[i]}#{m}"
    return Instance(f"{g.group_id}:{method}" + (f":K{level}" if level > 1 else ""), g.group_id, g.query, docs, ids,
                    g.source_index, method, g.split, g.docs[g.source_index]["text"], tuple(i for i, _, _ in co))


def clean_instance(g):
    """B.1.3: the original benign list; its base top-5 + A.3.7 answer is the clean reference. With an
    optimised pool (--pool optimized) the other candidates show their honest edits, as in the attacked
    lists, and the source stays as retrieved: the clean list is the attacked one without its attacks."""
    return Instance(f"{g.group_id}:clean", g.group_id, g.query, _pool_texts(g), [d["doc_id"] for d in g.docs],
                    None, None, g.split)


def _pool_texts(g):
    """The group's candidate texts, each other candidate's honest edit in place with an optimised pool."""
    return [(g.optimized or {}).get(i, d["text"]) for i, d in enumerate(g.docs)]


def honest_instance(g):
    """The clean list with docs[source_index] replaced IN PLACE by the group's honest edit (method
    "honest", its doc id "<source doc_id>#honest"): where the honest penalty is measured."""
    if g.honest is None:
        raise ValueError(f"group {g.group_id}: no honest edit (build-bench --honest writes one)")
    docs, ids = _pool_texts(g), [d["doc_id"] for d in g.docs]
    docs[g.source_index], ids[g.source_index] = g.honest, f"{ids[g.source_index]}#honest"
    return Instance(f"{g.group_id}:honest", g.group_id, g.query, docs, ids, g.source_index, "honest", g.split,
                    g.docs[g.source_index]["text"])


def expand(groups, methods, paper=False):
    """Every group x method (in the given method order), group-major; a method a group has no rewrite of
    (its `failed` ones) is left out, so each method is measured over the groups it rewrote. A group with
    co-attacks (--attacked K) gives each method's list at every level 1..K, level-major within the method;
    paper=True: level 1 alone (the paper's lists, one attacked document), for figures that pool instances."""
    return [attack_instance(g, m, lv) for g in groups for m in methods if m in g.attacks
            for lv in range(1, 2 + (0 if paper else len(g.co_attacks or ())))]


def attacked_levels(insts):
    """The numbers of attacked documents the instances' lists hold, ascending ([1] for the paper's)."""
    return sorted({len(x.attacked) for x in insts if x.attack_index is not None})


def construction_schedule(instances, n_seed=6, batch_size=10, n_batches=3, seed=0):
    """A.2.2: a seeded order of the construction instances; the first n_seed form the controlled
    contrast cases (E0 -> E1), the next n_batches x batch_size the update batches (E1 -> E2 ...).
    -> (seed_cases, [batch, ...]). Fewer instances than asked shrink the last batches."""
    order = sorted(instances, key=lambda x: x.instance_id)
    random.Random(seed).shuffle(order)
    seed_cases, rest = order[:n_seed], order[n_seed:]
    batches = [rest[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]
    return seed_cases, [b for b in batches if b]


def monitoring_split(instances, frac=0.2, seed=0, linked=None):
    """Table A.1: 80% optimisation / 20% monitoring, by query group. -> (optimise, monitor). linked
    (linked_groups): a group goes to the monitoring side with the groups it shares a text with, as a drawn
    split keeps them (a document trained on would inflate the figure that picks the epoch)."""
    gids = sorted({x.group_id for x in instances})
    random.Random(seed).shuffle(gids)
    n_mon = max(1, round(frac * len(gids))) if len(gids) > 1 else 0
    mon, here = set(), set(gids)
    for gid in gids:
        if len(mon) >= n_mon:
            break
        mon |= (linked or {}).get(gid, {gid}) & here
    return [x for x in instances if x.group_id not in mon], [x for x in instances if x.group_id in mon]


def preference_triples(groups, instances, base_scores):
    """A.1.1 triples (q, d+, d_a, d_b) for attack instances. base_scores(instance_id) -> float list of
    the frozen reranker's margins over the attack-injected list. d_b: highest-scored benign candidate
    other than the attack position (see module docstring). -> list of dicts of texts and indices."""
    by_id = {g.group_id: g for g in groups}
    out = []
    for x in instances:
        g = by_id[x.group_id]
        s0 = base_scores(x.instance_id)
        benign = [i for i in range(len(x.docs)) if i != x.attack_index]
        b = max(benign, key=lambda i: (s0[i], -i))
        out.append({"instance_id": x.instance_id, "group_id": x.group_id, "query": x.query,
                    "pos": g.docs[g.source_index]["text"], "att": x.docs[x.attack_index],
                    "ben": x.docs[b], "ben_index": b, "att_index": x.attack_index})
    return out


# ----------------------------------------------------------------------------- Eqs. 1-5


def policy_logprobs(scores):
    """Eq. 1: log pi(d | q, D(q)) = s(q,d) - logsumexp_{d' in D(q)} s(q,d'). (..., D) -> (..., D).
    Computed in float32 at least (bf16/fp16 scores are upcast; float64 stays float64)."""
    return F.log_softmax(scores if scores.dtype == torch.float64 else scores.float(), dim=-1)


def defensive_residual(scores_theta, scores_ref):
    """Eq. 2: r_theta(q,d) = log pi_theta(d|q) - log pi_0(d|q). (..., D) -> (..., D).
    The two normalisers are per query constants, so residual DIFFERENCES equal score-change differences."""
    return policy_logprobs(scores_theta) - policy_logprobs(scores_ref)


def preference_loss(r_w, r_l, beta):
    """Eq. 3: -log sigma(beta * (r(q,d_w) - r(q,d_l))). Shapes (N,) -> (N,)."""
    return -F.logsigmoid(beta * (r_w - r_l))


def consistency_loss(r_pos, r_ben):
    """Eq. 4: (r(q,d+) - r(q,d_b))^2. Shapes (N,) -> (N,)."""
    return (r_pos - r_ben) ** 2


# the per-example stats shield_loss returns (TRL's DPO log names), in their order
SHIELD_STATS = ("loss", "loss/orig", "loss/ben", "loss/cons", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "rewards/accuracies")


def shield_loss(r_pos, r_att, r_ben, beta=0.1, lam_def=1.1, lam_util=0.9, lam_cons=0.15):
    """Eq. 5 = lam_def*L_pref(P_orig) + lam_util*L_pref(P_ben) + lam_cons*L_cons, mean over the N
    examples (the expectations of Eqs. 3-4). Returns (scalar loss, stats of detached floats) with TRL's
    DPO keys: rewards are beta * residual, chosen = benign (d+ and d_b), rejected = attack."""
    l_orig = preference_loss(r_pos, r_att, beta)
    l_ben = preference_loss(r_ben, r_att, beta)
    l_cons = consistency_loss(r_pos, r_ben)
    loss = (lam_def * l_orig + lam_util * l_ben + lam_cons * l_cons).mean()
    with torch.no_grad():
        chosen = beta * torch.cat([r_pos, r_ben])           # (2N,) both preference types
        rejected = beta * torch.cat([r_att, r_att])          # (2N,)
        stats = {"loss": loss.item(), "loss/orig": l_orig.mean().item(), "loss/ben": l_ben.mean().item(),
                 "loss/cons": l_cons.mean().item(), "rewards/chosen": chosen.mean().item(),
                 "rewards/rejected": rejected.mean().item(),
                 "rewards/margins": (chosen - rejected).mean().item(),
                 "rewards/accuracies": (chosen > rejected).float().mean().item()}
    return loss, stats
