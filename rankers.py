"""Rankings of candidate lists: the protocol every ranker follows (prepare a batch of instances, then
scores and order of each), the in-process base and Shield rankers over one loaded Qwen3-Reranker (under
--quant int8, two, scored in int8),
rerank endpoints (Cohere, Jina, Voyage, vLLM- or TEI-shaped) through rerank_clients, and the
--reranker specs that name them.

Usage: base, shield = load_rankers(run, shield=True); base.prepare(insts); base.order(insts[0])[:5]
"""
import contextlib
import hashlib
import json
import os
import re
import sys

from tqdm import tqdm

import endpoints
import geodef
import lora
import metrics
import rerank_clients
import speed
from settings import SAMPLE, SettingsError
from store import file_sha1, log, write_json


def doc_key(query, doc):
    return hashlib.sha1((query + "\x00" + doc).encode("utf-8")).hexdigest()


class ScoreCacheError(SettingsError):
    """A score cache or share file that cannot be read as one, or made by another ranker, benchmark or
    rank layout: never merged; one line naming the file."""


KEY = re.compile(r"[0-9a-f]{40}")                 # doc_key's SHA-1


def read_scores(path, made_from=None):
    """A score file -> {doc_key: finite float}, {} if it is absent. The cache (made_from None) is the bare
    object {key: score}, as it always was: the run folder's config.json pins what its scores depend on and
    a Shield cache's name carries its adapter's digest. A share file (<cache>.rank<r>; made_from: the
    Ranker's) is {"made_from": {**made_from, "rank": r, "world": N}, "scores": {key: score}}: it outlives
    the run that wrote it, so it must say it was made by this ranker on this benchmark, as rank r of a
    layout that has one. Anything else (corrupted, stale, hand-made) is ScoreCacheError."""
    refused = lambda why: ScoreCacheError(f"{path}: {why}; remove it (its documents are scored again)")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError) as e:      # UnicodeDecodeError is a ValueError
        raise refused(f"not JSON ({'nested too deeply' if isinstance(e, RecursionError) else e})") from None
    if made_from is not None:
        got = obj.get("made_from") if isinstance(obj, dict) and set(obj) == {"made_from", "scores"} else None
        if not isinstance(got, dict):
            raise refused("not a share file {made_from, scores} (hand-made, or left by an older version)")
        want = {**made_from, "rank": int(path.rsplit(".rank", 1)[1]), "world": got.get("world")}
        if got != want or not (isinstance(want["world"], int) and want["world"] > max(1, want["rank"])):
            raise refused("made with " + (", ".join(f"{k}={got.get(k)!r} (this run: {want.get(k)!r})"
                                                    for k in {**got, **want} if got.get(k) != want.get(k))
                                          or f"world={want['world']!r}, which holds no rank {want['rank']}"))
        obj = obj["scores"]
    if not isinstance(obj, dict):
        raise refused(f"the scores must be a JSON object {{doc key: score}}, got {type(obj).__name__}")
    for k, v in obj.items():
        if not (KEY.fullmatch(k) and type(v) in (int, float) and abs(v) <= sys.float_info.max):  # NaN, inf: False
            raise refused(f"{k[:48]!r}: {str(v)[:40]}: not a 40-hex document key with a finite score")
    return {k: float(v) for k, v in obj.items()}


class Ranker:
    """Top-k by a reranker, scoring each distinct (query, document) once: the nine benign documents
    are shared by a group's seven attack variants and its clean list. Margins cached on disk (read_scores).
    made_from: what the scores are made from (ranker_identity), which its share files record; chunk: documents
    a call to the reranker scores (it packs them into micro-batches of its token budget)."""

    def __init__(self, rr, path, label, adapter_off=False, made_from=None, chunk=16):
        self.rr, self.path, self.label, self.chunk = rr, path, label, chunk
        self.adapter_off = adapter_off      # the frozen base policy from a model that carries the adapter
        self.made_from = made_from or {}
        self.cache = read_scores(path)

    def prepare(self, instances):
        """Score every (query, document) of `instances` not in the cache; the cache written after each query."""
        self.score(self.missing(instances), lambda new: write_json(self.path, self.cache))

    def missing(self, instances, share=None):
        """{query: {doc_key: document}} of `instances` not in the cache, queries in their first order.
        share (rank, world): only the queries of that rank, round robin over every query of `instances` in
        a fixed (sorted) order, whatever is cached: whole queries, so each document is scored in the batch
        one process would score it in, the same floats."""
        todo = {}
        for x in instances:
            for d in x.docs:
                todo.setdefault(x.query, {})[doc_key(x.query, d)] = d
        if share is not None:
            rank, world = share
            todo = {q: todo[q] for q in sorted(todo)[rank::world]}
        todo = {q: {k: d for k, d in kd.items() if k not in self.cache} for q, kd in todo.items()}
        return {q: kd for q, kd in todo.items() if kd}

    def score(self, todo, save):
        """Score `todo` ({query: {key: document}}) `chunk` documents a call into the cache, calling save(new)
        after each query with every score this call has made."""
        new = {}
        bar = tqdm(total=sum(map(len, todo.values())), desc=f"rerank ({self.label})", file=sys.stderr,
                   disable=not todo)
        with (lora.lora_disabled(self.rr.model) if self.adapter_off else contextlib.nullcontext()):
            for q, kd in todo.items():
                keys = list(kd)
                for i in range(0, len(keys), self.chunk):
                    chunk = keys[i:i + self.chunk]
                    for k, v in zip(chunk, self.rr.score(q, [kd[k] for k in chunk])):
                        self.cache[k] = new[k] = float(v)
                    bar.update(len(chunk))
                save(new)
        bar.close()
        return new

    def scores(self, x):
        return [self.cache[doc_key(x.query, d)] for d in x.docs]

    def order(self, x):
        return metrics.ranked(self.scores(x), x.doc_ids)


def share_files(path):
    """The ranks' share files of the cache `path` (a multi-rank scoring's; none once it has ended)."""
    folder, base = os.path.split(path)
    share = re.compile(re.escape(base) + r"\.rank\d+")        # not atomic_write's temporary files
    return sorted(os.path.join(folder, f) for f in (os.listdir(folder) if os.path.isdir(folder) else ())
                  if share.fullmatch(f))


def sharded(ranks, ranker, instances):
    """ranker.prepare(instances) across torchrun's ranks (parallel.Ranks): each rank scores the queries of
    its share (Ranker.missing), keeping them in a share file of its own (<cache>.rank<r>, which only grows)
    as it goes; every rank then holds all the scores, rank 0 writes the cache and removes the share files.
    A killed multi-rank run's share files are read first, by a rerun on any number of ranks (one included),
    so it scores only what no rank had scored; each is checked whole (read_scores) before any is merged.
    One rank alone: a plain prepare, after those shares."""
    shares = {part: read_scores(part, ranker.made_from) for part in share_files(ranker.path)}
    for scores in shares.values():
        ranker.cache.update(scores)
    if ranks.world == 1:
        ranker.prepare(instances)
    else:
        mine = f"{ranker.path}.rank{ranks.rank}"
        made_from = {**ranker.made_from, "rank": ranks.rank, "world": ranks.world}
        kept = shares.get(mine, {})
        new = ranker.score(ranker.missing(instances, (ranks.rank, ranks.world)),
                           lambda new: write_json(mine, {"made_from": made_from, "scores": {**kept, **new}}))
        ranker.cache.update(ranks.gather(new))
    if ranks.is_main and (ranks.world > 1 or shares):         # every rank's scores in the cache: shares go
        write_json(ranker.path, ranker.cache)
        for part in share_files(ranker.path):
            os.remove(part)
    ranks.barrier()                # no rank starts another sharded scoring of this cache before the shares go


def load_rankers(run, shield, adapter=None, base=True):
    """(base, shield or None) Rankers. In float (or NF4) over one loaded model: with the trained adapter
    attached, the base scores come from the same weights with the adapter disabled (pi_0). Under --quant
    int8 each is its own model, scored in int8 (the Shield's adapter merged first) once it passes the gate
    (as_scored), and the base is loaded only when asked (base=False: None). adapter: another adapter folder
    than the run's (a hardening round's)."""
    if run.cfg.model.quant == "int8":
        return (base_ranker(run, as_scored(run, run.reranker())) if base else None,
                shield_ranker(run, as_scored(run, run.shield(adapter=adapter)), adapter) if shield else None)
    rr = run.shield(adapter=adapter) if shield else run.reranker()
    return base_ranker(run, rr, adapter_off=shield), shield_ranker(run, rr, adapter) if shield else None


def ranker_identity(run, rr, adapter=None):
    """What a local ranker's scores are made from, as its share files record it: what the run folder's
    config.json pins for them (model, dtype, NF4, max length, the benchmark's content: None for
    build-bench, which scores before its benchmark exists; the hub revision as resolved), and the SHA-1
    of the Shield adapter's weights (None: the base policy)."""
    cfg = run.cfg
    bench = cfg.setting("bench")
    quant = "int8" if in_int8(rr) else "none" if cfg.model.quant == "int8" else cfg.model.quant   # as scored
    return {"model": cfg.model.model, "revision": rr.revision, "dtype": cfg.model.dtype, "quant": quant,
            "max_length": rr.max_length, "bench_sha1": bench and file_sha1(bench), "adapter_sha1": None
            if adapter is None else file_sha1(os.path.join(adapter, "adapter_model.safetensors"))}


def base_ranker(run, rr, adapter_off=False):
    """The frozen base reranker's Ranker, its scores cached in cache/scores_base.json, or scores_base_int8.json
    scored in int8 (adapter_off: the model carries the Shield adapter, disabled for these scores)."""
    return Ranker(rr, run.path("cache", f"scores_base{'_int8' * in_int8(rr)}.json"), "base", adapter_off=adapter_off,
                  made_from=ranker_identity(run, rr))


def unrecorded_base_ranker(run):
    """The base reranker's Ranker for a command whose run folder records no settings (build-bench): its cache
    file named by a digest of what its scores are made from (ranker_identity), so that neither another model
    or length on a rerun nor a later train or eval of that name (whose config.json pins scores_base.json)
    reads scores made otherwise."""
    rr = as_scored(run, run.reranker())
    made = ranker_identity(run, rr)
    digest = hashlib.sha1(json.dumps(made, sort_keys=True).encode()).hexdigest()[:12]
    return Ranker(rr, run.path("cache", f"scores_base_{digest}.json"), "base", made_from=made)


def shield_ranker(run, rr, adapter=None):
    """The Shield's Ranker (rr with the run's adapter, or `adapter`), its scores cached per adapter and
    precision (Run.shield_scores_path)."""
    return Ranker(rr, run.shield_scores_path(adapter, in_int8(rr)), "shield",
                  made_from=ranker_identity(run, rr, adapter or run.path("adapter")))


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


LOCAL = ("base", "shield")


def parse_rerankers(items):
    """["LABEL=SPEC" or "SPEC", ...] -> [(label, RerankSpec)] (endpoints.parse_rerankers), a bad one
    refused naming --reranker."""
    try:
        return endpoints.parse_rerankers(items)
    except ValueError as e:
        raise SettingsError(f"--reranker {e}") from None


def check_specs(items):
    """Every endpoint's key present, and RERANK_API_KEY (one endpoint's key) bound for one host, before anything
    runs: -> the same items."""
    for label, spec in items:
        if spec.kind not in LOCAL:
            try:
                rerank_clients.make_reranker(spec)
            except ValueError as e:
                raise SettingsError(f"--reranker {label}={spec}: {e}") from None
    hosts = sorted({"this machine" if endpoints.LOOPBACK_NAMES.fullmatch(s.endpoint.host) else s.endpoint.host
                    for _, s in items if s.kind not in LOCAL and s.kind not in endpoints.RERANK_PROVIDERS
                    and not s.endpoint.basic})          # (two ports of one host, or of this machine: one key)
    if os.environ.get(rerank_clients.RERANK_KEY_VAR) and len(hosts) > 1:
        raise SettingsError(f"{rerank_clients.RERANK_KEY_VAR} would go to every self-hosted endpoint "
                            f"({', '.join(hosts)}): give each its credentials in its URL "
                            "(http://user:password@host/...), or measure them in separate commands")
    return items


class RemoteRanker:
    """A rerank endpoint as a Ranker (prepare / scores / order): one request per candidate list
    (the ten candidates ranked together), `workers` at a time, every reply cached on disk."""

    def __init__(self, client, label, workers=8):
        self.client, self.label, self.workers = client, label, workers
        self.by_id = {}

    def prepare(self, instances):
        """One request per list not yet scored (an endpoint scales on its own side: never sharded)."""
        todo = [x for x in instances if x.instance_id not in self.by_id]
        hits = self.client.stats["cache_hits"]
        for x, r in zip(todo, self.client.map([(x.query, x.docs) for x in todo], workers=self.workers)):
            self.by_id[x.instance_id] = r.scores
        log(f"[rerank] {self.label}: {len(todo)} candidate lists ({self.client.stats['cache_hits'] - hits} from the "
            "cache)")

    def scores(self, x):
        return self.by_id[x.instance_id]

    def order(self, x):
        return metrics.ranked(self.scores(x), x.doc_ids)


def make_rankers(run, items, stage):
    """[(label, spec)] -> {label: Ranker}. base and shield as load_rankers makes them; endpoints go through
    RerankClient with the run's cache (cache/rerank) and usage ledger."""
    cfg, local = run.cfg, {spec.kind for _, spec in items if spec.kind in LOCAL}
    loaded = dict(zip(LOCAL, load_rankers(run, "shield" in local, base="base" in local))) if local else {}
    out = {}
    for label, spec in items:
        if spec.kind in LOCAL:
            out[label] = loaded[spec.kind]
        else:
            client = rerank_clients.make_reranker(spec, cache_dir=run.path("cache", "rerank"),
                                                  ledger=run.path("usage.jsonl"), stage=stage, rpm=cfg.request.rpm,
                                                  **({"timeout": cfg.request.timeout} if cfg.request.timeout else {}))
            out[label] = RemoteRanker(client, label, cfg.request.workers)
    return out


# ----------------------------------------------------------------------------- INT8 gate

# An INT8 Shield serves only when it ranks as the float one does on real candidate lists: the mean Kendall
# tau-b over the lists and the mean share of the float top 5 it keeps (metrics.rank_agreement).
INT8_GATE = {"kendall_tau": 0.97, "top5_agreement": 0.95}
GATE_LISTS = 32                   # candidate lists scored twice: each group's clean list, then its attacked ones


def gate_lists(bench, n=GATE_LISTS):
    """The first n candidate lists of a benchmark file (None: the bundled sample; build-bench gates before its
    file exists) -> [(query, docs)]: the test groups' first (their clean list, then each family's attacked
    one), then the construction groups'. A named file that is not there is an error: gated on the sample
    instead, the figures would read as the run's."""
    if bench and not os.path.isfile(bench):
        raise SettingsError(f"{bench}: the benchmark the INT8 gate measures on is not there (a path recorded "
                            "relative to where the run was trained: run from that folder)")
    groups, meta = geodef.load_bench(bench or SAMPLE, with_meta=True)
    lists = []
    for g in sorted(groups, key=lambda g: g.split != "test"):
        x = geodef.clean_instance(g)
        lists += [(x.query, x.docs)] + [(y.query, y.docs) for y in geodef.expand([g], meta.methods)]
    return lists[:n]


def in_int8(rr):
    """Whether rr scores in int8 (lora.quantize_int8 swapped its projections)."""
    return any(isinstance(m, lora.Int8Linear) for m in rr.model.modules())


def as_scored(run, rr):
    """rr as the run scores: with --quant int8 in int8 once its ranks on the run's own lists (gate_lists of its
    benchmark) pass the gate (int8_gated), else as it is."""
    if run.cfg.model.quant == "int8" and not in_int8(rr):
        int8_gated(rr, gate_lists(run.cfg.setting("bench")))
    return rr


def int8_gated(rr, lists, allow=False):
    """rr scored in int8 from now on (speed.quantize_int8: this CPU's int8 units, in place) after its rank
    agreement with its float scores on `lists` ([(query, docs)]) is measured and logged -> the figures. Below
    INT8_GATE a SettingsError names the figures and the flag that serves it anyway, unless `allow`."""
    before = [rr.score(q, d).tolist() for q, d in lists]
    speed.quantize_int8(rr.model)
    after = [rr.score(q, d).tolist() for q, d in lists]
    fig, gate = metrics.rank_agreement(before, after, 5), INT8_GATE
    said = (f"Kendall tau {fig['kendall_tau']:.3f} (gate {gate['kendall_tau']}), top-5 agreement "
            f"{fig['top5_agreement']:.3f} (gate {gate['top5_agreement']}), order identical in "
            f"{100 * fig['same_order']:.0f}% of {fig['lists']} lists")
    if all(fig[k] >= v for k, v in gate.items()):
        log(f"[int8] rank agreement with the float model: {said}")
    elif allow:
        log(f"[int8] WARNING: below the gate, scored in int8 as --allow-int8-disagreement asks: {said}")
    else:
        raise SettingsError(f"--quant int8: its ranks agree with the float model's below the gate: {said}; score "
                            "with the float model (a run with --quant none), or, to serve or export it, give "
                            "--allow-int8-disagreement")
    return fig
