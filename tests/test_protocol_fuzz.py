"""A bounded fuzz run (hypothesis, a few hundred examples each) over the server's request parsers: the shared
decoder (``protocol.decode_json``), the ZeroMQ parser (``protocol.parse_request``) and the HTTP input parsers
(``http_api.Api``). Every input either becomes a valid request or raises the one request-error type
(``protocol.RequestError``; ``ProtocolError`` and the HTTP ``Problem`` are kinds of it), never anything else; a
request that passes the runtime's text check then tokenizes without error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bertopt.errors import UserError
from bertopt.protocol import MAX_JSON_DEPTH, ProtocolError, RequestError, decode_json, json_depth, parse_request
from bertopt.runtime.predictor import check_texts

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# text with what breaks parsers: lone surrogates, quotes, backslashes, brackets, control and astral characters
nasty_text = st.text(st.characters(exclude_categories=()), max_size=20) | st.sampled_from(
    ["a\ud800b", "\udfff", '[["', '\\"]', "\\", "\x00", "\U0001F600", "", " ", "[" * 40])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | nasty_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(nasty_text | st.sampled_from(
        ["text", "pair", "aggregation"]), inner, max_size=3),
    max_leaves=30)
# bytes that look like JSON structure, to reach the depth scanner's corners
json_ish = st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"1", b"a", b" ",
                                     b"\\u", b"d800", b"\xff", b"\xc3\xa9"]), max_size=200).map(b"".join)
# nesting far past the limit (and past Python's recursion limit), inside and outside strings
deep = st.tuples(st.integers(0, 5000), st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'["', b'"]')])).map(
    lambda t: t[1][0] * t[0] + b"1" + t[1][1] * t[0])


def _depth(value) -> int:
    """Nesting depth of a decoded JSON value (iterative: no recursion on deep input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _json_encodings(value) -> list[bytes]:
    encoded = [json.dumps(value).encode()]  # ASCII, surrogates as \ud800 escapes
    try:
        encoded.append(json.dumps(value, ensure_ascii=False).encode())  # raw UTF-8
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form
        pass
    return encoded


@FUZZ
@given(st.binary(max_size=300) | json_ish | deep | json_values.map(lambda v: json.dumps(v).encode()))
def test_decode_json_returns_a_shallow_value_or_raises_request_error(data):
    try:
        value = decode_json(data, 10_000, "a JSON list of strings")
    except RequestError:
        return
    assert _depth(value) <= MAX_JSON_DEPTH
    assert json_depth(data) == _depth(value)  # the scan before parsing agrees with the parser


@FUZZ
@given(json_values)
def test_decode_json_accepts_every_valid_json_within_the_depth_limit(value):
    for data in _json_encodings(value):
        if _depth(value) <= MAX_JSON_DEPTH:
            assert decode_json(data, 10**6, "x") == value


@pytest.fixture(scope="module")
def tokenizer(tiny_onnx):
    from bertopt.runtime.predictor import load_tokenizer

    return load_tokenizer(tiny_onnx.tokenizer_path, 64)


def _frames():
    payload = json_values.map(lambda v: json.dumps(v).encode()) | st.lists(nasty_text, max_size=5).map(
        lambda v: json.dumps(v).encode()) | json_ish | deep | st.binary(max_size=100)
    request = st.tuples(st.binary(min_size=0, max_size=8), payload, st.sampled_from([b"1", b"x", b"", b"99"]),
                        st.binary(max_size=3)).map(list)
    return request | st.lists(st.binary(max_size=20), max_size=6)


@FUZZ
@given(_frames())
def test_zmq_parse_request_gives_a_valid_request_or_a_protocol_error(tokenizer, frames):
    try:
        req = parse_request(frames, 10_000)
    except ProtocolError as exc:
        str(exc).encode("utf-8")  # the reply's message is valid UTF-8 (request text is quoted escaped)
        return
    assert req.identity and req.request_id.isdigit()
    if req.command is not None:
        return
    assert req.texts and isinstance(req.texts, list)
    if isinstance(req.texts[0], dict):
        texts = [i["text"] for i in req.texts]
        pairs = [i["pair"] for i in req.texts] if "pair" in req.texts[0] else None
    else:
        texts, pairs = req.texts, None
    assert all(isinstance(t, str) for t in texts)
    try:
        check_texts(texts, pairs)  # the ventilator's intake check: a UserError is that request's error reply
    except UserError as exc:
        str(exc).encode("utf-8")
        return
    tokenizer.encode_batch(texts if pairs is None else list(zip(texts, pairs)))  # never raises after the check


@pytest.fixture(scope="module")
def http_api(tiny_onnx):
    """The HTTP routes' request handling on the tiny BERT's facts and the server's default configuration."""
    from bertopt.serve.http_api import Api
    from bertopt.serve.server import ServeConfig, _model_facts

    cfg = ServeConfig(artifact=str(tiny_onnx.path), http_port=8080)
    return Api(SimpleNamespace(cfg=cfg, facts=_model_facts(str(tiny_onnx.path), None)))


@FUZZ
@given(json_values)
def test_http_input_parsers_give_valid_inputs_or_a_request_error(http_api, value):
    from bertopt.serve.batching import KIND_IDS

    try:
        kind, items = http_api.parse_inputs(value, "inputs", 422)
        if kind != KIND_IDS:
            http_api.check_texts(items, None, "inputs", 413)
    except RequestError:
        pass
    else:
        assert items and (kind == KIND_IDS or all(isinstance(t, str) and t for t in items))
        if kind != KIND_IDS:
            http_api.tokenizer.encode_batch(items)
    try:
        _, items = http_api.parse_predict_inputs(value)
    except RequestError:
        return
    assert items and all(isinstance(i, str) or (isinstance(i, list) and len(i) == 2) for i in items)
    if len({isinstance(i, list) for i in items}) > 1:
        return  # /predict refuses texts mixed with pairs (a 422 of its own)
    pairs = [i[1] for i in items] if isinstance(items[0], list) else None
    try:
        http_api.check_texts([i[0] for i in items] if pairs else items, pairs, "inputs", 413)
    except RequestError:
        return
    http_api.tokenizer.encode_batch(items if pairs is None else [tuple(i) for i in items])
