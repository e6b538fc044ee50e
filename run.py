"""GEO Defender command line: train, eval, demo, rerank-eval, attack, harden, holdout, compare, export,
serve, deploy-check, bench, build-bench, bench-audit, serve-offline.

Every command that trains or evaluates writes into a run folder runs/<name>/ (config.json,
adapter/, library/, cache/, results/, report.md, figures/), reuses what a finished step left there
and resumes an interrupted one. The work is in the job files (runs, train, evaluation,
build_bench, bench, export, serve); this file parses arguments, checks what each
command needs before its first expensive step, and dispatches.

  python run.py demo --out runs                            # everything offline: tiny model + offline engine
  python run.py train --model Qwen/Qwen3-Reranker-0.6B --llm openai:gpt-5.5 --name gpt55
  python run.py eval --name gpt55
  python run.py rerank-eval --name gpt55 --reranker base --reranker shield --reranker co=cohere:rerank-v3.5
  python run.py holdout --name gpt55                       # a Shield without each family, measured on it
  python run.py compare --runs runs/gpt55,runs/claude --out runs/compare
  python run.py export --name gpt55 --out shield-seq-cls   # a checkpoint vLLM / sentence-transformers load
  python run.py serve --name gpt55 --port 8000             # POST /v1/rerank (Cohere/Jina/vLLM shape)
  python run.py deploy-check --name gpt55 --endpoint http://127.0.0.1:8000/rerank   # scores as the Shield's?
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys

import attack
import bench
import bench_audit
import build_bench
import deploy_check
import detect
import endpoints
import export
import geodef
import harden
import holdout
import llm_clients
import lora
import offline_server
import rankers
import report
import rerank_eval
import reranker
import serve
import settings
import speed
import tfsg
from evaluation import eval_conditions, evaluate, plan_eval, ranking_stage, reranker_items
from runs import NEEDS, Run, RunInUse, need_trained, resolve, run_lock
from settings import PRESETS, SettingsError
from store import JSONFileError, file_sha1, log, read_json
from train import plan_train, train_shield, train_tfsg


# ----------------------------------------------------------------------------- commands


def shield_settings(cls, args):
    """export's and serve's settings -> (settings, adapter folder or None, the run's folder or None).
    By default the trained run --name, whose record gives the model, revision, dtype, max length and
    quantization its Shield was trained with; with --model, that base and --adapter instead."""
    asked = given(args, cls)
    if "model" in asked:
        if "name" in asked:
            raise SettingsError("give --name (a trained run) or --model [--adapter], not both")
        cfg = resolve(cls, asked, from_record=False)
        if cfg.source.adapter and not os.path.isfile(os.path.join(cfg.source.adapter, "adapter_config.json")):
            raise FileNotFoundError(f"{cfg.source.adapter}/adapter_config.json: no adapter there")
        return cfg, cfg.source.adapter, None
    for flag in ("adapter", "revision"):
        if flag in asked:
            raise SettingsError(f"--{flag} goes with --model: a trained run (--name) brings its own adapter, "
                                "trained on the base revision its record names")
    checked = cls(**asked)                           # every flag checked before the run is looked for
    record = os.path.join(checked.folder.run_dir, "config.json")
    if not os.path.isfile(record):
        raise FileNotFoundError(f"{record}: no such run; give --name NAME (a trained run) or --model M "
                                "[--adapter DIR]")
    cfg = resolve(cls, asked)
    adapter = os.path.join(cfg.folder.run_dir, "adapter")
    need_trained(os.path.join(cfg.folder.run_dir, "shield_done.json"), "finished Shield training", cfg.folder)
    Run(cfg).check_weights(read_json(record))       # the adapter goes with the weights it was trained on
    trained = recorded(cfg.folder.run_dir)
    other = [f"--{k.replace('_', '-')} {asked[k]!r} (the run's: {trained.get(k)!r})"
             for k in ("dtype", "quant", "max_length") if k in asked and asked[k] != trained.get(k)]
    if other:
        log(f"[{args.cmd}] {', '.join(other)}: its scores may differ from the run's Shield's (deploy-check "
            "measures by how much)")
    return cfg, adapter, cfg.folder.run_dir


def reading(run_dir):
    """A trained run's folder held for reading (export, serve loading its adapter): refused while a
    train or eval writes it."""
    return run_lock(run_dir, shared=True) if run_dir is not None else contextlib.nullcontext()


def detector_file(run_dir, model=None):
    """The GEO detector a served or exported Shield carries: its run's detect/text_detector.json, or an
    export's own copy (export.DETECTOR_FILE); None when there is none."""
    path = os.path.join(run_dir, "detect", "text_detector.json") if run_dir else \
        os.path.join(model, export.DETECTOR_FILE) if model and os.path.isdir(model) else None
    return path if path and os.path.isfile(path) else None


def cmd_export(args):
    """The merged Shield as a Hugging Face checkpoint (export.py), in the run's dtype by default; with --quant int8
    its projections in int8, once they pass the gate."""
    cfg, adapter, run_dir = shield_settings(settings.ExportConfig, args)
    kw = exported(cfg, run_dir, args.out)
    export.check_out_dir(args.out, cfg.export.overwrite, kw["protected"])     # refused before any model loads
    with reading(run_dir):                     # the gate and the export read one adapter
        gate = shield_as_scored(cfg, adapter, run_dir)[1] if kw["int8"] else None
        out = export.export(Run(cfg).model_folder(), args.out, adapter=adapter, int8_agreement=gate, **kw)
    log(f"[export] {cfg.export.format} checkpoint in {out} (model card: {out}/README.md)")
    print(out)
    return out


def exported(cfg, run_dir, out):
    """export.export's settings from export's: format, dtype, revision, whether the adapter was trained over an
    NF4 base (a run's record says; for --model, --quant nf4), int8, name (--out's last part), overwrite, the
    folders it must not replace and the run's detector."""
    m, ex = cfg.model, cfg.export
    trained = recorded(run_dir).get("quant") if run_dir else m.quant
    if m.quant == "nf4" and trained != "nf4":
        raise SettingsError(f"--quant nf4: {run_dir}'s Shield was trained with --quant {trained!r}, and an export "
                            "writes its merged weights in --dtype (or, with --quant int8, in int8); whether the "
                            "base was 4-bit during training is the run's record's to say")
    return dict(fmt=ex.format, dtype=m.dtype, revision=m.revision, quantized_base=trained == "nf4",
                int8=m.quant == "int8", overwrite=ex.overwrite, name=os.path.basename(os.path.normpath(out)),
                detector=detector_file(run_dir), protected=[cfg.folder.runs_dir] + ([run_dir] if run_dir else []))


def shield_as_scored(cfg, adapter, run_dir):
    """serve's and export's reranker (the caller holds the run folder for reading): the Shield (or base) as its
    run scores, in eval mode; with --quant int8 scored in int8 once it passes the gate on the run's own lists
    (its record's benchmark), else the bundled sample's -> (reranker, the gate's figures or None)."""
    rr = Run(cfg).shield(adapter=adapter) if adapter else Run(cfg).reranker()
    rr.model.eval()
    if cfg.model.quant != "int8":
        return rr, None
    rec = read_json(os.path.join(run_dir, "config.json"), {}) if run_dir else {}
    bench, sha = rec.get("config", {}).get("bench"), rec.get("bench_sha1")
    if bench and sha and os.path.isfile(bench) and file_sha1(bench) != sha:
        raise SettingsError(f"{bench}: not the benchmark {run_dir} was trained on (its SHA-1 differs from the "
                            "record's): the INT8 gate measures on the run's own lists")
    log(f"[int8] the gate measures on {bench or 'the bundled sample'}")
    return rr, rankers.int8_gated(rr, rankers.gate_lists(bench), allow=cfg.source.allow_int8_disagreement)


def recorded(run_dir):
    """The settings a trained run's config.json records ({} without a run)."""
    return read_json(os.path.join(run_dir, "config.json"), {}).get("config", {}) if run_dir else {}


def cmd_serve(args):
    """The Shield behind a rerank endpoint (serve.py), loaded as its run scores."""
    cfg, adapter, run_dir = shield_settings(settings.ServeConfig, args)
    serve.check_address(cfg.serve)             # a busy port said before the model loads
    with reading(run_dir):
        detector = detect.Served.load(detector_file(run_dir, cfg.model.model))     # checked before the model loads
        rr, _ = shield_as_scored(cfg, adapter, run_dir)
    name = cfg.serve.served_name or (cfg.folder.name if run_dir else "geo-defender-shield")
    serve.serve_until_stopped(rr, cfg.serve, cfg.certify.deletion_rate, name, adapter, detector)


def add_settings_flags(p, cls, preset=True):
    """One flag per setting of the command's settings class (settings.flags): typed by the field's
    type (never its default's), bool as --x/--no-x, a list as a repeatable flag; and --preset for the
    commands that train or evaluate."""
    if preset:
        p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="named settings (paper: Table A.1 with its 4-bit base; tiny-demo: offline demo)")
    for f in settings.flags(cls):
        flag, help, required = "--" + settings.flag_name(f), f.metadata["help"], f.metadata["required"]
        if f.name in settings.own_defaults(cls):
            help += f" (default here: {settings.own_defaults(cls)[f.name].says})"
        if f.metadata["choices"]:        # checked by the settings class, with every other refusal at once
            help += f" (one of {', '.join(c for c in f.metadata['choices'] if c is not None)})"
        help = help.replace("%", "%%")   # argparse %-formats help text
        if f.type is list:
            p.add_argument(flag, dest=f.name, action="append", default=None, help=help)
        elif f.type is bool:
            p.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help)
        else:                            # a spec is text here; its settings class parses it (settings.spec_of)
            typ = str if f.metadata["parse"] else f.type
            p.add_argument(flag, dest=f.name, type=typ, default=None, required=required, help=help)


def given(args, cls):
    """The settings given on the command line (None: not given)."""
    return {f.name: getattr(args, f.name) for f in settings.flags(cls) if getattr(args, f.name, None) is not None}


def print_summary(s, run_dir=None):
    # one short line; what is simulated (model, LLMs, PPL model, benchmark) is listed in report.md
    print("\n" + ("OFFLINE / SIMULATION: plumbing checks, never the paper's results (what is simulated: "
                  "report.md)" if s.get("notes") else ""))
    honest = s.get("honest", {}).get("conditions", {})   # with honest edits: each condition's honest penalty

    def penalty(c):
        h = honest.get(c, {}).get("honest_penalty")
        return "" if not honest else f"{'-' if h is None else f'{h:.2f}':>16}"
    print(f"{'condition':<22}{'ASR':>8}{'ASI':>8}{'BER':>8}" + (f"{'honest penalty':>16}" if honest else ""))
    for k, v in s["conditions"].items():
        print(f"{k:<22}{v['ASR']:>8.2f}{v['ASI']:>8.2f}{v['BER']:>8.2f}{penalty(k)}")
    if run_dir is not None:               # the run's files
        report_paths(run_dir)


# A value argparse quotes in its message ("invalid choice: 'p@ss'"): repr, in either quote; a flag's name.
QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9-]*")


def unrecognized(word):
    """One word of argparse's "unrecognized arguments: ..." -> itself when it is a flag's name, its
    value as ***: --api-key=S3cret -> --api-key=***, S3cret -> ***."""
    name, eq, _ = word.partition("=")
    return (name + ("=***" if eq else "")) if FLAG.fullmatch(name) else "***"


def redacted_error(p, message):
    """argparse's error (usage, message, exit status 2) with no value the user typed in it: a value given
    to a flag the command does not take (--api-key S3cret to train), or refused by a flag's type or
    choices, may be a secret. Flag names stay, and a quoted value that is a word of the usage (a choice
    it lists); every other value is ***."""
    head, sep, rest = message.partition("unrecognized arguments: ")
    if sep:                              # argparse joins the words unquoted
        message = head + sep + " ".join(unrecognized(w) for w in rest.split())
    usage = set(re.findall(r"[\w.-]+", p.format_usage()))
    message = QUOTED.sub(lambda m: m[0] if m[0][1:-1] in usage else "***", message)
    argparse.ArgumentParser.error(p, message)


# The commands: name, settings class, help. JOBS work in a run folder; TOOLS read no run's record and
# take no --preset.
JOBS = (("train", settings.TrainConfig, "train the Shield Reranker and build the TFSG library"),
        ("eval", settings.EvalConfig, "evaluate all conditions on the test split and write the report"),
        ("demo", settings.DemoConfig, "offline end to end: tiny model + offline engine over loopback HTTP"),
        ("rerank-eval", settings.RerankEvalConfig, "any reranker under GEO attack: exposure, rank, promotion (no "
                                                   "LLM)"),
        ("detect", settings.DetectConfig, "flag GEO rewrites against honest edits: the Shield's residual and a text "
                                          "detector, thresholds held out (no LLM)"),
        ("attack", settings.AttackConfig, "an adaptive GEO attacker against the deployed defense, evaluated end to "
                                          "end"),
        ("harden", settings.HardenConfig, "hardening rounds: the attacker on the construction groups, the defense "
                                          "retrained on what got through, a fresh attacker on the test groups"),
        ("holdout", settings.HoldoutConfig, "leave-one-family-out: a Shield trained without each family, measured "
                                            "on it (no LLM)"),
        ("deploy-check", settings.DeployCheckConfig, "does a rerank endpoint score as the run's Shield? (a "
                                                     "known-answer check)"),
        ("build-bench", settings.BuildConfig, "build a GEO-DefenseBench file from queries with candidate documents"))
TOOLS = (("bench", settings.BenchConfig, "speed benchmarks against the reference implementations"),
         ("compare", settings.CompareConfig, "Table 1 across target LLMs, Table C.1 and the transfer matrix "
                                             "(Table C.2)"),
         ("export", settings.ExportConfig, "write the merged Shield as a Hugging Face checkpoint (seq-cls or causal)"),
         ("serve", settings.ServeConfig, "serve the Shield as a rerank HTTP endpoint (Cohere/Jina/vLLM and TEI "
                                         "shapes)"),
         ("bench-audit", settings.AuditConfig, "are the benchmark's families told apart, and does each raise "
                                               "visibility? (no LLM)"),
         ("serve-offline", settings.ServeOfflineConfig, "serve the offline engine as an OpenAI-compatible endpoint "
                                                        "on loopback"))
DRY_RUN = {"train", "eval", "attack", "harden", "build-bench", "holdout", "rerank-eval"}
# --out: where a command writes, never read back (not a setting)
def folder(v):
    """--out's folder: an empty path (the current folder, where a command then writes its files) is refused."""
    if not v.strip():
        raise argparse.ArgumentTypeError("a folder is required (an empty path would mean the current one)")
    return v


OUT = {"demo": dict(default="runs", type=folder, help="folder to write the demo run into (DIR/demo/...)"),
       "export": dict(required=True, type=folder, help="output folder"),
       "compare": dict(required=True, type=folder, help="folder for comparison.md and figures"),
       "bench-audit": dict(default=None, type=folder, help="folder for bench_audit.json and .md (default: "
                                                           "BENCH_audit/ beside --bench)")}


@functools.lru_cache(maxsize=None)
def parser(only=None):
    """The command line: one subcommand per job; each takes the flags of its settings class. With `only`
    (the command a call runs) the other subcommands are listed but given no flags: building every
    command's flags is most of what parsing one command line costs. Built once per `only` in a process
    that parses many command lines (argparse looks up a translation for each of its strings as it builds)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.allow_abbrev, ap.error = False, functools.partial(redacted_error, ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for tool, (name, cls, helptext) in [(False, c) for c in JOBS] + [(True, c) for c in TOOLS]:
        p = sub.add_parser(name, help=helptext, description=cls.__doc__ if tool else None)
        p.allow_abbrev = False                           # `--out` must not silently mean build-bench's --output
        p.error = functools.partial(redacted_error, p)   # error(): argparse's documented override
        if only not in (None, name):
            continue
        if name == "train":
            p.add_argument("--stage", choices=["all", "shield", "tfsg"], default="all", help="which part to train")
            p.add_argument("--no-resume", action="store_true", help="ignore an existing Shield checkpoint")
        add_settings_flags(p, cls, preset=not tool)
        if name in DRY_RUN:
            p.add_argument("--dry-run", action="store_true", help="print what the command would send, and send "
                                                                  "nothing")
        if name in OUT:
            p.add_argument("--out", **OUT[name])
    return ap


def cmd_bench_audit(args):
    """Families told apart (bench_audit.py): bench_audit.json and bench_audit.md."""
    asked = given(args, settings.AuditConfig)
    if "bench" not in asked:
        raise SettingsError("bench-audit: give --bench FILE (a GEO-DefenseBench JSONL file)")
    cfg = resolve(settings.AuditConfig, asked, from_record=False)
    result, path = bench_audit.run_audit(cfg, args.out or os.path.splitext(cfg.data.bench)[0] + "_audit")
    c = result["classifier"]
    print(f"family classifier accuracy {100 * c['accuracy']:.1f}% (chance {100 * c['chance']:.1f}%; labels shuffled "
          f"within groups: {100 * c['null']['mean']:.1f}%, p = {c['null']['p_value']:.3f})\nreport: {path}")
    return result


def cmd_serve_offline(args):
    cfg = resolve(settings.ServeOfflineConfig, given(args, settings.ServeOfflineConfig), from_record=False)
    eng = cfg.engine
    corpus = offline_server.load_corpus(eng.corpus) if eng.corpus else None
    try:
        srv = offline_server.make_server(eng.port, corpus=corpus, created=eng.created)
    except OSError as e:
        raise SettingsError(f"--port {eng.port}: cannot listen on 127.0.0.1:{eng.port} ({e.strerror or e})") from None
    print(f"offline engine (a simulation) on http://127.0.0.1:{srv.server_address[1]}/v1", flush=True)
    srv.serve_forever()


def cmd_compare(args):
    cfg = resolve(settings.CompareConfig, given(args, settings.CompareConfig), from_record=False)
    path = report.write_comparison(args.out, report.read_summaries(cfg.compare.runs))
    print(path)
    return path


def cmd_bench(args):
    res = bench.run_bench(resolve(settings.BenchConfig, given(args, settings.BenchConfig), from_record=False))
    print(json.dumps(res, indent=1))
    return res


def cmd_build_bench(args):
    """GEO-DefenseBench from GEO-Bench rows (build_bench.py): with no --attacks the paper's recipe."""
    cfg = resolve(settings.BuildConfig, given(args, settings.BuildConfig), args.preset, from_record=False)
    if args.dry_run:
        return show(build_bench.dry_run(Run.plan(cfg, llms=True, record=None)))
    plan = build_bench.plan(cfg)
    engine = build_bench.offline_engine_needed(cfg.llm.llm, cfg.build.fidelity_judge, plan)
    with Run.open(cfg, "build-bench", llms=True, record=None, engine=engine, corpus=plan.corpus) as run:
        path, comp = build_bench.build_bench(run, plan)
    print(build_bench.composition_table(comp) + f"\n\nbenchmark: {path}")
    return comp


def cmd_rerank_eval(args):
    """The reranker stage of every test instance under each --reranker, no LLM: results/rerank-*.jsonl,
    summary.json's rerank_stage, rerank_report.md. With --name of a trained run: its benchmark and
    split, and `shield` is its Shield. Under torchrun every rank scores its share of the local rerankers'
    lists; rank 0 then asks the endpoints and writes."""
    cfg = pipeline_settings(settings.RerankEvalConfig, args)
    items = rerank_eval.check_items(cfg.rerank.reranker)
    if args.dry_run:
        return show(rerank_eval.dry_run(Run.plan(cfg, needs=rerank_eval.needs(items), record="check"), items))
    with Run.open(cfg, "rerank-eval", record="check", distributed=True, needs=rerank_eval.needs(items)) as run:
        by_label = rerank_eval.stage_rankers(run, items)       # every rank its share
        stage = run.main_only(lambda: rerank_eval.rerank_stage(run, items, by_label=by_label)[0])
    if stage:
        print(rerank_eval.stage_text(stage, cfg.data.k, cfg.folder.run_dir))
    return stage


def cmd_detect(args):
    """GEO rewrites flagged against honest edits on a trained run (detect.py): detect/summary.json, report.md."""
    cfg = pipeline_settings(settings.DetectConfig, args)
    with Run.open(cfg, "detect", needs=("adapter",), record="check", check=detect.check) as run:
        out = detect.detect(run)
    print(detect.table(out) + f"\n\nreport: {os.path.join(cfg.folder.run_dir, 'detect', 'report.md')}")
    return out


def cmd_attack(args):
    """The adaptive attacker (attack.py) on a trained run's test instances, then every budget's
    documents evaluated end to end. On a demo run the offline engine plays the LLMs again."""
    cfg = pipeline_settings(settings.AttackConfig, args)
    opened = dict(needs=("adapter", "library"), llms=True, roles=True, check=attack.check, record="check")
    if args.dry_run:
        return show(attack.dry_run(Run.plan(cfg, **opened)))
    with Run.open(cfg, "attack", engine=cfg.llm.llm == "offline", **opened) as run:
        a = cfg.attack
        block = attack.run_attack(run, a.target, a.budgets, a.attack_rounds, cfg.attacker.candidates_per_round,
                                  cfg.attacker.attacker, a.aware_of_library)
    print(attack.attack_table(block) + f"\n\ngate: {block['gate']}\nsummary: {cfg.folder.run_dir}/summary.json")
    return block


def cmd_harden(args):
    """Hardening rounds (harden.py) on a trained run: attack, harvest, retrain, measure; the cross-play.
    Under torchrun every rank takes its share of each round's retraining; rank 0 does the rest."""
    cfg = pipeline_settings(settings.HardenConfig, args)
    opened = dict(needs=("adapter", "library"), llms=True, roles=True, check=harden.check, record="check")
    if args.dry_run:
        return show(harden.dry_run(Run.plan(cfg, **opened)))
    with Run.open(cfg, "harden", distributed=True, engine=cfg.llm.llm == "offline", **opened) as run:
        block = harden.harden(run) if run.ranks.is_main else harden.train_share(run)
    if block:
        print(harden.round_table(block, cfg.harden.eval_budgets) +
              f"\n\nreport: {cfg.folder.run_dir}/harden_report.md\nsummary: {cfg.folder.run_dir}/summary.json")
    return block


def cmd_holdout(args):
    """Leave-one-family-out (holdout.py): a Shield per held-out family, scored on the test split; with
    --llm-stage also its library and the two conditions end to end."""
    cfg = pipeline_settings(settings.HoldoutConfig, args)
    opened = dict(llms=cfg.holdout.llm_stage, roles=cfg.holdout.llm_stage, record="check", check=holdout.flags_taken)
    if args.dry_run:
        return show(holdout.dry_run(Run.plan(cfg, **opened)))
    with Run.open(cfg, "holdout", engine=cfg.holdout.llm_stage and cfg.llm.offline_batches, **opened) as run:
        s = holdout.holdout(run)
    print(holdout.table(s) + f"\n\nreport: {os.path.join(cfg.folder.run_dir, 'holdout', 'report.md')}\nsummary: "
          f"{os.path.join(cfg.folder.run_dir, 'holdout', 'summary.json')}")
    return s


def cmd_deploy_check(args):
    """Does an endpoint score as the run's Shield does (deploy_check.py)? A failed check exits with its
    likely cause."""
    cfg = pipeline_settings(settings.DeployCheckConfig, args)
    Run(cfg).check_weights(read_json(os.path.join(cfg.folder.run_dir, "config.json"), {}))   # (it records nothing)
    with Run.open(cfg, "deploy-check", needs=("adapter",), record=None, lock="read", check=deploy_check.check) as run:
        v = deploy_check.deploy_check(run, cfg.deploy.endpoint)
    print(deploy_check.table(v))
    if not v["pass"]:
        raise SystemExit(f"deploy-check: {cfg.deploy.endpoint} does not score as the run's Shield: {v['cause']}")
    return v


def show(plan):
    """A dry run's plan, printed as JSON (and returned)."""
    print(json.dumps(plan, indent=1))
    return plan


def pipeline_settings(cls, args, preset=None, **fixed):
    """A pipeline command's settings (defaults, the run's record, the preset: --preset, else `preset`, the
    flags) with its benchmark present; fixed: settings the command sets itself (demo's run folder, from its
    --out)."""
    if os.path.isfile(fixed.get("runs_dir", "")):
        raise SettingsError(f"--out {fixed['runs_dir']}: a file, not a folder")
    cfg = resolve(cls, {**given(args, cls), **fixed}, args.preset or preset, from_record="runs_dir" not in fixed)
    if not os.path.isfile(cfg.data.bench):
        what = "a folder, not a file" if os.path.isdir(cfg.data.bench) else "no such file"
        raise SettingsError(f"--bench {cfg.data.bench}: {what}")
    return cfg


def check_training(run, stage="all"):
    """What training needs (the stages' schedules filled by the benchmark; a library built over the Shield's ranks
    without training it, its trained Shield), before anything is written or loaded."""
    inst = geodef.expand(run.data.construction, run.data.seen)
    if stage in ("all", "shield"):
        run.shield_split(inst)
    if stage in ("all", "tfsg"):
        run.tfsg_schedule(inst)
    if stage == "tfsg" and run.cfg.tfsg.shield:
        path, what = NEEDS["adapter"]
        need_trained(path(run), what, run.cfg.folder)


def check_demo(run):
    """demo's checks, training's and evaluation's, before its settings are recorded."""
    check_training(run)
    eval_conditions(run, trained=False)


def report_paths(run_dir):
    print(f"\nreport: {os.path.join(run_dir, 'report.md')}\nsummary: {os.path.join(run_dir, 'summary.json')}")


def cmd_train(args):
    """The Shield (train.train_shield) and the TFSG library (train.train_tfsg), each resumable. Under
    torchrun every rank trains its share of the Shield's steps; rank 0 alone holds the run's lock,
    writes its files and builds the library (every LLM call once)."""
    cfg = pipeline_settings(settings.TrainConfig, args)
    shield, library = args.stage in ("all", "shield"), args.stage in ("all", "tfsg")
    opened = dict(llms=library, roles=library, check=lambda run: check_training(run, args.stage))
    if args.dry_run:
        return show(plan_train(Run.plan(cfg, **opened), args.stage))
    with Run.open(cfg, "train", distributed=True, engine=cfg.llm.offline_batches, **opened) as run:
        if shield:
            train_shield(run, resume=not args.no_resume)
        if library and run.ranks.is_main:
            train_tfsg(run)


def cmd_eval(args):
    """Every condition on the test split (evaluation.evaluate): summary.json, report.md, figures. Under
    torchrun every rank scores its share of the ranking stage; rank 0 then evaluates alone."""
    cfg = pipeline_settings(settings.EvalConfig, args)
    opened = dict(llms=True, roles=True, check=eval_conditions)     # -> run.checked
    if args.dry_run:
        return show(plan_eval(Run.plan(cfg, **opened)))
    with Run.open(cfg, "eval", distributed=True, engine=cfg.llm.offline_batches, **opened) as run:
        ranked = ranking_stage(run, run.checked[0], reranker_items(cfg.rerank.reranker))    # every rank its share
        s = run.main_only(lambda: evaluate(run, run.checked, ranked).summary)
    if s:
        print_summary(s, cfg.folder.run_dir)
    return s


def cmd_demo(args):
    """train and eval offline (tiny model, offline engine over loopback HTTP), then the reranker stage."""
    cfg = pipeline_settings(settings.DemoConfig, args, "tiny-demo", runs_dir=args.out, name=args.name or "demo")
    with Run.open(cfg, "demo", llms=True, engine=cfg.llm.llm == "offline", check=check_demo) as run:
        train_shield(run)
        train_tfsg(run)
        s = evaluate(run).summary
        print_summary(s)
        stage, _ = rerank_eval.rerank_stage(run, rankers.parse_rerankers(["base", "shield"]))
    print("\nreranker stage (no LLM):\n" + rerank_eval.stage_table(stage, cfg.data.k))
    report_paths(cfg.folder.run_dir)
    return s


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "demo": cmd_demo, "rerank-eval": cmd_rerank_eval,
            "attack": cmd_attack, "harden": cmd_harden, "compare": cmd_compare, "bench": cmd_bench,
            "build-bench": cmd_build_bench, "export": cmd_export, "serve": cmd_serve,
            "serve-offline": cmd_serve_offline, "bench-audit": cmd_bench_audit, "holdout": cmd_holdout,
            "deploy-check": cmd_deploy_check, "detect": cmd_detect}


# Errors that are the user's to fix, each naming its file, flag or API: one line, no traceback.
USER_ERRORS = (SettingsError, RunInUse, geodef.BenchFormatError, reranker.CheckpointError, reranker.PromptLengthError,
               FileNotFoundError, llm_clients.LLMError, tfsg.LibraryError, export.ExportError, export.IdentityError,
               lora.AdapterError, JSONFileError)


def no_credentials_outside_urls(args):
    """A URL with a password typed where no URL belongs (--out, --runs-dir, --name, --model, --dtype ...) is
    refused before anything is made of it: as a folder it would put the password into a path on disk. The
    flags that take a URL (a setting with `parse`: --base-url, --reranker, --search, --endpoint) hold their
    credentials apart (endpoints.Endpoint)."""
    specs = {f.name for cls in vars(settings).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
             for f in dataclasses.fields(cls) if f.metadata.get("parse")}
    for name, v in vars(args).items():
        for x in (v if isinstance(v, list) else [v]):
            if name not in specs and isinstance(x, str) and endpoints.redact(x) != x:
                raise SettingsError(f"--{name.replace('_', '-')} {endpoints.redact(x)}: a URL with credentials or a "
                                    "query, where this flag takes none")


def main(argv=None):
    """Parse and dispatch; library errors become `error: ...` and exit status 1 (SystemExit)."""
    words = sys.argv[1:] if argv is None else argv
    args = parser(words[0] if words and words[0] in COMMANDS else None).parse_args(argv)
    try:
        no_credentials_outside_urls(args)
        return COMMANDS[args.cmd](args)
    except USER_ERRORS as e:     # a refusal may quote any value typed: every URL in it redacted
        raise SystemExit(endpoints.redact(f"error: {e}")) from None
    except OSError as e:         # a read-only folder, a full disk, a port in use: the file or address and why
        raise SystemExit(endpoints.redact(f"error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}")) \
            from None


if __name__ == "__main__":
    speed.reuse_freed_memory()   # the process's malloc keeps freed activations for the next call
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: rerun the same command to resume (finished steps and LLM replies are kept)")
