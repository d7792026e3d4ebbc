"""ZeroMQ backpressure: the fleet's queue is bounded (--max-queued-requests); a request beyond it gets a busy
error reply at once, which the unchanged bert-serving-client raises and bertopt's Client raises as ServerBusy,
and the server lives on and answers afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from served_checks import encode_flood

from bertopt.protocol import BUSY_PREFIX, is_busy
from bertopt.serve.admission import Admission
from bertopt.serve.batching import FairQueue, cut_request

TEXTS = [f"sentence number {i} about the cat on the mat" for i in range(32)]


def _pieces(identity: bytes, request_id: bytes, n_texts: int, max_texts: int):
    return cut_request(identity, request_id, [f"t{i}" for i in range(n_texts)], [3] * n_texts, 10_000, max_texts)


def test_a_request_counts_as_queued_until_its_last_piece_leaves_the_queue():
    q = FairQueue()
    for piece in _pieces(b"a", b"1", 6, 2) + _pieces(b"b", b"1", 1, 2):  # 3 pieces, then 1
        q.push(piece)
    assert q.requests == 2
    popped = [q.pop() for _ in range(3)]  # round robin: a0, b0, a1
    assert [(p.identity, p.index) for p in popped] == [(b"a", 0), (b"b", 0), (b"a", 1)]
    assert q.requests == 1  # b is gone; a still has its last piece queued
    q.push(popped[0], front=True)  # a worker died: a0 is queued again, a is still one request
    assert q.requests == 1
    q.pop()
    q.pop()
    assert q.requests == 0 and len(q) == 0


def test_admission_refuses_at_the_bound_with_a_message_naming_the_limit_and_the_fix():
    admission = Admission(limit=3)
    assert admission.check(0) is None and admission.check(2) is None
    message = admission.check(3)
    assert message == ("server busy: 3 requests are waiting, this server's limit (--max-queued-requests 3); the "
                       "request did not run: send it again shortly, or start the server with more --num-worker "
                       "or a larger --max-queued-requests")
    assert is_busy(message) and message.startswith(BUSY_PREFIX)
    assert not is_busy("request has no texts; send at least one string")
    assert admission.refused == 1


def test_max_queued_requests_is_checked_like_every_serve_option(cli, tiny_onnx):
    code, _, err = cli(["serve", str(tiny_onnx.path), "--max-queued-requests", "0"])
    assert code == 2
    assert "--max-queued-requests" in err and "0" in err and "Traceback" not in err


def _flood_with_bert_serving_client(server, n: int) -> tuple[list[np.ndarray], list[str]]:
    """``n`` non-blocking requests of 32 texts from one BertClient, then every reply fetched: (arrays, errors)."""
    from bert_serving.client import BertClient

    arrays, errors = [], []
    with BertClient(ip="127.0.0.1", port=server.port, port_out=server.port_out, timeout=30000,
                    check_length=False) as bc:
        for _ in range(n):
            bc.encode(TEXTS, blocking=False)
        while bc.pending_request:
            try:
                arrays.append(next(bc.fetch()).embedding)
            except (TypeError, ValueError) as exc:  # numpy's refusal of the error message as a dtype
                errors.append(str(exc))
    return arrays, errors


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(300)
def test_a_flood_gets_busy_replies_the_clients_raise_and_the_server_lives_on(tiny_onnx, tiny_predictor,
                                                                            start_server):
    from bert_serving.client import BertClient

    from bertopt.client import ServerBusy, ServerTimeout

    # one worker, a queue of one request, requests cut into 8 mini-jobs each: a burst must overflow the queue
    server = start_server(tiny_onnx.path, "--max-queued-requests", "1", "--max-batch-size", "4", num_worker=1)
    want = tiny_predictor.encode(TEXTS)

    arrays, errors = _flood_with_bert_serving_client(server, 40)
    assert len(arrays) + len(errors) == 40  # every request got its one reply: none waited into the timeout
    assert arrays and errors
    for array in arrays:
        np.testing.assert_allclose(array, want, atol=1e-5, rtol=0)
    for message in errors:
        assert "bertopt serve error: server busy: " in message
        assert "(--max-queued-requests 1); the request did not run: send it again shortly" in message

    with server.client(timeout=30) as client:
        outcomes = encode_flood(client, TEXTS, 40)
        busy = [o for o in outcomes if isinstance(o, ServerBusy)]
        done = [o for o in outcomes if isinstance(o, np.ndarray)]
        assert busy and done and len(busy) + len(done) == 40
        assert all(isinstance(b, ServerTimeout) for b in busy)  # code that retries on timeouts retries this
        assert str(busy[0]).startswith("server busy: ") and "--max-queued-requests 1" in str(busy[0])
        for array in done:
            np.testing.assert_allclose(array, want, atol=1e-5, rtol=0)

        # afterwards: answered, and the refusals are counted
        np.testing.assert_allclose(client.encode(TEXTS), want, atol=1e-5, rtol=0)
        status = client.status()
        assert status["max_queued_requests"] == 1
        assert status["busy_refused"] == len(errors) + len(busy)
        assert status["queued_requests"] == 0
    # four clients flooding at once: every request still gets its one reply, the server still answers
    with ThreadPoolExecutor(4) as pool:
        floods = list(pool.map(lambda _: _flood_with_bert_serving_client(server, 40), range(4)))
    for arrays, errors in floods:
        assert len(arrays) + len(errors) == 40
        assert all("server busy: " in e for e in errors)
    with BertClient(ip="127.0.0.1", port=server.port, port_out=server.port_out, timeout=30000,
                    check_length=False) as bc:
        np.testing.assert_allclose(bc.encode(TEXTS), want, atol=1e-5, rtol=0)
    assert server.proc.poll() is None
    # a clean stop: every request taken was answered (the busy replies are counted as answers)
    assert server.terminate() == 0
    log = server.log()
    assert "Traceback" not in log


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(300)
def test_the_default_bound_takes_a_burst_without_refusing(tiny_onnx, tiny_predictor, start_server):
    server = start_server(tiny_onnx.path, num_worker=1)
    arrays, errors = _flood_with_bert_serving_client(server, 40)
    assert errors == [] and len(arrays) == 40
    with server.client() as client:
        status = client.status()
    assert status["max_queued_requests"] == 1024 and status["busy_refused"] == 0
