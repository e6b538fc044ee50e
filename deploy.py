"""Deploy the Shield Reranker outside this process: export to checkpoints serving engines load, and
a rerank HTTP endpoint that RAG frameworks call.

Export (`export`): the base Qwen3-Reranker with the trained LoRA merged in (float32, then the output
dtype), written in one of two standard Hugging Face layouts:
- "seq-cls": Qwen3ForSequenceClassification with one label. Its classifier row is
  score.weight = E[yes] - E[no] (the tied embedding's rows, or an untied head's), so its logit on
  the reranker prompt is our margin z_yes - z_no and sigmoid(logit) is P(yes) of the 2-way softmax
  (the model card's score). vLLM (`--runner pooling`) and sentence-transformers'
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
= sigmoid(margin). An `instruction` takes the prompt's <Instruct>: place for that request on the
base model; the Shield refuses one other than its own (400) unless started with allow_instruction.
`GET /health`, `GET /v1/models`. Requests arriving together are scored in shared micro-batches by
one scoring thread (a bounded queue; a full queue answers 503).
Every request is untrusted: sizes are capped, every field is validated (4xx naming it), documents
are tokenized as text (reranker.text_tokenizer), slow clients time out, and an optional API key is
compared in constant time and never printed.

Usage: export(rr_folder, "out/shield", adapter="runs/x/adapter")
       RerankServer(rr, port=8000).serve_forever()
"""
import contextlib
import copy
import hashlib
import hmac
import json
import math
import os
import queue
import re
import shutil
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
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
    the "query" and "document" messages. Built from reranker.PREFIX, BODY and SUFFIX (which hold no
    Jinja syntax), so it renders the bytes the reranker scores."""
    default = json.dumps(instruction)       # a JSON string is a valid Jinja string literal
    content = lambda role: f'messages | selectattr("role", "eq", "{role}") | map(attribute="content") | first'
    body = reranker.BODY.format(   # a request's `instruction`, else a system message, else the default
        instruction="{{ instruction | default(" + content("system") + " | default(" + default + ", true), true) }}",
        query="{{ " + content("query") + " }}", doc="{{ " + content("document") + " }}")
    # Jinja drops a template's final newline (SUFFIX ends in two): an empty expression after it keeps them
    return reranker.PREFIX + body + reranker.SUFFIX + "{{ '' }}"


def _sha1(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


class ExportError(ValueError):
    """An export refused (the output folder) or failed (a write): the folder named, nothing half-written left."""


def check_out_dir(out_dir, overwrite=False, protected=()):
    """Refuse an output folder that export must not replace: "/", the home folder, one of `protected`
    (a run folder, the runs directory, the model or adapter being exported) or a folder holding one,
    a folder that holds a run (config.json with a "config" record) or run folders; and an existing
    non-empty folder unless `overwrite`, which replaces only an earlier export (geodef_export.json)."""
    real = os.path.realpath(out_dir)
    home = os.path.realpath(os.path.expanduser("~"))
    if real in (os.path.realpath(os.sep), home):
        raise ExportError(f"--out {out_dir}: refusing to export into {real}")
    for p in protected:
        rp = os.path.realpath(p)
        if real == rp or rp.startswith(real.rstrip(os.sep) + os.sep):
            raise ExportError(f"--out {out_dir}: holds {p}, which export must not replace; choose a new folder")
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ExportError(f"--out {out_dir}: a file, not a folder")
    if _is_run(out_dir) or any(_is_run(os.path.join(out_dir, d)) for d in os.listdir(out_dir)):
        raise ExportError(f"--out {out_dir}: a run folder or a folder of runs; choose a new folder")
    if os.listdir(out_dir):
        if not overwrite:
            raise ExportError(f"--out {out_dir}: not empty; choose a new folder, or --overwrite to replace an "
                              "earlier export")
        if not os.path.isfile(os.path.join(out_dir, "geodef_export.json")):
            raise ExportError(f"--out {out_dir}: not an earlier export (no geodef_export.json); --overwrite "
                              "replaces only exports")


def _is_run(folder):
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return "config" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def export(model, out_dir, adapter=None, fmt="seq-cls", dtype=None, instruction=reranker.SHIELD_INSTRUCTION,
           quantized_base=False, name=None, overwrite=False, protected=()):
    """Write the merged Shield (base `model`: hub id or folder; `adapter`: a PEFT LoRA folder or None)
    to `out_dir` in `fmt` and `dtype` (default: the checkpoint's config dtype). quantized_base: the
    adapter was trained over an NF4 base (said in the model card: the merge uses the full-precision
    base weights). The folder is built beside `out_dir` and renamed into place whole: a failure (a
    full disk, a kill) leaves what was there before (see check_out_dir for what is refused).
    Returns out_dir."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    check_out_dir(out_dir, overwrite, protected=[p for p in (model, adapter, *protected) if p and os.path.exists(p)])
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.export-{os.getpid()}")
    old = tmp + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(model, tmp, adapter, fmt, dtype, instruction, quantized_base,
                      name or os.path.basename(os.path.normpath(out_dir)))
        if os.path.exists(out_dir):          # an empty folder, or an earlier export with --overwrite
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except Exception as e:
        if os.path.exists(old) and not os.path.exists(out_dir):
            os.rename(old, out_dir)
        if isinstance(e, (ValueError, reranker.CheckpointError)):
            raise
        raise ExportError(f"{out_dir}: export failed, nothing written ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _write_export(model, out_dir, adapter, fmt, dtype, instruction, quantized_base, name):
    """The export's files into a new folder `out_dir` (export() renames it into place)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
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
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
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
        f.write(model_card(meta, name))


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
                "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
                "\"yes\"], \"is_original_qwen3_reranker\": true}'")
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
{reranker.PREFIX}<Instruct>: {meta['instruction']}
<Query>: {{query}}
<Document>: {{document}}<|im_end|>
<|im_start|>assistant
<think>

</think>

```

`qwen3_reranker.jinja` is that prompt as vLLM's score template (the instruction above is its
default). Score the last token; relevance = sigmoid(z_yes - z_no).

## Serving

What reproduces the Shield's scores (its margins; relevance = sigmoid of them):
- run (tests of the repository that exported it): transformers (`AutoModelForSequenceClassification` /
  `AutoModelForCausalLM`) on the prompt above, to 1e-4 in float32; sentence-transformers 4.0 or newer
  (its `CrossEncoder.predict` tokenizes a pair as given; the tests run 5 or newer): `CrossEncoder`
  (seq-cls) on the formatted pairs below, sigmoid of them; GEO Defender's own `python run.py serve`
  (Cohere/Jina/vLLM and TEI request shapes).
- not run (it needs a GPU): vLLM with the template below; it renders the same prompt, so it is
  expected to, within its kernels' rounding.
- does **not**: Infinity (0.0.78), which strips leading and trailing whitespace from query and
  document, nor sentence-transformers 3.x (which Infinity installs), whose `CrossEncoder.predict`
  strips both texts of a pair: the newline after the query and the blank line after `</think>` are
  lost (`</think>` stays), so their scores and rankings differ from the Shield's. Use one of the above.

- vLLM, many GPUs or replicas (OpenAI/Cohere-style `/rerank`, `/v1/rerank`, `/score`):
  `{vllm}`
- sentence-transformers 4.0 or newer (run here): `CrossEncoder("./{name}")` (one label: sigmoid
  applied) on pairs
  `(prefix + "<Instruct>: ...\\n<Query>: " + query + "\\n", "<Document>: " + document + suffix)`,
  the prompt above split before `<Document>:`; a bare (query, document) pair lacks the prompt and
  scores poorly.

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


@dataclass
class RerankRequest:
    """A validated rerank request (parse_rerank)."""
    query: str
    texts: list
    tei: bool = False             # TEI's request and response shape
    top_n: int = None             # None: every document
    with_text: bool = False       # return_documents / return_text
    raw: bool = False             # TEI raw_scores: margins instead of sigmoid(margin)
    truncate: bool = True         # TEI truncate false: a too-long input is an error (413, as TEI)
    left: bool = False            # TEI truncation_direction Left: a too-long document loses its start
    max_doc_tokens: int = None    # Cohere max_tokens_per_doc: each document cut to that many tokens
    model: str = None             # echoed in the reply
    document_string: bool = False  # Infinity's /rerank shape: results[].document a string, not {text}
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


MAX_INSTRUCTION_CHARS = 4096


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
    """A decoded JSON body -> RerankRequest. Cohere/Jina/vLLM shape ({query, documents, top_n,
    return_documents, max_tokens_per_doc}) or TEI's ({query, texts, return_text, raw_scores,
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
    if tei:
        req.with_text, req.raw = _flag(body, "return_text"), _flag(body, "raw_scores")
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


RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
GET_PATHS = ("/health", "/v1/models", "/info")


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
        conf = self.server.conf
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError(411, "send the body with a Content-Length (no Transfer-Encoding)")
        lengths = set(self.headers.get_all("Content-Length") or [])
        if len(lengths) > 1:            # which one frames the body is ambiguous (request smuggling)
            self.close_connection = True
            raise RequestError(400, "Content-Length: given more than once with different values")
        n = self.headers.get("Content-Length")
        if n is None:
            self.close_connection = True
            raise RequestError(411, "Content-Length is required")
        n = n.strip()
        if not n.isascii() or not n.isdigit():   # 1*DIGIT (RFC 9110 8.6): not int()'s "+49", "4_9", " 49 "
            self.close_connection = True
            raise RequestError(400, "Content-Length: a non-negative integer is required")
        n = int(n)
        if n > conf["max_body_bytes"]:
            self.close_connection = True     # the unread body must not be parsed as the next request
            self._drain(n)
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

    def _drain(self, n):
        """Read and drop up to `n` body bytes (at most 4x the body cap, within the body timeout) so
        that a client still writing its oversized body reads the 413 instead of a broken pipe."""
        conf = self.server.conf
        left, deadline = min(n, 4 * conf["max_body_bytes"]), time.monotonic() + conf["body_timeout"]
        with contextlib.suppress(OSError):
            while left > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(65536, left))
                if not chunk:
                    break
                left -= len(chunk)

    # -- methods
    def do_GET(self):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            if path == "/health":
                return self._send(200, {"status": "ok"})
            if path == "/info":                     # Text Embeddings Inference's shape (tei-client)
                return self._send(200, self.server.info())
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
        conf = self.server.conf
        req = parse_rerank(body, conf["max_documents"])
        rr = self.server.prompter(req.instruction)
        # Infinity owns POST /rerank with `documents` and answers the document as a string; LiteLLM's
        # infinity/ provider posts there ({api_base}/rerank) and validates that shape. /v1 and /v2
        # answer Cohere's {text} object.
        req.document_string = urlsplit(self.path).path.rstrip("/") == "/rerank" and not req.tei
        try:
            texts = fit_documents(rr, req)
            ids = rr.tokenize(req.query, texts)
        except ValueError as e:   # a prompt without room for the document, or text BPE turns into a control token
            raise RequestError(400, f"query/instruction/documents: {e}") from None
        m = self.server.batcher.submit(ids, conf["score_timeout"])
        order = sorted(range(len(texts)), key=lambda i: (-m[i], i))              # best first, ties by index
        if req.tei:
            out = [{"index": i, "score": m[i] if req.raw else sigmoid(m[i]),
                    **({"text": req.texts[i]} if req.with_text else {})} for i in order]
            return self._send(200, out)
        order = order[:req.top_n] if req.top_n is not None else order
        doc = (lambda t: t) if req.document_string else (lambda t: {"text": t})
        results = [{"index": i, "relevance_score": sigmoid(m[i]),
                    **({"document": doc(req.texts[i])} if req.with_text else {})} for i in order]
        self._send(200, {"id": uuid.uuid4().hex, "model": req.model or conf["model_name"], "results": results,
                         "usage": {"total_tokens": sum(map(len, ids))},
                         "meta": {"elapsed_ms": round(1000 * (time.perf_counter() - t0), 1)}})


def serves_shield(rr):
    """Whether `rr` scores as the Shield: a LoRA adapter attached, or loaded from a folder `export`
    merged one into (its geodef_export.json names the adapter)."""
    if lora.lora_modules(rr.model):
        return True
    try:
        with open(os.path.join(str(rr.name_or_path), "geodef_export.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("adapter"))
    except (OSError, ValueError, AttributeError):   # a hub id or a plain folder: no export record
        return False


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
        self.shield = serves_shield(rr)
        self.batcher = Batcher(rr, max_queue=max_queue)
        self.conf = {"api_key": api_key or None, "model_name": model_name, "max_documents": max_documents,
                     "max_body_bytes": max_body_bytes, "read_timeout": read_timeout, "body_timeout": body_timeout,
                     "score_timeout": score_timeout, "log": log, "allow_instruction": allow_instruction}

    def prompter(self, instruction):
        """The Reranker that builds this request's prompts: the server's own, or (for another
        `instruction`) a shallow copy with that instruction. The copy shares the model and tokenizers
        and only tokenizes; the scoring thread takes token ids, so requests with different
        instructions share batches and never see each other's. The Shield refuses another
        instruction unless `allow_instruction`: its adapter was trained under its own, and a
        caller's could change what it scores, down to switching the defense off."""
        if instruction is None or instruction == self.rr.instruction:
            return self.rr
        if self.shield and not self.conf["allow_instruction"]:
            raise RequestError(400, "instruction: refused; this server scores with the Shield, whose adapter was "
                                    "trained under its own instruction, and another one could switch the defense "
                                    "off (omit it, or start the server with --allow-instruction)", "instruction")
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
