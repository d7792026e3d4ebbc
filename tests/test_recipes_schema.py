"""Recipe files: every key checked, errors name the key and where it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from bertopt.errors import UserError
from bertopt.recipes import load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_are_valid(path):
    recipe = load_recipe(path)
    assert (recipe.stages or recipe.tune is not None) and recipe.name == path.stem


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, message", [
    ("model: builtin:minilm\nstages: [export]\nmodle: x\n", "unknown key 'modle'"),
    ("stages:\n  - quantize: {mode: int4}\n", r"stages\[0\] quantize: 'mode' must be one of"),
    ("stages:\n  - export: {}\n  - quantize: {bits: 8}\n", r"stages\[1\] quantize: unknown parameter 'bits'"),
    ("stages:\n  - export: {}\n  - quantize: {mode: int8-static, per_token: true}\n",
     r"stages\[1\] quantize: --per-token applies to --mode int8-dynamic only \(ONNX Runtime dynamic int8\), not to "
     r"--mode int8-static \(ONNX Runtime static int8\); drop --per-token"),
    ("stages:\n  - distill: {}\n", "unknown stage 'distill'"),
    ("stages: []\n", "'stages' must be a non-empty list"),
    ("stages: [export]\nvalidate: {treshold: 1}\n", "validate: unknown parameter 'treshold'"),
    ("stages: [export]\nvalidate: {targets: 'cos_min=high'}\n", "cannot read target"),
    # the latency grid is checked with the recipe, before its first stage writes anything
    ("stages: [export]\nvalidate: {seq_lens: ['0']}\n", "validate: 'seq_lens' values must be at least 1, got 0"),
    ("stages: [export]\nvalidate: {batch_sizes: [a]}\n", "validate: 'batch_sizes' takes whole numbers like 1,32"),
    ("stages: [export]\nvalidate: {batch_sizes: [1.5]}\n", "validate: 'batch_sizes' takes whole numbers"),
    ("stages: [export]\nvalidate: {targets: ','}\n", "',' names no target"),
    # a list where a name goes was turned into the text "['x']"
    ("model: builtin:minilm\ntune: {text_column: [x]}\n", r"tune: 'text_column' must be str, got \['x'\]"),
    ("stages:\n  - export: {opset: 11}\n", "'opset' must be between 17 and 21"),
    ("stages: [export\n", "not valid YAML"),
    ("tune: {time_budget: 5m}\nstages: [export]\n", "a recipe with 'tune' has no 'stages'"),
    ("tune: {time_budget: 5m}\nvalidate: {targets: cos_min=0.99}\n", "a recipe with 'tune' has no 'validate'"),
    ("tune: {time_budget: soon}\n", "tune: 'time_budget' is not a duration"),
    ("tune: {candidates: [openvino-int4]}\n", "tune: 'candidates' names unknown candidate 'openvino-int4'"),
    ("tune: {rounds: 0}\n", "tune: 'rounds' must be at least 1"),
    ("tune: [time_budget]\n", "'tune' must be a mapping"),
])
def test_bad_recipes_name_the_problem(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load_recipe(_write(tmp_path, text))


def test_targets_may_be_a_mapping(tmp_path):
    r = load_recipe(_write(tmp_path, "stages: [export]\nvalidate:\n  targets: {cos_min: 0.99, max_abs: 0.1}\n"))
    assert r.validate["targets"] == "cos_min=0.99,max_abs=0.1"


def test_list_parameters_are_checked_too():
    from bertopt.params import Param, resolve_config

    p = Param("outputs", list, None, "x", check=lambda v: None if "a" in v else "must include a")
    assert resolve_config([p], {"outputs": "a,b"}, "t") == {"outputs": ["a", "b"]}
    with pytest.raises(UserError, match="'outputs' must include a"):
        resolve_config([p], {"outputs": ["b"]}, "t")


def test_anchors_and_aliases_within_bounds_still_work(tmp_path):
    r = load_recipe(_write(tmp_path, "stages:\n  - export: &e {opset: 18}\n  - optimize: {}\n  - export: *e\n"))
    assert [name for name, _ in r.stages] == ["export", "optimize", "export"]
    assert r.stages[0][1]["opset"] == r.stages[2][1]["opset"] == 18


@pytest.mark.parametrize("text, message", [
    ("name: ../x\nstages: [export]\n", "'name' '../x' must be a plain name"),
    ("name: /abs/x\nstages: [export]\n", "must be a plain name"),
    ("name: a/b\nstages: [export]\n", "must be a plain name"),
    ("name: ..\nstages: [export]\n", "must be a plain name"),
    ("out: 3\nstages: [export]\n", "'out' must be a folder path"),
    ("model: [a]\nstages: [export]\n", "'model' must be a model path"),
    ("a: &a [*a]\nstages: [export]\n", "refers to itself"),
    ("stages: " + "[" * 100 + "]" * 100 + "\n", "nests more than 64 levels"),
    ("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 12)) + "stages: [export]\n",
     "expands to more than 100000 values"),
])
def test_recipe_names_out_and_yaml_bounds(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load_recipe(_write(tmp_path, text))


def test_a_recipe_file_over_the_size_cap_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as fh:
        fh.truncate(64 << 20)  # sparse: 64 MiB of NUL bytes
    with pytest.raises(UserError, match="too large for a recipe"):
        load_recipe(path)


def test_a_tune_recipe(tmp_path):
    r = load_recipe(_write(tmp_path, "model: builtin:mpnet\ntune:\n  time_budget: 5m\n  targets: {cos_min: 0.99}\n"))
    assert r.stages == [] and r.validate is None and r.model == "builtin:mpnet"
    assert r.tune["time_budget"] == "5m" and r.tune["targets"] == "cos_min=0.99" and r.tune["rounds"] == 5
