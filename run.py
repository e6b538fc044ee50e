"""GEO Defender command line: train, eval, demo, bench, build-bench, serve-offline.

Ties the leaf files together (paper: Shield Reranker + TFSG, Experiments). Every command writes into
a run folder runs/<name>/ (config.json, adapter/, library/, cache/, results/, report.md, figures/),
reuses what a finished step left there and resumes an interrupted one.

  python run.py demo --out runs/demo             # everything offline: tiny model + offline engine
  python run.py train --model Qwen/Qwen3-Reranker-0.6B --llm openai:gpt-5.5 --name gpt55
  python run.py eval --name gpt55
"""
import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

import geodef
import lora
import reranker

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, "data", "geo_defensebench_sample.jsonl")
TINY_NOTE = "tiny random-weight Qwen3 checkpoint (offline plumbing; its scores mean nothing)"


@dataclass
class Config:
    name: str = "default"                      # run folder runs/<name>
    runs_dir: str = "runs"                     # parent of run folders
    model: str = "Qwen/Qwen3-Reranker-0.6B"    # hub id, local folder, or "tiny" (random weights, offline)
    revision: str = None                       # hub revision to pin
    dtype: str = "bfloat16"                    # base weights' dtype (Qwen3-Reranker ships bf16)
    device: str = "cpu"                        # "cuda" for a GPU
    quant: str = "none"                        # "nf4": 4-bit frozen base projections (Table A.1)
    max_length: int = 8192                     # reranker prompt length cap (model card)
    bench: str = SAMPLE                        # GEO-DefenseBench JSONL
    n_construction: int = 12                   # construction query groups (B.1)
    seed: int = 0                              # split, order and init seed
    k: int = 5                                 # top-k evidence passed to the LLM (A.1.3)
    # Shield Reranker (Table A.1)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lr: float = 1e-4
    epochs: int = 3                            # the paper does not state it
    grad_accum: int = 8
    max_grad_norm: float = 1.0                 # clip, as TRL's default
    beta: float = 0.1
    lam_def: float = 1.1
    lam_util: float = 0.9
    lam_cons: float = 0.15
    monitor_frac: float = 0.2
    grad_checkpointing: bool = False           # recompute layer activations in backward (long documents)
    save_every: int = 4                        # optimizer steps between resumable checkpoints
    # TFSG (A.2)
    llm: str = "offline"                       # target LLM, provider:model (llm_clients.make_client)
    analyzer: str = None                       # Analyzer LLM; default: the target LLM
    judge: str = None                          # ASI / quality judge; default: the target LLM
    base_url: str = None                       # override for any OpenAI-compatible server
    temperature: float = 0.0                   # decoding fixed per target and recorded (B.2.1)
    max_tokens: int = 2048
    workers: int = 8                           # concurrent LLM requests
    rpm: float = 0                             # requests per minute cap (0 = none)
    n_seed_cases: int = 6                      # A.2.2 controlled contrast cases
    batch_size: int = 10                       # A.2.2 cases per update batch
    n_batches: int = 3                         # E1 -> E4
    max_initial_rules: int = 10
    reasoning_interface: bool = False          # A.3.2/A.3.5 for targets that return reasoning_content
    shield: bool = True                        # TFSG construction on Shield top-5 (else base top-5)
    # evaluation
    conditions: str = "all"                    # comma list or "all"
    methods: str = "all"                       # GEO methods evaluated on the test split
    ppl_model: str = "openai-community/gpt2"   # PPL-Filter scorer; "tiny" = random GPT-2 offline
    ppl_quantile: float = 0.99
    n_boot: int = 10000
    max_test_groups: int = 0                   # 0 = all; a smaller number for quick runs

    @property
    def run_dir(self):
        return os.path.join(self.runs_dir, self.name)

    @property
    def offline(self):
        return self.model == "tiny" or self.llm.startswith("offline") or self.ppl_model == "tiny"


# Presets. "paper" = Table A.1; "tiny-demo" trains the random tiny model hard enough to see the
# objective move in minutes on a CPU (a plumbing check, not the paper's setting).
PRESETS = {
    "paper": {},
    "tiny-demo": {"model": "tiny", "dtype": "float32", "lr": 2e-3, "epochs": 6, "grad_accum": 4,
                  "llm": "offline", "ppl_model": "tiny", "n_boot": 2000},
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def atomic_write(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def read_json(path, default=None):
    if not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def code_version():
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


# ----------------------------------------------------------------------------- models


def model_folder(cfg):
    if cfg.model == "tiny":
        return reranker.make_tiny_checkpoint(os.path.join(cfg.runs_dir, "_tiny_qwen3"), seed=0)
    return cfg.model


def load_reranker(cfg):
    dtype = getattr(torch, cfg.dtype)
    rr = reranker.Reranker.from_pretrained(model_folder(cfg), dtype=dtype, device=cfg.device,
                                           max_length=cfg.max_length, revision=cfg.revision)
    if cfg.quant == "nf4":
        lora.quantize_nf4(rr.model)
    rr.model.gradient_checkpointing = cfg.grad_checkpointing
    return rr


def hub_id(cfg):
    return "tiny" if cfg.model == "tiny" else cfg.model


def load_shield(cfg, rr=None):
    """The base reranker with the run's trained adapter attached (LoRA enabled)."""
    rr = rr or load_reranker(cfg)
    path = os.path.join(cfg.run_dir, "adapter")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise FileNotFoundError(f"{path}: no trained adapter; run `python run.py train --name {cfg.name}` first")
    lora.load_adapter(rr.model, path)
    rr.model.eval()
    return rr


# ----------------------------------------------------------------------------- data


def load_data(cfg):
    groups, meta = geodef.load_bench(cfg.bench, with_meta=True)
    cons, test = geodef.split_groups(groups, cfg.n_construction, cfg.seed)
    seen = meta.seen_methods or meta.methods[:3]
    if cfg.max_test_groups:
        test = test[:cfg.max_test_groups]
    methods = meta.methods if cfg.methods == "all" else [m.strip() for m in cfg.methods.split(",")]
    for m in methods:
        if m not in meta.methods:
            raise ValueError(f"--methods: {m!r} is not in the benchmark's methods {meta.methods}")
    return groups, meta, cons, test, seen, methods


def cached_scores(rr, path, items, desc):
    """items: list of (key, query, docs). Margins cached in a JSON file keyed by `key`."""
    from tqdm import tqdm
    cache = read_json(path, {})
    todo = [it for it in items if it[0] not in cache]
    for i, (key, q, docs) in enumerate(tqdm(todo, desc=desc, disable=not todo, file=sys.stderr)):
        cache[key] = [float(v) for v in rr.score(q, docs)]
        if i % 16 == 15:
            write_json(path, cache)
    if todo:
        write_json(path, cache)
    return cache


# ----------------------------------------------------------------------------- Shield training


def _save_ckpt(path, model, opt, state):
    """Resumable checkpoint without pickle: LoRA + AdamW tensors in safetensors, counters in JSON."""
    from safetensors.torch import save_file
    tensors = {k: v.contiguous() for k, v in lora.lora_state_dict(model).items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                tensors[f"opt.{i}.{k}"] = st[k].contiguous()
        if "step" in st:
            state.setdefault("opt_steps", {})[str(i)] = float(st["step"])
    tensors["rng.torch"] = torch.get_rng_state()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "state.safetensors.tmp"))
    atomic_write(os.path.join(path, "state.json.tmp"), json.dumps(state))
    os.replace(os.path.join(path, "state.safetensors.tmp"), os.path.join(path, "state.safetensors"))
    os.replace(os.path.join(path, "state.json.tmp"), os.path.join(path, "state.json"))


def _load_ckpt(path, model, opt):
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, "state.safetensors"))
    state = read_json(os.path.join(path, "state.json"))
    mods = lora.lora_modules(model)
    with torch.no_grad():
        for name, m in mods.items():
            m.lora_A.copy_(tensors[f"{lora.PEFT_PREFIX}model.{name}.lora_A.weight"])
            m.lora_B.copy_(tensors[f"{lora.PEFT_PREFIX}model.{name}.lora_B.weight"])
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if f"opt.{i}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(state["opt_steps"][str(i)]),
                            "exp_avg": tensors[f"opt.{i}.exp_avg"], "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
    torch.set_rng_state(tensors["rng.torch"])
    return state


def monitor(rr, triples, ids, s0, cfg):
    """Monitoring split metrics: preference accuracy (both preference types, strict >), mean residuals,
    attack demotion rate (attack scored below both benign documents)."""
    acc, r_pos, r_att, r_ben, demoted = [], [], [], [], []
    rr.model.eval()
    for t in triples:
        s = rr.score_ids(ids[t["instance_id"]])                                  # (3,) pos, att, ben
        r = geodef.defensive_residual(s, torch.tensor(s0[t["instance_id"]]))     # Eq. 2
        acc += [float(r[0] > r[1]), float(r[2] > r[1])]
        r_pos.append(float(r[0])); r_att.append(float(r[1])); r_ben.append(float(r[2]))
        demoted.append(float(s[1] < s[0] and s[1] < s[2]))
    mean = lambda v: sum(v) / max(1, len(v))
    return {"pref_accuracy": mean(acc), "residual/pos": mean(r_pos), "residual/att": mean(r_att),
            "residual/ben": mean(r_ben), "attack_demotion": mean(demoted)}


def train_shield(cfg, rr=None, resume=True):
    """Shield Reranker: LoRA on the frozen reranker, residual preference objective (Eqs. 1-5, Table A.1)."""
    from tqdm import tqdm
    run = cfg.run_dir
    adapter_dir = os.path.join(run, "adapter")
    if read_json(os.path.join(run, "shield_done.json")):
        log(f"[train] Shield adapter already trained: {adapter_dir}")
        return
    torch.manual_seed(cfg.seed)
    rr = rr or load_reranker(cfg)
    groups, meta, cons, test, seen, methods = load_data(cfg)
    inst = geodef.expand(cons, seen)
    opt_inst, mon_inst = geodef.monitoring_split(inst, cfg.monitor_frac, cfg.seed)
    # Frozen base scores s_0, once, without gradient (TRL precompute_ref_log_probs): the full
    # attack-injected list (to pick d_b) and the clean source document d+.
    base = cached_scores(rr, os.path.join(run, "cache", "base_scores_construction.json"),
                         [(x.instance_id, x.query, x.docs) for x in inst], "base scores")
    triples = geodef.preference_triples(cons, inst, base.get)
    pos = cached_scores(rr, os.path.join(run, "cache", "base_scores_source.json"),
                        [(t["instance_id"], t["query"], [t["pos"]]) for t in triples], "base scores d+")
    s0 = {t["instance_id"]: [pos[t["instance_id"]][0], base[t["instance_id"]][t["att_index"]],
                             base[t["instance_id"]][t["ben_index"]]] for t in triples}
    ids = {t["instance_id"]: rr.tokenize(t["query"], [t["pos"], t["att"], t["ben"]]) for t in triples}
    opt_ids = {x.instance_id for x in opt_inst}
    opt_triples = [t for t in triples if t["instance_id"] in opt_ids]
    mon_triples = [t for t in triples if t["instance_id"] not in opt_ids]

    lora.add_lora(rr.model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    params = [p for p in rr.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    ckpt = os.path.join(run, "checkpoint")
    state = {"epoch": 0, "pos": 0, "step": 0, "best": None, "history": []}
    if resume and os.path.isfile(os.path.join(ckpt, "state.json")):
        state = _load_ckpt(ckpt, rr.model, opt)
        log(f"[train] resuming at epoch {state['epoch']} example {state['pos']} (step {state['step']})")
    log_path = os.path.join(run, "train_log.jsonl")
    if state["step"] == 0 and state["epoch"] == 0 and state["pos"] == 0:
        m0 = monitor(rr, mon_triples, ids, s0, cfg)
        state["history"].append({"epoch": 0, **m0})
        _append_jsonl(log_path, {"event": "monitor", "epoch": 0, "step": 0, **m0})
        log(f"[train] step 0 monitoring: {m0}")
    steps_per_epoch = math.ceil(len(opt_triples) / cfg.grad_accum)
    bar = tqdm(total=cfg.epochs * len(opt_triples), initial=state["epoch"] * len(opt_triples) + state["pos"],
               desc="shield", file=sys.stderr)
    while state["epoch"] < cfg.epochs:
        order = list(range(len(opt_triples)))
        random.Random(cfg.seed * 1000 + state["epoch"]).shuffle(order)   # epoch order from the seed alone
        rr.model.train()
        acc_stats = []
        while state["pos"] < len(order):
            t = opt_triples[order[state["pos"]]]
            s = rr.score_ids(ids[t["instance_id"]], grad=True)                  # (3,) s_theta: d+, d_a, d_b
            r = geodef.defensive_residual(s, torch.tensor(s0[t["instance_id"]]))  # (3,) Eq. 2
            loss, st = geodef.shield_loss(r[0:1], r[1:2], r[2:3], cfg.beta, cfg.lam_def, cfg.lam_util, cfg.lam_cons)
            n_in_step = min(cfg.grad_accum, len(order) - (state["pos"] // cfg.grad_accum) * cfg.grad_accum)
            (loss / n_in_step).backward()                                       # mean over the accumulated examples
            acc_stats.append(st)
            state["pos"] += 1
            bar.update(1)
            if state["pos"] % cfg.grad_accum == 0 or state["pos"] == len(order):
                gn = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                state["step"] += 1
                rec = {k: sum(a[k] for a in acc_stats) / len(acc_stats) for k in acc_stats[0]}
                rec.update({"grad_norm": float(gn), "learning_rate": cfg.lr, "step": state["step"],
                            "epoch": state["epoch"] + state["pos"] / len(order)})
                _append_jsonl(log_path, {"event": "train", **rec})
                bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['rewards/accuracies']:.2f}")
                acc_stats = []
                if state["step"] % cfg.save_every == 0 and state["pos"] < len(order):
                    _save_ckpt(ckpt, rr.model, opt, state)
        state["epoch"] += 1
        state["pos"] = 0
        m = monitor(rr, mon_triples, ids, s0, cfg)
        state["history"].append({"epoch": state["epoch"], **m})
        _append_jsonl(log_path, {"event": "monitor", "epoch": state["epoch"], "step": state["step"], **m})
        key = (m["pref_accuracy"], m["attack_demotion"], -m["residual/att"])
        if state["best"] is None or key > tuple(state["best"]["key"]):
            lora.save_adapter(rr.model, adapter_dir, hub_id(cfg))   # keep the best adapter by monitoring
            state["best"] = {"epoch": state["epoch"], "key": list(key), **m}
        _save_ckpt(ckpt, rr.model, opt, state)
    bar.close()
    write_json(os.path.join(run, "shield_done.json"), {"best": state["best"], "history": state["history"],
                                                      "steps": state["step"], "steps_per_epoch": steps_per_epoch})
    log(f"[train] best adapter (epoch {state['best']['epoch']}): {state['best']}")


def _append_jsonl(path, rec):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
