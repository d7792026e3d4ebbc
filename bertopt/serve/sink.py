"""The sink process: reassembles mini-job results into one reply per request and publishes it.

Started as ``python -m bertopt.serve.sink CONFIG_JSON``; prints ``PORT <n>`` (its internal PULL port) or
``ERROR <message>`` as its only stdout line, then logs to stderr.

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
from collections import OrderedDict, deque

from bertopt.protocol import CONFIG, ERROR, RESULT, SINK_STOP, config_reply, error_reply, ndarray_reply

log = logging.getLogger("bertopt.serve.sink")
FINISHED_MEMORY = 200_000  # answered request keys remembered to drop late duplicates


class Assembler:
    """Pure bookkeeping, no sockets: results in, finished replies out (tested on its own)."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self.open: dict[tuple[bytes, bytes], dict] = {}
        self.finished: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self.counters = {"replies": 0, "errors": 0, "duplicates_dropped": 0, "results": 0}

    def _finish(self, key) -> None:
        self.finished[key] = None
        if len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        self.open.pop(key, None)

    def result(self, identity, request_id, job_index, n_jobs, n_texts, offset, dim, data):
        """Returns the reply frames when this result completes its request, else None."""
        key = (identity, request_id)
        if key in self.finished:
            self.counters["duplicates_dropped"] += 1
            return None
        rec = self.open.get(key)
        if rec is None:
            rec = self.open[key] = {"n_jobs": n_jobs, "got": set(),
                                    "out": self._np.empty((n_texts, dim), dtype=self._np.float32)}
        if job_index in rec["got"]:
            self.counters["duplicates_dropped"] += 1
            return None
        rows = self._np.frombuffer(data, dtype=self._np.float32).reshape(-1, dim)
        rec["out"][offset:offset + len(rows)] = rows
        rec["got"].add(job_index)
        self.counters["results"] += 1
        if len(rec["got"]) < rec["n_jobs"]:
            return None
        self._finish(key)
        self.counters["replies"] += 1
        return ndarray_reply(identity, request_id, rec["out"])

    def error(self, identity, request_id, message: str):
        key = (identity, request_id)
        if key in self.finished:
            self.counters["duplicates_dropped"] += 1
            return None
        self._finish(key)
        self.counters["errors"] += 1
        return error_reply(identity, request_id, message)


def run_sink(cfg: dict) -> int:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.SNDHWM, 0)  # a reply is never dropped by the high-water mark
    pub.setsockopt(zmq.LINGER, 2000)
    auth = None
    if cfg.get("curve_secret"):
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=cfg["curve_authorized"])
        pub.setsockopt(zmq.CURVE_SERVER, 1)
        pub.setsockopt(zmq.CURVE_SECRETKEY, cfg["curve_secret"].encode())
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        pub.bind(f"tcp://{cfg['bind']}:{cfg['port_out']}")
    except zmq.ZMQError as exc:
        print(f"ERROR cannot bind the output port {cfg['bind']}:{cfg['port_out']} ({exc}); "
              "choose another --port-out or stop the process using it", flush=True)
        if auth is not None:
            auth.stop()
        ctx.destroy(0)
        return 1
    print(f"PORT {port}", flush=True)

    asm = Assembler()
    subscribed: set[bytes] = set()
    held: dict[bytes, deque] = {}  # identity -> replies waiting for that client's subscription
    hold_s = float(cfg.get("hold_s", 10.0))
    configs = 0
    expected: int | None = None
    stop_deadline = 0.0
    ppid = os.getppid()

    def is_subscribed(identity: bytes) -> bool:
        return identity in subscribed or b"" in subscribed or any(identity.startswith(s) for s in subscribed)

    def publish(frames) -> None:
        identity = frames[0]
        if is_subscribed(identity):
            pub.send_multipart(frames, copy=False)
        else:
            held.setdefault(identity, deque()).append((time.monotonic() + hold_s, frames))

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(pub, zmq.POLLIN)
    while True:
        events = dict(poller.poll(200))
        if pub in events:
            while True:
                try:
                    msg = pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                topic = msg[1:]
                if msg[:1] == b"\x01":
                    subscribed.add(topic)
                    for identity in [i for i in held if is_subscribed(i)]:
                        for _, frames in held.pop(identity):
                            pub.send_multipart(frames, copy=False)
                elif msg[:1] == b"\x00":
                    subscribed.discard(topic)
        if pull in events:
            for _ in range(1000):
                try:
                    frames = pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                tag = frames[0]
                reply = None
                if tag == RESULT and len(frames) == 9:
                    identity, request_id = frames[1], frames[2]
                    job_index, n_jobs, n_texts, offset, dim = (int(f) for f in frames[3:8])
                    reply = asm.result(identity, request_id, job_index, n_jobs, n_texts, offset, dim, frames[8])
                elif tag == ERROR and len(frames) == 4:
                    reply = asm.error(frames[1], frames[2], frames[3].decode(errors="replace"))
                elif tag == CONFIG and len(frames) == 4:
                    status = json.loads(frames[3])
                    status.update({"replies_sent": asm.counters["replies"], "error_replies": asm.counters["errors"],
                                   "duplicates_dropped": asm.counters["duplicates_dropped"],
                                   "requests_assembling": len(asm.open),
                                   "replies_waiting_for_subscriber": sum(len(q) for q in held.values())})
                    reply = config_reply(frames[1], frames[2], status)
                    configs += 1
                elif tag == SINK_STOP:
                    expected = int(frames[1])
                    stop_deadline = time.monotonic() + float(cfg.get("grace_s", 30.0))
                else:
                    log.error("sink: dropped an internal message with tag %r and %d frames", tag[:10], len(frames))
                if reply is not None:
                    publish(reply)
        now = time.monotonic()
        for identity in list(held):
            q = held[identity]
            while q and q[0][0] < now:
                q.popleft()
                log.warning("sink: dropped a reply for client %r: it never subscribed to port %s within %.0f s",
                            identity[:40], cfg["port_out"], hold_s)
            if not q:
                del held[identity]
        if expected is not None:
            answered = asm.counters["replies"] + asm.counters["errors"] + configs
            if (answered >= expected and not held) or now > stop_deadline:
                if answered < expected:
                    log.error("sink: stopping with %d of %d replies sent (grace period over)", answered, expected)
                break
        if os.getppid() != ppid:
            log.error("sink: server process is gone; exiting")
            break
    pull.close(0)
    pub.close()  # linger: lets the last replies leave
    if auth is not None:
        auth.stop()
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the sink stops
    logging.basicConfig(level=cfg.get("log_level", "INFO"), stream=sys.stderr,
                        format="bertopt serve [sink] %(levelname)s %(message)s")
    sys.exit(run_sink(cfg))


if __name__ == "__main__":
    main()
