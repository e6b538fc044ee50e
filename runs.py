"""Run settings and run folders: the Config dataclass and its presets, what a run folder pins and
guarantees (config.json, the benchmark's digest, one writer at a time), and loading what every
command needs from them: the benchmark and its splits, the reranker (base or Shield), the LLM clients.

A run folder runs/<name>/ holds everything a command made; see the README's "What a run folder
guarantees". Usage: cfg = resolve_config(args); record_config(cfg, "train"); load_data(cfg)
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from tqdm import tqdm

import geodef
import llm_clients
import lora
import rerank_clients
import reranker
import speed
import tfsg
import tiny


HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, "data", "geo_defensebench_sample.jsonl")
TINY_NOTE = "tiny random-weight Qwen3 checkpoint (offline plumbing; its scores mean nothing)"


class SettingsError(ValueError):
    """A setting, flag, input file or run-folder state that refuses the command, said in one sentence
    that names the flag or file (run.py prints it as `error: ...`)."""


def opt(default, help):
    """A Config field with its command-line help (run.py makes one flag per field)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    name: str = opt("default", "run folder name under --runs-dir")
    runs_dir: str = opt("runs", "parent folder of run folders")
    model: str = opt("Qwen/Qwen3-Reranker-0.6B",
                     "reranker: hub id, local folder, or 'tiny' (random weights, offline)")
    revision: str = opt(None, "hub revision to pin")
    dtype: str = opt("bfloat16", "reranker weights dtype: bfloat16 (as Qwen3-Reranker ships), float16, float32")
    device: str = opt("cpu", "torch device (cpu, cuda)")
    quant: str = opt("none", "'nf4' stores the frozen base projections in 4 bits (Table A.1)")
    max_length: int = opt(8192, "reranker prompt token cap (model card: 8192)")
    compile: bool = opt(False,
                        "fuse the norms, RoPE and SwiGLU with torch.compile (faster; needs a C++ compiler on CPU)")
    bench: str = opt(SAMPLE, "GEO-DefenseBench JSONL file")
    n_construction: int = opt(12, "construction query groups when the file has no split (B.1)")
    seed: int = opt(0, "split/order/init seed")
    k: int = opt(5, "top-k evidence given to the LLM (A.1.3)")
    seen_methods: str = opt(None,
                            "GEO methods of the construction split, comma list (default: the file's "
                            "_meta.seen_methods)")
    # Shield Reranker (Table A.1)
    lora_r: int = opt(16, "LoRA rank")
    lora_alpha: int = opt(32, "LoRA alpha (scaling alpha/r)")
    lora_dropout: float = opt(0.05, "dropout on the LoRA input")
    lr: float = opt(1e-4, "AdamW learning rate")
    epochs: int = opt(3, "Shield training epochs (the paper does not state them)")
    grad_accum: int = opt(8, "gradient accumulation steps")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (TRL's default)")
    beta: float = opt(0.1, "Eq. 3 beta")
    lam_def: float = opt(1.1, "Eq. 5 lambda_def")
    lam_util: float = opt(0.9, "Eq. 5 lambda_util")
    lam_cons: float = opt(0.15, "Eq. 5 lambda_cons")
    monitor_frac: float = opt(0.2, "share of construction groups held out for monitoring")
    grad_checkpointing: bool = opt(False, "recompute activations in backward (long documents)")
    save_every: int = opt(4, "optimizer steps between resumable checkpoints")
    # TFSG (A.2)
    llm: str = opt("offline",
                   "target LLM as provider:model (offline, openai:, anthropic:, deepseek:, moonshot:, zhipu:, vllm:, "
                   "ollama:, llama.cpp:)")
    analyzer: str = opt(None, "TFSG Analyzer LLM (default: the target)")
    judge: str = opt(None, "ASI/quality judge LLM (default: the target)")
    base_url: str = opt(None, "base URL of any OpenAI-compatible server")
    temperature: float = opt(0.0, "decoding temperature (fixed per target)")
    max_tokens: int = opt(2048, "max completion tokens")
    workers: int = opt(8, "concurrent LLM requests")
    rpm: float = opt(0, "requests per minute cap (0 = none)")
    batch_api: str = opt(None, "send bulk LLM stages through the provider's batch API (OpenAI Batch, Anthropic "
                               "Message Batches; half price): 'on', or 'auto' (synchronous where there is none)")
    batch_poll: float = opt(60.0, "seconds between batch status checks at first (then growing)")
    batch_deadline: float = opt(None, "seconds a batch may run before it is cancelled, its replies kept and the "
                                      "rest sent synchronously (default: the providers' 24 h window)")
    timeout: float = opt(None, "seconds for one whole reply of an LLM, rerank or search endpoint, retries apart "
                               "(default: 600 for LLMs, 120 for rerank and search)")
    n_seed_cases: int = opt(6, "A.2.2 controlled contrast instances")
    batch_size: int = opt(10, "A.2.2 instances per update batch")
    n_batches: int = opt(3, "update batches (E1 -> E{n+1})")
    max_initial_rules: int = opt(10, "cold-start rule cap (A.2.2)")
    # TFSG sizes the paper does not state (tfsg.Limits; README "Choices where the paper is silent")
    max_active_rules: int = opt(30, "TFSG Controller: most live rules at once (not in the paper)")
    rule_description_chars: int = opt(600, "TFSG Controller: longest rule description (not in the paper)")
    rule_condition_chars: int = opt(400, "TFSG Controller: longest apply_when / avoid_when (not in the paper)")
    rule_max_signals: int = opt(12,
                                "TFSG Controller: most trigger / benign counter signals per rule (not in the paper)")
    rule_max_evidence: int = opt(20, "TFSG Controller: most evidence items per rule (not in the paper)")
    rule_max_dependencies: int = opt(8, "TFSG Controller: most fp_guard dependencies per rule (not in the paper)")
    rule_item_chars: int = opt(240, "TFSG Controller: longest list item (not in the paper)")
    reject_duplicate_rules: bool = opt(True, "TFSG Controller: refuse a rule whose description equals a live rule's")
    analyzer_doc_chars: int = opt(1500, "TFSG Analyzer input: characters of each document (not in the paper)")
    analyzer_reasoning_chars: int = opt(4000,
                                        "TFSG Analyzer input: characters of each reasoning trace (not in the paper)")
    reasoning_interface: bool = opt(False, "use A.3.2/A.3.5 (targets that return reasoning_content)")
    shield: bool = opt(True, "TFSG construction on Shield top-k (else base top-k)")
    # evaluation
    conditions: str = opt("all", "comma list of conditions, 'paper' (the paper's six) or 'all' (those, then the "
                                 "injection defenses Spotlighting, Sandwich Prompt, PromptArmor, RobustRAG)")
    methods: str = opt("all", "comma list of GEO methods or 'all'")
    ppl_model: str = opt("openai-community/gpt2", "PPL-Filter GPT-2: hub id, folder, or 'tiny'")
    ppl_quantile: float = opt(0.99, "PPL threshold quantile (B.2.2)")
    n_boot: int = opt(10000, "bootstrap resamples")
    max_test_groups: int = opt(0, "evaluate only the first N test groups (0 = all)")
    transfer: str = opt(None, "Table C.2: other LLMs' libraries to apply to this target, name=path[,name=path]")
    reranker: list = opt(None,
                        "a deployed reranker, [LABEL=]SPEC (base, shield, cohere:MODEL, jina:MODEL, voyage:MODEL, "
                              "http://HOST:PORT[/v1/rerank][#MODEL], tei:http://HOST:PORT); repeatable. eval: adds "
                              "'Non-Defense [LABEL]' and 'TFSG only [LABEL]'")
    prices: str = opt(None,
                      "JSON price table {model: [USD per 1M input tokens, USD per 1M output tokens]} for cost reports")

    # the offline engine's loopback URL while a command serves it (demo, attack): not a setting, never
    # recorded; the engine's replies are cached under 'offline' whatever its port
    engine_url = None

    def __post_init__(self):
        """Reject out-of-range settings up front, naming the flag (not minutes later, deep inside a run)."""
        # k: below the candidate count (at k = 10 every candidate is in context and no reranker matters)
        checks = [("k", 1 <= self.k < geodef.N_DOCS), ("lora-r", self.lora_r >= 1),
                  ("lora-alpha", self.lora_alpha > 0),
                  ("lora-dropout", 0 <= self.lora_dropout < 1), ("lr", self.lr > 0), ("epochs", self.epochs >= 1),
                  ("grad-accum", self.grad_accum >= 1), ("max-grad-norm", self.max_grad_norm > 0),
                  ("beta", self.beta > 0), ("monitor-frac", 0 < self.monitor_frac < 1),
                  ("lam-def", self.lam_def >= 0), ("lam-util", self.lam_util >= 0), ("lam-cons", self.lam_cons >= 0),
                  ("save-every", self.save_every >= 1), ("n-construction", self.n_construction >= 1),
                  ("max-length", self.max_length >= 64), ("workers", self.workers >= 1), ("rpm", self.rpm >= 0),
                  ("timeout", self.timeout is None or self.timeout > 0),
                  ("batch-api", self.batch_api in (None, "on", "auto")), ("batch-poll", self.batch_poll > 0),
                  ("batch-deadline", self.batch_deadline is None or self.batch_deadline > 0),
                  ("max-tokens", self.max_tokens >= 1), ("temperature", self.temperature >= 0),
                  ("batch-size", self.batch_size >= 1), ("n-batches", self.n_batches >= 1),
                  ("n-seed-cases", self.n_seed_cases >= 0), ("max-initial-rules", self.max_initial_rules >= 1),
                  ("max-active-rules", self.max_active_rules >= 1),
                  ("rule-description-chars", self.rule_description_chars >= 1),
                  ("rule-condition-chars", self.rule_condition_chars >= 1),
                  ("rule-max-signals", self.rule_max_signals >= 1),
                  ("rule-max-evidence", self.rule_max_evidence >= 0),
                  ("rule-max-dependencies", self.rule_max_dependencies >= 0),
                  ("rule-item-chars", self.rule_item_chars >= 1), ("analyzer-doc-chars", self.analyzer_doc_chars >= 1),
                  ("analyzer-reasoning-chars", self.analyzer_reasoning_chars >= 0),
                  ("ppl-quantile", 0 < self.ppl_quantile <= 1), ("n-boot", self.n_boot >= 1),
                  ("max-test-groups", self.max_test_groups >= 0), ("quant", self.quant in ("none", "nf4")),
                  ("dtype", self.dtype in ("bfloat16", "float16", "float32"))]
        bad = [f"--{flag} {getattr(self, flag.replace('-', '_'))!r}" for flag, ok in checks if not ok]
        if bad:
            raise SettingsError(f"out of range: {', '.join(bad)} (see `python run.py train --help`)")
        check_device(self.device)
        check_name(self.name)

    @property
    def run_dir(self):
        return os.path.join(self.runs_dir, self.name)

    @property
    def offline(self):
        return self.model == "tiny" or "offline" in self.llm or self.ppl_model == "tiny"


# Presets. "paper" = Table A.1, including its 4-bit base ("Quantized loading 4-bit"), and GPT-5.5 as
# the judge of every target (B.2.3, B.2.4; without it the judge is the target itself); the plain
# defaults are the same but keep the bf16 base, which trains faster here (NF4 saves memory, not
# time: `bench --what nf4`). "tiny-demo" trains the random tiny model hard enough to see the
# objective move in minutes on a CPU (a plumbing check, not the paper's setting).
PRESETS = {
    "paper": {"quant": "nf4", "judge": "openai:gpt-5.5"},
    "tiny-demo": {"model": "tiny", "dtype": "float32", "lr": 1e-3, "epochs": 6, "grad_accum": 4,
                  "llm": "offline", "ppl_model": "tiny", "n_boot": 2000},
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def naming(path):
    """An OSError raised without a file name (write() on a full disk or past a size limit: "No space
    left on device", "File too large") re-raised naming `path`, so the one-line error says where."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from None
        raise


def atomic_write(path, text):
    """Write aside, then rename: the file is whole or as before; a failure (full disk) leaves no temp file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with naming(path), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def read_json(path, default=None):
    if not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def file_sha1(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def code_version():
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


def append_jsonl(path, rec):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with naming(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


# ----------------------------------------------------------------------------- models


def model_folder(cfg):
    if cfg.model == "tiny":
        return tiny.make_tiny_checkpoint(os.path.join(cfg.runs_dir, "_tiny_qwen3"), seed=0)
    return cfg.model


def load_reranker(cfg):
    dtype = getattr(torch, cfg.dtype)
    rr = reranker.Reranker.from_pretrained(model_folder(cfg), dtype=dtype, device=cfg.device,
                                           max_length=cfg.max_length, revision=cfg.revision)
    if cfg.quant == "nf4":
        lora.quantize_nf4(rr.model)
    rr.model.gradient_checkpointing = cfg.grad_checkpointing
    return fast(cfg, rr)


def fast(cfg, rr):
    """The speed paths on rr's model (speed.install, the run's --compile); again after LoRA is attached."""
    speed.install(rr.model, compile=cfg.compile)
    return rr


def check_name(name):
    """A run name is one safe path component: --name ../../x would write outside --runs-dir, and
    --name '' into it directly."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise SettingsError(f"--name {name!r}: a run name is letters, digits, '.', '_' and '-', starting with a "
                         "letter or digit (one folder under --runs-dir)")


def check_device(device):
    """A CUDA device asked for but not visible: a clear error up front, not torch's from inside loading."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise SettingsError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SettingsError(f"--device {device}: no CUDA device visible to torch {torch.__version__} ({build}); "
                         "use --device cpu, or a CUDA build of torch on a machine with a GPU")


def adapter_path(cfg):
    return os.path.join(cfg.run_dir, "adapter")


def shield_scores_path(cfg):
    """The Shield's score cache, one per adapter (named by the SHA-1 of its weights file): scores
    cached under a retrained or replaced adapter are never read for another."""
    digest = file_sha1(os.path.join(adapter_path(cfg), "adapter_model.safetensors"))
    return os.path.join(cfg.run_dir, "cache", f"scores_shield_{digest[:12]}.json")


def library_path(cfg, epoch=None):
    """The TFSG library E{epoch}; by default the final one, E{n_batches + 1}."""
    return os.path.join(cfg.run_dir, "library", f"E{cfg.n_batches + 1 if epoch is None else epoch}.json")


class NotTrainedError(FileNotFoundError):
    """What an eval condition needs from `train` is not in the run folder."""


def need_trained(cfg, path, what):
    if not os.path.isfile(path):
        raise NotTrainedError(f"{path}: no {what}; run `python run.py train --name {cfg.name}` first")


def load_shield(cfg, rr=None):
    """The base reranker with the run's trained adapter attached (LoRA enabled)."""
    rr = rr or load_reranker(cfg)
    path = adapter_path(cfg)
    need_trained(cfg, os.path.join(path, "adapter_config.json"), "trained adapter")
    lora.load_adapter(rr.model, path)
    rr.model.eval()
    return fast(cfg, rr)


# ----------------------------------------------------------------------------- data


class BenchData(NamedTuple):
    """A benchmark as a run uses it: all groups, the file's _meta, the construction and test groups
    (B.1.2), the construction (seen) methods and the evaluated methods."""
    groups: list
    meta: geodef.BenchMeta
    construction: list
    test: list
    seen: list
    methods: list


def load_data(cfg):
    """The run's benchmark, split and with its methods resolved -> BenchData."""
    groups, meta = geodef.load_bench(cfg.bench, with_meta=True)
    if cfg.k >= meta.n_docs:
        raise SettingsError(f"--k {cfg.k}: {cfg.bench} has {meta.n_docs} candidates a list (_meta.n_docs); "
                            f"the top-k must leave some out (--k below {meta.n_docs})")
    try:
        cons, test = geodef.split_groups(groups, cfg.n_construction, cfg.seed)
    except ValueError as e:
        raise SettingsError(f"{cfg.bench}: {e}")
    given = [m.strip() for m in cfg.seen_methods.split(",") if m.strip()] if cfg.seen_methods else None
    seen, origin = geodef.seen_methods(meta, given, cfg.bench)
    if origin == "the paper's seen methods":
        log(f"[data] {cfg.bench}: no _meta.seen_methods; the paper's seen methods {seen} (the file has the "
            "paper's seven)")
    if cfg.max_test_groups:
        test = test[:cfg.max_test_groups]
    methods = meta.methods if cfg.methods == "all" else [m.strip() for m in cfg.methods.split(",")]
    for m in methods:
        if m not in meta.methods:
            raise SettingsError(f"--methods: {m!r} is not in the benchmark's methods {meta.methods}")
    return BenchData(groups, meta, cons, test, seen, methods)


def shield_split(cfg, inst):
    """The Shield's construction instances split 80/20 by query group (Table A.1) -> (optimise,
    monitor). Refuses a split that leaves either side empty: it would train on nothing, or keep an
    epoch by empty monitoring metrics."""
    opt, mon = geodef.monitoring_split(inst, cfg.monitor_frac, cfg.seed)
    if not opt or not mon:
        raise SettingsError(f"{cfg.bench}: Shield training needs construction groups both to optimise on and to "
                         f"monitor (--monitor-frac {cfg.monitor_frac}, at least one group each); its "
                         f"{len({x.group_id for x in inst})} construction group(s) gave {len(opt)} and {len(mon)} "
                         "instances: use 2 or more (--n-construction, or the file's split fields)")
    return opt, mon


def tfsg_schedule(cfg, inst):
    """TFSG's construction schedule (A.2.2) -> (seed cases, update batches). Refuses one whose
    instances do not reach every update batch: the library would stop short of E{n_batches + 1}, the
    one evaluation reads (a short last batch is fine)."""
    seeds, batches = geodef.construction_schedule(inst, cfg.n_seed_cases, cfg.batch_size, cfg.n_batches, cfg.seed)
    if len(batches) < cfg.n_batches:
        raise SettingsError(f"{cfg.bench}: {len(inst)} construction instances fill {len(seeds)} seed cases and "
                         f"{len(batches)} of the {cfg.n_batches} update batches of {cfg.batch_size} "
                         f"(--n-seed-cases, --n-batches, --batch-size): lower those, or use more construction groups")
    return seeds, batches


# ----------------------------------------------------------------------------- LLMs and rankings


def read_prices(path):
    """--prices: a JSON object {model: [USD per 1M input tokens, USD per 1M output tokens(, the batch
    APIs' price as a share of the full one, default 0.5)]}, and for
    rerank models {model: {"usd_per_1k_searches": x}} or {model: {"usd_per_1m_tokens": y}}."""
    if not os.path.isfile(path):
        raise SettingsError(f"--prices {path}: no such file")
    try:
        table = read_json(path)
    except ValueError as e:
        raise SettingsError(f"--prices {path}: not JSON ({e})") from None
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
    ok = lambda v: (isinstance(v, list) and len(v) in (2, 3) and all(map(num, v))) or (
        isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("usd_per_1k_searches", "usd_per_1m_tokens")
        and num(next(iter(v.values()))))
    bad = [k for k, v in table.items() if not ok(v)] if isinstance(table, dict) else None
    if bad is None or bad:
        raise SettingsError(f"--prices {path}: expected {{model: [USD per 1M input, USD per 1M output]}} (rerank "
                            "models: {\"usd_per_1k_searches\": x} or {\"usd_per_1m_tokens\": y})"
                            + (f"; bad entries {bad[:3]}" if bad else ""))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


def make_llm(cfg, spec=None, stage=None):
    """The client for `spec` (default: the target LLM), caching in the run folder; with `stage`, every
    reply it receives is entered in the run's usage ledger under that stage (usage_path)."""
    prices = read_prices(cfg.prices) if cfg.prices else None
    spec = spec or cfg.llm
    base_url = cfg.engine_url if spec.partition(":")[0] == "offline" else cfg.base_url
    client = llm_clients.make_client(spec, base_url=base_url,
                                     cache_dir=os.path.join(cfg.run_dir, "cache", "llm"), rpm=cfg.rpm, prices=prices,
                                     **({"timeout": cfg.timeout} if cfg.timeout else {}),
                                     ledger=usage_path(cfg) if stage else None, stage=stage)
    if cfg.batch_api and stage and client.transport.base_url:
        import batch_clients
        client.use_batch(batch_clients.BatchRunner(client, os.path.join(cfg.run_dir, "batches.json"),
                                                   poll=cfg.batch_poll, auto=cfg.batch_api == "auto",
                                                   deadline=cfg.batch_deadline, log=log))
    return client


def usage_path(cfg):
    """The run folder's usage ledger: one line per LLM reply received, by stage, over every invocation."""
    return os.path.join(cfg.run_dir, "usage.jsonl")


def run_usage(cfg):
    """What the run folder's LLM calls cost over all its invocations (llm_clients.ledger_usage)."""
    return llm_clients.ledger_usage(usage_path(cfg), read_prices(cfg.prices) if cfg.prices else None)


def check_llms(cfg):
    """Build every client the command will use (target, analyzer, judge) once, so that an unknown
    provider, a missing API key or a missing --base-url is reported before any model is loaded.
    Builds clients only: no request is sent."""
    for spec in dict.fromkeys(s for s in (cfg.llm, cfg.analyzer, cfg.judge) if s):
        try:
            make_llm(cfg, spec)
        except ValueError as e:     # unknown provider, no model, no --base-url, a key's wrong host
            raise SettingsError(f"--llm/--analyzer/--judge: {e}") from None


def order_of(scores):
    """Candidate indices, best score first (ties keep input order)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def doc_key(query, doc):
    return hashlib.sha1((query + "\x00" + doc).encode("utf-8")).hexdigest()


class Ranker:
    """Top-k by a reranker, scoring each distinct (query, document) once: the nine benign documents
    are shared by a group's seven attack variants and its clean list. Margins cached on disk."""

    def __init__(self, rr, path, label, adapter_off=False):
        self.rr, self.path, self.label = rr, path, label
        self.adapter_off = adapter_off      # the frozen base policy from a model that carries the adapter
        self.cache = read_json(path, {})

    def prepare(self, instances):
        todo = {}
        for x in instances:
            for d in x.docs:
                k = doc_key(x.query, d)
                if k not in self.cache:
                    todo.setdefault(x.query, {})[k] = d
        items = [(q, k, d) for q, kd in todo.items() for k, d in kd.items()]
        bar = tqdm(total=len(items), desc=f"rerank ({self.label})", file=sys.stderr, disable=not items)
        with (lora.lora_disabled(self.rr.model) if self.adapter_off else contextlib.nullcontext()):
            self._score(todo, bar)
        bar.close()

    def _score(self, todo, bar):
        for q, kd in todo.items():
            keys = list(kd)
            for i in range(0, len(keys), 16):
                chunk = keys[i:i + 16]
                for k, v in zip(chunk, self.rr.score(q, [kd[k] for k in chunk])):
                    self.cache[k] = float(v)
                bar.update(len(chunk))
            write_json(self.path, self.cache)

    def scores(self, x):
        return [self.cache[doc_key(x.query, d)] for d in x.docs]

    def order(self, x):
        return order_of(self.scores(x))


def rankers(cfg, shield):
    """(base, shield or None) Rankers over ONE loaded model: with the trained adapter attached, the
    base scores come from the same weights with the adapter disabled (pi_0)."""
    rr = load_shield(cfg) if shield else load_reranker(cfg)
    return base_ranker(cfg, rr, adapter_off=shield), (shield_ranker(cfg, rr) if shield else None)


def base_ranker(cfg, rr, adapter_off=False):
    """The frozen base reranker's Ranker, its scores cached in cache/scores_base.json (adapter_off: the
    model carries the Shield adapter, disabled for these scores)."""
    return Ranker(rr, os.path.join(cfg.run_dir, "cache", "scores_base.json"), "base", adapter_off=adapter_off)


def shield_ranker(cfg, rr):
    """The Shield's Ranker (rr with the run's adapter), its scores cached per adapter (shield_scores_path)."""
    return Ranker(rr, shield_scores_path(cfg), "shield")


def documents_cut(rr, insts):
    """Distinct (query, document) prompts longer than --max-length among `insts`: their tails are cut
    (the model card's truncation); logged as a warning when there are any."""
    pairs = {}
    for x in insts:
        pairs.setdefault(x.query, set()).update(x.docs)
    n = sum(rr.overflow(q, sorted(d)) for q, d in pairs.items())
    if n:
        log(f"[rerank] WARNING: {n} of {sum(map(len, pairs.values()))} documents are cut to --max-length "
            f"{rr.max_length} tokens (their ends are not scored)")
    return n


def test_set_digest(insts):
    """SHA-1 of the evaluated instances (ids, queries, document texts): runs compared in one table
    (`compare`) must have been evaluated on the same test set."""
    h = hashlib.sha1()
    for x in sorted(insts, key=lambda x: x.instance_id):
        h.update("\x00".join([x.instance_id, x.query] + list(x.docs)).encode("utf-8") + b"\x01")
    return h.hexdigest()


def labels_of(x, idx):
    return ["attack" if i == x.attack_index else "benign" for i in idx]


def tfsg_limits(cfg):
    """The TFSG sizes of the run's settings (tfsg.Limits: its fields are Config's by the same names)."""
    return tfsg.Limits(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(tfsg.Limits)})




def resolve_config(args):
    """Defaults, then (train and eval on an existing run folder) the settings recorded in its
    config.json that the run depends on, then the preset and flags given. So `eval --name x` after
    `train --name x --llm openai:gpt-5.5 --bench b.jsonl` evaluates what was trained, without
    repeating the flags; a given flag that differs from the record is refused by record_config.
    A demo's record names its LLMs `offline` (served on loopback while it ran), so its settings are
    taken too; a record older than that named the loopback server itself, and is not taken."""
    given = dict(PRESETS[args.preset]) if args.preset else {}   # a preset asked for counts as given
    given.update({f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                  if getattr(args, f.name, None) is not None})
    kw = {}
    if args.cmd in ("train", "eval", "rerank-eval", "attack"):
        where = os.path.join(given.get("runs_dir", Config.runs_dir), given.get("name", Config.name))
        old = read_json(os.path.join(where, "config.json"), {})
        if old.get("config", {}).get("llm") != "openai-compatible:offline-engine":   # an old demo's dead server
            rec = {k: v for k, v in old.get("config", {}).items() if k in PINNED + TAKEN and k not in given}
            if "***@" in str(rec.get("base_url")):   # stored without its credentials: give --base-url again
                log(f"[config] {where}/config.json: base_url was stored without its credentials; "
                    "give --base-url again")
                rec.pop("base_url")
            taken = {k: v for k, v in rec.items() if v != getattr(Config, k)}   # those that are not defaults
            if taken:
                log(f"[config] from {where}/config.json: " + ", ".join(f"{k}={v!r}" for k, v in sorted(taken.items())))
            kw.update(rec)
    kw.update(given)
    return Config(**kw)


# settings taken over from a run's config.json when not given again (not pinned: eval records its own)
TAKEN = ("base_url", "judge", "ppl_model", "ppl_quantile", "max_tokens", "n_boot", "workers", "rpm", "timeout")
# settings a finished step depends on: a rerun under the same --name must not change them
PINNED = ("model", "revision", "bench", "n_construction", "seed", "seen_methods", "lora_r", "lora_alpha",
          "lora_dropout", "lr", "epochs",
          "grad_accum", "max_grad_norm", "beta", "lam_def", "lam_util", "lam_cons", "monitor_frac", "quant", "dtype",
          "max_length", "llm", "analyzer", "n_seed_cases", "batch_size", "n_batches", "max_initial_rules",
          "max_active_rules", "rule_description_chars", "rule_condition_chars", "rule_max_signals",
          "rule_max_evidence", "rule_max_dependencies", "rule_item_chars", "reject_duplicate_rules",
          "analyzer_doc_chars", "analyzer_reasoning_chars",
          "reasoning_interface", "shield", "k", "temperature")


def produced_anything(run_dir):
    """Whether any step has left a file in the run folder (adapter, checkpoint, library, caches,
    results) besides config.json itself."""
    for root, _, files in os.walk(run_dir):
        if any(root != run_dir or not (f.startswith("config.json") or f == LOCK) for f in files):
            return True
    return False


LOCK = ".lock"


@contextlib.contextmanager
def run_lock(run_dir, shared=False):
    """One writer per run folder: an exclusive lock on run_dir/.lock for the command's lifetime. The
    operating system releases it when the process ends, however it ends, so a crashed command leaves
    no stale lock. A second command on the same folder is refused at once, naming the holder.
    shared=True: a reader (export, serve loading the adapter): readers go together, never beside a
    writer, so nothing reads an adapter while train writes it."""
    os.makedirs(run_dir, exist_ok=True)
    try:
        import fcntl
    except ImportError:          # no flock (Windows): unlocked
        yield
        return
    path = os.path.join(run_dir, LOCK)
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunInUse(f"{run_dir}: in use by {holder}; wait for it to finish, or use another --name") from None
    if not shared:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} ({' '.join(sys.argv[1:3])})")
        f.flush()
    try:
        yield
    finally:
        f.close()                # closing releases the lock


class RunInUse(RuntimeError):
    """Another command holds the run folder (run_lock)."""


def check_pinned(cfg, old, new, digest, path):
    """Refuse settings (PINNED) and benchmark content that differ from the run's record `old`."""
    changed = [k for k in PINNED if k in old.get("config", {}) and old["config"][k] != new[k]
               and not (k == "bench" and old.get("bench_sha1") == digest)]   # same content, other path
    if changed:
        raise SettingsError(f"{path}: this run was made with different {', '.join(changed)} "
                            "(" + ", ".join(f"{k}={old['config'][k]!r}" for k in changed) + "); use a new --name")
    if old.get("bench_sha1") not in (None, digest):   # the same path, other content: results would mix
        raise SettingsError(f"{cfg.bench}: its content changed since this run used it (SHA-1 "
                            f"{old['bench_sha1'][:12]}, "
                            f"now {digest[:12]}); the run's adapter, library and results belong to the old content. "
                            "Restore the file, or use a new --name")


def record_or_check(cfg, command):
    """A command that adds results to a run without training (rerank-eval): a new folder gets its
    config.json; an existing record is checked (pinned settings, benchmark content), not rewritten."""
    path = os.path.join(cfg.run_dir, "config.json")
    old = read_json(path)
    if old is None:
        return record_config(cfg, command)
    check_pinned(cfg, old, dataclasses.asdict(cfg), file_sha1(cfg.bench), path)


def printable(cfg):
    """The settings as config.json stores them: URLs from their parsed endpoints, so no credential is
    written whatever characters it holds (llm_clients.Endpoint, rerank_clients.RerankSpec)."""
    new = dataclasses.asdict(cfg)
    if cfg.base_url:
        try:
            new["base_url"] = str(llm_clients.Endpoint.parse(cfg.base_url))
        except ValueError:
            new["base_url"] = llm_clients.redact_url(cfg.base_url)
    if cfg.reranker:
        new["reranker"] = []
        for item in cfg.reranker:
            try:
                label, spec = rerank_clients.parse_labelled(item)
                new["reranker"].append(f"{label}={spec}" if label else str(spec))
            except ValueError:
                new["reranker"].append(llm_clients.redact_url(item))
    return new


def record_config(cfg, command):
    """Write the run's settings to config.json. Once a step has produced something, a rerun that
    changes a setting it depends on (PINNED) is refused; before that (a start that failed, e.g. on a
    model that could not be downloaded) the record is simply replaced."""
    path = os.path.join(cfg.run_dir, "config.json")
    old = read_json(path)
    new = printable(cfg)
    digest = file_sha1(cfg.bench)
    if old and produced_anything(cfg.run_dir):
        check_pinned(cfg, old, new, digest, path)
    write_json(path, {"config": new, "bench_sha1": digest, "command": command, "code_version": code_version(),
                      "offline": cfg.offline, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__})
