"""Validation parameters, declared once: used by ``bertopt validate`` flags and a recipe's ``validate:`` section."""

from __future__ import annotations

from bertopt.measure.targets import targets_problem
from bertopt.params import BATCH_SIZE, DEVICE_ID, MAX_BATCH_SIZE, PROVIDER, THREADS, Param


def whole_numbers(values, most: int = 1 << 16) -> str | None:
    """A ``Param`` check for the latency grid (batch sizes, sequence lengths): whole numbers from 1 to ``most``, so
    a recipe's ``validate:`` is refused before its first stage runs, not after its last."""
    if not values:
        return "is empty; give at least one value like 1,32"
    for v in values:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            return f"takes whole numbers like 1,32; got {v!r}"
        try:
            n = int(v)
        except (TypeError, ValueError):
            return f"takes whole numbers like 1,32; got {v!r}"
        if n < 1:
            return f"values must be at least 1, got {n}"
        if n > most:
            return f"values must be at most {most:,}, got {n:,}"
    return None


def _batch_sizes(values) -> str | None:
    return whole_numbers(values, MAX_BATCH_SIZE)


def _quantile(value) -> str | None:
    return None if 0 < value < 1 else f"must be between 0 and 1 (exclusive), got {value}"


VALIDATE_PARAMS = [
    Param("data", str, "builtin", "Validation data: 'builtin' (the shipped corpus) or a .txt / .jsonl / .csv / "
          ".parquet file.", file=True),
    Param("text_column", str, "text", "Text column of a JSONL/CSV/Parquet file."),
    Param("text_pair_column", str, None, "Second-segment column for sentence-pair models."),
    Param("label_column", str, None, "Label column: the task metric is computed for artifact and reference."),
    Param("reference", str, None, "Model or artifact to compare with (default: the source in the lineage)."),
    Param("targets", str, None, "Gate thresholds, e.g. 'cos_min=0.99,neighbour_agreement_at_10=0.9,speedup=1.2'. "
          "Metrics: cos_mean/cos_p01/cos_min, max_abs, mean_abs, abs_err_p99, pass_fraction, nan_or_inf, "
          "neighbour_agreement_at_10, top1_agreement, batch_dev; per task: max_prob_diff (classification), "
          "token_label_agreement and entity_f1 (token-classification), ndcg_at_10 and spearman (rerank), "
          "term_overlap_at_10 (sparse-embedding) (name an output as 'last_hidden_state.max_abs'; default: the "
          "task's output); with labels accuracy, f1 and accuracy_degradation/f1_degradation (reference minus "
          "artifact); latency: speedup (geometric mean over the grid), speedup_min, latency_ratio, "
          "latency_p50_ms/p90/p99 and throughput (worst grid point), or one point as 'speedup@32x128'. Without "
          "targets: defaults for the primary output's kind (embeddings: cos_min>=0.99, "
          "neighbour_agreement_at_10>=0.9; logits: top1_agreement>=0.99, cos_min>=0.99).",
          check=targets_problem),
    Param("batch_sizes", list, ["1", "32"], "Latency grid: batch sizes.", check=_batch_sizes),
    Param("seq_lens", list, ["16", "128"], "Latency grid: sequence lengths (padded).", check=whole_numbers),
    Param("warmup", int, 2, "Latency: warm-up runs per grid point.", min=0),
    Param("repeats", int, 10, "Latency: timed runs per grid point.", min=1),
    THREADS,
    PROVIDER,
    DEVICE_ID,
    Param("atol", float, 1e-3, "Elementwise absolute tolerance for pass_fraction.", min=0),
    Param("rtol", float, 1e-3, "Elementwise relative tolerance for pass_fraction.", min=0),
    Param("max_texts", int, None, "Use at most this many texts of the data.", min=1),
    Param("spark", bool, False, "Also run the data through the Spark UDF and check it equals the runtime."),
    Param("master", str, "local[2]", "Spark master for --spark."),
    Param("latency", bool, True, "Measure the latency grid (off: accuracy only)."),
    Param("batch_check", bool, True, "Measure batch invariance: texts alone vs inside mixed-length batches of 1 "
          "(other padding), 7 and 32 (other neighbours); reported as batch_dev (largest 1 - cosine) and recorded "
          "in the manifest."),
    Param("error_quantile", float, 0.99, "Quantile of the elementwise absolute error reported as abs_err_pNN.",
          check=_quantile),
    BATCH_SIZE,
]
