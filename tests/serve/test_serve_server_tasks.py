"""Task results from real ``bertopt serve`` processes on 127.0.0.1 through bertopt's Client and ``bertopt client
predict``: equal to ``Predictor.predict`` on the same artifact, also when a request is cut into several
mini-jobs; bert-serving-client keeps its embeddings and gets a clear error from a task model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from task_models import TASK_TEXTS

from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(600)]

SMALL_JOBS = ("--max-batch-size", "2", "--priority-batch-size", "1")  # six texts -> three mini-jobs
QUERY = "the cat sat on a mat"


def _approx(got, want):
    """Results equal up to float noise (scores come through JSON as doubles)."""
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            _approx(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _approx(g, w)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-6)
    else:
        assert got == want


def test_token_classification_server_returns_entities(task_artifact, start_server, cli):
    _, art = task_artifact("token-classification")
    server = start_server(art.path, *SMALL_JOBS, num_worker=2)
    predictor = Predictor(art)
    with server.client() as client:
        for aggregation in (None, "first", "none"):
            got = client.predict(TASK_TEXTS, aggregation=aggregation)
            _approx(got, predictor.predict(TASK_TEXTS, aggregation=aggregation or "simple"))
        assert sum(len(e) for e in got) > 0
        assert client.status()["task"] == "token-classification"
        from bertopt.client import ServerError

        with pytest.raises(ServerError, match="token-classification model, which has no sentence embeddings; ask "
                                              "for its results with bertopt's Client.predict"):
            client.encode(["the cat"])
        with pytest.raises(ServerError, match="unknown aggregation 'mean'"):
            client.predict(["the cat"], aggregation="mean")
        with pytest.raises(ServerError, match="takes a single text, but text pairs were given"):
            client.predict(["the cat"], ["a dog"])
    code, out, err = cli("client", "predict", *TASK_TEXTS[:2], "--aggregation", "max", "--port", server.port,
                         "--port-out", server.port_out)
    assert code == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert [row["text"] for row in lines] == TASK_TEXTS[:2]
    _approx([row["result"] for row in lines], predictor.predict(TASK_TEXTS[:2], aggregation="max"))


def test_rerank_server_scores_pairs_and_ranks(task_artifact, start_server, cli):
    _, art = task_artifact("rerank", "roberta")
    server = start_server(art.path, *SMALL_JOBS, num_worker=1)
    predictor = Predictor(art)
    with server.client() as client:
        scores = client.predict([QUERY] * len(TASK_TEXTS), TASK_TEXTS)
        _approx(scores, predictor.predict([QUERY] * len(TASK_TEXTS), TASK_TEXTS))
        ranked = client.rerank(QUERY, TASK_TEXTS)
        assert [r["index"] for r in ranked] == [r["index"] for r in predictor.rerank(QUERY, TASK_TEXTS)]
        from bertopt.client import ServerError

        with pytest.raises(ServerError, match="scores \\(query, passage\\) pairs"):
            client.predict([QUERY])
    code, out, err = cli("client", "predict", QUERY, QUERY, "--pair", TASK_TEXTS[0], "--pair", TASK_TEXTS[1],
                         "--port", server.port, "--port-out", server.port_out)
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["pair"] for r in rows] == TASK_TEXTS[:2]
    assert [r["result"] for r in rows] == pytest.approx(scores[:2], abs=1e-9)


def test_classification_and_sparse_servers(task_artifact, start_server):
    for task, family in (("classification", "roberta"), ("sparse-embedding", "bert")):
        _, art = task_artifact(task, family)
        server = start_server(art.path, *SMALL_JOBS, num_worker=1)
        with server.client() as client:
            got = client.predict(TASK_TEXTS)
        _approx(got, Predictor(art).predict(TASK_TEXTS))
        server.stop()


def test_bert_serving_client_gets_a_clear_error_from_a_task_model(task_artifact, start_server):
    from bert_serving.client import BertClient

    _, art = task_artifact("classification")
    server = start_server(art.path, num_worker=1)
    with BertClient(ip="127.0.0.1", port=server.port, port_out=server.port_out, timeout=30000) as bc:
        # numpy's dtype parser raises it: TypeError or ValueError depending on the message's punctuation
        with pytest.raises((TypeError, ValueError), match="this server serves a classification model, which has "
                                                          "no sentence embeddings; ask for its results with "
                                                          "bertopt's Client.predict"):
            bc.encode(["the cat sat"])


def test_embedding_server_predict_gives_the_vectors(tiny_server, tiny_predictor):
    with tiny_server.client() as client:
        got = client.predict(TASK_TEXTS)
        encoded = client.encode(TASK_TEXTS)
    np.testing.assert_allclose(np.array(got, dtype=np.float32), tiny_predictor.encode(TASK_TEXTS), atol=1e-5)
    np.testing.assert_allclose(encoded, tiny_predictor.encode(TASK_TEXTS), atol=1e-5)
