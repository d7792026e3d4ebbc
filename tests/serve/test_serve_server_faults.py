"""Faults: malformed frames, oversized requests, no server, a worker SIGKILLed mid-request, SIGTERM, bad input."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest
from test_serve_server import make_texts

from bertopt.client import Client, ServerError
from bertopt.harness import alive, free_port

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(240)]


def _recv_reply(sub, timeout_s: float = 20.0) -> list[bytes]:
    assert sub.poll(int(timeout_s * 1000)), "no reply from the server"
    return sub.recv_multipart()


def test_malformed_messages_get_error_replies_and_server_keeps_running(tiny_server, tiny_predictor):
    import zmq

    ctx = zmq.Context()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    ident = b"raw-test-client"
    sub.setsockopt(zmq.SUBSCRIBE, ident)
    for sock in (push, sub):
        sock.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{tiny_server.port}")
    sub.connect(f"tcp://127.0.0.1:{tiny_server.port_out}")
    try:
        push.send_multipart([b"just one frame"])  # no reply address: dropped with a log line
        cases = [
            ([ident, b"not json", b"1", b"1"], "not JSON"),
            ([ident, b'{"a": 1}', b"2", b"1"], "not a list"),
            ([ident, b'["ok", 5]', b"3", b"2"], "text 1 is a int"),
            ([ident, b"[]", b"4", b"0"], "no texts"),
            ([ident, json.dumps(["x" * 200_000]).encode(), b"5", b"1"], "exceeds the server's limit"),
            ([ident, b'["ok"]', b"6"], "expected 4 frames"),
            ([ident, b'["ok"]', b"seven", b"1"], "not a decimal number"),
        ]
        for frames, _ in cases:
            push.send_multipart(frames)
        replies = {}
        for _ in cases:
            reply = _recv_reply(sub)
            assert reply[0] == ident and len(reply) == 4
            replies[reply[-1]] = json.loads(reply[1])["error"]
        for frames, expected in cases:
            assert expected in replies[frames[2]], (frames[2], replies[frames[2]])
        # still serving, and it says what it rejected
        push.send_multipart([ident, b'["the cat"]', b"8", b"1"])
        reply = _recv_reply(sub)
        info = json.loads(reply[1])
        got = np.frombuffer(reply[2], dtype=info["dtype"]).reshape(info["shape"])
        np.testing.assert_allclose(got, tiny_predictor.encode(["the cat"]), atol=1e-5, rtol=0)
        with tiny_server.client() as client:
            status = client.status()
            with pytest.raises(ServerError, match="--max-request-bytes"):
                client.encode(["y" * 200_000])
            assert client.encode(["still fine"]).shape == (1, 32)
        assert status["dropped_no_address"] >= 1 and status["rejected"] >= 7
        assert "no reply address" in tiny_server.log()
    finally:
        push.close()
        sub.close()
        ctx.term()


def test_client_times_out_when_no_server_answers():
    port, port_out = free_port(), free_port()
    t0 = time.monotonic()
    with Client("127.0.0.1", port, port_out, timeout=0.5) as client:
        with pytest.raises(TimeoutError, match="no reply from the bertopt server"):
            client.encode(["hello"])
        with pytest.raises(TimeoutError):
            client.status()
        future = client.encode_async(["hello"])
        with pytest.raises(TimeoutError):
            future.result(10)
    assert time.monotonic() - t0 < 10


def test_worker_killed_mid_request_every_request_answered_once(tiny_onnx, tiny_predictor, start_server):
    server = start_server(tiny_onnx.path, "--max-batch-size", "4", num_worker=2)
    jobs = [make_texts(1500, seed=s) for s in range(4)] + [make_texts(2, seed=9)]
    clients = [server.client(timeout=120) for _ in jobs]
    try:
        futures = [c.encode_async(t) for c, t in zip(clients, jobs)]
        with server.client() as probe:
            deadline = time.monotonic() + 60
            while True:  # kill while mini-jobs are queued, so the victim surely holds one
                status = probe.status()
                if status["mini_jobs_done"] > 20 and status["queue_length"]["bulk"] > 0:
                    break
                assert time.monotonic() < deadline, f"server never got busy: {status}"
                time.sleep(0.02)
            victim = status["workers"][0]["pid"]
            os.kill(victim, signal.SIGKILL)
            done, not_done = wait(futures, timeout=120)
            assert not not_done, "a request was never answered after the worker died"
            for texts, fut in zip(jobs, futures):
                np.testing.assert_allclose(fut.result(), tiny_predictor.encode(texts), atol=1e-5, rtol=0)
            time.sleep(1.0)  # a duplicate reply would arrive now and be counted
            assert all(c.unexpected_replies == 0 for c in clients)
            after = probe.status()
        assert after["worker_restarts"] >= 1 and after["mini_jobs_resent"] >= 1
        assert after["workers"][0]["restarts"] == 1 and after["workers"][0]["pid"] not in (None, victim)
        assert alive(after["workers"][0]["pid"])
        assert f"worker 0 (pid {victim}) was killed by SIGKILL" in server.log()
    finally:
        for c in clients:
            c.close()


def _wait_until_working(client, mini_jobs: int = 5) -> None:
    """Until the server has finished ``mini_jobs`` mini-jobs: a request is in flight, with more of it to do."""
    deadline = time.monotonic() + 60
    while client.status()["mini_jobs_done"] < mini_jobs:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sigterm_finishes_in_flight_requests_and_leaves_no_processes(tiny_onnx, tiny_predictor, start_server):
    # 3000 texts in one request: over the default --max-client-batch-size (2048), so the limit is raised
    server = start_server(tiny_onnx.path, "--max-batch-size", "4", "--max-client-batch-size", "4096", num_worker=2)
    texts = make_texts(3000, seed=11)
    with server.client(timeout=120) as client:
        future = client.encode_async(texts)
        _wait_until_working(client)
        children = set(server.children)
        assert len(children) >= 3  # sink + 2 workers
        code = server.terminate(timeout=90)
        np.testing.assert_allclose(future.result(60), tiny_predictor.encode(texts), atol=1e-5, rtol=0)
    assert code == 0, server.log()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in server.children if alive(p)], "orphan processes left behind"
    assert "stopped" in server.log()
    # a stopped server answers nobody: new requests time out instead of hanging
    with server.client(timeout=0.5) as client:
        with pytest.raises(TimeoutError):
            client.encode(["late"])


@pytest.mark.parametrize("stop", ["--grace runs out", "a second signal"])
def test_stopping_takes_at_most_the_grace_period_or_ends_at_a_second_signal(tiny_onnx, start_server, stop):
    """A request that cannot finish in time (20,000 one-text mini-jobs on one worker) is answered with an error
    when --grace runs out, or at once at a second signal; the server then exits 0 with no process left. Before,
    the server drained its whole queue whatever --grace said (85 s for --grace 5) and ignored a second signal."""
    grace = "1" if stop == "--grace runs out" else "120"
    server = start_server(tiny_onnx.path, "--grace", grace, "--max-batch-size", "1", "--priority-batch-size", "0",
                          "--max-client-batch-size", "20000", num_worker=1)
    texts = [f"text {i}" for i in range(20000)]
    with server.client(timeout=120) as client:
        future = client.encode_async(texts)
        _wait_until_working(client)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        if stop == "a second signal":
            time.sleep(1)
            assert server.proc.poll() is None  # still finishing (its grace is 120 s)
            server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
        with pytest.raises(ServerError, match="the server is stopping .* and did not finish this request"):
            future.result(30)
    assert code == 0, server.log()
    assert took < 20, f"took {took:.1f} s to stop"
    why = "--grace 1 s ran out" if stop == "--grace runs out" else "a second signal came"
    assert f"stopping now ({why})" in server.log()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in server.children if alive(p)], "orphan processes left behind"


def test_a_hung_worker_is_killed_restarted_and_its_work_answered(tiny_onnx, tiny_predictor, start_server):
    """A worker that stops (SIGSTOP here; a runtime that never returns is the same to the server) held its
    mini-jobs for ever while /health said ok and requests waited into their timeout. After
    --worker-stall-timeout it is killed, restarted, and the work re-sent."""
    server = start_server(tiny_onnx.path, "--worker-stall-timeout", "2", num_worker=1)
    texts = make_texts(20, seed=3)
    with server.client(timeout=90) as client:
        pid = client.status()["workers"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            got = client.encode(texts)
            took = time.monotonic() - started
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        np.testing.assert_allclose(got, tiny_predictor.encode(texts), atol=1e-5, rtol=0)
        status = client.status()
    assert 2 <= took < 60
    assert status["worker_restarts"] == 1 and status["workers"][0]["pid"] != pid
    assert not alive(pid)
    assert "more than --worker-stall-timeout 2 s: killing it" in server.log()


def test_a_sink_that_dies_stops_the_server_with_its_reason(tiny_onnx, start_server):
    # every reply goes through the sink: without it the server took requests it could never answer while /health
    # said ok; it now stops, says why, and leaves no process behind (a supervisor restarts it)
    server = start_server(tiny_onnx.path, num_worker=1, http=True)
    with server.client(timeout=60) as client:
        client.encode(["answered while the sink runs"])
    sinks = [pid for pid in server.children if b"bertopt.serve.sink" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(sinks) == 1, server.children
    os.kill(sinks[0], signal.SIGKILL)
    code = server.proc.wait(60)
    assert code == 2, server.log()
    err = server.err_path.read_text().strip().splitlines()
    # killed, it wrote nothing: the line names the signal (it said "see the log above", with nothing above)
    assert err[-1] == ("error: the sink process (it sends every reply) was killed by SIGKILL (the kernel's "
                       "out-of-memory killer sends it, or another process did)"), err[-3:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in server.children if alive(p)], "orphan processes left behind"


def test_serve_user_errors_are_one_line_exit_2(tmp_path, tiny_onnx, cli):
    import zmq

    code, _, err = cli("serve", tmp_path / "missing")
    assert code == 2 and "artifact not found" in err
    code, _, err = cli("serve", tiny_onnx.path, "--port", "7000", "--port-out", "7000")
    assert code == 2 and "different ports" in err
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        code, _, err = cli("serve", tiny_onnx.path, "--port", port, "--port-out", free_port())
        assert code == 2 and f"cannot bind 127.0.0.1:{port}" in err and "--port" in err
    finally:
        taken.close(0)
        ctx.term()
    code, _, err = cli("client", "status", "--port", free_port(), "--port-out", free_port(), "--timeout", "0.3")
    assert code == 2 and "no reply from the bertopt server" in err


def test_curve_keys_encrypt_and_authenticate(tiny_onnx, tiny_predictor, start_server, tmp_path, cli):
    keys = tmp_path / "keys"
    code, out, err = cli("serve", "--make-curve-keys", keys)
    assert code == 0, err
    # the secrets are their owner's alone, whatever the umask
    assert keys.stat().st_mode & 0o777 == 0o700
    secrets = sorted(p.name for p in keys.glob("*.key_secret"))
    assert secrets == ["client.key_secret", "server.key_secret"]
    assert all((keys / name).stat().st_mode & 0o777 == 0o600 for name in secrets)
    server = start_server(tiny_onnx.path, "--curve-keys", str(keys), num_worker=1)
    with server.client(curve_keys=str(keys)) as client:
        np.testing.assert_allclose(client.encode(["hello world"]), tiny_predictor.encode(["hello world"]),
                                   atol=1e-5, rtol=0)
    with server.client(timeout=1.0) as stranger:  # no keys: the handshake fails, nothing is answered
        with pytest.raises(TimeoutError):
            stranger.encode(["hello world"])
