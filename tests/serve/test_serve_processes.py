"""Worker and sink processes start isolated (``python -I``, configuration on stdin, a trimmed environment), and
SIGTERM ends the server promptly even when replies are owed to a client that never subscribed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(300)]

# modules every worker imports (json for its configuration, zlib through numpy/zipfile): a copy in the launch
# folder that leaves a marker when imported
PLANTED = ("zlib", "json", "numpy", "onnxruntime", "tokenizers", "zmq")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def test_workers_and_sink_do_not_import_code_from_the_launch_folder(tiny_onnx, tiny_predictor, start_server, tmp_path):
    launch = tmp_path / "launch"
    launch.mkdir()
    marker = tmp_path / "planted-code-ran"
    for name in PLANTED:
        (launch / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('{name} imported\\n')\n"
                                           "raise ImportError('planted module')\n")
    # the bertopt console script (its own folder, not the launch folder, is first on the server's sys.path)
    bertopt = Path(sys.executable).with_name("bertopt")
    server = start_server(tiny_onnx.path, num_worker=2, cwd=launch, command=[str(bertopt)],
                          env={"BERTOPT_API_KEY": "not-for-workers", "AWS_SECRET_ACCESS_KEY": "nor-this"})
    with server.client() as client:
        got = client.encode(["the cat sat", "a second text"])
    np.testing.assert_allclose(got, tiny_predictor.encode(["the cat sat", "a second text"]), atol=1e-5, rtol=0)
    assert not marker.exists(), marker.read_text()
    assert len(server.children) >= 3  # sink + 2 workers
    for pid in server.children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-I", b"-m"] and cmdline[3] in (b"bertopt.serve.worker", b"bertopt.serve.sink")
        assert not any(b"{" in arg for arg in cmdline), "configuration (it may hold a CurveZMQ secret) on argv"
        env = _environ(pid)
        assert "BERTOPT_API_KEY" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        assert env.get("HF_HUB_OFFLINE") == "1"  # what running a model needs is passed on


def test_sigterm_does_not_wait_for_replies_owed_to_a_client_that_never_subscribed(tiny_onnx, start_server):
    import zmq

    server = start_server(tiny_onnx.path, num_worker=1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for i in range(1, 6):  # five requests whose replies nobody subscribes to
            push.send_multipart([b"never-subscribes", json.dumps([f"text {i}"]).encode(), b"%d" % i, b"1"])
        with server.client() as client:
            deadline = time.monotonic() + 60
            while client.status()["replies_waiting_for_subscriber"] < 5:
                assert time.monotonic() < deadline, "the replies were never computed"
                time.sleep(0.05)
        started = time.monotonic()
        code = server.terminate(timeout=60)
        took = time.monotonic() - started
    finally:
        push.close()
        ctx.term()
    assert code == 0, server.log()
    # a liveness bound, not a speed claim: each held reply used to keep the sink (and so the server) for its
    # full 10 s hold
    assert took < 8, f"SIGTERM took {took:.1f} s"
    assert "dropped a reply for client b'never-subscribes'" in server.log()


def test_a_server_whose_workers_would_import_another_bertopt_refuses_in_one_line(tiny_onnx, tmp_path):
    # a copy of the package run through PYTHONPATH: the server imports the copy, but `python -I` (how workers
    # start) ignores PYTHONPATH and would import the installed one, other code than the server's
    src = tmp_path / "src"
    shutil.copytree(REPO / "bertopt", src / "bertopt", ignore=shutil.ignore_patterns("__pycache__"))
    from bertopt.harness import free_port

    port, port_out = free_port(), free_port()
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "serve", str(tiny_onnx.path), "--port", str(port),
                           "--port-out", str(port_out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(src)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = " ".join(proc.stderr.split())
    assert f"which finds bertopt at {REPO / 'bertopt'}, not {src / 'bertopt'}" in line, line
    assert "pip install -e" in line and "Traceback" not in proc.stderr
