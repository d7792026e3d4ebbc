"""`bertopt kafka` against a real broker (tansu) as a real process: values, malformed requests, SIGTERM."""

from __future__ import annotations

import json
import random
import signal

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "run", "fast", "slow", "good", "bad", "model", "bert", "text",
         "hello", "world", "is", "of", "and", "to", "in", "it", "a", "runs", "ed", "zebra", "quux", "!", "?", ","]


def make_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def make_requests(n: int, seed: int) -> tuple[list[dict], dict]:
    """Mostly single-text requests with int ids, every 10th a 3-text request with a string id."""
    texts = make_texts(n * 3, seed)
    requests, expected_texts = [], {}
    for i in range(n):
        if i % 10 == 9:
            req = {"id": f"multi-{i}", "texts": texts[3 * i:3 * i + 3]}
            expected_texts[req["id"]] = req["texts"]
        else:
            req = {"id": i, "text": texts[3 * i]}
            expected_texts[i] = [req["text"]]
        requests.append(req)
    return requests, expected_texts


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    from bertopt.runtime import Predictor

    predictor = Predictor(tiny_onnx.path, threads=1)
    return lambda texts: predictor.encode(texts)


def response_values(body: dict) -> np.ndarray:
    return np.asarray([body["embedding"]] if "embedding" in body else body["embeddings"], dtype=np.float32)


def check_responses(messages, expected_texts: dict, reference, digest: str) -> dict:
    """Every response: known id, key = the request's key, the artifact digest, values = the in-process runtime."""
    by_id: dict = {}
    for msg in messages:
        body = json.loads(msg.value())
        assert "error" not in body, body
        rid = body["id"]
        assert rid in expected_texts, f"response for an unknown id {rid!r}"
        assert msg.key() == f"k-{rid}".encode()
        assert body["artifact"] == digest
        by_id.setdefault(rid, []).append(body)
    ids = list(by_id)
    flat = [t for rid in ids for t in expected_texts[rid]]
    want = reference(flat)
    start = 0
    for rid in ids:
        n = len(expected_texts[rid])
        for body in by_id[rid]:
            assert ("embedding" in body) == isinstance(rid, int)
            got = response_values(body)
            assert got.shape == (n, want.shape[1])
            np.testing.assert_allclose(got, want[start:start + n], rtol=0, atol=1e-5, err_msg=f"id {rid!r}")
        start += n
    return by_id


def test_kafka_end_to_end_values_match_runtime_and_sigterm_commits(kafka, tiny_onnx, reference, read_final_stats):
    n = 2000
    req_topic, resp_topic = kafka.topics(partitions=3)
    requests, expected_texts = make_requests(n, seed=1)
    positions = kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "64", group="e2e")

    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= n, timeout_s=90)
    assert proc.poll() is None, log_file.read_text()[-3000:]
    assert len(messages) == n, f"{len(messages)} responses of {n}\n{log_file.read_text()[-3000:]}"
    by_id = check_responses(messages, expected_texts, reference, tiny_onnx.digest)
    assert set(by_id) == set(expected_texts)
    assert all(len(v) == 1 for v in by_id.values())  # a clean run answers each request once

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    stats = read_final_stats(log_text)
    assert stats["consumed"] == n and stats["produced"] == n and stats["committed"] == n
    assert stats["errors"] == 0 and stats["no_id"] == 0
    assert stats["texts"] == sum(len(t) for t in expected_texts.values())
    assert stats["lag"] >= 0
    # the group's committed offsets are one past the last request of every partition
    last = {}
    for part, offset in positions:
        last[part] = max(last.get(part, -1), offset)
    assert kafka.committed("e2e", req_topic, 3) == {p: o + 1 for p, o in last.items()}


def test_kafka_malformed_requests_get_errors_and_the_stream_keeps_flowing(kafka, tiny_onnx, reference,
                                                                         read_final_stats):
    req_topic, resp_topic = kafka.topics(partitions=1)  # one partition: bad messages sit in front of good ones
    good, expected_texts = make_requests(300, seed=2)
    no_id = [b"not json {", b"[1, 2]", json.dumps({"text": "no id"}).encode(), None, b"\xff\xfe\x00",
               json.dumps({"id": None, "text": "null id"}).encode()]
    erroneous = {
        "e-none": ({"id": "e-none"}, "exactly one of 'text'"),
        "e-int": ({"id": "e-int", "text": 5}, "'text' must be a string, got int"),
        "e-list": ({"id": "e-list", "texts": ["a", 3]}, "'texts' must be a list of strings"),
        "e-both": ({"id": "e-both", "text": "x", "texts": ["y"]}, "exactly one of 'text'"),
        "e-many": ({"id": "e-many", "texts": ["w"] * 300}, "300 texts in one request exceed the limit of 256"),
    }
    bad_id = {"id": {"nested": 1}, "text": "x"}
    values: list[tuple[bytes | None, bytes | None]] = []
    bad_values = [(None, v) for v in no_id] + [(f"k-{k}".encode(), json.dumps(body).encode())
                                                 for k, (body, _) in erroneous.items()]
    bad_values.append((b"k-bad-id", json.dumps(bad_id).encode()))
    rng = random.Random(3)
    slots = sorted(rng.sample(range(len(good)), len(bad_values)))
    bad_iter = iter(bad_values)
    for i, req in enumerate(good):
        if slots and i == slots[0]:
            slots.pop(0)
            values.append(next(bad_iter))
        values.append((f"k-{req['id']}".encode(), json.dumps(req).encode()))
    values.append((b"k-empty", json.dumps({"id": "empty", "texts": []}).encode()))
    kafka.produce(req_topic, values)
    total_answers = len(good) + len(erroneous) + len(no_id) + 2  # + the bad id + the empty list

    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "16", group="bad")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= total_answers, timeout_s=60)
    assert len(messages) == total_answers, log_file.read_text()[-3000:]

    bodies = [json.loads(m.value()) for m in messages]
    errors = {json.dumps(b["id"]): b for b in bodies if "error" in b and b["id"] is not None}
    assert sum(b["id"] is None and "error" in b for b in bodies) == len(no_id)  # answered with "id": null
    for key, (_, message) in erroneous.items():
        body = errors[json.dumps(key)]
        assert message in body["error"]
        assert body["artifact"] == tiny_onnx.digest
    assert "'id' must be a string or a number" in errors[json.dumps(bad_id["id"])]["error"]
    assert len(errors) == len(erroneous) + 1
    empty = [b for b in bodies if b["id"] == "empty"]
    assert empty == [{"id": "empty", "embeddings": [], "artifact": tiny_onnx.digest}]
    good_messages = [m for m, b in zip(messages, bodies) if "error" not in b and b["id"] != "empty"]
    check_responses(good_messages, expected_texts, reference, tiny_onnx.digest)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    log_text = log_file.read_text()
    stats = read_final_stats(log_text)
    assert stats["consumed"] == len(values)
    assert stats["produced"] == total_answers
    assert stats["no_id"] == len(no_id)
    assert stats["errors"] == len(no_id) + len(erroneous) + 1
    assert stats["committed"] == len(values)
    assert log_text.count("error response (id null) to request") == len(no_id)


def test_kafka_sigterm_mid_stream_finishes_the_batch_commits_and_exits_0(kafka, tiny_onnx, reference,
                                                                        read_final_stats):
    n = 1500
    req_topic, resp_topic = kafka.topics(partitions=2)
    requests, expected_texts = make_requests(n, seed=4)
    positions = kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "5", group="term")
    kafka.responses(resp_topic, until=lambda ms: len(ms) >= 200, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    assert "finishing the batch in hand" in log_text
    stats = read_final_stats(log_text)
    assert 200 <= stats["consumed"] < n, stats  # it stopped mid-stream ...
    assert stats["produced"] == stats["committed"] == stats["consumed"], stats  # ... with nothing half done

    committed = kafka.committed("term", req_topic, 2)
    answered = {json.loads(m.value())["id"] for m in
                kafka.responses(resp_topic, until=lambda ms: len(ms) >= stats["produced"], timeout_s=30)}
    assert len(answered) == stats["produced"]
    # every committed request has its response; nothing beyond the commit was answered
    for req, (part, offset) in zip(requests, positions):
        assert (req["id"] in answered) == (offset < committed[part]), (req["id"], part, offset, committed)

    # a restarted bridge answers the rest, exactly once since the stop was clean
    proc2, log2 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "64", group="term")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= n, timeout_s=90)
    by_id = check_responses(messages, expected_texts, reference, tiny_onnx.digest)
    assert set(by_id) == set(expected_texts)
    assert all(len(v) == 1 for v in by_id.values())
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(30) == 0, log2.read_text()[-3000:]
