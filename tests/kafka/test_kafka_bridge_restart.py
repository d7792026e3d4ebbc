"""At-least-once: bridges SIGKILLed mid-stream (between producing and committing, and at a random moment) lose
nothing after a restart; duplicates are allowed and identical."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
from test_kafka_bridge import check_responses, make_requests, response_values

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    from bertopt.runtime import Predictor

    predictor = Predictor(tiny_onnx.path, threads=1)
    return lambda texts: predictor.encode(texts)


def test_kafka_sigkill_and_restart_answers_every_request(kafka, tiny_onnx, reference, read_final_stats):
    n = 3000
    req_topic, resp_topic = kafka.topics(partitions=3)
    requests, expected_texts = make_requests(n, seed=5)
    kafka.produce_requests(req_topic, requests)
    batch = ("--max-batch", "20")

    # 1. a bridge that dies in the at-least-once window: batch 5's responses are acknowledged, its offsets are not
    first, log1 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, *batch, group="kill",
                                     env={"BERTOPT_KAFKA_FAILPOINT": "kill-before-commit:5"})
    assert first.wait(60) == -signal.SIGKILL, log1.read_text()[-3000:]
    answered_by_first = kafka.responses(resp_topic, until=lambda ms: len(ms) >= 100, timeout_s=30)
    assert len(answered_by_first) == 100  # five batches of 20 produced, four committed

    # 2. a bridge SIGKILLed from outside at whatever point it has reached
    second, log2 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, *batch, group="kill")
    kafka.responses(resp_topic, until=lambda ms: len(ms) >= 1200, timeout_s=90)
    second.send_signal(signal.SIGKILL)
    assert second.wait(10) == -signal.SIGKILL

    # 3. a restarted bridge finishes the stream
    third, log3 = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "64", group="kill")
    want_ids = set(expected_texts)
    messages = kafka.responses(resp_topic, timeout_s=120,
                               until=lambda ms: want_ids <= {json.loads(m.value())["id"] for m in ms})
    third.send_signal(signal.SIGTERM)
    assert third.wait(30) == 0, log3.read_text()[-3000:]

    by_id = check_responses(messages, expected_texts, reference, tiny_onnx.digest)
    missing = want_ids - set(by_id)
    assert not missing, f"{len(missing)} requests never answered, e.g. {sorted(map(str, missing))[:5]}"
    duplicated = {rid: bodies for rid, bodies in by_id.items() if len(bodies) > 1}
    # batch 5 of the first bridge was answered and not committed, so it is answered again
    first_ids = [json.loads(m.value())["id"] for m in answered_by_first]
    assert set(first_ids[80:]) <= set(duplicated)
    for rid, bodies in duplicated.items():
        first_values = response_values(bodies[0])
        for body in bodies[1:]:
            assert body.keys() == bodies[0].keys()
            # another bridge may batch (and pad) the text differently: equal to float rounding, not bit for bit
            np.testing.assert_allclose(response_values(body), first_values, rtol=0, atol=1e-6, err_msg=f"id {rid!r}")
    stats = read_final_stats(log3.read_text())
    assert stats["consumed"] > 0  # the outside SIGKILL left work for the restarted bridge
    assert stats["committed"] == stats["consumed"] and stats["errors"] == 0
