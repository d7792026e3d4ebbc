"""int8 for the OpenVINO runtime: int8 weights in the ONNX file, activations quantised by OpenVINO per token."""

from __future__ import annotations

import re

import numpy as np
import onnx
import openvino  # noqa: E402,F401  (make test installs it: a broken install must fail, not skip)
import pytest
from onnx import numpy_helper

from bertopt.artifact import Artifact, sha256_file
from bertopt.cosine import cosine_rows
from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.machine import has_int8_dot_product
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.stages.quantize.openvino_int8 import QMAX, quantizable_weights
from bertopt.tiny_models import FAMILY_FIXTURES

pytestmark = pytest.mark.usefixtures("private_openvino_cache")

OV_INT8 = {"mode": "int8-dynamic", "runtime": "openvino"}


def weight_matmuls(model) -> list[tuple[str, str]]:
    return [(node, weight) for node, weight, _ in quantizable_weights(model, ["MatMul"])]


def _weights(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_int8_weights_behind_dequantize_and_runtime_recorded(tiny_onnx, tmp_path):
    parent_hash = sha256_file(tiny_onnx.model_path)
    art = run_stage("quantize", tiny_onnx, OV_INT8, tmp_path / "ov")
    assert sha256_file(tiny_onnx.model_path) == parent_hash  # the input is never modified
    assert art.runtime == "openvino"
    options = art.manifest["runtime_options"]
    # static_full_batch: measured by the stage (auto), recorded with what it rests on
    assert options.pop("static_full_batch") is art.lineage["report"]["static_full_batch"]["on"]
    assert options == {"inference_precision": "bf16", "performance_hint": "LATENCY",
                       "dynamic_quantization_group_size": 32}
    assert art.precision == "int8-dynamic+bf16"

    before, after = onnx.load(str(tiny_onnx.model_path)), onnx.load(str(art.model_path))
    originals, stored = _weights(before), _weights(after)
    matmuls = weight_matmuls(before)
    assert matmuls and weight_matmuls(after) == []  # every weight MatMul now reads a dequantised weight
    producers = {o: n for n in after.graph.node for o in n.output}
    weight_fed = [n for n in after.graph.node if n.op_type == "MatMul"
                  and producers.get(n.input[1]) is not None and producers[n.input[1]].op_type == "DequantizeLinear"]
    assert [n.name for n in weight_fed] == [name for name, _ in matmuls]
    for node in weight_fed:
        dq = producers[node.input[1]]
        q, scale = stored[dq.input[0]], stored[dq.input[1]]
        assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= QMAX
        weight = originals[dq.input[0][: -len("_int8")]]
        assert scale.shape == (weight.shape[1],)  # one scale per output channel
        assert np.abs(q * scale - weight).max() <= scale.max() / 2 + 1e-7  # round to nearest on that grid
    assert not set(w for _, w in matmuls) & set(stored)  # the fp32 copies are gone

    report = art.manifest["lineage"]["report"]
    assert report["quantized_nodes"] == len(matmuls) and report["kept_fp32_nodes"] == []
    assert "groups of 32 channels" in report["activations"]
    # served by OpenVINO, close to the fp32 parent
    predictor = Predictor(art)
    assert predictor.session.backend == "openvino"
    texts = corpus()[:64]
    cos = cosine_rows(predictor.encode(texts), Predictor(tiny_onnx).encode(texts))
    assert cos.mean() > 0.99


def test_embedding_tables_int8_per_row_with_gather(tiny_onnx, tmp_path):
    art = run_stage("quantize", tiny_onnx, {**OV_INT8, "op_types": ["MatMul", "Gather"]}, tmp_path / "ov")
    before, after = onnx.load(str(tiny_onnx.model_path)), onnx.load(str(art.model_path))
    tables = [(node, table) for node, table, op in quantizable_weights(before, ["Gather"])]
    assert len(tables) >= 2 and quantizable_weights(after, ["MatMul", "Gather"]) == []
    originals, stored = _weights(before), _weights(after)
    dq_by_output = {n.output[0]: n for n in after.graph.node if n.op_type == "DequantizeLinear"}
    gathers = {n.name: n for n in after.graph.node if n.op_type == "Gather"}
    for node, table in tables:
        dq = dq_by_output[gathers[node].input[0]]
        assert next(a.i for a in dq.attribute if a.name == "axis") == 0  # one scale per row (token)
        q, scale = stored[dq.input[0]], stored[dq.input[1]]
        assert q.dtype == np.int8 and scale.shape == (originals[table].shape[0],)
        assert np.abs(q * scale[:, None] - originals[table]).max() <= scale.max() / 2 + 1e-7
    report = art.manifest["lineage"]["report"]
    assert report["quantized_nodes"] == len(tables) + len(weight_matmuls(before))
    assert report["accuracy_vs_parent"]["sentence_embedding"]["cos_mean"] > 0.99


@pytest.mark.skipif(not has_int8_dot_product(), reason="OpenVINO quantises activations dynamically only on CPUs "
                    "with VNNI or AMX; on this CPU every group size runs weights-only int8")
def test_activation_group_size_reaches_openvino(tiny_onnx, tmp_path):
    """Group 0 keeps activations float (weights-only int8); a positive group quantises them: the outputs differ,
    and weights-only is closer to fp32."""
    texts = corpus()[:64]
    reference = Predictor(tiny_onnx).encode(texts)
    errors = {}
    for group in (0, 32):
        art = run_stage("quantize", tiny_onnx, {**OV_INT8, "activation_group_size": group,
                                                "inference_precision": "f32"}, tmp_path / f"g{group}")
        assert art.manifest["runtime_options"]["dynamic_quantization_group_size"] == group
        errors[group] = float(np.abs(Predictor(art).encode(texts) - reference).mean())
    assert errors[0] != errors[32]
    assert errors[0] < errors[32]


def test_gptq_rounding_on_the_openvino_path(tiny_onnx, tmp_path):
    nearest = run_stage("quantize", tiny_onnx, OV_INT8, tmp_path / "nearest")
    gptq = run_stage("quantize", tiny_onnx, {**OV_INT8, "weight_rounding": "gptq"}, tmp_path / "gptq")
    a, b = (_weights(onnx.load(str(x.model_path))) for x in (nearest, gptq))
    ints = [k for k in a if k.endswith("_int8")]
    assert ints and all(np.array_equal(a[k + "_scale"], b[k + "_scale"]) for k in ints)  # same grid
    assert sum(not np.array_equal(a[k], b[k]) for k in ints) >= len(ints) // 2  # different rounding
    report = gptq.manifest["lineage"]["report"]["gptq"]
    assert report["weights"] == len(ints) and report["median_error_ratio"] < 1.0


def test_accuracy_aware_search_keeps_sensitive_weights_fp32(tiny_onnx, tmp_path):
    art = run_stage("quantize", tiny_onnx, {**OV_INT8, "inference_precision": "f32",
                                            "accuracy_target": "cos_min=0.99999", "accuracy_group": 1,
                                            "calibration_size": 32}, tmp_path / "aa")
    report = art.manifest["lineage"]["report"]
    search = report["accuracy_search"]
    kept = report["kept_fp32_nodes"]
    assert kept and [r["node"] for r in search["kept_fp32"]] == kept
    assert all("rank" in r["reason"] for r in search["kept_fp32"])
    assert search["steps"][0]["holds"] is False and search["steps"][-1]["holds"] is True
    assert search["final_calibration_metrics"]["cos_min"] >= 0.99999
    # what was kept reads its fp32 weight in the written model; the rest read int8
    model = onnx.load(str(art.model_path))
    kept_fp32 = {name for name, _ in weight_matmuls(model)}
    assert kept_fp32 == set(kept)
    assert report["quantized_nodes"] == len(weight_matmuls(onnx.load(str(tiny_onnx.model_path)))) - len(kept)


@pytest.mark.parametrize("config, message", [
    ({"per_token": True}, "--per-token applies to --mode int8-dynamic only .ONNX Runtime dynamic int8., not to "
                          "--mode int8-dynamic --runtime openvino .OpenVINO int8.; drop --per-token"),
    ({"mode": "fp16"}, "--runtime openvino quantises with --mode int8-dynamic"),
    ({"per_channel": False}, "--no-per-channel applies to --mode int8-dynamic or --mode int8-static only"),
])
def test_options_it_cannot_honour_are_refused(tiny_onnx, tmp_path, config, message):
    with pytest.raises(UserError, match=message):
        run_stage("quantize", tiny_onnx, {**OV_INT8, **config}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_fused_input_is_refused_on_the_command_line(tiny_optimized, tmp_path, cli):
    code, out, err = cli("quantize", tiny_optimized.path, "--runtime", "openvino", "--out", tmp_path / "x")
    assert code == 2
    assert "contrib ops" in err and "before 'optimize'" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


def test_inspect_shows_the_runtime_options(tiny_onnx, tmp_path, cli):
    art = run_stage("quantize", tiny_onnx, OV_INT8, tmp_path / "ov")
    code, out, _ = cli("inspect", art.path)
    assert code == 0
    assert "onnx / openvino" in out and "dynamic_quantization_group_size=32" in out


def test_compile_keeps_the_activation_quantisation(tiny_onnx, tmp_path):
    art = run_stage("quantize", tiny_onnx, {**OV_INT8, "activation_group_size": 16}, tmp_path / "ov")
    compiled = run_stage("compile", art, {"inference_precision": "f32"}, tmp_path / "f32")
    assert compiled.manifest["runtime_options"]["dynamic_quantization_group_size"] == 16
    assert compiled.precision == "int8-dynamic+fp32"
    assert Artifact.load(compiled.path).runtime == "openvino"


@pytest.mark.parametrize("family", FAMILY_FIXTURES)
def test_keep_ffn_output_keeps_each_familys_ffn_outputs_float(family, tmp_path):
    # tune's openvino-int8-dynamic candidate: the FFN output projections (GELU-fed inputs) stay float, found by the
    # family's own declaration; everything else with a weight is int8
    from bertopt.families import family_by_name
    from bertopt.tiny_models import build_tiny_family_model

    exported = run_stage("export", build_tiny_family_model(tmp_path / "hf", family), {}, tmp_path / "onnx")
    art = run_stage("quantize", exported, {**OV_INT8, "op_types": ["MatMul"], "keep_ffn_output": True,
                                           "inference_precision": "f32"}, tmp_path / "ov")
    before = onnx.load(str(exported.model_path))
    matmuls = [name for name, _ in weight_matmuls(before)]
    pattern = family_by_name(exported.model_info["family"]).ffn_output_matmul
    ffn_out = [name for name in matmuls if re.search(pattern, name)]
    report = art.manifest["lineage"]["report"]
    assert ffn_out and sorted(report["kept_fp32_nodes"]) == sorted(ffn_out)
    assert report["quantized_nodes"] == len(matmuls) - len(ffn_out)
    assert [name for name, _ in weight_matmuls(onnx.load(str(art.model_path)))] == ffn_out  # still float weights
    assert art.precision == "int8-dynamic+fp32"
    # and off by default for int8-dynamic (on for int8-static): every weight MatMul int8
    default = run_stage("quantize", exported, {**OV_INT8, "op_types": ["MatMul"]}, tmp_path / "ov-default")
    assert default.manifest["lineage"]["report"]["kept_fp32_nodes"] == []
