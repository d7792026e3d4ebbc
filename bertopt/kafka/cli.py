"""``bertopt kafka``: the request/response bridge command; confluent-kafka and the runtime are imported inside."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

import typer

from bertopt.errors import BackendFailed, UserError
from bertopt.kafka.spark_backend import SPARK_PARAM
from bertopt.messages import MAX_REQUEST_BYTES, MAX_TEXT_CHARS, MAX_TEXTS_PER_REQUEST
from bertopt.params import BATCH_SIZE, THREADS

HELP = (
    "Answer prediction requests from a Kafka topic, at least once.\n\n"
    "Consume up to --max-batch requests (or what arrived within --max-wait-ms), run them as one batch, produce one "
    "response per request to --response-topic, wait for the broker's acknowledgements, and only then commit the "
    "offsets. A bridge killed mid-batch leaves the batch uncommitted, so it is answered again after the restart "
    "(duplicates possible, losses not). A request that fails (malformed, over a bound, refused by the model) gets "
    "an error response with its id (null when it has none); the bridge lives on. SIGTERM finishes the batch in "
    "hand, commits and exits 0; a backend or broker failure exits 3 without committing the batch.\n\n"
    "Example: [bold]bertopt kafka artifacts/int8 --bootstrap kafka1:9092 --request-topic bert-requests "
    "--response-topic bert-responses --max-batch 64[/]"
)


def register(app: typer.Typer) -> None:
    @app.command("kafka", help=HELP)
    def kafka_command(
        artifact: Path = typer.Argument(..., help="Artifact folder: the model the responses come from (with "
                                        "--backend zmq, the one the serve cluster runs; its digest is reported).",
                                        show_default=False),
        bootstrap: str = typer.Option(..., "--bootstrap", "-b", help="Kafka bootstrap servers, HOST:PORT[,...].",
                                      show_default=False),
        request_topic: str = typer.Option(..., "--request-topic", help="Topic clients write requests to: JSON "
                                          '{"id": ..., "text": "..."} or {"id": ..., "texts": [...]}.',
                                          show_default=False),
        response_topic: str = typer.Option(..., "--response-topic", help="Topic the responses go to, keyed by "
                                           "the request's key and carrying its id.", show_default=False),
        group_id: str = typer.Option("bertopt-kafka", "--group-id", "-g", help="Consumer group: bridges sharing "
                                     "it split the request partitions between them."),
        max_batch: int = typer.Option(64, "--max-batch", help="Most requests run through the model as one batch."),
        max_wait_ms: int = typer.Option(50, "--max-wait-ms", help="How long to wait for a batch to fill before "
                                        "running what arrived."),
        backend: str = typer.Option("local", "--backend", help="local: run the artifact in this process. zmq: "
                                    "send batches to a running 'bertopt serve' cluster (--server, --port, "
                                    "--port-out), so the bridge scales out with its workers. spark: run each batch "
                                    "as a Spark job through the bertopt Spark UDF (--master, --partitions; "
                                    "--threads are then per Spark task)."),
        threads: Optional[int] = THREADS.typer_option(),
        batch_size: int = BATCH_SIZE.typer_option(),
        server: str = typer.Option("127.0.0.1", "--server", help="zmq backend: address of 'bertopt serve'."),
        port: int = typer.Option(5555, "--port", "-p", min=1, max=65535,
                                 help="zmq backend: the server's request port."),
        port_out: int = typer.Option(5556, "--port-out", min=1, max=65535,
                                     help="zmq backend: the server's reply port."),
        timeout_ms: int = typer.Option(30000, "--timeout-ms", min=1, help="zmq backend: give up on a batch after this "
                                       "long (the bridge then exits without committing it)."),
        max_texts_per_request: int = typer.Option(MAX_TEXTS_PER_REQUEST, "--max-texts-per-request",
                                                  help="A request with more texts gets an error response "
                                                  "(responses must fit in one Kafka message)."),
        max_text_chars: int = typer.Option(MAX_TEXT_CHARS, "--max-text-chars", help="A request holding a longer "
                                           "text (or pair) gets an error response; the model reads only its first "
                                           "--max-seq-len tokens anyway."),
        max_request_bytes: int = typer.Option(MAX_REQUEST_BYTES, "--max-request-bytes", help="A larger request "
                                              "message gets an error response, before it is parsed."),
        master: Optional[str] = typer.Option(None, SPARK_PARAM["master"].cli_flag, show_default=False,
                                             help=SPARK_PARAM["master"].help +
                                             f" (default: {SPARK_PARAM['master'].default})"),
        partitions: Optional[int] = typer.Option(None, SPARK_PARAM["partitions"].cli_flag, show_default=False,
                                                 help=SPARK_PARAM["partitions"].help),
        kafka_option: Optional[List[str]] = typer.Option(None, "-X", "--kafka-config", help="librdkafka property "
                                                         "KEY=VALUE for consumer and producer, repeatable, e.g. "
                                                         "-X security.protocol=SASL_SSL; prefix consumer. or "
                                                         "producer. to target one."),
        stats_interval: float = typer.Option(10.0, "--stats-interval", min=0, help="Seconds between counter log lines "
                                             "(consumed, produced, errors, lag)."),
        connect_timeout: float = typer.Option(10.0, "--connect-timeout", min=0.001,
                                              help="Seconds to wait for the cluster's "
                                              "metadata at start-up before giving up."),
        log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    ) -> None:
        """Answer prediction requests from a Kafka topic, at least once (help: HELP above)."""
        from bertopt.kafka.bridge import BridgeConfig, KafkaBridge, parse_kafka_options

        level = getattr(logging, log_level.upper(), None)
        if not isinstance(level, int):
            raise UserError(f"--log-level {log_level!r} is not known; use debug, info, warning or error")
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if backend not in ("local", "zmq", "spark"):
            raise UserError(f"--backend {backend!r} is not known; use local, zmq or spark")
        if backend != "spark" and (master is not None or partitions is not None):
            raise UserError("--master and --partitions belong to the spark backend; add --backend spark or drop them")
        cfg = BridgeConfig(bootstrap=bootstrap, request_topic=request_topic, response_topic=response_topic,
                           group_id=group_id, max_batch=max_batch, max_wait_ms=max_wait_ms,
                           max_texts_per_request=max_texts_per_request, max_text_chars=max_text_chars,
                           max_request_bytes=max_request_bytes, stats_interval_s=stats_interval,
                           connect_timeout_s=connect_timeout,
                           kafka_config=parse_kafka_options(kafka_option or []))
        cfg.check()
        from bertopt.artifact import Artifact

        warning = Artifact.load(artifact, verify=False).batch_dependence_warning()
        if warning:
            typer.echo(warning, err=True)
        try:
            if backend == "local":
                from bertopt.kafka.bridge import LocalBackend

                runner = LocalBackend(artifact, threads=threads, batch_size=batch_size)
            elif backend == "spark":
                from bertopt.kafka.spark_backend import SparkBackend

                runner = SparkBackend(artifact, master=master, partitions=partitions, threads=threads,
                                      batch_size=batch_size, max_text_chars=max_text_chars)
            else:
                from bertopt.errors import require
                from bertopt.kafka.bridge import ZmqBackend

                require("zmq", "serve", "bertopt kafka --backend zmq")
                runner = ZmqBackend(artifact, host=server, port=port, port_out=port_out, timeout_ms=timeout_ms)
            KafkaBridge(runner, cfg).run()
        except BackendFailed as exc:
            # one ERROR line, then the exit code itself: raised as SystemExit, it passes the Typer/click layer
            # untouched (a typer.Exit code is dropped in non-standalone mode)
            logging.getLogger("bertopt.kafka").error("backend failed: %s", exc)
            raise SystemExit(exc.exit_code) from None
