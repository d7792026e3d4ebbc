"""quantize --mode int8-static on a tiny BERT: QDQ with MinMax, Entropy and Percentile calibration on text."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bertopt.data import calibration_texts, corpus
from bertopt.registry import run_stage
from bertopt.runtime import Predictor


@pytest.fixture(scope="module")
def static_models(tiny_onnx, tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    return {m: run_stage("quantize", tiny_onnx, {"mode": "int8-static", "calibration_method": m,
                                                  "calibration_size": 64}, root / m)
            for m in ("minmax", "entropy", "percentile")}


def _activation_scales(art) -> dict[str, float]:
    model = onnx.load(str(art.model_path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[1] in inits and inits[n.input[1]].size == 1}


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_static_int8_is_qdq_calibrated_and_close(static_models, tiny_onnx, method):
    art = static_models[method]
    rep = art.lineage["report"]
    assert art.precision == "int8-static"
    assert rep["calibration"] == {"method": method, "texts": 64, "source": "builtin calibration text"}
    ops = rep["after"]["ops"]
    assert ops["QuantizeLinear"] >= 8 and ops["DequantizeLinear"] >= ops["QuantizeLinear"]
    emb = Predictor(art).encode(corpus())
    ref = Predictor(tiny_onnx).encode(corpus())
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    # measured cos min / mean: minmax 0.9936 / 0.9992, entropy 0.9706 / 0.9977, percentile 0.9934 / 0.9992
    floor = {"minmax": 0.99, "entropy": 0.965, "percentile": 0.99}[method]
    assert np.isfinite(emb).all() and cos.min() > floor and cos.mean() > 0.997
    assert rep["accuracy_vs_parent"]["sentence_embedding"]["cos_min"] == pytest.approx(cos.min(), abs=1e-6)


def test_the_methods_choose_different_activation_ranges(static_models):
    scales = {m: _activation_scales(a) for m, a in static_models.items()}
    common = set(scales["minmax"]) & set(scales["entropy"]) & set(scales["percentile"])
    assert len(common) >= 8
    # MinMax covers every calibrated value, so its ranges are the widest; the others clip outliers
    assert all(scales["percentile"][t] <= scales["minmax"][t] * (1 + 1e-6) for t in common)
    assert any(scales["percentile"][t] < scales["minmax"][t] * 0.999 for t in common)
    assert any(abs(scales["entropy"][t] - scales["minmax"][t]) > 1e-3 * scales["minmax"][t] for t in common)


def test_calibration_from_a_text_file(tiny_onnx, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(calibration_texts()[:16]) + "\n")
    art = run_stage("quantize", tiny_onnx, {"mode": "int8-static", "calibration_data": str(data)}, tmp_path / "q")
    assert art.lineage["report"]["calibration"] == {"method": "minmax", "texts": 16, "source": str(data)}


def test_bad_calibration_file_exits_2_and_writes_nothing(cli, tiny_onnx, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_bytes(b"\xff\xfe bad bytes\n")
    code, out, err = cli("quantize", tiny_onnx.path, "--mode", "int8-static", "--calibration-data", data,
                         "--out", tmp_path / "q")
    assert code == 2 and "calib.txt is not UTF-8" in err
    assert not (tmp_path / "q").exists()
