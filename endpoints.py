"""Endpoints parsed once: a URL (`http://user:pw@host:port/path#model`) becomes an Endpoint that
holds its credentials apart, prints without them, and tells servers apart in cache keys by scheme,
host, port and path (`identity`); `redact_url` hides the credentials and query of text that does
not parse, and `redact` every URL in a line of text.

A search spec (`--search`) and a reranker spec (`--reranker`: base, shield, cohere:MODEL, a URL,
tei:URL, with an optional LABEL=) are parsed the same way (SearchSpec, RerankSpec). The servers' side
(serve.py, offline_server.py) reads a request here: its path (request_path), its Content-Length by one rule
(content_length), its body within a deadline (read_body, drain_body, json_body).

Usage: ep = Endpoint.parse("http://usr:pw@127.0.0.1:8802/v1/rerank#m"); ep.url, ep.basic, str(ep)
"""
import contextlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse, urlsplit


# What is kept at the start of text that does not parse: a LABEL=, tei: or tavily:, then a scheme with
# its '://', or a mistyped one (http:/, http//, https:). Nothing else there is known not to be a secret.
HEAD = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*=)?(?:tei:|vllm-score:|tavily:)?"
                  r"(?:[A-Za-z][A-Za-z0-9+.-]*://|https?:/{0,2}|https?/+)?")


def redact_url(text):
    """A URL, or a spec holding one (`tei:URL`, `LABEL=URL`), for printing when it could not be parsed
    into an Endpoint (whose str() already hides credentials). Two parts may hold a secret: userinfo
    (`user:password@` or a key typed as `key@`) and a query string (`?api_key=...`). Everything after
    the HEAD up to the last '@' becomes ***, and so does everything after a '?' beyond it. A password
    may hold ',', '@', '#', '/', '?' or '://' (unencoded, or the URL is malformed), so no pattern over
    the text can tell where it ends; the last '@' is as far as it can reach. Without '://' the userinfo
    may start the text (`usr:pw@host`, `http:/usr:pw@host`): only the HEAD is kept before it. Text
    with no '@' and no '?' (`cohere:m`, `127.0.0.1:8000`) is shown as it is.
    http://user:p#w@host/v1 -> http://***@host/v1; usr:pw@host:1/v1 -> ***@host:1/v1;
    http://host:x/v1?key=k -> http://host:x/v1?***."""
    if not text:
        return text
    head = HEAD.match(text).group()
    rest = text[len(head):]
    if "@" in rest:
        head, rest = head + "***@", rest.rpartition("@")[2]
    host, query, _ = rest.partition("?")
    return head + host + ("?***" if query else "")


# A URL inside free text: a scheme, its '://' (or a mistyped ':/'), and what follows up to white space. Not up to
# a quote: userinfo may hold one unencoded (RFC 3986 3.2.1), and redact_url keeps what follows the last '@'.
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/{1,2}\S+")
# C0 and C1 controls as \xHH (str.translate): a server's or client's text printed raw (an error body, a batch's
# reason, a request line) could move the cursor, retitle or clear the terminal (ESC, OSC, \r)
CONTROL_CHARS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}


def redact(text):
    """Free text (a message, a log line, a value a command writes) with every URL in it as redact_url
    prints it: the one redaction that every value a command prints or writes passes, whichever flag
    it was typed into (a URL pasted into --name or --dtype is echoed in their refusals)."""
    return text if not isinstance(text, str) else URL_IN_TEXT.sub(lambda m: redact_url(m[0]), text)


@dataclass(frozen=True)
class Endpoint:
    """A URL parsed once, its credentials held apart. str() is the URL with `***@` where credentials
    were (never them); `identity` tells endpoints apart for cache keys: scheme, host, port and path,
    loopback or not (two local servers are two endpoints), never credentials.

    Endpoint.parse("http://usr:pw@127.0.0.1:8802/v1/rerank#m") -> .url 'http://127.0.0.1:8802/v1/rerank',
    .model 'm', .basic ('usr', 'pw'), str() 'http://***@127.0.0.1:8802/v1/rerank#m'."""
    scheme: str
    host: str
    port: int
    path: str
    model: str = None                        # the URL's #fragment (a rerank spec names its model there)
    basic: tuple = field(default=None, repr=False, compare=False)   # (user, password) from the URL

    @classmethod
    def parse(cls, url):
        url = (url or "").strip()
        p = urlparse(url)
        # '/', '?' and '#' end the authority: in a password they must be percent-encoded (RFC 3986 3.2.1)
        hint = ("; percent-encode '/', '?' and '#' in URL credentials" if "@" in url.partition("://")[2]
                and "@" not in p.netloc else "")
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"{redact_url(url)!r}: expected http(s)://HOST[:PORT][/path]{hint}")
        try:
            port = p.port or (443 if p.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"{redact_url(url)!r}: the port is not a number in 0..65535{hint}") from None
        if hint:
            raise ValueError(f"{redact_url(url)!r}: '@' after the host{hint}")
        basic = (unquote(p.username or ""), unquote(p.password or "")) if p.username or p.password else None
        return cls(p.scheme, p.hostname, port, p.path.rstrip("/"), unquote(p.fragment) or None, basic)

    @property
    def netloc(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else f"{host}:{self.port}"

    @property
    def url(self):
        """The URL to send to: no credentials, no fragment."""
        return f"{self.scheme}://{self.netloc}{self.path}"

    @property
    def identity(self):
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"

    def with_path(self, path):
        return Endpoint(self.scheme, self.host, self.port, path, self.model, self.basic)

    def __str__(self):
        return (f"{self.scheme}://{'***@' if self.basic else ''}{self.netloc}{self.path}"
                + (f"#{self.model}" if self.model else ""))

    def __format__(self, spec):
        return format(str(self), spec)


@dataclass(frozen=True)
class SearchSpec:
    """A search spec parsed once: "tavily" (Tavily's API, or a Tavily-shaped endpoint at `endpoint`) or
    "offline" (a synthetic corpus file at `corpus`, served by the offline engine). str() never shows
    credentials."""
    provider: str
    endpoint: Endpoint = None
    corpus: str = None

    @classmethod
    def parse(cls, spec):
        """'tavily' | 'tavily:http(s)://HOST[:PORT]' | 'offline:CORPUS.jsonl' -> SearchSpec; ValueError."""
        provider, _, rest = spec.partition(":")
        if provider == "tavily":
            return cls("tavily", Endpoint.parse(rest) if rest else None)
        if provider == "offline" and rest:
            return cls("offline", corpus=rest)
        raise ValueError(f"{redact_url(spec)!r}: give tavily, tavily:http(s)://HOST[:PORT] or offline:CORPUS.jsonl")

    def __str__(self):
        if self.provider == "offline":
            return f"offline:{os.path.basename(self.corpus)}"
        return f"tavily:{self.endpoint}" if self.endpoint else "tavily"


# Hosted rerank APIs: endpoint, key variables (the key goes only to that endpoint's host), shape.
RERANK_PROVIDERS = {
    "cohere": dict(url="https://api.cohere.com/v2/rerank", keys=["COHERE_API_KEY", "CO_API_KEY"], shape="cohere"),
    "jina": dict(url="https://api.jina.ai/v1/rerank", keys=["JINA_API_KEY"], shape="jina"),
    "voyage": dict(url="https://api.voyageai.com/v1/rerank", keys=["VOYAGE_API_KEY"], shape="voyage"),
}


@dataclass(frozen=True)
class RerankSpec:
    """A reranker spec parsed once: `kind` (cohere, jina, voyage: hosted; generic: any Cohere/Jina/
    vLLM-shaped endpoint; tei: Text Embeddings Inference; vllm-score: vLLM's Score API (POST /score with
    text_1 and text_2); base, shield: this project's in-process
    rerankers), the model, and the Endpoint (credentials held apart). str() is the spec as given
    without credentials: what config.json, records, reports and messages show."""
    kind: str
    model: str = None
    endpoint: Endpoint = None

    def __str__(self):
        if self.kind in LOCAL_RERANKERS:
            return self.kind
        if self.kind in RERANK_PROVIDERS:
            return f"{self.kind}:{self.model}"
        return (f"{self.kind}:" if self.kind in PREFIXED else "") + str(self.endpoint)

    def __format__(self, spec):
        return format(str(self), spec)

    @property
    def slug(self):
        """A default label: the host, port and path (never credentials), e.g. 127.0.0.1-8802-v1-rerank."""
        if self.endpoint is None:
            return str(self).replace(":", "-")
        e = self.endpoint
        return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{e.host}-{e.port}{e.path}").strip("-")[:60]


LOCAL_RERANKERS = ("base", "shield")
PREFIXED = {"tei": "/rerank", "vllm-score": "/score"}     # kind: -> the route added to its URL's path


def parse_spec(spec):
    """'base' | 'shield' | 'cohere:MODEL' | 'jina:MODEL' | 'voyage:MODEL' | 'http(s)://[USER:PW@]HOST[:PORT]
    [/path][#MODEL]' (default path /rerank) | 'tei:http(s)://HOST[:PORT]' (its /rerank) |
    'vllm-score:http(s)://HOST[:PORT][/v1][#MODEL]' (vLLM's /score) -> RerankSpec. A RerankSpec is returned
    as it is."""
    if isinstance(spec, RerankSpec):
        return spec
    spec = spec.strip()
    if spec in LOCAL_RERANKERS:
        return RerankSpec(spec)
    provider, _, rest = spec.partition(":")
    if provider in RERANK_PROVIDERS:
        if not rest:
            raise ValueError(f"{spec!r}: give {provider}:MODEL")
        return RerankSpec(provider, rest)
    prefixed = provider in PREFIXED
    try:
        ep = Endpoint.parse(rest if prefixed else spec)
    except ValueError:
        raise ValueError(f"unknown reranker {redact_url(spec)!r}: give base, shield, cohere:MODEL, jina:MODEL, "
                         "voyage:MODEL, http(s)://HOST[:PORT][/rerank][#MODEL], tei:http(s)://HOST[:PORT] or "
                         "vllm-score:http(s)://HOST[:PORT][#MODEL]") from None
    if prefixed:
        model = ep.model if provider != "tei" else None        # TEI serves one model and takes no name
        return RerankSpec(provider, model, ep.with_path(ep.path + PREFIXED[provider]))
    # /rerank: vLLM logs /v1/rerank and /v1/score as deprecated (vllm/entrypoints/pooling/score/api_router.py)
    return RerankSpec("generic", ep.model, ep if ep.path else ep.with_path("/rerank"))


def parse_labelled(item):
    """'LABEL=SPEC' or 'SPEC' -> (label or None, RerankSpec). A bare URL's '=' (in a password or a
    query) is not a label's."""
    label, eq, text = item.partition("=")
    if not eq or "://" in label or label.startswith(("tei:", "vllm-score:", "http")):
        return None, parse_spec(item)
    return label, parse_spec(text)


def slug(name):
    """A name as a records file names it: lower case, each run of characters other than letters, digits and '.'
    one '_' ("Non-Defense [co]" -> non_defense_co)."""
    return re.sub(r"[^a-z0-9.]+", "_", name.lower()).strip("_")


def parse_rerankers(items):
    """["LABEL=SPEC" or "SPEC", ...] -> [(label, RerankSpec)], each spec parsed once (its printable
    form never shows credentials); ValueError naming the item. A label names the reranker's records
    and table row (letters, digits, '.', '_', '-'); without one it is made from host, port and path."""
    out = []
    for item in items:
        if isinstance(item, tuple):           # parsed already
            out.append(item)
            continue
        label, spec = parse_labelled(item)
        label = label or spec.slug
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", label):
            raise ValueError(f"{redact_url(label)}={spec}: the label must be letters, digits, '.', '_', '-' (it names "
                             "results/rerank-<label>.jsonl); give LABEL=SPEC")
        # eval names a label's records files by its slug, a sample's with ".s<N>" after it, the honest audit's
        # with ".honest"
        same = next((lb for lb, _ in out if slug(lb) == slug(label)), None)
        if same is not None:
            raise ValueError(f"label {label!r} given twice" if same == label else
                             f"labels {same!r} and {label!r} differ only in case or punctuation (they would "
                             "name one records file)")
        if re.search(r"\.(s\d+|honest)$", label):
            raise ValueError(f"label {label!r}: '.s<N>' and '.honest' end the names of other records files; give "
                             "another")
        out.append((label, spec))
    return out


# ----------------------------------------------------------------------------- the servers' side


class RequestError(Exception):
    """A request a server refuses (serve.py, offline_server.py): HTTP status, message, the field at fault."""

    def __init__(self, status, message, param=None):
        super().__init__(message)
        self.status, self.param = status, param


def shut(sock):
    """Wake a connect, send or recv blocked on `sock`: shutdown ends it at once (None: nothing to shut)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.shutdown(socket.SHUT_RDWR)


def request_path(target):
    """An HTTP request target's path, without its query. A target urlsplit refuses (an absolute form with a
    broken host, "http://[x/") is cut at its '?' instead: the server still answers it (a 404), never drops it."""
    try:
        return urlsplit(target or "").path
    except ValueError:
        return (target or "").split("?", 1)[0]


def content_length(headers, required=True):
    """A request's body length as this project's servers read it -> int: one Content-Length of digits only
    (RFC 9110 8.6's 1*DIGIT, not int()'s "+49", "4_9" or "-1"), never beside a Transfer-Encoding; without one, 0
    unless `required`. RequestError 411 or 400 otherwise."""
    if headers.get("Transfer-Encoding"):
        raise RequestError(411, "send the body with a Content-Length (no Transfer-Encoding)")
    if len(set(headers.get_all("Content-Length") or [])) > 1:   # which one frames the body is ambiguous (smuggling)
        raise RequestError(400, "Content-Length: given more than once with different values")
    n = headers.get("Content-Length")
    if n is None:
        if required:
            raise RequestError(411, "Content-Length is required")
        return 0
    n = n.strip()
    if not n.isascii() or not n.isdigit():
        raise RequestError(400, "Content-Length: a non-negative integer is required")
    if len(n.lstrip("0")) > 18:        # past any body a server takes (and int() refuses over 4,300 digits)
        raise RequestError(413, f"Content-Length: a number of {len(n.lstrip('0'))} digits")
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
    oversized body reads the 413 instead of a broken pipe -> the bytes left unread."""
    left, deadline = n, time.monotonic() + timeout
    with contextlib.suppress(OSError):
        while left > 0 and time.monotonic() < deadline:
            chunk = rfile.read1(min(65536, left))
            if not chunk:
                break
            left -= len(chunk)
    return left


def _unique_keys(pairs):
    """A JSON object's pairs -> dict; a key given twice is refused: a gateway that reads the first and a
    server that reads the last would see two different requests. The message names it by its repr (a control
    character or lone surrogate escaped)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise RequestError(400, f"{k[:100]!r}: given twice in one object", k[:100])
        out[k] = v
    return out


LOOPBACK_NAMES = re.compile(r"localhost|[a-z0-9.-]*\.localhost|127(?:\.\d{1,3}){3}|::1")


def loopback_host(server_address, host_header):
    """Whether a request to a server bound to loopback names a loopback host (Host header, port aside): a web
    page that points its own name at 127.0.0.1 (DNS rebinding) sends that name, and is no loopback client of
    the server. Always True for a server bound beyond loopback (its clients name it as they reach it)."""
    if not LOOPBACK_NAMES.fullmatch(str(server_address[0])):
        return True
    h = (host_header or "").strip().lower()
    h = h[1:].partition("]")[0] if h.startswith("[") else h.rpartition(":")[0] if h.count(":") == 1 else h
    return LOOPBACK_NAMES.fullmatch(h) is not None


def json_body(raw):
    """Body bytes -> the decoded JSON value; RequestError 400 when they are not UTF-8 or not JSON, or an
    object gives a key twice."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise RequestError(400, "the body nests too deeply") from None
    except ValueError as e:
        raise RequestError(400, f"the body is not JSON ({e})") from None
