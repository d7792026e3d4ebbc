"""Validation parameters, declared once: used by ``bertopt validate`` flags and a recipe's ``validate:`` section."""

from __future__ import annotations

from bertopt.params import Param

VALIDATE_PARAMS = [
    Param("data", str, "builtin", "Validation data: 'builtin' (the shipped corpus) or a .txt / .jsonl / .csv / "
          ".parquet file."),
    Param("text_column", str, "text", "Text column of a JSONL/CSV/Parquet file."),
    Param("text_pair_column", str, None, "Second-segment column for sentence-pair models."),
    Param("label_column", str, None, "Label column: the task metric is computed for artifact and reference."),
    Param("reference", str, None, "Model or artifact to compare with (default: the source in the lineage)."),
    Param("targets", str, None, "Gate thresholds, e.g. 'cos_min=0.99,neighbour_agreement_at_10=0.9,speedup=1.2'."),
    Param("batch_sizes", list, ["1", "32"], "Latency grid: batch sizes."),
    Param("seq_lens", list, ["16", "128"], "Latency grid: sequence lengths (padded)."),
    Param("warmup", int, 2, "Latency: warm-up runs per grid point."),
    Param("repeats", int, 10, "Latency: timed runs per grid point."),
    Param("threads", int, None, "Threads for artifact and reference (default: all available cores)."),
    Param("provider", str, "auto", "Execution provider for the artifact.", choices=("auto", "cpu", "cuda", "tensorrt")),
    Param("atol", float, 1e-3, "Elementwise absolute tolerance for pass_fraction."),
    Param("rtol", float, 1e-3, "Elementwise relative tolerance for pass_fraction."),
    Param("max_texts", int, None, "Use at most this many texts of the data."),
    Param("spark", bool, False, "Also run the data through the Spark UDF and check it equals the runtime."),
    Param("master", str, "local[2]", "Spark master for --spark."),
    Param("latency", bool, True, "Measure the latency grid (off: accuracy only)."),
]
