"""Stage registry: the CLI, recipes and the Python API reach a stage by name, the same way.

Stage modules are imported lazily so ``bertopt --help`` never imports onnx, torch or tensorflow.
A stage module defines ``NAME``, ``HELP``, ``PARAMS`` (list[Param]) and
``run(input, config, out_dir, overwrite=False) -> Artifact``; heavy imports live inside ``run``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from bertopt.errors import UserError
from bertopt.params import resolve_config
from bertopt.plugins import LazyModules

STAGE_MODULES = {
    "export": "bertopt.stages.export",
    "freeze": "bertopt.stages.freeze",
    "prune": "bertopt.stages.prune",
    "optimize": "bertopt.stages.optimize",
    "quantize": "bertopt.stages.quantize.stage",
    "compile": "bertopt.stages.compile",
}


_STAGES = LazyModules("stage", STAGE_MODULES)


def stage_names() -> list[str]:
    return _STAGES.names()


def get_stage(name: str) -> ModuleType:
    return _STAGES.get(name)


def resolve_input(value: Any):
    """An Artifact stays an Artifact; a path to an artifact folder is loaded; anything else is a source."""
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.sources import Source, resolve_source

    if isinstance(value, (Artifact, Source)):
        return value
    if isinstance(value, (str, os.PathLike)) and is_artifact(Path(value)):
        return Artifact.load(value)
    return resolve_source(str(value))


def preflight_stage(stage: ModuleType, config: dict[str, Any], where: str) -> None:
    """A stage's model-free checks (input files named by its parameters, its own ``preflight``)."""
    from bertopt.params import check_input_files

    check_input_files(stage.PARAMS, config, where)
    if hasattr(stage, "preflight"):
        stage.preflight(config, where)


def input_paths(value: Any) -> list:
    """The local paths a stage input reads (an artifact's folder, a source model's file or folder), for the
    output-path policy; a built-in model (in bertopt's cache) reads nothing of the user's."""
    from bertopt.artifact import Artifact
    from bertopt.sources import Source

    if isinstance(value, Artifact):
        return [value.path]
    if isinstance(value, Source):
        return [] if str(value.spec).startswith("builtin:") else [value.path]
    text = str(value)
    return [] if text.startswith("builtin:") or "://" in text else [text]


def run_stage(name: str, input: Any, config: dict[str, Any] | None, out_dir: str | os.PathLike,
              overwrite: bool = False):
    """Run one stage by name: resolve the input, check the config and the output path (``output_paths``), and
    write a new artifact, holding the output's lock from the first check to the rename."""
    from collections.abc import Mapping

    from bertopt.output_paths import check_output, output_lock

    stage = get_stage(name)
    if config is not None and not isinstance(config, Mapping):
        raise UserError(f"stage '{name}': config must be a mapping of parameter names to values (e.g. "
                        f"{{'mode': 'fp16'}}), got {type(config).__name__}")
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise UserError(f"stage '{name}': out_dir must be the path of the folder to write, got {out_dir!r:.40}")
    if not isinstance(overwrite, bool):
        raise UserError(f"stage '{name}': overwrite must be True or False, got {overwrite!r:.40}")
    cfg = resolve_config(stage.PARAMS, config, where=f"stage '{name}'")
    preflight_stage(stage, cfg, f"stage '{name}'")
    check_output(out_dir, kind="artifact", inputs=input_paths(input), replace=overwrite)
    with output_lock(out_dir):
        return stage.run(resolve_input(input), cfg, Path(out_dir), overwrite=overwrite)
