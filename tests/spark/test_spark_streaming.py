"""bertopt.spark.streaming without Spark's Kafka connector (not available here): the per-batch transformation on
a static DataFrame shaped like the Kafka source, the checkpointed streaming query on a file source with the same
schema, and the clear error where the connector is required."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertopt.errors import UserError

pytestmark = [pytest.mark.slow, pytest.mark.spark]

KAFKA_SOURCE_SCHEMA = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
                       "timestampType int")


def kafka_rows(values: list[tuple[bytes | None, bytes | None]], first_offset: int = 0) -> list[tuple]:
    import datetime as dt

    now = dt.datetime(2026, 1, 1)
    return [(key, value, "bert-requests", 0, first_offset + i, now, 0) for i, (key, value) in enumerate(values)]


def request(rid, text=None, texts=None) -> tuple[bytes, bytes]:
    body = {"id": rid}
    if text is not None:
        body["text"] = text
    if texts is not None:
        body["texts"] = texts
    return f"k-{rid}".encode(), json.dumps(body).encode()


GOOD = [request(1, text="the cat sat on the mat"), request("multi", texts=["a dog", "runs fast and far", "hi"]),
        request(3, text="hello world"), request("empty", texts=[])]
MALFORMED = {  # request -> the bridge's error message (an id: answered with an error)
    "e-int": ({"id": "e-int", "text": 5}, "'text' must be a string, got int"),
    "e-both": ({"id": "e-both", "text": "x", "texts": ["y"]}, "exactly one of 'text'"),
    "e-many": ({"id": "e-many", "texts": ["w"] * 5}, "5 texts in one request exceed the limit of 4"),
    "e-blank": ({"id": "e-blank", "text": " \t"}, "empty or whitespace-only text has no prediction"),
    "e-surrogate": ({"id": "e-surrogate", "texts": ["fine", "a\ud800b"]}, "'texts'[1]: a lone surrogate U+D800"),
    "e-long": ({"id": "e-long", "text": "x" * 41}, "41 characters, over the limit of 40"),
}
# no usable id: answered with "id": null (key, value, error)
NO_ID = [(None, b"not json {", "not JSON"), (None, None, "empty message"),
         (b"k", json.dumps({"text": "no id"}).encode(), "request has no 'id'"),
         (b"k-deep", b"[" * 100_000 + b"]" * 100_000, "nests more than 32 arrays/objects deep")]
UNANSWERABLE = [(key, value) for key, value, _ in NO_ID]


def by_id(rows) -> dict:
    """Responses by id (each answered once); those with "id": null under None, as a list of (key, body)."""
    out = {None: []}
    for row in rows:
        body = json.loads(row["value"])
        if body["id"] is None:
            out[None].append((row["key"], body))
            continue
        assert body["id"] not in out, f"answered twice: {body}"
        out[body["id"]] = (row["key"], body)
    return out


def test_kafka_responses_on_a_kafka_shaped_dataframe_match_the_runtime_and_the_bridge(spark, tiny_onnx, fresh_copy,
                                                                                       tmp_path, monkeypatch):
    from bertopt.runtime import Predictor
    from bertopt.spark.streaming import kafka_responses
    from bertopt.spark.udf import LOAD_LOG_ENV, read_load_log

    art = fresh_copy(tiny_onnx, "streamed")  # a path no worker has loaded: its loads are this test's only
    monkeypatch.setenv(LOAD_LOG_ENV, str(tmp_path / "loads.tsv"))
    values = GOOD[:2] + UNANSWERABLE[:1] + [(f"k-{k}".encode(), json.dumps(b).encode()) for k, (b, _) in
                                          MALFORMED.items()] + GOOD[2:] + UNANSWERABLE[1:]
    df = spark.createDataFrame(kafka_rows(values), KAFKA_SOURCE_SCHEMA).repartition(2)
    answered = by_id(kafka_responses(df, art.path, max_texts_per_request=4, max_text_chars=40,
                                     batch_size=2).collect())
    # parsing, predicting and formatting run as separate stages: local[2] never holds more than two Python workers,
    # so the model is loaded at most twice
    assert 1 <= len(read_load_log(tmp_path / "loads.tsv")) <= 2

    assert set(answered) == {1, "multi", 3, "empty", None} | set(MALFORMED)
    no_id = sorted(((key or b"", body["error"]) for key, body in answered[None]), key=lambda kb: kb[1])
    assert len(no_id) == len(NO_ID)
    for key, _, message in NO_ID:  # each answered once, keyed by its key, with its own error
        assert [k for k, error in no_id if message in error] == [key or b""]
    predictor = Predictor(tiny_onnx.path, threads=1)
    key, one = answered[1]
    assert key == b"k-1" and one["artifact"] == art.digest and set(one) == {"id", "embedding", "artifact"}
    np.testing.assert_allclose(one["embedding"], predictor.encode(["the cat sat on the mat"])[0], rtol=0, atol=1e-5)
    key, multi = answered["multi"]
    assert key == b"k-multi"
    np.testing.assert_allclose(multi["embeddings"], predictor.encode(["a dog", "runs fast and far", "hi"]),
                               rtol=0, atol=1e-5)  # in request order, although the UDF sorts by length
    assert answered["empty"][1] == {"id": "empty", "embeddings": [], "artifact": art.digest}
    for rid, (_, message) in MALFORMED.items():
        key, body = answered[rid]
        assert key == f"k-{rid}".encode()
        assert set(body) == {"id", "error", "artifact"} and message in body["error"]


def test_kafka_responses_answer_a_classifier_with_predictor_results_and_refuse_pairs_it_cannot_take(
        spark, tiny_classifier, tiny_onnx):
    from bertopt.messages import EMBEDDING_PAIRS_ERROR, ResponseFormat
    from bertopt.runtime import Predictor
    from bertopt.spark.streaming import kafka_responses

    texts = ["good movie", "a dog runs fast and far", "bad"]
    values = [request("one", text=texts[0]), request("many", texts=texts),
              (b"k-pair", json.dumps({"id": "pair", "text": "x", "pair": "y"}).encode())]
    df = spark.createDataFrame(kafka_rows(values), KAFKA_SOURCE_SCHEMA)
    answered = by_id(kafka_responses(df, tiny_classifier.path, batch_size=2).collect())
    fmt = ResponseFormat(tiny_classifier.model_info, tiny_classifier.digest)
    want = json.loads(json.dumps(Predictor(tiny_classifier.path, threads=1).predict(texts)))
    many = answered["many"][1]
    assert set(many) == set(fmt.ok("many", want, single=False)) == {"id", "task", "results", "labels", "artifact"}
    assert many["labels"] == [w["label"] for w in want]
    for got, w in zip(many["results"] + [answered["one"][1]["result"]], want + want[:1]):
        assert got["label"] == w["label"] and got["scores"] == pytest.approx(w["scores"], abs=1e-6)
    assert "takes a single text, but text pairs were given" in answered["pair"][1]["error"]

    df = spark.createDataFrame(kafka_rows(values[2:]), KAFKA_SOURCE_SCHEMA)
    assert by_id(kafka_responses(df, tiny_onnx.path).collect())["pair"][1]["error"] == EMBEDDING_PAIRS_ERROR


def test_response_stream_is_checkpointed_and_answers_each_request_once(spark, tiny_onnx, tmp_path):
    """The streaming query of kafka_stream_job with a file source of the Kafka source's schema in place of Kafka
    (and a Parquet sink in place of the Kafka sink): a restart from the checkpoint answers only new requests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertopt.runtime import Predictor
    from bertopt.spark.streaming import start_response_stream

    schema = spark.createDataFrame([], KAFKA_SOURCE_SCHEMA).schema
    incoming, answers, checkpoint = tmp_path / "incoming", tmp_path / "answers", tmp_path / "checkpoint"
    incoming.mkdir()
    names = ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
    arrow_schema = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
                              ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp", pa.timestamp("us")),
                              ("timestampType", pa.int32())])

    def arrive(name: str, values, first_offset: int) -> None:
        rows = kafka_rows(values, first_offset)
        table = pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)}, schema=arrow_schema)
        pq.write_table(table, incoming / f"{name}.tmp")
        (incoming / f"{name}.tmp").rename(incoming / f"{name}.parquet")  # the file source sees whole files only

    def to_parquet(responses, epoch_id: int) -> None:
        responses.write.mode("overwrite").parquet(str(answers / f"epoch={epoch_id}"))

    def run_until_caught_up() -> None:
        source = spark.readStream.schema(schema).option("pathGlobFilter", "*.parquet").parquet(str(incoming))
        query = start_response_stream(source, tiny_onnx.path, to_parquet, str(checkpoint), query_name="bertopt-test")
        try:
            query.processAllAvailable()
            assert query.exception() is None
        finally:
            query.stop()

    first = [request(i, text=f"request number {i} " * (i % 5 + 1)) for i in range(20)]
    arrive("a", first, 0)
    run_until_caught_up()
    second = [request(i, text=f"later request {i}") for i in range(20, 35)] + [(None, b"garbage")]
    arrive("b", second, 20)
    run_until_caught_up()  # a new query on the same checkpoint: file "a" is not read again

    rows = spark.read.parquet(str(answers)).collect()
    answered = by_id(rows)  # each request exactly once over both runs
    assert set(answered) == set(range(35)) | {None}
    assert [body["error"][:8] for _, body in answered[None]] == ["not JSON"]  # the garbage, answered once
    epochs = {json.loads(r["value"])["id"]: r["epoch"] for r in rows}
    assert max(epochs[i] for i in range(20)) < min(epochs[i] for i in range(20, 35))
    texts = [json.loads(v)["text"] for _, v in first + second[:-1]]
    want = Predictor(tiny_onnx.path, threads=1).encode(texts)
    got = np.asarray([answered[i][1]["embedding"] for i in range(35)], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_kafka_stream_job_without_the_connector_names_the_package_to_add(spark, tiny_onnx, tmp_path):
    from bertopt.spark.streaming import kafka_package, kafka_stream_job

    package = kafka_package(spark)
    assert package == f"org.apache.spark:spark-sql-kafka-0-10_2.13:{spark.version}"
    with pytest.raises(UserError) as exc:
        kafka_stream_job(spark, tiny_onnx.path, "127.0.0.1:9092", "bert-requests", "bert-responses",
                         str(tmp_path / "checkpoint"))
    message = str(exc.value)
    assert "Kafka connector is not on this session's classpath" in message
    assert f"--packages {package}" in message and "spark.jars.packages" in message
    assert "\n" not in message
    assert not (tmp_path / "checkpoint").exists()  # nothing started, nothing written


@pytest.mark.parametrize("args, kwargs, message", [
    (("127.0.0.1:9092", "same", "same"), {}, "the request and response topics are both 'same'"),
    (("", "a", "b"), {}, "must not be empty"),
    (("127.0.0.1:9092", "a", "b"), {"max_offsets_per_trigger": 0}, "max_offsets_per_trigger must be at least 1"),
])
def test_kafka_stream_job_checks_its_arguments_first(spark, tiny_onnx, tmp_path, args, kwargs, message):
    from bertopt.spark.streaming import kafka_stream_job

    with pytest.raises(UserError, match=message):
        kafka_stream_job(spark, tiny_onnx.path, *args, str(tmp_path / "ck"), **kwargs)


def test_start_response_stream_refuses_a_static_dataframe_and_a_missing_checkpoint(spark, tiny_onnx):
    from bertopt.spark.streaming import start_response_stream

    static = spark.createDataFrame(kafka_rows([request(1, text="x")]), KAFKA_SOURCE_SCHEMA)
    with pytest.raises(UserError, match="needs a streaming DataFrame"):
        start_response_stream(static, tiny_onnx.path, lambda df, epoch: None, "/tmp/unused")
    source = spark.readStream.format("rate").load().selectExpr("CAST(CAST(value AS STRING) AS BINARY) AS key",
                                                                 "CAST(CAST(value AS STRING) AS BINARY) AS value")
    with pytest.raises(UserError, match="a checkpoint location is required"):
        start_response_stream(source, tiny_onnx.path, lambda df, epoch: None, "")
