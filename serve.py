"""A rerank HTTP server over one loaded Reranker, the Shield or the base model (`RerankServer`).

`POST /v1/rerank` (aliases `/rerank`, `/v2/rerank`, `/infinity/rerank`) takes the Cohere/Jina/vLLM
request {model, query, documents: [str | {text}], top_n?, return_documents?} and answers {id, model,
results: [{index, relevance_score, document?}] best first, usage}, the document as {text}; an
Infinity-shaped request (`infinity_shaped`) gets the document as a string; a body with `texts` on
/rerank gets Text Embeddings Inference's shape [{index, score, text?}]. `POST /score` (and `/v1/score`)
is vLLM's Score API: {model?, text_1: the query, text_2: the documents} -> {data: [{index, object,
score}]} in the documents' order. relevance_score and score = sigmoid(margin). An `instruction` takes
the prompt's <Instruct>: place for that request on the base model; the Shield, or weights the server
cannot tell from it (`scoring_identity`), refuses one other than its own (400) unless started with
allow_instruction. `GET /health`, `GET /v1/models`. Requests arriving together are scored in shared
micro-batches by one scoring thread (a bounded queue; a full queue answers 503).
Every request is untrusted: sizes are capped, every field is validated (4xx naming it), documents
are tokenized as text (reranker.text_tokenizer), slow clients time out, and an optional API key is
compared in constant time and never printed.

Usage: RerankServer(rr, port=8000).serve_forever()
"""
import contextlib
import copy
import hmac
import json
import math
import queue
import re
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import export
import lora

INFINITY_PATH = "/infinity/rerank"   # LiteLLM's infinity/ provider with api_base http://HOST:PORT/infinity
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank", INFINITY_PATH)
SCORE_PATHS = ("/score", "/v1/score")    # vLLM's Score API
POST_PATHS = RERANK_PATHS + SCORE_PATHS
GET_PATHS = ("/health", "/v1/models", "/info")
MAX_INSTRUCTION_CHARS = 4096


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, the field at fault."""

    def __init__(self, status, message, param=None):
        super().__init__(message)
        self.status, self.param = status, param


def sigmoid(m):
    return 1.0 / (1.0 + math.exp(-m)) if m >= 0 else math.exp(m) / (1.0 + math.exp(m))


@dataclass
class RerankRequest:
    """A validated rerank request (parse_rerank)."""
    query: str
    texts: list
    tei: bool = False             # TEI's request and response shape
    top_n: int = None             # None: every document
    with_text: bool = False       # return_documents / return_text
    raw: bool = False             # TEI's and Infinity's raw_scores: margins instead of sigmoid(margin)
    truncate: bool = True         # TEI truncate false: a too-long input is an error (413, as TEI)
    left: bool = False            # TEI truncation_direction Left: a too-long document loses its start
    max_doc_tokens: int = None    # Cohere max_tokens_per_doc: each document cut to that many tokens
    model: str = None             # echoed in the reply
    document_string: bool = False  # Infinity's reply: results[].document a string, not {text}
    instruction: str = None       # the prompt's <Instruct>: for this request; None: the server's


def _text(v, field):
    """A request string that can be encoded: a lone surrogate ("\\ud800" is valid JSON) is a 400 here,
    not a failure inside the tokenizer."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{field}: not valid Unicode text (character {e.start}: lone surrogate)",
                           field) from None
    return v


def _flag(body, k):
    """A boolean field; "true"/"false" as strings too (RAGFlow's Xinference provider sends them)."""
    v = body.get(k, False)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if not isinstance(v, bool):
        raise RequestError(400, f"{k}: true or false is required", k)
    return v


def _document(d, i, tei):
    """One entry of `documents` (a string, {text}, or {content: [{type: "text", text}]} as Dify's
    OpenAI-compatible provider sends with vision on) or of TEI's `texts` (a string) -> its text."""
    field = f"{'texts' if tei else 'documents'}[{i}]"
    if isinstance(d, dict) and not tei:
        if isinstance(d.get("content"), list) and "text" not in d:
            parts = d["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise RequestError(400, f"{field}.content: only text parts ({{type: text, text}}) can be reranked",
                                   f"{field}.content")
            return _text("".join(p["text"] for p in parts), f"{field}.content")
        d = d.get("text")
        if not isinstance(d, str):
            raise RequestError(400, f"{field}.text: a string is required", f"{field}.text")
        return _text(d, f"{field}.text")
    if not isinstance(d, str):
        raise RequestError(400, f"{field}: a string{'' if tei else ' or {text}'} is required", field)
    return _text(d, field)


def _int_field(body, k, minimum):
    v = body.get(k)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
        raise RequestError(400, f"{k}: an integer >= {minimum} is required, got {v!r}", k)
    return v


def _instruction(body):
    """The optional `instruction` (LiteLLM, llama.cpp and vLLM forward one to Qwen3 rerankers) -> a
    string or None. Empty means the server's, as vLLM's template reads it. Its text can never become
    prompt structure: it is tokenized with the query and documents as ordinary text (Reranker.tokenize)."""
    v = body.get("instruction")
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise RequestError(400, f"instruction: a string is required, got {type(v).__name__}", "instruction")
    if len(v) > MAX_INSTRUCTION_CHARS:
        raise RequestError(400, f"instruction: {len(v)} characters, at most {MAX_INSTRUCTION_CHARS}", "instruction")
    return _text(v, "instruction")


def parse_rerank(body, max_documents):
    """A decoded JSON body -> RerankRequest. Cohere/Jina/vLLM/Infinity shape ({query, documents, top_n,
    return_documents, max_tokens_per_doc, raw_scores}) or TEI's ({query, texts, return_text, raw_scores,
    truncate, truncation_direction}), either with an optional `instruction`. Unknown fields are
    ignored; every known one is checked. top_n 0 means all documents, as vLLM reads it."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    tei = "texts" in body and "documents" not in body
    q = body.get("query")
    if not isinstance(q, str) or not q.strip():
        raise RequestError(400, "query: a non-empty string is required", "query")
    _text(q, "query")
    field = "texts" if tei else "documents"
    docs = body.get(field)
    if not isinstance(docs, list) or not docs:
        raise RequestError(400, f"{field}: a non-empty list is required", field)
    if len(docs) > max_documents:
        raise RequestError(400, f"{field}: {len(docs)} items, at most {max_documents}", field)
    texts = [_document(d, i, tei) for i, d in enumerate(docs)]
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "model: a string is required", "model")
    req = RerankRequest(q, texts, tei=tei, model=_text(model, "model") if model else None,
                        instruction=_instruction(body))
    req.raw = _flag(body, "raw_scores")
    if tei:
        req.with_text = _flag(body, "return_text")
        if "truncate" in body:
            req.truncate = _flag(body, "truncate")
        direction = body.get("truncation_direction", "Right")
        if direction not in ("Left", "Right"):     # TEI's enum, spelled as TEI spells it
            raise RequestError(422, f"truncation_direction: Left or Right, got {direction!r}", "truncation_direction")
        req.left = direction == "Left"
    else:
        req.top_n = _int_field(body, "top_n", 0) or None
        req.with_text = _flag(body, "return_documents")
        req.max_doc_tokens = _int_field(body, "max_tokens_per_doc", 1)
    return req


def infinity_shaped(path, body):
    """Whether a `documents` request gets Infinity's reply (results[].document a string) instead of the
    Cohere/Jina/vLLM one ({text}). vLLM and Infinity both own POST /rerank, and LiteLLM's hosted_vllm/
    and infinity/ providers post the same body there ({model, query, documents, top_n?,
    return_documents: true}: litellm/llms/{hosted_vllm,infinity}/rerank/transformation.py), so on that
    route the body cannot tell them apart. The rule: Infinity's shape for a body with `raw_scores` (a
    field only Infinity's RerankInput defines; its own client, infinity_client, sends it every time)
    or one posted to /infinity/rerank; vLLM's (= Cohere's) everywhere else."""
    return path == INFINITY_PATH or "raw_scores" in body


def parse_score(body, max_documents):
    """A request to vLLM's Score API ({model?, text_1, text_2}) -> the RerankRequest it is: text_1 the
    query (one string; scoring two lists pairwise is not a reranker's request), text_2 the documents (a
    list, or one string). A refusal names text_1 or text_2."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("text_1"), str):
        raise RequestError(400, "text_1: one query string is required", "text_1")
    docs = body.get("text_2")
    as_rerank = {"model": body.get("model"), "query": body["text_1"],
                 "documents": [docs] if isinstance(docs, str) else docs}
    try:
        return parse_rerank({k: v for k, v in as_rerank.items() if v is not None}, max_documents)
    except RequestError as e:        # the rerank fields' names as this API spells them
        spelled = lambda text: re.sub(r"^query", "text_1", re.sub(r"^documents", "text_2", text))
        raise RequestError(e.status, spelled(str(e)), e.param and spelled(e.param)) from None


def fit_documents(rr, req):
    """The documents as the reranker will score them under the request's truncation settings: cut
    to max_doc_tokens, or (TEI) refused or cut from the left when the prompt exceeds max_length.
    Cuts fall on token boundaries of the document encoded alone (its character offsets)."""
    if req.max_doc_tokens is None and req.truncate and not req.left:
        return req.texts                  # Reranker.tokenize cuts the tail, as the model card does
    room = rr.max_length - len(rr.tokenize(req.query, [""])[0])      # tokens left for a document
    out = []
    for i, t in enumerate(req.texts):
        enc = rr.text_tokenizer.encode(t, add_special_tokens=False)
        n = len(enc.ids)
        if req.max_doc_tokens is not None and n > req.max_doc_tokens:
            t, n = t[:enc.offsets[req.max_doc_tokens - 1][1]], req.max_doc_tokens
        if n > room:
            if not req.truncate:
                raise RequestError(413, f"texts[{i}]: the input is {n} document tokens, at most {room} fit "
                                        f"max_length {rr.max_length} (truncate is false)", f"texts[{i}]")
            if req.left:
                t = t[enc.offsets[n - room][0]:]
        out.append(t)
    return out


# ----------------------------------------------------------------------------- bodies and replies


def body_length(headers):
    """A request's Content-Length -> int: one value of digits only (RFC 9110 8.6's 1*DIGIT, not int()'s
    "+49", "4_9" or " 49 "); RequestError 411 without one or with a Transfer-Encoding, 400 otherwise."""
    if headers.get("Transfer-Encoding"):
        raise RequestError(411, "send the body with a Content-Length (no Transfer-Encoding)")
    lengths = set(headers.get_all("Content-Length") or [])
    if len(lengths) > 1:            # which one frames the body is ambiguous (request smuggling)
        raise RequestError(400, "Content-Length: given more than once with different values")
    n = headers.get("Content-Length")
    if n is None:
        raise RequestError(411, "Content-Length is required")
    n = n.strip()
    if not n.isascii() or not n.isdigit():
        raise RequestError(400, "Content-Length: a non-negative integer is required")
    return int(n)


def read_body(rfile, n, timeout):
    """`n` body bytes from `rfile`, all within `timeout` seconds -> bytes; RequestError 408 when they
    stall or come late, 400 when the body ends early."""
    deadline, parts, got = time.monotonic() + timeout, [], 0
    while got < n:
        if time.monotonic() > deadline:
            raise RequestError(408, f"the body did not arrive within {timeout:.0f} s")
        try:
            chunk = rfile.read1(min(65536, n - got))   # one recv: blocks at most the socket timeout
        except TimeoutError:
            raise RequestError(408, f"the body stalled after {got} of {n} bytes") from None
        if not chunk:
            raise RequestError(400, f"the body ended after {got} of {n} bytes (Content-Length)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def drain_body(rfile, n, timeout):
    """Read and drop up to `n` body bytes within `timeout` seconds, so that a client still writing its
    oversized body reads the 413 instead of a broken pipe."""
    left, deadline = n, time.monotonic() + timeout
    with contextlib.suppress(OSError):
        while left > 0 and time.monotonic() < deadline:
            chunk = rfile.read1(min(65536, left))
            if not chunk:
                break
            left -= len(chunk)


def json_body(raw):
    """Body bytes -> the decoded JSON value; RequestError 400 when they are not UTF-8 or not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestError(400, "the body nests too deeply") from None
    except ValueError as e:
        raise RequestError(400, f"the body is not JSON ({e})") from None


def error_headers(status, allow):
    """The headers of an error reply: Allow (`allow`) on 405, WWW-Authenticate on 401, Retry-After on 503."""
    return ([("Allow", allow)] if status == 405 else [("WWW-Authenticate", "Bearer")] if status == 401 else
            [("Retry-After", "1")] if status == 503 else ())


def _ranked(m):
    """Document indices by margin, best first, ties by index."""
    return sorted(range(len(m)), key=lambda i: (-m[i], i))


def tei_results(req, m):
    """TEI's reply: [{index, score, text?}] best first; score sigmoid(margin), or the margin (raw_scores)."""
    return [{"index": i, "score": m[i] if req.raw else sigmoid(m[i]),
             **({"text": req.texts[i]} if req.with_text else {})} for i in _ranked(m)]


def rerank_results(req, m):
    """Cohere's and vLLM's `results`: [{index, relevance_score, document?}] best first, the first top_n;
    the document as {text}, or as a string for an Infinity-shaped request (req.document_string).
    relevance_score sigmoid(margin), or the margin (Infinity's raw_scores)."""
    order = _ranked(m)
    order = order[:req.top_n] if req.top_n is not None else order
    doc = (lambda t: t) if req.document_string else (lambda t: {"text": t})
    return [{"index": i, "relevance_score": m[i] if req.raw else sigmoid(m[i]),
             **({"document": doc(req.texts[i])} if req.with_text else {})} for i in order]


# ----------------------------------------------------------------------------- the server


class Batcher:
    """One scoring thread over a bounded queue of jobs (one job = one request's token-id lists). Jobs
    waiting together are scored in one `score_ids` call, which packs their documents into shared
    micro-batches, as long as they fit one micro-batch's token budget together: small requests
    share the GEMMs, while a request that fills a micro-batch on its own is scored alone, so that its
    documents keep sharing their query's prompt prefix (speed.py's `share_prefix`) and it is answered
    as soon as it is done. A score does not depend on its batch mates beyond float rounding."""

    def __init__(self, rr, max_queue=64, max_batch_tokens=None):
        self.rr = rr
        self.max_batch_tokens = max_batch_tokens or rr.token_budget
        self.jobs = queue.Queue(maxsize=max_queue)
        self.held = None           # a job taken from the queue that did not fit the last call
        self.batches = 0
        threading.Thread(target=self._loop, daemon=True, name="rerank-batcher").start()

    def submit(self, ids, timeout):
        """Token-id lists -> float margins, in order. Raises RequestError 503 when the queue is full
        or the scores are not ready within `timeout` seconds."""
        job = {"ids": ids, "done": threading.Event(), "scores": None, "error": None}
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(503, "the server is busy (request queue full); retry later") from None
        if not job["done"].wait(timeout):
            job["cancelled"] = True           # not scored later for nobody
            raise RequestError(503, f"not scored within {timeout:.0f} s; retry later")
        if job["error"] is not None:
            raise job["error"]
        return job["scores"]

    def _loop(self):
        size = lambda job: sum(map(len, job["ids"]))
        while True:
            batch = [self.held or self.jobs.get()]
            self.held, n = None, size(batch[0])
            while n < self.max_batch_tokens:   # what else is waiting joins this call while it fits
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if n + size(job) > self.max_batch_tokens:
                    self.held = job           # first in the next call
                    break
                batch.append(job)
                n += size(job)
            batch = [job for job in batch if not job.get("cancelled")]
            if not batch:
                continue
            try:
                flat = [x for job in batch for x in job["ids"]]
                margins = self.rr.score_ids(flat).tolist()
                self.batches += 1
                at = 0
                for job in batch:
                    job["scores"], at = margins[at:at + len(job["ids"])], at + len(job["ids"])
            except Exception as e:   # reported to each waiting request as a 500, the thread lives on
                traceback.print_exc(file=sys.stderr)
                for job in batch:
                    job["error"] = RequestError(500, f"scoring failed ({type(e).__name__})")
            for job in batch:
                job["done"].set()


def scoring_identity(rr):
    """What `rr` scores as -> ("shield" | "base" | "unknown", why, for the operator's log). The Shield: a
    LoRA adapter attached, or weights `export` merged one into, told by the identity export writes into
    config.json and the weights' safetensors header (export.identity_marks), read in the folder the
    weights were resolved to (for a hub id, its snapshot folder; never the id string). The base: that
    folder is known, its files read, and none says Shield. Unknown otherwise: the server then refuses
    a client's instruction as it does for the Shield, since it cannot tell."""
    if lora.lora_modules(rr.model):
        return "shield", "the Shield: a LoRA adapter is attached"
    folder = getattr(rr, "folder", None)
    if not folder:
        return "unknown", "weights from an unknown folder, taken for the Shield's"
    try:
        marks = export.identity_marks(folder)
    except export.IdentityError as e:
        return "unknown", f"weights whose identity cannot be read, taken for the Shield's ({e})"
    said = [f for f, m in marks if m["shield"]]
    if said:
        return "shield", f"the Shield: an export with an adapter merged in ({', '.join(said)} in {folder})"
    return "base", f"the base reranker: no Shield identity in {folder} (config.json, weights, geodef_export.json)"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive: a client's connection serves many requests
    server_version = "geo-defender-rerank"
    sys_version = ""

    def setup(self):
        self.timeout = self.server.conf["read_timeout"]   # socket timeout: an idle or slow client is dropped
        super().setup()
        # small replies leave at once: with Nagle on, a kept-alive connection waits for the client's
        # delayed ACK on every reply
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- replies
    def _send(self, status, obj, headers=()):
        try:
            self._write(status, obj, headers)
        except OSError:                     # the client is gone: nothing to answer
            self.close_connection = True

    def _write(self, status, obj, headers):
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self._headers_buffer.append(b"\r\n" + data)   # head and body in one write
        self.flush_headers()

    def _fail(self, e, headers=()):
        # OpenAI-style `error` and FastAPI-style `detail` (LlamaIndex's JinaRerank and xinference-client read it)
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status},
                              "detail": str(e)}, headers)

    def log_request(self, code="-", size="-"):   # the path without its query string (it may hold a key)
        path = urlsplit(getattr(self, "path", "") or "").path      # none on a malformed request line
        self.log_message('"%s %s" %s', self.command, path, getattr(code, "value", code))

    def log_message(self, fmt, *args):   # one line per request; never headers (the key), bodies or queries
        if self.server.conf["log"]:
            line = re.sub(r"\?[^\s'\"]*", "?...", fmt % args)
            sys.stderr.write(f"[serve] {self.address_string()} {line}\n")

    def parse_request(self):
        ok = super().parse_request()
        if ok and self.request_version == "HTTP/0.9":   # no headers and no status line to answer with
            self.close_connection = True
            self.log_message('"%s" refused: an HTTP/0.9 request line', self.command)
            return False
        return ok

    # -- request parts
    def _authorised(self):
        key = self.server.conf["api_key"]
        if not key:
            return True
        got = self.headers.get("Authorization", "")
        token = got[7:] if got[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))

    def _body(self):
        """The request's JSON body. A refusal before the whole body is read closes the connection: the
        unread rest must not be parsed as the next request."""
        conf = self.server.conf
        try:
            n = body_length(self.headers)
            if n > conf["max_body_bytes"]:
                drain_body(self.rfile, min(n, 4 * conf["max_body_bytes"]), conf["body_timeout"])   # 4x the cap at most
                raise RequestError(413, f"body of {n} bytes, at most {conf['max_body_bytes']}")
            raw = read_body(self.rfile, n, conf["body_timeout"])
        except RequestError:
            self.close_connection = True
            raise
        return json_body(raw)

    # -- methods
    def do_GET(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            if path == "/health":
                return self._send(200, {"status": "ok"})
            if path == "/info":                     # Text Embeddings Inference's shape (tei-client)
                return self._send(200, self.server.info())
            if path in POST_PATHS:
                raise RequestError(405, f"{path} takes POST")
            if path != "/v1/models":
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            name = self.server.conf["model_name"]
            self._send(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "geo-defender"}]})
        except RequestError as e:
            self._fail(e, error_headers(e.status, "POST"))

    def do_POST(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        t0 = time.perf_counter()
        try:
            if path in GET_PATHS:
                self.close_connection = True
                raise RequestError(405, f"{path} takes GET")
            if path not in POST_PATHS:
                self.close_connection = True
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                self.close_connection = True
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            self._rerank(self._body(), t0)
        except RequestError as e:
            self._fail(e, error_headers(e.status, "GET"))
        except Exception as e:   # a defect, not the client's fault: logged here, a short 500 there
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            self._fail(RequestError(500, f"internal error ({type(e).__name__})"))

    def _method_not_allowed(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        self.close_connection = True
        if path in POST_PATHS or path in GET_PATHS:
            self._fail(RequestError(405, f"{path} takes {'POST' if path in POST_PATHS else 'GET'}"),
                       [("Allow", "POST" if path in POST_PATHS else "GET")])
        else:
            self._fail(RequestError(404, f"no route {path}"))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def _rerank(self, body, t0):
        conf = self.server.conf
        path = urlsplit(self.path).path.rstrip("/")
        req = (parse_score if path in SCORE_PATHS else parse_rerank)(body, conf["max_documents"])
        rr = self.server.prompter(req.instruction)
        req.document_string = not req.tei and infinity_shaped(path, body)
        try:
            texts = fit_documents(rr, req)
            ids = rr.tokenize(req.query, texts)
        except ValueError as e:   # a prompt without room for the document, or text BPE turns into a control token
            raise RequestError(400, f"query/instruction/documents: {e}") from None
        m = self.server.batcher.submit(ids, conf["score_timeout"])
        if req.tei:
            return self._send(200, tei_results(req, m))
        if path in SCORE_PATHS:
            n = sum(map(len, ids))
            data = [{"index": i, "object": "score", "score": sigmoid(v)} for i, v in enumerate(m)]
            return self._send(200, {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                    "model": req.model or conf["model_name"], "data": data,
                                    "usage": {"prompt_tokens": n, "total_tokens": n}})
        self._send(200, {"id": uuid.uuid4().hex, "model": req.model or conf["model_name"],
                         "results": rerank_results(req, m), "usage": {"total_tokens": sum(map(len, ids))},
                         "meta": {"elapsed_ms": round(1000 * (time.perf_counter() - t0), 1)}})


class RerankServer(ThreadingHTTPServer):
    """The rerank endpoint over one loaded `Reranker` (adapter attached or not). Port 0 picks a free
    one (`server_address[1]`)."""
    daemon_threads = True
    request_queue_size = 1024    # listen backlog: a burst of new connections waits to be accepted (then
                                 # a full request queue answers 503), instead of TCP resets at 5

    def __init__(self, rr, host="127.0.0.1", port=8000, api_key=None, model_name="geo-defender-shield",
                 max_documents=1000, max_body_bytes=8 << 20, read_timeout=30.0, body_timeout=60.0,
                 score_timeout=600.0, max_queue=64, log=True, allow_instruction=False):
        super().__init__((host, port), _Handler)
        self.rr = rr
        self.identity, self.scoring = scoring_identity(rr)    # "shield" | "base" | "unknown", and why
        self.batcher = Batcher(rr, max_queue=max_queue)
        self.conf = {"api_key": api_key or None, "model_name": model_name, "max_documents": max_documents,
                     "max_body_bytes": max_body_bytes, "read_timeout": read_timeout, "body_timeout": body_timeout,
                     "score_timeout": score_timeout, "log": log, "allow_instruction": allow_instruction}
        if log:
            taken = "accepted" if self.identity == "base" or allow_instruction else "refused"
            sys.stderr.write(f"[serve] scoring with {self.scoring}; a client's instruction is {taken}\n")

    def prompter(self, instruction):
        """The Reranker that builds this request's prompts: the server's own, or (for another
        `instruction`) a shallow copy with that instruction. The copy shares the model and tokenizers
        and only tokenizes; the scoring thread takes token ids, so requests with different
        instructions share batches and never see each other's. The Shield refuses another
        instruction unless `allow_instruction`: its adapter was trained under its own, and a
        caller's could change what it scores, down to switching the defense off. So do weights the
        server cannot tell from the Shield's (scoring_identity); the reply names no file."""
        if instruction is None or instruction == self.rr.instruction:
            return self.rr
        if self.identity != "base" and not self.conf["allow_instruction"]:
            what = "with the Shield" if self.identity == "shield" else "with weights it cannot tell from the Shield's"
            raise RequestError(400, f"instruction: refused; this server scores {what}, whose adapter was trained "
                                    "under its own instruction, and another one could switch the defense off (omit "
                                    "it, or start the server with --allow-instruction)", "instruction")
        view = copy.copy(self.rr)
        view.instruction = instruction
        return view

    def info(self):
        """GET /info in Text Embeddings Inference's shape (its router's `Info`)."""
        rr = self.rr
        return {"model_id": self.conf["model_name"], "model_sha": rr.revision,
                "model_dtype": str(rr.model.embed_tokens.weight.dtype).removeprefix("torch."),
                "model_type": {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}},
                "max_concurrent_requests": self.batcher.jobs.maxsize, "max_input_length": rr.max_length,
                "max_batch_tokens": self.batcher.max_batch_tokens, "max_batch_requests": None,
                "max_client_batch_size": self.conf["max_documents"], "auto_truncate": True,
                "tokenization_workers": 1, "version": "geo-defender", "sha": None, "docker_label": None}

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
