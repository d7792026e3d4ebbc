"""Long inputs over HTTP and ZeroMQ: real ``bertopt serve`` processes on 127.0.0.1 (the real MiniLM, tiny task
models), httpx and the official openai client; answers compared with the in-process Predictor's policies."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from long_texts import text_of

from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_minilm_server_chunks_http_by_default_and_zeromq_keeps_truncating(minilm_onnx, start_server):
    from openai import BadRequestError, OpenAI

    pred = Predictor(minilm_onnx, threads=1)
    short, long3, long10 = "a short sentence", text_of(pred, 3 * 256), text_of(pred, 10 * 256)
    texts = [short, long3, long10]
    chunked = pred.encode(texts, long_inputs="chunk")
    truncated = pred.encode(texts)
    server = start_server(minilm_onnx.path, "--long-inputs", "chunk", http=True, num_worker=1)
    assert httpx.get(server.url + "/info", timeout=30).json()["long_inputs"] == "chunk"

    r = httpx.post(server.url + "/embed", json={"inputs": texts}, timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), chunked, atol=1e-5)
    r = httpx.post(server.url + "/embed", json={"inputs": texts, "truncate": True}, timeout=120)
    np.testing.assert_allclose(r.json(), truncated, atol=1e-5)
    r = httpx.post(server.url + "/embed", json={"inputs": texts, "long_inputs": "error"}, timeout=120)
    n = len(pred.untruncated_tokenizer().encode(long10).ids)
    assert r.status_code == 413
    assert r.json() == {"error": f"input 2 has {n} tokens, more than this model's limit of 256; shorten it, or send "
                                 "\"truncate\": true to cut it to the limit (or \"long_inputs\": \"chunk\" to pool "
                                 "overlapping windows)", "error_type": "Validation"}
    for body, message in (({"truncate": True, "long_inputs": "chunk"}, "'truncate': true contradicts 'long_inputs'"),
                          ({"long_inputs": "split"}, "'long_inputs' must be one of error, truncate, chunk")):
        r = httpx.post(server.url + "/embed", json={"inputs": texts, **body}, timeout=60)
        assert r.status_code == 422 and r.json()["error"].startswith(message)

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    res = client.embeddings.create(input=texts, model="minilm")
    np.testing.assert_allclose(np.array([d.embedding for d in res.data]), chunked, atol=1e-5)
    with pytest.raises(BadRequestError) as err:
        client.embeddings.create(input=[long3], model="minilm", extra_body={"long_inputs": "error"})
    assert err.value.status_code == 400 and err.value.body["code"] == "context_length_exceeded"
    assert "more than this model's limit of 256" in err.value.body["message"]

    # ZeroMQ (bert-serving-client's protocol has no field for it): bert-as-service's truncation, unchanged
    with server.client() as zmq_client:
        np.testing.assert_allclose(zmq_client.encode(texts), truncated, atol=1e-5)


def test_serve_long_inputs_option_is_checked_in_one_line(cli, tiny_onnx):
    code, _, err = cli("serve", tiny_onnx.path, "--long-inputs", "split")
    assert code == 2
    assert "'long_inputs' must be one of error, truncate, chunk; got 'split'" in " ".join(err.split())


def test_classifier_server_errors_by_default_and_chunks_by_request(task_artifact, start_server):
    _, cls = task_artifact("classification")
    pred = Predictor(cls, threads=1)
    long = text_of(pred, 3 * pred.max_seq_len)
    server = start_server(cls.path, "--no-zmq", http=True, num_worker=1)
    r = httpx.post(server.url + "/predict", json={"inputs": long}, timeout=60)
    assert r.status_code == 413 and f"more than this model's limit of {pred.max_seq_len}" in r.json()["error"]
    r = httpx.post(server.url + "/predict", json={"inputs": [long, "the cat", "a dog"], "long_inputs": "chunk",
                                                   "raw_scores": True}, timeout=60)
    assert r.status_code == 200, r.text
    logits = pred.encode([long, "the cat", "a dog"], long_inputs="chunk")  # 3 inputs: 2 would be TEI's pair
    for row, want in zip(r.json(), logits):
        np.testing.assert_allclose(sorted(d["score"] for d in row), np.sort(want), atol=1e-5)
    r = httpx.post(server.url + "/predict", json={"inputs": long, "truncate": True}, timeout=60)
    want = pred.predict([long])[0]
    assert r.json()[0]["label"] == want["label"] and abs(r.json()[0]["score"] - want["score"]) < 1e-5


def test_rerank_server_refuses_to_chunk_pairs(task_artifact, start_server):
    _, rerank = task_artifact("rerank")
    pred = Predictor(rerank, threads=1)
    long = text_of(pred, 3 * pred.max_seq_len)
    server = start_server(rerank.path, "--no-zmq", "--long-inputs", "chunk", http=True, num_worker=1)
    r = httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["the cat", long]}, timeout=60)
    assert r.status_code == 413
    assert "chunking splits texts, not text pairs; shorten it, or send \"truncate\": true" in r.json()["error"]
    ok = httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["the cat", "a dog"]}, timeout=60)
    assert ok.status_code == 200 and [d["index"] for d in ok.json()] == [
        d["index"] for d in pred.rerank("q", ["the cat", "a dog"])]


def test_sparse_chunks_by_max_and_token_classifier_refuses_over_http(task_artifact, start_server):
    _, sparse = task_artifact("sparse-embedding")
    pred = Predictor(sparse, threads=1)
    long = text_of(pred, 3 * pred.max_seq_len)
    server = start_server(sparse.path, "--no-zmq", http=True, num_worker=1)
    r = httpx.post(server.url + "/embed_sparse", json={"inputs": [long, "the cat"], "long_inputs": "chunk"},
                   timeout=60)
    assert r.status_code == 200, r.text
    for got, want in zip(r.json(), pred.predict([long, "the cat"], long_inputs="chunk")):
        assert [d["index"] for d in got] == want["indices"]
        np.testing.assert_allclose([d["value"] for d in got], want["values"], atol=1e-5)
    assert httpx.post(server.url + "/embed_sparse", json={"inputs": long}, timeout=60).status_code == 413
    server.stop()

    _, ner = task_artifact("token-classification")
    pred = Predictor(ner, threads=1)
    long = text_of(pred, 3 * pred.max_seq_len)
    server = start_server(ner.path, "--no-zmq", "--long-inputs", "chunk", http=True, num_worker=1)
    r = httpx.post(server.url + "/predict", json={"inputs": [long, "the cat"]}, timeout=60)
    assert r.status_code == 413
    assert "chunking splits texts, not a token classifier's inputs over HTTP (the Python API chunks them)" in \
        r.json()["error"]
    r = httpx.post(server.url + "/predict", json={"inputs": "the cat sat", "aggregation_strategy": "none"},
                   timeout=60)
    want = pred.predict(["the cat sat"], aggregation="none")[0]  # a text that fits is answered as always
    assert r.status_code == 200
    assert [(e["entity"], e["start"], e["end"]) for e in r.json()] == [(e["entity"], e["start"], e["end"])
                                                                        for e in want]
