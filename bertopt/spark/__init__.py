"""Spark batch inference with bertopt artifacts.

* ``predict_udf(artifact, ...)``: a ``predict_batch_udf`` column function, text column(s) -> embedding /
  logits (``array<float>``) or label (string);
* ``predict_dataframe(df, artifact, ...)``: the ``mapInPandas`` variant keeping every input column (plus
  ``error``: why a row got no prediction);
* ``text_error(text_col, pair_col=None, max_text_chars=...)``: that reason as a Spark SQL column;
* ``ship_artifact(spark, artifact)``: send an artifact to the executors as an archive;
* ``spark_check(artifact, texts, ...)``: the UDF's results against the in-process runtime's;
* ``get_session(master)``: a SparkSession set up for inference;
* ``kafka_stream_job(spark, artifact, bootstrap, request_topic, response_topic, checkpoint)``: the Structured
  Streaming job Kafka -> bertopt UDF -> Kafka (needs Spark's Kafka connector); ``kafka_responses(df, artifact)``
  its per-batch transformation.

Imports are lazy: ``import bertopt.spark`` does not import pyspark.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "predict_udf": "bertopt.spark.udf",
    "predict_dataframe": "bertopt.spark.udf",
    "text_error": "bertopt.spark.udf",
    "ship_artifact": "bertopt.spark.udf",
    "ArtifactRef": "bertopt.spark.udf",
    "read_load_log": "bertopt.spark.udf",
    "spark_check": "bertopt.spark.validate",
    "spark_predict": "bertopt.spark.job",
    "get_session": "bertopt.spark.session",
    "worker_errors": "bertopt.spark.session",
    "choose_placement": "bertopt.spark.placement",
    "kafka_stream_job": "bertopt.spark.streaming",
    "kafka_responses": "bertopt.spark.streaming",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bertopt.spark' has no attribute {name!r}")
