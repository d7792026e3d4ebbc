"""Timing: one call (``time_call``, what bench and tune time with), the throughput of a text list
(``measure_throughput``, the comparison ``bertopt run`` prints), and the latency of the artifact and its
reference over a grid of batch sizes x sequence lengths (``measure_grid``, ``summarize``: the gate's latency).

Each grid point feeds exactly ``batch`` inputs of exactly ``seq_len`` real tokens (cut from real text, so no
padding) through ``Predictor.run_batch`` - the same call serving makes. After warm-up, the contenders take turns
call by call (A B A B ...), so a noisy neighbour slows both alike; ratios are what to read, not absolute times.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from bertopt.errors import UserError


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values``; NaN when there are none."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def measure_throughput(predictor, texts, repeats: int = 2, batch_size: int = 32) -> float:
    """Texts per second over the whole list (best of ``repeats``; the first pass also warms up)."""
    predictor.run(texts[:batch_size], batch_size=batch_size)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, time_call(lambda: predictor.run(texts, batch_size=batch_size)))
    return len(texts) / best


MIN_SEQ_LEN = 3  # [CLS] text [SEP]: the fewest tokens a latency grid point can hold


def fixed_length_feeds(predictor, texts: list[str], batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Feeds of ``batch_size`` rows of exactly ``seq_len`` real tokens ([CLS] ... [SEP]) cut from ``texts``."""
    if seq_len < MIN_SEQ_LEN:
        raise UserError(f"latency sequence length {seq_len} is too short; use at least {MIN_SEQ_LEN} ([CLS] text "
                        "[SEP])")
    if seq_len > predictor.max_seq_len:
        raise UserError(f"latency sequence length {seq_len} exceeds the model's maximum of {predictor.max_seq_len} "
                        f"tokens; use --seq-lens with values up to {predictor.max_seq_len}")
    long_text = " ".join(t for t in texts if t.strip()) or "hello world"
    ids = predictor.tokenizer.encode(long_text).ids  # [CLS] ... [SEP], truncated to max_seq_len
    while len(ids) < seq_len:  # short corpora: repeat the word pieces between [CLS] and [SEP]
        ids = ids[:-1] + ids[1:]
    rows = []
    for row in range(batch_size):
        body = ids[1:-1]
        shift = (row * 7) % max(1, len(body) - (seq_len - 2) + 1)  # vary the rows a little
        piece = [ids[0]] + body[shift:shift + seq_len - 2] + [ids[-1]]
        rows.append(SimpleNamespace(ids=piece, type_ids=[0] * len(piece)))
    feeds, _ = predictor.feeds_for(rows)
    return feeds


def _percentiles(times_s: list[float], batch_size: int) -> dict[str, float]:
    arr = np.asarray(times_s) * 1000.0
    return {"p50_ms": float(np.percentile(arr, 50)), "p90_ms": float(np.percentile(arr, 90)),
            "p99_ms": float(np.percentile(arr, 99)), "mean_ms": float(arr.mean()),
            "texts_per_s": float(batch_size * len(arr) / (arr.sum() / 1000.0)), "calls": len(arr)}


def measure_grid(contenders: dict[str, Any], texts: list[str], batch_sizes: list[int], seq_lens: list[int],
                 warmup: int = 2, repeats: int = 10,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One entry per (batch, seq_len): per contender p50/p90/p99/mean ms and texts/s."""
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise UserError(f"--warmup must be 0 or more, got {warmup}")
    points = []
    for b in batch_sizes:
        for s in seq_lens:
            if progress:
                progress(f"latency batch {b} x {s} tokens")
            feeds = {name: fixed_length_feeds(p, texts, b, s) for name, p in contenders.items()}
            for name, p in contenders.items():
                for _ in range(warmup):
                    p.run_batch(feeds[name])
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(repeats):
                for name, p in contenders.items():
                    t0 = time.perf_counter()
                    p.run_batch(feeds[name])
                    times[name].append(time.perf_counter() - t0)
            points.append({"batch_size": b, "seq_len": s,
                           **{name: _percentiles(t, b) for name, t in times.items()}})
    return points


def summarize(points: list[dict[str, Any]], artifact: str = "artifact", reference: str = "reference") -> dict:
    """Gate metrics from the grid. Aggregates are worst-case over the grid (every point must meet an absolute
    bound), except ``speedup`` and ``latency_ratio``, which are geometric means; ``speedup_min`` is the worst
    point. Per point: ``speedup@BxS``, ``latency_p99_ms@BxS``, ... (B = batch size, S = tokens)."""
    metrics: dict[str, float] = {}
    speedups, ratios = [], []
    for pt in points:
        a, r = pt[artifact], pt[reference]
        key = f"@{pt['batch_size']}x{pt['seq_len']}"
        speedup = a["texts_per_s"] / r["texts_per_s"]
        ratio = a["p50_ms"] / r["p50_ms"]
        pt["speedup"], pt["latency_ratio"] = speedup, ratio
        speedups.append(speedup)
        ratios.append(ratio)
        metrics["speedup" + key] = speedup
        metrics["latency_ratio" + key] = ratio
        metrics["throughput" + key] = a["texts_per_s"]
        for q in ("p50", "p90", "p99"):
            metrics[f"latency_{q}_ms" + key] = a[f"{q}_ms"]
    if points:
        metrics["speedup"] = math.exp(float(np.mean(np.log(speedups))))
        metrics["speedup_min"] = min(speedups)
        metrics["latency_ratio"] = math.exp(float(np.mean(np.log(ratios))))
        metrics["throughput"] = min(pt[artifact]["texts_per_s"] for pt in points)
        for q in ("p50", "p90", "p99"):
            metrics[f"latency_{q}_ms"] = max(pt[artifact][f"{q}_ms"] for pt in points)
    return metrics
