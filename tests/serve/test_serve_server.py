"""Round trips through a real server: values equal the in-process Predictor, concurrency, status, CLI."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(180)]

WORDS = "the cat sat on the mat and the dog is fast hello world model bert text".split()


def make_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


def test_encode_equals_in_process_predictor(tiny_server, tiny_predictor):
    # 37 texts over mini-jobs of 8 (5 jobs, two workers), plus one far beyond max_seq_len (truncated, not refused)
    texts = make_texts(36, seed=1) + [" ".join(["hello world"] * 400)]
    with tiny_server.client() as client:
        got = client.encode(texts)
        single = client.encode("the cat sat on the mat")
    want = tiny_predictor.encode(texts)
    assert got.dtype == np.float32 and got.shape == want.shape == (37, 32)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(single, tiny_predictor.encode(["the cat sat on the mat"]), atol=1e-5, rtol=0)


def test_a_request_id_sent_again_is_answered_each_time_with_its_own_rows(tiny_server, tiny_predictor):
    # a service that reconnects with a fixed identity counts its ids from the start again, and a client may send an
    # id twice while the first is in flight: each request gets one reply, with its own texts' rows (the sink keyed
    # both by (identity, id): the second went unanswered, or a piece of one landed in the other and ended the sink)
    import zmq

    identity = b"my-service"
    first, second = make_texts(11, seed=7), make_texts(16, seed=8)
    with tiny_server.client(identity=identity.decode()) as client:
        np.testing.assert_allclose(client.encode(first), tiny_predictor.encode(first), atol=1e-5, rtol=0)
    ctx = zmq.Context()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    try:
        for sock in (push, sub):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, identity)
        sub.setsockopt(zmq.RCVTIMEO, 60_000)
        sub.connect(f"tcp://127.0.0.1:{tiny_server.port_out}")
        push.connect(f"tcp://127.0.0.1:{tiny_server.port}")
        time.sleep(0.3)  # the subscription reaches the server before the replies do
        for texts in (first, second, first):  # request id 1 again (the client above used it), three times at once
            push.send_multipart([identity, json.dumps(texts).encode(), b"1", b"%d" % len(texts)])
        replies = []
        for _ in range(3):
            frames = sub.recv_multipart()
            assert frames[-1] == b"1", frames[-1]
            info = json.loads(frames[1])
            replies.append(np.frombuffer(frames[2], dtype=np.float32).reshape(info["shape"]))
    finally:
        push.close()
        sub.close()
        ctx.term()
    assert sorted(r.shape[0] for r in replies) == [11, 11, 16]
    for rows in replies:
        want = tiny_predictor.encode(first if len(rows) == 11 else second)
        np.testing.assert_allclose(rows, want, atol=1e-5, rtol=0)
    with tiny_server.client() as client:  # and the server goes on
        assert client.status()["duplicates_dropped"] == 0


def test_concurrent_clients_and_one_shared_client(tiny_server, tiny_predictor):
    jobs = [make_texts(n, seed=n) for n in (1, 3, 9, 25, 60, 2, 17)]
    wants = [tiny_predictor.encode(t) for t in jobs]
    problems: list[str] = []
    shared = tiny_server.client()

    def run(client, name: str) -> None:
        for texts, want in zip(jobs, wants):
            got = client.encode(texts)
            if got.shape != want.shape or not np.allclose(got, want, atol=1e-5, rtol=0):
                problems.append(f"{name}: wrong result for {len(texts)} texts")

    own = [tiny_server.client() for _ in range(3)]
    threads = [threading.Thread(target=run, args=(c, f"own{i}")) for i, c in enumerate(own)]
    threads += [threading.Thread(target=run, args=(shared, f"shared{i}")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        assert problems == []
        assert all(c.unexpected_replies == 0 for c in own + [shared])
    finally:
        for c in own + [shared]:
            c.close()


def test_encode_async_many_in_flight(tiny_server, tiny_predictor):
    jobs = [make_texts(n, seed=100 + n) for n in range(1, 21)]
    with tiny_server.client() as client:
        futures = [client.encode_async(t) for t in jobs]
        done, not_done = wait(futures, timeout=60)
        assert not not_done
        for texts, fut in zip(jobs, futures):
            np.testing.assert_allclose(fut.result(), tiny_predictor.encode(texts), atol=1e-5, rtol=0)


def test_small_request_is_not_queued_behind_a_flood(tiny_server):
    """Ordering, not timing: a 1-text request sent after 20,000 queued texts from another client comes back
    while most of the flood is still pending."""
    flood = make_texts(20_000, seed=7)
    with tiny_server.client(timeout=120) as big, tiny_server.client() as small:
        # requests of 1,000 texts stay under this server's 100 kB request limit
        futures = [big.encode_async(flood[i:i + 1000]) for i in range(0, 20_000, 1000)]
        vec = small.encode(["hello world"])
        pending_when_small_done = sum(not f.done() for f in futures)
        assert vec.shape == (1, 32)
        assert pending_when_small_done >= 10, f"only {pending_when_small_done} of 20 flood requests were pending"
        wait(futures, timeout=120)
        assert all(f.result().shape == (1000, 32) for f in futures)


def test_status_reports_config_and_counters(tiny_server):
    with tiny_server.client() as client:
        before = client.status()
        client.encode(make_texts(20, seed=3))  # 3 bulk mini-jobs of <= 8
        after = client.status()
    assert after["server_version"] == "1.10.0" and after["embedding_dim"] == 32
    assert after["num_worker"] == 2 and after["max_batch_size"] == 8 and after["bind"] == "127.0.0.1"
    assert after["requests"] == before["requests"] + 1
    assert after["mini_jobs"] == before["mini_jobs"] + 3
    assert after["uptime_s"] > before["uptime_s"]
    assert set(after["queue_length"]) == {"priority", "bulk"}
    assert len(after["workers"]) == 2 and all(w["ready"] and w["pid"] for w in after["workers"])
    assert sum(w["jobs_done"] for w in after["workers"]) == after["mini_jobs_done"]


def test_cli_client_encode_status_and_serve_status(tiny_server, tiny_predictor, cli, tmp_path):
    ports = ["--port", str(tiny_server.port), "--port-out", str(tiny_server.port_out)]
    code, out, err = cli("client", "encode", "hello world", "the dog", *ports, "--json")
    assert code == 0, err
    np.testing.assert_allclose(np.array(json.loads(out), dtype=np.float32),
                               tiny_predictor.encode(["hello world", "the dog"]), atol=1e-5, rtol=0)
    # --out: a new .npy file, the same vectors
    code, out, err = cli("client", "encode", "hello world", "the dog", *ports, "--out", tmp_path / "v.npy")
    assert code == 0 and out.strip() == f"wrote {tmp_path / 'v.npy'} (2 x 32 float32)", err
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), tiny_predictor.encode(["hello world", "the dog"]),
                               atol=1e-5, rtol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["v.npy"]  # no temp file left beside it
    code, out, err = cli("client", "status", *ports, "--json")
    assert code == 0, err
    assert json.loads(out)["port"] == tiny_server.port
    code, out, err = cli("serve", "--status", *ports)
    assert code == 0, err
    assert "uptime_s" in out and "mini_jobs_done" in out and "workers" in out


def test_an_openvino_int8_artifact_is_served_by_openvino(tiny_onnx, start_server, tmp_path):
    """One runtime: the workers build the artifact's own backend (OpenVINO, from the manifest), so served values
    are the in-process Predictor's."""
    import openvino  # noqa: F401  (make test installs it: a broken install must fail, not skip)

    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor

    art = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "runtime": "openvino"}, tmp_path / "ov")
    server = start_server(art.path, num_worker=1)
    texts = make_texts(12, seed=5)
    with server.client() as client:
        got = client.encode(texts)
        status = client.status()
    assert status["precision"] == "int8-dynamic+bf16"
    assert [w["backend"] for w in status["workers"]] == ["openvino"]
    want = Predictor(art, threads=1).encode(texts)
    # same model, same runtime; batches may be cut differently, which moves bf16 sums by a few ulps
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
