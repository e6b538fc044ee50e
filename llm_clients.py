"""Chat clients over raw HTTP JSON: OpenAI Chat Completions and Anthropic Messages, with retries,
a disk cache, concurrency and usage accounting. Every LLM call of GEO Defender goes through here
(target LLMs, the TFSG Analyzer, the judges, the benchmark builder). `requests` only, no vendor SDK.

Conventions (those of the openai-python and anthropic-sdk-python clients):
- transport retries only where retrying can help, and `timeout` bounds a whole exchange (transport.py);
- JSON re-asks (the reply did not parse) are separate from transport retries and bounded;
- the cache key is a hash of the canonical request (protocol, host, model, messages, sampling
  params, JSON flag) and never contains the API key; entries are written atomically;
- every failure raises LLMError(status, provider, short body); no placeholder text is returned;
- a reply that fails its check is paid for too: it is kept under its request's key, apart from replies (the
  "unusable" marker), so that a rerun sends only what is left to ask, and raises a request's ReplyInvalid unsent.

Parts, each small: RequestShape (the body of a protocol, parameters an API refused adapted once),
ReplyCache (replies on disk by request hash, in-flight de-duplication), Client (chat with JSON
re-asks, map, usage) over transport.Transport (POST with retries, credentials, rate limit), make_client.

Usage: client = make_client("openai:gpt-5.5", cache_dir="runs/x/cache")
       reply = client.chat([{"role": "user", "content": "..."}], json=True); reply.data
"""
import bisect
import contextlib
import hashlib
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import accounting
import endpoints
from transport import LLMError, Transport, json_object, no_lone_surrogates, same_origin

# provider -> protocol, default base URL, env var(s) for the key, env var for the base URL, flags.
PROVIDERS = {
    "openai": dict(protocol="openai", base="https://api.openai.com/v1", keys=["OPENAI_API_KEY"],
                   base_env="OPENAI_BASE_URL", max_field="max_completion_tokens", json_mode=True),
    "anthropic": dict(protocol="anthropic", base="https://api.anthropic.com/v1", keys=["ANTHROPIC_API_KEY"],
                      base_env="ANTHROPIC_BASE_URL", json_mode=False),
    "deepseek": dict(protocol="openai", base="https://api.deepseek.com", keys=["DEEPSEEK_API_KEY"],
                     base_env="DEEPSEEK_BASE_URL", json_mode=True),
    "moonshot": dict(protocol="openai", base="https://api.moonshot.ai/v1", keys=["MOONSHOT_API_KEY"],
                     base_env="MOONSHOT_BASE_URL", json_mode=True),
    "zhipu": dict(protocol="openai", base="https://open.bigmodel.cn/api/paas/v4",
                  keys=["ZHIPUAI_API_KEY", "ZAI_API_KEY", "GLM_API_KEY"], base_env="ZHIPUAI_BASE_URL", json_mode=True),
    "openrouter": dict(protocol="openai", base="https://openrouter.ai/api/v1", keys=["OPENROUTER_API_KEY"],
                       base_env="OPENROUTER_BASE_URL", json_mode=True),
    "vllm": dict(protocol="openai", base="http://localhost:8000/v1", keys=["VLLM_API_KEY"], key_optional=True,
                 base_env="VLLM_BASE_URL", json_mode=True),
    "ollama": dict(protocol="openai", base="http://localhost:11434/v1", keys=["OLLAMA_API_KEY"], key_optional=True,
                   default_key="ollama", base_env="OLLAMA_BASE_URL", json_mode=True),
    "llama.cpp": dict(protocol="openai", base="http://127.0.0.1:8080/v1", keys=["LLAMACPP_API_KEY"],
                      key_optional=True, base_env="LLAMACPP_BASE_URL", json_mode=True),
    "openai-compatible": dict(protocol="openai", base=None, keys=["OPENAI_COMPATIBLE_API_KEY"], key_optional=True,
                              base_env=None, json_mode=False),
}
# Providers whose key belongs to one public API: it is sent only to that host over https (or to the provider's
# own *_BASE_URL variable's), never to a --base-url elsewhere (`make_client`).
HOSTED = ("openai", "anthropic", "deepseek", "moonshot", "zhipu", "openrouter")
# The stop reasons of a reply cut at the token cap: OpenAI's finish_reason, Anthropic's stop_reason; and of
# one that ended as the model chose (an empty text then is the model's answer, not a filtered or failed one).
CAPPED = ("length", "max_tokens")
ENDED = ("stop", "end_turn", "stop_sequence")


class ReplyInvalid(LLMError):
    """The API answered, but every attempt's reply failed to parse or to pass the caller's check
    (`chat(check=...)`). No reply was cached: the attempts are kept as unusable under the request's key, and
    a rerun of the request raises this again unsent (ReplyCache.forget to ask again). .attempts: how many
    replies were tried. (Its subclass RequestRefused is no reply: nothing is kept, a rerun asks again.)"""

    def __init__(self, message, provider=None, body=None, attempts=1):
        super().__init__(message, None, provider, body)
        self.attempts = attempts


class RequestRefused(ReplyInvalid):
    """The server refused one request for what it holds (HTTP 400, 413 or 422 saying so, REFUSED_FOR: a prompt
    past the model's context, a content filter on a page's text), which no retry changes. Under
    map(invalid="return") it takes its request's place as an unusable reply does, so that one long or filtered
    page does not stop a run; REFUSED_STOP refusals in a row stop it (every request refused: not the pages)."""

    def __init__(self, e):
        super().__init__(f"the server refused this request: {e}", e.provider, e.body, getattr(e, "attempts", 1))
        self.status = e.status


REFUSED_STATUS = (400, 413, 422)
# What the providers' errors say of a request refused for its content (OpenAI's and vLLM's context_length_exceeded
# and content_filter, Anthropic's "prompt is too long", Azure's content management policy); any other 400 (a low
# credit balance, a malformed request) is the run's and stops it
REFUSED_FOR = re.compile(r"context.length|context window|maximum context|too long|too large|content.?filter|"
                         r"content.?policy|content management", re.I)
REFUSED_STOP = 8        # refusals in a row (no reply sent back between them) that stop a run


@dataclass
class Reply:
    text: str
    reasoning: str = None        # reasoning_content / reasoning / thinking, kept apart from text
    usage: dict = field(default_factory=dict)
    finish_reason: str = None
    model: str = None
    data: object = None          # parsed JSON when json=True
    cached: bool = False

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if k != "cached"}


# ----------------------------------------------------------------------------- JSON extraction

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)


def split_think(text):
    """-> (answer text, reasoning or None): the reasoning block that opens a reply, where a reasoning model
    served without a reasoning parser writes it, split off. Tags after the answer starts are its own text (a
    guard quoting a document's "<think>...</think>", inside a JSON string too) and stay. An unclosed opening
    <think> (truncated reply) is reasoning up to the first '{' after it; a reply whose server dropped the
    opening tag (the chat template put it in the prompt) is reasoning up to its first </think>, unless a '{'
    comes before that: then a JSON value would be cut, and nothing is split."""
    s = (text or "").lstrip()
    if s.startswith("<think>"):
        reasoning, closed, rest = s[len("<think>"):].partition("</think>")
        if not closed:
            brace = reasoning.find("{")
            reasoning, rest = (reasoning, "") if brace < 0 else (reasoning[:brace], reasoning[brace:])
    else:
        reasoning, closed, rest = s.partition("</think>")
        if not closed or "{" in reasoning or "<think>" in reasoning:
            return text, None
    return rest.strip(), reasoning.strip() or None


def _tokens(v):
    """A token count from a reply's usage: a non-negative whole number (12 or a proxy's 12.0), else None (a
    server's "abc", NaN or 1e400 is no count)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 53 else None


def _usage(resp, protocol):
    """A reply's usage block -> {prompt_tokens (every input token, cached ones included), completion_tokens,
    reasoning_tokens}, with the input tokens read from the provider's prompt cache (`cached_tokens`:
    OpenAI's prompt_tokens_details.cached_tokens, Anthropic's cache_read_input_tokens) and written to it
    (`cache_write_tokens`: Anthropic's cache_creation_input_tokens, which its input_tokens leaves out) where
    there are some, and "unmetered": 1 when a count is missing or no count (servers that send no usage, a
    proxy's null): the reply's cost is then unknown, where its zeros would price it at $0."""
    u = json_object(json_object(resp).get("usage"))
    fields = ("input_tokens", "output_tokens") if protocol == "anthropic" else ("prompt_tokens", "completion_tokens")
    n = {"prompt_tokens": _tokens(u.get(fields[0])), "completion_tokens": _tokens(u.get(fields[1]))}
    if protocol == "anthropic":
        cached, written, reasoning = u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens"), 0
    else:
        cached, written = json_object(u.get("prompt_tokens_details")).get("cached_tokens"), 0
        reasoning = json_object(u.get("completion_tokens_details")).get("reasoning_tokens")
    cache = {"cached_tokens": _tokens(cached) or 0, "cache_write_tokens": _tokens(written) or 0}
    if protocol == "anthropic" and n["prompt_tokens"] is not None:
        n["prompt_tokens"] += cache["cached_tokens"] + cache["cache_write_tokens"]
    return {**{k: v or 0 for k, v in n.items()}, "reasoning_tokens": _tokens(reasoning) or 0,
            **{k: v for k, v in cache.items() if v}, **({"unmetered": 1} if None in n.values() else {})}


def extract_json(text, cut=False):
    """Parse the JSON object in a model reply: plain JSON, a leading think block (also unclosed), code fences,
    prose around the object. Raises ValueError with the reason when nothing parses. cut: the reply stopped
    at the token cap, so only a reply that parses whole is taken (an object found inside a cut one may be
    the "[1]" of a citation, or the first of several decisions)."""
    if text is None:
        raise ValueError("empty reply (content is null)")
    s = text.strip()
    try:
        return json.loads(s)
    except (json.JSONDecodeError, RecursionError):   # (nested past the parser's depth)
        if cut:
            raise ValueError("the reply stopped at the token cap before its JSON ended") from None
    s, _ = split_think(s)
    # the values at top level, read left to right (a fence's content among them)
    dec, found, starts, ends, i = json.JSONDecoder(), [], [], [], 0
    while i < len(s):
        if s[i] in "{[":
            try:
                obj, end = dec.raw_decode(s, i)
                found.append(obj)
                starts.append(i)
                ends.append(end)
                i = end
                continue
            except (json.JSONDecodeError, RecursionError):
                pass
        i += 1
    for m in reversed(list(_FENCE.finditer(s))):
        k = bisect.bisect_right(starts, m.start()) - 1
        if k >= 0 and m.start() < ends[k]:          # a fence inside a value is its text (a quoted passage's)
            continue
        try:
            return json.loads(m.group(1).strip())
        except (json.JSONDecodeError, RecursionError):
            # the value that opens the fence's text, whole: "```" in one of its strings ended the fence early
            k = bisect.bisect_left(starts, m.start(1))
            if k < len(starts) and not s[m.start(1):starts[k]].strip():
                return found[k]
    # prose around the JSON: the last object is the reply's (a "[1]" cited before it, or an object it shows as
    # an example, is not), a list only where no object is
    objects = [x for x in found if isinstance(x, dict)]
    if found:
        return objects[-1] if objects else found[0]
    raise ValueError(f"no JSON object found in a reply of {len(text)} characters")


# ----------------------------------------------------------------------------- request shape


class RequestShape:
    """The request body of one protocol (OpenAI Chat Completions or Anthropic Messages), and the
    parameters an API has refused: each is adapted once, for every later request, and the cache key
    keeps the body as first asked (`body(asked=True)`) so that replies cached before and after an
    adaptation are found again."""

    def __init__(self, model, protocol="openai", max_field="max_tokens", json_mode=True, extra_body=None):
        if protocol not in ("openai", "anthropic"):
            raise ValueError(f"protocol must be 'openai' or 'anthropic', got {protocol!r}")
        if "://" in str(model):     # a URL typed where the model goes would travel in every body and label
            raise ValueError(f"model {endpoints.redact(model)!r} is a URL: give the server as --base-url and the "
                             "model's name after the provider, e.g. openai-compatible:qwen3-8b")
        self.model, self.protocol, self.extra_body = model, protocol, extra_body or {}
        self.max_field, self.json_mode = max_field, json_mode
        self.asked = (max_field, json_mode)      # the request as first built: the cache key's form
        self.send_temperature = True             # False once the API refused it
        self.adapted = []                        # what adapt() changed, in words (usage() reports it)
        self.lock = threading.Lock()

    def body(self, messages, temperature, max_tokens, want_json, asked=False):
        max_field, json_mode = self.asked if asked else (self.max_field, self.json_mode)
        if self.protocol == "anthropic":
            system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
            body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature,
                    "messages": [m for m in messages if m["role"] != "system"]}
            if system:
                body["system"] = system
        else:
            body = {"model": self.model, "messages": messages, "temperature": temperature, max_field: max_tokens}
            if want_json and json_mode:
                body["response_format"] = {"type": "json_object"}
        body.update(self.extra_body)
        return body

    def sent(self, body):
        """The body as it goes out: without what the API has refused."""
        return body if self.send_temperature else {k: v for k, v in body.items() if k != "temperature"}

    def adapt(self, body, err):
        """An HTTP 400 that names a request parameter this model does not take -> (the change made, in
        words, whether it is new); the caller rebuilds and resends. Else (None, False). Cases seen in
        the wild: reasoning models accept only their default temperature ("Unsupported value:
        'temperature' does not support 0 with this model", OpenAI GPT-5.x, o-series); 'max_tokens' vs
        'max_completion_tokens' (o-series behind Azure or proxies; GLM knows only max_tokens); servers
        without JSON mode."""
        text = err.body or ""
        m = re.search(r'"param"\s*:\s*"([^"]+)"', text)
        param, low = (m.group(1) if m else ""), text.lower()
        # a refusal of the parameter itself, not of its value ("-1 is less than the minimum of 0", "2.5 is
        # greater than the maximum of 2" name their param too): the code or the words say it is unsupported
        unsupported = (re.search(r'"code"\s*:\s*"unsupported_(?:parameter|value)"', text) is not None
                       or "unsupported" in low or "not support" in low)
        def refused(name):
            return unsupported and (param == name or f"'{name}'" in text)
        change = None
        if "temperature" in body and refused("temperature"):
            self.send_temperature, change = False, "temperature: not sent (the API accepts only the model's default)"
        elif self.protocol == "openai" and self.asked[0] in body and refused(self.asked[0]):   # once: never back
            other = "max_completion_tokens" if self.asked[0] == "max_tokens" else "max_tokens"
            self.max_field, change = other, f"token cap sent as {other}"
        elif "response_format" in body and refused("response_format"):
            self.json_mode, change = False, "JSON mode off (JSON still parsed from the text, with re-asks)"
        if change is None:
            return None, False
        with self.lock:
            first = change not in self.adapted     # threads that met the same refusal log it once
            if first:
                self.adapted.append(change)
        return change, first

    def rebuild(self, body):
        """The body with the current token-cap field and JSON mode (after adapt changed them)."""
        if self.protocol == "anthropic":
            return body
        cap = next(v for k, v in body.items() if k in ("max_tokens", "max_completion_tokens"))
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
        body[self.max_field] = cap
        if not self.json_mode:
            body.pop("response_format", None)
        return body


# ----------------------------------------------------------------------------- reply cache


class ReplyCache:
    """Replies on disk, one JSON file per request hash (written aside and renamed: whole or absent),
    and in-flight de-duplication: while one thread sends a request, the others asking the same wait
    for its cached reply instead of paying twice. An entry is a reply ({"reply": ...}) or the unusable
    replies of a request ({"unusable": [...]}, Client._keep), never both: get() reads replies only.
    No cache_dir: nothing is kept."""

    def __init__(self, cache_dir=None, refresh=False):
        self.dir, self.refresh = cache_dir, refresh
        self.inflight = {}                       # key -> Event of the request being sent for it
        self.written = set()                     # keys this cache wrote: read back even with refresh (a
        self.lock = threading.Lock()             # batch's replies, stored before map() asks for them)

    @staticmethod
    def key(protocol, where, body, want_json):
        """A hash of the canonical request: the protocol or shape, where it goes (an Endpoint's
        identity: scheme, host, port and path, loopback included; or a provider name such as
        'offline'), the body as asked (model, messages, sampling) and the JSON flag. Never a key or
        URL credentials."""
        canon = json.dumps({"protocol": protocol, "where": where, "body": body, "json": bool(want_json)},
                           sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    def _path(self, key):
        return os.path.join(self.dir, key[:2], key + ".json")

    def get(self, key):
        try:
            return Reply(**self.get_raw(key)["reply"], cached=True)
        except (KeyError, TypeError):
            return None                          # missing, corrupt or unusable: no reply

    def get_raw(self, key):
        """A stored JSON object (not a chat reply), or None; with refresh, only one this cache wrote."""
        if not self.dir or self.refresh and key not in self.written:
            return None
        try:
            with open(self._path(key), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def forget(self, key):
        """Deletes the entry of `key`: its request is sent again (a request kept as unusable, to try again)."""
        self.written.discard(key)
        if self.dir:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(key))

    def put(self, key, reply, provider, model):
        self.put_raw(key, {"provider": provider, "model": model, "reply": reply.to_dict()})

    def put_raw(self, key, obj):
        if not self.dir:
            return
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False)
            os.replace(tmp, path)
            self.written.add(key)
        except BaseException as e:   # a full disk or a kill: no half-written entry left behind
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if isinstance(e, UnicodeEncodeError):   # text UTF-8 cannot hold: not kept (no_lone_surrogates
                return                               # prevents it)
            if isinstance(e, OSError) and e.filename is None:   # a full disk names no file: this one is named
                raise OSError(e.errno, e.strerror, path) from None
            raise

    def through(self, key, lookup, ask):
        """The value for `key`: lookup() (a usable cached entry, or None), else ask() (sends, stores).
        While one thread asks, the others asking the same key wait for its entry instead of paying
        twice; if it failed, the next waiter asks itself. Without a cache nothing is shared."""
        mine = None
        while True:
            hit = lookup()
            if hit is not None:
                return hit
            with self.lock:                      # another thread sending `key`: wait for it; else claim it
                wait = self.inflight.get(key)
                if wait is None and self.dir and not self.refresh:
                    mine = self.inflight[key] = threading.Event()
            if wait is None:
                break
            wait.wait()
            if self.get_raw(key) is None:        # it failed: this thread asks itself
                break
        try:
            hit = lookup() if mine is not None else None   # answered meanwhile
            return hit if hit is not None else ask()
        finally:
            if mine is not None:
                with self.lock:
                    del self.inflight[key]
                mine.set()


# ----------------------------------------------------------------------------- client


def _fill_data(reply, check):
    """reply.data from its text's JSON, then `check` on it; ValueError when either fails."""
    try:   # (no_lone_surrogates: an escaped "\\ud800" inside the JSON string)
        reply.data = no_lone_surrogates(extract_json(reply.text, cut=reply.finish_reason in CAPPED))
    except RecursionError:
        raise ValueError("JSON nested past the parser's depth") from None
    if check is not None:
        check(reply.data)


def _judge(reply, want_json, check):
    """ValueError when a reply is no answer: with want_json, its JSON does not parse or fails `check`
    (_fill_data fills reply.data); without, its text is empty and the model did not end it (filtered,
    refused or failed)."""
    if want_json:
        _fill_data(reply, check)
    elif not reply.text.strip() and reply.finish_reason not in ENDED:
        raise ValueError(f"no text (stop reason {reply.finish_reason!r})")


def _usable(check, data):
    try:
        check(data)
        return True
    except ValueError:
        return False


class Client:
    """A chat client over its parts: RequestShape (what is sent), Transport (how it is sent), ReplyCache
    (what is kept), with JSON re-asks, usage accounting and an optional usage ledger. Client.open builds
    the parts from a URL and a model; make_client from a provider:model spec."""

    def __init__(self, shape, transport, cache, provider, identity=None, json_retries=1, prices=None, ledger=None,
                 stage=None, batch=None):
        # batch: a function of this client -> its batch runner (batch_clients.BatchRunner), through
        # which map() fills the reply cache first; None: synchronous calls only
        self.shape, self.transport, self.cache = shape, transport, cache
        transport.on_lost = self._lost
        self.model, self.protocol, self.provider = shape.model, shape.protocol, provider
        # what tells this server apart in cache keys: its endpoint (scheme, host, port, path), or a
        # stable name for a server whose address changes (the offline engine on a new port each run)
        self.identity = identity or (self.transport.where.identity if self.transport.where else self.provider)
        self.json_retries = json_retries
        self.prices = prices or {}               # model -> (USD per 1M input tokens, per 1M output tokens)
        self.ledger, self.stage = ledger, stage  # JSONL file: one line per reply received (see _count)
        self.lock = threading.Lock()
        self._stats = {"calls": 0, "cache_hits": 0, "json_reasks": 0,
                       "prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0}
        self._batch_tokens = {}                  # the part of _stats' tokens a batch API billed (its share)
        self._refused = 0                        # RequestRefused in a row (REFUSED_STOP)
        self.batch = batch(self) if batch is not None else None

    @classmethod
    def open(cls, base_url, model, api_key=None, protocol="openai", provider=None, cache_dir=None, refresh=False,
             timeout=600, connect_timeout=10, max_retries=2, max_retry_after=60, rpm=0, handler=None,
             max_field="max_tokens", json_mode=True, extra_body=None, bearer=False, **kw):
        """A Client from a base URL (or an in-process `handler`) and a model: its RequestShape, Transport
        (timeouts, retries, rate) and ReplyCache (cache_dir); the rest of `kw` goes to Client."""
        provider = provider or protocol
        shape = RequestShape(model, protocol, max_field, json_mode, extra_body)
        transport = Transport(base_url, f"{provider}:{model}", protocol, api_key, timeout, connect_timeout,
                              max_retries, max_retry_after, rpm, handler, provider, bearer=bearer)
        return cls(shape, transport, ReplyCache(cache_dir, refresh), provider, **kw)

    def __repr__(self):
        return f"Client(provider={self.provider!r}, model={self.model!r}, base_url={self.base_url!r})"

    @property
    def label(self):
        """provider:model as the ledger, summary.json and the reports name it."""
        return f"{self.provider}:{self.model}"

    @property
    def base_url(self):
        return self.transport.base_url           # without credentials

    @property
    def stats(self):
        """This client's counters: calls, cache hits, JSON re-asks, tokens; HTTP calls and retries."""
        return {**self._stats, "http_calls": self.transport.http_calls, "retries": self.transport.retries}

    @property
    def max_field(self):
        return self.shape.max_field

    @property
    def adapted(self):
        return self.shape.adapted

    @property
    def _key(self):
        return self.transport._key

    def _send(self, body):
        """One logical request -> parsed response JSON; a 400 that names a parameter this model does
        not take is answered by adapting the request (RequestShape.adapt) and sending it again."""
        while True:                      # ends: each kind of change happens once, and each resend differs
            sent = self.shape.sent(body)
            try:
                return self.transport.post(sent)
            except LLMError as e:     # (another thread may have adapted meanwhile: judged on what was sent)
                change, first = self.shape.adapt(sent, e) if e.status == 400 else (None, False)
                if change is None:
                    raise
                if first:
                    print(f"[llm] {self.label}: HTTP 400 refused a parameter; {change}", file=sys.stderr, flush=True)
                body = self.shape.rebuild(body)
                if self.shape.sent(body) == sent:            # nothing this client can change: the error stands
                    raise

    def _receive(self, resp, mode=None):
        """A reply received (paid for) -> Reply, counted (_count) even when its shape is unexpected: the
        provider billed it whatever its shape."""
        try:
            reply = self._parse(resp)
        except LLMError:
            self._count(Reply("", usage=_usage(resp, self.protocol)), mode)
            raise
        self._count(reply, mode)
        return reply

    def _parse(self, resp):
        usage = _usage(resp, self.protocol)
        try:
            if self.protocol == "anthropic":
                blocks = resp["content"]
                text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
                thinking = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking") or None
                return Reply(text, thinking, usage, resp.get("stop_reason"), resp.get("model"))
            choice = resp["choices"][0]
            msg = choice["message"]
            text = msg.get("content")
            if not isinstance(text, (str, type(None))):          # a list of parts, or worse: not a text reply
                raise TypeError(f"content is a {type(text).__name__}, not text")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            reasoning = reasoning if isinstance(reasoning, str) else None
            if text and ("<think>" in text or "</think>" in text):   # servers without a reasoning parser
                text, inline = split_think(text)
                reasoning = reasoning or inline
            return Reply(text if text is not None else "", reasoning, usage, choice.get("finish_reason"),
                         resp.get("model"))
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise self.transport.error(f"unexpected response shape ({type(e).__name__}: {e})", 200,
                                       json.dumps(resp)) from None       # (error() masks, then cuts)

    def _count(self, reply, mode=None):
        """A reply received (paid for): added to this client's stats and, with a ledger, appended to
        it. The ledger outlives the process: a run folder's cost over all its invocations (accounting.ledger_usage).
        mode "batch": a batch API's reply, entered as '<label> [batch]' (priced at the batch discount)."""
        tokens = {k: int(reply.usage.get(k, 0) or 0)
                  for k in ("prompt_tokens", "completion_tokens", "reasoning_tokens")}
        tokens.update({k: int(reply.usage[k]) for k in ("cached_tokens", "cache_write_tokens", "unmetered")
                       if reply.usage.get(k)})                       # (counted where there are some)
        self._enter(tokens, mode)

    def _lost(self):
        """A request sent whose reply was lost (Transport.lost): billed or not, unknown; the ledger's row
        for it makes the cost unknown rather than short."""
        self._enter({"lost": 1, "unmetered": 1})

    def _enter(self, tokens, mode=None):
        """Counts added to this client's stats and, with a ledger, appended to it as one row."""
        with self.lock:
            for k, v in tokens.items():
                self._stats[k] = self._stats.get(k, 0) + v
                if mode == "batch":
                    self._batch_tokens[k] = self._batch_tokens.get(k, 0) + v
        if self.ledger:
            label = self.label + (" [batch]" if mode == "batch" else "")
            accounting.append_ledger(self.ledger, {"stage": self.stage, "model": label, **tokens})

    def request_key(self, messages, temperature=0, max_tokens=2048, json=False, check=None, sample=0):
        """The cache key of a chat() request, and the body to send for it (what a batch line carries).
        sample > 0: the sample-th repeat of the same request (repeated answers of one prompt, "Don't
        Measure Once", arXiv 2604.07585): its own cache entry, the same body sent."""
        asked = self.shape.body(messages, temperature, max_tokens, json, asked=True)
        key = self.cache.key(self.protocol, self.identity, {**asked, "sample": sample} if sample else asked, json)
        return key, self.shape.sent(self.shape.body(messages, temperature, max_tokens, json))

    def store(self, key, resp, want_json, check, mode=None):
        """A reply received another way (a batch API's line) -> parsed, counted, and cached under `key`
        when usable, exactly as chat() would have cached it. -> True if cached; an unusable reply is not
        cached but kept as the request's first attempt where none is kept yet (_keep): chat() then sends
        the re-ask, not the request the batch paid for, where one is asked (a JSON request with json_retries);
        otherwise the kept line is the request's ReplyInvalid, nothing sent again."""
        reply = self._receive(no_lone_surrogates(resp), mode)
        try:
            _judge(reply, want_json, check)
        except ValueError:
            if not self._kept(key):
                self._keep(key, [(None, reply)])
            return False
        self.cache.put(key, reply, self.provider, self.model)
        return True

    # --- public

    def chat(self, messages, temperature=0, max_tokens=2048, json=False, check=None, sample=0):
        """One chat completion -> Reply. json=True: ask for a JSON object and parse it into .data,
        re-asking at most `json_retries` times with the parse error when the reply does not parse.
        check: a function of .data that raises ValueError when the reply is unusable (a judge score
        out of range, ...): such a reply is re-asked like one that does not parse, never cached as a reply,
        and a cached one that fails it is asked again. After the last attempt: ReplyInvalid, kept (_ask):
        the same request raises it again unsent, until `cache.forget(key)` (key: request_key's). sample:
        the repeat's index (request_key): another cached reply of the same request."""
        want_json = json                         # the public name; `json` is the module everywhere else
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {role, content} dicts")
        with self.lock:
            self._stats["calls"] += 1
        key, _ = self.request_key(messages, temperature, max_tokens, want_json, sample=sample)
        return self.cache.through(key, lambda: self._usable_hit(key, check),
                                  lambda: self._ask(key, messages, temperature, max_tokens, want_json, check))

    def _usable_hit(self, key, check):
        """The cached reply for `key`, counted as a cache hit, or None; a cached reply that fails
        `check` is None: asked again."""
        hit = self.cache.get(key)
        if hit is None or (check is not None and not _usable(check, hit.data)):
            return None
        with self.lock:
            self._stats["cache_hits"] += 1
        return hit

    def _kept(self, key):
        """The unusable replies kept for `key` (_keep), oldest first, as (re-ask, Reply) pairs: the re-ask
        each answered, None for the request itself; [] where none are (no entry, a reply, a corrupt one)."""
        raw = self.cache.get_raw(key)
        try:
            return [(a["reask"], Reply(**a["reply"], cached=True)) for a in raw["unusable"]]
        except (KeyError, TypeError):
            return []

    def _keep(self, key, kept):
        """The unusable replies of a request, written under its key as (re-ask, Reply) pairs: an entry
        without a "reply" field, so that nothing reads it as a reply. A reply another caller's laxer check
        took (a batch line kept for another call's request) stays: it is paid for and usable to that caller."""
        if "reply" in (self.cache.get_raw(key) or {}):
            return
        self.cache.put_raw(key, {"provider": self.provider, "model": self.model,
                                 "unusable": [{"reask": q, "reply": r.to_dict()} for q, r in kept]})

    def _ask(self, key, messages, temperature, max_tokens, want_json, check):
        """chat() past the cache: send, parse, re-ask when unusable, cache. The reply cached carries the usage
        of every attempt it took (summed, with their count): what answering the request cost. Each unusable
        reply is kept (_keep) before the re-ask goes out; a rerun takes the kept replies again, judged by
        its own `check`, and sends only what they leave to ask: a kept reply stands for its attempt while it
        answered the re-ask this run would send (a changed check words the re-ask otherwise). A request
        unusable to its last attempt is thus ReplyInvalid again, with the same error, nothing sent."""
        convo, spent, reask = list(messages), [], None
        kept, sent = self._kept(key), False
        for ask in range(self.json_retries + 1):
            fresh = ask >= len(kept) or kept[ask][0] != reask
            if fresh:
                del kept[ask:]                   # (those answered another re-ask)
                if ask:
                    with self.lock:
                        self._stats["json_reasks"] += 1
                try:
                    reply = self._receive(self._send(self.shape.body(convo, temperature, max_tokens, want_json)))
                except LLMError as e:    # (a re-ask the server refuses: its request's attempts, this one's too)
                    e.attempts = ask + 1
                    raise
                kept.append((reask, reply))
                sent = True
            reply = kept[ask][1]
            spent.append(reply.usage)
            try:
                _judge(reply, want_json, check)
                break
            except ValueError as e:
                if fresh:
                    self._keep(key, kept)
                if not sent and (not want_json or ask == self.json_retries):   # the failure, from the cache
                    with self.lock:
                        self._stats["cache_hits"] += 1
                if not want_json:                # no text: no answer, not re-asked
                    raise ReplyInvalid(str(self.transport.error(str(e))), self.provider, attempts=1) from None
                if ask == self.json_retries:
                    cut = (f"; the reply stopped at the token cap ({self.shape.max_field}={max_tokens}, stop reason "
                           f"{reply.finish_reason!r}; reasoning models count their reasoning in it): raise "
                           "--max-tokens" if reply.finish_reason in CAPPED else "")
                    kept_note = "" if sent or not self.cache.dir else (f"; kept from an earlier request, nothing "
                                                                       f"sent now: delete {self.cache._path(key)} "
                                                                       "to ask again")
                    err = self.transport.error(f"reply is not usable after {ask + 1} attempts ({e}){cut}{kept_note}",
                                               None, reply.text)
                    raise ReplyInvalid(str(err), self.provider, err.body, attempts=ask + 1) from None
                problem = "could not be parsed as JSON" if reply.data is None else "is not usable"
                reask = f"Your reply {problem} ({e}). Return only the JSON object, nothing else."
                # the reply echoed as the assistant's turn; an empty one is left out (Anthropic refuses a turn
                # with empty content, and two user turns in a row are read as one)
                said = [{"role": "assistant", "content": reply.text}] if reply.text else []
                convo = convo + said + [{"role": "user", "content": reask}]
        if len(spent) > 1:                  # re-asked: the reply stands for all its attempts
            reply.usage = {k: sum(u.get(k, 0) for u in spent) for k in sorted(set().union(*spent))} | {
                "attempts": len(spent)}
        if not sent:                        # a kept reply this check takes: answered from the cache, as kept
            with self.lock:
                self._stats["cache_hits"] += 1
            return reply
        self.cache.put(key, reply, self.provider, self.model)
        return reply

    def map(self, requests_, workers=8, desc=None, progress=True, invalid="raise"):
        """Run many chat requests concurrently; results in input order. Each request is a dict of
        chat() keyword arguments. Exceptions propagate (the first failure in input order), except
        that with invalid="return" a ReplyInvalid (a RequestRefused among them) takes its request's place in
        the results, until REFUSED_STOP requests in a row (input order, over the client's maps; a reply the
        server sent in between starts over) are refused: then that refusal is raised."""
        from tqdm import tqdm
        self.transport.resume()                  # a new run of requests: an earlier map's failure stops none of them
        if self.batch is not None and requests_:   # the provider's batch API fills the cache first
            self.batch.fill_cache(requests_, desc or self.label)
        out = [None] * len(requests_)
        ex = ThreadPoolExecutor(max_workers=max(1, workers))
        try:
            with tqdm(total=len(requests_), desc=desc or self.label, disable=not progress or not requests_) as bar:
                futs = [ex.submit(self.chat, **r) for r in requests_]
                for f in futs:
                    f.add_done_callback(lambda _: bar.update(1))
                for i, f in enumerate(futs):
                    try:
                        out[i] = f.result()
                    except ReplyInvalid as e:
                        if invalid != "return":
                            raise
                        out[i] = e
                    except LLMError as e:
                        if invalid != "return" or e.status not in REFUSED_STATUS or not REFUSED_FOR.search(str(e)):
                            raise
                        out[i] = RequestRefused(e)
                    with self.lock:
                        if isinstance(out[i], RequestRefused):
                            self._refused += 1
                            if self._refused >= REFUSED_STOP:
                                raise LLMError(f"{self.label}: {self._refused} requests in a row refused, stopped "
                                               f"(not one page: fix the cause and rerun); the last: {out[i]}",
                                               out[i].status, self.provider, out[i].body)
                        elif isinstance(out[i], Reply) and not out[i].cached:
                            self._refused = 0
        except BaseException:
            # Ctrl-C or a failure: requests not yet started are cancelled, those in flight stopped
            # (Transport.abort), so the exit is not held up by workers running out their retries
            ex.shutdown(wait=False, cancel_futures=True)
            self.transport.abort()
            raise
        ex.shutdown()
        return out

    def usage(self):
        """Calls, HTTP calls, cache hits, retries, tokens and (with a price table entry) cost in USD."""
        s, batch = self.stats, dict(self._batch_tokens)
        p = self.prices.get(accounting.price_key(self.label))
        # unknown without a chat price (a per-token rerank entry is another kind) or with unmetered replies
        priced = isinstance(p, (list, tuple)) and not s.get("unmetered")
        sync = {k: v - batch.get(k, 0) for k, v in s.items() if isinstance(v, int)}
        costs = [accounting.token_cost(p, sync), accounting.token_cost(p, batch, batch=True)] if priced else [None]
        s["cost_usd"] = None if None in costs else sum(costs)
        s["model"] = self.label
        if self.adapted:
            s["adapted"] = list(self.adapted)
        return s


def make_client(spec, base_url=None, api_key=None, cache_dir=None, **kw):
    """'provider:model' -> Client. Keys come from the provider's conventional environment variable;
    a missing key is an error naming it. base_url overrides the provider's (any OpenAI-compatible
    server). 'offline' is the deterministic offline engine behind the same interface: over HTTP with
    base_url (`serve-offline`), or in process with handler=offline.respond (the caller imports it),
    both under one cache identity ('offline'); without either, ValueError."""
    provider, _, model = spec.partition(":")
    shown = endpoints.redact_url(spec)      # a spec typed with credentials in it is never echoed
    if provider == "offline":   # over HTTP or in process: a stable identity, whatever the port
        if not base_url and kw.get("handler") is None:
            raise ValueError(f"{shown!r}: give base_url (the engine served over HTTP by serve-offline) or "
                             "handler (its in-process function, offline.respond)")
        return Client.open(base_url or None, model or "offline-engine", protocol="openai", provider="offline",
                           cache_dir=cache_dir, identity="offline", **kw)
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {endpoints.redact_url(provider)!r} in {shown!r}; known: offline, "
                         f"{', '.join(PROVIDERS)}")
    if not model:
        raise ValueError(f"{shown!r}: give provider:model, e.g. openai:gpt-5.5")
    p = PROVIDERS[provider]
    given = endpoints.Endpoint.parse(base_url) if isinstance(base_url, str) and base_url else base_url or None
    home = urlparse(p["base"]).hostname if p["base"] else None
    if given and provider in HOSTED and not same_origin(given, p["base"]):   # the host, and https on 443
        raise ValueError(f"{shown!r} with --base-url {given}: {provider}'s key ({p['keys'][0]}) goes only to {home} "
                         f"over https on port 443 (or to {p['base_env']}); for another server use "
                         "openai-compatible:MODEL (its key from OPENAI_COMPATIBLE_API_KEY)")
    key, base, bearer = provider_environment(provider, api_key)
    base = given or base
    if base is None:
        raise ValueError(f"{shown!r}: provider {provider!r} needs base_url (--base-url)")
    base = base if isinstance(base, endpoints.Endpoint) else endpoints.Endpoint.parse(base)
    if key is None and not p.get("key_optional"):
        raise LLMError(f"{shown}: no API key: set {' or '.join(p['keys'])}", None, provider)
    max_field = p.get("max_field", "max_tokens")
    if provider == "openai" and base.host != "api.openai.com":
        max_field = "max_tokens"   # compatible servers (vLLM, GLM, ...) know only max_tokens
    return Client.open(base, model, api_key=key, protocol=p["protocol"], provider=provider, cache_dir=cache_dir,
                  max_field=max_field, json_mode=p.get("json_mode", True), bearer=bearer, **kw)


def provider_environment(provider, api_key=None):
    """A provider's key and base URL from its conventional environment variables -> (key or None, base
    URL or None, whether the key is a bearer token). OpenAI's clients also read OPENAI_API_BASE (what many
    .env files set). Anthropic's SDK reads ANTHROPIC_AUTH_TOKEN (sent as Authorization: Bearer) and an
    ANTHROPIC_BASE_URL without /v1 (it adds /v1/messages). Local servers have a default key."""
    p = PROVIDERS[provider]
    base = (os.environ.get(p["base_env"]) if p.get("base_env") else None) or p["base"]
    if provider == "openai" and not os.environ.get("OPENAI_BASE_URL"):
        base = os.environ.get("OPENAI_API_BASE") or base
    if provider == "anthropic" and os.environ.get("ANTHROPIC_BASE_URL") and not base.rstrip("/").endswith("/v1"):
        base = base.rstrip("/") + "/v1"
    key = api_key or next((os.environ[v] for v in p["keys"] if os.environ.get(v)), None)
    token = os.environ.get("ANTHROPIC_AUTH_TOKEN") if key is None and provider == "anthropic" else None
    key = key if key is not None else token or p.get("default_key")
    return key, base, bool(token)
