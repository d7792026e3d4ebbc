"""Served = validated: the ZeroMQ server returns what the in-process runtime returns for the default artifact,
whatever batches the texts arrive in (alone, in shuffled groups of 7, 32 at a time), within the batch deviation the
artifact's own validation measured (bf16 and int8 outputs move with their batch-mates by rounding)."""

from __future__ import annotations

import pytest
from served_checks import batch_compositions, served_deviation

from bertopt.data import mixed_text
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_server_matches_in_process_in_every_batch_composition(default_artifact, start_server):
    texts = mixed_text()[:64]
    want = Predictor(default_artifact).encode(texts)
    server = start_server(default_artifact.path, num_worker=2)
    # the warning at start-up says what validation measured: tune may pick a batch-dependent artifact (static int8
    # within the gate's 1e-3) on one machine and a batch-invariant one on another
    assert ("batch-dependent" in server.log()) == (default_artifact.batch_dependence_warning() is not None)
    bound = default_artifact.served_deviation_bound()
    worst = 0.0
    with server.client() as client:
        for batch in batch_compositions(texts):
            got = client.encode([texts[i] for i in batch])
            worst = max(worst, served_deviation(got, want[batch]))
    assert worst <= bound, (worst, bound)
