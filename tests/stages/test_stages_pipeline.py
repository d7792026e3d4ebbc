"""Every stage on a tiny random BERT: export matches PyTorch, prune/optimize keep outputs, quantize stays finite."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference

TEXTS = ["hello world", "the cat sat on the mat", "", "a dog is running fast!", "bert model text " * 30]


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def test_export_matches_pytorch_and_names_dynamic_axes(tiny_onnx, tiny_hf):
    model = onnx.load(str(tiny_onnx.model_path))
    assert model.opset_import[0].version >= 17
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    ours = Predictor(tiny_onnx).run(TEXTS)
    ref = hf_reference(tiny_hf).run(TEXTS)
    assert _max_diff(ours["last_hidden_state"], ref["last_hidden_state"]) <= 1e-4
    assert np.max(np.abs(ours["sentence_embedding"] - ref["sentence_embedding"])) <= 1e-4
    # mean pooling + normalisation inside the graph
    assert np.allclose(np.linalg.norm(ours["sentence_embedding"], axis=1), 1.0, atol=1e-5)
    # different texts give different embeddings (the model is not degenerate)
    assert np.min(np.abs(ours["sentence_embedding"][0] - ours["sentence_embedding"][1]).max()) > 1e-3


def test_export_classifier_gives_logits(tmp_path):
    from bertopt.tiny_models import build_tiny_hf_bert

    src = build_tiny_hf_bert(tmp_path / "cls", classifier=True)
    art = run_stage("export", src, {}, tmp_path / "onnx")
    assert [o["name"] for o in art.outputs] == ["logits"]
    logits = Predictor(art).encode(TEXTS)
    ref = hf_reference(src).encode(TEXTS)
    assert logits.shape == (len(TEXTS), 3)
    assert np.max(np.abs(logits - ref)) <= 1e-4


def test_export_imports_an_onnx_file_with_its_tokenizer(tiny_onnx, tmp_path):
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(tiny_onnx.tokenizer_path, folder)
    shutil.copy(tiny_onnx.model_path, folder / "encoder.onnx")
    art = run_stage("export", folder / "encoder.onnx", {"max_seq_len": 48}, tmp_path / "imported")
    assert art.model_info["max_position_embeddings"] == 64  # read from the position embedding table
    assert art.source["kind"] == "onnx"
    got = Predictor(art).run(TEXTS)["sentence_embedding"]
    assert np.allclose(got, Predictor(tiny_onnx).encode(TEXTS), atol=1e-6)


def test_prune_keeps_only_requested_outputs_and_reports_counts(tiny_onnx, tmp_path):
    art = run_stage("prune", tiny_onnx, {"outputs": "sentence_embedding"}, tmp_path / "p")
    rep = art.lineage["report"]
    assert rep["after"]["nodes"] < rep["before"]["nodes"]
    assert "Constant" not in rep["after"]["ops"]  # folded into initializers
    assert [o["name"] for o in art.outputs] == ["sentence_embedding"]
    model = onnx.load(str(art.model_path))
    assert [o.name for o in model.graph.output] == ["sentence_embedding"]
    assert np.allclose(Predictor(art).encode(TEXTS), Predictor(tiny_onnx).encode(TEXTS), atol=1e-5)


def test_prune_rejects_unknown_output(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="unknown output 'pooled'"):
        run_stage("prune", tiny_onnx, {"outputs": "pooled"}, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_optimize_fuses_bert_ops_and_keeps_outputs(tiny_onnx, tmp_path):
    art = run_stage("optimize", tiny_onnx, {}, tmp_path / "o")
    fused = art.lineage["report"]["fused_ops"]
    assert fused["Attention"] == 2 and fused["SkipLayerNormalization"] == 4
    assert fused["EmbedLayerNormalization"] == 1
    assert art.lineage["report"]["max_abs_diff_vs_parent"] <= 1e-4
    ops = {n.op_type for n in onnx.load(str(art.model_path)).graph.node}
    assert "Attention" in ops and "Softmax" not in ops


def test_fp16_keeps_io_fp32_and_sensitive_ops_fp32(tiny_optimized, tmp_path):
    art = run_stage("quantize", tiny_optimized, {"mode": "fp16"}, tmp_path / "f")
    assert art.precision == "fp16"
    model = onnx.load(str(art.model_path))
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.INT64 for i in model.graph.input)
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in model.graph.output)
    weights = [i for i in model.graph.initializer if len(i.dims) == 2 and i.dims[0] > 4]
    assert any(w.data_type == onnx.TensorProto.FLOAT16 for w in weights)
    kept = art.lineage["report"]["kept_fp32_nodes"]
    assert any("SkipLayerNorm" in k or "LayerNorm" in k for k in kept)
    stats = art.lineage["report"]["accuracy_vs_parent"]["sentence_embedding"]
    assert stats["nan_or_inf"] == 0 and stats["cos_min"] > 0.999
    emb = Predictor(art).encode(corpus())
    assert np.isfinite(emb).all()


def test_fp16_on_unfused_graph_keeps_mask_path_fp32(tiny_onnx, tmp_path):
    """The additive attention mask (about -3.4e38) overflows fp16: its nodes must stay fp32."""
    from bertopt.stages.quantize.fp16 import mask_path_nodes

    model = onnx.load(str(tiny_onnx.model_path))
    assert mask_path_nodes(model.graph), "the exported graph has a mask path"
    art = run_stage("quantize", tiny_onnx, {"mode": "fp16"}, tmp_path / "f")
    emb = Predictor(art).encode(TEXTS)
    assert np.isfinite(emb).all()
    assert np.allclose(emb, Predictor(tiny_onnx).encode(TEXTS), atol=5e-3)


def test_int8_dynamic_per_channel_and_exclusions(tiny_optimized, tmp_path):
    art = run_stage("quantize", tiny_optimized, {"mode": "int8-dynamic"}, tmp_path / "q")
    ops = {n.op_type for n in onnx.load(str(art.model_path)).graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops or "QAttention" in ops
    assert art.precision == "int8-dynamic"
    cos = art.lineage["report"]["accuracy_vs_parent"]["sentence_embedding"]["cos_min"]
    # measured 0.947 on the built-in corpus in the Predictor's length buckets (0.958 in the looser ones before
    # 2026-11-26: dynamic int8's error depends on its batch-mates)
    assert 0.94 < cos <= 1.0
    matmuls = [n.name for n in onnx.load(str(tiny_optimized.model_path)).graph.node if n.op_type == "MatMul"]
    kept = run_stage("quantize", tiny_optimized, {"mode": "int8-dynamic", "exclude_nodes": matmuls},
                     tmp_path / "q2")
    q_ops = [n.op_type for n in onnx.load(str(kept.model_path)).graph.node]
    assert q_ops.count("MatMul") == len(matmuls)
    assert kept.lineage["report"]["kept_fp32_nodes"] == matmuls


def test_stage_params_are_checked(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="'mode' must be one of fp16, int8-dynamic, int8-static"):
        run_stage("quantize", tiny_onnx, {"mode": "int4"}, tmp_path / "x")
    with pytest.raises(UserError, match="unknown parameter 'bits'"):
        run_stage("quantize", tiny_onnx, {"bits": 4}, tmp_path / "x")
    with pytest.raises(UserError, match="unknown stage 'distill'"):
        run_stage("distill", tiny_onnx, {}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_tiny_fixture_tokenizer_sees_real_words(tiny_onnx):
    pred = Predictor(tiny_onnx)
    tokens = pred.tokenizer.encode("hello world the cat").tokens
    assert tokens == ["[CLS]", "hello", "world", "the", "cat", "[SEP]"]
