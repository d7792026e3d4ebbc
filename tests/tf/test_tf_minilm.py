"""The real all-MiniLM-L6-v2 through the TensorFlow path (recipes/minilm-tf-fp16.yaml):
Keras BERT SavedModel -> freeze -> prune -> fp16 -> ONNX, each step checked, the result compared with the
TensorFlow original and with PyTorch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.tf]


@pytest.fixture(scope="module")
def minilm_tf_run(tmp_path_factory):
    """The recipe's stages (the recipe runner itself is exercised end to end by the Google-checkpoint recipe
    test; here the comparison is done below on the corpus, without the throughput passes)."""
    from types import SimpleNamespace

    from bertopt.recipes import load_recipe
    from bertopt.registry import get_stage, resolve_input

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "minilm-tf-fp16.yaml")
    out = tmp_path_factory.mktemp("minilm-tf")
    current, artifacts = recipe.model, []
    for i, (name, config) in enumerate(recipe.stages):
        current = get_stage(name).run(resolve_input(current), config, out / f"{i + 1:02d}-{name}")
        artifacts.append(current)
    return SimpleNamespace(artifacts=artifacts, final=artifacts[-1])


def test_minilm_tf_path_each_stage(minilm_tf_run):
    savedmodel, frozen, pruned, fp16, onnx_art = minilm_tf_run.artifacts
    assert savedmodel.lineage["report"]["max_abs_diff_vs_pytorch"] <= 1e-4
    assert frozen.lineage["report"]["variables_folded"] == 5 + 6 * 16
    assert frozen.lineage["report"]["max_abs_diff_vs_source"] <= 1e-6
    steps = pruned.lineage["report"]["steps"]
    assert steps["grappler_constfold_arithmetic"] < steps["frozen"]
    assert pruned.lineage["report"]["max_abs_diff_vs_parent"] <= 1e-5
    acc = fp16.lineage["report"]["accuracy_vs_parent"]["sentence_embedding"]
    assert acc["nan_or_inf"] == 0 and acc["cos_min"] > 0.9999
    assert onnx_art.model_format == "onnx" and onnx_art.precision == "fp16"
    for art in minilm_tf_run.artifacts:
        assert art.model_info["num_attention_heads"] == 12 and art.model_info["hidden_size"] == 384


def test_minilm_tf_path_vs_tf_original_and_pytorch(minilm_tf_run):
    from bertopt.data import corpus
    from bertopt.measure.compare import compare_runs
    from bertopt.runtime import Predictor
    from bertopt.sources import resolve_source
    from bertopt.sources.hf import hf_reference
    from bertopt.validate.reference import reference_predictor

    texts = corpus()
    tf_original = reference_predictor(minilm_tf_run.final)
    assert tf_original.session.backend == "tensorflow"
    final_pred = Predictor(minilm_tf_run.final)
    stats = compare_runs(final_pred.run(texts, outputs=["sentence_embedding"]),
                         tf_original.run(texts, outputs=["sentence_embedding"]), {"sentence_embedding": "embedding"})
    assert stats["sentence_embedding"]["nan_or_inf"] == 0 and stats["sentence_embedding"]["cos_min"] > 0.999
    final = final_pred.encode(texts)
    torch_emb = hf_reference(resolve_source("builtin:minilm").path).encode(texts)
    cos = (final * torch_emb).sum(1) / np.linalg.norm(final, axis=1) / np.linalg.norm(torch_emb, axis=1)
    assert cos.min() > 0.999
