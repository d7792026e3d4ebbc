"""`bertopt run` on the default recipe and the real MiniLM: the main job of `make demo` (slow). The default is
`bertopt tune` (recipes/minilm-tuned.yaml): the fastest candidate on this machine that passes the gate."""

from __future__ import annotations

import json

import pytest

from bertopt.recipes import DEFAULT_RECIPE

pytestmark = pytest.mark.slow


def test_default_recipe_end_to_end(default_recipe_run):
    code, out, err, tmp_path = (default_recipe_run.code, default_recipe_run.stdout, default_recipe_run.stderr,
                                default_recipe_run.out)
    assert code == 0, err + out
    final = tmp_path / DEFAULT_RECIPE
    manifest = json.loads((final / "bertopt.json").read_text())
    record = manifest["tune"]
    by_name = {c["name"]: c for c in record["candidates"]}
    winner = by_name[record["winner"]]
    # the default's promise: faithful alone and in batches, and a served text within 1e-3 of the validated one
    assert winner["status"] == "passed" and winner["cos_min_alone"] >= 0.995 and winner["cos_min_batched"] >= 0.995
    assert winner["batch_dev"] <= 1e-3 and winner["texts_per_s"] > 0
    assert manifest["runtime"] == winner["runtime"] and [h["stage"] for h in manifest["history"]][:2] == \
        ["export", "prune"]
    # every candidate this machine can run was considered; ONNX Runtime's dynamic int8 moves with its batch-mates
    # (~6e-2 on MiniLM) and must fail the gate wherever it was gated
    assert "openvino-f32" in by_name
    if by_name.get("onnxruntime-int8", {}).get("status") in ("passed", "failed"):
        assert by_name["onnxruntime-int8"]["status"] == "failed"
        assert by_name["onnxruntime-int8"]["batch_dev"] > 1e-3
    gate = manifest["validation"]["gate"]
    assert gate["passed"] is True and gate["reference"]["framework"] == "pytorch"
    checks = {c["metric"]: c for c in gate["checks"]}
    assert checks["cos_min"]["threshold"] == 0.995 and checks["cos_min"]["passed"]
    assert checks["batch_dev"]["threshold"] == 1e-3 and checks["batch_dev"]["passed"]
    # batch invariance measured and recorded where validate records it: what inspect and the servers read
    measured = manifest["validation"]["batch_invariance"]
    assert measured["invariant"] is True and measured["bound"] == 1e-3 and measured["batch_sizes"] == [1, 7, 32]
    assert measured["batch_dev"] >= winner["batch_dev"]  # worst over every output, the primary included
    assert record["machine"]["cpu_features"] and record["gate"]["reference"].startswith("pytorch")
    report = tmp_path / f"{DEFAULT_RECIPE}-report"
    assert (report / "tune.md").is_file() and (report / "tune.html").is_file()
    assert "wrote" in out and record["winner"] in out


def test_the_default_recipe_gates_faithfulness_and_batch_invariance():
    from bertopt.measure.targets import parse_targets
    from bertopt.recipes import find_recipe, load_recipe
    from bertopt.tune import default_tune_targets

    recipe = load_recipe(find_recipe(None))
    assert recipe.name == DEFAULT_RECIPE and recipe.tune is not None and not recipe.tune["targets"]
    targets = {t.metric: t for t in parse_targets(default_tune_targets("embedding", "embedding"))}
    assert targets["cos_min"].op == ">=" and targets["cos_min"].value == 0.995
    assert targets["batch_dev"].op == "<=" and targets["batch_dev"].value == 1e-3
