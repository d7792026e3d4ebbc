"""Dispatch to a worker whose connection is already gone (it was killed, and ZeroMQ noticed before the server
reaped the process): the send fails (ROUTER_MANDATORY), the work goes back to its queue and dispatch returns, so
the main loop goes on to reap the dead worker and re-send the work (or fail it with a reply). A real ROUTER socket
with no worker connected stands for the dead worker."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import zmq

from bertopt.protocol import LANE_BULK, LANE_PRIORITY
from bertopt.serve.ventilator import Scheduler, WorkerPool

CFG = {"max_batch_tokens": 1024, "max_batch_size": 64, "priority_batch_size": 4, "priority_tokens": 256}


@pytest.fixture
def pool_with_a_dead_worker():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://dispatch-test")
    pool = WorkerPool(zmq, router, {"m": {"num_worker": 1}}, None)
    slot = pool.slots[0]
    # it said READY, then died (not yet reaped): nothing is connected under its identity any more
    slot.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    slot.proc.wait()
    slot.ready = True
    yield pool, slot
    router.close(0)
    ctx.term()


@pytest.mark.parametrize("texts", [1, 40], ids=["priority", "bulk"])
def test_dispatch_to_a_worker_whose_connection_is_gone_returns_and_keeps_the_work(pool_with_a_dead_worker, texts):
    pool, slot = pool_with_a_dead_worker
    failed = []
    scheduler = Scheduler(CFG, pool, lambda key, message: failed.append((key, message)))
    scheduler.enqueue(b"client", b"1", ["a text"] * texts, [5] * texts, b"T", "m")
    queued = len(scheduler)

    done = threading.Event()

    def dispatch():
        scheduler.dispatch()
        done.set()

    threading.Thread(target=dispatch, daemon=True).start()
    assert done.wait(10), "dispatch kept re-sending to a worker whose connection is gone (the server hangs)"
    assert slot.ready is False  # not offered work again until it is restarted and says READY
    assert slot.lanes == {LANE_BULK: None, LANE_PRIORITY: None}
    assert len(scheduler) == queued and scheduler.counters["mini_jobs"] == 0  # the work waits for a live worker
    assert failed == []


def test_failed_requests_are_remembered_up_to_a_bound():
    """A long-running server fails requests now and then: it remembers them (to drop their queued pieces) without
    growing for ever."""
    from bertopt.serve.recent_keys import RecentKeys

    keys = RecentKeys(limit=3)
    for i in range(5):
        keys.add((b"client", b"%d" % i))
    assert len(keys) == 3
    assert (b"client", b"1") not in keys and (b"client", b"2") in keys and (b"client", b"4") in keys


def test_queued_pieces_of_a_failed_request_are_dropped_not_run(pool_with_a_dead_worker):
    pool, slot = pool_with_a_dead_worker
    scheduler = Scheduler(CFG, pool, lambda key, message: None)
    scheduler.enqueue(b"client", b"1", ["a text"] * 40, [5] * 40, b"T", "m")
    scheduler.enqueue(b"client", b"2", ["a text"] * 40, [5] * 40, b"T", "m")
    scheduler.failed_requests.add((b"client", b"1"))
    job = scheduler._next_job(scheduler.queues["m"].bulk, LANE_BULK, 10_000, 1000, "m")
    assert {p.request_id for p in job.pieces} == {b"2"} and job.size == 40
    assert len(scheduler) == 0


def test_a_load_failure_is_logged_only_once_the_fleet_has_started(pool_with_a_dead_worker, caplog):
    """At start the failure is the user's one 'error:' line (start raises it); a log line too would say it twice.
    A restarted worker's failure has only the log to show it."""
    import logging

    from bertopt.protocol import FAIL

    pool, slot = pool_with_a_dead_worker
    with caplog.at_level(logging.DEBUG, logger="bertopt"):
        pool.handle([slot.identity, FAIL, b"no such file"])
        assert slot.last_error == "no such file"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        pool.started = True
        pool.handle([slot.identity, FAIL, b"no such file"])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "worker 0 could not load the artifact: no such file"]
