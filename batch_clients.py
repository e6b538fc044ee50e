"""The providers' batch APIs for bulk LLM stages (`--batch-api`): OpenAI's Batch API (Files + Batches;
also any OpenAI-shaped server that offers /v1/batches) and Anthropic's Message Batches, at half the
price within a day, without the synchronous rate limits.

A BatchRunner is the algorithm (rounds, manifest, polling, deadline, what is kept or sent again) over a
provider (OpenAIBatches, AnthropicBatches: a request's line, creating a batch, its status, where its
results are, and each result line's outcome). It sits in front of a Client's map() (Client(...,
batch=...)): fill_cache() writes the requests not yet in the reply cache as batch lines (custom_id =
the request's cache key), submits them, polls with backoff, and parses and caches every usable reply
exactly as a synchronous call would cache it; map() then reads them all from the cache, so a batch run
and a synchronous run give identical records, and a rerun sends nothing. What the batches did not
answer goes through map()'s synchronous path (re-asks of unparsable replies, a 400's parameter
adaptation): nothing is lost.

An answer is one line with a usable reply for an id the batch asked. An id on more than one line
(the last line must not win), lines for ids the batch never asked, and unusable lines (no body, no
choices, odd types) are no answer: such requests are sent again; the log says how many, once per batch.

Resumable: before a batch is created, the run folder's manifest records its requests' custom ids;
its id is recorded as soon as the provider returns it. Creating a batch is never sent twice blind: a
creation whose reply was lost (or a rerun after a kill before its id was recorded) first looks for the
batch it may have made (`find`: OpenAI's by its input file, Anthropic's by its size and creation time),
since a second batch would be billed again. The manifest is one object per file in the
process (Manifest.at): the target's and the judge's runners share it, every change written under its
lock. A rerun after a kill first collects every recorded batch that holds requests still missing,
instead of submitting them again, and takes all its lines, those of requests the rerun does not ask
included (billed: cached for the call that asks them). Lines that failed for a reason retrying can help
(5xx, rate limit, expired or cancelled) are resubmitted, exactly those, up to `rounds` batch rounds in all.

Polling logs the request counts when they change (else every PROGRESS_EVERY polls) and ends at the
batch's deadline (`deadline` seconds after submission; by default the providers' 24 h window): the
batch is cancelled, and once it has ended (it may stay cancelling for up to CANCEL_GRACE, a wait logged
as polling is) the replies it has are kept and the rest go synchronously. A batch that failed, one the
server no longer knows (HTTP 404: another API key, a purged file), results over the size cap,
or a status without a status field (MALFORMED_POLLS times) is closed in the manifest with its reason,
and its requests are sent again once, in a new batch, then synchronously. A batch given up with lines it
may have run (billed, their replies unread) enters one `lost`, unmetered row in the usage ledger, so
that the run's cost reads unknown rather than short.

Usage: client = Client.open(url, model, batch=lambda c: BatchRunner(c, "runs/x/batches.json", poll=60))
       client.map(requests)
"""
import hashlib
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlparse

import store
from llm_clients import LLMError
from transport import RETRY_STATUS, json_object, same_origin

# Provider limits per batch (OpenAI: 50,000 requests and a 200 MB input file; Anthropic: 100,000
# requests and 256 MB).
LIMITS = {"openai": (50_000, 200 << 20), "anthropic": (100_000, 256 << 20)}
# A batch's results are read whole: far above one chat reply's cap, since a batch of the largest input
# the providers take returns a file of its replies (OpenAI's output files run to hundreds of MB)
RESULTS_CAP = 2 << 30
RETRYABLE_TYPES = ("overloaded_error", "api_error", "rate_limit_error", "timeout_error")
# An OpenAI batch line's error codes that a later batch can answer (its batch reference: the window ended, the batch
# was cancelled, the model's call timed out), as Anthropic's RETRYABLE_TYPES
RETRYABLE_CODES = ("batch_expired", "batch_cancelled", "request_timeout")
ENDED = {"completed", "failed", "expired", "cancelled", "ended"}
DEADLINE = 24 * 3600        # the providers' completion window: a batch still running then is cancelled
# A cancelled batch stays "cancelling" for up to 10 minutes (OpenAI's cancel reference), then ends with the
# lines it ran; waiting for that keeps those replies, which are billed, from being bought again synchronously
CANCEL_GRACE = 600
PROGRESS_EVERY = 10         # polls between progress lines while the counts stay the same
MALFORMED_POLLS = 3         # status replies in a row without a status field before the batch counts as lost
FAILED_POLLS = 8            # status checks in a row that fail (past the transport's retries) before the run stops
GONE = (404, 410)           # the server no longer knows the batch or file
CLOCK_SKEW = 300            # seconds the provider's clock may run behind ours (AnthropicBatches.find)


class BatchUnsupported(LLMError):
    """The server has no batch endpoint (404/405/501 on it), or refused to create the batch (another 4xx that
    retrying cannot help: not 408, 409 or 429)."""


def _refusal(e, label, where):
    """A failed batch creation, in its caller's except clause: BatchUnsupported raised where the server says it
    has no batches or refuses this one; a failure that may pass (a rate limit, a 5xx, no reply, past the
    transport's retries) returns, to be re-raised as the LLMError it is, since BatchUnsupported turns batching
    off for the run (`auto`: every later stage synchronous, at twice the price)."""
    if e.status in (404, 405, 501):
        raise BatchUnsupported(f"{label}: no batch endpoint at {where} (HTTP {e.status})", e.status) from None
    if e.status is not None and 400 <= e.status < 500 and e.status not in RETRY_STATUS:
        raise BatchUnsupported(f"{label}: the batch was refused at creation (HTTP {e.status}): {e}",
                               e.status) from None


class _Lost(Exception):
    """A batch that cannot give its answers (failed, unknown to the server, results over the size
    cap, no status field): closed with this reason, its requests sent again. counts: its last request
    counts (None: unknown), which say how many lines it ran and billed."""

    def __init__(self, reason, state=None, counts=None):
        super().__init__(reason)
        self.state, self.counts = state, counts


class Manifest:
    """The run folder's record of batches: {"batches": [{"digest", "custom_ids", "json", "id", "provider",
    "submitted_at", "status", "collected", "reason"}]}; `json`: one character per custom id, "1" where
    the request asked for JSON (what caching a line for a request a rerun no longer asks needs, see
    BatchRunner._keep); `collected`: closed, nothing more to fetch, `reason` saying why when it did not
    end normally. One object per file in the process (Manifest.at), so that runners sharing a run folder
    (the target's, the judge's) never write over each other's batches: every change is made under its
    lock, and the whole file is rewritten from it (aside, then renamed)."""

    _open = weakref.WeakValueDictionary()     # absolute path -> that file's Manifest, while one is in use
    _open_lock = threading.Lock()

    @classmethod
    def at(cls, path):
        """The one Manifest of `path` in this process (read from the file when first asked for)."""
        path = os.path.abspath(path)
        with cls._open_lock:
            m = cls._open.get(path)
            if m is None:
                m = cls._open[path] = cls(path)
            return m

    def __init__(self, path):
        self.path, self.lock = path, threading.RLock()
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        ok = isinstance(data, dict) and isinstance(data.get("batches"), list)
        self.data = {"batches": [b for b in data["batches"] if isinstance(b, dict) and
                                 isinstance(b.get("custom_ids"), list)] if ok else []}

    def add(self, entry):
        with self.lock:
            self.data["batches"].append(entry)
            self.save()

    def update(self, entry, **fields):
        with self.lock:
            entry.update(fields)
            self.save()

    def ids(self):
        """Every batch id recorded."""
        with self.lock:
            return {b["id"] for b in self.data["batches"] if b.get("id")}

    def open_for(self, keys, created=True):
        """Recorded batches, not yet collected, holding any of `keys`: created (with an id), or (created=False)
        asked for without an id recorded (a kill, or a lost reply, before it came)."""
        with self.lock:
            return [b for b in self.data["batches"] if bool(b.get("id")) is created and not b.get("collected")
                    and not keys.isdisjoint(b["custom_ids"])]

    def save(self):
        """The whole record written aside and renamed (store.atomic_write): whole or as it was."""
        with self.lock:
            store.atomic_write(self.path, json.dumps(self.data, indent=1))


@dataclass
class _Job:
    """One fill_cache() call: its unanswered requests by cache key -> (chat() keywords, body to send),
    and the keys already sent again after a lost batch (that happens once)."""
    desc: str
    todo: dict
    resent: set = field(default_factory=set)


class BatchRunner:
    """A client's batch API (see the module docstring). poll: seconds between status checks at first
    (growing by half each time up to 10x); auto: a server without a batch endpoint falls back to
    synchronous calls (else an error); rounds: batch rounds before what is left goes synchronous;
    deadline: seconds from a batch's submission to its cancellation (None: DEADLINE); limits:
    (requests, bytes) per batch (None: the provider's); results_cap: the largest results file read
    (bytes); log, sleep, clock: replaceable for tests."""

    def __init__(self, client, manifest, poll=60.0, auto=False, rounds=3, limits=None, deadline=None, log=print,
                 sleep=time.sleep, clock=time.time, results_cap=RESULTS_CAP):
        if client.transport.base_url is None:
            raise ValueError(f"{client.label}: the batch API needs an HTTP endpoint")
        self.client, self.manifest = client, Manifest.at(manifest)
        self.poll, self.auto, self.rounds, self.results_cap = poll, auto, rounds, results_cap
        self.deadline = DEADLINE if deadline is None else deadline
        # what a server says (a failure's reasons, ids) is logged with any credential in it masked and its control
        # characters escaped (Transport.shown), and kept masked
        self.log, self.sleep, self.clock = lambda msg: log(client.transport.shown(msg)), sleep, clock
        self.provider = (AnthropicBatches if client.protocol == "anthropic" else OpenAIBatches)(client.transport,
                                                                                                 client.label)
        self.limits = limits or LIMITS[self.provider.name]
        self.unsupported, self.stats = False, {"batches": 0, "lines": 0, "cached": 0, "retried": 0, "closed": 0}

    # --- the runner

    def fill_cache(self, requests_, desc="batch"):
        """Every request of `requests_` (chat() keyword dicts) not in the reply cache, answered through
        batches where they can be; what is left is for map()'s synchronous path."""
        if self.unsupported:
            return
        todo = {}
        for r in requests_:
            key, body = self.client.request_key(**r)
            if key not in todo and self.client.cache.get_raw(key) is None:
                todo[key] = (r, body)
        job = _Job(desc, todo)
        for _ in range(self.rounds):
            if not job.todo:
                return
            try:
                again = self._round(job)
            except BatchUnsupported as e:
                if not self.auto:
                    raise
                self.unsupported = True
                self.log(f"[batch] {e}; --batch-api auto: synchronous calls instead")
                return
            self.stats["retried"] += len(again)
            job.todo = {k: job.todo[k] for k in again}
        if job.todo:
            self.log(f"[batch] {desc}: {len(job.todo)} requests still unanswered after {self.rounds} batch rounds: "
                     "sent synchronously")

    def _round(self, job):
        """One round: recorded batches collected, the rest submitted and collected -> keys to send again."""
        again, keys = set(), set(job.todo)
        for b in self.manifest.open_for(keys, created=False):     # made before a kill? (else sent again)
            found = self.provider.find(b, self.manifest.ids())
            made = {"id": _id(found, self.client.label, "batch"), "submitted_at": b.get("tried_at")} if found else {}
            self.manifest.update(b, **(made or {"collected": True, "reason": "not found"}))
        for b in self.manifest.open_for(keys):
            again |= self._collect(b, job)
            keys -= set(b["custom_ids"])
        keys = [k for k in job.todo if k in keys and self.client.cache.get_raw(k) is None]
        for chunk in self._chunks(keys, job.todo):
            again |= self._collect(self._submit(chunk, job), job)
        return again

    def _chunks(self, keys, todo):
        """Keys split at the provider's limits (requests and bytes per batch)."""
        out, cur, size = [], [], 0
        for k in keys:
            n = len(json.dumps(self.provider.line(k, todo[k][1]))) + 1
            if cur and (len(cur) == self.limits[0] or size + n > self.limits[1]):
                out.append(cur)
                cur, size = [], 0
            cur.append(k)
            size += n
        return out + ([cur] if cur else [])

    def _submit(self, chunk, job):
        """Record the chunk, create its batch, record the id -> the manifest entry."""
        entry = {"digest": hashlib.sha256("".join(sorted(chunk)).encode()).hexdigest()[:16], "custom_ids": chunk,
                 "json": "".join("1" if job.todo[k][0].get("json") else "0" for k in chunk), "id": None,
                 "provider": self.client.label, "submitted_at": None, "status": None, "collected": False,
                 "reason": None, "tried_at": self.clock()}
        self.manifest.add(entry)
        def made_meanwhile():        # before each retry of the creation: the batch an attempt made, if any
            found = self.provider.find(entry, self.manifest.ids())
            if found is None:        # the next attempt may make it: AnthropicBatches.find's window runs on
                self.manifest.update(entry, last_try=self.clock())
            return found
        try:
            batch_id = self.provider.create([self.provider.line(k, job.todo[k][1]) for k in chunk],
                                            lambda **f: self.manifest.update(entry, **f), made_meanwhile)
        except BatchUnsupported:                # refused: nothing was made
            self.manifest.update(entry, collected=True, reason="refused at creation")
            raise
        self.manifest.update(entry, id=batch_id, submitted_at=self.clock())
        self.stats["batches"] += 1
        self.stats["lines"] += len(chunk)
        self.log(f"[batch] {job.desc}: batch {batch_id} of {len(chunk)} requests submitted "
                 f"(deadline: {_span(self.deadline)})")
        return entry

    def _collect(self, entry, job):
        """Poll the batch until it ends or its deadline passes; cache every usable reply -> keys worth
        another batch (a lost batch's: see _lost; past the deadline: none, the rest go synchronously)."""
        try:
            status, late = self._poll(entry, job.desc)
            if status["state"] == "failed":
                raise _Lost(f"failed ({status['why']})", "failed", status["counts"])
            results = self._results(status, entry, job.desc) if status["state"] in ENDED else {}
        except _Lost as e:
            return self._lost(entry, job, e)
        again, kept = self._take(entry, job, results)
        if status["state"] not in ENDED:       # given up still cancelling (or no status): its lines go unread
            self._unread(entry, status["state"], status["counts"])
        self.manifest.update(entry, status=status["state"], collected=True, reason="deadline" if late else None)
        if not late:
            return again
        rest = [k for k in entry["custom_ids"] if k in job.todo and self.client.cache.get_raw(k) is None]
        self.log(f"[batch] {job.desc}: batch {entry['id']} still running at its deadline ({_span(self.deadline)} "
                 f"after submission): cancelled; {kept} replies kept, {len(rest)} requests sent synchronously")
        return set()

    def _lost(self, entry, job, lost):
        """A batch that cannot give its answers: the lines it ran entered in the ledger (_unread), closed in
        the manifest with the reason; its unanswered requests are sent again once, in a new batch, then
        synchronously -> the keys to send again."""
        self._unread(entry, lost.state, lost.counts)
        self.manifest.update(entry, status=lost.state or entry.get("status"), collected=True,
                             reason=self.client.transport.mask(str(lost)))
        self.stats["closed"] += 1
        keys = [k for k in entry["custom_ids"] if k in job.todo and self.client.cache.get_raw(k) is None]
        again = {k for k in keys if k not in job.resent}
        job.resent |= again
        sync = len(keys) - len(again)
        then = ", ".join(([f"{len(again)} requests go into a new batch"] if again else []) +
                         ([f"{sync} requests are sent synchronously"] if sync else [])) or "nothing left to send"
        self.log(f"[batch] {job.desc}: batch {entry['id']} {lost}: closed; {then}")
        return again

    def _unread(self, entry, state, counts):
        """A batch given up with lines it may have run, their replies unread: one ledger row under the batch
        label, {"lost": n, "unmetered": 1}, as Client._lost enters a synchronous reply lost, so that the cost
        reads unknown rather than short (the requests are bought again). n: the lines the provider counts as
        completed; with no counts, every line (each may have run or still run), save a failed batch's (it
        failed validation: none ran). Entered before the manifest closes the batch: a kill between the two
        enters it twice on the rerun, which leaves the cost unknown, never short."""
        n = counts[0] if counts else 0 if state == "failed" else len(entry["custom_ids"])
        if n:
            self.client._enter({"lost": n, "unmetered": 1}, mode="batch")

    def _poll(self, entry, desc):
        """Status checks with backoff until the batch ends -> (status, False); at its deadline it is
        cancelled -> (its status then, True). The request counts are logged when they change, else
        every PROGRESS_EVERY polls. Raises _Lost (unknown to the server, or no status field)."""
        end = (entry.get("submitted_at") or self.clock()) + self.deadline
        wait, shown, polls, malformed, failed = self.poll, None, 0, 0, 0
        while True:
            try:
                status = self._status(entry["id"])
            except LLMError as e:        # a network outage or a 5xx past the transport's retries: the batch
                failed += 1              # runs on at the provider; polled again, up to FAILED_POLLS in a row
                if failed >= FAILED_POLLS or (e.status is not None and e.status not in RETRY_STATUS):
                    raise
                self.log(f"[batch] {desc}: batch {entry['id']}: no status ({e}); asking again")
                self.sleep(min(wait, max(0.0, end - self.clock())))
                wait = min(wait * 1.5, 10 * self.poll)
                continue
            polls, failed = polls + 1, 0
            malformed = malformed + 1 if status["state"] is None else 0
            if malformed >= MALFORMED_POLLS:
                raise _Lost(f"answered {malformed} status checks in a row without a status field")
            if status["state"] in ENDED:       # past the deadline (a resume after a kill while cancelling):
                return status, not status.get("completed") and self.clock() >= end      # its rest synchronous
            shown = self._show(desc, entry["id"], status, shown, polls)
            left = end - self.clock()
            if left <= 0:
                return self._cancelled(entry["id"], desc), True
            self.sleep(min(wait, left))
            wait = min(wait * 1.5, 10 * self.poll)

    def _show(self, desc, batch_id, status, shown, polls):
        """Log the batch's status when its request counts changed since `shown`, else every PROGRESS_EVERY
        polls -> the status in words."""
        progress = _progress(status)
        if progress != shown or polls % PROGRESS_EVERY == 0:
            self.log(f"[batch] {desc}: batch {batch_id} {progress}")
        return progress

    def _cancelled(self, batch_id, desc):
        """Cancel the batch and wait while it is cancelling, up to CANCEL_GRACE -> its status then: ended
        (its lines are taken) or not (nothing is taken, the lines it ran are entered in the ledger as lost:
        _unread; the rest go synchronously). The wait is logged as it starts, then as polling logs progress."""
        status, end, wait, polls = self._cancel(batch_id), self.clock() + CANCEL_GRACE, self.poll, 0
        shown = _progress(status)
        if status["state"] is not None and status["state"] not in ENDED:
            self.log(f"[batch] {desc}: batch {batch_id} {shown}: waiting up to {_span(CANCEL_GRACE)} for the "
                     "cancel to end, to keep the lines it ran")
        while status["state"] is not None and status["state"] not in ENDED:
            left = end - self.clock()
            if left <= 0:
                self.log(f"[batch] {desc}: batch {batch_id} still {status['state']} {_span(CANCEL_GRACE)} after its "
                         "cancel: the lines it ran are not taken (the ledger counts them as lost)")
                break
            self.sleep(min(wait, left))
            wait = min(wait * 1.5, 10 * self.poll)
            try:
                status = self._status(batch_id)
            except (LLMError, _Lost) as e:
                self.log(f"[batch] {desc}: batch {batch_id}: no status after its cancel ({e})")
                break
            polls += 1
            if status["state"] not in ENDED:
                shown = self._show(desc, batch_id, status, shown, polls)
        return status

    def _results(self, status, entry, desc):
        """The ended batch's lines -> {custom_id: ("ok", reply) | ("retry", why) | ("fail", why)}. An id
        on more than one line is no answer (sent again); lines for ids never asked are dropped."""
        asked, seen = set(entry["custom_ids"]), {}
        lines, stray = self._lines(status, asked)
        for rec in lines:
            seen[rec["custom_id"]] = seen.get(rec["custom_id"], 0) + 1
        twice = {k for k, n in seen.items() if n > 1}
        if twice or stray:
            self.log(f"[batch] {desc}: batch {entry['id']}: {len(twice)} requests answered on more than one line "
                     f"and {stray} lines for ids it never asked: not taken (those requests are sent again)")
        return {rec["custom_id"]: ("retry", "more than one line") if rec["custom_id"] in twice
                else self.provider.outcome(rec) for rec in lines}

    def _take(self, entry, job, results):
        """Cache the usable replies of one ended batch -> (keys worth another batch, replies kept). Every line
        is taken, whatever this call asks: a batch made before a kill and collected by a rerun that asks
        fewer requests holds the others' replies, billed, which a later call then reads from the cache."""
        again, kept = set(), 0
        mask = entry.get("json")
        asked_json = dict(zip(entry["custom_ids"], mask)) if isinstance(mask, str) and \
            len(mask) == len(entry["custom_ids"]) else None
        for key in entry["custom_ids"]:
            if self.client.cache.get_raw(key) is not None:
                continue                                   # answered already (and counted then)
            kind, got = results.get(key, ("retry", "no line"))     # no line: expired or cancelled unrun
            if key not in job.todo:                        # another call's request: cached for it
                if kind == "ok" and self._keep(key, got, asked_json):
                    kept += 1
            elif kind == "retry":
                again.add(key)
            elif kind == "ok" and self._store(key, got, job.todo[key][0]):
                kept += 1
            # "fail", and replies no parser takes: left to the synchronous path (a 400's adaptation, re-asks)
        self.stats["cached"] += kept
        return again, kept

    def _store(self, key, reply, request):
        """A line's reply parsed, counted and cached as chat() would -> True if cached. A reply of a
        shape no parser takes (no choices, a null message, odd usage) is no answer, not an error."""
        try:
            return self.client.store(key, reply, request.get("json", False), request.get("check"), mode="batch")
        except (LLMError, ValueError, TypeError, AttributeError, RecursionError, OverflowError):
            return False

    def _keep(self, key, reply, asked_json):
        """A line for a request this call does not ask -> True if cached: cached as chat() caches it, its
        JSON parsed where the manifest says it asked for JSON (`check`, a function, is not recorded: chat()
        applies it to a cached reply, asking again where it fails). Without that record (an entry written
        before it was kept) the reply cannot be cached under its key: it is counted, being billed, no more."""
        if asked_json is not None:
            return self._store(key, reply, {"json": asked_json[key] == "1"})
        try:
            self.client._receive(reply, "batch")           # counts it, even where it does not parse
        except (LLMError, ValueError, TypeError, AttributeError, RecursionError, OverflowError):
            pass
        return False

    # --- the providers' endpoints

    def _status(self, batch_id):
        """GET the batch -> {"state" (None without a status field), "counts", "completed" (it ended on its own),
        where its results are, "why" it failed}. Raises _Lost when the server no longer knows it."""
        try:
            b = self.client.transport.send("GET", self.provider.path(batch_id))
        except LLMError as e:
            if e.status in GONE:
                raise _Lost(f"is unknown to the server (HTTP {e.status}: another API key, or deleted)") from None
            raise
        return self.provider.status(b if isinstance(b, dict) else {})

    def _cancel(self, batch_id):
        """Ask the server to cancel the batch -> its status after that ({"state": None} if unknown). A
        refused cancel (one already cancelling, after a kill) still reads the status."""
        try:
            self.client.transport.send("POST", self.provider.path(batch_id) + "/cancel", {})
        except LLMError as e:
            self.log(f"[batch] batch {batch_id}: the cancel was not confirmed ({e})")
        try:
            return self._status(batch_id)
        except (LLMError, _Lost) as e:
            self.log(f"[batch] batch {batch_id}: no status after the cancel ({e})")
            return {"state": None, "counts": None}

    def _lines(self, status, asked):
        """The JSONL lines of an ended batch (the provider's result files) for the ids in `asked` -> (those lines,
        how many name another id). Raises _Lost for results the server no longer has, or over the size cap."""
        out, stray = [], 0
        for url in self.provider.result_urls(status):
            try:
                got, n = _jsonl(self.client.transport.send("GET", url, raw=True, max_bytes=self.results_cap), asked)
                out, stray = out + got, stray + n          # (OpenAI's: an output and an error file)
            except LLMError as e:
                if e.status in GONE or e.status == 200:        # 200: refused unread, over results_cap
                    raise _Lost(f"has results the server no longer has ({urlparse(url).path}: HTTP {e.status})"
                                if e.status in GONE else f"has results over the size cap ({self.results_cap} bytes)",
                                status["state"], status.get("counts")) from None
                raise
        return out, stray


# ----------------------------------------------------------------------------- the providers


class OpenAIBatches:
    """OpenAI's Batch API (and any OpenAI-shaped server with /v1/batches): the input uploaded as a JSONL
    file, the batch created over it; results in an output file and an error file
    (https://platform.openai.com/docs/api-reference/batch)."""
    name = "openai"

    def __init__(self, transport, label):
        self.transport, self.label, self.base = transport, label, transport.base_url

    def line(self, key, body):
        return {"custom_id": key, "method": "POST", "url": urlparse(self.base + "/chat/completions").path,
                "body": body}

    def create(self, lines, record, again):
        """Upload the lines (`record` keeps the file's id in the manifest entry) and create the batch (`again`:
        the batch a lost creation reply may have made) -> its id; a refusal at creation is BatchUnsupported."""
        data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8")
        try:
            f = self.transport.send("POST", self.base + "/files", files={
                "purpose": (None, "batch"), "file": ("batch.jsonl", data, "application/jsonl")})
            record(input_file_id=_id(f, self.label, "file"))
            b = self.transport.send("POST", self.base + "/batches", {
                "input_file_id": f["id"], "completion_window": "24h",
                "endpoint": urlparse(self.base + "/chat/completions").path}, again=again)
        except LLMError as e:
            _refusal(e, self.label, f"{self.base}/batches")
            raise
        return _id(b, self.label, "batch")

    def find(self, entry, known):
        """The batch made from the entry's input file (each upload is a file of its own), among the newest
        100 -> its object, or None (also where the server lists no batches)."""
        fid = entry.get("input_file_id")
        page = _listing(self.transport, self.base + "/batches?limit=100") if fid else []
        return next((b for b in page if b.get("input_file_id") == fid and isinstance(b.get("id"), str)
                     and b["id"] not in known), None)

    def path(self, batch_id):
        return f"{self.base}/batches/{batch_id}"

    def status(self, b):
        """An OpenAI Batch object -> the runner's status (see BatchRunner._status)."""
        rc = json_object(b.get("request_counts"))
        counts = tuple(_int(rc.get(k)) for k in ("completed", "failed", "total"))
        errors = json_object(b.get("errors")).get("data")
        errors = errors if isinstance(errors, list) else []         # a list of {code, message, ...}; else none
        why = "; ".join(self.transport.mask(str(json_object(e).get("message")))[:200]     # masked, then cut
                        for e in errors[:3] if json_object(e).get("message"))
        fids = [f if isinstance(f, str) and f else None for f in (b.get("output_file_id"), b.get("error_file_id"))]
        return {"state": b.get("status") if isinstance(b.get("status"), str) else None,
                "counts": counts if None not in counts else None, "why": why or "the provider gave no reason",
                "completed": b.get("status") == "completed",
                "output": fids[0], "errors": fids[1]}

    def result_urls(self, status):
        return [f"{self.base}/files/{fid}/content" for fid in (status.get("output"), status.get("errors")) if fid]

    @staticmethod
    def outcome(rec):
        """One line of an output or error file -> ("ok", reply) | ("retry", why) | ("fail", why)."""
        resp, err = json_object(rec.get("response")), json_object(rec.get("error"))
        code = _int(resp.get("status_code"))
        if code == 200 and isinstance(resp.get("body"), dict):
            return "ok", resp["body"]
        if code in (408, 409, 429) or (code or 0) >= 500 or err.get("code") in RETRYABLE_CODES:
            return "retry", str(code or err.get("code"))
        return "fail", json.dumps(resp.get("body") or err)[:200]


class AnthropicBatches:
    """Anthropic's Message Batches: the requests posted in the create call; results as one JSONL at the
    batch's results_url (https://docs.anthropic.com/en/api/creating-message-batches)."""
    name = "anthropic"

    def __init__(self, transport, label):
        self.transport, self.label, self.base = transport, label, transport.base_url

    def line(self, key, body):
        return {"custom_id": key, "params": body}

    def create(self, lines, record, again):
        """Create the batch with its requests (`again`: the batch a lost creation reply may have made) -> its
        id; a refusal at creation is BatchUnsupported."""
        try:
            b = self.transport.send("POST", self.base + "/messages/batches", {"requests": lines}, again=again)
        except LLMError as e:
            _refusal(e, self.label, f"{self.base}/messages/batches")
            raise
        return _id(b, self.label, "batch")

    def find(self, entry, known):
        """A Message Batch has no metadata and no input file: among the newest 100 not `known` (recorded in
        the manifest), one with as many requests created nearest after the entry was tried (else within
        CLOCK_SKEW before), while the creation call could still run (its last attempt, from its last_try, to
        its timeout and longest Retry-After) -> its object, or None. A batch made later is another run's:
        adopted, it would be cancelled at this entry's deadline. Another client's batch of that size taken by
        mistake costs a round, never an answer: its lines name other custom ids. Residual risk: two runners
        killed before either recorded its id may each adopt the other's batch (the API shows no request ids
        before results exist); each then resends its requests, and the other's billed lines are counted by
        neither."""
        tried, t = entry.get("tried_at"), self.transport
        page = _listing(t, self.base + "/messages/batches?limit=100") if tried else []
        last = (entry.get("last_try") or tried or 0) + CLOCK_SKEW + (t.connect_timeout + t.timeout +
                                                                      t.max_retry_after)   # one attempt's span
        fits = []
        for b in page:
            try:
                made = datetime.fromisoformat(str(b.get("created_at"))).timestamp()
            except (ValueError, OverflowError):        # (a year the platform's clock cannot hold)
                continue
            n, bid = self.counts(b), b.get("id")
            if isinstance(bid, str) and bid not in known and n and sum(n.values()) == len(entry["custom_ids"]) and \
                    tried - CLOCK_SKEW <= made <= last:
                fits.append((made < tried, abs(made - tried), b))
        return min(fits, key=lambda f: f[:2])[2] if fits else None

    def path(self, batch_id):
        return f"{self.base}/messages/batches/{batch_id}"

    @staticmethod
    def counts(b):
        """A MessageBatch's request counts by kind (processing, succeeded, ...), or None where one is missing."""
        rc = json_object(b.get("request_counts"))
        n = {k: _int(rc.get(k)) for k in ("processing", "succeeded", "errored", "canceled", "expired")}
        return None if None in n.values() else n

    def status(self, b):
        """A MessageBatch object -> the runner's status (see BatchRunner._status). Its request counts are
        read once it has ended only: until the whole batch ends every request counts as processing (the
        Message Batches reference), so a batch given up before that may have run any of its lines. It
        completed when it ended neither cancelled nor with a request expired."""
        n, state = self.counts(b), b.get("processing_status")
        counts = (n["succeeded"], n["errored"] + n["canceled"] + n["expired"], sum(n.values())) \
            if n and state == "ended" else None
        return {"state": state if isinstance(state, str) else None, "counts": counts, "why": "",
                "completed": state == "ended" and not b.get("cancel_initiated_at") and not (n or {}).get("expired"),
                "results_url": b.get("results_url") if isinstance(b.get("results_url"), str) else None}

    def result_urls(self, status):
        """The results_url, on the API's own scheme, host and port only (elsewhere the key would go there, or in
        clear text over http): another is a batch that cannot give its answers."""
        url = status.get("results_url")
        if url and not same_origin(url, self.base):
            where = urlparse(url)
            raise _Lost(f"has a results_url elsewhere ({where.scheme}://{where.netloc.rpartition('@')[2]}), refused",
                        status["state"], status.get("counts"))
        return [url] if url else []

    @staticmethod
    def outcome(rec):
        """One line of the results -> ("ok", message) | ("retry", why) | ("fail", why)."""
        res = json_object(rec.get("result"))
        err = json_object(res.get("error"))
        err = json_object(err.get("error")) if err.get("type") == "error" else err    # wrapped: {type: error, error}
        if res.get("type") == "succeeded" and isinstance(res.get("message"), dict):
            return "ok", res["message"]
        if res.get("type") in ("canceled", "expired") or err.get("type") in RETRYABLE_TYPES:
            return "retry", str(res.get("type"))
        return "fail", json.dumps(res)[:200]


# ----------------------------------------------------------------------------- the providers' shapes


def _int(x):
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _listing(transport, url):
    """A list endpoint's batch objects (its `data`); [] where the server lists none (HTTP 400, 404, 405)."""
    try:
        page = json_object(transport.send("GET", url)).get("data")
    except LLMError as e:
        if e.status in (400, 404, 405):
            return []
        raise
    return [b for b in page if isinstance(b, dict)] if isinstance(page, list) else []


def _id(reply, label, what):
    """The id of a created file or batch; a reply without one is an error naming it."""
    if not isinstance(json_object(reply).get("id"), str):
        raise LLMError(f"{label}: the {what} creation reply has no id (its fields: {sorted(json_object(reply))[:10]})")
    return reply["id"]


def _progress(status):
    """A status in words: 'in_progress: 40/100 completed, 2 failed'."""
    state, c = status["state"] or "(no status field)", status.get("counts")
    return f"{state}: {c[0]}/{c[2]} completed, {c[1]} failed" if c else f"{state} (no request counts)"


def _jsonl(text, asked):
    """A results file -> (its records whose custom_id is in `asked`, how many name another id). Read a line
    ("\n") at a time and a record for an id never asked dropped as it is parsed: a file of such lines costs
    no parsed objects; a line that does not parse (nested past the parser's depth included) is no record."""
    out, stray, text, start = [], 0, text or "", 0
    while start < len(text):                    # no list of every line, no copy of the text
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line, start = text[start:end], end + 1
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("custom_id"), str):
            if rec["custom_id"] in asked:
                out.append(rec)
            else:
                stray += 1
    return out, stray


def _span(seconds):
    return f"{seconds:g} s" if seconds < 3600 else f"{seconds / 3600:g} h"
