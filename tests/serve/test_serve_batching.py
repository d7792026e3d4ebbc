"""The scheduler, the sink's reassembly/de-duplication and request parsing, without sockets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertopt.protocol import HTTP_IDENTITY, ProtocolError, parse_request
from bertopt.serve.batching import KIND_PAIR, FairQueue, Piece, cut_request, pack
from bertopt.serve.sink import Assembler


def job(client: bytes, index: int, tokens: int = 10, size: int = 1) -> Piece:
    return Piece(client, b"1", index, 99, 99, 0, ["x"] * size, tokens)


def test_fair_queue_round_robins_clients_and_requeues_first():
    q = FairQueue()
    for i in range(5):
        q.push(job(b"flood", i))
    q.push(job(b"small", 0))
    order = [(j.identity, j.index) for j in (q.pop(), q.pop(), q.pop())]
    assert order == [(b"flood", 0), (b"small", 0), (b"flood", 1)]
    q.push(job(b"flood", 1), front=True)  # re-sent after a worker died: next in line
    assert (q.pop().index, len(q)) == (1, 3)


def test_fair_queue_takes_out_every_piece_of_one_identity_and_keeps_its_counts():
    q = FairQueue()
    for i in range(3):
        q.push(Piece(b"gone", b"1", i, 3, 3, i, ["x"], 10))
    q.push(job(b"waiting", 0, tokens=7))
    removed = q.remove(b"gone")
    assert [p.index for p in removed] == [0, 1, 2]
    assert (len(q), q.tokens, q.clients(), q.requests) == (1, 7, 1, 0)
    assert q.pop().identity == b"waiting" and not q
    assert q.remove(b"never queued") == []


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


def test_assembler_drops_a_piece_that_does_not_fit_its_record_and_lives_on():
    # a piece of another shape under an open key (two requests under one key, before the server numbered its
    # requests) ended the sink with a numpy broadcast error, and every later request went unanswered
    asm = Assembler()
    first = np.ones((1, 4), np.float32)
    assert asm.result(b"c", b"1#1", 0, 3, 3, 0, 4, first.tobytes()) is None
    assert asm.result(b"c", b"1#1", 1, 3, 3, 2, 4, np.ones((2, 4), np.float32).tobytes()) is None  # rows 2-3 of 3
    assert asm.result(b"c", b"1#1", 2, 3, 3, 1, 8, np.ones((1, 8), np.float32).tobytes()) is None  # another width
    assert asm.result(b"c", b"1#1", 2, 9, 3, 1, 4, first.tobytes()) is None  # another count of pieces
    assert asm.result(b"c", b"1#2", 5, 2, 3, 0, 4, first.tobytes()) is None  # a piece index past the count
    assert asm.counters["misfits_dropped"] == 4
    reply = asm.result(b"c", b"1#1", 2, 3, 3, 1, 4, np.full((1, 4), 2, np.float32).tobytes())  # the real piece
    assert reply is None and asm.counters["misfits_dropped"] == 4
    reply = asm.result(b"c", b"1#1", 1, 3, 3, 2, 4, np.full((1, 4), 3, np.float32).tobytes())
    out = np.frombuffer(bytes(reply[2]), dtype=np.float32).reshape(json.loads(reply[1])["shape"])
    np.testing.assert_array_equal(out, [[1] * 4, [2] * 4, [3] * 4])
    assert asm.task_result(b"c", b"2#3", 0, 1, 2, 1, json.dumps([{"a": 1}, {"b": 2}]).encode()) is None
    assert asm.counters["misfits_dropped"] == 5


def test_the_client_sees_its_own_request_id_whatever_the_server_keys_it_by():
    from bertopt.protocol import client_request_id

    assert client_request_id(b"17#4") == b"17" and client_request_id(b"17") == b"17"


def test_parse_request_accepts_tokenized_and_rejects_bad_payloads():
    req = parse_request([b"id", json.dumps([["hello", "world"], "x"]).encode(), b"3", b"2"], 1000)
    assert req.texts == ["hello world", "x"] and req.key == (b"id", b"3")
    with pytest.raises(ProtocolError, match="no reply address") as exc:
        parse_request([b"x", b"y"], 1000)
    assert exc.value.identity is None
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_request([b"id", b'["' + b"a" * 2000 + b'"]', b"1", b"1"], 1000)
    for bad_id in (b"1\n", b"1#2", b" 1"):  # digits only: "#" is the server's own (protocol.SEQ_SEPARATOR)
        with pytest.raises(ProtocolError, match="request id"):
            parse_request([b"id", b'["a"]', bad_id, b"1"], 1000)


def test_cut_request_bounds_tokens_and_texts_per_piece_in_order():
    lengths = [10, 500, 10, 10, 10, 300, 300, 5]
    pieces = cut_request(b"c", b"1", list(range(8)), lengths, max_tokens=512, max_texts=3)
    assert [p.items for p in pieces] == [[0, 1], [2, 3, 4], [5], [6, 7]]
    assert [p.tokens for p in pieces] == [510, 30, 300, 305]
    assert [p.offset for p in pieces] == [0, 2, 5, 6]
    assert {(p.n_pieces, p.n_texts) for p in pieces} == {(4, 8)}
    # a text longer than the budget is a piece of its own, never dropped
    assert [p.items for p in cut_request(b"c", b"1", ["a", "b"], [900, 900], 512, 10)] == [["a"], ["b"]]


def test_pack_fills_the_budget_across_clients_and_keeps_kinds_apart():
    q = FairQueue()
    for i in range(4):
        q.push(job(f"client{i}".encode(), 0, tokens=100))
    q.push(Piece(b"pairs", b"1", 0, 1, 1, 0, [["q", "p"]], 50, KIND_PAIR))
    batch = pack(q, max_tokens=250, max_texts=100)
    assert [p.identity for p in batch] == [b"client0", b"client1"]
    batch = pack(q, max_tokens=1000, max_texts=100, skip=lambda p: p.identity == b"client3")
    assert [p.identity for p in batch] == [b"client2"]  # client3 skipped (failed), pairs are another kind
    assert [p.identity for p in pack(q, 1000, 100)] == [b"pairs"] and not q and q.tokens == 0


def test_zmq_clients_cannot_use_the_http_identity():
    with pytest.raises(ProtocolError, match="reserved") as exc:
        parse_request([HTTP_IDENTITY, b'["x"]', b"1", b"1"], 1000)
    assert exc.value.identity is None  # dropped, not answered into the HTTP front end


def test_a_server_listening_beyond_this_machine_says_what_it_leaves_open():
    # said on the server's log as it starts (bound on 127.0.0.1 by default: nothing to say); the suite never binds
    # beyond loopback, so the lines are checked on the configuration
    from bertopt.serve.server import ServeConfig, exposure_warnings

    assert exposure_warnings(ServeConfig(artifact="a", http_port=8080)) == []
    open_both = exposure_warnings(ServeConfig(artifact="a", bind="0.0.0.0", port=5555, port_out=5556, http_port=8080))
    assert open_both == [
        "listening on 0.0.0.0 without --curve-keys: anyone who reaches port 5555 can send requests, and anyone who "
        "subscribes to port 5556 reads every reply",
        "listening on 0.0.0.0 without --api-key: anyone who reaches port 8080 can send requests"]
    assert exposure_warnings(ServeConfig(artifact="a", bind="0.0.0.0", curve_keys="keys", http_port=8080,
                                         api_key="secret")) == []
