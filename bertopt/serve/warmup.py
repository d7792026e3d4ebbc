"""Worker warm-up: before a worker reports ready, it runs one batch per sequence-length bucket, so the first
user requests do not pay the runtime's first-run costs (memory arena growth, kernel and thread-pool set-up, a
GPU's per-shape work) and ``/health`` turns 200 only on a warm fleet.

Buckets: the powers of two from 16 tokens below the served ``max_seq_len``, and ``max_seq_len`` itself — the
Predictor pads each batch to its longest text, so these are the shapes a request meets (rounded up). Each batch
holds about ``WARMUP_TOKENS`` tokens (at most the Predictor's batch size in rows, at least one): enough to set up
every shape's kernels and buffers, little enough that a restarted worker is back within a second or two on a
small CPU model (all-MiniLM-L6-v2, 2 cores: about 2 s).
"""

from __future__ import annotations

import time

FIRST_BUCKET = 16
WARMUP_TOKENS = 1024  # per bucket


def warmup_lengths(max_seq_len: int) -> list[int]:
    lengths = []
    length = FIRST_BUCKET
    while length < max_seq_len:
        lengths.append(length)
        length *= 2
    return [*lengths, max_seq_len]


def warmup_rows(batch_size: int, length: int, max_batch_tokens: int) -> int:
    return max(1, min(batch_size, min(WARMUP_TOKENS, max_batch_tokens) // length))


class _Ids:
    """What ``Predictor.feeds_for`` reads from a tokenizer encoding."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.type_ids = [0] * len(ids)


def warm_up(predictor, output: str, max_batch_tokens: int) -> dict:
    """Run one batch per length bucket on ``predictor`` (the ``output`` the server asks for); returns
    ``{"seconds", "batches", "lengths"}``. Raises whatever the runtime raises (the worker reports it)."""
    start = time.perf_counter()
    # a text longer than the window, truncated by the tokenizer: real special tokens at both ends
    full = predictor.tokenizer.encode(" ".join(["warm"] * predictor.max_seq_len)).ids
    lengths = warmup_lengths(predictor.max_seq_len)
    for length in lengths:
        ids = full[: length - 1] + full[-1:] if len(full) > length else full
        rows = warmup_rows(predictor.batch_size, length, max_batch_tokens)
        feeds, _ = predictor.feeds_for([_Ids(ids)] * rows)
        predictor.run_batch(feeds, [output])
    return {"seconds": round(time.perf_counter() - start, 3), "batches": len(lengths), "lengths": lengths}
