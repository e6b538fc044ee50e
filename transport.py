"""HTTP transport for the raw-HTTP API clients: POST JSON to one API with retries where retrying can
help, a deadline on each whole exchange, credentials held apart and masked, a rate limit, counters.
llm_clients.py's chat clients, rerank_clients.py's rerank clients and build_bench.py's search client send
through it.

Conventions (those of the openai-python and anthropic-sdk-python clients, whose retry schedule is reproduced):
- retries only where retrying can help: connection errors, timeouts, 408/409/429/5xx/529, backoff
  min(0.5 * 2^n, 8) s with 25% jitter (the Stainless SDKs' schedule); a server hint (retry-after-ms,
  Retry-After) is honoured up to `max_retry_after` s, a longer hint fails at once; never retried:
  400/401/403/404/422, `insufficient_quota` and spend limits;
- `timeout` bounds a whole exchange, a proxy's CONNECT reply, status line and headers included (a name
  lookup excepted: the resolver cannot be interrupted): a Deadline shuts the socket when it runs out, so a
  reply trickled a byte at a time cannot hold a request open. requests' own timeouts
  bound each read, not the exchange (test_llm_clients.py shows such a reply outliving them), and
  requests hands the socket over only with the headers, so this reaches into urllib3: its connection
  and pool classes subclassed, installed through PoolManager.pool_classes_by_scheme; requirements.txt
  pins the urllib3 range it is written against (2.x);
- a TLS handshake refused (a certificate refused, a server not speaking TLS) is not retried: nothing was
  sent, and sending again meets the same refusal; a handshake cut short is retried, never booked as billed;
- every failure raises LLMError(status, provider, short body), a server's control characters in it as \\xHH.

Usage: t = Transport("https://api.openai.com/v1", "openai:gpt-5.5", api_key=key); t.post(body)   # protocol's path
"""
import base64
import http.client
import json
import math
import os
import random
import re
import ssl
import threading
import time
from datetime import timezone
from email.utils import parsedate_to_datetime
from urllib.parse import quote, urlparse

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection    # requests' own HTTP layer
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import NewConnectionError, SSLError

import endpoints
from endpoints import CONTROL_CHARS

# transport failures worth another attempt: refused or reset connections, timeouts, a reply cut short
RETRY_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                requests.exceptions.ContentDecodingError, http.client.IncompleteRead, ConnectionError)
# statuses worth another attempt, as the OpenAI and Anthropic SDKs retry them: 408, 409, 429 and every 5xx (a
# gateway's 520-524 too) but 501 and 505, which say the request can never succeed
RETRY_STATUS = frozenset({408, 409, 429} | set(range(500, 600)) - {501, 505})
ABORT_GRACE = 1.0                # seconds a reply in flight may still arrive after its run failed
NO_RETRY_CODES = ("insufficient_quota", "billing_hard_limit_reached", "enforced_spend_limit_reached",
                  "spend_limit", "billing_error")
_SURROGATE = re.compile("[\ud800-\udfff]")


class TLSHandshakeError(SSLError):
    """The TLS handshake of a new connection failed (_NotesDeadline.connect raises it): nothing was sent."""


def refused(e):
    """Whether a transport failure came before the request was sent (no connection made): nothing billed."""
    cause = e.args[0] if isinstance(e, requests.ConnectionError) and e.args else None
    return isinstance(e, requests.ConnectTimeout) or isinstance(getattr(cause, "reason", None), NewConnectionError)


# Handshake failures that sending again meets too: a certificate refused, a server that does not speak TLS (or
# not a version we offer). Others (the connection cut mid-handshake by a proxy or balancer) are retried.
REFUSED_HANDSHAKE = ("CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER", "UNSUPPORTED_PROTOCOL",
                     "TLSV1_ALERT_PROTOCOL_VERSION")


def handshake_failure(e):
    """The TLS handshake failure behind a requests error (see TLSHandshakeError), or None."""
    cause = e.args[0] if isinstance(e, requests.exceptions.SSLError) and e.args else None
    reason = getattr(cause, "reason", None)
    return reason if isinstance(reason, TLSHandshakeError) else None


def refused_handshake(tls):
    """Whether a handshake failure (handshake_failure) is a refusal that a retry would meet again."""
    return tls is not None and any(r in str(tls.args[0] if tls.args else tls) for r in REFUSED_HANDSHAKE)


def same_origin(url, home):
    """Whether `url` (a URL or an Endpoint) is on `home`'s scheme, host and port, a port left out read as the
    scheme's (443, 80): the test before a provider's key goes to it, since the host alone would let it go in
    clear text (http://) or to another port. A URL string with credentials of its own, or one that does not
    parse, is not; an Endpoint is compared on scheme, host and port alone (its credentials are its own)."""
    def origin(u):
        try:
            e = u if isinstance(u, endpoints.Endpoint) else endpoints.Endpoint.parse(u)
        except ValueError:                   # not http(s)://HOST[:PORT]
            return None
        return None if e.basic and not isinstance(u, endpoints.Endpoint) else (e.scheme, e.host, e.port)
    mine = origin(url)
    return mine is not None and mine == origin(home)


def json_object(x):
    """x if it is a JSON object, else {}: a field of a reply of the wrong type reads as absent."""
    return x if isinstance(x, dict) else {}


def no_lone_surrogates(obj):
    """Every string in a parsed reply with lone surrogates (a JSON "\\ud800" escape, or one a handler
    made) replaced by U+FFFD, as a UTF-8 decoder replaces bytes it cannot read: such text cannot be
    written as UTF-8 (cache, records) and means nothing. Paired escapes are one character already."""
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {no_lone_surrogates(k): no_lone_surrogates(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_lone_surrogates(v) for v in obj]
    return obj


class LLMError(RuntimeError):
    """Any failed LLM call. .status is the HTTP status (None for transport or parse failures)."""

    def __init__(self, message, status=None, provider=None, body=None):
        super().__init__(message)
        self.status, self.provider, self.body = status, provider, body


# ----------------------------------------------------------------------------- transport


class RateLimiter:
    """At most `rpm` request starts per minute across threads (evenly spaced)."""

    def __init__(self, rpm):
        self.interval = 60.0 / rpm if rpm else 0.0
        self.lock, self.next = threading.Lock(), 0.0

    def wait(self):
        if not self.interval:
            return
        with self.lock:
            now = time.monotonic()
            t = max(now, self.next)
            self.next = t + self.interval
        if t > now:
            time.sleep(t - now)


class Deadline:
    """One exchange (connect, request, status line, headers, body) within `seconds`: a watchdog timer
    shuts the socket it is on when they run out, so a reply trickled a byte at a time ends like a stalled
    one. requests hands the socket over only with the headers, too late for a reply trickled from its
    first byte, so the connections of Transport's session note themselves here as they connect and send."""

    def __init__(self, seconds):
        self.at = time.monotonic() + seconds
        self.conn, self.ended = None, False     # the urllib3 connection noted last; end() has run
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self.end)
        self.timer.daemon = True
        self.timer.start()

    def note(self, conn):
        """`conn` carries the exchange now; shut at once when the exchange has already ended."""
        with self.lock:
            self.conn = conn
            if self.ended:
                endpoints.shut(getattr(conn, "sock", None))

    def end(self):
        """Shut the exchange's socket now, and any it goes on to use (the deadline, or Transport.abort)."""
        with self.lock:
            self.ended = True
            endpoints.shut(getattr(self.conn, "sock", None))

    def passed(self):
        return time.monotonic() >= self.at

    def cancel(self):
        self.timer.cancel()


# The Deadline of the exchange the calling thread is sending, read by the noting connections: a thread
# sends one request at a time, and requests calls the connection in the thread that sends
_SENDING = threading.local()


class _NotesDeadline:
    """urllib3's connection, noting itself in the calling thread's Deadline as it connects (a fresh
    connection) and as it sends a request (a kept-alive one)."""

    def connect(self):
        _note(self)                  # before: a proxy's CONNECT reply is read inside connect(), on self.sock
        try:
            super().connect()
        except (ssl.SSLError, SSLError) as e:    # raised only by the handshake: told apart from a read's later
            raise TLSHandshakeError(e) from e
        _note(self)

    def request(self, *args, **kw):
        _note(self)
        return super().request(*args, **kw)


def _note(conn):
    deadline = getattr(_SENDING, "deadline", None)
    if deadline is not None:
        deadline.note(conn)


class _NotingHTTPConnection(_NotesDeadline, HTTPConnection):
    pass


class _NotingHTTPSConnection(_NotesDeadline, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _NotingHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _NotingHTTPSConnection


class DeadlineAdapter(HTTPAdapter):
    """requests' adapter on pools of noting connections (a proxy's pools too; a SOCKS proxy's keep their
    own, whose socket the Deadline gets only with the headers)."""
    POOLS = {"http": _HTTPPool, "https": _HTTPSPool}

    def init_poolmanager(self, *args, **kw):
        super().init_poolmanager(*args, **kw)
        self.poolmanager.pool_classes_by_scheme = self.POOLS

    def proxy_manager_for(self, proxy, **kw):
        manager = super().proxy_manager_for(proxy, **kw)
        if not proxy.lower().startswith("socks"):
            manager.pool_classes_by_scheme = self.POOLS
        return manager


class Transport:
    """POST JSON to one API with retries where retrying can help (module docstring), credentials sent
    only in headers and masked in every error, a rate limit, and counters. `handler`: a callable
    body -> response dict instead of HTTP (the offline engine in-process)."""

    def __init__(self, base_url, label, protocol="openai", api_key=None, timeout=600, connect_timeout=10,
                 max_retries=2, max_retry_after=60, rpm=0, handler=None, provider=None, endpoint=None,
                 max_reply_bytes=64 << 20, bearer=False):
        # base_url: a URL or an Endpoint. Credentials in it (http://user:pass@host/v1) are held apart:
        # they go only into an explicit Basic header when no API key is given, never into cache
        # keys, messages or logs
        ep = (base_url if isinstance(base_url, endpoints.Endpoint) or not base_url
              else endpoints.Endpoint.parse(base_url))
        self.where = ep or None                  # None: an in-process handler
        self._basic, self.base_url = (ep.basic, ep.url) if ep else (None, None)
        self.label, self.protocol, self.provider = label, protocol, provider or protocol
        if api_key and not re.fullmatch(r"[!-~]+", api_key):   # requests would echo the header in its error
            raise LLMError(f"{label}: the API key holds a space, a line ending or a character outside printable "
                           "ASCII (copied from a file with CRLF lines?); the key is not shown", None, self.provider)
        self._key = api_key                      # never logged, never cached, never in errors
        self.bearer = bearer                     # Anthropic: the key is an auth token (Authorization: Bearer)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_retries, self.max_retry_after = max_retries, max_retry_after
        self.handler = handler
        self.endpoint = endpoint                 # the full URL to POST to (default: the chat endpoint)
        self.max_reply_bytes = max_reply_bytes
        self.limiter = RateLimiter(rpm)
        self.aborted = threading.Event()         # set by abort(): the run has failed, stop sending
        self.abort_at = 0.0                      # when abort() shuts the sockets still open
        self.sleep = self.aborted.wait           # backoff sleep, woken by abort (tests replace it)
        self.session = requests.Session()
        self.session.auth = lambda r: r          # the key goes in headers(): a ~/.netrc entry would replace it
        if ep and endpoints.LOOPBACK_NAMES.fullmatch(ep.host.lower()):
            self.session.trust_env = False       # reached directly: an environment proxy would take its prompts
            self.session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        for scheme in ("http://", "https://"):   # connections that tell a Deadline their socket (see there)
            self.session.mount(scheme, DeadlineAdapter())
        self.lock = threading.Lock()
        self.exchanges = set()                   # the Deadlines of requests in flight (abort ends them)
        self.http_calls = self.retries = 0
        self.on_lost = None                      # called when a reply the server may have billed is lost

    @property
    def url(self):
        return self.base_url + ("/messages" if self.protocol == "anthropic" else "/chat/completions")

    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.protocol == "anthropic":
            h["anthropic-version"] = "2023-06-01"
            if self._key:
                h.update({"Authorization": f"Bearer {self._key}"} if self.bearer else {"x-api-key": self._key})
        elif self._key:
            h["Authorization"] = f"Bearer {self._key}"
        if self._basic and "Authorization" not in h and "x-api-key" not in h:   # the URL's user:pass
            h["Authorization"] = "Basic " + base64.b64encode(":".join(self._basic).encode()).decode()
        return h

    def secrets(self):
        """Every form in which a credential could come back in an error body: the key, the URL's user
        and password (also percent-encoded), and their Basic-auth base64."""
        out = [self._key] if self._key else []
        if self._basic:
            user, pw = self._basic
            pair = f"{user}:{pw}"
            out += [pair, base64.b64encode(pair.encode()).decode(), pw, quote(pw, safe=""), quote(user, safe="")]
        return sorted((s for s in out if s and len(s) >= 3), key=len, reverse=True)   # longest first

    def mask(self, text):
        """`text` with every form of this transport's credentials (secrets()) as ***."""
        for s in self.secrets():
            text = text.replace(s, "***")
        return text

    def shown(self, text):
        """`text` as it may be printed: credentials masked, control characters as \\xHH (CONTROL_CHARS)."""
        return self.mask(text).translate(CONTROL_CHARS)

    def error(self, msg, status=None, body=None):
        text = self.mask(body or "")[:300]   # masked BEFORE the body is cut: a cut must not leave part of a key
        # .body keeps the text as sent (RequestShape.adapt reads it); the message is escaped for the terminal
        return LLMError(f"{self.label}: {self.shown(msg)}" + (f": {self.shown(text)}" if text else ""), status,
                        self.provider, text)

    def retry_after(self, headers):
        """Server hint in seconds (retry-after-ms, else Retry-After: seconds or an HTTP date), or None where
        neither is a finite number of seconds from now on."""
        for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
            v = (headers.get(name) or "").strip()
            try:
                s = float(v) / scale
            except ValueError:
                try:                         # an HTTP date is GMT; "-0000" parses naive, read as UTC too
                    when = parsedate_to_datetime(v) if name == "retry-after" and v else None
                except (TypeError, ValueError):
                    when = None
                s = when and max(0.0, when.replace(tzinfo=when.tzinfo or timezone.utc).timestamp() - time.time())
            if s is not None and math.isfinite(s) and s >= 0:
                return s
        return None

    def abort(self, grace=ABORT_GRACE):
        """The caller's run has failed: no request is sent or retried until resume(), backoff sleeps
        wake, and a reply still in flight gets `grace` seconds to arrive (it is paid for; arrived, it is
        cached) before its socket is shut. Otherwise worker threads would run out their retries,
        minutes after the error was reported."""
        self.abort_at = time.monotonic() + grace
        self.aborted.set()
        self._shut_timer = threading.Timer(grace, self._shut_open)
        self._shut_timer.daemon = True
        self._shut_timer.start()

    def _shut_open(self):
        with self.lock:
            if not self.aborted.is_set():        # resumed meanwhile: the sockets are a new run's requests
                return
            for deadline in list(self.exchanges):
                deadline.end()

    def resume(self):
        """A new run of requests after an abort: sent again, and the abort's socket shutdown called off."""
        with self.lock:
            self.aborted.clear()
        timer = self.__dict__.pop("_shut_timer", None)
        if timer is not None:
            timer.cancel()

    def lost(self, maybe_billed):
        """A request was sent and its reply lost (timed out, cut, unreadable), after the server may have
        done the work and billed it: on_lost is told, so that a cost is not read as whole without it. (An
        HTTP error status is a reply: the providers bill no error.)"""
        if maybe_billed and self.on_lost is not None:
            self.on_lost()

    def post(self, body):
        """One request with transport retries -> parsed response JSON; raises LLMError. Redirects are
        refused (the key goes to no other host) and a reply over max_reply_bytes is refused unread."""
        return self.send("POST", self.endpoint or (self.url if self.base_url else None), body, billed=True)

    def send(self, method, url, body=None, files=None, raw=False, max_bytes=None, again=None, billed=False):
        """`post` for any method and URL of this API (the batch clients: GET a batch, upload a file as
        multipart `files`); raw=True returns the reply text instead of parsed JSON. url None: the
        in-process handler. again: for a request the server must not apply twice (creating a batch),
        called before it is sent again after a failure that may come after the server applied it (a reply
        lost, a 5xx other than 529): what it returns, when not None, is the reply. billed: the request is
        a paid one (post's), whose lost replies on_lost is told of."""
        try:
            return self._send(method, url, body, files, raw, max_bytes, again, billed)
        except LLMError as e:            # raised while handling requests' error, which holds the request and its
            e.__context__ = None         # key: hidden by `from None`, kept on the error for whoever walks it
            raise

    def _send(self, method, url, body, files, raw, max_bytes, again, billed):
        """send's attempts (send's arguments)."""
        applied = False                  # whether the last failure may have come after the server applied it
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            found = again() if applied and again is not None else None
            if found is not None:
                return found
            if self.aborted.is_set():
                raise self.error("not sent: the run stopped after another request failed")
            self.limiter.wait()
            with self.lock:
                self.http_calls += 1
            try:
                if self.handler is not None:
                    try:
                        return no_lone_surrogates(self.handler(body))
                    except (ValueError, KeyError, TypeError) as e:   # the local engine's 400
                        raise self.error(f"offline engine rejected the request ({e})", 400) from None
                status, headers, text = self._exchange(url, body, method, files, max_bytes or self.max_reply_bytes)
            except LLMError as e:                # a reply over the size cap, refused unread: billed all the same
                self.lost(billed and e.status == 200)
                raise
            except RETRY_ERRORS as e:            # the connection failed, timed out or broke mid-reply
                tls = handshake_failure(e)       # nothing sent: never billed
                applied = tls is None and not refused(e)
                self.lost(applied and billed)
                if self.aborted.is_set():
                    raise self.error("stopped: the run failed on another request") from None
                if refused_handshake(tls):       # a certificate refused, no TLS there: a retry meets it again
                    raise self.error(f"TLS handshake with {urlparse(url).netloc} failed, nothing sent: "
                                     f"{self.mask(str(tls.args[0]))[:200]}") from None
                if last:
                    raise self.error(f"{type(e).__name__} on {url} after {attempt + 1} attempts") from None
                self.backoff(attempt, None)
                continue
            except (requests.RequestException, http.client.HTTPException, OSError) as e:   # nothing to retry
                raise self.error(f"{type(e).__name__} on {url}: {self.mask(str(e))[:200]}") from None
            if status == 200:
                if raw:
                    return text
                try:
                    return no_lone_surrogates(json.loads(text))
                except (ValueError, RecursionError):
                    self.lost(billed)
                    raise self.error("HTTP 200 with a body that is not JSON", 200, text) from None
            if 300 <= status < 400:
                where = urlparse(headers.get("location") or "").netloc or "elsewhere"
                raise self.error(f"HTTP {status} redirect to {where} refused (requests go only to "
                                 f"{urlparse(url).netloc})", status)
            if status not in RETRY_STATUS or any(c in text.lower() for c in NO_RETRY_CODES):
                raise self.error(f"HTTP {status}", status, text)
            hint = self.retry_after(headers)
            if hint is not None and hint > self.max_retry_after:
                raise self.error(f"HTTP {status}, server asks to wait {hint:.0f}s "
                                 f"(> {self.max_retry_after}s cap)", status, text)
            if last:
                raise self.error(f"HTTP {status} after {attempt + 1} attempts", status, text)
            applied = status >= 500 and status != 529      # (429, 529: refused before any work)
            self.backoff(attempt, hint)

    def _exchange(self, url, body, method, files, max_bytes):
        """Send `body` -> (status, headers, body text), reading at most max_reply_bytes, the whole exchange
        (connect, request, status line, headers, body) within `timeout` seconds: a Deadline shuts the
        socket when they run out, so a reply trickled a byte at a time, headers included, ends like a
        stalled one (requests.Timeout, retried like one)."""
        headers = self.headers()
        if files:                                 # multipart: requests sets its own Content-Type
            headers.pop("Content-Type")
        deadline = Deadline(self.timeout)
        with self.lock:
            self.exchanges.add(deadline)
        if self.aborted.is_set() and time.monotonic() >= self.abort_at:   # sent after the grace ran out
            deadline.end()
        r = None
        try:
            r = self._request(deadline, method, url, body, files, headers)
            deadline.note(getattr(r.raw, "connection", None))    # a SOCKS proxy's connection: noted only now
            return r.status_code, r.headers, self._read(r, deadline, max_bytes)
        finally:
            deadline.cancel()
            with self.lock:
                self.exchanges.discard(deadline)
            if r is not None:
                r.close()

    def _request(self, deadline, method, url, body, files, headers):
        """The request sent and its status line and headers read under `deadline` -> the streamed response;
        a connection shut at the deadline is requests.Timeout."""
        _SENDING.deadline = deadline
        try:
            return self.session.request(method, url, json=body, files=files, data=None, headers=headers,
                                        timeout=(self.connect_timeout, self.timeout), stream=True,
                                        allow_redirects=False)
        except requests.RequestException:
            if deadline.passed():
                raise requests.Timeout(f"reply not complete within {self.timeout:g} s") from None
            raise
        finally:
            _SENDING.deadline = None

    def _read(self, r, deadline, cap):
        """The body of `r` as text, at most `cap` bytes (a larger one is refused unread), before `deadline`."""
        n = r.headers.get("content-length") or ""
        # a malformed length ("²" is a digit to isdigit) is no promise: the streamed cap holds
        n = int(n) if n.isascii() and n.isdigit() and len(n) < 19 else 0
        if n > cap:
            raise self.error(f"reply of {n} bytes refused (at most {cap})", r.status_code)
        parts, got = [], 0
        try:
            for chunk in r.iter_content(65536):
                got += len(chunk)
                if got > cap:
                    raise self.error(f"reply over {cap} bytes refused", r.status_code)
                parts.append(chunk)
        except requests.RequestException:
            if not deadline.passed():
                raise
        if deadline.passed():                     # (a read the deadline's shutdown broke included)
            raise requests.Timeout(f"reply not complete within {self.timeout:g} s")
        return b"".join(parts).decode("utf-8", "replace")     # JSON is UTF-8 (RFC 8259)

    def backoff(self, attempt, hint):
        with self.lock:
            self.retries += 1
        delay = hint if hint is not None else min(0.5 * 2 ** attempt, 8.0) * (1 - 0.25 * random.random())
        self.sleep(max(0.0, delay))
