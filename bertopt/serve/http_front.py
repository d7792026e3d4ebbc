"""The HTTP front end of ``bertopt serve --http-port``: a uvicorn server in a thread of the server process,
feeding the same ventilator (and so the same worker fleet) as the ZeroMQ clients.

    HTTP clients --> [uvicorn thread: routes, validation, token counting] --inproc--> ventilator --> workers
                                 ^                                                                    |
                                 +-------- replies (tcp 127.0.0.1) <------------ sink <---------------+

Each admitted HTTP request becomes one fleet request with the reserved identity ``HTTP_IDENTITY`` and its own
request id; a receiver thread hands each reply to the waiting request's future on the event loop. Starlette on
uvicorn was picked by measurement (``benchmarks/http_stack.py``; docs/serving.md).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
from typing import Any

from bertopt.errors import UserError, require
from bertopt.protocol import decode_reply
from bertopt.serve.batching import KIND_CANCEL
from bertopt.serve.http_api import FleetError
from bertopt.serve.metrics import Metrics

log = logging.getLogger("bertopt.serve.http")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot bind HTTP {host}:{port} ({exc.strerror}); choose another --http-port or stop "
                        "the process using it") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def max_connections() -> int:
    """HTTP connections held open at most: half the file descriptors this process may open, so that connections
    (a flood of them, or of half-sent requests) never take those ZeroMQ, the workers' pipes and the log need."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(32, min(soft, 1 << 20) // 2)


def guarded_h11(header_timeout_s: float, limit: int):
    """uvicorn's HTTP/1.1 protocol with two bounds it lacks: a request line and headers must arrive within
    ``header_timeout_s`` of the connection opening or of the previous answer (a client trickling them held its
    connection, and a file descriptor, for ever: 3,000 such connections stayed open; ~20,000 ran the process out
    of file descriptors, taking the ZeroMQ side down with it), and a connection beyond ``limit`` open ones is
    closed at once."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limit:
                log.warning("HTTP: %d connections open, the most this server holds; closed a new one", limit)
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                self._arm_header_timer()  # the next request's headers are held to the same time

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11


class HttpFront:
    def __init__(self, cfg, models: list[dict[str, Any]], ctx):
        """``models``: the facts of every served model (``server._model_facts``), the first the default."""
        zmq = require("zmq", "serve", "bertopt serve")
        require("uvicorn", "serve", "bertopt serve --http-port")
        require("starlette", "serve", "bertopt serve --http-port")
        self.zmq = zmq
        self.cfg = cfg
        self.models = models
        self.facts = models[0]
        self.ctx = ctx
        self.metrics = Metrics()
        self.request_address = f"inproc://bertopt-http-{id(self)}"
        self.replies = ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.RCVHWM, 0)
        self.replies.setsockopt(zmq.LINGER, 0)
        self.reply_address = f"tcp://127.0.0.1:{self.replies.bind_to_random_port('tcp://127.0.0.1')}"
        self.sock = _listen(cfg.bind, cfg.http_port)
        self.ventilator = None
        self.ready = False
        self.in_flight = 0  # admitted requests not yet answered (event-loop thread only)
        self.duplicate_replies = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._push = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._receiver: threading.Thread | None = None
        self._closing = threading.Event()

    # -- life cycle (server process main thread) ----------------------------------------------------------
    def start(self, ventilator) -> None:
        import uvicorn

        from bertopt.serve.http_api import build_app

        self.ventilator = ventilator
        # uvicorn's own bounds: request line + headers at most 16 KiB (h11), an idle keep-alive connection closed
        # after 5 s; ours: the request line and headers within --body-timeout, at most max_connections open
        # (guarded_h11); the body is bounded by http_api (--max-request-bytes, --body-timeout)
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=int(max(1, self.cfg.grace_s)),
                                http=guarded_h11(self.cfg.body_timeout_s, max_connections()),
                                h11_max_incomplete_event_size=16 * 1024, timeout_keep_alive=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="bertopt-http", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="bertopt-http-replies", daemon=True)
        self._receiver.start()
        self._thread.start()

    def set_ready(self) -> None:
        self.ready = True

    def begin_shutdown(self) -> None:
        """Stop taking connections; requests already admitted are still answered (uvicorn waits for them)."""
        if self._server is not None and not self._server.should_exit:
            log.info("HTTP: no new connections; answering %d admitted request(s)", self.in_flight)
            self._server.should_exit = True

    def stopped(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def close(self) -> None:
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(self.cfg.grace_s + 5)
        self._closing.set()
        if self._receiver is not None:
            self._receiver.join(5)
        self.replies.close(0)
        self.sock.close()

    # -- event loop side ----------------------------------------------------------------------------------
    async def on_startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._push = self.ctx.socket(self.zmq.PUSH)
        self._push.setsockopt(self.zmq.SNDHWM, 0)
        self._push.setsockopt(self.zmq.LINGER, 2000)
        self._push.connect(self.request_address)

    async def on_shutdown(self) -> None:
        if self._push is not None:
            self._push.close()
            self._push = None

    def workers_ready(self, model: str | None = None) -> int:
        v = self.ventilator
        return 0 if v is None else len(v.pool.live(model))

    def worker_info(self, model: str | None = None) -> dict[str, Any]:
        v = self.ventilator
        live = v.pool.live(model) if v is not None else []
        return dict(live[0].info) if live else {}

    async def run(self, kind: bytes, items: list, lengths: list[int], model: str | None = None):
        """Send one request to the fleet and wait for its rows (float32 ``(n, d)``); FleetError on an error
        reply, asyncio.TimeoutError after ``--request-timeout`` (the late reply is then dropped)."""
        request_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[request_id] = future
        body = json.dumps({"items": items, "lengths": lengths, "model": model}).encode()
        try:
            self._push.send_multipart([b"%d" % request_id, kind, body])
            value = await asyncio.wait_for(future, self.cfg.request_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            # timed out, or its client hung up: the fleet drops what of it is still queued (else the queue
            # grew past every bound with work for clients that were gone)
            if self._push is not None:
                self._push.send_multipart([b"%d" % request_id, KIND_CANCEL, b""])
            raise
        finally:
            self._pending.pop(request_id, None)
        if isinstance(value, Exception):
            raise FleetError(str(value))
        return value

    def _resolve(self, request_id: int, value) -> None:
        future = self._pending.get(request_id)
        if future is None or future.done():  # timed out already (or a duplicate: the sink prevents those)
            self.duplicate_replies += 1
            return
        future.set_result(value)

    # -- receiver thread ----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        zmq = self.zmq
        while not self._closing.is_set():
            if not self.replies.poll(200):
                continue
            while True:
                try:
                    frames = self.replies.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    request_id, value = decode_reply(frames)
                except (ValueError, KeyError) as exc:
                    log.error("HTTP: dropped a malformed reply from the sink: %s", exc)
                    continue
                if self._loop is not None:
                    try:
                        self._loop.call_soon_threadsafe(self._resolve, request_id, value)
                    except RuntimeError:  # the event loop closed (shutting down): nobody waits for replies
                        return
