"""Client for ``bertopt serve`` (and, being the same wire protocol, for a bert-as-service server).

    from bertopt.client import Client

    with Client("127.0.0.1", port=5555, port_out=5556, timeout=30) as client:
        vectors = client.encode(["hello world", "a second sentence"])   # float32 (2, d)
        results = client.predict(["Ada lives in Paris"])                # a task model's results (entities, ...)
        future = client.encode_async(["many", "texts"])                  # concurrent.futures.Future
        print(client.status()["uptime_s"])

Timeouts: every call fails with ``ServerTimeout`` (a ``TimeoutError``) when no reply arrives within
``timeout`` seconds — also when no server is running at all — instead of hanging (``timeout=None`` waits
forever). Give large requests a large enough timeout. A server whose queue is full answers at once with
``ServerBusy`` (a ``ServerTimeout`` too): the request did not run; send it again later.

Threads: one ``Client`` may be shared by any number of threads. Sends go through one PUSH socket under a lock
(a ZeroMQ socket may change threads, never be used by two at once); one background thread owns the SUB socket
and hands each reply to the ``Future`` of its request id. So ``encode`` from many threads, or many
``encode_async`` calls in flight from one thread, all work on one pair of connections.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bertopt.errors import UserError, require
from bertopt.protocol import MODEL_PREFIX


class ServerTimeout(TimeoutError):
    """No reply from the server within the client's timeout."""


class ServerError(RuntimeError):
    """The server answered the request with an error (the message says what and how to fix it)."""


class ServerBusy(ServerTimeout):
    """The server's queue was full (``--max-queued-requests``): the request did not run and may be sent again
    later. A ``ServerTimeout`` (so code that retries on timeouts retries this too), answered at once instead of
    after the timeout."""


class Client:
    def __init__(self, ip: str = "127.0.0.1", port: int = 5555, port_out: int = 5556,
                 timeout: float | None = 60.0, identity: str | None = None, curve_keys: str | None = None,
                 model: str | None = None):
        """``model``: the served model this client's requests address (a server of several; default its first)."""
        zmq = require("zmq", "serve", "bertopt.client")
        self._zmq = zmq
        self.model = model
        self.ip, self.port, self.port_out, self.timeout = ip, port, port_out, timeout
        self.identity = (identity or str(uuid.uuid4())).encode()
        self._ctx = zmq.Context()
        self._sender = self._ctx.socket(zmq.PUSH)
        self._sender.setsockopt(zmq.LINGER, 0)
        if timeout is not None:
            self._sender.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._receiver = self._ctx.socket(zmq.SUB)
        self._receiver.setsockopt(zmq.LINGER, 0)
        self._receiver.setsockopt(zmq.RCVHWM, 0)
        self._receiver.setsockopt(zmq.SUBSCRIBE, self.identity)
        if curve_keys:
            self._use_curve(curve_keys)
        try:
            self._sender.connect(f"tcp://{ip}:{port}")
            self._receiver.connect(f"tcp://{ip}:{port_out}")
        except zmq.ZMQError as exc:  # a malformed address ("bad host", "a:b"): the caller's input, said as such
            self._ctx.destroy(linger=0)
            raise UserError(f"cannot address a server at {ip!r} (ports {port}/{port_out}): {exc.strerror}; give "
                            "a host name or IP address (--ip / --server)") from None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, float]] = {}
        self._next_id = 0
        self._closed = threading.Event()
        self.unexpected_replies = 0  # replies for no pending request (a duplicate would show up here)
        self._thread = threading.Thread(target=self._receive_loop, name="bertopt-client-recv", daemon=True)
        self._thread.start()

    def _use_curve(self, keys_dir: str) -> None:
        import zmq.auth

        root = Path(keys_dir)
        for name in ("client.key_secret", "server.key"):
            if not (root / name).exists():
                raise UserError(f"no {name} in {keys_dir}; use the folder 'bertopt serve --make-curve-keys' made")
        public, secret = zmq.auth.load_certificate(str(root / "client.key_secret"))
        server_public, _ = zmq.auth.load_certificate(str(root / "server.key"))
        for sock in (self._sender, self._receiver):
            sock.setsockopt(self._zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(self._zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(self._zmq.CURVE_SERVERKEY, server_public)

    # -- public API ---------------------------------------------------------------------------------------
    def encode(self, texts: Sequence[str] | str) -> np.ndarray:
        """Embeddings of ``texts`` as a float32 ``(n, d)`` array, rows in input order."""
        return self._wait(self.encode_async(texts))

    def encode_async(self, texts: Sequence[str] | str) -> Future:
        """Send the request now; the Future resolves to the array (or ServerError / ServerTimeout)."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise UserError("encode() got no texts; pass at least one string")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise UserError(f"text {i} is a {type(t).__name__}, not a string; pass a list of strings")
        return self._request(json.dumps(texts).encode(), len(texts))

    def predict(self, texts: Sequence[str] | str, pairs: Sequence[str] | None = None,
                aggregation: str | None = None) -> list[Any]:
        """The served model's task results, one per text, as ``bertopt.Predictor.predict`` gives them:
        classification ``{"label", "score", "scores"}``; token classification a list of entities (``aggregation``:
        none, simple, first, average, max); rerank a score per (text, pair); sparse embedding ``{"indices",
        "values"}``; embedding the vector (a list of floats)."""
        return self._wait(self.predict_async(texts, pairs, aggregation))

    def predict_async(self, texts: Sequence[str] | str, pairs: Sequence[str] | None = None,
                      aggregation: str | None = None) -> Future:
        """Send a predict request now; the Future resolves to the list of results."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(pairs, str):
            pairs = [pairs]
        texts = list(texts)
        if not texts:
            raise UserError("predict() got no texts; pass at least one string")
        if pairs is not None and len(pairs) != len(texts):
            raise UserError(f"got {len(texts)} texts but {len(pairs)} pairs; give one pair per text")
        items = []
        for i, t in enumerate(texts):
            if not isinstance(t, str) or (pairs is not None and not isinstance(pairs[i], str)):
                raise UserError(f"text {i} is not a string (or its pair is not); pass lists of strings")
            item: dict[str, str] = {"text": t}
            if pairs is not None:
                item["pair"] = pairs[i]
            if aggregation is not None:
                item["aggregation"] = aggregation
            items.append(item)
        return self._request(json.dumps(items).encode(), len(items))

    def rerank(self, query: str, passages: Sequence[str], top_k: int | None = None) -> list[dict[str, Any]]:
        """A rerank server's order of ``passages`` for ``query``: ``[{"index", "score", "text"}]`` best first."""
        if not isinstance(query, str) or isinstance(passages, str):
            raise UserError("rerank() takes a query string and a list of passage strings")
        passages = list(passages)
        if not passages:
            return []
        scores = self.predict([query] * len(passages), passages)
        order = sorted(range(len(passages)), key=lambda i: -scores[i])
        ranked = [{"index": i, "score": scores[i], "text": passages[i]} for i in order]
        return ranked[:top_k] if top_k else ranked

    def status(self) -> dict[str, Any]:
        """The server's configuration and counters (requests, mini-jobs, per-worker load, queues, uptime)."""
        return self._wait(self._request(b"SHOW_STATUS", 0))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(5)
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            fut.set_exception(RuntimeError("the client was closed before the reply arrived"))
        self._sender.close(0)
        self._receiver.close(0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------
    def _timeout_error(self) -> ServerTimeout:
        return ServerTimeout(f"no reply from the bertopt server at {self.ip}:{self.port}/{self.port_out} within "
                             f"{self.timeout:g} s; is 'bertopt serve' running with these --port/--port-out? "
                             "(large requests need a larger timeout)")

    def _request(self, payload: bytes, count: int) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("this client is closed; create a new Client")
            self._next_id += 1
            request_id = self._next_id
            deadline = time.monotonic() + self.timeout if self.timeout is not None else float("inf")
            self._pending[request_id] = (fut, deadline)
            try:
                frames = [self.identity, payload, b"%d" % request_id, b"%d" % count]
                self._sender.send_multipart(frames + ([MODEL_PREFIX + self.model.encode()] if self.model else []))
            except self._zmq.Again:
                del self._pending[request_id]
                raise self._timeout_error() from None
        return fut

    def _wait(self, fut: Future):
        # the receiver thread fails the future at its deadline; the extra margin only guards against a bug
        return fut.result(None if self.timeout is None else self.timeout + 5)

    def _receive_loop(self) -> None:
        from bertopt.protocol import ProtocolError, decode_reply, is_busy

        zmq = self._zmq
        while not self._closed.is_set():
            if self._receiver.poll(50):
                while True:
                    try:
                        frames = self._receiver.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        request_id, value = decode_reply(frames)
                    except (ValueError, KeyError, TypeError):
                        self.unexpected_replies += 1
                        continue
                    with self._lock:
                        entry = self._pending.pop(request_id, None)
                    if entry is None:
                        self.unexpected_replies += 1
                        continue
                    fut = entry[0]
                    if isinstance(value, ProtocolError):
                        fut.set_exception((ServerBusy if is_busy(str(value)) else ServerError)(str(value)))
                    elif isinstance(value, np.ndarray):
                        fut.set_result(value.copy())  # writeable, owns its memory
                    else:
                        fut.set_result(value)
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, (_, deadline) in self._pending.items() if deadline < now]
                futures = [self._pending.pop(rid)[0] for rid in expired]
            for fut in futures:
                fut.set_exception(self._timeout_error())
