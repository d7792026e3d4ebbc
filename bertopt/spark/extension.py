"""How Spark plugs into bertopt (loaded by :func:`bertopt.extensions.load_extensions`): the ``--spark`` check of
``bertopt validate``. pyspark is imported when the check runs."""

from __future__ import annotations

from bertopt.validate.gate import register_runner_check


@register_runner_check("spark")
def spark(artifact, texts, **options):
    from bertopt.spark.validate import spark_check

    return spark_check(artifact, texts, **options)
