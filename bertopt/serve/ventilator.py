"""The ventilator: takes client requests, cuts them into mini-jobs, schedules them over workers, and
supervises the worker processes (restart on death, re-send their in-flight mini-jobs).

Scheduling (what keeps small clients fast under a flood):

* A request of at most ``priority_batch_size`` texts is one *priority* mini-job; a larger one is cut into bulk
  mini-jobs of at most ``max_batch_size``.
* Each queue (priority, bulk) is per-client round-robin (``FairQueue``): a client with 10,000 queued
  mini-jobs gets one turn, then the next client gets one.
* Each worker holds at most one bulk and one priority mini-job at a time (two lanes, two threads over one
  Predictor). Bulk work can therefore never occupy a worker fully: a priority job starts at once on a free
  priority lane instead of waiting for a 256-text mini-job to finish. Bounded in-flight work also means a
  dead worker costs at most two re-sent mini-jobs.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bertopt.protocol import (
    CONFIG,
    DONE,
    ERROR,
    FAIL,
    JOB,
    LANE_BULK,
    LANE_PRIORITY,
    READY,
    SINK_STOP,
    STOP,
    ProtocolError,
    Request,
    num,
    parse_request,
)

log = logging.getLogger("bertopt.serve")
MAX_ATTEMPTS = 3  # a mini-job that killed this many workers gets an error reply instead of a 4th try


@dataclass
class MiniJob:
    job_id: int
    identity: bytes
    request_id: bytes
    index: int
    n_jobs: int
    n_texts: int
    offset: int
    payload: bytes
    lane: bytes
    size: int = 0  # texts in this mini-job
    attempts: int = 0

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.identity, self.request_id)


class FairQueue:
    """Per-client FIFO queues served round-robin, one mini-job per client per turn."""

    def __init__(self) -> None:
        self._queues: dict[bytes, deque] = {}
        self._turns: deque[bytes] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, job: MiniJob, front: bool = False) -> None:
        q = self._queues.get(job.identity)
        if q is None:
            q = self._queues[job.identity] = deque()
            # a client re-sent work (front) goes first in the rotation too
            (self._turns.appendleft if front else self._turns.append)(job.identity)
        (q.appendleft if front else q.append)(job)
        self._len += 1

    def pop(self) -> MiniJob:
        identity = self._turns.popleft()
        q = self._queues[identity]
        job = q.popleft()
        self._len -= 1
        if q:
            self._turns.append(identity)
        else:
            del self._queues[identity]
        return job

    def clients(self) -> int:
        return len(self._queues)


@dataclass
class WorkerSlot:
    index: int
    generation: int = 0
    proc: subprocess.Popen | None = None
    ready: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    lanes: dict[bytes, MiniJob | None] = field(default_factory=lambda: {LANE_BULK: None, LANE_PRIORITY: None})
    jobs_done: int = 0
    texts_done: int = 0
    restarts: int = 0
    start_failures: int = 0
    last_error: str = ""

    @property
    def identity(self) -> bytes:
        return f"w{self.index}.{self.generation}".encode()

    def in_flight(self) -> list[MiniJob]:
        return [j for j in self.lanes.values() if j is not None]


class Ventilator:
    def __init__(self, ctx, cfg: dict[str, Any], frontend, router, sink_push, worker_cfg: dict[str, Any]):
        import zmq

        self.zmq = zmq
        self.ctx = ctx
        self.cfg = cfg
        self.frontend = frontend
        self.router = router
        self.sink = sink_push
        self.worker_cfg = worker_cfg
        self.workers = [WorkerSlot(i) for i in range(cfg["num_worker"])]
        self.priority = FairQueue()
        self.bulk = FairQueue()
        self.job_ids = itertools.count(1)
        self.failed_requests: set[tuple[bytes, bytes]] = set()
        self.started = time.time()
        self.accepting = True
        self.replies_owed = 0  # one per request taken (encode, status or error): told to the sink at stop
        self.counters = {"requests": 0, "texts": 0, "status_requests": 0, "rejected": 0, "dropped_no_address": 0,
                         "mini_jobs": 0, "mini_jobs_done": 0, "mini_jobs_resent": 0, "worker_restarts": 0}

    # -- workers ------------------------------------------------------------------------------------------
    def spawn(self, slot: WorkerSlot) -> None:
        wcfg = dict(self.worker_cfg, index=slot.index, identity=slot.identity.decode())
        devices = self.cfg.get("device_map") or []
        wcfg["device"] = devices[slot.index % len(devices)] if devices else None
        slot.proc = subprocess.Popen([sys.executable, "-m", "bertopt.serve.worker", json.dumps(wcfg)],
                                     stdin=subprocess.DEVNULL)
        slot.ready = False

    def start_workers(self, timeout_s: float, progress=None) -> None:
        """Start every worker and wait until all have loaded the artifact (or one failed: UserError)."""
        from bertopt.errors import UserError

        for slot in self.workers:
            self.spawn(slot)
        deadline = time.monotonic() + timeout_s
        while not all(s.ready for s in self.workers):
            if time.monotonic() > deadline:
                raise UserError(f"workers did not load the artifact within {timeout_s:.0f} s; "
                                "check the log above, or use fewer --num-worker")
            if self.router.poll(200):
                self.handle_worker(self.router.recv_multipart())
            for slot in self.workers:
                if slot.last_error:
                    raise UserError(f"worker {slot.index} could not load the artifact: {slot.last_error}")
                if slot.proc.poll() is not None and not slot.ready:
                    raise UserError(f"worker {slot.index} exited with code {slot.proc.returncode} while loading "
                                    "the artifact; see the log above")
            if progress:
                progress(sum(s.ready for s in self.workers), len(self.workers))

    def check_workers(self) -> None:
        for slot in self.workers:
            if slot.proc is None or slot.proc.poll() is None:
                continue
            jobs = slot.in_flight()
            if not slot.ready:
                slot.start_failures += 1
            slot.ready = False
            log.warning("worker %d (pid %s) died with exit code %s; restarting it and re-sending %d mini-job(s)",
                        slot.index, slot.proc.pid, slot.proc.returncode, len(jobs))
            for lane in slot.lanes:
                slot.lanes[lane] = None
            for job in jobs:
                self.requeue(job, f"worker {slot.index} died")
            if slot.start_failures >= MAX_ATTEMPTS:
                log.error("worker %d failed to start %d times (%s); leaving it stopped", slot.index,
                          slot.start_failures, slot.last_error)
                slot.proc = None
                continue
            slot.generation += 1
            slot.restarts += 1
            self.counters["worker_restarts"] += 1
            self.spawn(slot)

    def requeue(self, job: MiniJob, why: str) -> None:
        job.attempts += 1
        if job.attempts >= MAX_ATTEMPTS:
            self.fail_request(job.key, f"mini-job {job.index} of this request failed {job.attempts} times "
                                       f"({why}); the request may crash the model, check its texts")
            return
        self.counters["mini_jobs_resent"] += 1
        (self.priority if job.lane == LANE_PRIORITY else self.bulk).push(job, front=True)

    def fail_request(self, key: tuple[bytes, bytes], message: str) -> None:
        if key in self.failed_requests:
            return
        self.failed_requests.add(key)
        self.sink.send_multipart([ERROR, key[0], key[1], message.encode()])

    def handle_worker(self, frames: list[bytes]) -> None:
        identity, tag = frames[0], frames[1]
        slot = next((s for s in self.workers if s.identity == identity), None)
        if slot is None:
            log.warning("message %r from unknown or replaced worker %r ignored", tag[:10], identity)
            return
        if tag == READY:
            slot.ready = True
            slot.info = json.loads(frames[2])
            slot.start_failures = 0
            slot.last_error = ""
            log.info("worker %d ready (pid %s, %s threads, %s)", slot.index, slot.info.get("pid"),
                     slot.info.get("threads"), slot.info.get("provider"))
        elif tag == FAIL:
            slot.last_error = frames[2].decode(errors="replace")
            log.error("worker %d could not load the artifact: %s", slot.index, slot.last_error)
        elif tag == DONE:
            job_id = int(frames[2])
            for lane, job in slot.lanes.items():
                if job is not None and job.job_id == job_id:
                    slot.lanes[lane] = None
                    slot.jobs_done += 1
                    slot.texts_done += job.size
                    self.counters["mini_jobs_done"] += 1
                    break

    # -- requests -----------------------------------------------------------------------------------------
    def handle_request(self, frames: list[bytes]) -> None:
        try:
            req = parse_request(frames, self.cfg["max_request_bytes"])
        except ProtocolError as exc:
            if exc.identity is None:
                self.counters["dropped_no_address"] += 1
                log.warning("%s", exc)
                return
            self.counters["rejected"] += 1
            self.replies_owed += 1
            log.warning("rejected a request from %r: %s", exc.identity[:40], exc)
            self.sink.send_multipart([ERROR, exc.identity, exc.request_id, str(exc).encode()])
            return
        self.replies_owed += 1
        if req.command is not None:
            self.counters["status_requests"] += 1
            self.sink.send_multipart([CONFIG, req.identity, req.request_id, json.dumps(self.status()).encode()])
            return
        self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        n = len(req.texts)
        self.counters["requests"] += 1
        self.counters["texts"] += n
        size = self.cfg["max_batch_size"]
        lane = LANE_PRIORITY if n <= self.cfg["priority_batch_size"] else LANE_BULK
        queue = self.priority if lane == LANE_PRIORITY else self.bulk
        n_jobs = (n + size - 1) // size
        for index, start in enumerate(range(0, n, size)):
            chunk = req.texts[start:start + size]
            job = MiniJob(next(self.job_ids), req.identity, req.request_id, index, n_jobs, n, start,
                          json.dumps(chunk).encode(), lane, size=len(chunk))
            queue.push(job)
            self.counters["mini_jobs"] += 1

    # -- dispatch -----------------------------------------------------------------------------------------
    def _send(self, slot: WorkerSlot, lane: bytes, job: MiniJob) -> bool:
        try:
            # the worker runs it on the lane it occupies here (a priority job may borrow an idle bulk lane)
            self.router.send_multipart([slot.identity, JOB, num(job.job_id), lane, job.identity,
                                        job.request_id, num(job.index), num(job.n_jobs), num(job.n_texts),
                                        num(job.offset), job.payload])
        except self.zmq.ZMQError:  # ROUTER_MANDATORY: the worker's connection is gone (it died)
            slot.ready = False
            return False
        slot.lanes[lane] = job
        return True

    def dispatch(self) -> None:
        live = [s for s in self.workers if s.ready and s.proc is not None]
        while self.priority:
            # least busy worker first; its priority lane if free, else its (idle) bulk lane
            free = [(len(s.in_flight()), s) for s in live if None in s.lanes.values()]
            if not free:
                break
            job = self.priority.pop()
            if job.key in self.failed_requests:
                continue
            slot = min(free, key=lambda t: (t[0], t[1].index))[1]
            lane = LANE_PRIORITY if slot.lanes[LANE_PRIORITY] is None else LANE_BULK
            if not self._send(slot, lane, job):
                self.priority.push(job, front=True)
        while self.bulk:
            free = [s for s in live if s.ready and s.lanes[LANE_BULK] is None]
            if not free:
                break
            job = self.bulk.pop()
            if job.key in self.failed_requests:
                continue
            slot = min(free, key=lambda s: (s.jobs_done, s.index))
            if not self._send(slot, LANE_BULK, job):
                self.bulk.push(job, front=True)

    def idle(self) -> bool:
        return not self.priority and not self.bulk and not any(s.in_flight() for s in self.workers)

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        from bertopt.version import __version__

        c = self.cfg
        return {
            "server_version": c["wire_version"],
            "bertopt_version": __version__,
            "artifact": c["artifact"],
            "digest": c["digest"],
            "precision": c["precision"],
            "embedding_dim": c["embedding_dim"],
            "max_seq_len": c["max_seq_len"],
            "max_batch_size": c["max_batch_size"],
            "priority_batch_size": c["priority_batch_size"],
            "max_request_bytes": c["max_request_bytes"],
            "num_worker": c["num_worker"],
            "threads_per_worker": c["threads_per_worker"],
            "device_map": c.get("device_map"),
            "bind": c["bind"],
            "port": c["port"],
            "port_out": c["port_out"],
            "curve": bool(c.get("curve_keys")),
            "show_tokens_to_client": False,
            "accepting": self.accepting,
            "uptime_s": round(time.time() - self.started, 3),
            "queue_length": {"priority": len(self.priority), "bulk": len(self.bulk)},
            "clients_queued": self.priority.clients() + self.bulk.clients(),
            **self.counters,
            "workers": [{"index": s.index, "pid": s.info.get("pid") if s.ready else None,
                         "ready": s.ready, "in_flight": len(s.in_flight()), "jobs_done": s.jobs_done,
                         "texts_done": s.texts_done, "restarts": s.restarts,
                         "threads": s.info.get("threads"), "provider": s.info.get("provider"),
                         "backend": s.info.get("backend")}
                        for s in self.workers],
        }

    # -- main loop ----------------------------------------------------------------------------------------
    def run(self, should_stop) -> None:
        """Serve until ``should_stop()``; then stop taking requests and finish everything taken."""
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        last_check = 0.0
        while True:
            if self.accepting and should_stop():
                self.accepting = False
                poller.unregister(self.frontend)
                self.frontend.close(0)  # new requests now go nowhere; clients time out
                log.info("stopping: no new requests; finishing %d queued and %d in-flight mini-job(s)",
                         len(self.priority) + len(self.bulk), sum(len(s.in_flight()) for s in self.workers))
            if not self.accepting and self.idle():
                return
            events = dict(poller.poll(100))
            if self.router in events:
                for _ in range(10_000):
                    try:
                        self.handle_worker(self.router.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.accepting and self.frontend in events:
                for _ in range(1000):
                    try:
                        frames = self.frontend.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle_request(frames)
            now = time.monotonic()
            if now - last_check > 0.1:
                last_check = now
                self.check_workers()
                if not any(s.proc is not None for s in self.workers):
                    self._fail_everything("no worker can run: every worker failed to start")
                    return
            self.dispatch()

    def _fail_everything(self, message: str) -> None:
        for q in (self.priority, self.bulk):
            while q:
                self.fail_request(q.pop().key, message)

    def stop_workers(self, timeout_s: float) -> None:
        for slot in self.workers:
            if slot.proc is not None and slot.proc.poll() is None:
                try:
                    self.router.send_multipart([slot.identity, STOP])
                except self.zmq.ZMQError:
                    slot.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for slot in self.workers:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in time; killing it", slot.index)
                slot.proc.kill()
                slot.proc.wait(10)

    def stop_sink(self) -> None:
        self.sink.send_multipart([SINK_STOP, num(self.replies_owed)])
