"""HTTP routes of ``bertopt serve --http-port``: OpenAI's embeddings API and Hugging Face
text-embeddings-inference's (TEI) routes, on Starlette.

    POST /v1/embeddings   OpenAI: input (string | strings | token ids | lists of token ids), model,
                          encoding_format (float | base64), dimensions (truncate + re-normalise)
    GET  /v1/models       OpenAI: the served models (name, task, digest)
    POST /embed           TEI: inputs, normalize (default true), truncate (default false), long_inputs
    POST /predict         TEI: inputs (text | [text, text] pair | a list of them), raw_scores; on a token
                          classifier: inputs (text | texts), aggregation_strategy -> entities per text
    POST /rerank          TEI: query, texts, return_text, raw_scores, truncate
    POST /embed_sparse    TEI: inputs, truncate -> [{"index", "value"}] per input (SPLADE models)
    POST /tokenize        TEI: inputs, add_special_tokens
    GET  /health          200 once the workers have loaded (503 before), /info, /metrics (Prometheus)

A server of several models (``bertopt serve ART1 ART2``) routes each request to one: the OpenAI ``model`` field,
or on a TEI route its optional ``model`` field (default: the first model of the route's task). An unknown model is
a 404, a model of another task a 400 naming the models that serve the route (``ModelRouter``). With one model,
every route answers with it whatever ``model`` says, as before.

Every route checks the artifact's task and answers 400 naming the route that fits when it does not. Errors
use each API's schema (OpenAI ``{"error": {"message", "type", "param", "code"}}``, TEI ``{"error",
"error_type"}``); a client never sees a stack trace (unexpected failures are logged and answered 500).

An input longer than the model's window follows the server's ``--long-inputs`` (default error: 413, TEI's
behaviour), or the request's own choice: ``"truncate": true`` (TEI) or ``"long_inputs": "error" | "truncate" |
"chunk"`` (every route; the OpenAI client sends it with ``extra_body``). Chunked texts run as KIND_CHUNK
mini-jobs (``Predictor.run(long_inputs="chunk")``); pairs, token ids and token classification are not chunked
(an over-long one is refused, naming what to send instead).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from bertopt.errors import UserError
from bertopt.params import LONG_INPUT_POLICIES
from bertopt.protocol import RequestError, RequestLimits, check_text_sizes, decode_json
from bertopt.serve.batching import KIND_CHUNK, KIND_IDS, KIND_PAIR, KIND_TEXT


class FleetError(Exception):
    """The fleet answered a request with an error message (a worker failed on it, or it could not run)."""


log = logging.getLogger("bertopt.serve.http")
OPENAI, TEI = "openai", "tei"
ROUTE_FOR_TASK = {"embedding": "/embed or /v1/embeddings", "classification": "/predict", "rerank": "/rerank",
                  "token-classification": "/predict",
                  "sparse-embedding": "/embed_sparse"}
_TEI_ERROR_TYPES = {400: "Validation", 401: "Unauthorized", 404: "NotFound", 405: "Validation", 408: "Validation",
                    413: "Validation", 422: "Validation", 429: "Overloaded", 503: "Unhealthy", 504: "Backend"}
CLIENT_CLOSED = 499  # the status a request is counted under when its client went away (nginx's convention)
# bodies and texts up to these sizes are decoded / tokenized on the event loop (sub-millisecond); larger ones in a
# thread, so one large request does not hold every other connection and /health
INLINE_DECODE_BYTES = 64 << 10
INLINE_TOKENIZE_CHARS = 32_768
TOKENIZE_MAX_TOKENS = 1 << 17  # tokens one /tokenize answer lists (with --max-request-tokens, the lower)


class Problem(RequestError):
    """A request the server answers with an error status (never a stack trace)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None):
    from starlette.responses import Response

    return Response(json.dumps(obj, separators=(",", ":"), default=_plain), status_code=status, headers=headers,
                    media_type="application/json")


def _plain(value: Any):
    """numpy scalars (entity scores, offsets) as JSON numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def error_response(style: str, p: Problem):
    if style == OPENAI:
        kind = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
                504: "timeout_error"}.get(p.status, "invalid_request_error")
        body = {"error": {"message": p.message, "type": kind, "param": p.param, "code": p.code}}
    else:
        body = {"error": p.message, "error_type": _TEI_ERROR_TYPES.get(p.status, "Backend")}
    return _json(body, p.status, p.headers)


class RequestHandling:
    """What every route shares, independent of the web framework: the API key, the task check, limits, JSON
    body reading, token counting and the fleet call."""

    def __init__(self, front, facts: dict[str, Any] | None = None):
        """``facts``: the served model this instance answers for (default: the front end's first)."""
        from bertopt.runtime.tokenizer_file import read_tokenizer_json

        self.front = front
        self.cfg = front.cfg
        self.facts = facts or front.facts
        self.task = self.facts["task"]
        self.max_seq_len = int(self.facts["max_seq_len"])
        self.long_inputs = self.cfg.long_inputs
        self.model_id = self.facts.get("name") or Path(self.facts["artifact"]).name
        self.created = int(time.time())
        # counts tokens without truncating, so an over-long input is seen (and refused unless truncate)
        self.tokenizer = read_tokenizer_json(Path(self.facts["tokenizer"]) / "tokenizer.json")
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._key = self.cfg.api_key.encode() if self.cfg.api_key else None
        self.limits = RequestLimits(self.cfg.max_client_batch_size, self.cfg.max_text_chars,
                                    self.cfg.max_request_chars)
        self.token_view = TokenView(self.facts) if self.task == "token-classification" else None

    # -- checks -------------------------------------------------------------------------------------------
    def check_key(self, headers) -> None:
        if self._key is None:
            return
        given = headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)
        if not ok:
            raise Problem(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>' with "
                          "the key the server was started with (--api-key)", code="invalid_api_key")

    def check_task(self, wanted: str, route: str) -> None:
        if self.task != wanted:
            raise Problem(400, f"{route} needs a {wanted} model, but this server serves {_a(self.task)} model "
                          f"({self.model_id}); use {ROUTE_FOR_TASK.get(self.task, 'another route')}",
                          code="wrong_task")

    def check_count(self, n: int, param: str, status: int | None = None) -> None:
        """``status``: OpenAI's routes answer every invalid request 400; TEI's say 422 / 413."""
        if n == 0:
            raise Problem(status or 422, f"'{param}' is empty; send at least one input", param=param)
        if n > self.cfg.max_client_batch_size:
            raise Problem(status or 413, f"'{param}' has {n} inputs, more than this server's limit of "
                          f"{self.cfg.max_client_batch_size} (--max-client-batch-size); split the request",
                          param=param)

    async def read_json(self, request) -> Any:
        """The body, decoded by the one bounded decoder of both front ends (``protocol.decode_json``): its size
        from Content-Length before reading (413), counted while reading (chunked bodies too), all of it
        within ``--body-timeout`` (408), then nesting depth and JSON (400)."""
        limit = self.cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise Problem(400, f"Content-Length {declared[:20]!r} is not a number")
            if int(declared) > limit:
                raise Problem(413, f"request body of {declared} bytes exceeds this server's limit of {limit} "
                              "(--max-request-bytes); split the request")
        body = bytearray()
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise Problem(413, f"request body exceeds this server's limit of {limit} bytes "
                                      "(--max-request-bytes); split the request")
        except TimeoutError:
            raise Problem(408, f"the request body was not received within {self.cfg.body_timeout_s:g} s "
                          f"(--body-timeout; {len(body)} bytes arrived); send the whole body promptly",
                          headers={"Connection": "close"}) from None
        try:
            if len(body) <= INLINE_DECODE_BYTES:
                return decode_json(bytes(body), limit, "a JSON object")
            # a large body is decoded off the event loop: every other connection (and /health) is served meanwhile
            return await asyncio.to_thread(decode_json, bytes(body), limit, "a JSON object")
        except RequestError as exc:
            raise Problem(400, str(exc).replace("request payload is not JSON", "request body is not valid JSON")
                          ) from None

    def check_texts(self, texts: list, pairs: list | None, param: str, status: int) -> None:
        """Before tokenising: characters per text and request (413; OpenAI routes 400) and valid Unicode (the
        runtime's check; 422 / 400), each naming the input."""
        name = f"'{param}[{{}}]'"
        try:
            check_text_sizes(texts, self.limits, name, pairs)
        except RequestError as exc:
            raise Problem(status, str(exc), param=param) from None
        from bertopt.runtime.predictor import check_texts

        try:
            check_texts(texts, pairs, name)
        except UserError as exc:
            raise Problem(400 if status == 400 else 422, str(exc), param=param) from None

    def long_input_policy(self, body: dict, status: int = 422) -> str:
        """What this request does with an input over the window: its ``long_inputs`` field, else TEI's
        ``truncate`` (true: truncate; false: not truncated, so an error where the server would truncate), else
        the server's ``--long-inputs``."""
        truncate = self.flag(body, "truncate", False, status) if "truncate" in body else None
        if "long_inputs" in body:
            policy = body["long_inputs"]
            if policy not in LONG_INPUT_POLICIES:
                raise Problem(status, f"'long_inputs' must be one of {', '.join(LONG_INPUT_POLICIES)}, got {policy!r}",
                              param="long_inputs")
            if truncate is not None and truncate != (policy == "truncate"):
                raise Problem(status, f"'truncate': {str(truncate).lower()} contradicts 'long_inputs': {policy!r}; "
                              "send one of them", param="long_inputs")
            return policy
        if truncate:
            return "truncate"
        if truncate is False and self.long_inputs == "truncate":
            return "error"
        return self.long_inputs

    @staticmethod
    def flag(body: dict, name: str, default: bool, status: int = 422) -> bool:
        """A true/false field; ``status``: 400 on OpenAI's routes (every invalid request), TEI's 422 elsewhere."""
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise Problem(status, f"'{name}' must be true or false, got {value!r}", param=name)
        return value

    # -- token counting -----------------------------------------------------------------------------------
    async def count_tokens(self, items: list, kind: bytes, policy: str, param: str,
                           status: int) -> tuple[bytes, list[int]]:
        """The kind to run the inputs as and their tokens (what the model will see: at most max_seq_len, or
        every token of a text to chunk); over-long inputs follow ``policy`` (``long_input_policy``)."""
        if kind == KIND_IDS:
            lengths = [len(ids) for ids in items]
        else:
            pairs = [p[1] for p in items] if kind == KIND_PAIR else None
            self.check_texts([p[0] for p in items] if kind == KIND_PAIR else items, pairs, param, status)
            encode = self.tokenizer.encode_batch
            seqs = [tuple(p) for p in items] if kind == KIND_PAIR else items
            # a big batch, or long texts, are tokenized off the event loop (the Rust tokenizer releases the GIL):
            # 32 texts of 100,000 characters held every other connection (and /health) for seconds
            chars = sum(len(t) for t in items) if kind == KIND_TEXT else sum(len(a) + len(b) for a, b in items)
            inline = len(seqs) <= 32 and chars <= INLINE_TOKENIZE_CHARS
            encodings = encode(seqs) if inline else await asyncio.to_thread(encode, seqs)
            lengths = [len(e.ids) for e in encodings]
        longest = max(lengths)
        if longest > self.max_seq_len and policy == "chunk":
            what = {KIND_PAIR: "text pairs", KIND_IDS: "token ids"}.get(kind)
            if what is None and self.task == "token-classification":
                what = "a token classifier's inputs over HTTP (the Python API chunks them)"
            if what is not None:
                i = lengths.index(longest)
                raise Problem(status, f"input {i} has {longest} tokens, more than this model's limit of "
                              f"{self.max_seq_len}, and chunking splits texts, not {what}; shorten it, or send "
                              "\"truncate\": true to cut it to the limit", param=param, code="context_length_exceeded")
            kind = KIND_CHUNK
        elif longest > self.max_seq_len and policy == "error":
            i = lengths.index(longest)
            raise Problem(status, f"input {i} has {longest} tokens, more than this model's limit of "
                          f"{self.max_seq_len}; shorten it, or send \"truncate\": true to cut it to the limit (or "
                          "\"long_inputs\": \"chunk\" to pool overlapping windows)", param=param,
                          code="context_length_exceeded")
        if kind != KIND_CHUNK:
            lengths = [min(n, self.max_seq_len) for n in lengths]
        limit = self.cfg.max_request_tokens
        if sum(lengths) > limit:
            raise Problem(status, f"request holds {sum(lengths)} tokens, more than this server's limit of {limit} "
                          "(--max-request-tokens); split the request", param=param)
        return kind, lengths

    async def run(self, kind: bytes, items: list, lengths: list[int]) -> np.ndarray:
        try:
            return await self.front.run(kind, items, lengths, self.model_id)
        except asyncio.TimeoutError:
            raise Problem(504, f"no answer within {self.cfg.request_timeout_s:g} s (--request-timeout); the "
                          "server is overloaded or the request is too large, retry later or split it") from None
        except FleetError as exc:
            raise Problem(500, f"the model could not process this request: {exc}") from None

    # -- input parsing ------------------------------------------------------------------------------------
    def parse_inputs(self, value: Any, param: str, status: int, allow_ids: bool = True) -> tuple[bytes, list]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists -> (kind, items)."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise Problem(status, f"'{param}' must be a string or a list of strings, got "
                          f"{type(value).__name__}", param=param)
        openai_status = 400 if status == 400 else None
        if allow_ids and value and all(_is_int(v) for v in value):  # one input of token ids, not len(value) inputs
            value = [value]
        self.check_count(len(value), param, openai_status)
        if all(isinstance(v, str) for v in value):
            for i, v in enumerate(value):
                if not v:
                    raise Problem(status, f"'{param}[{i}]' is an empty string; send text", param=param)
            return KIND_TEXT, value
        if allow_ids and all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
            for i, ids in enumerate(value):
                if len(ids) > self.cfg.max_text_chars:
                    raise Problem(openai_status or 413, f"'{param}[{i}]' has {len(ids)} token ids, more than this "
                                  f"server's limit of {self.cfg.max_text_chars} (--max-text-chars)", param=param)
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise Problem(status, f"'{param}[{i}]' has token id {bad}, outside this model's vocabulary "
                                  f"of {self.vocab_size}; send ids from /tokenize", param=param)
            return KIND_IDS, value
        bad = next(i for i, v in enumerate(value) if not isinstance(v, str))
        raise Problem(status, f"'{param}[{bad}]' is a {type(value[bad]).__name__}; send strings"
                      + (" (or lists of integer token ids)" if allow_ids else ""), param=param)

    async def embeddings(self, kind: bytes, items: list, policy: str, param: str, status: int):
        kind, lengths = await self.count_tokens(items, kind, policy, param, status)
        if kind == KIND_IDS:
            items = [ids[: self.max_seq_len] for ids in items]
        return await self.run(kind, items, lengths), sum(lengths)

class OpenAIRoutes(RequestHandling):
    async def openai_embeddings(self, body: Any):
        if not isinstance(body, dict):
            raise Problem(400, "request body must be a JSON object with 'input' and 'model'")
        self.check_task("embedding", "/v1/embeddings")
        if "input" not in body:
            raise Problem(400, "missing 'input'; send a string or a list of strings", param="input")
        model = body.get("model", self.model_id)
        if not isinstance(model, str):
            raise Problem(400, f"'model' must be a string, got {type(model).__name__}", param="model")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise Problem(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                          param="encoding_format")
        dims = body.get("dimensions")
        kind, items = self.parse_inputs(body["input"], "input", 400)
        policy = self.long_input_policy(body, 400)
        vectors, tokens = await self.embeddings(kind, items, policy, "input", 400)
        if dims is not None:
            vectors = self.truncate_dims(vectors, dims)
        data = [{"object": "embedding", "index": i,
                 "embedding": _b64(v) if fmt == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @staticmethod
    def truncate_dims(vectors: np.ndarray, dims: Any) -> np.ndarray:
        d = vectors.shape[1]
        if not _is_int(dims) or not 1 <= dims <= d:
            raise Problem(400, f"'dimensions' must be an integer from 1 to {d} (this model's size), got {dims!r}",
                          param="dimensions")
        return _l2(vectors[:, :dims])

    def openai_model(self) -> dict[str, Any]:
        """This model's /v1/models entry (OpenAI's fields, then the task and the artifact's digest)."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "bertopt",
                "task": self.task, "digest": self.facts["digest"]}

class TeiRoutes(RequestHandling):
    """Hugging Face text-embeddings-inference's routes, and /info."""

    async def tei_embed(self, body: Any):
        if not isinstance(body, dict):
            raise Problem(422, "request body must be a JSON object with 'inputs'")
        self.check_task("embedding", "/embed")
        if "inputs" not in body:
            raise Problem(422, "missing 'inputs'; send a string or a list of strings", param="inputs")
        normalize, policy = self.flag(body, "normalize", True), self.long_input_policy(body)
        kind, items = self.parse_inputs(body["inputs"], "inputs", 422)
        vectors, _ = await self.embeddings(kind, items, policy, "inputs", 413)
        return (_l2(vectors) if normalize else vectors).tolist()

    def parse_predict_inputs(self, value: Any) -> tuple[bool, list]:
        """TEI's shapes: a text, a [text, text] pair (one input), or a list of texts and pairs (a batch)."""
        def one(v):
            if isinstance(v, str) and v:
                return v
            if isinstance(v, list) and len(v) == 2 and all(isinstance(t, str) and t for t in v):
                return v
            return None

        if one(value) is not None:
            return True, [one(value)]
        if not isinstance(value, list):
            raise Problem(422, f"'inputs' must be a text, a [text, text] pair or a list of them, got "
                          f"{type(value).__name__}", param="inputs")
        self.check_count(len(value), "inputs")
        items = [one(v) for v in value]
        if None in items:
            i = items.index(None)
            raise Problem(422, f"'inputs[{i}]' must be a non-empty text or a [text, text] pair", param="inputs")
        return False, items

    async def tei_predict(self, body: Any):
        if not isinstance(body, dict):
            raise Problem(422, "request body must be a JSON object with 'inputs'")
        if self.task == "token-classification":
            return await self.token_entities(body)
        self.check_task("classification", "/predict")
        if "inputs" not in body:
            raise Problem(422, "missing 'inputs'", param="inputs")
        raw, policy = self.flag(body, "raw_scores", False), self.long_input_policy(body)
        single, items = self.parse_predict_inputs(body["inputs"])
        kinds = {isinstance(v, list) for v in items}
        if len(kinds) > 1:
            raise Problem(422, "'inputs' mixes texts and pairs; send one kind per request", param="inputs")
        kind = KIND_PAIR if kinds == {True} else KIND_TEXT
        if kind == KIND_PAIR and self.facts["model_info"].get("pair_input") is False:
            raise Problem(422, "this classification model takes a single text, but [text, text] pairs were given; "
                          "send texts", param="inputs")
        kind, lengths = await self.count_tokens(items, kind, policy, "inputs", 413)
        logits = await self.run(kind, items, lengths)
        from bertopt.runtime.tasks import class_probabilities, label_names

        info = self.facts["model_info"]
        scores = logits if raw else class_probabilities(logits, info)
        names = label_names(info, logits.shape[1])
        out = [sorted(({"label": n, "score": float(s)} for n, s in zip(names, row)), key=lambda d: -d["score"])
               for row in scores]
        return out[0] if single else out

    async def token_entities(self, body: dict):
        """/predict on a token-classification model: the entities of each text (transformers' pipeline
        aggregation, ``aggregation_strategy`` none | simple | first | average | max, default simple)."""
        from bertopt.runtime.tasks import AGGREGATIONS, token_entities

        if "inputs" not in body:
            raise Problem(422, "missing 'inputs'", param="inputs")
        aggregation = body.get("aggregation_strategy", "simple")
        if aggregation not in AGGREGATIONS:
            raise Problem(422, f"'aggregation_strategy' must be one of {', '.join(AGGREGATIONS)}, got "
                          f"{aggregation!r}", param="aggregation_strategy")
        policy = self.long_input_policy(body)
        single = isinstance(body["inputs"], str)
        _, texts = self.parse_inputs(body["inputs"], "inputs", 422, allow_ids=False)
        _, lengths = await self.count_tokens(texts, KIND_TEXT, policy, "inputs", 413)
        rows = await self.run(KIND_TEXT, texts, lengths)
        per_token = rows.reshape(len(texts), self.max_seq_len, -1)
        logits = [per_token[i, :n] for i, n in enumerate(lengths)]
        entities = token_entities(self.token_view, texts, logits, aggregation=aggregation)
        return entities[0] if single else entities

    async def tei_rerank(self, body: Any):
        if not isinstance(body, dict):
            raise Problem(422, "request body must be a JSON object with 'query' and 'texts'")
        self.check_task("rerank", "/rerank")
        query, texts = body.get("query"), body.get("texts")
        if not isinstance(query, str) or not query:
            raise Problem(422, "'query' must be a non-empty string", param="query")
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise Problem(422, "'texts' must be a list of non-empty strings", param="texts")
        self.check_count(len(texts), "texts")
        raw, policy = self.flag(body, "raw_scores", False), self.long_input_policy(body)
        return_text = self.flag(body, "return_text", False)
        items = [[query, t] for t in texts]
        _, lengths = await self.count_tokens(items, KIND_PAIR, policy, "texts", 413)
        logits = await self.run(KIND_PAIR, items, lengths)
        from bertopt.runtime.tasks import rerank_scores

        scores = logits[:, 0].astype(np.float64)
        if not raw:
            scores = rerank_scores(scores, self.facts["model_info"])
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i])
        return [{"index": i, "score": float(scores[i]), **({"text": texts[i]} if return_text else {})}
                for i in ranked]

    async def tei_embed_sparse(self, body: Any):
        from bertopt.runtime.tasks import sparse_vectors

        if not isinstance(body, dict):
            raise Problem(422, "request body must be a JSON object with 'inputs'")
        self.check_task("sparse-embedding", "/embed_sparse")
        if "inputs" not in body:
            raise Problem(422, "missing 'inputs'; send a string or a list of strings", param="inputs")
        policy = self.long_input_policy(body)
        kind, items = self.parse_inputs(body["inputs"], "inputs", 422)
        weights, _ = await self.embeddings(kind, items, policy, "inputs", 413)
        return [[{"index": i, "value": v} for i, v in zip(s["indices"], s["values"])]
                for s in sparse_vectors(weights)]

    async def tei_tokenize(self, body: Any):
        if not isinstance(body, dict) or "inputs" not in body:
            raise Problem(422, "request body must be a JSON object with 'inputs'", param="inputs")
        special = self.flag(body, "add_special_tokens", True)
        _, texts = self.parse_inputs(body["inputs"], "inputs", 422, allow_ids=False)
        self.check_texts(texts, None, "inputs", 413)
        encodings = await asyncio.to_thread(self.tokenizer.encode_batch, texts, add_special_tokens=special)
        tokens = sum(len(enc.ids) for enc in encodings)
        # each token becomes a JSON object of ~60 bytes, and ~1 kB of Python while the answer is built: 4 MB of
        # text within every other limit made a 131 MB answer and 1 GB of server memory
        limit = min(self.cfg.max_request_tokens, TOKENIZE_MAX_TOKENS)
        if tokens > limit:
            which = "(--max-request-tokens)" if limit == self.cfg.max_request_tokens else "on /tokenize"
            raise Problem(413, f"request holds {tokens} tokens, more than this server's limit of {limit} {which}; "
                          "split the request", param="inputs")
        out = []
        for enc in encodings:
            out.append([{"id": i, "text": t, "special": bool(s), "start": a if not s else None,
                         "stop": b if not s else None}
                        for i, t, s, (a, b) in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets)])
        return out

    def info(self) -> dict[str, Any]:
        from bertopt.version import __version__

        f, c = self.facts, self.cfg
        worker = self.front.worker_info(self.model_id)
        model_type = {"embedding": {"embedding": {"dim": f.get("embedding_dim")}},
                      "classification": {"classifier": {"id2label": f.get("id2label")}},
                      "rerank": {"reranker": {}}, "sparse-embedding": {"splade": {}}}.get(self.task, {self.task: {}})
        return {"model_id": self.model_id, "model_sha": f["digest"], "model_dtype": f["precision"],
                "model_type": model_type, "task": self.task, "artifact": f["artifact"], "digest": f["digest"],
                "max_input_length": self.max_seq_len, "long_inputs": c.long_inputs,
                "max_batch_tokens": c.max_batch_tokens,
                "max_client_batch_size": c.max_client_batch_size, "max_text_chars": c.max_text_chars,
                "max_request_chars": c.max_request_chars, "max_request_tokens": c.max_request_tokens,
                "max_request_bytes": c.max_request_bytes, "body_timeout_s": c.body_timeout_s,
                "max_concurrent_requests": c.max_concurrent_requests, "num_worker": c.num_worker,
                "runtime": {k: worker.get(k) for k in ("backend", "provider", "threads")},
                "version": __version__, "ready": self.front.ready}


class Api(OpenAIRoutes, TeiRoutes):
    """Request handling for every route on one served model: validation, token counting, the fleet call, each
    API's answer."""


class ModelRouter:
    """Which served model answers a request: one ``Api`` per model, picked by the body's ``model`` field and the
    route's tasks."""

    def __init__(self, front):
        self.apis = {m["name"]: Api(front, m) for m in front.models}
        self.first = next(iter(self.apis.values()))

    def serving(self, tasks: tuple[str, ...]) -> list[str]:
        return [name for name, api in self.apis.items() if api.task in tasks]

    def pick(self, payload: Any, route: str, tasks: tuple[str, ...] | None, style: str) -> Api:
        """The model named by ``payload["model"]`` (404 when none is so named; 400 when it does not serve the
        route), else the first model serving ``tasks`` (all: the first model). One model answers everything."""
        if len(self.apis) == 1:  # as before several models: any `model` name reaches the one model
            return self.first
        name = payload.get("model") if isinstance(payload, dict) else None
        bad = 400 if style == OPENAI else 422
        if name is not None and not isinstance(name, str):
            raise Problem(bad, f"'model' must be a string, got {type(name).__name__}", param="model")
        served = ", ".join(f"{n} ({api.task})" for n, api in self.apis.items())
        if name is not None:
            api = self.apis.get(name)
            if api is None:
                raise Problem(404, f"the model '{name}' does not exist on this server; it serves {served} (see "
                              "/v1/models)", param="model", code="model_not_found")
            if tasks is not None and api.task not in tasks:
                names = self.serving(tasks)
                which = (f"models that serve it here: {', '.join(names)}" if names
                         else f"no model here serves it (models: {served})")
                raise Problem(400, f"{route} needs {_a(tasks[0])} model, but '{name}' is {_a(api.task)} model "
                              f"(use {ROUTE_FOR_TASK.get(api.task, 'another route')} for it); {which}",
                              param="model", code="wrong_task")
            return api
        if tasks is None:
            return self.first
        names = self.serving(tasks)
        if not names:
            raise Problem(400, f"{route} needs {_a(tasks[0])} model, but none of this server's models is one "
                          f"(models: {served})", code="wrong_task")
        return self.apis[names[0]]

    def openai_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [api.openai_model() for api in self.apis.values()]}

    def info(self) -> dict[str, Any]:
        """The first model's /info (TEI's fields, as with one model) and every model's under ``models``."""
        infos = [api.info() for api in self.apis.values()]
        return {**infos[0], "models": infos}


class TokenView:
    """What ``bertopt.runtime.tasks.token_entities`` reads from a Predictor (its truncating tokenizer and the
    manifest's model section), without a model session: the front end only post-processes the fleet's logits."""

    def __init__(self, facts: dict[str, Any]):
        from types import SimpleNamespace

        from bertopt.runtime.predictor import load_tokenizer

        self.tokenizer = load_tokenizer(Path(facts["tokenizer"]), int(facts["max_seq_len"]))
        self.model = SimpleNamespace(model_info=facts["model_info"])

    def tokenize(self, texts, pairs=None):
        return self.tokenizer.encode_batch(list(texts) if pairs is None else list(zip(texts, pairs)))


# -- helpers (task post-processing lives in bertopt.runtime.tasks, shared with the Predictor) --------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _l2(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


# -- Starlette wiring ---------------------------------------------------------------------------------------
def build_app(front):
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response
    from starlette.routing import Route

    router = ModelRouter(front)
    api = router.first  # what does not depend on the model: the API key, reading the body
    metrics = front.metrics

    def endpoint(route: str, style: str, handler, *, auth: bool = True, admit: bool = False, body: bool = True,
                 tasks: tuple[str, ...] | None = None):
        """``handler``: a callable, or the name of the ``Api`` method that answers on the request's model (picked
        by ``router`` among the models of ``tasks``; None: any model)."""
        async def call(request):
            started = time.perf_counter()
            admitted = False
            model = ""
            try:
                if auth:
                    api.check_key(request.headers)
                # the body is read before admission: a slow (or stalled) upload holds no admission slot, and
                # is cut off after --body-timeout
                payload = await api.read_json(request) if body else None
                run = handler
                if isinstance(handler, str):
                    chosen = router.pick(payload, route, tasks, style)
                    model, run = chosen.model_id, getattr(chosen, handler)
                if admit:
                    if not front.ready or not front.workers_ready(model or None):
                        message = "the server is loading its workers; retry shortly"
                        if front.ready and model and front.workers_ready():  # the fleet runs, this model does not
                            message = (f"no worker of model '{model}' is running (restarting, or stopped after "
                                       "failing to start: see /health and the server log); retry shortly")
                        raise Problem(503, message, headers={"Retry-After": "1"})
                    if front.in_flight >= front.cfg.max_concurrent_requests:
                        raise Problem(429, f"the server is at its limit of {front.cfg.max_concurrent_requests} "
                                      "concurrent requests (--max-concurrent-requests); retry after a second",
                                      headers={"Retry-After": "1"})
                    front.in_flight += 1
                    metrics.in_flight.inc()
                    admitted = True
                work = run(payload) if body else run()
                # a fleet request whose client hangs up is cancelled, and its queued work with it
                result = await _unless_disconnected(request, work) if admit else await work
                response = result if isinstance(result, Response) else _json(result)
            except Problem as p:
                response = error_response(style, p)
            except UserError as exc:  # what the request's input made the runtime refuse (a text its tokenizer fails on)
                response = error_response(style, Problem(400 if style == OPENAI else 422, str(exc)))
            except ClientDisconnect:  # the client went away: nothing to answer, nothing broken
                log.info("HTTP %s: the client disconnected before its answer", route)
                response = error_response(style, Problem(CLIENT_CLOSED, "client closed the connection"))
            except Exception:  # a bug: logged with its traceback here, never sent to the client
                log.exception("HTTP %s failed", route)
                response = error_response(style, Problem(500, "internal server error; see the server log"))
            finally:
                if admitted:
                    front.in_flight -= 1
                    metrics.in_flight.dec()
            metrics.requests.labels(route, str(response.status_code)).inc()
            if model:
                metrics.model_requests.labels(model, str(response.status_code)).inc()
            metrics.request_seconds.labels(route, model).observe(time.perf_counter() - started)
            return response

        return call

    def sync(fn):
        async def wrapped(*args):
            return fn(*args)
        return wrapped

    async def health():
        ready = front.workers_ready()
        # ready when every model has a worker (a fleet of several models answers for all of them or is not ready)
        missing = [name for name in router.apis if not front.workers_ready(name)]
        if front.ready and not missing:
            return {"status": "ok", "workers_ready": ready}
        status = "loading" if not front.ready else "no worker ready"
        if front.ready and ready:  # a fleet of several models, some of them without a live worker
            status += " for " + ", ".join(missing)
        return _json({"status": status, "workers_ready": ready}, 503)

    async def prometheus():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @asynccontextmanager
    async def lifespan(app):
        await front.on_startup()
        yield
        await front.on_shutdown()

    routes = [
        Route("/v1/embeddings", endpoint("/v1/embeddings", OPENAI, "openai_embeddings", admit=True,
                                         tasks=("embedding",)), methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", OPENAI, sync(router.openai_models), body=False),
              methods=["GET"]),
        Route("/embed", endpoint("/embed", TEI, "tei_embed", admit=True, tasks=("embedding",)), methods=["POST"]),
        Route("/predict", endpoint("/predict", TEI, "tei_predict", admit=True,
                                   tasks=("classification", "token-classification")), methods=["POST"]),
        Route("/rerank", endpoint("/rerank", TEI, "tei_rerank", admit=True, tasks=("rerank",)), methods=["POST"]),
        Route("/embed_sparse", endpoint("/embed_sparse", TEI, "tei_embed_sparse", admit=True,
                                        tasks=("sparse-embedding",)), methods=["POST"]),
        Route("/tokenize", endpoint("/tokenize", TEI, "tei_tokenize", admit=True), methods=["POST"]),
        Route("/health", endpoint("/health", TEI, health, auth=False, body=False), methods=["GET"]),
        Route("/info", endpoint("/info", TEI, sync(router.info), body=False), methods=["GET"]),
        Route("/metrics", endpoint("/metrics", TEI, prometheus, body=False), methods=["GET"]),
    ]
    async def no_route(request, exc):
        """404 / 405 in OpenAI's error schema (a JSON body, like every other answer), not Starlette's text."""
        status = getattr(exc, "status_code", 404)
        if status == 405:
            message = f"{request.method} is not allowed on {request.url.path}; use {exc.headers.get('Allow', '')}"
        else:
            message = f"no route {request.url.path}; see /v1/models, /embed, /predict, /rerank, /health"
        metrics.requests.labels("unrouted", str(status)).inc()
        return error_response(OPENAI, Problem(status, message, code="not_found" if status == 404 else None,
                                              headers=dict(exc.headers or {})))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: no_route, 405: no_route})


async def _unless_disconnected(request, work):
    """``work``'s result, or ClientDisconnect once the client hangs up first (``work`` is then cancelled: the
    front end tells the fleet to drop the request's queued pieces). Without this a request whose client was gone
    stayed queued, and was computed, for nobody."""
    from starlette.requests import ClientDisconnect

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    try:
        await task
    except asyncio.CancelledError:
        pass  # cancelled here, as meant: the client is gone
    raise ClientDisconnect()


async def _disconnected(request) -> None:
    """Returns when the client closes the connection (the body was read already: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


def _a(word: str) -> str:
    return ("an " if word[:1] in "aeiou" else "a ") + word
