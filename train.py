"""Training: the Shield Reranker's LoRA on the frozen reranker with the residual preference objective
(paper Eqs. 1-5, Table A.1), resumable from one-file checkpoints, and the TFSG driver (Algorithm 1)
that builds the experience library E0 -> E{n+1} from construction cases.

Usage: run = runs.Run(cfg); train_shield(run); train_tfsg(run)     (outputs in run.dir)
"""
import glob
import hashlib
import json
import math
import os
import random
import sys

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import certify
import geodef
import lora
import speed
import tfsg
from accounting import estimate, price_plan
from evaluation import clean_answers, clean_reference, eval_condition
from llm_clients import ReplyInvalid
from metrics import ranked
from rankers import base_ranker, doc_key, load_rankers, shield_ranker
from reranker import CheckpointError
from runs import code_version, labels_of
from store import append_jsonl, log, read_json, write_json


# ----------------------------------------------------------------------------- Shield training


def rng_states(ranks):
    """Every rank's generators, which draw its LoRA dropout masks, as tensors named for the checkpoint
    (rank 0's "rng.torch", rank r's "rng.torch.rank{r}"; "rng.cuda..." on a GPU). A collective: every rank
    calls it, so that a resumed multi-rank run draws each rank's masks where it left off."""
    mine = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():   # dropout masks on a GPU draw from its generator
        mine["cuda"] = torch.cuda.get_rng_state()
    return {f"rng.{kind}{f'.rank{r}' if r else ''}": t
            for r, states in ranks.gather({ranks.rank: mine}).items() for kind, t in states.items()}


def _save_ckpt(path, model, opt, state, log_path, rngs):
    """Resumable checkpoint without pickle: LoRA + AdamW tensors and every rank's generators (`rngs`,
    rng_states) in safetensors, with the counters and how much of the training log belongs to it (a resume
    cuts what was logged after it) as JSON in the same file's metadata: one file, written aside and renamed,
    so a checkpoint is whole or absent whenever the process dies."""
    state["log_bytes"] = os.path.getsize(log_path) if os.path.isfile(log_path) else 0
    tensors = {k: v.contiguous() for k, v in lora.lora_state_dict(model).items()}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        st = opt.state.get(p, {})
        tensors.update({f"opt.{i}.{k}": st[k].contiguous() for k in ("exp_avg", "exp_avg_sq") if k in st})
        if "step" in st:
            state.setdefault("opt_steps", {})[str(i)] = float(st["step"])
    tensors.update(rngs)
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f"state.safetensors.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt", "state": json.dumps(state)})
    os.replace(tmp, os.path.join(path, "state.safetensors"))


def _load_ckpt(path, model, opt, rank=0):
    """_save_ckpt's file back into the model, the optimizer and this rank's generators -> the loop's state. A
    rank the checkpoint holds no generator of (a run resumed on more ranks) keeps the stream attach_lora seeded
    for it. Anything but what _save_ckpt writes is a CheckpointError naming the file."""
    file = os.path.join(path, "state.safetensors")
    try:
        tensors = load_file(file)
        with safe_open(file, "pt") as f:
            state = json.loads(f.metadata()["state"])
        if not all(type(state.get(k)) is int for k in ("epoch", "pos", "step")) or not isinstance(
                state.get("history"), list) or not isinstance(state.get("best", 0), (dict, type(None))):
            raise ValueError("epoch, pos and step whole numbers, a history list and the best epoch: not all there")
        lora.load_lora_state_dict(model, tensors)
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            if f"opt.{i}.exp_avg" in tensors:
                moments = {k: tensors[f"opt.{i}.{k}"] for k in ("exp_avg", "exp_avg_sq")}
                if any(m.shape != p.shape for m in moments.values()):
                    raise ValueError(f"opt.{i}: Adam moments of another shape than its parameter's {tuple(p.shape)}")
                opt.state[p] = {"step": torch.tensor(state["opt_steps"][str(i)]),   # (AdamW keeps it on the CPU)
                                **{k: m.to(p.device) for k, m in moments.items()}}
        mine = f".rank{rank}" if rank else ""
        if rank == 0 or "rng.torch" + mine in tensors:
            torch.set_rng_state(tensors["rng.torch" + mine])
        if "rng.cuda" + mine in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng.cuda" + mine])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:   # (written whole: a
        raise CheckpointError(f"{file}: not a checkpoint this code wrote ({type(e).__name__}: "     # failed disk)
                              f"{str(e)[:100]}); move the folder aside to train from the start") from None
    return state


def prepare_triples(run, rr, cons, inst):
    """A.1.1 preference triples of the construction instances, tokenized, with their frozen base
    scores s_0 (once, without gradient, as TRL's precompute_ref_log_probs): every distinct document
    of the attack-injected lists (to pick d_b) and of the clean lists (d+), cached in the file the
    evaluation reads. -> (triples, ids {instance_id: 3 token-id lists}, s0 {instance_id: 3 floats},
    base scores {instance_id: the 10 candidates' scores})."""
    base = base_ranker(run, rr)
    base.prepare(inst + [geodef.clean_instance(g) for g in cons])
    scores = {x.instance_id: base.scores(x) for x in inst}
    triples = geodef.preference_triples(cons, inst, scores.get)
    s0 = {t["instance_id"]: [base.cache[doc_key(t["query"], t["pos"])], scores[t["instance_id"]][t["att_index"]],
                             scores[t["instance_id"]][t["ben_index"]]] for t in triples}
    ids = {t["instance_id"]: rr.tokenize(t["query"], [t["pos"], t["att"], t["ben"]]) for t in triples}
    return triples, ids, s0, scores


def example(rr, noise, seed, t, ids, s0, epoch):
    """A training example's three token-id lists and their base scores s_0: as prepared, or with
    --deletion-noise (`noise`) the epoch's deleted text (noised_triple)."""
    return noised_triple(rr, t, noise, f"{seed}:{epoch}") if noise else (ids[t["instance_id"]], s0[t["instance_id"]])


def monitored(state, m, log_path):
    """The monitoring split's figures `m` at state's epoch and step, in the history and the training log."""
    state["history"].append({"epoch": state["epoch"], **m})
    append_jsonl(log_path, {"event": "monitor", "epoch": state["epoch"], "step": state["step"], **m})


def noised_triple(rr, t, rate, key):
    """A triple's three documents with words deleted at `rate` (certify.delete_words, drawn from the stream
    key:instance_id: the same in a resumed run), tokenized, with their base scores s_0 on that text (the
    adapter off, no gradient), so that Eq. 2's residual still measures the adapter alone -> (ids, s0)."""
    rng = random.Random(f"{key}:{t['instance_id']}")
    docs = [certify.delete_words(t[d], rate, rng) for d in ("pos", "att", "ben")]
    ids = rr.tokenize(t["query"], docs)
    with lora.lora_disabled(rr.model):
        return ids, rr.score_ids(ids).tolist()


def triple_loss(rr, sh, ids, s0, grad):
    """Eqs. 2-5 for one triple, scored in the order (d+, d_a, d_b) -> (loss, stats, s (3,), r (3,)), with
    the ShieldSettings `sh`' beta and lambdas. The training loop and the monitoring split compute their
    loss here. Eq. 1's D(q) is the triple: each residual differs from the full list's by a per-query constant
    (the two normalisers), so the differences Eqs. 3-4 read are the same, and the monitoring log's
    residual/pos, /att and /ben are over the triple."""
    s = rr.score_ids(ids, grad=grad)                                           # (3,) s_theta: d+, d_a, d_b
    r = geodef.defensive_residual(s, torch.tensor(s0, device=s.device))       # (3,) Eq. 2
    loss, stats = geodef.shield_loss(r[0:1], r[1:2], r[2:3], sh.beta, sh.lam_def, sh.lam_util, sh.lam_cons)
    return loss, stats, s, r


def monitor(rr, triples, ids, s0, sh, k, lists=()):
    """Monitoring split metrics: Eq. 5 loss, preference accuracy (both preference types, strict >), mean residuals,
    attack demotion rate (attack scored below both benign documents), and over the full candidate
    lists (instance, base scores): the share of the base top-k's benign documents the adapter keeps."""
    acc, r_pos, r_att, r_ben, demoted, losses = [], [], [], [], [], []
    rr.model.eval()
    for t in triples:
        loss, _, s, r = triple_loss(rr, sh, ids[t["instance_id"]], s0[t["instance_id"]], grad=False)
        losses.append(loss.item())
        acc += [float(r[0] > r[1]), float(r[2] > r[1])]
        for out, v in zip((r_pos, r_att, r_ben), r):
            out.append(float(v))
        demoted.append(float(s[1] < s[0] and s[1] < s[2]))
    overlap = [benign_kept(b, rr.score(x.query, x.docs).tolist(), x, k) for x, b in lists]
    mean = lambda v: sum(v) / max(1, len(v))
    return {"loss": mean(losses), "pref_accuracy": mean(acc), "residual/pos": mean(r_pos), "residual/att": mean(r_att),
            "residual/ben": mean(r_ben), "attack_demotion": mean(demoted), "benign_topk_overlap": mean(overlap)}


def train_shield(run, rr=None, resume=True, out=None, extra=(), init=None):
    """Shield Reranker: LoRA on the frozen reranker, residual preference objective (Eqs. 1-5, Table A.1).
    Keeps the adapter of the epoch with the lowest Eq. 5 loss on the monitoring split; resumable.
    out: the folder for the adapter, checkpoint and logs (default: the run folder); extra: more
    construction instances (a hardening round's survivors); init: an adapter folder to start from
    (warm start) instead of PEFT's initialisation.

    The loop: per example forward and loss, backward scaled to the mean over the accumulated examples,
    then clip, step and log every grad_accum examples, and monitor after each epoch. Each epoch's order
    comes from the seed alone, so a resumed run redoes exactly the examples it lost. Under torchrun
    (run.ranks) each of N ranks runs every N-th example of a window and the window's gradients are
    summed over the ranks before the clip, so each rank takes the single-process step (float32 sums in
    another order: equal within rounding); rank 0 alone writes (logs, checkpoints, the adapter).
    Deviation: LoRA dropout masks are drawn from each rank's own generator, so with dropout > 0 a
    multi-rank run differs from one process's as another seed would."""
    cfg, folder, ranks = run.cfg, out or run.dir, run.ranks
    sh, main = cfg.shield, ranks.is_main
    adapter_dir = os.path.join(out, "adapter") if out else run.path("adapter")
    if read_json(os.path.join(folder, "shield_done.json")):
        log(f"[train] Shield adapter already trained: {adapter_dir}")
        return
    rr, opt_triples, mon_triples, mon_lists, ids, s0 = shield_examples(run, rr, extra)
    watch = lambda: monitor(rr, mon_triples, ids, s0, sh, cfg.data.k, mon_lists)      # the monitoring split's figures

    params, opt = attach_lora(run, rr, init)
    ckpt, log_path = os.path.join(folder, "checkpoint"), os.path.join(folder, "train_log.jsonl")
    state = start_state(rr, opt, ckpt, log_path, resume, ranks)
    if main and state["step"] == 0 and state["epoch"] == 0 and state["pos"] == 0:
        m0 = watch()
        monitored(state, m0, log_path)                  # before the first step: epoch 0, step 0
        log(f"[train] step 0 monitoring: {m0}")
        if init:          # a warm start: the adapter it starts from competes with its epochs (a fresh one is the base)
            keep_if_best(cfg.model.model, rr, state, m0, adapter_dir)

    n = len(opt_triples)
    bar = tqdm(total=sh.epochs * n, initial=state["epoch"] * n + state["pos"], desc="shield", file=sys.stderr,
               disable=not main)
    while state["epoch"] < sh.epochs:
        order = list(range(n))
        random.Random(cfg.folder.seed * 1000 + state["epoch"]).shuffle(order)
        rr.model.train()
        window = []                                    # this rank's examples' stats in the accumulation window
        while state["pos"] < n:
            start = (state["pos"] // sh.grad_accum) * sh.grad_accum            # this accumulation window's
            if ranks.mine(state["pos"], start):         # under torchrun each rank takes its share of the window
                t = opt_triples[order[state["pos"]]]
                loss, st, _, _ = triple_loss(rr, sh, *example(rr, sh.deletion_noise, cfg.folder.seed, t, ids, s0,
                                                                 state["epoch"]), grad=True)
                (loss / min(sh.grad_accum, n - start)).backward()              # mean over the window's examples
                window.append(st)
            state["pos"] += 1
            bar.update(1)
            if state["pos"] % sh.grad_accum and state["pos"] < n:
                continue
            ranks.sum_grads(params)                     # the window's whole gradient on every rank
            gn = torch.nn.utils.clip_grad_norm_(params, sh.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            rec = ranks.mean_stats(window, geodef.SHIELD_STATS, params[0].device)
            rec.update({"grad_norm": float(gn), "learning_rate": sh.lr, "step": state["step"],
                        "epoch": state["epoch"] + state["pos"] / n})
            bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['rewards/accuracies']:.2f}")
            window = []
            if main:
                append_jsonl(log_path, {"event": "train", **rec})
            if state["step"] % sh.save_every == 0 and state["pos"] < n:           # mid-epoch checkpoints
                rngs = rng_states(ranks)
                if main:
                    _save_ckpt(ckpt, rr.model, opt, state, log_path, rngs)
        state["epoch"] += 1
        state["pos"] = 0
        rngs = rng_states(ranks)
        if main:                                        # monitoring, the best adapter, the epoch's checkpoint
            end_of_epoch(cfg.model.model, rr, opt, state, watch(), adapter_dir, ckpt, log_path, rngs)
    bar.close()
    if not main:                                        # the other ranks only compute their share of each step
        return
    finish_shield(run, rr, folder, adapter_dir, state, math.ceil(n / sh.grad_accum))


def shield_examples(run, rr, extra):
    """The Shield's examples: the construction instances (and `extra`) split for optimisation and monitoring,
    the reranker loaded (rr, else the run's) and the base's scores prepared -> (rr, optimisation triples,
    monitoring triples, monitoring lists with their base scores, token ids, s_0). Under torchrun rank 0
    loads (a tiny checkpoint: makes) the model and scores the base lists first; the others then read its
    files and its score cache."""
    data, ranks = run.data, run.ranks
    cons, inst = data.construction, geodef.expand(data.construction, data.seen) + list(extra)
    opt_inst, mon_inst = run.shield_split(inst)
    if not ranks.is_main:
        ranks.barrier()
    rr = rr or run.reranker()
    rr.model.gradient_checkpointing = run.cfg.shield.grad_checkpointing   # recomputes only under grad: training's
    triples, ids, s0, scores = prepare_triples(run, rr, cons, inst)
    if ranks.is_main:
        ranks.barrier()
    opt_ids = {x.instance_id for x in opt_inst}
    opt_triples = [t for t in triples if t["instance_id"] in opt_ids]
    mon_triples = [t for t in triples if t["instance_id"] not in opt_ids]
    return rr, opt_triples, mon_triples, [(x, scores[x.instance_id]) for x in mon_inst], ids, s0


def end_of_epoch(base, rr, opt, state, m, adapter_dir, ckpt, log_path, rngs):
    """After an epoch (rank 0): its monitoring metrics `m` logged, the adapter (of the `base` model) kept
    when its Eq. 5 loss on the monitoring split is the lowest so far (ties: the higher preference
    accuracy), and the checkpoint with the ranks' generators `rngs`. The adapter goes first: a process
    killed between the two resumes from the checkpoint before, redoes the rest of the epoch (the same
    order and masks) and writes its adapter again."""
    monitored(state, m, log_path)
    keep_if_best(base, rr, state, m, adapter_dir)
    _save_ckpt(ckpt, rr.model, opt, state, log_path, rngs)


def keep_if_best(base, rr, state, m, adapter_dir):
    """rr's adapter written to adapter_dir as the best when the monitoring metrics `m` of state's epoch beat the
    best so far: the lower Eq. 5 loss (ties: the higher preference accuracy)."""
    key = (-m["loss"], m["pref_accuracy"])
    if state["best"] is None or key > tuple(state["best"]["key"]):
        lora.save_adapter(rr.model, adapter_dir, base)
        state["best"] = {"epoch": state["epoch"], "key": list(key), **m}


def attach_lora(run, rr, init=None):
    """LoRA on the frozen reranker (its A initialised and its dropout masks drawn from the seed alone),
    started from the adapter folder `init` when given, with the speed paths -> (trainable params, AdamW).
    Under torchrun every rank initialises the same A; rank r > 0 then draws its masks from a stream of its
    own (seeded by seed and r), not a copy of rank 0's."""
    cfg = run.cfg
    torch.manual_seed(cfg.folder.seed)
    lora.add_lora(rr.model, cfg.shield.lora_r, cfg.shield.lora_alpha, cfg.shield.lora_dropout)
    if run.ranks.rank:                          # (a 63-bit seed from the pair: no overflow, no collision)
        torch.manual_seed(random.Random(f"{cfg.folder.seed}:dropout:{run.ranks.rank}").getrandbits(63))
    if init:
        lora.load_adapter(rr.model, init)
    speed.install(rr.model, compile=cfg.model.compile)     # the LoRA layers get the speed paths too
    params = [p for p in rr.model.parameters() if p.requires_grad]
    # Table A.1 names AdamW and its learning rate, no weight decay: torch's default 0.01 is kept, said here
    # (TRL and transformers' Trainer default to 0.0; over the paper's ~12 steps at 1e-4 the two differ by 1e-5)
    return params, torch.optim.AdamW(params, lr=cfg.shield.lr, weight_decay=0.01)


def start_state(rr, opt, ckpt, log_path, resume, ranks):
    """The loop's state: from the checkpoint when resuming (rank 0 cuts the log to the steps it holds), else
    fresh (rank 0 removes an earlier attempt's log) -> {epoch, pos, step, best, history}."""
    for tmp in glob.glob(os.path.join(ckpt, "state.safetensors.tmp*")) if ranks.is_main else ():
        os.remove(tmp)                          # a write a kill cut short (_save_ckpt renames a whole one)
    if resume and os.path.isfile(os.path.join(ckpt, "state.safetensors")):
        state = _load_ckpt(ckpt, rr.model, opt, ranks.rank)
        log(f"[train] resuming at epoch {state['epoch']} example {state['pos']} (step {state['step']})")
        if ranks.is_main:
            with open(log_path, "a+b") as f:    # steps logged after the checkpoint are redone: drop their lines
                end = f.seek(0, os.SEEK_END)
                f.truncate(min(state.get("log_bytes", end), end))     # (never past its end: no NUL padding)
        return state
    for old in (log_path, os.path.join(ckpt, "state.safetensors")) if ranks.is_main else ():
        if os.path.isfile(old):                 # a fresh start: nothing of an earlier attempt, which a later
            os.remove(old)                      # plain rerun would otherwise resume
    return {"epoch": 0, "pos": 0, "step": 0, "best": None, "history": []}


def finish_shield(run, rr, folder, adapter_dir, state, steps_per_epoch):
    """The best adapter back on the model, its ranking of the test groups against the base's, and
    shield_done.json (what `train` reads to skip a finished Shield)."""
    data = run.data
    lora.load_adapter(rr.model, adapter_dir)
    rr.model.eval()
    # the paper's lists (one attacked document each): the stats follow the source's rewrite alone
    test_stats = shield_test_stats(run, rr, geodef.expand(data.test, data.methods, paper=True), adapter_dir)
    write_json(os.path.join(folder, "shield_done.json"), {"best": state["best"], "history": state["history"],
                                                      "steps": state["step"], "steps_per_epoch": steps_per_epoch,
                                                      "test_ranking": test_stats, "trained_by": trained_by(run, rr)})
    log(f"[train] best adapter (epoch {state['best']['epoch']}): {state['best']}")
    log(f"[train] test groups, base -> shield: {test_stats}")


def trained_by(run, rr):
    """What finished a Shield's training (shield_done.json): the code, torch, the ranks and the dtype; config.json
    is rewritten by every later command."""
    return {"code_version": code_version(), "torch": torch.__version__, "ranks": run.ranks.world,
            "dtype": str(rr.model.embed_tokens.weight.dtype)}


def benign_kept(base_scores, new_scores, x, k):
    """Share of the base top-k's benign documents of instance x (every attacked document left out, co-attacks
    included) that are still in the new top-k (ties by document id, as eval ranks)."""
    ben = [i for i in ranked(base_scores, x.doc_ids)[:k] if i not in x.attacked]
    return len(set(ben) & set(ranked(new_scores, x.doc_ids)[:k])) / max(1, len(ben))


def shield_test_stats(run, rr, insts, adapter_dir=None):
    """On the test instances: where the attack document ranks under the base scorer (LoRA disabled)
    and under the Shield scorer, and how much of the base top-k's benign evidence the Shield keeps."""
    k, base, shield = run.cfg.data.k, base_ranker(run, rr, adapter_off=True), shield_ranker(run, rr, adapter_dir)
    base.prepare(insts)
    shield.prepare(insts)
    rank_b, rank_s, in_b, in_s, overlap = [], [], 0, 0, []
    for x in insts:
        ob, os_ = base.order(x), shield.order(x)
        rank_b.append(ob.index(x.attack_index) + 1)
        rank_s.append(os_.index(x.attack_index) + 1)
        in_b += x.attack_index in ob[:k]
        in_s += x.attack_index in os_[:k]
        overlap.append(benign_kept(base.scores(x), shield.scores(x), x, k))
    n = max(1, len(insts))
    return {"instances": len(insts), "attack_mean_rank_base": sum(rank_b) / n,
            "attack_mean_rank_shield": sum(rank_s) / n,
            "attack_in_topk_base": 100.0 * in_b / n, "attack_in_topk_shield": 100.0 * in_s / n,
            "benign_topk_overlap": 100.0 * sum(overlap) / n}


# ----------------------------------------------------------------------------- TFSG construction


def clean_reference_benign(run, llm, base, groups):
    """b_clean per group: benign documents cited by the clean reference (B.1.3), computed once and
    kept in results/clean_reference_construction.jsonl."""
    cfg = run.cfg
    insts = [geodef.clean_instance(g) for g in groups]
    base.prepare(insts)
    ref = clean_reference(cfg.data.k, base)
    path = os.path.join(cfg.folder.run_dir, "results", "clean_reference_construction.jsonl")
    # no attack in a clean list: the judge is never asked
    recs = eval_condition(cfg.llm, cfg.request.workers, llm, "clean reference (construction)", insts, ref.topk,
                          ref.pipeline, path, judge=llm)
    return clean_answers(recs)         # (a group whose clean answer failed has no b_clean: None in its cases)


def tfsg_target(target, workers, desc):
    """The target LLM as TFSG's answer_many (tfsg.build_library, update_library): one stage, concurrent or
    one batch with --batch-api. A reply that never parsed as JSON (ReplyInvalid: a document may ask for
    prose, or a reasoning model spend the token cap) is None, its case 'invalid' and left out of the
    Analyzer's input and the statistics, and logged: raised, it stopped the whole build; read as an empty
    answer, it taught the Analyzer an over-defense that never happened."""
    def answer_many(requests):
        replies = target.map(requests, workers=workers, desc=desc, invalid="return")
        bad = sum(isinstance(r, ReplyInvalid) for r in replies)
        if bad:
            log(f"[tfsg] {desc}: {bad} of {len(replies)} requests gave no usable reply (never parsed as JSON, or "
                "refused by the server): their cases left out")
        return [None if isinstance(r, ReplyInvalid) else r for r in replies]
    return answer_many


def train_tfsg(run):
    """Algorithm 1: E0 -> E4 on the construction instances (A.2.2), with the Shield (or base) top-k."""
    cfg = run.cfg
    if os.path.isfile(run.library_path()):
        log(f"[train] TFSG library already built: {run.dir}/library")
        return
    data = run.data
    cons, inst = data.construction, geodef.expand(data.construction, data.seen)
    seeds, batches = run.tfsg_schedule(inst)
    base, shield = load_rankers(run, cfg.tfsg.shield)
    ranker = shield or base
    ranker.prepare(inst)
    target = run.llm(stage="train")
    analyzer = run.llm(cfg.tfsg.analyzer, stage="train") if cfg.tfsg.analyzer else target
    clean = clean_reference_benign(run, target, base, cons)

    def case_input(x, force_attack=False):
        top = ranker.order(x)[:cfg.data.k]
        if force_attack and x.attack_index not in top:      # controlled contrast: the attack in context
            top = top[:-1] + [x.attack_index]
        return {"case_id": f"case-{hashlib.sha1(x.instance_id.encode()).hexdigest()[:8]}", "query": x.query,
                "docs": [x.docs[i] for i in top], "labels": labels_of(x, top),
                "b_clean": clean[x.group_id]["benign_cited"] if x.group_id in clean else None}

    seed_inputs = [case_input(x, force_attack=True) for x in seeds]
    batch_inputs = [[case_input(x) for x in b] for b in batches]
    interface = "reasoning" if cfg.tfsg.reasoning_interface else "structured"

    answer_many = tfsg_target(target, cfg.request.workers, "TFSG target")
    lib = tfsg.build_library(answer_many, analyzer.chat, seed_inputs, batch_inputs, os.path.join(run.dir, "library"),
                             answer_prompt=tfsg.standard_prompt, interface=interface,
                             max_initial_rules=cfg.tfsg.max_initial_rules, temperature=cfg.llm.temperature,
                             controller=tfsg.Controller(limits=run.limits), max_tokens=cfg.llm.max_tokens)
    for c in dict.fromkeys((target, analyzer)):
        log(f"[train] this invocation, {c.label}: {c.stats['calls']} calls, {c.stats['http_calls']} sent, "
            f"{c.stats['cache_hits']} from the cache (the run's cost: usage.jsonl, summed in summary.json)")
    log(f"[train] TFSG library E{cfg.tfsg.n_batches + 1}: {len(lib.active())} active rules ({len(lib.rules)} total)")


def analyzer_prompt_chars(run):
    """An Analyzer call's prompt at most, in characters: a batch's cases, each its top-k documents as the
    Analyzer sees them, its answers and the instructions (A.3.4)."""
    cfg = run.cfg
    return cfg.tfsg.batch_size * (cfg.data.k * cfg.limits.analyzer_doc_chars + 1500) + 6000


def plan_train(run, stage="all"):
    """train --dry-run: what training would send, and nothing sent. The Shield sends nothing (its
    optimizer steps are given); TFSG (A.2.2): the clean reference of each construction group, four
    controlled rollouts per seed case, one cold-start Analyzer call, and per update batch one answer
    per case and one Analyzer call. A finished library, or --stage shield, costs nothing."""
    cfg, data = run.cfg, run.data
    inst = geodef.expand(data.construction, data.seen)
    opt, _ = run.shield_split(inst) if stage != "tfsg" else ([], [])
    seeds, batches = run.tfsg_schedule(inst) if stage != "shield" else ([], [])
    built = os.path.isfile(run.library_path())
    done = built or stage == "shield"
    ctx = sum(sum(map(len, x.docs[:cfg.data.k])) for x in inst) / max(1, len(inst))
    answers = 0 if done else len(data.construction) + 4 * len(seeds) + sum(map(len, batches))
    analyzer = 0 if done else 1 + len(batches)
    stages = {"target answers": estimate(answers, ctx + 2500, 400),
              "Analyzer": estimate(analyzer, analyzer_prompt_chars(run), 1500)}
    target, analyst = cfg.llm.llm, cfg.tfsg.analyzer or cfg.llm.llm
    return {"shield_optimizer_steps": cfg.shield.optimizer_steps(len(opt)), "tfsg_library_built": built,
            "stages": stages,
            "usd_at_most": price_plan(run.prices, stages, lambda s: target if s == "target answers" else analyst),
            # the rollouts through a batch API; the Analyzer's calls stay synchronous (each needs the last)
            "usd_at_most_batch_api": _sum_or_none(
                price_plan(run.prices, {"target answers": stages["target answers"]}, lambda s: target, batch=True),
                price_plan(run.prices, {"Analyzer": stages["Analyzer"]}, lambda s: analyst)),
            "note": "estimates: prompt tokens at 4 characters a token; cached replies cost nothing"}


def _sum_or_none(*xs):
    return None if any(x is None for x in xs) else sum(xs)
