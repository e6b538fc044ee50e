"""Usage accounting for the LLM, rerank and search calls of a run: the usage ledger (one JSON line
per reply received, over every invocation), its sums per stage and model, and their price from a
price table: one key (`price_key`, the model name after the provider) and one formula for tokens
(`token_cost`), a batch API's rows at the batch share.

Usage: append_ledger("runs/x/usage.jsonl", {"stage": "eval", "model": "openai:gpt-5.5", ...})
       ledger_usage("runs/x/usage.jsonl", {"gpt-5.5": [1.25, 10.0]})["total"]["cost_usd"]
"""
import json
import os
import threading

BATCH_SHARE = 0.5
LEDGER_KINDS = ("rerank:", "search:")    # ledger rows other than chat replies: 'rerank:SPEC', 'search:SPEC'


def price_key(label):
    """A usage label's key in a price table: the model name after the provider prefix, a batch row's
    ' [batch]' removed, and a rerank or search row's kind before it: 'ollama:qwen3:8b' -> 'qwen3:8b',
    'openai:gpt-5.5 [batch]' -> 'gpt-5.5', 'rerank:cohere:rerank-v3.5' -> 'rerank-v3.5'."""
    spec = label.removesuffix(" [batch]")
    if spec.startswith(LEDGER_KINDS):
        spec = spec.partition(":")[2]
    _, colon, model = spec.partition(":")
    return model if colon else spec


def token_cost(p, row, batch=False):
    """USD of a chat model's tokens under price entry p = [USD per 1M input, per 1M output(, batch
    share(, USD per 1M input tokens read from the provider's prompt cache))]; batch=True: the batch APIs'
    share of that (default BATCH_SHARE). None (unknown) for cached input tokens without a cached price
    (OpenAI and Anthropic charge them 10-50% of the input price, by model), or for tokens written to a
    prompt cache (priced above the input, by the cache's lifetime; this project asks for no caching)."""
    cached, written = row.get("cached_tokens", 0), row.get("cache_write_tokens", 0)
    if written or (cached and len(p) < 4):
        return None
    full = ((row.get("prompt_tokens", 0) - cached) * p[0] + cached * (p[3] if cached else 0)
            + row.get("completion_tokens", 0) * p[1]) / 1e6
    return full * (p[2] if len(p) > 2 else BATCH_SHARE) if batch else full


def estimate(requests, prompt_chars, completion_tokens):
    """A stage of a dry run: requests, prompt tokens at 4 characters a token, completion tokens."""
    return {"requests": requests, "prompt_tokens": int(requests * prompt_chars / 4),
            "completion_tokens": int(requests * completion_tokens)}


def price_plan(prices, stages, model_of, batch=False):
    """USD of a dry run's stages with --prices ([USD per 1M in, per 1M out(, batch share)] by model),
    or None; batch=True: through the batch APIs (price_of's batch share, default half)."""
    prices = prices or {}
    total = 0.0
    for name, st in stages.items():
        p = prices.get(price_key(model_of(name)))
        if p is None or isinstance(p, dict):
            return None
        total += token_cost(p, st, batch)
    return total


def price_of(label, row, prices):
    """USD of one ledger row from a price table keyed by model name (price_key):
    [USD per 1M input tokens, per 1M output tokens] for chat models; for rerank models
    {"usd_per_1k_searches": x} (Cohere's search units, else one per request) or
    {"usd_per_1m_tokens": y}. None when the table has no entry, or one of another kind (a chat price for a
    rerank row, a token price for an endpoint that reports no tokens), or the row holds replies that came
    without token counts ("unmetered"): unknown, not $0. A batch API's rows
    ('<label> [batch]') cost the entry's third number times the full price (default BATCH_SHARE: half,
    OpenAI's and Anthropic's batch discount)."""
    p = prices.get(price_key(label))
    if p is None or isinstance(p, dict) != label.startswith(LEDGER_KINDS) or row.get("unmetered"):
        return None
    if isinstance(p, dict):
        if "usd_per_1k_searches" in p:
            return row.get("search_units", row["replies"]) * p["usd_per_1k_searches"] / 1e3
        return row["tokens"] * p["usd_per_1m_tokens"] / 1e6 if "tokens" in row and "usd_per_1m_tokens" in p else None
    return token_cost(p, row, batch=label.endswith(" [batch]"))


_LOCKS, _LOCKS_HELD = {}, threading.Lock()       # one lock a ledger file, whichever client writes it


def append_ledger(path, record):
    """One line of a usage ledger (see ledger_usage), written under the file's one lock in this process: a
    target, a judge and a reranker client append to one run's ledger, and the repair of a cut last line
    below must not run while another writer's line is half written."""
    with _LOCKS_HELD:
        lock = _LOCKS.setdefault(os.path.abspath(path), threading.Lock())
    with lock:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            with open(path, "a+b") as f:
                end = f.seek(0, os.SEEK_END)
                if end:
                    f.seek(end - 1)
                    if f.read(1) != b"\n":      # a line a kill cut: dropped, so that this record does not
                        f.seek(0)               # start on its end (and go unread with it)
                        f.truncate(f.read().rfind(b"\n") + 1)
                f.write((json.dumps(record) + "\n").encode("utf-8"))
        except OSError as e:      # a full disk names no file: this one is named
            raise OSError(e.errno, e.strerror, e.filename or path) from None


def ledger_usage(path, prices=None, since=0):
    """A usage ledger (Client(ledger=...), RerankClient(ledger=...)) summed per stage and model, and
    in total: {"stages": {stage: {model: {replies, prompt_tokens, ..., cost_usd}}}, "total": {...}}.
    Chat rows sum tokens; rerank rows (model "rerank:...") documents, search units and tokens; a `lost`
    row is a request whose reply was lost after it was sent (unmetered: it may have been billed).
    cost_usd is None where `prices` lacks the model or a row is unmetered (price_of). A line cut by a kill is
    skipped (its reply was not cached either, and is asked again), as is one that is not a UTF-8 JSON object.
    since: the byte offset of the first line counted (a job's own lines, appended after it)."""
    stages = {}
    lines = open(path, "rb").read()[since:].split(b"\n") if path and os.path.isfile(path) else []
    for line in lines:
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:                     # (a damaged byte too: UnicodeDecodeError is a ValueError)
            continue
        if not isinstance(rec, dict):
            continue
        row = stages.setdefault(str(rec.get("stage")), {}).setdefault(str(rec.get("model", "?")), {"replies": 0})
        row["replies"] += not rec.get("lost")       # a lost reply's row: a request that may have been billed
        for k, v in rec.items():
            if k not in ("stage", "model") and isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = row.get(k, 0) + v
    total = {"replies": 0, "cost_usd": 0.0}
    for rows in stages.values():
        for label, row in rows.items():
            row["cost_usd"] = price_of(label, row, prices or {})
            for k, v in row.items():
                if k != "cost_usd":
                    total[k] = total.get(k, 0) + v
            total["cost_usd"] = None if row["cost_usd"] is None or total["cost_usd"] is None else \
                total["cost_usd"] + row["cost_usd"]
    return {"stages": {k: stages[k] for k in sorted(stages)}, "total": total}
