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
