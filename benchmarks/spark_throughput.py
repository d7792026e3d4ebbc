"""Spark UDF throughput against the in-process runtime on the same artifact, in one run.

    .venv/bin/python benchmarks/spark_throughput.py [--sentences 10000] [--precision int8|fp32] [--master local[2]]

Measures, on the same cores:
  1. in-process: one Predictor (all cores) encoding every sentence with length-bucketed batches of 32;
  2. Spark start-up (session) and the first action (Python workers start, the model loads once per worker),
     reported separately;
  3. the predict_batch_udf column function and the mapInPandas variant over the same sentences, once started
     (a ``noop`` sink forces every row through the model without collecting them on the driver);
and reports each Spark variant's throughput as a ratio of (1) (target >= 0.8).
The artifact is all-MiniLM-L6-v2 exported to ONNX (optimized + dynamic int8 by default), built under
artifacts/bench/spark/ with bertopt.registry.run_stage if absent. Prints a table and writes
benchmarks/results/spark_throughput.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def say(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def ensure_artifact(precision: str, folder: Path):
    """MiniLM as ONNX (fp32) or optimized + dynamic int8, built once and reused."""
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.registry import run_stage

    onnx_dir, opt_dir, int8_dir = folder / "minilm-onnx", folder / "minilm-optimized", folder / "minilm-int8"
    if not is_artifact(onnx_dir):
        say("exporting builtin:minilm to ONNX ...")
        run_stage("export", "builtin:minilm", {}, onnx_dir)
    if precision == "fp32":
        return Artifact.load(onnx_dir)
    if not is_artifact(opt_dir):
        say("optimizing ...")
        run_stage("optimize", onnx_dir, {}, opt_dir)
    if not is_artifact(int8_dir):
        say("quantizing (int8 dynamic) ...")
        run_stage("quantize", opt_dir, {"mode": "int8-dynamic"}, int8_dir)
    return Artifact.load(int8_dir)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=10_000, help="Sentences per pass (mixed text, repeated).")
    parser.add_argument("--precision", choices=("int8", "fp32"), default="int8")
    parser.add_argument("--artifact", type=Path, default=None, help="Use this artifact instead of building MiniLM.")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "spark_throughput.json")
    args = parser.parse_args(argv)
    if args.sentences < 1:
        parser.error("--sentences must be at least 1")

    import warnings

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    import pandas as pd

    from bertopt.artifact import Artifact
    from bertopt.data import mixed_text
    from bertopt.output_paths import write_json
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads
    from bertopt.spark import get_session, predict_dataframe, predict_udf
    from bertopt.spark.session import worker_errors

    art = Artifact.load(args.artifact) if args.artifact else ensure_artifact(args.precision,
                                                                              REPO / "artifacts" / "bench" / "spark")
    base = mixed_text()
    texts = (base * (args.sentences // len(base) + 1))[: args.sentences]
    tokens_note = f"{len(texts)} sentences of mixed-length English ({len(base)} distinct lines repeated)"
    say(f"artifact {art.path} ({art.precision}); {tokens_note}")

    # 1. in-process, all cores
    predictor = Predictor(art, batch_size=args.batch_size)
    predictor.run(texts[:64])
    say("in-process pass ...")
    t0 = time.perf_counter()
    predictor.run(texts)
    in_process_s = time.perf_counter() - t0
    in_rps = len(texts) / in_process_s

    # 2. Spark start-up and the first action, separately
    t0 = time.perf_counter()
    spark = get_session(args.master, app_name="bertopt spark benchmark")
    startup_s = time.perf_counter() - t0
    slots = spark.sparkContext.defaultParallelism
    df = spark.createDataFrame(pd.DataFrame({"text": texts}), schema="text string").repartition(slots).cache()
    df.count()  # the input in memory: reading it is not what is measured
    udf = predict_udf(art, batch_size=args.batch_size, spark=spark)
    warm = spark.createDataFrame(pd.DataFrame({"text": texts[: 32 * slots]}), schema="text string")
    t0 = time.perf_counter()
    with worker_errors():
        warm.repartition(slots).select(udf("text")).write.format("noop").mode("overwrite").save()
    first_action_s = time.perf_counter() - t0

    # 3. the two Spark variants, once started
    def timed(frame) -> float:
        t = time.perf_counter()
        with worker_errors():
            frame.write.format("noop").mode("overwrite").save()
        return time.perf_counter() - t

    say("Spark predict_batch_udf pass ...")
    udf_s = timed(df.select(udf("text").alias("embedding")))
    say("Spark mapInPandas pass ...")
    map_s = timed(predict_dataframe(df, art, batch_size=args.batch_size))
    spark.stop()

    rows = [
        ("in-process Predictor (all cores)", in_process_s, in_rps, 1.0),
        (f"Spark predict_batch_udf ({args.master})", udf_s, len(texts) / udf_s, (len(texts) / udf_s) / in_rps),
        (f"Spark mapInPandas ({args.master})", map_s, len(texts) / map_s, (len(texts) / map_s) / in_rps),
    ]
    print(f"\nSpark throughput: {art.path.name} ({art.precision}), {tokens_note}, batch {args.batch_size}, "
          f"{default_threads()} cores")
    print(f"{'variant':<42} {'seconds':>9} {'sentences/s':>12} {'x in-process':>13}")
    for name, seconds, rps, ratio in rows:
        print(f"{name:<42} {seconds:>9.1f} {rps:>12.1f} {ratio:>13.2f}")
    print(f"Spark start-up (session): {startup_s:.1f} s; first action (workers start, model loads): "
          f"{first_action_s:.1f} s; target: Spark >= 0.8 x in-process once started")
    result = {
        "artifact": str(art.path), "precision": art.precision, "sentences": len(texts), "batch_size": args.batch_size,
        "master": args.master, "cores": default_threads(), "machine": platform.platform(),
        "in_process": {"seconds": in_process_s, "sentences_per_s": in_rps},
        "spark_udf": {"seconds": udf_s, "sentences_per_s": len(texts) / udf_s, "ratio": rows[1][3]},
        "spark_map_in_pandas": {"seconds": map_s, "sentences_per_s": len(texts) / map_s, "ratio": rows[2][3]},
        "spark_startup_s": startup_s, "spark_first_action_s": first_action_s, "target_ratio": 0.8,
        "note": "shared machine: other processes compete for the same cores; compare the ratios",
    }
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
