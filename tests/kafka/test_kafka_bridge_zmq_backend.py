"""`bertopt kafka --backend zmq`: batches go to a real `bertopt serve` process; values equal the in-process runtime."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_kafka_bridge import check_responses, make_requests

from bertopt.harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.server]


@pytest.fixture
def tiny_serve(tiny_onnx, tmp_path):
    """``bertopt serve`` on free loopback ports in its own session, so its workers are stopped with it."""
    port, port_out = free_port(), free_port()
    while port_out == port:
        port_out = free_port()
    out = tmp_path / "serve.log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(tiny_onnx.path), "--port",
                                 str(port), "--port-out", str(port_out), "--num-worker", "1"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while "ready on" not in out.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"bertopt serve did not start (exit {proc.poll()}):\n{out.read_text()[-3000:]}")
            time.sleep(0.1)
        yield port, port_out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_kafka_zmq_backend_answers_through_bertopt_serve(kafka, tiny_onnx, tiny_serve, read_final_stats):
    from bertopt.runtime import Predictor

    port, port_out = tiny_serve
    n = 500
    req_topic, resp_topic = kafka.topics(partitions=2)
    requests, expected_texts = make_requests(n, seed=6)
    kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--backend", "zmq", "--port",
                                        str(port), "--port-out", str(port_out), "--max-batch", "32", group="zmq")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= n, timeout_s=90)
    assert len(messages) == n, log_file.read_text()[-3000:]
    predictor = Predictor(tiny_onnx.path, threads=1)
    by_id = check_responses(messages, expected_texts, predictor.encode, tiny_onnx.digest)
    assert set(by_id) == set(expected_texts)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    assert "zmq backend" in log_text
    stats = read_final_stats(log_text)
    assert stats["produced"] == stats["committed"] == n
    assert json.loads(messages[0].value())["artifact"] == tiny_onnx.digest
