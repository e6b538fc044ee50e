"""The providers' batch APIs for bulk LLM stages (`--batch-api`): OpenAI's Batch API (Files + Batches;
also any OpenAI-shaped server that offers /v1/batches) and Anthropic's Message Batches, at half the
price within a day, without the synchronous rate limits.

A BatchRunner sits in front of a Client's map(): the requests not yet in the reply cache are written
as batch lines (custom_id = the request's cache key), submitted, polled with backoff, and every
usable reply is parsed and cached exactly as a synchronous call would cache it; map() then reads
them all from the cache, so a batch run and a synchronous run give identical records, and a rerun
sends nothing. What the batch could not answer goes through map()'s synchronous path (re-asks of
unparsable replies, a 400's parameter adaptation), so nothing is silently lost.

Resumable: before a batch is created, the run folder's manifest records its requests' custom ids;
its id is recorded as soon as the provider returns it. A rerun after a kill first collects every
recorded batch that holds requests still missing, instead of submitting them again. Lines that
failed for a reason retrying can help (5xx, rate limit, expired or cancelled batches) are
resubmitted, exactly those, up to `rounds` batch rounds in all.

Usage: client.batch = BatchRunner(client, "runs/x/batches.json", poll=60); client.map(requests)
"""
import hashlib
import json
import os
import threading
import time
from urllib.parse import urlparse

from llm_clients import LLMError

# Provider limits per batch (OpenAI: 50,000 requests and a 200 MB input file; Anthropic: 100,000
# requests and 256 MB).
LIMITS = {"openai": (50_000, 200 << 20), "anthropic": (100_000, 256 << 20)}
RETRYABLE_TYPES = ("overloaded_error", "api_error", "rate_limit_error", "timeout_error")
ENDED = {"completed", "failed", "expired", "cancelled", "ended"}


class BatchUnsupported(LLMError):
    """The server has no batch endpoint (404/405 on it), or refused to create the batch."""


class Manifest:
    """The run folder's record of batches: {"batches": [{"digest", "custom_ids", "id", "provider",
    "status", "collected"}]}, rewritten whole (aside, then renamed) after every change."""

    def __init__(self, path):
        self.path, self.lock = path, threading.Lock()
        try:
            with open(path, encoding="utf-8") as f:
                self.data = json.load(f)
        except (OSError, ValueError):
            self.data = {"batches": []}

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def open_for(self, keys):
        """Recorded batches, created and not yet collected, holding any of `keys`."""
        return [b for b in self.data["batches"]
                if b.get("id") and not b.get("collected") and set(b["custom_ids"]) & keys]


class BatchRunner:
    """A client's batch API (see the module docstring). poll: seconds between status checks at first
    (growing by half each time up to 10x); auto: a server without a batch endpoint falls back to
    synchronous calls (else an error); rounds: batch rounds before what is left goes synchronous."""

    def __init__(self, client, manifest, poll=60.0, auto=False, rounds=3, limits=None, log=print, sleep=time.sleep):
        if client.transport.base_url is None:
            raise ValueError(f"{client.label}: the batch API needs an HTTP endpoint")
        self.client, self.manifest = client, Manifest(manifest)
        self.poll, self.auto, self.rounds, self.log, self.sleep = poll, auto, rounds, log, sleep
        self.anthropic = client.protocol == "anthropic"
        self.limits = limits or LIMITS["anthropic" if self.anthropic else "openai"]
        self.base = client.transport.base_url
        self.unsupported = False
        self.stats = {"batches": 0, "lines": 0, "cached": 0, "retried": 0}

    # --- the runner

    def run(self, requests_, desc="batch"):
        """Every request of `requests_` (chat() keyword dicts) not in the cache, through batches."""
        if self.unsupported:
            return
        todo = {}
        for r in requests_:
            key, body = self.client.request_key(**r)
            if key not in todo and self.client.cache.get(key) is None:
                todo[key] = (r, body)
        for rnd in range(self.rounds):
            if not todo:
                return
            try:
                retry = self._round(todo, desc)
            except BatchUnsupported as e:
                if not self.auto:
                    raise
                self.unsupported = True
                self.log(f"[batch] {e}; --batch-api auto: synchronous calls instead")
                return
            self.stats["retried"] += len(retry)
            todo = {k: todo[k] for k in retry}
        if todo:
            self.log(f"[batch] {desc}: {len(todo)} requests still unanswered after {self.rounds} batch rounds: "
                     "sent synchronously")

    def _round(self, todo, desc):
        """One round: recorded batches collected, the rest submitted and collected -> keys to retry."""
        retry, keys = set(), set(todo)
        for b in self.manifest.open_for(keys):
            retry |= self._collect(b, todo)
            keys -= set(b["custom_ids"])
        keys = [k for k in todo if k in keys and self.client.cache.get(k) is None]
        for chunk in self._chunks(keys, todo):
            b = self._submit(chunk, todo, desc)
            retry |= self._collect(b, todo)
        return retry

    def _chunks(self, keys, todo):
        """Keys split at the provider's limits (requests and bytes per batch)."""
        out, cur, size = [], [], 0
        for k in keys:
            n = len(json.dumps(self._line(k, todo[k][1]))) + 1
            if cur and (len(cur) == self.limits[0] or size + n > self.limits[1]):
                out.append(cur)
                cur, size = [], 0
            cur.append(k)
            size += n
        return out + ([cur] if cur else [])

    def _line(self, key, body):
        if self.anthropic:
            return {"custom_id": key, "params": body}
        return {"custom_id": key, "method": "POST", "url": urlparse(self.base + "/chat/completions").path,
                "body": body}

    def _submit(self, chunk, todo, desc):
        """Record the chunk, create its batch, record the id -> the manifest entry."""
        entry = {"digest": hashlib.sha256("".join(sorted(chunk)).encode()).hexdigest()[:16], "custom_ids": chunk,
                 "id": None, "provider": self.client.label, "status": None, "collected": False}
        with self.manifest.lock:
            self.manifest.data["batches"].append(entry)
            self.manifest.save()
        lines = [self._line(k, todo[k][1]) for k in chunk]
        entry["id"] = self._create_anthropic(lines) if self.anthropic else self._create_openai(lines)
        with self.manifest.lock:
            self.manifest.save()
        self.stats["batches"] += 1
        self.stats["lines"] += len(chunk)
        self.log(f"[batch] {desc}: batch {entry['id']} of {len(chunk)} requests submitted")
        return entry

    def _collect(self, entry, todo):
        """Poll the batch until it ends; cache every usable reply -> keys worth another batch."""
        status, wait = self._status(entry["id"]), self.poll
        while status["state"] not in ENDED:
            self.sleep(wait)
            wait = min(wait * 1.5, 10 * self.poll)
            status = self._status(entry["id"])
        if status["state"] == "failed":                        # OpenAI: the input file did not validate
            raise BatchUnsupported(f"{self.client.label}: batch {entry['id']} failed validation", None)
        results = self._results(status)
        retry = set()
        for key in entry["custom_ids"]:
            if key not in todo:
                continue
            got = results.get(key)
            if got is None:                                    # expired or cancelled before it ran
                retry.add(key)
            elif got[0] == "ok":
                r = todo[key][0]
                self.client.store(key, got[1], r.get("json", False), r.get("check"), mode="batch")
                self.stats["cached"] += 1
            elif got[0] == "retry":
                retry.add(key)
            # "fail": left to the synchronous path (a 400's parameter adaptation, or its error)
        entry["status"], entry["collected"] = status["state"], True
        with self.manifest.lock:
            self.manifest.save()
        return retry

    # --- OpenAI Batch API

    def _create_openai(self, lines):
        t = self.client.transport
        data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8")
        try:
            f = t.send("POST", self.base + "/files", files={"purpose": (None, "batch"),
                                                            "file": ("batch.jsonl", data, "application/jsonl")})
            b = t.send("POST", self.base + "/batches", {"input_file_id": f["id"], "completion_window": "24h",
                                                        "endpoint": urlparse(self.base + "/chat/completions").path})
        except LLMError as e:
            if e.status in (404, 405):
                raise BatchUnsupported(f"{self.client.label}: no batch endpoint at {self.base}/batches "
                                       f"(HTTP {e.status})", e.status) from None
            if e.status is not None and 400 <= e.status < 500:
                raise BatchUnsupported(f"{self.client.label}: the batch was refused at creation: {e}",
                                       e.status) from None
            raise
        return b["id"]

    def _status(self, batch_id):
        t = self.client.transport
        if self.anthropic:
            b = t.send("GET", f"{self.base}/messages/batches/{batch_id}")
            return {"state": "ended" if b.get("processing_status") == "ended" else b.get("processing_status"),
                    "results_url": b.get("results_url")}
        b = t.send("GET", f"{self.base}/batches/{batch_id}")
        return {"state": b.get("status"), "output": b.get("output_file_id"), "errors": b.get("error_file_id")}

    def _results(self, status):
        """-> {custom_id: ("ok", response body) | ("retry", why) | ("fail", why)}."""
        t, out = self.client.transport, {}
        if self.anthropic:
            url = status.get("results_url")
            if url and urlparse(url).netloc != urlparse(self.base).netloc:
                raise LLMError(f"{self.client.label}: results_url on another host ({urlparse(url).netloc}) refused")
            for rec in _jsonl(t.send("GET", url, raw=True) if url else ""):
                res = rec.get("result") or {}
                kind = res.get("type")
                if kind == "succeeded":
                    out[rec["custom_id"]] = ("ok", res.get("message"))
                elif kind in ("canceled", "expired") or (res.get("error") or {}).get("type") in RETRYABLE_TYPES:
                    out[rec["custom_id"]] = ("retry", kind)
                else:
                    out[rec["custom_id"]] = ("fail", json.dumps(res)[:200])
            return out
        for fid in (status.get("output"), status.get("errors")):
            if not fid:
                continue
            for rec in _jsonl(t.send("GET", f"{self.base}/files/{fid}/content", raw=True)):
                resp, err = rec.get("response") or {}, rec.get("error") or {}
                code = resp.get("status_code")
                if code == 200:
                    out[rec["custom_id"]] = ("ok", resp.get("body"))
                elif code in (408, 409, 429) or (code or 0) >= 500 or err.get("code") == "batch_expired":
                    out[rec["custom_id"]] = ("retry", str(code or err.get("code")))
                else:
                    out[rec["custom_id"]] = ("fail", json.dumps(resp.get("body") or err)[:200])
        return out

    # --- Anthropic Message Batches

    def _create_anthropic(self, lines):
        try:
            b = self.client.transport.send("POST", self.base + "/messages/batches", {"requests": lines})
        except LLMError as e:
            if e.status is not None and 400 <= e.status < 500:
                raise BatchUnsupported(f"{self.client.label}: the batch was refused at creation "
                                       f"(HTTP {e.status}): {e}", e.status) from None
            raise
        return b["id"]


def _jsonl(text):
    out = []
    for line in (text or "").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("custom_id"), str):
            out.append(rec)
    return out
