"""`bertopt kafka` usage errors: one line, exit 2, before anything is consumed."""

from __future__ import annotations

import pytest

from bertopt.harness import free_port
from bertopt.kafka.bridge import parse_request


def test_kafka_request_parsing_rules():
    ok = parse_request(b'{"id": "a", "text": "hi"}')
    assert (ok.id, ok.texts, ok.single, ok.error) == ("a", ["hi"], True, None)
    many = parse_request(b'{"id": 3, "texts": ["x", "y"]}')
    assert (many.id, many.texts, many.single, many.error) == (3, ["x", "y"], False, None)
    assert "no 'id'" in parse_request(b'{"text": "x"}').error
    assert "not JSON" in parse_request(b"{").error
    assert "limit of 2" in parse_request(b'{"id": 1, "texts": ["a", "b", "c"]}', max_texts=2).error


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "kafka: 'max_batch' must be at least 1, got 0"),
    (["-X", "novalue"], "-X 'novalue' is not KEY=VALUE"),
    (["-X", "no.such.property=1"], "invalid Kafka configuration"),
    (["--backend", "grpc"], "kafka: 'backend' must be one of local, zmq, spark; got 'grpc'"),
])
def test_kafka_bad_options_exit_2(cli, tiny_onnx, args, message):
    code, out, err = cli("kafka", tiny_onnx.path, "--bootstrap", f"127.0.0.1:{free_port()}", "--request-topic",
                         "a", "--response-topic", "b", *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_kafka_same_topic_twice_exits_2(cli, tiny_onnx):
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", "127.0.0.1:9", "--request-topic", "t",
                       "--response-topic", "t")
    assert code == 2 and "would consume its own responses" in err


def test_kafka_unreachable_cluster_exits_2(cli, tiny_onnx):
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", f"127.0.0.1:{free_port()}", "--request-topic", "a",
                       "--response-topic", "b", "--connect-timeout", "2")
    assert code == 2
    assert "cannot reach Kafka at 127.0.0.1:" in err and "check --bootstrap" in err
    # the brokers actually used are named: an -X bootstrap.servers wins over --bootstrap
    other = free_port()
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", "127.0.0.1:9", "--request-topic", "a",
                       "--response-topic", "b", "--connect-timeout", "2", "-X", f"bootstrap.servers=127.0.0.1:{other}")
    assert code == 2 and f"cannot reach Kafka at 127.0.0.1:{other} (" in err, err


def test_kafka_zmq_backend_without_a_server_exits_2(cli, tiny_onnx):
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", "127.0.0.1:9", "--request-topic", "a",
                       "--response-topic", "b", "--backend", "zmq", "--port", str(free_port()), "--port-out",
                       str(free_port()), "--timeout-ms", "1000")
    assert code == 2
    assert "no reply from the bertopt server" in err


@pytest.mark.slow
@pytest.mark.kafka
def test_kafka_missing_topic_exits_2(cli, tiny_onnx, kafka):
    req, _ = kafka.topics(partitions=1)
    code, _, err = cli("kafka", tiny_onnx.path, "--bootstrap", kafka.bootstrap, "--request-topic", req,
                       "--response-topic", "no-such-topic")
    assert code == 2
    assert "topic 'no-such-topic' (--response-topic) does not exist" in err
