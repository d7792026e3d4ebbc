"""Accuracy metrics between two sets of outputs (the artifact's and the reference's).

Token-level outputs are compared on real tokens only (padding is never looked at); pooled outputs
(embeddings) get cosine statistics; logits get top-1 agreement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bertopt.cosine import ROWS_PER_SLICE, cosine_rows


def flatten_outputs(values) -> np.ndarray:
    if isinstance(values, list):
        if not values:
            return np.zeros((0, 1))
        return np.concatenate([v.reshape(-1, v.shape[-1]) for v in values if v.size], axis=0)
    return values


def neighbour_agreement(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """Mean overlap of the k nearest neighbours (cosine) of every row, computed in each embedding space."""
    n = a.shape[0]
    if n < 2:
        return 1.0
    k = min(k, n - 1)

    def knn(x):
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        sim = x @ x.T
        np.fill_diagonal(sim, -np.inf)
        return np.argsort(-sim, axis=1, kind="stable")[:, :k]

    na, nb = knn(a.astype(np.float64)), knn(b.astype(np.float64))
    return float(np.mean([len(set(r1) & set(r2)) / k for r1, r2 in zip(na, nb)]))


def _within(err: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> int:
    """How many errors are at most ``atol + rtol * |ref|`` (float64), counted a slice of rows at a time: no
    full-size bound array next to the errors."""
    rows = err.shape[0] if err.ndim else 1
    err, ref = err.reshape(rows, -1), np.asarray(ref).reshape(rows, -1)
    count = 0
    for start in range(0, rows, ROWS_PER_SLICE):
        bound = np.abs(ref[start:start + ROWS_PER_SLICE], dtype=np.float64)
        bound *= rtol
        bound += atol
        count += int(np.count_nonzero(err[start:start + ROWS_PER_SLICE] <= bound))
    return count


COSINE_KINDS = ("embedding", "token", "logits", "token-logits", "sparse")
ERROR_SAMPLE = 200_000  # absolute errors kept for a plot: a seeded sample where there are more


def compare_output(name: str, kind: str, got, ref, atol: float = 1e-3, rtol: float = 1e-3,
                   quantile: float = 0.99) -> dict[str, Any]:
    return measure_output(name, kind, got, ref, atol=atol, rtol=rtol, quantile=quantile)[0]


def measure_output(name: str, kind: str, got, ref, atol: float = 1e-3, rtol: float = 1e-3,
                   quantile: float = 0.99) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One output's statistics (float64 arithmetic), and its error distribution for the plots: a sample of the
    absolute errors and, where rows are vectors other than token states, each row's cosine."""
    g, r = flatten_outputs(got), flatten_outputs(ref)
    if g.shape != r.shape:
        return {"name": name, "error": f"shape mismatch {g.shape} vs {r.shape}"}, {}
    # float64 differences of the values as given: the same as casting both first, without the two copies
    err = np.abs(np.subtract(g, r, dtype=np.float64))
    stats: dict[str, Any] = {"name": name, "kind": kind, "count": int(g.size),
                             "nan_or_inf": int(g.size - np.count_nonzero(np.isfinite(g)))}
    if err.size:
        stats.update({"max_abs": float(err.max()), "mean_abs": float(err.mean()),
                      "pass_fraction": _within(err, r, atol, rtol) / err.size})
    else:
        stats.update({"max_abs": 0.0, "mean_abs": 0.0, "pass_fraction": 1.0})
    flat = err.reshape(-1)
    distribution = {"abs_err": np.random.default_rng(0).choice(flat, ERROR_SAMPLE, replace=False)
                    if flat.size > ERROR_SAMPLE else flat.copy()}
    # last use of err: the quantile may reorder it in place
    stats[f"abs_err_p{int(quantile * 100)}"] = (float(np.quantile(flat, quantile, overwrite_input=True))
                                                 if flat.size else 0.0)
    stats.update({"atol": atol, "rtol": rtol})
    del err, flat
    if g.ndim == 2 and g.shape[0] > 0:
        cos = cosine_rows(g, r)
        if kind in COSINE_KINDS:
            stats.update({"cos_mean": float(cos.mean()), "cos_p01": float(np.quantile(cos, 0.01)),
                          "cos_min": float(cos.min())})
        if kind != "token":
            distribution["cosine"] = cos
    if kind == "embedding" and not isinstance(got, list):
        stats["neighbour_agreement_at_10"] = neighbour_agreement(g, r, 10)
    if kind in ("logits", "token-logits") and g.ndim == 2:
        stats["top1_agreement"] = float(np.mean(g.argmax(1) == r.argmax(1)))
    return stats, distribution


def compare_runs(got: dict[str, Any], ref: dict[str, Any], kinds: dict[str, str], **kw) -> dict[str, dict]:
    return {name: stats for name, (stats, _) in measure_runs(got, ref, kinds, **kw).items()}


def measure_runs(got: dict[str, Any], ref: dict[str, Any], kinds: dict[str, str],
                 **kw) -> dict[str, tuple[dict, dict]]:
    """Every output both runs have: its statistics and error distribution (``measure_output``)."""
    return {name: measure_output(name, kinds.get(name, "embedding"), got[name], ref[name], **kw)
            for name in got if name in ref}
