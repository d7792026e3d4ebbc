"""The gate's statistics (bertopt.measure.compare): the figures are float64 arithmetic on the values as given, the
same when the work is done a slice of rows at a time, and the error sample the plots draw is the seeded one."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt import cosine
from bertopt.measure import compare
from bertopt.measure.compare import compare_output, cosine_rows, measure_output


def _token_states(rows_per_text, seed=0, noise=1e-3):
    rng = np.random.default_rng(seed)
    got = [rng.standard_normal((n, 16)).astype(np.float32) for n in rows_per_text]
    ref = [g + noise * rng.standard_normal(g.shape).astype(np.float32) for g in got]
    return got, ref


def _float64_figures(got, ref, atol=1e-3, rtol=1e-3):
    """The figures written out the plain way: both sides cast to float64 first, whole arrays at once."""
    g = np.concatenate([x.reshape(-1, x.shape[-1]) for x in got]).astype(np.float64)
    r = np.concatenate([x.reshape(-1, x.shape[-1]) for x in ref]).astype(np.float64)
    err = np.abs(g - r)
    dot = (g * r).sum(axis=1)
    cos = dot / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1))
    return {"max_abs": err.max(), "mean_abs": err.mean(), "abs_err_p99": np.quantile(err, 0.99),
            "pass_fraction": np.mean(err <= atol + rtol * np.abs(r)), "cos_min": cos.min(), "cos_mean": cos.mean(),
            "cos_p01": np.quantile(cos, 0.01)}, err.ravel()


def test_token_figures_are_the_float64_ones_across_slices(monkeypatch):
    # 100 rows: 15 slices, the last one short (the error's and the cosine's)
    monkeypatch.setattr(compare, "ROWS_PER_SLICE", 7)
    monkeypatch.setattr(cosine, "ROWS_PER_SLICE", 7)
    got, ref = _token_states([30, 1, 45, 24])
    stats, dist = measure_output("last_hidden_state", "token", got, ref)
    want, err = _float64_figures(got, ref)
    for key, value in want.items():
        assert stats[key] == value, key
    assert stats["count"] == 100 * 16 and stats["nan_or_inf"] == 0
    assert np.array_equal(dist["abs_err"], err)  # under the sample size: every error, in order
    assert "cosine" not in dist  # token rows are not plotted per input
    assert compare_output("last_hidden_state", "token", got, ref) == stats


def test_error_sample_is_seeded_and_drawn_from_the_errors(monkeypatch):
    monkeypatch.setattr(compare, "ERROR_SAMPLE", 50)
    got, ref = _token_states([40, 60], seed=1)
    _, dist = measure_output("h", "token", got, ref)
    _, err = _float64_figures(got, ref)
    assert np.array_equal(dist["abs_err"], np.random.default_rng(0).choice(err, 50, replace=False))
    assert np.array_equal(measure_output("h", "token", got, ref)[1]["abs_err"], dist["abs_err"])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_embedding_cosines_zero_rows_and_non_finite_values():
    rng = np.random.default_rng(2)
    got = rng.standard_normal((9, 8)).astype(np.float32)
    ref = got.copy()
    got[1] = 0.0
    ref[1] = 0.0  # two zero vectors: identical
    got[2] = 0.0  # a zero vector against a non-zero one: maximally wrong
    got[4, 3] = np.inf
    stats, dist = measure_output("sentence_embedding", "embedding", got, ref)
    assert stats["nan_or_inf"] == 1 and stats["max_abs"] == np.inf
    assert dist["cosine"][1] == 1.0 and dist["cosine"][2] == 0.0
    assert np.isnan(dist["cosine"][4])  # inf / inf: not a cosine, and the plots drop it
    assert np.isnan(stats["cos_min"])  # so no cos_min target can pass
    assert np.allclose(np.delete(dist["cosine"], [2, 4]), 1.0)
    assert np.array_equal(cosine_rows(got, ref), dist["cosine"], equal_nan=True)


def test_shape_mismatch_is_a_line_and_nothing_to_plot():
    stats, dist = measure_output("logits", "logits", np.zeros((3, 2), np.float32), np.zeros((3, 4), np.float32))
    assert stats == {"name": "logits", "error": "shape mismatch (3, 2) vs (3, 4)"} and dist == {}


@pytest.mark.parametrize("rows", [0, 1, 4096, 4097])
def test_cosine_rows_at_slice_edges(rows):
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, 5)).astype(np.float32)
    b = rng.standard_normal((rows, 5)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    got = cosine_rows(a, b)
    assert got.dtype == np.float64 and got.shape == (rows,)
    assert np.array_equal(got, want)
