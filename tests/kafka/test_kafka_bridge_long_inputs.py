"""`bertopt kafka --long-inputs` against a real broker (tansu), the bridge a real process: error answers the long
request with an error response naming the window (the other requests are answered), chunk answers it with the
Predictor's pooled vector; the zmq backend refuses anything but truncation in one line."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from bertopt.data import corpus
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_kafka_long_inputs_error_and_chunk(kafka, tiny_onnx):
    pred = Predictor(tiny_onnx.path, threads=1)
    long = " ".join(t for t in corpus()[:40] if t)
    length = len(pred.untruncated_tokenizer().encode(long).ids)
    assert length > 3 * pred.max_seq_len
    requests = [{"id": 1, "text": "the cat sat"}, {"id": 2, "text": long}, {"id": 3, "texts": ["a dog", long]}]
    bridges = []
    for policy in ("error", "chunk"):
        req, resp = kafka.topics(partitions=1)
        kafka.produce_requests(req, requests)
        bridges.append((policy, resp, *kafka.start_bridge(tiny_onnx.path, req, resp, "--long-inputs", policy,
                                                          group=f"long-{policy}")))
    for policy, resp, proc, log_file in bridges:
        messages = kafka.responses(resp, until=lambda ms: len(ms) >= 3, timeout_s=90)
        assert len(messages) == 3, log_file.read_text()[-3000:]
        bodies = {b["id"]: b for b in (json.loads(m.value()) for m in messages)}
        np.testing.assert_allclose(bodies[1]["embedding"], pred.encode(["the cat sat"])[0], atol=1e-5)
        if policy == "error":
            assert bodies[2]["error"].startswith(f"text 0 has {length} tokens, more than this model's window of "
                                                 f"{pred.max_seq_len} tokens; shorten it")
            assert bodies[3]["error"].startswith(f"text 1 has {length} tokens")
        else:
            np.testing.assert_allclose(bodies[2]["embedding"], pred.encode([long], long_inputs="chunk")[0],
                                       atol=1e-5)
            np.testing.assert_allclose(bodies[3]["embeddings"], pred.encode(["a dog", long], long_inputs="chunk"),
                                       atol=1e-5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_file.read_text()[-3000:]


def test_kafka_zmq_backend_refuses_chunk_in_one_line(tiny_onnx, cli):
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", "127.0.0.1:9", "--request-topic", "a",
                       "--response-topic", "b", "--backend", "zmq", "--long-inputs", "chunk")
    assert code == 2
    assert "--long-inputs chunk needs --backend local or spark" in " ".join(err.split())


@pytest.mark.spark
def test_kafka_spark_backend_chunks_like_the_predictor_and_refuses_error(tiny_onnx):
    from bertopt.errors import UserError
    from bertopt.kafka.spark_backend import SparkBackend
    from bertopt.spark.session import get_session

    with pytest.raises(UserError, match="^bertopt kafka --backend spark: 'long_inputs' must be one of truncate, "
                                        "chunk; got 'error'$"):
        SparkBackend(tiny_onnx.path, long_inputs="error")  # refused before Spark starts
    pred = Predictor(tiny_onnx.path, threads=1)
    long = " ".join(t for t in corpus()[:40] if t)
    spark = get_session("local[2]", app_name="bertopt-kafka-long", conf={"spark.sql.shuffle.partitions": "2"})
    backend = SparkBackend(tiny_onnx.path, spark=spark, partitions=2, threads=1, long_inputs="chunk")
    try:
        got = backend.encode(["the cat sat", long])
    finally:
        backend.close()
        spark.stop()
    np.testing.assert_allclose(got, pred.encode(["the cat sat", long], long_inputs="chunk"), atol=1e-5)
