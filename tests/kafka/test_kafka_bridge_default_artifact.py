"""Served = validated: the Kafka bridge answers with what the in-process runtime returns for the default artifact,
whatever batches the requests are grouped into (single texts, lists of 7, bridge batches of 1 and 32), within the
batch deviation the artifact's own validation measured."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from served_checks import served_deviation

from bertopt.data import mixed_text
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.mark.parametrize("max_batch", ["1", "32"])
def test_bridge_matches_in_process_in_every_batch_composition(kafka, default_artifact, max_batch):
    texts = mixed_text()[:48]
    want = Predictor(default_artifact).encode(texts)
    order = list(range(len(texts)))
    random.Random(int(max_batch)).shuffle(order)
    requests, wanted = [], {}
    for i in range(24):  # single texts
        requests.append({"id": i, "text": texts[order[i]]})
        wanted[i] = [order[i]]
    for j, start in enumerate(range(24, 48, 7)):  # lists of (up to) 7 other neighbours
        rid = f"list-{j}"
        requests.append({"id": rid, "texts": [texts[k] for k in order[start:start + 7]]})
        wanted[rid] = order[start:start + 7]
    req_topic, resp_topic = kafka.topics(partitions=2)
    kafka.produce_requests(req_topic, requests)
    proc, log_file = kafka.start_bridge(default_artifact.path, req_topic, resp_topic, "--max-batch", max_batch,
                                        group=f"served-{max_batch}")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(requests), timeout_s=120)
    assert len(messages) >= len(requests), log_file.read_text()[-3000:]
    # the warning says what validation measured (tune's winner differs by machine: static int8 is batch-dependent)
    assert ("batch-dependent" in log_file.read_text()) == (default_artifact.batch_dependence_warning() is not None)
    bound = default_artifact.served_deviation_bound()
    worst = 0.0
    for msg in messages:
        body = json.loads(msg.value())
        assert "error" not in body, body
        got = np.asarray([body["embedding"]] if "embedding" in body else body["embeddings"], dtype=np.float32)
        worst = max(worst, served_deviation(got, want[wanted[body["id"]]]))
    assert worst <= bound, (worst, bound)
