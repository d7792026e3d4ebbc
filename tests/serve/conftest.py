"""Real ``bertopt serve`` processes on free 127.0.0.1 ports, always stopped (and their children killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


from bertopt.harness import alive, descendants, free_port  # noqa: E402,F401


class ServerProcess:
    def __init__(self, artifact, tmp: Path, *args: str, num_worker: int = 2, ready_timeout: float = 120.0,
                 http: bool = False, new_session: bool = False, cwd: Path | None = None,
                 command: list[str] | None = None, env: dict[str, str] | None = None):
        """``command``: how to start bertopt (default ``python -m bertopt.cli``); ``cwd``: the folder it starts
        in (default the repository); ``env``: extra environment variables. A port another process took between
        ``free_port()`` and the server's bind (the other pytest-xdist worker, say) is tried again, on new ports."""
        for attempt in range(3):
            try:
                self._start(artifact, tmp, args, num_worker, ready_timeout, http, new_session, cwd, command, env)
                return
            except RuntimeError as exc:
                if "cannot bind" not in str(exc) or attempt == 2:
                    raise

    def _start(self, artifact, tmp, args, num_worker, ready_timeout, http, new_session, cwd, command, env):
        self.port, self.port_out = free_port(), free_port()
        while self.port_out == self.port:
            self.port_out = free_port()
        self.http_port = None
        if http:
            self.http_port = free_port()
            while self.http_port in (self.port, self.port_out):
                self.http_port = free_port()
            args = ("--http-port", str(self.http_port), *args)
        self.out_path, self.err_path = tmp / "serve.out", tmp / "serve.err"
        cmd = [*(command or [sys.executable, "-m", "bertopt.cli"]), "serve", str(artifact), "--port", str(self.port),
               "--port-out", str(self.port_out), "--num-worker", str(num_worker), *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"),
                                     stdin=subprocess.DEVNULL, cwd=cwd or REPO, env=env,
                                     start_new_session=new_session)
        self.children: set[int] = set()
        deadline = time.monotonic() + ready_timeout
        while "ready on" not in self.out_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start (exit {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        self.children = descendants(self.proc.pid)

    def log(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, **kw):
        from bertopt.client import Client

        kw.setdefault("timeout", 60)
        return Client("127.0.0.1", self.port, self.port_out, **kw)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path under test."""
        self.children |= descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Whatever state it is in: stop the server and kill every process it started."""
        if self.proc.poll() is None:
            self.children |= descendants(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start_server(tmp_path):
    started: list[ServerProcess] = []

    def start(artifact, *args, **kw) -> ServerProcess:
        folder = tmp_path / f"server{len(started)}"
        folder.mkdir()
        server = ServerProcess(artifact, folder, *args, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server_process():
    """The ServerProcess class, for a module's own server with its own flags (``from conftest import ...`` would
    find whichever tests/*/conftest.py pytest imported last)."""
    return ServerProcess


@pytest.fixture(scope="session")
def tiny_server(tiny_onnx, tmp_path_factory):
    """One shared server on the tiny BERT: 2 workers, small mini-jobs so requests split, a 100 kB limit."""
    server = ServerProcess(tiny_onnx.path, tmp_path_factory.mktemp("tiny-server"), "--max-batch-size", "8",
                           "--priority-batch-size", "4", "--max-request-bytes", "100000")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_predictor(tiny_onnx):
    from bertopt.runtime import Predictor

    return Predictor(tiny_onnx, threads=1)


@pytest.fixture(scope="session")
def http_server(tiny_onnx, tmp_path_factory):
    """ZeroMQ and HTTP on one fleet of 2 workers (tiny BERT), with an API key and a 100 kB body limit."""
    server = ServerProcess(tiny_onnx.path, tmp_path_factory.mktemp("http-server"), "--api-key", "test-secret-key",
                           "--max-request-bytes", "100000", http=True)
    try:
        yield server
    finally:
        server.stop()
