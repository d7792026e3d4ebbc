"""Task-level results of ``Predictor.predict`` / ``Predictor.rerank`` against the independent references: the
transformers pipelines (text / token classification), sentence-transformers' CrossEncoder (rerank) and
SparseEncoder (SPLADE), on tiny random models of two families (BERT WordPiece, RoBERTa byte-level BPE)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from task_models import TASK_TEXTS

from bertopt.errors import UserError
from bertopt.runtime import Predictor
from bertopt.runtime.tasks import AGGREGATIONS, task_of
from bertopt.tasks import known_task
from bertopt.tiny_models import NER_LABELS

FAMILIES = ("bert", "roberta", "deberta-v2")  # WordPiece, byte-level BPE, SentencePiece (Unigram)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _same_entities(got, want):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert set(g) == set(w) - {"index"} | ({"index"} if "index" in g else set())
        for key in g:
            if key == "score":
                assert g[key] == pytest.approx(float(w[key]), abs=1e-4)
            else:
                assert g[key] == w[key], (key, g, w)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_classification_equals_the_transformers_pipeline(task_artifact, family):
    from transformers import pipeline

    hf, art = task_artifact("token-classification", family)
    predictor = Predictor(art)
    assert predictor.task == "token-classification"
    for aggregation in AGGREGATIONS:
        pipe = pipeline("token-classification", model=str(hf), aggregation_strategy=aggregation)
        got = predictor.predict(TASK_TEXTS, aggregation=aggregation)
        assert len(got) == len(TASK_TEXTS)
        for text, entities, want in zip(TASK_TEXTS, got, (pipe(t) for t in TASK_TEXTS)):
            _same_entities(entities, want)
            key = "entity" if aggregation == "none" else "entity_group"
            for e in entities:
                assert 0 <= e["start"] <= e["end"] <= len(text)  # a lone space token has an empty span
                assert e[key] in ({lab for lab in NER_LABELS} if aggregation == "none"
                                  else {lab.split("-")[-1] for lab in NER_LABELS}) - {"O"}
        assert sum(len(e) for e in got) > 0, f"no entity at all for {family}/{aggregation}: the test sees nothing"


@pytest.mark.parametrize("family", FAMILIES)
def test_entity_offsets_point_into_the_original_text(task_artifact, family):
    _, art = task_artifact("token-classification", family)
    text = "Hello   World, the CAT sat on xyzzy."  # runs of spaces, capitals, an unknown word
    for e in Predictor(art).predict(text, aggregation="none")[0]:
        piece = text[e["start"]:e["end"]]
        if family == "bert":  # lower-casing WordPiece: "##" marks a continuation
            assert piece.lower() == e["word"].removeprefix("##") or e["word"] == piece
        else:  # byte-level BPE "Ġ" / SentencePiece "▁" mark a leading space (inside the span or not)
            assert piece.strip() == e["word"].replace("Ġ", " ").replace("▁", " ").strip()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", ["classification", "multi-label"])
def test_classification_equals_the_text_classification_pipeline(task_artifact, family, task):
    from transformers import pipeline

    hf, art = task_artifact(task, family)
    got = Predictor(art).predict(TASK_TEXTS)
    want = pipeline("text-classification", model=str(hf))(TASK_TEXTS)
    for g, w in zip(got, want):
        assert g["label"] == w["label"]
        assert g["score"] == pytest.approx(w["score"], abs=1e-5)
        assert g["score"] == max(g["scores"].values())
        total = sum(g["scores"].values())
        if task == "classification":  # softmax
            assert total == pytest.approx(1.0, abs=1e-9)
        else:  # sigmoid per label: independent probabilities
            assert total != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_rerank_equals_the_cross_encoder(task_artifact, family):
    from sentence_transformers import CrossEncoder

    hf, art = task_artifact("rerank", family)
    predictor = Predictor(art)
    encoder = CrossEncoder(str(hf))
    query = "the cat sat on a mat"
    scores = predictor.predict([query] * len(TASK_TEXTS), TASK_TEXTS)
    np.testing.assert_allclose(scores, encoder.predict([(query, p) for p in TASK_TEXTS]), atol=1e-5)
    ranked = predictor.rerank(query, TASK_TEXTS)
    assert [r["index"] for r in ranked] == [r["corpus_id"] for r in encoder.rank(query, TASK_TEXTS)]
    assert [r["text"] for r in ranked] == [TASK_TEXTS[r["index"]] for r in ranked]
    assert [r["score"] for r in ranked] == sorted(scores, reverse=True)
    assert len(predictor.rerank(query, TASK_TEXTS, top_k=2)) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_embedding_equals_the_sparse_encoder(task_artifact, family):
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    hf, art = task_artifact("sparse-embedding", family)
    got = Predictor(art).predict(TASK_TEXTS)
    want = SparseEncoder(modules=[MLMTransformer(str(hf)), SpladePooling("max")]).encode(
        TASK_TEXTS, convert_to_tensor=True).to_dense().numpy()
    dense = np.zeros_like(want)
    for row, vec in enumerate(got):
        assert vec["indices"] == sorted(vec["indices"]) and all(v > 0 for v in vec["values"])
        dense[row, vec["indices"]] = vec["values"]
    np.testing.assert_allclose(dense, want, atol=1e-5)
    assert (want > 1e-4).sum() <= sum(len(v["indices"]) for v in got)  # nothing the reference has is dropped


def test_embedding_predict_gives_the_sentence_vectors(tiny_onnx):
    predictor = Predictor(tiny_onnx)
    assert predictor.task == "embedding"
    got = predictor.predict(["the cat", "a dog runs"])
    np.testing.assert_allclose(np.stack(got), predictor.encode(["the cat", "a dog runs"]), atol=1e-6)


def test_pairs_for_a_single_text_model_are_refused(task_artifact):
    _, art = task_artifact("classification")
    assert art.model_info["pair_input"] is False
    with pytest.raises(UserError, match="takes a single text, but text pairs were given"):
        Predictor(art).predict(["a"], ["b"])


def test_rerank_misuse_is_refused(task_artifact):
    _, rerank_art = task_artifact("rerank")
    _, cls_art = task_artifact("classification")
    with pytest.raises(UserError, match="scores \\(query, passage\\) pairs"):
        Predictor(rerank_art).predict(["only a query"])
    with pytest.raises(UserError, match="needs a rerank"):
        Predictor(cls_art).rerank("q", ["p"])
    with pytest.raises(UserError, match="list of strings, got one string"):
        Predictor(rerank_art).rerank("q", "one passage")
    assert Predictor(rerank_art).rerank("q", []) == []


def test_unknown_aggregation_is_refused(task_artifact):
    _, art = task_artifact("token-classification")
    with pytest.raises(UserError, match="unknown aggregation 'mean'; choose one of none, simple"):
        Predictor(art).predict(["the cat"], aggregation="mean")


def test_old_manifest_task_names_map_to_the_contract(tiny_onnx):
    assert known_task("classifier") == "classification"
    assert known_task("sentence-embedding") == "embedding"
    assert known_task("encoder") == "embedding"
    assert known_task("something-else") is None
    assert task_of(tiny_onnx) == "embedding"
