"""NNCF static int8 for OpenVINO on the real MiniLM and MPNet, held to the gate of issue 28 by ``bertopt tune``'s own
gate (the release gate of ``bertopt validate``, against the original PyTorch fp32 model): cosine min >= 0.995 on
the built-in corpus and ``mixed_text``, every text alone and in batches of 32, and batch deviation <= 1e-3 (slow:
calibration, the held-back measurement and, where the target misses, the ranked search compile and run dozens
of models)."""

from __future__ import annotations

import pytest

from bertopt.artifact import Artifact

pytestmark = pytest.mark.slow
pytest.importorskip("nncf")


@pytest.mark.parametrize("model", ["builtin:minilm", "builtin:mpnet"])
def test_static_int8_passes_the_gate_on_the_real_model(model, tmp_path, cli):
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", model, "--out", out, "--candidates", "openvino-int8-static", "--rounds", "1")
    assert code == 0, err + stdout
    art = Artifact.load(out)
    assert art.model_format == "openvino-ir" and art.precision.startswith("int8-static")
    static = next(c for c in art.manifest["tune"]["candidates"] if c["name"] == "openvino-int8-static")
    assert static["status"] == "passed"
    assert min(static["cos_min_alone"], static["cos_min_batched"]) >= 0.995 and static["batch_dev"] <= 1e-3
    report = art.manifest["lineage"]["report"]
    assert report["quantized_nodes"] > 0 and report["held_back"]["cos_min"] >= 0.997
