"""Endpoints parsed once: a URL (`http://user:pw@host:port/path#model`) becomes an Endpoint that
holds its credentials apart, prints without them, and tells servers apart in cache keys by scheme,
host, port and path (`identity`); `redact_url` hides the credentials of text that does not parse.

A search spec (`--search`) is parsed the same way (SearchSpec).

Usage: ep = Endpoint.parse("http://usr:pw@127.0.0.1:8802/v1/rerank#m"); ep.url, ep.basic, str(ep)
"""
import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse


def redact_url(text):
    """A URL, or a spec holding one (`tei:URL`, `LABEL=URL`), for printing when it could not be parsed
    into an Endpoint (whose str() already hides credentials): everything between '://' and the last '@'
    becomes ***. A password may hold ',', '@', '#', '/' or '?' (unencoded, or the URL is malformed), so
    no pattern over the text can tell where it ends; the last '@' is as far as it can reach.
    http://user:p#w@host/v1 -> http://***@host/v1."""
    if not text or "://" not in text:
        return text
    head, _, rest = text.partition("://")
    return f"{head}://***@{rest.rpartition('@')[2]}" if "@" in rest else text


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
