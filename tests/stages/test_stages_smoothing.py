"""Outlier handling before int8 on a tiny BERT: smoothing, first token in fp32 and per-token scaling rewrite the
graph without changing the fp32 function, the manifest records them, and on a model with outlier channels they
bring int8 closer to fp32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from bertopt.artifact import ArtifactWriter
from bertopt.cosine import cosine_rows
from bertopt.data import calibration_texts
from bertopt.errors import UserError
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.stages.quantize.smoothing import (
    channel_absmax,
    node_roles,
    per_token_scaling,
    smooth_model,
    split_first_token,
)

TEXTS = [t for t in calibration_texts() if t.strip()][:48]


def _feeds(art, texts):
    p = Predictor(art, verify=False)
    return [p.feeds_for(p.tokenize([t]))[0] for t in texts]


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [s.run(None, f) for f in feeds]


@pytest.fixture(scope="module")
def outlier_model(tiny_onnx, tmp_path_factory):
    """The tiny BERT with three hidden channels of every LayerNorm output blown up 25x (gamma and beta), the
    outlier pattern real BERTs have, as an artifact."""
    model = onnx.load(str(tiny_onnx.model_path))
    tensors = {i.name: i for i in model.graph.initializer}
    aliases = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Identity"}  # deduplicated
    scaled = 0
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            for k in (1, 2):
                arr = numpy_helper.to_array(tensors[aliases.get(node.input[k], node.input[k])]).copy()
                arr[[3, 11, 20]] *= 25.0
                name = f"outlier_{node.name}_{k}"
                model.graph.initializer.append(numpy_helper.from_array(arr, name))
                node.input[k] = name
            scaled += 1
    assert scaled >= 4
    out = tmp_path_factory.mktemp("outliers") / "art"
    with ArtifactWriter(out, stage="test-outliers", parent=tiny_onnx) as w:
        w.copy_tokenizer(tiny_onnx)
        onnx.save(model, str(w.dir / "model.onnx"))
        w.set_model("model.onnx", "onnx", tiny_onnx.inputs, tiny_onnx.outputs, precision="fp32")
    return w.artifact


def test_rewrites_keep_the_fp32_function(outlier_model):
    model = onnx.load(str(outlier_model.model_path))
    roles = node_roles(model)
    # 2 layers x (Q, K, V, attention output, FFN in, FFN out) in the unfused export
    assert sorted(roles.values()).count("ffn-in") == 2 and sorted(roles.values()).count("ffn-out") == 2
    assert len(roles) == 12
    feeds = _feeds(outlier_model, TEXTS[:12])
    before = _run(model, feeds)
    maxima = channel_absmax(model, feeds, list(roles))
    # the blown-up channels are the largest inputs of the MatMuls fed by a LayerNorm
    ffn_in = next(n for n, r in roles.items() if r == "ffn-in")
    assert set(np.argsort(maxima[ffn_in])[-3:]) == {3, 11, 20}
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    rows = smooth_model(rewritten, maxima, alpha=0.5)
    assert [r["node"] for r in rows] == list(roles)
    first = split_first_token(rewritten, {n for n, r in roles.items() if r.startswith("ffn")})
    per_token_scaling(rewritten, set(roles))
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Concat") >= 4 and ops.count("ReduceMax") >= 12 and len(first) == 4
    after = _run(rewritten, feeds)
    for a, b in zip(before, after):  # within 1e-4, relative for the 25x outlier channels of the hidden state
        assert np.abs(a[-1] - b[-1]).max() <= 1e-4  # the sentence embedding
        for x, y in zip(a, b):
            assert np.abs(x - y).max() <= 1e-4 * max(1.0, float(np.abs(x).max()))


def _cos_min(art, parent):
    return float(cosine_rows(Predictor(art).encode(TEXTS), Predictor(parent).encode(TEXTS)).min())


def test_smoothing_is_recorded_and_brings_int8_closer_on_outlier_channels(outlier_model, tmp_path):
    base = {"mode": "int8-dynamic", "per_channel": True}
    plain = run_stage("quantize", outlier_model, base, tmp_path / "plain")
    smoothed = run_stage("quantize", outlier_model, {**base, "calibration_size": 48, "smooth_alpha": 0.5,
                                                     "smooth_roles": ["ffn-in", "other"]}, tmp_path / "smooth")
    rep = smoothed.lineage["report"]["outliers"]
    assert rep["smoothing"]["alpha"] == 0.5 and rep["smoothing"]["roles"] == ["ffn-in", "other"]
    assert len(rep["smoothing"]["smoothed"]) == 10  # 2 x (Q, K, V, attention output, FFN in)
    assert all(r["scale_max"] > 1.0 for r in rep["smoothing"]["smoothed"])
    assert rep["fp32_max_change"] <= 1e-4
    assert smoothed.lineage["params"]["smooth_alpha"] == 0.5
    plain_cos, smooth_cos = _cos_min(plain, outlier_model), _cos_min(smoothed, outlier_model)
    assert smooth_cos >= plain_cos and 1 - smooth_cos < 0.7 * (1 - plain_cos), (plain_cos, smooth_cos)


def test_first_token_and_per_token_are_recorded_and_searchable(outlier_model, tmp_path):
    art = run_stage("quantize", outlier_model, {"mode": "int8-dynamic", "first_token_fp32": True,
                                                "per_token": True, "calibration_size": 48,
                                                "accuracy_target": "cos_min=0.5"}, tmp_path / "aa")
    rep = art.lineage["report"]
    assert len(rep["outliers"]["first_token_fp32"]) == 4 and len(rep["outliers"]["per_token"]) == 12
    assert rep["outliers"]["fp32_max_change"] <= 1e-4
    # the fp32 first-token MatMuls are not search candidates; the 12 int8 ones are
    assert rep["accuracy_search"]["candidates"] == 12
    q = onnx.load(str(art.model_path))
    assert sum(n.name.endswith("_first_token") and n.op_type == "MatMul" for n in q.graph.node) == 4
    assert _cos_min(art, outlier_model) >= 0.5


def test_bad_outlier_settings_are_user_errors(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="smooth_alpha' must be between 0 and 1"):
        run_stage("quantize", tiny_onnx, {"smooth_alpha": 1.5}, tmp_path / "a")
    with pytest.raises(UserError, match="smooth_roles' must name roles among"):
        run_stage("quantize", tiny_onnx, {"smooth_alpha": 0.5, "smooth_roles": ["qkv"]}, tmp_path / "b")
    with pytest.raises(UserError, match="no operator has a role in"):
        run_stage("quantize", tiny_onnx, {"smooth_alpha": 0.5, "smooth_roles": ["attention"]}, tmp_path / "c")
    with pytest.raises(UserError, match="--per-token applies to --mode int8-dynamic only"):
        run_stage("quantize", tiny_onnx, {"mode": "int8-static", "per_token": True}, tmp_path / "d")
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_roles_in_the_fused_graph(tiny_optimized):
    # after 'optimize' the attention output projection reaches the next FFN's GELU through SkipLayerNormalization
    # and the FFN input MatMul; it must not be taken for an FFN input (first-token / per-token work is costly)
    fused = tiny_optimized
    model = onnx.load(str(fused.model_path))
    roles = node_roles(model)
    layers = int(fused.model_info["num_hidden_layers"])
    assert sorted(roles.values()) == sorted(["attention", "ffn-in", "ffn-out", "other"] * layers)
    ops = {n.name: n.op_type for n in model.graph.node}
    assert all(ops[n] == "Attention" for n, r in roles.items() if r == "attention")
    consumers = {i: n.op_type for n in model.graph.node for i in n.input}
    # an FFN input MatMul feeds the (fused) GELU directly; the attention output feeds SkipLayerNormalization
    assert all(consumers[next(n for n in model.graph.node if n.name == name).output[0]] in ("BiasGelu", "Gelu")
               for name, r in roles.items() if r == "ffn-in")
