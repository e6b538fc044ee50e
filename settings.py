"""Every command's settings, each declared once: its type, default, help (the flag's), the check of its
value, and whether a finished step pins it. Settings come in small groups (the run folder, the
reranker model, the benchmark, the LLM clients, the Shield of Table A.1, TFSG of A.2, evaluation, the
adaptive attack, the benchmark builder, and the tools: export, serve, bench, compare, bench-audit); a
command's settings hold the groups it reads as fields (cfg.shield.lr, cfg.data.k), as litgpt's fit()
takes TrainArgs and EvalArgs. run.py makes one flag per field of the groups (or `some` of a group's
fields) a command takes from its command line, typed by the field's type.

Usage: cfg = TrainConfig(name="gpt55", llm="openai:gpt-5.5"); cfg.llm.llm; cfg.replace(seed=1);
TrainConfig.pinned(); flags(EvalConfig)
"""
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import endpoints
import tfsg

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, "data", "geo_defensebench_sample.jsonl")
N_DOCS = 10                           # candidates a list (geodef.N_DOCS): the top-k must leave some out
# The longest wait a setting may ask for (a reply's timeout, a batch poll's interval), in seconds. A socket
# timeout or a sleep must fit the platform's time_t (socket.settimeout(1e10) raises OverflowError on 64-bit
# Linux; threading.TIMEOUT_MAX is ~9.2e9 s); one day fits with room and is as long as the providers' whole
# batch window (https://platform.openai.com/docs/guides/batch: completion_window "24h"), so no single reply
# or status check is worth waiting longer for.
MAX_WAIT = 24 * 3600
MAX_SAMPLES = 10_000                  # answers per instance or deletion samples per document
# bench --against: the CPU engines, and ours-int8 (our own scorer in int8)
ENGINES = ("onnxruntime", "onnxruntime-int8", "openvino", "torch-int8", "ours-int8")
MAX_THREADS = 1024                    # workers, clients or requests in progress: a thread (and a socket) each


class SettingsError(ValueError):
    """A setting, flag, input file or run-folder state that refuses the command, said in one sentence
    that names the flag or file (run.py prints it as `error: ...`)."""


def setting(default, help, ok=None, pinned=False, taken=False, choices=None, parse=None, says=None, secret=False,
            required=False):
    """One setting. ok: a check of its value (refused up front, naming the flag); says: what ok accepts, in a few
    words, for the refusal; pinned: a finished step depends on it, so a rerun under the same run folder may not
    change it; taken: a later command on the run folder takes it from config.json when it is not given again;
    choices: the values the flag accepts; parse: the text of a spec (a URL, a reranker, a search) -> its object,
    parsed once here; str() of the object is its printable form (never a credential); secret: a credential, left
    out of the settings' repr and of config.json; required: a flag the command line must give (a command's object:
    compare's runs, bench's race). A float must be finite, whatever its check: inf or nan is no rate, weight or
    timeout, and config.json could not hold it (JSON has no Infinity or NaN, RFC 8259 section 6)."""
    return field(default=default, repr=not secret,
                 metadata={"help": help, "ok": ok, "pinned": pinned, "taken": taken, "choices": choices,
                           "parse": parse, "says": says, "required": required, "secret": secret})


def spec_of(parse):
    """A parser for a spec given as text; an object already parsed is kept as it is."""
    return lambda v: parse(v) if isinstance(v, str) else v


class CommaList(tuple):
    """A comma list parsed once, its items in order; str() gives the list's text back (config.json keeps it)."""

    def __str__(self):
        return ",".join(map(str, self))


def comma_list(item=str, words=(), once=None):
    """A comma list's parser: "a, b" -> CommaList(item("a"), item("b")); one of `words` ('all', 'paper') stays
    the word it is. once(x): what must not repeat (an item counted twice, or two files under one name). A list
    read back from config.json is parsed the same way."""
    def parse(v):
        word = v.strip().strip(",").strip() if isinstance(v, str) else v       # "paper " or "all," is the word
        if isinstance(v, CommaList) or word in words:
            return word
        out = CommaList(item(x.strip()) for x in (v.split(",") if isinstance(v, str) else v) if str(x).strip())
        if not out:
            raise ValueError(f"{v!r}: an empty list")
        keys = [once(x) for x in out] if once else []
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"{v!r}: {', '.join(twice)} given more than once")
        return out
    return parse


class Transfer(NamedTuple):
    """--transfer's name=path: a library of another target (Table C.2); the name names
    results/transfer_<name>.jsonl and, as the run whose library it is, compare's Table C.2 row (the run's
    own library's row is named by the run), so it is safe in a file name."""
    name: str
    path: str

    def __str__(self):
        return f"{self.name}={self.path}"

    @classmethod
    def parse(cls, text):
        name, eq, path = text.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise ValueError(f"{text!r}: give name=path, the name in letters, digits, '.', '_', '-' (it names "
                             "results/transfer_<name>.jsonl and the Table C.2 row)")
        return cls(name, path)


def one_of(names):
    """A comma list's item parser: each item one of `names` (bench's --against and --workloads)."""
    def item(v):
        if v not in names:
            raise ValueError(f"{v!r}: not one of {', '.join(names)}")
        return v
    return item


def budget_list(v):
    """--budgets / --eval-budgets: "16,1,4" -> (1, 4, 16), candidates per instance, each at least 1."""
    try:
        out = CommaList(sorted(set(comma_list(int)(v))))
    except ValueError:
        out = ()
    if not out or out[0] < 1:
        raise ValueError(f"{v!r}: a comma list of positive integers, e.g. 1,4,16")
    return out


def at_least(lo):
    return lambda v: v >= lo


def between(lo, hi):
    """A bound on both sides, for a setting that sizes memory, threads or a sleep: past `hi` the process
    would run out of memory or fail deep inside (a thread per worker, an array per sample)."""
    return lambda v: lo <= v <= hi


def positive(v):
    return v > 0


def wait_seconds(v):
    """A wait in seconds that a socket timeout or a sleep can take (MAX_WAIT)."""
    return 0 < v <= MAX_WAIT


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_device(device):
    """A CUDA device asked for but not visible: a clear error up front, not torch's from inside loading."""
    import torch
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise SettingsError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SettingsError(f"--device {device}: no CUDA device visible to torch {torch.__version__} ({build}); "
                            "use --device cpu, or a CUDA build of torch on a machine with a GPU")
    return True


def check_name(name):
    """A run name is one safe path component: --name ../../x would write outside --runs-dir, and
    --name '' into it directly."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SettingsError(f"--name {name!r}: a run name is letters, digits, '.', '_' and '-', starting with a "
                            "letter or digit (one folder under --runs-dir)")
    return True


@dataclass(frozen=True)
class Settings:
    """A group of settings (one concern: the run folder, the model, the Shield's objective): each field a flag.
    Its text specs are parsed once, here; its checks are run by the command that composes it (`problems`),
    since a command may give a field a default of its own."""
    KEY = None              # the group's name as a field of a command's settings: cfg.shield.lr

    def __post_init__(self):
        for f in fields(self):          # specs given as text are parsed once, into the objects that travel
            parse, v = f.metadata.get("parse"), getattr(self, f.name)
            if parse is not None and v is not None:
                # text, or a list of texts (a repeated flag): a hand-edited config.json's true, 5 or {"GEO": 1}
                # would pass as an object already parsed and fail later, or read as its keys
                if not _spec_like(v):
                    raise SettingsError(f"--{flag_name(f)} {v!r} (not text)")
                try:
                    object.__setattr__(self, f.name, parse(v))
                except ValueError as e:
                    raise SettingsError(f"--{flag_name(f)} {e}") from None

    def problems(self, own=None):
        """Each field refused by its `ok` or `choices`, as '--flag value (what it accepts)'; own: the
        command's own defaults {setting: Default}, accepted as they are (None: decided later)."""
        bad = []
        for f in fields(self):
            v, ok, choices = getattr(self, f.name), f.metadata.get("ok"), f.metadata.get("choices")
            if f.name in (own or {}) and v == own[f.name].value:
                continue
            # a value of another type (a hand-edited config.json's "k": true or null) is refused here, not read
            # as 1 or met as a TypeError later; flags arrive typed, and a `parse` setting holds what it parsed
            kind = f.type if f.type in KINDS and f.metadata.get("parse") is None else None
            if kind and not (of_kind(v, kind) or v is None and f.default is None):
                bad.append(f"--{flag_name(f)} {v!r} (not {KINDS[kind]})")
            elif kind is float and not _finite(v):     # --timeout inf would pass `v > 0`; 10**400 is no float
                bad.append(f"--{flag_name(f)} {v!r} (not a finite number)")
            elif ok is not None and v is not None and not ok(v):
                says = f.metadata.get("says")
                bad.append(f"--{flag_name(f)} {v!r}" + (f" ({says})" if says else ""))
            if choices and v not in choices:
                bad.append(f"--{flag_name(f)} {v!r} (one of {', '.join(c for c in choices if c is not None)})")
        return bad


KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}


def _finite(v):
    """Whether a number (an int JSON gave included) is a finite float; None (unset) is."""
    try:
        return v is None or math.isfinite(float(v))
    except (OverflowError, TypeError, ValueError):
        return False


def _spec_like(v):
    """A spec's value as a flag or config.json gives it: text, a list of texts, or an object parsed already
    (never a JSON number, true/false or object)."""
    if isinstance(v, list):
        return all(isinstance(x, str) for x in v)
    return not isinstance(v, (bool, int, float, dict))


def of_kind(v, kind):
    """Whether v is a `kind` of KINDS as JSON gives one: an int counts as a float, a bool as nothing else."""
    return isinstance(v, (int, float) if kind is float else kind) and isinstance(v, bool) == (kind is bool)


def flag_name(f):
    return f.name.replace("_", "-")


class Default(NamedTuple):
    """A command's own default for a setting of a group it composes (bench-audit's float32 weights), and
    what it means, for the flag's help (None: "the checkpoint's dtype", decided by the command)."""
    value: object
    says: str


def own_defaults(cls):
    """A command class's own defaults {setting: Default}; a group's fields keep theirs elsewhere."""
    return getattr(cls, "DEFAULTS", {})


def offline_llm(spec):
    """Whether a provider:model spec names the offline engine (its provider, not a model name holding
    'offline')."""
    return str(spec or "").partition(":")[0] == "offline"


class Some(NamedTuple):
    """Some of a group's settings, for a command that reads only those (export: the model's name,
    revision and dtype, not its device or quantization)."""
    group: type
    names: frozenset


def some(group, *names):
    """Some(group, names), each name one of the group's fields."""
    unknown = set(names) - {f.name for f in fields(group)}
    assert not unknown, f"{group.__name__} has no {sorted(unknown)}"
    return Some(group, frozenset(names))


# ----------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class RunSettings(Settings):
    """The run folder (README "What a run folder guarantees") and the seed of everything drawn."""
    KEY = "folder"
    name: str = setting("default", "run folder name under --runs-dir", ok=check_name)
    runs_dir: str = setting("runs", "parent folder of run folders", ok=lambda v: bool(v.strip()),
                            says="a folder (an empty path would mean the current one)")
    seed: int = setting(0, "split, order and initialisation seed", ok=between(0, 2**63 - 1),
                        says="0 to 2**63 - 1 (torch.manual_seed's range)", pinned=True)

    @property
    def run_dir(self):
        return os.path.join(self.runs_dir, self.name)


@dataclass(frozen=True)
class ModelSettings(Settings):
    """The reranker: Qwen3-Reranker (or the tiny random checkpoint) and how it is loaded."""
    KEY = "model"
    model: str = setting("Qwen/Qwen3-Reranker-0.6B", "reranker: hub id, local folder, or 'tiny' (random weights, "
                         "offline)", pinned=True)
    revision: str = setting(None, "hub revision to pin", pinned=True)
    dtype: str = setting("bfloat16", "reranker weights dtype (bfloat16: as Qwen3-Reranker ships)", pinned=True,
                         choices=("bfloat16", "float16", "float32"))
    device: str = setting("cpu", "torch device (cpu, cuda)", ok=check_device)
    quant: str = setting("none", "'nf4' stores the frozen base projections in 4 bits (Table A.1); 'int8' trains on "
                                 "the float base and scores with int8 projections, the adapter merged first, once "
                                 "their ranks agree with the float model's on the run's first lists (bench --against "
                                 "ours-int8 times it)", pinned=True, choices=("none", "nf4", "int8"))
    max_length: int = setting(8192, "reranker prompt token cap (model card: 8192)", ok=at_least(64), pinned=True)
    compile: bool = setting(False, "fuse the norms, RoPE and SwiGLU with torch.compile (faster; needs a C++ "
                                   "compiler on CPU)")


@dataclass(frozen=True)
class SeenSettings(Settings):
    """The seen GEO families (B.1): those whose construction instances build the Shield and the library."""
    KEY = "seen"
    seen_methods: tuple = setting(None, "the seen (construction) GEO families, comma list (build-bench default: the "
                                        "paper's three; train: the file's _meta.seen_methods)", pinned=True,
                                  parse=comma_list(once=str))


@dataclass(frozen=True)
class DataSettings(Settings):
    """The benchmark a run trains and evaluates on, its split (B.1.2) and the top-k (A.1.3)."""
    KEY = "data"
    bench: str = setting(SAMPLE, "GEO-DefenseBench JSONL file", pinned=True)
    n_construction: int = setting(12, "construction query groups when the file has no split (B.1)", ok=at_least(1),
                                  pinned=True)
    # k below the candidate count: at k = 10 every candidate is in context and no reranker matters
    k: int = setting(5, "top-k evidence given to the LLM (A.1.3)", ok=lambda v: 1 <= v < N_DOCS, pinned=True)
    methods: tuple = setting("all", "comma list of GEO methods to evaluate, or 'all'",
                             parse=comma_list(words=("all",), once=str))
    max_test_groups: int = setting(0, "evaluate only the first N test groups (0 = all)", ok=at_least(0))


@dataclass(frozen=True)
class LLMSettings(Settings):
    """The target LLM, how it is reached (any OpenAI-compatible server), decoding and batch APIs."""
    KEY = "llm"
    llm: str = setting("offline", "target LLM as provider:model (offline, openai:, anthropic:, deepseek:, moonshot:, "
                                  "zhipu:, vllm:, ollama:, llama.cpp:)", pinned=True)
    base_url: endpoints.Endpoint = setting(None, "base URL of any OpenAI-compatible server", taken=True,
                                           parse=spec_of(endpoints.Endpoint.parse))
    temperature: float = setting(0.0, "decoding temperature (fixed per target)", ok=at_least(0), pinned=True)
    max_tokens: int = setting(2048, "max completion tokens", ok=at_least(1), taken=True)
    batch_api: str = setting(None, "send bulk LLM stages through the provider's batch API (OpenAI Batch, Anthropic "
                                   "Message Batches; half price): 'on', or 'auto' (synchronous where there is none)",
                             choices=(None, "on", "auto"))
    batch_poll: float = setting(60.0, "seconds between batch status checks at first (then growing)",
                                ok=wait_seconds, says=f"seconds, more than 0 and at most {MAX_WAIT}")
    batch_deadline: float = setting(None, "seconds a batch may run before it is cancelled, its replies kept and the "
                                          "rest sent synchronously (default: the providers' 24 h window)",
                                    ok=wait_seconds, says=f"seconds, more than 0 and at most {MAX_WAIT}")

    @property
    def offline_batches(self):
        """The offline target's batch API, which the offline engine serves on loopback."""
        return offline_llm(self.llm) and bool(self.batch_api)


@dataclass(frozen=True)
class RequestSettings(Settings):
    """How requests to any endpoint go out (LLM, rerank, search): concurrency, rate, timeout, prices."""
    KEY = "request"
    workers: int = setting(8, "concurrent requests", ok=between(1, MAX_THREADS), says=f"1 to {MAX_THREADS}",
                           taken=True)
    rpm: float = setting(0, "requests per minute cap (0 = none)", ok=lambda v: v == 0 or 0 < v and 60 / v <= MAX_WAIT,
                         says=f"0, or at least {60 / MAX_WAIT:.6f}: one request a day", taken=True)
    timeout: float = setting(None, "seconds for one whole reply of an LLM, rerank or search endpoint, retries apart "
                                   f"(default: 600 for LLMs, 120 for rerank and search; at most {MAX_WAIT})",
                             ok=wait_seconds, says=f"seconds, more than 0 and at most {MAX_WAIT}", taken=True)
    prices: str = setting(None, "JSON price table {model: [USD per 1M input tokens, USD per 1M output tokens]} "
                                "for cost reports")


@dataclass(frozen=True)
class ShieldSettings(Settings):
    """The Shield Reranker's LoRA and objective (Table A.1, Eqs. 1-5) and its training loop."""
    KEY = "shield"
    lora_r: int = setting(16, "LoRA rank", ok=at_least(1), pinned=True)
    lora_alpha: int = setting(32, "LoRA alpha (scaling alpha/r)", ok=positive, pinned=True)
    lora_dropout: float = setting(0.05, "dropout on the LoRA input", ok=lambda v: 0 <= v < 1, pinned=True)
    lr: float = setting(1e-4, "AdamW learning rate", ok=positive, pinned=True)
    epochs: int = setting(3, "Shield training epochs (the paper does not state them)", ok=at_least(1), pinned=True)
    grad_accum: int = setting(8, "gradient accumulation steps", ok=at_least(1), pinned=True)
    max_grad_norm: float = setting(1.0, "gradient clipping norm (TRL's default)", ok=positive, pinned=True)
    beta: float = setting(0.1, "Eq. 3 beta", ok=positive, pinned=True)
    lam_def: float = setting(1.1, "Eq. 5 lambda_def", ok=at_least(0), pinned=True)
    lam_util: float = setting(0.9, "Eq. 5 lambda_util", ok=at_least(0), pinned=True)
    lam_cons: float = setting(0.15, "Eq. 5 lambda_cons", ok=at_least(0), pinned=True)
    monitor_frac: float = setting(0.2, "share of construction groups held out for monitoring",
                                  ok=lambda v: 0 < v < 1, pinned=True)
    deletion_noise: float = setting(0.0, "train on documents each of whose words is deleted with this chance, drawn "
                                         "afresh each epoch (RS-Del's training noise, for a Shield smoothed by "
                                         "randomized deletion: rerank-eval --certify, serve --smooth); 0: none",
                                    ok=lambda v: 0 <= v < 1, says="0 or more, less than 1", pinned=True)
    grad_checkpointing: bool = setting(False, "recompute activations in backward (long documents)")
    save_every: int = setting(4, "optimizer steps between resumable checkpoints", ok=at_least(1))

    def optimizer_steps(self, examples):
        """Optimizer steps of a training on `examples` triples: epochs x ceil(examples / grad_accum)."""
        return self.epochs * -(-examples // self.grad_accum)


@dataclass(frozen=True)
class TFSGSettings(Settings):
    """TFSG's construction (A.2): the Analyzer, the schedule, the interface, and the Controller's sizes
    that the paper does not state (tfsg.Limits, whose fields are settings under their own names)."""
    KEY = "tfsg"
    analyzer: str = setting(None, "TFSG Analyzer LLM (default: the target)", pinned=True)
    n_seed_cases: int = setting(6, "A.2.2 controlled contrast instances", ok=at_least(0), pinned=True)
    batch_size: int = setting(10, "A.2.2 instances per update batch", ok=at_least(1), pinned=True)
    n_batches: int = setting(3, "update batches (E1 -> E{n+1})", ok=at_least(1), pinned=True)
    max_initial_rules: int = setting(10, "cold-start rule cap (A.2.2)", ok=at_least(1), pinned=True)
    reasoning_interface: bool = setting(False, "use A.3.2/A.3.5 (targets that return reasoning_content)", pinned=True)
    shield: bool = setting(True, "TFSG construction on Shield top-k (else base top-k)", pinned=True)


def _limit(f):
    lo = f.metadata.get("min")
    return (f.name, f.type, setting(f.default, f"TFSG {f.metadata['help']} (not in the paper)",
                                    ok=None if lo is None else at_least(lo), pinned=True))


# tfsg.Limits' sizes as settings: each declared once, in tfsg.py (type, default, help, minimum)
TFSGLimits = dataclasses.make_dataclass("TFSGLimits", [_limit(f) for f in fields(tfsg.Limits)], bases=(Settings,),
                                     frozen=True, namespace={"KEY": "limits"})


@dataclass(frozen=True)
class RolesSettings(Settings):
    """Who may play which part: a target or judge that built or judged the benchmark is refused by default."""
    KEY = "roles"
    allow_shared_roles: bool = setting(False, "let the target or judge be a model that built the benchmark, judged "
                                              "its rewrites' fidelity or was MAGEO's engine (_meta); the report says "
                                              "so")


@dataclass(frozen=True)
class JudgeSettings(Settings):
    """The judge of the answers (ASI, pairwise quality: B.2.3, B.2.4) and of an attacker's fidelity."""
    KEY = "judge"
    judge: str = setting(None, "ASI, pairwise-quality and fidelity judge LLM (default: the target)", taken=True)


@dataclass(frozen=True)
class SampleSettings(Settings):
    """Repeated answers: eval's answers per instance and condition."""
    KEY = "sample"
    samples: int = setting(1, "answers per instance and condition, each its own cached reply (Don't Measure "
                              "Once, arXiv 2604.07585), CIs over query groups of each instance's mean answer, the "
                              "two-level bootstrap beside as a check (the paper: 1)", ok=between(1, MAX_SAMPLES),
                           says=f"1 to {MAX_SAMPLES}")


@dataclass(frozen=True)
class EvalSettings(Settings):
    """Evaluation (B.2): the conditions, PPL-Filter, transfer libraries (Table C.2)."""
    KEY = "eval"
    conditions: tuple = setting("all", "comma list of conditions, 'paper' (the paper's six) or 'all' (those, then "
                                       "the injection defenses Spotlighting, Sandwich Prompt, PromptArmor, RobustRAG)",
                                parse=comma_list(words=("all", "paper"), once=str))
    ppl_model: str = setting("openai-community/gpt2", "PPL-Filter GPT-2: hub id, folder, or 'tiny'", taken=True)
    ppl_quantile: float = setting(0.99, "PPL threshold quantile (B.2.2)", ok=lambda v: 0 < v <= 1, taken=True)
    transfer: tuple = setting(None, "Table C.2: other LLMs' libraries to apply to this target, name=path[,name=path] "
                                    "(name: the run whose library it is, as compare's --runs names it)",
                              parse=comma_list(Transfer.parse, once=lambda t: t.name))


@dataclass(frozen=True)
class RerankSettings(Settings):
    """Deployed rerankers under GEO attack (rerank-eval; eval --reranker) and the bootstrap's size."""
    KEY = "rerank"
    reranker: list = setting(None, "a deployed reranker, [LABEL=]SPEC (base, shield, cohere:MODEL, jina:MODEL, "
                                   "voyage:MODEL, http://HOST:PORT[/rerank][#MODEL], tei:http://HOST:PORT, "
                                   "vllm-score:http://HOST:PORT[#MODEL]); repeatable. eval: adds 'Non-Defense "
                                   "[LABEL]' and 'TFSG only [LABEL]'", parse=endpoints.parse_rerankers)
    n_boot: int = setting(10000, "bootstrap resamples", ok=between(1, 1_000_000), says="1 to 1000000", taken=True)


@dataclass(frozen=True)
class CertifySettings(Settings):
    """rerank-eval --certify: the local rerankers smoothed by randomized deletion, and their certificate."""
    KEY = "certify"
    certify: bool = setting(False, "also rank with each local reranker smoothed by randomized deletion and certify "
                                   "which attacked documents no insertion, deletion or substitution of r words can "
                                   "bring into the smoothed top k (certify.py)")
    deletion_rate: float = setting(0.9, "the chance each word of a document is deleted in a smoothing sample "
                                        "(RS-Del's p_del)", ok=lambda v: 0 < v < 1, says="more than 0, less than 1")
    certify_samples: int = setting(1250, "deletion samples per document (eps < 0.05 at 10 documents a list needs "
                                         "1200)", ok=between(1, MAX_SAMPLES), says=f"1 to {MAX_SAMPLES}")


@dataclass(frozen=True)
class DetectSettings(Settings):
    """detect (detect.py): the false-positive rate on honest edits each detector's threshold is chosen at."""
    KEY = "detect"
    fpr: float = setting(0.05, "the FPR on the construction split's honest edits each detector's threshold is chosen "
                               "at, then applied to the test split", ok=lambda v: 0 < v < 1,
                         says="more than 0, less than 1")


@dataclass(frozen=True)
class AttackerSettings(Settings):
    """The attacker LLM of `attack` and `harden` and how many rewrites it writes a round."""
    KEY = "attacker"
    candidates_per_round: int = setting(2, "rewrites the attacker writes a round (MAGEO: 2)", ok=at_least(1))
    attacker: str = setting(None, "attacker LLM, provider:model (default: the target LLM; harden: the training-side "
                                  "attacker)")
    algorithm: str = setting("mageo", "the attacker's algorithm: mageo (MAGEO's loop of full rewrites) or repair "
                                      "(ours after AgentGEO's diagnose-and-repair, small edits; harden: the training "
                                      "side's)", choices=("mageo", "repair"))
    start: str = setting("source", "the repair attacker's first document: the source, or the benchmark's rewrite "
                                   "(MAGEO's loop always starts from the rewrite)", choices=("source", "rewrite"))
    edit_budget: float = setting(0.10, "the repair attacker's budget: the share of its start's words (the source's, "
                                       "or with --start rewrite the rewrite's) its document may differ by, over all "
                                       "its rounds (AgentGEO: about 5%)",
                                 ok=lambda v: 0 < v <= 1, says="more than 0, at most 1")


@dataclass(frozen=True)
class AttackSettings(Settings):
    """The adaptive attacker (attack.py): its target, budgets, rounds, LLM and knowledge."""
    KEY = "attack"
    target: str = setting("shield", "the reranker the attacker queries: shield, base, or a reranker spec "
                                    "(see --reranker)")
    budgets: tuple = setting("1,4,16", "candidates per instance, comma list (nested: one run)", parse=budget_list)
    attack_rounds: int = setting(None, "attacker rounds (default: enough for the largest budget)", ok=at_least(1))
    aware_of_library: bool = setting(False, "the attacker reads the TFSG library's rules")


@dataclass(frozen=True)
class BuildSettings(Settings):
    """The benchmark builder (build_bench.py, B.1.1): inputs, search, the families and the split."""
    KEY = "build"
    input: str = setting(None, "GEO-Bench rows (.jsonl, .json, .parquet), a folder of AutoGEO's datachunk_N.json, "
                               "hf:GEO-Optim/geo-bench, or {query, docs[, source_index]} rows")
    output: str = setting(None, "GEO-DefenseBench JSONL to write", ok=lambda v: v is None or bool(v.strip()),
                          says="a file path")
    search: endpoints.SearchSpec = setting(None, "tavily (TAVILY_API_KEY), tavily:http://HOST:PORT, or "
                                                 "offline:CORPUS.jsonl (a SIMULATED search): retrieve the candidates "
                                                 "(default: the rows' own documents)",
                                           parse=spec_of(endpoints.SearchSpec.parse))
    docs: int = setting(10, "candidates per list (the paper: 10)", ok=lambda v: 2 <= v <= N_DOCS)
    attacks: tuple = setting(None, "comma list of attack families (default: the paper's seven)", parse=comma_list())
    construction_families: tuple = setting(None, "families rewritten in the construction groups too: 'all', or a "
                                                 "comma list holding the seen ones (default: the seen ones, as "
                                                 "the paper); `holdout` trains with any of them left out",
                                           parse=comma_list(words=("all",), once=str))
    groups: int = setting(100, "query groups to sample (Table B.1: 100)", ok=at_least(2))
    construction_groups: int = setting(12, "of them, construction groups (Table B.1: 12)", ok=at_least(1))
    fidelity_judge: str = setting(None, "provider:model judging each rewrite's faithfulness (default: --llm)")
    test_llm: str = setting(None, "another builder LLM for the test split's rewrites (and honest edits and pool), "
                                  "so that a Shield cannot learn one builder's style (default: --llm)")
    test_fidelity_judge: str = setting(None, "the test split's fidelity judge (default: --fidelity-judge, else "
                                             "--test-llm)")
    mageo_signal: str = setting("engine", "MAGEO's signal: a simulated generative engine's citations of the "
                                          "document (as MAGEO), or the base reranker's score (hill-climbs on the "
                                          "model the benchmark measures)", choices=("engine", "reranker"))
    agentic_archive: str = setting(None, "AgenticGEO's strategies.json (default: our archive)")
    autogeo_rules: str = setting(None, "AutoGEO's merged_rules.json or a JSON list of rules")
    synthetic: bool = setting(False, "mark the file synthetic in _meta (the bundled sample)")
    honest: bool = setting(False, "also write each group's honest edit of its source (clearer wording and "
                                  "structure, nothing GEO adds; both splits): eval's and rerank-eval's honest "
                                  "penalty, detect's thresholds")
    attacked: int = setting(1, "attacked documents in each test list: the source and K-1 further candidates, each "
                               "rewritten by a family drawn per group with the seed (the paper: 1); eval and "
                               "rerank-eval measure every list at 1..K", ok=lambda v: 1 <= v < N_DOCS)
    pool: str = setting("search", "the test lists' other candidates: as the search returned them, or each given an "
                                  "honest edit (the honest editor and its gate), so that attacks compete with "
                                  "optimised pages", choices=("search", "optimized"))


@dataclass(frozen=True)
class HardenSettings(Settings):
    """Hardening rounds (harden.py): attacker and defender in turns on a trained run."""
    KEY = "harden"
    rounds: int = setting(2, "hardening rounds R: each attacks the construction groups, retrains the Shield and "
                             "grows the library on the survivors, then measures a fresh attacker", ok=at_least(1))
    budget: int = setting(16, "candidates the training-side attacker scores per construction instance", ok=at_least(2))
    eval_budgets: tuple = setting("1,4,16", "the fresh test-side attacker's budgets, comma list (nested: one run)",
                                  parse=budget_list)
    eval_groups: int = setting(0, "test groups the test side measures (0: all)", ok=at_least(0))
    test_attacker: str = setting(None, "the test-side (fresh) attacker LLM (default: --attacker)")
    test_algorithm: str = setting(None, "the fresh attacker's algorithm (default: --algorithm, which the report "
                                        "labels in-distribution)", choices=(None, "mageo", "repair"))
    unaware: bool = setting(False, "attackers do not read the TFSG library (default: they do)")
    restart: bool = setting(False, "retrain the Shield from the base each round (default: warm start from the "
                                   "previous round's adapter)")


@dataclass(frozen=True)
class HoldoutSettings(Settings):
    """Leave-one-family-out (holdout.py): which families are held out in turn, and whether the LLM stage runs."""
    KEY = "holdout"
    families: tuple = setting("all", "families to hold out in turn, comma list, or 'all' (every family the "
                                     "construction groups hold)", parse=comma_list(words=("all",)))
    llm_stage: bool = setting(False, "also build each fold's TFSG library and measure ASR under Shield only and GEO "
                                     "Defender end to end (the target, analyzer and judge LLMs)")
    seen_size: int = setting(0, "train on S-family subsets of the construction families and measure the unseen ones "
                                "(3: the paper's regime); 0: leave one out", ok=at_least(0))
    subsets: int = setting(0, "with --seen-size: this many S-family subsets drawn with the seed (0: all of them)",
                           ok=at_least(0))
    seeds: int = setting(1, "with --seen-size: training seeds per subset (the run's seed, +1, ...)",
                         ok=between(1, 100), says="1 to 100")


@dataclass(frozen=True)
class DeploySettings(Settings):
    """deploy-check (deploy_check.py): the endpoint whose scores are checked against the run's Shield."""
    KEY = "deploy"
    endpoint: endpoints.RerankSpec = setting(None, "the rerank endpoint to check, a spec as --reranker takes it "
                                                   "(http://HOST:PORT[/rerank][#MODEL], tei:http://HOST:PORT, "
                                                   "vllm-score:http://HOST:PORT[#MODEL], cohere:MODEL, ...)",
                                             parse=spec_of(endpoints.parse_spec))
    long: bool = setting(True, "send the long-document list (--no-long: leave it out, for an endpoint that cannot "
                               "take a long input)")
    long_tokens: int = setting(None, "the long list's prompt length in tokens (default: 2048, or 1.2 x --max-length "
                                     "when less; never more than the endpoint advertises)", ok=at_least(64),
                               says="64 or more")


@dataclass(frozen=True)
class SourceSettings(Settings):
    """Where export and serve take the Shield from: the trained run --name (its record's model, revision,
    dtype, max length and quantization, and its adapter) or, with --model given, that base and an adapter."""
    KEY = "source"
    adapter: str = setting(None, "with --model: a PEFT LoRA adapter folder (with --name: the run's own)")
    allow_int8_disagreement: bool = setting(False, "with --quant int8, serve or export even when its ranks agree "
                                                   "with the float model's below the gate (Kendall tau 0.97, top-5 "
                                                   "0.95)")


@dataclass(frozen=True)
class ExportSettings(Settings):
    """export (export.py): the checkpoint format written."""
    KEY = "export"
    format: str = setting("seq-cls", "seq-cls: Qwen3ForSequenceClassification (score = E[yes] - E[no]); causal: "
                                     "Qwen3ForCausalLM", choices=("seq-cls", "causal"))
    overwrite: bool = setting(False, "replace an earlier export in --out (it is replaced whole, once the new one is "
                                     "written)")


@dataclass(frozen=True)
class ServeSettings(Settings):
    """serve (serve.py): where the rerank endpoint listens and what it accepts."""
    KEY = "serve"
    host: str = setting("127.0.0.1", "address to bind (default loopback)")
    port: int = setting(8000, "port (0: any free one)", ok=between(0, 65535), says="0 to 65535")
    api_key: str = setting(None, "require 'Authorization: Bearer KEY' (better: the GEODEF_API_KEY environment "
                                 "variable)", secret=True)
    served_name: str = setting(None, "model name in responses and /v1/models (default: the run's name)")
    max_documents: int = setting(1000, "most documents per request", ok=between(1, 100_000), says="1 to 100000")
    max_body_bytes: int = setting(8 << 20, "largest request body (413 above)", ok=between(1, 1 << 30),
                                  says="1 byte to 1 GiB")
    max_concurrent_requests: int = setting(128, "requests in progress at once (as TEI's flag of that name); one "
                                                "more is answered 429 with Retry-After", ok=between(1, MAX_THREADS),
                                           says=f"1 to {MAX_THREADS}")
    max_queue: int = setting(64, "requests waiting for the scoring thread; one more is answered 429 with "
                                 "Retry-After", ok=between(1, 100_000), says="1 to 100000")
    max_queue_tokens: int = setting(1 << 22, "prompt tokens the waiting requests hold together (in memory, ~36 "
                                             "bytes a token); a request past it is answered 429 with Retry-After, "
                                             "into an empty queue one is always taken", ok=between(1, 1 << 40),
                                    says=f"1 to {1 << 40}")
    smooth: int = setting(0, "answer with the Shield smoothed by randomized deletion: each document's mean score over "
                             "this many samples (--deletion-rate), drawn afresh for every request (certify.py); 0: "
                             "plain", ok=between(0, MAX_SAMPLES), says=f"0 to {MAX_SAMPLES}")
    allow_instruction: bool = setting(False, "let clients send an `instruction` to the Shield too (by default "
                                             "refused with a 400: the adapter was trained under its own, and "
                                             "another could switch the defense off)")


@dataclass(frozen=True)
class EngineSettings(Settings):
    """serve-offline: the offline engine (a simulation) on a loopback port."""
    KEY = "engine"
    port: int = setting(8765, "port on 127.0.0.1 (0: any free one)", ok=between(0, 65535), says="0 to 65535")
    corpus: str = setting(None, "JSONL of {query, url, text} answering Tavily-shaped /search (data/make_sample.py "
                                "writes one)")
    created: int = setting(None, "pin every chat reply's `created` to this Unix second (default: the second its "
                                 "request arrived)", ok=at_least(0), says="a Unix second, 0 or more")


@dataclass(frozen=True)
class CompareSettings(Settings):
    """compare (report.py): evaluated runs side by side."""
    KEY = "compare"
    runs: tuple = setting(None, "comma list of evaluated run folders (one per target LLM)", required=True,
                          parse=lambda v: CommaList(dict.fromkeys(comma_list(os.path.normpath)(v))),   # each once
                          ok=lambda v: len(v) > 0, says="at least one run folder")


@dataclass(frozen=True)
class AuditSettings(Settings):
    """bench-audit (bench_audit.py): the family classifier's folds, and whether a reranker measures exposure."""
    KEY = "audit"
    folds: int = setting(5, "cross-validation folds of the family classifier", ok=at_least(2), says="at least 2")
    exposure: bool = setting(True, "measure each family's exposure gain with --model (--no-exposure: no reranker "
                                   "is loaded)")


@dataclass(frozen=True)
class BenchSettings(Settings):
    """bench (bench.py): which race, its workload at real width, and its contenders."""
    KEY = "bench"
    what: str = setting(None, "which benchmark", choices=("score", "memory", "train", "llm", "nf4", "serve"),
                        required=True)
    layers: int = setting(28, "decoder layers at real width", ok=at_least(1))
    seq: int = setting(512, "tokens per document in the fixed workload", ok=at_least(1))
    prefix: int = setting(0, "first N tokens common to every document, as one query's prompts are (86 with Qwen3's "
                             "vocabulary); also races ours with prefix sharing off. Default 0: unrelated ids",
                          ok=at_least(0))
    repeat: int = setting(3, "timed repetitions (best is reported)", ok=at_least(1))
    clients: int = setting(8, "serve: concurrent clients", ok=between(1, MAX_THREADS), says=f"1 to {MAX_THREADS}")
    requests: int = setting(2, "serve: requests per client per round", ok=between(1, 100_000), says="1 to 100000")
    out: str = setting("runs/_bench", "where the random real-width checkpoint is kept", ok=lambda v: bool(v.strip()),
                       says="a folder (an empty path would mean the current one)")
    against: tuple = setting(None, "score: CPU engines to race beside transformers on the seq-cls export, comma list "
                                   f"of {', '.join(ENGINES)} (test-only dependencies: requirements-test.txt)",
                             parse=comma_list(one_of(ENGINES), once=str))
    workloads: tuple = setting("mixed,fixed", "score, memory: the workloads measured, comma list of mixed (10 "
                                              "documents of 100-1000 tokens), fixed (10 x --seq)",
                               parse=comma_list(one_of(("mixed", "fixed")), once=str))


# ----------------------------------------------------------------------------- commands


class Command:
    """A command's settings: the groups it reads, each a field under its KEY (cfg.shield.lr, cfg.data.k), as
    litgpt's fit(..., train: TrainArgs, eval: EvalArgs) takes its groups. Built from the flat settings a
    command line, a preset or a config.json holds (every setting's name is its flag's, unique in a command);
    `flat()` gives them back for config.json. Immutable: `replace(**settings)` makes another."""
    GROUPS = ()         # the groups it composes, the run folder first: the order of config.json and of --help
    FLAGS = ()          # those it takes from its command line (a group, or Some of one); the rest from the record
    DEFAULTS = {}       # {setting: Default}: the command's own default for a setting of a group

    def __init__(self, **flat):
        unknown = set(flat) - {f.name for f in self.fields()}
        if unknown:
            raise TypeError(f"{type(self).__name__} has no setting {', '.join(sorted(unknown))}")
        bad = []
        for g in self.GROUPS:
            group = g(**{f.name: flat[f.name] for f in fields(g) if f.name in flat})
            bad += group.problems(own_defaults(type(self)))
            object.__setattr__(self, g.KEY, group)
        if bad:                         # every refused flag of every group, in one sentence
            raise SettingsError(f"out of range: {', '.join(bad)}")

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    __hash__ = None                     # compared by value (some settings are lists): never a dict key

    def __eq__(self, other):
        return type(self) is type(other) and self.flat() == other.flat()

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(repr(getattr(self, g.KEY)) for g in self.GROUPS)})"

    @classmethod
    def fields(cls):
        """Every setting of every group, in GROUPS order."""
        return [f for g in cls.GROUPS for f in fields(g)]

    @classmethod
    def pinned(cls):
        return [f.name for f in cls.fields() if f.metadata.get("pinned")]

    @classmethod
    def taken(cls):
        return [f.name for f in cls.fields() if f.metadata.get("taken")]

    def flat(self):
        """{setting: value} of every group (what config.json records, secrets apart: runs.printable)."""
        return {f.name: getattr(getattr(self, g.KEY), f.name) for g in self.GROUPS for f in fields(g)}

    def replace(self, **changes):
        """The same settings with `changes` (flat names), checked again."""
        return type(self)(**{**self.flat(), **changes})

    def setting(self, name, default=None):
        """A setting of a group this command may not compose (the judge of a command without one): default
        when it does not."""
        return self.flat().get(name, default)


TRAIN = (RunSettings, ModelSettings, SeenSettings, DataSettings, LLMSettings, RequestSettings, ShieldSettings,
         TFSGSettings, TFSGLimits, RolesSettings)
EVAL = TRAIN + (JudgeSettings, SampleSettings, EvalSettings, RerankSettings)


class TrainConfig(Command):
    """train: the Shield (Eqs. 1-5) and the TFSG library (Algorithm 1)."""
    GROUPS = FLAGS = TRAIN


class EvalConfig(Command):
    """eval: every condition on what `train` made; the trained run's settings come from its record."""
    GROUPS = EVAL
    FLAGS = (RunSettings, ModelSettings, DataSettings, SeenSettings, LLMSettings, RequestSettings, JudgeSettings,
             EvalSettings, SampleSettings, RerankSettings, RolesSettings)


class DemoConfig(Command):
    """demo: train then eval, offline; its run folder goes under --out (no --runs-dir)."""
    GROUPS = EVAL
    FLAGS = (some(RunSettings, "name", "seed"),) + EVAL[1:]


class RerankEvalConfig(Command):
    """rerank-eval: the reranker stage alone (no LLM call)."""
    GROUPS = EVAL + (CertifySettings,)
    FLAGS = (RunSettings, ModelSettings, DataSettings, SeenSettings, RequestSettings, RerankSettings, CertifySettings)


class DetectConfig(Command):
    """detect: GEO rewrites flagged against honest edits, by the Shield's residual and a text detector."""
    GROUPS = EVAL + (DetectSettings,)
    FLAGS = (RunSettings, ModelSettings, DataSettings, SeenSettings, some(RerankSettings, "n_boot"), DetectSettings)


class AttackConfig(Command):
    """attack: the adaptive attacker against a trained run, then every budget end to end."""
    GROUPS = EVAL + (AttackerSettings, AttackSettings)
    FLAGS = (RunSettings, ModelSettings, DataSettings, SeenSettings, LLMSettings, RequestSettings, JudgeSettings,
             AttackSettings, AttackerSettings, RolesSettings)      # (its conditions are attack.CONDITIONS)


class HardenConfig(Command):
    """harden: hardening rounds on a trained run; the trained run's settings come from its record."""
    GROUPS = TRAIN + (JudgeSettings, AttackerSettings, HardenSettings, RerankSettings)   # (n_boot: the rounds' CIs)
    FLAGS = (RunSettings, LLMSettings, RequestSettings, JudgeSettings, HardenSettings, AttackerSettings, RolesSettings,
             some(RerankSettings, "n_boot"))


class HoldoutConfig(Command):
    """holdout: a Shield (and with --llm-stage a library) per held-out family, each measured on the test
    split; a trained run's settings come from its record."""
    GROUPS = EVAL + (HoldoutSettings,)
    FLAGS = (RunSettings, ModelSettings, DataSettings, SeenSettings, LLMSettings, RequestSettings, ShieldSettings,
             TFSGSettings, TFSGLimits, JudgeSettings, some(RerankSettings, "n_boot"), RolesSettings, HoldoutSettings)


class DeployCheckConfig(Command):
    """deploy-check: the run's Shield (its record's model, adapter and max length) against an endpoint."""
    GROUPS = EVAL + (DeploySettings,)
    FLAGS = (RunSettings, some(RequestSettings, "timeout", "rpm"), DeploySettings)   # its lists go one at a time


class BuildConfig(Command):
    """build-bench: GEO-DefenseBench from GEO-Bench rows."""
    GROUPS = FLAGS = (RunSettings, ModelSettings, LLMSettings, RequestSettings, SeenSettings, BuildSettings)


class ExportConfig(Command):
    """export: the merged Shield as a Hugging Face checkpoint: the trained run --name (in its record's model,
    revision and dtype unless given), or --model and an optional --adapter."""
    GROUPS = (RunSettings, ModelSettings, SourceSettings, ExportSettings)
    FLAGS = (some(RunSettings, "name", "runs_dir"), some(ModelSettings, "model", "revision", "dtype", "quant"),
             SourceSettings, ExportSettings)
    DEFAULTS = {"dtype": Default(None, "a run's, else the checkpoint's")}


class ServeConfig(Command):
    """serve: the Shield behind a rerank endpoint, loaded as its run scores (the record's model, revision,
    dtype, max length and quantization unless given), or --model and an optional --adapter."""
    GROUPS = (RunSettings, ModelSettings, SourceSettings, CertifySettings, ServeSettings)
    FLAGS = (some(RunSettings, "name", "runs_dir"), ModelSettings, SourceSettings, ServeSettings,
             some(CertifySettings, "deletion_rate"))


class ServeOfflineConfig(Command):
    """serve-offline: the offline engine on loopback."""
    GROUPS = FLAGS = (EngineSettings,)


class CompareConfig(Command):
    """compare: Table 1 across target LLMs, Table C.1 and the transfer matrix (Table C.2)."""
    GROUPS = FLAGS = (CompareSettings,)


class AuditConfig(Command):
    """bench-audit: a benchmark file's families told apart, and each one's exposure gain under a reranker."""
    GROUPS = (ModelSettings, SeenSettings, DataSettings, AuditSettings)
    FLAGS = (some(DataSettings, "bench", "k"), ModelSettings, AuditSettings)
    DEFAULTS = {"dtype": Default("float32", "float32")}


class BenchConfig(Command):
    """bench: ours against the reference implementations at real width (random weights); with --compile
    ours races compiled too; --device cuda times score and train with synchronisation and reports each
    contender's allocation peak above the resident weights instead of peak RSS."""
    GROUPS = (ModelSettings, BenchSettings)
    FLAGS = (some(ModelSettings, "dtype", "device", "compile"), BenchSettings)
    DEFAULTS = {"compile": Default(None, "when a C++ compiler is found")}


# Presets. "paper" = Table A.1, including its 4-bit base ("Quantized loading 4-bit"), and GPT-5.5 as the
# judge of every target (B.2.3, B.2.4); the plain defaults are the same but keep the bf16 base, which
# trains faster here (NF4 saves memory, not time: `bench --what nf4`), and judge with the target itself
# (no second provider needed). "tiny-demo" trains the random tiny model hard enough to see the objective
# move in minutes on a CPU (a plumbing check, not the paper's setting).
PRESETS = {
    "paper": {"quant": "nf4", "judge": "openai:gpt-5.5"},
    "tiny-demo": {"model": "tiny", "dtype": "float32", "lr": 1e-3, "epochs": 6, "grad_accum": 4,
                  "llm": "offline", "ppl_model": "tiny", "n_boot": 2000},
}


def flags(cls):
    """The fields a command takes from its command line: those of its FLAGS entries, in its order."""
    names = set().union(*(g.names if isinstance(g, Some) else {f.name for f in fields(g)} for g in cls.FLAGS))
    return [f for f in cls.fields() if f.name in names]
