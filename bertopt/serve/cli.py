"""``bertopt serve`` and ``bertopt client encode|predict|status``; heavy imports (zmq, onnxruntime) stay inside."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bertopt.errors import UserError
from bertopt.params import MAX_SEQ_LEN, PROVIDER

_ADDR_HELP = "Server address to connect to."


def _print_status(status: dict, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if as_json:
        print(json.dumps(status, indent=2, default=str))
        return
    console = Console()
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


def _device_map(value: Optional[str]) -> Optional[list[int]]:
    if not value:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--device-map {value!r} is not a list of GPU numbers; use e.g. --device-map 0,1") from None


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


def _register_serve(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_command(
        artifact: Optional[Path] = typer.Argument(None, help="Artifact folder to serve (not needed with --status "
                                                  "or --make-curve-keys).", show_default=False),
        port: int = typer.Option(5555, "--port", "-p", min=1, max=65535, help="Port clients push requests to."),
        port_out: int = typer.Option(5556, "--port-out", min=1, max=65535,
                                     help="Port clients subscribe to for replies."),
        num_worker: int = typer.Option(1, "--num-worker", "-n", min=1, help="Worker processes, each with one runtime "
                                       "session; on CPU the cores are split between them."),
        max_batch_size: int = typer.Option(256, "--max-batch-size", min=1, help="Most texts in one mini-job."),
        max_batch_tokens: int = typer.Option(16384, "--max-batch-tokens", min=1, help="Most tokens in one mini-job: "
                                             "requests are cut into, and packed into, mini-jobs of at most this "
                                             "many tokens (ZeroMQ and HTTP alike)."),
        http_port: Optional[int] = typer.Option(None, "--http-port",
                                                help="Also serve HTTP on this port: OpenAI /v1/embeddings and TEI "
                                                "/embed, /predict, /rerank, /tokenize, /health, /info, /metrics."),
        zmq: bool = typer.Option(True, "--zmq/--no-zmq", help="Serve ZeroMQ on --port/--port-out (--no-zmq "
                                 "with --http-port: HTTP only)."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="BERTOPT_API_KEY", help="HTTP clients "
                                              "must send 'Authorization: Bearer KEY' (env BERTOPT_API_KEY)."),
        max_client_batch_size: int = typer.Option(2048, "--max-client-batch-size", min=1, help="Most texts in one "
                                                  "request, ZeroMQ and HTTP (more: an error reply / 413)."),
        max_text_chars: int = typer.Option(100_000, "--max-text-chars", min=1, help="Most characters in one text "
                                           "(with its pair); checked before tokenising (more: an error reply / "
                                           "413)."),
        max_request_chars: int = typer.Option(4_000_000, "--max-request-chars", min=1, help="Most characters in "
                                              "one request, all texts together; checked before tokenising."),
        max_request_tokens: int = typer.Option(1 << 20, "--max-request-tokens", min=1, help="Most tokens in one "
                                               "request after truncation to --max-seq-len, checked before any "
                                               "inference (a mini-job holds at most --max-batch-tokens)."),
        body_timeout: float = typer.Option(30.0, "--body-timeout", min=0.001, help="Seconds an HTTP client may take "
                                           "to send its request body (then 408); a request is admitted (counted "
                                           "against --max-concurrent-requests) only once its body is read."),
        max_concurrent_requests: int = typer.Option(512, "--max-concurrent-requests", min=1, help="HTTP requests "
                                                    "admitted at once; beyond it: 429 with Retry-After."),
        request_timeout: float = typer.Option(60.0, "--request-timeout", min=0.001, help="Seconds an HTTP request may "
                                              "wait for its answer (then 504)."),
        bulk_nice: int = typer.Option(10, "--bulk-nice",
                                      help="Nice value of the workers' bulk-lane threads (0-19): under a "
                                      "flood, small (priority) requests get the cores first. 0 gives bulk work the "
                                      "same priority."),
        priority_batch_size: int = typer.Option(16, "--priority-batch-size", min=0, help="Requests of at most this "
                                                "many texts go to the priority lane and never wait behind "
                                                "large requests (0 disables it)."),
        max_seq_len: Optional[int] = MAX_SEQ_LEN.typer_option(),
        device_map: Optional[str] = typer.Option(None, "--device-map", help="GPU numbers for the workers, e.g. "
                                                 "0,1 (worker i uses device i mod len); CUDA only."),
        bind: str = typer.Option("127.0.0.1", "--bind", help="Address to listen on; 0.0.0.0 exposes the "
                                 "server to the network (consider --curve-keys)."),
        provider: str = PROVIDER.typer_option(),
        threads_per_worker: Optional[int] = typer.Option(None, "--threads-per-worker", min=1, help="Threads per "
                                                         "worker (default: cores // workers, at least 1)."),
        max_request_bytes: int = typer.Option(64 << 20, "--max-request-bytes", min=1, help="Larger requests get an "
                                              "error reply asking to split them (HTTP: 413, from Content-Length "
                                              "before the body is read)."),
        grace: float = typer.Option(60.0, "--grace", min=0, help="Seconds to finish in-flight requests on SIGTERM."),
        curve_keys: Optional[str] = typer.Option(None, "--curve-keys", help="Folder with server.key_secret and "
                                                 "authorized/*.key: CurveZMQ encryption + client "
                                                 "authentication (make one with --make-curve-keys)."),
        make_curve_keys: Optional[str] = typer.Option(None, "--make-curve-keys", help="Create a key folder "
                                                      "(server and one client key pair) and exit."),
        status: bool = typer.Option(False, "--status", help="Do not serve: ask the server running on --port/"
                                    "--port-out for its configuration and counters."),
        ip: str = typer.Option("127.0.0.1", "--ip", help="With --status: the server's address."),
        as_json: bool = typer.Option(False, "--json", help="With --status: print raw JSON."),
        timeout: float = typer.Option(10.0, "--timeout", min=0.001,
                                      help="With --status: seconds to wait for the server."),
    ) -> None:
        """Serve an artifact over ZeroMQ (bert-as-service compatible: BertClient works unchanged) and/or HTTP
        (OpenAI /v1/embeddings and Hugging Face TEI routes) from one worker fleet.

        One ventilator splits requests into mini-jobs and balances them over worker processes (each running the
        artifact through bertopt's runtime, so what is served is what was validated); a sink reassembles and
        publishes each reply. Small requests have their own lane and do not wait behind large ones; a worker
        that dies is restarted and its work re-sent. SIGTERM/Ctrl-C finishes in-flight requests, then exits 0.

        Example: [bold]bertopt serve artifacts/minilm/03-quantize --num-worker 2 --http-port 8080[/], then
        [bold]bertopt client encode "hello world"[/], [bold]curl localhost:8080/embed -d '{"inputs":"hi"}'[/]
        or [bold]bertopt serve --status[/].
        """
        if make_curve_keys:
            from bertopt.serve.server import make_curve_keys as make

            root = make(make_curve_keys)
            typer.echo(f"wrote CurveZMQ keys to {root}: serve with --curve-keys {root}; give clients "
                       f"{root}/client.key_secret and {root}/server.key (Client(curve_keys=...))")
            return
        if status:
            _print_status(_fetch_status(ip, port, port_out, timeout, curve_keys), as_json)
            return
        if artifact is None:
            raise UserError("missing ARTIFACT; give the artifact folder to serve (or --status to query a server)")
        from bertopt.artifact import Artifact
        from bertopt.serve.server import ServeConfig, serve

        warning = Artifact.load(artifact, verify=False).batch_dependence_warning()
        if warning:
            typer.echo(warning, err=True)
        cfg = ServeConfig(artifact=str(artifact), port=port, port_out=port_out, bind=bind, num_worker=num_worker,
                          max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                          priority_batch_size=priority_batch_size, max_seq_len=max_seq_len,
                          device_map=_device_map(device_map), provider=provider,
                          threads_per_worker=threads_per_worker, max_request_bytes=max_request_bytes,
                          grace_s=grace, curve_keys=curve_keys, zmq=zmq, http_port=http_port, api_key=api_key,
                          max_client_batch_size=max_client_batch_size, max_text_chars=max_text_chars,
                          max_request_chars=max_request_chars, max_request_tokens=max_request_tokens,
                          body_timeout_s=body_timeout,
                          max_concurrent_requests=max_concurrent_requests, request_timeout_s=request_timeout,
                          bulk_nice=bulk_nice)

        # each worker logs "worker i ready" to stderr as it loads; the ready line goes to stdout
        serve(cfg, on_ready=lambda line: print(line, flush=True))


def _register_client(app: typer.Typer) -> None:
    client_app = typer.Typer(help="Talk to a running 'bertopt serve' (or bert-as-service) server.",
                             no_args_is_help=True)
    app.add_typer(client_app, name="client")

    @client_app.command("encode")
    def client_encode(
        texts: List[str] = typer.Argument(..., help="Texts to encode.", show_default=False),
        ip: str = typer.Option("127.0.0.1", "--ip", help=_ADDR_HELP),
        port: int = typer.Option(5555, "--port", "-p", min=1, max=65535, help="The server's request port."),
        port_out: int = typer.Option(5556, "--port-out", min=1, max=65535, help="The server's reply port."),
        timeout: float = typer.Option(30.0, "--timeout", min=0.001, help="Seconds to wait for the reply."),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="Save the (n, d) float32 array as .npy."),
        as_json: bool = typer.Option(False, "--json", help="Print the full vectors as JSON."),
        curve_keys: Optional[str] = typer.Option(None, "--curve-keys", help="Key folder for a CurveZMQ server."),
    ) -> None:
        """Encode texts on a running server and print their vectors (or save them with --out)."""
        import numpy as np

        from bertopt.client import Client, ServerError, ServerTimeout

        try:
            with Client(ip, port, port_out, timeout=timeout, curve_keys=curve_keys) as client:
                vectors = client.encode(texts)
        except (ServerTimeout, ServerError) as exc:
            raise UserError(str(exc)) from None
        if out is not None:
            np.save(out, vectors)
            print(f"wrote {out} ({vectors.shape[0]} x {vectors.shape[1]} float32)")
        elif as_json:
            print(json.dumps(vectors.tolist()))
        else:
            for text, vec in zip(texts, vectors):
                head = ", ".join(f"{v:+.4f}" for v in vec[:4])
                print(f"{text[:40]!r:44} d={len(vec)} norm={np.linalg.norm(vec):.4f} [{head}, ...]")

    @client_app.command("predict")
    def client_predict(
        texts: List[str] = typer.Argument(..., help="Texts (rerank: the queries).", show_default=False),
        pair: Optional[List[str]] = typer.Option(None, "--pair", help="Second text of each input, once per text "
                                                 "(rerank: the passage each query is scored with)."),
        aggregation: Optional[str] = typer.Option(None, "--aggregation", help="Token classification: none, simple, "
                                                  "first, average or max (default: simple)."),
        ip: str = typer.Option("127.0.0.1", "--ip", help=_ADDR_HELP),
        port: int = typer.Option(5555, "--port", "-p", help="The server's request port."),
        port_out: int = typer.Option(5556, "--port-out", help="The server's reply port."),
        timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the reply."),
        curve_keys: Optional[str] = typer.Option(None, "--curve-keys", help="Key folder for a CurveZMQ server."),
    ) -> None:
        """The served model's task results, one JSON line per text: label + score for classifiers, entities for
        token classification, a score for rerank (with --pair), indices + values for SPLADE, the vector for
        embeddings."""
        from bertopt.client import Client, ServerError, ServerTimeout

        try:
            with Client(ip, port, port_out, timeout=timeout, curve_keys=curve_keys) as client:
                results = client.predict(texts, pair or None, aggregation=aggregation)
        except (ServerTimeout, ServerError) as exc:
            raise UserError(str(exc)) from None
        for i, (text, result) in enumerate(zip(texts, results)):
            row = {"text": text, **({"pair": pair[i]} if pair else {}), "result": result}
            print(json.dumps(row))

    @client_app.command("status")
    def client_status(
        ip: str = typer.Option("127.0.0.1", "--ip", help=_ADDR_HELP),
        port: int = typer.Option(5555, "--port", "-p", min=1, max=65535, help="The server's request port."),
        port_out: int = typer.Option(5556, "--port-out", min=1, max=65535, help="The server's reply port."),
        timeout: float = typer.Option(10.0, "--timeout", min=0.001, help="Seconds to wait for the reply."),
        as_json: bool = typer.Option(False, "--json", help="Print raw JSON."),
        curve_keys: Optional[str] = typer.Option(None, "--curve-keys", help="Key folder for a CurveZMQ server."),
    ) -> None:
        """Show a running server's configuration and counters (requests, mini-jobs, workers, queues, uptime)."""
        _print_status(_fetch_status(ip, port, port_out, timeout, curve_keys), as_json)
