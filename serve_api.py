"""The rerank server's API shapes (serve.py serves them): the routes, each request's fields read and
validated as its clients spell them (Cohere, Jina, vLLM's rerank and Score APIs, TEI, Infinity), the
prompts a request makes (its documents fitted to its truncation settings, its query's copies bounded),
the replies each client parses, the Prometheus metrics and the OpenAPI description. Every field a route
reads is checked here, a RequestError naming it as the client spelled it: nothing a client sends reaches
the scorer unchecked.

Usage: req = parse_rerank("/v1/rerank", body, max_documents=1000); ids = prompt_ids(rr, req)
"""
import collections
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

import certify
from endpoints import RequestError
from metrics import ranked, sigmoid

INFINITY_PATHS = ("/rerank", "/infinity/rerank")   # Infinity's reply; /infinity/rerank: api_base .../infinity
RERANK_PATHS = ("/v1/rerank", "/v2/rerank") + INFINITY_PATHS
SCORE_PATHS = ("/score", "/v1/score")    # vLLM's Score API
DETECT_PATH = "/detect"                   # the run's GEO detector (detect.py), ours
POST_PATHS = RERANK_PATHS + SCORE_PATHS + (DETECT_PATH,)
GET_PATHS = ("/health", "/info", "/v1/models", "/metrics", "/openapi.json")   # and /v1/models/{id}
MODEL_PATH = "/v1/models/"
# vLLM's spellings of a score request's two sides (ScoreRequest, vllm/entrypoints/pooling/score/protocol.py)
SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
MAX_INSTRUCTION_CHARS = 4096
MAX_QUERY_CHARS = 65536           # a query enters every document's prompt: a longer one fills no real max_length
MAX_QUERY_COPY_TOKENS = 1 << 21   # the query's and instruction's tokens over all of a request's prompts
SEAM = 8     # tokens a document may encode to in its prompt, more than alone (a leading space, a cut character)


@dataclass
class RerankRequest:
    """A validated rerank or score request (parse_rerank, parse_score)."""
    query: object                 # one query string, or (vLLM's N:N score) a list: one query per document
    texts: list
    tei: bool = False             # TEI's request and response shape
    top_n: int = None             # None: every document
    with_text: bool = False       # return_documents / return_text
    raw: bool = False             # margins instead of sigmoid(margin): raw_scores true, use_activation false
    truncate: bool = True         # TEI truncate false: a too-long input is an error (413, as TEI)
    left: bool = False            # TEI Left, vLLM truncation_side left: a too-long document loses its start
    max_doc_tokens: int = None    # max_tokens_per_doc: each document cut to that many tokens
    max_prompt_tokens: int = None  # vLLM truncate_prompt_tokens: each prompt at most that many (-1: max_length)
    model: str = None             # echoed in the reply
    document_string: bool = False  # Infinity's reply: results[].document a string, not {text}
    instruction: str = None       # the prompt's <Instruct>: for this request; None: the server's
    instruction_field: str = None  # the field it came in: instruction or chat_template_kwargs.instruction
    detect: bool = False          # return_detect: each result with the run's detector's score and flag (ours)


def _text(v, field):
    """A request string that can be encoded: a lone surrogate ("\\ud800" is valid JSON) is a 400 here,
    not a failure inside the tokenizer."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{field}: not valid Unicode text (character {e.start}: lone surrogate)",
                           field) from None
    return v


def _flag(body, k, default=False):
    """A boolean field; "true"/"false" as strings too (RAGFlow's Xinference provider sends them); null is the
    default (TEI's Option<bool>, an SDK's unset field)."""
    v = default if body.get(k) is None else body[k]
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if not isinstance(v, bool):
        raise RequestError(400, f"{k}: true or false is required", k)
    return v


def _int_field(body, k, minimum):
    v = body.get(k)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
        raise RequestError(400, f"{k}: an integer >= {minimum} is required, got {v!r}", k)
    return v


def _object(body):
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _query(q, field):
    if not isinstance(q, str) or not q.strip():
        raise RequestError(400, f"{field}: a non-empty string is required", field)
    if len(q) > MAX_QUERY_CHARS:
        raise RequestError(400, f"{field}: {len(q)} characters, at most {MAX_QUERY_CHARS}", field)
    return _text(q, field)


def _document(d, field, strings_only=False):
    """One document (a string, {text}, or {content: [{type: "text", text}]} as Dify's OpenAI-compatible
    provider and vLLM's multimodal score input send) -> its text; strings only for TEI's `texts`."""
    if isinstance(d, dict) and not strings_only:
        parts = d.get("content")
        if isinstance(parts, list) and "text" not in d:
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise RequestError(400, f"{field}.content: only text parts ({{type: text, text}}) can be reranked",
                                   f"{field}.content")
            return _text("".join(p["text"] for p in parts), f"{field}.content")
        d, field, want = d.get("text"), f"{field}.text", "a string"
    else:
        want = "a string" if strings_only else "a string or {text}"
    if not isinstance(d, str):
        raise RequestError(400, f"{field}: {want} is required", field)
    return _text(d, field)


def _documents(docs, field, max_documents, strings_only=False):
    if not isinstance(docs, list) or not docs:
        raise RequestError(400, f"{field}: a non-empty list is required", field)
    if len(docs) > max_documents:
        raise RequestError(400, f"{field}: {len(docs)} items, at most {max_documents}", field)
    return [_document(d, f"{field}[{i}]", strings_only) for i, d in enumerate(docs)]


def _instruction_text(v, field):
    if not isinstance(v, str):
        raise RequestError(400, f"{field}: a string is required, got {type(v).__name__}", field)
    if len(v) > MAX_INSTRUCTION_CHARS:
        raise RequestError(400, f"{field}: {len(v)} characters, at most {MAX_INSTRUCTION_CHARS}", field)
    return _text(v, field)


def requested_instruction(body):
    """The instruction a request asks for -> (text or None, the field it came in). `instruction`
    (LiteLLM's hosted_vllm/, llama.cpp, vLLM and TensorRT-LLM forward one to Qwen3 rerankers) or vLLM's
    `chat_template_kwargs.instruction`, which fills the same template variable; both at once must say
    the same. Empty means the server's, as vLLM's template reads it; other template kwargs are ignored,
    as the template ignores what it does not read. The text can never become prompt structure: it is
    tokenized with the query and documents as ordinary text (Reranker.tokenize)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(400, "chat_template_kwargs: an object is required", "chat_template_kwargs")
    given = (("instruction", body.get("instruction")),
             ("chat_template_kwargs.instruction", (kwargs or {}).get("instruction")))
    said = {f: _instruction_text(v, f) for f, v in given if v is not None and v != ""}
    if len(set(said.values())) > 1:
        raise RequestError(400, "instruction and chat_template_kwargs.instruction differ: send one", "instruction")
    return next(((v, f) for f, v in said.items()), (None, None))


def _margins_asked(body):
    """Whether the request asks for margins instead of sigmoid(margin): raw_scores true (TEI, Infinity;
    infinity_client sends false every time, its default) or vLLM's use_activation false (or its older
    spellings activation, softmax). Asking for both at once is a 400 naming the fields."""
    asks = {k: not _flag(body, k) for k in ("use_activation", "activation", "softmax") if body.get(k) is not None}
    if _flag(body, "raw_scores"):
        asks["raw_scores"] = True          # field -> whether it asks for margins
    if len(set(asks.values())) > 1:
        raise RequestError(400, f"{' and '.join(asks)}: one asks for margins, the other for sigmoid scores",
                           next(iter(asks)))
    return any(asks.values())


def _options(body, req):
    """The fields every route reads, set on `req` -> req: model, the instruction, the score's activation,
    and truncation (max_tokens_per_doc; vLLM's truncate_prompt_tokens and truncation_side)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "model: a string is required", "model")
    req.model = _text(model, "model") if model else None
    req.instruction, req.instruction_field = requested_instruction(body)
    req.raw = _margins_asked(body)
    req.detect = _flag(body, "return_detect")
    req.max_doc_tokens = _int_field(body, "max_tokens_per_doc", 1)
    req.max_prompt_tokens = _int_field(body, "truncate_prompt_tokens", -1)
    if req.max_prompt_tokens == 0:
        raise RequestError(400, "truncate_prompt_tokens: an integer >= 1, or -1 for the model's max length",
                           "truncate_prompt_tokens")
    side = "right" if body.get("truncation_side") is None else body["truncation_side"]
    if side not in ("left", "right"):
        raise RequestError(400, f"truncation_side: left or right, got {side!r}", "truncation_side")
    req.left = req.left or side == "left"
    return req


def parse_rerank(path, body, max_documents):
    """A decoded JSON body posted to rerank route `path` -> RerankRequest. Cohere/Jina/vLLM/Infinity shape
    ({query, documents, top_n, return_documents}) or TEI's ({query, texts, return_text, truncate,
    truncation_direction}), with _options' fields. Unknown fields are ignored; every known one is
    checked. top_n 0 means all documents, as vLLM reads it. Infinity's reply (document_string) on
    INFINITY_PATHS, or for a body with `raw_scores` (a field only Infinity's RerankInput defines; its
    own client, infinity_client, sends it every time)."""
    tei = "texts" in _object(body) and "documents" not in body
    field = "texts" if tei else "documents"
    req = RerankRequest(_query(body.get("query"), "query"), _documents(body.get(field), field, max_documents, tei),
                        tei=tei, document_string=not tei and (path in INFINITY_PATHS or "raw_scores" in body))
    if tei:
        req.with_text = _flag(body, "return_text")
        req.truncate = _flag(body, "truncate", True)
        direction = body.get("truncation_direction", "Right")
        if direction not in ("Left", "Right"):     # TEI's enum, spelled as TEI spells it
            raise RequestError(422, f"truncation_direction: Left or Right, got {direction!r}", "truncation_direction")
        req.left = direction == "Left"
    else:
        req.top_n = _int_field(body, "top_n", 0) or None
        req.with_text = _flag(body, "return_documents", not req.document_string)
    return _options(body, req)


def parse_detect(body, max_documents):
    """POST /detect's body {documents[, query]} -> the documents' texts (the detector reads pages alone)."""
    return _documents(_object(body).get("documents"), "documents", max_documents)


def parse_score(body, max_documents):
    """A request to vLLM's Score API -> the RerankRequest it is. Its two sides are spelled as one of
    SCORE_FIELDS, each a string or a list; one query for N documents (1:1, 1:N) or N queries paired with
    N documents (N:N, as vLLM's Qwen3-Reranker example sends), vLLM's three length rules. A refusal names
    the fields the client sent."""
    sent = [(q, d) for q, d in SCORE_FIELDS if q in _object(body) and d in body]
    if len(sent) != 1:
        given = [k for k in dict.fromkeys(k for pair in SCORE_FIELDS for k in pair) if k in body]
        raise RequestError(400, f"{', '.join(given) or 'the body'}: give one pair of queries and documents "
                                "(or queries and items, data_1 and data_2, text_1 and text_2)",
                           given[0] if given else None)
    qf, df = sent[0]
    listed = lambda v: [v] if isinstance(v, str) else v
    texts = _documents(listed(body[df]), df, max_documents)
    queries = listed(body[qf])
    if not isinstance(queries, list) or len(queries) not in (1, len(texts)):
        n = len(queries) if isinstance(queries, list) else type(queries).__name__
        raise RequestError(400, f"{qf}: {n} for {len(texts)} {df}; give one, or one per item of {df}", qf)
    queries = [_query(q, f"{qf}[{i}]" if isinstance(body[qf], list) else qf) for i, q in enumerate(queries)]
    return _options(body, RerankRequest(queries[0] if len(queries) == 1 else queries, texts))


def fit_documents(rr, queries, req):
    """The documents as the reranker will score them under the request's truncation settings (queries:
    one per document): cut to max_doc_tokens, or refused (TEI truncate false) or cut from the left when
    the prompt exceeds max_length. Cuts fall on token boundaries of the document encoded alone (its
    character offsets), never inside a character; whether a prompt fits is read in the prompt (Reranker.
    overflow): there a document may encode to a token more than alone, which the tail cut would drop."""
    if req.max_doc_tokens is None and req.truncate and not req.left:
        return req.texts                  # Reranker.tokenize cuts the tail, as the model card does
    rooms, out = {}, []                   # tokens left for a document, per query
    for i, (q, t) in enumerate(zip(queries, req.texts)):
        if q not in rooms:
            rooms[q] = rr.max_length - len(rr.tokenize(q, [""])[0])
        room = rooms[q]
        enc = rr.text_tokenizer.encode(t, add_special_tokens=False)
        n = len(enc.ids)
        if req.max_doc_tokens is not None and n > req.max_doc_tokens:     # before the first token not kept
            t = t[:enc.offsets[req.max_doc_tokens][0]]
            enc = rr.text_tokenizer.encode(t, add_special_tokens=False)
            n = len(enc.ids)
        over = n > room or n > room - SEAM and rr.overflow(q, [t])     # (in the prompt: a few tokens either way)
        if over and not req.truncate:
            raise RequestError(413, f"texts[{i}]: the input is {n} document tokens, at most {room} fit "
                                    f"max_length {rr.max_length} (truncate is false)", f"texts[{i}]")
        if over and req.left:             # its last tokens that fit; none when the prompt leaves no room
            k = max(0, n - room)
            while k < n and rr.overflow(q, [t[enc.offsets[k][0]:]]) and k < max(0, n - room) + SEAM:
                k += 1
            t = t[enc.offsets[k][0]:] if 0 < room and k < n else ""
        out.append(t)
    return out


def query_copies(rr, req, samples=1):
    """Refuses (413) a request whose query and instruction, copied into each of its prompts (`samples` a
    document), would take more than MAX_QUERY_COPY_TOKENS tokens: they are encoded once a prompt, so a
    long query times a thousand documents would hold gigabytes before any check on the prompts."""
    queries = req.query if isinstance(req.query, list) else [req.query] * len(req.texts)
    head = {q: len(rr.tokenize(q, [""])[0]) for q in set(queries)}
    n = samples * sum(head[q] for q in queries)
    if n > MAX_QUERY_COPY_TOKENS:
        raise RequestError(413, f"query: its tokens (with the instruction's) in each of the request's "
                                f"{samples * len(queries)} prompts make {n}, at most {MAX_QUERY_COPY_TOKENS}: send a "
                                "shorter query or fewer documents", "query")


def prompt_ids(rr, req):
    """The request's prompts as token-id lists, one per document (fit_documents, then Reranker.tokenize)."""
    queries = req.query if isinstance(req.query, list) else [req.query] * len(req.texts)
    texts = fit_documents(rr, queries, req)
    if not isinstance(req.query, list):
        return rr.tokenize(req.query, texts)
    return [rr.tokenize(q, [t])[0] for q, t in zip(queries, texts)]


def deletion_ids(rr, req, conf):
    """serve --smooth N: the prompts of N deletion samples of each document (certify.delete_words), drawn
    for this request from the OS's CSPRNG, so no client can learn which words a later request keeps
    (certify.py) -> token-id lists, document by document."""
    n, rate, rng = conf["smooth"], conf["deletion_rate"], random.SystemRandom()
    queries = req.query if isinstance(req.query, list) else [req.query] * len(req.texts)
    return [ids for q, t in zip(queries, fit_documents(rr, queries, req))
            for ids in rr.tokenize(q, [certify.delete_words(t, rate, rng) for _ in range(n)])]


# ----------------------------------------------------------------------------- replies


def error_headers(status, allow):
    """The headers of an error reply: Allow (`allow`) on 405, WWW-Authenticate on 401, Retry-After on 429
    and 503 (RFC 9110 10.2.3: when to come back)."""
    return ([("Allow", allow)] if status == 405 else [("WWW-Authenticate", "Bearer")] if status == 401 else
            [("Retry-After", "1")] if status in (429, 503) else ())


def reply(path, req, m, tokens, model):
    """The reply to `req` on `path` given its margins `m` (document order) and prompt tokens: TEI's list,
    vLLM's ScoreResponse (the pairs' order), or the rerank results best first (the first top_n), the
    document as {text} or (Infinity's ReRankResult) a string."""
    score = (lambda v: v) if req.raw else sigmoid
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    order = ranked(m)
    if req.tei:
        return [{"index": i, "score": score(m[i]), **({"text": req.texts[i]} if req.with_text else {})} for i in order]
    if path in SCORE_PATHS:
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": score(v)} for i, v in enumerate(m)],
                "usage": {**usage, "completion_tokens": 0}}
    doc = (lambda t: t) if req.document_string else (lambda t: {"text": t})
    results = [{"index": i, "relevance_score": score(m[i]),
                **({"document": doc(req.texts[i])} if req.with_text else {})} for i in order[:req.top_n]]
    out = {"id": uuid.uuid4().hex, "model": model, "results": results, "usage": usage}
    return {"object": "rerank", **out, "created": int(time.time())} if req.document_string else out


class Metrics:
    """The server's Prometheus metrics in the text exposition format 0.0.4
    (https://prometheus.io/docs/instrumenting/exposition_formats/): FAMILIES, then the gauges `render` is
    given at scrape time. Label values come from fixed sets (the routes, "other", status names), so
    they need no escaping."""
    FAMILIES = {"geodef_requests_total": ("counter", "HTTP requests answered, by route and status"),
                "geodef_errors_total": ("counter", "error replies, by kind (the HTTP status' name)"),
                "geodef_documents_total": ("counter", "documents scored"),
                "geodef_prompt_tokens_total": ("counter", "prompt tokens scored"),
                "geodef_request_duration_seconds": ("histogram", "time from the request line to the reply")}
    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)  # the Python
    # client's default buckets, and 30 s, 60 s for long requests

    def __init__(self):
        self.lock, self.values = threading.Lock(), collections.Counter()   # (sample, labels) -> value

    def add(self, sample, value=1, **labels):
        with self.lock:
            self.values[sample, tuple(labels.items())] += value

    def answered(self, route, status, seconds):
        self.add("geodef_requests_total", route=route, status=status)
        if status >= 400:
            self.add("geodef_errors_total", kind=HTTPStatus(status).name.lower())
        for le in self.BUCKETS:            # cumulative: each bucket counts the requests at most `le` long
            self.add("geodef_request_duration_seconds_bucket", seconds <= le, route=route,
                     le="+Inf" if le == math.inf else le)
        self.add("geodef_request_duration_seconds_sum", seconds, route=route)
        self.add("geodef_request_duration_seconds_count", route=route)

    def render(self, gauges):
        """-> the exposition text; gauges: [(name, type, help, value)] the caller reads at scrape time."""
        with self.lock:
            values = list(self.values.items())
        out = []
        for name, kind, what, value in [(n, k, h, None) for n, (k, h) in self.FAMILIES.items()] + gauges:
            out += [f"# HELP {name} {what}", f"# TYPE {name} {kind}"]
            samples = [x for x in values if x[0][0].startswith(name)]
            samples = samples or ([((name, ()), value)] if value is not None else [])
            for (sample, labels), v in samples:
                tags = ",".join(f'{k}="{v}"' for k, v in labels)
                out.append(f"{sample}{{{tags}}} {v}" if tags else f"{sample} {v}")
        return "\n".join(out) + "\n"


def openapi(keyed):
    """GET /openapi.json: the routes and the fields this file reads as an OpenAPI 3.1 document (checked with
    openapi-spec-validator in test_serve.py); keyed: the routes behind the API key say so."""
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}
    text, number, flag = {"type": "string"}, {"type": "number"}, {"type": "boolean"}
    count = lambda lo: {"type": "integer", "minimum": lo}
    obj = lambda **props: {"type": "object", "properties": props}
    listed = lambda item: {"type": "array", "items": item}
    document = {"oneOf": [text, obj(text=text)]}
    options = dict(model=text, instruction=text, chat_template_kwargs=obj(instruction=text), raw_scores=flag,
                   return_detect=flag, use_activation=flag, activation=flag, softmax=flag,
                   max_tokens_per_doc=count(1), truncate_prompt_tokens={"oneOf": [count(1), {"const": -1}]},
                   truncation_side={"enum": ["left", "right"]})
    schemas = {
        "RerankRequest": {**obj(**options, query=text, documents=listed(document), texts=listed(text), top_n=count(0),
                                return_documents=flag, return_text=flag, truncate=flag,
                                truncation_direction={"enum": ["Left", "Right"]}), "required": ["query"]},
        "RerankResponse": {"oneOf": [
            obj(id=text, model=text, usage=ref("Usage"),
                results=listed(obj(index=count(0), relevance_score=number, document=document))),
            listed(obj(index=count(0), score=number, text=text))]},          # TEI's
        "ScoreRequest": obj(**options, **{k: {"oneOf": [text, listed(text)]} for pair in SCORE_FIELDS for k in pair}),
        "ScoreResponse": obj(id=text, object=text, created=count(0), model=text, usage=ref("Usage"),
                             data=listed(obj(index=count(0), object=text, score=number))),
        "DetectRequest": {**obj(documents=listed(document), query=text), "required": ["documents"]},
        "DetectResponse": obj(object=text, detector=text, threshold=number,
                              results=listed(obj(index=count(0), score=number, flagged=flag))),
        "Usage": obj(prompt_tokens=count(0), total_tokens=count(0), completion_tokens=count(0)),
        "Error": obj(detail=text, error=obj(message=text, type=text, code=count(400),
                                            param={"type": ["string", "null"]}))}

    body = lambda schema, media="application/json": {"content": {media: {"schema": schema}}}
    errors = {str(s): {"description": HTTPStatus(s).phrase, **body(ref("Error"))} for s in (400, 401, 413, 429)}

    def operation(method, summary, request=None, response=None, keyed=keyed, media="application/json"):
        ok = {"description": "OK", **body(ref(response) if response else text, media)}
        return {method: {"summary": summary, "responses": {"200": ok, **errors},
                         **({"requestBody": {"required": True, **body(ref(request))}} if request else {}),
                         **({"security": [{"bearer": []}]} if keyed else {})}}
    paths = {**{p: operation("post", "rerank documents", "RerankRequest", "RerankResponse") for p in RERANK_PATHS},
             **{p: operation("post", "score pairs", "ScoreRequest", "ScoreResponse") for p in SCORE_PATHS},
             DETECT_PATH: operation("post", "flag GEO rewrites (the run's text detector)", "DetectRequest",
                                    "DetectResponse"),
             "/health": operation("get", "liveness", keyed=False), "/info": operation("get", "TEI's", keyed=False),
             "/openapi.json": operation("get", "this document", keyed=False), "/v1/models": operation("get", "models"),
             "/metrics": operation("get", "Prometheus metrics", media="text/plain"),
             "/v1/models/{model}": operation("get", "the served model")}
    paths["/v1/models/{model}"]["get"]["parameters"] = [{"name": "model", "in": "path", "required": True,
                                                         "schema": text}]
    return {"openapi": "3.1.0", "info": {"title": "GEO Defender rerank server", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
