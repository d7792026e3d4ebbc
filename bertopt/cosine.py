"""Row cosines, the one definition every layer compares outputs with (the runtime's fixed-shape check, the
quantisers' held-back measurements, validate's statistics).

Two zero rows are identical (cosine 1); a zero row against a non-zero one is maximally wrong (cosine 0).
"""

from __future__ import annotations

import numpy as np

# rows per slice of the cosine's float64 work: the arithmetic is row-wise, so slicing changes no figure, and a
# slice's temporaries stay small instead of full-size float64 copies (with one pass for figures and plot sample,
# MiniLM's outputs on the gate's 831 texts, 14.9 M values: 1.32 s -> 0.43 s a comparison, peak memory 667 -> 333 MiB;
# benchmarks/gate_cost.py)
ROWS_PER_SLICE = 4096


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``a`` with the same row of ``b``, computed in float64."""
    out = np.empty(len(a), dtype=np.float64)
    for start in range(0, len(a), ROWS_PER_SLICE):
        stop = start + ROWS_PER_SLICE
        out[start:stop] = _cosine_slice(np.asarray(a[start:stop], np.float64), np.asarray(b[start:stop], np.float64))
    return out


def min_row_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest cosine between matching rows of two same-shaped arrays, rows along the last axis (a pooled output
    is one row; a token-level one, a row per token; a scalar, a row of one); 1.0 for no rows."""
    a = np.asarray(a)
    a = a.reshape(-1, a.shape[-1] if a.ndim else 1)
    b = np.asarray(b).reshape(a.shape)
    return float(cosine_rows(a, b).min()) if len(a) else 1.0


def _cosine_slice(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    denom = na * nb
    cos = np.divide((a * b).sum(axis=1), denom, out=np.ones_like(denom), where=denom > 0)
    cos[(na == 0) ^ (nb == 0)] = 0.0
    return cos
