"""The one row cosine: what it says of zero rows, sign flips, token-level arrays, scalars and no rows."""

import numpy as np
import pytest

from bertopt import cosine


def test_each_row_is_compared_with_its_own_twin():
    a = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], np.float32)
    b = np.array([[2.0, 0.0], [0.0, -1.0], [4.0, 3.0]], np.float32)
    assert cosine.cosine_rows(a, b) == pytest.approx([1.0, -1.0, 24 / 25])


def test_two_zero_rows_agree_and_a_zero_row_against_another_is_maximally_wrong():
    zero, one = np.zeros((1, 3)), np.ones((1, 3))
    assert cosine.cosine_rows(zero, zero).tolist() == [1.0]
    assert cosine.cosine_rows(zero, one).tolist() == [0.0]
    assert cosine.cosine_rows(one, zero).tolist() == [0.0]


def test_rows_past_one_slice_are_all_computed(monkeypatch):
    monkeypatch.setattr(cosine, "ROWS_PER_SLICE", 3)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(10, 4)), rng.normal(size=(10, 4))
    expected = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.cosine_rows(a, b) == pytest.approx(expected)


def test_min_row_cosine_reads_rows_along_the_last_axis():
    tokens = np.ones((2, 3, 4))  # a text's token states: one row per token
    moved = tokens.copy()
    moved[1, 2] = [1.0, -1.0, 1.0, -1.0]
    assert cosine.min_row_cosine(tokens, moved) == pytest.approx(0.0)
    assert cosine.min_row_cosine(np.array(2.0), np.array(-3.0)) == -1.0  # a score is a row of one
    assert cosine.min_row_cosine(np.zeros((0, 4)), np.zeros((0, 4))) == 1.0
