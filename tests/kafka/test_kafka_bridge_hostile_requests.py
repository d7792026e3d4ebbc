"""Hostile and careless Kafka requests against a real broker (tansu) and a real bridge process: each gets one error
response for itself, keyed by its message key, the bridge lives on and answers a good request with its
embedding; a bridge whose backend dies exits non-zero with one line saying so."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from bertopt.messages import MAX_JSON_DEPTH, MessageError, decode_bounded, parse_request

# limits lowered on the command line so the over-limit messages stay small
MAX_TEXT_CHARS = 5000
MAX_REQUEST_BYTES = 262144  # above the 100,000-deep nests (200 kB), so their depth is what fails

HOSTILE: dict[str, tuple[bytes | None, object, str]] = {  # key -> (message value, id answered, error fragment)
    "not-json": (b"not json {", None, "not JSON"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, None, f"nests more than {MAX_JSON_DEPTH} arrays/objects deep"),
    "deep-object": (b'{"id": "deep-object", "text": ' + b'{"a":' * 40_000 + b"1" + b"}" * 40_001, None,
                    "nests more than"),
    "not-utf8": (b'{"id": "cesu", "text": "a\xed\xa0\x80b"}', None, "not UTF-8"),
    "empty": (None, None, "empty message"),
    "no-id": (json.dumps({"text": "no id"}).encode(), None, "request has no 'id'"),
    "infinite-id": (b'{"id": Infinity, "text": "x"}', None, "Infinity is not a JSON value"),
    "bool-id": (b'{"id": true, "text": "x"}', None, "'id' must be a string or a finite number"),
    "too-big": (json.dumps({"id": "too-big", "texts": ["y" * 1000] * 300}).encode(), None,
                f"over the limit of {MAX_REQUEST_BYTES}"),
    "wrong-type": (json.dumps({"id": "wrong-type", "text": 5}).encode(), "wrong-type",
                   "'text' must be a string, got int"),
    "texts-not-list": (json.dumps({"id": "texts-not-list", "texts": "abc"}).encode(), "texts-not-list",
                       "'texts' must be a list of strings"),
    "surrogate": (json.dumps({"id": "surrogate", "text": "a\ud800b"}).encode(), "surrogate",
                  "'text': a lone surrogate U+D800 at character 1"),
    "surrogate-in-list": (json.dumps({"id": "surrogate-in-list", "texts": ["fine", "x\udfffy"]}).encode(),
                          "surrogate-in-list", "'texts'[1]: a lone surrogate U+DFFF"),
    "long": (json.dumps({"id": "long", "text": "x" * (MAX_TEXT_CHARS + 1)}).encode(), "long",
             f"{MAX_TEXT_CHARS + 1} characters, over the limit of {MAX_TEXT_CHARS}"),
    "many": (json.dumps({"id": "many", "texts": ["w"] * 300}).encode(), "many",
             "300 texts in one request exceed the limit of 256"),
}
GOOD = {"good-1": {"id": "good-1", "text": "the cat sat on the mat"},
        "good-2": {"id": 2, "texts": ["hello world", "a dog runs fast"]},
        "good-3": {"id": "good-3", "text": "\U0001F600 an emoji (a surrogate pair in the JSON escapes)"}}


def test_decode_bounded_checks_size_and_depth_before_parsing():
    assert decode_bounded(b'{"a": [1, "]]]]"], "b": "\\"[[["}') == {"a": [1, "]]]]"], "b": '"[[['}
    assert decode_bounded(b"[" * 3 + b"]" * 3, max_depth=3) == [[[]]]
    for raw, max_bytes, max_depth, message in [
        (b"[" * 4 + b"]" * 4, 100, 3, "nests more than 3"),
        (b"[" * 1_000_000, 2_000_000, 32, "nests more than 32"),   # RecursionError territory for json.loads
        (b'"' + b"x" * 200 + b'"', 100, 32, "has 202 bytes, over the limit of 100"),
        (b"{", 100, 32, "not JSON"),
        (b"\xff", 100, 32, "not UTF-8"),
        (b"NaN", 100, 32, "NaN is not a JSON value"),
        (b"1" * 5000, 10_000, 32, "not JSON"),  # more integer digits than Python converts
    ]:
        with pytest.raises(MessageError, match=message) as raised:
            decode_bounded(raw, max_bytes, max_depth)
        assert "sys.set_int_max_str_digits" not in str(raised.value)  # Python's advice is not the sender's fix
    # the defaults bound the message and the text
    assert "over the limit of 1048576" in parse_request(b'"' + b"x" * (1 << 20) + b'"').error
    assert "over the limit of 100000" in parse_request(json.dumps({"id": 1, "text": "x" * 100_001}).encode()).error
    assert parse_request(json.dumps({"id": 1, "text": "x" * 100_000}).encode()).error is None


def test_parse_request_never_raises_on_mutated_messages():
    """A seeded mutation fuzz of the request parser: flipped, inserted and deleted bytes and spliced fragments of
    valid requests. Every message gives a ParsedRequest: either an error (one line) or texts that are valid,
    bounded Unicode."""
    import random

    rng = random.Random(29)
    seeds = [json.dumps(body).encode() for body in GOOD.values()] + [
        b'{"id": "p", "text": "query", "pair": "passage", "aggregation": "max"}',
        b'{"id": 7, "texts": ["a", "b"], "pairs": ["c", "d"]}', b'{"id": "e", "text": "\\ud800"}']
    fragments = [b"[", b"]", b"{", b"}", b'"', b"\\", b"\\ud800", b"\\udfff", b"\xed\xa0\x80", b"\xff", b"NaN",
                 b"1e999", b",", b":", b"null", b"true", b'"id"', b'"texts"', b"\x00"]
    for _ in range(20_000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op, at = rng.randrange(4), rng.randrange(len(raw) + 1)
            if op == 0 and raw:
                raw[min(at, len(raw) - 1)] = rng.randrange(256)
            elif op == 1:
                raw[at:at] = rng.choice(fragments) * rng.randint(1, 40)
            elif op == 2:
                del raw[at:at + rng.randint(1, 8)]
            else:
                raw[at:at] = rng.choice(seeds)
        req = parse_request(bytes(raw), max_texts=4, max_text_chars=50)
        if req.error is not None:
            assert isinstance(req.error, str) and "\n" not in req.error and req.texts == []
        else:
            assert 1 <= len(req.texts) <= 4 or req.texts == []
            for text in req.texts + (req.pairs or []):
                assert len(text) <= 50
                text.encode("utf-8")  # valid Unicode scalar values only


@pytest.fixture
def serve_process(tiny_onnx, tmp_path):
    """``bertopt serve`` on free loopback ports in its own session (its workers are killed with it)."""
    import subprocess
    import sys
    import time

    from bertopt.harness import free_port

    port, port_out = free_port(), free_port()
    while port_out == port:
        port_out = free_port()
    out = tmp_path / "serve.log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(tiny_onnx.path), "--port",
                                 str(port), "--port-out", str(port_out), "--num-worker", "1"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while "ready on" not in out.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"bertopt serve did not start (exit {proc.poll()}):\n{out.read_text()[-3000:]}")
            time.sleep(0.1)
        yield proc, port, port_out
    finally:
        if proc.poll() is None:  # not yet killed by the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.slow
@pytest.mark.kafka
def test_every_hostile_request_gets_one_error_response_and_a_good_one_its_embedding(kafka, tiny_onnx,
                                                                                    read_final_stats):
    from bertopt.runtime import Predictor

    req_topic, resp_topic = kafka.topics(partitions=1)  # one partition: hostile messages sit among good ones
    after = {"deep": "good-1", "surrogate": "good-2"}  # good requests in the hostile ones' batches ...
    values = []
    for key, (value, _, _) in HOSTILE.items():
        values.append((f"k-{key}".encode(), value))
        if key in after:
            values.append((f"k-{after[key]}".encode(), json.dumps(GOOD[after[key]]).encode()))
    values.append((b"k-good-3", json.dumps(GOOD["good-3"]).encode()))  # ... and one after them all
    kafka.produce(req_topic, values)
    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--max-batch", "4",
                                        "--max-text-chars", str(MAX_TEXT_CHARS), "--max-request-bytes",
                                        str(MAX_REQUEST_BYTES), group="hostile")
    messages = kafka.responses(resp_topic, until=lambda ms: len(ms) >= len(values), timeout_s=90)
    assert proc.poll() is None, log_file.read_text()[-3000:]  # alive
    assert len(messages) == len(values), log_file.read_text()[-3000:]

    by_key: dict[bytes, list[dict]] = {}
    for msg in messages:
        by_key.setdefault(msg.key(), []).append(json.loads(msg.value()))
    for key, (_, rid, fragment) in HOSTILE.items():
        answers = by_key[f"k-{key}".encode()]
        assert len(answers) == 1, (key, answers)
        body = answers[0]
        assert set(body) == {"id", "error", "artifact"}, body
        assert body["id"] == rid and body["artifact"] == tiny_onnx.digest
        assert fragment in body["error"], (key, body["error"])
        assert len(body["error"].splitlines()) == 1 and len(body["error"]) < 400
    predictor = Predictor(tiny_onnx.path, threads=1)
    for key, request in GOOD.items():
        for body in by_key[f"k-{key}".encode()]:
            assert "error" not in body, body
            assert body["id"] == request["id"]
            texts = [request["text"]] if "text" in request else request["texts"]
            got = np.asarray([body["embedding"]] if "text" in request else body["embeddings"], dtype=np.float32)
            np.testing.assert_allclose(got, predictor.encode(texts), rtol=0, atol=1e-5)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_file.read_text()[-3000:]
    log_text = log_file.read_text()
    assert "Traceback" not in log_text
    stats = read_final_stats(log_text)
    assert stats["consumed"] == stats["produced"] == stats["committed"] == len(values)
    assert stats["errors"] == len(HOSTILE)
    assert stats["no_id"] == sum(rid is None for _, rid, _ in HOSTILE.values())


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.server
def test_a_bridge_whose_backend_dies_exits_3_with_one_line_and_leaves_the_batch_uncommitted(
        kafka, tiny_onnx, serve_process):
    server, port, port_out = serve_process
    req_topic, resp_topic = kafka.topics(partitions=1)
    proc, log_file = kafka.start_bridge(tiny_onnx.path, req_topic, resp_topic, "--backend", "zmq", "--port",
                                        str(port), "--port-out", str(port_out), "--timeout-ms", "3000",
                                        group="dies")
    kafka.produce(req_topic, [(b"k-1", json.dumps({"id": 1, "text": "before"}).encode())])
    first = kafka.responses(resp_topic, until=lambda ms: len(ms) >= 1, timeout_s=60)
    assert len(first) == 1 and "embedding" in json.loads(first[0].value()), log_file.read_text()[-3000:]

    os.killpg(server.pid, signal.SIGKILL)  # the server and its workers die
    server.wait(10)
    kafka.produce(req_topic, [(b"k-2", json.dumps({"id": 2, "text": "after"}).encode())])
    code = proc.wait(60)
    log_text = log_file.read_text()
    assert code == 3, log_text[-3000:]
    errors = [line for line in log_text.splitlines() if " ERROR " in line]
    assert len(errors) == 1, log_text[-3000:]
    assert "backend failed: no reply from the bertopt server" in errors[0]
    assert "will be processed again" in errors[0]
    assert "Traceback" not in log_text
    assert kafka.committed("dies", req_topic, 1) == {0: 1}  # request 2 stays uncommitted: answered after a restart


@pytest.mark.slow
@pytest.mark.kafka
def test_a_bridge_whose_model_cannot_be_loaded_exits_non_zero_with_one_line(kafka, tiny_onnx, tmp_path):
    import shutil
    import subprocess
    import sys

    from bertopt.artifact import _digest_of_files, sha256_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_onnx.path, broken)
    manifest = json.loads((broken / "bertopt.json").read_text())
    model = broken / manifest["model_file"]
    model.write_bytes(b"not an ONNX model\n" * 8)  # hashed like a real file: only loading it fails
    manifest["files"][manifest["model_file"]] = {"size": model.stat().st_size, "sha256": sha256_file(model)}
    manifest["digest"] = _digest_of_files(manifest["files"])
    (broken / "bertopt.json").write_text(json.dumps(manifest))
    req_topic, resp_topic = kafka.topics(partitions=1)
    done = subprocess.run([sys.executable, "-m", "bertopt.cli", "kafka", str(broken), "--bootstrap", kafka.bootstrap,
                           "--request-topic", req_topic, "--response-topic", resp_topic],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.returncode in (2, 3), done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "cannot load" in lines[0] and "model.onnx" in lines[0]

