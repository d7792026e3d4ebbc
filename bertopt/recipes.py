"""Recipes: a source model, a list of stages with parameters, and a ``validate:`` section, in YAML.

    name: minilm-faithful-cpu
    model: builtin:minilm
    stages:
      - export: {opset: 17}
      - optimize: {}
      - quantize: {mode: int8-dynamic, per_channel: true}
    validate:
      targets: cos_min=0.95

Instead of ``stages:`` a recipe may say ``tune:`` (the parameters of ``bertopt tune``): every candidate that makes
sense on the machine is built, gated and timed, and the fastest that passes is the recipe's artifact
(``<out>/<name>``, its report in ``<out>/<name>-report``); tune gates every candidate itself, so such a recipe
has no ``validate:``.

    name: minilm-tuned
    model: builtin:minilm
    tune: {time_budget: 4m}

Every key is checked: an unknown key or a bad value is an error naming the key and where it is. ``name`` is a
plain name (it names the folder ``OUT/<name>``); ``out`` is the default for ``--out`` (relative to the current
folder). The file is read with limits (1 MiB, 64 levels, 100,000 values once YAML aliases are expanded), so a
"billion laughs" file is one line, not a MemoryError. Before the first stage runs, every folder the recipe will
write is checked (``check_recipe_outputs``): absent or bertopt's own output of that kind, and not the model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bertopt.errors import UserError
from bertopt.params import resolve_config
from bertopt.untrusted import load_yaml_bounded, read_user_file

RECIPE_KEYS = ("name", "description", "model", "out", "stages", "validate", "tune")
DEFAULT_RECIPE = "minilm-tuned"  # the fastest artifact that passes the gate on the machine it runs on (bertopt tune)


@dataclass
class Recipe:
    name: str
    model: str
    stages: list[tuple[str, dict[str, Any]]]
    validate: dict[str, Any] | None
    description: str = ""
    out: str | None = None
    path: Path | None = None
    tune: dict[str, Any] | None = None  # a tune recipe: bertopt tune's parameters instead of stages


@dataclass
class RecipeResult:
    recipe: Recipe
    artifacts: list[Any] = field(default_factory=list)
    comparison: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None
    tune: Any = None  # a tune recipe's TuneResult

    @property
    def final(self):
        return self.artifacts[-1]


def find_recipe(name_or_path: str | os.PathLike | None) -> Path:
    """A recipe path, or a bare name looked up in ./recipes/ (``minilm-fp16`` -> recipes/minilm-fp16.yaml)."""
    name = str(name_or_path or DEFAULT_RECIPE)
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (Path("recipes") / name, Path("recipes") / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    if os.path.lexists(path):  # there, but a folder, a FIFO or a device: named for what it is
        what = "a folder" if path.is_dir() else "not a regular file"
        raise UserError(f"recipe {name} is {what}; give the path of a .yaml recipe")
    known = sorted(p.stem for p in Path("recipes").glob("*.yaml")) if Path("recipes").is_dir() else []
    raise UserError(f"recipe not found: {name}" + (f" (known: {', '.join(known)})" if known else
                                                    " (give the path of a .yaml recipe)"))


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few hundred bytes; anything near this is not one


def load_recipe(path: str | os.PathLike) -> Recipe:
    path = Path(path)
    text = read_user_file(path, max_bytes=MAX_RECIPE_BYTES, what="recipe",
                          fix="give the path of a .yaml recipe (a few lines of YAML)")
    return parse_recipe(load_yaml_bounded(text, str(path), "a recipe"), str(path), path)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def check_plain_name(name: str, where: str) -> str:
    """A recipe name becomes a folder under --out: one plain path component (no '/', '..', absolute path)."""
    if not _PLAIN_NAME.fullmatch(name) or ".." in name or len(name) > 128:
        raise UserError(f"{where}: 'name' {name!r} must be a plain name (letters, digits, '_', '-', '.', '+'; no "
                        "'/', '..' or absolute path), since it names the folder the recipe writes under --out")
    return name


def parse_recipe(data: Any, where: str, path: Path | None = None) -> Recipe:
    from bertopt.registry import get_stage
    from bertopt.validate.params import VALIDATE_PARAMS

    if not isinstance(data, dict):
        raise UserError(f"{where}: a recipe is a mapping with keys {', '.join(RECIPE_KEYS)}")
    unknown = [k for k in data if k not in RECIPE_KEYS]
    if unknown:
        raise UserError(f"{where}: unknown key '{unknown[0]}'; allowed keys: {', '.join(RECIPE_KEYS)}")
    if "tune" in data:
        return _parse_tune_recipe(data, where, path)
    if "stages" not in data or not isinstance(data["stages"], list) or not data["stages"]:
        raise UserError(f"{where}: 'stages' must be a non-empty list like "
                        "[{export: {}}, {quantize: {mode: fp16}}]")
    stages = []
    for i, entry in enumerate(data["stages"]):
        if isinstance(entry, str):
            entry = {entry: {}}
        if not isinstance(entry, dict) or len(entry) != 1:
            raise UserError(f"{where}: stages[{i}] must be a mapping of one stage name to its parameters")
        (name, params), = entry.items()
        stage = get_stage(str(name))
        if params is not None and not isinstance(params, dict):
            raise UserError(f"{where}: stages[{i}] {name}: parameters must be a mapping, got {params!r}")
        stages.append((str(name), resolve_config(stage.PARAMS, params, f"{where}: stages[{i}] {name}")))
    validate = data.get("validate")
    if validate is not None:
        if not isinstance(validate, dict):
            raise UserError(f"{where}: 'validate' must be a mapping")
        validate = dict(validate)
        if isinstance(validate.get("targets"), dict):  # targets may be written as a mapping too
            validate["targets"] = ",".join(f"{k}={v}" for k, v in validate["targets"].items())
        validate = resolve_config(VALIDATE_PARAMS, validate, f"{where}: validate")
        if validate.get("targets"):
            from bertopt.measure.targets import parse_targets

            parse_targets(validate["targets"])
    name, model, out = _name_model_out(data, where, path)
    return Recipe(name=name, model=model, stages=stages, validate=validate,
                  description=str(data.get("description", "")), out=out, path=path)


def _name_model_out(data: dict, where: str, path: Path | None) -> tuple[str, str, Any]:
    """The keys every recipe has, checked: ``name`` a plain name (it names ``OUT/<name>``), ``model`` a model
    spec, ``out`` a folder path."""
    model = data.get("model", "builtin:minilm")
    if not isinstance(model, str) or not model.strip():
        raise UserError(f"{where}: 'model' must be a model path or builtin:NAME, got {model!r:.60}")
    name = check_plain_name(str(data.get("name") or (path.stem if path else "recipe")), where)
    out = data.get("out")
    if out is not None and (not isinstance(out, str) or not out.strip()):
        raise UserError(f"{where}: 'out' must be a folder path (the default for --out), got {out!r:.60}")
    return name, model, out


def _parse_tune_recipe(data: dict, where: str, path: Path | None) -> Recipe:
    from bertopt.tune import TUNE_PARAMS

    for key in ("stages", "validate"):
        if key in data:
            raise UserError(f"{where}: a recipe with 'tune' has no '{key}' (tune builds and gates its own "
                            "candidates); drop one of them")
    tune = data["tune"] if data["tune"] is not None else {}
    if not isinstance(tune, dict):
        raise UserError(f"{where}: 'tune' must be a mapping of tune parameters, e.g. {{time_budget: 5m}}")
    tune = dict(tune)
    if isinstance(tune.get("targets"), dict):  # targets may be written as a mapping too
        tune["targets"] = ",".join(f"{k}={v}" for k, v in tune["targets"].items())
    name, model, out = _name_model_out(data, where, path)
    return Recipe(name=name, model=model, stages=[], validate=None,
                  description=str(data.get("description", "")), out=out, path=path,
                  tune=resolve_config(TUNE_PARAMS, tune, f"{where}: tune"))


ProgressFn = Callable[[str, int, int], None]


def run_recipe(recipe: Recipe | str | os.PathLike, *, model: str | None = None, out: str | os.PathLike | None = None,
               progress: ProgressFn | None = None, compare: bool = True, gate: bool = True,
               say: Callable[[str], None] | None = None) -> RecipeResult:
    """Run every stage in order (each output folder ``<out>/<name>/<NN>-<stage>``; ``out``: the argument, else
    the recipe's ``out:``, else ``artifacts``), then compare the final artifact with the original model on the
    built-in corpus, and run the recipe's ``validate:`` gate. A ``tune:`` recipe runs ``bertopt tune`` instead
    (its artifact ``<out>/<name>``; it always gates, ``compare``/``gate`` aside)."""
    from bertopt.output_paths import output_lock, replaced_together
    from bertopt.registry import get_stage, resolve_input

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(find_recipe(recipe))
    source_spec = model or recipe.model
    base = recipe_base(recipe, out)
    check_recipe(recipe, base, model=source_spec)  # the whole recipe, before its first stage writes anything
    result = RecipeResult(recipe)
    if recipe.tune is not None:
        from bertopt.tune import run_tune

        # outside the recipe's lock: tune's own artifact writer takes the lock on <out>/<name>
        result.tune = run_tune(source_spec, base, recipe.tune, overwrite=True, say=say, progress=progress)
        result.artifacts.append(result.tune.artifact)
        return result
    total = len(recipe.stages) + (1 if compare else 0) + (1 if gate and recipe.validate else 0)
    # what this run writes, each checked by check_recipe_outputs to be absent or bertopt's own output
    outputs = [stage_folder(base, i, name) for i, (name, _) in enumerate(recipe.stages)]
    if recipe.validate:
        outputs.append(base / "validation")
    with output_lock(base):  # one recipe run writes under this folder at a time
        check_recipe_outputs(recipe, base, source_spec)  # again, now that nobody else can write there
        # each stage folder names its parent: a run that stops half-way puts the earlier run's folders back
        with replaced_together(base, outputs):
            current = resolve_input(source_spec)
            for i, (name, config) in enumerate(recipe.stages):
                if progress:
                    progress(f"{name}", i, total)
                stage = get_stage(name)
                current = stage.run(current, config, stage_folder(base, i, name), overwrite=True)
                result.artifacts.append(current)
            if compare:
                if progress:
                    progress("compare with the original", len(recipe.stages), total)
                from bertopt.validate.quick import compare_with_original

                result.comparison = compare_with_original(result.final)
                result.final.record_validation("run", result.comparison)
            if gate and recipe.validate:
                if progress:
                    progress("validate (gate)", total - 1, total)
                from bertopt.validate.gate import validate_artifact

                result.validation = validate_artifact(result.final, recipe.validate,
                                                      report_dir=base / "validation", raise_on_fail=False)
    if progress:
        progress("done", total, total)
    return result


def recipe_base(recipe: Recipe, out: str | os.PathLike | None = None) -> Path:
    """The folder a recipe run writes under: ``OUT/<recipe name>`` (the name is a plain name: parse_recipe)."""
    return Path(out or recipe.out or "artifacts") / check_plain_name(recipe.name, str(recipe.path or recipe.name))


def stage_folder(base: Path, index: int, name: str) -> Path:
    return base / f"{index + 1:02d}-{name}"


def check_recipe_outputs(recipe: Recipe, base: Path, model: str) -> None:
    """Every folder the recipe will write, checked before the first stage: each stage folder and the report
    folder are absent, or bertopt's own output of that kind (replaced: a recipe re-runs in place); none is or
    holds the model it reads. A later stage's folder holding user files fails here, not after the earlier
    stages were written."""
    from bertopt.errors import check_writable
    from bertopt.output_paths import check_not_input, check_output
    from bertopt.registry import input_paths

    where = str(recipe.path or recipe.name)
    inputs = input_paths(model)
    if base.exists() and not base.is_dir():
        raise UserError(f"{where}: --out {base.parent}: {base} is a file, so the recipe's folder cannot be made "
                        "there; choose another --out")
    check_writable(check_not_input(base, inputs), "--out")
    for i, (name, _) in enumerate(recipe.stages):
        check_output(stage_folder(base, i, name), kind="artifact", inputs=inputs, replace=True)
    if recipe.validate:
        check_output(base / "validation", kind="report", inputs=inputs, replace=True, flag="--report-dir")


def check_recipe(recipe: Recipe, base: Path, model: str | None = None) -> None:
    """Everything about a recipe that can be wrong before it runs: every file a stage or the gate reads exists,
    each stage's own pre-flight checks pass, and every output folder can be written. A recipe that would fail in
    its third stage fails here instead, leaving nothing behind."""
    from bertopt.params import check_input_files
    from bertopt.registry import get_stage, preflight_stage
    from bertopt.validate.params import VALIDATE_PARAMS

    where = str(recipe.path or recipe.name)
    for i, (name, config) in enumerate(recipe.stages):
        preflight_stage(get_stage(name), config, f"{where}: stages[{i}] {name}")
    if recipe.tune:
        from bertopt.tune import TUNE_PARAMS

        check_input_files(TUNE_PARAMS, recipe.tune, f"{where}: tune")
    if recipe.validate:
        check_input_files(VALIDATE_PARAMS, recipe.validate, f"{where}: validate")
        from bertopt.measure.data import load_texts

        # reading the data now also catches a file with no real text or a missing column
        load_texts(recipe.validate["data"], recipe.validate["text_column"], recipe.validate["text_pair_column"],
                   recipe.validate["label_column"])
    check_recipe_outputs(recipe, base, model or recipe.model)
