"""The GEO-DefenseBench builder (`python run.py build-bench`), as the paper built it (B.1.1, B.1.2):
GEO-Bench queries, ten retrieved candidates per query with the row's own source document among
them, the source rewritten by the paper's seven attack families (geo_attacks.py), the split made at
the query-group level before anything is rewritten (Table B.1: 12 construction groups x 3 seen
families, 88 test groups x 7).

Inputs: GEO-Bench rows as the hub ships them (query, tags, sugg_idx, sources[{url, raw_text,
cleaned_text}]) in .jsonl, .json or .parquet; `hf:GEO-Optim/geo-bench` (its test split, the one with
source texts); AutoGEO's rows ({query_id: {query, text_list, target_id}}); AgenticGEO's MSdata rows
({query_id, query, text_list, suggest_id}); or {query, docs[, source_index]} rows. The source document
is the row's (sugg_idx / target_id or suggest_id / source_index).

Candidates: `--search tavily[:URL]` asks Tavily's search API (raw HTTP JSON, key TAVILY_API_KEY,
sent only to its host, over https) for the query's pages with their raw content; the row's source is placed
among them at a position drawn from --seed (recorded), duplicates (URL or text) and near-empty pages
dropped; `--search offline:CORPUS` searches a synthetic corpus the same way (a simulation, for the
bundled sample). Without --search, a row needs --docs documents of its own; rows with fewer are
reported.

Every rewrite passes one fidelity gate (geo_jobs.gate: cheap checks, then the fidelity judge,
--fidelity-judge or the builder's LLM); a refused one is asked again (REWRITE_TRIES attempts in
all, the retry marked in the prompt), then the group is kept without that family, the reason in its
line's `failed` and _meta.family_drops (each family measured over the groups it rewrote); a group
no family rewrote is dropped with the reasons. A rewrite whose judge reply stays unusable is no refusal:
it is not asked again, the judge's error is its reason, and a judge that fails on most of its requests
stops the build (geo_jobs.judge_check). Every call is cached in the run folder: a killed build
reruns to the same bytes. The output is written aside, validated, and only then replaces the file.

`--honest` adds, per group, an honest edit of the source (honest.HonestEdit: clearer wording and
structure, nothing GEO adds), through its own gate (honest_gate: the families' checks, then no new
number, quotation, name or authority wording, then the fidelity judge), REWRITE_TRIES attempts; a
group whose every attempt is refused keeps its attacks without an honest edit. eval and rerank-eval
measure on the test split's whether a defense punishes honest optimisation (the honest penalty); `detect`
chooses its thresholds on the construction split's, so that its false-positive rate on the test split is
a held-out one.

`--construction-families all` rewrites the construction groups with every family, not only the seen
three (recorded as _meta.construction_methods; _meta.seen_methods stays the default training set), so
that `holdout` can train a Shield with any one family left out and measure it on that family.

Usage: python run.py build-bench --input test.jsonl --output bench.jsonl --search tavily --llm openai:gpt-5.5
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import unicodedata
from typing import NamedTuple
from urllib.parse import urlsplit

import accounting
import endpoints
import geo_attacks
import geo_jobs
import geodef
import honest
import llm_clients
import offline_server
import transport
from rankers import unrecorded_base_ranker
from settings import SettingsError
from store import atomic_write, log
from tiny import left_by_the_dead

REWRITE_TRIES = 2                 # attempts per family and group before the group goes without the family
MIN_WORDS = 40                    # a retrieved page with fewer words is near-empty and dropped, unless it has
MIN_WIDE = 200                    # this many wide characters (CJK, kana, Hangul: written without spaces)
TAVILY_URL = "https://api.tavily.com"
TAVILY_MAX_RESULTS = 20           # Tavily's documented cap on max_results
HF_DATASET = "GEO-Optim/geo-bench"


# ----------------------------------------------------------------------------- inputs


def read_rows(path):
    """Any supported input -> [{"id", "line", "query", "docs": [{"url", "text"}], "source_index"}]."""
    if path.startswith("hf:"):
        path = fetch_hf(path[3:])
    if os.path.isdir(path):                             # AutoGEO ships its splits as datachunk_N.json files
        return [row_of(o, f, n) for f in autogeo_chunks(path) for n, o in read_json_rows(f)]
    if not os.path.isfile(path):
        raise SettingsError(f"--input {path}: no such file")
    if path.endswith(".parquet"):
        objs = read_parquet(path)
    elif path.endswith(".json"):
        objs = read_json_rows(path)
    else:
        objs = list(geodef.read_jsonl(path))
    return [row_of(o, path, n) for n, o in objs]


def autogeo_chunks(folder):
    """A folder of AutoGEO's datachunk_N.json files, in the order of N."""
    chunks = sorted((int(m.group(1)), f) for f in os.listdir(folder)
                    if (m := re.fullmatch(r"datachunk_(\d+)\.json", f)))
    if not chunks:
        raise SettingsError(f"--input {folder}: a folder, with no datachunk_N.json files (AutoGEO's layout)")
    return [os.path.join(folder, f) for _, f in chunks]


def read_json_rows(path):
    """A .json file: a list of rows, or AutoGEO's {query_id: {query, text_list, target_id}} -> [(n, row)]."""
    try:
        with open(path, encoding="utf-8-sig") as f:      # a byte-order mark is dropped, as in .jsonl
            data = json.load(f, object_pairs_hook=geodef._unique_keys)    # (a query id twice: not the last kept)
    except geodef._DuplicateKey as e:
        raise geodef.BenchFormatError(f"{path}: invalid JSON: key {e.args[0]!r} given twice in one object") from None
    except UnicodeDecodeError as e:
        raise geodef.BenchFormatError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise geodef.BenchFormatError(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as e:
        raise geodef.BenchFormatError(f"{path}: invalid JSON ({str(e)[:200]})") from None
    if isinstance(data, dict):                      # AutoGEO: {query_id: {query, text_list, target_id}}
        data = [{"query_id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
    if not isinstance(data, list):
        raise geodef.BenchFormatError(f"{path}: expected a list of rows or AutoGEO's {{query_id: row}}")
    return list(enumerate(data, 1))


def read_parquet(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SettingsError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow), "
                            "or give the .jsonl") from None
    try:
        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    except Exception as e:                 # pyarrow's ArrowInvalid, OSError, ...: a corrupt or empty file
        raise geodef.BenchFormatError(f"{path}: not a readable parquet file ({type(e).__name__}: "
                                      f"{str(e)[:200]})") from None


SOURCE_KEYS = ("sugg_idx", "target_id", "suggest_id", "source_index")     # the input formats' source indices


def row_of(o, path, n):
    """One input row -> the builder's row, every field checked (file:line: field: what is wrong)."""
    if not isinstance(o, dict):
        raise geodef.BenchFormatError(f"{path}:{n}: (row): expected an object")
    for key, src_keys, text_of in (("sources", ("sugg_idx",), lambda d: d.get("cleaned_text") or d.get("raw_text")),
                                   ("text_list", ("target_id", "suggest_id"), None),   # AutoGEO; AgenticGEO's
                                   ("docs", ("source_index",), lambda d: d.get("text"))):
        if key in o:
            break
    else:
        raise geodef.BenchFormatError(f"{path}:{n}: sources/text_list/docs: missing")
    # one source index, of this format's spelling: another's would be ignored, and the longest document
    # rewritten in its place
    given = [k for k in SOURCE_KEYS if o.get(k) is not None]
    if len(given) > 1 or given and given[0] not in src_keys:
        raise geodef.BenchFormatError(
            f"{path}:{n}: {given[-1]}: " + (f"given beside {given[0]}" if len(given) > 1 else
                                            f"not a source index of rows with {key} (give {' or '.join(src_keys)})"))
    src_key = given[0] if given else src_keys[0]
    items = o[key]
    if not isinstance(items, list):
        raise geodef.BenchFormatError(f"{path}:{n}: {key}: expected a list, got {type(items).__name__}")
    docs = []
    for i, d in enumerate(items):
        t, u = (text_of(d), d.get("url", "")) if isinstance(d, dict) and text_of else (d, "")
        t = "" if t is None else t
        if not isinstance(t, str) or not isinstance(u, str):
            raise geodef.BenchFormatError(f"{path}:{n}: {key}[{i}]: text and url must be strings")
        geodef.check_text(t, path, n, f"{key}[{i}]")
        geodef.check_unicode(u, path, n, f"{key}[{i}].url")
        docs.append({"url": u, "text": t})
    q = o.get("query")
    if q is None:
        raise geodef.BenchFormatError(f"{path}:{n}: query: missing")
    if not isinstance(q, str):
        raise geodef.BenchFormatError(f"{path}:{n}: query: expected a string, got {type(q).__name__}")
    if not INVISIBLE.sub("", q):                # no character a reader sees
        raise geodef.BenchFormatError(f"{path}:{n}: query: empty (only spaces or invisible characters)")
    geodef.check_text(q, path, n, "query")
    src = source_index(o.get(src_key), len(docs), path, n, src_key)
    rid = next((o[k] for k in ("group_id", "query_id") if o.get(k) is not None), f"q{n:04d}")   # (0 is an id)
    rkey = next((k for k in ("group_id", "query_id") if o.get(k) is not None), "query_id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        raise geodef.BenchFormatError(f"{path}:{n}: {rkey}: expected a non-empty string or an integer, got {rid!r}")
    geodef.check_unicode(str(rid), path, n, rkey)
    return {"id": str(rid), "line": n, "path": path, "query": q, "docs": docs, "source_index": src}


# spaces, zero-width spaces, joiners and marks: no character a reader sees
INVISIBLE = re.compile(r"[\s\u200b-\u200f\u2060-\u2064\ufeff\u00ad\u034f\u180e]+")


def source_index(v, n_docs, path, n, key):
    """The row's source document index: an integer, or a string of digits (GEO-Bench's loaders cast it);
    None when the row names none. 1.9, true or "a" are refused: rounding would rewrite another document."""
    if v is None:
        return None
    if isinstance(v, str) and re.fullmatch(r"\s*[0-9]{1,9}\s*", v):      # ASCII digits, no 5,000-digit int()
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise geodef.BenchFormatError(f"{path}:{n}: {key}: expected an integer, got {v!r}")
    if not 0 <= v < n_docs:
        raise geodef.BenchFormatError(f"{path}:{n}: {key}: {v} out of range 0..{n_docs - 1}")
    return v


def fetch_hf(spec):
    """hf:GEO-Optim/geo-bench[:split] -> a local file of its rows (huggingface-hub; HF_HOME, HF_ENDPOINT,
    HF_TOKEN, HF_HUB_OFFLINE respected). Only the test split carries the source texts."""
    repo, _, split = spec.partition(":")
    split = split or "test"
    if repo == HF_DATASET and split != "test":
        raise SettingsError(f"hf:{spec}: only GEO-Bench's test split has source texts (sources[].raw_text); "
                            "give hf:GEO-Optim/geo-bench:test")
    from huggingface_hub import hf_hub_download
    for name in (f"{split}.jsonl", f"data/{split}.jsonl", f"{split}.json"):
        try:
            return hf_hub_download(repo, name, repo_type="dataset")
        except Exception as e:                 # not that file name, or offline: try the next, then say why
            last = e
    raise SettingsError(f"hf:{spec}: could not fetch {split}.jsonl from the hub ({type(last).__name__}: "
                        f"{str(last)[:200]})")


# ----------------------------------------------------------------------------- search


class SearchClient:
    """Tavily's search API over raw HTTP JSON on the chat clients' machinery (transport.Transport:
    retries, timeouts, reply cap, the key only in headers and only to its host over https; ReplyCache; the usage
    ledger). `tavily:http://HOST:PORT` names a Tavily-shaped endpoint (a proxy, a test server);
    `offline:CORPUS` is the offline engine's /search over a synthetic corpus at `engine_url` (run.py
    serves it on loopback), cached under the corpus's digest, not the port."""

    def __init__(self, spec, cache_dir=None, ledger=None, timeout=120, rpm=0, engine_url=None):
        if spec.provider == "offline":
            if not engine_url:
                raise SettingsError(f"--search {spec}: the offline engine is not running (run.py serves it)")
            with open(spec.corpus, "rb") as f:
                self.identity = ("offline-search", hashlib.sha1(f.read()).hexdigest())
            self.where = endpoints.Endpoint.parse(engine_url.removesuffix("/v1"))
        else:
            self.where = spec.endpoint or endpoints.Endpoint.parse(TAVILY_URL)
            self.identity = self.where.identity
        self.label = str(spec)
        # TAVILY_API_KEY goes only to Tavily's own host, over https on its port; another endpoint gets
        # SEARCH_API_KEY (optional); the offline engine none
        tavily = transport.same_origin(self.where, TAVILY_URL)
        if not tavily and self.where.host == "api.tavily.com":
            raise SettingsError(f"--search {spec}: TAVILY_API_KEY goes only to {TAVILY_URL}, over https on port 443")
        key = (os.environ.get("TAVILY_API_KEY" if tavily else "SEARCH_API_KEY")
               if tavily or spec.provider == "tavily" else None)
        if tavily and not key:
            raise SettingsError("--search tavily: set TAVILY_API_KEY")
        self.transport = transport.Transport(self.where, self.label, api_key=key, timeout=timeout, rpm=rpm,
                                               provider="search", endpoint=self.where.url + "/search",
                                               max_reply_bytes=32 << 20)
        self.cache, self.ledger, self.requests = llm_clients.ReplyCache(cache_dir), ledger, 0

    def search(self, query, n):
        """Up to n results [{url, text}] with their raw page content (falling back to the snippet)."""
        body = {"query": query, "max_results": min(n, TAVILY_MAX_RESULTS), "search_depth": "advanced",
                "include_raw_content": True}
        key = self.cache.key("tavily-search", self.identity, body, False)
        hit = self.cache.get_raw(key)
        if not isinstance(hit, dict) or not isinstance(hit.get("results"), list):
            resp = self.transport.post(body)
            self.requests += 1
            # paid as it arrives: entered before it is checked and cached, so a kill in between loses no credit
            # (advanced search: 2 API credits a request, Tavily's pricing)
            if self.ledger:
                accounting.append_ledger(self.ledger, {"stage": "build-bench", "model": "search:" + self.label,
                                                       "search_units": 2})
            if not isinstance(resp, dict) or not isinstance(resp.get("results"), list):
                raise transport.LLMError(f"{self.label}: results: expected a list")
            hit = {"results": [{"url": r.get("url") if isinstance(r.get("url"), str) else "",
                                "text": r.get("raw_content") or r.get("content") or ""}
                               for r in resp["results"] if isinstance(r, dict)]}
            self.cache.put_raw(key, hit)
        return [r for r in hit["results"] if isinstance(r.get("text"), str)]


def norm(text):
    return " ".join(text.split()).lower()


def page(url):
    """A URL as the page it names: its scheme, "www.", fragment, tracking (utm_*) parameters and a trailing
    slash aside, so that http://example.com/a/ is https://www.example.com/a ("" stays "")."""
    try:
        u = urlsplit(url.strip())
    except ValueError:                  # (a broken host: the string itself)
        return url
    query = "&".join(x for x in u.query.split("&") if x and not x.lower().startswith("utm_"))
    return f"{(u.hostname or '').removeprefix('www.')}{u.path.rstrip('/')}" + (f"?{query}" if query else "") \
        if u.hostname else url


def near_empty(text):
    return len(text.split()) < MIN_WORDS and sum(unicodedata.east_asian_width(c) in "WF" for c in text) < MIN_WIDE


def candidates(row, results, n_docs, seed):
    """The row's source among the search results: n_docs documents without duplicates (the same page, its URL
    read as `page` reads it: the source's own page is no competitor of its rewrite; or the same text),
    near-empty pages or pages spelling a chat control token (geodef.control_tokens), the source at a position
    drawn from (seed, row id). -> (docs, source index) or (None, reason)."""
    src = row["docs"][row["source_index"]]
    seen_urls, seen_texts, others = {page(src["url"])} - {""}, {norm(src["text"])}, []
    for r in results:
        t = r["text"].strip()
        if near_empty(t) or norm(t) in seen_texts or (r["url"] and page(r["url"]) in seen_urls) \
                or geodef.control_tokens(t):
            continue
        seen_urls.add(page(r["url"]))
        seen_texts.add(norm(t))
        others.append({"url": r["url"], "text": t})
    if len(others) < n_docs - 1:
        return None, f"{len(others) + 1} usable documents < --docs {n_docs} after search"
    pos = random.Random(f"{seed}:{row['id']}").randrange(n_docs)
    docs = others[:n_docs - 1]
    docs.insert(pos, src)
    return docs, pos


def own_candidates(row, n_docs):
    """Without search: the row's first n_docs non-empty, distinct documents, its source among them (a
    document repeating an earlier one's text, or the source's, is skipped: a list holds each text once)."""
    src = row["source_index"]
    texts = {norm(row["docs"][src]["text"])} if src is not None else set()
    keep = []
    for i, d in enumerate(row["docs"]):
        t = norm(d["text"])
        if t and (i == src or t not in texts):
            keep.append(i)
            texts.add(t)
    keep = keep[:n_docs]
    if len(keep) < n_docs:
        return None, (f"{len(keep)} non-empty, distinct documents < --docs {n_docs} (give --search tavily to "
                      "retrieve more)")
    if src is None:     # stated rule: the longest candidate, as the most content to rewrite
        src = max(keep, key=lambda i: (len(row["docs"][i]["text"]), -i))
    if src not in keep:
        return None, f"source document {src} is empty or not among the first {n_docs} non-empty ones"
    return [row["docs"][i] for i in keep], keep.index(src)


# ----------------------------------------------------------------------------- composition


def compose(rows, n_groups, n_construction, seed, dropped=()):
    """The rows in a seeded random order; the build walks it until N groups have their candidates,
    and splits those (the first C construction) before any rewrite (B.1.2). -> [(row, split)] of the
    first N rows, construction first (what the dry run plans), and the whole order. `dropped`: the rows
    usable_rows left out, named when too few are left."""
    rows = sorted(rows, key=lambda r: r["id"])
    order = random.Random(seed).sample(rows, len(rows))
    picked = order[:n_groups]
    if len(picked) < n_groups:
        log(f"[build-bench] the input has {len(picked)} usable rows, fewer than --groups {n_groups}: all taken")
    if len(picked) <= n_construction:
        raise SettingsError(f"{len(picked)} query groups leave none for the test split after --construction-groups "
                            f"{n_construction}" + (f"; {len(dropped)} rows dropped (first: {dropped[0][1]})"
                                                   if dropped else ""))
    return [(r, "construction" if i < n_construction else "test") for i, r in enumerate(picked)], order


def where(row):
    return f"{row['path']}:{row['line']}"


def usable_rows(rows, search, n_docs=None):
    """The rows a build can use, every check the inputs allow made before the first request: ids
    unique (their group ids too), one row per query (a query in both splits would leak, B.1.2), a
    source document with text when candidates are searched, else (n_docs given) n_docs candidates of its
    own (own_candidates), so that the splits are composed of rows the build keeps. -> (rows, [(row, why
    dropped)])."""
    by_id = {}
    for r in rows:
        if r["id"] in by_id:
            raise SettingsError(f"query id {r['id']!r} given twice: {where(by_id[r['id']])} and {where(r)}")
        by_id[r["id"]] = r
    by_gid = {}
    for r in rows:
        r["group_id"] = group_id(r["id"])
        if r["group_id"] in by_gid:             # only a hash collision: group_id keeps distinct ids apart
            raise SettingsError(f"query ids {by_gid[r['group_id']]['id']!r} ({where(by_gid[r['group_id']])}) and "
                                f"{r['id']!r} ({where(r)}) give the same group id {r['group_id']!r}")
        by_gid[r["group_id"]] = r
    kept, dropped, queries = [], [], {}
    for r in rows:
        q = geodef.query_key(r["query"])
        if q in queries:
            dropped.append((r, f"the same query as {where(queries[q])}"))
        elif search and r["source_index"] is None:
            dropped.append((r, "no source document (sugg_idx / target_id / suggest_id / source_index)"))
        elif search and not r["docs"][r["source_index"]]["text"].strip():
            dropped.append((r, f"its source document ({r['source_index']}) has no text"))
        elif not search and n_docs and (why := own_candidates(r, n_docs))[0] is None:
            dropped.append((r, why[1]))
        else:
            queries[q] = r
            kept.append(r)
    return kept, dropped


def group_id(rid):
    """A row id as a group id (letters, digits, '.', '_', '-'; at most 40 characters). An id that had to
    be changed gets a digest of itself, so 'a b' and 'a-b', or two long ids sharing 40 characters,
    stay two groups."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", rid)
    if clean == rid and 0 < len(rid) <= 40:
        return rid
    return f"{clean[:31]}-{hashlib.sha1(rid.encode('utf-8')).hexdigest()[:8]}"


# ----------------------------------------------------------------------------- rewriting


def rewrite_family(ctx, fam, groups, gate=geo_jobs.gate):
    """Family `fam` (a geo_attacks rewriter, or the honest editor with its gate) on every group (dicts
    with query, docs, source_index): -> {group_id: (text, trace)} for the rewrites that passed the gate,
    and {group_id: reason} for the groups it failed on. A rewrite the fidelity judge failed on
    (geo_jobs.judge_failed) is no refusal: it is not written again (another rewrite would meet the same
    judge), and its group's reason is the judge's error, logged when it happens; the gate stops the build
    once the judge fails on most of its requests (geo_jobs.judge_check)."""
    done, failed, todo = {}, {}, list(groups)
    verdicts = {g["group_id"]: [] for g in groups}
    for attempt in range(REWRITE_TRIES):
        if not todo:
            break
        jobs = [geo_jobs.Job(g["query"], g["docs"][g["source_index"]]["text"], attempt, g["group_id"],
                                [d["text"] for d in g["docs"]], g["source_index"]) for g in todo]
        out = fam.run(ctx, jobs)
        why = gate(ctx, [j.source for j in jobs], [t for t, _ in out], f"{fam.name} fidelity")
        retry = []
        for g, (t, trace), w in zip(todo, out, why):
            gid = g["group_id"]
            # a family that gates its own candidates (MAGEO) and wrote none the judge could judge: the judge's
            # failure, not a refusal of the family's work
            inner = [v for v in (trace or {}).get("candidate_gate", []) if geo_jobs.judge_failed(v)]
            w = inner[-1] if w is not None and not t and inner else w
            verdicts[gid].append(w or "accepted")
            if w is None:
                done[gid] = (t, {**trace, "attempts": attempt + 1, "gate": verdicts[gid]})
            elif geo_jobs.judge_failed(w):
                failed[gid] = f"{fam.name}: {'; '.join(verdicts[gid])}"
                log(f"[build-bench] {gid}: {fam.name}: the fidelity judge failed on attempt {attempt + 1}'s rewrite, "
                    f"not written again ({w})")
            else:
                retry.append(g)
        todo = retry
    for g in todo:
        failed[g["group_id"]] = f"{fam.name}: every attempt refused ({'; '.join(verdicts[g['group_id']])})"
    return done, failed


def rewrite_all(ctx, fams, cons, groups, mageo_signal, test_ctx=None):
    """Every family on every group of its splits (cons: the construction groups' families), one split at
    a time (MAGEO's memory never crosses splits, B.1.2) -> ({gid: {family: text}}, {gid: {family: trace}},
    {gid: {family: why every attempt was refused}}). A family refused on a group leaves the group its
    other families: each family is measured over the groups it rewrote. test_ctx: the test split's
    builder and judge (build-bench --test-llm), when they are not the construction split's."""
    attacks, traces, failed = ({g["group_id"]: {} for g in groups} for _ in range(3))
    for f in fams:
        fam = geo_attacks.rewriter(f, mageo_signal)
        for split in ("construction", "test"):
            todo = [g for g in groups if g["split"] == split and (f in cons or split == "test")]
            done, bad = rewrite_family(test_ctx if split == "test" and test_ctx else ctx, fam, todo)
            for gid, why in bad.items():
                failed[gid][f] = why
            for gid, (text, trace) in done.items():
                attacks[gid][f], traces[gid][f] = text, trace
    return attacks, traces, failed


def honest_edits(ctx, groups):
    """The honest editor (honest.HonestEdit) on the kept groups of a split, through its own gate
    (honest_gate), REWRITE_TRIES attempts: -> ({group_id: (text or None, trace)}, {refusal kind: attempts
    refused so}). A group whose every attempt is refused keeps its attacks and has no honest edit; its
    trace says why. An edit the fidelity judge failed on is no refusal: its group has no honest edit, its
    trace holds the judge's error, and the refusal kinds leave it out; honest_gate counts the judge on ctx's
    tally (geo_jobs.judge_check), as the families' gate does."""
    verdicts = []

    def gate(ctx, sources, texts, desc="honest edit fidelity"):
        why = honest.honest_gate(ctx, sources, texts, desc)
        verdicts.extend(w for w in why if w and not geo_jobs.judge_failed(w))
        return why
    done, failed = rewrite_family(ctx, honest.HonestEdit(), groups, gate)
    for gid, why in failed.items():
        log(f"[build-bench] {gid}: no honest edit ({why})")
    kinds = [re.split(r"\s*[\[(\d<:]", w, maxsplit=1)[0].strip() for w in verdicts]  # without particulars:
    # "adds numbers ['12']" -> "adds numbers", "fidelity 3 < 4" -> "fidelity"
    refused = f"{honest.HonestEdit.name}: every attempt refused ("        # (rewrite_family's reason for a refusal)
    trace = lambda why: ({"attempts": REWRITE_TRIES, "refused": why} if why.startswith(refused) else
                         {"judge_failed": why})
    return ({**done, **{gid: (None, trace(why)) for gid, why in failed.items()}},
            {k: kinds.count(k) for k in sorted(set(kinds))})


def co_attack_picks(groups, fams, attacked, seed):
    """--attacked K: per test group, K-1 candidates other than the source and a family for each, drawn
    from a generator seeded by the build's seed and the group id (a group's picks do not depend on the
    others) -> {group_id: [(index, family)]}."""
    out = {}
    for g in groups:
        rng = random.Random(f"{seed}:co-attacks:{g['group_id']}")
        others = [i for i in range(len(g["docs"])) if i != g["source_index"]]
        out[g["group_id"]] = [(i, rng.choice(fams)) for i in rng.sample(others, attacked - 1)]
    return out


def at_candidate(g, i):
    """Group g as the rewriters see a group, with candidate i as the document to rewrite."""
    return {**g, "group_id": f"{g['group_id']}@{i}", "source_index": i}


def pool_lists(ctx, b, seed, fams, groups):
    """The test lists' further attacked documents (--attacked K) and optimised pool (--pool optimized)
    -> ({group_id: {"co_attacks": [...], "optimized": {...}}}, {refusal kind: count} of the pool's
    honest edits). Each further attack passes the families' gate, each honest edit the honest gate, as
    the source's do; a refused one leaves the list without it (fewer attacked documents, or that
    candidate as the search returned it), said in the log. b: the BuildSettings; seed: the draw's."""
    out = {g["group_id"]: {} for g in groups}
    picks = co_attack_picks(groups, fams, b.attacked, seed) if b.attacked > 1 else {}
    by_id, got = {g["group_id"]: g for g in groups}, {}
    for f in fams:                      # a rewriter per family, over every candidate it was drawn for
        todo = [at_candidate(by_id[gid], i) for gid, ps in picks.items() for i, m in ps if m == f]
        done, bad = rewrite_family(ctx, geo_attacks.rewriter(f, b.mageo_signal), todo) if todo else ({}, {})
        for key, why in bad.items():
            log(f"[build-bench] {key}: no further {f} attack ({why})")
        for key, (text, trace) in done.items():
            got[key] = {"index": int(key.rsplit("@", 1)[1]), "method": f, "text": text, "trace": trace}
    for gid, ps in picks.items():      # in the drawn order: level L holds the first L-1
        out[gid]["co_attacks"] = [got[f"{gid}@{i}"] for i, _ in ps if f"{gid}@{i}" in got]
    refused = {}
    if b.pool == "optimized":
        edits, refused = honest_edits(ctx, [at_candidate(g, i) for g in groups for i in range(len(g["docs"]))
                                            if i != g["source_index"]])
        add_optimized(out, by_id, edits)
    return out, refused


def add_optimized(out, by_id, edits):
    """The pool's honest edits ({"<group_id>@<index>": (text or None, trace)}) into `out`'s groups as
    "optimized", but one that copies a text its list shows (a candidate, a further attack, another edit):
    geodef refuses a list showing one text twice, so that candidate stays as the search returned it."""
    norm = lambda t: " ".join(t.split())
    shown = {gid: {norm(d["text"]) for d in g["docs"]} | {norm(c["text"]) for c in out[gid].get("co_attacks", [])}
             for gid, g in by_id.items()}
    for key, (text, _) in edits.items():
        gid, i = key.rsplit("@", 1)
        if text is not None and norm(text) in shown[gid]:
            log(f"[build-bench] {key}: its honest edit copies a text the list shows; the candidate kept as it is")
        elif text is not None:
            out[gid].setdefault("optimized", {})[i] = text
            shown[gid].add(norm(text))


# ----------------------------------------------------------------------------- the command


def known_families(names, default):
    """The families a flag names (default when not given), each one of the seven."""
    names = list(names or default)
    bad = [m for m in names if m not in geo_attacks.FAMILIES]
    if bad:
        raise SettingsError(f"unknown attack families {bad}; known: {', '.join(geo_attacks.FAMILIES)}")
    twice = sorted({m for m in names if names.count(m) > 1})
    if twice:                  # the build's own _meta check would refuse the file after every rewrite was paid
        raise SettingsError(f"attack families {twice} named more than once")
    return names


class Plan(NamedTuple):
    """A build, checked before any request: the families, the seen ones, the first --groups rows with
    their splits (what the dry run prices), the whole seeded order the build walks, the rows dropped
    up front, the offline search corpus's pages (offline:CORPUS), AgenticGEO's archive and AutoGEO's
    rules when given, and the families rewritten in the construction groups (the seen ones, or more)."""
    families: list
    seen: list
    picked: list
    order: list
    dropped: list
    corpus: list
    archive: list
    rules: list
    construction: list


def construction_families(asked, fams, seen):
    """--construction-families: None -> the seen families (the paper's 12 x 3), 'all' -> every family,
    else a comma list among --attacks that holds the seen ones (the Shield's default training set)."""
    if not asked:
        return list(seen)
    names = list(fams) if asked == "all" else known_families(asked, ())
    if [m for m in names if m not in fams] or [m for m in seen if m not in names]:
        raise SettingsError(f"--construction-families {asked}: each among --attacks {fams}, and holding the seen "
                            f"families {seen}")
    return [m for m in fams if m in names]           # in --attacks' order


def read_resource(flag, reader, path):
    """--agentic-archive / --autogeo-rules, read and checked before anything is paid for."""
    if path is None:
        return None
    try:
        return reader(path)
    except OSError as e:
        raise SettingsError(f"{flag} {path}: {e.strerror or e}") from None
    except RecursionError:
        raise SettingsError(f"{flag} {path}: invalid JSON (nested too deeply)") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise SettingsError(f"{flag} {path}: {str(e)[:200]}") from None


def offline_engine_needed(llm, judge, plan):
    """Whether the build needs the offline engine on loopback: an offline builder (llm) or judge, or a
    simulated search (offline:CORPUS)."""
    return llm == "offline" or (judge or "").startswith("offline") or plan.corpus is not None


def composition_table(comp):
    """The built file's composition as text: groups, methods and instances per split."""
    row = lambda *c: f"{c[0]:<14}{c[1]:>8}{c[2]:>9}{c[3]:>11}"
    return "\n".join([row("split", "groups", "methods", "instances")] +
                     [row(split, v["groups"], v["methods"], v["instances"]) for split, v in comp.items()])


def plan(cfg):
    """Every check the inputs allow, before the first request (and in --dry-run) -> Plan."""
    b = cfg.build
    fams = known_families(b.attacks, geodef.PAPER_METHODS)
    if b.attacks and not cfg.seen.seen_methods:
        raise SettingsError("--attacks: name the construction (seen) families too, with --seen-methods")
    seen = known_families(cfg.seen.seen_methods, geodef.PAPER_SEEN_METHODS)
    if [m for m in seen if m not in fams]:
        raise SettingsError(f"--seen-methods {seen}: each must be among --attacks {fams}")
    if not b.input or not b.output:
        raise SettingsError("build-bench: give --input (the rows) and --output (the JSONL to write)")
    if b.attacked >= b.docs:
        raise SettingsError(f"--attacked {b.attacked}: at most --docs - 1 ({b.docs - 1}) of a list's candidates")
    if b.groups <= b.construction_groups:
        raise SettingsError(f"--groups {b.groups} --construction-groups {b.construction_groups}: at least one "
                            "construction group and one test group")
    if os.path.isdir(b.output):
        raise SettingsError(f"--output {b.output}: a folder; give the JSONL file to write")
    corpus = None
    if b.search and b.search.provider == "offline":
        if not os.path.isfile(b.search.corpus):
            raise SettingsError(f"--search {b.search}: no such file")
        corpus = offline_server.load_corpus(b.search.corpus)
    archive = read_resource("--agentic-archive", geo_attacks.read_archive, b.agentic_archive)
    rules = read_resource("--autogeo-rules", geo_attacks.read_rules, b.autogeo_rules)
    cons = construction_families(b.construction_families, fams, seen)
    rows, dropped = usable_rows(read_rows(b.input), b.search is not None, b.docs)
    if not rows and not dropped:
        raise SettingsError(f"--input {b.input}: no rows (an empty file, or a folder without its data files)")
    picked, order = compose(rows, b.groups, b.construction_groups, cfg.folder.seed, dropped)
    return Plan(fams, seen, picked, order, dropped, corpus, archive, rules, cons)


def dry_run(run):
    """What build-bench would send, without sending or writing anything: requests per family (at most,
    retries and JSON re-asks included), search requests, tokens estimated at 4 characters a token, and
    the price with --prices."""
    cfg, p = run.cfg, plan(run.cfg)
    b = cfg.build
    fams, cons, picked = p.families, p.construction, p.picked
    n_cons = sum(1 for _, s in picked if s == "construction")
    chars = sum(len(max((d["text"] for d in r["docs"]), key=len, default="")) for r, _ in picked) / max(1, len(picked))

    def priced(st, spec):                       # a stage's USD at its own client's model (None: not in --prices)
        price = (run.prices or {}).get(accounting.price_key(spec))
        ok = isinstance(price, (list, tuple))
        return {**st, "usd": accounting.token_cost(price, st) if ok else None,
                "usd_batch_api": accounting.token_cost(price, st, batch=True) if ok else None}

    # `groups` rewrites of `calls` calls each, tried and judged: prompts of `reads` documents' text and 400 tokens,
    # replies of `writes` documents' text
    def stage(groups, calls, reads=2, writes=1.3, spec=cfg.llm.llm):
        req = groups * calls * REWRITE_TRIES * 2
        return priced({"groups": groups, "requests": req, "prompt_tokens": int(req * (chars / 4 * reads + 400)),
                       "completion_tokens": int(req * chars / 4 * writes)}, spec)
    n_test = len(picked) - n_cons
    test_split = b.test_llm or cfg.llm.llm      # --test-llm writes the test split's rewrites
    stages = {}
    for f in fams:
        calls = geo_attacks.FAMILIES[f].calls
        stages[f] = stage(n_cons * (f in cons) + n_test * (not b.test_llm), calls)
        if b.test_llm:
            stages[f"{f} (test split)"] = stage(n_test, calls, spec=test_split)
    if b.honest:                      # one edit per group, each judged like a family's rewrite
        stages["honest edit"] = stage(n_cons if b.test_llm else len(picked), 1, reads=1, writes=1.1)
        if b.test_llm:
            stages["honest edit (test split)"] = stage(n_test, 1, reads=1, writes=1.1, spec=test_split)
    extra = {"further attacks": (n_test * (b.attacked - 1), max(geo_attacks.FAMILIES[f].calls for f in fams)),
             "pool honest edits": (n_test * (b.docs - 1) * (b.pool == "optimized"), 1)}
    # --attacked K, --pool optimized: rewrites of other candidates
    stages.update({name: stage(rewrites, calls, spec=test_split) for name, (rewrites, calls) in extra.items()
                   if rewrites})
    # every rewrite (and edit) is judged, and MAGEO's loop judges its candidates: up to MAGEO_CANDIDATES a round
    mageo = sum(v["groups"] for name, v in stages.items() if name.split(" (")[0] == "MAGEO")
    n = (sum(v["groups"] for v in stages.values()) + mageo * geo_attacks.MAGEO_ROUNDS * geo_attacks.MAGEO_CANDIDATES) \
        * REWRITE_TRIES * 2
    judged = {"requests": n, "prompt_tokens": int(n * chars / 2), "completion_tokens": n * 60}
    stages["fidelity judge"] = priced(judged, b.fidelity_judge or cfg.llm.llm)
    return {"groups": len(picked), "construction": n_cons, "test": n_test,
            "instances": {"construction": n_cons * len(cons), "test": n_test * len(fams)},
            "search_requests": len(picked) if b.search else 0, "dropped_up_front": len(p.dropped),
            "stages": stages,
            "note": "upper bounds (gate retries and JSON re-asks included); cached replies cost nothing"}


def both_splits(groups, dropped, b, when):
    """A SettingsError unless `groups` hold a construction group and a test group: a file without one
    split trains or evaluates nothing (refused by the first command that reads it)."""
    empty = [s for s in ("construction", "test") if not any(g["split"] == s for g in groups)]
    if empty:
        raise SettingsError(f"{b.input}: no {' and no '.join(empty)} group {when}: {len(groups)} made, {len(dropped)} "
                            f"rows dropped (first: {dropped[0][1] if dropped else 'none'}); give more rows, or fewer "
                            "--construction-groups")


def build_bench(run, p=None):
    """Build the benchmark file run.cfg.build.output (settings.BuildConfig; see the module docstring) -> (path,
    composition). `p`: the build's Plan when the caller has made it (run.py does, to serve the offline
    corpus)."""
    cfg = run.cfg
    b = cfg.build
    p = p or plan(cfg)
    fams, seen, cons = p.families, p.seen, p.construction
    llm = run.llm(stage="build-bench")
    judge = run.llm(b.fidelity_judge, stage="build-bench") if b.fidelity_judge else None
    search = SearchClient(b.search, run.path("cache", "search"), run.path("usage.jsonl"), engine_url=run.engine_url,
                          timeout=cfg.request.timeout or 120, rpm=cfg.request.rpm) if b.search else None
    groups, dropped = [], list(p.dropped)
    for row in p.order:                 # in the seeded order until --groups lists are complete
        if len(groups) == b.groups:
            break
        docs, pos = (candidates(row, search.search(row["query"], b.docs + 5), b.docs, cfg.folder.seed) if search
                     else own_candidates(row, b.docs))
        if docs is None:
            dropped.append((row, pos))
            continue
        gid = row["group_id"]
        split = "construction" if len(groups) < b.construction_groups else "test"
        # a document is its text or its URL (a page fetched again for another query may differ by a date)
        pages = lambda ds: {norm(d["text"]) for d in ds} | {page(d["url"]) for d in ds if d["url"]}
        other = next((g["group_id"] for g in groups if g["split"] != split and pages(g["docs"]) & pages(docs)), None)
        if other:                       # B.1.2: nothing of a group crosses splits
            dropped.append((row, f"shares a document with group {other} of the other split"))
            continue
        docs = [{"doc_id": f"{gid}-{i}", "url": d["url"], "text": d["text"]} for i, d in enumerate(docs)]
        groups.append({"group_id": gid, "query": row["query"], "split": split, "source_index": pos, "row": row,
                       "docs": docs})
    both_splits(groups, dropped, b, "before any rewrite")
    ranker = unrecorded_base_ranker(run) if "MAGEO" in fams and b.mageo_signal == "reranker" and groups else None
    ctx = geo_jobs.Ctx(llm, cfg.llm.temperature, max(cfg.llm.max_tokens, 4096), cfg.request.workers, judge=judge,
                          archive=p.archive, rules=p.rules, ranker=ranker)
    test_llm = run.llm(b.test_llm, stage="build-bench") if b.test_llm else None
    test_judge = b.test_fidelity_judge or b.fidelity_judge
    test_ctx = dataclasses.replace(ctx, llm=test_llm, judge=run.llm(test_judge, stage="build-bench")
                                   if test_judge else None, calls={}, judge_tally={}) if test_llm else None
    attacks, traces, failed = rewrite_all(ctx, fams, cons, groups, b.mageo_signal, test_ctx)
    kept = [g for g in groups if attacks[g["group_id"]]]
    dropped += [(g["row"], "; ".join(failed[g["group_id"]].values())) for g in groups if not attacks[g["group_id"]]]
    for g in kept:
        for f, why in failed[g["group_id"]].items():
            log(f"[build-bench] {g['group_id']}: no {f} rewrite, the group kept without it ({why})")
    for row, why in dropped:
        log(f"[build-bench] dropped {where(row)} ({row['id']}): {why}")
    both_splits(kept, dropped, b, "after the rewrites (those made are cached)")
    markers = surface_markers(kept, attacks, fams)
    tctx = test_ctx or ctx                               # the test split's builder writes its honest edits too
    edits, refused = None, None
    if b.honest:                       # each split's by its own builder; detect's threshold reads construction's
        (edits, refused), (t_edits, t_refused) = (honest_edits(c, [g for g in kept if g["split"] == split])
                                                  for c, split in ((ctx, "construction"), (tctx, "test")))
        edits.update(t_edits)
        refused = {k: refused.get(k, 0) + t_refused.get(k, 0) for k in sorted({*refused, *t_refused})}
    lists = pool_lists(tctx, b, cfg.folder.seed, fams, [g for g in kept if g["split"] == "test"])   # none by default
    if edits:                           # the honest edits' template, beside the families'
        markers["honest edits"] = geo_jobs.surface_rates(t for t, _ in edits.values() if t)
    for name, rates in markers.items():
        log(f"[build-bench] surface markers, % of {name}: " + ", ".join(f"{k} {v:g}" for k, v in rates.items()))
    write(b, cfg.folder.seed, fams, seen, kept, (attacks, traces, failed), llm, search, markers, (edits, refused),
          cons, lists, test_llm, (p.archive, p.rules))
    comp = composition(kept, fams, cons, attacks)
    log(f"[build-bench] wrote {len(kept)} groups to {b.output}; dropped {len(dropped)}; calls {ctx.calls}; "
        f"search requests {search.requests if search else 0}; usage {llm.usage()}")
    return b.output, comp


def surface_markers(groups, attacks, fams):
    """How often each surface marker (geo_jobs.SURFACE_MARKERS: headings, bold, lists, summary
    phrases, ...) appears in each family's rewrites, in the sources they rewrote and in the benign
    candidates: a family far from the benign rates is detectable by its template, not its intent."""
    benign = [d["text"] for g in groups for i, d in enumerate(g["docs"]) if i != g["source_index"]]
    out = {"benign candidates": geo_jobs.surface_rates(benign),
           "sources": geo_jobs.surface_rates(g["docs"][g["source_index"]]["text"] for g in groups)}
    for f in fams:
        out[f] = geo_jobs.surface_rates(attacks[g["group_id"]][f] for g in groups if f in attacks[g["group_id"]])
    return out


def composition(groups, fams, cons, attacks):
    """Table B.1 of a build: groups and attack-injected instances per split (cons: the construction
    groups' families; a family refused on a group adds no instance there)."""
    out = {}
    for split, names in (("construction", cons), ("test", fams)):
        gs = [g for g in groups if g["split"] == split]
        out[split] = {"groups": len(gs), "methods": len(names),
                      "instances": sum(m in attacks[g["group_id"]] for g in gs for m in names)}
    return out


def write(b, seed, fams, seen, groups, rewrites, llm, search, markers, honest_audit, cons, lists, test_llm, read):
    """The benchmark file b.output (b: the BuildSettings; seed: the build's): written aside, validated
    (geodef.load_bench), then renamed over the output.
    honest_audit ({group_id: (text or None, trace)} of every group and the refusal kinds' counts,
    build-bench --honest): each line's `honest` edit and its `honest_trace`, and _meta's `honest`,
    `honest_digest`, `honest_edits`, `honest_edit_rate` (% of groups) and `honest_refusals`; without
    it the lines are as before. rewrites: rewrite_all's (attacks, traces, failed); a family refused on a
    group is in the line's `failed` with why, and _meta.family_drops counts them per family. cons: the
    construction groups' families; _meta.construction_methods records them when they are more than the
    seen ones. lists: pool_lists' fields of the test lines and the pool's refusals; _meta.attacked and
    _meta.pool are written when they are not the paper's (one attacked document, the search's pool).
    test_llm: the test split's builder (--test-llm): _meta.test_builder_llm and test_fidelity_judge name it
    and its judge beside the construction split's builder_llm and fidelity_judge. read: the archive and
    rules read from --agentic-archive and --autogeo-rules (None: the bundled ones): their families' prompt
    digests cover them."""
    attacks, traces, failed = rewrites
    edits, refused = honest_audit
    cons = list(cons or seen)
    meta = {"name": os.path.basename(b.output), "synthetic": bool(b.synthetic), "methods": fams,
            "seen_methods": seen, "n_docs": b.docs, "search": search.label if search else None,
            "builder_llm": llm.label, "fidelity_judge": b.fidelity_judge or llm.label, "seed": seed,
            "groups": len(groups), "source": os.path.basename(b.input),
            "prompt_digests": geo_attacks.prompt_digests(fams, b.mageo_signal, *read),
            "mageo_signal": b.mageo_signal if "MAGEO" in fams else None, "surface_markers": markers}
    if cons != list(seen):
        meta["construction_methods"] = cons
    if test_llm is not None:
        meta.update(test_builder_llm=test_llm.label,
                    test_fidelity_judge=b.test_fidelity_judge or b.fidelity_judge or test_llm.label)
    if b.attacked > 1 or b.pool != "search":
        meta.update(attacked=b.attacked, pool=b.pool)
        meta.update({"pool_refusals": lists[1]} if b.pool != "search" else {})
    drops = {f: sum(f in why for why in failed.values()) for f in fams}       # dropped groups' too
    if any(drops.values()):                  # each family's own denominator: the groups it rewrote
        meta["family_drops"] = drops
    if edits is not None:
        n = sum(t is not None for t, _ in edits.values())
        meta.update(honest=True, honest_digest=honest.HonestEdit().digest(), honest_edits=n,
                    honest_edit_rate=round(100.0 * n / max(1, len(edits)), 1), honest_refusals=refused)
    if b.synthetic:
        meta["note"] = ("SYNTHETIC: programmatic pages and offline-engine rewrites for offline plumbing; not the "
                        "paper's benchmark and not real web pages. Numbers measured on it say nothing about real "
                        "engines.")
    lines = [json.dumps({"_meta": meta}, ensure_ascii=False)]
    for g in groups:
        gid = g["group_id"]
        names = fams if g["split"] == "test" else cons
        line = {"group_id": gid, "query": g["query"], "docs": g["docs"], "source_index": g["source_index"],
                "attacks": {m: attacks[gid][m] for m in names if m in attacks[gid]},
                "trace": {m: traces[gid][m] for m in names if m in traces[gid]}}
        line.update({"failed": {m: failed[gid][m] for m in names if m in failed[gid]}} if failed[gid] else {})
        line.update(lists[0].get(gid, {}))                  # test groups with --attacked K or --pool optimized
        if edits is not None and gid in edits:
            text, trace = edits[gid]
            line.update(({"honest": text} if text is not None else {}), honest_trace=trace)
        lines.append(json.dumps({**line, "split": g["split"]}, ensure_ascii=False))
    for old in left_by_the_dead(f"{b.output}.tmp"):       # a build killed while its file was checked
        with contextlib.suppress(FileNotFoundError):      # (another build's cleanup first)
            os.remove(old)
    tmp = f"{b.output}.tmp{os.getpid()}"
    try:
        atomic_write(tmp, "\n".join(lines) + "\n")
        geodef.load_bench(tmp, n_docs=b.docs)
        os.replace(tmp, b.output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
