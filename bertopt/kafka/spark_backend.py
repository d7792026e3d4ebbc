"""``bertopt kafka --backend spark``: each consumed batch runs as a Spark job through the bertopt Spark UDF.

The bridge keeps its contract (consume a batch, predict, produce every response, wait for the acknowledgements,
then commit); only the "predict" step changes: the batch's texts become a DataFrame of ``--partitions``
partitions, the column function from ``bertopt.spark.predict_udf`` (``predict_batch_udf``; the model is loaded
once per Python worker and placed on a GPU or a share of the CPU cores per partition, exactly as in
``bertopt spark-predict``) predicts them on the executors, and the driver collects the values in request order.

The Spark session and the column function are made once, when the bridge starts, and a warm-up job loads the
model in the workers before the first request is consumed, so a broken set-up (artifact missing on the
executors, no GPU for ``--provider cuda``) fails at start-up with one line and exit code 2. A Spark job that
fails later (a worker lost, the JVM gone) raises ``BackendFailed``: the bridge exits 1 without committing and the
batch is answered after the restart (at least once).

The UDF gives no prediction for empty or whitespace-only text (a null, as in ``spark-predict``), so a request
holding such a text is answered with an error response instead of being sent to Spark.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from bertopt.errors import UserError
from bertopt.params import Param, resolve_config

log = logging.getLogger("bertopt.kafka")


def _positive(value: int) -> str | None:
    return None if value >= 1 else f"must be at least 1, got {value}"


# Declared once: the `bertopt kafka` flags (--master, --partitions) and SparkBackend's keyword arguments.
SPARK_BACKEND_PARAMS = [
    Param("master", str, "local[2]", "spark backend: the Spark master the bridge's session connects to "
          "(local[N], spark://HOST:7077, yarn, k8s://...)."),
    Param("partitions", int, None, "spark backend: partitions (Spark tasks) each consumed batch is split into "
          "(default: the session's default parallelism, e.g. N for local[N]).", check=_positive),
]
SPARK_PARAM = {p.name: p for p in SPARK_BACKEND_PARAMS}

WARMUP_TEXT = "bertopt warm-up"


class SparkBackend:
    """Batches of texts through ``bertopt.spark.predict_udf`` on a Spark session started once."""

    name = "spark"

    def __init__(self, artifact, *, master: str | None = None, partitions: int | None = None,
                 threads: int | None = None, batch_size: int = 32, provider: str = "auto",
                 conf: dict[str, str] | None = None, spark=None):
        from bertopt.artifact import Artifact
        from bertopt.errors import require

        require("pyspark", "spark", "bertopt kafka --backend spark")
        config = resolve_config(SPARK_BACKEND_PARAMS, {"master": master, "partitions": partitions},
                                "bertopt kafka --backend spark")
        from bertopt.spark.streaming import refuse_task_models

        art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
        refuse_task_models(art.model_info, "bertopt kafka --backend spark")
        self.digest = art.digest
        self.model_info = art.model_info
        self.batches = 0
        self.spark_seconds = 0.0  # time spent in Spark jobs (DataFrame made, predicted, collected)
        self._own_session = spark is None
        from bertopt.spark.session import get_session
        from bertopt.spark.udf import predict_udf

        t0 = time.perf_counter()
        self.spark = spark if spark is not None else get_session(config["master"], app_name="bertopt-kafka",
                                                                 conf=conf)
        self.startup_s = time.perf_counter() - t0
        try:
            self.partitions = config["partitions"] or max(1, self.spark.sparkContext.defaultParallelism)
            self.udf = predict_udf(art, batch_size=batch_size, threads=threads, provider=provider, spark=self.spark)
            self.output = self.udf.output
            log.info("spark session up on %s in %.1f s (%d partitions per batch, output %s)",
                     self.spark.sparkContext.master, self.startup_s, self.partitions, self.output)
            self._warm_up()
        except BaseException:
            self.close()
            raise

    def _warm_up(self) -> None:
        """One job with a text per partition: the workers load the model now, and set-up errors surface now."""
        from bertopt.spark.session import worker_errors

        t0 = time.perf_counter()
        with worker_errors():
            values = self._run([WARMUP_TEXT] * self.partitions)
        self.dim = values.shape[1]
        log.info("spark workers loaded the model in %.1f s", time.perf_counter() - t0)

    def refuse(self, texts: Sequence[str]) -> str | None:
        """Why a request cannot go to Spark (answered with an error response), or None."""
        from bertopt.spark.streaming import EMPTY_TEXT_ERROR
        from bertopt.spark.udf import is_text

        return None if all(is_text(t) for t in texts) else EMPTY_TEXT_ERROR

    def encode(self, texts: Sequence[str]):
        from bertopt.kafka.bridge import BackendFailed
        from bertopt.spark.session import bertopt_error_in

        refused = self.refuse(texts)
        if refused is not None:
            raise UserError(refused)  # the bridge answers such requests one by one
        t0 = time.perf_counter()
        try:
            values = self._run(list(texts))
        except Exception as exc:  # Py4J / Spark errors: the batch is not committed, a restart re-processes it
            reason = bertopt_error_in(exc) or _first_line(exc)
            raise BackendFailed(f"the Spark job for a batch of {len(texts)} texts failed ({reason}); the batch was "
                                "not committed and will be processed again") from None
        self.spark_seconds += time.perf_counter() - t0
        self.batches += 1
        return values

    def _run(self, texts: list[str]):
        """Predict ``texts`` in one Spark job (a float32 array); rows come back in the order given."""
        import numpy as np
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        schema = StructType([StructField("i", LongType(), False), StructField("text", StringType(), True)])
        rows = self.spark.sparkContext.parallelize(list(enumerate(texts)), min(self.partitions, len(texts)))
        df = self.spark.createDataFrame(rows, schema)
        collected = df.select("i", self.udf("text").alias("y")).collect()
        out: list[Any] = [None] * len(texts)
        for row in collected:
            out[row[0]] = row[1]
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            raise RuntimeError(f"the Spark UDF returned no prediction for {len(missing)} of {len(texts)} texts")
        return np.asarray(out, dtype=np.float32)

    def close(self) -> None:
        if self._own_session and getattr(self, "spark", None) is not None:
            self.spark.stop()
            self.spark = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
