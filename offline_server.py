"""The offline engine's loopback HTTP server: OpenAI-compatible /v1/chat/completions answered by
offline.respond, the batch APIs the official SDKs call (OpenAI Files + Batches, Anthropic Message
Batches: `Batches`), and a Tavily-shaped /search over a synthetic corpus (`load_corpus`). A
SIMULATION, as the engine is: its replies say nothing about real LLMs or web search.

Errors come in the shape of the API a route belongs to (`error_body`): Anthropic's
{"type": "error", "error": {type, message}} on /v1/messages routes, OpenAI's
{"error": {message, type, param, code}} elsewhere, an unknown route or method a 404 "Invalid URL".

A reply's `id` is a digest of its request (`answer`): two requests never share one, and the same
request gets the same id (and the same text), so answers stay deterministic; its `created` is the
second the request arrived (a batch line's: its batch's), unless `make_server(created=...)` pins it.

Usage: srv = make_server(8765, corpus=load_corpus("corpus.jsonl")); srv.serve_forever()
       (python run.py serve-offline --port 8765)
"""
import email.parser
import email.policy
import hashlib
import json
import re
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import geodef
import offline
from endpoints import RequestError, content_length, loopback_host, request_path

MAX_BODY = 64 << 20
MAX_HELD = 1 << 30         # the uploaded files held at once, in characters (a batch's outputs are smaller)
DAY = 24 * 3600
OPENAI_ENDPOINT = "/v1/chat/completions"
# the batch routes: OpenAI's /v1/files[/ID[/content]] and /v1/batches[/ID[/cancel]], Anthropic's
# /v1/messages/batches[/ID[/cancel | /results]]
BATCH_ROUTE = re.compile(r"/v1/(files|batches|messages/batches)(?:/([^/]+))?(?:/(content|cancel|results))?$")
RUNNING = ("validating", "in_progress", "cancelling")
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); other 4xx: invalid_request_error
ANTHROPIC_ERRORS = {404: "not_found_error", 413: "request_too_large", 500: "api_error"}
ANTHROPIC_ROUTE = re.compile(r"/v1/messages(?:/|$)")
PARAM = re.compile(r"([A-Za-z_][\w.\[\]]*): ")   # the field a 400's message starts with ("limit: ..."): its param


class NotFound(LookupError):
    """404: no such route, file or batch. `param` names the path parameter that held the id (None for a
    route), as OpenAI's error object does."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.message, self.param = message, param


def error_body(status, message, anthropic, param=None):
    """An error reply in its API's shape: Anthropic's (https://docs.anthropic.com/en/api/errors) or OpenAI's
    error object (https://platform.openai.com/docs/guides/error-codes): message, type, param, code. A 400's
    param, when not given, is the field its message names first ("after: ..." -> "after")."""
    if anthropic:
        kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if param is None and status == 400:
        m = PARAM.match(message)
        param = m.group(1) if m else None
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": None}}


def answer(body, created):
    """offline.respond with the reply's `id` a digest of the request (unique per request, the same for
    the same one) and `created` the given Unix second. A request the engine cannot answer (a prompt
    missing a field its kind needs, a value of the wrong type) is raised as ValueError: a 400, never a
    404 or a 500."""
    try:
        resp = offline.respond(body)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"the offline engine cannot answer this request ({type(e).__name__}: {e})") from None
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
    return {**resp, "id": f"chatcmpl-{digest}", "created": int(created)}


# ----------------------------------------------------------------------------- batch APIs


def _iso(t):
    """Unix seconds -> Anthropic's RFC 3339 timestamp ('2024-08-20T18:37:24.100435Z'); None stays None."""
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _text(content):
    """Anthropic content: a string, or its text blocks joined (what the engine reads)."""
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return content


def _as_message(resp):
    """The engine's Chat Completions reply -> Anthropic's Message object."""
    return {"id": "msg_" + resp["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": offline.ENGINE, "content": [{"type": "text", "text": resp["choices"][0]["message"]["content"]}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": resp["usage"]["prompt_tokens"],
                      "output_tokens": resp["usage"]["completion_tokens"]}}


def _usage(rows):
    """OpenAI's batch `usage` (https://platform.openai.com/docs/api-reference/batch/object): the answered
    lines' tokens summed; the engine caches nothing and does not reason, so those details are 0."""
    used = [r["response"]["body"]["usage"] for r in rows if (r.get("response") or {}).get("status_code") == 200]
    n_in, n_out = sum(u["prompt_tokens"] for u in used), sum(u["completion_tokens"] for u in used)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def _file_object(f):
    """A stored file as OpenAI's File object."""
    return {"id": f["id"], "object": "file", "bytes": len(f["content"].encode("utf-8")), "created_at": f["created_at"],
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def _line_problem(line, seen):
    """An OpenAI batch input line -> (error code, message) when it would fail the batch's validation."""
    if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
        return "missing_custom_id", "custom_id: a string is required"
    if line["custom_id"] in seen:
        return "duplicate_custom_id", f"custom_id {line['custom_id'][:40]!r} is used more than once"
    if line.get("method") != "POST" or line.get("url") != OPENAI_ENDPOINT:
        return "invalid_url", f"method POST and url {OPENAI_ENDPOINT} are required"
    if not isinstance(line.get("body"), dict):
        return "invalid_body", "body: an object is required"
    return None


class OpenAIBatchAPI:
    """OpenAI's Batch API as the store serves it: input lines from an uploaded file, validated as the batch
    starts; output and error files; the Batch object (https://platform.openai.com/docs/api-reference/batch)."""
    anthropic, listed = False, {"object": "list"}     # error_body's shape; a listing's leading fields
    status_field, after, before = "status", "after", None

    @staticmethod
    def requests(store, body):
        """An OpenAI batch request -> (its input file's lines, the first problem with them or None)."""
        if body.get("endpoint") != OPENAI_ENDPOINT:
            raise ValueError(f"endpoint: the offline engine serves {OPENAI_ENDPOINT} only")
        if body.get("completion_window") != "24h":
            raise ValueError("completion_window: '24h' is required")
        fid = body.get("input_file_id")
        if not isinstance(fid, str) or fid not in store.files:
            raise ValueError(f"input_file_id: no file {str(fid)[:80]!r} (upload it first)")
        lines, seen = [], set()
        # JSONL lines end at "\n" alone: str.splitlines would also cut at U+2028, U+2029 and U+0085, which a
        # JSON string holds raw when written with ensure_ascii=False (as the project writes batch lines)
        for n, text in enumerate(store.files[fid]["content"].split("\n"), 1):
            text = text.removesuffix("\r")
            if not text:
                continue                    # an empty line (the file's last newline leaves one) holds no request
            try:
                line = json.loads(text)
            except ValueError:
                line = None
            bad = _line_problem(line, seen)
            if bad:
                return lines, {"code": bad[0], "message": f"line {n}: {bad[1]}", "param": None, "line": n}
            seen.add(line["custom_id"])
            lines.append(line)
        return lines, None if lines else {"code": "empty_file", "message": "the input file has no lines",
                                          "param": None, "line": None}

    @staticmethod
    def size(store, body):
        """The characters the batch's requests take (its input file's)."""
        return len(store.files[body["input_file_id"]]["content"])

    @staticmethod
    def chat_body(line):
        return line["body"]

    @staticmethod
    def row(b, i, cid, code, payload):
        """A line's row of the output file (answered) or error file -> (row, answered)."""
        body = payload if code == 200 else {"error": {**payload, "param": payload.get("param"),
                                                      "code": payload.get("code")}}
        return {"id": f"batch_req_{b['id']}_{i}", "custom_id": cid,
                "response": {"status_code": code, "request_id": f"req_{b['id']}_{i}", "body": body},
                "error": None}, code == 200

    @staticmethod
    def unrun(b, i, line, state):
        """A line the batch ended without running (expired, or cancelled) -> its error-file row."""
        why = "batch_expired" if state == "expired" else "batch_cancelled"
        return {"id": f"batch_req_{b['id']}_{i}", "custom_id": line["custom_id"], "response": None,
                "error": {"code": why, "message": f"the batch was {state} before this request ran"}}, False

    @staticmethod
    def kind(row, ok):
        gone = {"batch_expired": "expired", "batch_cancelled": "canceled"}
        return "succeeded" if ok else gone.get((row["error"] or {}).get("code"), "errored")

    @staticmethod
    def keep(store, b, rows):
        """The ended batch's output file (answered rows, in order) and error file (the others)."""
        out, errors = [r for r, ok in rows if ok], [r for r, ok in rows if not ok]
        b["usage"] = _usage(out)
        if store.knobs["tamper"]:
            out, store.knobs["tamper"] = store.knobs["tamper"](out), None
        jsonl = lambda rows_: "".join(json.dumps(r) + "\n" for r in rows_)
        b["output_file_id"] = store.keep_file(jsonl(out), f"{b['id']}_output.jsonl", "batch_output")["id"]
        if errors:
            b["error_file_id"] = store.keep_file(jsonl(errors), f"{b['id']}_error.jsonl", "batch_output")["id"]

    @staticmethod
    def view(b, host):
        at, c = b["at"], b["counts"]
        stamps = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
        return {"id": b["id"], "object": "batch", "endpoint": OPENAI_ENDPOINT, "model": offline.ENGINE,
                "input_file_id": b["input_file_id"], "completion_window": "24h", "status": b["state"],
                "output_file_id": b.get("output_file_id"), "error_file_id": b.get("error_file_id"),
                "errors": {"object": "list", "data": [b["problem"]]} if b["state"] == "failed" else None,
                "created_at": int(at["created"]), "expires_at": int(at["created"] + DAY),
                **{f"{k}_at": int(at[k]) if k in at else None for k in stamps},
                "request_counts": {"total": b["total"], "completed": c["succeeded"],
                                   "failed": sum(c.get(k, 0) for k in ("errored", "canceled", "expired"))},
                "usage": b.get("usage") or _usage([]), "metadata": b["metadata"]}


class AnthropicBatchAPI:
    """Anthropic's Message Batches as the store serves it: requests in the body, results at results_url in
    reverse order (the API promises none), an `errored` result where the engine cannot answer; the
    MessageBatch object (https://docs.anthropic.com/en/api/creating-message-batches)."""
    anthropic, listed = True, {}
    status_field, after, before = "processing_status", "after_id", "before_id"

    @staticmethod
    def requests(store, body):
        reqs = body.get("requests")
        if not isinstance(reqs, list) or not reqs or not all(
                isinstance(r, dict) and isinstance(r.get("custom_id"), str) and isinstance(r.get("params"), dict)
                for r in reqs):
            raise ValueError("requests: a non-empty list of {custom_id, params} objects is required")
        if len({r["custom_id"] for r in reqs}) != len(reqs):
            raise ValueError("requests: each custom_id must be unique")
        return reqs, None

    @staticmethod
    def size(store, body):
        """The characters the batch's requests take (as JSON)."""
        try:
            return len(json.dumps(body["requests"], ensure_ascii=False))
        except RecursionError:
            raise ValueError("requests: nested too deeply") from None

    @staticmethod
    def chat_body(line):
        """Anthropic Messages params -> the Chat Completions body the engine answers."""
        params = line["params"]
        system = _text(params.get("system"))
        msgs = [{"role": m["role"], "content": _text(m["content"])} for m in params["messages"]]
        return {"messages": ([{"role": "system", "content": system}] if system else []) + msgs}

    @staticmethod
    def row(b, i, cid, code, payload):
        res = ({"type": "succeeded", "message": payload} if code == 200 else
               {"type": "errored", "error": {"type": "error", "error": payload}})
        return {"custom_id": cid, "result": res}, code == 200

    @staticmethod
    def unrun(b, i, line, state):
        return {"custom_id": line["custom_id"], "result": {"type": "expired" if state == "expired" else
                                                           "canceled"}}, False

    @staticmethod
    def kind(row, ok):
        return row["result"]["type"]

    @staticmethod
    def keep(store, b, rows):
        out = [r for r, _ in rows][::-1]
        if store.knobs["tamper"]:
            out, store.knobs["tamper"] = store.knobs["tamper"](out), None
        b["usage"], b["out"] = None, out

    @staticmethod
    def view(b, host):
        at, c, ended = b["at"], b["counts"], b["state"] not in RUNNING
        # every request counts as processing until the whole batch has ended (the Message Batches reference)
        counts = {k: c.get(k, 0) if ended else 0 for k in ("succeeded", "errored", "canceled", "expired")}
        return {"id": b["id"], "type": "message_batch",
                "processing_status": "ended" if ended else "canceling" if b["state"] == "cancelling" else
                "in_progress",
                "request_counts": {"processing": b["total"] - sum(counts.values()), **counts},
                "created_at": _iso(at["created"]), "expires_at": _iso(at["created"] + DAY),
                "ended_at": _iso(at.get(b["state"])) if ended else None,
                "cancel_initiated_at": _iso(at.get("cancelling")), "archived_at": None,
                "results_url": f"http://{host}/v1/messages/batches/{b['id']}/results" if ended else None}


class Batches:
    """The batch store and its runner: OpenAI's Files + Batches and Anthropic's Message Batches, answered
    by the engine, with the objects and routes the official SDKs read (`route`); what differs between
    the two APIs is in OpenAIBatchAPI and AnthropicBatchAPI. A batch stays in progress for `polls` status
    checks (its request counts advancing), then runs every line. A line the engine cannot answer is an
    error line (OpenAI: status_code 400 in the error file; Anthropic: an `errored` result), never a
    failed call.

    `knobs`, for tests (a "once" knob clears itself when used):
      polls         status checks a batch stays in progress (1)
      stall         lines a batch completes before it stops progressing, never ending (None: it ends)
      expire_after  lines run before the next batch to end expires (once)
      fail_first    that many lines answer 500 (Anthropic: api_error), once each
      fail          a message: the next OpenAI batch created fails validation with it (once)
      reject        creation refused with 400
      missing       no batch endpoints: 404 on each of them
      no_status     the next that many status replies lack their status field
      purge         the next batch to end has its output purged: reading it answers 404 (once)
      tamper        a function of the next ended batch's output rows -> the rows served (once)
      cancelling    status checks a cancelled batch stays cancelling before it ends (0: the next one ends it)
      lose_created  the next that many batches created have their creation reply lost (the connection closes)
      status_down   the next that many status checks answer 500
    """
    KNOBS = {"polls": 1, "stall": None, "expire_after": None, "fail_first": 0, "fail": None, "reject": False,
             "missing": False, "no_status": 0, "purge": False, "tamper": None, "cancelling": 0,
             "lose_created": 0, "status_down": 0}

    def __init__(self, pinned_created=None):
        self.files, self.batches, self.failed, self.lock = {}, {}, set(), threading.RLock()
        self.knobs = dict(self.KNOBS)
        self.created = self.n_files = 0
        self.pinned_created = pinned_created     # every answered line's `created` (None: its batch's second)

    def route(self, method, path, query, raw, content_type, host):
        """A batch API request -> (200, reply object or JSONL text); raises NotFound (404: no such
        route, batch or file) or ValueError (400)."""
        m = BATCH_ROUTE.search(path)
        if m is None or self.knobs["missing"]:
            raise NotFound(f"Invalid URL ({method} {path[:200]})")
        kind, oid, verb = m.groups()
        api = AnthropicBatchAPI if kind == "messages/batches" else OpenAIBatchAPI
        if kind == "files":
            if method == "POST" and oid is None:
                return 200, self.upload(content_type, raw)
            if method == "GET" and oid is None:
                return 200, self.file_listing(query)
            if method == "GET" and verb in (None, "content"):
                f = self._file(oid)
                return 200, f["content"] if verb else _file_object(f)
            if method == "DELETE" and verb is None:
                return 200, self.delete_file(oid)
        elif method == "POST" and oid is None:
            return 200, self.create(json.loads(raw), api, host)
        elif method == "GET" and oid is None:
            return 200, self.listing(api, query, host)
        elif method == "GET" and verb is None:
            return 200, self.status(oid, api, host)
        elif method == "POST" and verb == "cancel":
            return 200, self.cancel(oid, api, host)
        elif method == "GET" and verb == "results" and api is AnthropicBatchAPI:
            return 200, self.results(oid)
        elif method == "DELETE" and verb is None and api is AnthropicBatchAPI:
            return 200, self.delete_batch(oid)
        raise NotFound(f"Invalid URL ({method} {path[:200]})")

    # --- files (OpenAI's)

    def upload(self, content_type, raw):
        """POST /v1/files (multipart: purpose=batch and the file) -> its File object."""
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
        parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
        if "file" not in parts or "purpose" not in parts or parts["purpose"].get_payload(decode=True) != b"batch":
            raise ValueError("multipart/form-data fields purpose=batch and file are required")
        data = parts["file"].get_payload(decode=True)
        if not isinstance(data, bytes):     # a part that is itself multipart holds parts, not the file's bytes
            raise ValueError(f"file: the part must hold the JSONL file, not {parts['file'].get_content_type()} parts")
        data = data.decode("utf-8")
        return _file_object(self.keep_file(data, parts["file"].get_filename() or "batch.jsonl", "batch"))

    def keep_file(self, content, filename, purpose):
        with self.lock:
            held = sum(len(f["content"]) for f in self.files.values() if f["purpose"] == "batch")
            if purpose == "batch" and held + len(content) > MAX_HELD:    # an upload; outputs are always kept
                raise ValueError(f"uploads held would reach {held + len(content)} characters, at most {MAX_HELD}: "
                                 "delete some (DELETE /v1/files/ID)")
            self.n_files += 1
            fid = f"file-{self.n_files}"
            self.files[fid] = {"id": fid, "content": content, "filename": filename, "purpose": purpose,
                               "created_at": int(time.time())}
            return self.files[fid]

    def _file(self, fid):
        if fid not in self.files:
            raise NotFound(f"No such File object: {str(fid)[:80]}", "file_id")
        return self.files[fid]

    def file_listing(self, query):
        """GET /v1/files (https://platform.openai.com/docs/api-reference/files/list): `order` by creation
        (desc, the default, or asc), `purpose` only, `limit` (1..10000, default 10000) after `after`."""
        q = {k: v[-1] for k, v in query.items()}
        limit, order = q.get("limit", "10000"), q.get("order", "desc")
        if not limit.isdigit() or not 1 <= int(limit) <= 10000:
            raise ValueError("limit: an integer in 1..10000 is required")
        if order not in ("asc", "desc"):
            raise ValueError("order: 'asc' or 'desc' is required")
        with self.lock:
            files = [f for f in self.files.values() if q.get("purpose") in (None, f["purpose"])]
            ids = [f["id"] for f in (files if order == "asc" else files[::-1])]
            if "after" in q:
                if q["after"] not in ids:
                    raise ValueError(f"after: no file {q['after'][:80]!r} in this list")
                ids = ids[ids.index(q["after"]) + 1:]
            page = ids[:int(limit)]
            return {"object": "list", "data": [_file_object(self.files[i]) for i in page],
                    "has_more": len(ids) > len(page), "first_id": page[0] if page else None,
                    "last_id": page[-1] if page else None}

    def delete_file(self, fid):
        """DELETE /v1/files/{file_id} -> OpenAI's deletion status; the file's content is gone."""
        with self.lock:
            self._file(fid)
            del self.files[fid]
            return {"id": fid, "object": "file", "deleted": True}

    # --- batches

    def create(self, body, api, host):
        """POST /v1/batches or /v1/messages/batches -> the new batch. A request not of the API's shape
        is refused (400); OpenAI's input lines are validated as the batch starts: a bad one fails the
        batch, its line number in `errors`."""
        if self.knobs["reject"]:
            raise ValueError("batch refused (offline engine's reject knob)")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        lines, problem = api.requests(self, body)
        size = api.size(self, body)
        with self.lock:
            held = sum(b["size"] for b in self.batches.values() if b["lines"])
            if held + size > MAX_HELD:          # the lines of the batches still running are held parsed
                raise ValueError(f"the running batches' requests would reach {held + size} characters, at most "
                                 f"{MAX_HELD}: let some end or cancel them")
            if problem is None and api is OpenAIBatchAPI and self.knobs["fail"]:
                problem, self.knobs["fail"] = {"code": "invalid_request", "message": self.knobs["fail"]}, None
            self.created += 1
            bid = f"batch-{self.created}"
            b = self.batches[bid] = {
                "id": bid, "api": api, "lines": lines, "total": len(lines), "size": size, "polls": 0,
                "state": "validating",
                "at": {"created": time.time()}, "counts": {"succeeded": 0}, "out": [], "problem": problem,
                "input_file_id": body.get("input_file_id"), "metadata": body.get("metadata")}
            if self.knobs["lose_created"]:
                self.knobs["lose_created"] -= 1
                raise ConnectionError("the creation reply is lost (lose_created knob)")
            return api.view(b, host)

    def _batch(self, bid, api):
        b = self.batches.get(bid)
        if b is None or b["api"] is not api:
            raise NotFound(f"No batch found with id {bid[:80]!r}", "batch_id")
        return b

    def status(self, bid, api, host):
        """GET a batch: one status check (the batch advances) -> its object."""
        with self.lock:
            if self.knobs["status_down"]:
                self.knobs["status_down"] -= 1
                raise RuntimeError("status checks down (status_down knob)")      # -> 500
            b = self._batch(bid, api)
            self._advance(b)
            view = api.view(b, host)
            if self.knobs["no_status"]:
                self.knobs["no_status"] -= 1
                view.pop(api.status_field)
            return view

    def cancel(self, bid, api, host):
        """POST .../cancel: a batch in progress is cancelling; it ends with the lines it has done (_advance)."""
        with self.lock:
            b = self._batch(bid, api)
            if b["state"] in ("validating", "in_progress"):
                b["state"], b["at"]["cancelling"] = "cancelling", time.time()
            return api.view(b, host)

    def listing(self, api, query, host):
        """GET /v1/batches or /v1/messages/batches: newest first, `limit` (1..100, default 20) after
        `after` (OpenAI) or `after_id`, or before `before_id` (Anthropic)."""
        q = {k: v[-1] for k, v in query.items()}
        limit = q.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ValueError("limit: an integer in 1..100 is required")
        limit = int(limit)
        with self.lock:
            ids = [bid for bid, b in reversed(self.batches.items()) if b["api"] is api]
            after, before = q.get(api.after), q.get(api.before) if api.before else None
            for name, cursor in ((api.after, after), (api.before, before)):
                if cursor and cursor not in ids:
                    raise ValueError(f"{name}: no batch {cursor[:80]!r} in this list")
            if after:
                ids = ids[ids.index(after) + 1:]
            if before and before not in ids:   # before_id at or above after_id: nothing lies between them
                ids = []
            page = ids[:ids.index(before)][-limit:] if before else ids[:limit]
            more = ids.index(page[0]) > 0 if before and page else len(ids) > limit
            out = {"data": [api.view(self.batches[i], host) for i in page], "has_more": more,
                   "first_id": page[0] if page else None, "last_id": page[-1] if page else None}
        return {**api.listed, **out}

    def results(self, bid):
        """GET /v1/messages/batches/{id}/results (the results_url) -> JSONL."""
        with self.lock:
            b = self._batch(bid, AnthropicBatchAPI)
            if b["state"] in RUNNING or b.get("purged"):
                raise NotFound(f"No results for batch {bid!r}: " + ("it has not ended" if b["state"] in RUNNING else
                                                                     "they were purged"))
            return "".join(json.dumps(r) + "\n" for r in b["out"])

    def delete_batch(self, bid):
        """DELETE /v1/messages/batches/{id}: an ended batch and its results are gone -> Anthropic's
        {"id", "type": "message_batch_deleted"}. One still processing is refused (400): Anthropic deletes
        a batch only once it has ended, so one in progress must be cancelled first."""
        with self.lock:
            b = self._batch(bid, AnthropicBatchAPI)
            if b["state"] in RUNNING:
                raise ValueError(f"message_batch_id: batch {bid!r} is still processing; cancel it, and delete it "
                                 "once it has ended")
            del self.batches[bid]
            return {"id": bid, "type": "message_batch_deleted"}

    # --- running a batch

    def _advance(self, b):
        """One status check's progress: lines complete over `polls` checks, then the batch ends (expired
        under expire_after; never while `stall` holds it); a cancelled one ends with what it has done
        after `cancelling` more checks."""
        k, now = self.knobs, time.time()
        if b["state"] == "cancelling":
            b["cancel_checks"] = b.get("cancel_checks", 0) + 1
            if b["cancel_checks"] > k["cancelling"]:
                self._end(b, "cancelled", b["counts"]["succeeded"])
            return
        if b["state"] not in RUNNING:
            return
        if b["problem"]:
            b["state"], b["at"]["failed"], b["lines"] = "failed", now, []
            return
        b["polls"] += 1
        b["state"] = "in_progress"
        b["at"].setdefault("in_progress", now)
        total = b["total"]
        b["counts"]["succeeded"] = min(total * b["polls"] // (k["polls"] + 1), total if k["stall"] is None else
                                       k["stall"])
        if b["polls"] > k["polls"] and k["stall"] is None:
            n = total if k["expire_after"] is None else min(k["expire_after"], total)
            if n < total:
                k["expire_after"] = None           # one batch expires; the resubmitted lines run
            self._end(b, "completed" if n == total else "expired", n)

    def _end(self, b, state, n):
        """The batch ends in `state` with its first n lines run, the others expired or cancelled; its
        output is kept as its API keeps it (output and error files, or results)."""
        api = b["api"]
        rows = [self._run_line(b, i, line) if i < n else api.unrun(b, i, line, state)
                for i, line in enumerate(b["lines"])]
        kinds = [api.kind(r, ok) for r, ok in rows]
        b["lines"] = []                        # its rows are kept (api.keep); its requests no longer
        b["counts"] = {k: kinds.count(k) for k in ("succeeded", "errored", "canceled", "expired")}
        b["state"], b["at"]["finalizing"], b["at"][state] = state, time.time(), time.time()
        api.keep(self, b, rows)
        if self.knobs["purge"]:
            self.knobs["purge"], b["purged"] = False, True
            for fid in (b.get("output_file_id"), b.get("error_file_id")):
                self.files.pop(fid, None)

    def _run_line(self, b, i, line):
        """One line answered by the engine -> (row, answered): its API's row, an error row where the
        engine cannot answer the prompt."""
        api, cid = b["api"], line["custom_id"]
        if cid not in self.failed and len(self.failed) < self.knobs["fail_first"]:
            self.failed.add(cid)
            return api.row(b, i, cid, 500, {"type": "api_error", "message": "offline engine's fail_first knob"})
        try:
            at = b["at"]["created"] if self.pinned_created is None else self.pinned_created
            resp = answer(api.chat_body(line), at)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:    # a prompt the engine
            msg = str(e)[:300]                  # cannot answer (chat_body: Anthropic params of the wrong shape)
            return api.row(b, i, cid, 400, error_body(400, msg, api.anthropic)["error"])
        return api.row(b, i, cid, 200, _as_message(resp) if api.anthropic else resp)


# ----------------------------------------------------------------------------- search


def load_corpus(path):
    """A synthetic search corpus (JSONL of {query, url, text}; data/make_sample.py writes one) -> list,
    every line checked (file:line: field: what is wrong, as geodef.BenchFormatError)."""
    pages = []
    for n, obj in geodef.read_jsonl(path):
        for key in ("query", "url", "text"):
            if not isinstance(obj.get(key), str) or (key != "url" and not obj[key].strip()):
                raise geodef.BenchFormatError(f"{path}:{n}: {key}: expected a non-empty string"
                                              if key != "url" else f"{path}:{n}: url: expected a string")
            geodef.check_unicode(obj[key], path, n, key)
        pages.append(obj)
    if not pages:
        raise geodef.BenchFormatError(f"{path}: no pages (JSONL of {{query, url, text}})")
    return pages


def search(body, corpus):
    """A Tavily-shaped /search request -> its reply, from the corpus: the pages of the corpus query
    that shares most words with the asked one, best first (deterministic; a SIMULATION of a web search)."""
    if not isinstance(body, dict) or not isinstance(body.get("query"), str) or not body["query"].strip():
        raise ValueError("query: a non-empty string is required")
    n = body.get("max_results", 5)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= 20:
        raise ValueError("max_results: an integer in 1..20 is required")
    q = set(offline.words(body["query"])) - offline.STOP
    by_query = {}
    for page in corpus or []:
        by_query.setdefault(page["query"], []).append(page)
    best = max(by_query, key=lambda k: (len(q & set(offline.words(k))), k), default=None)
    pages = by_query.get(best, []) if best is not None and q & set(offline.words(best)) else []
    return {"query": body["query"], "response_time": 0.0, "images": [],
            "results": [{"title": p["text"].split(".")[0][:80], "url": p["url"], "content": p["text"][:300],
                         "raw_content": p["text"] if body.get("include_raw_content") else None,
                         "score": round(1.0 - 0.05 * i, 2)} for i, p in enumerate(pages[:n])]}


# ----------------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    timeout = 30             # socket timeout: a client that stops sending is dropped, the thread freed

    def _route(self, method, path, query, raw, arrived):
        """-> (status, reply object or JSONL text) for the engine's routes; raises ValueError (400),
        NotFound (404). arrived: the request's Unix second, a chat reply's `created` unless pinned."""
        if method == "POST" and path.endswith("/chat/completions"):
            pinned = self.server.batches.pinned_created
            return 200, answer(json.loads(raw), arrived if pinned is None else pinned)
        if method == "POST" and path == "/search":               # Tavily's route, answered from the corpus
            return 200, search(json.loads(raw), self.server.corpus)
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        return self.server.batches.route(method, path, query, raw, self.headers.get("Content-Type", ""), host)

    def _error(self, status, message, param=None):
        """error_body for this request's route: Anthropic's shape on /v1/messages routes."""
        anthropic = ANTHROPIC_ROUTE.search(request_path(getattr(self, "path", ""))) is not None
        return error_body(status, message, anthropic, param)

    def _handle(self):
        arrived = time.time()
        if self.headers.get("Origin") is not None:   # a web page's request (no API client sends one): its
            return self._refuse(403, "requests from a web page (an Origin header) are refused")   # uploads, too
        if not loopback_host(self.server.server_address, self.headers.get("Host") or "localhost"):
            return self._refuse(403, "Host: a loopback server answers loopback names only (a web page that "
                                     "rebinds its own name to 127.0.0.1 sends that name)")
        try:
            n = content_length(self.headers, required=False)
        except RequestError as e:
            return self._refuse(e.status, str(e))
        if n > MAX_BODY:
            return self._refuse(413, f"body of {n} bytes, at most {MAX_BODY}")
        try:
            raw = self.rfile.read(n) if n else b""
            if len(raw) < n:
                raise ValueError(f"the body ended after {len(raw)} of {n} bytes")
            url = urlsplit(self.path)                    # a target it refuses is a 400 (ValueError) below
            return self._send(*self._route(self.command, url.path.rstrip("/"), parse_qs(url.query), raw, arrived))
        except (TimeoutError, ConnectionError):
            self.close_connection = True
        except NotFound as e:
            return self._send(404, self._error(404, e.message, e.param))
        except (ValueError, TypeError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
            return self._send(400, self._error(400, str(e)[:300]))
        except Exception as e:   # never a request left unanswered
            return self._send(500, self._error(500, f"offline engine failed ({type(e).__name__})"))

    def _refuse(self, code, message):
        """An error before the body is read: the connection closes, so the unread body is never taken
        for the next request."""
        self.close_connection = True
        self._send(code, self._error(code, message))

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line, an overlong line) as JSON in the route's API
        shape instead of its HTML page; a method no do_* serves is OpenAI's 404 "Invalid URL", not a 501. The
        connection closes."""
        if code == 501:
            code, message = 404, f"Invalid URL ({self.command} {request_path(self.path)[:200]})"
        self._refuse(code, message or self.responses.get(code, ("error",))[0])

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    def _send(self, code, obj):
        text = isinstance(obj, str)                  # JSONL: a batch's output file or results
        data = obj.encode("utf-8") if text else json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/x-ndjson" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":               # a HEAD reply has no body (RFC 9110, 9.3.2)
                self.wfile.write(data)
        except OSError:      # the client went away
            self.close_connection = True

    def log_message(self, *a):
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024    # listen backlog (serve.py's): a burst of new connections waits to be
                                 # accepted instead of being dropped or reset past socketserver's 5


def make_server(port=0, host="127.0.0.1", corpus=None, created=None):
    """A loopback OpenAI-compatible server (chat completions and the batch APIs: `Batches`), and a
    Tavily-shaped /search over `corpus` (load_corpus); port 0 picks a free port (server.server_address[1]).
    created: the Unix second every chat reply carries (None: the second its request arrived)."""
    srv = _Server((host, port), _Handler)
    srv.corpus, srv.batches = corpus or [], Batches(created)
    return srv
