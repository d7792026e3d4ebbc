"""`bertopt run` on the default recipe and the real MiniLM: the main job of `make demo` (slow)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_default_recipe_end_to_end(cli, tmp_path):
    code, out, err = cli("run", "recipes/minilm-int8-cpu.yaml", "--out", tmp_path)
    assert code == 0, err + out
    final = tmp_path / "minilm-int8-cpu" / "04-quantize"
    manifest = json.loads((final / "bertopt.json").read_text())
    assert manifest["precision"] == "int8-dynamic"
    assert [h["stage"] for h in manifest["history"]] == ["export", "prune", "optimize"]
    run = manifest["validation"]["run"]
    emb = run["accuracy"]["sentence_embedding"]
    assert 0.95 < emb["cos_min"] <= emb["cos_mean"] <= 1.0
    assert run["accuracy"]["last_hidden_state"]["max_abs"] < 2.0
    assert run["throughput"]["artifact_texts_per_s"] > 0 and run["throughput"]["reference_texts_per_s"] > 0
    assert run["reference"]["framework"] == "pytorch"
    # the summary table names what a user looks for
    for text in ("cosine mean", "cosine min", "speedup", "final artifact"):
        assert text in out
    assert "gate" in manifest["validation"]
