"""A worker process: one Predictor (bertopt's runtime, so served = validated), mini-jobs in, embeddings out.

Started by the server as ``python -m bertopt.serve.worker CONFIG_JSON``. It connects a DEALER to the
ventilator (jobs in, READY/DONE out) and a PUSH per lane thread to the sink (results out). Two lane threads
share the Predictor (ONNX Runtime sessions are thread-safe): one runs bulk mini-jobs, the other priority ones,
so a small request never waits for a 256-text mini-job to finish; the OS time-slices the two.

A result is pushed to the sink *before* DONE goes to the ventilator: if the worker dies in between, the
ventilator re-sends the job and the sink drops the duplicate, so nothing is lost and nothing is doubled.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import threading
import traceback

from bertopt.protocol import DONE, ERROR, FAIL, JOB, LANE_PRIORITY, READY, RESULT, STOP, num

log = logging.getLogger("bertopt.serve.worker")


def _parent_alive(ppid: int) -> bool:
    return os.getppid() == ppid


def run_worker(cfg: dict) -> int:
    import numpy as np
    import zmq

    index = cfg["index"]
    if cfg.get("device") is not None:  # pin to one GPU; must happen before ONNX Runtime loads CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg["device"])
    ctx = zmq.Context()
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.IDENTITY, cfg["identity"].encode())
    ctrl.setsockopt(zmq.LINGER, 2000)
    ctrl.connect(cfg["ventilator"])
    try:
        from bertopt.runtime import Predictor

        predictor = Predictor(cfg["artifact"], provider=cfg["provider"], threads=cfg["threads"],
                              max_seq_len=cfg.get("max_seq_len"), verify=False)
    except Exception as exc:  # any load failure is reported to the server, which shows it to the user
        ctrl.send_multipart([FAIL, str(exc).encode()])
        ctrl.close()
        ctx.term()
        return 1
    info = {"pid": os.getpid(), **predictor.describe()}
    ctrl.send_multipart([READY, json.dumps(info, default=str).encode()])

    done_pull = ctx.socket(zmq.PULL)
    done_pull.bind(f"inproc://done-{index}")
    lanes = {"bulk": queue.Queue(), "priority": queue.Queue()}

    def lane_loop(q: "queue.Queue") -> None:
        sink = ctx.socket(zmq.PUSH)
        sink.setsockopt(zmq.LINGER, 5000)
        sink.connect(cfg["sink"])
        done = ctx.socket(zmq.PUSH)
        done.setsockopt(zmq.LINGER, 1000)
        done.connect(f"inproc://done-{index}")
        try:
            while (frames := q.get()) is not None:
                _, job_id, _lane, identity, request_id, job_index, n_jobs, n_texts, offset, payload = frames
                try:
                    texts = json.loads(payload)
                    array = np.ascontiguousarray(predictor.encode(texts), dtype=np.float32)
                    sink.send_multipart([RESULT, identity, request_id, job_index, n_jobs, n_texts, offset,
                                         num(array.shape[1]), memoryview(array).cast("B")])
                except Exception as exc:  # the request gets an error reply instead of silence
                    log.error("worker %d: mini-job %s failed: %s", index, job_id.decode(), traceback.format_exc())
                    sink.send_multipart([ERROR, identity, request_id,
                                         f"worker failed on this request: {exc}".encode()])
                done.send_multipart([DONE, job_id])
        finally:
            sink.close()
            done.close()

    threads = [threading.Thread(target=lane_loop, args=(q,), name=f"lane-{name}", daemon=True)
               for name, q in lanes.items()]
    for t in threads:
        t.start()

    ppid = os.getppid()
    poller = zmq.Poller()
    poller.register(ctrl, zmq.POLLIN)
    poller.register(done_pull, zmq.POLLIN)
    running = True
    while running:
        events = dict(poller.poll(500))
        if done_pull in events:
            while True:
                try:
                    ctrl.send_multipart(done_pull.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if ctrl in events:
            while True:
                try:
                    frames = ctrl.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[0] == JOB:
                    lanes["priority" if frames[2] == LANE_PRIORITY else "bulk"].put(frames)
                elif frames[0] == STOP:
                    running = False
        if not _parent_alive(ppid):  # the server died without stopping us: do not linger as an orphan
            log.error("worker %d: server process is gone; exiting", index)
            return 1
    # STOP: finish what we hold, report it, leave
    for q in lanes.values():
        q.put(None)
    for t in threads:
        t.join()
    while True:
        try:
            ctrl.send_multipart(done_pull.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    done_pull.close()
    ctrl.close()
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(argv[0])
    # Ctrl-C reaches the whole process group; the server decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=cfg.get("log_level", "INFO"), stream=sys.stderr,
                        format=f"bertopt serve [worker {cfg['index']}] %(levelname)s %(message)s")
    sys.exit(run_worker(cfg))


if __name__ == "__main__":
    main()
