"""The real all-MiniLM-L6-v2 through every stage (slow: ~1 minute)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bertopt.data import corpus
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources import builtin_model_path
from bertopt.sources.hf import hf_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pytorch_outputs():
    return hf_reference(builtin_model_path("minilm")).run(corpus())


def test_builtin_minilm_is_found_offline():
    path = builtin_model_path("minilm")
    assert (path / "model.safetensors").exists() and (path / "modules.json").exists()


def test_export_matches_pytorch_on_the_whole_corpus(minilm_onnx, pytorch_outputs):
    assert minilm_onnx.model_info["pooling"] == "mean" and minilm_onnx.model_info["normalize"] is True
    assert minilm_onnx.model_info["max_seq_len"] == 256
    ours = Predictor(minilm_onnx).run(corpus())
    emb_diff = np.max(np.abs(ours["sentence_embedding"] - pytorch_outputs["sentence_embedding"]))
    tok_diff = max(float(np.max(np.abs(a - b))) for a, b in
                   zip(ours["last_hidden_state"], pytorch_outputs["last_hidden_state"]))
    assert emb_diff <= 1e-4 and tok_diff <= 1e-4


def test_optimize_fuses_all_six_layers(minilm_optimized):
    fused = minilm_optimized.lineage["report"]["fused_ops"]
    assert fused["Attention"] == 6 and fused["SkipLayerNormalization"] == 12
    assert fused["EmbedLayerNormalization"] == 1 and fused.get("BiasGelu", 0) + fused.get("Gelu", 0) == 6


def test_int8_dynamic_per_channel_is_close_and_smaller(minilm_int8, minilm_optimized, pytorch_outputs):
    # the 47 MB word-embedding table stays fp32 (it is a lookup, not a MatMul); the encoder weights shrink 4x
    assert minilm_int8.size_bytes() < 0.7 * minilm_optimized.size_bytes()
    model = onnx.load(str(minilm_int8.model_path))
    int8_weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert len(int8_weights) >= 6 * 4  # QKV (packed) / attention output / two FFN matrices per layer
    emb = Predictor(minilm_int8).encode(corpus())
    ref = pytorch_outputs["sentence_embedding"]
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    # measured mean / min 0.992 / 0.960 with AVX-512 VNNI, 0.992 / 0.951 on an AVX2-only CPU
    assert cos.mean() > 0.99 and cos.min() > 0.945


def test_fp16_has_no_nan_and_keeps_fidelity(minilm_optimized, tmp_path, pytorch_outputs):
    art = run_stage("quantize", minilm_optimized, {"mode": "fp16"}, tmp_path / "fp16")
    emb = Predictor(art).encode(corpus())
    assert np.isfinite(emb).all()
    ref = pytorch_outputs["sentence_embedding"]
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.9999
    model = onnx.load(str(art.model_path))
    fp32_layernorms = [n for n in model.graph.node if n.op_type == "SkipLayerNormalization"]
    assert fp32_layernorms and set(n.name for n in fp32_layernorms) <= set(art.lineage["report"]["kept_fp32_nodes"])


def test_prune_to_sentence_embedding_only(minilm_onnx, tmp_path):
    art = run_stage("prune", minilm_onnx, {"outputs": "sentence_embedding"}, tmp_path / "p")
    assert [o["name"] for o in art.outputs] == ["sentence_embedding"]
    rep = art.lineage["report"]
    assert rep["after"]["nodes"] < rep["before"]["nodes"]


def test_accuracy_aware_int8_for_openvino_meets_the_issue_target(minilm_onnx, minilm_int8, tmp_path,
                                                                  pytorch_outputs):
    """Issue 4's accuracy half on the real model: accuracy-aware int8 at cosine min >= 0.995 against PyTorch fp32
    on the built-in corpus, where plain ONNX Runtime int8 gives ~0.96 (the speed half is
    benchmarks/accuracy_aware.py: ratios are never timed in tests)."""
    art = run_stage("quantize", minilm_onnx, {"mode": "int8-dynamic", "runtime": "openvino",
                                              "op_types": ["MatMul", "Gather"], "weight_rounding": "gptq",
                                              "accuracy_target": "cos_min=0.997"}, tmp_path / "ov-int8")
    assert art.size_bytes() < 0.3 * minilm_onnx.size_bytes()  # every weight and embedding table int8
    model = onnx.load(str(art.model_path))
    int8_weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert len(int8_weights) >= 6 * 6 - len(art.lineage["report"]["kept_fp32_nodes"])  # Q K V O FFN-in FFN-out
    ref = pytorch_outputs["sentence_embedding"]

    def cos_min(emb):
        return float(((emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)).min())

    assert cos_min(Predictor(art).encode(corpus())) >= 0.995
    assert cos_min(Predictor(minilm_int8).encode(corpus())) < 0.99  # the problem it solves
