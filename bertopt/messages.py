"""The request and response messages of ``bertopt kafka`` (docs/kafka.md), shared by the bridge and by Spark's
Kafka streaming job (``bertopt.spark.streaming``), so both parse and answer exactly alike.

Every message is untrusted: ``decode_bounded`` bounds its size and nesting depth before JSON parsing, and
``parse_request`` checks types, counts and each text (valid Unicode scalar values, at most ``max_text_chars``)
before anything is tokenised. A request that fails any check becomes an error response (``ResponseFormat.error``)
for that request alone; this module never raises on a message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from bertopt.params import Param
from bertopt.tasks import DEFAULT_TASK, known_task
from bertopt.untrusted import json_depth, lone_surrogate

_NO_ID = object()

# Defaults of the per-request bounds (the bridge's --max-request-bytes / --max-texts-per-request /
# --max-text-chars). 1 MiB is Kafka's own default message.max.bytes; a request is an object holding a list of
# strings (depth 2), so 32 levels is generous; 100,000 characters is about 50 times the text a 512-token
# window reads (the rest is truncated), and tokenising it takes milliseconds.
MAX_REQUEST_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_TEXTS_PER_REQUEST = 256
MAX_TEXT_CHARS = 100_000

# The request limits `bertopt serve` and the Kafka bridge both take, declared once (flag, bound, help); each front
# end sets its own default where they differ (serve: bigger requests over HTTP).
MAX_TEXT_CHARS_PARAM = Param("max_text_chars", int, MAX_TEXT_CHARS, "Most characters in one text (with its pair), "
                             "checked before tokenising: a longer one gets an error reply (HTTP: 413); the model "
                             "reads only its first --max-seq-len tokens anyway.", min=1)
MAX_TEXTS_PARAM = Param("max_texts_per_request", int, MAX_TEXTS_PER_REQUEST, "Most texts in one request (more: an "
                        "error reply; HTTP: 413).", min=1)
MAX_REQUEST_CHARS_PARAM = Param("max_request_chars", int, 4_000_000, "Most characters in one request, all texts "
                                "together; checked before tokenising.", min=1)
MAX_REQUEST_BYTES_PARAM = Param("max_request_bytes", int, MAX_REQUEST_BYTES, "A larger request gets an error reply "
                                "asking to split it, before it is parsed.", min=64)


class MessageError(ValueError):
    """A message that cannot be decoded: too large, nested too deep, not UTF-8, or not JSON."""


def _no_constant(name: str):
    raise MessageError(f"{name} is not a JSON value; send finite numbers")


def decode_bounded(raw: bytes, max_bytes: int = MAX_REQUEST_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` (UTF-8 JSON) as Python values, after checking, before any parsing, that it holds at most
    ``max_bytes`` bytes and nests at most ``max_depth`` arrays/objects (so no input reaches the recursive JSON
    parser that could exhaust the stack or memory). Raises ``MessageError`` (one line) on anything else."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MessageError(f"a message must be bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise MessageError(f"the message has {len(raw)} bytes, over the limit of {max_bytes}; send a smaller "
                           "request")
    if json_depth(raw, max_depth) > max_depth:
        raise MessageError(f"the message nests more than {max_depth} arrays/objects deep; send a flat "
                           "request object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError(f"the message is not UTF-8 (byte {exc.start}); send UTF-8 JSON") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except MessageError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too many integer digits
        # the reason only: Python's advice after ';' ("use sys.set_int_max_str_digits()") is not the sender's
        reason = str(exc).splitlines()[0].split(";")[0][:200]
        raise MessageError(f"not JSON ({reason}); send one JSON object") from None


def text_problem(text: str, max_chars: int = MAX_TEXT_CHARS) -> str | None:
    """Why ``text`` cannot be tokenised, or None: over ``max_chars`` characters, or not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON escapes can carry and no tokenizer accepts)."""
    if len(text) > max_chars:
        return f"{len(text)} characters, over the limit of {max_chars}; shorten or split the text"
    at = lone_surrogate(text)
    if at is not None:
        return (f"a lone surrogate U+{ord(text[at]):04X} at character {at} is not a Unicode character; send valid "
                "UTF-16 pairs or UTF-8")
    return None


@dataclass
class ParsedRequest:
    id: Any               # _NO_ID when the request has no usable id (answered with "id": null)
    texts: list[str]
    single: bool          # "text" (one embedding) rather than "texts" (a list)
    error: str | None = None
    pairs: list[str] | None = None  # "pair" / "pairs": the second texts (rerank passages)
    aggregation: str = "simple"     # token classification


def response_id(req: ParsedRequest) -> Any:
    """The id a response carries: the request's, or null for a request without a usable one."""
    return None if req.id is _NO_ID else req.id


def _first_text_problem(field: str, values: list[str], max_chars: int) -> str | None:
    for i, value in enumerate(values):
        problem = text_problem(value, max_chars)
        if problem is not None:
            where = f"'{field}'" if field in ("text", "pair") else f"'{field}'[{i}]"
            return f"{where}: {problem}"
    return None


def parse_request(value: bytes | None, max_texts: int = MAX_TEXTS_PER_REQUEST, *,
                  max_text_chars: int = MAX_TEXT_CHARS, max_bytes: int = MAX_REQUEST_BYTES) -> ParsedRequest:
    """Validate one request message; never raises (a bad request becomes ``error``, and ``id`` is ``_NO_ID``
    when the request has no usable id)."""
    if value is None:
        return ParsedRequest(_NO_ID, [], True, "empty message (no value); send a JSON request object")
    try:
        body = decode_bounded(value, max_bytes, MAX_JSON_DEPTH)
    except MessageError as exc:
        return ParsedRequest(_NO_ID, [], True, str(exc))
    if not isinstance(body, dict):
        return ParsedRequest(_NO_ID, [], True, f"a request must be a JSON object, got {type(body).__name__}")
    rid = body.get("id")
    if rid is None:
        return ParsedRequest(_NO_ID, [], True, "request has no 'id'; give each request an id (string or number)")
    if isinstance(rid, (dict, list)):
        return ParsedRequest(rid, [], True, "'id' must be a string or a number")
    if isinstance(rid, bool) or (isinstance(rid, float) and not math.isfinite(rid)):
        return ParsedRequest(_NO_ID, [], True, "'id' must be a string or a finite number")
    has_text, has_texts = "text" in body, "texts" in body
    if has_text == has_texts:
        return ParsedRequest(rid, [], True, "a request needs exactly one of 'text' (a string) or 'texts' "
                                            "(a list of strings)")
    aggregation = body.get("aggregation", "simple")
    if not isinstance(aggregation, str):
        return ParsedRequest(rid, [], has_text, "'aggregation' must be a string")
    if len(aggregation) > 32:
        return ParsedRequest(rid, [], has_text, "'aggregation' is not known; use none, simple, first, average "
                                                "or max")
    if has_text:
        if not isinstance(body["text"], str):
            return ParsedRequest(rid, [], True, f"'text' must be a string, got {type(body['text']).__name__}")
        if "pairs" in body:
            return ParsedRequest(rid, [], True, "a 'text' request takes one 'pair', not 'pairs'")
        pair = body.get("pair")
        if pair is not None and not isinstance(pair, str):
            return ParsedRequest(rid, [], True, f"'pair' must be a string, got {type(pair).__name__}")
        problem = (_first_text_problem("text", [body["text"]], max_text_chars)
                   or (None if pair is None else _first_text_problem("pair", [pair], max_text_chars)))
        if problem:
            return ParsedRequest(rid, [], True, problem)
        return ParsedRequest(rid, [body["text"]], True, pairs=None if pair is None else [pair],
                             aggregation=aggregation)
    texts = body["texts"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return ParsedRequest(rid, [], False, "'texts' must be a list of strings")
    if len(texts) > max_texts:
        return ParsedRequest(rid, [], False, f"{len(texts)} texts in one request exceed the limit of {max_texts}; "
                                             "split the request (or raise --max-texts-per-request)")
    if "pair" in body:
        return ParsedRequest(rid, [], False, "a 'texts' request takes 'pairs' (a list), not 'pair'")
    pairs = body.get("pairs")
    if pairs is not None and (not isinstance(pairs, list) or not all(isinstance(p, str) for p in pairs)
                              or len(pairs) != len(texts)):
        return ParsedRequest(rid, [], False, "'pairs' must be a list of strings, one per text")
    problem = (_first_text_problem("texts", texts, max_text_chars)
               or (None if pairs is None else _first_text_problem("pairs", pairs, max_text_chars)))
    if problem:
        return ParsedRequest(rid, [], False, problem)
    return ParsedRequest(rid, list(texts), False, pairs=None if pairs is None else list(pairs),
                         aggregation=aggregation)


EMBEDDING_PAIRS_ERROR = "an embedding model takes single texts; drop 'pair' / 'pairs'"


class ResponseFormat:
    """How results become response fields: an embedding (``embedding`` / ``embeddings``), or a task model's
    results (``result`` / ``results``, as ``Predictor.predict`` gives them; classifiers also ``label(s)``)."""

    def __init__(self, model_info: dict[str, Any], digest: str):
        self.digest = digest
        self.task = known_task(model_info.get("task")) or DEFAULT_TASK

    def ok(self, rid: Any, values, single: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid}
        if self.task == "embedding":
            import numpy as np

            values = np.asarray(values, dtype=np.float32)
            if single:
                out["embedding"] = values[0].tolist()
            else:
                out["embeddings"] = values.tolist()
        else:
            from bertopt.runtime.tasks import jsonable

            results = jsonable(list(values))
            out["task"] = self.task
            if single:
                out["result"] = results[0]
                if self.task == "classification":
                    out["label"] = results[0]["label"]
            else:
                out["results"] = results
                if self.task == "classification":
                    out["labels"] = [r["label"] for r in results]
        out["artifact"] = self.digest
        return out

    def error(self, rid: Any, message: str) -> dict[str, Any]:
        return {"id": rid, "error": message, "artifact": self.digest}
