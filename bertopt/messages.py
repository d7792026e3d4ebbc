"""The request and response messages of ``bertopt kafka`` (docs/kafka.md), shared by the bridge and by Spark's
Kafka streaming job (``bertopt.spark.streaming``), so both parse and answer exactly alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

_NO_ID = object()


@dataclass
class ParsedRequest:
    id: Any               # _NO_ID when the request has no usable id
    texts: list[str]
    single: bool          # "text" (one embedding) rather than "texts" (a list)
    error: str | None = None
    pairs: list[str] | None = None  # "pair" / "pairs": the second texts (rerank passages)
    aggregation: str = "simple"     # token classification


def parse_request(value: bytes | None, max_texts: int = 256) -> ParsedRequest:
    """Validate one request message; never raises (a bad request becomes ``error`` / ``_NO_ID``)."""
    if value is None:
        return ParsedRequest(_NO_ID, [], True, "empty message (no value)")
    try:
        body = json.loads(value)
    except (UnicodeDecodeError, ValueError) as exc:
        return ParsedRequest(_NO_ID, [], True, f"not JSON ({exc})")
    if not isinstance(body, dict):
        return ParsedRequest(_NO_ID, [], True, f"a request must be a JSON object, got {type(body).__name__}")
    rid = body.get("id")
    if rid is None:
        return ParsedRequest(_NO_ID, [], True, "request has no 'id'")
    if isinstance(rid, (dict, list)):
        return ParsedRequest(rid, [], True, "'id' must be a string or a number")
    has_text, has_texts = "text" in body, "texts" in body
    if has_text == has_texts:
        return ParsedRequest(rid, [], True, "a request needs exactly one of 'text' (a string) or 'texts' "
                                            "(a list of strings)")
    aggregation = body.get("aggregation", "simple")
    if not isinstance(aggregation, str):
        return ParsedRequest(rid, [], has_text, "'aggregation' must be a string")
    if has_text:
        if not isinstance(body["text"], str):
            return ParsedRequest(rid, [], True, f"'text' must be a string, got {type(body['text']).__name__}")
        if "pairs" in body:
            return ParsedRequest(rid, [], True, "a 'text' request takes one 'pair', not 'pairs'")
        pair = body.get("pair")
        if pair is not None and not isinstance(pair, str):
            return ParsedRequest(rid, [], True, f"'pair' must be a string, got {type(pair).__name__}")
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
    return ParsedRequest(rid, list(texts), False, pairs=None if pairs is None else list(pairs),
                         aggregation=aggregation)


EMBEDDING_PAIRS_ERROR = "an embedding model takes single texts; drop 'pair' / 'pairs'"


class ResponseFormat:
    """How results become response fields: an embedding (``embedding`` / ``embeddings``), or a task model's
    results (``result`` / ``results``, as ``Predictor.predict`` gives them; classifiers also ``label(s)``)."""

    def __init__(self, model_info: dict[str, Any], digest: str):
        from bertopt.runtime.tasks import normalize_task

        self.digest = digest
        self.task = normalize_task(model_info.get("task")) or "embedding"

    def ok(self, rid: Any, values, single: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid}
        if self.task == "embedding":
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
