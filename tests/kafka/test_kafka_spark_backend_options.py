"""`bertopt kafka` options of the spark backend: declared once (Params), checked before Spark or Kafka start."""

from __future__ import annotations

import pytest

from bertopt.errors import UserError
from bertopt.harness import free_port
from bertopt.kafka.spark_backend import SPARK_BACKEND_PARAMS, SparkBackend


@pytest.mark.parametrize("args, message", [
    (["--master", "local[1]"], "--master and --partitions belong to the spark backend"),
    (["--backend", "zmq", "--partitions", "2"], "--master and --partitions belong to the spark backend"),
    (["--backend", "spark", "--partitions", "0"], "'partitions' must be at least 1, got 0"),
])
def test_kafka_spark_options_are_checked_first(cli, tiny_onnx, args, message):
    code, out, err = cli("kafka", tiny_onnx.path, "--bootstrap", f"127.0.0.1:{free_port()}", "--request-topic",
                         "a", "--response-topic", "b", *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_kafka_spark_params_drive_cli_help_and_api(cli):
    code, out, _ = cli("kafka", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for p in SPARK_BACKEND_PARAMS:
        assert p.cli_flag in flat
    assert "local[2]" in flat  # the default the Param declares
    with pytest.raises(UserError, match="'partitions' must be int"):
        SparkBackend("unused", partitions="two")

