"""Response bodies from the real runtime: embeddings for encoders, the task result (+ label) for classifiers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from bertopt.kafka.bridge import LocalBackend, ResponseFormat


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    # the root conftest's builder, loaded by path ("conftest" alone is ambiguous between test folders)
    spec = importlib.util.spec_from_file_location("bertopt_root_conftest", Path(__file__).parents[1] / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    from bertopt.registry import run_stage

    hf = root.build_tiny_hf_bert(tmp_path_factory.mktemp("tiny-cls") / "hf", classifier=True)
    return run_stage("export", hf, {}, tmp_path_factory.mktemp("tiny-cls") / "onnx")


def test_kafka_classifier_responses_carry_the_task_result(tiny_classifier):
    from bertopt.runtime import Predictor

    backend = LocalBackend(tiny_classifier.path, threads=1)
    fmt = ResponseFormat(backend.model_info, backend.digest)
    texts = ["the cat sat on the mat", "a bad model", "hello world !"]
    results = backend.predict(texts)
    want = Predictor(tiny_classifier).predict(texts)
    assert results == want
    labels = {int(k): v for k, v in tiny_classifier.model_info["id2label"].items()}
    logits = Predictor(tiny_classifier).encode(texts)
    one = fmt.ok("a", results[:1], single=True)
    assert one["task"] == "classification" and one["result"] == want[0]
    assert one["label"] == labels[int(np.argmax(logits[0]))]
    many = fmt.ok("b", results, single=False)
    assert many["labels"] == [labels[int(i)] for i in np.argmax(logits, axis=1)]
    assert many["results"] == want
    assert many["artifact"] == tiny_classifier.digest and "embedding" not in many


def test_kafka_encoder_responses_carry_embeddings(tiny_onnx):
    backend = LocalBackend(tiny_onnx.path, threads=1)
    fmt = ResponseFormat(backend.model_info, backend.digest)
    values = backend.encode(["hello world", "the dog runs"])
    assert fmt.ok(1, values[:1], single=True) == {"id": 1, "embedding": values[0].tolist(),
                                                   "artifact": tiny_onnx.digest}
    assert fmt.ok(2, values, single=False)["embeddings"] == values.tolist()
    assert fmt.error(3, "bad; fix") == {"id": 3, "error": "bad; fix", "artifact": tiny_onnx.digest}
