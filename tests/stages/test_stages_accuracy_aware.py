"""Accuracy-aware quantisation on a tiny BERT: the search keeps the most sensitive operators in fp32 until the
target holds on the calibration text (measured against the fp32 parent), and the manifest says what and why."""

from __future__ import annotations

import onnx
import pytest

from bertopt.cosine import cosine_rows
from bertopt.data import calibration_texts
from bertopt.errors import UserError
from bertopt.registry import run_stage
from bertopt.runtime import Predictor


def _cos_min_on_calibration(art, parent, n=128):
    texts = [t for t in calibration_texts() if t.strip()][:n]
    return float(cosine_rows(Predictor(art).encode(texts), Predictor(parent).encode(texts)).min())


@pytest.fixture(scope="module")
def plain(tiny_onnx, tmp_path_factory):
    return run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False},
                     tmp_path_factory.mktemp("aa") / "plain")


def test_int8_dynamic_search_meets_a_target_plain_int8_misses(tiny_onnx, plain, tmp_path):
    plain_cos = _cos_min_on_calibration(plain, tiny_onnx)
    target = 1 - (1 - plain_cos) / 2.5  # halfway-plus between plain int8 and perfect
    assert plain_cos < target
    art = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False,
                                            "accuracy_target": f"cos_min={target:.8f}"}, tmp_path / "aa")
    rep = art.lineage["report"]
    search = rep["accuracy_search"]
    kept = rep["kept_fp32_nodes"]
    assert kept and len(kept) < search["candidates"] == 12  # 2 layers x (Q, K, V, out, FFN in, FFN out)
    assert search["steps"][0]["holds"] is False and search["steps"][-1]["holds"] is True
    assert [s["kept_fp32"] for s in search["steps"]] == list(range(0, len(kept) + 1, 2))
    # every candidate was ranked; what was kept is the top of the ranking, each with its reason
    ranking = [row["node"] for row in sorted(search["sensitivity"], key=lambda r: r["rank"])]
    assert len(ranking) == 12 and kept == ranking[:len(kept)]
    scores = [row["score"] for row in sorted(search["sensitivity"], key=lambda r: r["rank"])]
    assert scores == sorted(scores, reverse=True)
    for row, name in zip(search["kept_fp32"], kept):
        assert row["node"] == name and row["reason"].startswith(f"rank {row['rank']} of 12 by sensitivity per weight")
    # independently re-measured: the target holds on the calibration text against the fp32 parent
    assert _cos_min_on_calibration(art, tiny_onnx) >= target
    # the kept nodes really are fp32 MatMuls with fp32 weights in the final graph
    model = onnx.load(str(art.model_path))
    inits = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for name in kept:
        assert nodes[name].op_type == "MatMul"
        assert inits[nodes[name].input[1]].data_type == onnx.TensorProto.FLOAT
    assert rep["quantized_nodes"] == 12 - len(kept)


def test_a_target_plain_int8_already_meets_keeps_nothing(tiny_onnx, plain, tmp_path):
    art = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False,
                                            "accuracy_target": "cos_min=0.99"}, tmp_path / "aa")
    search = art.lineage["report"]["accuracy_search"]
    assert art.lineage["report"]["kept_fp32_nodes"] == [] and len(search["steps"]) == 1
    assert search["sensitivity"] == []  # no ranking needed


def test_static_search_reuses_one_calibration(tiny_onnx, tmp_path):
    plain = run_stage("quantize", tiny_onnx, {"mode": "int8-static", "calibration_method": "entropy",
                                              "calibration_size": 64}, tmp_path / "plain")
    plain_cos = _cos_min_on_calibration(plain, tiny_onnx, 64)
    target = 1 - (1 - plain_cos) / 3
    art = run_stage("quantize", tiny_onnx, {"mode": "int8-static", "calibration_method": "entropy",
                                            "calibration_size": 64, "accuracy_target": f"cos_min={target:.8f}"},
                    tmp_path / "aa")
    rep = art.lineage["report"]
    assert rep["kept_fp32_nodes"] and art.precision == "int8-static"
    assert _cos_min_on_calibration(art, tiny_onnx, 64) >= target
    assert rep["after"]["ops"]["QuantizeLinear"] < plain.lineage["report"]["after"]["ops"]["QuantizeLinear"]


def test_fp16_search_picks_fp32_islands(tiny_onnx, tmp_path):
    plain = run_stage("quantize", tiny_onnx, {"mode": "fp16"}, tmp_path / "plain")
    plain_cos = _cos_min_on_calibration(plain, tiny_onnx)
    target = 1 - (1 - plain_cos) / 1.5
    art = run_stage("quantize", tiny_onnx, {"mode": "fp16", "accuracy_target": f"cos_min={target:.12f}"},
                    tmp_path / "aa")
    rep = art.lineage["report"]
    assert art.precision == "fp16" and rep["fp32_islands"]
    assert set(rep["fp32_islands"]) <= set(rep["kept_fp32_nodes"])
    assert _cos_min_on_calibration(art, tiny_onnx) >= target


def test_unreachable_or_wrong_targets_are_user_errors(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="not an accuracy metric"):
        run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "accuracy_target": "speedup=2"}, tmp_path / "a")
    with pytest.raises(UserError, match="'cos_min@32x128' is not an accuracy metric"):  # a grid point is latency's
        run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "accuracy_target": "cos_min@32x128=0.9"},
                  tmp_path / "a2")
    with pytest.raises(UserError, match="names output 'pooled'"):
        run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "accuracy_target": "pooled.cos_min=0.9"},
                  tmp_path / "b")
    with pytest.raises(UserError, match="not met even with every candidate kept in fp32"):
        run_stage("quantize", tiny_onnx, {"mode": "fp16", "accuracy_target": "max_abs<=0"}, tmp_path / "c")
    assert not (tmp_path / "c").exists()
