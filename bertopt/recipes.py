"""Recipes: a source model, a list of stages with parameters, and a ``validate:`` section, in YAML.

    name: minilm-faithful-cpu
    model: builtin:minilm
    stages:
      - export: {opset: 17}
      - optimize: {}
      - quantize: {mode: int8-dynamic, per_channel: true}
    validate:
      targets: cos_min=0.95

Every key is checked: an unknown key or a bad value is an error naming the key and where it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bertopt.errors import UserError
from bertopt.params import resolve_config

RECIPE_KEYS = ("name", "description", "model", "out", "stages", "validate")
DEFAULT_RECIPE = "minilm-faithful-cpu"  # faithful and batch-invariant on every CPU (benchmarks/default_candidates.py)


@dataclass
class Recipe:
    name: str
    model: str
    stages: list[tuple[str, dict[str, Any]]]
    validate: dict[str, Any] | None
    description: str = ""
    out: str | None = None
    path: Path | None = None


@dataclass
class RecipeResult:
    recipe: Recipe
    artifacts: list[Any] = field(default_factory=list)
    comparison: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None

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
    known = sorted(p.stem for p in Path("recipes").glob("*.yaml")) if Path("recipes").is_dir() else []
    raise UserError(f"recipe not found: {name}" + (f" (known: {', '.join(known)})" if known else
                                                    " (give the path of a .yaml recipe)"))


def load_recipe(path: str | os.PathLike) -> Recipe:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UserError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a UTF-8 text file") from None
    return parse_recipe(data, str(path), path)


def parse_recipe(data: Any, where: str, path: Path | None = None) -> Recipe:
    from bertopt.registry import get_stage
    from bertopt.validate.params import VALIDATE_PARAMS

    if not isinstance(data, dict):
        raise UserError(f"{where}: a recipe is a mapping with keys {', '.join(RECIPE_KEYS)}")
    unknown = [k for k in data if k not in RECIPE_KEYS]
    if unknown:
        raise UserError(f"{where}: unknown key '{unknown[0]}'; allowed keys: {', '.join(RECIPE_KEYS)}")
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
            from bertopt.validate.targets import parse_targets

            parse_targets(validate["targets"])
    model = data.get("model", "builtin:minilm")
    name = str(data.get("name") or (path.stem if path else "recipe"))
    return Recipe(name=name, model=str(model), stages=stages, validate=validate,
                  description=str(data.get("description", "")), out=data.get("out"), path=path)


ProgressFn = Callable[[str, int, int], None]


def run_recipe(recipe: Recipe | str | os.PathLike, *, model: str | None = None, out: str | os.PathLike | None = None,
               progress: ProgressFn | None = None, compare: bool = True, gate: bool = True) -> RecipeResult:
    """Run every stage in order (each output folder ``<out>/<NN>-<stage>``), then compare the final artifact
    with the original model on the built-in corpus, and run the recipe's ``validate:`` gate."""
    from bertopt.registry import get_stage, resolve_input

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(find_recipe(recipe))
    source_spec = model or recipe.model
    base = Path(out or recipe.out or Path("artifacts")) / recipe.name
    check_recipe(recipe, base)  # the whole recipe, before its first stage writes anything
    result = RecipeResult(recipe)
    current = resolve_input(source_spec)
    total = len(recipe.stages) + (1 if compare else 0) + (1 if gate and recipe.validate else 0)
    for i, (name, config) in enumerate(recipe.stages):
        if progress:
            progress(f"{name}", i, total)
        stage = get_stage(name)
        current = stage.run(current, config, base / f"{i + 1:02d}-{name}", overwrite=True)
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


def check_recipe(recipe: Recipe, base: Path) -> None:
    """Everything about a recipe that can be wrong before it runs: every file a stage or the gate reads exists,
    each stage's own pre-flight checks pass, and the output folder can be written. A recipe that would fail in
    its third stage fails here instead, leaving nothing behind."""
    from bertopt.errors import check_writable
    from bertopt.params import check_input_files
    from bertopt.registry import get_stage, preflight_stage
    from bertopt.validate.params import VALIDATE_PARAMS

    where = str(recipe.path or recipe.name)
    for i, (name, config) in enumerate(recipe.stages):
        preflight_stage(get_stage(name), config, f"{where}: stages[{i}] {name}")
    if recipe.validate:
        check_input_files(VALIDATE_PARAMS, recipe.validate, f"{where}: validate")
        from bertopt.validate.data import load_texts

        # reading the data now also catches a file with no real text or a missing column
        load_texts(recipe.validate["data"], recipe.validate["text_column"], recipe.validate["text_pair_column"],
                   recipe.validate["label_column"])
    check_writable(base, "--out")

