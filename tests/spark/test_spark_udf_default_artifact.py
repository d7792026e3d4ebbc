"""Served = validated: the Spark UDF returns what the in-process runtime returns for the default artifact, whatever
batches and partitions the rows land in (batch sizes 1 / 7 / 32, other partitionings and row orders)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from served_checks import served_deviation

from bertopt.data import mixed_text
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_udf_matches_in_process_in_every_batch_composition(spark, default_artifact):
    from bertopt.spark import predict_udf
    from bertopt.spark.session import worker_errors

    texts = mixed_text()[:64]
    want = Predictor(default_artifact).encode(texts)
    order = list(range(len(texts)))
    random.Random(3).shuffle(order)
    bound = default_artifact.served_deviation_bound()
    worst = 0.0
    for batch_size, partitions, rows in ((1, 2, order), (7, 3, order), (32, 1, list(range(len(texts))))):
        df = spark.createDataFrame([(i, texts[i]) for i in rows], "idx long, text string").repartition(partitions)
        udf = predict_udf(default_artifact.path, batch_size=batch_size, spark=spark)
        with worker_errors():
            got = {r["idx"]: r["emb"] for r in df.select("idx", udf("text").alias("emb")).collect()}
        assert sorted(got) == list(range(len(texts)))
        values = np.array([got[i] for i in range(len(texts))], dtype=np.float32)
        worst = max(worst, served_deviation(values, want))
    assert worst <= bound, (worst, bound)
