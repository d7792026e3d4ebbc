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

    ventilator -> worker  [b"J", job_id, lane, kind, n_pieces, (identity, request_id, piece_meta) x n_pieces,
                           items_json]                                  (a mini-job: pieces of one or more requests)
                          [b"STOP"]
                          piece_meta = b"index n_pieces n_texts offset count"; kind t (texts), p (pairs), i (ids)
    HTTP front end -> ventilator (inproc)  [request_id, kind, {"items": [...], "lengths": [...]} json]
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
from typing import Any, Sequence

import numpy as np

from bertopt.untrusted import json_depth

WIRE_VERSION = "1.10.0"  # bert-serving-client checks server_version == its own version
SHOW_CONFIG = b"SHOW_CONFIG"
SHOW_STATUS = b"SHOW_STATUS"
COMMANDS = (SHOW_CONFIG, SHOW_STATUS)
MAX_IDENTITY_BYTES = 255  # ZeroMQ subscription topics longer than this are not client ids
MAX_MODEL_BYTES = 128  # a model name (``bertopt serve NAME=PATH``)
MODEL_PREFIX = b"model="  # the optional fifth request frame: model=NAME (bertopt's Client(model=...))
_REQ_ID = re.compile(rb"[0-9]{1,20}")  # used with fullmatch: "$" would let a trailing newline through

# inside the server a ZeroMQ request is keyed by its client's id and a number of the server's own
# (``REQUEST_ID#SEQ``): two requests that reuse an id (a client that reconnects with a fixed identity and counts from
# 1 again, or one that sends the same id twice) never share the sink's record; replies carry the client's id
# (``client_request_id``). Client ids are digits only, so the separator cannot be part of one.
SEQ_SEPARATOR = b"#"


def client_request_id(request_id: bytes) -> bytes:
    """The id the client sent, from a request id as the server keys it internally."""
    return request_id.split(SEQ_SEPARATOR, 1)[0]


# internal message tags
JOB, STOP, READY, FAIL, DONE = b"J", b"STOP", b"READY", b"FAIL", b"DONE"
RESULT, ERROR, CONFIG, SINK_STOP = b"R", b"E", b"C", b"S"
LANE_PRIORITY, LANE_BULK = b"p", b"b"
# the HTTP front end's requests use identities that start with this; ZeroMQ clients may not (their replies would
# go astray)
HTTP_IDENTITY = b"\x00bertopt-http"


def http_identity(request_id: bytes) -> bytes:
    """One HTTP request's identity in the fleet: its own, so the fair queue takes turns between HTTP requests."""
    return HTTP_IDENTITY + b"/" + request_id


class RequestError(ValueError):
    """A request that cannot be served, with a one-line reason; every front end answers it as an error reply
    (ZeroMQ: the error frame below; HTTP: a 4xx JSON body) and carries on. The request parsers raise nothing
    else on any input (``tests/test_protocol_fuzz.py``)."""


class ProtocolError(RequestError):
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
    model: str | None = None  # the model it addresses (an optional fifth frame model=NAME); None: the first

    @property
    def key(self) -> tuple[bytes, bytes]:
        return (self.identity, self.request_id)


def num(value: int) -> bytes:
    return b"%d" % value


def message_bytes(message: str) -> bytes:
    """An error message as UTF-8 for the wire; anything unencodable (a lone surrogate quoted from a request)
    becomes a backslash escape instead of an exception in the middle of answering."""
    return message.encode("utf-8", "backslashreplace")


# a predict request (bertopt's Client.predict) is a list of objects: {"text", "pair"?, "aggregation"?}
PREDICT_ITEM_KEYS = {"text", "pair", "aggregation"}


def is_predict_request(items: list) -> bool:
    return bool(items) and isinstance(items[0], dict)


def check_items(items: list) -> str | None:
    """Why a predict request's items are malformed (None when they are fine); used by the request parser."""
    dicts = [isinstance(i, dict) for i in items]
    if any(dicts) and not all(dicts):
        return "a request mixes texts and predict objects; send a list of strings or a list of objects"
    if not any(dicts):
        return None
    for n, item in enumerate(items):
        extra = set(item) - PREDICT_ITEM_KEYS
        if extra:
            return f"item {n} has unknown key(s) {sorted(extra)}; use text, pair and aggregation"
        if not isinstance(item.get("text"), str):
            return f"item {n} has no 'text' string"
        for key in ("pair", "aggregation"):
            if key in item and not isinstance(item[key], str):
                return f"item {n}: '{key}' must be a string"
    if len({"pair" in i for i in items}) > 1:
        return "some items have a 'pair' and some do not; give every item a pair or none"
    if len({i.get("aggregation", "simple") for i in items}) > 1:
        return "items ask for different aggregations; use one per request"
    return None


# -- bounded decoding (shared by the ZeroMQ and HTTP front ends) ---------------------------------------------
# the deepest valid request nests 3 levels (a list of token-id lists inside an object); json.loads recurses once
# per level, so a message nested 100,000 deep would end in RecursionError: depth is checked before parsing
MAX_JSON_DEPTH = 16
def decode_json(payload: bytes, max_bytes: int, expect: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The one request decoder of every front end: size, then nesting depth, then ``json.loads``; raises
    RequestError (naming the limit and the fix) and nothing else. ``expect`` says what to send instead."""
    if len(payload) > max_bytes:
        raise RequestError(f"request of {len(payload)} bytes exceeds the server's limit of {max_bytes} "
                           "(--max-request-bytes); split it into smaller requests")
    if json.detect_encoding(payload[:4]) not in ("utf-8", "utf-8-sig"):  # the depth scan reads UTF-8 bytes
        raise RequestError(f"request is not UTF-8 JSON (it looks like {json.detect_encoding(payload[:4])}); "
                           f"send {expect} encoded as UTF-8")
    depth = json_depth(payload, max_depth)
    if depth > max_depth:
        raise RequestError(f"request JSON nests more than {max_depth} levels deep; send {expect}")
    try:
        return json.loads(payload, parse_constant=_not_json_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # the reason only: Python's own advice after ';' (e.g. "use sys.set_int_max_str_digits()") is not the user's
        reason = str(exc).split(";")[0][:200]
        raise RequestError(f"request payload is not JSON ({reason}); send {expect}") from None


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost, checked before any tokenising (``bertopt serve`` options)."""

    max_texts: int = 2048  # --max-client-batch-size
    max_text_chars: int = 100_000  # --max-text-chars
    max_request_chars: int = 4_000_000  # --max-request-chars


DEFAULT_LIMITS = RequestLimits()


def check_text_sizes(texts: Sequence[str], limits: RequestLimits, name: str = "text {}",
                     pairs: Sequence[str] | None = None) -> None:
    """Characters per text and per request within ``limits`` (a pair's second text counts too), else
    RequestError naming the first text over the limit (``name`` formats its index)."""
    total = 0
    for i, text in enumerate(texts):
        size = len(text) + (len(pairs[i]) if pairs is not None else 0)
        if size > limits.max_text_chars:
            raise RequestError(f"{name.format(i)} has {size} characters, more than this server's limit of "
                               f"{limits.max_text_chars} (--max-text-chars); shorten or split it")
        total += size
    if total > limits.max_request_chars:
        raise RequestError(f"request holds {total} characters, more than this server's limit of "
                           f"{limits.max_request_chars} (--max-request-chars); split it into smaller requests")


def check_count(n: int, limits: RequestLimits, what: str = "texts") -> None:
    if n > limits.max_texts:
        raise RequestError(f"request has {n} {what}, more than this server's limit of {limits.max_texts} "
                           "(--max-client-batch-size); split it into smaller requests")


def parse_request(frames: list[bytes], max_bytes: int, limits: RequestLimits = DEFAULT_LIMITS) -> Request:
    """Check a client message; raise ProtocolError with a reply address when one can be trusted."""
    if len(frames) < 3:
        raise ProtocolError(f"malformed message with {len(frames)} frame(s) and no reply address; dropped")
    identity = frames[0]
    if not identity or len(identity) > MAX_IDENTITY_BYTES:
        raise ProtocolError(f"malformed message: client identity of {len(identity)} bytes "
                            f"(must be 1-{MAX_IDENTITY_BYTES}); dropped")
    request_id = frames[2]
    if identity.startswith(HTTP_IDENTITY):
        raise ProtocolError("malformed message: client identity reserved for the HTTP front end; dropped")
    if len(frames) != 4 and not (len(frames) == 5 and frames[4].startswith(MODEL_PREFIX)):
        raise ProtocolError(f"malformed request: expected 4 frames [identity, payload, request id, count] (and "
                            f"optionally a fifth, model=NAME), got {len(frames)}; use bertopt.client.Client or "
                            "bert-serving-client", identity, request_id)
    if not _REQ_ID.fullmatch(request_id):
        raise ProtocolError(f"malformed request: request id {request_id[:40]!r} is not a decimal number; "
                            "number requests 1, 2, 3, ...", identity, request_id)
    model = _model_frame(frames[4][len(MODEL_PREFIX):], identity, request_id) if len(frames) == 5 else None
    payload = frames[1]
    if payload in COMMANDS:
        return Request(identity, request_id, payload, [], model)
    try:
        texts = decode_json(payload, max_bytes, "a JSON list of strings")
    except RequestError as exc:
        raise ProtocolError(str(exc), identity, request_id) from None
    if not isinstance(texts, list):
        raise ProtocolError(f"request payload is a JSON {type(texts).__name__}, not a list; "
                            "send a JSON list of strings", identity, request_id)
    if not texts:
        raise ProtocolError("request has no texts; send at least one string", identity, request_id)
    try:
        check_count(len(texts), limits)
    except RequestError as exc:
        raise ProtocolError(str(exc), identity, request_id) from None
    if is_predict_request(texts) or any(isinstance(t, dict) for t in texts):  # Client.predict: task results
        problem = check_items(texts)
        if problem:
            raise ProtocolError(f"malformed predict request: {problem}", identity, request_id)
        pairs = [i["pair"] for i in texts] if "pair" in texts[0] else None
        _check_sizes([i["text"] for i in texts], limits, identity, request_id, pairs)
        return Request(identity, request_id, None, texts, model)
    for i, text in enumerate(texts):
        if isinstance(text, str):
            continue
        # bert-as-service's is_tokenized=True sends token lists; the tokenizer re-splits the joined words
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts[i] = " ".join(text)
            continue
        raise ProtocolError(f"text {i} is a {type(text).__name__} ({_preview(text)}), not a string; "
                            "send a JSON list of strings", identity, request_id)
    _check_sizes(texts, limits, identity, request_id)
    return Request(identity, request_id, None, texts, model)


def _model_frame(frame: bytes, identity: bytes, request_id: bytes) -> str:
    """The name in the optional fifth frame (model=NAME): the model a request addresses."""
    try:
        name = frame.decode("utf-8")
    except UnicodeDecodeError:
        name = ""
    if not name or len(frame) > MAX_MODEL_BYTES or not name.isprintable():
        raise ProtocolError(f"malformed request: model frame {frame[:40]!r} is not a model name (1-"
                            f"{MAX_MODEL_BYTES} printable UTF-8 bytes); see the server's status for its models",
                            identity, request_id)
    return name


def _check_sizes(texts, limits, identity, request_id, pairs=None) -> None:
    try:
        check_text_sizes(texts, limits, pairs=pairs)
    except RequestError as exc:
        raise ProtocolError(str(exc), identity, request_id) from None


def _preview(value: Any) -> str:
    """A short, printable view of a JSON value (no deep recursion, no lone surrogates in the reply)."""
    text = json.dumps(value)[:40] if not isinstance(value, (list, dict)) else type(value).__name__
    return text.encode("utf-8", "backslashreplace").decode()


def ndarray_reply(identity: bytes, request_id: bytes, array: np.ndarray) -> list[Any]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    info = json.dumps({"dtype": "float32", "shape": list(array.shape), "tokens": ""}).encode()
    return [identity, info, memoryview(array).cast("B"), request_id]


# a request refused because the server's queue is full starts its error message with this: the request did not
# run and may be sent again later (bertopt's Client raises ServerBusy for it; bert-serving-client shows the text)
BUSY_PREFIX = "server busy: "


def is_busy(message: str) -> bool:
    return message.startswith(BUSY_PREFIX)


def error_reply(identity: bytes, request_id: bytes, message: str) -> list[bytes]:
    # "dtype" carries the message too: bert-serving-client reads only dtype/shape, and numpy's refusal of that
    # dtype ("data type '<message>' not understood" / "format ... of '<message>' is not recognized") is how its
    # user gets to see why
    return [identity, json.dumps({"error": message, "dtype": f"bertopt serve error: {message}"}).encode(), b"",
            request_id]


def config_reply(identity: bytes, request_id: bytes, config: dict[str, Any]) -> list[bytes]:
    return [identity, json.dumps(config, default=str).encode(), request_id]


def decode_reply(frames: list[bytes]) -> tuple[int, Any]:
    """Client side: (request id, ndarray | config dict | task results list | error message as ProtocolError)."""
    request_id = int(frames[-1])
    if len(frames) == 3:
        return request_id, json.loads(frames[1])
    info = json.loads(frames[1])
    if "error" in info:
        return request_id, ProtocolError(info["error"])
    if "results" in info:
        return request_id, info["results"]
    array = np.frombuffer(frames[2], dtype=info["dtype"]).reshape(info["shape"])
    return request_id, array
