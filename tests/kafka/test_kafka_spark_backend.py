"""`bertopt kafka --backend spark` against a real broker (tansu), as real processes each running Spark local[2]:
values equal to the in-process runtime, malformed requests answered with errors, SIGKILL mid-stream and restart."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import pytest
from test_kafka_bridge import check_responses, make_requests, response_values

from bertopt.harness import alive

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.spark]

SPARK = ("--backend", "spark", "--master", "local[2]", "--partitions", "2")


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    from bertopt.runtime import Predictor

    predictor = Predictor(tiny_onnx.path, threads=1)  # fp32 ONNX: batch-invariant, so batches may differ
    return lambda texts: predictor.encode(texts)


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the Spark JVM the bridge launched, ...)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_kafka_spark_backend_answers_2000_requests_like_the_runtime_and_malformed_ones_with_errors(
        kafka, tiny_onnx, reference, read_final_stats, tmp_path):
    n = 2000
    req_topic, resp_topic = kafka.topics(partitions=3)
    good, expected_texts = make_requests(n, seed=11)
    erroneous = {
        "e-none": ({"id": "e-none"}, "exactly one of 'text'"),
        "e-int": ({"id": "e-int", "text": 5}, "'text' must be a string, got int"),
        "e-many": ({"id": "e-many", "texts": ["w"] * 300}, "300 texts in one request exceed the limit of 256"),
        "e-blank": ({"id": "e-blank", "texts": ["fine", "  "]}, "empty or whitespace-only text has no prediction"),
        "e-surrogate": ({"id": "e-surrogate", "texts": ["fine", "a\ud800b"]}, "'texts'[1]: a lone surrogate U+D800"),
    }
    no_id = [b"not json {", json.dumps({"text": "no id"}).encode(), None, b"[" * 100_000 + b"]" * 100_000]
    bad_values = [(None, v) for v in no_id] + [(f"k-{k}".encode(), json.dumps(body).encode())
                                                 for k, (body, _) in erroneous.items()]
    values = [(f"k-{r['id']}".encode(), json.dumps(r).encode()) for r in good]
    rng = random.Random(12)
    for bad in bad_values:
        values.insert(rng.randrange(len(values)), bad)
    values.append((b"k-empty", json.dumps({"id": "empty", "texts": []}).encode()))
    positions = kafka.produce(req_topic, values)
    total_answers = n + len(erroneous) + len(no_id) + 1
    load_log = tmp_path / "loads.tsv"

    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, *SPARK, "--max-batch", "100",
                                        group="spark-e2e", env={"BERTOPT_SPARK_LOAD_LOG": str(load_log)})
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= total_answers, timeout_s=400)
    assert proc.poll() is None, log_file.read_text()[-3000:]
    assert len(messages) == total_answers, f"{len(messages)} of {total_answers}\n{log_file.read_text()[-3000:]}"

    bodies = [json.loads(m.value()) for m in messages]
    errors = {b["id"]: b for b in bodies if "error" in b}
    assert set(errors) == set(erroneous) | {None}
    assert sum(b["id"] is None for b in bodies) == len(no_id)  # answered with "id": null
    for key, (_, message) in erroneous.items():
        assert message in errors[key]["error"]
        assert errors[key]["artifact"] == tiny_onnx.digest
    assert [b for b in bodies if b["id"] == "empty"] == [{"id": "empty", "embeddings": [],
                                                         "artifact": tiny_onnx.digest}]
    good_messages = [m for m, b in zip(messages, bodies) if "error" not in b and b["id"] != "empty"]
    by_id = check_responses(good_messages, expected_texts, reference, tiny_onnx.digest)  # values within 1e-5
    assert set(by_id) == set(expected_texts)
    assert all(len(v) == 1 for v in by_id.values())

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    stats = read_final_stats(log_text)
    assert stats["consumed"] == stats["committed"] == len(values)
    assert stats["produced"] == total_answers
    assert stats["no_id"] == len(no_id)
    assert stats["errors"] == len(no_id) + len(erroneous)
    assert stats["texts"] == sum(len(t) for t in expected_texts.values())  # the blank request never ran
    assert stats["batches"] >= n // 100
    # one Spark session for the whole stream, and the model loaded once per Python worker (local[2]: at most 2),
    # not once per batch
    assert log_text.count("spark session up on local[2]") == 1
    loads = [line for line in load_log.read_text().splitlines() if line.strip()]
    assert 1 <= len(loads) <= 2, loads
    last = {}
    for part, offset in positions:
        last[part] = max(last.get(part, -1), offset)
    assert kafka.committed("spark-e2e", req_topic, 3) == {p: o + 1 for p, o in last.items()}


def test_kafka_spark_backend_sigkill_mid_stream_then_restart_answers_every_request(kafka, tiny_onnx, reference,
                                                                                   read_final_stats):
    n = 2000
    req_topic, resp_topic = kafka.topics(partitions=3)
    requests, expected_texts = make_requests(n, seed=13)
    kafka.produce_requests(req_topic, requests)

    first, log1 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, *SPARK, "--max-batch", "40",
                                     group="spark-kill")
    answered_before = kafka.responses(resp_topic, until=lambda ms: len(ms) >= 300, timeout_s=300)
    assert len(answered_before) >= 300, log1.read_text()[-3000:]
    spark_processes = children_of(first.pid)
    assert spark_processes, "the bridge runs no Spark JVM"
    first.send_signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    # the Spark JVM (and its Python workers) notice the dead driver and exit: nothing is left holding cores
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in spark_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in spark_processes)

    second, log2 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, *SPARK, "--max-batch", "100",
                                      group="spark-kill")
    want_ids = set(expected_texts)
    messages = kafka.responses(resp_topic, timeout_s=400,
                               until=lambda ms: want_ids <= {json.loads(m.value())["id"] for m in ms})
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == 0, log2.read_text()[-3000:]

    by_id = check_responses(messages, expected_texts, reference, tiny_onnx.digest)
    missing = want_ids - set(by_id)
    assert not missing, f"{len(missing)} requests never answered, e.g. {sorted(map(str, missing))[:5]}"
    for rid, bodies in by_id.items():
        for body in bodies[1:]:  # answered before the kill and again after it: the same values
            np.testing.assert_allclose(response_values(body), response_values(bodies[0]), rtol=0, atol=1e-6,
                                       err_msg=f"id {rid!r}")
    stats = read_final_stats(log2.read_text())
    assert stats["consumed"] > 0 and stats["committed"] == stats["consumed"] and stats["errors"] == 0
    # the second bridge resumed from the first one's last commit (at most the batch in flight is answered twice)
    assert stats["consumed"] <= n - len({json.loads(m.value())["id"] for m in answered_before}) + 40
