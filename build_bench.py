"""The GEO-DefenseBench builder (`python run.py build-bench`), as the paper built it (B.1.1, B.1.2):
GEO-Bench queries, ten retrieved candidates per query with the row's own source document among
them, the source rewritten by the paper's seven attack families (geo_attacks.py), the split made at
the query-group level before anything is rewritten (Table B.1: 12 construction groups x 3 seen
families, 88 test groups x 7).

Inputs: GEO-Bench rows as the hub ships them (query, tags, sugg_idx, sources[{url, raw_text,
cleaned_text}]) in .jsonl, .json or .parquet; `hf:GEO-Optim/geo-bench` (its test split, the one with
source texts); AutoGEO's rows ({query_id: {query, text_list, target_id}}); or {query, docs[,
source_index]} rows. The source document is the row's (sugg_idx / target_id / source_index).

Candidates: `--search tavily[:URL]` asks Tavily's search API (raw HTTP JSON, key TAVILY_API_KEY,
sent only to its host) for the query's pages with their raw content; the row's source is placed
among them at a position drawn from --seed (recorded), duplicates (URL or text) and near-empty pages
dropped; `--search offline:CORPUS` searches a synthetic corpus the same way (a simulation, for the
bundled sample). Without --search, a row needs --docs documents of its own; rows with fewer are
reported.

Every rewrite passes the fidelity gate (attack.cheap_gate, then --fidelity-judge when given); a
refused one is asked again (REWRITE_TRIES attempts in all), then its group is dropped with the
reason. Every call is cached in the run folder: a killed build reruns to the same bytes. The output
is written aside, validated, and only then replaces the file.

Usage: python run.py build-bench --input test.jsonl --output bench.jsonl --search tavily --llm openai:gpt-5.5
"""
import hashlib
import json
import os
import random
import re

import attack
import geo_attacks
import geodef
import llm_clients
from runs import SettingsError, atomic_write, log, make_llm, read_prices, usage_path

REWRITE_TRIES = 2                 # attempts per family and group before the group is dropped
MIN_WORDS = 40                    # a retrieved page with fewer words is near-empty and dropped
TAVILY_URL = "https://api.tavily.com"
HF_DATASET = "GEO-Optim/geo-bench"


# ----------------------------------------------------------------------------- inputs


def read_rows(path):
    """Any supported input -> [{"id", "line", "query", "docs": [{"url", "text"}], "source_index"}]."""
    if path.startswith("hf:"):
        path = fetch_hf(path[3:])
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SettingsError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow), "
                                "or give the .jsonl") from None
        objs = list(enumerate(pq.read_table(path).to_pylist(), 1))
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise geodef.BenchFormatError(f"{path}: invalid JSON ({e})") from None
        if isinstance(data, dict):                      # AutoGEO: {query_id: {query, text_list, target_id}}
            data = [{"query_id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
        if not isinstance(data, list):
            raise geodef.BenchFormatError(f"{path}: expected a list of rows or AutoGEO's {{query_id: row}}")
        objs = list(enumerate(data, 1))
    else:
        objs = list(geodef.read_jsonl(path))
    return [row_of(o, path, n) for n, o in objs]


def row_of(o, path, n):
    """One input row -> the builder's row, every field checked (file:line: field: what is wrong)."""
    if not isinstance(o, dict):
        raise geodef.BenchFormatError(f"{path}:{n}: (row): expected an object")
    for key, src_key, text_of in (("sources", "sugg_idx", lambda d: d.get("cleaned_text") or d.get("raw_text")),
                                  ("text_list", "target_id", None), ("docs", "source_index", lambda d: d.get("text"))):
        if key in o:
            break
    else:
        raise geodef.BenchFormatError(f"{path}:{n}: sources/text_list/docs: missing")
    items = o[key]
    if not isinstance(items, list):
        raise geodef.BenchFormatError(f"{path}:{n}: {key}: expected a list, got {type(items).__name__}")
    docs = []
    for i, d in enumerate(items):
        t, u = (text_of(d), d.get("url", "")) if isinstance(d, dict) and text_of else (d, "")
        t = "" if t is None else t
        if not isinstance(t, str) or not isinstance(u, str):
            raise geodef.BenchFormatError(f"{path}:{n}: {key}[{i}]: text and url must be strings")
        geodef.check_unicode(t, path, n, f"{key}[{i}]")
        docs.append({"url": u, "text": t})
    q = o.get("query")
    if not isinstance(q, str) or not q.strip():
        raise geodef.BenchFormatError(f"{path}:{n}: query: missing or empty")
    geodef.check_unicode(q, path, n, "query")
    src = o.get(src_key)
    if src is not None:
        try:
            src = int(src)                      # GEO-Bench: an int, in some copies a numeric string
        except (TypeError, ValueError):
            raise geodef.BenchFormatError(f"{path}:{n}: {src_key}: expected an integer, got {src!r}") from None
        if not 0 <= src < len(docs):
            raise geodef.BenchFormatError(f"{path}:{n}: {src_key}: {src} out of range 0..{len(docs) - 1}")
    rid = str(o.get("group_id") or o.get("query_id") or f"q{n:04d}")
    return {"id": rid, "line": n, "query": q, "docs": docs, "source_index": src}


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
    """Tavily's search API over raw HTTP JSON on the chat clients' machinery (llm_clients.Transport:
    retries, timeouts, reply cap, the key only in headers and only to its host; ReplyCache; the usage
    ledger). `tavily:http://HOST:PORT` names a Tavily-shaped endpoint (a proxy, a test server);
    `offline:CORPUS` is the offline engine's /search over a synthetic corpus at `engine_url` (run.py
    serves it on loopback), cached under the corpus's digest, not the port."""

    def __init__(self, spec, cache_dir=None, ledger=None, timeout=120, rpm=0, engine_url=None):
        provider, _, url = spec.partition(":")
        if provider not in ("tavily", "offline") or (provider == "offline" and not url):
            raise SettingsError(f"--search {spec!r}: give tavily, tavily:http(s)://HOST[:PORT] or "
                                "offline:CORPUS.jsonl")
        if provider == "offline":
            if not engine_url:
                raise SettingsError(f"--search {spec}: the offline engine is not running (run.py serves it)")
            with open(url, "rb") as f:
                self.identity = ("offline-search", hashlib.sha1(f.read()).hexdigest())
            self.where = llm_clients.Endpoint.parse(engine_url.removesuffix("/v1"))
            self.label = f"offline:{os.path.basename(url)}"
        else:
            self.where = llm_clients.Endpoint.parse(url or TAVILY_URL)
            self.identity = self.where.identity
            self.label = f"tavily:{self.where}" if url else "tavily"
        # TAVILY_API_KEY goes only to Tavily's own host; another endpoint gets SEARCH_API_KEY (optional);
        # the offline engine none
        if self.where.host == "api.tavily.com":
            key = os.environ.get("TAVILY_API_KEY")
        else:
            key = os.environ.get("SEARCH_API_KEY") if provider == "tavily" else None
        if self.where.host == "api.tavily.com" and not key:
            raise SettingsError("--search tavily: set TAVILY_API_KEY")
        self.transport = llm_clients.Transport(self.where, self.label, api_key=key, timeout=timeout, rpm=rpm,
                                               provider="search", endpoint=self.where.url + "/search",
                                               max_reply_bytes=32 << 20)
        self.cache, self.ledger, self.requests = llm_clients.ReplyCache(cache_dir), ledger, 0

    def search(self, query, n):
        """Up to n results [{url, text}] with their raw page content (falling back to the snippet)."""
        body = {"query": query, "max_results": n, "search_depth": "advanced", "include_raw_content": True}
        key = self.cache.key("tavily-search", self.identity, body, False)
        hit = self.cache.get_raw(key)
        if not isinstance(hit, dict) or not isinstance(hit.get("results"), list):
            resp = self.transport.post(body)
            self.requests += 1
            if not isinstance(resp, dict) or not isinstance(resp.get("results"), list):
                raise llm_clients.LLMError(f"{self.label}: results: expected a list")
            hit = {"results": [{"url": r.get("url") if isinstance(r.get("url"), str) else "",
                                "text": r.get("raw_content") or r.get("content") or ""}
                               for r in resp["results"] if isinstance(r, dict)]}
            self.cache.put_raw(key, hit)
            if self.ledger:        # advanced search: 2 API credits a request (Tavily's pricing)
                llm_clients.append_ledger(self.ledger, {"stage": "build-bench", "model": "search:" + self.label,
                                                        "search_units": 2}, self.transport.lock)
        return [r for r in hit["results"] if isinstance(r.get("text"), str)]


def norm(text):
    return " ".join(text.split()).lower()


def candidates(row, results, n_docs, seed):
    """The row's source among the search results: n_docs documents without duplicates (URL or text)
    or near-empty pages, the source at a position drawn from (seed, row id). -> (docs, source index)
    or (None, reason)."""
    src = row["docs"][row["source_index"]]
    seen_urls, seen_texts, others = {src["url"]} - {""}, {norm(src["text"])}, []
    for r in results:
        t = r["text"].strip()
        if len(t.split()) < MIN_WORDS or norm(t) in seen_texts or (r["url"] and r["url"] in seen_urls):
            continue
        seen_urls.add(r["url"])
        seen_texts.add(norm(t))
        others.append({"url": r["url"], "text": t})
    if len(others) < n_docs - 1:
        return None, f"{len(others) + 1} usable documents < --docs {n_docs} after search"
    pos = random.Random(f"{seed}:{row['id']}").randrange(n_docs)
    docs = others[:n_docs - 1]
    docs.insert(pos, src)
    return docs, pos


def own_candidates(row, n_docs):
    """Without search: the row's first n_docs non-empty documents, its source among them."""
    keep = [i for i, d in enumerate(row["docs"]) if d["text"].strip()][:n_docs]
    if len(keep) < n_docs:
        return None, f"{len(keep)} non-empty documents < --docs {n_docs} (give --search tavily to retrieve more)"
    src = row["source_index"]
    if src is None:     # stated rule: the longest candidate, as the most content to rewrite
        src = max(keep, key=lambda i: (len(row["docs"][i]["text"]), -i))
    if src not in keep:
        return None, f"source document {src} is empty or not among the first {n_docs} non-empty ones"
    return [row["docs"][i] for i in keep], keep.index(src)


# ----------------------------------------------------------------------------- composition


def compose(rows, n_groups, n_construction, seed):
    """The rows in a seeded random order; the build walks it until N groups have their candidates,
    and splits those (the first C construction) before any rewrite (B.1.2). -> [(row, split)] of the
    first N rows, construction first (what the dry run plans), and the whole order."""
    rows = sorted(rows, key=lambda r: r["id"])
    if len({r["id"] for r in rows}) != len(rows):
        raise SettingsError("the input has two rows with the same query id")
    order = random.Random(seed).sample(rows, len(rows))
    picked = order[:n_groups]
    if len(picked) < n_groups:
        log(f"[build-bench] the input has {len(picked)} rows, fewer than --groups {n_groups}: all taken")
    if len(picked) <= n_construction:
        raise SettingsError(f"{len(picked)} query groups leave none for the test split after "
                            f"--construction-groups {n_construction}")
    return [(r, "construction" if i < n_construction else "test") for i, r in enumerate(picked)], order


def group_id(row):
    return re.sub(r"[^A-Za-z0-9._-]+", "-", row["id"])[:40] or hashlib.sha1(row["query"].encode()).hexdigest()[:10]


# ----------------------------------------------------------------------------- rewriting


def validate_rewrite(src, new):
    """None if a rewrite may go to the fidelity judge, else the reason it is refused: the attacker's
    cheap gate (length, prompt text, every number of the source kept, chat control tokens) and a
    rewrite that changes nothing or spells our prompt's JSON."""
    if not isinstance(new, str) or not new.strip():
        return "empty"
    if " ".join(new.split()) == " ".join(src.split()):
        return "identical to the source"
    if "rewritten_document" in new or '"geo_family"' in new:
        return "contains prompt text"
    return attack.cheap_gate(src, new)


def gate(ctx, jobs, texts):
    """Each rewrite's verdict: None (kept) or why it is refused; the fidelity judge (ctx.judge) asked
    for those that pass the cheap checks."""
    why = [validate_rewrite(j.source, t) for j, t in zip(jobs, texts)]
    if ctx.judge is None:
        return why
    ask = [i for i, w in enumerate(why) if w is None]
    for i, w in zip(ask, attack.fidelity_verdicts(ctx.judge, [(jobs[i].source, texts[i]) for i in ask],
                                                  ctx.max_tokens, ctx.workers)):
        why[i] = w
    return why


def rewrite_family(ctx, name, groups):
    """Family `name` on every group (dicts with query, docs, source_index): -> {group_id: (text, trace)}
    for the rewrites that passed the gate, and {group_id: reason} for the groups it failed on."""
    done, failed, todo = {}, {}, list(groups)
    verdicts = {g["group_id"]: [] for g in groups}
    for attempt in range(REWRITE_TRIES):
        if not todo:
            break
        jobs = [geo_attacks.Job(g["query"], g["docs"][g["source_index"]]["text"], attempt,
                                g["group_id"]) for g in todo]
        out = geo_attacks.family(name, ctx).run(ctx, jobs)
        why = gate(ctx, jobs, [t for t, _ in out])
        retry = []
        for g, (t, trace), w in zip(todo, out, why):
            verdicts[g["group_id"]].append(w or "accepted")
            if w is None:
                done[g["group_id"]] = (t, {**trace, "attempts": attempt + 1, "gate": verdicts[g["group_id"]]})
            else:
                retry.append(g)
        todo = retry
    for g in todo:
        failed[g["group_id"]] = f"{name}: every attempt refused ({'; '.join(verdicts[g['group_id']])})"
    return done, failed


def mageo_engine(groups):
    """MAGEO's engine signal: each job as a geodef.Instance of its group's candidates (source in place)."""
    by_id = {g["group_id"]: g for g in groups}

    def instance(job):
        g = by_id[job.group_id]
        x = geodef.Instance(f"{g['group_id']}@build{job.attempt}", g["group_id"], g["query"],
                            [d["text"] for d in g["docs"]], [f"{g['group_id']}-{i}" for i in range(len(g["docs"]))],
                            g["source_index"], "MAGEO")
        x.source, x.attempt = job.source, job.attempt
        return x
    return instance


# ----------------------------------------------------------------------------- the command


def parse_families(text, default):
    names = [m.strip() for m in text.split(",") if m.strip()] if text else list(default)
    bad = [m for m in names if m not in geo_attacks.CALLS]
    if bad or not names:
        raise SettingsError(f"unknown attack families {bad}; known: {', '.join(geo_attacks.CALLS)}")
    return names


def plan(cfg, opts):
    """The families, seen families and groups a build makes, checked: -> (families, seen, [(row, split)])."""
    fams = parse_families(opts.attacks, geodef.PAPER_METHODS)
    if opts.attacks and not opts.seen_methods:
        raise SettingsError("--attacks: name the construction (seen) families too, with --seen-methods")
    seen = parse_families(opts.seen_methods, geodef.PAPER_SEEN_METHODS)
    if [m for m in seen if m not in fams]:
        raise SettingsError(f"--seen-methods {seen}: each must be among --attacks {fams}")
    if not 2 <= opts.docs <= geodef.N_DOCS:
        raise SettingsError(f"--docs {opts.docs}: between 2 and {geodef.N_DOCS}")
    if opts.docs <= cfg.k:
        raise SettingsError(f"--docs {opts.docs}: eval's top-k (--k {cfg.k}) needs more candidates than k")
    rows = read_rows(opts.input)
    return (fams, seen, *compose(rows, opts.groups, opts.construction_groups, cfg.seed))


def dry_run(cfg, opts):
    """What build-bench would send, without sending or writing anything: requests per family (at most,
    retries and JSON re-asks included), search requests, tokens estimated at 4 characters a token, and
    the price with --prices."""
    fams, seen, picked, _ = plan(cfg, opts)
    n_cons = sum(1 for _, s in picked if s == "construction")
    chars = sum(len(max((d["text"] for d in r["docs"]), key=len, default="")) for r, _ in picked) / max(1, len(picked))
    prices = read_prices(cfg.prices) if cfg.prices else {}
    price = prices.get(cfg.llm.rsplit(":", 1)[-1])
    stages = {}
    for f in fams:
        n = len(picked) if f in seen else len(picked) - n_cons
        req = n * geo_attacks.CALLS[f] * REWRITE_TRIES * 2
        tok_in, tok_out = int(req * (chars / 4 * 2 + 400)), int(req * chars / 4 * 1.3)
        stages[f] = {"groups": n, "requests": req, "prompt_tokens": tok_in, "completion_tokens": tok_out,
                     "usd": None if price is None else (tok_in * price[0] + tok_out * price[1]) / 1e6}
    if opts.fidelity_judge:
        n = sum(v["groups"] for v in stages.values()) * REWRITE_TRIES * 2
        stages["fidelity judge"] = {"requests": n, "prompt_tokens": int(n * chars / 2), "completion_tokens": n * 60}
    return {"groups": len(picked), "construction": n_cons, "test": len(picked) - n_cons,
            "instances": {"construction": n_cons * len(seen), "test": (len(picked) - n_cons) * len(fams)},
            "search_requests": len(picked) if opts.search else 0, "stages": stages,
            "note": "upper bounds (gate retries and JSON re-asks included); cached replies cost nothing"}


def build_bench(cfg, opts):
    """Build the benchmark file `opts.output` (see the module docstring) -> (path, composition)."""
    fams, seen, _, order = plan(cfg, opts)
    llm = make_llm(cfg, stage="build-bench")
    judge = make_llm(cfg, opts.fidelity_judge, stage="build-bench") if opts.fidelity_judge else None
    search = SearchClient(opts.search, os.path.join(cfg.run_dir, "cache", "search"), usage_path(cfg),
                          timeout=cfg.timeout or 120, rpm=cfg.rpm, engine_url=cfg.engine_url) if opts.search else None
    groups, dropped = [], []
    for row in order:                   # in the seeded order until --groups lists are complete
        if len(groups) == opts.groups:
            break
        if search:
            if row["source_index"] is None:
                dropped.append((row, "no source document (sugg_idx / target_id / source_index)"))
                continue
            docs, pos = candidates(row, search.search(row["query"], opts.docs + 5), opts.docs, cfg.seed)
        else:
            docs, pos = own_candidates(row, opts.docs)
        if docs is None:
            dropped.append((row, pos))
            continue
        gid = group_id(row)
        split = "construction" if len(groups) < opts.construction_groups else "test"
        other = next((g["group_id"] for g in groups if g["split"] != split and
                      {norm(d["text"]) for d in g["docs"]} & {norm(d["text"]) for d in docs}), None)
        if other:                       # B.1.2: nothing of a group crosses splits
            dropped.append((row, f"shares a document with group {other} of the other split"))
            continue
        docs = [{"doc_id": f"{gid}-{i}", "url": d["url"], "text": d["text"]} for i, d in enumerate(docs)]
        groups.append({"group_id": gid, "query": row["query"], "split": split, "source_index": pos, "row": row,
                       "docs": docs})
    ctx = geo_attacks.Ctx(llm, cfg.temperature, max(cfg.max_tokens, 4096), cfg.workers, judge=judge,
                          archive=geo_attacks.read_archive(opts.agentic_archive) if opts.agentic_archive else None,
                          rules=geo_attacks.read_rules(opts.autogeo_rules) if opts.autogeo_rules else None)
    if "MAGEO" in fams and groups:
        from runs import rankers
        ctx.ranker, ctx.engine = rankers(cfg, False)[0], mageo_engine(groups)
    attacks, traces, failed = {g["group_id"]: {} for g in groups}, {g["group_id"]: {} for g in groups}, {}
    for f in fams:
        todo = [g for g in groups if (f in seen or g["split"] == "test") and g["group_id"] not in failed]
        done, bad = rewrite_family(ctx, f, todo)
        failed.update(bad)
        for gid, (text, trace) in done.items():
            attacks[gid][f], traces[gid][f] = text, trace
    kept = [g for g in groups if g["group_id"] not in failed]
    dropped += [(g["row"], failed[g["group_id"]]) for g in groups if g["group_id"] in failed]
    for row, why in dropped:
        log(f"[build-bench] dropped {opts.input}:{row['line']} ({row['id']}): {why}")
    if not kept:
        raise SettingsError(f"{opts.input}: no query group left, all {len(dropped)} dropped "
                            f"(first: {dropped[0][1] if dropped else 'no rows'})")
    write(cfg, opts, fams, seen, kept, attacks, traces, llm, search)
    comp = composition(kept, fams, seen)
    log(f"[build-bench] wrote {len(kept)} groups to {opts.output}; dropped {len(dropped)}; calls {ctx.calls}; "
        f"search requests {search.requests if search else 0}; usage {llm.usage()}")
    return opts.output, comp


def composition(groups, fams, seen):
    """Table B.1 of a build: groups and attack-injected instances per split."""
    out = {}
    for split, names in (("construction", seen), ("test", fams)):
        n = sum(1 for g in groups if g["split"] == split)
        out[split] = {"groups": n, "methods": len(names), "instances": n * len(names)}
    return out


def write(cfg, opts, fams, seen, groups, attacks, traces, llm, search):
    """The benchmark file: written aside, validated (geodef.load_bench), then renamed over the output."""
    meta = {"name": os.path.basename(opts.output), "synthetic": bool(opts.synthetic), "methods": fams,
            "seen_methods": seen, "n_docs": opts.docs, "search": search.label if search else None,
            "builder_llm": llm.label, "fidelity_judge": opts.fidelity_judge, "seed": cfg.seed,
            "groups": len(groups), "source": os.path.basename(opts.input),
            "prompt_digests": geo_attacks.prompt_digests(fams)}
    if opts.synthetic:
        meta["note"] = ("SYNTHETIC: programmatic pages and offline-engine rewrites for offline plumbing; not the "
                        "paper's benchmark and not real web pages. Numbers measured on it say nothing about real "
                        "engines.")
    lines = [json.dumps({"_meta": meta}, ensure_ascii=False)]
    for g in groups:
        gid = g["group_id"]
        names = fams if g["split"] == "test" else seen
        lines.append(json.dumps({"group_id": gid, "query": g["query"], "docs": g["docs"],
                                 "source_index": g["source_index"],
                                 "attacks": {m: attacks[gid][m] for m in names},
                                 "trace": {m: traces[gid][m] for m in names}, "split": g["split"]},
                                 ensure_ascii=False))
    tmp = f"{opts.output}.tmp{os.getpid()}"
    try:
        atomic_write(tmp, "\n".join(lines) + "\n")
        geodef.load_bench(tmp, n_docs=opts.docs)
        os.replace(tmp, opts.output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
