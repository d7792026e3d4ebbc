"""Task models through `bertopt kafka --backend spark` on a real broker (tansu) and a real Spark local[2] session:
for the same request messages, every response document (classification labels and all class scores, NER entities
with each aggregation, rerank scores of (query, passage) pairs, SPLADE vectors, embeddings) equals the one the
local backend writes, error responses included, and so do the Structured Streaming job's (``kafka_responses``);
the CLI answers a rerank model's pairs the same way."""

from __future__ import annotations

import json
import signal
import threading

import pytest
from task_models import TASK_TEXTS

from bertopt.kafka.bridge import BridgeConfig, KafkaBridge, LocalBackend
from bertopt.runtime import Predictor
from bertopt.spark.streaming import EMPTY_TEXT_ERROR

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.spark]

QUERY = "the cat sat on a mat"
AGGREGATIONS = ("none", "simple", "first", "average", "max")
TOLERANCE = 1e-5  # fp32 ONNX run in other batches (other padding) on the executors


@pytest.fixture(scope="module")
def spark():
    from bertopt.spark.session import get_session

    session = get_session("local[2]", app_name="bertopt-kafka-tasks", conf={"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


def assert_same_document(got, want, where="response"):
    """Same JSON structure, keys, strings and ints; floats within TOLERANCE."""
    if isinstance(want, bool) or want is None or isinstance(want, str):
        assert got == want, f"{where}: {got!r} != {want!r}"
    elif isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if isinstance(want, int) and isinstance(got, int):
            assert got == want, f"{where}: {got} != {want}"
        else:
            assert got == pytest.approx(want, abs=TOLERANCE), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same_document(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_document(g, w, f"{where}[{i}]")
    else:
        raise AssertionError(f"{where}: unexpected value {want!r}")


def answer(kafka, backend, requests: list[dict], group: str) -> dict:
    """Run a bridge in this process on ``backend`` until every request is answered; responses by id."""
    req_topic, resp_topic = kafka.topics(partitions=2)
    kafka.produce_requests(req_topic, requests)
    cfg = BridgeConfig(bootstrap=kafka.bootstrap, request_topic=req_topic, response_topic=resp_topic,
                       group_id=group, max_batch=6, max_wait_ms=20, stats_interval_s=60)
    bridge = KafkaBridge(backend, cfg)
    failed: list[BaseException] = []

    def run():
        try:
            bridge.run(install_signal_handlers=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(requests) or failed, timeout_s=180)
    finally:
        bridge.request_stop()
        thread.join(120)
    assert not failed, failed
    assert not thread.is_alive()
    assert bridge.counters.committed == len(requests)
    bodies = {}
    for msg in messages:
        body = json.loads(msg.value())
        assert msg.key() == f"k-{body['id']}".encode()
        bodies[body["id"]] = body
    assert len(messages) == len(bodies) == len(requests), sorted(map(str, bodies))
    return bodies


def stream_responses(spark, art, requests: list[dict]) -> dict:
    """``kafka_responses`` (the streaming job's per-batch step) on a Kafka-shaped DataFrame of ``requests``."""
    from bertopt.spark.session import worker_errors
    from bertopt.spark.streaming import kafka_responses

    rows = [(f"k-{r['id']}".encode(), json.dumps(r).encode(), i % 2, i) for i, r in enumerate(requests)]
    df = spark.createDataFrame(rows, "key binary, value binary, partition int, offset long")
    with worker_errors():
        out = kafka_responses(df, art.path, partitions=2, batch_size=4, threads=1).collect()
    bodies = {}
    for row in out:
        body = json.loads(row["value"])
        assert row["key"] == f"k-{body['id']}".encode() and body["id"] not in bodies
        bodies[body["id"]] = body
    return bodies


def task_requests(task: str) -> list[dict]:
    singles = [{"id": i, "text": t} for i, t in enumerate(TASK_TEXTS)]
    if task == "rerank":
        passages = TASK_TEXTS + ["the cat sat on a mat", "zebra quux"]
        return [{"id": i, "text": QUERY, "pair": p} for i, p in enumerate(passages)] + [
            {"id": "all", "texts": [QUERY] * len(passages), "pairs": passages},
            {"id": "swapped", "texts": passages[:3], "pairs": [QUERY] * 3},
            {"id": "no-pair", "text": QUERY},                                    # refused: no passage
            {"id": "no-pairs", "texts": [QUERY, QUERY]}]
    requests = singles + [{"id": "all", "texts": TASK_TEXTS},
                          {"id": "with-pair", "text": TASK_TEXTS[0], "pair": TASK_TEXTS[1]},  # single-text model
                          {"id": "empty", "texts": []}]
    if task == "token-classification":
        requests += [{"id": f"agg-{a}", "texts": TASK_TEXTS, "aggregation": a} for a in AGGREGATIONS]
        requests += [{"id": "agg-one", "text": TASK_TEXTS[3], "aggregation": "first"},
                     {"id": "agg-bad", "text": "x", "aggregation": "mean"}]              # refused
    else:
        requests.append({"id": "agg-ignored", "text": TASK_TEXTS[2], "aggregation": "mean"})  # not NER: ignored
    return requests


MODELS = [("classification", "roberta"), ("multi-label", "bert"), ("token-classification", "roberta"),
          ("token-classification", "bert"), ("rerank", "bert"), ("sparse-embedding", "bert")]


def test_kafka_spark_backend_answers_task_models_like_the_local_backend(kafka, task_artifact, tiny_onnx, spark):
    from bertopt.kafka.spark_backend import SparkBackend

    for n, (task, family) in enumerate(MODELS + [("embedding", "bert")]):
        art = tiny_onnx if task == "embedding" else task_artifact(task, family)[1]
        requests = task_requests(task) if task != "embedding" else [{"id": i, "text": t} for i, t in
                                                                    enumerate(TASK_TEXTS)] + [
            {"id": "all", "texts": TASK_TEXTS}, {"id": "with-pair", "text": "a", "pair": "b"}]
        blanks = [{"id": "blank", "texts": [TASK_TEXTS[0], "  "]}]
        if task == "rerank":
            blanks.append({"id": "blank-pair", "text": QUERY, "pair": " \t"})
        local = answer(kafka, LocalBackend(art.path, threads=1), requests, group=f"local-{n}")
        backend = SparkBackend(art.path, spark=spark, partitions=2, threads=1, batch_size=4)
        got = answer(kafka, backend, requests + blanks, group=f"spark-{n}")
        assert backend.batches > 0 and backend.spark_seconds > 0  # the answers came from Spark jobs
        assert spark.sparkContext.master == "local[2]"  # the one session, not one per model
        for rid, want in local.items():
            assert_same_document(got[rid], want, f"{task}/{family} id {rid!r}")
        for blank in blanks:  # Spark has no prediction for blank text: an error, never a silent null
            assert got[blank["id"]] == {"id": blank["id"], "error": EMPTY_TEXT_ERROR, "artifact": art.digest}
        # the Structured Streaming job's per-batch transformation answers the same messages the same way
        streamed = stream_responses(spark, art, requests + blanks)
        assert set(streamed) == set(got)
        for rid, want in got.items():
            assert_same_document(streamed[rid], want, f"streamed {task}/{family} id {rid!r}")

        if task == "embedding":
            assert "embedding" in got[0] and "error" in got["with-pair"]
            continue
        assert got[0]["task"] == ("classification" if task == "multi-label" else task)
        predictor = Predictor(art)
        if task == "rerank":
            passages = next(r for r in requests if r["id"] == "all")["pairs"]
            scores = got["all"]["results"]
            # the passages reached the model: each pair scores differently, and as the runtime scores the pairs
            assert len({round(s, 6) for s in scores}) == len(scores)
            assert scores == pytest.approx(predictor.predict([QUERY] * len(passages), passages), abs=TOLERANCE)
            assert [got[i]["result"] for i in range(len(passages))] == pytest.approx(scores, abs=TOLERANCE)
            assert "scores (query, passage) pairs" in got["no-pair"]["error"]
            assert "scores (query, passage) pairs" in got["no-pairs"]["error"]
            continue
        want_all = json.loads(json.dumps(predictor.predict(TASK_TEXTS)))
        assert_same_document(got["all"]["results"], want_all, f"{task} Predictor.predict")
        assert "takes a single text, but text pairs were given" in got["with-pair"]["error"]
        assert got["empty"]["results"] == []
        if task in ("classification", "multi-label"):
            assert got["all"]["labels"] == [r["label"] for r in want_all]
            assert set(got[0]["result"]["scores"]) == set(art.model_info["id2label"].values())
        if task == "token-classification":
            for agg in AGGREGATIONS:
                want = json.loads(json.dumps(predictor.predict(TASK_TEXTS, aggregation=agg)))
                assert_same_document(got[f"agg-{agg}"]["results"], want, f"{family} aggregation {agg}")
            assert any(got["agg-none"]["results"]), "the tiny NER model found no entity: nothing compared"
            assert "index" in got["agg-none"]["results"][0][0]  # per-token entities keep every field
            assert "unknown aggregation 'mean'" in got["agg-bad"]["error"]
        if task == "sparse-embedding":
            assert all(len(r["indices"]) == len(r["values"]) > 0 for r in got["all"]["results"])


def test_kafka_cli_spark_backend_scores_rerank_pairs(kafka, task_artifact, read_final_stats):
    _, art = task_artifact("rerank", "roberta")
    req_topic, resp_topic = kafka.topics(partitions=2)
    passages = TASK_TEXTS[:4]
    requests = [{"id": "r", "texts": [QUERY] * 4, "pairs": passages},
                {"id": "s", "text": QUERY, "pair": TASK_TEXTS[4]},
                {"id": "nopair", "text": QUERY}]
    kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(art.path, req_topic, resp_topic, "--backend", "spark", "--master",
                                        "local[2]", "--partitions", "2", group="spark-rerank")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(requests), timeout_s=300)
    assert proc.poll() is None, log_file.read_text()[-3000:]
    assert len(messages) == len(requests), log_file.read_text()[-3000:]
    bodies = {json.loads(m.value())["id"]: json.loads(m.value()) for m in messages}
    want = Predictor(art).predict([QUERY] * 5, passages + [TASK_TEXTS[4]])
    assert len({round(w, 6) for w in want}) == 5  # distinct passages score differently
    assert bodies["r"]["task"] == "rerank" and bodies["r"]["artifact"] == art.digest
    assert bodies["r"]["results"] == pytest.approx(want[:4], abs=TOLERANCE)
    assert bodies["s"]["result"] == pytest.approx(want[4], abs=TOLERANCE)
    assert "scores (query, passage) pairs" in bodies["nopair"]["error"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    assert log_text.count("spark session up on local[2]") == 1 and "output result" in log_text
    stats = read_final_stats(log_text)
    assert stats["committed"] == stats["consumed"] == len(requests) and stats["texts"] == 5
