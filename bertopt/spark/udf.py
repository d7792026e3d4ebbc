"""Spark inference with a bertopt artifact: a ``predict_batch_udf`` column function and a ``mapInPandas``
variant that keeps every input column.

The model is loaded once per Python worker process and reused across batches, tasks and jobs: the cache
below is a module global of this importable module, so each worker process has exactly one (a cache defined
in a driver script would be pickled by value and rebuilt for every task). Spark's own ``ModelCache`` (used
by ``predict_batch_udf``) only holds the predict function, keyed by a UUID that changes with every UDF
object; bertopt's cache is keyed by the artifact digest and placement, so even a new UDF on the same artifact
reuses the loaded model. Both rely on ``spark.python.worker.reuse=true`` (Spark's default, set explicitly by
``bertopt.spark.get_session``); with reuse off, every task starts a new worker and loads the model again.

Every load appends one line to the load log (``load_log=`` or the ``BERTOPT_SPARK_LOAD_LOG`` environment
variable) and bumps ``LOADS``: that is how tests and users can see that a job loaded the model N times, not
once per batch.

A row whose text cannot be predicted (null, empty or whitespace-only, not valid UTF-8, over
``max_text_chars`` characters) gets a null prediction and never fails the job or the stage: the checks run in
Spark SQL (``text_error``) before any text reaches Python, so even bytes that are not UTF-8 never get to the
Arrow/pandas conversion that would raise. ``predict_dataframe`` (and so ``spark-predict``) writes the reason
into an ``error`` column (null where the row was predicted); with ``predict_udf``, add ``text_error(...)`` as a
column to see it. The model always runs through ``bertopt.runtime.Predictor``, the one runtime that
``bertopt validate`` checks.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from bertopt.errors import ArtifactError, UserError
from bertopt.messages import MAX_TEXT_CHARS, text_problem
from bertopt.params import LONG_INPUTS, PROVIDER

# executors run ONNX Runtime on CPU or one GPU per partition (no TensorRT)
SPARK_PROVIDER = PROVIDER.with_(choices=("auto", "cpu", "cuda"),
                                help="Execution provider (auto: a GPU per partition when executors have them, "
                                "else CPU).")
# a row cannot be refused for its token count (the 'error' column is computed by Spark before the model runs, and
# raising would fail the whole job), so Spark offers truncate (as before) and chunk
SPARK_LONG_INPUTS = LONG_INPUTS.with_(choices=("truncate", "chunk"),
                                      help="A text longer than the model's window (--max-seq-len tokens): truncate "
                                      "(cut it to the window) or chunk (run it as overlapping windows and pool them: "
                                      "a token-weighted mean of embeddings or logits; docs/serving.md).")

LOAD_LOG_ENV = "BERTOPT_SPARK_LOAD_LOG"
CACHE_SIZE = 4  # models kept per worker process (different artifacts, or one per GPU)
DEFAULT_WINDOW = 1024  # rows one predict call sees: sorted by length, then cut into batch_size batches
LABEL = "label"
CONFIDENCE = "confidence"
ENTITIES = "entities"
SCORE = "score"
SPARSE = "sparse"
# the task result exactly as ``Predictor.predict`` gives it (every field: all class scores, per-token entities with
# their index, ...), as JSON text; what ``bertopt kafka --backend spark`` answers task requests with
RESULT = "result"
# why a row has no prediction (null when it has one): predict_dataframe's last column, and text_error's value
ERROR = "error"
# columns computed from the task's output (bertopt.runtime.tasks), next to the artifact's own outputs
DERIVED = {LABEL: "classification", CONFIDENCE: "classification", ENTITIES: "token-classification",
           SCORE: "rerank", SPARSE: "sparse-embedding"}
_NEEDS = {"classification": "a classifier (a logits output)",
          "token-classification": "a token-classification model (a token-logits output)",
          "rerank": "a rerank (cross-encoder) model (a score output)",
          "sparse-embedding": "a sparse-embedding (SPLADE) model (a sparse output)"}
SPARSE_FORMATS = ("struct", "vector")
# Java's \s, so the Spark-side null mask and the Python-side check agree on what "empty" text is
_BLANK = " \t\n\x0b\f\r"
_BLANK_REGEX = r"\A[ \t\n\x0B\f\r]*\z"

_PREDICTORS: "OrderedDict[tuple, Any]" = OrderedDict()
_LOCK = threading.Lock()
LOADS = 0  # models loaded by this process
_SHIPPED: dict[tuple[str, str], str] = {}  # (application id, digest) -> archive name, on the driver


# -- where executors find the artifact -------------------------------------------------------------------------
@dataclass(frozen=True)
class ArtifactRef:
    """The artifact as executors see it: a path they can read (shared file system, local mode), or the name
    of an archive shipped with ``SparkContext.addArchive`` / ``spark-submit --archives``; plus the digest the
    driver saw, so an executor never silently runs a different model."""

    path: str
    digest: str
    archive: str | None = None

    def resolve(self) -> Path:
        host = socket.gethostname()
        if self.archive:
            from pyspark import SparkFiles

            root = Path(SparkFiles.getRootDirectory()) / self.archive
            if not root.exists():
                raise ArtifactError(
                    f"artifact archive '{self.archive}' is not present on executor {host} (looked in {root}); "
                    f"ship it with ship_artifact(spark, path) / --ship, or spark-submit --archives "
                    f"ARTIFACT.zip#{self.archive}")
            return _artifact_dir_in(root, self.archive)
        path = Path(self.path)
        if not (path / "bertopt.json").is_file():
            raise ArtifactError(
                f"artifact {path} is not present on executor {host}; put it on a file system every executor "
                "can read, or ship it to the executors with --ship (SparkContext.addArchive)")
        return path


def _artifact_dir_in(root: Path, name: str) -> Path:
    if (root / "bertopt.json").is_file():
        return root
    inner = [d for d in root.iterdir() if (d / "bertopt.json").is_file()] if root.is_dir() else []
    if len(inner) == 1:
        return inner[0]
    raise ArtifactError(f"archive '{name}' holds no bertopt artifact (no bertopt.json at its top or one folder "
                        "down); zip the artifact folder itself")


def ship_artifact(spark, artifact) -> ArtifactRef:
    """Zip a driver-local artifact and add it to the Spark job (``SparkContext.addArchive``): every executor
    downloads and unpacks it once, and the UDF loads it from there (hashes verified on load)."""
    import zipfile

    from bertopt.artifact import Artifact
    from bertopt.output_paths import process_scratch

    art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    sc = spark.sparkContext
    key = (sc.applicationId, art.digest)
    name = _SHIPPED.get(key)
    if name is None:
        name = f"bertopt-{art.digest[:16]}"
        folder = process_scratch("ship")  # Spark serves the archive from here until the job ends
        archive = folder / f"{name}.zip"
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:  # model weights barely compress
            for file in sorted(art.path.rglob("*")):
                if file.is_file():
                    zf.write(file, file.relative_to(art.path).as_posix())
        sc.addArchive(f"{archive}#{name}")
        _SHIPPED[key] = name
    return ArtifactRef(str(art.path.absolute()), art.digest, archive=name)


# -- options and the per-process model cache ---------------------------------------------------------------
@dataclass(frozen=True)
class UdfOptions:
    outputs: tuple[str, ...]  # artifact output names and/or derived columns (DERIVED)
    batch_size: int = 32
    max_seq_len: int | None = None
    provider: str = "auto"  # auto: CUDA when the executor has a GPU, else CPU; or "cpu" / "cuda"
    threads: int | None = None  # per task; default: executor cores // concurrent tasks
    concurrent_tasks: int = 1
    load_log: str | None = None
    label_source: str | None = None  # the output the derived columns are computed from (the task's output)
    id2label: tuple[tuple[str, str], ...] = ()
    task: str = "embedding"
    aggregation: str = "simple"  # token classification: the transformers-pipeline aggregation strategy
    sparse_format: str = "struct"  # SPLADE: struct<indices, values> or "vector" (Spark ML SparseVector)
    sparse_size: int = 0  # the vocabulary size, for SparseVector
    max_text_chars: int = MAX_TEXT_CHARS  # longer texts get no prediction (text_error says why)
    long_inputs: str = "truncate"  # a text over the window: truncate or chunk (SPARK_LONG_INPUTS)


def task_placement(opts: UdfOptions):
    from pyspark import TaskContext

    from bertopt.runtime.backends import default_threads
    from bertopt.spark.placement import choose_placement, visible_gpu_count

    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx is not None else 0
    assigned = None
    n_gpus = 0
    if opts.provider != "cpu":
        resources = ctx.resources() if ctx is not None else {}
        assigned = list(resources["gpu"].addresses) if "gpu" in resources else None
        n_gpus = visible_gpu_count()
        if opts.provider == "cuda" and not n_gpus and not assigned:
            raise UserError(f"provider 'cuda' requested but executor {socket.gethostname()} has no visible GPU; "
                            "use --provider cpu or auto")
    return choose_placement(partition, n_gpus, default_threads(), opts.concurrent_tasks, assigned, opts.threads)


def get_predictor(ref: ArtifactRef, opts: UdfOptions):
    """This process's Predictor for the artifact and task placement, loading it on first use only."""
    global LOADS
    placement = task_placement(opts)
    key = (ref.path, ref.archive, ref.digest, opts.max_seq_len, placement)
    with _LOCK:
        predictor = _PREDICTORS.get(key)
        if predictor is not None:
            _PREDICTORS.move_to_end(key)
            return predictor
        from bertopt.runtime import Predictor

        path = ref.resolve()
        t0 = time.perf_counter()
        predictor = Predictor(path, provider=placement.provider, device_id=placement.device_id,
                              threads=placement.threads, max_seq_len=opts.max_seq_len, batch_size=opts.batch_size)
        if predictor.model.digest != ref.digest:
            raise ArtifactError(f"artifact at {path} on executor {socket.gethostname()} has digest "
                                f"{predictor.model.digest[:12]}, the driver's has {ref.digest[:12]}; "
                                "the executors see a different model, ship the same artifact to them")
        _PREDICTORS[key] = predictor
        while len(_PREDICTORS) > CACHE_SIZE:
            _PREDICTORS.popitem(last=False)
        LOADS += 1
        _log_load(opts.load_log or os.environ.get(LOAD_LOG_ENV), path, placement, time.perf_counter() - t0)
    return predictor


def _log_load(log: str | None, path: Path, placement, seconds: float) -> None:
    if not log:
        return
    from pyspark import TaskContext

    ctx = TaskContext.get()
    line = "\t".join([str(os.getpid()), socket.gethostname(), str(ctx.partitionId() if ctx else -1),
                      placement.describe(), str(path), f"{seconds:.3f}"])
    with open(log, "a", encoding="utf-8") as fh:  # one short O_APPEND write per load
        fh.write(line + "\n")


def read_load_log(log: str | os.PathLike) -> list[dict[str, Any]]:
    """The loads recorded in a load log: one dict (pid, host, partition, placement, path, seconds) each."""
    p = Path(log)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text(encoding="utf-8").splitlines():
        pid, host, partition, placement, path, seconds = line.split("\t")
        rows.append({"pid": int(pid), "host": host, "partition": int(partition), "placement": placement,
                     "path": path, "seconds": float(seconds)})
    return rows


# -- predicting ----------------------------------------------------------------------------------------------
def is_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip(_BLANK) != ""


def predictable(value: Any, max_chars: int = MAX_TEXT_CHARS) -> bool:
    """Text the model can take: non-empty, valid Unicode, at most ``max_chars`` characters (``text_error``'s
    rules, checked again on the Python side for callers that bypass the Spark-side check)."""
    return is_text(value) and text_problem(value, max_chars) is None


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def text_error(text_col, pair_col=None, max_text_chars: int = MAX_TEXT_CHARS):
    """A string Column: why a row gets no prediction from ``predict_udf`` / ``predict_dataframe`` (null text,
    empty or whitespace-only, not valid UTF-8, over ``max_text_chars`` characters), or null when it gets one.
    Pure Spark SQL: no Python worker, no model. ``df.withColumn("error", text_error("text"))``."""
    from pyspark.sql import functions as F

    if max_text_chars < 1:
        raise UserError(f"max_text_chars must be at least 1, got {max_text_chars}")
    named = [("text", text_col)] + ([("pair", pair_col)] if pair_col is not None else [])
    error = None
    for label, col in named:
        c = F.col(_quoted(col)) if isinstance(col, str) else col
        checks = [
            (c.isNull(), F.lit(f"{label} is null")),
            (~F.is_valid_utf8(c), F.lit(f"{label} is not valid UTF-8 (a broken byte sequence or an encoded lone "
                                         "surrogate); re-encode it")),
            (c.rlike(_BLANK_REGEX), F.lit(f"{label} is empty or whitespace-only")),
            (F.length(c) > max_text_chars, F.concat(F.lit(f"{label}: "), F.length(c).cast("string"),
                                                    F.lit(f" characters, over the limit of {max_text_chars}; "
                                                          "shorten or split it (or raise max_text_chars)"))),
        ]
        for condition, message in checks:
            error = F.when(condition, message) if error is None else error.when(condition, message)
    return error


def predict_rows(predictor, texts: Sequence[Any], pairs: Sequence[Any] | None, opts: UdfOptions) -> dict[str, list]:
    """Each requested output as a per-row list (arrays; label strings, confidences, entity lists, rerank scores,
    sparse {indices, values}); None where the text is null/empty."""
    from bertopt.runtime.tasks import results_from_outputs

    n = len(texts)
    limit = opts.max_text_chars
    valid = [i for i in range(n) if predictable(texts[i], limit) and (pairs is None or predictable(pairs[i], limit))]
    result: dict[str, list] = {name: [None] * n for name in opts.outputs}
    if not valid:
        return result
    derived = [o for o in opts.outputs if o in DERIVED or o == RESULT]
    model_outputs = [o for o in opts.outputs if o not in derived]
    needed = list(dict.fromkeys(model_outputs + ([opts.label_source] if derived else [])))
    valid_texts = [texts[i] for i in valid]
    valid_pairs = [pairs[i] for i in valid] if pairs is not None else None
    run = predictor.run(valid_texts, valid_pairs, outputs=needed, batch_size=opts.batch_size,
                        long_inputs=opts.long_inputs)
    for name in model_outputs:
        column, values = result[name], run[name]
        for j, i in enumerate(valid):
            column[i] = values[j]
    if derived:
        found = results_from_outputs(predictor, opts.task, valid_texts, run[opts.label_source], pairs=valid_pairs,
                                     aggregation=opts.aggregation, whole=opts.long_inputs == "chunk")
        for name in derived:
            column = result[name]
            for j, i in enumerate(valid):
                column[i] = _column_value(name, found[j])
        if SPARSE in derived and opts.sparse_format == "vector":
            from pyspark.ml.linalg import SparseVector

            result[SPARSE] = [None if v is None else SparseVector(opts.sparse_size, v["indices"], v["values"])
                              for v in result[SPARSE]]
    return result


def _column_value(name: str, found: Any) -> Any:
    if name == LABEL:
        return found["label"]
    if name == CONFIDENCE:
        return found["score"]
    if name == ENTITIES:
        return [{"entity_group": e.get("entity_group", e.get("entity")), "score": e["score"], "word": e["word"],
                 "start": e["start"], "end": e["end"]} for e in found]
    if name == RESULT:
        import json

        from bertopt.runtime.tasks import jsonable

        return json.dumps(jsonable(found))  # floats as repr: they read back bit for bit
    return found  # rerank score (float), sparse {"indices", "values"}


def spark_type(name: str, sparse_format: str = "struct"):
    """The Spark SQL type of a derived column."""
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        FloatType,
        IntegerType,
        StringType,
        StructField,
        StructType,
    )

    if name in (LABEL, RESULT):
        return StringType()
    if name in (CONFIDENCE, SCORE):
        return DoubleType()
    if name == ENTITIES:
        return ArrayType(StructType([StructField("entity_group", StringType()), StructField("score", DoubleType()),
                                     StructField("word", StringType()), StructField("start", IntegerType()),
                                     StructField("end", IntegerType())]))
    if name == SPARSE:
        if sparse_format == "vector":
            from pyspark.ml.linalg import VectorUDT

            return VectorUDT()
        return StructType([StructField("indices", ArrayType(IntegerType())),
                           StructField("values", ArrayType(FloatType()))])
    return ArrayType(FloatType())


class _MakePredictFn:
    """``make_predict_fn`` for predict_batch_udf: importable, so cloudpickle sends a reference, not the code."""

    def __init__(self, ref: ArtifactRef, opts: UdfOptions, with_pairs: bool, dim: int):
        self.ref, self.opts, self.with_pairs, self.dim = ref, opts, with_pairs, dim

    def _format(self, texts, pairs):
        # the predictor is looked up per call (a dict hit): Spark's ModelCache may hand this function to a
        # task of another partition, which may belong on another GPU
        values = predict_rows(get_predictor(self.ref, self.opts), texts, pairs, self.opts)[self.opts.outputs[0]]
        if self.opts.outputs[0] == LABEL:
            return np.array(values, dtype=object)
        out = np.full((len(values), self.dim), np.nan, dtype=np.float32)  # NaN rows are nulled by the mask
        for i, v in enumerate(values):
            if v is not None:
                out[i] = v
        return out

    def __call__(self):
        if self.with_pairs:
            def predict(texts: np.ndarray, pairs: np.ndarray) -> np.ndarray:
                return self._format(texts, pairs)
        else:
            def predict(texts: np.ndarray) -> np.ndarray:
                return self._format(texts, None)
        return predict


# -- driver side ------------------------------------------------------------------------------------------------
def _load_on_driver(artifact):
    from bertopt.artifact import Artifact

    return artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)


def _is_pooled(spec: dict[str, Any]) -> bool:
    return "sequence" not in [str(d) for d in spec.get("shape", [])]


def resolve_outputs(art, outputs: Sequence[str] | str | None) -> list[str]:
    """The columns to predict. By default the task's result: the sentence embedding; logits, label and
    confidence for classifiers; entities for token classification; score for rerank; sparse for SPLADE."""
    from bertopt.runtime.tasks import task_of

    specs = {o["name"]: o for o in art.outputs}
    task = task_of(art)
    derived = [name for name, t in DERIVED.items() if t == task]
    if outputs is None:
        if task == "classification":
            return [_task_output(art, task), LABEL, CONFIDENCE]
        if derived:
            return derived
        from bertopt.artifact import primary_output

        primary = primary_output(art)
        if primary is None or not _is_pooled(specs[primary]):
            pooled = [name for name, o in specs.items() if _is_pooled(o)]
            if not pooled:
                raise UserError(f"artifact {art.path} has only per-token outputs; the Spark UDF returns one row per "
                                "text, export the model with pooling (a sentence embedding) or as a classifier")
            primary = pooled[-1]
        return [primary]
    names = [outputs] if isinstance(outputs, str) else list(outputs)
    if not names:
        raise UserError("no outputs requested; name at least one (e.g. --outputs sentence_embedding)")
    for name in names:
        if name == RESULT:
            continue
        if name in DERIVED:
            if DERIVED[name] != task:
                raise UserError(f"output '{name}' needs {_NEEDS[DERIVED[name]]}; {art.path} is a {task} model with "
                                f"outputs: {', '.join(list(specs) + derived + [RESULT])}")
            continue
        if name not in specs:
            known = ", ".join(list(specs) + derived + [RESULT])
            raise UserError(f"unknown output '{name}'; this artifact has: {known}")
        if not _is_pooled(specs[name]):
            hint = " (token classification: ask for 'entities')" if task == "token-classification" else ""
            raise UserError(f"output '{name}' is per-token; the Spark UDF returns one value per row, "
                            f"choose a pooled output (sentence embedding or logits){hint}")
    return names


def _task_output(art, task: str) -> str:
    from bertopt.runtime.tasks import task_output

    return task_output(art, task)


def _output_dim(art, name: str) -> int:
    shape = {o["name"]: o for o in art.outputs}[name].get("shape", [])
    if shape and isinstance(shape[-1], int):
        return shape[-1]
    hidden = art.model_info.get("hidden_size")
    if hidden:
        return int(hidden)
    raise UserError(f"artifact {art.path} does not record the width of output '{name}'; re-create the artifact")


def make_options(art, spark, outputs: Sequence[str], *, batch_size: int, max_seq_len: int | None, provider: str,
                 threads: int | None, load_log: str | None, aggregation: str = "simple",
                 sparse_format: str = "struct", max_text_chars: int = MAX_TEXT_CHARS,
                 long_inputs: str = "truncate") -> UdfOptions:
    from bertopt.spark.placement import concurrent_tasks_for
    from bertopt.spark.session import worker_reuse_enabled

    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    if max_text_chars < 1:
        raise UserError(f"max_text_chars must be at least 1, got {max_text_chars}")
    if provider not in SPARK_PROVIDER.choices:
        raise UserError(f"unknown provider '{provider}'; choose {', '.join(SPARK_PROVIDER.choices)}")
    long_inputs = SPARK_LONG_INPUTS.coerce(long_inputs, "spark")
    if not worker_reuse_enabled(spark):
        import warnings

        warnings.warn("spark.python.worker.reuse is false: every task starts a new Python worker and loads the "
                      "model again; set it to true", stacklevel=3)
    conf = spark.sparkContext.getConf()
    concurrent = concurrent_tasks_for(spark.sparkContext.master, conf.get("spark.executor.cores"),
                                      conf.get("spark.task.cpus"))
    from bertopt.runtime.tasks import check_aggregation, task_of

    task = task_of(art)
    check_aggregation(aggregation)
    if sparse_format not in SPARSE_FORMATS:
        raise UserError(f"unknown sparse format {sparse_format!r}; choose struct (indices and values arrays) or "
                        "vector (Spark ML SparseVector)")
    sparse_size = _output_dim(art, _task_output(art, task)) if task == "sparse-embedding" else 0
    task_columns = task != "embedding" or RESULT in outputs
    id2label = art.model_info.get("id2label") or {}
    return UdfOptions(outputs=tuple(outputs), batch_size=batch_size, max_seq_len=max_seq_len, provider=provider,
                      threads=threads, concurrent_tasks=concurrent,
                      load_log=load_log or os.environ.get(LOAD_LOG_ENV),
                      label_source=_task_output(art, task) if task_columns else None,
                      id2label=tuple((str(k), str(v)) for k, v in id2label.items()), task=task,
                      aggregation=aggregation, sparse_format=sparse_format, sparse_size=sparse_size,
                      max_text_chars=max_text_chars, long_inputs=long_inputs)


def check_task_columns(art, pairs: bool) -> None:
    """A rerank model needs a passage column; a single-text model refuses one."""
    from bertopt.runtime.tasks import task_of

    task = task_of(art)
    if task == "rerank" and not pairs:
        raise UserError("a rerank model scores (query, passage) pairs; give the passage column too "
                        "(--pair-col, or pairs=True and two columns)")
    if pairs and task != "rerank" and art.model_info.get("pair_input") is False:
        raise UserError(f"this {task} model takes a single text, but a second text column was given; drop "
                        "--pair-col / pairs=True")


def _ref_for(spark, art, archive: str | None, ship: bool) -> ArtifactRef:
    if ship:
        return ship_artifact(spark, art)
    return ArtifactRef(str(art.path.absolute()), art.digest, archive=archive)


def _active_session(spark):
    if spark is not None:
        return spark
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        raise UserError("no active Spark session; create one first (bertopt.spark.get_session()) or pass spark=")
    return active


def predict_udf(artifact, *, output: str | None = None, batch_size: int = 32, max_seq_len: int | None = None,
                pairs: bool = False, provider: str = "auto", threads: int | None = None, window: int | None = None,
                spark=None, archive: str | None = None, ship: bool = False, load_log: str | None = None,
                aggregation: str = "simple", sparse_format: str = "struct", max_text_chars: int = MAX_TEXT_CHARS,
                long_inputs: str = "truncate"):
    """A column function running an artifact on a text column (or two, for pairs), built on
    ``pyspark.ml.functions.predict_batch_udf``.

    ``udf = predict_udf("art/")`` then ``df.withColumn("embedding", udf("text"))`` gives ``array<float>``
    (sentence embedding, or logits for classifiers); ``output="label"`` gives the class name as a string,
    ``"confidence"`` its score. Task models give their result by default: token classification ``entities``
    (``array<struct<entity_group, score, word, start, end>>``, pipeline ``aggregation``), rerank ``score``
    (a double; ``pairs=True``, called with the query and passage columns), SPLADE ``sparse``
    (``struct<indices, values>``, or a Spark ML ``SparseVector`` with ``sparse_format="vector"``).
    ``output="result"`` gives, for any model, the result ``Predictor.predict`` returns as JSON text (every
    field: all class scores, per-token entities with their index, ...).
    Each predict call sees up to ``window`` rows, sorted by length and cut into ``batch_size`` batches.
    ``archive=NAME`` loads the artifact on executors from an archive shipped as ``--archives ART.zip#NAME``;
    ``ship=True`` zips and ships the driver's copy itself.
    A row whose text (or pair) is null, empty, not valid UTF-8 or over ``max_text_chars`` characters gets null,
    and its text never reaches Python; ``text_error(text, pair, max_text_chars)`` is the column saying why.
    ``long_inputs``: a text over the model's window is truncated, or ``"chunk"``: run as overlapping windows and
    pooled (``Predictor.run``).
    """
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, FloatType, StringType

    spark = _active_session(spark)
    art = _load_on_driver(artifact)
    check_task_columns(art, pairs)
    name = resolve_outputs(art, None)[0] if output is None else resolve_outputs(art, [output])[0]
    opts = make_options(art, spark, [name], batch_size=batch_size, max_seq_len=max_seq_len, provider=provider,
                        threads=threads, load_log=load_log, aggregation=aggregation, sparse_format=sparse_format,
                        max_text_chars=max_text_chars, long_inputs=long_inputs)
    ref = _ref_for(spark, art, archive, ship)
    is_label = name == LABEL
    window = max(batch_size, window or DEFAULT_WINDOW)
    if (name in DERIVED or name == RESULT) and not is_label:
        raw = _TaskColumnFn(ref, opts, name).udf(pairs, spark_type(name, sparse_format))
    else:
        dim = 0 if is_label else _output_dim(art, name)
        raw = predict_batch_udf(_MakePredictFn(ref, opts, pairs, dim),
                                return_type=StringType() if is_label else ArrayType(FloatType()), batch_size=window)

    def column(text_col, pair_col=None):
        if pairs and pair_col is None:
            raise UserError("this UDF was made with pairs=True; call it with two columns (text, pair)")
        if not pairs and pair_col is not None:
            raise UserError("this UDF takes one text column; make it with pairs=True to pass a second one")
        cols = [F.col(c) if isinstance(c, str) else c for c in ([text_col] if pair_col is None else
                                                                 [text_col, pair_col])]
        valid = text_error(*cols, max_text_chars=max_text_chars).isNull()
        # A Python UDF sees every row whatever the CASE around it, so a row that fails the checks is handed to
        # it as null (never decoded in Python) and its result nulled here
        return F.when(valid, raw(*[F.when(valid, c) for c in cols]))

    column.output = name
    column.options = opts
    column.artifact_ref = ref
    return column


class _TaskColumnFn:
    """A pandas UDF body for a task column (confidence, entities, score, sparse): importable, so the
    closure pickles by reference; the model comes from this process's cache."""

    def __init__(self, ref: ArtifactRef, opts: UdfOptions, name: str):
        self.ref, self.opts, self.name = ref, opts, name

    def values(self, texts, pairs):
        import pandas as pd

        rows = predict_rows(get_predictor(self.ref, self.opts), texts.tolist(),
                            pairs.tolist() if pairs is not None else None, self.opts)[self.name]
        if self.name == SPARSE and self.opts.sparse_format == "struct":  # a struct column comes as a frame
            return pd.DataFrame({"indices": [v["indices"] if v else [] for v in rows],
                                 "values": [v["values"] if v else [] for v in rows]})
        return pd.Series(rows)

    def udf(self, with_pairs: bool, return_type):
        import pandas as pd
        from pyspark.sql import functions as F

        if with_pairs:
            def predict(texts, pairs):
                return self.values(texts, pairs)
            predict.__annotations__ = {"texts": pd.Series, "pairs": pd.Series, "return": pd.Series}
        else:
            def predict(texts):
                return self.values(texts, None)
            predict.__annotations__ = {"texts": pd.Series, "return": pd.Series}
        # real classes, not the strings ``from __future__ import annotations`` would leave for Spark to resolve
        return F.pandas_udf(predict, return_type)


_HIDDEN_TEXT, _HIDDEN_PAIR = "__bertopt_text", "__bertopt_pair"


class _PartitionPredictor:
    """The mapInPandas function: appends prediction columns (and the error column) to each pandas batch of a
    partition. The model reads the hidden, checked copies of the text columns (null where ``text_error`` found a
    problem); the input columns pass through untouched."""

    def __init__(self, ref: ArtifactRef, opts: UdfOptions, text_col: str, pair_col: str | None,
                 columns: dict[str, str], rows_acc=None, null_acc=None, input_cols: Sequence[str] = (),
                 error_col: str = ERROR):
        self.ref, self.opts, self.text_col, self.pair_col = ref, opts, text_col, pair_col
        self.columns, self.rows_acc, self.null_acc = columns, rows_acc, null_acc
        self.input_cols, self.error_col = list(input_cols), error_col

    def __call__(self, batches: Iterator) -> Iterator:
        for pdf in batches:
            texts = pdf[_HIDDEN_TEXT].tolist()
            pairs = pdf[_HIDDEN_PAIR].tolist() if self.pair_col else None
            values = predict_rows(get_predictor(self.ref, self.opts), texts, pairs, self.opts)
            out = pdf[self.input_cols].copy()
            for name, column in self.columns.items():
                out[column] = values[name]
            out[self.error_col] = pdf[self.error_col]
            if self.rows_acc is not None:
                self.rows_acc.add(len(pdf))
            if self.null_acc is not None and self.opts.outputs:
                self.null_acc.add(sum(v is None for v in values[self.opts.outputs[0]]))
            yield out


def check_columns(df, text_col: str, pair_col: str | None = None) -> None:
    """A clear error, before any job runs, when a text column is missing or is not a string."""
    from pyspark.sql.types import StringType

    fields = {f.name: f for f in df.schema.fields}
    for col in [text_col] + ([pair_col] if pair_col else []):
        if col not in fields:
            raise UserError(f"input has no column '{col}'; its columns are: {', '.join(fields) or 'none'} "
                            "(choose one with --text-col)")
        if not isinstance(fields[col].dataType, StringType):
            raise UserError(f"column '{col}' holds {fields[col].dataType.simpleString()}, not text; "
                            "choose a string column or cast it")


def predict_dataframe(df, artifact, *, text_col: str = "text", pair_col: str | None = None,
                      outputs: Sequence[str] | str | None = None, prefix: str = "", batch_size: int = 32,
                      max_seq_len: int | None = None, provider: str = "auto", threads: int | None = None,
                      archive: str | None = None, ship: bool = False, load_log: str | None = None,
                      counters: dict | None = None, aggregation: str = "simple", sparse_format: str = "struct",
                      max_text_chars: int = MAX_TEXT_CHARS, long_inputs: str = "truncate"):
    """``df`` with every input column kept, one column per prediction appended (``mapInPandas``), and last an
    ``error`` column (``prefix`` + "error"): null where the row was predicted, else why not (``text_error``: null,
    empty, not valid UTF-8, over ``max_text_chars`` characters), the row's predictions then null.

    Embeddings/logits are ``array<float>``, ``label`` is a string and ``confidence`` a double (classifiers),
    ``entities`` an ``array<struct<entity_group, score, word, start, end>>`` (token classification), ``score`` a
    double (rerank: ``pair_col`` holds the passages), ``sparse`` a ``struct<indices, values>`` or SparseVector
    (SPLADE), ``result`` the JSON text of ``Predictor.predict``'s result.
    ``counters``: pass a dict to receive Spark accumulators ``rows`` and ``null_rows`` (rows without a
    prediction) filled by the job.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    spark = df.sparkSession
    check_columns(df, text_col, pair_col)
    art = _load_on_driver(artifact)
    check_task_columns(art, pair_col is not None)
    names = resolve_outputs(art, outputs)
    columns = {name: f"{prefix}{name}" for name in names}
    error_col = f"{prefix}{ERROR}"
    clash = [c for c in [*columns.values(), error_col] if c in df.columns]
    if clash:
        raise UserError(f"the input already has a column '{clash[0]}'; choose a --prefix for the prediction columns")
    opts = make_options(art, spark, names, batch_size=batch_size, max_seq_len=max_seq_len, provider=provider,
                        threads=threads, load_log=load_log, aggregation=aggregation, sparse_format=sparse_format,
                        max_text_chars=max_text_chars, long_inputs=long_inputs)
    ref = _ref_for(spark, art, archive, ship)
    rows_acc = null_acc = None
    if counters is not None:
        rows_acc = counters["rows"] = spark.sparkContext.accumulator(0)
        null_acc = counters["null_rows"] = spark.sparkContext.accumulator(0)
    # The checks run in Spark SQL; the model reads checked copies of the text columns (null where a check failed),
    # and the text columns themselves cross to Python as bytes, so text that is not UTF-8 is never decoded there
    # (the Arrow -> pandas conversion would raise and fail the stage)
    error = text_error(text_col, pair_col, max_text_chars)
    as_bytes = {text_col} | ({pair_col} if pair_col else set())
    checked = df.select(
        *[F.col(_quoted(c)).cast("binary").alias(c) if c in as_bytes else F.col(_quoted(c)) for c in df.columns],
        F.when(error.isNull(), F.col(_quoted(text_col))).alias(_HIDDEN_TEXT),
        *([F.when(error.isNull(), F.col(_quoted(pair_col))).alias(_HIDDEN_PAIR)] if pair_col else []),
        error.alias(error_col))
    fields = [StructField(f.name, BinaryType(), f.nullable) if f.name in as_bytes else f for f in df.schema.fields]
    schema = StructType(fields + [StructField(columns[name], spark_type(name, sparse_format), True) for name in names]
                        + [StructField(error_col, StringType(), True)])
    predicted = checked.mapInPandas(_PartitionPredictor(ref, opts, text_col, pair_col, columns, rows_acc, null_acc,
                                                        input_cols=df.columns, error_col=error_col), schema)
    return predicted.select(*[F.col(_quoted(c)).cast("string").alias(c) if c in as_bytes else F.col(_quoted(c))
                              for c in predicted.columns])
