"""bertopt's MPNet attention fusion (``bertopt.onnx_graph.fusions.mpnet``): each layer's attention becomes one
``com.microsoft.MultiHeadAttention`` whose ``attention_bias`` (relative position bias + padding mask) is computed
once; the fused graph answers as the export does on every MPNet task head, and int8 / fp16 made from it keep
their fidelity."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bertopt.cosine import cosine_rows
from bertopt.data import corpus, mixed_text
from bertopt.onnx_graph.fusions import apply_fusion
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.tiny_models import build_tiny_family_model

# short sentences and paragraphs together, so every batch is padded (mixed lengths)
TEXTS = [t for t in corpus() if t][:24] + mixed_text()[:8]
LAYERS = 2
# same floors as tests/test_families_pipeline.py
FLOORS = {"int8": 0.93, "fp16": 0.999}


def _ops(art) -> list[str]:
    return [n.op_type for n in onnx.load(str(art.model_path), load_external_data=False).graph.node]


def _outputs(art, texts, pairs=None) -> dict[str, np.ndarray]:
    """Every graph output over ``texts`` (and ``pairs``), batches of 8 padded to their longest text."""
    pred = Predictor(art, provider="cpu")
    enc = pred.tokenize(texts, pairs)
    got: dict[str, list] = {}
    for start in range(0, len(enc), 8):
        feeds, _ = pred.feeds_for(enc[start:start + 8])
        for name, value in zip(pred.output_names, pred.session.run(pred.output_names, feeds)):
            got.setdefault(name, []).append(value)
    return {k: v for k, v in got.items()}


@pytest.mark.parametrize("task", ["embedding", "classification", "token-classification", "rerank",
                                  "sparse-embedding"])
def test_fused_attention_matches_the_export_on_every_head(task, tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "mpnet", task=task, layers=LAYERS, hidden=64, heads=4)
    onnx_art = run_stage("export", hf, {}, tmp_path / "onnx")
    opt = run_stage("optimize", onnx_art, {}, tmp_path / "opt")

    report = opt.manifest["lineage"]["report"]
    assert report["fused_ops"]["MultiHeadAttention"] == LAYERS
    assert report["attention_fusion"] == "mpnet"
    ops = _ops(opt)
    assert ops.count("MultiHeadAttention") == LAYERS
    assert "Softmax" not in ops  # no unfused attention left behind
    assert report["max_abs_diff_vs_parent"] <= 1e-4

    pairs = [TEXTS[-1 - i] for i in range(len(TEXTS))] if task == "rerank" else None
    want, got = _outputs(onnx_art, TEXTS, pairs), _outputs(opt, TEXTS, pairs)
    assert set(got) == set(want)
    for name in want:
        for w, g in zip(want[name], got[name]):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=1e-4, err_msg=f"{task}: {name}")


def test_fused_graph_quantizes_and_keeps_fidelity(tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "mpnet", layers=LAYERS, pooling="mean", normalize=True)
    ref = hf_reference(hf).encode(TEXTS)
    opt = run_stage("optimize", run_stage("export", hf, {}, tmp_path / "onnx"), {}, tmp_path / "opt")
    np.testing.assert_allclose(Predictor(opt, provider="cpu").encode(TEXTS), ref, atol=1e-4)

    int8 = run_stage("quantize", opt, {"mode": "int8-dynamic"}, tmp_path / "int8")
    ops = _ops(int8)
    # the attention stays float; its Q/K/V and output projections are quantised
    assert ops.count("MultiHeadAttention") == LAYERS
    assert ops.count("MatMulInteger") == 6 * LAYERS  # q, k, v, output, FFN in, FFN out
    per_token = run_stage("quantize", opt, {"mode": "int8-dynamic", "per_token": True}, tmp_path / "int8-pt")
    fp16 = run_stage("quantize", opt, {"mode": "fp16"}, tmp_path / "fp16")
    assert _ops(fp16).count("MultiHeadAttention") == LAYERS
    for name, art in [("int8", int8), ("int8", per_token), ("fp16", fp16)]:
        cos = cosine_rows(Predictor(art, provider="cpu").encode(TEXTS), ref)
        assert cos.min() >= FLOORS[name], (name, float(cos.min()))


def test_graph_it_does_not_recognise_is_left_unchanged(tiny_optimized, tmp_path):
    from onnxruntime.transformers.optimizer import optimize_model

    # BERT after ONNX Runtime's fusions: its attention is already one Attention node, nothing for MPNet's fusion
    model = onnx.load(str(tiny_optimized.model_path))
    before = model.SerializeToString()
    assert apply_fusion("mpnet", model, 2, 32) == {}
    assert model.SerializeToString() == before
    # MPNet's pattern with heads of another size than the graph's (4 x 16): MultiHeadAttention would be wrong
    hf = build_tiny_family_model(tmp_path / "hf", "mpnet", layers=LAYERS, hidden=64, heads=4)
    export = optimize_model(str(run_stage("export", hf, {}, tmp_path / "onnx").model_path), model_type="bert",
                            num_heads=4, hidden_size=64, opt_level=1).model  # what the fusion runs after
    before = export.SerializeToString()
    assert apply_fusion("mpnet", export, 8, 64) == {}
    assert export.SerializeToString() == before
    assert apply_fusion("mpnet", export, 4, 64) == {"MultiHeadAttention": LAYERS}
