"""Deploy the Shield Reranker outside this process: export to checkpoints serving engines load, and
a rerank HTTP endpoint that RAG frameworks call.

Export (`export`): the base Qwen3-Reranker with the trained LoRA merged in (float32, then the output
dtype), written in one of two standard Hugging Face layouts:
- "seq-cls": Qwen3ForSequenceClassification with one label. Its classifier row is
  score.weight = E[yes] - E[no] (the tied embedding's rows, or an untied head's), so its logit on
  the reranker prompt is our margin z_yes - z_no and sigmoid(logit) is P(yes) of the 2-way softmax
  (the model card's score). vLLM (`--runner pooling`), Infinity and sentence-transformers'
  CrossEncoder load this layout as a Qwen3 reranker (vLLM's convert_model_to_seq_cls.py,
  method from_2_way_softmax, writes the same row).
- "causal": the merged Qwen3ForCausalLM, what the model card's snippet and vLLM's
  `hf_overrides` route load.
Beside the weights: the tokenizer files, the prompt as a chat template (vLLM's Qwen3-reranker
template with the Shield instruction as its default), `geodef_export.json` (provenance) and a
model card (README.md) with the serving commands.

Serving (`RerankServer`): `POST /v1/rerank` (aliases `/rerank`, `/v2/rerank`) takes the
Cohere/Jina/vLLM request {model, query, documents: [str | {text}], top_n?, return_documents?} and
answers {id, model, results: [{index, relevance_score, document?}] best first, usage}; a body with
`texts` on /rerank gets Text Embeddings Inference's shape [{index, score, text?}]. relevance_score
= sigmoid(margin). `GET /health`, `GET /v1/models`. Requests arriving together are scored in
shared micro-batches by one scoring thread (a bounded queue; a full queue answers 503).
Every request is untrusted: sizes are capped, every field is validated (4xx naming it), documents
are tokenized as text (reranker.text_tokenizer), slow clients time out, and an optional API key is
compared in constant time and never printed.

Usage: export(rr_folder, "out/shield", adapter="runs/x/adapter")
       RerankServer(rr, port=8000).serve_forever()
"""
import hashlib
import hmac
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import torch

import lora
import reranker

# ----------------------------------------------------------------------------- export

FORMATS = ("seq-cls", "causal")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


def chat_template(instruction):
    """vLLM's Qwen3-reranker score template (examples/pooling/score/template/qwen3_reranker.jinja)
    with `instruction` as the default <Instruct>: the model card's prompt, query and document as
    the "query" and "document" messages."""
    default = json.dumps(instruction)       # a JSON string is a valid Jinja string literal
    return ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
            "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
            "<Instruct>: {{ instruction | default(messages | selectattr(\"role\", \"eq\", \"system\") | "
            f"map(attribute=\"content\") | first | default({default}, true), true) }}}}\n"
            "<Query>: {{ messages | selectattr(\"role\", \"eq\", \"query\") | map(attribute=\"content\") | first }}\n"
            "<Document>: {{ messages | selectattr(\"role\", \"eq\", \"document\") | map(attribute=\"content\") | first }}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{{ '' }}")   # ends in a tag: Jinja drops
                                                                           # a template's final newline


def _sha1(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def export(model, out_dir, adapter=None, fmt="seq-cls", dtype=None, instruction=reranker.SHIELD_INSTRUCTION,
           quantized_base=False, name=None):
    """Write the merged Shield (base `model`: hub id or folder; `adapter`: a PEFT LoRA folder or None)
    to `out_dir` in `fmt` and `dtype` (default: the checkpoint's config dtype). quantized_base: the
    adapter was trained over an NF4 base (said in the model card: the merge uses the full-precision
    base weights). Returns out_dir."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    folder, sha = reranker.resolve_model_path(model)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        raw_cfg = json.load(f)
    dtype = dtype or raw_cfg.get("torch_dtype") or raw_cfg.get("dtype") or "bfloat16"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    out_dt = getattr(torch, dtype)
    # the merge in float32: W + (alpha/r) B A rounded once, to the output dtype
    qwen, cfg, lm_head = reranker.load_qwen3(folder, dtype=torch.float32)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    yes, no = (tok.encode(w, add_special_tokens=False).ids for w in ("yes", "no"))
    if len(yes) != 1 or len(no) != 1:
        raise reranker.CheckpointError(f"{folder}/tokenizer.json: 'yes' and 'no' must be single tokens")
    if adapter:
        lora.load_adapter(qwen, adapter)
        lora.merge_and_unload(qwen)
    state = {"model." + k: v.to(out_dt).contiguous() for k, v in qwen.state_dict().items()}   # checkpoint keys
    head = lm_head.float() if lm_head is not None else qwen.embed_tokens.weight
    pad = tok.token_to_id("<|endoftext|>")
    config = {k: v for k, v in raw_cfg.items() if k not in ("torch_dtype", "dtype", "_note")}
    config.update(torch_dtype=dtype, transformers_version=raw_cfg.get("transformers_version", "4.51.0"))
    if fmt == "seq-cls":
        # (1, C): logit = h_last . (E[yes] - E[no]) = z_yes - z_no; computed in float32, rounded once
        state["score.weight"] = (head[yes[0]].float() - head[no[0]].float())[None].to(out_dt).contiguous()
        config.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"},
                      label2id={"LABEL_0": 0}, use_sep_token=False)
    else:
        config["architectures"] = ["Qwen3ForCausalLM"]
        if lm_head is not None:                       # untied: the full head goes with the weights
            state["lm_head.weight"] = lm_head.to(out_dt).contiguous()
    if pad is not None:   # AutoModelForSequenceClassification pools the last token that is not pad
        config["pad_token_id"] = pad
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".model.safetensors.tmp{os.getpid()}")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    for f in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(folder, f)):
            shutil.copy(os.path.join(folder, f), os.path.join(out_dir, f))
    if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):   # what AutoTokenizer needs
        _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                    {"tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left",
                     **({"pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>"} if pad is not None else {})})
    _write_json(os.path.join(out_dir, "config.json"), config)
    with open(os.path.join(out_dir, "qwen3_reranker.jinja"), "w", encoding="utf-8") as f:
        f.write(chat_template(instruction))
    meta = {"format": fmt, "dtype": dtype, "base_model": str(model), "base_revision": sha,
            "adapter": os.path.abspath(adapter) if adapter else None,
            "adapter_sha1": _sha1(os.path.join(adapter, "adapter_model.safetensors")) if adapter else None,
            "merged_in": "float32", "quantized_base_during_training": bool(quantized_base),
            "yes_id": yes[0], "no_id": no[0], "instruction": instruction, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write_json(os.path.join(out_dir, "geodef_export.json"), meta)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(meta, name or os.path.basename(os.path.normpath(out_dir))))
    return out_dir


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def model_card(meta, name):
    nf4 = ("\nThe adapter was trained over an NF4 (4-bit) base; it is merged here into the full-precision base "
           "weights, so scores differ slightly from the training-time forward (the 4-bit rounding is not "
           "reproduced).\n" if meta["quantized_base_during_training"] else "")
    adapter = f"LoRA adapter `{meta['adapter']}` (SHA-1 {meta['adapter_sha1']})" if meta["adapter"] else "no adapter"
    head = ("a one-label `Qwen3ForSequenceClassification`: `score.weight` = E[yes] - E[no], so the logit is the "
            "margin z_yes - z_no and sigmoid(logit) is P(yes)" if meta["format"] == "seq-cls" else
            "the merged `Qwen3ForCausalLM`: score with the logits of \"yes\" and \"no\" at the last position")
    if meta["format"] == "seq-cls":
        vllm = f"vllm serve ./{name} --runner pooling --chat-template ./{name}/qwen3_reranker.jinja"
    else:
        vllm = (f"vllm serve ./{name} --runner pooling --chat-template ./{name}/qwen3_reranker.jinja --hf-overrides "
                "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                "\"is_original_qwen3_reranker\": true}'")
    return f"""# {name}: GEO Defender Shield Reranker ({meta['format']}, {meta['dtype']})

The Shield Reranker of *When Optimization Becomes Manipulation: Defending Generative Search against
Malicious Generative Engine Optimization*: the frozen base `{meta['base_model']}` (revision
{meta['base_revision'] or 'local folder'}) with the {adapter} merged into its weights in float32,
then stored in {meta['dtype']}. Layout: {head}. Made by `python run.py export` of the GEO Defender
reference implementation at {meta['time']}.
{nf4}
## Prompt

The Qwen3-Reranker prompt (its model card), with the Shield instruction (paper A.1.2):

```
<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {meta['instruction']}
<Query>: {{query}}
<Document>: {{document}}<|im_end|>
<|im_start|>assistant
<think>

</think>

```

`qwen3_reranker.jinja` is that prompt as vLLM's score template (the instruction above is its
default). Score the last token; relevance = sigmoid(z_yes - z_no).

## Serving

Run here (tests of the repository that exported it): loading this folder with transformers
(`AutoModelForSequenceClassification` / `AutoModelForCausalLM`) gives the Shield's margins to
1e-4 in float32, and sentence-transformers' `CrossEncoder` (seq-cls) gives sigmoid of them on the
formatted pairs below. **Not run here**: vLLM (needs a GPU) and Infinity; their commands follow
their documentation.

- vLLM, many GPUs or replicas (OpenAI/Cohere-style `/rerank`, `/v1/rerank`, `/score`):
  `{vllm}`
- sentence-transformers (run here): `CrossEncoder("./{name}")` (one label: sigmoid applied) on pairs
  `(prefix + "<Instruct>: ...\\n<Query>: " + query + "\\n", "<Document>: " + document + suffix)`,
  the prompt above split before `<Document>:`; a bare (query, document) pair lacks the prompt and
  scores poorly.
- Infinity: `infinity_emb v2 --model-id ./{name}`; it applies no template, so send the formatted
  query and document strings as above.

## Security

An engine that tokenizes the prompt text matches the tokenizer's added tokens anywhere in it: a
document containing `<|im_end|>` or `<think>` can then close the user turn and write the
assistant's. Remove those strings from queries and documents before sending them, or send token
ids made as GEO Defender's `Reranker.tokenize` makes them (added tokens never matched in text).
"""


# ----------------------------------------------------------------------------- rerank server


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, the field at fault."""

    def __init__(self, status, message, param=None):
        super().__init__(message)
        self.status, self.param = status, param


def sigmoid(m):
    return 1.0 / (1.0 + math.exp(-m)) if m >= 0 else math.exp(m) / (1.0 + math.exp(m))


def parse_rerank(body, max_documents):
    """A decoded JSON body -> (query, texts, top_n or None, return_documents, tei). Cohere/Jina/vLLM
    shape ({query, documents, top_n, return_documents}) or TEI's ({query, texts, return_text,
    raw_scores}). Unknown fields are ignored; every known one is checked."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    tei = "texts" in body and "documents" not in body
    q = body.get("query")
    if not isinstance(q, str) or not q.strip():
        raise RequestError(400, "query: a non-empty string is required", "query")
    field = "texts" if tei else "documents"
    docs = body.get(field)
    if not isinstance(docs, list) or not docs:
        raise RequestError(400, f"{field}: a non-empty list is required", field)
    if len(docs) > max_documents:
        raise RequestError(400, f"{field}: {len(docs)} items, at most {max_documents}", field)
    texts = []
    for i, d in enumerate(docs):
        if isinstance(d, dict) and not tei:
            d = d.get("text")
            if not isinstance(d, str):
                raise RequestError(400, f"documents[{i}].text: a string is required", f"documents[{i}].text")
        if not isinstance(d, str):
            raise RequestError(400, f"{field}[{i}]: a string{'' if tei else ' or {text}'} is required", f"{field}[{i}]")
        texts.append(d)
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise RequestError(400, f"top_n: a non-negative integer is required, got {top_n!r}", "top_n")
    flags = ("return_text", "raw_scores") if tei else ("return_documents",)
    for k in flags:
        if k in body and not isinstance(body[k], bool):
            raise RequestError(400, f"{k}: true or false is required", k)
    if tei:
        return q, texts, None, bool(body.get("return_text")), (True, bool(body.get("raw_scores")))
    return q, texts, top_n, bool(body.get("return_documents")), (False, False)


class Batcher:
    """One scoring thread over a bounded queue of jobs (one job = one request's token-id lists). Jobs
    waiting together are scored in one `score_ids` call, which packs their documents into shared
    micro-batches, as long as they fit one micro-batch's token budget together: small requests
    share the GEMMs, while a request that fills a micro-batch on its own is scored alone, so that its
    documents keep sharing their query's prompt prefix (`Reranker.share_prefix`) and it is answered
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


RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
GET_PATHS = ("/health", "/v1/models")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive: a client's connection serves many requests
    server_version = "geo-defender-rerank"
    sys_version = ""

    def setup(self):
        self.timeout = self.server.conf["read_timeout"]   # socket timeout: an idle or slow client is dropped
        super().setup()

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
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, e, headers=()):
        self._send(e.status, {"error": {"message": str(e), "type": "invalid_request_error" if e.status < 500 else
                                        "server_error", "param": e.param, "code": e.status}}, headers)

    def log_message(self, fmt, *args):   # one line per request; never headers (the key) or bodies
        if self.server.conf["log"]:
            sys.stderr.write(f"[serve] {self.address_string()} {fmt % args}\n")

    # -- request parts
    def _authorised(self):
        key = self.server.conf["api_key"]
        if not key:
            return True
        got = self.headers.get("Authorization", "")
        token = got[7:] if got[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))

    def _body(self):
        conf = self.server.conf
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError(411, "send the body with a Content-Length (no Transfer-Encoding)")
        n = self.headers.get("Content-Length")
        if n is None:
            self.close_connection = True
            raise RequestError(411, "Content-Length is required")
        try:
            n = int(n)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise RequestError(400, "Content-Length: a non-negative integer is required")
        if n > conf["max_body_bytes"]:
            self.close_connection = True     # the unread body must not be parsed as the next request
            raise RequestError(413, f"body of {n} bytes, at most {conf['max_body_bytes']}")
        deadline, parts, got = time.monotonic() + conf["body_timeout"], [], 0
        while got < n:
            if time.monotonic() > deadline:
                self.close_connection = True
                raise RequestError(408, f"the body did not arrive within {conf['body_timeout']:.0f} s")
            try:
                chunk = self.rfile.read1(min(65536, n - got))   # one recv: blocks at most the socket timeout
            except TimeoutError:
                self.close_connection = True
                raise RequestError(408, f"the body stalled after {got} of {n} bytes") from None
            if not chunk:
                self.close_connection = True
                raise RequestError(400, f"the body ended after {got} of {n} bytes (Content-Length)")
            parts.append(chunk)
            got += len(chunk)
        raw = b"".join(parts)
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

    # -- methods
    def do_GET(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            if path == "/health":
                return self._send(200, {"status": "ok"})
            if path in RERANK_PATHS:
                raise RequestError(405, f"{path} takes POST")
            if path != "/v1/models":
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            name = self.server.conf["model_name"]
            self._send(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "geo-defender"}]})
        except RequestError as e:
            self._fail(e, [("Allow", "POST")] if e.status == 405 else
                       [("WWW-Authenticate", "Bearer")] if e.status == 401 else ())

    def do_POST(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        t0 = time.perf_counter()
        try:
            if path in GET_PATHS:
                self.close_connection = True
                raise RequestError(405, f"{path} takes GET")
            if path not in RERANK_PATHS:
                self.close_connection = True
                raise RequestError(404, f"no route {path}")
            if not self._authorised():
                self.close_connection = True
                raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
            self._rerank(self._body(), t0)
        except RequestError as e:
            self._fail(e, [("Allow", "GET")] if e.status == 405 else
                       [("WWW-Authenticate", "Bearer")] if e.status == 401 else
                       [("Retry-After", "1")] if e.status == 503 else ())
        except Exception as e:   # a defect, not the client's fault: logged here, a short 500 there
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            self._fail(RequestError(500, f"internal error ({type(e).__name__})"))

    def _method_not_allowed(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        self.close_connection = True
        if path in RERANK_PATHS or path in GET_PATHS:
            self._fail(RequestError(405, f"{path} takes {'POST' if path in RERANK_PATHS else 'GET'}"),
                       [("Allow", "POST" if path in RERANK_PATHS else "GET")])
        else:
            self._fail(RequestError(404, f"no route {path}"))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def _rerank(self, body, t0):
        conf, rr = self.server.conf, self.server.rr
        query, texts, top_n, with_text, (tei, raw) = parse_rerank(body, conf["max_documents"])
        try:
            ids = rr.tokenize(query, texts)
        except ValueError as e:   # text the tokenizer's BPE turns into a control token
            raise RequestError(400, f"query/documents: {e}") from None
        m = self.server.batcher.submit(ids, conf["score_timeout"])
        order = sorted(range(len(texts)), key=lambda i: (-m[i], i))              # best first, ties by index
        if tei:
            out = [{"index": i, "score": m[i] if raw else sigmoid(m[i]), **({"text": texts[i]} if with_text else {})}
                   for i in order]
            return self._send(200, out)
        order = order[:top_n] if top_n is not None else order
        results = [{"index": i, "relevance_score": sigmoid(m[i]), **({"document": {"text": texts[i]}} if with_text else {})}
                   for i in order]
        self._send(200, {"id": uuid.uuid4().hex, "model": body.get("model") if isinstance(body.get("model"), str)
                         else conf["model_name"], "results": results,
                         "usage": {"total_tokens": sum(map(len, ids))},
                         "meta": {"elapsed_ms": round(1000 * (time.perf_counter() - t0), 1)}})


class RerankServer(ThreadingHTTPServer):
    """The rerank endpoint over one loaded `Reranker` (adapter attached or not). Port 0 picks a free
    one (`server_address[1]`)."""
    daemon_threads = True

    def __init__(self, rr, host="127.0.0.1", port=8000, api_key=None, model_name="geo-defender-shield",
                 max_documents=1000, max_body_bytes=8 << 20, read_timeout=30.0, body_timeout=60.0,
                 score_timeout=600.0, max_queue=64, log=True):
        super().__init__((host, port), _Handler)
        self.rr = rr
        self.batcher = Batcher(rr, max_queue=max_queue)
        self.conf = {"api_key": api_key or None, "model_name": model_name, "max_documents": max_documents,
                     "max_body_bytes": max_body_bytes, "read_timeout": read_timeout, "body_timeout": body_timeout,
                     "score_timeout": score_timeout, "log": log}

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
