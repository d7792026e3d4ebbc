"""Predictor: artifact (or any model handle) -> session -> text in, embeddings/logits out.

This is the only place a served or validated model is run (``run``, ``validate``, ``bench``, the Spark
UDF, the ZeroMQ worker and the Kafka bridge all build a Predictor), so what is validated is what is served.

Batching is length-bucketed by default: texts are sorted by token count, each batch is padded only to its
own longest text, and results are put back in the caller's order. A batch also ends early when the next text
is much longer than the batch's first (``BUCKET_GROWTH``): real text has a long tail (a few paragraphs among
many short sentences), and without that bound one paragraph pads 31 short texts to its length. On 256-text
chunks of the built-in corpus this bound doubled MiniLM's throughput; tightening it from 1.25x + 8 tokens to
1.05x made MiniLM another 1.12x and MPNet 1.20x faster on ``mixed_text`` (``benchmarks/bucketing.py``). Padding never
changes a real token's output (attention masks it), so bucketing changes speed, not values.

Long inputs (a text over the window of ``sequence_length`` tokens) follow one policy, ``long_inputs``
(``params.LONG_INPUTS``): ``truncate`` cuts the text to the window (the tokenizer's truncation, as before);
``error`` refuses it with a UserError naming the window and the text's length; ``chunk`` runs it as overlapping
windows (the tokenizer's own overflow with ``stride``, so every window carries the family's special tokens) and
pools them (``pool_windows``, ``join_token_windows``): embeddings and logits by a token-weighted mean (an
embedding re-normalised when the model normalises), sparse vectors by their maximum (SPLADE's own pooling),
token outputs by joining the windows. Text pairs (rerank) are never chunked: over the window they are refused.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bertopt.artifact import Artifact
from bertopt.errors import ModelRunError, UserError
from bertopt.model_handle import ModelHandle
from bertopt.params import LONG_INPUTS
from bertopt.runtime.backends import describe, open_session
from bertopt.runtime.tokenizer_file import read_tokenizer_json, read_tokenizer_json_str
from bertopt.tasks import task_spec
from bertopt.untrusted import lone_surrogate, text_list

DEFAULT_BATCH_SIZE = 32
# a batch ends before a text longer than BUCKET_GROWTH x (its first text) + BUCKET_SLACK_TOKENS. Measured side
# by side (benchmarks/bucketing.py, mixed_text, 2 AVX2 cores): 1.05x + 0 ran 1.12x the old 1.25x + 8 for MiniLM on
# ONNX Runtime and on OpenVINO, 1.20x for MPNet, more than the 7% fewer padded tokens alone explain; its 3x more batches
# (52 for 512 texts) cost less than they save. Exact-length batches (1.0x: 151) were within noise on ONNX Runtime and
# slower on OpenVINO, whose per-batch cost is higher
BUCKET_GROWTH = 1.05
BUCKET_SLACK_TOKENS = 0
# chunk: consecutive windows share this fraction of a window's text tokens (the tokenizer's ``stride``), so no
# token is only ever seen at a window's edge without context
CHUNK_OVERLAP = 0.25


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


def load_tokenizer(tokenizer_dir: Path, max_seq_len: int):
    """A fast (Rust) tokenizer from ``tokenizer.json``, truncating to ``max_seq_len``, no padding."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.exists() and not file.is_symlink():
        raise UserError(f"no tokenizer.json in {tokenizer_dir}; re-create the artifact with 'bertopt export'")
    tok = read_tokenizer_json(file)
    specials = int(tok.num_special_tokens_to_add(False))
    if max_seq_len <= specials:  # the Rust tokenizer then silently truncates nothing: inputs past the positions
        raise UserError(f"a maximum of {max_seq_len} tokens per text leaves no room for the text (the tokenizer adds "
                        f"{specials} special tokens to each); use {specials + 1} or more")
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_len)
    return tok


def position_limit(model_info: dict[str, Any]) -> int:
    """The most tokens the model's position embeddings cover."""
    return int(model_info.get("max_position_embeddings", 512))


def sequence_length(model_info: dict[str, Any], max_seq_len: int | None = None) -> int:
    """The tokens a text is truncated to: ``max_seq_len`` when given, else the artifact's recorded one, else the
    model's position limit; never more than that limit (the one rule; serve and every Predictor apply it)."""
    model_max = position_limit(model_info)
    seq = int(max_seq_len or model_info.get("max_seq_len") or model_max)
    if seq < 1:
        raise UserError(f"a maximum of {seq} tokens per text is no length; give a positive --max-seq-len (or "
                        "re-create the artifact whose manifest records it)")
    if seq > model_max:
        raise UserError(f"max sequence length {seq} exceeds the model's {model_max} positions; "
                        f"use --max-seq-len {model_max} or less")
    return seq


def window_tokens(tokenizer) -> int:
    """Special tokens the family's tokenizer adds to one text ([CLS] ... [SEP], <s> ... </s>)."""
    return int(tokenizer.num_special_tokens_to_add(False))


def chunk_overlap(content_tokens: int) -> int:
    """Text tokens two consecutive windows share, for windows of ``content_tokens`` text tokens."""
    return int(content_tokens * CHUNK_OVERLAP)


def pool_windows(spec: dict[str, Any], rows: Sequence[np.ndarray], weights: Sequence[int],
                 normalize: bool = False) -> np.ndarray:
    """One pooled row from the rows of a text's windows: sparse vectors by their element-wise maximum (SPLADE
    pools tokens by max, so this is the max over every window's tokens); everything else (sentence
    embeddings, logits) by the mean weighted by each window's token count, then an embedding the model
    normalises is re-normalised to unit length."""
    stacked = np.stack([np.asarray(r, dtype=np.float64) for r in rows])
    if spec.get("kind") == "sparse":
        return stacked.max(axis=0).astype(np.float32)
    w = np.asarray(weights, dtype=np.float64)
    pooled = (stacked * w[:, None]).sum(axis=0) / w.sum()
    if spec.get("kind") == "embedding" and spec.get("normalized", normalize):
        pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
    return pooled.astype(np.float32)


def join_token_windows(windows, rows: Sequence[np.ndarray], overlap: int) -> np.ndarray:
    """One ``(tokens, d)`` array for a chunked text, aligned with its untruncated encoding: the leading special
    tokens of the first window, each text token from one window (of the ``overlap`` tokens two windows share,
    the first half from the earlier window, the rest from the later one, so each is away from a window's
    edge), the trailing special tokens of the last window."""
    parts = []
    last = len(windows) - 1
    for k, (window, row) in enumerate(zip(windows, rows)):
        text = [j for j, s in enumerate(window.sequence_ids) if s is not None]
        first, stop = text[0], text[-1] + 1
        if k == 0:
            parts.append(row[:first])
        head = overlap // 2 if k > 0 else 0
        tail = overlap - overlap // 2 if k < last else 0
        parts.append(row[first + head:stop - tail])
        if k == last:
            parts.append(row[stop:len(window.ids)])
    return np.concatenate(parts)


def _split(items: list[int], parts: int) -> list[list[int]]:
    size = -(-len(items) // parts)
    return [items[s: s + size] for s in range(0, len(items), size)]


def side_by_side(fn, items: Sequence[Any], width: int) -> list[Any]:
    """``fn`` of each item, in order, ``width`` at a time: the calling thread and ``width - 1`` helper threads
    (started per call, so a caller's runs never queue behind another caller's, as the server's priority lane's
    must not). The first error stops the rest and is raised here."""
    if width < 2 or len(items) < 2:
        return [fn(item) for item in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    indices = iter(range(len(items)))
    lock = threading.Lock()

    def work():
        while not errors:
            with lock:
                i = next(indices, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # handed to the caller below (Ctrl-C in the calling thread too)
                errors.append(exc)

    helpers = [threading.Thread(target=work, name="bertopt-stream", daemon=True)
               for _ in range(min(width, len(items)) - 1)]
    for thread in helpers:
        thread.start()
    try:
        work()
        for thread in helpers:
            thread.join()
    except BaseException as exc:  # Ctrl-C while waiting: the helpers stop after the batch they are running
        errors.append(exc)
        raise
    if errors:
        raise errors[0]
    return results


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
        long_inputs: str = LONG_INPUTS.default,
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
        self.long_inputs = LONG_INPUTS.coerce(long_inputs, "Predictor")
        self.tokenizer = load_tokenizer(handle.tokenizer_path, self.max_seq_len)
        self._untruncated = self._chunker = None  # copies of the tokenizer, made when first needed
        self.session = session or open_session(handle, backend=runtime, provider=provider, threads=threads,
                                               device_id=device_id)
        # the shapes of a full batch (every text at the window) as this Predictor runs it: whole, and where the
        # session runs batches side by side, the part of one split between its streams (a call of one batch)
        streams = max(1, int(getattr(self.session, "parallel_runs", 1)))
        part = -(-self.batch_size // streams)
        self.full_batches = [(self.batch_size, self.max_seq_len)] + \
            ([(part, self.max_seq_len)] if part < self.batch_size else [])
        expect = getattr(self.session, "expect_full_batches", None)
        if expect is not None:  # OpenVINO: a full batch may run on a copy of the model compiled for its shape
            for rows, tokens in self.full_batches:
                expect(rows, tokens)
        self.input_names = [i["name"] for i in handle.inputs]
        missing = [n for n in self.input_names if n not in self.session.input_names]
        if missing:
            raise UserError(f"artifact {handle.path} declares inputs {missing} the model does not have; "
                            "re-create the artifact")
        self.outputs = {o["name"]: o for o in handle.outputs}
        self.output_names = [o["name"] for o in handle.outputs]
        self.primary_output = handle.primary_output
        # padded tokens per call at most, as the task declares (SPLADE's vocabulary-sized temporaries)
        self.batch_tokens = task_spec(self.task).batch_tokens
        self.stats = {"batches": 0, "texts": 0, "tokens": 0}
        self._open_widths: dict[tuple[str, int], int] = {}  # (output, axis) -> the width its first batch had
        self._lock = threading.Lock()  # sessions are thread-safe; counters are not

    # -- info -----------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "artifact": str(self.model.path),
            "digest": self.model.digest,
            "precision": self.model.precision,
            "max_seq_len": self.max_seq_len,
            "batch_size": self.batch_size,
            "long_inputs": self.long_inputs,
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
    def tokenize(self, texts: Sequence[str], pairs: Sequence[str] | None = None, truncate: bool = True):
        """Encodings cut to the window (``truncate``; what the model runs), or whole (``truncate=False``: what a
        chunked text's joined token outputs line up with)."""
        texts = text_list(texts)
        pairs = None if pairs is None else text_list(pairs, "pairs")
        if pairs is not None and len(pairs) != len(texts):
            raise UserError(f"got {len(texts)} first segments but {len(pairs)} second segments")
        check_texts(texts, pairs)
        tokenizer = self.tokenizer if truncate else self.untruncated_tokenizer()
        if pairs is not None:
            return tokenizer.encode_batch(list(zip(texts, pairs)))
        return tokenizer.encode_batch(list(texts))

    # -- long inputs ----------------------------------------------------------------------------------------
    def long_input_policy(self, long_inputs: str | None = None) -> str:
        """``long_inputs`` (one call's choice) when given, else the Predictor's."""
        return self.long_inputs if long_inputs is None else LONG_INPUTS.coerce(long_inputs, "long_inputs")

    def untruncated_tokenizer(self):
        if self._untruncated is None:
            tok = read_tokenizer_json_str(self.tokenizer.to_str())
            tok.no_truncation()
            self._untruncated = tok
        return self._untruncated

    def chunk_tokenizer(self):
        """The tokenizer cutting a text into windows of ``max_seq_len`` tokens (special tokens included) that
        overlap by ``chunk_overlap`` text tokens: its encoding's ``overflowing`` are the windows after the
        first."""
        if self._chunker is None:
            specials = window_tokens(self.tokenizer)
            content = self.max_seq_len - specials
            if content < 2:
                raise UserError(f"a window of {self.max_seq_len} tokens leaves {content} for text beside the "
                                f"model's {specials} special tokens; chunking needs --max-seq-len "
                                f"{specials + 2} or more")
            tok = read_tokenizer_json_str(self.tokenizer.to_str())
            tok.enable_truncation(max_length=self.max_seq_len, stride=chunk_overlap(content))
            self._chunker = tok
        return self._chunker

    @property
    def chunk_stride(self) -> int:
        """Text tokens consecutive windows share."""
        return chunk_overlap(self.max_seq_len - window_tokens(self.tokenizer))

    def too_long(self, index: int, texts: Sequence[str], pairs: Sequence[str] | None = None,
                 name: str = "text {}") -> UserError:
        """The error of the ``error`` policy: which text, its length and the window."""
        seq = texts[index] if pairs is None else (texts[index], pairs[index])
        length = len(self.untruncated_tokenizer().encode(*([seq] if pairs is None else seq)).ids)
        return UserError(f"{name.format(index)} has {length} tokens, more than this model's window of "
                         f"{self.max_seq_len} tokens; shorten it, or set long inputs to truncate (cut to the window) "
                         "or chunk (overlapping windows, pooled): --long-inputs / long_inputs=")

    def check_chunkable(self, names: Sequence[str], pairs) -> None:
        if pairs is not None:
            raise UserError("chunking splits single texts, not text pairs (rerank, pair classification); a pair "
                            "over the model's window cannot be chunked: shorten it, or set long inputs to "
                            "truncate")
        bad = [n for n in names if self.outputs[n].get("kind") == "score"]
        if bad:
            raise UserError(f"output {bad[0]} is a relevance score of a text pair, which cannot be chunked; set "
                            "long inputs to truncate or error")

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
        rows, tokens = next(iter(feeds.values())).shape
        result = {}
        for name, array in zip(names, arrays):
            array = np.asarray(array)
            self._check_output(name, array, rows, tokens)
            result[name] = array if array.dtype == np.float32 else array.astype(np.float32)
        return result

    def _check_output(self, name: str, array: np.ndarray, rows: int, tokens: int) -> None:
        """An output must come back as its artifact declares (batch x width, or batch x sequence x width, a width
        the same in every batch): an imported graph may compute something else than its declared shapes say (a
        "pooled" output as wide as the batch's longest text), and every caller stacks rows of one width."""
        declared = self.outputs[name].get("shape", [])
        want: list[int | None] = []
        for axis, dim in enumerate(declared):
            if dim == "batch":
                want.append(rows)
            elif dim == "sequence":
                want.append(tokens)
            elif isinstance(dim, int):
                want.append(dim)
            else:  # a width the artifact left open (an imported graph's symbolic labels): the first batch fixes it
                want.append(self._open_widths.setdefault((name, axis), array.shape[axis])
                            if array.ndim == len(declared) else None)
        if array.ndim != len(want) or any(w is not None and w != got for w, got in zip(want, array.shape)):
            expected = " x ".join(str(w if w is not None else d) for w, d in zip(want, declared))
            got = " x ".join(map(str, array.shape))
            raise ModelRunError(f"{self.model.path}: the model's output '{name}' came back {got} for a batch of "
                                f"{rows} x {tokens} tokens, not {expected} as the artifact declares "
                                f"({' x '.join(map(str, declared))}); the graph does not compute what it declares: "
                                "re-export the model (bertopt export from its Hugging Face folder)")

    def run(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
        pad_to: int | None = None,
        batch_size: int | None = None,
        long_inputs: str | None = None,
    ) -> dict[str, Any]:
        """Run every text; pooled outputs come back as ``(n, d)`` arrays, token-level outputs as a list of
        per-text ``(tokens, d)`` arrays trimmed to the real tokens, all in the caller's order. A text over the
        window follows ``long_inputs`` (this call's policy; default: the Predictor's): truncated, refused
        (UserError naming it, its length and the window) or chunked (pooled rows; token-level outputs joined
        into one array per text, as long as its untruncated encoding)."""
        texts = text_list(texts)  # a generator is read once: here, not by the first check that walks it
        pairs = None if pairs is None else text_list(pairs, "pairs")
        names = list(outputs or self.output_names)
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise UserError(f"unknown output {unknown[0]!r}; this artifact has: {', '.join(self.output_names)}")
        policy = self.long_input_policy(long_inputs)
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
        over = [i for i, e in enumerate(encodings) if e.overflowing] if policy != "truncate" else []
        if over and policy == "error":
            raise self.too_long(over[0], texts, pairs)
        if over:
            return self._run_chunked(list(texts), encodings, set(over), names, pairs, pad_to, batch_size)
        pieces = self._run_rows(encodings, names, pad_to, batch_size)
        for name in names:
            result[name] = pieces[name] if self.is_token_level(name) else np.stack(pieces[name])
        return result

    def _run_chunked(self, texts, encodings, over: set[int], names, pairs, pad_to, batch_size) -> dict[str, Any]:
        self.check_chunkable(names, pairs)
        chunker = self.chunk_tokenizer()
        windows: list = []
        spans: list[tuple[int, int]] = []
        for i, enc in enumerate(encodings):
            if i in over:
                whole = chunker.encode(texts[i])
                parts = [whole, *whole.overflowing]
            else:
                parts = [enc]
            spans.append((len(windows), len(windows) + len(parts)))
            windows.extend(parts)
        rows = self._run_rows(windows, names, pad_to, batch_size, texts=len(texts))
        normalize = bool(self.model.model_info.get("normalize"))
        result: dict[str, Any] = {}
        for name in names:
            spec = self.outputs[name]
            if self.is_token_level(name):
                result[name] = [rows[name][a] if b - a == 1 else
                                join_token_windows(windows[a:b], rows[name][a:b], self.chunk_stride)
                                for a, b in spans]
            else:
                result[name] = np.stack([rows[name][a] if b - a == 1 else
                                         pool_windows(spec, rows[name][a:b], [len(w.ids) for w in windows[a:b]],
                                                      normalize)
                                         for a, b in spans])
        return result

    def _run_rows(self, encodings, names, pad_to, batch_size, texts: int | None = None) -> dict[str, list]:
        """Each output's row per encoding (token-level ones trimmed to the real tokens), in input order;
        ``texts``: how many texts the encodings are (fewer than them when texts were chunked into windows).
        Where the session runs several batches side by side (OpenVINO's THROUGHPUT streams), that many are in
        flight, and a call of fewer batches is split so that every stream has one."""
        n = len(encodings)
        bs = batch_size or self.batch_size
        plan = self.plan_batches(encodings, bs, bounded_padding=pad_to is None)
        streams = self.session.parallel_runs
        if streams > 1 and len(plan) < streams:
            plan = [part for idx in plan for part in _split(idx, streams)]

        def run_one(idx):
            feeds, lengths = self.feeds_for([encodings[i] for i in idx], pad_to=pad_to)
            return idx, lengths, self.run_batch(feeds, names)

        pieces: dict[str, list] = {name: [None] * n for name in names}
        tokens = 0
        for idx, lengths, out in side_by_side(run_one, plan, streams):
            tokens += int(lengths.sum())
            for name in names:
                arr = out[name]
                for j, i in enumerate(idx):
                    pieces[name][i] = arr[j, : lengths[j]] if self.is_token_level(name) else arr[j]
        with self._lock:
            self.stats["batches"] += len(plan)
            self.stats["texts"] += n if texts is None else texts
            self.stats["tokens"] += tokens
        return pieces

    def plan_batches(self, encodings, batch_size: int, bounded_padding: bool = True, growth: float = BUCKET_GROWTH,
                     slack: int = BUCKET_SLACK_TOKENS) -> list[list[int]]:
        """Indices of each batch, in run order. Without bucketing: input order, ``batch_size`` at a time.
        With it: sorted by length (stable, so results are reproducible), at most ``batch_size`` a batch, and
        (unless every batch is padded to one fixed length anyway) a new batch before a text longer than
        ``growth`` x the batch's first + ``slack`` tokens. Either way, where the task bounds the tokens of a call
        (``batch_tokens``), a new batch before one whose texts x longest text would exceed it."""
        n = len(encodings)
        cap = self.batch_tokens
        if not self.length_bucketing and cap is None:
            return [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
        order = sorted(range(n), key=lambda i: len(encodings[i].ids)) if self.length_bucketing else range(n)
        bounded_padding = bounded_padding and self.length_bucketing
        batches: list[list[int]] = []
        current: list[int] = []
        limit = 0.0
        width = 0
        for i in order:
            length = len(encodings[i].ids)
            if current and (len(current) >= batch_size or (bounded_padding and length > limit)
                            or (cap is not None and (len(current) + 1) * max(width, length) > cap)):
                batches.append(current)
                current = []
            if not current:
                limit = growth * length + slack
                width = 0
            width = max(width, length)
            current.append(i)
        if current:
            batches.append(current)
        return batches

    def encode(self, texts: Sequence[str] | str, pairs: Sequence[str] | None = None,
               long_inputs: str | None = None) -> np.ndarray:
        """The primary output (sentence embedding, logits, ...) as one float32 array."""
        out = self.run(texts, pairs, outputs=[self.primary_output], long_inputs=long_inputs)[self.primary_output]
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
                ignore_labels: Sequence[str] | None = None, long_inputs: str | None = None) -> list[Any]:
        """One task result per text: classification ``{"label", "score", "scores"}``; token classification a
        list of entities (transformers-pipeline ``aggregation``: none, simple, first, average, max); rerank a
        score per (text, pair); sparse embedding ``{"indices", "values"}``; embedding the vector."""
        from bertopt.runtime.tasks import predict

        return predict(self, texts, pairs, aggregation=aggregation, ignore_labels=ignore_labels,
                       long_inputs=long_inputs)

    def rerank(self, query: str, passages: Sequence[str], top_k: int | None = None,
               long_inputs: str | None = None) -> list[dict[str, Any]]:
        """Passages sorted by relevance to ``query`` (rerank models): ``[{"index", "score", "text"}]``."""
        from bertopt.runtime.tasks import rerank

        return rerank(self, query, passages, top_k=top_k, long_inputs=long_inputs)
