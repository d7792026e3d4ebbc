"""Accuracy-aware quantisation: keep the most sensitive operators in fp32 until an accuracy target holds.

1. Quantise everything; if the target holds on the calibration text (measured against the fp32 parent artifact),
   that is the result.
2. Otherwise rank every candidate operator (MatMul / Gemm / Gather / fused Attention - a fused Attention node is
   one unit) by sensitivity: quantise it alone, everything else fp32, and measure how far the target metric falls.
3. Keep the worst ones in fp32, one group at a time (``accuracy_group`` operators per step), until the target
   holds or nothing is left to quantise.

The manifest's report lists ``kept_fp32_nodes``, why each was kept (its rank and measured sensitivity), the full
sensitivity table and every search step. The search only looks at the calibration text; the result is then
checked on the built-in corpus (``accuracy_vs_parent``), which the search never saw.

The same search picks fp32 islands for fp16 (``--mode fp16 --accuracy-target ...``): "quantise" means "convert
to fp16" there.

This module is a library the quantisers call (``onnxruntime_int8``, ``openvino_int8``, ``fp16`` in
``bertopt.stages.quantize``): each hands :func:`search` its candidates and a ``build(kept, path)`` that writes
one candidate model; the search never calls a quantiser back. Candidate models run through :mod:`bertopt.runtime`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bertopt.cosine import cosine_rows
from bertopt.errors import UserError
from bertopt.params import Param

# read by the methods that run this search (NNCF's static int8 has its own, ranked one, and refuses it)
ACCURACY_GROUP = Param("accuracy_group", int, 2, "With --accuracy-target: how many of the most sensitive operators "
                       "are kept fp32 per search step (smaller: fewer kept, more steps).", min=1)

ACCURACY_METRICS = ("cos_mean", "cos_p01", "cos_min", "max_abs", "mean_abs", "pass_fraction", "nan_or_inf",
                    "neighbour_agreement_at_10", "top1_agreement", "abs_err_p99")


def accuracy_targets(config, art) -> list:
    """The parsed ``accuracy_target`` of ``config``, checked against ``art``'s outputs and the accuracy metrics."""
    from bertopt.measure.targets import parse_targets

    targets = parse_targets(config["accuracy_target"])
    outputs = art.output_names
    for t in targets:
        output, base, point = t.parts
        if output and output not in outputs:
            raise UserError(f"accuracy target '{t.metric}' names output '{output}', which {art.path} does not have "
                            f"(outputs: {', '.join(outputs)})")
        if point or base not in ACCURACY_METRICS:
            raise UserError(f"accuracy target '{t.metric}' is not an accuracy metric; use one of "
                            f"{', '.join(ACCURACY_METRICS)} (latency is gated by 'bertopt validate')")
    return targets


class Evaluator:
    """Runs candidate model files on the calibration text and compares them with the fp32 parent's outputs, on the
    runtime the result will be served with (ONNX Runtime, or OpenVINO with ``runtime_options``)."""

    def __init__(self, art, texts: list[str], runtime: str = "onnxruntime",
                 runtime_options: dict[str, Any] | None = None, threads: int | None = None):
        from bertopt.runtime import Predictor

        self.art = art
        self.runtime = runtime
        self.threads = threads
        # no blob cache: every candidate is a different model compiled once
        self.runtime_options = {**(runtime_options or {}), "cache": False}
        self.texts = texts
        self.primary = art.primary_output
        self.kinds = art.output_kinds
        self.reference = Predictor(art, provider="cpu", threads=threads, verify=False).run(texts)
        self.evaluations = 0

    def __call__(self, model_path: Path) -> dict[str, float]:
        from bertopt.measure.compare import compare_runs
        from bertopt.runtime import Predictor
        from bertopt.runtime.backends import open_model

        session = open_model(Path(model_path), runtime=self.runtime, runtime_options=self.runtime_options,
                             provider="cpu", threads=self.threads)
        predictor = Predictor(self.art, session=session, verify=False)
        got = predictor.run(self.texts)
        self.evaluations += 1
        stats = compare_runs(got, self.reference, self.kinds)
        metrics: dict[str, float] = {}
        if not isinstance(got[self.primary], list):
            # the ranking signal: mean cosine distance over the worst 10% of texts - tail-focused like cos_min,
            # but far less noisy than a single text's value when one operator is quantised alone
            dist = np.sort(1.0 - cosine_rows(got[self.primary], self.reference[self.primary]))[::-1]
            metrics["tail_cos_distance"] = float(dist[: max(1, len(dist) // 10)].mean())
        for name, s in stats.items():
            for key, value in s.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"{name}.{key}"] = float(value)
                    if name == self.primary:
                        metrics[key] = float(value)
        return metrics


def _holds(targets, metrics) -> bool:
    return all(t.metric in metrics and np.isfinite(metrics[t.metric]) and t.holds(metrics[t.metric])
               for t in targets)


def _badness(targets, metrics) -> float:
    """How far a candidate's metrics fall from perfect, in units of each target's allowed gap (worst target)."""
    worst = 0.0
    for t in targets:
        value = metrics.get(t.metric, float("nan"))
        if not np.isfinite(value):
            return float("inf")
        perfect = 1.0 if t.op == ">=" else 0.0
        gap = abs(perfect - t.value) or 1e-12
        worst = max(worst, abs(perfect - value) / gap)
    return worst


def node_costs(model, names: list[str]) -> dict[str, float]:
    """What keeping a node fp32 costs, as its weight count (MatMul/Gemm/Attention compute scales with it); nodes
    without weights (attention scores in static QDQ) count as the median weighted node."""
    sizes = {i.name: int(np.prod(i.dims)) if len(i.dims) else 1 for i in model.graph.initializer}
    costs = {n.name: float(sum(sizes.get(i, 0) for i in n.input if sizes.get(i, 0) > 1))
             for n in model.graph.node if n.name in names}
    positive = [c for c in costs.values() if c > 0]
    fallback = float(np.median(positive)) if positive else 1.0
    return {n: (costs.get(n) or fallback) for n in names}


def greedy_fallback(candidates: list[tuple[str, str]], build: Callable[[list[str], Path], None],
                    evaluate: Callable[[Path], dict[str, float]], targets, group: int, workdir: Path,
                    progress: Callable[[str], None] | None = None,
                    costs: dict[str, float] | None = None) -> dict[str, Any]:
    """The search. ``candidates`` are (node name, op type); ``build(excluded, path)`` writes a model with the
    ``excluded`` candidates kept fp32. Candidates are ranked by sensitivity per unit of ``costs`` (weight count),
    so a cheap sensitive operator goes back to fp32 before an expensive one that helps as much. Returns the chosen
    model path, what was kept and the evidence."""
    say = progress or (lambda text: None)
    names = [n for n, _ in candidates]
    op_of = dict(candidates)
    steps = []
    t0 = time.perf_counter()

    def attempt(kept: list[str], label: str) -> tuple[Path, dict[str, float]]:
        path = workdir / f"step{len(steps)}.onnx"
        build(kept, path)
        metrics = evaluate(path)
        steps.append({"kept_fp32": len(kept), "label": label, "holds": _holds(targets, metrics),
                      **{t.metric: metrics.get(t.metric) for t in targets}, "cos_mean": metrics.get("cos_mean")})
        return path, metrics

    say("quantising every candidate")
    path, metrics = attempt([], "all quantised")
    sensitivity: list[dict[str, Any]] = []
    kept: list[str] = []
    if not _holds(targets, metrics):
        for i, name in enumerate(names):
            say(f"sensitivity {i + 1}/{len(names)}: {name}")
            single = workdir / "single.onnx"
            build([n for n in names if n != name], single)
            m = evaluate(single)
            signal = m.get("tail_cos_distance")
            score = float(signal) if signal is not None else _badness(targets, m)
            cost = (costs or {}).get(name, 1.0)
            sensitivity.append({"node": name, "op_type": op_of[name], "sensitivity": score,
                                "weights": cost, "score": score / (cost / 1e6),
                                "target_badness": _badness(targets, m),
                                **{t.metric: m.get(t.metric) for t in targets}, "cos_mean": m.get("cos_mean")})
        # most sensitive per weight first; ties by lower cosine mean, then graph order (stable sort)
        sensitivity.sort(key=lambda r: (-r["score"], r.get("cos_mean") or 0.0))
        for rank, row in enumerate(sensitivity, 1):
            row["rank"] = rank
        order = [r["node"] for r in sensitivity]
        while not _holds(targets, metrics) and len(kept) < len(order):
            kept = order[: len(kept) + group]
            say(f"keeping {len(kept)} of {len(order)} in fp32")
            path, metrics = attempt(kept, f"{len(kept)} most sensitive kept fp32")
    if not _holds(targets, metrics):
        shown = ", ".join(f"{t.metric} {metrics.get(t.metric, float('nan')):.6g}" for t in targets)
        raise UserError(f"accuracy target '{', '.join(map(str, targets))}' is not met even with every candidate "
                        f"kept in fp32 (measured {shown}); relax the target")
    by_node = {r["node"]: r for r in sensitivity}
    kept_rows = [{"node": n, "op_type": op_of[n], "rank": by_node[n]["rank"], "score": by_node[n]["score"],
                  "reason": f"rank {by_node[n]['rank']} of {len(names)} by sensitivity per weight: quantised alone "
                  "it gives " + ", ".join(f"{t.metric} {by_node[n].get(t.metric, float('nan')):.6g}" for t in targets)}
                 for n in kept]
    return {"model": path, "kept": kept, "kept_rows": kept_rows, "metrics": metrics, "sensitivity": sensitivity,
            "steps": steps, "candidates": len(names), "search_s": round(time.perf_counter() - t0, 1)}


def search(art, config: dict[str, Any], targets, texts: list[str], candidates: list[tuple[str, str]],
           build: Callable[[list[str], Path], None], workdir: Path, costs: dict[str, float] | None = None,
           runtime: str = "onnxruntime", runtime_options: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """Run the search for ``art`` on the calibration ``texts``, candidate models measured on ``runtime``; returns
    (the result of :func:`greedy_fallback`, the manifest's ``accuracy_search`` section)."""
    evaluator = Evaluator(art, texts, runtime=runtime, runtime_options=runtime_options, threads=config.get("threads"))
    result = greedy_fallback(candidates, build, evaluator, targets, config["accuracy_group"], workdir, costs=costs)
    return result, _search_report(config, targets, texts, result, evaluator)


def _search_report(config, targets, texts, result, evaluator) -> dict[str, Any]:
    return {"target": ", ".join(map(str, targets)), "measured_on": f"calibration text ({len(texts)} texts) vs the "
            "fp32 parent", "candidates": result["candidates"], "group": config["accuracy_group"],
            "evaluations": evaluator.evaluations, "search_s": result["search_s"],
            "final_calibration_metrics": {t.metric: result["metrics"].get(t.metric) for t in targets},
            "kept_fp32": result["kept_rows"], "sensitivity": result["sensitivity"], "steps": result["steps"]}
