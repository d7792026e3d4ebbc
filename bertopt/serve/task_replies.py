"""Task results over the ZeroMQ protocol (what a worker computes for a predict request, what the sink returns).

A *predict* request (``bertopt.client.Client.predict``) is a JSON list of objects instead of strings:

    [{"text": "...", "pair": "...", "aggregation": "simple"}, ...]     ("pair" / "aggregation" optional)

The worker runs ``Predictor.predict`` on its slice and sends the JSON results to the sink
(``[b"T", identity, request_id, job_index, n_jobs, n_texts, offset, results_json]``); the sink puts the slices
together and replies ``[identity, {"task": ..., "results": [...]}, b"", request_id]``.

A plain request (a list of strings: bert-serving-client, ``Client.encode``) still gets an embedding array
from an embedding model; a task model answers it with an error that says to use ``Client.predict``.
"""

from __future__ import annotations

import json

TASK_RESULT = b"T"
ITEM_KEYS = {"text", "pair", "aggregation"}


class TaskRequestError(ValueError):
    """A request this artifact cannot answer (the message goes back to the client)."""


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
        extra = set(item) - ITEM_KEYS
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


def predict_payload(predictor, items: list) -> bytes:
    """The worker's job for a predict request: the task results of ``items`` as JSON."""
    texts = [i["text"] for i in items]
    pairs = [i["pair"] for i in items] if "pair" in items[0] else None
    aggregation = items[0].get("aggregation", "simple")
    from bertopt.runtime.tasks import jsonable

    results = predictor.predict(texts, pairs, aggregation=aggregation)
    return json.dumps(jsonable(results)).encode()


def check_encode_request(predictor) -> None:
    """A plain (embedding) request on a task model: say what to use instead."""
    from bertopt.runtime.tasks import task_of

    task = task_of(predictor.artifact)
    if task != "embedding":
        raise TaskRequestError(f"this server serves a {task} model, which has no sentence embeddings; ask for its "
                               "results with bertopt's Client.predict (or 'bertopt client predict'); "
                               "bert-serving-client gets embeddings from embedding models only")


class TaskAssembly:
    """The sink's bookkeeping for predict replies (kept apart from the array assembly)."""

    def __init__(self, task: str | None = None):
        self.task = task
        self.open: dict[tuple[bytes, bytes], dict] = {}

    def add(self, key, job_index: int, n_jobs: int, n_texts: int, offset: int, payload: bytes):
        """The full result list when this slice completes the request, else None (duplicates: ``False``)."""
        rec = self.open.get(key)
        if rec is None:
            rec = self.open[key] = {"n_jobs": n_jobs, "got": set(), "out": [None] * n_texts}
        if job_index in rec["got"]:
            return False
        rows = json.loads(payload)
        rec["out"][offset:offset + len(rows)] = rows
        rec["got"].add(job_index)
        if len(rec["got"]) < rec["n_jobs"]:
            return None
        del self.open[key]
        return rec["out"]


def task_reply(identity: bytes, request_id: bytes, results: list) -> list[bytes]:
    return [identity, json.dumps({"results": results}).encode(), b"", request_id]
