"""``bertopt kafka --backend spark``: each consumed batch runs as a Spark job through the bertopt Spark UDF.

The bridge keeps its contract (consume a batch, predict, produce every response, wait for the acknowledgements,
then commit); only the "predict" step changes: the batch's texts become a DataFrame of ``--partitions``
partitions, the column function from ``bertopt.spark.predict_udf`` (``predict_batch_udf``; the model is loaded
once per Python worker and placed on a GPU or a share of the CPU cores per partition, exactly as in
``bertopt spark-predict``) predicts them on the executors, and the driver collects the values in request order.
Embedding models give their sentence embedding; task models (classification, token classification with the
request's aggregation, rerank with the request's pairs as a second column, SPLADE) give the UDF's ``result``
column, ``Predictor.predict``'s result as JSON, so every response equals the local backend's for the same message
(and a request the local backend refuses, such as a rerank request without pairs, gets the same error message).

The Spark session and the column function are made once, when the bridge starts, and a warm-up job loads the
model in the workers before the first request is consumed, so a broken set-up (artifact missing on the
executors, no GPU for ``--provider cuda``) fails at start-up with one line and exit code 2. A Spark job that
fails later (a worker lost, the JVM gone) raises ``BackendFailed``: the bridge exits 3 without committing and the
batch is answered after the restart (at least once).

The UDF gives no prediction for empty or whitespace-only text (a null, as in ``spark-predict``), so a request
holding such a text (or such a pair) is answered with an error response instead of being sent to Spark.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from bertopt.errors import UserError
from bertopt.messages import MAX_TEXT_CHARS
from bertopt.params import Param, resolve_config

log = logging.getLogger("bertopt.kafka")


# Declared once: the `bertopt kafka` flags (--master, --partitions) and SparkBackend's keyword arguments.
SPARK_BACKEND_PARAMS = [
    Param("master", str, "local[2]", "spark backend: the Spark master the bridge's session connects to "
          "(local[N], spark://HOST:7077, yarn, k8s://...)."),
    Param("partitions", int, None, "spark backend: partitions (Spark tasks) each consumed batch is split into "
          "(default: the session's default parallelism, e.g. N for local[N]).", min=1),
]

WARMUP_TEXT = "bertopt warm-up"


class SparkBackend:
    """Batches of texts through ``bertopt.spark.predict_udf`` on a Spark session started once.

    An embedding model answers with its sentence embedding (the UDF's default column). A task model
    (classification, token classification, rerank, sparse embedding) answers with the UDF's ``result`` column:
    ``Predictor.predict``'s result computed on the executors, as JSON, so the bridge builds exactly the response
    the local backend builds. One column function per kind of request (with or without pairs; each token
    classification aggregation), made on first use; the executors' model cache serves them all.
    """

    name = "spark"

    def __init__(self, artifact, *, master: str | None = None, partitions: int | None = None,
                 threads: int | None = None, batch_size: int = 32, provider: str = "auto",
                 conf: dict[str, str] | None = None, spark=None, max_text_chars: int = MAX_TEXT_CHARS,
                 long_inputs: str = "truncate"):
        from bertopt.artifact import Artifact
        from bertopt.errors import require

        require("pyspark", "spark", "bertopt kafka --backend spark")
        config = resolve_config(SPARK_BACKEND_PARAMS, {"master": master, "partitions": partitions},
                                "bertopt kafka --backend spark")
        from bertopt.runtime.tasks import task_of, task_output

        art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
        self.art = art
        self.task = task_of(art)
        if self.task != "embedding":  # a task artifact without its task's output fails here, before Spark starts
            task_output(art, self.task)
        self.digest = art.digest
        self.model_info = art.model_info
        self.batches = 0
        self.spark_seconds = 0.0  # time spent in Spark jobs (DataFrame made, predicted, collected)
        from bertopt.spark.udf import SPARK_LONG_INPUTS

        self._udf_options = {"batch_size": batch_size, "threads": threads, "provider": provider,
                             "max_text_chars": max_text_chars,
                             "long_inputs": SPARK_LONG_INPUTS.coerce(long_inputs, "bertopt kafka --backend spark")}
        self.max_text_chars = max_text_chars
        self._udfs: dict[tuple[bool, str], Any] = {}
        self._own_session = spark is None
        from bertopt.spark.session import get_session

        t0 = time.perf_counter()
        self.spark = spark if spark is not None else get_session(config["master"], app_name="bertopt-kafka",
                                                                 conf=conf)
        self.startup_s = time.perf_counter() - t0
        try:
            self.partitions = config["partitions"] or max(1, self.spark.sparkContext.defaultParallelism)
            self.udf = self._udf(self.task == "rerank", "simple")
            self.output = self.udf.output
            log.info("spark session up on %s in %.1f s (%d partitions per batch, output %s)",
                     self.spark.sparkContext.master, self.startup_s, self.partitions, self.output)
            self._warm_up()
        except BaseException:
            self.close()
            raise

    def _udf(self, with_pairs: bool, aggregation: str):
        """The column function for requests with or without pairs (and, for token classification, one
        aggregation), made once."""
        from bertopt.spark.udf import RESULT, predict_udf

        key = (with_pairs, aggregation if self.task == "token-classification" else "simple")
        if key not in self._udfs:
            output = None if self.task == "embedding" else RESULT
            self._udfs[key] = predict_udf(self.art, output=output, pairs=with_pairs, aggregation=key[1],
                                          spark=self.spark, **self._udf_options)
        return self._udfs[key]

    def _warm_up(self) -> None:
        """One job with a text per partition: the workers load the model now, and set-up errors surface now."""
        from bertopt.spark.session import worker_errors

        t0 = time.perf_counter()
        texts = [WARMUP_TEXT] * self.partitions
        with worker_errors():
            if self.task == "embedding":
                self.dim = self._run(self.udf, texts, None).shape[1]
            else:
                self._run(self.udf, texts, texts if self.task == "rerank" else None)
        log.info("spark workers loaded the model in %.1f s", time.perf_counter() - t0)

    def refuse(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> str | None:
        """Why a request cannot go to Spark (answered with an error response), or None."""
        from bertopt.messages import text_problem
        from bertopt.spark.streaming import EMPTY_TEXT_ERROR
        from bertopt.spark.udf import is_text

        ok = all(is_text(t) for t in texts) and (pairs is None or all(is_text(p) for p in pairs))
        if not ok:
            return EMPTY_TEXT_ERROR
        for value in list(texts) + list(pairs or []):  # the bridge checked these already; API callers may not
            problem = text_problem(value, self.max_text_chars)
            if problem is not None:
                return problem
        return None

    def encode(self, texts: Sequence[str]):
        if self.task != "embedding":
            raise UserError(f"this artifact is a {self.task} model; it has no sentence embedding to encode")
        return self._job(self.udf, list(texts), None)

    def predict(self, texts: Sequence[str], pairs: Sequence[str] | None = None, aggregation: str = "simple") -> list:
        """``Predictor.predict``'s results for ``texts`` (and ``pairs``), computed by a Spark job; the same checks
        first, so a refused request gets the local backend's error message."""
        import json

        from bertopt.runtime.tasks import check_predict_args

        if self.task == "embedding":  # the bridge asks embedding models to encode; kept for API callers
            return list(self.encode(texts))
        check_predict_args(self.art, self.task, pairs, aggregation)
        texts = list(texts)
        pairs = None if pairs is None else list(pairs)
        values = self._job(self._udf(pairs is not None, aggregation), texts, pairs)
        return [json.loads(v) for v in values]

    def _job(self, udf, texts: list[str], pairs: list[str] | None):
        from bertopt.errors import BackendFailed
        from bertopt.spark.session import bertopt_error_in

        refused = self.refuse(texts, pairs)
        if refused is not None:
            raise UserError(refused)  # the bridge answers such requests one by one
        t0 = time.perf_counter()
        try:
            values = self._run(udf, texts, pairs)
        except Exception as exc:  # Py4J / Spark errors: the batch is not committed, a restart re-processes it
            reason = bertopt_error_in(exc) or _first_line(exc)
            raise BackendFailed(f"the Spark job for a batch of {len(texts)} texts failed ({reason}); the batch was "
                                "not committed and will be processed again") from None
        self.spark_seconds += time.perf_counter() - t0
        self.batches += 1
        return values

    def _run(self, udf, texts: list[str], pairs: list[str] | None):
        """Predict ``texts`` (with ``pairs``) in one Spark job; rows come back in the order given: a float32 array
        of embeddings, or the task results' JSON texts."""
        import numpy as np
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        if not texts:
            return np.zeros((0, 0), dtype=np.float32) if self.task == "embedding" else []
        fields = [StructField("i", LongType(), False), StructField("text", StringType(), True)]
        rows = list(enumerate(texts))
        if pairs is not None:
            fields.append(StructField("pair", StringType(), True))
            rows = [(i, t, p) for (i, t), p in zip(rows, pairs)]
        rdd = self.spark.sparkContext.parallelize(rows, min(self.partitions, len(texts)))
        df = self.spark.createDataFrame(rdd, StructType(fields))
        column = udf("text") if pairs is None else udf("text", "pair")
        collected = df.select("i", column.alias("y")).collect()
        out: list[Any] = [None] * len(texts)
        for row in collected:
            out[row[0]] = row[1]
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            raise RuntimeError(f"the Spark UDF returned no prediction for {len(missing)} of {len(texts)} texts")
        return np.asarray(out, dtype=np.float32) if self.task == "embedding" else out

    def close(self) -> None:
        if self._own_session and getattr(self, "spark", None) is not None:
            self.spark.stop()
            self.spark = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
