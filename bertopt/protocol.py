"""Wire protocol of ``bertopt serve``: bert-as-service's, so its unchanged ``BertClient`` works.

Client -> server (client PUSH -> ventilator PULL on ``port``), 4 frames:

    [identity, payload, request_id, count]

``identity`` is the client's id (also its SUB topic), ``payload`` is ``SHOW_CONFIG``, ``SHOW_STATUS`` or a
JSON list of strings (or of token lists, bert-as-service's ``is_tokenized``), ``request_id`` is the client's
own decimal counter, ``count`` the number of texts. Requests are keyed by ``(identity, request_id)``.

Server -> client (sink PUB on ``port_out``, topic = identity):

    config/status:  [identity, config_json, request_id]
    embeddings:     [identity, {"dtype": "float32", "shape": [n, d], "tokens": ""}, raw bytes, request_id]
    error:          [identity, {"error": "<problem>; <fix>"}, b"", request_id]

``server_version`` in the config is the wire-protocol version (``1.10.0``): BertClient refuses a server whose
``server_version`` differs from its own.

Internal messages (numbers travel as decimal ASCII):

    ventilator -> worker  [b"J", job_id, lane, identity, request_id, job_index, n_jobs, n_texts, offset, texts_json]
                          [b"STOP"]
    worker -> ventilator  [b"READY", info_json] | [b"FAIL", message] | [b"DONE", job_id]
    worker -> sink        [b"R", identity, request_id, job_index, n_jobs, n_texts, offset, dim, float32 bytes]
    anyone -> sink        [b"E", identity, request_id, message]            (the request's one reply is an error)
    ventilator -> sink    [b"C", identity, request_id, status_json]         (config/status reply)
                          [b"S", expected_replies]                          (stop once that many replies are out)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

WIRE_VERSION = "1.10.0"  # bert-serving-client checks server_version == its own version
SHOW_CONFIG = b"SHOW_CONFIG"
SHOW_STATUS = b"SHOW_STATUS"
COMMANDS = (SHOW_CONFIG, SHOW_STATUS)
MAX_IDENTITY_BYTES = 255  # ZeroMQ subscription topics longer than this are not client ids
_REQ_ID = re.compile(rb"^[0-9]{1,20}$")

# internal message tags
JOB, STOP, READY, FAIL, DONE = b"J", b"STOP", b"READY", b"FAIL", b"DONE"
RESULT, ERROR, CONFIG, SINK_STOP = b"R", b"E", b"C", b"S"
LANE_PRIORITY, LANE_BULK = b"p", b"b"


class ProtocolError(Exception):
    """A request that cannot be served; ``identity``/``request_id`` say where to send the error (or None)."""

    def __init__(self, message: str, identity: bytes | None = None, request_id: bytes | None = None):
        super().__init__(message)
        self.identity = identity
        self.request_id = request_id


@dataclass
class Request:
    identity: bytes
    request_id: bytes
    command: bytes | None  # SHOW_CONFIG / SHOW_STATUS, or None for an encode request
    texts: list[str]

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.identity, self.request_id)


def num(value: int) -> bytes:
    return b"%d" % value


def parse_request(frames: list[bytes], max_bytes: int) -> Request:
    """Check a client message; raise ProtocolError with a reply address when one can be trusted."""
    if len(frames) < 3:
        raise ProtocolError(f"malformed message with {len(frames)} frame(s) and no reply address; dropped")
    identity = frames[0]
    if not identity or len(identity) > MAX_IDENTITY_BYTES:
        raise ProtocolError(f"malformed message: client identity of {len(identity)} bytes "
                            f"(must be 1-{MAX_IDENTITY_BYTES}); dropped")
    request_id = frames[2]
    if len(frames) != 4:
        raise ProtocolError(f"malformed request: expected 4 frames [identity, payload, request id, count], "
                            f"got {len(frames)}; use bertopt.client.Client or bert-serving-client",
                            identity, request_id)
    if not _REQ_ID.match(request_id):
        raise ProtocolError(f"malformed request: request id {request_id[:40]!r} is not a decimal number; "
                            "number requests 1, 2, 3, ...", identity, request_id)
    payload = frames[1]
    if payload in COMMANDS:
        return Request(identity, request_id, payload, [])
    if len(payload) > max_bytes:
        raise ProtocolError(f"request of {len(payload)} bytes exceeds the server's limit of {max_bytes} "
                            "(--max-request-bytes); split it into smaller requests", identity, request_id)
    try:
        texts = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"request payload is not JSON ({exc}); send a JSON list of strings",
                            identity, request_id) from None
    if not isinstance(texts, list):
        raise ProtocolError(f"request payload is a JSON {type(texts).__name__}, not a list; "
                            "send a JSON list of strings", identity, request_id)
    if not texts:
        raise ProtocolError("request has no texts; send at least one string", identity, request_id)
    for i, text in enumerate(texts):
        if isinstance(text, str):
            continue
        # bert-as-service's is_tokenized=True sends token lists; the tokenizer re-splits the joined words
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts[i] = " ".join(text)
            continue
        raise ProtocolError(f"text {i} is a {type(text).__name__} ({str(text)[:40]}), not a string; "
                            "send a JSON list of strings", identity, request_id)
    return Request(identity, request_id, None, texts)


def ndarray_reply(identity: bytes, request_id: bytes, array: np.ndarray) -> list[Any]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    info = json.dumps({"dtype": "float32", "shape": list(array.shape), "tokens": ""}).encode()
    return [identity, info, memoryview(array).cast("B"), request_id]


def error_reply(identity: bytes, request_id: bytes, message: str) -> list[bytes]:
    return [identity, json.dumps({"error": message}).encode(), b"", request_id]


def config_reply(identity: bytes, request_id: bytes, config: dict[str, Any]) -> list[bytes]:
    return [identity, json.dumps(config, default=str).encode(), request_id]


def decode_reply(frames: list[bytes]) -> tuple[int, Any]:
    """Client side: (request id, ndarray | config dict | error message as ProtocolError)."""
    request_id = int(frames[-1])
    if len(frames) == 3:
        return request_id, json.loads(frames[1])
    info = json.loads(frames[1])
    if "error" in info:
        return request_id, ProtocolError(info["error"])
    array = np.frombuffer(frames[2], dtype=info["dtype"]).reshape(info["shape"])
    return request_id, array
