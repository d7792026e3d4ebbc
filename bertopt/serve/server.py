"""``bertopt serve``: one ventilator (this process), one sink process, N worker processes per served model.

    clients --PUSH--> [ventilator :port] --mini-jobs--> [worker 0..N-1] --results--> [sink] --PUB :port_out--> clients
                           ^   supervises workers, re-sends the mini-jobs of a dead one    |
                           +--------------------- status/errors ---------------------------+

Several models (``bertopt serve ART1 ART2``, ``--models fleet.yaml``; ``fleet.py``) share the ventilator, the sink
and the front ends; each has worker processes and queues of its own (``ventilator.py``).

Workers are real processes (``python -I -m bertopt.serve.worker``: isolated from the current folder, the user
site and PYTHON* variables, with a trimmed environment), each with one Predictor; on CPU the cores are
split between them (threads per worker = cores // workers, at least 1). SIGTERM/SIGINT: stop taking requests,
finish every request taken, stop workers and sink, return normally (exit 0).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from bertopt.errors import UserError, check_writable, require
from bertopt.protocol import WIRE_VERSION
from bertopt.serve.fleet import ModelSpec, check_name, check_unique
from bertopt.serve.params import SERVE_FIELDS
from bertopt.serve.processes import check_children_import_this_bertopt, start_child

log = logging.getLogger("bertopt.serve")
MiB = 1 << 20
_DEFAULT = SERVE_FIELDS.defaults()  # ServeConfig's defaults are its Params' (serve/params.py)


@dataclass
class ServeConfig:
    artifact: str | None = None  # the one model's folder (several: ``models``)
    port: int = _DEFAULT["port"]
    port_out: int = _DEFAULT["port_out"]
    bind: str = _DEFAULT["bind"]
    num_worker: int = _DEFAULT["num_worker"]
    max_batch_size: int = _DEFAULT["max_batch_size"]
    max_batch_tokens: int = _DEFAULT["max_batch_tokens"]
    priority_batch_size: int = _DEFAULT["priority_batch_size"]
    max_seq_len: int | None = _DEFAULT["max_seq_len"]
    long_inputs: str = _DEFAULT["long_inputs"]
    device_map: list[int] | None = None
    provider: str = _DEFAULT["provider"]
    threads_per_worker: int | None = _DEFAULT["threads_per_worker"]
    max_request_bytes: int = _DEFAULT["max_request_bytes"]
    grace_s: float = _DEFAULT["grace_s"]
    worker_stall_timeout_s: float = _DEFAULT["worker_stall_timeout_s"]
    startup_timeout_s: float = 300.0
    curve_keys: str | None = _DEFAULT["curve_keys"]
    log_level: str = "INFO"
    zmq: bool = _DEFAULT["zmq"]
    http_port: int | None = _DEFAULT["http_port"]
    api_key: str | None = _DEFAULT["api_key"]
    max_client_batch_size: int = _DEFAULT["max_client_batch_size"]
    max_text_chars: int = _DEFAULT["max_text_chars"]
    max_request_chars: int = _DEFAULT["max_request_chars"]
    max_request_tokens: int = _DEFAULT["max_request_tokens"]
    body_timeout_s: float = _DEFAULT["body_timeout_s"]
    max_concurrent_requests: int = _DEFAULT["max_concurrent_requests"]
    request_timeout_s: float = _DEFAULT["request_timeout_s"]
    bulk_nice: int = _DEFAULT["bulk_nice"]
    max_queued_requests: int = _DEFAULT["max_queued_requests"]
    warmup: bool = _DEFAULT["warmup"]
    name: str | None = None  # the one model's name (default: the artifact's folder name)
    models: list[ModelSpec] = field(default_factory=list)  # several models: these (then artifact is ignored)

    def model_specs(self) -> list[ModelSpec]:
        """The served models, the first the default: ``models``, or the one ``artifact``."""
        if self.models:
            return list(self.models)
        if not self.artifact:
            raise UserError("serve: no artifact; give artifact= (one model) or models=[ModelSpec(name, artifact)]")
        return [ModelSpec(self.name or Path(self.artifact).resolve().name, self.artifact)]

    def workers_of(self, spec: ModelSpec) -> int:
        return spec.num_worker or self.num_worker

    @property
    def priority_tokens(self) -> int:
        """A priority request (and a priority mini-job) holds at most this many tokens."""
        return max(512, self.max_batch_tokens // 8)

    def check(self) -> None:
        """Each value against its declaration (``serve/params.py``: the flags' bounds, stated once), then what
        relates two of them."""
        from bertopt.serve.params import config_values

        SERVE_FIELDS.check(self, "serve", config_values(self))
        if not self.zmq and self.http_port is None:
            raise UserError("--no-zmq leaves nothing to serve; add --http-port PORT")
        if self.port == self.port_out:
            raise UserError(f"--port and --port-out are both {self.port}; give them different ports")
        if self.device_map and self.provider == "cpu":  # a device map runs every worker on CUDA
            raise UserError("--device-map places the workers on GPUs, but --provider cpu keeps them on the CPU; drop "
                            "one of the two")
        if self.http_port is not None and self.zmq and self.http_port in (self.port, self.port_out):
            which = "--port" if self.http_port == self.port else "--port-out"
            raise UserError(f"--http-port {self.http_port} is also the ZeroMQ {which}; give each its own port")
        specs = self.model_specs()
        for spec in specs:
            check_name(spec.name, "serve")
        check_unique(specs)
        # a priority request is one mini-job, so it can be no larger than one
        self.priority_batch_size = min(self.priority_batch_size, self.max_batch_size)

    def threads(self, spec: ModelSpec | None = None) -> int:
        """Threads per worker of ``spec`` (default: the first model): its own, --threads-per-worker, or the cores
        split over every worker of the fleet."""
        from bertopt.runtime.backends import default_threads

        if spec is not None and spec.threads:
            return spec.threads
        if self.threads_per_worker:
            return self.threads_per_worker
        total = sum(self.workers_of(s) for s in self.model_specs())
        return max(1, default_threads() // total)


def _model_facts(artifact_path: str, max_seq_len: int | None, name: str | None = None) -> dict:
    from bertopt.artifact import Artifact

    art = Artifact.load(artifact_path)  # verified here and again by every worker that loads it (restarts too)
    info = art.model_info
    from bertopt.runtime.predictor import sequence_length

    seq = sequence_length(info, max_seq_len)
    from bertopt.runtime.tasks import task_of, task_output

    task = task_of(art)
    outputs = {o["name"]: o for o in art.outputs}
    primary = task_output(art, task)
    shape = outputs[primary].get("shape", [])
    token_level = "sequence" in [str(d) for d in shape]
    if token_level and task != "token-classification":
        raise UserError(f"the artifact's {task} output {primary!r} is per-token; bertopt serve returns one "
                        "result per text, serve a pooled (embedding, classification, rerank or sparse) artifact")
    return {"name": name or art.path.absolute().name, "artifact": str(art.path.absolute()), "digest": art.digest,
            "precision": art.precision,
            "max_seq_len": seq, "embedding_dim": shape[-1] if shape else None, "output": primary,
            "task": task, "tokenizer": str(art.tokenizer_path),
            "id2label": info.get("id2label"), "problem_type": info.get("problem_type"),
            "model_info": info, "token_level": token_level}


def _curve_server_keys(keys_dir: str | None) -> tuple[str, str] | None:
    """(public, secret) of DIR/server.key_secret, made with ``bertopt serve --make-curve-keys DIR``."""
    if not keys_dir:
        return None
    require("zmq", "serve", "CurveZMQ")
    import zmq
    import zmq.auth

    secret_file = Path(keys_dir) / "server.key_secret"
    if not secret_file.exists():
        raise UserError(f"no server.key_secret in {keys_dir}; create keys with 'bertopt serve --make-curve-keys "
                        f"{keys_dir}'")
    if not zmq.has("curve"):
        raise UserError("this libzmq has no CurveZMQ support; drop --curve-keys or install pyzmq with libsodium")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    return public.decode(), secret.decode()


def exposure_warnings(c: ServeConfig) -> list[str]:
    """What a server listening beyond this machine leaves open (no error: a private network may be meant)."""
    if c.bind in ("127.0.0.1", "::1", "localhost"):
        return []
    lines = []
    if c.zmq and not c.curve_keys:
        lines.append(f"listening on {c.bind} without --curve-keys: anyone who reaches port {c.port} can send "
                     f"requests, and anyone who subscribes to port {c.port_out} reads every reply")
    if c.http_port is not None and not c.api_key:
        lines.append(f"listening on {c.bind} without --api-key: anyone who reaches port {c.http_port} can send "
                     "requests")
    return lines


def make_curve_keys(keys_dir: str) -> Path:
    """Server and one client key pair; clients listed in DIR/authorized/*.key may connect."""
    require("zmq", "serve", "CurveZMQ")
    import zmq.auth

    root = Path(keys_dir)
    if (root / "server.key_secret").exists():
        raise UserError(f"{root} already holds server keys; choose an empty folder")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        # secret keys beside other files end up shipped with them (an artifact folder, a repository)
        raise UserError(f"{root} is not an empty folder; secret keys go in a folder of their own: choose a new one")
    check_writable(root, "--make-curve-keys")  # a parent that is a file, or a folder this process cannot write
    # secrets readable by their owner only, whatever the umask: the folder 700 from its creation, each secret 600
    old_umask = os.umask(0o077)
    try:
        (root / "authorized").mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        zmq.auth.create_certificates(str(root), "server")
        zmq.auth.create_certificates(str(root), "client")
    finally:
        os.umask(old_umask)
    for secret in root.glob("*.key_secret"):
        secret.chmod(0o600)
    (root / "authorized" / "client.key").write_bytes((root / "client.key").read_bytes())
    return root


class Server:
    def __init__(self, cfg: ServeConfig):
        cfg.check()
        self.cfg = cfg
        self.specs = cfg.model_specs()
        # every model's facts (the first is the default model; ``facts`` keeps the one-model name)
        self.models = [dict(_model_facts(s.artifact, cfg.max_seq_len, s.name), num_worker=cfg.workers_of(s),
                            threads_per_worker=cfg.threads(s)) for s in self.specs]
        self.facts = self.models[0]
        self.threads = cfg.threads(self.specs[0])
        self.sink_proc: subprocess.Popen | None = None
        self.ventilator = None
        self.http = None  # the HTTP front end (bertopt.serve.http_front.HttpFront), when --http-port
        self.ctx = None
        self.auth = None
        self._stopped = False

    def _sink_exit(self) -> int | None:
        return None if self.sink_proc is None else self.sink_proc.poll()

    def _start_sink(self, curve, http_reply: str | None) -> str:
        scfg = {"bind": self.cfg.bind, "port_out": self.cfg.port_out if self.cfg.zmq else None,
                "grace_s": self.cfg.grace_s, "log_level": self.cfg.log_level,
                "curve_secret": curve[1] if curve else None, "http_reply": http_reply,
                "curve_authorized": str(Path(self.cfg.curve_keys) / "authorized") if curve else None}
        self.sink_proc = start_child("bertopt.serve.sink", scfg, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.sink_proc.stdout], [], [], 60)
        line = self.sink_proc.stdout.readline().strip() if ready else ""
        self.sink_proc.stdout.close()
        if line.startswith("PORT "):
            return f"tcp://127.0.0.1:{int(line.split()[1])}"
        self.sink_proc.kill()
        self.sink_proc.wait(10)
        if line.startswith("ERROR "):
            raise UserError(line[6:])
        raise UserError("the sink process did not start; see the log above")

    def _bind_frontend(self, zmq, curve):
        """The ZeroMQ request port (PULL), or None when serving HTTP only."""
        cfg = self.cfg
        if not cfg.zmq:
            return None
        frontend = self.ctx.socket(zmq.PULL)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.setsockopt(zmq.RCVHWM, 0)
        # hard stop far above the polite limit: the polite one gets an error reply, this one a disconnect
        frontend.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_request_bytes + 4096)
        if curve:
            frontend.setsockopt(zmq.CURVE_SERVER, 1)
            frontend.setsockopt(zmq.CURVE_SECRETKEY, curve[1].encode())
        try:
            frontend.bind(f"tcp://{cfg.bind}:{cfg.port}")
        except zmq.ZMQError as exc:
            frontend.close(0)
            if exc.errno in (errno.ENODEV, errno.EINVAL):  # the address, not the port
                raise UserError(f"cannot listen on --bind {cfg.bind!r} ({exc.strerror}): it is no address of this "
                                "machine; give one of its addresses, 127.0.0.1 (the default) or 0.0.0.0") from None
            raise UserError(f"cannot bind {cfg.bind}:{cfg.port} ({exc}); choose another --port or stop the "
                            "process using it") from None
        return frontend

    def _start_curve(self, zmq):
        curve = _curve_server_keys(self.cfg.curve_keys)
        if curve:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(Path(self.cfg.curve_keys) / "authorized"))
        return curve

    def _make_http(self, zmq):
        """The HTTP front end, its socket bound now (a taken port fails before any worker starts)."""
        if self.cfg.http_port is None:
            return None, None, None
        from bertopt.serve.http_front import HttpFront

        self.http = HttpFront(self.cfg, self.models, self.ctx)
        http_in = self.ctx.socket(zmq.PULL)
        http_in.setsockopt(zmq.RCVHWM, 0)
        http_in.bind(self.http.request_address)
        return self.http, http_in, self.http.reply_address

    def _worker_cfg(self, model: dict, router_port: int, sink_addr: str) -> dict:
        """What a worker of ``model`` is started with (every worker of a model alike)."""
        cfg = self.cfg
        return {"model": model["name"], "num_worker": model["num_worker"], "artifact": model["artifact"],
                "digest": model["digest"], "provider": "cuda" if cfg.device_map else cfg.provider,
                "threads": model["threads_per_worker"], "max_seq_len": model["max_seq_len"],
                "output": model["output"], "bulk_nice": cfg.bulk_nice, "warmup": cfg.warmup,
                "max_batch_tokens": cfg.max_batch_tokens, "ventilator": f"tcp://127.0.0.1:{router_port}",
                "sink": sink_addr, "log_level": cfg.log_level}

    def start(self, progress: Callable[[int, int], None] | None = None) -> None:
        zmq = require("zmq", "serve", "bertopt serve")
        from bertopt.runtime.predictor import load_tokenizer
        from bertopt.serve.ventilator import Ventilator

        cfg = self.cfg
        check_children_import_this_bertopt()
        self.ctx = zmq.Context()
        try:
            curve = self._start_curve(zmq)
            frontend = self._bind_frontend(zmq, curve)
            http, http_in, http_reply = self._make_http(zmq)
            sink_addr = self._start_sink(curve, http_reply)
            sink = self.ctx.socket(zmq.PUSH)
            sink.setsockopt(zmq.LINGER, 5000)
            sink.connect(sink_addr)
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.LINGER, 1000)
            router_port = router.bind_to_random_port("tcp://127.0.0.1")
            vcfg = {**asdict(cfg), **self.facts, "wire_version": WIRE_VERSION, "threads_per_worker": self.threads,
                    "priority_tokens": cfg.priority_tokens, "models": self.models,
                    "num_worker": sum(m["num_worker"] for m in self.models)}
            vcfg.pop("api_key", None)
            worker_cfgs = {m["name"]: self._worker_cfg(m, router_port, sink_addr) for m in self.models}
            tokenizers = {m["name"]: load_tokenizer(Path(m["tokenizer"]), m["max_seq_len"]) for m in self.models}
            self.ventilator = Ventilator(self.ctx, vcfg, frontend, router, sink, worker_cfgs, http_in=http_in,
                                         tokenizers=tokenizers, metrics=http.metrics if http else None,
                                         sink_exit=self._sink_exit)
            if http is not None:
                http.start(self.ventilator)  # answers /health with 503 until the workers are ready
            self.ventilator.start_workers(cfg.startup_timeout_s, progress)
            if http is not None:
                http.set_ready()
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def describe(self) -> str:
        c = self.cfg
        where = []
        if c.zmq:
            where.append(f"tcp://{c.bind}:{c.port} (requests) and :{c.port_out} (replies)")
        if c.http_port is not None:
            where.append(f"http://{c.bind}:{c.http_port}" + (" (API key required)" if c.api_key else ""))
        if len(self.models) > 1:
            fleet = ", ".join(f"{m['name']} ({m['task']}, {m['num_worker']} worker(s) x {m['threads_per_worker']} "
                              f"thread(s))" for m in self.models)
            return (f"bertopt serve: ready on {' and '.join(where)}; models {fleet}; max batch {c.max_batch_size} "
                    f"texts / {c.max_batch_tokens} tokens, priority <= {c.priority_batch_size} texts"
                    + (", CurveZMQ on" if c.curve_keys else ""))
        return (f"bertopt serve: ready on {' and '.join(where)}; {c.num_worker} worker(s) x {self.threads} "
                f"thread(s), task {self.facts['task']}, max batch {c.max_batch_size} texts / {c.max_batch_tokens} "
                f"tokens, priority <= {c.priority_batch_size} texts, max_seq_len {self.facts['max_seq_len']}"
                + (", CurveZMQ on" if c.curve_keys else ""))

    def run(self, should_stop: Callable[[], bool], stop_now: Callable[[], bool] = lambda: False) -> None:
        """Serve until ``should_stop()``, then finish what was taken within --grace (or until ``stop_now()``)."""
        http = self.http

        def stopping() -> bool:
            if should_stop():
                if http is not None:
                    http.begin_shutdown()  # no new connections; admitted requests are still answered
                return True
            return False

        self.ventilator.run(stopping, http_stopped=http.stopped if http is not None else lambda: True,
                            grace_s=self.cfg.grace_s, stop_now=stop_now)
        if self.ventilator.failure:  # not a clean stop: the error replies owed go out, then the command fails
            self.shutdown(graceful=True)
            raise UserError(self.ventilator.failure)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop workers and sink; kill whatever does not stop in time. Leaves no child process behind."""
        if self._stopped:
            return
        self._stopped = True
        if self.http is not None:
            self.http.close()
        v = self.ventilator
        if v is not None:
            # out of grace, workers are not waited for to finish what they hold (its requests were answered)
            v.stop_workers(timeout_s=10.0 if graceful and not v.gave_up else 0.5)
            if graceful:
                v.stop_sink()
        self._stop_sink(graceful)
        if v is not None:
            v.pool.kill_all()
        self.close()

    def _stop_sink(self, graceful: bool) -> None:
        if self.sink_proc is None:
            return
        if not graceful:
            self.sink_proc.kill()  # it ignores SIGTERM (see sink.main)
        try:
            self.sink_proc.wait(self.cfg.grace_s + 5 if graceful else 5)
        except subprocess.TimeoutExpired:
            log.warning("sink did not stop in time; killing it")
            self.sink_proc.kill()
            self.sink_proc.wait(10)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.ctx is not None:
            self.ctx.destroy(linger=2000)
            self.ctx = None


def serve(cfg: ServeConfig, on_ready: Callable[[str], None] = print,
          progress: Callable[[int, int], None] | None = None) -> None:
    """Run the server in this process until SIGTERM/SIGINT, then shut down cleanly."""
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="bertopt serve %(levelname)s %(message)s")
    stop = {"signal": None, "count": 0}

    def on_signal(signum, _frame):
        # the first signal stops taking requests and finishes those taken (within --grace); a second one stops
        # now, answering what is unfinished with an error
        stop["signal"] = signum
        stop["count"] += 1

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    server = Server(cfg)
    try:
        server.start(progress)
        for line in exposure_warnings(cfg):
            log.warning("%s", line)
        on_ready(server.describe())
        server.run(lambda: stop["signal"] is not None, stop_now=lambda: stop["count"] > 1)
        log.info("all requests answered; stopping workers")
        server.shutdown(graceful=True)
        log.info("stopped (pid %d)", os.getpid())
    except BaseException:
        server.shutdown(graceful=False)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
