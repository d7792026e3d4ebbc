"""ModernBERT's own attention fusion (bertopt.onnx_graph.fusions.modernbert): each rotary attention block becomes two
RotaryEmbedding + one MultiHeadAttention, the optimized artifact still equals the export on padded mixed-length
batches (longer than the local attention window) for every task head, and int8 / fp16 built from it keep the
fidelity the family pipeline test asks of them."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.onnx_graph.util import load_onnx
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.tiny_models import build_tiny_family_model

# mixed lengths: short texts padded next to long ones (beyond the tiny models' 16-token local attention window)
TEXTS = [t for t in corpus() if t][:40] + ["word " * 90, "a", "two words", " ".join(corpus()[:6])]
PAIRS = [t[::-1] or "x" for t in TEXTS]
LAYERS = 2


def _ops(art) -> collections.Counter:
    return collections.Counter(n.op_type for n in load_onnx(art.model_path).graph.node)


def _assert_same(a, b, pairs=None, atol=1e-4):
    got = Predictor(a, provider="cpu", batch_size=8).run(TEXTS, pairs=pairs)
    ref = Predictor(b, provider="cpu", batch_size=8).run(TEXTS, pairs=pairs)
    assert set(got) == set(ref)
    for name in ref:
        for x, y in zip(got[name], ref[name]) if isinstance(ref[name], list) else [(got[name], ref[name])]:
            np.testing.assert_allclose(x, y, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mb")
    hf = build_tiny_family_model(tmp / "hf", "modernbert", layers=LAYERS, max_seq_length=128)
    onnx = run_stage("export", hf, {}, tmp / "onnx")
    opt = run_stage("optimize", onnx, {}, tmp / "opt")
    return hf, onnx, opt, tmp


def test_every_layer_fused_and_equal_to_export(embedding):
    _, onnx, opt, _ = embedding
    ops = _ops(opt)
    assert ops["MultiHeadAttention"] == LAYERS
    assert ops["RotaryEmbedding"] == 2 * LAYERS
    assert ops["Softmax"] == 0 and ops["Neg"] == 0 and ops["Sin"] == 0  # no unfused rotary/attention left
    report = opt.manifest["lineage"]["report"]
    assert report["fused_ops"]["MultiHeadAttention"] == LAYERS
    assert report["attention_fusion"] == "modernbert"
    assert report["max_abs_diff_vs_parent"] <= 1e-4
    _assert_same(opt, onnx)


def test_int8_and_fp16_from_fused_artifact(tmp_path):
    """A tiny ModernBERT and the family pipeline test's texts; int8 of the fused graph is as close to PyTorch as
    int8 of the unfused export (q/k/v become three MatMuls, each quantised like the packed one)."""
    from bertopt.cosine import cosine_rows
    from bertopt.sources.hf import hf_reference

    texts = [t for t in corpus() if t][:64]
    hf = build_tiny_family_model(tmp_path / "hf", "modernbert", layers=LAYERS)
    ref = hf_reference(hf).encode(texts)
    onnx = run_stage("export", hf, {}, tmp_path / "onnx")
    opt = run_stage("optimize", onnx, {}, tmp_path / "opt")
    floors = {"int8": 0.93, "fp16": 0.999}
    arts = {"int8": run_stage("quantize", opt, {"mode": "int8-dynamic"}, tmp_path / "int8"),
            "fp16": run_stage("quantize", opt, {"mode": "fp16"}, tmp_path / "fp16")}
    cos = {}
    for name, art in arts.items():
        assert _ops(art)["MultiHeadAttention"] == LAYERS
        # ORT dynamic int8 takes one activation scale per batch, so its error depends on the batch plan: every
        # text in one batch, the same whatever the Predictor's length buckets are
        cos[name] = cosine_rows(Predictor(art, provider="cpu", length_bucketing=False,
                                          batch_size=len(texts)).encode(texts), ref)
        assert cos[name].min() >= floors[name], (name, float(cos[name].min()))
    unfused = run_stage("quantize", onnx, {"mode": "int8-dynamic"}, tmp_path / "int8-unfused")
    assert _ops(unfused)["MultiHeadAttention"] == 0
    unfused_cos = cosine_rows(Predictor(unfused, provider="cpu", length_bucketing=False,
                                        batch_size=len(texts)).encode(texts), ref)
    np.testing.assert_allclose(cos["int8"], unfused_cos, atol=1e-3)


def test_openvino_refuses_fused_artifact_like_fused_bert(embedding):
    _, _, opt, tmp = embedding
    with pytest.raises(UserError, match="MultiHeadAttention.*OpenVINO cannot read"):
        run_stage("compile", opt, {"runtime": "openvino"}, tmp / "ov")


@pytest.mark.parametrize("task", ["classification", "token-classification", "rerank", "sparse-embedding"])
def test_task_heads_equal_to_export(task, tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "modernbert", task, layers=LAYERS)
    onnx = run_stage("export", hf, {}, tmp_path / "onnx")
    opt = run_stage("optimize", onnx, {}, tmp_path / "opt")
    assert _ops(opt)["MultiHeadAttention"] == LAYERS
    _assert_same(opt, onnx, pairs=PAIRS if task == "rerank" else None)


def test_other_graph_left_unchanged(tmp_path):
    from onnxruntime.transformers.optimizer import optimize_model

    from bertopt.onnx_graph.fusions.modernbert import fuse

    hf = build_tiny_family_model(tmp_path / "hf", "bert", layers=LAYERS)
    onnx = run_stage("export", hf, {}, tmp_path / "onnx")
    for model in (load_onnx(onnx.model_path),
                  optimize_model(str(onnx.model_path), model_type="bert", num_heads=4, hidden_size=32,
                                 opt_level=0).model):
        before = model.SerializeToString()
        assert fuse(model, 4, 32) == {}
        assert model.SerializeToString() == before
