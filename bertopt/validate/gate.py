"""The release gate: run an artifact and its reference on the same data, measure (with ``bertopt.measure``)
accuracy per output, the task metrics, the label metrics when there are labels, latency over a grid, batch
invariance, optionally the Spark path; check every threshold; write reports (JSON, JUnit XML, Markdown, HTML
with plots); record the result in the manifest.

A missed threshold is a failed check, never a warning: ``validate_artifact(..., raise_on_fail=True)`` raises
``GateFailed`` (exit 1) after the reports are written. Usage problems (bad data file, unknown metric, a grid the
model cannot run) are ``UserError`` (exit 2) raised before anything is run or written.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bertopt.errors import GateFailed, UserError
from bertopt.extensions import load_extensions
from bertopt.measure.batch import batch_deviation
from bertopt.measure.compare import measure_runs
from bertopt.measure.data import Dataset, load_texts
from bertopt.measure.fidelity import rerank_pairs, task_fidelity
from bertopt.measure.labels import label_indices, label_metrics
from bertopt.measure.latency import measure_grid, summarize
from bertopt.measure.targets import (
    BATCH_METRICS,
    LABEL_METRICS,
    LATENCY_METRICS,
    PER_OUTPUT_METRICS,
    SPARK_METRICS,
    Target,
    known_metrics,
    parse_targets,
)
from bertopt.model_handle import primary_output_problem
from bertopt.plugins import Registry
from bertopt.tasks import FIDELITY_METRIC_TASK, FIDELITY_METRICS

SPARK_TOLERANCE = 1e-5
# the default bound of a batch-invariant artifact (1 - cosine, bertopt.measure.batch), also the default recipe's
# gate
INVARIANCE_BOUND = 1e-4


def _quantile_key(q: float) -> str:
    return f"abs_err_p{int(q * 100)}"


def check_target_metrics(targets, outputs: list[dict[str, Any]], primary: str, config: dict[str, Any],
                         grid: set[str], task: str | None = None) -> None:
    """Every target must name something this run measures; say what to change when it does not."""
    kinds = {o["name"]: o.get("kind", "embedding") for o in outputs}
    qkey = _quantile_key(config["error_quantile"])
    for t in targets:
        named, base, point = t.parts
        output = named or primary
        if named is not None:
            if output not in kinds:
                raise UserError(f"target '{t.metric}' names output '{output}', which this artifact does not have "
                                f"(outputs: {', '.join(kinds)})")
        if base in PER_OUTPUT_METRICS or base.startswith("abs_err_p"):
            if base.startswith("abs_err_p") and base != qkey:
                raise UserError(f"target '{t.metric}': this run measures {qkey}; pass --error-quantile "
                                f"{int(base[len('abs_err_p'):]) / 100:g} to measure {base}")
            if base == "neighbour_agreement_at_10" and kinds[output] != "embedding":
                raise UserError(f"target '{t.metric}': neighbour agreement is measured for sentence embeddings; "
                                f"output '{output}' is {kinds[output]}-level")
            if base == "top1_agreement" and kinds[output] not in ("logits", "token-logits"):
                raise UserError(f"target '{t.metric}': top-1 agreement is measured for classifier logits; output "
                                f"'{output}' is {kinds[output]}-level")
            continue
        if base in LABEL_METRICS:
            if not config["label_column"]:
                raise UserError(f"target '{t.metric}' needs labels; give a data file with a label column and "
                                "--label-column NAME")
            continue
        if base in LATENCY_METRICS:
            if not config["latency"]:
                raise UserError(f"target '{t.metric}' is a latency metric but latency is off; drop --no-latency")
            if point and point not in grid:
                raise UserError(f"target '{t.metric}': grid point {point} is not measured (grid: "
                                f"{', '.join(sorted(grid))}); add it with --batch-sizes/--seq-lens")
            continue
        if base in SPARK_METRICS:
            if not config["spark"]:
                raise UserError(f"target '{t.metric}' needs the Spark check; pass --spark")
            continue
        if base in FIDELITY_METRICS:
            measured_for = FIDELITY_METRIC_TASK[base]
            if task is not None and measured_for != task:
                raise UserError(f"target '{t.metric}': {base} is measured for {measured_for} models; this "
                                f"artifact is a {task} model")
            continue
        if base in BATCH_METRICS:
            if not config["batch_check"]:
                raise UserError(f"target '{t.metric}' needs the batch-invariance check; drop --no-batch-check")
            continue
        raise UserError(f"unknown metric '{t.metric}' in targets; known: " + ", ".join(known_metrics(qkey)))


def _prepare_report_dir(report_dir: Path, artifact, config: dict[str, Any]) -> Path:
    """The output-path policy for the report folder: not the artifact, the data or the reference (nor inside or
    around them); a previous bertopt report there is replaced, anything else is refused."""
    from bertopt.output_paths import check_output

    inputs = [artifact.path] + [config[k] for k in ("data", "reference")
                                if config.get(k) and config[k] != "builtin" and Path(config[k]).exists()]
    return check_output(report_dir, kind="report", inputs=inputs, replace=True, flag="--report-dir")


# checks run by another part (Spark registers "spark": the UDF against the in-process runtime), so validate/
# never imports that part
_RUNNER_CHECKS: Registry[Callable] = Registry("runner check", load=load_extensions)


def register_runner_check(name: str):
    return _RUNNER_CHECKS.register(name)


def _spark_check(artifact, data, config):
    return _RUNNER_CHECKS.get("spark")(artifact, data.texts, master=config["master"], batch_size=config["batch_size"],
                                   pairs=data.pairs)


# What ``validate`` gates when no --targets are given, by the kind of the primary output: a faithful artifact
# passes these, an unfaithful one fails them (NaN/Inf is checked for every output in any case).
DEFAULT_TARGETS = {
    "embedding": "cos_min>=0.99,neighbour_agreement_at_10>=0.9",
    "token": "cos_min>=0.99",
    "logits": "top1_agreement>=0.99,cos_min>=0.99",
    "token-logits": "cos_min>=0.99",
    "sparse": "cos_min>=0.99",
    "score": "max_abs<=0.05",
}


def default_targets(kind: str) -> str:
    return DEFAULT_TARGETS.get(kind, "cos_min>=0.99")


@dataclass
class GatePlan:
    """Everything a run of the gate needs, checked before any model runs."""

    artifact: Any
    config: dict[str, Any]
    report_dir: Path
    targets: list
    targets_are_defaults: bool
    batch_sizes: list[int]
    seq_lens: list[int]
    outputs: list[dict[str, Any]]
    primary: str
    kinds: dict[str, str]
    data: Any
    labels: np.ndarray | None
    task: str = "embedding"  # bertopt.runtime.tasks: the task metric is measured on its output (the primary)


def latency_seq_lens(artifact, config: dict[str, Any]) -> list[int]:
    """The latency grid's sequence lengths: ``--seq-lens``, refused now (before any model loads) under
    ``MIN_SEQ_LEN`` or past the tokens the artifact takes; the default grid (16, 128) is capped there instead, so a
    model of 64 positions is timed at 16 and 64 rather than refused for an option its user never gave."""
    from bertopt.measure.latency import MIN_SEQ_LEN
    from bertopt.runtime.predictor import sequence_length
    from bertopt.validate.params import VALIDATE_PARAMS

    seq_lens = [int(v) for v in config["seq_lens"]]
    longest = sequence_length(artifact.model_info)
    if config["latency"] and min(seq_lens) < MIN_SEQ_LEN:
        raise UserError(f"latency sequence length {min(seq_lens)} is too short; use at least {MIN_SEQ_LEN} ([CLS] "
                        "text [SEP])")
    if not config["latency"] or max(seq_lens) <= longest:
        return seq_lens
    default = next(p.default for p in VALIDATE_PARAMS if p.name == "seq_lens")
    if [str(v) for v in config["seq_lens"]] == list(default):
        return sorted({min(s, longest) for s in seq_lens})
    raise UserError(f"latency sequence length {max(seq_lens)} exceeds the {longest} tokens {artifact.path} takes; "
                    f"use --seq-lens with values up to {longest}")


def plan_gate(artifact, config: dict[str, Any] | None, report_dir) -> GatePlan:
    """Resolve and check the config, the artifact, the report folder, the targets and the data: every usage
    problem is a UserError here, before anything is run or written."""
    from bertopt.artifact import Artifact
    from bertopt.params import resolve_config
    from bertopt.validate.params import VALIDATE_PARAMS

    config = resolve_config(VALIDATE_PARAMS, config, "validate")
    if not isinstance(artifact, Artifact):
        artifact = Artifact.load(artifact)
    report_dir = _prepare_report_dir(Path(report_dir), artifact, config)
    from bertopt.runtime.tasks import check_pairs, task_of, task_output

    outputs = artifact.outputs
    kinds = artifact.output_kinds
    model_task = task_of(artifact)
    primary = artifact.primary_output
    if model_task != "embedding":
        primary = task_output(artifact, model_task)
    problem = primary_output_problem(primary, outputs)
    if problem:
        raise UserError(f"{artifact.path}: {problem}; re-create the artifact")
    targets_are_defaults = not config["targets"]
    targets = parse_targets(config["targets"] or default_targets(kinds[primary]))
    batch_sizes = [int(v) for v in config["batch_sizes"]]  # checked by VALIDATE_PARAMS (whole_numbers)
    seq_lens = latency_seq_lens(artifact, config)
    grid = {f"{b}x{s}" for b in batch_sizes for s in seq_lens}
    check_target_metrics(targets, outputs, primary, config, grid, model_task)
    data = load_texts(config["data"], config["text_column"], config["text_pair_column"], config["label_column"])
    data = data.head(config["max_texts"])
    if model_task == "rerank" and data.pairs is None:  # plain texts: the first ones rank the next ones
        queries, passages = rerank_pairs(data.texts)
        data = Dataset(queries, passages, None, f"{data.source} (query x passage pairs)")
    check_pairs(artifact, model_task, data.pairs)
    labels = None
    if config["label_column"]:
        logits = [o for o in outputs if o.get("kind") == "logits"]
        if not logits:
            raise UserError(f"--label-column needs a classifier (an output of kind logits); {artifact.path} has "
                            f"{', '.join(f'{k} ({v})' for k, v in kinds.items())}")
        num_classes = int(logits[0]["shape"][-1])
        labels = label_indices(data.labels, artifact.model_info, num_classes, data.source)
    return GatePlan(artifact, config, report_dir, targets, targets_are_defaults, batch_sizes, seq_lens, outputs,
                    primary, kinds, data, labels, model_task)


def measure_accuracy(plan: GatePlan, art, ref, names: list[str]):
    """Artifact vs reference on the data: per-output statistics, error distributions (for the plots) and both
    runs' outputs."""
    data, config = plan.data, plan.config
    got = art.run(data.texts, data.pairs, outputs=names)
    want = ref.run(data.texts, data.pairs, outputs=names)
    measured = measure_runs(got, want, plan.kinds, atol=config["atol"], rtol=config["rtol"],
                            quantile=config["error_quantile"])
    accuracy = {name: stats for name, (stats, _) in measured.items()}
    if plan.primary in accuracy and "error" not in accuracy[plan.primary]:
        accuracy[plan.primary].update(task_fidelity(plan.task, art, data.texts, data.pairs, got[plan.primary],
                                                    want[plan.primary]))
    # an output whose shapes differ has its error line in the statistics and nothing to plot
    distributions = {name: measured[name][1] for name in names if name in measured and measured[name][1]}
    return accuracy, distributions, got, want


def measure_task(plan: GatePlan, got, want) -> dict[str, Any] | None:
    """Accuracy and macro F1 of artifact and reference against the labels (classifiers with --label-column)."""
    if plan.labels is None:
        return None
    logit_name = next(o["name"] for o in plan.outputs if o.get("kind") == "logits")
    num_classes = int(np.asarray(got[logit_name]).shape[-1])
    mine = label_metrics(np.asarray(got[logit_name]).argmax(1), plan.labels, num_classes)
    theirs = label_metrics(np.asarray(want[logit_name]).argmax(1), plan.labels, num_classes)
    return {"output": logit_name, "labels": len(plan.labels), "artifact": mine, "reference": theirs,
            "accuracy_degradation": theirs["accuracy"] - mine["accuracy"], "f1_degradation": theirs["f1"] - mine["f1"]}


def measure_latency(plan: GatePlan, art, ref, progress) -> dict[str, Any] | None:
    if not plan.config["latency"]:
        return None
    config = plan.config
    points = measure_grid({"artifact": art, "reference": ref}, plan.data.texts, plan.batch_sizes, plan.seq_lens,
                          warmup=config["warmup"], repeats=config["repeats"], progress=progress)
    return {"grid": points, "metrics": summarize(points), "warmup": config["warmup"], "repeats": config["repeats"]}


def measure_batch_invariance(plan: GatePlan, art, names: list[str]) -> dict[str, Any] | None:
    """The largest deviation of a text alone vs inside other batches (``bertopt.measure.batch``)."""
    if not plan.config["batch_check"]:
        return None
    found = batch_deviation(art, plan.data.texts, plan.data.pairs, outputs=names)
    # the bound is the gate's own batch_dev target when it names one (bertopt tune gates at 1e-3), so the
    # manifest's "invariant" says what was actually required of this artifact
    bounds = [t.value for t in plan.targets if t.metric == "batch_dev" and t.op in ("<=", "<")]
    found["bound"] = min(bounds) if bounds else INVARIANCE_BOUND
    found["invariant"] = bool(found["batch_dev"] <= found["bound"])
    return found


def collect_metrics(plan: GatePlan, accuracy, task, latency, spark, batch) -> dict[str, float]:
    """One flat name -> value mapping the targets are checked against (``output.metric`` and, for the primary
    output, the bare metric name)."""
    metrics: dict[str, float] = {}
    for name, stats in accuracy.items():
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("atol", "rtol"):
                metrics[f"{name}.{key}"] = float(value)
                if name == plan.primary:
                    metrics[key] = float(value)
    if task:
        metrics.update({"accuracy": task["artifact"]["accuracy"], "f1": task["artifact"]["f1"],
                        "reference_accuracy": task["reference"]["accuracy"], "reference_f1": task["reference"]["f1"],
                        "accuracy_degradation": task["accuracy_degradation"],
                        "f1_degradation": task["f1_degradation"]})
    if latency:
        metrics.update(latency["metrics"])
    if spark:
        metrics["spark_max_abs_diff"] = float(spark["max_abs_diff"])
    if batch:
        metrics["batch_dev"] = float(batch["outputs"].get(plan.primary, {}).get("batch_dev", batch["batch_dev"]))
        for name, found in batch["outputs"].items():
            metrics[f"{name}.batch_dev"] = float(found["batch_dev"])
    return metrics


def gate_checks(plan: GatePlan, names: list[str], metrics: dict[str, float], spark) -> list[dict[str, Any]]:
    checks = [_check(f"{name}: no NaN/Inf", Target(f"{name}.nan_or_inf", "<=", 0), metrics) for name in names]
    suffix = " (default)" if plan.targets_are_defaults else ""
    checks += [_check(f"{t}{suffix}", t, metrics) for t in plan.targets]
    if spark:
        checks.append(_check("spark_matches_runtime", Target("spark_max_abs_diff", "<=", SPARK_TOLERANCE), metrics))
    return checks


def validate_artifact(artifact, config: dict[str, Any] | None, report_dir, raise_on_fail: bool = True,
                      console=None, reference=None, record: bool = True) -> dict[str, Any]:
    """Gate ``artifact`` against its reference with thresholds from ``config`` (``VALIDATE_PARAMS``; without
    targets, ``DEFAULT_TARGETS`` for the kind of the primary output). ``reference``: a reference Predictor the
    caller already opened (``bertopt tune`` gates every candidate against one), instead of ``config['reference']``
    or the lineage's source. ``record=False``: reports only, the manifest's ``validation`` left as it is (tune's
    second run of a candidate, so the manifest keeps the run that measured batch invariance)."""
    from bertopt.output_paths import output_lock

    t_start = time.perf_counter()
    plan = plan_gate(artifact, config, report_dir)
    with output_lock(plan.report_dir, "--report-dir"):
        return _run_gate(plan, t_start, raise_on_fail, console, reference, record)


def _run_gate(plan: GatePlan, t_start: float, raise_on_fail: bool, console, reference=None,
              record: bool = True) -> dict[str, Any]:
    artifact, config = plan.artifact, plan.config

    status = console.status("[bold]validate[/] loading models ...") if console is not None else nullcontext()
    with status as live:
        def progress(text: str) -> None:
            if live is not None:
                live.update(f"[bold]validate[/] {text}")

        from bertopt.runtime import Predictor
        from bertopt.validate.reference import reference_predictor

        art = Predictor(artifact, provider=config["provider"], threads=config["threads"],
                        batch_size=config["batch_size"], verify=False, device_id=config.get("device_id"))
        ref = reference if reference is not None else reference_predictor(
            artifact, config["reference"], threads=config["threads"], batch_size=config["batch_size"])
        longest = min(art.max_seq_len, ref.max_seq_len)
        if config["latency"] and max(plan.seq_lens) > longest:
            raise UserError(f"latency sequence length {max(plan.seq_lens)} exceeds the model's maximum of "
                            f"{longest} tokens; use --seq-lens with values up to {longest}")
        names = [n for n in art.output_names if n in ref.output_names]
        if not names:
            raise UserError(f"the reference has none of the artifact's outputs ({', '.join(art.output_names)}); "
                            "name a matching reference with --reference")
        progress(f"accuracy: artifact and reference ({ref.session.backend}) on {len(plan.data)} texts")
        accuracy, distributions, got, want = measure_accuracy(plan, art, ref, names)
        task = measure_task(plan, got, want)
        progress("batch invariance: texts alone vs inside other batches")
        batch = measure_batch_invariance(plan, art, names)
        latency = measure_latency(plan, art, ref, progress)
        spark = None
        if config["spark"]:
            progress(f"spark ({config['master']})")
            spark = _spark_check(artifact, plan.data, config)

    metrics = collect_metrics(plan, accuracy, task, latency, spark, batch)
    checks = gate_checks(plan, names, metrics, spark)
    passed = all(c["passed"] for c in checks)

    from bertopt.machine import machine_info
    from bertopt.validate.reports import package_versions, print_summary, write_reports

    result: dict[str, Any] = {
        "passed": passed,
        "report_dir": str(plan.report_dir),
        "checks": checks,
        "default_targets": ",".join(str(t) for t in plan.targets) if plan.targets_are_defaults else None,
        "artifact": {**art.describe(), "path": str(artifact.path), "model_format": artifact.model_format,
                     "size_bytes": artifact.size_bytes(), "stages": [h.get("stage") for h in artifact.history()]},
        "reference": {**ref.describe(), "framework": ref.session.backend, "spec": config["reference"] or "lineage",
                      "model": str(getattr(ref.artifact, "path", ""))},
        "data": plan.data.describe(),
        "primary_output": plan.primary,
        "model_task": plan.task,
        "accuracy": accuracy,
        "task": task,
        "latency": latency,
        "spark": spark,
        "batch_invariance": batch,
        "metrics": metrics,
        "config": config,
        "versions": package_versions(),
        "machine": machine_info(),
        "wall_time_s": round(time.perf_counter() - t_start, 2),
    }
    write_reports(result, distributions, plan.report_dir)
    if console is not None:
        print_summary(result, console)
    if record:
        record_gate(artifact, result)
    if not passed and raise_on_fail:
        failed = [c["name"] for c in checks if not c["passed"]]
        raise GateFailed(f"{len(failed)} of {len(checks)} checks failed ({'; '.join(failed)}); reports in "
                         f"{plan.report_dir}")
    return result


def record_gate(artifact, result: dict[str, Any]) -> None:
    """The gate's outcome and the measured batch invariance, written into the artifact's manifest."""
    summary = {k: result[k] for k in ("passed", "report_dir", "checks", "metrics", "data", "primary_output",
                                      "wall_time_s")}
    summary["reference"] = {k: result["reference"][k] for k in ("framework", "spec", "model")}
    artifact.manifest.setdefault("validation", {})["gate"] = summary
    batch = result.get("batch_invariance")
    if batch:
        artifact.manifest["validation"]["batch_invariance"] = {
            "invariant": batch["invariant"], "batch_dev": batch["batch_dev"], "bound": batch["bound"],
            "outputs": {name: found["batch_dev"] for name, found in batch["outputs"].items()},
            "batch_sizes": batch["batch_sizes"], "full_batches": batch["full_batches"], "texts": batch["texts"],
            "data": result["data"]["source"], "measured_by": "validate"}
    artifact.record_validation("gate", summary)


def _check(name: str, target, metrics: dict[str, float]) -> dict[str, Any]:
    measured = metrics.get(target.metric)
    ok = measured is not None and bool(np.isfinite(measured)) and target.holds(measured)
    if measured is None:
        message = f"{target.metric} was not measured"
    else:
        message = f"measured {measured:.6g}, needs {target.op} {target.value:.10g}"
    return {"name": name, "metric": target.metric, "op": target.op, "threshold": target.value,
            "measured": measured, "passed": ok, "message": message}

