"""Kafka -> bertopt -> Kafka as a Spark Structured Streaming job, for clusters with Spark's Kafka connector.

``kafka_stream_job(spark, artifact, bootstrap, request_topic, response_topic, checkpoint)`` starts::

    readStream.format("kafka") (request topic)
      -> foreachBatch: parse each request, predict its texts with the bertopt Spark UDF (predict_udf), build one
         response per request
      -> write.format("kafka") (response topic)        checkpointed in ``checkpoint``

Requests and responses are the ones ``bertopt kafka`` reads and writes (``docs/kafka.md``): the same parser, the
same bounds and checks (size and JSON depth before parsing, text count, valid Unicode, text length), the same
error messages, the same response fields, keyed by the request's key: every request that fails gets an error
response for itself (``"id": null`` when it has no usable id) and the query lives on. Each micro-batch is a
static DataFrame inside ``foreachBatch``, so the texts of a multi-text request can be exploded, predicted and
gathered again without streaming state; Spark re-runs a micro-batch whose write failed from the checkpointed
offsets, so delivery is at least once, as with the bridge.

``kafka_responses(df, artifact)`` is that per-batch transformation on its own: any DataFrame with the Kafka
source's ``key`` / ``value`` columns (a static one in tests, or read with ``spark.read.format("kafka")``) becomes
a ``key`` / ``value`` DataFrame ready for the Kafka sink.

The request/response contract lives in ``bertopt.messages`` (a leaf module: neither Spark nor the runtime is
imported there); it is imported inside the functions below.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterator

import numpy as np

from bertopt.errors import UserError
from bertopt.messages import MAX_REQUEST_BYTES, MAX_TEXT_CHARS, MAX_TEXTS_PER_REQUEST

log = logging.getLogger("bertopt.spark")

KAFKA_SOURCE = "kafka"
EMPTY_TEXT_ERROR = ("empty or whitespace-only text has no prediction on Spark (the bertopt Spark UDF gives "
                    "null for it); send non-empty text")


def kafka_package(spark) -> str:
    """The Maven coordinate of Spark's Kafka connector matching this session's Spark and Scala versions."""
    scala = "2.13"
    try:
        full = spark.sparkContext._jvm.scala.util.Properties.versionNumberString()
        scala = ".".join(str(full).split(".")[:2]) or scala
    except Exception as exc:  # noqa: BLE001 - a Spark Connect session has no JVM handle: Spark 4 is Scala 2.13
        log.debug("Scala version unknown (%s); assuming %s", exc, scala)
    return f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{spark.version}"


def missing_connector_error(spark) -> UserError:
    package = kafka_package(spark)
    return UserError(f"Spark's Kafka connector is not on this session's classpath (package {package}); start Spark "
                     f"with it: spark-submit --packages {package} ..., pyspark --packages {package}, or "
                     f"SparkSession.builder.config('spark.jars.packages', '{package}') before the session starts")


def _is_missing_source(exc: BaseException) -> bool:
    text = str(exc)
    return "DATA_SOURCE_NOT_FOUND" in text or "Failed to find data source: kafka" in text


# -- the per-batch transformation --------------------------------------------------------------------------------
class _ParseRequests:
    """mapInPandas: Kafka rows -> one row per answerable request (id as JSON, its (text, pair) items, aggregation,
    error); the rest dropped. A request the model cannot take (pairs for a single-text model, a rerank request
    without them, an unknown aggregation) gets the error ``Predictor.predict`` (and so the bridge) gives."""

    def __init__(self, max_texts: int, has_position: bool, task: str, model_info: dict[str, Any],
                 max_text_chars: int, max_bytes: int):
        self.max_texts, self.has_position = max_texts, has_position
        self.max_text_chars, self.max_bytes = max_text_chars, max_bytes
        self.task, self.model_info = task, model_info

    def refusal(self, req) -> str | None:
        from types import SimpleNamespace

        from bertopt.messages import EMBEDDING_PAIRS_ERROR
        from bertopt.runtime.tasks import check_predict_args
        from bertopt.spark.udf import is_text

        if not all(is_text(t) for t in req.texts + (req.pairs or [])):
            return EMPTY_TEXT_ERROR
        if self.task == "embedding":
            return None if req.pairs is None else EMBEDDING_PAIRS_ERROR
        try:
            check_predict_args(SimpleNamespace(model_info=self.model_info), self.task, req.pairs, req.aggregation)
        except UserError as exc:
            return str(exc)
        return None

    def __call__(self, batches: Iterator) -> Iterator:
        import pandas as pd

        from bertopt.messages import _NO_ID, parse_request, response_id

        for pdf in batches:
            rows = []
            positions = zip(pdf["partition"], pdf["offset"]) if self.has_position else [("?", "?")] * len(pdf)
            for key, value, (part, offset) in zip(pdf["key"], pdf["value"], positions):
                value = value.encode() if isinstance(value, str) else value
                req = parse_request(None if value is None else bytes(value), self.max_texts,
                                    max_text_chars=self.max_text_chars, max_bytes=self.max_bytes)
                if req.error is None:
                    req.error = self.refusal(req)
                if req.id is _NO_ID:
                    log.warning("error response (id null) to request [%s]@%s: %s", part, offset, req.error)
                pairs = req.pairs if req.pairs is not None else [None] * len(req.texts)
                items = [{"text": t, "pair": p} for t, p in zip(req.texts, pairs)] if req.error is None else []
                aggregation = req.aggregation if self.task == "token-classification" else "simple"
                rows.append((None if key is None else bytes(key), json.dumps(response_id(req)), req.single, items,
                             aggregation, req.error))
            yield pd.DataFrame(rows, columns=["key", "rid", "single", "items", "aggregation", "error"])


class _PredictTasks:
    """mapInPandas for task models: one row per (request, text) -> its ``Predictor.predict`` result as JSON in
    ``y``, through ``bertopt.spark.udf.predict_rows`` (the Spark UDF's own path, ``result`` column), one call per
    kind of row (with or without a pair, aggregation)."""

    def __init__(self, ref, options: dict[str, Any]):
        self.ref, self.options = ref, options  # aggregation -> UdfOptions

    def __call__(self, batches: Iterator) -> Iterator:
        import pandas as pd

        from bertopt.spark.udf import RESULT, get_predictor, predict_rows

        for pdf in batches:
            y: list[Any] = [None] * len(pdf)
            groups: dict[tuple[bool, str], list[int]] = {}
            # a null comes as None or NaN (pandas 3 string columns): pd.isna covers both
            for i, (pos, pair, aggregation) in enumerate(zip(pdf["pos"], pdf["pair"], pdf["aggregation"])):
                if not pd.isna(pos):
                    groups.setdefault((not pd.isna(pair), aggregation), []).append(i)
            for (with_pairs, aggregation), rows in groups.items():
                opts = self.options[aggregation]
                texts = [pdf["text"].iat[i] for i in rows]
                pairs = [pdf["pair"].iat[i] for i in rows] if with_pairs else None
                values = predict_rows(get_predictor(self.ref, opts), texts, pairs, opts)[RESULT]
                for i, value in zip(rows, values):
                    y[i] = value
            out = pdf[["req_no", "key", "rid", "single", "error"]].copy()
            out["pos"] = pdf["pos"].astype("Int32")  # null for a request answered with an error
            out["y"] = y
            yield out


class _FormatResponses:
    """mapInPandas: one row per request with its gathered predictions -> key, value (the response's JSON)."""

    def __init__(self, model_info: dict[str, Any], digest: str):
        self.model_info, self.digest = model_info, digest

    def __call__(self, batches: Iterator) -> Iterator:
        import pandas as pd

        from bertopt.messages import ResponseFormat

        fmt = ResponseFormat(self.model_info, self.digest)
        for pdf in batches:
            values_out = []
            for rid_json, single, error, preds in zip(pdf["rid"], pdf["single"], pdf["error"], pdf["preds"]):
                rid = json.loads(rid_json)
                if error is not None and not (isinstance(error, float) and np.isnan(error)):
                    body = fmt.error(rid, error)
                else:
                    ordered = sorted((p for p in preds if p["pos"] is not None), key=lambda p: p["pos"])
                    if any(p["y"] is None for p in ordered):  # not expected: blank texts were refused above
                        body = fmt.error(rid, EMPTY_TEXT_ERROR)
                    elif fmt.task != "embedding":  # Predictor.predict's results, as JSON
                        body = fmt.ok(rid, [json.loads(p["y"]) for p in ordered], bool(single))
                    else:
                        arr = (np.stack([np.asarray(p["y"], dtype=np.float32) for p in ordered]) if ordered
                               else np.zeros((0, 0), dtype=np.float32))
                        body = fmt.ok(rid, arr, bool(single))
                values_out.append(json.dumps(body, separators=(",", ":")).encode())
            yield pd.DataFrame({"key": pdf["key"], "value": values_out})


class ResponseBuilder:
    """Kafka request rows -> Kafka response rows through the bertopt Spark UDF; made once per query (the artifact
    is read and the UDF built once, not per micro-batch). Embedding models answer with the UDF's embedding column;
    task models with its ``result`` column (``Predictor.predict``'s result), so responses equal the bridge's."""

    def __init__(self, artifact, *, spark=None, batch_size: int = 32,
                 max_texts_per_request: int = MAX_TEXTS_PER_REQUEST, max_text_chars: int = MAX_TEXT_CHARS,
                 max_request_bytes: int = MAX_REQUEST_BYTES, threads: int | None = None, provider: str = "auto",
                 archive: str | None = None, ship: bool = False, partitions: int | None = None):
        from bertopt.runtime.tasks import AGGREGATIONS, task_of
        from bertopt.spark.udf import RESULT, _active_session, _load_on_driver, _ref_for, make_options, predict_udf

        for name, value in (("max_texts_per_request", max_texts_per_request), ("max_text_chars", max_text_chars),
                            ("max_request_bytes", max_request_bytes)):
            if value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if partitions is not None and partitions < 1:
            raise UserError(f"partitions must be at least 1, got {partitions}")
        self.spark = _active_session(spark)
        self.partitions = partitions or max(1, self.spark.sparkContext.defaultParallelism)
        self.art = _load_on_driver(artifact)
        self.task = task_of(self.art)
        self.max_texts = max_texts_per_request
        self.max_text_chars, self.max_request_bytes = max_text_chars, max_request_bytes
        if self.task == "embedding":
            self.udf = predict_udf(self.art, batch_size=batch_size, threads=threads, provider=provider,
                                   spark=self.spark, archive=archive, ship=ship, max_text_chars=max_text_chars)
        else:
            aggregations = AGGREGATIONS if self.task == "token-classification" else ("simple",)
            self.options = {a: make_options(self.art, self.spark, [RESULT], batch_size=batch_size, max_seq_len=None,
                                            provider=provider, threads=threads, load_log=None, aggregation=a,
                                            max_text_chars=max_text_chars)
                            for a in aggregations}
            self.ref = _ref_for(self.spark, self.art, archive, ship)

    def responses(self, requests):
        """``requests``: a DataFrame with ``key`` and ``value`` (binary or string; ``partition``/``offset`` are used
        in log lines when present) -> a DataFrame of ``key`` (binary), ``value`` (binary JSON), one row per
        answerable request."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import (
            ArrayType,
            BinaryType,
            BooleanType,
            IntegerType,
            LongType,
            StringType,
            StructField,
            StructType,
        )

        for col in ("key", "value"):
            if col not in requests.columns:
                raise UserError(f"the requests DataFrame has no '{col}' column (columns: "
                                f"{', '.join(requests.columns)}); pass the Kafka source's rows")
        has_position = {"partition", "offset"} <= set(requests.columns)
        cols = ["key", "value"] + (["partition", "offset"] if has_position else [])
        item = StructType([StructField("text", StringType(), False), StructField("pair", StringType(), True)])
        parsed_schema = StructType([
            StructField("key", BinaryType(), True), StructField("rid", StringType(), False),
            StructField("single", BooleanType(), False), StructField("items", ArrayType(item), False),
            StructField("aggregation", StringType(), False), StructField("error", StringType(), True)])
        # The repartition spreads the texts over `partitions` tasks (a topic may have fewer partitions than the
        # cluster has cores) and ends the parsing stage: a task then runs one Python step at a time, so a worker
        # parsing requests never sits next to a worker holding the model (twice the workers, twice the loads).
        parsed = (requests.select(*cols)
                  .mapInPandas(_ParseRequests(self.max_texts, has_position, self.task, self.art.model_info,
                                              self.max_text_chars, self.max_request_bytes), parsed_schema)
                  .withColumn("req_no", F.monotonically_increasing_id())
                  .repartition(self.partitions))
        exploded = parsed.select("req_no", "key", "rid", "single", "error", "aggregation",
                                 F.posexplode_outer("items").alias("pos", "item"))
        exploded = exploded.select("req_no", "key", "rid", "single", "error", "aggregation", "pos",
                                   F.col("item.text").alias("text"), F.col("item.pair").alias("pair"))
        if self.task == "embedding":
            predicted = exploded.withColumn("y", self.udf("text"))
        else:
            predicted_schema = StructType([
                StructField("req_no", LongType(), False), StructField("key", BinaryType(), True),
                StructField("rid", StringType(), False), StructField("single", BooleanType(), False),
                StructField("error", StringType(), True), StructField("pos", IntegerType(), True),
                StructField("y", StringType(), True)])
            predicted = exploded.mapInPandas(_PredictTasks(self.ref, self.options), predicted_schema)
        gathered = predicted.groupBy("req_no").agg(
            F.first("key").alias("key"), F.first("rid").alias("rid"), F.first("single").alias("single"),
            F.first("error").alias("error"), F.collect_list(F.struct("pos", "y")).alias("preds"))
        out_schema = StructType([StructField("key", BinaryType(), True), StructField("value", BinaryType(), False)])
        return gathered.mapInPandas(_FormatResponses(self.art.model_info, self.art.digest), out_schema)


def kafka_responses(requests, artifact, **options):
    """Kafka request rows (``key``, ``value``) -> response rows (``key``, ``value``), as ``bertopt kafka`` answers
    them. ``options``: ``batch_size``, ``max_texts_per_request``, ``max_text_chars``, ``max_request_bytes`` (the
    bridge's per-request bounds, same defaults), ``threads``, ``provider``, ``archive``,
    ``ship`` (as for ``predict_udf``), ``partitions`` (tasks the texts are spread over; default: the session's
    default parallelism)."""
    return ResponseBuilder(artifact, spark=requests.sparkSession, **options).responses(requests)


# -- the streaming query ----------------------------------------------------------------------------------------
class _RespondToBatch:
    """The foreachBatch function: answer one micro-batch and hand the responses to ``sink``."""

    def __init__(self, builder: ResponseBuilder, sink: Callable[[Any, int], None]):
        self.builder, self.sink = builder, sink

    def __call__(self, batch_df, epoch_id: int) -> None:
        self.sink(self.builder.responses(batch_df), epoch_id)


def start_response_stream(source, artifact, sink: Callable[[Any, int], None], checkpoint: str, *,
                          query_name: str | None = None, trigger_seconds: float | None = None, **options):
    """Start the checkpointed query ``source`` (a streaming DataFrame with the Kafka source's columns) -> responses
    -> ``sink(responses_df, epoch_id)``. ``kafka_stream_job`` uses it with the Kafka source and sink."""
    if not source.isStreaming:
        raise UserError("start_response_stream needs a streaming DataFrame (spark.readStream...); for a static one "
                        "use kafka_responses(df, artifact)")
    if not str(checkpoint or "").strip():
        raise UserError("a checkpoint location is required (a folder on a file system every node can reach, e.g. "
                        "hdfs:///checkpoints/bert-requests): it records the request offsets already answered")
    builder = ResponseBuilder(artifact, spark=source.sparkSession, **options)
    writer = source.writeStream.foreachBatch(_RespondToBatch(builder, sink)).option("checkpointLocation",
                                                                                     str(checkpoint))
    if query_name:
        writer = writer.queryName(query_name)
    if trigger_seconds:
        writer = writer.trigger(processingTime=f"{float(trigger_seconds)} seconds")
    return writer.start()


def _kafka_options(kafka_options: dict[str, str] | None) -> dict[str, str]:
    """Consumer/producer properties for Spark's Kafka source and sink: ``kafka.`` prefixed as Spark expects."""
    out = {}
    for key, value in (kafka_options or {}).items():
        out[key if key.startswith("kafka.") else f"kafka.{key}"] = str(value)
    return out


def kafka_stream_job(spark, artifact, bootstrap: str, request_topic: str, response_topic: str, checkpoint: str, *,
                     batch_size: int = 32, max_texts_per_request: int = MAX_TEXTS_PER_REQUEST,
                     max_text_chars: int = MAX_TEXT_CHARS, max_request_bytes: int = MAX_REQUEST_BYTES,
                     max_offsets_per_trigger: int | None = None,
                     starting_offsets: str = "earliest", trigger_seconds: float | None = None,
                     kafka_options: dict[str, str] | None = None, query_name: str | None = None,
                     threads: int | None = None, provider: str = "auto", archive: str | None = None,
                     ship: bool = False, partitions: int | None = None):
    """Start the Structured Streaming job request topic -> bertopt UDF -> response topic; returns the
    ``StreamingQuery`` (``.awaitTermination()``, ``.stop()``, ``.lastProgress``).

    Needs Spark's Kafka connector (``kafka_package(spark)`` names it: ``spark-submit --packages ...``); without
    it a UserError says so. ``kafka_options``: Kafka client properties for both sides (``security.protocol``,
    ``sasl.jaas.config``, ...); ``max_offsets_per_trigger`` bounds a micro-batch; ``partitions``: the Spark tasks
    a micro-batch's texts are spread over (default: the session's default parallelism).
    """
    from bertopt.artifact import Artifact

    if not bootstrap or not request_topic or not response_topic:
        raise UserError("bootstrap, request_topic and response_topic must not be empty")
    if request_topic == response_topic:
        raise UserError(f"the request and response topics are both {request_topic!r}; the job would consume its own "
                        "responses: use two topics")
    if max_offsets_per_trigger is not None and max_offsets_per_trigger < 1:
        raise UserError(f"max_offsets_per_trigger must be at least 1, got {max_offsets_per_trigger}")
    art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    extra = _kafka_options(kafka_options)
    reader = (spark.readStream.format(KAFKA_SOURCE).option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", request_topic).option("startingOffsets", starting_offsets)
              .option("failOnDataLoss", "true").options(**extra))
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    try:
        source = reader.load()
    except Exception as exc:
        if _is_missing_source(exc):
            raise missing_connector_error(spark) from None
        raise

    def to_kafka(responses, epoch_id: int) -> None:
        (responses.write.format(KAFKA_SOURCE).option("kafka.bootstrap.servers", bootstrap)
         .option("topic", response_topic).options(**extra).save())

    return start_response_stream(source, art, to_kafka, checkpoint, query_name=query_name,
                                 trigger_seconds=trigger_seconds, batch_size=batch_size,
                                 max_texts_per_request=max_texts_per_request, max_text_chars=max_text_chars,
                                 max_request_bytes=max_request_bytes, threads=threads, provider=provider,
                                 archive=archive, ship=ship, partitions=partitions)
