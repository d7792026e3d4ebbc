"""A worker process: one Predictor (bertopt's runtime, so served = validated), mini-jobs in, embeddings out.

Started by the server as ``python -I -m bertopt.serve.worker`` (its configuration a JSON line on stdin).
A mini-job packs pieces of one or
more requests (texts, text pairs or token-id lists); the worker runs them as one batch and sends each piece's
rows to the sink separately, so packing is invisible to the sink and the clients. It connects a DEALER to the
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

import numpy as np

from bertopt.errors import ModelRunError, UserError
from bertopt.protocol import DONE, ERROR, FAIL, JOB, LANE_PRIORITY, READY, RESULT, STOP, message_bytes, num
from bertopt.serve.batching import KIND_PREDICT
from bertopt.serve.task_replies import TASK_RESULT, TaskRequestError, predict_payload

log = logging.getLogger("bertopt.serve.worker")


def _parent_alive(ppid: int) -> bool:
    return os.getppid() == ppid


def parse_job(frames: list[bytes]) -> tuple[bytes, bytes, list[tuple[bytes, bytes, list[int]]], list]:
    """(job id, kind, pieces as (identity, request id, [index, n_pieces, n_texts, offset, count]), items)."""
    job_id, kind, n = frames[1], frames[3], int(frames[4])
    pieces = [(frames[5 + 3 * k], frames[6 + 3 * k], [int(v) for v in frames[7 + 3 * k].split()])
              for k in range(n)]
    return job_id, kind, pieces, json.loads(frames[5 + 3 * n])


def run_items(predictor, output: str, kind: bytes, items: list):
    """The output rows for a mini-job's items: texts, [first, second] pairs, or token-id lists."""
    import numpy as np

    from bertopt.serve.batching import KIND_CHUNK, KIND_IDS, KIND_PAIR

    if kind == KIND_CHUNK:
        out = predictor.run(items, outputs=[output], long_inputs="chunk")[output]
    elif kind == KIND_PAIR:
        out = predictor.run([a for a, _ in items], pairs=[b for _, b in items], outputs=[output])[output]
    elif kind == KIND_IDS:
        out = run_token_ids(predictor, output, items)
    else:
        out = predictor.run(items, outputs=[output])[output]
    if isinstance(out, list):  # per-token output (token classification): one padded, flattened row per text
        out = pad_token_rows(out, predictor.max_seq_len)
    return np.ascontiguousarray(out, dtype=np.float32)


def pad_token_rows(rows: list, width: int):
    """Per-text ``(tokens, labels)`` arrays as ``(texts, width * labels)`` rows, zero-padded: fixed-width rows
    travel through the sink like pooled ones; the HTTP front end cuts each back to its text's tokens."""
    labels = rows[0].shape[-1]
    out = np.zeros((len(rows), width, labels), dtype=np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out.reshape(len(rows), width * labels)


class _Ids:
    """What ``Predictor.feeds_for`` reads from a tokenizer encoding."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.type_ids = [0] * len(ids)


def run_token_ids(predictor, output: str, items: list[list[int]]):
    """Token-id inputs (already tokenized, special tokens included, within max_seq_len): the same batches and
    feeds the Predictor builds for texts."""
    import numpy as np

    encodings = [_Ids(ids) for ids in items]
    rows: list = [None] * len(items)
    for idx in predictor.plan_batches(encodings, predictor.batch_size):
        feeds, _ = predictor.feeds_for([encodings[i] for i in idx])
        out = predictor.run_batch(feeds, [output])[output]
        for j, i in enumerate(idx):
            rows[i] = out[j]
    return np.stack(rows)


class LaneRunner:
    """One lane thread: runs mini-jobs on the shared Predictor, pushes each piece's rows to the sink, then
    reports DONE (result first, so a death in between re-sends rather than loses)."""

    def __init__(self, ctx, cfg: dict, predictor, nice: int = 0):
        self.ctx, self.cfg, self.predictor, self.nice = ctx, cfg, predictor, nice
        self.queue: queue.Queue = queue.Queue()

    def loop(self) -> None:
        import zmq

        if self.nice:
            self._lower_priority()

        sink = self.ctx.socket(zmq.PUSH)
        sink.setsockopt(zmq.LINGER, 5000)
        sink.connect(self.cfg["sink"])
        done = self.ctx.socket(zmq.PUSH)
        done.setsockopt(zmq.LINGER, 1000)
        done.connect(f"inproc://done-{self.cfg['index']}")
        try:
            while (frames := self.queue.get()) is not None:
                job_id, kind, pieces, items = parse_job(frames)
                self.run_job(sink, job_id, kind, pieces, items)
                done.send_multipart([DONE, job_id])
        finally:
            sink.close()
            done.close()

    def run_predict(self, sink, pieces, items) -> None:
        """Client.predict pieces: ``Predictor.predict`` per piece (each request has its own pair / aggregation),
        JSON results to the sink."""
        start = 0
        for identity, request_id, (index, n_pieces, n_texts, offset, count) in pieces:
            chunk, start = items[start:start + count], start + count
            try:
                payload = predict_payload(self.predictor, chunk)
            except (TaskRequestError, UserError) as exc:  # the request asks for what the model cannot do
                if isinstance(exc, ModelRunError):  # or the model failed in its runtime: the operator's to see
                    log.error("worker %d: predict failed: %s", self.cfg["index"], exc)
                sink.send_multipart([ERROR, identity, request_id, message_bytes(str(exc))])
                continue
            except Exception as exc:  # the request gets an error reply instead of silence
                log.error("worker %d: predict failed: %s", self.cfg["index"], traceback.format_exc())
                failed = message_bytes(f"worker failed on this request: {exc}")
                sink.send_multipart([ERROR, identity, request_id, failed])
                continue
            sink.send_multipart([TASK_RESULT, identity, request_id, num(index), num(n_pieces), num(n_texts),
                                 num(offset), payload])

    def _lower_priority(self) -> None:
        """Bulk work yields the cores to priority work: the lane thread (which runs the model with one thread
        per worker) gets a higher nice value. Linux schedules threads separately, so this is per thread."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except (AttributeError, OSError) as exc:  # not Linux, or not permitted: bulk keeps normal priority
            log.warning("worker %d: could not lower the bulk lane's priority (%s)", self.cfg["index"], exc)

    def run_job(self, sink, job_id: bytes, kind: bytes, pieces, items) -> None:
        if kind == KIND_PREDICT:
            self.run_predict(sink, pieces, items)
            return
        try:
            array = run_items(self.predictor, self.cfg["output"], kind, items)
        except Exception as exc:  # each request gets an error reply instead of silence
            log.error("worker %d: mini-job %s failed: %s", self.cfg["index"], job_id.decode(),
                      traceback.format_exc())
            for identity, request_id, _ in pieces:
                failed = message_bytes(f"worker failed on this request: {exc}")
                sink.send_multipart([ERROR, identity, request_id, failed])
            return
        start = 0
        for identity, request_id, (index, n_pieces, n_texts, offset, count) in pieces:
            rows = np.ascontiguousarray(array[start:start + count])
            start += count
            sink.send_multipart([RESULT, identity, request_id, num(index), num(n_pieces), num(n_texts),
                                 num(offset), num(array.shape[1]), memoryview(rows).cast("B")])


def _load_predictor(cfg: dict, ctrl):
    """The Predictor, on the artifact verified again here (every start, restarts included: the folder may have
    changed since the server checked it) and refused unless it is the artifact the server announces (its digest,
    which ``/info`` and status report)."""
    try:
        from bertopt.artifact import Artifact
        from bertopt.runtime import Predictor

        artifact = Artifact.load(cfg["artifact"])
        if cfg.get("digest") and artifact.digest != cfg["digest"]:
            raise UserError(f"the artifact at {cfg['artifact']} changed since the server started (digest "
                            f"{artifact.digest[:12]}, the server serves {cfg['digest'][:12]}); this worker refuses "
                            "it: restart the server to serve the new artifact")
        return Predictor(artifact, provider=cfg["provider"], threads=cfg["threads"],
                         max_seq_len=cfg.get("max_seq_len"))
    except Exception as exc:  # any load failure is reported to the server, which shows it to the user
        ctrl.send_multipart([FAIL, str(exc).encode()])
        return None


def _warm_up(cfg: dict, ctrl, predictor, priority_predictor) -> dict | None | bool:
    """One batch per length bucket on each session, before READY (``serve/warmup.py``); None when turned off,
    False when it failed (reported to the server like a load failure: a model that cannot run its own window)."""
    if not cfg.get("warmup", True):
        return None
    from bertopt.serve.warmup import warm_up

    budget = int(cfg["max_batch_tokens"])  # a warm-up batch is no larger than a mini-job
    try:
        warm = warm_up(predictor, cfg["output"], budget)
        if priority_predictor is not predictor:  # a second session (OpenVINO): warm it too
            warm["seconds"] += warm_up(priority_predictor, cfg["output"], budget)["seconds"]
    except Exception as exc:
        # the server shows the one line below (as the start's error, or in its log on a restart); the trace is
        # for --log-level debug
        log.debug("worker %d: warm-up failed: %s", cfg["index"], traceback.format_exc())
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        message = f"its warm-up batch failed ({reason}); serve with --no-warmup or a smaller --max-seq-len"
        ctrl.send_multipart([FAIL, message_bytes(message)])
        return False
    log.info("worker %d warmed up in %.3f s (%d batches, lengths %s tokens)", cfg["index"], warm["seconds"],
             warm["batches"], ",".join(str(n) for n in warm["lengths"]))
    return warm


def _forward_done(ctrl, done_pull) -> None:
    import zmq

    while True:
        try:
            ctrl.send_multipart(done_pull.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break


def _control_loop(ctrl, done_pull, lanes: dict[str, LaneRunner], index: int) -> bool:
    """Jobs in, DONE out, until STOP (True) or the server process is gone (False)."""
    import zmq

    ppid = os.getppid()
    poller = zmq.Poller()
    poller.register(ctrl, zmq.POLLIN)
    poller.register(done_pull, zmq.POLLIN)
    while True:
        events = dict(poller.poll(500))
        if done_pull in events:
            _forward_done(ctrl, done_pull)
        if ctrl in events:
            while True:
                try:
                    frames = ctrl.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[0] == JOB:
                    lanes["priority" if frames[2] == LANE_PRIORITY else "bulk"].queue.put(frames)
                elif frames[0] == STOP:
                    return True
        if not _parent_alive(ppid):  # the server died without stopping us: do not linger as an orphan
            log.error("worker %d: server process is gone; exiting", index)
            return False


def run_worker(cfg: dict) -> int:
    import zmq

    index = cfg["index"]
    if cfg.get("device") is not None:  # pin to one GPU; must happen before ONNX Runtime loads CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg["device"])
    ctx = zmq.Context()
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.IDENTITY, cfg["identity"].encode())
    ctrl.setsockopt(zmq.LINGER, 2000)
    ctrl.connect(cfg["ventilator"])
    predictor = _load_predictor(cfg, ctrl)
    if predictor is None:
        ctrl.close()
        ctx.term()
        return 1
    cfg.setdefault("output", predictor.primary_output)

    # the priority lane must not wait behind a bulk mini-job: where the backend runs one inference at a time
    # (OpenVINO's single stream), it gets a session of its own (the model's weights twice in memory)
    priority_predictor = predictor
    if not predictor.session.concurrent_runs:
        priority_predictor = _load_predictor(cfg, ctrl)
        if priority_predictor is None:
            ctrl.close()
            ctx.term()
            return 1
    warm = _warm_up(cfg, ctrl, predictor, priority_predictor)
    if warm is False:
        ctrl.close()
        ctx.term()
        return 1
    info = {"pid": os.getpid(), **predictor.describe(), "warmup_s": warm["seconds"] if warm else None}
    ctrl.send_multipart([READY, json.dumps(info, default=str).encode()])
    done_pull = ctx.socket(zmq.PULL)
    done_pull.bind(f"inproc://done-{index}")
    lanes = {"bulk": LaneRunner(ctx, cfg, predictor, nice=int(cfg.get("bulk_nice") or 0)),
             "priority": LaneRunner(ctx, cfg, priority_predictor)}
    threads = [threading.Thread(target=lane.loop, name=f"lane-{name}", daemon=True) for name, lane in lanes.items()]
    for t in threads:
        t.start()
    if not _control_loop(ctrl, done_pull, lanes, index):
        return 1
    # STOP: finish what we hold, report it, leave
    for lane in lanes.values():
        lane.queue.put(None)
    for t in threads:
        t.join()
    _forward_done(ctrl, done_pull)
    done_pull.close()
    ctrl.close()
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> None:
    from bertopt.serve.processes import read_config

    cfg = read_config(sys.argv[1:] if argv is None else argv)
    # Ctrl-C, and SIGTERM sent to the whole process group (systemd, `timeout`, some container inits), reach the
    # workers too; the server decides when they stop (after draining), and they exit if the server dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=cfg.get("log_level", "INFO"), stream=sys.stderr,
                        format=f"bertopt serve [worker {cfg['index']}] %(levelname)s %(message)s")
    sys.exit(run_worker(cfg))


if __name__ == "__main__":
    main()
