"""Worker warm-up: one batch per sequence-length bucket on the real runtime before a worker reports ready; /health
turns 200 only once every worker has warmed up (and logged how long it took); --no-warmup skips it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from task_models import TASK_TEXTS

from bertopt.harness import alive, descendants, free_port
from bertopt.runtime import Predictor
from bertopt.serve.warmup import WARMUP_TOKENS, warm_up, warmup_lengths, warmup_rows
from bertopt.tiny_models import FAMILY_FIXTURES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_buckets_are_powers_of_two_up_to_the_served_window():
    assert warmup_lengths(512) == [16, 32, 64, 128, 256, 512]
    assert warmup_lengths(384) == [16, 32, 64, 128, 256, 384]
    assert warmup_lengths(16) == [16]
    assert warmup_lengths(8) == [8]
    assert warmup_rows(32, 16, 16384) == 32  # the Predictor's batch size
    assert warmup_rows(32, 512, 16384) == WARMUP_TOKENS // 512
    assert warmup_rows(32, 512, 100) == 1  # at least one row


def _warm_and_check(art, runtime: str | None = None) -> None:
    """warm_up runs one batch per bucket, each a real token sequence of that length, and changes no result."""
    p = Predictor(art, threads=1, runtime=runtime)
    fresh = Predictor(art, threads=1, runtime=runtime).run(TASK_TEXTS, outputs=[p.primary_output])[p.primary_output]
    shapes, ends = [], set()
    run_batch = p.run_batch

    def recording(feeds, outputs=None):
        ids = feeds[p.model.inputs[0]["name"]]
        shapes.append(ids.shape)
        ends.add((int(ids[0, 0]), int(ids[0, -1])))
        return run_batch(feeds, outputs)

    p.run_batch = recording
    warm = warm_up(p, p.primary_output, 16384)
    p.run_batch = run_batch
    lengths = warmup_lengths(p.max_seq_len)
    assert warm["lengths"] == lengths and warm["batches"] == len(lengths) and warm["seconds"] > 0
    assert shapes == [(warmup_rows(p.batch_size, n, 16384), n) for n in lengths]
    special = p.tokenizer.encode("x").ids
    assert ends == {(special[0], special[-1])}  # the tokenizer's own start and end tokens
    assert p.stats["batches"] == 0  # not counted as served work
    after = p.run(TASK_TEXTS, outputs=[p.primary_output])[p.primary_output]
    if isinstance(after, list):  # token classification: per-text arrays
        for a, b in zip(after, fresh):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    else:
        np.testing.assert_allclose(after, fresh, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_FIXTURES)
def test_warm_up_runs_every_bucket_on_every_family(family, task_artifact):
    _warm_and_check(task_artifact("embedding", family)[1])


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "token-classification", "rerank", "sparse-embedding"])
def test_warm_up_runs_every_bucket_on_every_task(task, task_artifact):
    _warm_and_check(task_artifact(task)[1])


@pytest.mark.slow
def test_warm_up_runs_every_bucket_on_openvino(tiny_onnx, private_openvino_cache):
    _warm_and_check(tiny_onnx, runtime="openvino")


def _health(url: str):
    import httpx

    try:
        r = httpx.get(url + "/health", timeout=5)
    except httpx.TransportError:  # not listening yet
        return None
    return r.status_code, r.json()


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(300)
def test_health_turns_ready_only_after_every_worker_warmed_up(tiny_onnx, tmp_path):
    port, port_out, http_port = free_port(), free_port(), free_port()
    assert len({port, port_out, http_port}) == 3
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(tiny_onnx.path), "--port", str(port),
                             "--port-out", str(port_out), "--http-port", str(http_port), "--num-worker", "2"],
                            stdout=open(out, "w"), stderr=open(err, "w"), stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{http_port}"
    children: set[int] = set()
    try:
        seen = []
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            children |= descendants(proc.pid)
            answer = _health(url)
            if answer is not None:
                log_then = err.read_text()
                seen.append(answer)
                if answer[0] == 200:
                    break
            time.sleep(0.01)
        # before: 503 while the workers load and warm up
        assert seen[0] == (503, {"status": "loading", "workers_ready": 0})
        # the moment it is 200, both workers have logged their warm-up (they log it before reporting ready)
        assert seen[-1] == (200, {"status": "ok", "workers_ready": 2})
        for index in (0, 1):
            line = next(x for x in log_then.splitlines() if f"[worker {index}]" in x and "warmed up in" in x)
            assert line.endswith("tokens)") and " s (" in line  # "warmed up in 0.012 s (4 batches, lengths ...)"
        from bertopt.client import Client

        with Client("127.0.0.1", port, port_out, timeout=30) as client:
            status = client.status()
        assert status["warmup"] is True and status["workers_ready"] == 2
        assert all(w["warmup_s"] > 0 for w in status["workers"])
    finally:
        children |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(300)
def test_no_warmup_skips_it_and_serves_the_same_values(tiny_onnx, tiny_predictor, start_server):
    server = start_server(tiny_onnx.path, "--no-warmup", num_worker=1)
    with server.client() as client:
        status = client.status()
        got = client.encode(TASK_TEXTS)
    assert status["warmup"] is False
    assert [w["warmup_s"] for w in status["workers"]] == [None]
    assert "warmed up in" not in server.log()
    np.testing.assert_allclose(got, tiny_predictor.encode(TASK_TEXTS), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(600)
def test_first_request_benchmark_smoke(tiny_onnx, tmp_path):
    """The benchmark's wiring on the tiny BERT (its numbers are not checked: speed is noisy)."""
    import json

    out = tmp_path / "first.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "first_request.py"), "--artifact",
                           str(tiny_onnx.path), "--starts", "1", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"warm-up", "no warm-up"}
    assert len(data["runs"]["warm-up"][0]["warmup_log"]) == 1  # one worker, one warm-up line
    assert data["runs"]["no warm-up"][0]["warmup_log"] == []
    assert "no warm-up" in proc.stdout and "ratio" in proc.stdout


def test_a_failing_warm_up_is_reported_to_the_server_as_one_line(tiny_onnx):
    """The worker's warm-up step on a real session that fails (an output the model does not have): the server
    gets FAIL with one line naming the fix, as for an artifact that cannot load."""
    import zmq

    from bertopt.protocol import FAIL
    from bertopt.serve.worker import _warm_up

    p = Predictor(tiny_onnx, threads=1)
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind("inproc://warm-up-test")
    worker = ctx.socket(zmq.DEALER)
    worker.connect("inproc://warm-up-test")
    try:
        assert _warm_up({"index": 0, "output": "no_such_output", "max_batch_tokens": 1024}, worker, p, p) is False
        assert server.poll(5000)
        _, tag, message = server.recv_multipart()
        text = message.decode()
        assert tag == FAIL and "\n" not in text
        assert text.startswith("its warm-up batch failed (")
        assert text.endswith("); serve with --no-warmup or a smaller --max-seq-len")
        assert _warm_up({"index": 0, "output": p.primary_output, "warmup": False}, worker, p, p) is None
    finally:
        worker.close(0)
        server.close(0)
        ctx.term()
