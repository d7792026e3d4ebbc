"""``bertopt spark-predict``: read a table (Parquet, CSV or text), append predictions, write Parquet.

Everything that can be checked before the job starts is checked first (input readable, text column present
and a string, output free, artifact valid), so a typo fails in seconds with one line, not after a job.
The output is written to a hidden folder next to the destination and renamed into place when the job
succeeds: a failed job leaves nothing that looks like a result.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from bertopt.errors import BackendFailed, UserError
from bertopt.measure.data import has_real_text
from bertopt.messages import MAX_TEXT_CHARS
from bertopt.output_paths import check_output, move_into_place, output_lock, sweep_stale, temp_sibling

FORMATS = ("auto", "parquet", "csv", "text")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".txt": "text", ".text": "text"}
JOB_GROUP = "bertopt-spark-predict"


def _has_scheme(path: str) -> bool:
    return "://" in path


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt not in FORMATS:
        raise UserError(f"unknown input format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    p = Path(path)
    candidates = [p]
    if not _has_scheme(path) and p.is_dir():
        candidates = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(("_", ".")))
    for f in candidates:
        found = _SUFFIXES.get(f.suffix.lower())
        if found:
            return found
    raise UserError(f"cannot tell the format of {path} from its name; pass --format parquet, csv or text")


def read_input(spark, path: str, fmt: str, text_col: str):
    """The input as a DataFrame; an unreadable input raises a UserError naming the file."""
    if not _has_scheme(path):
        p = Path(path)
        if not p.exists():
            raise UserError(f"input {path} does not exist; give a Parquet, CSV or text file (or a folder of them)")
        if p.is_file():
            try:
                with open(p, "rb") as fh:
                    fh.read(1)
            except OSError as exc:
                raise UserError(f"cannot read input {path}: {exc.strerror}; check its permissions") from None
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    try:
        if fmt == "parquet":
            df = spark.read.parquet(path)
        elif fmt == "csv":
            df = spark.read.options(header=True, multiLine=True, escape='"').csv(path)
        else:
            df = spark.read.text(path).withColumnRenamed("value", text_col)
        df.schema  # noqa: B018 - forces the file footers / header to be read now, before the job
    except (PySparkException, Py4JJavaError) as exc:
        raise UserError(f"cannot read {path} as {fmt}: {spark_error_summary(exc)}; check the file or pass "
                        "--format") from None
    return df


def local_columns(path: str, fmt: str, text_col: str) -> list[str] | None:
    """The column names of a local input, read without Spark (Parquet footers, the CSV header line), so a
    missing input or column fails in a second instead of after Spark's start-up. None: not checkable here
    (a URL; a text file, whose one column is named by --text-col)."""
    if _has_scheme(path):
        return None
    p = Path(path)
    if not p.exists():
        raise UserError(f"input {path} does not exist; give a Parquet, CSV or text file (or a folder of them)")
    if not p.is_dir() and not p.is_file():  # a FIFO would block the read for ever, /dev/zero fill the memory
        raise UserError(f"input {path} is not a regular file (a FIFO, device or socket); give a Parquet, CSV or "
                        "text file (or a folder of them)")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                           and not f.name.startswith(("_", ".")))
    if not files:
        raise UserError(f"input folder {path} holds no data files; give a Parquet, CSV or text file")
    if fmt == "text":
        _check_text_files(path, files)
        return [text_col]
    first = files[0]
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(str(first)).names)
        if fmt == "csv":
            import csv

            with open(first, newline="", encoding="utf-8-sig") as fh:
                header = next(csv.reader(fh), None)
            if not header:
                raise UserError(f"input {first} is empty; a CSV input needs a header line naming its columns")
            return [h.strip() for h in header]
    except UserError:
        raise
    except UnicodeDecodeError:
        raise UserError(f"input {first} is not UTF-8 text; re-save it as UTF-8 or pass --format") from None
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for a damaged or foreign file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot read {first} as {fmt}: {first_line}; check the file or pass --format") from None
    return None


_TEXT_PROBE_BYTES = 1 << 20  # read of each text file before Spark starts: enough to find a line, bounded


def _check_text_files(path: str, files: list[Path]) -> None:
    """A text input holds some text, as UTF-8: an empty or blank file wrote a table of rows without predictions
    and exited 0, and a file of random bytes was read as 27 such rows. Reads the start of each file only; a
    mostly-UTF-8 file with a bad line is left to the rows (that row gets no prediction, the rest do)."""
    found = False
    for file in files:
        with open(file, "rb") as handle:
            chunk = handle.read(_TEXT_PROBE_BYTES)
        text = chunk.decode("utf-8", errors="replace")
        if "\x00" in text or text.count("\ufffd") > len(text) // 10:
            raise UserError(f"input {file} is not UTF-8 text (NUL bytes or undecodable bytes throughout); give one "
                            "input a line, re-saved as UTF-8, or pass --format")
        found = found or has_real_text(text)
    if not found:
        raise UserError(f"input {path} has no text (empty or blank); write one input a line")


def check_local_input(path: str, fmt: str, text_col: str, pair_col: str | None) -> None:
    columns = local_columns(path, fmt, text_col)
    if columns is None:
        return
    for name, flag in ((text_col, "--text-col"), (pair_col, "--pair-col")):
        if name is not None and name not in columns:
            raise UserError(f"input has no column '{name}'; its columns are: {', '.join(columns) or 'none'} "
                            f"(choose one with {flag})")


def spark_error_summary(exc: BaseException) -> str:
    """The useful line of a Spark error: the Java exception's message, without error class or stack."""
    text = str(exc).strip()
    found = re.search(r"^: [\w.$]+(?:Exception|Error): (.+)$", text, flags=re.M)
    line = found.group(1) if found else (text.splitlines()[0] if text else type(exc).__name__)
    line = re.sub(r"^\[[A-Z_.]+\]\s*", "", line).strip()
    return line if len(line) <= 300 else line[:297] + "..."


def task_counts(sc, group: str) -> tuple[int, int]:
    """Completed and total tasks of the spark-predict job group's stages so far."""
    tracker = sc.statusTracker()
    done = total = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in (job.stageIds if job else []):
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                done += stage.numCompletedTasks
                total += stage.numTasks
    return done, total


def _progress_poller(sc, group: str, report: Callable[[int, int], None], stop: threading.Event) -> threading.Thread:
    def poll() -> None:
        while not stop.wait(0.5):
            done, total = task_counts(sc, group)
            if total:
                report(done, total)

    thread = threading.Thread(target=poll, name="bertopt-spark-progress", daemon=True)
    thread.start()
    return thread


def write_marker(folder: Path, art, input: str) -> None:
    """The file that marks a folder as a spark-predict output (so --force may replace it later); readers of the
    Parquet folder (Spark, pyarrow, pandas) skip files starting with '_'."""
    from bertopt.output_paths import OWN_MARKERS, write_json
    from bertopt.version import __version__

    write_json(folder / OWN_MARKERS["spark-output"], {"written_by": "bertopt spark-predict", "bertopt": __version__,
                                                      "artifact": str(art.path), "digest": art.digest,
                                                      "input": input})


def spark_predict(artifact: str | Path, input: str | Path, output: str | Path, *, text_col: str = "text",
                  pair_col: str | None = None, master: str = "local[2]", partitions: int | None = None,
                  batch_size: int = 32, max_seq_len: int | None = None, fmt: str = "auto",
                  outputs: Sequence[str] | None = None, prefix: str = "", force: bool = False, ship: bool = False,
                  provider: str = "auto", threads: int | None = None, spark=None,
                  progress: Callable[[int, int], None] | None = None, aggregation: str = "simple",
                  sparse_format: str = "struct", max_text_chars: int = MAX_TEXT_CHARS,
                  long_inputs: str = "truncate") -> dict[str, Any]:
    """Run the artifact over a table and write Parquet with the input columns plus the predictions."""
    from bertopt.artifact import Artifact
    from bertopt.runtime.tasks import check_aggregation
    from bertopt.spark.udf import SPARSE_FORMATS, check_task_columns, resolve_outputs

    input, output = str(input), str(output)
    from bertopt.params import check_values
    from bertopt.spark.params import SPARK_PREDICT_PARAMS

    check_values(SPARK_PREDICT_PARAMS, {"partitions": partitions, "batch_size": batch_size, "max_seq_len": max_seq_len,
                                        "max_text_chars": max_text_chars, "long_inputs": long_inputs}, "spark-predict")
    if _has_scheme(output):
        raise UserError(f"output {output}: spark-predict writes to a local or shared file system path; "
                        "use the Python API (predict_dataframe) to write elsewhere")
    # --force replaces only an earlier spark-predict output (it carries OWN_MARKERS["spark-output"]), never the
    # input, the artifact or a folder of other files
    out_path = check_output(output, kind="spark-output", inputs=[artifact, input], replace=force, flag="--output")
    fmt = detect_format(input, fmt)
    art = Artifact.load(artifact)
    warning = art.batch_dependence_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_local_input(input, fmt, text_col, pair_col)  # a missing input or column fails before Spark starts
    from bertopt.runtime.predictor import sequence_length

    sequence_length(art.model_info, max_seq_len)  # so does a --max-seq-len past the model's positions
    if provider == "cuda" and spark is None and str(master).startswith("local"):  # a session of this command's
        from bertopt.spark.placement import visible_gpu_count

        if not visible_gpu_count():  # the executors are this machine: say it now, not from every task
            raise UserError("provider 'cuda' requested but this machine has no visible GPU; use --provider cpu or "
                            "auto")
    resolve_outputs(art, outputs)  # an unknown output fails here, before Spark starts
    check_task_columns(art, pair_col is not None)  # so do a missing passage column and an unwanted one
    check_aggregation(aggregation)
    if sparse_format not in SPARSE_FORMATS:
        raise UserError(f"unknown --sparse-format {sparse_format!r}; choose struct or vector")

    with output_lock(out_path, "--output"):
        return _predict_and_write(art, input, fmt, out_path, spark=spark, master=master, text_col=text_col,
                                  pair_col=pair_col, partitions=partitions, batch_size=batch_size,
                                  max_seq_len=max_seq_len, outputs=outputs, prefix=prefix, provider=provider,
                                  threads=threads, ship=ship, progress=progress, aggregation=aggregation,
                                  sparse_format=sparse_format, max_text_chars=max_text_chars, force=force,
                                  long_inputs=long_inputs)


def _predict_and_write(art, input: str, fmt: str, out_path: Path, *, spark, master, text_col, pair_col, partitions,
                       batch_size, max_seq_len, outputs, prefix, provider, threads, ship, progress, aggregation,
                       sparse_format, max_text_chars, force, long_inputs="truncate") -> dict[str, Any]:
    from bertopt.spark.session import get_session, worker_errors
    from bertopt.spark.udf import _quoted, check_columns, predict_dataframe, resolve_outputs

    t0 = time.perf_counter()
    if spark is None:
        spark = get_session(master, app_name="bertopt spark-predict")
    startup_s = time.perf_counter() - t0
    df = read_input(spark, input, fmt, text_col)
    check_columns(df, text_col, pair_col)  # a missing column fails here, before any job
    n_parts = df.rdd.getNumPartitions()
    wanted = partitions or max(n_parts, spark.sparkContext.defaultParallelism)
    if wanted != n_parts:
        df = df.repartition(wanted)
    counters: dict[str, Any] = {}
    predicted = predict_dataframe(df, art, text_col=text_col, pair_col=pair_col, outputs=outputs, prefix=prefix,
                                  batch_size=batch_size, max_seq_len=max_seq_len, provider=provider,
                                  threads=threads, ship=ship, counters=counters, aggregation=aggregation,
                                  sparse_format=sparse_format, max_text_chars=max_text_chars,
                                  long_inputs=long_inputs)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out_path)
    # a Parquet string is UTF-8: bytes that are not (their row's error says so) are written with U+FFFD in their
    # place, or no reader could open the text column (pyarrow: "Wrapping ... failed")
    from pyspark.sql import functions as F

    text_cols = {text_col} | ({pair_col} if pair_col else set())
    predicted = predicted.select(*[F.make_valid_utf8(F.col(_quoted(c))).alias(c) if c in text_cols
                                   else F.col(_quoted(c)) for c in predicted.columns])
    tmp = temp_sibling(out_path)
    sc = spark.sparkContext
    group = f"{JOB_GROUP}-{uuid.uuid4().hex[:8]}"  # this run's jobs only, for the progress bar
    sc.setJobGroup(group, f"bertopt spark-predict {input}")
    stop = threading.Event()
    poller = _progress_poller(sc, group, progress, stop) if progress else None
    t1 = time.perf_counter()
    try:
        try:
            with worker_errors():
                predicted.write.mode("errorifexists").parquet(str(tmp))
        except UserError:
            raise
        except Exception as exc:  # the job itself failed (an executor died, Spark gave up): exit 3, not a traceback
            raise BackendFailed(f"the Spark job failed: {spark_error_summary(exc)}; see the Spark executor logs "
                                f"(master {sc.master})") from None
        finally:
            stop.set()
            if poller is not None:
                poller.join(timeout=5)
            sc.setLocalProperty("spark.jobGroup.id", None)
        seconds = time.perf_counter() - t1
        write_marker(tmp, art, input)
        if out_path.exists():  # checked again under the lock: only our own earlier output is replaced
            check_output(out_path, kind="spark-output", replace=force, flag="--output")
        move_into_place(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rows = int(counters["rows"].value)
    if progress:
        _, total = task_counts(sc, group)
        progress(total or 1, total or 1)
    return {"input": input, "format": fmt, "output": str(out_path), "rows": rows,
            "null_rows": int(counters["null_rows"].value), "partitions": wanted, "seconds": seconds,
            "rows_per_s": rows / seconds if seconds > 0 else float("inf"), "startup_s": startup_s,
            "master": sc.master, "outputs": resolve_outputs(art, outputs)}
