"""bench.py: the GEMM / matmul floors replay exactly the scorer's matrix work; bench_engines.py: the CPU
engines score as we do, in a process of their own too.
Run: python -m pytest -q test_bench.py
"""
import json
import queue
import random
import shutil
import types

import pytest
import torch

import bench
import bench_engines
import lora
import reranker
import speed
from testing import fast


def test_gemm_floor_replays_the_scorers_projection_gemms(tiny_dir):
    """`bench`'s zero-overhead floor (bench.gemm_floor) runs exactly the frozen projections' GEMMs of one
    scoring call: per micro-batch, every layer's seven on all N rows, except the last layer's q, o and
    MLP on the S final tokens only; the same with LoRA added (its base weights, not A and B), where
    every input but layer 0's q/k/v one (the frozen embedding, normed) needs its gradient. The
    training step's matmul floor adds one LoRA call per projection and the packed attentions."""
    rr = fast(reranker.Reranker.from_pretrained(tiny_dir, dtype=torch.float32, token_budget=64))
    rng = random.Random(0)
    ids = [[5 + j] + [rng.randrange(100, 700) for _ in range(L - 1)] for j, L in enumerate([30, 20, 10, 40])]

    def expected():
        out = []
        for N, S in [(40, 1), (60, 3)]:                 # budget 64: [40], then [30, 20, 10] (no common prefix)
            for i, layer in enumerate(rr.model.layers):
                a, m = layer.self_attn, layer.mlp
                n = S if i == len(rr.model.layers) - 1 else N
                out += [(a.q_proj, n), (a.k_proj, N), (a.v_proj, N), (a.o_proj, n),
                        (m.gate_proj, n), (m.up_proj, n), (m.down_proj, n)]
        return [(getattr(p, "base", p).weight, n) for p, n in out]

    for with_lora in (False, True):
        if with_lora:
            lora.add_lora(rr.model)
            speed.install(rr.model)
            rr.model.train()
        floor = bench.gemm_floor(rr, ids, grad=with_lora)
        got, want = floor.gemms, expected()
        assert [n for _, n, _ in got] == [n for _, n in want]
        assert all(w is v for (w, _, _), (v, _) in zip(got, want))
        per_batch = 7 * len(rr.model.layers)
        needs = [i % per_batch >= 3 for i in range(len(got))] if with_lora else [False] * len(got)
        assert [d for _, _, d in got] == needs
        floor()
    # the training floor with LoRA's matmuls and the attention (bench.matmul_floor): one LoRA call per
    # projection GEMM (same rows, same dx needs), one packed attention per layer but the last
    full = bench.matmul_floor(rr, ids)
    assert [(m.base.weight, n, d) for m, n, d in full.loras] == [(w, n, d) for w, n, d in got]
    cfg = rr.model.cfg
    assert full.attentions == [(N, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, lens, 0)
                               for N, lens in [(40, [40]), (60, [30, 20, 10])]
                               for _ in range(len(rr.model.layers) - 1)]
    full()
    assert set(full.parts) == {"gemm", "lora", "attention"}
    # exact causal attention FLOPs: 14 H E per visible (query, key) pair, T(T+1)/2 pairs per sequence
    pairs = sum(T * (T + 1) // 2 for T in (40, 30, 20, 10)) * (len(rr.model.layers) - 1)
    assert bench.attention_flops(full.attentions) == 14 * cfg.num_attention_heads * cfg.head_dim * pairs
    # with a shared prefix of P rows, the prefix's queries count once (in sequence 0)
    assert bench.attention_flops([(9, 1, 1, 1, [3, 2], 4)]) == 14 * (sum(range(1, 8)) + 6 + 5)
    # both CPU forward kernels timed on the step's shapes
    times = bench.attention_forwards(full.qkv, repeat=1)
    assert set(times) == {"attention_forward_sdpa_s", "attention_forward_blocked_s"} and min(times.values()) > 0


def test_minor_faults_counts_the_pages_a_call_maps_in():
    """bench.minor_faults: a call that writes a fresh 40 MiB tensor (above glibc's largest dynamic mmap
    threshold, so mapped afresh) faults its pages in, at least one per MiB whatever the page size; a call
    that allocates nothing faults (almost) none."""
    if bench.minor_faults(lambda: None) is None:
        pytest.skip("no resource module here: faults are not counted")
    assert bench.minor_faults(lambda: torch.empty(40 << 20, dtype=torch.uint8).fill_(1)) >= 40
    assert bench.minor_faults(lambda: None) < 40


def test_race_reports_every_call_as_it_ends(capsys):
    """bench.race tells `say` of each call when it ends, before the race returns: the warm-up (round 0) in the
    given order, then every contender once per round in a rotating order; bench's `progress` prints each as a
    stderr line with its seconds and documents per second."""
    heard, calls = [], []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("ours", "onnxruntime", "openvino")}
    say = lambda k, r, s: heard.append((k, r, len(calls)))     # how many calls had ended when it was told
    best = bench.race(fns, 2, say=say)
    assert [(k, r) for k, r, _ in heard] == [("ours", 0), ("onnxruntime", 0), ("openvino", 0),
                                             ("ours", 1), ("onnxruntime", 1), ("openvino", 1),
                                             ("onnxruntime", 2), ("openvino", 2), ("ours", 2)]
    assert [n for _, _, n in heard] == list(range(1, 10)) and set(best) == set(fns)
    bench.progress("fixed", 10, 3)("openvino", 2, 0.5)
    bench.progress("fixed", 10, 3)("ours", 0, 2.0)
    assert capsys.readouterr().err.splitlines() == ["[bench] fixed/openvino round 2/3: 0.500 s, 20.00 docs/s",
                                                    "[bench] fixed/ours warm-up: 2.000 s, 5.00 docs/s"]


@pytest.mark.parametrize("engine", ["onnxruntime", "onnxruntime-int8", "openvino", "torch-int8"])
def test_each_cpu_engine_scores_the_seq_cls_export_as_we_do(tiny_dir, tmp_path, engine, monkeypatch):
    """bench --against's contenders on the tiny checkpoint's seq-cls export, left-padded as their users batch
    them: ONNX Runtime and OpenVINO (float32, the ONNX graph) give our margins; torch's dynamic int8 ranks as
    we do on these well-separated documents and moves each margin by less than its own spread, and so does ONNX
    Runtime's dynamic int8. ONNX Runtime in a process of its own, as bench races it, gives the same margins
    and says its errors; in the engine race it is paired with our compiled scorer as with our eager one."""
    pytest.importorskip("transformers")
    for m in bench_engines.ENGINE_MODULES[engine]:
        pytest.importorskip(m)
    folder = str(tmp_path / "tiny")
    shutil.copytree(tiny_dir, folder)
    fn = bench_engines.engine_scorers(folder, [engine])[engine]
    rr = bench.load_ours(folder, dtype=torch.float32)
    ids = rr.tokenize("how long to boil an egg", ["Boil eggs for six minutes.", "The stock market fell sharply.",
                                                  "Eggs: nine minutes for a hard yolk, six for soft."])
    pad_id = json.load(open(folder + "_seqcls/config.json"))["pad_token_id"]
    got, ours = fn(*bench.left_padded(ids, pad_id)), rr.score_ids(ids)
    if engine.endswith("int8"):
        assert (got - ours).abs().max() < ours.std() and got.argsort().tolist() == ours.argsort().tolist()
    else:
        torch.testing.assert_close(got, ours, rtol=1e-4, atol=1e-4)
    if engine == "onnxruntime":       # as bench races it: in a process of its own (EngineProcess), the same margins
        p = bench_engines.EngineProcess(folder, engine)
        try:
            torch.testing.assert_close(p.load(ids), got)
            assert p.call() is None and p.call(per_doc=True) is None
            with pytest.raises(RuntimeError, match="bench: onnxruntime: "):     # its error, said by the parent
                p.load([[10 ** 6] * 4])                                         # a token id past the vocabulary
        finally:
            p.close()
        assert p.proc.exitcode == 0
        # the engine race: a second scorer of ours (bench's compiled one, here eager) is paired with each
        # float engine directly; our int8 only with int8 engines; neither overwrites the main race's figures
        monkeypatch.setattr(bench, "random_ids", lambda lens, prefix: ids)    # the tiny vocabulary's lists
        monkeypatch.setattr(bench, "in_fresh_process", lambda fn, *a: fn(*a, queue.SimpleQueue()))  # written above
        b = types.SimpleNamespace(against=("onnxruntime", "ours-int8"), prefix=0, repeat=1)
        rc = bench.load_ours(folder, dtype=torch.float32)
        res = bench_engines.engine_race(types.SimpleNamespace(dtype="float32", compile=False), b, folder, rr,
                                        {"fixed": list(map(len, ids))}, {}, rc=rc)
        paired = {k.split("/")[1] for k in res if k.endswith("_paired_median")}
        assert paired == {"ours_vs_onnxruntime_paired_median", "ours_vs_onnxruntime_per_doc_paired_median",
                          "ours_vs_ours-int8_paired_median", "ours_compiled_vs_onnxruntime_paired_median",
                          "ours_compiled_vs_onnxruntime_per_doc_paired_median"}, paired
        assert "fixed/ours_compiled_docs_per_s" not in res and res["fixed/onnxruntime_max_margin_diff"] < 1e-3
        # a bf16 race reads every contender against our float32 margins, ours in bf16 among them
        res = bench_engines.engine_race(types.SimpleNamespace(dtype="bfloat16", compile=False), types.SimpleNamespace(
            against=("onnxruntime",), prefix=0, repeat=1), folder, bench.load_ours(folder, dtype=torch.bfloat16),
            {"fixed": list(map(len, ids))}, {})
        assert res["fixed/onnxruntime_max_margin_diff"] < 1e-3 < res["fixed/ours_max_margin_diff"]


def test_against_is_refused_outside_a_cpu_score_race():
    import run
    for argv in (["--what", "train", "--against", "onnxruntime"], ["--what", "score", "--against", "onnx"]):
        with pytest.raises(SystemExit, match="--against"):
            run.main(["bench", *argv])


def test_workloads_are_those_named_in_their_order():
    """--workloads picks bench's workloads (one of them alone at the real depth on a slow CPU); a name that is
    not one is refused naming the flag."""
    import run
    from settings import BenchSettings
    assert list(bench.workloads(BenchSettings(what="score", seq=7, workloads="fixed"))) == ["fixed"]
    both = bench.workloads(BenchSettings(what="score", seq=7))
    assert list(both) == ["mixed", "fixed"] and both["mixed"] == bench.mixed_lengths() and both["fixed"] == [7] * 10
    with pytest.raises(SystemExit, match="--workloads 'fixd': not one of mixed, fixed"):
        run.main(["bench", "--what", "score", "--workloads", "fixd"])


def test_p99_is_the_nearest_rank_not_the_largest():
    assert bench.p99(list(range(1, 101))) == 99 and bench.p99(list(range(100, 0, -1))) == 99
    assert bench.p99([5.0]) == 5.0 and bench.p99(list(range(1, 1001))) == 990
