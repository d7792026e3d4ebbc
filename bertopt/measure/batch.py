"""Batch invariance: does a text's output depend on what it is batched with?

Every text of a probe set (spread over the data's length distribution) is run alone, unpadded, as the
baseline; then again (a) alone but padded to the probe set's longest text (batch size 1, other padding),
(b) inside mixed-length batches of 7 and 32 whose neighbours are drawn at random from the probe set (other
neighbours, other padding, other batch shapes) and (c) in one full batch of each shape the Predictor runs one in
(its batch size, and the part of a batch split between streams, padded to its window): the shapes an OpenVINO
artifact may run on a copy of its model compiled for them (``static_full_batch``), so those outputs are measured
too (where a batch of (b) already had a full batch's shape, its figure stands for (c): the same shape, run the
same way). The deviation of a row is 1 - cosine to its baseline (per real token for token-level outputs); the largest
over every composition is ``batch_dev``.

ONNX Runtime's dynamic int8 picks one activation scale per batch matrix, so its outputs move with their
neighbours (1e-2 and more on AVX2 CPUs, whose u8s8 kernels saturate; 1e-4 to 1e-3 on a tiny model with
VNNI); float and bf16 runtimes, and int8 with per-token activation scales, stay near
float rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from bertopt.cosine import cosine_rows

BATCH_SIZES = (1, 7, 32)
PROBE_TEXTS = 64


def probe_indices(lengths: Sequence[int], n: int = PROBE_TEXTS) -> list[int]:
    """Up to ``n`` indices spread evenly over the length-sorted data (short and long texts both in)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if len(order) <= n:
        return order
    picks = np.linspace(0, len(order) - 1, n).round().astype(int)
    return [order[i] for i in sorted(set(picks.tolist()))]


def _row_deviation(a: np.ndarray, b: np.ndarray) -> float:
    """Largest 1 - cosine between matching rows of a and b (2-D)."""
    if a.ndim == 1:
        a, b = a[None], b[None]
    return float(np.max(1.0 - cosine_rows(a, b))) if len(a) else 0.0


class _Batch(NamedTuple):
    """One composition ready to run: probe indices, the feeds, each row's length, (rows, padded tokens)."""

    rows: list[int]
    feeds: dict[str, np.ndarray]
    lengths: np.ndarray
    shape: tuple[int, int]


def batch_deviation(predictor, texts: Sequence[str], pairs: Sequence[str] | None = None,
                    outputs: Sequence[str] | None = None, batch_sizes: Sequence[int] = BATCH_SIZES,
                    probes: int = PROBE_TEXTS, seed: int = 0) -> dict[str, Any]:
    """Largest deviation (1 - cosine) of each output between a text alone and the same text in other batches.

    Returns ``{"batch_dev": worst over outputs, "outputs": {name: {"batch_dev", "by_batch_size": {...}}},
    "texts": probes used, "batch_sizes": [...], "full_batches": [[rows, window], ...]}`` (each full batch's
    deviation is ``by_batch_size`` entry ``"<rows>x<window>"``; ``Predictor.full_batches``)."""
    from bertopt.runtime.predictor import side_by_side

    names = list(outputs or predictor.output_names)
    encodings = predictor.tokenize(texts, pairs)
    idx = probe_indices([len(e.ids) for e in encodings], probes)
    probe = [encodings[i] for i in idx]
    n = len(probe)
    if n == 0:
        return {"batch_dev": 0.0, "outputs": {}, "texts": 0, "batch_sizes": list(batch_sizes)}
    longest = max(len(e.ids) for e in probe)
    # the compositions are independent batches: where the session runs several side by side (OpenVINO's
    # THROUGHPUT streams, each with its share of the cores) they run that way, as the Predictor runs a call, so a
    # stream-per-core artifact is not measured one single-threaded batch at a time (values are the same either
    # way: each batch is one request on one stream)
    streams = max(1, int(getattr(getattr(predictor, "session", None), "parallel_runs", 1) or 1))

    def prepare(rows: list[int], pad_to: int | None = None) -> _Batch:
        feeds, lengths = predictor.feeds_for([probe[r] for r in rows], pad_to=pad_to)
        shape = tuple(int(x) for x in np.shape(next(iter(feeds.values())))[:2])
        return _Batch(rows, feeds, lengths, shape)

    def run(batch: _Batch) -> dict[str, list]:
        """Each output's rows of one prepared batch (token-level outputs trimmed to the real tokens)."""
        out = predictor.run_batch(batch.feeds, names)
        return {name: [out[name][j, : batch.lengths[j]] if predictor.is_token_level(name) else out[name][j]
                       for j in range(len(batch.rows))] for name in names}

    alone_runs = side_by_side(run, [prepare([r]) for r in range(n)], streams)
    alone = {name: [one[name][0] for one in alone_runs] for name in names}

    def deviation(batch: _Batch) -> dict[str, float]:
        """Each output's largest deviation over the rows of one prepared batch from the same texts alone."""
        got = run(batch)
        return {name: max(_row_deviation(got[name][j], alone[name][r]) for j, r in enumerate(batch.rows))
                for name in names}

    rng = np.random.default_rng(seed)
    compositions: list[tuple[str, _Batch]] = []  # (key, prepared batch), in the order the random draws are made
    for size in batch_sizes:
        size = int(size)
        if size == 1:
            # alone again, but padded to the longest probe: padding must not reach a real token
            compositions += [(str(size), prepare([r], longest)) for r in range(n)]
        else:
            perm = rng.permutation(n).tolist()
            if n < size:  # too few probes to fill a batch: repeat neighbours so the batch really has `size` rows
                perm = (perm * (size // n + 1))[:size]
            compositions += [(str(size), prepare(perm[s:s + size])) for s in range(0, len(perm), size)]
    full = [(int(rows), int(tokens)) for rows, tokens in predictor.full_batches]
    shapes_run = {batch.shape for _, batch in compositions}
    measured_by_mixed = []
    for rows, tokens in full:
        if (rows, tokens) in shapes_run:
            # a mixed batch above already is a full batch of this shape (its longest probe at the window): the
            # same shape, run the same way, with random neighbours; measured once (a 32 x 256 batch of an f32
            # MiniLM on one AVX2 stream: 3 s of the gate)
            measured_by_mixed.append((rows, tokens))
            continue
        compositions.append((f"{rows}x{tokens}", prepare((rng.permutation(n).tolist() * (rows // n + 1))[:rows],
                                                         tokens)))
    found = side_by_side(deviation, [batch for _, batch in compositions], streams)
    worst: dict[str, dict[str, float]] = {name: {} for name in names}
    by_shape: dict[tuple[int, int], dict[str, float]] = {}  # (rows, padded tokens) -> each output's deviation
    for (key, batch), devs in zip(compositions, found):
        seen = by_shape.setdefault(batch.shape, {})
        for name in names:
            worst[name][key] = max(worst[name].get(key, 0.0), devs[name])
            seen[name] = max(seen.get(name, 0.0), devs[name])
    for rows, tokens in measured_by_mixed:
        for name in names:
            worst[name][f"{rows}x{tokens}"] = by_shape[(rows, tokens)][name]
    per_output = {name: {"batch_dev": max(w.values(), default=0.0), "by_batch_size": w}
                  for name, w in worst.items()}
    return {"batch_dev": max((p["batch_dev"] for p in per_output.values()), default=0.0),
            "outputs": per_output, "texts": n, "batch_sizes": [int(b) for b in batch_sizes],
            "full_batches": [list(shape) for shape in full]}
