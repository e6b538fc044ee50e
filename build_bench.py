"""The GEO-DefenseBench builder: rewrites each row's source document with one fact-keeping prompt per
GEO method (our wording of Aggarwal et al. 2024's methods) through an LLM, validates the rewrites
and the file, and only then replaces the output.

Usage: build_bench(cfg, "geo_bench.jsonl", "my_bench.jsonl", ["authoritative", "statistics"])
"""
import json
import os


import geodef
from runs import SettingsError, atomic_write, log, make_llm

# ----------------------------------------------------------------------------- benchmark builder

# Our own wording of the nine GEO methods of Aggarwal et al. 2024 (GEO, arXiv 2311.09735, Sec. 3) plus a
# generic visibility rewrite. Every prompt keeps the facts; none is the original GEO prompt text.
GEO_METHODS = {
    "fluency": "Rewrite the document so that it reads more fluently and smoothly. Keep every fact unchanged.",
    "unique_words": "Rewrite the document using more distinctive and less common vocabulary. Keep every fact unchanged.",
    "authoritative": "Rewrite the document in a confident, authoritative voice that projects expertise and certainty. "
                     "Keep every fact unchanged.",
    "quotation": "Rewrite the document adding quotations from people or organisations that support its points. "
                 "Keep every original fact unchanged.",
    "citation": "Rewrite the document adding references to sources that appear to back up its statements. "
                "Keep every original fact unchanged.",
    "simple": "Rewrite the document in simple, easy-to-understand language. Keep every fact unchanged.",
    "technical": "Rewrite the document using more technical terminology where it fits. Keep every fact unchanged.",
    "statistics": "Rewrite the document adding compelling quantitative statements and statistics that support its "
                  "points. Keep every original fact unchanged.",
    "keywords": "Rewrite the document adding up to ten new keywords relevant to the likely search query. Keep every "
                "fact unchanged.",
    "maximize": "Rewrite the document so that a generative search engine answering the query is as likely as possible "
                "to select and cite it. Keep every fact unchanged.",
}
BUILDER_HEADER = "GEO-DefenseBench builder: rewrite one web document for a GEO robustness benchmark."


def builder_prompt(query, doc, method):
    return (f"{BUILDER_HEADER}\n\n{GEO_METHODS[method]} Return only JSON of the form "
            "{\"rewritten_document\": \"...\"} with the full rewritten document.\n\n<input>\n"
            + json.dumps({"query": query, "method": method, "document": doc}, ensure_ascii=False) + "\n</input>")


def validate_rewrite(src, new, min_ratio=0.5, max_ratio=4.0):
    """None if the rewrite is usable, else the reason it is dropped."""
    if not isinstance(new, str) or not new.strip():
        return "empty"
    if " ".join(new.split()) == " ".join(src.split()):
        return "identical to the source"
    r = len(new) / max(1, len(src))
    if not min_ratio <= r <= max_ratio:
        return f"length ratio {r:.2f} outside [{min_ratio}, {max_ratio}]"
    low = new.lower()
    if BUILDER_HEADER.lower()[:30] in low or "rewritten_document" in low or "<input>" in low:
        return "contains prompt text"
    if geodef.control_tokens(new):
        return f"holds chat control tokens {geodef.control_tokens(new)[:3]}"
    return None


def read_source_rows(path):
    """GEO-Bench test rows (query, sources[].cleaned_text, sugg_idx) or simple rows (query, docs[, source_index])."""
    rows = []
    for n, o in geodef.read_jsonl(path):
        if "sources" in o or "docs" in o:
            key = "sources" if "sources" in o else "docs"
            items = o[key]
            if not isinstance(items, list):
                raise geodef.BenchFormatError(f"{path}:{n}: {key}: expected a list, got {type(items).__name__}")
            docs, urls = [], []
            for i, d in enumerate(items):
                if isinstance(d, dict):
                    t = (d.get("cleaned_text") or d.get("raw_text")) if key == "sources" else d.get("text")
                    t, u = ("" if t is None else t), d.get("url", "")
                else:
                    t, u = d, ""
                if not isinstance(t, str) or not isinstance(u, str):
                    raise geodef.BenchFormatError(f"{path}:{n}: {key}[{i}]: text and url must be strings")
                geodef._unicode(t, path, n, f"{key}[{i}]")
                docs.append(t)
                urls.append(u)
            field = "sugg_idx" if key == "sources" else "source_index"
        else:
            raise geodef.BenchFormatError(f"{path}:{n}: sources/docs: missing")
        if not isinstance(o.get("query"), str) or not o["query"].strip():
            raise geodef.BenchFormatError(f"{path}:{n}: query: missing or empty")
        src = o.get(field)
        if src is not None:
            try:
                src = int(src)  # GEO-Bench: an int, in some copies a numeric string
            except (TypeError, ValueError):
                raise geodef.BenchFormatError(f"{path}:{n}: {field}: expected an integer, got {src!r}") from None
        rows.append({"line": n, "query": o["query"], "docs": docs, "urls": urls, "source_index": src,
                     "group_id": o.get("group_id") or o.get("query_id") or f"q{n:04d}"})
    return rows


def build_bench(cfg, src_path, out_path, methods, n_docs=geodef.N_DOCS):
    """Rewrite each row's source document with every method through the LLM (cached, resumable),
    validate, drop unusable rows with a logged reason, write a file load_bench accepts."""
    seen = [m.strip() for m in cfg.seen_methods.split(",") if m.strip()] if cfg.seen_methods else []
    bad = [m for m in seen if m not in methods]
    if bad:
        raise SettingsError(f"--seen-methods: {bad} are not among --geo-methods {methods}")
    if not seen:
        log("[build-bench] no --seen-methods: the file gets no _meta.seen_methods, and train will ask for them")
    llm = make_llm(cfg)
    rows = read_source_rows(src_path)
    kept, dropped = [], []
    for r in rows:
        keep = [i for i, d in enumerate(r["docs"]) if d and d.strip()][:n_docs]   # the row's own indices
        if len(keep) < n_docs:
            dropped.append((r["line"], f"{len(keep)} non-empty documents < {n_docs}"))
            continue
        src = r["source_index"]
        if src is not None and src not in keep:
            dropped.append((r["line"], f"source document {src} is empty or not among the first {n_docs} "
                                       "non-empty ones"))
            continue
        r["docs"], r["urls"] = [r["docs"][i] for i in keep], [r["urls"][i] for i in keep]
        # the given source, renumbered past dropped empty documents; when none is given (stated rule):
        # the longest candidate, as the most content to rewrite
        r["source_index"] = keep.index(src) if src is not None else \
            max(range(n_docs), key=lambda i: (len(r["docs"][i]), -i))
        kept.append(r)
    reqs = [{"messages": [{"role": "user", "content": builder_prompt(r["query"], r["docs"][r["source_index"]], m)}],
             "temperature": cfg.temperature, "max_tokens": max(cfg.max_tokens, 4096), "json": True}
            for r in kept for m in methods]
    replies = llm.map(reqs, workers=cfg.workers, desc="rewrites")
    out = [json.dumps({"_meta": {"name": os.path.basename(out_path), "synthetic": False, "methods": methods,
                                 **({"seen_methods": seen} if seen else {}), "builder_llm": llm.label,
                                 "source": src_path}})]
    it = iter(replies)
    for r in kept:
        src = r["docs"][r["source_index"]]
        attacks, why = {}, None
        for m in methods:
            rep = next(it)
            new = rep.data.get("rewritten_document") if isinstance(rep.data, dict) else None
            why = why or (None if validate_rewrite(src, new) is None else f"{m}: {validate_rewrite(src, new)}")
            attacks[m] = new
        if why:
            dropped.append((r["line"], why))
            continue
        out.append(json.dumps({"group_id": r["group_id"], "query": r["query"], "source_index": r["source_index"],
                               "docs": [{"doc_id": f"{r['group_id']}-{i}", "url": r["urls"][i] if i < len(r["urls"]) else "",
                                         "text": d} for i, d in enumerate(r["docs"])], "attacks": attacks},
                              ensure_ascii=False))
    for line, why in dropped:
        log(f"[build-bench] dropped {src_path}:{line}: {why}")
    # written aside and validated before it replaces anything: a bad run never destroys an existing file
    tmp = f"{out_path}.tmp{os.getpid()}"
    try:
        atomic_write(tmp, "\n".join(out) + "\n")
        geodef.load_bench(tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    u = llm.usage()
    log(f"[build-bench] wrote {len(out) - 1} groups to {out_path}; dropped {len(dropped)}; usage {u}")
    return out_path
