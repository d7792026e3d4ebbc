"""``bertopt serve`` and ``bertopt client`` options, declared once: the command line is built from them
(``params.typer_command``) and ``ServeConfig.check`` checks a config made through the API against the same ones."""

from __future__ import annotations

from bertopt.messages import MAX_REQUEST_BYTES_PARAM, MAX_REQUEST_CHARS_PARAM, MAX_TEXT_CHARS_PARAM, MAX_TEXTS_PARAM
from bertopt.params import (
    LONG_INPUTS,
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    MAX_THREADS,
    MAX_WORKERS,
    PROVIDER,
    ConfigFields,
    Param,
    not_blank,
    path_given,
)


def _gpu_numbers(value: str) -> str | None:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        return f"{value!r} is not a list of GPU numbers; use e.g. --device-map 0,1"
    if not numbers or min(numbers) < 0:  # ',,' would serve on the CPU without a word
        return f"{value!r} is not a list of GPU numbers (0 or more); use e.g. --device-map 0,1"
    return None


def device_map(value: str | None) -> list[int] | None:
    """``--device-map 0,1`` as the list of GPU numbers ServeConfig takes."""
    return [int(v) for v in value.split(",") if v.strip()] if value else None


def _port(name: str, default: int, help: str) -> Param:
    return Param(name, int, default, help, min=1, max=65535, aliases=("-p",) if name == "port" else ())


# What a client needs to reach a server (serve --status and every `bertopt client` command).
IP = Param("ip", str, "127.0.0.1", "Server address to connect to.")
PORT = _port("port", 5555, "The server's request port (clients push requests to it).")
PORT_OUT = _port("port_out", 5556, "The server's reply port (clients subscribe to it).")
CURVE_KEYS = Param("curve_keys", str, None, "Key folder: with serve, server.key_secret and authorized/*.key "
                   "(CurveZMQ encryption + client authentication; make one with --make-curve-keys); with a client, "
                   "the folder of a CurveZMQ server's keys.")
TIMEOUT = Param("timeout", float, 30.0, "Seconds to wait for the reply.", min=0.001)
AS_JSON = Param("as_json", bool, False, "Print raw JSON.", flag="--json", negatable=False)

# ServeConfig's settings; the Param's name is the field's unless SERVE_FIELDS says otherwise.
SERVE_CONFIG_PARAMS = [
    PORT,
    PORT_OUT,
    Param("num_worker", int, 1, "Worker processes, each with one runtime session; on CPU the cores are split "
          "between them.", min=1, max=MAX_WORKERS, aliases=("-n",)),
    Param("max_batch_size", int, 256, "Most texts in one mini-job.", min=1, max=MAX_BATCH_SIZE),
    Param("max_batch_tokens", int, 16384, "Most tokens in one mini-job: requests are cut into, and packed into, "
          "mini-jobs of at most this many tokens (ZeroMQ and HTTP alike).", min=1),
    Param("http_port", int, None, "Also serve HTTP on this port: OpenAI /v1/embeddings and TEI /embed, /predict, "
          "/rerank, /tokenize, /health, /info, /metrics.", min=1, max=65535),
    Param("zmq", bool, True, "Serve ZeroMQ on --port/--port-out (--no-zmq with --http-port: HTTP only)."),
    Param("api_key", str, None, "HTTP clients must send 'Authorization: Bearer KEY' (env BERTOPT_API_KEY).",
          envvar="BERTOPT_API_KEY", check=not_blank("give a secret, or leave the option out")),
    MAX_TEXTS_PARAM.with_(name="max_client_batch_size", default=2048, help="Most texts in one request, ZeroMQ and "
                          "HTTP (more: an error reply / 413)."),
    MAX_TEXT_CHARS_PARAM,
    MAX_REQUEST_CHARS_PARAM,
    Param("max_request_tokens", int, 1 << 20, "Most tokens in one request after truncation to --max-seq-len (a "
          "chunked text: all its tokens), checked before any inference (a mini-job holds at most "
          "--max-batch-tokens).", min=1),
    Param("body_timeout", float, 30.0, "Seconds an HTTP client may take to send its request line and headers "
          "(then the connection is closed), and again its body (then 408); a request is admitted (counted against "
          "--max-concurrent-requests) only once its body is read.",
          min=0.001),
    Param("max_concurrent_requests", int, 512, "HTTP requests admitted at once; beyond it: 429 with Retry-After.",
          min=1),
    Param("max_queued_requests", int, 1024, "Requests waiting in the fleet's queue (ZeroMQ and HTTP together); a "
          "ZeroMQ request beyond it gets a busy error reply at once (bert-serving-client raises it, bertopt's "
          "Client raises ServerBusy) instead of waiting into the client's timeout.", min=1),
    Param("warmup", bool, True, "Each worker runs one batch per sequence-length bucket before it reports ready "
          "(/health turns 200 after), so the first requests do not pay the runtime's first-run costs; "
          "--no-warmup skips it."),
    Param("request_timeout", float, 60.0, "Seconds an HTTP request may wait for its answer (then 504).",
          min=0.001),
    Param("bulk_nice", int, 10, "Nice value of the workers' bulk-lane threads (0-19): under a flood, small "
          "(priority) requests get the cores first. 0 gives bulk work the same priority.", min=0, max=19),
    Param("priority_batch_size", int, 16, "Requests of at most this many texts go to the priority lane and never "
          "wait behind large requests (0 disables it).", min=0),
    MAX_SEQ_LEN,
    LONG_INPUTS.with_(default="error", help="HTTP: an input longer than the model's window (--max-seq-len) is an "
                      "error naming the limit (TEI's behaviour; a request's \"truncate\": true cuts it instead), is "
                      "truncated, or is chunked: run as overlapping windows pooled by a token-weighted mean (a "
                      "request's \"long_inputs\" field overrides it). ZeroMQ clients keep bert-as-service's "
                      "truncation."),
    Param("device_map", str, None, "GPU numbers for the workers, e.g. 0,1 (worker i uses device i mod len); CUDA "
          "only.", check=_gpu_numbers),
    Param("bind", str, "127.0.0.1", "Address to listen on; 0.0.0.0 exposes the server to the network (consider "
          "--curve-keys)."),
    PROVIDER,
    Param("threads_per_worker", int, None, "Threads per worker (default: cores // workers, at least 1).", min=1,
          max=MAX_THREADS),
    MAX_REQUEST_BYTES_PARAM.with_(default=64 << 20, min=1024, help="Larger requests get an error reply asking to "
                                  "split them (HTTP: 413, from Content-Length before the body is read)."),
    Param("worker_stall_timeout", float, 300.0, "Seconds a worker may spend on one mini-job before it is taken "
          "for hung (stopped, or stuck in its runtime): it is killed and restarted and the mini-job re-sent (a "
          "request whose piece stalls 3 times gets an error).", min=1),
    Param("grace", float, 60.0, "Seconds to finish the requests already taken on SIGTERM / Ctrl-C; then (or at a "
          "second signal) those unfinished are answered with an error and the server exits.", min=0),
    CURVE_KEYS,
]
# ServeConfig's fields: the flags say --grace, the config grace_s
SERVE_FIELDS = ConfigFields(SERVE_CONFIG_PARAMS, {"grace": "grace_s", "body_timeout": "body_timeout_s",
                                                  "request_timeout": "request_timeout_s",
                                                  "worker_stall_timeout": "worker_stall_timeout_s"})

SERVE_PARAMS = [
    Param("artifact", list, None, "Artifact folder(s) to serve on one fleet; NAME=PATH names a model (default: "
          "the folder's name), the first is the default model (not needed with --status or --make-curve-keys).",
          positional=True),
    Param("models", str, None, "A YAML file listing the models to serve (name -> artifact, or name -> {artifact, "
          "workers, threads}); with or instead of ARTIFACT.", file=True),
    *SERVE_CONFIG_PARAMS,
    Param("make_curve_keys", str, None, "Create a key folder (server and one client key pair) and exit.",
          check=path_given),
    Param("status", bool, False, "Do not serve: ask the server running on --port/--port-out for its configuration "
          "and counters.", negatable=False),
    IP.with_(help="With --status: the server's address."),
    AS_JSON.with_(help="With --status: print raw JSON."),
    TIMEOUT.with_(default=10.0, help="With --status: seconds to wait for the server."),
]

_CLIENT = [IP, PORT, PORT_OUT, CURVE_KEYS.with_(help="Key folder for a CurveZMQ server.")]
MODEL = Param("model", str, None, "The served model to address, by name (a server of several models; default: "
              "its first).")
CLIENT_ENCODE_PARAMS = [
    Param("texts", list, None, "Texts to encode.", positional=True, required=True),
    *_CLIENT,
    MODEL,
    TIMEOUT,
    Param("out", str, None, "Save the (n, d) float32 array to this new .npy file (never inside an artifact "
          "folder; an existing file is not replaced).", aliases=("-o",)),
    AS_JSON.with_(help="Print the full vectors as JSON."),
]
CLIENT_PREDICT_PARAMS = [
    Param("texts", list, None, "Texts (rerank: the queries).", positional=True, required=True),
    Param("pair", list, None, "Second text of each input, once per text (rerank: the passage each query is scored "
          "with).", repeat=True),
    Param("aggregation", str, None, "Token classification: none, simple, first, average or max (default: "
          "simple)."),
    *_CLIENT,
    MODEL,
    TIMEOUT,
]
CLIENT_STATUS_PARAMS = [*_CLIENT, TIMEOUT.with_(default=10.0), AS_JSON]


def config_values(config) -> dict:
    """ServeConfig's fields, by Param name, as the flags spell them (for ``check_values``)."""
    values = SERVE_FIELDS.values(config)
    if values["device_map"] is not None:
        values["device_map"] = ",".join(str(d) for d in values["device_map"])
    return values


def serve_config_kwargs(config: dict) -> dict:
    """ServeConfig keyword arguments from a checked ``bertopt serve`` config: one artifact as before, several (or
    ``--models``) as ``models``."""
    from bertopt.serve.fleet import model_specs

    specs = model_specs(config["artifact"], config["models"])
    out = SERVE_FIELDS.kwargs(config)
    out["device_map"] = device_map(out["device_map"])
    if len(specs) == 1 and specs[0].num_worker is None and specs[0].threads is None:
        return {"artifact": specs[0].artifact, "name": specs[0].name, **out}
    return {"models": specs, **out}
