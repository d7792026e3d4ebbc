"""Which models one ``bertopt serve`` fleet serves: ``bertopt serve ART1 ART2 ...`` (``NAME=PATH`` names one; the
default name is the artifact's folder name) or ``--models fleet.yaml``::

    models:
      embed: artifacts/minilm/03-quantize          # name: artifact folder (relative to this file)
      rerank:
        artifact: artifacts/ms-marco/03-quantize
        workers: 1                                 # default: --num-worker
        threads: 1                                 # default: the cores split over every worker of the fleet

Every model gets worker processes of its own (one runtime session each) and queues of its own in the ventilator;
the first model is the default of ZeroMQ clients, and the first model of a task the default of that task's HTTP
route. Pure parsing, no model is opened here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import MAX_THREADS, MAX_WORKERS
from bertopt.untrusted import load_yaml_bounded, read_user_file

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its name (the OpenAI ``model`` field, TEI's ``model``, ZeroMQ's model frame), its artifact
    folder, and optionally its own worker count and threads per worker."""

    name: str
    artifact: str
    num_worker: int | None = None
    threads: int | None = None


def check_name(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise UserError(f"{where}: model name {name!r} must be 1-128 letters, digits or ._:/- (starting with a "
                        "letter or digit); name it with NAME=PATH")
    return name


def spec_from_arg(arg: str) -> ModelSpec:
    """``PATH`` (named after its folder) or ``NAME=PATH``."""
    name, sep, path = arg.partition("=")
    if not sep or Path(arg).exists():  # a folder whose name holds "=" is a path
        path = arg
        name = Path(arg.rstrip("/")).resolve().name or arg
    elif not path:
        raise UserError(f"ARTIFACT {arg!r} names no folder; write NAME=PATH")
    return ModelSpec(check_name(name, "ARTIFACT"), path)


def _count(value: Any, key: str, where: str) -> int | None:
    if value is None:
        return None
    most = MAX_WORKERS if key == "workers" else MAX_THREADS
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise UserError(f"{where}: '{key}' must be a whole number from 1 to {most}, got {value!r:.40}")
    return value


MAX_FLEET_FILE_BYTES = 1 << 20  # a fleet file names a few models


def read_models_file(path: str) -> list[ModelSpec]:
    """The models of a YAML fleet file (see the module's doc); relative artifact paths are read from the file's
    folder. Every problem is one line naming the file and the entry."""
    file = Path(path)
    text = read_user_file(file, max_bytes=MAX_FLEET_FILE_BYTES, what="fleet file",
                          fix="give a YAML file listing name -> artifact (docs/serving.md)")
    data = load_yaml_bounded(text, f"--models {path}", "a fleet file")
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise UserError(f"--models {path}: expected a 'models:' mapping of name -> artifact (or name -> {{artifact, "
                        "workers, threads})")
    specs = []
    for name, entry in models.items():
        where = f"--models {path}: model {name!r}"
        check_name(str(name), f"--models {path}")
        if isinstance(entry, str):
            entry = {"artifact": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("artifact"), str):
            raise UserError(f"{where} needs an 'artifact' folder (name: PATH, or name: {{artifact: PATH}})")
        unknown = sorted(set(entry) - {"artifact", "workers", "threads"})
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; use artifact, workers, threads")
        artifact = Path(entry["artifact"]).expanduser()
        if not artifact.is_absolute():
            artifact = file.parent / artifact
        specs.append(ModelSpec(str(name), str(artifact), _count(entry.get("workers"), "workers", where),
                               _count(entry.get("threads"), "threads", where)))
    return specs


def model_specs(artifacts: list[str] | None, models_file: str | None) -> list[ModelSpec]:
    """The fleet from the command line: positional artifacts, then the YAML file's models; names must differ."""
    specs = [spec_from_arg(a) for a in artifacts or []]
    if models_file:
        specs += read_models_file(models_file)
    if not specs:
        raise UserError("missing ARTIFACT; give the artifact folder(s) to serve or --models FILE (or --status to "
                        "query a server)")
    check_unique(specs)
    return specs


def check_unique(specs: list[ModelSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise UserError(f"two models are named {s.name!r}; name them apart with NAME=PATH (or in --models)")
        seen.add(s.name)
