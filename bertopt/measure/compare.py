"""Accuracy metrics between two sets of outputs (the artifact's and the reference's).

Token-level outputs are compared on real tokens only (padding is never looked at); pooled outputs
(embeddings) get cosine statistics; logits get top-1 agreement.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def flatten_outputs(values) -> np.ndarray:
    if isinstance(values, list):
        if not values:
            return np.zeros((0, 1))
        return np.concatenate([v.reshape(-1, v.shape[-1]) for v in values if v.size], axis=0)
    return values


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    denom = na * nb
    cos = np.divide((a * b).sum(axis=1), denom, out=np.ones_like(denom), where=denom > 0)
    # two zero vectors are identical; one zero vector against a non-zero one is maximally wrong
    cos[(na == 0) ^ (nb == 0)] = 0.0
    return cos


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


def compare_output(name: str, kind: str, got, ref, atol: float = 1e-3, rtol: float = 1e-3,
                   quantile: float = 0.99) -> dict[str, Any]:
    g = flatten_outputs(got).astype(np.float64)
    r = flatten_outputs(ref).astype(np.float64)
    if g.shape != r.shape:
        return {"name": name, "error": f"shape mismatch {g.shape} vs {r.shape}"}
    err = np.abs(g - r)
    finite = np.isfinite(g)
    stats: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "count": int(g.size),
        "nan_or_inf": int((~finite).sum()),
        "max_abs": float(err.max()) if err.size else 0.0,
        "mean_abs": float(err.mean()) if err.size else 0.0,
        f"abs_err_p{int(quantile * 100)}": float(np.quantile(err, quantile)) if err.size else 0.0,
        "pass_fraction": float(np.mean(err <= atol + rtol * np.abs(r))) if err.size else 1.0,
        "atol": atol,
        "rtol": rtol,
    }
    if kind in ("embedding", "token", "logits", "token-logits", "sparse") and g.ndim == 2 and g.shape[0]:
        cos = cosine_rows(g, r)
        stats.update({"cos_mean": float(cos.mean()), "cos_p01": float(np.quantile(cos, 0.01)),
                      "cos_min": float(cos.min())})
    if kind == "embedding" and not isinstance(got, list):
        stats["neighbour_agreement_at_10"] = neighbour_agreement(g, r, 10)
    if kind in ("logits", "token-logits") and g.ndim == 2:
        stats["top1_agreement"] = float(np.mean(g.argmax(1) == r.argmax(1)))
    return stats


def compare_runs(got: dict[str, Any], ref: dict[str, Any], kinds: dict[str, str], **kw) -> dict[str, dict]:
    return {name: compare_output(name, kinds.get(name, "embedding"), got[name], ref[name], **kw)
            for name in got if name in ref}
