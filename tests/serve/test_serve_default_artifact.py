"""Served = validated: the ZeroMQ server returns what the in-process runtime returns for the default artifact,
whatever batches the texts arrive in (alone, in shuffled groups of 7, 32 at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt.data import mixed_text
from bertopt.runtime import Predictor
from bertopt.testing import batch_compositions

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_server_matches_in_process_in_every_batch_composition(default_artifact, start_server):
    texts = mixed_text()[:64]
    want = Predictor(default_artifact).encode(texts)
    server = start_server(default_artifact.path, num_worker=2)
    assert "batch-dependent" not in server.log()  # the default artifact is batch-invariant: no warning
    worst = 0.0
    with server.client() as client:
        for batch in batch_compositions(texts):
            got = client.encode([texts[i] for i in batch])
            worst = max(worst, float(np.abs(got - want[batch]).max()))
    assert worst <= 1e-5, worst
