"""Predictor: artifact (or any model handle) -> session -> text in, embeddings/logits out.

This is the only place a served or validated model is run (``run``, ``validate``, ``bench``, the Spark
UDF, the ZeroMQ worker and the Kafka bridge all build a Predictor), so what is validated is what is served.

Batching is length-bucketed by default: texts are sorted by token count, each batch is padded only to its
own longest text, and results are put back in the caller's order. A batch also ends early when the next text
is much longer than the batch's first (``BUCKET_GROWTH``): real text has a long tail (a few paragraphs among
many short sentences), and without that bound one paragraph pads 31 short texts to its length. On 256-text
chunks of the built-in corpus this bound doubled MiniLM's throughput. Padding never changes a real token's
output (attention masks it), so bucketing changes speed, not values.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bertopt.artifact import Artifact, read_regular_file
from bertopt.errors import UserError
from bertopt.model_handle import ModelHandle
from bertopt.runtime.backends import describe, open_session
from bertopt.untrusted import lone_surrogate

DEFAULT_BATCH_SIZE = 32
# a batch ends before a text longer than BUCKET_GROWTH x (its first text) + BUCKET_SLACK_TOKENS; the slack
# keeps short texts (3-10 tokens) in full batches, where per-batch overhead matters more than padding
BUCKET_GROWTH = 1.25
BUCKET_SLACK_TOKENS = 8


def check_texts(texts: Sequence[Any], pairs: Sequence[Any] | None = None, name: str = "text {}") -> None:
    """Every text a ``str`` of Unicode scalar values, else UserError naming the first bad one (``name`` formats
    its index). A lone surrogate (``"a\\ud800b"``, what JSON's ``\\ud800`` escape decodes to) is not a
    character: the tokenizer cannot encode it and raises mid-batch, so it is refused here, before tokenising.
    Every front end (ZeroMQ, HTTP, Kafka, Spark) reaches this through ``Predictor.tokenize``, and the servers
    call it at intake so the request gets its own error reply."""
    for segments, which in ((texts, ""), (pairs, " (second text)")):
        if segments is None:
            continue
        for i, text in enumerate(segments):
            if not isinstance(text, str):
                raise UserError(f"{name.format(i)}{which} is a {type(text).__name__}, not a string; "
                                "send strings")
            at = lone_surrogate(text)
            if at is not None:
                raise UserError(f"{name.format(i)}{which} holds a lone surrogate (U+{ord(text[at]):04X}) at "
                                f"character {at}, which is not a Unicode character; send valid UTF-8 "
                                "text")


# tokenizer.json files run to tens of megabytes (large multilingual vocabularies); far larger is not one
MAX_TOKENIZER_BYTES = 512 << 20


def read_tokenizer_json(file: Path, shown_as: Path | None = None):
    """A ``tokenizers.Tokenizer`` from ``file``: a regular file (no symlink, FIFO or device: nothing hangs) read
    once and parsed from what was read; a file that is not a tokenizer is one UserError naming it (as
    ``shown_as``: the user's file this one is a copy of) and the fix."""
    from tokenizers import Tokenizer

    file = Path(file)
    shown = shown_as or file
    fix = "save the tokenizer again with the model (tokenizer.save_pretrained) or re-create the artifact"
    data = read_regular_file(file, max_bytes=MAX_TOKENIZER_BYTES, fix=fix, shown_as=shown,
                             too_large="too large for a tokenizer")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{shown} is not UTF-8 text, so not a tokenizer.json; {fix}") from None
    except Exception as exc:  # the tokenizers library raises plain Exception for any file it cannot read
        reason = " ".join(str(exc).split())[:160]
        raise UserError(f"{shown} is not a tokenizer the tokenizers library can read ({reason}); {fix}") from None


def load_tokenizer(tokenizer_dir: Path, max_seq_len: int):
    """A fast (Rust) tokenizer from ``tokenizer.json``, truncating to ``max_seq_len``, no padding."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.exists() and not file.is_symlink():
        raise UserError(f"no tokenizer.json in {tokenizer_dir}; re-create the artifact with 'bertopt export'")
    tok = read_tokenizer_json(file)
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_len)
    return tok


def sequence_length(model_info: dict[str, Any], max_seq_len: int | None = None) -> int:
    """The tokens a text is truncated to: ``max_seq_len`` when given, else the artifact's recorded one, else the
    model's position limit; never more than that limit (the one rule; serve and every Predictor apply it)."""
    model_max = int(model_info.get("max_position_embeddings", 512))
    seq = int(max_seq_len or model_info.get("max_seq_len") or model_max)
    if seq > model_max:
        raise UserError(f"max sequence length {seq} exceeds the model's {model_max} positions; "
                        f"use --max-seq-len {model_max} or less")
    return seq


class Predictor:
    def __init__(
        self,
        model: ModelHandle | Artifact | str | os.PathLike,
        *,
        provider: str = "auto",
        threads: int | None = None,
        max_seq_len: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        runtime: str | None = None,
        length_bucketing: bool = True,
        verify: bool = True,
        session=None,
        device_id: int | None = None,
    ):
        # ``model`` is an artifact folder (loaded and verified here), an Artifact, or a ModelHandle (a reference
        # model, a staged artifact's handle, a variant with other runtime options); ``session`` runs another model
        # with this one's description (the accuracy search's candidates, a view at another sequence length).
        if isinstance(model, (str, os.PathLike)):
            model = Artifact.load(model, verify=verify)
        if isinstance(model, Artifact):
            handle = model.model_handle()
        elif isinstance(model, ModelHandle):
            handle = model
        else:
            raise TypeError(f"Predictor runs an artifact or a ModelHandle, not {type(model).__name__}")
        self.model = handle
        # what the model is, for callers that describe or inspect it (model_info, inputs, outputs, path, digest):
        # the Artifact when there is one, else the handle, which carries the same facts
        self.artifact: Artifact | ModelHandle = model
        info = handle.model_info
        self.max_seq_len = sequence_length(info, max_seq_len)
        if batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.length_bucketing = length_bucketing
        self.tokenizer = load_tokenizer(handle.tokenizer_path, self.max_seq_len)
        self.session = session or open_session(handle, backend=runtime, provider=provider, threads=threads,
                                               device_id=device_id)
        self.input_names = [i["name"] for i in handle.inputs]
        missing = [n for n in self.input_names if n not in self.session.input_names]
        if missing:
            raise UserError(f"artifact {handle.path} declares inputs {missing} the model does not have; "
                            "re-create the artifact")
        self.outputs = {o["name"]: o for o in handle.outputs}
        self.output_names = [o["name"] for o in handle.outputs]
        self.primary_output = handle.primary_output
        self.stats = {"batches": 0, "texts": 0, "tokens": 0}
        self._lock = threading.Lock()  # sessions are thread-safe; counters are not

    # -- info -----------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "artifact": str(self.model.path),
            "digest": self.model.digest,
            "precision": self.model.precision,
            "max_seq_len": self.max_seq_len,
            "batch_size": self.batch_size,
            "primary_output": self.primary_output,
            **describe(self.session),
        }

    def is_token_level(self, name: str) -> bool:
        return "sequence" in [str(d) for d in self.outputs[name].get("shape", [])]

    @property
    def embedding_dim(self) -> int:
        shape = self.outputs[self.primary_output].get("shape", [])
        return int(shape[-1]) if shape and isinstance(shape[-1], int) else -1

    # -- tokenisation ---------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], pairs: Sequence[str] | None = None):
        if pairs is not None and len(pairs) != len(texts):
            raise UserError(f"got {len(texts)} first segments but {len(pairs)} second segments")
        check_texts(texts, pairs)
        if pairs is not None:
            return self.tokenizer.encode_batch(list(zip(texts, pairs)))
        return self.tokenizer.encode_batch(list(texts))

    def feeds_for(self, encodings, pad_to: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        width = int(lengths.max()) if len(lengths) else 0
        if pad_to:
            width = max(width, min(pad_to, self.max_seq_len))
        n = len(encodings)
        ids = np.zeros((n, width), dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            k = len(enc.ids)
            ids[row, :k] = enc.ids
            mask[row, :k] = 1
            types[row, :k] = enc.type_ids
        all_feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
                     "input_mask": mask, "segment_ids": types}
        feeds = {}
        for spec in self.model.inputs:
            arr = all_feeds[spec.get("role", spec["name"])]
            if spec.get("dtype") == "int32":
                arr = arr.astype(np.int32)
            feeds[spec["name"]] = arr
        return feeds, lengths

    # -- running -----------------------------------------------------------------------------------------
    def run_batch(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs or self.output_names)
        arrays = self.session.run(names, feeds)
        return {n: np.asarray(a, dtype=np.float32) if a.dtype != np.float32 else a for n, a in zip(names, arrays)}

    def run(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
        pad_to: int | None = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """Run every text; pooled outputs come back as ``(n, d)`` arrays, token-level outputs as a list of
        per-text ``(tokens, d)`` arrays trimmed to the real tokens, all in the caller's order."""
        names = list(outputs or self.output_names)
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise UserError(f"unknown output {unknown[0]!r}; this artifact has: {', '.join(self.output_names)}")
        encodings = self.tokenize(texts, pairs)
        n = len(encodings)
        result: dict[str, Any] = {}
        if n == 0:
            for name in names:
                if self.is_token_level(name):
                    result[name] = []
                else:
                    result[name] = np.zeros((0, max(self.embedding_dim, 0)), dtype=np.float32)
            return result
        bs = batch_size or self.batch_size
        pieces: dict[str, list] = {name: [None] * n for name in names}
        tokens = 0
        batches = 0
        for idx in self.plan_batches(encodings, bs, bounded_padding=pad_to is None):
            feeds, lengths = self.feeds_for([encodings[i] for i in idx], pad_to=pad_to)
            out = self.run_batch(feeds, names)
            batches += 1
            tokens += int(lengths.sum())
            for name in names:
                arr = out[name]
                for j, i in enumerate(idx):
                    pieces[name][i] = arr[j, : lengths[j]] if self.is_token_level(name) else arr[j]
        with self._lock:
            self.stats["batches"] += batches
            self.stats["texts"] += n
            self.stats["tokens"] += tokens
        for name in names:
            result[name] = pieces[name] if self.is_token_level(name) else np.stack(pieces[name])
        return result

    def plan_batches(self, encodings, batch_size: int, bounded_padding: bool = True) -> list[list[int]]:
        """Indices of each batch, in run order. Without bucketing: input order, ``batch_size`` at a time.
        With it: sorted by length (stable, so results are reproducible), at most ``batch_size`` a batch, and
        (unless every batch is padded to one fixed length anyway) a new batch before a text much longer than
        the batch's first."""
        n = len(encodings)
        if not self.length_bucketing:
            return [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
        order = sorted(range(n), key=lambda i: len(encodings[i].ids))
        batches: list[list[int]] = []
        current: list[int] = []
        limit = 0.0
        for i in order:
            length = len(encodings[i].ids)
            if current and (len(current) >= batch_size or (bounded_padding and length > limit)):
                batches.append(current)
                current = []
            if not current:
                limit = BUCKET_GROWTH * length + BUCKET_SLACK_TOKENS
            current.append(i)
        if current:
            batches.append(current)
        return batches

    def encode(self, texts: Sequence[str] | str, pairs: Sequence[str] | None = None) -> np.ndarray:
        """The primary output (sentence embedding, logits, ...) as one float32 array."""
        if isinstance(texts, str):
            texts = [texts]
        out = self.run(texts, pairs, outputs=[self.primary_output])[self.primary_output]
        if self.is_token_level(self.primary_output):
            raise UserError(f"primary output {self.primary_output} is per-token; ask for it with run()")
        return out

    # -- task-level results (bertopt.runtime.tasks) ---------------------------------------------------------
    @property
    def task(self) -> str:
        """embedding, classification, token-classification, rerank or sparse-embedding."""
        from bertopt.runtime.tasks import task_of

        return task_of(self.model)

    def predict(self, texts: Sequence[str] | str, pairs: Sequence[str] | None = None, aggregation: str = "simple",
                ignore_labels: Sequence[str] | None = None) -> list[Any]:
        """One task result per text: classification ``{"label", "score", "scores"}``; token classification a
        list of entities (transformers-pipeline ``aggregation``: none, simple, first, average, max); rerank a
        score per (text, pair); sparse embedding ``{"indices", "values"}``; embedding the vector."""
        from bertopt.runtime.tasks import predict

        return predict(self, texts, pairs, aggregation=aggregation, ignore_labels=ignore_labels)

    def rerank(self, query: str, passages: Sequence[str], top_k: int | None = None) -> list[dict[str, Any]]:
        """Passages sorted by relevance to ``query`` (rerank models): ``[{"index", "score", "text"}]``."""
        from bertopt.runtime.tasks import rerank

        return rerank(self, query, passages, top_k=top_k)
