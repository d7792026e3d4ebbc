"""Hostile and malformed requests on a real ``bertopt serve`` (ZeroMQ and HTTP on one fleet), sent with raw pyzmq
sockets and raw HTTP: each gets its own error reply, and the server and its workers live on to answer a good
request with the right vectors."""

from __future__ import annotations

import json
import socket

import httpx
import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(300)]

DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads recursed once per level: RecursionError ended the server
SURROGATE = json.dumps(["fine", "a\ud800b"]).encode()  # '"a\\ud800b"': decodes to a lone surrogate
HUGE_TEXT = 50_000_000  # characters: under the default --max-request-bytes (64 MiB), over --max-text-chars


@pytest.fixture(scope="module")
def hostile_server(tiny_onnx, tmp_path_factory, server_process):
    """Default limits but a small per-request token budget, so that limit can be reached with a few texts."""
    server = server_process(tiny_onnx.path, tmp_path_factory.mktemp("hostile"), "--max-request-tokens", "2000",
                            http=True)
    try:
        yield server
    finally:
        server.stop()


class RawZmq:
    """A raw PUSH + SUB pair with one identity: sends any frames, reads the replies for that identity."""

    def __init__(self, server, identity: bytes):
        import zmq

        self.ctx = zmq.Context()
        self.push, self.sub = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.SUB)
        self.identity = identity
        self.sub.setsockopt(zmq.SUBSCRIBE, identity)
        for sock in (self.push, self.sub):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://127.0.0.1:{server.port}")
        self.sub.connect(f"tcp://127.0.0.1:{server.port_out}")

    def send(self, *frames: bytes) -> None:
        self.push.send_multipart(list(frames))

    def replies(self, n: int, timeout_s: float = 60.0) -> dict[bytes, list[bytes]]:
        got = {}
        for _ in range(n):
            assert self.sub.poll(int(timeout_s * 1000)), f"only {len(got)} of {n} replies arrived"
            frames = self.sub.recv_multipart()
            assert frames[0] == self.identity
            got[frames[-1]] = frames
        return got

    def close(self) -> None:
        self.push.close()
        self.sub.close()
        self.ctx.term()


def _error(frames: list[bytes]) -> str:
    """The error of a reply in bert-as-service's error form ([identity, {"error"}, b"", request id])."""
    assert len(frames) == 4 and frames[2] == b"", frames[:2]
    return json.loads(frames[1])["error"]


def test_zmq_hostile_messages_each_get_an_error_reply_and_the_server_lives_on(hostile_server, tiny_predictor):
    with hostile_server.client() as client:
        workers_before = {w["pid"] for w in client.status()["workers"]}
    raw = RawZmq(hostile_server, b"hostile-client")
    cases = [
        ([DEEP, b"1", b"1"], "request JSON nests more than 16 levels deep; send a JSON list of strings"),
        ([SURROGATE, b"2", b"2"], "text 1 holds a lone surrogate (U+D800) at character 1"),
        ([b"\x80\x81 not json at all", b"3", b"1"], "request payload is not JSON"),
        ([b'["ok"]', b"4", b"1", b"extra"], "expected 4 frames"),
        ([b"42", b"5", b"1"], "payload is a JSON int, not a list"),
        ([b'[1, 2]', b"6", b"2"], "text 0 is a int (1), not a string"),
        ([b'{"text": "x"}', b"7", b"1"], "not a list"),
        ([b"[]", b"8", b"0"], "request has no texts"),
        ([json.dumps(["x"] * 3000).encode(), b"9", b"3000"],
         "request has 3000 texts, more than this server's limit of 2048 (--max-client-batch-size)"),
        ([json.dumps(["y" * HUGE_TEXT]).encode(), b"10", b"1"],
         f"text 0 has {HUGE_TEXT} characters, more than this server's limit of 100000 (--max-text-chars)"),
        ([json.dumps(["z" * 90_000] * 50).encode(), b"11", b"50"],
         "request holds 4500000 characters, more than this server's limit of 4000000 (--max-request-chars)"),
        ([json.dumps(["hello world " * 20] * 100).encode(), b"12", b"100"],
         "more than this server's limit of 2000 (--max-request-tokens)"),
        ([json.dumps([{"text": "q", "pair": "p\udfff"}]).encode(), b"13", b"1"],
         "text 0 (second text) holds a lone surrogate (U+DFFF)"),
        ([b'[' * 17 + b'"x"' + b']' * 17, b"14", b"1"], "nests more than 16 levels"),
        (['["x"]'.encode("utf-16"), b"15", b"1"], "not UTF-8 JSON"),
        ([b'["a", NaN]', b"16", b"2"], "request payload is not JSON (NaN is not a JSON value)"),
        ([b"[" + b"7" * 5000 + b"]", b"17", b"1"], "(Exceeds the limit (4300 digits) for integer string conversion: "
                                                  "value has 5000 digits); send a JSON list of strings"),
    ]
    try:
        for frames, _ in cases:
            raw.send(raw.identity, *frames)
        replies = raw.replies(len(cases))
        for frames, expected in cases:
            message = _error(replies[frames[1]])
            assert expected in message, (frames[1], message)
            assert "Traceback" not in message
        # a good request afterwards: the right vectors, from the same workers (none died or restarted)
        raw.send(raw.identity, b'["the cat sat"]', b"99", b"1")
        frames = raw.replies(1)[b"99"]
        info = json.loads(frames[1])
        got = np.frombuffer(frames[2], dtype=info["dtype"]).reshape(info["shape"])
        np.testing.assert_allclose(got, tiny_predictor.encode(["the cat sat"]), atol=1e-5, rtol=0)
    finally:
        raw.close()
    with hostile_server.client() as client:
        status = client.status()
    assert {w["pid"] for w in status["workers"]} == workers_before and status["worker_restarts"] == 0
    assert hostile_server.proc.poll() is None
    assert "Traceback" not in hostile_server.log()


def _raw_http(server, head: bytes, body: bytes = b"", timeout_s: float = 30.0) -> tuple[int, dict, bytes]:
    """One request over a plain socket (any bytes, any framing); the status, headers and body of the answer."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed without an answer: {data!r}"
            data += chunk
        header_block, _, rest = data.partition(b"\r\n\r\n")
        lines = header_block.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def _post_head(route: str, length: int, extra: str = "") -> bytes:
    return (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


@pytest.mark.parametrize("route, body, status, message", [
    ("/embed", b'{"inputs": ' + DEEP + b"}", 400, "nests more than 16 levels deep"),
    ("/embed", b'{"inputs": ' + SURROGATE + b"}", 422, "'inputs[1]' holds a lone surrogate (U+D800) at character 1"),
    ("/v1/embeddings", b'{"model": "m", "input": ' + SURROGATE + b"}", 400, "'input[1]' holds a lone surrogate"),
    ("/tokenize", b'{"inputs": ' + SURROGATE + b"}", 422, "'inputs[1]' holds a lone surrogate"),
    ("/embed", b"\x80\x81 not json", 400, "not valid JSON"),
    ("/embed", json.dumps({"inputs": ["y" * HUGE_TEXT]}).encode(), 413,
     f"'inputs[0]' has {HUGE_TEXT} characters, more than this server's limit of 100000 (--max-text-chars)"),
    ("/v1/embeddings", json.dumps({"model": "m", "input": ["z" * 90_000] * 50}).encode(), 400,
     "(--max-request-chars)"),
    ("/embed", json.dumps({"inputs": ["hello world " * 20] * 100}).encode(), 413, "(--max-request-tokens)"),
    ("/tokenize", json.dumps({"inputs": ["y" * 200_000]}).encode(), 413, "(--max-text-chars)"),
])
def test_http_hostile_bodies_get_a_json_4xx_never_a_500(hostile_server, route, body, status, message):
    code, headers, answer = _raw_http(hostile_server, _post_head(route, len(body)), body)
    assert code == status, answer[:300]
    assert headers["content-type"] == "application/json"
    error = json.loads(answer)["error"]
    text = error["message"] if route.startswith("/v1") else error
    assert message in text and "Traceback" not in text
    r = httpx.post(hostile_server.url + "/embed", json={"inputs": "still up"}, timeout=30)
    assert r.status_code == 200 and len(r.json()[0]) == 32


def test_http_content_length_over_the_cap_is_refused_before_the_body_is_sent(hostile_server):
    # 100 MB announced, nothing sent: the 413 comes back without the server waiting for (or reading) the body
    code, headers, answer = _raw_http(hostile_server, _post_head("/embed", 100_000_000), timeout_s=30)
    assert code == 413
    assert "exceeds this server's limit of 67108864 (--max-request-bytes)" in json.loads(answer)["error"]
    assert httpx.post(hostile_server.url + "/embed", json={"inputs": "still up"}, timeout=30).status_code == 200
    metrics = httpx.get(hostile_server.url + "/metrics", timeout=30).text
    assert 'status="500"' not in metrics
