"""Workers verify what they load, restarts included: a model swapped on disk under a running server is refused by
the worker restarted after a crash; the server says so, keeps serving with its healthy workers (which hold the
artifact it announced), and stops with exit 2 and one line when no worker is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request

import numpy as np
import pytest

from bertopt.artifact import MANIFEST_NAME, _digest_of_files, sha256_file
from bertopt.client import ServerError

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(300)]


def _copy(art, tmp_path):
    dest = tmp_path / "served"
    shutil.copytree(art.path, dest)
    return dest


def _swap_model(folder, *, update_manifest: bool) -> str:
    """Replace model.onnx with other bytes; with ``update_manifest`` also its size, sha256 and the digest (a
    consistent, different artifact). Returns the digest the folder now claims."""
    data = bytearray((folder / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "model.onnx").write_bytes(bytes(data))
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    if update_manifest:
        file = folder / "model.onnx"
        manifest["files"]["model.onnx"] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
        manifest["digest"] = _digest_of_files(manifest["files"])
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return manifest["digest"]


def _wait_for(predicate, what: str, server, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert server.proc.poll() is None or what == "exit", f"server exited while waiting for {what}:\n" \
                                                              f"{server.log()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{server.log()}"
        time.sleep(0.2)


def test_restarted_worker_refuses_a_swapped_model_and_the_healthy_one_serves_on(tiny_onnx, tiny_predictor,
                                                                             start_server, tmp_path):
    folder = _copy(tiny_onnx, tmp_path)
    server = start_server(folder, num_worker=2, http=True)
    texts = ["the served model is the validated one", "a second sentence"]
    with server.client() as client:
        np.testing.assert_allclose(client.encode(texts), tiny_predictor.encode(texts), atol=1e-5, rtol=0)
        announced = client.status()["digest"]
        assert announced == tiny_onnx.digest
        new_digest = _swap_model(folder, update_manifest=True)
        assert new_digest != announced
        victim = client.status()["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        _wait_for(lambda: "leaving it stopped, serving with 1 worker(s)" in server.log(), "the refusal", server)
        log = server.log()
        assert (f"worker 0 could not load the artifact: the artifact at {folder} changed since the server started "
                f"(digest {new_digest[:12]}, the server serves {announced[:12]}); this worker refuses it: restart "
                "the server to serve the new artifact") in log
        status = client.status()
        worker0 = status["workers"][0]
        assert worker0["ready"] is False and worker0["pid"] is None and "changed since the server started" in \
            worker0["error"]
        assert status["workers"][1]["ready"] is True and status["digest"] == announced
        # the healthy worker loaded (and verified) the announced artifact before the swap: still served
        np.testing.assert_allclose(client.encode(texts), tiny_predictor.encode(texts), atol=1e-5, rtol=0)
    with urllib.request.urlopen(f"{server.url}/info", timeout=30) as reply:
        assert json.loads(reply.read())["model_sha"] == announced
    assert server.terminate() == 0


def test_last_worker_refusing_a_tampered_model_stops_the_server_with_exit_2(tiny_onnx, start_server, tmp_path):
    folder = _copy(tiny_onnx, tmp_path)
    server = start_server(folder, num_worker=1)
    with server.client(timeout=120) as client:
        victim = client.status()["workers"][0]["pid"]
        _swap_model(folder, update_manifest=False)  # the model changed, the manifest did not: its sha256 differs
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ServerError, match="no worker can run"):
            client.encode(["asked while the only worker is being restarted"])
    code = server.proc.wait(120)
    assert code == 2, server.log()
    err = server.err_path.read_text().strip().splitlines()
    assert err[-1].startswith("error: every worker stopped: ") and "sha256 of model.onnx does not match" in err[-1]
    assert "Traceback" not in server.log()
