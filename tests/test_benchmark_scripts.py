"""Smoke runs of the benchmark scripts on a tiny BERT with tiny sizes: they build their recipes, measure, print
a table and write JSON. The numbers are not checked (speed is noisy); the wiring is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--rounds", "1", "--texts", "8", "--mixed-texts", "12", "--latency-calls", "2", "--batch-size", "4",
        "--seq-len", "24", "--latency-seq-len", "8"]


def _run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_recipes_script_smoke(tiny_hf, tmp_path):
    out = tmp_path / "r.json"
    proc = _run("bench_recipes.py", "--model", tiny_hf, "--out", tmp_path / "art", "--recipes",
                "minilm-fp32-optimized", *TINY, "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["results"]] == ["PyTorch fp32", "minilm-fp32-optimized"]
    assert data["results"][1]["fidelity"]["corpus"]["cos_min"] > 0.9999
    assert "minilm-fp32-optimized" in proc.stdout
    # a second run reuses the built artifact instead of rebuilding it
    again = _run("bench_recipes.py", "--model", tiny_hf, "--out", tmp_path / "art", "--recipes",
                 "minilm-fp32-optimized", *TINY, "--json", out)
    assert again.returncode == 0 and "reusing" in again.stderr


@pytest.mark.slow
def test_compare_script_smoke(tiny_hf, tmp_path):
    out = tmp_path / "c.json"
    proc = _run("compare.py", "--model", tiny_hf, "--out", tmp_path / "art", *TINY, "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["results"]]
    assert names[:3] == ["PyTorch fp32", "PyTorch bf16 autocast", "ORT fp32 as exported"]
    assert "bertopt fastest-cpu" in names and "ORT int8 dynamic per-channel" in names
    fastest = next(r for r in data["results"] if r["name"] == "bertopt fastest-cpu")
    assert fastest["backend"] == "openvino"
    assert set(data["goal"]["checks"]) == {"padded_vs_bf16", "mixed_vs_bf16", "latency_vs_fp32"}
    assert "GOAL" in proc.stdout


@pytest.mark.slow
def test_accuracy_aware_script_smoke(tiny_hf, tmp_path):
    out = tmp_path / "a.json"
    proc = _run("accuracy_aware.py", "--model", tiny_hf, "--work", tmp_path / "art", "--rounds", "1",
                "--mixed-texts", "40", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert {"int8 per-channel", "+ GPTQ + search", "openvino + GPTQ + search", "openvino bf16 (no int8)"} <= set(rows)
    assert rows["int8 per-channel"]["speedup_share"] == 1.0  # the reference of the share
    assert rows["openvino + GPTQ + search"]["size_bytes"] < rows["openvino bf16 (no int8)"]["size_bytes"]
    assert set(data["goal"]) >= {"cos_min_met", "speedup_share_met", "share_of_openvino_int8"}
    assert "goal: cos_min" in proc.stdout


@pytest.mark.slow
def test_default_candidates_script_smoke(tiny_hf, tmp_path):
    out = tmp_path / "d.json"
    proc = _run("default_candidates.py", "--model", tiny_hf, "--out", tmp_path / "art", "--recipes",
                "minilm-int8-cpu", "minilm-faithful-cpu", *TINY, "--probes", "8", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert list(rows) == ["PyTorch fp32", "minilm-int8-cpu", "minilm-faithful-cpu"]
    faithful = rows["minilm-faithful-cpu"]
    # OpenVINO f32 is the model itself, alone or batched: the default's bar on fidelity and batch invariance
    assert faithful["fidelity"]["corpus"]["cos_min"] > 0.9999
    assert max(faithful["batch_dev"].values()) < 1e-6
    assert rows["minilm-int8-cpu"]["vs"]["old-default"]["mixed"] == 1.0  # the first recipe is the baseline
    assert "meets bar" in proc.stdout and data["machine"]["load_average"]


@pytest.mark.slow
def test_models_script_smoke(tmp_path):
    """benchmarks/models.py (the generator of docs/models.md) on two tiny families next to the real MiniLM: every
    stage measured, the optimize row says which attention operators were fused, MiniLM's ratio is re-timed in each
    family's window and the summary holds each family against it, and the docs are left alone with --no-docs."""
    out = tmp_path / "m.json"
    docs_before = (ROOT / "docs" / "models.md").read_text()
    proc = _run("models.py", "--families", "bert,roberta", "--hidden", 32, "--layers", 1, "--heads", 2,
                "--no-heads", "--no-mpnet", "--no-docs", "--mixed-texts", 8, "--fidelity-texts", 8,
                "--rounds", 1, "--min-round-s", 0.2, "--out", tmp_path / "art", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    from benchmarks.models import REAL_MODEL_COS_MIN, STAGES, best_stage, paired_vs_yardstick

    minilm = {r["stage"]: r for r in rows if r["model"] == "minilm"}
    assert list(minilm) == ["pytorch-fp32", "pytorch-bf16", *STAGES[1:]]
    assert not any("yardstick_round_s" in r for r in minilm.values())
    _, yard_stage = best_stage(rows, "minilm")
    assert minilm[yard_stage]["cos_min"] >= REAL_MODEL_COS_MIN  # a real model's best stage is a faithful one
    summary = proc.stdout[proc.stdout.index("| model | best stage"):]
    for model in ("bert", "roberta"):
        mine = [r for r in rows if r["model"] == model]
        assert all(len(r["round_s"]) == 1 and len(r["yardstick_round_s"]["best"]) == 1 for r in mine)
        ratio, stage = best_stage(rows, model)
        # the paired figure from the round's own four timings
        row, bf16 = (next(r for r in mine if r["stage"] == s) for s in (stage, "pytorch-bf16"))
        want = (bf16["round_s"][0] / row["round_s"][0]) / (
            row["yardstick_round_s"]["pytorch-bf16"][0] / row["yardstick_round_s"]["best"][0])
        assert paired_vs_yardstick(rows, model, stage) == [want]
        line = next(line for line in summary.splitlines() if line.startswith(f"| {model} |"))
        assert line.split(" | ")[1] == stage and line.split(" | ")[3:5] == [f"{ratio:.2f}", f"{want:.0%}"], line

    for model in ("bert", "roberta"):
        stages = [r["stage"] for r in rows if r["model"] == model]
        assert stages == ["pytorch-fp32", "pytorch-bf16", *STAGES[1:]]
        assert all(r["texts_per_s"] > 0 for r in rows if r["model"] == model)
        optimized = next(r for r in rows if r["model"] == model and r["stage"] == "optimize")
        assert optimized["fused_ops"].get("Attention") == 1, optimized["fused_ops"]
        assert optimized["cos_min"] > 0.9999
    assert json.loads(out.read_text())["meta"]["min_round_s"] == 0.2
    assert (ROOT / "docs" / "models.md").read_text() == docs_before


@pytest.mark.slow
def test_compare_st_peers_smoke_without_peer_venv(tiny_hf, tiny_onnx, tmp_path):
    """compare.py --st-peers on the tiny model: sentence-transformers' PyTorch contenders and the artifact each run
    in a process of their own and are timed; without the peer venv its OpenVINO contenders are reported as
    skipped with the reason, and the table names the CPU's features."""
    out = tmp_path / "p.json"
    missing = tmp_path / "no-peer-venv"
    proc = _run("compare.py", "--st-peers", "--model", tiny_hf, "--artifacts", tiny_onnx.path, "--peer-venv",
                missing, "--rounds", "2", "--texts", "8", "--mixed-texts", "12", "--batch-size", "4",
                "--seq-len", "24", "--threads", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert list(rows) == ["sentence-transformers PyTorch fp32", "sentence-transformers PyTorch bf16 autocast",
                          'sentence-transformers backend="openvino"', "sentence-transformers static int8 OpenVINO",
                          "bertopt art"]
    for name in ('sentence-transformers backend="openvino"', "sentence-transformers static int8 OpenVINO"):
        assert rows[name]["skipped"] == f"no peer venv at {missing}: create it with benchmarks/peer-venv.sh {missing}"
    # bf16 autocast only where bf16 is native: PyTorch emulates it elsewhere, slower than its fp32
    from bertopt.machine import has_native_bf16

    bf16 = rows["sentence-transformers PyTorch bf16 autocast"]
    if has_native_bf16():
        assert "skipped" not in bf16 and len(bf16["mixed_texts_per_s_rounds"]) == 2
    else:
        assert bf16["skipped"] == "bf16 is not native on this CPU (no AVX-512 BF16 / AMX); --st-bf16 runs it anyway"
    ref, art = rows["sentence-transformers PyTorch fp32"], rows["bertopt art"]
    assert len(ref["padded_texts_per_s_rounds"]) == 2 and len(art["mixed_texts_per_s_rounds"]) == 2
    assert ref["fidelity"]["mixed"]["cos_min"] == pytest.approx(1.0)
    # the fp32 export of the same model against sentence-transformers' own pipeline: rounding only
    assert art["fidelity"]["mixed"]["cos_min"] > 0.9999 and art["fidelity"]["padded"]["cos_min"] > 0.9999
    assert art["vs"]["st-fp32"]["mixed"] > 0 and "st-openvino" not in art["vs"]
    assert data["settings"]["padded_texts"] == 8 and data["settings"]["threads"] == 1
    assert set(data["machine"]["cpu_features"]) <= set(data["cpu"].replace(",", " ").replace(";", " ").split())
    assert "skipped" in proc.stdout and "against sentence-transformers on" in proc.stdout
    # each skipped contender's reason is one line under the table, whole (not wrapped through the rate columns)
    printed = " ".join(proc.stdout.split())
    assert 'sentence-transformers backend="openvino": skipped: no peer venv at' in printed


@pytest.mark.slow
def test_profile_openvino_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/profile_openvino.py on a tiny OpenVINO artifact: per-node time by exec type, the model's MACs
    counted from its graph (equal to the shape formula of bertopt.bench), the overhead split, JSON written."""
    from bertopt.bench import flops_per_sentence
    from bertopt.registry import run_stage

    art = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32"}, tmp_path / "ov")
    out = tmp_path / "prof.json"
    proc = _run("profile_openvino.py", art.path, "--reps", "1", "--batch-size", "4", "--seq-len", "24",
                "--mixed-texts", "8", "--short-texts", "8", "--threads", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    padded = data["nodes"]["padded"]
    assert padded and sum(r["share"] for r in padded) == pytest.approx(1.0)
    assert data["precision_share"]["padded"].get("f32", 0) > 0.5
    matmuls = [r for r in padded if r["node_type"].startswith(("FullyConnected", "MatMul"))]
    assert matmuls and {r["precision"] for r in matmuls} == {"f32"}  # f32 pinned: no bf16 or int8 kernel
    want = 4 * flops_per_sentence(art.model_info, 24) / 2  # batch 4, 2 FLOPs per MAC
    assert data["macs"]["total"] == pytest.approx(want, rel=0.01)
    assert {o["batch"] for o in data["overhead_short_texts"]} == {4, 1}
    assert "time by node type and exec type" in proc.stdout and "MACs at 4 x 24" in proc.stdout


@pytest.mark.slow
def test_static_int8_script_smoke(tiny_hf, tmp_path):
    pytest.importorskip("nncf")
    out = tmp_path / "s.json"
    proc = _run("static_int8.py", "--model", tiny_hf, "--out", tmp_path / "art", "--recipes",
                "minilm-faithful-cpu", "minilm-int8-static", *TINY, "--probes", "8", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert list(rows) == ["PyTorch fp32", "minilm-faithful-cpu", "minilm-int8-static"]
    assert rows["minilm-faithful-cpu"]["vs"]["bf16"]["mixed"] == 1.0  # the first recipe is the yardstick
    assert rows["minilm-int8-static"]["precision"].startswith("int8-static")
    assert set(rows["minilm-int8-static"]["batch_dev"]) == {"corpus", "mixed"}
    assert "faithful" in proc.stdout and data["machine"]["load_average"]


@pytest.mark.slow
@pytest.mark.server
def test_http_load_two_models_script_smoke(tiny_onnx, task_artifact, tmp_path):
    """The two-model fleet run on a tiny embedder and a tiny cross-encoder: both probed idle and flooded, the
    throughput of both at once, a table and JSON."""
    out = tmp_path / "two.json"
    proc = _run("http_load.py", "--two-models", "--artifact", tiny_onnx.path, "--cross-encoder",
                task_artifact("rerank")[1].path, "--probes", "3", "--flood-size", "32", "--flood-request", "16",
                "--fleet-texts", "64", "--steady-s", "2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["latency"]] == ["embed", "rerank"]
    assert len(data["threads_per_worker"]) == 2 and data["throughput_ratio"] > 0
    assert set(data["flood_texts_answered"]) == {"embed", "rerank"}
    assert data["steady"]["answered"]["embed"] > 0 and data["steady"]["answered"]["rerank"] > 0
    assert "p99 ratio" in proc.stdout and "steady load" in proc.stdout


def test_bucketing_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/bucketing.py on a tiny artifact: each plan's batch count and padded tokens, the looser plan
    pads more; the table names the CPU's features and the Predictor's default plan; JSON written."""
    from bertopt.machine import cpu_features
    from bertopt.runtime.predictor import BUCKET_GROWTH, BUCKET_SLACK_TOKENS

    out = tmp_path / "bucketing.json"
    default = f"{BUCKET_GROWTH:g}:{BUCKET_SLACK_TOKENS}"
    proc = _run("bucketing.py", tiny_onnx.path, "--rounds", "1", "--plans", f"1.25:8,{default},1.0:0",
                "--threads", "1", "--quiet", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    plans = data["results"][0]["plans"]
    assert [(p["growth"], p["slack"]) for p in plans] == [(1.25, 8), (BUCKET_GROWTH, BUCKET_SLACK_TOKENS), (1.0, 0)]
    real = data["results"][0]["real_tokens"]
    assert plans[0]["padded_tokens"] >= plans[1]["padded_tokens"] >= plans[2]["padded_tokens"] == real
    assert plans[0]["batches"] <= plans[1]["batches"] <= plans[2]["batches"]
    assert plans[0]["x_first_plan"] == 1.0 and all(p["texts_per_s"] > 0 for p in plans)
    assert data["cpu_features"] == sorted(cpu_features())
    assert f"{default} (default)" in proc.stdout and "CPU features:" in proc.stdout
    bad = _run("bucketing.py", tiny_onnx.path, "--plans", "fast")
    assert bad.returncode != 0 and "is not GROWTH:SLACK" in bad.stderr


def test_onnxruntime_static_int8_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/onnxruntime_static_int8.py on a tiny artifact: with one Q / DQ pair per consumer ONNX Runtime
    runs every weight MatMul as an integer kernel (with ``--fuse`` too), each float group takes its MatMuls out of
    int8, static scales leave a text's embedding independent of its batch-mates; the table names the CPU's features;
    JSON written."""
    pytest.importorskip("nncf")
    import onnx

    from bertopt.machine import cpu_features
    from bertopt.onnx_graph.util import weight_matmuls as weight_matmuls_of

    weight_matmuls = len(weight_matmuls_of(onnx.load(str(tiny_onnx.model_path)), op_types=("MatMul",)))
    runs = {}
    for kernel, variants, extra in (("u8s8", "none;ffn-out", ()), ("u8u8", "none", ("--fuse",))):
        out = tmp_path / f"{kernel}.json"
        proc = _run("onnxruntime_static_int8.py", tiny_onnx.path, "--kernel", kernel, "--rounds", "1", "--calibration",
                    "16", "--variants", variants, "--threads", "1", "--quiet", "--json", out, *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "CPU features:" in proc.stdout
        runs[kernel] = json.loads(out.read_text())
    signed, unsigned = runs["u8s8"], runs["u8u8"]
    none, ffn_out = signed["results"]
    # NNCF shares one quantiser between query, key and value; ONNX Runtime fuses the copies only with their own
    # scale / zero-point tensors
    assert signed["consumer_pairs_added"] > 0 and signed["tensors_made_unsigned"] == 0
    assert none["float_matmuls"] == 0 and none["int8_matmuls"] >= weight_matmuls > 0
    assert ffn_out["float_matmuls"] > 0 and ffn_out["int8_matmuls"] == none["int8_matmuls"] - ffn_out["float_matmuls"]
    assert unsigned["kernel"] == "u8u8" and unsigned["tensors_made_unsigned"] > 0
    assert unsigned["results"][0]["int8_matmuls"] == none["int8_matmuls"]
    # --fuse: the optimize stage's LayerNorm / GELU fusions around the int8 MatMuls, none taken out of int8
    assert unsigned["fuse"] and unsigned["results"][0]["fused_ops"].get("SkipLayerNormalization", 0) > 0
    assert not signed["fuse"] and signed["results"][0]["fused_ops"] == {}
    for row in signed["results"] + unsigned["results"]:
        assert 0.5 < row["cos_min_corpus"] <= 1.0 + 1e-6 and 0.5 < row["cos_min_mixed"] <= 1.0 + 1e-6
        assert row["batch_dev"] < 1e-5  # fixed activation scales: no batch-mate moves a text
        assert row["padded_texts_per_s"] > 0 and row["mixed_texts_per_s"] > 0
    assert signed["cpu_features"] == sorted(cpu_features())
    bad = _run("onnxruntime_static_int8.py", tiny_onnx.path, "--variants", "ffn-out,everything")
    assert bad.returncode == 2 and "unknown group 'everything'" in bad.stderr


@pytest.mark.slow
def test_sparse_batches_script_smoke(task_artifact, tmp_path):
    """benchmarks/sparse_batches.py on a tiny SPLADE: each (cap, length) in its own process, the plan follows the
    cap (fewer texts a call under a tighter one), peak memory and speed recorded, the CPU named; JSON written."""
    _, art = task_artifact("sparse-embedding")
    out = tmp_path / "sparse.json"
    proc = _run("sparse_batches.py", art.path, "--caps", "none,256", "--lengths", "40", "--texts", "16",
                "--rounds", "1", "--passes", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cap"], r["length"]) for r in rows] == [("none", 40), ("256", 40)]
    assert rows[0]["batches"] == [16] and max(rows[1]["batches"]) * rows[1]["tokens_per_text"] <= 256
    assert rows[0]["x_first"] == 1.0 and all(r["texts_per_s"] > 0 and r["peak_rss_gb"] > 0 for r in rows)
    assert "sparse-embedding by tokens per call" in proc.stdout and "CPU" in proc.stdout


def test_the_cpu_line_and_peaks_follow_a_onednn_isa_cap():
    # a benchmark run under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on an AMX CPU measures the kernels of a CPU without
    # AMX: its table must say so, and its peaks must be that CPU's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from common import cpu_line, peak_gflops
    finally:
        sys.path.pop(0)
    machine = {"cpu_model": "Xeon", "usable_cores": 2, "cpus": 2, "cpu_mhz": 2000.0, "isa_cap": "AVX512_CORE_BF16",
               "flags": ["amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f"],
               "cpu_features": ["avx2", "avx512_bf16", "avx512_vnni", "avx512f"]}
    line = cpu_line(machine)
    assert "avx512_vnni, avx512_bf16; no amx_int8" in line
    assert "(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: the CPU's amx_bf16, amx_int8 unused)" in line
    peaks = peak_gflops(machine)
    assert peaks["bf16"] == 128 * 2.0 * 2 and peaks["int8"] == 256 * 2.0 * 2  # AVX-512 dot products, not AMX tiles
    uncapped = peak_gflops({**machine, "cpu_features": machine["flags"]})
    assert uncapped["int8"] == 2048 * 2.0 * 2


def test_a_zen_4_is_given_half_the_avx512_peaks():
    # AMD family 25 with AVX-512 (Zen 4, "AMD EPYC" by name) runs a 512-bit instruction on 256-bit units: the
    # profile's "% of peak" on such a host was half what it should be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from common import peak_gflops
    finally:
        sys.path.pop(0)
    features = ["avx2", "avx512_bf16", "avx512_vnni", "avx512f"]
    zen4 = {"cpu_model": "AMD EPYC", "cpus": 2, "cpu_mhz": 2500.0, "cpu_vendor": "AuthenticAMD", "cpu_family": 25,
            "cpu_model_number": 17, "cpu_features": features}
    peaks = peak_gflops(zen4)
    assert (peaks["fp32"], peaks["bf16"], peaks["int8"]) == (32 * 5.0, 64 * 5.0, 128 * 5.0)
    assert "Zen 4" in peaks["assumption"]
    zen5 = peak_gflops({**zen4, "cpu_family": 26, "cpu_model_number": 2})
    assert (zen5["bf16"], zen5["int8"]) == (128 * 5.0, 256 * 5.0)


def test_machine_info_names_the_cpu_generation():
    from bertopt.machine import machine_info

    info = machine_info()
    if Path("/proc/cpuinfo").exists():
        assert isinstance(info["cpu_family"], int) and isinstance(info["cpu_model_number"], int)
        assert info["cpu_vendor"] in Path("/proc/cpuinfo").read_text()


def test_fixed_shape_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/fixed_shape.py on a tiny OpenVINO artifact: each shape timed on the dynamic model and on a copy
    compiled for it, the table names the CPU's features, JSON written; an ONNX Runtime artifact is refused."""
    from bertopt.machine import cpu_features
    from bertopt.registry import run_stage

    art = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                           "static_full_batch": "off"}, tmp_path / "ov")
    out = tmp_path / "fixed.json"
    proc = _run("fixed_shape.py", art.path, "--shapes", "4x16,8x24", "--rounds", "1", "--threads", "1", "--quiet",
                "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = data["results"][0]["shapes"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(4, 16), (8, 24)]
    assert all(r["dynamic_texts_per_s"] > 0 and r["fixed_texts_per_s"] > 0 and len(r["rounds"]["fixed"]) == 1
               for r in rows)
    assert data["cpu_features"] == sorted(cpu_features()) and "CPU features:" in proc.stdout
    assert "| ov | 1 | 8 x 24 |" in proc.stdout
    onnxruntime = _run("fixed_shape.py", tiny_onnx.path, "--rounds", "1", "--quiet")
    assert onnxruntime.returncode != 0 and "not OpenVINO" in onnxruntime.stderr
    bad = _run("fixed_shape.py", art.path, "--shapes", "big")
    assert bad.returncode != 0 and "is not TEXTSxTOKENS" in bad.stderr


def test_gate_cost_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/gate_cost.py on a tiny OpenVINO artifact with a stream per core: the batch-invariance check timed
    side by side and one batch at a time, and the gate's statistics both ways, the same figures each time, the
    tables name the CPU's features."""
    from bertopt.machine import cpu_features
    from bertopt.registry import run_stage

    art = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                           "performance_hint": "THROUGHPUT"}, tmp_path / "twin")
    out = tmp_path / "gate.json"
    proc = _run("gate_cost.py", art.path, tiny_onnx.path, "--max-texts", "24", "--rounds", "1", "--threads", "2",
                "--quiet", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    twin, onnxruntime = data["results"]
    assert twin["streams"] == min(2, os.cpu_count() or 1) and onnxruntime["streams"] == 1
    for r in (twin, onnxruntime):
        assert r["texts"] == 48 and r["probes"] == 48 and r["same_figures"] is True and r["batch_dev"] < 1e-6
        assert len(r["rounds_s"]["side by side"]) == len(r["rounds_s"]["one at a time"]) == 1
    assert data["cpu_features"] == sorted(cpu_features()) and "CPU features:" in proc.stdout
    assert f"| twin | {twin['streams']} | 48 |" in proc.stdout and "| yes |" in proc.stdout
    # the gate's statistics on each artifact's outputs: both ways timed, the same figures
    for r, art in zip(data["statistics"], (twin, onnxruntime)):
        assert r["artifact"] == art["artifact"] and r["same_figures"] is True
        assert r["outputs"] == ["last_hidden_state", "sentence_embedding"] and r["values"] > 48 * 32
        assert len(r["rounds_s"]["slices"]) == len(r["rounds_s"]["whole arrays"]) == 1
        assert 0 < r["peak_mib"]["slices"] <= r["peak_mib"]["whole arrays"]
    assert "The gate's statistics" in proc.stdout


@pytest.mark.slow
def test_serve_memory_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/serve_memory.py on a tiny OpenVINO artifact with the full-batch copy on: a real server answers each
    phase, the workers' memory is read and grows once long texts come, the table names the CPU's features."""
    from bertopt.machine import cpu_features
    from bertopt.registry import run_stage

    art = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                           "static_full_batch": "on"}, tmp_path / "ov")
    out = tmp_path / "memory.json"
    proc = _run("serve_memory.py", art.path, "--requests", "2", "--batch-size", "4", "--batches", "2", "--quiet",
                "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    phases = {p["phase"]: p for p in data["results"][0]["phases"]}
    assert list(phases) == ["ready", "short", "1 x 4", "2 x 4"]
    assert phases["2 x 4"]["texts"] == 8 and phases["1 x 4"]["steady_s"] > 0
    assert phases["ready"]["processes"] >= 1 and phases["ready"]["workers_gb"] > 0
    assert phases["2 x 4"]["workers_gb"] >= phases["ready"]["workers_gb"] * 0.9  # read from /proc, same workers
    assert data["results"][0]["runtime_options"]["static_full_batch"] is True
    assert data["cpu_features"] == sorted(cpu_features()) and "CPU features:" in proc.stdout
    assert "| ov | " in proc.stdout and "| 1 x 4 |" in proc.stdout
    bad = _run("serve_memory.py", art.path, "--batches", "0")
    assert bad.returncode != 0 and "must be at least 1" in bad.stderr


@pytest.mark.slow
def test_hybrid_int8_script_smoke(tiny_onnx, tmp_path):
    """benchmarks/hybrid_int8.py on a tiny static int8 artifact: the float-kept weight MatMuls get int8 weights, each
    variant is compared with the parent and timed, JSON written; an artifact that is not static int8 is refused."""
    from bertopt.machine import cpu_features
    from bertopt.registry import run_stage

    static = run_stage("quantize", tiny_onnx, {"mode": "int8-static", "runtime": "openvino", "calibration_size": 64,
                                                "inference_precision": "f32"}, tmp_path / "s8")
    out = tmp_path / "hybrid.json"
    proc = _run("hybrid_int8.py", static.path, tiny_onnx.path, "--texts", "12", "--batch", "4", "--tokens", "16",
                "--rounds", "1", "--threads", "1", "--quiet", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())["results"][0]
    variants = {v["variant"]: v for v in data["variants"]}
    assert list(variants) == ["parent (float)", "static int8 as built", "hybrid: restored MatMuls dynamic int8",
                              "hybrid + FFN outputs dynamic int8"]
    assert variants["parent (float)"]["cos_min"] > 0.99999  # the parent against itself
    as_built = variants["static int8 as built"]["int8_matmuls"]
    # the FFN outputs (kept float by the stage) are among what the last variant makes int8
    assert variants["hybrid + FFN outputs dynamic int8"]["int8_matmuls"] > as_built > 0
    assert all(0.9 < v["cos_min"] <= 1.0 + 1e-6 and v["texts_per_s"] > 0 for v in variants.values())
    assert json.loads(out.read_text())["cpu_features"] == sorted(cpu_features()) and "CPU features:" in proc.stdout
    refused = _run("hybrid_int8.py", tiny_onnx.path, tiny_onnx.path, "--quiet")
    assert refused.returncode != 0 and "not an OpenVINO static int8 artifact" in refused.stderr
