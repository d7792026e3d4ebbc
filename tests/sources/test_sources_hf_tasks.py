"""Task detection and head export: each head reaches the artifact with the contract's outputs and manifest,
equal to the original model run by its own library (transformers / sentence-transformers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertopt.artifact import Artifact
from bertopt.data import corpus
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import read_model_info
from bertopt.tiny_models import NER_LABELS, build_tiny_family_model

TEXTS = [t for t in corpus() if t][:24]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(family, task, **kw):
        key = (family, task, tuple(sorted(kw.items())))
        if key not in built:
            root = tmp_path_factory.mktemp(f"{family}-{task}")
            hf = build_tiny_family_model(root / "hf", family, task, **kw)
            built[key] = (hf, run_stage("export", hf, {}, root / "onnx"))
        return built[key]

    return get


def _torch_feeds(art, texts, pairs=None):
    import torch

    pred = Predictor(art, provider="cpu")
    feeds, lengths = pred.feeds_for(pred.tokenize(texts, pairs))
    return {k: torch.from_numpy(v) for k, v in feeds.items()}, lengths, pred


@pytest.mark.parametrize("family", ["bert", "roberta", "deberta-v2"])
def test_classification_head_exported_with_labels(models, family):
    import torch
    from transformers import AutoModelForSequenceClassification

    hf, art = models(family, "classification")
    info = art.model_info
    assert info["task"] == "classification" and info["family"] == family
    assert info["id2label"] == {"0": "class_a", "1": "class_b", "2": "class_c"}
    assert info["problem_type"] == "single_label_classification" and info["pair_input"] is False
    assert [(o["name"], o["kind"], o["shape"]) for o in art.outputs] == [("logits", "logits", ["batch", 3])]
    feeds, _, pred = _torch_feeds(art, TEXTS)
    with torch.no_grad():
        want = AutoModelForSequenceClassification.from_pretrained(hf).eval()(**feeds).logits.numpy()
    got = pred.run(TEXTS)["logits"]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert len(set(got.argmax(1))) > 1  # a random head that always says the same class would hide a dropped head


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "electra"])
def test_token_classification_head_is_kept(models, family):
    import torch
    from transformers import AutoModelForTokenClassification

    hf, art = models(family, "token-classification")
    info = art.model_info
    assert info["task"] == "token-classification"
    assert [info["id2label"][str(i)] for i in range(len(NER_LABELS))] == NER_LABELS
    assert [(o["name"], o["kind"]) for o in art.outputs] == [("logits", "token-logits")]
    assert art.outputs[0]["shape"] == ["batch", "sequence", len(NER_LABELS)]
    feeds, lengths, pred = _torch_feeds(art, TEXTS)
    with torch.no_grad():
        want = AutoModelForTokenClassification.from_pretrained(hf).eval()(**feeds).logits.numpy()
    got = pred.run(TEXTS)["logits"]
    for row, (g, n) in enumerate(zip(got, lengths)):
        assert g.shape == (n, len(NER_LABELS))
        np.testing.assert_allclose(g, want[row, :n], atol=1e-4)


@pytest.mark.parametrize("family", ["bert", "roberta", "mpnet"])
def test_cross_encoder_is_a_pair_reranker_equal_to_sentence_transformers(models, family):
    from sentence_transformers import CrossEncoder

    hf, art = models(family, "rerank")
    info = art.model_info
    assert info["task"] == "rerank" and info["pair_input"] is True and info["score_activation"] == "sigmoid"
    assert [(o["name"], o["kind"], o["shape"]) for o in art.outputs] == [("logits", "score", ["batch", 1])]
    queries, passages = TEXTS[:12], TEXTS[12:24]
    want = CrossEncoder(str(hf), device="cpu").predict(list(zip(queries, passages)), batch_size=4)
    logits = Predictor(art, provider="cpu").run(queries, passages)["logits"][:, 0]
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), want, atol=1e-5)
    # pairs change the score: the second segment reaches the model
    alone = Predictor(art, provider="cpu").run(queries, list(reversed(passages)))["logits"][:, 0]
    assert np.max(np.abs(alone - logits)) > 1e-3


@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta"])
def test_splade_is_a_sparse_embedding_equal_to_sparse_encoder(models, family):
    from sentence_transformers import SparseEncoder

    hf, art = models(family, "sparse-embedding")
    info = art.model_info
    assert info["task"] == "sparse-embedding"
    out = art.outputs[0]
    assert (out["name"], out["kind"], out["shape"]) == ("sparse_embedding", "sparse", ["batch", info["vocab_size"]])
    want = SparseEncoder(str(hf), device="cpu").encode(TEXTS, batch_size=8, convert_to_tensor=True).to_dense().numpy()
    got = Predictor(art, provider="cpu").run(TEXTS)["sparse_embedding"]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert (got >= 0).all() and (got == 0).any()  # log(1 + relu(.)): non-negative, exact zeros


def test_task_override_and_refusal(models, tmp_path, cli, capsys):
    hf, _ = models("bert", "classification")
    art = run_stage("export", hf, {"task": "embedding"}, tmp_path / "as-embedding")
    assert art.model_info["task"] == "embedding"
    assert [o["kind"] for o in art.outputs] == ["token", "embedding"]
    # a plain encoder has no token-classification head: refused before any work, one line, nothing written
    plain, _ = models("bert", "embedding")
    capsys.readouterr()  # the fixtures' own output
    code, out, err = cli("export", plain, "--out", tmp_path / "ner", "--task", "token-classification")
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "no token-classification head" in err and "BertModel" in err and "embedding" in err
    assert not (tmp_path / "ner").exists() and not list(tmp_path.glob(".ner*"))


def test_masked_lm_without_splade_module_needs_the_task_flag(tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "bert", "sparse-embedding")
    (hf / "modules.json").unlink()
    assert read_model_info(hf)["task"] == "embedding"
    info = read_model_info(hf, task="sparse-embedding")
    assert info["task"] == "sparse-embedding" and info["sparse_pooling"] == "max"


def test_old_manifest_task_names_map_on_load(models, tmp_path):
    import shutil

    _, art = models("bert", "classification")
    old = tmp_path / "old"
    shutil.copytree(art.path, old)
    manifest = json.loads((old / "bertopt.json").read_text())
    for key in ("family", "pair_input", "problem_type"):
        manifest["model"].pop(key, None)
    manifest["model"]["task"] = "classifier"
    (old / "bertopt.json").write_text(json.dumps(manifest))
    info = Artifact.load(old).model_info
    assert (info["task"], info["family"], info["pair_input"], info["problem_type"]) == \
        ("classification", "bert", False, "single_label_classification")
    manifest["model"]["task"] = "sentence-embedding"
    (old / "bertopt.json").write_text(json.dumps(manifest))
    assert Artifact.load(old).model_info["task"] == "embedding"
