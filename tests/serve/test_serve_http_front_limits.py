"""HTTP resource limits on a real ``bertopt serve --http-port``, with raw sockets: stalled uploads (slowloris) hold
no admission slot and time out with 408, /tokenize is under admission control, chunked bodies are counted while
read, unknown routes and methods answer JSON, and a client that disconnects is neither an ERROR nor a 500."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from served_checks import metric_value
from test_serve_server_hostile_input import _post_head, _raw_http

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(300)]

BODY_TIMEOUT_S = 6


@pytest.fixture(scope="module")
def limited_server(tiny_onnx, tmp_path_factory, server_process):
    """One request admitted at a time, a short body timeout, a 100 kB body cap, one-text mini-jobs (so a
    2048-text request stays in flight for a while)."""
    server = server_process(tiny_onnx.path, tmp_path_factory.mktemp("limited"), "--max-concurrent-requests", "1",
                            "--body-timeout", str(BODY_TIMEOUT_S), "--max-request-bytes", "100000",
                            "--max-batch-size", "1", "--priority-batch-size", "0", num_worker=1, http=True)
    try:
        yield server
    finally:
        server.stop()


def _metric(server, name: str, **labels: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics", timeout=30).text, name, **labels)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock``: an orderly end, or a reset where the bytes the client kept sending were
    still unread in the server's socket when it closed (the kernel then answers with RST, not FIN)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.I)
        if length and len(body) >= int(length.group(1)):
            break
    return int(data.split()[1]), data.partition(b"\r\n\r\n")[2]


def test_stalled_uploads_hold_no_admission_slot_and_time_out_with_408(limited_server):
    before = _metric(limited_server, "bertopt_http_requests_total", route="/embed", status="408")
    stalled = []
    for _ in range(5):  # five uploads that send their headers and part of the body, then stall
        sock = socket.create_connection(("127.0.0.1", limited_server.http_port), timeout=60)
        sock.sendall(_post_head("/embed", 100) + b'{"inputs": ')
        stalled.append(sock)
    try:
        time.sleep(0.5)
        # only one request may be admitted at a time, and five uploads are stalled: a good request still gets in
        r = httpx.post(limited_server.url + "/embed", json={"inputs": "a good request"}, timeout=BODY_TIMEOUT_S - 1)
        assert r.status_code == 200 and len(r.json()[0]) == 32
        for sock in stalled:  # each stalled upload is cut off after --body-timeout with a JSON 408
            status, body = _read_answer(sock)
            assert status == 408
            assert "not received within 6 s (--body-timeout" in json.loads(body)["error"]
    finally:
        for sock in stalled:
            sock.close()
    assert _metric(limited_server, "bertopt_http_requests_total", route="/embed", status="408") == before + 5


def test_tokenize_is_under_admission_control(limited_server, tiny_predictor):
    texts = [f"sentence number {i} about the cat" for i in range(2048)]
    result = {}

    def big_request():
        result["response"] = httpx.post(limited_server.url + "/embed", json={"inputs": texts}, timeout=120)

    worker = threading.Thread(target=big_request)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while _metric(limited_server, "bertopt_http_requests_in_flight") < 1:
            assert time.monotonic() < deadline and worker.is_alive(), "the big request was never in flight"
            time.sleep(0.02)
        busy = httpx.post(limited_server.url + "/tokenize", json={"inputs": "hi"}, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert "--max-concurrent-requests" in busy.json()["error"] and busy.json()["error_type"] == "Overloaded"
    finally:
        worker.join(120)
    assert result["response"].status_code == 200 and len(result["response"].json()) == 2048
    ok = httpx.post(limited_server.url + "/tokenize", json={"inputs": "the cat"}, timeout=30)
    assert ok.status_code == 200
    assert [t["id"] for t in ok.json()[0]] == tiny_predictor.tokenize(["the cat"])[0].ids


def test_unknown_routes_and_methods_answer_json_in_openai_schema(limited_server):
    r = httpx.get(limited_server.url + "/no/such/route", timeout=30)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
    assert error["message"].startswith("no route /no/such/route;")
    r = httpx.get(limited_server.url + "/embed", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "GET is not allowed on /embed; use POST"


def test_chunked_body_over_the_cap_is_refused_while_read(limited_server):
    head = (b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"inputs": "' + b"x" * 9988
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(15)) + b"0\r\n\r\n"  # 150 kB
    status, _, body = _raw_http(limited_server, head, chunks)
    assert status == 413
    assert "request body exceeds this server's limit of 100000 bytes (--max-request-bytes)" in json.loads(body)["error"]
    status, _, body = _raw_http(limited_server, _post_head("/embed", 5_000_000))  # announced, never sent
    assert status == 413 and "request body of 5000000 bytes exceeds" in json.loads(body)["error"]


def test_a_client_disconnect_is_not_an_error_nor_a_500(limited_server):
    before = _metric(limited_server, "bertopt_http_requests_total", route="/embed", status="499")
    sock = socket.create_connection(("127.0.0.1", limited_server.http_port), timeout=30)
    sock.sendall(_post_head("/embed", 1000) + b'{"inputs": "half a bo')
    time.sleep(0.3)
    sock.close()  # gone mid-upload
    deadline = time.monotonic() + 30
    while _metric(limited_server, "bertopt_http_requests_total", route="/embed", status="499") < before + 1:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    assert _metric(limited_server, "bertopt_http_requests_total", route="/embed", status="500") == 0
    log = limited_server.log()
    assert "Traceback" not in log and " ERROR " not in log
    assert httpx.post(limited_server.url + "/embed", json={"inputs": "still up"}, timeout=30).status_code == 200


# -- work for clients that are gone; slow headers; bounded /tokenize -----------------------------------------
def _queue_depth(server) -> int:
    """Request pieces waiting in the fleet's queues (the server's status, over ZeroMQ)."""
    return sum(server.client().status()["queue_length"].values())


@pytest.fixture(scope="module")
def impatient_server(tiny_onnx, tmp_path_factory, server_process):
    """One-text mini-jobs on one worker (an 8192-text request queues 8192 pieces), a 2 s request timeout and a
    token budget per request."""
    server = server_process(tiny_onnx.path, tmp_path_factory.mktemp("impatient"), "--request-timeout", "2",
                            "--body-timeout", str(BODY_TIMEOUT_S), "--max-batch-size", "1",
                            "--priority-batch-size", "0", "--max-request-tokens", "60000",
                            "--max-client-batch-size", "8192", num_worker=1, http=True)
    try:
        yield server
    finally:
        server.stop()


def _wait_for(what, condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["the client hangs up", "the request times out"])
def test_a_request_nobody_waits_for_leaves_the_fleet_queue(impatient_server, how):
    """Its queued pieces are dropped at once: before, they stayed queued (and were computed) for a client that was
    gone, so the queue grew past every bound under a flood of timeouts and starved the clients still waiting."""
    server = impatient_server
    # 8192 one-text mini-jobs (~50,000 tokens): on an AVX-512 EPYC one worker ran 2048 of them inside the 2 s
    # timeout, and the request answered 200
    body = json.dumps({"inputs": [f"text number {i}" for i in range(8192)]}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    sock.sendall(_post_head("/embed", len(body)) + body)
    _wait_for("the request never reached the queue", lambda: _queue_depth(server) > 100)
    if how == "the client hangs up":
        sock.close()
        status = "499"
    else:
        assert _read_answer(sock)[0] == 504
        sock.close()
        status = "504"
    # 8192 one-text mini-jobs take far longer than this on one worker
    _wait_for("the dropped request's pieces stayed queued", lambda: _queue_depth(server) == 0, timeout_s=10)
    assert _metric(server, "bertopt_http_requests_total", route="/embed", status=status) >= 1
    answer = httpx.post(server.url + "/embed", json={"inputs": ["still answered"]}, timeout=30)
    assert answer.status_code == 200 and len(answer.json()) == 1
    status_reply = server.client().status()
    assert status_reply["http_cancelled"] >= 1 and status_reply["queued_requests"] == 0
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log


@pytest.mark.parametrize("sent", [b"", b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-"])
def test_a_connection_whose_headers_never_come_is_closed(impatient_server, sent):
    """Slowloris: a connection that sends nothing, or trickles a request's headers, was held open for ever (3,000
    of them stayed open; ~20,000 ran the server out of file descriptors, ZeroMQ side included)."""
    sock = socket.create_connection(("127.0.0.1", impatient_server.http_port), timeout=BODY_TIMEOUT_S + 30)
    sock.sendall(sent)
    started = time.monotonic()
    for _ in range(3):  # more bytes, never the end of the headers
        time.sleep(1)
        sock.sendall(b"X")
    assert _closed_by_server(sock)
    assert BODY_TIMEOUT_S - 1 <= time.monotonic() - started < BODY_TIMEOUT_S + 10
    sock.close()
    # a request that keeps its connection open afterwards is held to the same time for the next one's headers
    keep = socket.create_connection(("127.0.0.1", impatient_server.http_port), timeout=BODY_TIMEOUT_S + 30)
    body = b'{"inputs": "hello"}'
    keep.sendall(_post_head("/embed", len(body)) + body)
    assert _read_answer(keep)[0] == 200
    started = time.monotonic()
    for _ in range(BODY_TIMEOUT_S + 3):  # within uvicorn's 5 s keep-alive each time, never a whole request
        keep.sendall(b"P")
        time.sleep(1)
        if time.monotonic() - started > BODY_TIMEOUT_S + 1:
            break
    assert _closed_by_server(keep)
    keep.close()


def test_tokenize_answers_at_most_the_request_token_budget(impatient_server):
    """/tokenize builds a JSON object per token (~1 kB of Python each while it is built): 4 MB of text within every
    other limit made a 131 MB answer and 1 GB of server memory."""
    texts = ["word " * 400] * 180  # ~72,000 tokens, over this server's --max-request-tokens 60000
    answer = httpx.post(impatient_server.url + "/tokenize", json={"inputs": texts}, timeout=60)
    assert answer.status_code == 413, answer.text
    assert "more than this server's limit of 60000 (--max-request-tokens)" in answer.json()["error"]
    ok = httpx.post(impatient_server.url + "/tokenize", json={"inputs": texts[:10]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()) == 10
