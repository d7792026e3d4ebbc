"""``bertopt kafka``: the request/response bridge command; confluent-kafka and the runtime are imported inside."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from bertopt.errors import BackendFailed, UserError
from bertopt.params import typer_command

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


def _kafka(config) -> None:
    """Answer prediction requests from a Kafka topic, at least once (help: HELP above)."""
    from bertopt.kafka.bridge import BridgeConfig, KafkaBridge, parse_kafka_options
    from bertopt.kafka.params import BRIDGE_FIELDS

    logging.basicConfig(level=getattr(logging, config["log_level"].upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend, artifact = config["backend"], Path(config["artifact"])
    if backend != "spark" and {"master", "partitions"} & config.given:
        raise UserError("--master and --partitions belong to the spark backend; add --backend spark or drop them")
    cfg = BridgeConfig(**BRIDGE_FIELDS.kwargs(config), kafka_config=parse_kafka_options(config["kafka_option"] or []))
    cfg.check()
    from bertopt.artifact import Artifact

    warning = Artifact.load(artifact, verify=False).batch_dependence_warning()
    if warning:
        typer.echo(warning, err=True)
    threads, batch_size, long_inputs = config["threads"], config["batch_size"], config["long_inputs"]
    if backend == "zmq" and long_inputs != "truncate":
        raise UserError(f"--long-inputs {long_inputs} needs --backend local or spark: a 'bertopt serve' fleet "
                        "truncates what ZeroMQ sends it (bert-as-service's behaviour)")
    try:
        if backend == "local":
            from bertopt.kafka.bridge import LocalBackend

            runner = LocalBackend(artifact, threads=threads, batch_size=batch_size, long_inputs=long_inputs)
        elif backend == "spark":
            from bertopt.kafka.spark_backend import SparkBackend

            runner = SparkBackend(artifact, master=config["master"], partitions=config["partitions"],
                                  threads=threads, batch_size=batch_size, max_text_chars=config["max_text_chars"],
                                  long_inputs=long_inputs)
        else:
            from bertopt.errors import require
            from bertopt.kafka.bridge import ZmqBackend

            require("zmq", "serve", "bertopt kafka --backend zmq")
            runner = ZmqBackend(artifact, host=config["server"], port=config["port"], port_out=config["port_out"],
                                timeout_ms=config["timeout_ms"])
        KafkaBridge(runner, cfg).run()
    except BackendFailed as exc:
        # one ERROR line, then the exit code itself: raised as SystemExit, it passes the Typer/click layer
        # untouched (a typer.Exit code is dropped in non-standalone mode)
        logging.getLogger("bertopt.kafka").error("backend failed: %s", exc)
        raise SystemExit(exc.exit_code) from None


def register(app: typer.Typer) -> None:
    from bertopt.kafka.params import KAFKA_PARAMS

    app.command("kafka", help=HELP)(typer_command("kafka", KAFKA_PARAMS, _kafka, help=HELP))
