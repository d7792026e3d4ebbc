"""The sink process: reassembles mini-job results into one reply per request and publishes it.

Started as ``python -I -m bertopt.serve.sink`` (its configuration a JSON line on stdin); prints ``PORT <n>``
(its internal PULL port) or ``ERROR <message>`` as its only stdout line, then logs to stderr.

* Exactly one reply per request: results are keyed by (client identity, request id, job index); a job seen
  twice (re-sent after a worker died) and anything arriving for an already answered request is dropped and
  counted as a duplicate.
* No slow-joiner loss: the PUB side is an XPUB that sees subscriptions, so a reply for a client whose
  subscription has not arrived yet is held (up to ``hold_s``) instead of being published into the void —
  bert-as-service slept 100 ms and hoped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections import deque

from bertopt.protocol import (
    CONFIG,
    ERROR,
    HTTP_IDENTITY,
    RESULT,
    SINK_STOP,
    client_request_id,
    config_reply,
    error_reply,
    ndarray_reply,
)
from bertopt.serve.recent_keys import RecentKeys
from bertopt.serve.task_replies import TASK_RESULT, TaskAssembly, task_reply

log = logging.getLogger("bertopt.serve.sink")
FINISHED_MEMORY = 200_000  # answered request keys remembered to drop late duplicates
STOP_HOLD_S = 1.0  # once stopping, how long a reply still waits for its client's subscription


class Assembler:
    """Pure bookkeeping, no sockets: results in, finished replies out (tested on its own)."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self.open: dict[tuple[bytes, bytes], dict] = {}
        self.finished = RecentKeys(FINISHED_MEMORY)
        self.counters = {"replies": 0, "errors": 0, "duplicates_dropped": 0, "results": 0, "misfits_dropped": 0}
        self.tasks = TaskAssembly()  # predict requests: JSON task results

    def _finish(self, key) -> None:
        self.finished.add(key)
        self.open.pop(key, None)
        self.tasks.open.pop(key, None)

    def task_result(self, identity, request_id, job_index, n_jobs, n_texts, offset, payload):
        """Like ``result`` for a predict request's slice of JSON task results."""
        key = (identity, request_id)
        if key in self.finished:
            self.counters["duplicates_dropped"] += 1
            return None
        results = self.tasks.add(key, job_index, n_jobs, n_texts, offset, payload)
        if results is False:
            self.counters["duplicates_dropped"] += 1
            return None
        if isinstance(results, str):
            return self._misfit(key, results)
        self.counters["results"] += 1
        if results is None:
            return None
        self._finish(key)
        self.counters["replies"] += 1
        return task_reply(identity, request_id, results)

    def result(self, identity, request_id, job_index, n_jobs, n_texts, offset, dim, data):
        """Returns the reply frames when this result completes its request, else None."""
        key = (identity, request_id)
        if key in self.finished:
            self.counters["duplicates_dropped"] += 1
            return None
        rec = self.open.get(key)
        if rec is None:
            if min(n_jobs, n_texts, dim) < 1 or not 0 <= job_index < n_jobs:
                return self._misfit(key, "a result that describes no request")
            rec = self.open[key] = {"n_jobs": n_jobs, "got": set(),
                                    "out": self._np.empty((n_texts, dim), dtype=self._np.float32)}
        if job_index in rec["got"]:
            self.counters["duplicates_dropped"] += 1
            return None
        out = rec["out"]
        if (n_jobs, n_texts, dim) != (rec["n_jobs"], *out.shape) or len(data) % (4 * dim) \
                or not 0 <= offset <= n_texts - len(data) // (4 * dim) or not 0 <= job_index < n_jobs:
            return self._misfit(key, f"a piece of {len(data) // 4} values at row {offset} that does not fit the "
                                     f"request's {out.shape[0]} x {out.shape[1]}")
        rows = self._np.frombuffer(data, dtype=self._np.float32).reshape(-1, dim)
        out[offset:offset + len(rows)] = rows
        rec["got"].add(job_index)
        self.counters["results"] += 1
        if len(rec["got"]) < rec["n_jobs"]:
            return None
        self._finish(key)
        self.counters["replies"] += 1
        return ndarray_reply(identity, request_id, rec["out"])

    def _misfit(self, key, what: str) -> None:
        """A result that cannot belong to the open record (internal ids keep requests apart, so this is a bug):
        dropped and logged, never written over another request's rows, never the end of the sink."""
        self.counters["misfits_dropped"] += 1
        log.error("sink: dropped %s (request %r of %r)", what, key[1][:40], key[0][:40])
        return None

    def error(self, identity, request_id, message: str):
        key = (identity, request_id)
        if key in self.finished:
            self.counters["duplicates_dropped"] += 1
            return None
        self._finish(key)
        self.counters["errors"] += 1
        return error_reply(identity, request_id, message)


class SinkSockets:
    """The sink's sockets: results in (PULL), replies out (XPUB for ZeroMQ clients, a PUSH to the server
    process for the HTTP front end's requests)."""

    def __init__(self, cfg: dict):
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a reply is never dropped by the high-water mark
        self.pub.setsockopt(zmq.LINGER, 2000)
        # what clients send here is subscriptions (a client id, at most 255 bytes): anything larger is hostile
        self.pub.setsockopt(zmq.MAXMSGSIZE, 4096)
        self.http = None
        if cfg.get("http_reply"):
            self.http = self.ctx.socket(zmq.PUSH)
            self.http.setsockopt(zmq.SNDHWM, 0)
            self.http.setsockopt(zmq.LINGER, 2000)
            self.http.connect(cfg["http_reply"])
        self.auth = None
        if cfg.get("curve_secret"):
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=cfg["curve_authorized"])
            self.pub.setsockopt(zmq.CURVE_SERVER, 1)
            self.pub.setsockopt(zmq.CURVE_SECRETKEY, cfg["curve_secret"].encode())

    def bind(self, cfg: dict) -> int | None:
        """The internal PULL port, or None (after printing the error line) when the output port is taken."""
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        if cfg.get("port_out") is None:  # HTTP only: no ZeroMQ clients to publish to
            return port
        try:
            self.pub.bind(f"tcp://{cfg['bind']}:{cfg['port_out']}")
        except self.zmq.ZMQError as exc:
            print(f"ERROR cannot bind the output port {cfg['bind']}:{cfg['port_out']} ({exc}); "
                  "choose another --port-out or stop the process using it", flush=True)
            self.close(linger=0)
            return None
        return port

    def close(self, linger: int | None = None) -> None:
        self.pull.close(0)
        self.pub.close(linger)  # linger: lets the last replies leave
        if self.http is not None:
            self.http.close(linger)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class Publisher:
    """Sends replies: to the HTTP front end, or on the XPUB once the client has subscribed (held until then,
    up to ``hold_s``)."""

    def __init__(self, sockets: SinkSockets, hold_s: float, port_out):
        self.s = sockets
        self.hold_s = hold_s
        self.port_out = port_out
        self.subscribed: set[bytes] = set()
        self.held: dict[bytes, deque] = {}  # identity -> replies waiting for that client's subscription

    def is_subscribed(self, identity: bytes) -> bool:
        return (identity in self.subscribed or b"" in self.subscribed
                or any(identity.startswith(s) for s in self.subscribed))

    def publish(self, frames) -> None:
        identity = frames[0]
        if self.s.http is not None and identity.startswith(HTTP_IDENTITY):
            self.s.http.send_multipart(frames, copy=False)
        elif self.is_subscribed(identity):
            self.s.pub.send_multipart(frames, copy=False)
        else:
            self.held.setdefault(identity, deque()).append((time.monotonic() + self.hold_s, frames))

    def on_subscriptions(self) -> None:
        while True:
            try:
                msg = self.s.pub.recv(self.s.zmq.NOBLOCK)
            except self.s.zmq.Again:
                break
            topic = msg[1:]
            if msg[:1] == b"\x01":
                self.subscribed.add(topic)
                for identity in [i for i in self.held if self.is_subscribed(i)]:
                    for _, frames in self.held.pop(identity):
                        self.s.pub.send_multipart(frames, copy=False)
            elif msg[:1] == b"\x00":
                self.subscribed.discard(topic)

    def expire(self, now: float) -> None:
        for identity in list(self.held):
            q = self.held[identity]
            while q and q[0][0] < now:
                q.popleft()
                log.warning("sink: dropped a reply for client %r: it never subscribed to port %s within %.0f s",
                            identity[:40], self.port_out, self.hold_s)
            if not q:
                del self.held[identity]

    def shorten_hold(self, hold_s: float) -> None:
        """Stopping: a client that has not subscribed by now gets ``hold_s`` more, not the full hold, so
        replies owed to clients that never subscribe cannot keep the server from exiting."""
        self.hold_s = min(self.hold_s, hold_s)
        until = time.monotonic() + self.hold_s
        for identity, q in self.held.items():
            self.held[identity] = deque((min(deadline, until), frames) for deadline, frames in q)

    def waiting(self) -> int:
        return sum(len(q) for q in self.held.values())


class Sink:
    """Results in, one reply per request out; stops once every reply the server owes is sent."""

    def __init__(self, cfg: dict, sockets: SinkSockets):
        self.cfg = cfg
        self.sockets = sockets
        self.asm = Assembler()
        self.out = Publisher(sockets, float(cfg.get("hold_s", 10.0)), cfg.get("port_out"))
        self.configs = 0
        self.expected: int | None = None
        self.stop_deadline = 0.0

    def handle(self, frames: list[bytes]) -> None:
        try:
            self._handle(frames)
        except Exception:  # a bug: one message must not end the sink (every reply after it would be lost)
            log.exception("sink: could not handle an internal message (tag %r, %d frames); dropped", frames[0][:10],
                          len(frames))

    def _handle(self, frames: list[bytes]) -> None:
        tag = frames[0]
        reply = None
        if tag == RESULT and len(frames) == 9:
            identity, request_id = frames[1], frames[2]
            job_index, n_jobs, n_texts, offset, dim = (int(f) for f in frames[3:8])
            reply = self.asm.result(identity, request_id, job_index, n_jobs, n_texts, offset, dim, frames[8])
        elif tag == TASK_RESULT and len(frames) == 8:
            job_index, n_jobs, n_texts, offset = (int(f) for f in frames[3:7])
            reply = self.asm.task_result(frames[1], frames[2], job_index, n_jobs, n_texts, offset, frames[7])
        elif tag == ERROR and len(frames) == 4:
            reply = self.asm.error(frames[1], frames[2], frames[3].decode(errors="replace"))
        elif tag == CONFIG and len(frames) == 4:
            reply = config_reply(frames[1], frames[2], self._status(json.loads(frames[3])))
            self.configs += 1
        elif tag == SINK_STOP:
            self.expected = int(frames[1])
            self.stop_deadline = time.monotonic() + float(self.cfg.get("grace_s", 30.0))
            self.out.shorten_hold(STOP_HOLD_S)
        else:
            log.error("sink: dropped an internal message with tag %r and %d frames", tag[:10], len(frames))
        if reply is not None:
            reply[-1] = client_request_id(reply[-1])  # the id the client sent (protocol.SEQ_SEPARATOR)
            self.out.publish(reply)

    def _status(self, status: dict) -> dict:
        c = self.asm.counters
        status.update({"replies_sent": c["replies"], "error_replies": c["errors"],
                       "duplicates_dropped": c["duplicates_dropped"], "requests_assembling": len(self.asm.open),
                       "replies_waiting_for_subscriber": self.out.waiting()})
        return status

    def finished(self, now: float) -> bool:
        if self.expected is None:
            return False
        answered = self.asm.counters["replies"] + self.asm.counters["errors"] + self.configs
        if (answered >= self.expected and not self.out.held) or now > self.stop_deadline:
            if answered < self.expected:
                log.error("sink: stopping with %d of %d replies sent (grace period over)", answered, self.expected)
            return True
        return False

    def run(self) -> None:
        zmq = self.sockets.zmq
        poller = zmq.Poller()
        poller.register(self.sockets.pull, zmq.POLLIN)
        poller.register(self.sockets.pub, zmq.POLLIN)
        ppid = os.getppid()
        while True:
            events = dict(poller.poll(200))
            if self.sockets.pub in events:
                self.out.on_subscriptions()
            if self.sockets.pull in events:
                for _ in range(1000):
                    try:
                        self.handle(self.sockets.pull.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            now = time.monotonic()
            self.out.expire(now)
            if self.finished(now):
                return
            if os.getppid() != ppid:
                log.error("sink: server process is gone; exiting")
                return


def run_sink(cfg: dict) -> int:
    sockets = SinkSockets(cfg)
    port = sockets.bind(cfg)
    if port is None:
        return 1
    print(f"PORT {port}", flush=True)
    Sink(cfg, sockets).run()
    sockets.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    from bertopt.serve.processes import read_config

    cfg = read_config(sys.argv[1:] if argv is None else argv)
    # the server decides when the sink stops (a process-group SIGINT/SIGTERM must not cut the drain short)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=cfg.get("log_level", "INFO"), stream=sys.stderr,
                        format="bertopt serve [sink] %(levelname)s %(message)s")
    sys.exit(run_sink(cfg))


if __name__ == "__main__":
    main()
