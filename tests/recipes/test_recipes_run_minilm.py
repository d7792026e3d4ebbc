"""`bertopt run` on the default recipe and the real MiniLM: the main job of `make demo` (slow)."""

from __future__ import annotations

import json

import pytest

from bertopt.recipes import DEFAULT_RECIPE

pytestmark = pytest.mark.slow


def test_default_recipe_end_to_end(cli, tmp_path):
    code, out, err = cli("run", f"recipes/{DEFAULT_RECIPE}.yaml", "--out", tmp_path)
    assert code == 0, err + out
    final = tmp_path / DEFAULT_RECIPE / "03-compile"
    manifest = json.loads((final / "bertopt.json").read_text())
    # f32 pinned: bf16 would make a text's values move with its batch-mates on BF16 CPUs
    assert manifest["runtime"] == "openvino" and manifest["precision"] == "fp32"
    assert manifest["runtime_options"]["inference_precision"] == "f32"
    assert [h["stage"] for h in manifest["history"]] == ["export", "prune"]
    run = manifest["validation"]["run"]
    emb = run["accuracy"]["sentence_embedding"]
    assert 0.995 <= emb["cos_min"] <= emb["cos_mean"] <= 1.0  # the default's promise: faithful
    assert run["throughput"]["artifact_texts_per_s"] > 0 and run["throughput"]["reference_texts_per_s"] > 0
    assert run["reference"]["framework"] == "pytorch"
    # the summary table names what a user looks for
    for text in ("cosine mean", "cosine min", "speedup", "final artifact"):
        assert text in out
    gate = manifest["validation"]["gate"]
    assert gate["passed"] is True
    checks = {c["metric"]: c for c in gate["checks"]}
    assert checks["cos_min"]["threshold"] == 0.995 and checks["cos_min"]["passed"]
    assert checks["batch_dev"]["threshold"] == 1e-4 and checks["batch_dev"]["passed"]
    # batch invariance measured and recorded: what inspect and the servers read
    record = manifest["validation"]["batch_invariance"]
    assert record["invariant"] is True and record["batch_dev"] <= 1e-4 and record["batch_sizes"] == [1, 7, 32]


def test_the_default_recipe_gates_faithfulness_and_batch_invariance():
    from bertopt.recipes import find_recipe, load_recipe
    from bertopt.validate.targets import parse_targets

    recipe = load_recipe(find_recipe(None))
    assert recipe.name == DEFAULT_RECIPE
    targets = {t.metric: t for t in parse_targets(recipe.validate["targets"])}
    assert targets["cos_min"].op == ">=" and targets["cos_min"].value == 0.995
    assert targets["batch_dev"].op == "<=" and targets["batch_dev"].value == 1e-4
