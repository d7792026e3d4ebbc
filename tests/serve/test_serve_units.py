"""The scheduler, the sink's reassembly/de-duplication and request parsing, without sockets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertopt.protocol import LANE_BULK, ProtocolError, parse_request
from bertopt.serve.sink import Assembler
from bertopt.serve.ventilator import FairQueue, MiniJob


def job(client: bytes, index: int) -> MiniJob:
    return MiniJob(index, client, b"1", index, 99, 99, 0, b"[]", LANE_BULK)


def test_fair_queue_round_robins_clients_and_requeues_first():
    q = FairQueue()
    for i in range(5):
        q.push(job(b"flood", i))
    q.push(job(b"small", 0))
    order = [(j.identity, j.index) for j in (q.pop(), q.pop(), q.pop())]
    assert order == [(b"flood", 0), (b"small", 0), (b"flood", 1)]
    q.push(job(b"flood", 1), front=True)  # re-sent after a worker died: next in line
    assert (q.pop().index, len(q)) == (1, 3)


def test_assembler_puts_rows_in_place_and_drops_duplicates():
    asm = Assembler()
    a, b = np.ones((2, 3), np.float32), np.full((1, 3), 2, np.float32)
    assert asm.result(b"c", b"1", 1, 2, 3, 2, 3, b.tobytes()) is None
    assert asm.result(b"c", b"1", 1, 2, 3, 2, 3, b.tobytes()) is None  # the same job again
    reply = asm.result(b"c", b"1", 0, 2, 3, 0, 3, a.tobytes())
    info = json.loads(reply[1])
    out = np.frombuffer(bytes(reply[2]), dtype=np.float32).reshape(info["shape"])
    np.testing.assert_array_equal(out, np.vstack([a, b]))
    assert asm.result(b"c", b"1", 0, 2, 3, 0, 3, a.tobytes()) is None  # after the reply
    assert asm.error(b"c", b"1", "late error") is None
    assert asm.counters["duplicates_dropped"] == 3 and asm.counters["replies"] == 1


def test_parse_request_accepts_tokenized_and_rejects_bad_payloads():
    req = parse_request([b"id", json.dumps([["hello", "world"], "x"]).encode(), b"3", b"2"], 1000)
    assert req.texts == ["hello world", "x"] and req.key == (b"id", b"3")
    with pytest.raises(ProtocolError, match="no reply address") as exc:
        parse_request([b"x", b"y"], 1000)
    assert exc.value.identity is None
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_request([b"id", b'["' + b"a" * 2000 + b'"]', b"1", b"1"], 1000)
