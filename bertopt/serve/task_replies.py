"""Task results over the ZeroMQ protocol (what a worker computes for a predict request, what the sink returns).

A *predict* request (``bertopt.client.Client.predict``) is a JSON list of objects instead of strings:

    [{"text": "...", "pair": "...", "aggregation": "simple"}, ...]     ("pair" / "aggregation" optional)

The worker runs ``Predictor.predict`` on its slice and sends the JSON results to the sink
(``[b"T", identity, request_id, job_index, n_jobs, n_texts, offset, results_json]``); the sink puts the slices
together and replies ``[identity, {"results": [...]}, b"", request_id]``.

A plain request (a list of strings: bert-serving-client, ``Client.encode``) still gets an embedding array
from an embedding model; a task model answers it with an error that says to use ``Client.predict``.
"""

from __future__ import annotations

import json

from bertopt.protocol import is_predict_request  # noqa: F401  (re-exported for the worker)

TASK_RESULT = b"T"


class TaskRequestError(ValueError):
    """A request this artifact cannot answer (the message goes back to the client)."""


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

    task = task_of(predictor.model)
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
        """The full result list when this slice completes the request, else None (duplicates: ``False``; a slice
        that cannot belong to the request: a line saying why)."""
        rec = self.open.get(key)
        if rec is None:
            if min(n_jobs, n_texts) < 1 or not 0 <= job_index < n_jobs:
                return "a task result that describes no request"
            rec = self.open[key] = {"n_jobs": n_jobs, "got": set(), "out": [None] * n_texts}
        if job_index in rec["got"]:
            return False
        rows = json.loads(payload)
        if not isinstance(rows, list) or (n_jobs, n_texts) != (rec["n_jobs"], len(rec["out"])) \
                or not 0 <= offset <= n_texts - len(rows) or not 0 <= job_index < n_jobs:
            return f"a task result of {len(rows) if isinstance(rows, list) else '?'} rows at row {offset} that " \
                   f"does not fit the request's {len(rec['out'])}"
        rec["out"][offset:offset + len(rows)] = rows
        rec["got"].add(job_index)
        if len(rec["got"]) < rec["n_jobs"]:
            return None
        del self.open[key]
        return rec["out"]


def task_reply(identity: bytes, request_id: bytes, results: list) -> list[bytes]:
    return [identity, json.dumps({"results": results}).encode(), b"", request_id]
