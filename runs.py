"""Run folders and what every command loads from them: what a run folder pins and guarantees
(config.json, the benchmark's digest, one writer at a time), the benchmark and its splits, the
reranker (base or Shield), the LLM clients, and `Run`, which holds one run folder's services for a
command's jobs. The settings themselves are in settings.py.

A run folder runs/<name>/ holds everything a command made; see the README's "What a run folder
guarantees". Usage: cfg = resolve(TrainConfig, given); with Run.open(cfg, "train") as run: run.data
"""
import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import shlex
import subprocess
import threading
import time
from typing import NamedTuple

import torch

import accounting
import batch_clients
import endpoints
import geodef
import llm_clients
import lora
import offline
import offline_server
import parallel
import reranker
import speed
import tfsg
import tiny
from settings import HERE, PRESETS, RunSettings, SettingsError, check_name, offline_llm, own_defaults
from store import changed_settings, file_sha1, log, read_json, write_json

TINY_NOTE = "tiny random-weight Qwen3 checkpoint (offline plumbing; its scores mean nothing)"


# summary.json holds a block per command: each command rewrites its own keys and keeps every other's
SUMMARY_KEYS = {"rerank-eval": ("rerank_stage", "rerank_stage_k"), "attack": ("attack",), "harden": ("harden",)}


def write_summary(run, command, blocks, merge=()):
    """The one writer of the run folder's summary.json -> the summary written. `command`'s `blocks`
    replace its own keys and every other command's stay; a key in `merge` is a block of blocks (rerank-eval's
    rerank_stage, one per reranker label) whose entries replace the old block's, the others kept when they
    were measured as the new ones were (`measured_alike`). eval owns every key no other command names and
    rewrites them whole (a condition it no longer evaluates leaves no stale figure). `usage`, the run folder's
    cost over every invocation, is refreshed here, whoever writes."""
    path = os.path.join(run.dir, "summary.json")
    old = read_json(path, {})
    blocks = {**blocks, **{k: {**measured_alike(k, old.get(k, {}), blocks[k]), **blocks[k]} for k in merge},
              "usage": run.usage()}
    if command == "eval":
        others = {k for c, keys in SUMMARY_KEYS.items() for k in keys}
        summary = {**blocks, **{k: v for k, v in old.items() if k in others}}
    else:
        summary = {**old, **blocks}
    write_json(path, summary)
    return summary


def offline_notes(run):
    """What the run's figures are not: the notes a summary carries when a model, LLM or benchmark is the
    offline plumbing."""
    cfg, notes = run.cfg, []
    if cfg.model.model == "tiny":
        notes.append("Reranker: " + TINY_NOTE + ".")
    if offline_llm(cfg.llm.llm) or offline_llm(cfg.judge.judge):
        notes.append("LLMs: the offline engine (offline.py), a deterministic SIMULATION; not a real LLM.")
    if cfg.setting("ppl_model") == "tiny":
        notes.append("PPL-Filter: tiny random-weight GPT-2 (offline plumbing).")
    if run.data.meta.synthetic:
        notes.append("Benchmark: SYNTHETIC (build-bench with the offline engine on data/make_sample.py's "
                     "pages); not the paper's GEO-DefenseBench.")
    if notes:
        notes.append("These numbers are plumbing checks, never the paper's results.")
    return notes


def with_notes(run, summary):
    """`summary` with its notes, or the run's offline_notes when it has none (what a report prints first)."""
    return {**summary, "notes": summary.get("notes") or offline_notes(run)}


def code_version():
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


# ----------------------------------------------------------------------------- models and data


class NotTrainedError(FileNotFoundError):
    """What an eval condition needs from `train` is not in the run folder."""


def train_command(folder, stage=""):
    """The `train` command that writes the run folder `folder` (RunSettings), named as the refused command
    named it (--runs-dir where not the default); `stage`: " --stage shield" or " --stage tfsg"."""
    where = "" if folder.runs_dir == RunSettings.runs_dir else f" --runs-dir {shlex.quote(folder.runs_dir)}"
    return f"python run.py train --name {shlex.quote(folder.name)}{where}{stage}"


def need_trained(path, what, folder):
    """Refuse a missing file that `train` writes in the run folder `folder` (its adapter, its library)."""
    if not os.path.isfile(path):
        raise NotTrainedError(f"{path}: no {what}; run `{train_command(folder)}` first")


class BenchData(NamedTuple):
    """A benchmark as a run uses it: all groups, the file's _meta, the construction and test groups
    (B.1.2), the construction (seen) methods and the evaluated methods."""
    groups: list
    meta: geodef.BenchMeta
    construction: list
    test: list
    seen: list
    methods: list


# ----------------------------------------------------------------------------- LLMs and rankings


def read_prices(path):
    """--prices: a JSON object {model: [USD per 1M input tokens, USD per 1M output tokens(, the batch
    APIs' price as a share of the full one, default 0.5(, USD per 1M input tokens read from the provider's
    prompt cache))]}, and for
    rerank models {model: {"usd_per_1k_searches": x}} or {model: {"usd_per_1m_tokens": y}}."""
    if not os.path.isfile(path):
        raise SettingsError(f"--prices {path}: no such file")
    try:
        table = read_json(path)
    except ValueError as e:
        raise SettingsError(f"--prices {e}") from None
    # at most $1M a unit: 1e308 or a 400-digit integer made an infinite cost, which summary.json cannot hold
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1e6
    share = lambda v: len(v) == 2 or 0 < v[2] <= 1              # the batch APIs' price, a share of the full one
    ok = lambda v: (isinstance(v, list) and len(v) in (2, 3, 4) and all(map(num, v)) and share(v)) or (
        isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("usd_per_1k_searches", "usd_per_1m_tokens")
        and num(next(iter(v.values()))))
    bad = [k for k, v in table.items() if not ok(v)] if isinstance(table, dict) else None
    if bad is None or bad:
        raise SettingsError(f"--prices {path}: expected {{model: [USD per 1M input, USD per 1M output]}} (rerank "
                            "models: {\"usd_per_1k_searches\": x} or {\"usd_per_1m_tokens\": y})"
                            + (f"; bad entries {bad[:3]}" if bad else ""))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


# what a command may need from `train`, by name: (path of the run's file, what it is)
# (the adapter folder is saved at every improving epoch: only shield_done.json says the Shield's training ended)
NEEDS = {"adapter": (lambda run: run.path("shield_done.json"), "finished Shield training (shield_done.json)"),
         "library": (lambda run: run.library_path(), "TFSG library")}


class Run:
    """One command's run folder and services, made once per command beside its settings (as uvicorn's
    `Server(config)` holds a server's state beside its frozen `Config`): the settings (`cfg`, frozen,
    read by group), paths in the folder (`path`, `library_path`, `shield_scores_path`), the reranker
    loaded as the settings say (`reranker`, `shield`), the benchmark read and split once (`data`), the
    price table read once (`prices`), the LLM clients (`llm`), the usage ledger's totals (`usage`), the
    record of its settings (`record`, `check_record`), this process's place among torchrun's ranks
    (`ranks`, parallel.Ranks) and, while a loopback offline engine serves the run, its address
    (`engine_url`). Commands make it with `Run.open` (the whole lifecycle) or `Run.plan` (a dry run);
    jobs take a Run."""

    def __init__(self, cfg, engine_url=None, ranks=None):
        self.cfg = cfg
        self.engine_url = engine_url
        self.ranks = ranks or parallel.Ranks()
        self._weights = None                    # this command's reading of --model's weights (weights())
        self.writes = False                     # whether this command holds the folder's write lock (Run.open)

    @classmethod
    def plan(cls, cfg, needs=(), llms=False, roles=False, record="config", check=None, keys=False):
        """A command's checks, nothing started (what a --dry-run prices, and what `open` runs first): every
        client the command uses built (check_llms; keys=False: a missing API key said, not refused), the
        benchmark's roles (check_roles), the files it needs from `train` (`needs`: names of NEEDS), the
        run's record (`record` as `open` takes it; "config" and "check" both check_record: a record of
        something produced is checked, None nothing), then the command's own `check(run)`, whose answer (what it
        checked: eval's conditions) the Run keeps as `checked`. -> the Run."""
        run = cls(cfg)
        if llms:
            run.check_llms(keys=keys)
        elif cfg.setting("prices"):       # read now, not when the summary is written after the paid work
            run.prices
        if roles:
            run.check_roles()
        for name in needs:
            path, what = NEEDS[name]
            need_trained(path(run), what, cfg.folder)
        if record is not None:          # "config" and "check" check alike: a record of something produced
            run.check_record()
        run.checked = check(run) if check else None
        return run

    @classmethod
    @contextlib.contextmanager
    def open(cls, cfg, command, needs=(), llms=False, roles=False, record="config", check=None, distributed=False,
             engine=False, corpus=None, lock="write"):
        """A command's whole life: its checks (`plan`, keys required), then the ranks joined (`distributed`:
        under torchrun; the Run's settings then name the rank's device), and on rank 0 the offline engine
        (`engine`, with `corpus` its /search), the run folder's lock (`lock`: "write", "read" or None) and
        the record of its settings (`record`: "config" writes config.json, "check" writes a new folder's
        and checks an existing one, None neither); undone in reverse on the way out, the ranks left last.
        -> the Run, inside a with block."""
        run = cls.plan(cfg, needs, llms, roles, record, check, keys=True)
        with contextlib.ExitStack() as stack:
            if distributed:
                run.ranks, device = parallel.Ranks.join(cfg.model.device)
                stack.push(lambda kind, *_: run.ranks.finish(failed=kind is not None))   # (an exit: not handled)
                if device != cfg.model.device:
                    run.cfg = cfg.replace(device=device)
            if run.ranks.is_main:
                if engine:
                    stack.enter_context(offline_engine(run, corpus))
                if lock:
                    stack.enter_context(run_lock(cfg.folder.run_dir, shared=lock == "read", command=command))
                    run.writes = lock == "write"
                if record == "config":
                    run.record(command)
                elif record == "check":
                    run.record_or_check(command)
            # the other ranks start once rank 0 holds the folder (refused, rank 0 exits and torchrun stops them):
            # they write too (their shares of a sharded scoring)
            run.ranks.barrier()
            yield run

    def main_only(self, fn):
        """The rest of a command on rank 0 alone: every rank leaves the process group (ranks.finish; Run.open's
        own finish then does nothing) and rank 0 runs fn() -> its answer (None on the other ranks)."""
        self.ranks.finish()
        return fn() if self.ranks.is_main else None

    @property
    def dir(self):
        return self.cfg.folder.run_dir

    def path(self, *parts):
        """A path in the run folder."""
        return os.path.join(self.cfg.folder.run_dir, *parts)

    def library_path(self, epoch=None):
        """The TFSG library E{epoch}; by default the final one, E{n_batches + 1}."""
        return self.path("library", f"E{self.cfg.tfsg.n_batches + 1 if epoch is None else epoch}.json")

    def shield_scores_path(self, adapter=None, int8=False):
        """The Shield's score cache, one per adapter (named by the SHA-1 of its weights file) and precision
        (int8: the scores of the int8 Shield, beside the float ones training caches): scores cached under one
        adapter or precision are never read for another. adapter: a folder other than the run's (a hardening
        round's)."""
        digest = file_sha1(os.path.join(adapter or self.path("adapter"), "adapter_model.safetensors"))
        return self.path("cache", f"scores_shield_{digest[:12]}{'_int8' * int8}.json")

    # ------------------------------------------------------------------------- models

    def model_folder(self):
        """--model's folder: the tiny random checkpoint is written beside the run folders (runs_dir/_tiny_qwen3)."""
        if self.cfg.model.model == "tiny":
            return tiny.make_tiny_checkpoint(os.path.join(self.cfg.folder.runs_dir, "_tiny_qwen3"), seed=0)
        return self.cfg.model.model

    def reranker(self):
        """The base reranker as the settings load it: model, revision, dtype, device, max length, an NF4
        base with --quant nf4, and the speed paths (speed.install, --compile). With --quant int8 the float
        model: training runs on it, and a scorer quantizes it once it passes the gate (rankers.as_scored)."""
        cfg, dtype = self.cfg, getattr(torch, self.cfg.model.dtype)
        rr = reranker.Reranker.from_pretrained(self.model_folder(), dtype=dtype, device=cfg.model.device,
                                               max_length=cfg.model.max_length, revision=cfg.model.revision)
        if cfg.model.quant == "nf4":
            lora.quantize_nf4(rr.model)
        on_cpu = rr.model.embed_tokens.weight.device.type == "cpu"
        if dtype == torch.bfloat16 and on_cpu and speed.CPU_BF16_UNITS == set():
            log("[model] bfloat16 on a CPU without AMX or AVX-512 BF16 (/proc/cpuinfo): its matmuls run at a few "
                "GFLOP/s here, float32 at the vector units' rate; --dtype float32 is faster on this machine")
        speed.install(rr.model, compile=cfg.model.compile)
        if rr.revision and not os.path.isdir(self.model_folder()):
            self._pin_revision(rr.revision)
        return rr

    def _pin_revision(self, sha):
        """A hub id's weights are its resolved commit: the first command that loads them records it (the
        writer's), and a later one that resolves another (a push to the hub's main since) is refused, as a
        local folder whose weights changed is (check_record)."""
        path = self.path("config.json")
        old = read_json(path)
        was = old.get("weights") if isinstance(old, dict) else None
        produced = produced_anything(self.dir)
        if isinstance(was, dict) and was.get("revision") not in (None, sha) and produced:
            raise SettingsError(f"{self.cfg.model.model}: the hub's commit {sha[:12]} is not the one this run used "
                                f"({was['revision'][:12]}); its scores, adapter and results belong to that one. "
                                f"Give --revision {was['revision']}, or use a new --name")
        if self.writes and isinstance(old, dict) and (not isinstance(was, dict) or not produced) and \
                (was or {}).get("revision") != sha:        # (before anything is made, the commit this command loads)
            write_json(path, {**old, "weights": {"revision": sha}})

    def shield(self, rr=None, adapter=None):
        """The base reranker (rr, else loaded) with the run's trained adapter attached (LoRA enabled), in
        eval mode with the speed paths; adapter: another adapter folder (a hardening round's)."""
        rr = rr or self.reranker()
        path = adapter or self.path("adapter")
        if adapter is None:                       # a killed training leaves a best-so-far adapter behind
            done, what = NEEDS["adapter"]
            need_trained(done(self), what, self.cfg.folder)
        need_trained(os.path.join(path, "adapter_config.json"), "trained adapter", self.cfg.folder)
        lora.load_adapter(rr.model, path)
        rr.model.eval()
        speed.install(rr.model, compile=self.cfg.model.compile)   # the LoRA layers get the speed paths too
        return rr

    # ------------------------------------------------------------------------- data

    @functools.cached_property
    def data(self):
        """The run's benchmark, split and with its methods resolved -> BenchData, read on first use."""
        cfg, d = self.cfg, self.cfg.data
        groups, meta = geodef.load_bench(d.bench, with_meta=True)
        if d.k >= meta.n_docs:
            raise SettingsError(f"--k {d.k}: {d.bench} has {meta.n_docs} candidates a list (_meta.n_docs); "
                                f"the top-k must leave some out (--k below {meta.n_docs})")
        try:
            cons, test = geodef.split_groups(groups, d.n_construction, cfg.folder.seed)
        except ValueError as e:
            raise SettingsError(f"{d.bench}: {e}")
        given = list(cfg.seen.seen_methods) if cfg.seen.seen_methods else None
        seen, origin = geodef.seen_methods(meta, given, d.bench)
        if origin == "the paper's seen methods":
            log(f"[data] {d.bench}: no _meta.seen_methods; the paper's seen methods {seen} (the file has the "
                "paper's seven)")
        if d.max_test_groups:
            test = test[:d.max_test_groups]
        methods = meta.methods if d.methods == "all" else list(d.methods)
        for m in methods:
            if m not in meta.methods:
                raise SettingsError(f"--methods: {m!r} is not in the benchmark's methods {meta.methods}")
        return BenchData(groups, meta, cons, test, seen, methods)

    def shield_split(self, inst):
        """The Shield's construction instances split 80/20 by query group (Table A.1) -> (optimise,
        monitor). Refuses a split that leaves either side empty: it would train on nothing, or keep an
        epoch by empty monitoring metrics."""
        cfg = self.cfg
        opt, mon = geodef.monitoring_split(inst, cfg.shield.monitor_frac, cfg.folder.seed,
                                           geodef.linked_groups(self.data.construction))
        if not opt or not mon:
            raise SettingsError(f"{cfg.data.bench}: Shield training needs construction groups both to optimise on and "
                                f"to monitor (--monitor-frac {cfg.shield.monitor_frac}, at least one group each); its "
                                f"{len({x.group_id for x in inst})} construction group(s) gave {len(opt)} and "
                                f"{len(mon)} instances: use 2 or more (--n-construction, or the file's split fields)")
        return opt, mon

    def tfsg_schedule(self, inst):
        """TFSG's construction schedule (A.2.2) -> (seed cases, update batches). Refuses one whose
        instances do not reach every update batch: the library would stop short of E{n_batches + 1}, the
        one evaluation reads (a short last batch is fine)."""
        cfg, t = self.cfg, self.cfg.tfsg
        seeds, batches = geodef.construction_schedule(inst, t.n_seed_cases, t.batch_size, t.n_batches, cfg.folder.seed)
        if len(batches) < t.n_batches:
            raise SettingsError(f"{cfg.data.bench}: {len(inst)} construction instances fill {len(seeds)} seed "
                                f"cases and {len(batches)} of the {t.n_batches} update batches of {t.batch_size} "
                                f"(--n-seed-cases, --n-batches, --batch-size): lower those, or use more construction "
                                "groups")
        return seeds, batches

    @functools.cached_property
    def limits(self):
        """The TFSG sizes of the run's settings (tfsg.Limits: its fields are settings by the same names)."""
        return tfsg.Limits(**{f.name: getattr(self.cfg.limits, f.name) for f in dataclasses.fields(tfsg.Limits)})

    @property
    def offline(self):
        """Whether the run uses anything simulated: the tiny checkpoint, the offline engine, the tiny GPT-2."""
        cfg = self.cfg
        return (cfg.setting("model") == "tiny" or offline_llm(cfg.setting("llm")) or offline_llm(cfg.setting("judge"))
                or cfg.setting("ppl_model") == "tiny")

    # ------------------------------------------------------------------------- LLMs

    @functools.cached_property
    def prices(self):
        """--prices read and checked once (read_prices), or None."""
        return read_prices(self.cfg.request.prices) if self.cfg.setting("prices") else None

    def llm(self, spec=None, stage=None):
        """The client for `spec` (default: the target LLM), caching in the run folder; with `stage`, every
        reply it receives is entered in the run's usage ledger (usage.jsonl) under that stage. The offline
        engine answers over loopback while one serves the run (engine_url), else in process."""
        cfg = self.cfg
        spec = spec or cfg.llm.llm
        offline_spec = offline_llm(spec)
        base_url = self.engine_url if offline_spec else cfg.llm.base_url
        # a base URL read back from config.json, which keeps no credentials: given again, never left out (the
        # provider's default URL is no stand-in); a command that builds no client never asks for it
        if base_url is not None and getattr(base_url, "basic", None) == ("***", ""):
            raise SettingsError(f"--base-url {base_url}: stored in config.json without its credentials; give "
                                "--base-url again")
        engine = {"handler": offline.respond} if offline_spec and not base_url else {}
        if cfg.llm.batch_api and stage and not engine:         # a batch API needs an HTTP endpoint
            engine["batch"] = functools.partial(batch_clients.BatchRunner, manifest=self.path("batches.json"),
                                                poll=cfg.llm.batch_poll, auto=cfg.llm.batch_api == "auto",
                                                deadline=cfg.llm.batch_deadline, log=log)
        return llm_clients.make_client(spec, base_url=base_url, **engine, cache_dir=self.path("cache", "llm"),
                                       rpm=cfg.request.rpm, prices=self.prices,
                                       **({"timeout": cfg.request.timeout} if cfg.request.timeout else {}),
                                       ledger=self.path("usage.jsonl") if stage else None, stage=stage)

    def usage(self, since=0):
        """What the run folder's LLM calls cost over all its invocations (accounting.ledger_usage); since: from
        that byte of the ledger on."""
        return accounting.ledger_usage(self.path("usage.jsonl"), self.prices, since)

    def check_llms(self, keys=True):
        """Build every client the command will use (target, analyzer, judge) once, so that an unknown
        provider, a missing API key or a missing --base-url is reported before any model is loaded.
        Builds clients only: no request is sent. keys=False (a dry run, which prices a plan before any
        key is bought): a missing key is said, not refused. A bad price table is refused here too."""
        cfg = self.cfg
        specs = [cfg.llm.llm] + [cfg.setting(k) for k in ("analyzer", "judge", "fidelity_judge", "test_llm",
                                                              "test_fidelity_judge", "attacker", "test_attacker")]
        for spec in dict.fromkeys(s for s in specs if s):
            try:
                self.llm(spec)
            except SettingsError:       # the price table's own refusal (a SettingsError is a ValueError too)
                raise
            except ValueError as e:     # unknown provider, no model, no --base-url, a key's wrong host
                raise SettingsError(f"--llm/--analyzer/--judge/--fidelity-judge/--attacker: {e}") from None
            except llm_clients.LLMError as e:        # no API key
                if keys:
                    raise
                log(f"[dry-run] {e}; the run itself refuses until it is set")

    def check_roles(self):
        """A target or judge that played one of the benchmark's roles is refused before any paid call, unless
        --allow-shared-roles: a model scoring attacks it wrote, judged or was hill-climbed on (MAGEO's edits
        climb its engine's citations) measures them in its own favour. -> the shared roles (allowed ones)."""
        cfg = self.cfg
        shared = shared_roles(cfg.data.bench, cfg.llm.llm, cfg.setting("judge"))
        if shared and not cfg.roles.allow_shared_roles:
            raise SettingsError(f"{cfg.data.bench}: {'; '.join(shared)} (its _meta). A model that made, judged or "
                                "steered the attacks measures them in its own favour: give another --llm / --judge, "
                                "or --allow-shared-roles (the report then says so)")
        return shared

    # ------------------------------------------------------------------------- the record

    def check_record(self):
        """The check `record` runs before it writes, alone (a dry run runs it too): once a step has produced
        something, pinned settings, benchmark content and model weights must match the run's config.json.
        -> the record (None: none)."""
        old = read_json(self.path("config.json"))
        if old is not None and not (isinstance(old, dict) and isinstance(old.get("config"), dict)
                                    and isinstance(old.get("bench_sha1"), (str, type(None)))):
            raise SettingsError(f"{self.path('config.json')}: not a run record (a \"config\" object and the "
                                "benchmark's SHA-1); move it aside")
        if old and produced_anything(self.dir):
            self._check_pinned(old)
        return old

    def weights(self, old=None):
        """--model's weights as the run's record holds them: {"files": [[name, bytes, mtime_ns]], "sha1": of
        their bytes} for a local folder (the bytes read only when a file's size or time differs from the
        record `old`'s: gigabytes are hashed once, then again only after the folder changed); for a hub id,
        {"revision": its resolved commit} as the record `old` holds it (the first load records it:
        _pin_revision), else None."""
        folder, was = self.model_folder(), old.get("weights") if isinstance(old, dict) else None
        if not os.path.isdir(folder):
            return was if isinstance(was, dict) and "revision" in was else None
        files = reranker.weight_files(folder)
        stat = [[os.path.relpath(f, folder), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
        for known in (was, self._weights):     # the record's, or this command's own reading
            if isinstance(known, dict) and known.get("files") == stat and isinstance(known.get("sha1"), str):
                return known
        digest = hashlib.sha1()
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
        self._weights = {"files": stat, "sha1": digest.hexdigest()}
        return self._weights

    def record(self, command):
        """Write the run's settings to config.json. Once a step has produced something, a rerun that
        changes a setting it depends on (pinned) is refused; before that (a start that failed, e.g. on a
        model that could not be downloaded) the settings are written over the record's. Either way the
        record's settings this command has no field for (eval's judge and n_boot, when train records) are
        kept: later commands take them from here."""
        old = self.check_record()
        kept = old["config"] if isinstance(old, dict) and isinstance(old.get("config"), dict) else {}
        write_json(self.path("config.json"),
                   {"config": {**kept, **printable(self.cfg)}, "bench_sha1": file_sha1(self.cfg.data.bench),
                    "weights": self.weights(old), "command": command, "code_version": code_version(),
                    "offline": self.offline,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__})

    def record_or_check(self, command):
        """A command that adds results to a run without training (rerank-eval): a new folder, or one whose
        start failed before it produced anything, gets its config.json; an existing record of something
        produced is checked (pinned settings, benchmark content), not rewritten."""
        old = read_json(self.path("config.json"))
        if old is None or not produced_anything(self.dir):
            return self.record(command)
        self._check_pinned(old)
        if isinstance(old.get("weights"), dict) and self.weights(old) != old["weights"]:
            # the same bytes under new file times (a copy): recorded, so the next command does not hash them again
            write_json(self.path("config.json"), {**old, "weights": self.weights(old)})

    def _check_pinned(self, old):
        """Refuse pinned settings and benchmark content that differ from the run's record `old`."""
        cfg, path, new = self.cfg, self.path("config.json"), printable(self.cfg)
        digest = file_sha1(cfg.data.bench)
        changed = [k for k in type(cfg).pinned() if k in old.get("config", {}) and old["config"][k] != new[k]
                   and not (k == "bench" and old.get("bench_sha1") == digest)]   # same content, other path
        if changed:
            raise changed_settings(path, "this run was made", old["config"], {k: new[k] for k in changed},
                                   "Use a new --name")
        if old.get("bench_sha1") not in (None, digest):   # the same path, other content: results would mix
            raise SettingsError(f"{cfg.data.bench}: its content changed since this run used it (SHA-1 "
                                f"{old['bench_sha1'][:12]}, now {digest[:12]}); the run's adapter, library and "
                                "results belong to the old content. Restore the file, or use a new --name")
        self.check_weights(old)

    def check_weights(self, old):
        """Refuse --model's weights when they differ from those the run's record `old` names: the run's scores,
        adapter and results are the old weights' (export, serve and deploy-check, which check nothing else of
        the record, as every other command)."""
        cfg = self.cfg
        was = old.get("weights")           # the same folder, other weights: its cached scores would be stale
        if not (isinstance(was, dict) and "sha1" in was):          # (a hub id's commit: _pin_revision)
            return
        now = self.weights(old)
        if not isinstance(now, dict) or now.get("sha1") != was["sha1"]:
            what = f"its weights changed since this run used them (SHA-1 {str(was['sha1'])[:12]}, now " \
                   f"{now['sha1'][:12]})" if isinstance(now, dict) and "sha1" in now else \
                "no longer the folder this run used (moved, or named from another working directory)"
            raise SettingsError(f"{cfg.model.model}: {what}; the run's scores, adapter and results belong to the "
                                "old weights. Restore them, or use a new --name")

    def with_settings(self, cfg, data):
        """The same services under other settings (holdout's folds): the engine's address, the ranks and
        the prices shared; `data` the benchmark as these settings read it (a fold's: the same groups, other
        seen families)."""
        other = Run(cfg, self.engine_url, self.ranks)
        other.prices, other.data = self.prices, data      # cached_properties: set on the instance, never read again
        return other


@contextlib.contextmanager
def offline_engine(run, corpus=None):
    """While the block runs, the offline engine on a loopback port (run.engine_url): the demo, attack and
    build-bench reach it through real HTTP, and batch APIs need HTTP; with a `corpus` it also answers
    Tavily-shaped /search. Closed, not only stopped, on the way out: requests still queued fail at once
    instead of waiting out their timeouts on a socket nobody accepts from."""
    srv = offline_server.make_server(0, corpus=corpus)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    run.engine_url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        yield
    finally:
        run.engine_url = None
        srv.shutdown()
        srv.server_close()


def role_model(spec):
    """The model a provider:model spec names, for telling roles apart across providers and routers: a
    router's or self-hosted server's model id carries the upstream vendor before a '/' and may carry a
    variant after a ':' (OpenRouter's `openai/gpt-5.5:free`, a vLLM served name `openai/gpt-5.5`), so
    'openai:gpt-5.5', 'openai-compatible:gpt-5.5', 'openrouter:openai/gpt-5.5' and 'vllm:openai/gpt-5.5'
    are one model, and so are 'anthropic:claude-opus-4-5-20251101' and 'openrouter:anthropic/claude-opus-4.5'.
    None for the offline engine, which may play every role (a labelled simulation)."""
    provider, _, model = str(spec or "").partition(":")
    if not spec or provider == "offline":
        return None
    name = (model or provider).strip().lower().rstrip("/").rpartition("/")[2]
    base, _, variant = name.rpartition(":")
    name = base if variant in ROUTE_VARIANTS and base else name
    # one model's spellings: OpenRouter writes claude-opus-4.5 for Anthropic's claude-opus-4-5, and a dated
    # snapshot (claude-opus-4-5-20251101, gpt-4o-2024-08-06) or alias (claude-3-7-sonnet-latest) is the model
    name = re.sub(r"-(?:\d{8}|\d{4}-\d{2}-\d{2}|latest)$", "", name.replace(".", "-").replace("_", "-"))
    return name or None


# OpenRouter's model variants (openrouter.ai/docs, "Model Variants"): the same model served another way, as is
# Ollama's default tag `:latest` (`llama3.1` is `llama3.1:latest`). Another Ollama tag (`qwen3:8b`) names
# another model.
ROUTE_VARIANTS = ("free", "extended", "exacto", "thinking", "online", "nitro", "floor", "beta", "latest")


# the benchmark's roles, as build-bench records them in _meta
BENCH_ROLES = {"builder_llm": "built the benchmark", "fidelity_judge": "judged its rewrites' fidelity",
               "mageo_engine": "was MAGEO's engine", "test_builder_llm": "built the benchmark's test split",
               "test_fidelity_judge": "judged its test split's fidelity"}


def shared_roles(bench, target, judge=None):
    """The benchmark's roles (its _meta: builder, fidelity judge, MAGEO's engine: the builder when MAGEO's
    signal is the engine's citations) that the target or judge also plays -> ["the target openai:gpt-5.5
    built the benchmark", ...]."""
    meta = dict(geodef.read_meta(bench).raw)
    if meta.get("mageo_signal") == "engine":
        meta.setdefault("mageo_engine", meta.get("builder_llm"))
    out = []
    for role, spec in (("target", target), ("judge", judge)):
        for key, did in BENCH_ROLES.items():
            if role_model(spec) and role_model(spec) == role_model(meta.get(key)):
                out.append(f"the {role} {spec} {did}")
    return out


def measured_alike(key, old, new):
    """The entries of summary.json's block of blocks `key` that were measured on the lists (test_set_sha1) and at
    the k the `new` entries were: an entry of another test set or k would sit in one table as comparable."""
    alike = {(b.get("test_set_sha1"), b.get("k")) for b in new.values()}
    other = sorted(lb for lb, b in old.items() if lb not in new and (b.get("test_set_sha1"), b.get("k")) not in alike)
    if other:
        log(f"[summary] {key}: {', '.join(other)} measured on other test lists or k: left out (records in results/)")
    return {lb: b for lb, b in old.items() if lb not in other}


def test_set_digest(insts):
    """SHA-1 of the evaluated instances (ids, queries, document texts): runs compared in one table
    (`compare`) must have been evaluated on the same test set."""
    h = hashlib.sha1()
    for x in sorted(insts, key=lambda x: x.instance_id):
        h.update("\x00".join([x.instance_id, x.query] + list(x.docs)).encode("utf-8") + b"\x01")
    return h.hexdigest()


def labels_of(x, idx):
    return ["attack" if i == x.attack_index else "benign" for i in idx]


# ----------------------------------------------------------------------------- settings of a run folder


def resolve(cls, given, preset=None, from_record=True):
    """A command's settings (a settings.py class): defaults (settings.Default where the command has its own), then
    (from_record, on an existing run folder) what its config.json records that the run depends on (pinned) or that
    commands take over (taken), then the preset, then the flags `given`. So `eval --name x` after `train --name x
    --llm openai:gpt-5.5 --bench b.jsonl` evaluates what was trained without repeating the flags; a given flag
    that differs from the record is refused by Run.record."""
    names = {f.name for f in cls.fields()}
    asked = {k: v for k, v in PRESETS.get(preset or "", {}).items() if k in names}   # a preset counts as given
    asked.update({k: v for k, v in given.items() if v is not None})
    kw = {k: d.value for k, d in own_defaults(cls).items()}               # the command's own, over its groups'
    if from_record:
        check_name(asked.get("name", "default"))              # before any file under it is read
        where = os.path.join(asked.get("runs_dir", "runs"), asked.get("name", "default"))
        keep = set(cls.pinned()) | set(cls.taken())
        path = os.path.join(where, "config.json")
        try:
            recorded = read_json(path, {"config": {}})
        except ValueError as e:                     # (UnicodeDecodeError included)
            raise SettingsError(f"{path}: not JSON ({e}); move it aside") from None
        if not isinstance(recorded, dict) or not isinstance(recorded.get("config"), dict):
            raise SettingsError(f"{path}: no settings object under \"config\"; move it aside")
        rec = {k: v for k, v in recorded["config"].items() if k in keep and k not in asked}
        defaults = {f.name: f.default for f in cls.fields()}
        taken = {k: v for k, v in rec.items() if v != defaults[k]}          # those that are not defaults
        if taken:
            log(f"[config] from {where}/config.json: " + ", ".join(f"{k}={v!r}" for k, v in sorted(taken.items())))
        kw.update(rec)
    kw.update(asked)
    try:
        return cls(**kw)
    except TypeError as e:          # a recorded value of another type (a hand-edited config.json): the checks
        if not from_record:         # compare it with numbers
            raise
        raise SettingsError(f"{where}/config.json: a recorded setting is not of its type ({e}); give it as a flag "
                            "or fix the file") from None
    except SettingsError as e:      # a recorded value the checks refuse: named as the record's
        recorded = [k for k in (rec if from_record else ()) if f"--{k.replace('_', '-')} " in str(e)]
        if not recorded:
            raise
        raise SettingsError(f"{where}/config.json records {', '.join(recorded)}: {e}; give it as a flag or fix the "
                            "file") from None


LOCK = ".lock"


def produced_anything(run_dir):
    """Whether any step has left a file in the run folder (adapter, checkpoint, library, caches,
    results) besides config.json itself."""
    return any(root != run_dir or not (f.startswith("config.json") or f == LOCK)
               for root, _, files in os.walk(run_dir) for f in files)


class RunInUse(RuntimeError):
    """Another command holds the run folder (run_lock)."""


@contextlib.contextmanager
def run_lock(run_dir, shared=False, command="a command"):
    """One writer per run folder: an exclusive lock on run_dir/.lock for the command's lifetime. The
    operating system releases it when the process ends, however it ends, so a crashed command leaves
    no stale lock. A second command on the same folder is refused at once, naming the holder.
    shared=True: a reader (export, serve loading the adapter): readers go together, never beside a
    writer, so nothing reads an adapter while train writes it. A reader takes its shared lock through a
    read-only handle, so it works on a read-only mount (containers mount models so); where the folder
    cannot be written and has no lock file, no writer can exist, and the reader goes unlocked. command: the
    holder's name in a refusal (the command's name, never a value typed after it)."""
    if not shared:
        os.makedirs(run_dir, exist_ok=True)
    try:
        import fcntl
    except ImportError:          # no flock (Windows): unlocked
        yield
        return
    path = os.path.join(run_dir, LOCK)
    try:
        f = open(path, "a+" if not shared else "r", encoding="utf-8")
    except FileNotFoundError:    # a reader, and no writer has been here yet
        try:
            f = open(path, "a+", encoding="utf-8")
        except OSError:          # nor can one come: the folder cannot be written
            yield
            return
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        pid = re.match(r"pid (\d{1,9}) ", holder)
        if pid and not tiny.alive(int(pid.group(1))):     # a writer killed (SIGKILL) left its name: a reader holds
            holder = "another process (a reader: serve, export or deploy-check)"
        holder = holder or "another process"
        raise RunInUse(f"{run_dir}: in use by {holder}; wait for it to finish, or use another --name") from None
    if not shared:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} ({command})")
        f.flush()
    try:
        yield
    finally:
        if not shared:           # a later refusal names a holder only while it holds: a reader (serve,
            f.seek(0)            # export) writes no name, and this writer is gone
            f.truncate()
        f.close()                # closing releases the lock


def printable(cfg):
    """The settings as config.json stores them: every setting but a secret (serve's API key), each spec in
    its printable form, which its parsed object gives without credentials whatever characters they hold
    (endpoints.Endpoint, endpoints.SearchSpec, endpoints.RerankSpec)."""
    new, values = {}, cfg.flat()
    for f in cfg.fields():
        if f.metadata.get("secret"):
            continue
        v = values[f.name]
        if f.metadata.get("parse") and v is not None:
            v = [f"{label}={spec}" for label, spec in v] if isinstance(v, list) else str(v)
        new[f.name] = [endpoints.redact(x) for x in v] if isinstance(v, list) else endpoints.redact(v)
    return new
