"""The runtime against references bertopt did not write.

``validate``'s default reference is bertopt's own export wrapper (``sources.hf.hf_reference``): a pooling or
truncation bug would sit on both sides and cancel out. Here the artifact is checked against the model's own
pipeline instead: sentence-transformers' ``SentenceTransformer.encode`` (Pooling / Normalize modules from
modules.json, its own truncation) for MiniLM, and the transformers model's own classification head for a
classifier, on real text (long paragraphs included, so truncation is exercised).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from bertopt.cosine import cosine_rows
from bertopt.data import corpus, mixed_text
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.tiny_models import build_tiny_hf_bert


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    hf = build_tiny_hf_bert(tmp_path_factory.mktemp("cls") / "hf", classifier=True, seed=5)
    return hf, run_stage("export", hf, {}, tmp_path_factory.mktemp("cls") / "onnx")


def _own_logits(hf, texts, pairs=None, max_length=64):
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    enc = tok(texts, pairs, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.numpy()


def test_classifier_logits_match_the_transformers_head(classifier):
    hf, art = classifier
    texts = corpus()[:48] + mixed_text()[:16]  # sentences and paragraphs longer than the 64 positions
    got = Predictor(art).encode(texts)
    want = _own_logits(hf, texts)
    assert got.shape == want.shape == (len(texts), 3)
    assert np.abs(got - want).max() < 1e-4  # measured ~1e-6
    assert (got.argmax(1) == want.argmax(1)).all()


def test_classifier_pairs_match_the_transformers_head_and_the_pair_matters(classifier):
    hf, art = classifier
    firsts = corpus()[:24]
    seconds = corpus()[24:48]
    pred = Predictor(art)
    got = pred.encode(firsts, seconds)
    want = _own_logits(hf, firsts, seconds)
    assert np.abs(got - want).max() < 1e-4
    # the second segment reaches the model: other second segments give other logits, on both sides
    other = _own_logits(hf, firsts, list(reversed(seconds)))
    assert np.abs(want - other).max() > 1e-3
    assert np.abs(pred.encode(firsts, list(reversed(seconds))) - other).max() < 1e-4


@pytest.mark.slow
def test_minilm_matches_sentence_transformers_encode(minilm_onnx, default_artifact):
    """The exported fp32 graph and the default artifact against sentence-transformers' own pipeline."""
    from sentence_transformers import SentenceTransformer

    from bertopt.sources import resolve_source

    folder = resolve_source("builtin:minilm").path
    st = SentenceTransformer(str(folder), device="cpu")
    texts = corpus() + mixed_text()[:128]
    want = st.encode(texts, batch_size=32, convert_to_numpy=True)
    exported = Predictor(minilm_onnx).encode(texts)
    assert exported.shape == want.shape
    assert cosine_rows(exported, want).min() > 0.99999  # same model in fp32: rounding only
    assert np.abs(np.linalg.norm(exported, axis=1) - np.linalg.norm(want, axis=1)).max() < 1e-4  # Normalize kept
    served = Predictor(default_artifact).encode(texts)
    assert cosine_rows(served, want).min() >= 0.995  # the default recipe's promise, against an outside reference
