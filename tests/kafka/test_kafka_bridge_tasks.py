"""Task models through `bertopt kafka` on a real broker (tansu): responses carry the task result (entities,
rerank scores from "pair"/"pairs", classification labels), equal to ``Predictor.predict``; request checks."""

from __future__ import annotations

import json
import signal

import pytest
from task_models import TASK_TEXTS

from bertopt.kafka.bridge import LocalBackend, ResponseFormat, parse_request
from bertopt.runtime import Predictor

QUERY = "the cat sat on a mat"


def test_task_request_fields_are_checked():
    ok = parse_request(json.dumps({"id": 1, "text": "q", "pair": "p", "aggregation": "first"}).encode())
    assert ok.error is None and ok.pairs == ["p"] and ok.aggregation == "first"
    many = parse_request(json.dumps({"id": 2, "texts": ["q", "q"], "pairs": ["a", "b"]}).encode())
    assert many.error is None and many.pairs == ["a", "b"]
    assert "one per text" in parse_request(json.dumps({"id": 3, "texts": ["q"], "pairs": ["a", "b"]}).encode()).error
    assert "takes one 'pair'" in parse_request(json.dumps({"id": 4, "text": "q", "pairs": ["a"]}).encode()).error
    assert "'pair' must be a string" in parse_request(json.dumps({"id": 5, "text": "q", "pair": 3}).encode()).error


def test_local_backend_responses_for_each_task(task_artifact):
    for task, family in (("token-classification", "roberta"), ("rerank", "bert"), ("sparse-embedding", "bert")):
        _, art = task_artifact(task, family)
        backend = LocalBackend(art.path, threads=1)
        fmt = ResponseFormat(backend.model_info, backend.digest)
        pairs = [TASK_TEXTS[0]] * 2 if task == "rerank" else None
        texts = [QUERY] * 2 if task == "rerank" else TASK_TEXTS[:2]
        results = backend.predict(texts, pairs)
        assert results == Predictor(art).predict(texts, pairs)
        body = json.loads(json.dumps(fmt.ok("x", results, single=False)))
        assert body["task"] == task and body["results"] == json.loads(json.dumps(results))


@pytest.mark.slow
@pytest.mark.kafka
def test_kafka_bridge_answers_with_task_results(kafka, task_artifact, read_final_stats):
    _, ner = task_artifact("token-classification")
    req_topic, resp_topic = kafka.topics(partitions=2)
    requests = [{"id": i, "text": t} for i, t in enumerate(TASK_TEXTS)]
    requests.append({"id": "many", "texts": TASK_TEXTS[:3], "aggregation": "first"})
    requests.append({"id": "bad", "text": "x", "aggregation": "mean"})
    kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(ner.path, req_topic, resp_topic, group="ner")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(requests), timeout_s=90)
    assert len(messages) == len(requests), log_file.read_text()[-3000:]
    predictor = Predictor(ner)
    bodies = {json.loads(m.value())["id"]: json.loads(m.value()) for m in messages}
    for i, text in enumerate(TASK_TEXTS):
        assert bodies[i]["task"] == "token-classification"
        assert bodies[i]["result"] == json.loads(json.dumps(predictor.predict([text])[0]))
    assert bodies["many"]["results"] == json.loads(json.dumps(predictor.predict(TASK_TEXTS[:3], aggregation="first")))
    assert "unknown aggregation 'mean'" in bodies["bad"]["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_file.read_text()[-3000:]
    assert read_final_stats(log_file.read_text())["committed"] == len(requests)

    _, rerank = task_artifact("rerank", "roberta")
    req_topic, resp_topic = kafka.topics(partitions=1)
    kafka.produce_requests(req_topic, [{"id": "r", "texts": [QUERY] * 3, "pairs": TASK_TEXTS[:3]},
                                       {"id": "s", "text": QUERY, "pair": TASK_TEXTS[4]},
                                       {"id": "nopair", "text": QUERY}])
    proc, log_file = kafka.start_bridge(rerank.path, req_topic, resp_topic, group="rerank")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= 3, timeout_s=90)
    bodies = {json.loads(m.value())["id"]: json.loads(m.value()) for m in messages}
    want = Predictor(rerank).predict([QUERY] * 4, TASK_TEXTS[:3] + [TASK_TEXTS[4]])
    assert bodies["r"]["results"] == pytest.approx(want[:3], abs=1e-9)
    assert bodies["s"]["result"] == pytest.approx(want[3], abs=1e-9)
    assert "scores (query, passage) pairs" in bodies["nopair"]["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.server
def test_kafka_zmq_backend_carries_task_results(kafka, task_artifact, tmp_path):
    import os
    import subprocess
    import sys
    import time

    from bertopt.harness import free_port

    _, art = task_artifact("classification", "roberta")
    port, port_out = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(art.path), "--port", str(port),
                                  "--port-out", str(port_out), "--num-worker", "1"], stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "ready on" not in log_path.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        req_topic, resp_topic = kafka.topics(partitions=1)
        requests = [{"id": i, "text": t} for i, t in enumerate(TASK_TEXTS)] + [{"id": "all", "texts": TASK_TEXTS}]
        kafka.produce_requests(req_topic, requests)
        proc, log_file = kafka.start_bridge(art.path, req_topic, resp_topic, "--backend", "zmq", "--port", str(port),
                                            "--port-out", str(port_out), group="zmq-task")
        messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(requests), timeout_s=90)
        assert len(messages) == len(requests), log_file.read_text()[-3000:]
        want = json.loads(json.dumps(Predictor(art).predict(TASK_TEXTS)))
        bodies = {json.loads(m.value())["id"]: json.loads(m.value()) for m in messages}
        for i in range(len(TASK_TEXTS)):
            assert bodies[i]["result"]["label"] == bodies[i]["label"] == want[i]["label"]
            assert bodies[i]["result"]["score"] == pytest.approx(want[i]["score"], abs=1e-6)
        assert bodies["all"]["labels"] == [w["label"] for w in want]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
