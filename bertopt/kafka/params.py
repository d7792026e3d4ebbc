"""``bertopt kafka`` options, declared once: the command line is built from them (``params.typer_command``) and
``BridgeConfig.check`` checks a config made through the API against the same ones."""

from __future__ import annotations

from bertopt.kafka.spark_backend import SPARK_BACKEND_PARAMS
from bertopt.messages import MAX_REQUEST_BYTES_PARAM, MAX_TEXT_CHARS_PARAM, MAX_TEXTS_PARAM
from bertopt.params import BATCH_SIZE, LONG_INPUTS, THREADS, ConfigFields, Param, not_blank

BACKENDS = ("local", "zmq", "spark")
LOG_LEVELS = ("debug", "info", "warning", "error")


# BridgeConfig's settings; the Param's name is the field's unless BRIDGE_FIELDS says otherwise.
BRIDGE_PARAMS = [
    Param("bootstrap", str, None, "Kafka bootstrap servers, HOST:PORT[,...].", required=True, aliases=("-b",),
          check=not_blank("give HOST:PORT")),
    Param("request_topic", str, None, 'Topic clients write requests to: JSON {"id": ..., "text": "..."} or '
          '{"id": ..., "texts": [...]}.', required=True, check=not_blank("give a topic name")),
    Param("response_topic", str, None, "Topic the responses go to, keyed by the request's key and carrying its id.",
          required=True, check=not_blank("give a topic name")),
    Param("group_id", str, "bertopt-kafka", "Consumer group: bridges sharing it split the request partitions "
          "between them.", aliases=("-g",), check=not_blank("give a consumer group name")),
    Param("max_batch", int, 64, "Most requests run through the model as one batch.", min=1),
    Param("max_wait_ms", int, 50, "How long to wait for a batch to fill before running what arrived.", min=0),
    MAX_TEXTS_PARAM.with_(help="A request with more texts gets an error response (responses must fit in one Kafka "
                          "message)."),
    MAX_TEXT_CHARS_PARAM.with_(help="A request holding a longer text (or pair) gets an error response; the model "
                               "reads only the first tokens its artifact takes anyway."),
    MAX_REQUEST_BYTES_PARAM.with_(help="A larger request message gets an error response, before it is parsed."),
    Param("stats_interval", float, 10.0, "Seconds between counter log lines (consumed, produced, errors, lag).",
          min=0),
    Param("connect_timeout", float, 10.0, "Seconds to wait for the cluster's metadata at start-up before giving up.",
          min=0.001),
]
# BridgeConfig's fields: the flags say --stats-interval, the config stats_interval_s
BRIDGE_FIELDS = ConfigFields(BRIDGE_PARAMS, {"stats_interval": "stats_interval_s",
                                             "connect_timeout": "connect_timeout_s"})

KAFKA_PARAMS = [
    Param("artifact", str, None, "Artifact folder: the model the responses come from (with --backend zmq, the one "
          "the serve cluster runs; its digest is reported).", positional=True, required=True),
    *BRIDGE_PARAMS[:6],
    Param("backend", str, "local", "local: run the artifact in this process. zmq: send batches to a running "
          "'bertopt serve' cluster (--server, --port, --port-out), so the bridge scales out with its workers. spark: "
          "run each batch as a Spark job through the bertopt Spark UDF (--master, --partitions; --threads are then "
          "per Spark task).", choices=BACKENDS),
    THREADS,
    BATCH_SIZE,
    LONG_INPUTS.with_(help=LONG_INPUTS.help + " local backend: error answers the request with an error response; "
                      "spark backend: truncate or chunk; zmq backend: the server's ZeroMQ truncation only."),
    Param("server", str, "127.0.0.1", "zmq backend: address of 'bertopt serve'."),
    Param("port", int, 5555, "zmq backend: the server's request port.", min=1, max=65535, aliases=("-p",)),
    Param("port_out", int, 5556, "zmq backend: the server's reply port.", min=1, max=65535),
    Param("timeout_ms", int, 30000, "zmq backend: give up on a batch after this long (the bridge then exits without "
          "committing it).", min=1),
    *BRIDGE_PARAMS[6:9],
    *SPARK_BACKEND_PARAMS,
    Param("kafka_option", list, None, "librdkafka property KEY=VALUE for consumer and producer, repeatable, e.g. "
          "-X security.protocol=SASL_SSL; prefix consumer. or producer. to target one.", flag="-X",
          aliases=("--kafka-config",), repeat=True),
    *BRIDGE_PARAMS[9:],
    Param("log_level", str, "info", "How much the bridge logs.", choices=LOG_LEVELS),
]
