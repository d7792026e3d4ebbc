"""The ventilator: takes requests (ZeroMQ clients and the HTTP front end alike), cuts them into pieces by
tokens, packs pieces into mini-jobs, schedules them over workers, and supervises the worker processes.

Three parts, one per concern:

* ``WorkerPool``: the worker processes: start, ready/done messages, restart on death (handing back the dead
  one's in-flight pieces), stop.
* ``Scheduler``: two fair queues (priority, bulk) per model and the dispatch of packed mini-jobs to free lanes.
* ``Ventilator``: the main loop: request intake, status, the stop sequence.

Scheduling (what keeps small clients fast under a flood):

* A request is cut into pieces of at most ``max_batch_tokens`` tokens and ``max_batch_size`` texts
  (``batching.cut_request``). A request of at most ``priority_batch_size`` texts and ``priority_tokens``
  tokens is *priority* work.
* Each worker holds at most one bulk and one priority mini-job (two lanes, two threads over one Predictor),
  so a priority job starts at once on a free lane instead of waiting for a bulk mini-job to finish, and a
  bulk mini-job is bounded by tokens, so what a priority job shares the cores with is bounded too.
* A free lane takes a packed mini-job: the next pieces in round-robin order up to the lane's token budget,
  so a hundred one-sentence requests from different clients run as one batch.

Several models (``bertopt serve ART1 ART2``): every model has its own workers and its own two queues; a request
names its model (HTTP: the route's or the ``model`` field; ZeroMQ: an optional fifth frame; default the first
model). A mini-job holds one model's pieces and goes to a worker of that model, so a flood on one model fills its
own queues and lanes only: another model's requests wait for nothing but their own model's work, and the cores
are shared between the models' worker processes by the OS (a flood's bulk lanes run at a higher nice value).
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from bertopt.errors import UserError
from bertopt.protocol import (
    CONFIG,
    DONE,
    ERROR,
    FAIL,
    JOB,
    LANE_BULK,
    LANE_PRIORITY,
    READY,
    SEQ_SEPARATOR,
    SINK_STOP,
    STOP,
    ProtocolError,
    Request,
    RequestError,
    RequestLimits,
    http_identity,
    message_bytes,
    num,
    parse_request,
)
from bertopt.runtime.predictor import check_texts
from bertopt.serve.admission import Admission
from bertopt.serve.batching import (
    KIND_CANCEL,
    KIND_PREDICT,
    KIND_TEXT,
    KINDS,
    FairQueue,
    Piece,
    cut_request,
    pack,
)
from bertopt.serve.processes import how_it_ended, start_child
from bertopt.serve.recent_keys import RecentKeys

log = logging.getLogger("bertopt.serve")
MAX_ATTEMPTS = 3  # a piece that killed this many workers gets an error reply instead of a 4th try
FAILED_MEMORY = 100_000  # failed requests remembered (their queued pieces are dropped, not run)


@dataclass
class MiniJob:
    job_id: int
    lane: bytes
    pieces: list[Piece]
    model: str = ""
    dispatched: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    def frames(self, lane: bytes) -> list[bytes]:
        out = [JOB, num(self.job_id), lane, self.pieces[0].kind, num(len(self.pieces))]
        items: list[Any] = []
        for p in self.pieces:
            out += [p.identity, p.request_id, b"%d %d %d %d %d" % (p.index, p.n_pieces, p.n_texts, p.offset,
                                                                   p.size)]
            items += p.items
        out.append(json.dumps(items).encode())
        return out


@dataclass
class WorkerSlot:
    index: int
    model: str = ""  # the model this worker runs
    generation: int = 0
    proc: subprocess.Popen | None = None
    ready: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    lanes: dict[bytes, MiniJob | None] = field(default_factory=lambda: {LANE_BULK: None, LANE_PRIORITY: None})
    jobs_done: int = 0
    texts_done: int = 0
    restarts: int = 0
    start_failures: int = 0
    last_error: str = ""  # what it said when it could not load the artifact
    last_end: str = ""  # how its process last ended (how_it_ended)

    @property
    def identity(self) -> bytes:
        return f"w{self.index}.{self.generation}".encode()

    def in_flight(self) -> list[MiniJob]:
        return [j for j in self.lanes.values() if j is not None]

    def clear_lanes(self) -> list[MiniJob]:
        jobs = self.in_flight()
        for lane in self.lanes:
            self.lanes[lane] = None
        return jobs

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "model": self.model, "pid": self.info.get("pid") if self.ready else None,
                "ready": self.ready,
                "in_flight": len(self.in_flight()), "jobs_done": self.jobs_done, "texts_done": self.texts_done,
                "restarts": self.restarts, "threads": self.info.get("threads"),
                "provider": self.info.get("provider"), "backend": self.info.get("backend"),
                "warmup_s": self.info.get("warmup_s"),
                "error": None if self.ready else (self.last_error or None)}


class WorkerPool:
    """The worker processes and their lanes, talked to over one ROUTER socket."""

    def __init__(self, zmq, router, worker_cfgs: dict[str, dict[str, Any]], device_map: list[int] | None,
                 metrics=None):
        """``worker_cfgs``: per model (in serving order), its workers' configuration, ``num_worker`` of them."""
        self.zmq = zmq
        self.router = router
        self.worker_cfgs = worker_cfgs
        self.device_map = device_map or []
        models = [name for name, wcfg in worker_cfgs.items() for _ in range(wcfg["num_worker"])]
        self.slots = [WorkerSlot(i, model) for i, model in enumerate(models)]
        self.metrics = metrics
        self.restarts = 0
        # until every worker has loaded, start() raises a load failure as the one error line the user sees; after
        # that (a restart), the log is where it shows
        self.started = False

    def spawn(self, slot: WorkerSlot) -> None:
        wcfg = dict(self.worker_cfgs[slot.model], index=slot.index, identity=slot.identity.decode())
        wcfg["device"] = self.device_map[slot.index % len(self.device_map)] if self.device_map else None
        slot.proc = start_child("bertopt.serve.worker", wcfg)
        slot.ready = False

    def start(self, timeout_s: float, progress=None) -> None:
        """Start every worker and wait until all have loaded the artifact (or one failed: UserError)."""
        for slot in self.slots:
            self.spawn(slot)
        deadline = time.monotonic() + timeout_s
        while not all(s.ready for s in self.slots):
            if time.monotonic() > deadline:
                from bertopt.errors import UserError

                raise UserError(f"workers did not load the artifact within {timeout_s:.0f} s; "
                                "check the log above, or use fewer --num-worker")
            if self.router.poll(200):
                self.handle(self.router.recv_multipart())
            self._raise_on_start_failure()
            if progress:
                progress(sum(s.ready for s in self.slots), len(self.slots))
        self.started = True

    def _raise_on_start_failure(self) -> None:
        from bertopt.errors import UserError

        for slot in self.slots:
            if slot.last_error:
                raise UserError(f"worker {slot.index}{self._of(slot)} could not load the artifact: "
                                f"{slot.last_error}")
            if slot.proc.poll() is not None and not slot.ready:
                raise UserError(f"worker {slot.index}{self._of(slot)} stopped while loading the artifact: it "
                                f"{how_it_ended(slot.proc.returncode)}")

    def _of(self, slot: WorkerSlot) -> str:
        """' (model NAME)' where the fleet serves several models."""
        return f" (model {slot.model})" if len(self.worker_cfgs) > 1 else ""

    def reap_dead(self) -> list[MiniJob]:
        """Restart every dead worker; return the mini-jobs it held (to be re-sent)."""
        lost: list[MiniJob] = []
        for slot in self.slots:
            if slot.proc is None or slot.proc.poll() is None:
                continue
            if not slot.ready:
                slot.start_failures += 1
            slot.ready = False
            jobs = slot.clear_lanes()
            lost += jobs
            slot.last_end = how_it_ended(slot.proc.returncode)
            log.warning("worker %d (pid %s) %s; restarting it and re-sending %d mini-job(s)",
                        slot.index, slot.proc.pid, slot.last_end, len(jobs))
            if slot.start_failures >= MAX_ATTEMPTS:
                log.error("worker %d failed to start %d times (%s); leaving it stopped, serving with %d "
                          "worker(s)", slot.index, slot.start_failures, slot.last_error,
                          sum(1 for s in self.slots if s.proc is not None and s is not slot))
                slot.proc = None
                continue
            slot.generation += 1
            slot.restarts += 1
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.worker_restarts.inc()
            self.spawn(slot)
        return lost

    def kill_stalled(self, stall_s: float) -> None:
        """Kill every worker that has held a mini-job for more than ``stall_s`` seconds: a stopped process or a
        runtime that never returns answered nothing while /health said ok. ``reap_dead`` then restarts it and
        its work is re-sent (a piece that stalls again counts towards the request's attempts)."""
        now = time.monotonic()
        for slot in self.slots:
            held = [now - job.dispatched for job in slot.in_flight()]
            if slot.proc is None or slot.proc.poll() is not None or not held or max(held) <= stall_s:
                continue
            log.error("worker %d (pid %s) has held a mini-job for %.0f s, more than --worker-stall-timeout %g s: "
                      "killing it", slot.index, slot.proc.pid, max(held), stall_s)
            slot.proc.kill()
            slot.proc.wait(10)

    def any_alive(self, model: str | None = None) -> bool:
        return any(s.proc is not None for s in self.slots if model in (None, s.model))

    def live(self, model: str | None = None) -> list[WorkerSlot]:
        return [s for s in self.slots if s.ready and s.proc is not None and model in (None, s.model)]

    def handle(self, frames: list[bytes]) -> MiniJob | None:
        """A worker's READY / FAIL / DONE; returns the finished mini-job for DONE."""
        identity, tag = frames[0], frames[1]
        slot = next((s for s in self.slots if s.identity == identity), None)
        if slot is None:
            log.warning("message %r from unknown or replaced worker %r ignored", tag[:10], identity)
            return None
        if tag == READY:
            slot.ready = True
            slot.info = json.loads(frames[2])
            slot.start_failures = 0
            slot.last_error = ""
            log.info("worker %d ready (pid %s, %s threads, %s)", slot.index, slot.info.get("pid"),
                     slot.info.get("threads"), slot.info.get("provider"))
        elif tag == FAIL:
            slot.last_error = frames[2].decode(errors="replace")
            log.log(logging.ERROR if self.started else logging.DEBUG, "worker %d could not load the artifact: %s",
                    slot.index, slot.last_error)
        elif tag == DONE:
            job_id = int(frames[2])
            for lane, job in slot.lanes.items():
                if job is not None and job.job_id == job_id:
                    slot.lanes[lane] = None
                    slot.jobs_done += 1
                    slot.texts_done += job.size
                    return job
        return None

    def send(self, slot: WorkerSlot, lane: bytes, job: MiniJob) -> bool:
        try:
            # the worker runs it on the lane it occupies here (a priority job may borrow an idle bulk lane)
            self.router.send_multipart([slot.identity, *job.frames(lane)])
        except self.zmq.ZMQError:  # ROUTER_MANDATORY: the worker's connection is gone (it died)
            slot.ready = False
            return False
        slot.lanes[lane] = job
        job.dispatched = time.monotonic()
        return True

    def stop(self, timeout_s: float) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                try:
                    self.router.send_multipart([slot.identity, STOP])
                except self.zmq.ZMQError:
                    slot.proc.kill()  # unreachable; it ignores SIGTERM (see worker.main)
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in time; killing it", slot.index)
                slot.proc.kill()
                slot.proc.wait(10)

    def kill_all(self) -> None:
        for slot in self.slots:  # workers that never got a STOP (start-up failed) are killed here
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait(10)


@dataclass
class ModelQueues:
    """One model's two fair queues."""

    priority: FairQueue = field(default_factory=FairQueue)
    bulk: FairQueue = field(default_factory=FairQueue)

    def __len__(self) -> int:
        return len(self.priority) + len(self.bulk)

    def of(self, lane: bytes) -> FairQueue:
        return self.priority if lane == LANE_PRIORITY else self.bulk


class Scheduler:
    """Fair queues of pieces (two per model) and their dispatch, packed by tokens, to free lanes of the model's
    workers."""

    def __init__(self, cfg: dict[str, Any], pool: WorkerPool, fail_request: Callable, metrics=None):
        self.pool = pool
        self.queues = {name: ModelQueues() for name in pool.worker_cfgs}
        self.default_model = next(iter(self.queues))
        self.job_ids = itertools.count(1)
        self.fail_request = fail_request
        self.failed_requests = RecentKeys(FAILED_MEMORY)
        self.metrics = metrics
        self.max_tokens = cfg["max_batch_tokens"]
        self.max_texts = cfg["max_batch_size"]
        self.priority_texts = cfg["priority_batch_size"]
        self.priority_tokens = cfg["priority_tokens"]
        self.counters = {"mini_jobs": 0, "mini_jobs_done": 0, "mini_jobs_resent": 0, "pieces": 0}

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def queued_requests(self, model: str | None = None) -> int:
        """Requests waiting in ``model``'s queues (every model's when None): what admission bounds."""
        queues = self.queues.values() if model is None else [self.queues[model]]
        return sum(q.priority.requests + q.bulk.requests for q in queues)

    def lane_totals(self, what: Callable[[FairQueue], int]) -> dict[str, int]:
        """``what`` summed over the models' priority and bulk queues (status)."""
        return {"priority": sum(what(q.priority) for q in self.queues.values()),
                "bulk": sum(what(q.bulk) for q in self.queues.values())}

    def enqueue(self, identity: bytes, request_id: bytes, items: list, lengths: list[int], kind: bytes,
                model: str | None = None) -> None:
        small = len(items) <= self.priority_texts and sum(lengths) <= self.priority_tokens
        queues = self.queues[model or self.default_model]
        queue = queues.priority if small else queues.bulk
        for piece in cut_request(identity, request_id, items, lengths, self.max_tokens, self.max_texts, kind):
            queue.push(piece)
            self.counters["pieces"] += 1

    def requeue(self, job: MiniJob, why: str) -> None:
        for piece in job.pieces:
            piece.attempts += 1
            if piece.attempts >= MAX_ATTEMPTS:
                self.fail_request(piece.key, f"part {piece.index} of this request failed {piece.attempts} times "
                                             f"({why}); the request may crash the model, check its texts")
                continue
            self.counters["mini_jobs_resent"] += 1
            self.queues[job.model].of(job.lane).push(piece, front=True)

    def done(self, job: MiniJob) -> None:
        self.counters["mini_jobs_done"] += 1
        if self.metrics is not None:
            self.metrics.inference_seconds.labels(job.model).observe(time.monotonic() - job.dispatched)

    def _next_job(self, queue: FairQueue, lane: bytes, max_tokens: int, max_texts: int,
                  model: str) -> MiniJob | None:
        pieces = pack(queue, max_tokens, max_texts, skip=lambda p: p.key in self.failed_requests)
        if not pieces:
            return None
        job = MiniJob(next(self.job_ids), lane, pieces, model)
        if self.metrics is not None:
            now = time.monotonic()
            waited = self.metrics.queue_seconds.labels(model)
            for p in pieces:
                waited.observe(now - p.enqueued)
        return job

    def _sent(self, job: MiniJob) -> None:
        self.counters["mini_jobs"] += 1
        if self.metrics is not None:
            self.metrics.batch_texts.labels(job.model).observe(job.size)
            self.metrics.batch_tokens.labels(job.model).observe(job.tokens)

    def _return(self, queue: FairQueue, job: MiniJob) -> None:
        for piece in reversed(job.pieces):
            queue.push(piece, front=True)

    def dispatch(self) -> None:
        live = self.pool.live()
        for model, queues in self.queues.items():
            if queues:
                self._dispatch(queues, [s for s in live if s.model == model], model)

    def _dispatch(self, queues: ModelQueues, live: list[WorkerSlot], model: str) -> None:
        """One model's queued work to free lanes of its own workers."""
        while queues.priority:
            # least busy worker first; its priority lane if free, else its (idle) bulk lane
            # ``ready`` again: a failed send (the worker's connection is gone) marks it not ready, and without
            # this the loop re-sent to it forever and the server hung
            free = [(len(s.in_flight()), s) for s in live if s.ready and None in s.lanes.values()]
            if not free:
                break
            # a packed priority job stays as small as one priority request may be, so packing never makes a
            # small request wait for much more than itself
            job = self._next_job(queues.priority, LANE_PRIORITY, self.priority_tokens, max(1, self.priority_texts),
                                 model)
            if job is None:
                break
            slot = min(free, key=lambda t: (t[0], t[1].index))[1]
            lane = LANE_PRIORITY if slot.lanes[LANE_PRIORITY] is None else LANE_BULK
            if self.pool.send(slot, lane, job):
                self._sent(job)
            else:
                self._return(queues.priority, job)
        while queues.bulk:
            free = [s for s in live if s.ready and s.lanes[LANE_BULK] is None]
            if not free:
                break
            job = self._next_job(queues.bulk, LANE_BULK, self.max_tokens, self.max_texts, model)
            if job is None:
                break
            slot = min(free, key=lambda s: (s.jobs_done, s.index))
            if self.pool.send(slot, LANE_BULK, job):
                self._sent(job)
            else:
                self._return(queues.bulk, job)

    def remove(self, identity: bytes) -> list[Piece]:
        """Every piece queued for ``identity``, in any model's queues, taken out."""
        return [piece for queues in self.queues.values() for q in (queues.priority, queues.bulk)
                for piece in q.remove(identity)]

    def drain(self, model: str | None = None) -> list[Piece]:
        """Every queued piece (of ``model``, or of all models), taken out of the queues."""
        pieces = []
        for name, queues in self.queues.items():
            if model not in (None, name):
                continue
            for q in (queues.priority, queues.bulk):
                while q:
                    pieces.append(q.pop())
        return pieces


class Ventilator:
    def __init__(self, ctx, cfg: dict[str, Any], frontend, router, sink_push, worker_cfgs: dict[str, dict[str, Any]],
                 http_in=None, tokenizers: dict[str, Any] | None = None, metrics=None,
                 sink_exit: Callable[[], int | None] | None = None):
        """``sink_exit``: the sink process's exit code, None while it runs (every reply goes through it)."""
        import zmq

        self.sink_exit = sink_exit

        self.zmq = zmq
        self.ctx = ctx
        self.cfg = cfg
        self.frontend = frontend  # ZeroMQ clients (None: HTTP only)
        self.http_in = http_in  # the HTTP front end's requests (inproc), or None
        self.sink = sink_push
        # per model: counts the tokens of ZeroMQ requests (HTTP requests come counted)
        self.tokenizers = tokenizers or {}
        self.models = {m["name"]: m for m in cfg.get("models") or [{**cfg, "name": next(iter(worker_cfgs))}]}
        self.metrics = metrics
        self.pool = WorkerPool(zmq, router, worker_cfgs, cfg.get("device_map"), metrics)
        self.scheduler = Scheduler(cfg, self.pool, self.fail_request, metrics)
        self.started = time.time()
        self.accepting = True
        self.limits = RequestLimits(cfg["max_client_batch_size"], cfg["max_text_chars"], cfg["max_request_chars"])
        # ZeroMQ requests against their model's queue bound: a flood on one model is refused without shutting
        # the other models' clients out
        self.admission = {name: Admission(cfg["max_queued_requests"]) for name in self.scheduler.queues}
        self.replies_owed = 0  # one per request taken (encode, status or error): told to the sink at stop
        self.request_seq = 0  # numbers every ZeroMQ request taken (protocol.SEQ_SEPARATOR)
        self.counters = {"requests": 0, "http_requests": 0, "http_cancelled": 0, "texts": 0, "tokens": 0,
                         "status_requests": 0, "rejected": 0, "dropped_no_address": 0}
        self.failure: str | None = None  # why the server cannot go on (every worker stopped), once it is so
        self.gave_up = False  # stopping, and --grace ran out (or a second signal came): unfinished work was failed

    @property
    def workers(self) -> list[WorkerSlot]:
        return self.pool.slots

    def start_workers(self, timeout_s: float, progress=None) -> None:
        self.pool.start(timeout_s, progress)

    def fail_request(self, key: tuple[bytes, bytes], message: str) -> None:
        if key in self.scheduler.failed_requests:
            return
        self.scheduler.failed_requests.add(key)
        self.sink.send_multipart([ERROR, key[0], key[1], message_bytes(message)])

    # -- requests -----------------------------------------------------------------------------------------
    def handle_request(self, frames: list[bytes]) -> None:
        """A ZeroMQ client's message: an encode request, a status request, or something to reject."""
        try:
            req = parse_request(frames, self.cfg["max_request_bytes"], self.limits)
        except ProtocolError as exc:
            self._reject(exc)
            return
        except Exception:  # a bug: no message may end the server (the parser raises ProtocolError only)
            log.exception("could not read a client message; dropped")
            self.counters["dropped_no_address"] += 1
            return
        self.replies_owed += 1
        self.request_seq += 1
        req.request_id += SEQ_SEPARATOR + num(self.request_seq)  # the sink's key; replies carry the client's id
        if req.command is not None:
            self.counters["status_requests"] += 1
            self.sink.send_multipart([CONFIG, req.identity, req.request_id, json.dumps(self.status()).encode()])
            return
        model = req.model or self.scheduler.default_model
        admission = self.admission.get(model)  # an unknown model is refused by enqueue, naming the models
        busy = admission.check(self.scheduler.queued_requests(model)) if admission is not None else None
        if busy is not None:  # the queue is full: refused now (not remembered as failed: nothing of it is queued)
            self.sink.send_multipart([ERROR, req.identity, req.request_id, message_bytes(busy)])
            return
        try:
            self.enqueue(req)
        except (UserError, RequestError) as exc:  # bad text, too many tokens: this request's error reply
            self.counters["rejected"] += 1
            log.warning("rejected a request from %r: %s", req.identity[:40], exc)
            self.fail_request(req.key, str(exc))
        except Exception as exc:  # a bug: the client still gets its one reply, the server lives on
            log.exception("request %r of %r failed at intake", req.request_id, req.identity[:40])
            self.fail_request(req.key, f"the server could not take this request ({type(exc).__name__}); "
                                       "see the server log")

    def _reject(self, exc: ProtocolError) -> None:
        if exc.identity is None:
            self.counters["dropped_no_address"] += 1
            log.warning("%s", exc)
            return
        self.counters["rejected"] += 1
        self.replies_owed += 1
        log.warning("rejected a request from %r: %s", exc.identity[:40], exc)
        self.sink.send_multipart([ERROR, exc.identity, exc.request_id, message_bytes(str(exc))])

    def token_lengths(self, texts: list, pairs: list | None = None, model: str | None = None) -> list[int]:
        """Tokens per text (at most max_seq_len: the model's view); the texts are checked first (valid Unicode,
        UserError naming the text), and the request's total against --max-request-tokens (RequestError)."""
        check_texts(texts, pairs)
        tokenizer = self.tokenizers.get(model or self.scheduler.default_model)
        if tokenizer is None:
            return [1] * len(texts)
        seqs = texts if pairs is None else list(zip(texts, pairs))
        lengths = [len(e.ids) for e in tokenizer.encode_batch(seqs)]
        limit = self.cfg["max_request_tokens"]
        if sum(lengths) > limit:
            raise RequestError(f"request holds {sum(lengths)} tokens, more than this server's limit of {limit} "
                               "(--max-request-tokens); split it into smaller requests")
        return lengths

    def model_of(self, name: str | None) -> str:
        """The model a ZeroMQ request names (None: the first model); RequestError naming the served ones."""
        if name is None:
            return self.scheduler.default_model
        if name not in self.models:
            raise RequestError(f"unknown model {name!r}; this server serves {', '.join(map(repr, self.models))}")
        return name

    def enqueue(self, req: Request) -> None:
        from bertopt.protocol import is_predict_request

        model = self.model_of(req.model)
        if is_predict_request(req.texts):  # Client.predict: the task's results
            texts = [i["text"] for i in req.texts]
            pairs = [i["pair"] for i in req.texts] if "pair" in req.texts[0] else None
            self._take(req.identity, req.request_id, req.texts, self.token_lengths(texts, pairs, model),
                       KIND_PREDICT, model)
            return
        task = self.models[model].get("task", "embedding")
        if task != "embedding":  # a plain (embedding) request on a task model: say what to use instead
            which = "this server serves" if len(self.models) == 1 else f"model {model!r} is"
            embedders = [n for n, m in self.models.items() if m.get("task") == "embedding"]
            other = f" (embedding models here: {', '.join(embedders)})" if len(self.models) > 1 and embedders else ""
            self.fail_request(req.key, f"{which} a {task} model, which has no sentence embeddings; ask "
                                       "for its results with bertopt's Client.predict (or 'bertopt client predict')"
                                       f"; bert-serving-client gets embeddings from embedding models only{other}")
            return
        self._take(req.identity, req.request_id, req.texts, self.token_lengths(req.texts, None, model), KIND_TEXT,
                   model)

    def _take(self, identity: bytes, request_id: bytes, items: list, lengths: list[int], kind: bytes,
              model: str | None = None) -> None:
        self.counters["requests"] += 1
        self.counters["texts"] += len(items)
        self.counters["tokens"] += sum(lengths)
        self.scheduler.enqueue(identity, request_id, items, lengths, kind, model)

    def handle_http(self, frames: list[bytes]) -> None:
        """The HTTP front end's request: already validated and counted there (a trusted in-process socket). Each
        gets an identity of its own, so the fair queue takes turns between HTTP requests as between ZeroMQ
        clients (one identity for all of HTTP put every HTTP request behind the biggest one). A cancel (the
        client timed out or hung up) takes the request's queued pieces out and answers it with an error, so
        the fleet does not go on working, and queueing, for clients that are gone."""
        request_id, kind, body = frames
        identity = http_identity(request_id)
        if kind == KIND_CANCEL:
            dropped = self.scheduler.remove(identity)
            if dropped:
                self.counters["http_cancelled"] += 1
                self.fail_request((identity, request_id), "cancelled: the HTTP client stopped waiting")
            return
        self.replies_owed += 1
        self.counters["http_requests"] += 1
        payload = json.loads(body)
        model = payload.get("model") or self.scheduler.default_model
        if kind not in KINDS or model not in self.models:
            self.sink.send_multipart([ERROR, identity, request_id, b"internal: unknown request kind or model"])
            return
        self._take(identity, request_id, payload["items"], payload["lengths"], kind, model)

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        from bertopt.version import __version__

        c = self.cfg
        s = self.scheduler
        return {
            "server_version": c["wire_version"],
            "bertopt_version": __version__,
            **{k: c.get(k) for k in ("artifact", "digest", "precision", "task", "embedding_dim", "max_seq_len",
                                     "max_batch_size", "max_batch_tokens", "priority_batch_size",
                                     "priority_tokens", "max_request_bytes", "max_client_batch_size",
                                     "max_text_chars", "max_request_chars", "max_request_tokens", "num_worker",
                                     "threads_per_worker",
                                     "device_map", "bind", "port", "port_out", "http_port",
                                     "max_queued_requests", "warmup")},
            "curve": bool(c.get("curve_keys")),
            "show_tokens_to_client": False,
            "accepting": self.accepting,
            "uptime_s": round(time.time() - self.started, 3),
            "queue_length": s.lane_totals(len),
            "queued_requests": s.queued_requests(),
            "busy_refused": sum(a.refused for a in self.admission.values()),
            "queue_tokens": s.lane_totals(lambda q: q.tokens),
            "clients_queued": sum(s.lane_totals(FairQueue.clients).values()),
            "models": [self._model_status(name, m) for name, m in self.models.items()],
            **self.counters,
            **s.counters,
            "worker_restarts": self.pool.restarts,
            "workers_ready": len(self.pool.live()),  # ready = loaded and warmed up (--warmup)
            "workers": [slot.describe() for slot in self.workers],
        }

    def _model_status(self, name: str, m: dict[str, Any]) -> dict[str, Any]:
        queues = self.scheduler.queues[name]
        return {"name": name, **{k: m.get(k) for k in ("artifact", "digest", "precision", "task", "embedding_dim",
                                                        "max_seq_len", "num_worker", "threads_per_worker")},
                "queue_length": {"priority": len(queues.priority), "bulk": len(queues.bulk)},
                "queued_requests": self.scheduler.queued_requests(name),
                "busy_refused": self.admission[name].refused,
                "workers_ready": len(self.pool.live(name))}

    # -- main loop ----------------------------------------------------------------------------------------
    def idle(self) -> bool:
        return not self.scheduler and not any(s.in_flight() for s in self.workers)

    def run(self, should_stop: Callable[[], bool], http_stopped: Callable[[], bool] = lambda: True,
            grace_s: float = float("inf"), stop_now: Callable[[], bool] = lambda: False) -> None:
        """Serve until ``should_stop()``; then stop taking ZeroMQ requests, take the HTTP front end's until it
        has stopped (it answers what it admitted), and finish everything taken, for at most ``grace_s`` seconds
        or until ``stop_now()`` (a second signal): then every request not finished is answered with an error."""
        zmq = self.zmq
        poller = zmq.Poller()
        for sock in (self.frontend, self.pool.router, self.http_in):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        last_check = 0.0
        deadline = float("inf")
        while True:
            if self.accepting and should_stop():
                self._stop_accepting(poller)
                deadline = time.monotonic() + grace_s
            if not self.accepting and http_stopped() and self._http_queue_empty() and self.idle():
                return
            if not self.accepting and (time.monotonic() >= deadline or stop_now()):
                self._give_up("a second signal came" if stop_now() else f"--grace {grace_s:g} s ran out")
                return
            events = dict(poller.poll(100))
            self._drain(events, self.pool.router, 10_000, self._worker_message)
            if self.http_in is not None:
                self._drain(events, self.http_in, 1000, self.handle_http)
            if self.accepting and self.frontend is not None:
                self._drain(events, self.frontend, 1000, self.handle_request)
            now = time.monotonic()
            if now - last_check > 0.1:
                last_check = now
                if not self._supervise():
                    return
            self.scheduler.dispatch()
            if self.metrics is not None:
                for name, queues in self.scheduler.queues.items():
                    self.metrics.queue_depth.labels(name).set(len(queues))

    def _drain(self, events, sock, limit: int, handle) -> None:
        if sock not in events:
            return
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(self.zmq.NOBLOCK)
            except self.zmq.Again:
                break
            handle(frames)

    def _http_queue_empty(self) -> bool:
        return self.http_in is None or not self.http_in.poll(0)

    def _worker_message(self, frames: list[bytes]) -> None:
        job = self.pool.handle(frames)
        if job is not None:
            self.scheduler.done(job)

    def _stop_accepting(self, poller) -> None:
        self.accepting = False
        if self.frontend is not None:
            poller.unregister(self.frontend)
            self.frontend.close(0)  # new requests now go nowhere; clients time out
        log.info("stopping: no new requests; finishing %d queued and %d in-flight mini-job(s)",
                 len(self.scheduler), sum(len(s.in_flight()) for s in self.workers))

    def _give_up(self, why: str) -> None:
        """Stopping, out of time: every request still queued or running is answered with an error (so the sink
        owes no reply and the server can exit now) instead of being finished."""
        self.gave_up = True
        while self.http_in is not None and self.http_in.poll(0):  # HTTP requests forwarded but not yet taken
            self.handle_http(self.http_in.recv_multipart())
        keys = {piece.key for piece in self.scheduler.drain()}
        keys |= {piece.key for slot in self.workers for job in slot.in_flight() for piece in job.pieces}
        log.warning("stopping now (%s): %d unfinished request(s) answered with an error", why, len(keys))
        for key in sorted(keys):
            self.fail_request(key, f"the server is stopping ({why}) and did not finish this request; send it "
                                   "again to a running server")

    def _supervise(self) -> bool:
        """Restart dead workers and re-send their work; False when no worker can run at all, or the sink stopped
        (nothing could be answered: the server stops and says why, instead of taking requests it cannot answer
        while /health says ok)."""
        ended = self.sink_exit() if self.sink_exit is not None else None
        if ended is not None:
            self.failure = f"the sink process (it sends every reply) {how_it_ended(ended)}"
            return False
        self.pool.kill_stalled(self.cfg.get("worker_stall_timeout_s", float("inf")))
        for job in self.pool.reap_dead():
            self.scheduler.requeue(job, "a worker died or hung")
        if not self.pool.any_alive():
            reasons = sorted({s.last_error for s in self.workers if s.last_error}) or \
                sorted({f"a worker {s.last_end}" for s in self.workers if s.last_end})
            self.failure = ("every worker stopped: " + ("; ".join(reasons) if reasons else
                                                          "they failed to start; see the log above"))
            for piece in self.scheduler.drain():
                self.fail_request(piece.key, f"no worker can run: {self.failure}")
            return False
        for model in self.scheduler.queues:  # a fleet of several models serves on without one whose workers stopped
            if not self.pool.any_alive(model):
                for piece in self.scheduler.drain(model):
                    self.fail_request(piece.key, f"every worker of model {model!r} stopped (they failed to start; "
                                                 "see the server log); its requests cannot be answered")
        return True

    def stop_workers(self, timeout_s: float) -> None:
        self.pool.stop(timeout_s)

    def stop_sink(self) -> None:
        self.sink.send_multipart([SINK_STOP, num(self.replies_owed)])
