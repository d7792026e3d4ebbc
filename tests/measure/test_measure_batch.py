"""bertopt.measure.batch on a session that runs batches side by side (OpenVINO THROUGHPUT, a stream per core): the
batch-invariance compositions run that way, and measure what they measure one at a time."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bertopt.data import corpus
from bertopt.measure.batch import batch_deviation
from bertopt.registry import run_stage
from bertopt.runtime import Predictor


def _in_flight(predictor) -> list[int]:
    """Wraps the predictor's run_batch to record how many batches were running as each one started (each held a
    few ms, so that two started side by side overlap however fast the tiny model is)."""
    counts: list[int] = []
    running = [0]
    lock = threading.Lock()
    run_batch = predictor.run_batch

    def counted(feeds, outputs=None):
        with lock:
            running[0] += 1
            counts.append(running[0])
        try:
            time.sleep(0.005)
            return run_batch(feeds, outputs)
        finally:
            with lock:
                running[0] -= 1

    predictor.run_batch = counted
    return counts


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one OpenVINO stream per thread")
def test_compositions_run_side_by_side_on_a_stream_per_core_and_measure_the_same(tiny_onnx, tmp_path):
    streams = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                               "performance_hint": "THROUGHPUT"}, tmp_path / "streams")
    texts = corpus()[:96]
    parallel = Predictor(streams.path, threads=2)
    assert parallel.session.parallel_runs == 2
    seen = _in_flight(parallel)
    found = batch_deviation(parallel, texts)
    assert max(seen) == 2  # two batches in flight: one per stream

    serial = Predictor(streams.path, threads=2)
    serial.session.parallel_runs = 1  # the same compiled streams, one batch at a time
    seen_serial = _in_flight(serial)
    alone_at_a_time = batch_deviation(serial, texts)
    assert max(seen_serial) == 1 and len(seen_serial) == len(seen)  # the same batches
    # the same figures: each batch is one request on one stream whichever way they are scheduled
    assert found == alone_at_a_time
    assert found["texts"] == 64 and found["batch_dev"] < 1e-6
    assert set(found["outputs"]["sentence_embedding"]["by_batch_size"]) == {
        "1", "7", "32", *(f"{rows}x{tokens}" for rows, tokens in found["full_batches"])}
