"""Rerank clients over raw HTTP JSON: Cohere (v2), Jina, Voyage, any Cohere/Jina/vLLM-shaped /rerank
endpoint and Text Embeddings Inference, on the chat clients' machinery (transport.Transport:
retries with Retry-After, a whole-reply deadline, no redirects, a reply-size cap, the key only in
headers and only to its own host; llm_clients.ReplyCache: replies by request hash, in-flight
de-duplication).
Every reply is checked index by index: a wrong one is an error naming the endpoint and the field,
never a silently wrong ranking.

Usage: rc = make_reranker("cohere:rerank-v3.5", cache_dir="runs/x/cache/rerank"); rc.rerank(query, docs).scores
"""
import json
import math
import os
import re
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from accounting import append_ledger
from endpoints import LOCAL_RERANKERS, RERANK_PROVIDERS, Endpoint, parse_spec
from llm_clients import ReplyCache
from transport import LLMError, Transport, json_object

RERANK_KEY_VAR = "RERANK_API_KEY"        # the key of a self-hosted endpoint (http://... or tei:http://...)


@dataclass
class RerankReply:
    scores: list                 # one float per document, in the documents' order (higher = more relevant)
    usage: dict = field(default_factory=dict)   # search_units (Cohere), tokens (Jina, Voyage), if reported
    cached: bool = False


def rerank_body(shape, model, query, docs):
    """The request of each API shape: Cohere v2, Jina, Voyage, any Cohere/Jina/vLLM-shaped endpoint
    ("generic"), Text Embeddings Inference's /rerank ("tei"), or vLLM's Score API ("vllm-score": the query
    as text_1, the documents as text_2). Every document is asked for."""
    if shape == "tei":
        return {"query": query, "texts": docs, "raw_scores": False}
    if shape == "vllm-score":
        return {**({"model": model} if model is not None else {}), "text_1": query, "text_2": docs}
    if shape == "voyage":
        return {"model": model, "query": query, "documents": docs, "return_documents": False, "truncation": True}
    body = {"model": model, "query": query, "documents": docs, "top_n": len(docs)}
    if model is None:            # no #MODEL in the spec: the field is left out (the server's own model)
        del body["model"]
    if shape == "jina":
        body["return_documents"] = False
    return body


# Where each shape puts its results and their scores (TEI's reply is the list itself)
REPLY_FIELDS = {"tei": ("(body)", "score"), "voyage": ("data", "relevance_score"), "vllm-score": ("data", "score")}


def _finite(v):
    """A finite JSON number as it is, or None (a bool, a string, NaN, inf, or an int past float's range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return v if math.isfinite(v) else None
    except OverflowError:
        return None


def rerank_scores(shape, resp, n, where):
    """A rerank reply -> (n scores in document order, usage). Checked: a list of results, one per
    document, every index in 0..n-1 exactly once, finite numeric scores; anything else raises
    LLMError naming the endpoint and the field (a wrong reply is never a silently wrong ranking)."""
    def bad(field, msg):
        return LLMError(f"{where}: {field}: {msg}", None, "rerank")
    field_name, score_key = REPLY_FIELDS.get(shape, ("results", "relevance_score"))
    items = resp if shape == "tei" else resp.get(field_name) if isinstance(resp, dict) else None
    if not isinstance(items, list):
        raise bad(field_name, f"expected a list of results, got {type(items).__name__}")
    if len(items) != n:
        raise bad(field_name, f"{len(items)} results for {n} documents")
    scores = [None] * n
    for j, it in enumerate(items):
        idx = it.get("index") if isinstance(it, dict) else None
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:   # a value is never echoed:
            raise bad(f"{field_name}[{j}].index", f"expected an integer in 0..{n - 1}, got "   # it may be a key
                                                  f"{idx if isinstance(idx, int) else type(idx).__name__}")
        if scores[idx] is not None:
            raise bad(f"{field_name}[{j}].index", f"{idx} given twice")
        v = _finite(it.get(score_key))
        if v is None:
            raise bad(f"{field_name}[{j}].{score_key}", f"expected a finite number, got "
                                                        f"{type(it.get(score_key)).__name__}")
        scores[idx] = float(v)
    usage = {}
    if isinstance(resp, dict):
        units = _finite(json_object(json_object(resp.get("meta")).get("billed_units")).get("search_units"))
        tokens = _finite(json_object(resp.get("usage")).get("total_tokens"))
        if units is not None and units >= 0:
            usage["search_units"] = units
        if tokens is not None and tokens >= 0:
            usage["tokens"] = tokens
    return scores, usage


class RerankClient:
    """A rerank endpoint over raw HTTP JSON, on the chat clients' machinery: Transport (retries with
    Retry-After, a whole-reply deadline, no redirects, a reply-size cap, the key only in headers),
    ReplyCache (by request hash, in-flight de-duplication), a rate limit, counters and the usage ledger."""

    def __init__(self, url, model=None, shape="generic", api_key=None, label=None, cache_dir=None, timeout=120,
                 max_retries=2, rpm=0, ledger=None, stage=None, max_reply_bytes=8 << 20):
        if shape not in ("cohere", "jina", "voyage", "generic", "tei", "vllm-score"):
            raise ValueError(f"rerank shape must be cohere, jina, voyage, generic, tei or vllm-score, got {shape!r}")
        self.where = url if isinstance(url, Endpoint) else Endpoint.parse(url)   # credentials held apart
        self.url, self.model, self.shape = self.where.url, model, shape
        self.label = label or str(self.where)
        self.transport = Transport(self.where, self.label, "openai", api_key, timeout=timeout, max_retries=max_retries,
                                   rpm=rpm, provider="rerank", endpoint=self.url, max_reply_bytes=max_reply_bytes)
        self.cache = ReplyCache(cache_dir)
        self.ledger, self.stage = ledger, stage
        self.lock = threading.Lock()
        self._stats = {"requests": 0, "cache_hits": 0, "documents": 0, "search_units": 0, "tokens": 0}
        self.transport.on_lost = lambda: self._enter({"lost": 1, "unmetered": 1})   # a reply lost after it was sent
        self._card = None                       # served(): what the endpoint says it serves, asked once

    @property
    def stats(self):
        return {**self._stats, "http_calls": self.transport.http_calls, "retries": self.transport.retries}

    def rerank(self, query, docs):
        """Score `docs` for `query` in one request -> RerankReply (scores in the documents' order)."""
        if not isinstance(query, str) or not docs or not all(isinstance(d, str) for d in docs):
            raise ValueError("rerank needs a query string and a non-empty list of document strings")
        body = rerank_body(self.shape, self.model, query, list(docs))
        key = self.cache.key("rerank-" + self.shape, self.where.identity + self.served_model(), body, False)
        with self.lock:
            self._stats["requests"] += 1
        return self.cache.through(key, lambda: self._hit(key, len(docs)), lambda: self._ask(key, body, len(docs)))

    def served(self):
        """What a self-hosted endpoint says it serves, asked once at its root: TEI's GET /info, vLLM's GET
        /v1/models -> (route, reply), or None (hosted APIs, which name their model in every request, and
        endpoints answering neither)."""
        with self.lock:                      # asked once, the first requests waiting for it
            if self._card is None:
                card = ()
                root = re.sub(r"(/v[12])?/(rerank|score)$", "", self.where.path)
                routes = ("/info", "/v1/models") if self.shape == "tei" else ("/v1/models", "/info")
                for route in routes if self.shape in ("tei", "generic", "vllm-score") else ():
                    try:
                        card = (route, self.transport.send("GET", self.where.with_path(root + route).url))
                        break
                    except LLMError as e:   # no such route (a 4xx, a page not JSON): the other one, or nothing said
                        if e.status is None or e.status >= 500 or e.status in (401, 403, 408, 429):
                            raise LLMError(f"{self.label}: asking what the endpoint serves ({route}) failed, so its "
                                           f"cached scores cannot be told from another model's: {e}", e.status,
                                           "rerank") from None
                self._card = card            # (a failure is asked again by the next request, never remembered)
            return self._card or None

    def served_model(self):
        """The served model's name, commit and input limit, for the cache key of an endpoint whose requests
        name no model: the same URL serving another model after a restart is another reranker ('' when the
        endpoint names a model in its requests, or says nothing)."""
        if self.model is not None:
            return ""
        route, reply = self.served() or (None, None)
        if route == "/info" and isinstance(reply, dict):
            said = [reply.get(k) for k in ("model_id", "model_sha", "max_input_length", "auto_truncate")]
        else:
            cards = reply.get("data") if isinstance(reply, dict) else None
            said = sorted(json.dumps([c.get("id"), c.get("root"), c.get("max_model_len")]) for c in cards
                          if isinstance(c, dict)) if isinstance(cards, list) else []
        return " " + json.dumps(said) if any(x is not None for x in said) else ""

    def _ask(self, key, body, n):
        resp = self.transport.post(body)
        try:
            scores, usage = rerank_scores(self.shape, resp, n, self.label)
        except LLMError:                     # refused, but answered: billed as a request
            self._count(n, {})
            raise
        self._count(n, usage)
        self.cache.put_raw(key, {"scores": scores, "usage": usage})
        return RerankReply(scores, usage)

    def _hit(self, key, n):
        d = self.cache.get_raw(key)
        if not isinstance(d, dict) or not isinstance(d.get("scores"), list) or len(d["scores"]) != n or \
                any(_finite(v) is None for v in d["scores"]):   # an entry edited or cut: asked again
            return None
        with self.lock:
            self._stats["cache_hits"] += 1
        return RerankReply(d["scores"], d.get("usage") or {}, cached=True)

    def _count(self, n_docs, usage):
        """A reply received: counted, and entered in the usage ledger (one line each)."""
        self._enter({"documents": n_docs, **usage})

    def _enter(self, row):
        """Counts added to this client's stats and, with a ledger, appended to it as one row."""
        with self.lock:
            for k, v in row.items():
                self._stats[k] = self._stats.get(k, 0) + v
        if self.ledger:
            append_ledger(self.ledger, {"stage": self.stage, "model": "rerank:" + self.label, **row})

    def map(self, requests_, workers=8):
        """[(query, docs), ...] -> [RerankReply, ...] in order, `workers` at a time; the first failure
        raises: requests not started are cancelled, those in flight stopped (Transport.abort)."""
        self.transport.resume()                  # a new run of requests: an earlier map's failure stops none of them
        ex = ThreadPoolExecutor(max_workers=max(1, workers))
        try:
            futs = [ex.submit(self.rerank, q, d) for q, d in requests_]
            wait(futs, return_when=FIRST_EXCEPTION)            # a failure ends the wait at once
            failed = next((f for f in futs if f.done() and f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
            out = [f.result() for f in futs]
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            self.transport.abort()
            raise
        ex.shutdown()
        return out


def make_reranker(spec, cache_dir=None, api_key=None, **kw):
    """A reranker spec (text or RerankSpec, see parse_spec) -> RerankClient. Hosted APIs take their
    keys from COHERE_API_KEY, JINA_API_KEY, VOYAGE_API_KEY; a self-hosted endpoint the URL's user:password
    as Basic auth, else RERANK_API_KEY (optional; rankers.check_specs sends it to one host only)."""
    s = parse_spec(spec)
    if s.kind in LOCAL_RERANKERS:
        raise ValueError(f"{s.kind!r} is this project's in-process reranker, not an endpoint")
    if s.kind in RERANK_PROVIDERS:
        p = RERANK_PROVIDERS[s.kind]
        key = api_key or next((os.environ[v] for v in p["keys"] if os.environ.get(v)), None)
        if not key:
            raise LLMError(f"{s}: no API key: set {' or '.join(p['keys'])}", None, s.kind)
        return RerankClient(Endpoint.parse(p["url"]), s.model, p["shape"], key, label=str(s), cache_dir=cache_dir,
                            **kw)
    key = api_key or (None if s.endpoint.basic else os.environ.get(RERANK_KEY_VAR)) or None
    return RerankClient(s.endpoint, s.model, s.kind, key, label=str(s), cache_dir=cache_dir, **kw)
