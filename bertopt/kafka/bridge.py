"""Kafka request/response bridge: requests topic -> one batch through the model -> responses topic -> commit.

Client applications never call the model. They write a JSON request to the request topic::

    {"id": "r-1", "text": "a sentence"}          or        {"id": 7, "texts": ["one", "two"]}

(a rerank model takes ``"pair"`` / ``"pairs"`` with the passages; a token-classification model an optional
``"aggregation"``: none, simple, first, average, max)
The bridge takes up to ``max_batch`` requests (or what arrived within ``max_wait_ms``), runs all their texts as one
batch (through ``bertopt.runtime.Predictor`` or a running ``bertopt serve`` cluster), writes one response per
request to the response topic, keyed by the request's key::

    {"id": "r-1", "embedding": [...], "artifact": "<digest>"}            ("embeddings": [[...]] for "texts")
    {"id": 7, "task": "classification", "result": {"label": "POSITIVE", "score": 0.93, "scores": {...}},
     "label": "POSITIVE", "artifact": ...}                                  (task models: "results" for "texts";
                                                                            entities, rerank score, sparse vector)
    {"id": "r-2", "error": "<problem>; <fix>", "artifact": ...}          (a request that failed)

and only after the broker acknowledged every response does it commit the batch's offsets (auto-commit is off).
So delivery is at-least-once: a bridge that dies between predicting and committing leaves the batch uncommitted
and it is processed again after the restart (the duplicate responses carry the same values).

Every message is untrusted (``bertopt.messages``): its size and JSON depth are bounded before parsing, and its
types, text count and texts (valid Unicode, at most ``--max-text-chars``) are checked before anything is
tokenised. Any request that fails (malformed, over a bound, refused or failed by the model) gets an error
response for itself alone, keyed by its message key; one without a usable id is answered with ``"id": null``.
The bridge itself exits, non-zero (``BackendFailed``, exit code 3), only when the backend or the broker fails:
the batch is then not committed, and a restart answers it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from bertopt.errors import BackendFailed, UserError, require
from bertopt.kafka.params import BRIDGE_FIELDS
from bertopt.messages import (  # noqa: F401  (the bridge's contract)
    _NO_ID,
    EMBEDDING_PAIRS_ERROR,
    MAX_REQUEST_BYTES,
    MAX_TEXT_CHARS,
    MAX_TEXTS_PER_REQUEST,
    ParsedRequest,
    ResponseFormat,
    parse_request,
    response_id,
)

log = logging.getLogger("bertopt.kafka")

# Test-only fault injection: "kill-before-commit:N" makes the bridge SIGKILL itself after the N-th batch's
# responses were acknowledged and before its offsets are committed, the exact window at-least-once is about.
FAILPOINT_ENV = "BERTOPT_KAFKA_FAILPOINT"
PROBE_TEXT = "bertopt health probe"

_DEFAULT = BRIDGE_FIELDS.defaults()  # BridgeConfig's defaults are its Params' (kafka/params.py)


@dataclass
class BridgeConfig:
    bootstrap: str
    request_topic: str
    response_topic: str
    group_id: str = _DEFAULT["group_id"]
    max_batch: int = _DEFAULT["max_batch"]
    max_wait_ms: int = _DEFAULT["max_wait_ms"]
    max_texts_per_request: int = _DEFAULT["max_texts_per_request"]
    max_text_chars: int = _DEFAULT["max_text_chars"]
    max_request_bytes: int = _DEFAULT["max_request_bytes"]
    stats_interval_s: float = _DEFAULT["stats_interval_s"]
    connect_timeout_s: float = _DEFAULT["connect_timeout_s"]
    flush_timeout_s: float = 60.0
    kafka_config: dict[str, str] = field(default_factory=dict)
    client_errors: Any = field(default_factory=lambda: _ClientErrors(), repr=False, compare=False)

    def check(self) -> None:
        """Each value against its declaration (``kafka/params.py``: the flags' bounds, stated once), then what
        relates two of them."""
        BRIDGE_FIELDS.check(self, "kafka")
        if self.request_topic == self.response_topic:
            raise UserError(f"the request and response topics are both {self.request_topic!r}; the bridge would "
                            "consume its own responses: use two topics")


@dataclass
class Counters:
    consumed: int = 0   # messages taken from the request topic
    produced: int = 0   # responses the broker acknowledged (error responses included)
    errors: int = 0     # requests answered with an error response, and consumer errors
    no_id: int = 0      # of those, requests without a usable id (answered with "id": null)
    texts: int = 0      # texts run through the model
    batches: int = 0
    committed: int = 0  # messages whose offsets were committed
    lag: int = -1       # requests waiting in the assigned partitions at the last check (-1: unknown)


class DeliveryFailed(BackendFailed):
    """The broker did not acknowledge every response: the batch is not committed (it will be re-processed)."""


# -- backends: where a batch of texts is run ------------------------------------------------------------------
class LocalBackend:
    """In this process, through the one runtime."""

    name = "local"

    def __init__(self, artifact, *, threads: int | None = None, batch_size: int = 32, provider: str = "auto",
                 long_inputs: str = "truncate"):
        from bertopt.runtime import Predictor

        try:
            self.predictor = Predictor(artifact, threads=threads, batch_size=batch_size, provider=provider,
                                       long_inputs=long_inputs)
        except UserError:
            raise
        except Exception as exc:  # a model the runtime cannot open: one line, and a non-zero exit
            raise BackendFailed(f"cannot load the model of {artifact}: {_first_line(exc)}") from None
        self.digest = self.predictor.model.digest
        self.model_info = self.predictor.model.model_info

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self.predictor.encode(list(texts))

    def predict(self, texts: Sequence[str], pairs: Sequence[str] | None = None, aggregation: str = "simple") -> list:
        return self.predictor.predict(list(texts), pairs, aggregation=aggregation)

    def close(self) -> None:
        return None


class ZmqBackend:
    """Through a running ``bertopt serve`` cluster, so the bridge scales out with the workers."""

    name = "zmq"

    def __init__(self, artifact, *, host: str, port: int, port_out: int, timeout_ms: int):
        from bertopt.artifact import Artifact
        from bertopt.client import Client, ServerTimeout

        art = Artifact.load(artifact)  # the manifest names the digest and the task the responses report
        self.digest = art.digest
        self.model_info = art.model_info
        self.where = f"{host}:{port}/{port_out}"
        self.client = Client(host, port, port_out, timeout=timeout_ms / 1000)
        try:
            served = self.client.status().get("digest")
        except ServerTimeout as exc:
            self.client.close()
            raise UserError(str(exc)) from None
        if served != self.digest:
            self.client.close()
            raise UserError(f"the server at {self.where} serves artifact {str(served)[:12]}, not {art.path} "
                            f"({self.digest[:12]}); pass the artifact it serves or point --port at the right server")

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        from bertopt.client import ServerError, ServerTimeout

        try:
            return np.asarray(self.client.encode(list(texts)), dtype=np.float32)
        except ServerTimeout as exc:
            raise BackendFailed(f"{exc}; the batch was not committed and will be processed again") from None
        except ServerError as exc:
            # the server refused this input: answered request by request (see KafkaBridge._predict)
            raise UserError(str(exc)) from None

    def predict(self, texts: Sequence[str], pairs: Sequence[str] | None = None, aggregation: str = "simple") -> list:
        from bertopt.client import ServerError, ServerTimeout

        try:
            return self.client.predict(list(texts), pairs, aggregation=aggregation)
        except ServerTimeout as exc:
            raise BackendFailed(f"{exc}; the batch was not committed and will be processed again") from None
        except ServerError as exc:
            raise UserError(str(exc)) from None

    def close(self) -> None:
        self.client.close()


# -- the bridge ----------------------------------------------------------------------------------------------
class _LibrdkafkaLog:
    """librdkafka's own log lines (one per failed connection attempt and broker: hundreds while a cluster is
    unreachable) go to the ``bertopt.kafka.librdkafka`` logger at DEBUG; the bridge says what matters itself in
    one line (``check_topics``)."""

    def __init__(self):
        self.logger = logging.getLogger("bertopt.kafka.librdkafka")

    def log(self, level, fmt, *args):
        self.logger.debug(fmt, *args)


class _ClientErrors:
    """librdkafka's error callback. Before the bridge runs, ``check_topics`` turns an unreachable cluster into one
    line, so errors are DEBUG; once it runs, each kind of error is a WARNING the first time it is seen."""

    def __init__(self):
        self.running = False
        self.seen: set[str] = set()

    def __call__(self, err) -> None:
        logger = logging.getLogger("bertopt.kafka.librdkafka")
        name = err.name() if hasattr(err, "name") else str(err)
        if self.running and name not in self.seen:
            self.seen.add(name)
            logger.warning("Kafka client error: %s (further ones of this kind at DEBUG)", err)
        else:
            logger.debug("Kafka client error: %s", err)


def kafka_configs(cfg: BridgeConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Consumer and producer configurations: manual offsets, acks from every in-sync replica; ``-X`` wins."""
    consumer = {
        "bootstrap.servers": cfg.bootstrap,
        "group.id": cfg.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",  # requests written before the first bridge started are answered too
        "session.timeout.ms": 10000,      # a dead bridge's partitions move to a live one after 10 s
        "client.id": "bertopt-kafka",
    }
    producer = {
        "bootstrap.servers": cfg.bootstrap,
        "acks": "all",
        "linger.ms": 5,
        "client.id": "bertopt-kafka",
    }
    for conf in (consumer, producer):
        conf["logger"] = _LibrdkafkaLog()
        conf["error_cb"] = cfg.client_errors
    for key, value in cfg.kafka_config.items():
        if key.startswith("consumer."):
            consumer[key[len("consumer."):]] = value
        elif key.startswith("producer."):
            producer[key[len("producer."):]] = value
        else:
            consumer[key] = value
            producer[key] = value
    if not str(consumer.get("group.id", "")).strip():  # librdkafka aborts the process (a C assertion) on ''
        raise UserError("the consumer's group.id is empty (from -X); give a consumer group name, or drop that -X")
    return consumer, producer


class KafkaBridge:
    def __init__(self, backend, cfg: BridgeConfig):
        cfg.check()
        self.ck = require("confluent_kafka", "kafka", "bertopt kafka")
        self.backend = backend
        self.cfg = cfg
        self.format = ResponseFormat(backend.model_info, backend.digest)
        self.counters = Counters()
        self.stopping = False
        self._failpoint = _parse_failpoint(os.environ.get(FAILPOINT_ENV))
        # a backend's own limits on a request's texts and pairs (spark: no empty text)
        self._refuse = getattr(backend, "refuse", None)
        consumer_conf, producer_conf = kafka_configs(cfg)
        # the brokers the consumer is told (an -X bootstrap.servers wins over --bootstrap), named in the errors
        self.brokers = str(consumer_conf["bootstrap.servers"])
        try:
            self.consumer = self.ck.Consumer(consumer_conf)
            self.producer = self.ck.Producer(producer_conf)
        except self.ck.KafkaException as exc:
            raise UserError(f"invalid Kafka configuration: {exc.args[0].str()}; fix the -X KEY=VALUE options") \
                from exc
        self._delivery_errors: list[str] = []
        self._acked = 0

    # -- set-up -------------------------------------------------------------------------------------------
    def check_topics(self) -> None:
        """Fail early, as a user error, on an unreachable cluster or a missing topic."""
        try:
            meta = self.consumer.list_topics(timeout=self.cfg.connect_timeout_s)
        except self.ck.KafkaException as exc:
            raise UserError(f"cannot reach Kafka at {self.brokers} ({exc.args[0].str()}); check --bootstrap "
                            "(or -X bootstrap.servers) and that the brokers are up (security settings go in -X "
                            "KEY=VALUE)") from exc
        for flag, topic in (("--request-topic", self.cfg.request_topic),
                            ("--response-topic", self.cfg.response_topic)):
            if topic not in meta.topics or meta.topics[topic].error is not None:
                raise UserError(f"topic {topic!r} ({flag}) does not exist on {self.brokers}; create it first "
                                f"(kafka-topics.sh --create --topic {topic} --bootstrap-server {self.brokers})")

    # -- main loop ----------------------------------------------------------------------------------------
    def request_stop(self, signum=None, frame=None) -> None:
        if not self.stopping:
            log.info("signal %s: finishing the batch in hand, committing, then exiting", signum)
        self.stopping = True

    def run(self, install_signal_handlers: bool = True) -> Counters:
        try:
            self.check_topics()
        except UserError:
            self.consumer.close()
            raise
        self.cfg.client_errors.running = True
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        self.consumer.subscribe([self.cfg.request_topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        log.info("bridge up: %s -> %s (%s backend, artifact %s, group %s, batch <= %d, wait <= %d ms)",
                 self.cfg.request_topic, self.cfg.response_topic, self.backend.name, self.backend.digest[:12],
                 self.cfg.group_id, self.cfg.max_batch, self.cfg.max_wait_ms)
        next_stats = time.monotonic() + self.cfg.stats_interval_s
        try:
            while not self.stopping:
                messages = self.consumer.consume(num_messages=self.cfg.max_batch,
                                                 timeout=max(self.cfg.max_wait_ms, 1) / 1000)
                if messages:
                    self.process(messages)  # a signal during consume() still lets this batch finish
                if time.monotonic() >= next_stats:
                    self.log_stats()
                    next_stats = time.monotonic() + self.cfg.stats_interval_s
        finally:
            self.close()
        return self.counters

    def close(self) -> None:
        left = self.producer.flush(self.cfg.flush_timeout_s)
        if left:
            log.error("%d responses still unacknowledged at exit", left)
        self.log_stats(final=True)
        self.consumer.close()
        self.backend.close()

    def _on_assign(self, consumer, partitions) -> None:
        log.info("assigned partitions %s", [p.partition for p in partitions])

    def _on_revoke(self, consumer, partitions) -> None:
        # nothing is in flight here: every batch is committed before the next consume() call
        log.info("revoked partitions %s", [p.partition for p in partitions])

    # -- one batch ----------------------------------------------------------------------------------------
    def process(self, messages: list) -> None:
        """Predict, produce every response, wait for the broker's acknowledgements, then commit."""
        ok: list[tuple[Any, ParsedRequest]] = []
        responses: list[tuple[Any, dict[str, Any]]] = []
        commit_to: dict[tuple[str, int], int] = {}
        consumed = 0
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise self.ck.KafkaException(err)
                log.warning("consumer error: %s", err.str())
                self.counters.errors += 1
                continue
            self.counters.consumed += 1
            consumed += 1
            key = (msg.topic(), msg.partition())
            commit_to[key] = max(commit_to.get(key, -1), msg.offset() + 1)
            req = parse_request(msg.value(), self.cfg.max_texts_per_request, max_text_chars=self.cfg.max_text_chars,
                                max_bytes=self.cfg.max_request_bytes)
            if req.error is None and self._refuse is not None:
                req.error = self._refuse(req.texts, req.pairs)
            if req.error is not None:
                self.counters.errors += 1
                where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
                if req.id is _NO_ID:
                    self.counters.no_id += 1
                    log.warning("error response (id null) to request %s: %s; value starts %r", where, req.error,
                                (msg.value() or b"")[:80])
                else:
                    log.warning("error response to request %s (id %.80r): %s", where, req.id, req.error)
                responses.append((msg, self.format.error(response_id(req), req.error)))
                continue
            ok.append((msg, req))
        responses.extend(self._predict(ok))
        self._produce_and_wait(responses)
        self.counters.batches += 1
        if self._failpoint and self.counters.batches == self._failpoint:
            log.error("failpoint %s: killing the bridge before committing batch %d", FAILPOINT_ENV,
                      self.counters.batches)
            os.kill(os.getpid(), signal.SIGKILL)
        if commit_to:
            offsets = [self.ck.TopicPartition(t, p, o) for (t, p), o in commit_to.items()]
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
                self.counters.committed += consumed
            except self.ck.KafkaException as exc:
                # e.g. the partitions moved to another bridge in a rebalance: it re-processes them (duplicates,
                # never losses), so this is logged, not fatal
                log.warning("commit failed (%s); those requests will be answered again", exc.args[0].str())

    def _run(self, texts: list[str], pairs: list[str] | None, aggregation: str):
        """Embeddings (an array) from an embedding model, else the task results (a list)."""
        if self.format.task == "embedding":
            if pairs is not None:
                raise UserError(EMBEDDING_PAIRS_ERROR)
            return self.backend.encode(texts) if texts else np.zeros((0, 0), dtype=np.float32)
        return self.backend.predict(texts, pairs, aggregation) if texts else []

    def _predict(self, ok: list[tuple[Any, ParsedRequest]]) -> list[tuple[Any, dict[str, Any]]]:
        if not ok:
            return []
        # one model call per kind of request (with or without pairs, aggregation): usually just one
        groups: dict[tuple[bool, str], list[tuple[Any, ParsedRequest]]] = {}
        for msg, req in ok:
            groups.setdefault((req.pairs is not None, req.aggregation), []).append((msg, req))
        answered: dict[int, tuple[Any, dict[str, Any]]] = {}
        for (with_pairs, aggregation), members in groups.items():
            texts = [t for _, req in members for t in req.texts]
            pairs = [p for _, req in members for p in req.pairs] if with_pairs else None
            try:
                values = self._run(texts, pairs, aggregation)
            except BackendFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - which request is to blame is found below
                # an input the model refuses (UserError) or fails on: answer request by request, so one bad
                # request cannot sink the batch
                log.warning("batch failed (%s); retrying request by request", _first_line(exc))
                for msg, req in members:
                    answered[id(msg)] = self._predict_one(msg, req)
                continue
            self.counters.texts += len(texts)
            start = 0
            for msg, req in members:
                n = len(req.texts)
                answered[id(msg)] = (msg, self.format.ok(req.id, values[start:start + n], req.single))
                start += n
        return [answered[id(msg)] for msg, _ in ok]

    def _predict_one(self, msg, req: ParsedRequest) -> tuple[Any, dict[str, Any]]:
        try:
            values = self._run(req.texts, req.pairs, req.aggregation)
        except UserError as exc:
            self.counters.errors += 1
            return msg, self.format.error(req.id, str(exc))
        except BackendFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the request, or the backend? a known-good probe tells
            reason = _first_line(exc)
            self._check_backend(reason)
            self.counters.errors += 1
            log.warning("error response to request id %.80r: the model failed on it (%s)", req.id, reason)
            return msg, self.format.error(req.id, f"the model failed on this request ({reason}); check its texts")
        self.counters.texts += len(req.texts)
        return msg, self.format.ok(req.id, values, req.single)

    def _check_backend(self, reason: str) -> None:
        """After a request failed in the model: run a known-good text; if that fails too, the backend is broken
        (BackendFailed: the batch is not committed, the bridge exits non-zero) rather than the request."""
        probe = [PROBE_TEXT]
        try:
            self._run(probe, probe if self.format.task == "rerank" else None, "simple")
        except BackendFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a known-good text means a broken backend
            raise BackendFailed(f"the {self.backend.name} backend fails on a known-good text too "
                                f"({_first_line(exc)}; the request had failed with: {reason}); the batch was not "
                                "committed and will be processed again after a restart") from None

    def _produce_and_wait(self, responses: list[tuple[Any, dict[str, Any]]]) -> None:
        self._delivery_errors.clear()
        self._acked = 0
        for msg, body in responses:
            payload = json.dumps(body, separators=(",", ":")).encode()
            self._produce(msg.key(), payload, body)
        left = self.producer.flush(self.cfg.flush_timeout_s)
        if left or self._delivery_errors or self._acked != len(responses):
            raise DeliveryFailed(f"{left} of {len(responses)} responses unacknowledged after "
                                 f"{self.cfg.flush_timeout_s:.0f} s, {len(self._delivery_errors)} failed "
                                 f"({'; '.join(self._delivery_errors[:3])}); the batch was not committed and will "
                                 "be processed again after a restart")
        self.counters.produced += self._acked

    def _produce(self, key, payload: bytes, body: dict[str, Any]) -> None:
        while True:
            try:
                self.producer.produce(self.cfg.response_topic, value=payload, key=key, on_delivery=self._delivered)
                return
            except BufferError:  # the local queue is full: serve delivery reports, then try again
                self.producer.poll(0.1)
            except self.ck.KafkaException as exc:
                if exc.args[0].code() != self.ck.KafkaError.MSG_SIZE_TOO_LARGE or "error" in body:
                    raise
                self.counters.errors += 1
                message = (f"the response ({len(payload)} bytes) exceeds the producer's message.max.bytes; "
                           "send fewer texts per request")
                payload = json.dumps(self.format.error(body["id"], message)).encode()
                body = {"error": message}

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self._delivery_errors.append(err.str())
        else:
            self._acked += 1

    # -- counters -----------------------------------------------------------------------------------------
    def lag(self) -> int:
        """Requests waiting in this bridge's partitions: high watermark minus position, summed (-1: unknown)."""
        try:
            assigned = self.consumer.assignment()
            if not assigned:
                return 0
            total = 0
            for tp in self.consumer.position(assigned):
                low, high = self.consumer.get_watermark_offsets(tp, timeout=2.0, cached=False)
                position = tp.offset if tp.offset >= 0 else low
                total += max(high - position, 0)
            return total
        except self.ck.KafkaException as exc:
            log.warning("lag unknown: %s", exc.args[0].str())
            return -1

    def log_stats(self, final: bool = False) -> None:
        self.counters.lag = self.lag()
        log.info("%s %s", "final stats" if final else "stats", json.dumps(asdict(self.counters)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _parse_failpoint(value: str | None) -> int:
    if not value:
        return 0
    name, _, count = value.partition(":")
    if name != "kill-before-commit" or not count.isdigit():
        raise UserError(f"{FAILPOINT_ENV}={value!r} is not understood; use kill-before-commit:N or unset it")
    return int(count)


def parse_kafka_options(options: Sequence[str]) -> dict[str, str]:
    """``-X key=value`` pairs (librdkafka property names; ``consumer.``/``producer.`` prefixes target one)."""
    out: dict[str, str] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"-X {item!r} is not KEY=VALUE; write e.g. -X security.protocol=SASL_SSL")
        out[key.strip()] = value
    return out
