"""A rerank HTTP server over one loaded Reranker, the Shield or the base model (`RerankServer`).

Each route answers the shape its clients parse (their parsers run on the replies in test_serve.py):
- `POST /v1/rerank`, `/v2/rerank`: Cohere/Jina/vLLM {model, query, documents: [str | {text}], top_n?,
  return_documents?} -> {id, model, results: [{index, relevance_score, document?: {text}}] best first,
  usage: {prompt_tokens, total_tokens}}; documents come back unless return_documents is false, as vLLM
  (always) and Jina (by default) answer; Cohere's SDKs accept them.
- `POST /rerank` (and `/infinity/rerank`): Infinity's reply, the document a string, returned only when
  asked. vLLM serves this route too, and LiteLLM's hosted_vllm/ and infinity/ providers post the same
  bytes to it, but no `document` passes both parsers (infinity/ wants a string, hosted_vllm/ calls
  .get on it): the host URL serves infinity/, as LiteLLM's Infinity page configures it, and
  hosted_vllm/ takes api_base http://HOST:PORT/v1. A body with `texts` gets TEI's [{index, score, text?}].
- `POST /score` (`/v1/score`): vLLM's Score API, its two sides spelled as SCORE_FIELDS, one query for N
  documents or N queries paired with N documents -> {id, object, created, model, data: [{index,
  object, score}] in the pairs' order, usage}.
- `GET /health`, `/info` (TEI's), `/v1/models`, `/v1/models/{id}`, `/metrics` (Prometheus), `/openapi.json`.
A score is sigmoid(margin), or the margin for raw_scores true (TEI, Infinity) or use_activation false
(vLLM). A client's instruction (`instruction` or `chat_template_kwargs.instruction`, any route) takes
the prompt's <Instruct>: place on the base model; the Shield, or weights the server cannot tell from
it (`scoring_identity`), refuses one other than its own (400) unless started with allow_instruction:
one policy, `RerankServer.prompter`, every route goes through. One scoring thread scores requests in
shared micro-batches; past max_concurrent_requests in progress, or max_queue requests or max_queue_tokens
tokens waiting, a request gets 429 with Retry-After; a request whose client hangs up is not scored.
Every request is untrusted: sizes are capped, every field a route reads is validated (4xx naming it as
the client spelled it), documents are tokenized as text (reranker.text_tokenizer), slow clients time
out, an optional API key is compared in constant time and never printed, and a web page's request (an
Origin header, or a loopback server asked under a name that is not loopback) is refused.
The routes' request fields, prompts and replies: serve_api.py; here, the server that answers them.
Deviation from vLLM: truncate_prompt_tokens caps each prompt by cutting the document's tail (its start
with truncation_side left), so the scoring suffix stays; vLLM cuts the end of the whole prompt.

Usage: RerankServer(rr, port=8000).serve_forever()
"""
import contextlib
import copy
import hmac
import json
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import certify
import export
import lora
import speed
from endpoints import (CONTROL_CHARS, RequestError, content_length, drain_body, json_body, loopback_host, read_body,
                       request_path, shut)
from serve_api import (DETECT_PATH, GET_PATHS, MODEL_PATH, POST_PATHS, SCORE_PATHS, Metrics, deletion_ids,
                       error_headers, openapi, parse_detect, parse_rerank, parse_score, prompt_ids, query_copies,
                       reply)
from settings import SettingsError
from store import log as say   # one line on stderr, every URL in it redacted



# ----------------------------------------------------------------------------- the server


WAIT_SLICE = 1.0      # seconds between a waiting request's looks at whether its client is still there


class Batcher:
    """One scoring thread over a bounded queue of jobs (one job = one request's token-id lists). Jobs
    waiting together are scored in one `score_ids` call, which packs their documents into shared
    micro-batches, as long as they fit one micro-batch's token budget together: small requests
    share the GEMMs, while a request that fills a micro-batch on its own is scored alone, so that its
    documents keep sharing their query's prompt prefix (speed.py's `share_prefix`) and it is answered
    as soon as it is done. A score does not depend on its batch mates beyond float rounding. The queue is
    bounded in requests (max_queue) and in the tokens they hold (max_queue_tokens): a waiting request keeps
    its prompts in memory, and one body of a few MiB can hold millions of tokens. The call being scored holds
    its own besides: at most one call's worth."""

    def __init__(self, rr, max_queue=64, max_queue_tokens=1 << 22):
        self.rr, self.max_batch_tokens = rr, rr.token_budget
        self.jobs = queue.Queue(maxsize=max_queue)
        self.max_queue_tokens, self.waiting, self.lock = max_queue_tokens, 0, threading.Lock()   # tokens queued
        self.held = None           # a job taken from the queue that did not fit the last call
        self.batches = 0
        threading.Thread(target=self._loop, daemon=True, name="rerank-batcher").start()

    def submit(self, ids, timeout, gone=lambda: False):
        """Token-id lists -> float margins, in order. Raises RequestError 429 when the queue is full, in
        requests or in tokens (as TEI answers when overloaded; into an empty queue a request is always taken),
        503 when the scores are not ready within `timeout` seconds. gone(): whether the client has hung up,
        asked every WAIT_SLICE s: its job is then not scored for nobody (a client's retries would each add one)."""
        n = sum(map(len, ids))
        job = {"ids": ids, "tokens": n, "done": threading.Event(), "scores": None, "error": None}
        with self.lock:
            if self.waiting and self.waiting + n > self.max_queue_tokens:
                raise RequestError(429, f"the server is busy ({self.waiting} tokens wait for scoring, "
                                        f"max_queue_tokens {self.max_queue_tokens}); retry later")
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                raise RequestError(429, f"the server is busy ({self.jobs.maxsize} requests wait for scoring, "
                                        "max_queue); retry later") from None
            self.waiting += n
        end = time.monotonic() + timeout
        while not job["done"].wait(max(0.0, min(WAIT_SLICE, end - time.monotonic()))):
            if time.monotonic() >= end or gone():
                job["cancelled"] = True           # not scored later for nobody
                raise RequestError(503, f"not scored within {timeout:.0f} s; retry later")
        if job["error"] is not None:
            raise job["error"]
        return job["scores"]

    def _loop(self):
        while True:
            batch = [self.held or self.jobs.get()]
            self.held, n = None, batch[0]["tokens"]
            while n < self.max_batch_tokens:   # what else is waiting joins this call while it fits
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if n + job["tokens"] > self.max_batch_tokens:
                    self.held = job           # first in the next call
                    break
                batch.append(job)
                n += job["tokens"]
            with self.lock:                   # in this call now (the held job still waits)
                self.waiting -= n
            live = [job for job in batch if not job.get("cancelled")]
            if live:
                self._score(live)
            for job in live:
                job["done"].set()

    def _score(self, batch):
        """The jobs' documents scored in one call, each job's margins given to it. Non-finite margins
        (reranker.score_ids' FloatingPointError) in a shared call are scored again a job at a time: one
        request's text may not fail the requests it shared the call with."""
        try:
            flat = [x for job in batch for x in job["ids"]]
            margins = self.rr.score_ids(flat).tolist()
            self.batches += 1
            at = 0
            for job in batch:
                job["scores"], at = margins[at:at + len(job["ids"])], at + len(job["ids"])
        except FloatingPointError:
            if len(batch) > 1:
                for job in batch:
                    self._score([job])
            else:
                batch[0]["error"] = RequestError(500, "scoring failed (non-finite margins for this request)")
        except Exception as e:   # reported to each waiting request as a 500, the thread lives on
            traceback.print_exc(file=sys.stderr)
            for job in batch:
                job["error"] = RequestError(500, f"scoring failed ({type(e).__name__})")


def scoring_identity(rr):
    """What `rr` scores as -> ("shield" | "base" | "unknown", why, for the operator's log). The Shield: a
    LoRA adapter attached or merged for int8 (the model's adapter_merged, lora.quantize_int8), or weights
    `export` merged one into, told by the identity export writes into
    config.json and the weights' safetensors header (export.identity_marks), read in the folder the
    weights were resolved to (for a hub id, its snapshot folder; never the id string). The base: that
    folder is known, its files read, and none says Shield. Unknown otherwise: the server then refuses
    a client's instruction as it does for the Shield, since it cannot tell."""
    if lora.lora_modules(rr.model) or getattr(rr.model, "adapter_merged", False):
        return "shield", "the Shield: a LoRA adapter is attached (or merged, for int8)"
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
        """`obj` as JSON, or a str as Prometheus text, head and body in one write. A lone surrogate (a JSON
        escape a client sent, echoed in an error), which UTF-8 cannot encode, leaves as its JSON escape (\\ud800),
        read back as it came: every reply is sent, whatever text a client put in it."""
        text = isinstance(obj, str)
        data = (obj if text else json.dumps(obj, ensure_ascii=False)).encode("utf-8", "backslashreplace")
        kind = "text/plain; version=0.0.4; charset=utf-8" if text else "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self._headers_buffer.append(b"\r\n" + data)
            self.flush_headers()
        except OSError:                     # the client is gone: nothing to answer
            self.close_connection = True

    def _fail(self, e, headers=()):
        # OpenAI-style `error` and FastAPI-style `detail` (LlamaIndex's JinaRerank and xinference-client read it)
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status},
                              "detail": str(e)}, headers)

    def log_request(self, code="-", size="-"):
        """Every reply passes here (send_response calls it, for the base class's own errors too): it is
        counted in the metrics and logged, the path without its query string (it may hold a key)."""
        path = request_path(getattr(self, "path", ""))      # none on a malformed request line
        if isinstance(code, int):
            route = path.rstrip("/") or "/"
            route = route if route in POST_PATHS + GET_PATHS else "/v1/models/{id}" if route.startswith(MODEL_PATH) \
                else "other"
            t0 = self.__dict__.pop("_t0", None)          # none: a request line refused before parse_request
            self.server.metrics.answered(route, int(code), time.perf_counter() - t0 if t0 else 0.0)
        self.log_message('"%s %s" %s', self.command, path, getattr(code, "value", code))

    def log_message(self, fmt, *args):   # one line per request; never headers (the key), bodies or queries
        if self.server.conf["log"]:
            line = re.sub(r"\?[^\s'\"]*", "?...", fmt % args).translate(CONTROL_CHARS)   # no terminal escape
            sys.stderr.write(f"[serve] {self.address_string()} {line}\n")

    def handle_one_request(self):
        # The request line and headers within read_timeout all told from their first byte, not only per read:
        # a client trickling them a byte at a time (slowloris) would otherwise hold this thread for as long as
        # it kept sending. Waiting for that byte (a kept-alive connection between requests) is bounded per
        # read as before; the body has its own deadline (body_timeout, _body).
        try:
            if not self.rfile.peek(1):          # the client closed the connection
                self.close_connection = True
                return
        except OSError:                         # idle past read_timeout (TimeoutError), or a reset
            self.close_connection = True
            return
        self._head_timer = threading.Timer(self.server.conf["read_timeout"], shut, (self.connection,))
        self._head_timer.daemon = True
        self._head_timer.start()
        try:
            super().handle_one_request()
        finally:
            self._head_timer.cancel()

    def parse_request(self):
        self._t0 = time.perf_counter()       # the request line is read: latency counts from here
        ok = super().parse_request()
        self._head_timer.cancel()            # the headers are in
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
        """The request's body bytes. A refusal before the whole body is read closes the connection: the
        unread rest must not be parsed as the next request."""
        conf = self.server.conf
        try:
            n = content_length(self.headers)
            if n > conf["max_body_bytes"]:
                drain_body(self.rfile, min(n, 4 * conf["max_body_bytes"]), conf["body_timeout"])   # 4x the cap at most
                raise RequestError(413, f"body of {n} bytes, at most {conf['max_body_bytes']}")
            return read_body(self.rfile, n, conf["body_timeout"])
        except RequestError:
            self.close_connection = True
            raise

    def _drop_body(self):
        """The body of a request refused before it is read (no free slot) read and dropped, so that the
        connection serves the next request; one past the cap, or not all read in time, closes it."""
        conf = self.server.conf
        try:
            n = content_length(self.headers)
        except RequestError:
            n = None
        if n is None or n > conf["max_body_bytes"] or drain_body(self.rfile, n, conf["body_timeout"]):
            self.close_connection = True

    def _from_a_web_page(self):
        """A request from a web page, or a loopback server asked under another host name: refused (403) before
        its body is read -> True. Without a key the server trusts its machine's own clients, not a web page.
        An Origin header is refused on every route, as offline_server.py does: browsers send one on cross-site
        requests and API clients do not, and a page's no-cors fetch (a "simple" POST, no preflight) names the
        real loopback Host, so without this check its body would be scored for a page that never reads the
        reply. A page that rebinds its own name to 127.0.0.1 sends that name as the Host."""
        if self.headers.get("Origin") is not None:
            e = RequestError(403, "Origin: requests from a web page (an Origin header) are refused; API clients "
                                  "send none", "Origin")
        elif not loopback_host(self.server.server_address, self.headers.get("Host") or "localhost"):
            e = RequestError(403, "Host: this server listens on loopback and answers loopback names only "
                                  "(localhost, 127.0.0.1, [::1])", "Host")
        else:
            return False
        self.close_connection = True
        self._fail(e)
        return True

    # -- methods
    def do_GET(self):
        if self._from_a_web_page():
            return
        path = request_path(self.path).rstrip("/") or "/"
        srv = self.server
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0").strip() != "0":
            self.close_connection = True      # a body no GET route reads must not be parsed as the next request
        try:
            if path == "/health":
                return self._send(200, {"status": "ok"})
            if path == "/info":                     # Text Embeddings Inference's shape (tei-client)
                return self._send(200, srv.info())
            if path == "/openapi.json":             # the API's description, no key needed
                return self._send(200, openapi(bool(srv.conf["api_key"])))
            if path in POST_PATHS:
                raise RequestError(405, f"{path} takes POST")
            if path not in ("/v1/models", "/metrics") and not path.startswith(MODEL_PATH):
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            if path == "/metrics":
                return self._send(200, srv.metrics.render(srv.gauges()))
            card = srv.model_card()
            if path == "/v1/models":
                return self._send(200, {"object": "list", "data": [card]})
            if unquote(path[len(MODEL_PATH):]) != card["id"]:     # OpenAI's retrieve-model route
                raise RequestError(404, f"model {unquote(path[len(MODEL_PATH):])!r}: this server serves "
                                        f"{card['id']!r}", "model")
            self._send(200, card)
        except RequestError as e:
            self._fail(e, error_headers(e.status, "POST"))

    def do_POST(self):
        if self._from_a_web_page():
            return
        path = request_path(self.path).rstrip("/") or "/"
        try:
            if path in GET_PATHS or path.startswith(MODEL_PATH):
                self.close_connection = True
                raise RequestError(405, f"{path} takes GET")
            if path not in POST_PATHS:
                self.close_connection = True
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                self.close_connection = True
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            with self.server.slot(refused=self._drop_body):   # taken before the body is read: max_concurrent_requests
                raw = self._body()                             # also bounds the bodies held in memory
                self._detect(raw) if path == DETECT_PATH else self._rerank(path, raw)
        except RequestError as e:
            self._fail(e, error_headers(e.status, "GET"))
        except Exception as e:   # a defect, not the client's fault: logged here, a short 500 there
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            self._fail(RequestError(500, f"internal error ({type(e).__name__})"))

    def _method_not_allowed(self):
        if self._from_a_web_page():
            return
        path = request_path(self.path).rstrip("/") or "/"
        self.close_connection = True
        if path in POST_PATHS or path in GET_PATHS:
            self._fail(RequestError(405, f"{path} takes {'POST' if path in POST_PATHS else 'GET'}"),
                       [("Allow", "POST" if path in POST_PATHS else "GET")])
        else:
            self._fail(RequestError(404, f"no route {path}"))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def _detect(self, raw):
        """POST /detect {documents[, query]}: each document's score under the run's text detector and whether
        it passes the run's threshold (detect.py). The detector reads the page alone, so a query is accepted
        and not read."""
        srv = self.server
        if srv.detector is None:
            raise RequestError(404, "no detector: run `python run.py detect --name RUN` on the served run, then "
                                    "serve it again")
        with srv.work:
            out = srv.detector.reply(parse_detect(json_body(raw), srv.conf["max_documents"]))
        self._send(200, out)

    def _rerank(self, path, raw):
        srv, conf = self.server, self.server.conf
        with srv.work:
            req, ids = self._prompts(path, json_body(raw))
        m = srv.batcher.submit(ids, conf["score_timeout"], lambda: hung_up(self.connection))
        if conf["smooth"]:
            m = certify.smoothed_margins(m, conf["smooth"])
        tokens = sum(map(len, ids))
        srv.metrics.add("geodef_documents_total", len(req.texts))
        srv.metrics.add("geodef_prompt_tokens_total", tokens)
        out = reply(path, req, m, tokens, req.model or conf["model_name"])
        if req.detect:
            with srv.work:
                out = srv.detector.annotate(out, req.texts)
        self._send(200, out)

    def _prompts(self, path, body):
        """A rerank or score request's body -> (the request, its prompts' token ids)."""
        srv, conf = self.server, self.server.conf
        req = parse_score(body, conf["max_documents"]) if path in SCORE_PATHS else \
            parse_rerank(path, body, conf["max_documents"])
        if req.detect and srv.detector is None:
            raise RequestError(400, "return_detect: this server has no detector (run `python run.py detect --name "
                                    "RUN` on the served run, then serve it again)", "return_detect")
        if conf["smooth"] and len(req.texts) * conf["smooth"] > conf["max_documents"]:
            raise RequestError(413, f"documents: {len(req.texts)} x {conf['smooth']} deletion samples (--smooth), at "
                                    f"most {conf['max_documents']} prompts a request (max_documents)", "documents")
        rr = srv.prompter(req)
        try:
            query_copies(rr, req, conf["smooth"] or 1)
            return req, prompt_ids(rr, req) if not conf["smooth"] else deletion_ids(rr, req, conf)
        except ValueError as e:   # a prompt without room for the document, or text BPE turns into a control token
            cap = "truncate_prompt_tokens" if req.max_prompt_tokens else None    # the client's budget, if any
            raise RequestError(400, f"query/instruction/documents{'/' + cap if cap else ''}: {e}", cap) from None


def hung_up(sock):
    """Whether the client has closed the connection: its socket reads as ended (bytes of a next request are
    no end)."""
    poll = select.poll()                  # (select.select refuses descriptors past 1,023)
    try:
        poll.register(sock, select.POLLIN)
        return bool(poll.poll(0)) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):         # reset, or closed on our side
        return True


def check_address(sv):
    """--host and --port bound once and let go: a busy port or another machine's address is refused at once,
    not after the model loads."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in sv.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the server binds
            s.bind((sv.host, sv.port))
    except OSError as e:
        raise SettingsError(f"--host {sv.host} --port {sv.port}: cannot listen there ({e.strerror or e})") from None


STOP_GRACE = 25.0     # seconds the requests in progress get at a stop (within Kubernetes' default 30 s grace)


def serve_until_stopped(rr, sv, deletion_rate, model_name, adapter=None, detector=None):
    """serve's command: a RerankServer over `rr` on the ServeSettings `sv`' host and port until Ctrl-C or
    SIGTERM (the requests in progress then finish, STOP_GRACE at most), its API key sv.api_key or $GEODEF_API_KEY;
    a warning when it listens beyond loopback without one; `detector` answers POST /detect; deletion_rate:
    --smooth's chance a word is deleted."""
    key = sv.api_key or os.environ.get("GEODEF_API_KEY") or None
    try:
        srv = RerankServer(rr, host=sv.host, port=sv.port, api_key=key, max_documents=sv.max_documents,
                           max_body_bytes=sv.max_body_bytes, max_queue=sv.max_queue,
                           max_queue_tokens=sv.max_queue_tokens, model_name=model_name,
                           max_concurrent_requests=sv.max_concurrent_requests, allow_instruction=sv.allow_instruction,
                           smooth=sv.smooth, deletion_rate=deletion_rate, detector=detector)
    except OSError as e:
        raise SettingsError(f"--host {sv.host} --port {sv.port}: cannot listen there ({e.strerror or e})") from None
    if sv.host not in ("127.0.0.1", "localhost", "::1") and not key:
        say(f"[serve] WARNING: listening on {sv.host} without an API key: anyone who can reach this port can use "
            "it (set GEODEF_API_KEY or --api-key)")
    say(f"[serve] {srv.scoring}{' (adapter ' + adapter + ')' if adapter else ''} on {srv.url} (/v1/rerank, "
        f"/rerank, /score, {'/detect, ' if detector else ''}/metrics){' (API key required)' if key else ''}")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)       # docker stop, systemd: as Ctrl-C
    try:
        with speed.short_documents(rr.model) if sv.smooth else contextlib.nullcontext():
            try:
                srv.serve_forever()
            except KeyboardInterrupt:
                srv.socket.close()              # no new connection; the requests in progress finish, on their kernels
                left = srv.drain(STOP_GRACE)
                say(f"[serve] stopped{f' ({left} requests cut off after {STOP_GRACE:g} s)' if left else ''}")
    finally:
        srv.server_close()


class RerankServer(ThreadingHTTPServer):
    """The rerank endpoint over one loaded `Reranker` (adapter attached or not). Port 0 picks a free
    one (`server_address[1]`)."""
    daemon_threads = True
    request_queue_size = 1024    # listen backlog: a burst of new connections waits to be accepted (then
                                 # a full server answers 429), instead of TCP resets at 5

    def __init__(self, rr, host="127.0.0.1", port=8000, api_key=None, model_name="geo-defender-shield",
                 max_documents=1000, max_body_bytes=8 << 20, read_timeout=30.0, body_timeout=60.0,
                 score_timeout=600.0, max_queue=64, max_queue_tokens=1 << 22, max_concurrent_requests=128, log=True,
                 allow_instruction=False, smooth=0, deletion_rate=0.9, detector=None, max_connections=1024):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET      # (an IPv6 address: ::1)
        super().__init__((host, port), _Handler)
        # a connection is a thread, held up to read_timeout by a client that sends nothing: past this many, a new
        # one is answered 503 and closed, so that idle connections cannot exhaust the process's threads
        self.connections = threading.BoundedSemaphore(max_connections)
        self.rr, self.detector = rr, detector           # detect.Served (POST /detect, return_detect) or None
        self.identity, self.scoring = scoring_identity(rr)    # "shield" | "base" | "unknown", and why
        self.batcher = Batcher(rr, max_queue, max_queue_tokens)
        self.metrics, self.started = Metrics(), int(time.time())
        self.in_flight, self.lock = 0, threading.Lock()      # requests in progress (slot)
        # parsing, tokenizing and detecting a request a few at a time: a body decodes to many times its bytes
        self.work = threading.BoundedSemaphore(os.cpu_count() or 1)
        self.conf = {"api_key": api_key or None, "model_name": model_name, "max_documents": max_documents,
                     "max_body_bytes": max_body_bytes, "read_timeout": read_timeout, "body_timeout": body_timeout,
                     "score_timeout": score_timeout, "max_concurrent_requests": max_concurrent_requests, "log": log,
                     "allow_instruction": allow_instruction, "smooth": smooth, "deletion_rate": deletion_rate}
        if smooth:
            self.scoring += f", smoothed over {smooth} deletion samples at p_del {deletion_rate:g} a request"
        if log:
            taken = "accepted" if self.identity == "base" or allow_instruction else "refused"
            sys.stderr.write(f"[serve] scoring with {self.scoring}; a client's instruction is {taken}\n")

    def process_request(self, request, client_address):
        if not self.connections.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)     # a client that reads nothing cannot hold this thread either
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:                   # no thread started: its place is free again
            self.connections.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    @contextlib.contextmanager
    def slot(self, refused=None):
        """One of max_concurrent_requests places for a request in progress; none free: refused() (the
        handler drops the unread body), then 429 with Retry-After (TEI's answer past its
        --max-concurrent-requests), the connection kept."""
        with self.lock:
            busy = self.in_flight
            self.in_flight += busy < self.conf["max_concurrent_requests"]
        if busy >= self.conf["max_concurrent_requests"]:
            if refused is not None:
                refused()
            raise RequestError(429, f"the server is busy ({busy} requests in progress, max_concurrent_requests); "
                                    "retry later")
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1

    def drain(self, seconds):
        """Wait up to `seconds` for the requests in progress to be answered -> how many are left."""
        end = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < end:
            time.sleep(0.05)
        return self.in_flight

    def prompter(self, req):
        """The Reranker that builds `req`'s prompts: the server's own, or a shallow copy with the
        request's instruction and prompt budget (truncate_prompt_tokens as its max_length; -1: the
        server's). Every route goes through here, so this is the one instruction policy. The copy shares
        the model and tokenizers and only tokenizes; the scoring thread takes token ids, so requests with
        different instructions share batches and never see each other's. The Shield refuses another
        instruction unless `allow_instruction`: its adapter was trained under its own, and a caller's
        could change what it scores, down to switching the defense off. So do weights the server cannot
        tell from the Shield's (scoring_identity); the reply names no file."""
        other = req.instruction is not None and req.instruction != self.rr.instruction
        if other and self.identity != "base" and not self.conf["allow_instruction"]:
            what = "with the Shield" if self.identity == "shield" else "with weights it cannot tell from the Shield's"
            raise RequestError(400, f"{req.instruction_field}: refused; this server scores {what}, whose adapter was "
                                    "trained under its own instruction, and another one could switch the defense off "
                                    "(omit it, or start the server with --allow-instruction)", req.instruction_field)
        budget = req.max_prompt_tokens
        if budget is not None and budget > self.rr.max_length:       # as vLLM refuses one over max_model_len
            raise RequestError(400, f"truncate_prompt_tokens: {budget}, at most the max length {self.rr.max_length}",
                               "truncate_prompt_tokens")
        if not other and budget in (None, -1):
            return self.rr
        view = copy.copy(self.rr)
        view.instruction = req.instruction if other else self.rr.instruction
        view.max_length = self.rr.max_length if budget in (None, -1) else budget
        return view

    def model_card(self):
        """The served model as OpenAI's Model object, with vLLM's max_model_len."""
        return {"id": self.conf["model_name"], "object": "model", "created": self.started,
                "owned_by": "geo-defender", "max_model_len": self.rr.max_length}

    def gauges(self):
        """What /metrics reads at scrape time: [(name, type, help, value)]."""
        waiting = self.batcher.jobs.qsize() + (self.batcher.held is not None)
        return [("geodef_queue_depth", "gauge", "requests waiting for the scoring thread", waiting),
                ("geodef_requests_in_flight", "gauge", "requests in progress (max_concurrent_requests at most)",
                 self.in_flight),
                ("geodef_scoring_calls_total", "counter", "score_ids calls (shared micro-batches)",
                 self.batcher.batches)]

    def info(self):
        """GET /info in Text Embeddings Inference's shape (its router's `Info`)."""
        rr = self.rr
        return {"model_id": self.conf["model_name"], "model_sha": rr.revision,
                "model_dtype": str(rr.model.embed_tokens.weight.dtype).removeprefix("torch."),
                "model_type": {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}},
                "max_concurrent_requests": self.conf["max_concurrent_requests"], "max_input_length": rr.max_length,
                "max_batch_tokens": self.batcher.max_batch_tokens, "max_batch_requests": None,
                "max_client_batch_size": self.conf["max_documents"] // max(1, self.conf["smooth"]),   # (--smooth: its
                "auto_truncate": True,                                                 # samples count as documents)
                "tokenization_workers": 1, "version": "geo-defender", "sha": None, "docker_label": None}

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"
