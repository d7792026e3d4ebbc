"""What several stages share: checking the staged (not yet renamed) artifact against its parent."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Callable

from bertopt.artifact import Artifact
from bertopt.extensions import load_extensions
from bertopt.plugins import Registry

# "stage:model format" -> the stage's implementation for that format, registered by the part that knows the
# format (bertopt.tf registers TensorFlow graphs and models), so stages/ never imports it
_FORMAT_HANDLERS: Registry[Callable] = Registry("format handler", load=load_extensions)


def register_format_handler(stage: str, *formats: str):
    return _FORMAT_HANDLERS.register(*(f"{stage}:{model_format}" for model_format in formats))


def format_handler(stage: str, model_format: str) -> Callable | None:
    """The registered implementation of ``stage`` for ``model_format``, or None."""
    return _FORMAT_HANDLERS.find(f"{stage}:{model_format}")


def check_against(writer, reference: Artifact, texts: list[str], outputs: list[str] | None = None,
                  threads: int | None = None) -> dict[str, Any]:
    """Run ``texts`` through the staged model and ``reference``; return per-output accuracy stats."""
    from bertopt.measure.compare import compare_runs
    from bertopt.runtime import Predictor

    new = Predictor(writer.staged(), provider="cpu", threads=threads)
    names = outputs or [o for o in new.output_names if o in reference.output_names]
    got, ref = new.run(texts, outputs=names), parent_outputs(reference, texts, names, threads=threads)
    stats = compare_runs(got, ref, reference.output_kinds)
    notes = fidelity_notes(stats, writer.stage)
    if notes:
        writer.report.setdefault("notes", []).extend(notes)
    return stats


# A parent's outputs on a check's texts, kept for the process: tune compiles and quantises one parent into several
# candidates, and each stage's check ran that parent on the same corpus again (real MPNet: 24 s a check on one
# thread). Keyed by all that decides the values: the parent's files (its digest), how it runs (runtime, options),
# threads, outputs and texts. A few runs only: a candidate's stages share one parent.
_PARENT_RUNS: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
PARENT_RUNS_KEPT = 2


def parent_outputs(parent: Artifact, texts: list[str], names: list[str], threads: int | None = None,
                   provider: str = "cpu") -> dict[str, Any]:
    """``parent`` run on ``texts`` (outputs ``names``) on ``provider``, once per process for the same inputs."""
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads

    key = (str(parent.path.resolve()), parent.digest, parent.runtime,
           json.dumps(parent.manifest.get("runtime_options") or {}, sort_keys=True), provider,
           threads or default_threads(), tuple(names), hashlib.sha256("\0".join(texts).encode()).hexdigest(),
           len(texts))
    if key in _PARENT_RUNS:
        _PARENT_RUNS.move_to_end(key)
        return _PARENT_RUNS[key]
    runs = Predictor(parent, provider=provider, threads=threads, verify=False).run(texts, outputs=names)
    _PARENT_RUNS[key] = runs
    while len(_PARENT_RUNS) > PARENT_RUNS_KEPT:
        _PARENT_RUNS.popitem(last=False)
    return runs


# below this mean cosine to its input a stage's output no longer computes the same function (a working int8 of a
# trained model stays above 0.99); the artifact is still written, since validate is the gate, but the user is told
FIDELITY_WARNING_COS_MEAN = 0.9


def fidelity_notes(stats: dict[str, dict], stage: str) -> list[str]:
    """Notes for outputs a stage broke (cosine mean to its input below ``FIDELITY_WARNING_COS_MEAN``)."""
    hint = {"quantize": "; for ONNX Runtime int8 try --per-token (one activation scale per token) or "
                        "--runtime openvino"}.get(stage, "")
    return [f"{name} differs from the input model (cos mean {s['cos_mean']:.3f}, min {s['cos_min']:.3f}): this "
            f"artifact will not pass 'bertopt validate'{hint}"
            for name, s in stats.items() if s.get("cos_mean", 1.0) < FIDELITY_WARNING_COS_MEAN]


def worst_abs_diff(stats: dict[str, dict]) -> float:
    return max((s.get("max_abs", float("inf")) for s in stats.values()), default=0.0)


def require_onnx_artifact(input, stage: str) -> Artifact:
    from bertopt.errors import UserError

    if not isinstance(input, Artifact):
        raise UserError(f"{stage} takes a bertopt artifact; turn {input.path} into one first with "
                        f"'bertopt export {input.spec} --out DIR'")
    if input.model_format == "openvino-ir" and stage != "compile":
        raise UserError(f"{stage} cannot take {input.path}: it is an OpenVINO IR (static int8, the last stage of a "
                        f"chain); run {stage} on the ONNX artifact it was quantised from, then quantise again")
    return input


def settle_static_full_batch(writer, setting: str, threads: int | None = None) -> None:
    """An OpenVINO artifact's ``static_full_batch`` runtime option: decided (``auto``: measured on the staged model,
    ``bertopt.runtime.openvino_backend.static_full_batch_choice``) and recorded with what it rests on in the stage's
    report. Call after ``set_model``, before the stage's own check runs the staged model."""
    from bertopt.params import BATCH_SIZE
    from bertopt.runtime.openvino_backend import static_full_batch_choice

    found = static_full_batch_choice(writer.staged().model_handle(), setting, BATCH_SIZE.default, threads)
    writer.extra["runtime_options"] = {**writer.extra.get("runtime_options", {}), "static_full_batch": found["on"]}
    writer.report["static_full_batch"] = found
