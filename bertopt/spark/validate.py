"""Validation in UDF form: run texts through the Spark UDF and through the in-process Predictor on the same
artifact, and report how far apart they are and how fast the UDF is.

``bertopt validate --spark`` calls ``spark_check`` and applies its threshold (within 1e-5) to
``max_abs_diff``. Null/empty texts must come back null from the UDF; they are left out of the comparison.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np


def spark_check(artifact, texts: Sequence[str], master: str = "local[2]", batch_size: int = 32,
                pairs: Sequence[str] | None = None, *, spark=None, output: str | None = None,
                threads: int | None = None) -> dict[str, Any]:
    """Compare the UDF's results with the in-process runtime's on the same artifact.

    Returns ``max_abs_diff`` (over all compared values; inf when a row that should have a prediction came back
    null), ``rows``, ``rows_per_s`` (UDF, once started: a second pass after a warm-up pass that starts the
    Python workers and loads the model), ``startup_s`` (getting the Spark session), ``first_action_s``
    (warm-up pass), ``in_process_rows_per_s``, ``ratio`` (UDF / in-process throughput), ``null_rows`` and
    ``null_rows_ok``, ``output``, ``master``, ``batch_size``.
    """
    import pandas as pd

    from bertopt.artifact import Artifact
    from bertopt.errors import UserError
    from bertopt.runtime import Predictor
    from bertopt.spark.session import get_session, worker_errors
    from bertopt.spark.udf import (
        DERIVED,
        LABEL,
        RESULT,
        check_task_columns,
        predict_rows,
        predict_udf,
        predictable,
        resolve_outputs,
    )

    art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    texts = list(texts)
    if not texts:
        raise UserError("spark check needs at least one text")
    if pairs is not None and len(pairs) != len(texts):
        raise UserError(f"got {len(texts)} texts but {len(pairs)} pairs")
    check_task_columns(art, pairs is not None)
    name = resolve_outputs(art, [output] if output else None)[0]
    if name in (LABEL, RESULT):
        raise UserError(f"spark check compares numeric outputs, not '{name}' (text); choose the logits, embedding "
                        "or task output (entities, score, sparse)")
    task_column = name in DERIVED  # entities / score / sparse: compared with the same post-processing in process

    t0 = time.perf_counter()
    session = spark if spark is not None else get_session(master, app_name="bertopt validate --spark")
    startup_s = time.perf_counter() - t0

    frame = {"idx": np.arange(len(texts), dtype=np.int64), "text": pd.Series(texts, dtype=object)}
    if pairs is not None:
        frame["pair"] = pd.Series(list(pairs), dtype=object)
    df = session.createDataFrame(pd.DataFrame(frame), schema="idx long, text string"
                                 + (", pair string" if pairs is not None else ""))
    from pyspark.sql.functions import spark_partition_id

    from bertopt.spark.udf import DEFAULT_WINDOW

    udf = predict_udf(art, output=name, batch_size=batch_size, pairs=pairs is not None, spark=session)
    result = df.select("idx", spark_partition_id().alias("partition"),
                       (udf("text", "pair") if pairs is not None else udf("text")).alias("prediction"))
    with worker_errors():
        t1 = time.perf_counter()
        result.collect()  # warm-up: starts the Python workers and loads the model once per worker
        first_action_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        rows = result.collect()
        udf_seconds = time.perf_counter() - t2
    by_index = {int(r["idx"]): r["prediction"] for r in rows}

    valid = [i for i in range(len(texts)) if predictable(texts[i]) and (pairs is None or predictable(pairs[i]))]
    predictor = Predictor(art, batch_size=batch_size, threads=threads)
    valid_texts = [texts[i] for i in valid]
    valid_pairs = [pairs[i] for i in valid] if pairs is not None else None
    opts = udf.options

    def in_process(chunk_texts, chunk_pairs):
        if task_column:
            return predict_rows(predictor, chunk_texts, chunk_pairs, opts)[name]
        return predictor.run(chunk_texts, chunk_pairs, outputs=[name])[name]

    in_process(valid_texts[:batch_size], valid_pairs[:batch_size] if valid_pairs else None)
    t3 = time.perf_counter()
    reference = in_process(valid_texts, valid_pairs) if valid else np.zeros((0, 0))
    in_process_seconds = time.perf_counter() - t3
    # Same batches: dynamic int8 quantises activations with one scale per batch, so a text's result depends
    # on its batch neighbours. Re-run in process exactly as the UDF batched: per partition, rows in order, cut
    # into windows of DEFAULT_WINDOW rows, each sorted by length and cut into batch_size batches.
    window = max(batch_size, DEFAULT_WINDOW)
    partition_of = {int(r["idx"]): int(r["partition"]) for r in rows}
    position = {i: j for j, i in enumerate(valid)}
    same_batches = list(reference) if task_column else np.array(reference, copy=True)
    for part in sorted(set(partition_of.values())):
        members = sorted(i for i, p in partition_of.items() if p == part)
        for start in range(0, len(members), window):
            chunk = [i for i in members[start:start + window] if i in position]
            if not chunk:
                continue
            out = in_process([texts[i] for i in chunk], [pairs[i] for i in chunk] if pairs is not None else None)
            for k, i in enumerate(chunk):
                same_batches[position[i]] = out[k]
    reference = same_batches

    max_abs_diff = 0.0
    for j, i in enumerate(valid):
        got = by_index.get(i)
        if got is None:
            max_abs_diff = float("inf")
            break
        max_abs_diff = max(max_abs_diff, row_distance(got, reference[j]))
    expected_null = set(range(len(texts))) - set(valid)
    got_null = {i for i, v in by_index.items() if v is None}
    udf_rps = len(rows) / udf_seconds if udf_seconds > 0 else float("inf")
    in_rps = len(valid) / in_process_seconds if in_process_seconds > 0 else float("inf")
    return {
        "max_abs_diff": max_abs_diff,
        "rows": len(rows),
        "compared_rows": len(valid),
        "rows_per_s": udf_rps,
        "startup_s": startup_s,
        "first_action_s": first_action_s,
        "in_process_rows_per_s": in_rps,
        "ratio": udf_rps / in_rps if in_rps else float("nan"),
        "null_rows": len(got_null),
        "null_rows_ok": got_null == expected_null and len(rows) == len(texts),
        "output": name,
        "master": session.sparkContext.master,
        "batch_size": batch_size,
    }


def row_distance(got: Any, want: Any) -> float:
    """Largest difference between a UDF value and the in-process one: numbers and arrays elementwise; a SPLADE
    struct or SparseVector term by term (a term only one side has counts in full); entities by score, and
    infinitely far when their groups or spans differ."""
    if hasattr(got, "indices") and hasattr(got, "values") and not isinstance(got, dict):  # SparseVector, Row
        got = {"indices": list(got["indices"] if not hasattr(got, "toArray") else got.indices),
               "values": list(got["values"] if not hasattr(got, "toArray") else got.values)}
    if hasattr(want, "toArray"):
        want = {"indices": list(want.indices), "values": list(want.values)}
    if isinstance(want, dict):
        a = dict(zip(got["indices"], got["values"]))
        b = dict(zip(want["indices"], want["values"]))
        return max((abs(float(a.get(k, 0.0)) - float(b.get(k, 0.0))) for k in set(a) | set(b)), default=0.0)
    if isinstance(want, list) and (not want or isinstance(want[0], dict)):  # entities
        if len(got) != len(want):
            return float("inf")
        worst = 0.0
        for g, w in zip(got, want):
            if (g["entity_group"], g["start"], g["end"], g["word"]) != (w["entity_group"], w["start"], w["end"],
                                                                          w["word"]):
                return float("inf")
            worst = max(worst, abs(float(g["score"]) - float(w["score"])))
        return worst
    diff = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))
    return float(np.max(diff)) if diff.size else 0.0
