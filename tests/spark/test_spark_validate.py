"""spark_check: the UDF's results against the in-process runtime on the same artifact."""

from __future__ import annotations

import math

import pytest
from spark_testdata import TEXTS

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_spark_check_tiny_with_nulls(spark, tiny_onnx):
    from bertopt.spark import spark_check

    texts = TEXTS * 4 + ["", "  "]
    report = spark_check(tiny_onnx.path, texts, batch_size=8, spark=spark)
    assert report["rows"] == len(texts) and report["compared_rows"] == len(TEXTS) * 4
    assert report["max_abs_diff"] <= 1e-5
    assert report["null_rows"] == 2 and report["null_rows_ok"]
    assert report["output"] == "sentence_embedding" and report["master"] == "local[2]"
    for key in ("rows_per_s", "in_process_rows_per_s", "ratio", "first_action_s"):
        assert report[key] > 0 and math.isfinite(report[key]), key
    assert report["startup_s"] >= 0


def test_spark_check_pairs_on_cross_encoder(spark, task_artifact):
    """(query, passage) pairs through Spark: a cross-encoder (a plain classifier refuses pairs)."""
    from bertopt.spark import spark_check

    _, reranker = task_artifact("rerank")
    pairs = list(reversed(TEXTS))
    report = spark_check(reranker, TEXTS, pairs=pairs, batch_size=4, spark=spark)
    assert report["output"] == "score" and report["rows"] == len(TEXTS)
    assert report["max_abs_diff"] <= 1e-5 and report["null_rows"] == 0
    # the second segment matters (the score moves by far more than 1e-5 when it changes), so the UDF's match with
    # the in-process run on pairs proves the pairs reached the executors' model
    from bertopt.runtime import Predictor

    pred = Predictor(reranker)
    assert abs(pred.encode(TEXTS, pairs) - pred.encode(TEXTS, TEXTS)).max() > 1e-3


def test_spark_check_real_minilm_on_builtin_corpus(spark, minilm_onnx):
    from bertopt.data import corpus
    from bertopt.spark import spark_check

    texts = corpus()
    report = spark_check(minilm_onnx, texts, batch_size=32, spark=spark)
    assert report["rows"] == len(texts)
    assert report["max_abs_diff"] <= 1e-5, report
    assert report["null_rows"] == sum(1 for t in texts if not t.strip()) and report["null_rows_ok"]


@pytest.mark.parametrize("output", ["label", "result"])
def test_spark_check_refuses_text_outputs_before_spark_starts(tiny_classifier, output):
    from bertopt.errors import UserError
    from bertopt.spark import spark_check

    with pytest.raises(UserError, match=f"compares numeric outputs, not '{output}'"):
        spark_check(tiny_classifier.path, ["a text"], output=output, master="no-such-master")
