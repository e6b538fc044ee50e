"""bench --against: the CPU inference engines a provider would pick (ONNX Runtime, OpenVINO, torch's dynamic
int8), each on this project's seq-cls export in a process of its own, raced round-robin with our scorer and
our int8 path (bench.race). Method and figures: docs/PERF.md.

Usage: python run.py bench --what score --layers 4 --against onnxruntime,openvino,ours-int8
"""
import functools
import json
import multiprocessing as mp
import os

import torch
import torch.nn as nn

import bench          # its race, workloads and fresh processes (bench imports this module for --against)
import metrics
import speed


# What each engine needs installed (test-only dependencies): the ONNX graph is written by torch.onnx from
# transformers' Qwen3ForSequenceClassification, which ONNX Runtime and OpenVINO read.
ENGINE_MODULES = {"onnxruntime": ("transformers", "onnx", "onnxruntime"),
                  "onnxruntime-int8": ("transformers", "onnx", "onnxruntime"),
                  "openvino": ("transformers", "onnx", "openvino"), "torch-int8": ("transformers",), "ours-int8": ()}


def seq_cls_model(seqcls, attn="sdpa"):
    """transformers' Qwen3ForSequenceClassification of the seq-cls export, float32, no cache; attention as
    transformers runs it by default (SDPA), or eager where the ONNX export needs it."""
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        seqcls, dtype=torch.float32, attn_implementation=attn).eval()
    model.config.use_cache = False
    return model


def seq_cls_onnx(seqcls):
    """The seq-cls export as ONNX (torch.onnx's TorchScript exporter, opset 17, dynamic batch and length),
    written once beside the export (its model loaded only then) -> its path."""
    path = os.path.join(seqcls, "model.onnx")
    if not os.path.isfile(path):        # written under another name first: a killed export leaves no model.onnx
        ids = torch.zeros((2, 8), dtype=torch.long)
        torch.onnx.export(seq_cls_model(seqcls, attn="eager"), (ids, torch.ones_like(ids)), path + ".tmp",
                          input_names=["input_ids", "attention_mask"], output_names=["logits"], opset_version=17,
                          dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "length"} for n in ("input_ids", "attention_mask")})
        os.replace(path + ".tmp", path)
    return path


def engine_files(folder, engines):
    """The files `engines` read, written once beside `folder`: export.py's seq-cls export (float32), its ONNX
    graph (seq_cls_onnx) and ONNX Runtime's dynamic-int8 graph of it -> (seq-cls folder, {"float" | "int8":
    ONNX path})."""
    import export
    seqcls = folder.rstrip("/") + "_seqcls"
    if not os.path.isfile(os.path.join(seqcls, "model.safetensors")):
        export.export(folder, seqcls, fmt="seq-cls", dtype="float32")
    graphs = {}
    if {"onnxruntime", "openvino", "onnxruntime-int8"} & set(engines):
        graphs["float"] = seq_cls_onnx(seqcls)
    if "onnxruntime-int8" in engines:         # its dynamic quantization as its docs give it
        from onnxruntime.quantization import QuantType, quantize_dynamic
        graphs["int8"] = os.path.join(seqcls, "model.int8.onnx")
        if not os.path.isfile(graphs["int8"]):
            quantize_dynamic(graphs["float"], graphs["int8"] + ".tmp", weight_type=QuantType.QInt8)
            os.replace(graphs["int8"] + ".tmp", graphs["int8"])
    return seqcls, graphs


def engine_scorers(folder, engines, dtype="float32"):
    """Each engine of `engines` over the checkpoint as a user deploys it, export.py's seq-cls export (engine_files)
    -> {engine: fn(ids (B, T), mask (B, T)) -> (B,) float32 margins}: ONNX Runtime (float32: its CPU provider
    has no bf16 GEMMs on x86) and OpenVINO (in `dtype`, ours) on its ONNX graph, onnxruntime-int8 on that
    graph under ONNX Runtime's dynamic quantization (int8 weights, activations quantized per tensor at run
    time), torch-int8 transformers' model under torch's dynamic int8 quantization of every nn.Linear
    (per-tensor activation scales, fbgemm or onednn kernels)."""
    seqcls, graphs = engine_files(folder, engines)
    feeds = lambda ids, mask: {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}

    def ort(path):
        import onnxruntime
        # torch's thread count, and no spinning between calls (it takes the CPU from the contender run next)
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = onnxruntime.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        return lambda ids, mask: torch.from_numpy(sess.run(None, feeds(ids, mask))[0][:, 0])
    out = {}
    if "onnxruntime" in engines:
        out["onnxruntime"] = ort(graphs["float"])
    if "onnxruntime-int8" in engines:
        out["onnxruntime-int8"] = ort(graphs["int8"])
    if "openvino" in engines:
        import openvino
        # OpenVINO's CPU plugin runs bf16 by default where the CPU has bf16 units: the precision is set
        # to ours, so that a float32 race is float32 (INFERENCE_PRECISION_HINT, OpenVINO's CPU device docs)
        hint = {"INFERENCE_PRECISION_HINT": {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype],
                "INFERENCE_NUM_THREADS": torch.get_num_threads()}
        compiled = openvino.Core().compile_model(graphs["float"], "CPU", hint)
        got = compiled.get_property("INFERENCE_PRECISION_HINT")      # a CPU without the units falls back
        if got != getattr(openvino.Type, hint["INFERENCE_PRECISION_HINT"]):
            raise RuntimeError(f"bench: openvino: {dtype} asked, {got} compiled on this CPU")
        out["openvino"] = lambda ids, mask: torch.from_numpy(compiled(feeds(ids, mask))[0][:, 0])
    if "torch-int8" in engines:
        q = torch.ao.quantization.quantize_dynamic(seq_cls_model(seqcls), {nn.Linear}, dtype=torch.qint8)

        def int8(ids, mask):
            with torch.inference_mode():
                return q(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        out["torch-int8"] = int8
    return out


class EngineProcess:
    """One engine of engine_scorers in a process of its own (spawn): its weights, sessions and what its build
    leaves behind live and die apart from ours, and an engine that runs out of memory ends alone. load(ids)
    gives it a workload (-> its margins, one left-padded call); then each call(per_doc) scores it again, one
    padded batch or one call a document, as the race times it."""

    def __init__(self, folder, engine, dtype="float32"):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.engine = engine
        self.proc = ctx.Process(target=_engine_child, args=(folder, engine, dtype, child), daemon=True)
        self.proc.start()
        child.close()
        self._ask(None)                                   # its scorer built

    def _ask(self, msg):
        if msg is not None:
            self.conn.send(msg)
        try:
            kind, out = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(f"bench: the {self.engine} process ended (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"bench: {self.engine}: {out}")
        return out

    def load(self, ids):
        return self._ask(("load", ids))

    def call(self, per_doc=False):
        return self._ask(("per_doc" if per_doc else "batch", None))

    def close(self):
        """Stops the process (ended already: nothing to say); one that does not stop within a minute is killed."""
        try:
            self.conn.send(("stop", None))
        except OSError:
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _engine_child(folder, engine, dtype, conn):
    """EngineProcess's process: builds the engine's scorer (its export written by the parent first), then
    answers each message until "stop"."""
    speed.reuse_freed_memory()   # entry point of this fresh (spawned) process: malloc as in run.py's __main__
    try:
        fn = engine_scorers(folder, [engine], dtype)[engine]
        with open(folder.rstrip("/") + "_seqcls/config.json", encoding="utf-8") as f:
            pad_id = json.load(f).get("pad_token_id", 151643)
        conn.send(("ok", None))
    except Exception as e:                                # said to the parent, which names the engine
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    ids = None
    while True:
        kind, arg = conn.recv()
        if kind == "stop":
            return
        try:
            if kind == "load":
                ids = arg
            if kind == "per_doc":
                out = [fn(*bench.left_padded([x], pad_id)) for x in ids]
            else:
                out = fn(*bench.left_padded(ids, pad_id)).float()
            conn.send(("ok", out if kind == "load" else None))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def float32_margins(folder, rr, inputs):
    """{workload: our float32 margins on its ids}: the reference every contender's margins and ranks are read
    against (the float model, not our rounding in the race's dtype). A float32 copy is loaded for it when the
    race runs in another dtype, and dropped before the race."""
    ref = rr if rr.model.embed_tokens.weight.dtype == torch.float32 else bench.load_ours(folder, dtype=torch.float32)
    out = {name: ref.score_ids(ids).float() for name, ids in inputs.items()}
    del ref
    return out


def engine_race(m, b, folder, rr, work, results, rc=None):
    """--against: each engine on the workloads in a process of its own (EngineProcess), padded as its users
    batch (one left-padded call) and one call per document, and ours in int8 (speed.quantize_int8, packed as
    ours), raced round-robin with our scorer (and `rc`, our compiled scorer, where bench compiles) -> results
    gains, per workload and engine, documents per second, our speed over the engine's (paired median: above 1,
    ours is faster; with ours-int8 or ours_compiled, its speed over each engine of its precision too), the
    largest margin difference from our float32 margins and the rank agreement with them (the workload's
    documents as one list: Kendall tau-b, top-5 agreement); in a bf16 race, ours in bf16 against them too."""
    inputs = {name: bench.random_ids(lens, prefix=b.prefix) for name, lens in work.items()}
    reference = float32_margins(folder, rr, inputs)
    engines = [e for e in b.against if e != "ours-int8"]
    if engines:                                       # the exports, written once in a process that then ends
        bench.in_fresh_process(_export_child, folder, engines)
    procs = {}
    try:
        for e in engines:
            procs[e] = EngineProcess(folder, e, m.dtype)
        q8 = None
        if "ours-int8" in b.against:                  # compiled where bench compiles (--compile), as rc is
            q8 = bench.load_ours(folder, dtype=rr.model.embed_tokens.weight.dtype, compile=m.compile)
            speed.quantize_int8(q8.model)
        for name, lens in work.items():
            ids, ours = inputs[name], reference[name]
            cands = {"ours": lambda: rr.score_ids(ids)}
            if rc is not None:
                cands["ours_compiled"] = lambda: rc.score_ids(ids)
            scored = {e: p.load(ids) for e, p in procs.items()}
            for e, p in procs.items():
                cands[e] = p.call
                cands[f"{e}_per_doc"] = functools.partial(p.call, per_doc=True)
            if q8 is not None:
                cands["ours-int8"] = lambda: q8.score_ids(ids)
                scored["ours-int8"] = q8.score_ids(ids)
            if rr.model.embed_tokens.weight.dtype != torch.float32:     # ours in the race's dtype, against float32
                scored["ours"] = rr.score_ids(ids)
            for e, s in scored.items():
                results[f"{name}/{e}_max_margin_diff"] = float((s.float() - ours).abs().max())
                agree = metrics.rank_agreement([ours.tolist()], [s.float().tolist()], 5)
                results[f"{name}/{e}_kendall_tau"], results[f"{name}/{e}_top5_agreement"] = \
                    agree["kendall_tau"], agree["top5_agreement"]
            rounds = []
            for k, t in bench.race(cands, b.repeat, rounds, bench.progress(name, len(lens), b.repeat)).items():
                if k in ("ours", "ours_compiled"):           # their figures: the main race's
                    continue
                results[f"{name}/{k}_docs_per_s"] = len(lens) / t
                results[f"{name}/ours_vs_{k}_paired_median"] = bench.paired_ratio(rounds, k)
                if q8 is not None and "int8" in k and k != "ours-int8":        # int8 against int8, paired
                    results[f"{name}/ours-int8_vs_{k}_paired_median"] = bench.paired_ratio(rounds, k, "ours-int8")
                if rc is not None and "int8" not in k:                         # compiled against float, paired
                    results[f"{name}/ours_compiled_vs_{k}_paired_median"] = bench.paired_ratio(rounds, k,
                                                                                               "ours_compiled")
    finally:
        for p in procs.values():
            p.close()
    return results


def _export_child(folder, engines, q):
    """engine_files in a fresh process, whose memory (the exporter's) goes with it."""
    engine_files(folder, engines)
    q.put(None)
