"""Export the Shield Reranker to checkpoints that serving engines load: the base Qwen3-Reranker
with the trained LoRA merged in (float32, then the output dtype), written in one of two standard
Hugging Face layouts:
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
model card (README.md) with the serving commands. The Shield's identity (`identity`: whether an
adapter is merged in, its SHA-1, the instruction) also goes into the files every copy keeps: the
`geodef_export` entry of config.json (transformers keeps unknown config keys when it re-saves) and of
the weights' safetensors header `__metadata__`; `identity_marks` reads them back, wherever the
folder was resolved to (a hub id's snapshot folder included).

Usage: export(rr_folder, "out/shield", adapter="runs/x/adapter")
"""
import json
import os
import shutil
import sys
import time

import torch

import lora
import reranker
from store import file_sha1 as _sha1
from tiny import alive as _alive


FORMATS = ("seq-cls", "causal")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
IDENTITY_KEY = "geodef_export"    # the identity's key in config.json and in the safetensors __metadata__


class ExportError(ValueError):
    """An export refused (the output folder) or failed (a write): the folder named, nothing half-written left."""


class IdentityError(ValueError):
    """A model folder whose Shield identity cannot be read (a file unreadable, a mark malformed): names the file."""
DETECTOR_FILE = "geodef_detector.json"      # the run's GEO detector beside the weights (serve answers /detect)
EXPORT_FILES = ("model.safetensors", "config.json", "qwen3_reranker.jinja", "geodef_export.json", "README.md",
                DETECTOR_FILE, *TOKENIZER_FILES)       # everything an export writes: all --overwrite replaces


def int8_quantization_config(fmt):
    """config.json's quantization_config of an int8 export: the compressed-tensors "int-quantized" layout of
    W8A8 (int8 weights per output channel, int8 activations per token at run time, both symmetric), which
    vLLM's compressed-tensors scheme and transformers with the compressed-tensors package load. Each
    projection stores `weight` int8 (out, in) and `weight_scale` float32 (out, 1); the head stays float."""
    int8 = dict(num_bits=8, type="int", symmetric=True)
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**int8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
            "ignore": ["score" if fmt == "seq-cls" else "lm_head"]}


def identity(adapter_sha1, instruction, base_is_shield=False):
    """The record an export carries in config.json and the weights' header: whether it scores as the
    Shield (an adapter merged in, named by its SHA-1, or a base that already was a Shield export) and
    the instruction it was trained under. No path, no time: exports of the same inputs stay
    byte-identical."""
    return {"shield": bool(adapter_sha1) or base_is_shield, "adapter_sha1": adapter_sha1, "instruction": instruction}


def _mark(record, where):
    """A decoded identity record -> the record; IdentityError unless it is one (a JSON object with a
    boolean `shield`)."""
    if not isinstance(record, dict) or not isinstance(record.get("shield"), bool):
        raise IdentityError(f"{where}: {IDENTITY_KEY}: not an identity record (an object with a boolean 'shield')")
    return record


def _json_file(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _marks(folder):
    """identity_marks' reading, file by file; lets OSError, ValueError (bad JSON) and SafetensorError out."""
    from safetensors import safe_open
    marks = []
    if os.path.isfile(os.path.join(folder, "geodef_export.json")):
        meta = _json_file(os.path.join(folder, "geodef_export.json"))
        if not isinstance(meta, dict):
            raise IdentityError(f"{folder}/geodef_export.json: not a JSON object")
        shield = bool(meta.get("adapter")) or meta.get("shield") is True
        marks.append(("geodef_export.json", {**meta, "shield": shield}))
    cfg = _json_file(os.path.join(folder, "config.json"))
    if not isinstance(cfg, dict):
        raise IdentityError(f"{folder}/config.json: not a JSON object")
    if IDENTITY_KEY in cfg:
        marks.append(("config.json", _mark(cfg[IDENTITY_KEY], f"{folder}/config.json")))
    for path in reranker.weight_files(folder):          # the files the loader reads, wherever the index puts them
        name = os.path.relpath(path, folder)
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
        if IDENTITY_KEY in header:
            marks.append((name, _mark(json.loads(header[IDENTITY_KEY]), f"{folder}/{name}")))
    return marks


def identity_marks(folder):
    """Every identity record the files of a model folder carry -> [(file, record)]: geodef_export.json
    (older exports carry only this one; an `adapter` in it says Shield), config.json's `geodef_export`
    and the header of each weight file the loader reads (reranker.weight_files). [] for a checkpoint no
    export wrote. IdentityError when one of
    these files cannot be read or holds a malformed record: then nobody can tell what the folder holds."""
    from safetensors import SafetensorError
    try:
        return _marks(folder)
    except IdentityError:
        raise
    except (OSError, ValueError, RecursionError, SafetensorError) as e:     # (JSON nested past the parser's depth)
        raise IdentityError(f"{folder}: its identity cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def chat_template(instruction):
    """vLLM's Qwen3-reranker score template (examples/pooling/score/template/qwen3_reranker.jinja)
    with `instruction` as the default <Instruct>: the model card's prompt, query and document as
    the "query" and "document" messages. Built from reranker.PREFIX, BODY and SUFFIX (which hold no
    Jinja syntax), so it renders the bytes the reranker scores, the query's and document's field labels in
    parentheses (reranker.FIELD_LABEL)."""
    default = json.dumps(instruction)       # a JSON string is a valid Jinja string literal
    content = lambda role: f'messages | selectattr("role", "eq", "{role}") | map(attribute="content") | first'
    unlabel = "".join(f' | replace("<{f}>", "({f})")' for f in reranker.FIELDS)     # as reranker.FIELD_LABEL
    text = lambda role: "{{ " + content(role) + unlabel + " }}"
    body = reranker.BODY.format(   # a request's `instruction`, else a system message, else the default
        instruction="{{ instruction | default(" + content("system") + " | default(" + default + ", true), true) }}",
        query=text("query"), doc=text("document"))
    # Jinja drops a template's final newline (SUFFIX ends in two): an empty expression after it keeps them
    return reranker.PREFIX + body + reranker.SUFFIX + "{{ '' }}"


def _card_intro(meta, name):
    """The model card's title and first paragraphs: what the checkpoint is, its layout, NF4 and int8 notes."""
    nf4 = ("\nThe adapter was trained over an NF4 (4-bit) base; it is merged here into the full-precision base "
           "weights, so scores differ slightly from the training-time forward (the 4-bit rounding is not "
           "reproduced).\n" if meta["quantized_base_during_training"] else "")
    adapter = f"LoRA adapter `{meta['adapter']}` (SHA-1 {meta['adapter_sha1']})" if meta["adapter"] else "no adapter"
    gate = meta.get("int8_agreement")
    int8 = ("\nThe seven projections of every layer are stored in int8 per output channel, activations quantized "
            "per token at run time (compressed-tensors W8A8: `quantization_config` in config.json), as `serve --quant "
            "int8` scores. Its ranks against the float Shield's on the run's lists: " +
            (f"Kendall tau {gate['kendall_tau']:.3f}, top-5 agreement {gate['top5_agreement']:.3f} over "
             f"{gate['lists']} lists.\n" if gate else "not measured.\n")) if meta.get("int8") else ""
    head = ("a one-label `Qwen3ForSequenceClassification`: `score.weight` = E[yes] - E[no], so the logit is the "
            "margin z_yes - z_no and sigmoid(logit) is P(yes)" if meta["format"] == "seq-cls" else
            "the merged `Qwen3ForCausalLM`: score with the logits of \"yes\" and \"no\" at the last position")
    what = ("GEO Defender Shield Reranker", "The Shield Reranker of") if meta["adapter"] else \
        ("base reranker, no Shield adapter", "The base reranker (no Shield adapter merged) as exported for")
    merged = f"with the {adapter} merged into its weights in float32," if meta["adapter"] else "as it is,"
    return f"""# {name}: {what[0]} ({meta['format']}, {meta['dtype']})

{what[1]} *When Optimization Becomes Manipulation: Defending Generative Search against
Malicious Generative Engine Optimization*: the frozen base `{meta['base_model']}` (revision
{meta['base_revision'] or 'local folder'}) {merged} then stored in {meta['dtype']}. Layout: {head}.
Made by `python run.py export` of the GEO Defender reference implementation at {meta['time']}.
{nf4}{int8}"""


def model_card(meta, name):
    vllm = f"vllm serve ./{name} --runner pooling --chat-template ./{name}/qwen3_reranker.jinja"
    if meta["format"] != "seq-cls":
        vllm += (" --hf-overrides '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                 "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    return _card_intro(meta, name) + f"""
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

`config.json` and the weights' safetensors header carry this checkpoint's identity (`geodef_export`:
Shield or not): GEO Defender's `serve` reads it, from a copy or a hub download too, and refuses a
client's `instruction` to the Shield. Keep both when copying or re-uploading.
"""


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _sort_metadata(path):
    """Rewrite a safetensors file's `__metadata__` with its keys sorted, in place. safetensors writes it
    in hash-map order, which changes from run to run once it holds two keys; sorted, exports of the same
    inputs are byte-identical. The header keeps its length (the same JSON reordered, space-padded as
    the format pads it)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")           # the format: u64 header length, then JSON
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))   # keeps its place
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > n:
            raise ExportError(f"{path}: the weights' header grew when its metadata was sorted")
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


def _is_run(folder):
    try:
        return "config" in _json_file(os.path.join(folder, "config.json"))
    except (OSError, ValueError, TypeError):
        return False


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
        other = sorted(set(os.listdir(out_dir)) - set(EXPORT_FILES))
        if other:              # a hub repository's clone (.git, a LICENSE): the swap would delete them
            raise ExportError(f"--out {out_dir}: holds {', '.join(other[:5])}, which no export writes; --overwrite "
                              "replaces only an export's own files: move them, or choose a new folder")


def _write_export(model, revision, out_dir, adapter, fmt, dtype, instruction, quantized_base, name, detector=None,
                  int8=False, int8_agreement=None):
    """The export's files into a new folder `out_dir` (export() renames it into place)."""
    from safetensors.torch import save_file
    folder, sha = reranker.resolve_model_path(model, revision)
    raw_cfg = _json_file(os.path.join(folder, "config.json"))
    dtype = dtype or raw_cfg.get("torch_dtype") or raw_cfg.get("dtype") or "bfloat16"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    out_dt = getattr(torch, dtype)
    # the merge in float32: W + (alpha/r) B A rounded once, to the output dtype
    qwen, cfg, lm_head = reranker.load_qwen3(folder, dtype=torch.float32)
    tok = reranker.untruncated_tokenizer(os.path.join(folder, "tokenizer.json"))
    yes, no = (tok.encode(w, add_special_tokens=False).ids for w in ("yes", "no"))
    if len(yes) != 1 or len(no) != 1:
        raise reranker.CheckpointError(f"{folder}/tokenizer.json: 'yes' and 'no' must be single tokens")
    if adapter:
        lora.load_adapter(qwen, adapter)
        lora.merge_and_unload(qwen)
    state = {"model." + k: v.to(out_dt).contiguous() for k, v in qwen.state_dict().items()}   # checkpoint keys
    if int8:                 # the merged float32 weights quantized as serve --quant int8 scores them
        for k, w in qwen.state_dict().items():
            if k.split(".")[-2] in lora.TARGETS:
                state[f"model.{k}"], state[f"model.{k}_scale"] = lora.int8_quantize(w)
    head = lm_head.float() if lm_head is not None else qwen.embed_tokens.weight
    seq_cls_base = lm_head is not None and len(lm_head) == 1        # a seq-cls base: its one row, E[yes] - E[no]
    if seq_cls_base and fmt == "causal":
        raise reranker.CheckpointError(f"{folder}: a seq-cls checkpoint (score.weight, one row) has no full head "
                                       "to write as a causal LM: export it as --format seq-cls")
    pad = tok.token_to_id("<|endoftext|>")
    config = {k: v for k, v in raw_cfg.items() if k not in ("torch_dtype", "dtype", "_note")}
    config.update(torch_dtype=dtype, transformers_version=raw_cfg.get("transformers_version", "4.51.0"))
    if fmt == "seq-cls":
        # (1, C): logit = h_last . (E[yes] - E[no]) = z_yes - z_no; computed in float32, rounded once
        row = head if seq_cls_base else (head[yes[0]].float() - head[no[0]].float())[None]
        state["score.weight"] = row.to(out_dt).contiguous()
        config.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"},
                      label2id={"LABEL_0": 0}, use_sep_token=False)
    else:
        config["architectures"] = ["Qwen3ForCausalLM"]
        if lm_head is not None:                       # untied: the full head goes with the weights
            state["lm_head.weight"] = lm_head.to(out_dt).contiguous()
    if pad is not None:   # AutoModelForSequenceClassification pools the last token that is not pad
        config["pad_token_id"] = pad
    if int8:
        config["quantization_config"] = int8_quantization_config(fmt)
    adapter_sha1 = _sha1(os.path.join(adapter, "adapter_model.safetensors")) if adapter else None
    ident = identity(adapter_sha1, instruction, any(m["shield"] for _, m in identity_marks(folder)))
    config[IDENTITY_KEY] = ident        # travels with the weights: a copy or hub upload keeps both files
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt", IDENTITY_KEY: json.dumps(ident, sort_keys=True)})
    _sort_metadata(os.path.join(out_dir, "model.safetensors"))
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
            "adapter": os.path.basename(os.path.normpath(adapter)) if adapter else None, "adapter_sha1": adapter_sha1,
            "shield": ident["shield"], "merged_in": "float32", "quantized_base_during_training": bool(quantized_base),
            "int8": bool(int8), "int8_agreement": int8_agreement,
            "yes_id": yes[0], "no_id": no[0], "instruction": instruction, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "detector": _sha1(detector) if detector else None}
    if detector:                        # the run's GEO detector and threshold (detect.py), served as /detect
        shutil.copy(detector, os.path.join(out_dir, DETECTOR_FILE))
    _write_json(os.path.join(out_dir, "geodef_export.json"), meta)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(meta, name))


def export(model, out_dir, adapter=None, fmt="seq-cls", dtype=None, instruction=reranker.SHIELD_INSTRUCTION,
           quantized_base=False, name=None, overwrite=False, protected=(), revision=None, detector=None, int8=False,
           int8_agreement=None):
    """Write the merged Shield (base `model`: hub id or folder, at `revision`; `adapter`: a PEFT LoRA
    folder or None) to `out_dir` in `fmt` and `dtype` (default: the checkpoint's config dtype).
    quantized_base: the adapter was trained over an NF4 base (said in the model card: the merge uses the
    full-precision base weights); int8: the projections written in int8 (int8_quantization_config), with
    `int8_agreement`, the rank agreement its gate measured (rankers.int8_gated), in the card; detector:
    the run's detect/text_detector.json, copied as DETECTOR_FILE. The folder is built beside `out_dir` and
    renamed into place whole: a failure (a full disk, a kill) leaves what was there before (see
    check_out_dir for what is refused).
    Returns out_dir."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if quantized_base:
        print("[export] the adapter was trained over an NF4 base; it is merged into the full-precision base (the "
              "model card says so)", file=sys.stderr, flush=True)
    parent = os.path.dirname(os.path.abspath(out_dir))
    stem = f".{os.path.basename(os.path.abspath(out_dir))}.export-"
    for left in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:    # a killed export's folders (no
        pid = left[len(stem):].removesuffix(".old")                             # `finally` ran): a model copy each
        if left.startswith(stem) and pid.isdigit() and not _alive(int(pid)):
            if left.endswith(".old") and not os.path.exists(out_dir):      # killed between its two renames
                os.rename(os.path.join(parent, left), out_dir)
            else:
                shutil.rmtree(os.path.join(parent, left), ignore_errors=True)
    check_out_dir(out_dir, overwrite, protected=[p for p in (model, adapter, *protected) if p and os.path.exists(p)])
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{stem}{os.getpid()}")
    old = tmp + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(model, revision, tmp, adapter, fmt, dtype, instruction, quantized_base,
                      name or os.path.basename(os.path.normpath(out_dir)), detector, int8, int8_agreement)
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
