"""bertopt's DeBERTa-v2/v3 attention fusion (bertopt.onnx_graph.fusions.deberta): every disentangled attention block
is rewritten (c2p and p2c by whole-block Gathers through one shared index, no GatherElements or per-layer index
copies), the fused artifact computes what the export computes for every real token on padded batches of every
shape and for every task head, and int8/fp16 built from it keep their fidelity."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bertopt.cosine import cosine_rows
from bertopt.data import corpus
from bertopt.onnx_graph.fusions import apply_fusion
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.tiny_models import build_tiny_family_model

TEXTS = [t for t in corpus() if t][:64]
LAYERS = 2
# the floors of tests/test_families_pipeline.py
FLOORS = {"fp16": 0.999, "int8": 0.93}


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _padded_feeds(session, batch: int, seq: int, lengths: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, seq), np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    ids = np.where(mask == 1, rng.integers(5, 700, (batch, seq)), 0).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in {i.name for i in session.get_inputs()}:
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deberta-fusion")
    hf = build_tiny_family_model(tmp / "hf", "deberta-v2", layers=LAYERS)
    onnx_art = run_stage("export", hf, {}, tmp / "onnx")
    return hf, onnx_art, run_stage("optimize", onnx_art, {}, tmp / "opt"), tmp


@pytest.mark.parametrize("task", ["embedding", "classification", "token-classification", "rerank",
                                  "sparse-embedding"])
def test_every_layer_fused_and_equal_to_export(task, tmp_path, embedding):
    if task == "embedding":
        _, onnx_art, opt, _ = embedding
    else:
        hf = build_tiny_family_model(tmp_path / "hf", "deberta-v2", task, layers=LAYERS)
        onnx_art = run_stage("export", hf, {}, tmp_path / "onnx")
        opt = run_stage("optimize", onnx_art, {}, tmp_path / "opt")
    before, ops = _ops(onnx_art.model_path), _ops(opt.model_path)
    assert before["GatherElements"] == 2 * LAYERS and before["Tile"] > 0
    # the export's attention is gone, not left beside the rewrite: one Softmax and two Gathers per layer
    assert ops["Softmax"] == LAYERS and ops["GatherElements"] == 0 and ops["Tile"] == 0
    model = onnx.load(str(opt.model_path))
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    score_gathers = [n for n in model.graph.node if n.op_type == "Gather" and producer.get(n.input[0]) == "Transpose"]
    assert len(score_gathers) == 2 * LAYERS
    assert len({n.input[1] for n in score_gathers}) == 2  # c2p's and p2c's index, each built once per model
    assert opt.manifest["lineage"]["report"]["fused_ops"]["DisentangledAttention"] == LAYERS
    assert opt.manifest["lineage"]["report"]["attention_fusion"] == "deberta"
    ref = ort.InferenceSession(str(onnx_art.model_path), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(opt.model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    assert names == [o.name for o in got.get_outputs()]
    # dynamic batch and sequence, mixed lengths (padding, one fully real row), the default max length
    for batch, seq, lengths in [(1, 7, [7]), (3, 19, [19, 4, 11]), (5, 64, [64, 1, 33, 50, 2]),
                                (2, 512, [512, 100])]:
        feeds = _padded_feeds(ref, batch, seq, lengths, seed=seq)
        for name, a, b in zip(names, ref.run(names, feeds), got.run(names, feeds)):
            assert a.shape == b.shape
            # every position, padding rows included: dynamic int8 takes its activation range over the whole batch
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=0, err_msg=f"{task} {name} {batch}x{seq}")


def test_int8_and_fp16_from_the_fused_artifact_keep_fidelity(embedding):
    hf, _, opt, tmp = embedding
    ref = hf_reference(hf).encode(TEXTS)
    np.testing.assert_allclose(Predictor(opt, provider="cpu").encode(TEXTS), ref, atol=1e-4)
    for name, config in [("int8", {"mode": "int8-dynamic"}), ("fp16", {"mode": "fp16"})]:
        art = run_stage("quantize", opt, config, tmp / name)
        assert _ops(art.model_path)["Softmax"] == LAYERS and _ops(art.model_path)["GatherElements"] == 0
        # ORT dynamic int8 takes one activation scale per batch, so its error depends on the batch plan: every
        # text in one batch, the same whatever the Predictor's length buckets are
        got = Predictor(art, provider="cpu", length_bucketing=False, batch_size=len(TEXTS)).encode(TEXTS)
        assert np.isfinite(got).all()
        cos = cosine_rows(got, ref)
        assert cos.min() >= FLOORS[name], (name, float(cos.min()))


@pytest.mark.slow
def test_per_token_static_and_accuracy_aware_int8_as_faithful_as_unfused(embedding, monkeypatch):
    import bertopt.onnx_graph.fusions as fusions

    hf, onnx_art, opt, tmp = embedding
    ref = hf_reference(hf).encode(TEXTS)
    monkeypatch.setattr(fusions, "apply_fusion", lambda *a, **k: {})
    plain = run_stage("optimize", onnx_art, {}, tmp / "opt-unfused")
    monkeypatch.undo()
    assert _ops(plain.model_path)["GatherElements"] == 2 * LAYERS
    for name, config in [("pt", {"mode": "int8-dynamic", "per_token": True}), ("static", {"mode": "int8-static"}),
                         ("aware", {"mode": "int8-dynamic", "accuracy_target": "cos_min=0.99"})]:
        fused = run_stage("quantize", opt, config, tmp / name)
        unfused = run_stage("quantize", plain, config, tmp / f"{name}-unfused")
        cos = cosine_rows(Predictor(fused, provider="cpu").encode(TEXTS), ref).min()
        cos_unfused = cosine_rows(Predictor(unfused, provider="cpu").encode(TEXTS), ref).min()
        assert cos >= min(cos_unfused - 0.01, FLOORS["int8"]), (name, cos, cos_unfused)


def test_openvino_compile_of_the_fused_artifact_is_refused_as_for_bert(embedding):
    from bertopt.errors import UserError

    _, _, opt, tmp = embedding
    with pytest.raises(UserError, match="exported"):
        run_stage("compile", opt, {}, tmp / "ov")


def test_unrecognised_graph_is_left_unchanged(tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "bert", layers=LAYERS)
    art = run_stage("export", hf, {}, tmp_path / "onnx")
    model = onnx.load(str(art.model_path))
    before = model.SerializeToString()
    assert apply_fusion("deberta", model, 4, 32) == {}
    assert model.SerializeToString() == before


def test_half_matching_deberta_graph_is_left_unchanged(embedding):
    _, onnx_art, _, _ = embedding
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(str(onnx_art.model_path), model_type="bert", num_heads=4, hidden_size=32,
                           opt_level=0, use_gpu=False, only_onnxruntime=False).model
    # break one layer's c2p term: the pattern no longer holds there, so nothing is rewritten anywhere
    ge = next(n for n in model.graph.node if n.op_type == "GatherElements")
    ge.op_type = "Gather"
    before = model.SerializeToString()
    assert apply_fusion("deberta", model, 4, 32) == {}
    assert model.SerializeToString() == before
