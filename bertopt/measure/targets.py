"""Threshold expressions shared by ``quantize --accuracy-target`` and the release gate.

``"cos_min=0.995,max_abs<=0.05"``: ``=`` means "at least" for similarity-like metrics (cos_*, *agreement*,
*pass_fraction*, speedup) and "at most" for error-like metrics (max_abs, mean_abs, abs_err_*, nan_or_inf,
latency); ``>=`` and ``<=`` say it explicitly. Bounds relative to the reference: ``*_degradation`` (reference
minus artifact, at most), ``speedup`` (artifact over reference throughput, at least), ``latency_ratio`` (at most).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bertopt.errors import UserError
from bertopt.tasks import FIDELITY_METRICS

# the metric names a target may use: what validate measures, by where it comes from (and FIDELITY_METRICS, each
# task's own, declared per task in bertopt.tasks and measured by bertopt.measure.fidelity)
PER_OUTPUT_METRICS = ("cos_mean", "cos_p01", "cos_min", "max_abs", "mean_abs", "pass_fraction", "nan_or_inf",
                      "neighbour_agreement_at_10", "top1_agreement")
# measured against the data's labels (--label-column): the artifact's and the reference's task accuracy
LABEL_METRICS = ("accuracy", "f1", "reference_accuracy", "reference_f1", "accuracy_degradation", "f1_degradation")
LATENCY_METRICS = ("speedup", "speedup_min", "latency_ratio", "throughput", "latency_p50_ms", "latency_p90_ms",
                   "latency_p99_ms")
SPARK_METRICS = ("spark_max_abs_diff",)
BATCH_METRICS = ("batch_dev",)


def known_metrics(quantile_key: str = "abs_err_p99") -> tuple[str, ...]:
    return (PER_OUTPUT_METRICS + (quantile_key,) + FIDELITY_METRICS + LABEL_METRICS + LATENCY_METRICS
            + SPARK_METRICS + BATCH_METRICS)

HIGHER_IS_BETTER = ("cos_", "agreement", "pass_fraction", "speedup", "throughput", "accuracy", "f1", "ndcg", "spearman",
                    "overlap")
LOWER_IS_BETTER = ("max_abs", "mean_abs", "abs_err", "nan_or_inf", "latency", "p50", "p90", "p99", "degradation",
                   "batch_dev", "prob_diff")


@dataclass(frozen=True)
class Target:
    metric: str
    op: str  # ">=" or "<="
    value: float

    def holds(self, measured: float) -> bool:
        return measured >= self.value if self.op == ">=" else measured <= self.value

    @property
    def parts(self) -> tuple[str | None, str, str]:
        """(output or None, metric name, grid point or ''): ``pooled.cos_min`` -> ('pooled', 'cos_min', ''),
        ``speedup@32x128`` -> (None, 'speedup', '32x128')."""
        # a metric name has no dot and an output name may (ONNX names like 'output.1'): the last dot splits them
        head, _, point = self.metric.partition("@")
        output, _, base = head.rpartition(".")
        return output or None, base, point

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:.10g}"


def default_op(metric: str) -> str:
    base = metric.split("@")[0]  # latency metrics may name a grid point: speedup@32x128
    if "degradation" in base or "ratio" in base:  # relative to the reference: accuracy_degradation, latency_ratio
        return "<="
    if any(base.startswith(p) or p in base for p in HIGHER_IS_BETTER):
        return ">="
    if any(p in base for p in LOWER_IS_BETTER):
        return "<="
    raise UserError(f"unknown metric '{metric}' in target; known metrics: {', '.join(known_metrics())}")


def parse_targets(text: str | None) -> list[Target]:
    if not text:
        return []
    targets = []
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        m = re.fullmatch(r"([A-Za-z0-9_.@]+)\s*(>=|<=|=)\s*([-+0-9.eE]+)", part)
        if not m:
            raise UserError(f"cannot read target '{part}'; write it like cos_min=0.995 or max_abs<=0.01")
        metric, op, value = m.groups()
        try:
            number = float(value)
        except ValueError:
            raise UserError(f"target '{part}': {value!r} is not a number") from None
        target = Target(metric, default_op(metric) if op == "=" else op, number)
        never = _never_holds(target)
        if never:
            raise UserError(f"target '{part}' can never hold: {never}; give a bound the metric can meet")
        targets.append(target)
    return targets


# metrics that are fractions or cosines (at most 1), and errors, counts and times (never below 0): a target past
# those ends runs the whole gate to fail it
AT_MOST_ONE = ("cos_", "agreement", "pass_fraction", "accuracy", "f1", "ndcg", "spearman", "overlap")
NEVER_NEGATIVE = ("max_abs", "mean_abs", "abs_err", "nan_or_inf", "latency_p", "batch_dev", "prob_diff")


def _never_holds(target: Target) -> str | None:
    base = target.parts[1]
    if target.value != target.value:
        return "it is not a number"
    if "degradation" in base or base.startswith("reference_"):
        return None
    if target.op == ">=" and target.value > 1 and any(p in base for p in AT_MOST_ONE):
        return f"{base} is at most 1"
    if target.op == "<=" and target.value < 0 and any(p in base for p in NEVER_NEGATIVE):
        return f"{base} is never below 0"
    return None


def targets_problem(value: str) -> str | None:
    """A ``Param`` check for a target expression: why ``value`` does not parse, or None."""
    try:
        parsed = parse_targets(value)
    except UserError as exc:
        return str(exc)
    if not parsed:  # ',' or '' would silently drop the gate to another command's defaults
        return (f"{value!r} names no target; write one like cos_min>=0.995 (several joined by commas), or leave the "
                "option out for the defaults")
    return None
