"""``bertopt serve`` and ``bertopt client encode|predict|status``; heavy imports (zmq, onnxruntime) stay inside."""

from __future__ import annotations

import json
from typing import Optional

import typer

from bertopt.errors import UserError
from bertopt.params import typer_command


def _print_status(status: dict, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if as_json:
        print(json.dumps(status, indent=2, default=str))
        return
    console = Console(emoji=False)
    workers = status.pop("workers", [])
    table = Table(title="bertopt server", title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in status.items():
        table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    console.print(table)
    wt = Table(title="workers", title_justify="left")
    for col in ("index", "pid", "ready", "in_flight", "jobs_done", "texts_done", "restarts", "threads", "provider"):
        wt.add_column(col)
    for w in workers:
        wt.add_row(*(str(w.get(c)) for c in ("index", "pid", "ready", "in_flight", "jobs_done", "texts_done",
                                             "restarts", "threads", "provider")))
    console.print(wt)


def _fetch_status(ip: str, port: int, port_out: int, timeout: float, curve_keys: Optional[str]) -> dict:
    from bertopt.client import Client, ServerTimeout

    try:
        with Client(ip, port, port_out, timeout=timeout, curve_keys=curve_keys) as client:
            return client.status()
    except ServerTimeout as exc:
        raise UserError(str(exc)) from None


def register(app: typer.Typer) -> None:
    _register_serve(app)
    _register_client(app)


SERVE_HELP = """Serve an artifact over ZeroMQ (bert-as-service compatible: BertClient works unchanged) and/or HTTP
(OpenAI /v1/embeddings and Hugging Face TEI routes) from one worker fleet.

One ventilator splits requests into mini-jobs and balances them over worker processes (each running the
artifact through bertopt's runtime, so what is served is what was validated); a sink reassembles and
publishes each reply. Small requests have their own lane and do not wait behind large ones; a worker
that dies is restarted and its work re-sent. SIGTERM/Ctrl-C finishes in-flight requests, then exits 0.

Several artifacts share one fleet (each with its own workers and queues): [bold]bertopt serve embed=ART1
rerank=ART2[/] or [bold]--models fleet.yaml[/]; HTTP requests pick one by "model" (TEI routes: by task), ZeroMQ
clients with Client(model=...) (bert-serving-client: the first).

Example: [bold]bertopt serve artifacts/minilm/03-quantize --num-worker 2 --http-port 8080[/], then
[bold]bertopt client encode "hello world"[/], [bold]curl localhost:8080/embed -d '{"inputs":"hi"}'[/]
or [bold]bertopt serve --status[/]."""


def _serve(config: dict) -> None:
    if config["make_curve_keys"]:
        from bertopt.serve.server import make_curve_keys as make

        root = make(config["make_curve_keys"])
        typer.echo(f"wrote CurveZMQ keys to {root}: serve with --curve-keys {root}; give clients "
                   f"{root}/client.key_secret and {root}/server.key (Client(curve_keys=...))")
        return
    if config["status"]:
        _print_status(_fetch_status(config["ip"], config["port"], config["port_out"], config["timeout"],
                                    config["curve_keys"]), config["as_json"])
        return
    from bertopt.serve.params import serve_config_kwargs

    kwargs = serve_config_kwargs(config)
    from bertopt.artifact import Artifact
    from bertopt.serve.server import ServeConfig, serve

    for artifact in [s.artifact for s in kwargs.get("models") or []] or [kwargs.get("artifact")]:
        warning = Artifact.load(artifact, verify=False).batch_dependence_warning()
        if warning:
            typer.echo(warning, err=True)
    # each worker logs "worker i ready" to stderr as it loads; the ready line goes to stdout
    serve(ServeConfig(**kwargs), on_ready=lambda line: print(line, flush=True))


def _client_encode(config: dict) -> None:
    """Encode texts on a running server and print their vectors (or save them with --out)."""
    import numpy as np

    from bertopt.client import Client, ServerError, ServerTimeout

    texts, out = config["texts"], config["out"]
    if out is not None:  # before the server is asked: a bad --out costs no request
        from bertopt.output_paths import check_output_file

        out = check_output_file(out, suffix=".npy")
    try:
        with Client(config["ip"], config["port"], config["port_out"], timeout=config["timeout"],
                    curve_keys=config["curve_keys"], model=config["model"]) as client:
            vectors = client.encode(texts)
    except (ServerTimeout, ServerError) as exc:
        raise UserError(str(exc)) from None
    if out is not None:
        from bertopt.output_paths import write_file

        write_file(out, lambda handle: np.save(handle, vectors))
        print(f"wrote {config['out']} ({vectors.shape[0]} x {vectors.shape[1]} float32)")
    elif config["as_json"]:
        print(json.dumps(vectors.tolist()))
    else:
        for text, vec in zip(texts, vectors):
            head = ", ".join(f"{v:+.4f}" for v in vec[:4])
            print(f"{text[:40]!r:44} d={len(vec)} norm={np.linalg.norm(vec):.4f} [{head}, ...]")


def _client_predict(config: dict) -> None:
    from bertopt.client import Client, ServerError, ServerTimeout

    texts, pair = config["texts"], config["pair"]
    try:
        with Client(config["ip"], config["port"], config["port_out"], timeout=config["timeout"],
                    curve_keys=config["curve_keys"], model=config["model"]) as client:
            results = client.predict(texts, pair or None, aggregation=config["aggregation"])
    except (ServerTimeout, ServerError) as exc:
        raise UserError(str(exc)) from None
    for i, (text, result) in enumerate(zip(texts, results)):
        row = {"text": text, **({"pair": pair[i]} if pair else {}), "result": result}
        print(json.dumps(row))


def _client_status(config: dict) -> None:
    _print_status(_fetch_status(config["ip"], config["port"], config["port_out"], config["timeout"],
                                config["curve_keys"]), config["as_json"])


def _register_serve(app: typer.Typer) -> None:
    from bertopt.serve.params import SERVE_PARAMS

    app.command("serve", help=SERVE_HELP)(typer_command("serve", SERVE_PARAMS, _serve, help=SERVE_HELP))


def _register_client(app: typer.Typer) -> None:
    from bertopt.serve.params import CLIENT_ENCODE_PARAMS, CLIENT_PREDICT_PARAMS, CLIENT_STATUS_PARAMS

    client_app = typer.Typer(help="Talk to a running 'bertopt serve' (or bert-as-service) server.",
                             no_args_is_help=True)
    app.add_typer(client_app, name="client")
    for name, params, run, text in (
        ("encode", CLIENT_ENCODE_PARAMS, _client_encode,
         "Encode texts on a running server and print their vectors (or save them with --out)."),
        ("predict", CLIENT_PREDICT_PARAMS, _client_predict,
         "The served model's task results, one JSON line per text: label + score for classifiers, entities for "
         "token classification, a score for rerank (with --pair), indices + values for SPLADE, the vector for "
         "embeddings."),
        ("status", CLIENT_STATUS_PARAMS, _client_status,
         "Show a running server's configuration and counters (requests, mini-jobs, workers, queues, uptime)."),
    ):
        client_app.command(name, help=text)(typer_command(f"client {name}", params, run, help=text))
