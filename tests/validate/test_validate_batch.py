"""Batch invariance measured, recorded and gated: ``batch_dev`` from ``validate``, the manifest's record,
``inspect``'s label, the start-up warning of the serving commands, and the default thresholds."""

from __future__ import annotations

import json

import pytest

from bertopt.data import corpus
from bertopt.measure.batch import batch_deviation
from bertopt.registry import run_stage
from bertopt.runtime import Predictor

FAST = ["--no-latency", "--max-texts", "96"]


@pytest.fixture(scope="module")
def tiny_int8(tiny_onnx, tmp_path_factory):
    # per-tensor dynamic int8: one activation scale per batch matrix, the batch-dependent kind
    return run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False},
                     tmp_path_factory.mktemp("bi") / "int8")


def test_batch_deviation_separates_float_from_dynamic_int8(tiny_onnx, tiny_int8):
    texts = corpus()[:96]
    fp32 = batch_deviation(Predictor(tiny_onnx), texts)
    int8 = batch_deviation(Predictor(tiny_int8), texts)
    window = Predictor(tiny_onnx).max_seq_len
    assert fp32["batch_sizes"] == [1, 7, 32] and fp32["texts"] == 64 and fp32["full_batches"] == [[32, window]]
    assert fp32["batch_dev"] < 1e-6  # float rounding only
    # its neighbours move it: measured 7.7e-4 with VNNI, over 1e-3 on AVX2 (whose u8s8 kernels saturate); either way
    # over 100x float rounding
    assert int8["batch_dev"] > 1e-4
    assert set(int8["outputs"]) == {"last_hidden_state", "sentence_embedding"}
    # and one full batch (32 texts padded to the window): the shape an OpenVINO artifact may compile a copy for
    assert set(int8["outputs"]["sentence_embedding"]["by_batch_size"]) == {"1", "7", "32", f"32x{window}"}


def test_a_full_batch_shape_already_run_is_measured_once(tiny_int8):
    # with a 16-token window every mixed batch of 32 probes is 32 x 16, the full batch's shape: the full batch is
    # not run a third time, and its key reports what those batches measured
    predictor = Predictor(tiny_int8, max_seq_len=16)
    shapes = []
    run_batch = predictor.run_batch

    def counted(feeds, outputs=None):
        shapes.append(next(iter(feeds.values())).shape)
        return run_batch(feeds, outputs)

    predictor.run_batch = counted
    found = batch_deviation(predictor, corpus()[:96])
    assert found["full_batches"] == [[32, 16]] and shapes.count((32, 16)) == 2, shapes
    by_size = found["outputs"]["sentence_embedding"]["by_batch_size"]
    assert by_size["32x16"] == by_size["32"] > 0  # the dynamic int8 moves with its neighbours at that shape


def test_validate_reports_records_and_gates_batch_dev(cli, tiny_int8, tiny_onnx, tmp_path):
    # a bound 10x above float rounding (fp32 < 1e-6 above); the per-tensor int8 measured 1.6e-4 with VNNI, more on AVX2
    code, out, err = cli("validate", tiny_int8.path, "--targets", "cos_min=0.5,batch_dev<=1e-5", "--report-dir",
                         tmp_path / "r", *FAST)
    assert code == 1, err  # the deviation bound fails the gate
    result = json.loads((tmp_path / "r" / "validation.json").read_text())
    measured = result["metrics"]["batch_dev"]
    assert measured > 1e-5 and result["batch_invariance"]["invariant"] is False
    assert "BATCH-DEPENDENT" in out and "batch_dev" in out
    manifest = json.loads((tiny_int8.path / "bertopt.json").read_text())
    record = manifest["validation"]["batch_invariance"]
    assert record["invariant"] is False and record["outputs"]["sentence_embedding"] == pytest.approx(measured)
    # which compositions: batch sizes, and the full batch (32 texts at the window) as the Predictor runs one
    assert record["batch_sizes"] == [1, 7, 32] and record["full_batches"] == [[32, Predictor(tiny_int8).max_seq_len]]
    # the record's figure is the worst output's (the token-level output moves most)
    assert record["batch_dev"] == pytest.approx(max(result["metrics"][f"{n}.batch_dev"] for n in record["outputs"]))
    code, out, _ = cli("inspect", tiny_int8.path)
    assert code == 0 and "BATCH-DEPENDENT" in out and f"{record['batch_dev']:.3g}" in out

    code, out, err = cli("validate", tiny_onnx.path, "--targets", "batch_dev<=1e-5", "--report-dir",
                         tmp_path / "r2", *FAST)
    assert code == 0, err
    code, out, _ = cli("inspect", tiny_onnx.path)
    assert "batch-invariant" in out


def test_quantize_declares_dynamic_int8_batch_dependent(tiny_int8, cli):
    fresh = json.loads((tiny_int8.path / "bertopt.json").read_text())
    declared = fresh["batch_invariance"]
    assert declared["invariant"] is False and "one activation scale" in declared["why"]


def test_validate_without_targets_applies_and_prints_the_defaults(cli, tiny_onnx, tmp_path):
    code, out, err = cli("validate", tiny_onnx.path, "--report-dir", tmp_path / "r", *FAST)
    assert code == 0, err
    assert "no --targets given: gated at the defaults for embedding outputs" in " ".join(out.split())
    result = json.loads((tmp_path / "r" / "validation.json").read_text())
    names = [c["name"] for c in result["checks"]]
    assert "cos_min >= 0.99 (default)" in names and "neighbour_agreement_at_10 >= 0.9 (default)" in names
    assert result["default_targets"].startswith("cos_min >= 0.99")


def test_validate_default_thresholds_fail_an_unfaithful_artifact(cli, tiny_int8, tmp_path):
    code, out, err = cli("validate", tiny_int8.path, "--report-dir", tmp_path / "r", *FAST)
    result = json.loads((tmp_path / "r" / "validation.json").read_text())
    cos_min = result["metrics"]["cos_min"]
    assert (code == 1) == (cos_min < 0.99 or result["metrics"]["neighbour_agreement_at_10"] < 0.9)


def test_serving_commands_warn_once_about_a_batch_dependent_artifact(tiny_int8, tiny_onnx, tmp_path):
    import subprocess
    import sys

    from bertopt.harness import free_port

    port = free_port()
    argv = ["kafka", "--bootstrap", f"127.0.0.1:{port}", "--request-topic", "a", "--response-topic", "b",
            "--connect-timeout", "1"]
    for art, warned in ((tiny_int8, True), (tiny_onnx, False)):
        proc = subprocess.run([sys.executable, "-m", "bertopt.cli", argv[0], str(art.path), *argv[1:]],
                              capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2
        assert sum("is batch-dependent" in line for line in lines) == (1 if warned else 0), proc.stderr
        assert lines[-1].startswith("error:") and "cannot reach Kafka" in lines[-1]
    (tmp_path / "in.csv").write_text("body\nhello\n")
    for art, warned in ((tiny_int8, True), (tiny_onnx, False)):
        proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "spark-predict", "--artifact", str(art.path),
                               "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "has no column 'text'" in lines[-1]
        assert sum("is batch-dependent" in line for line in lines) == (1 if warned else 0), proc.stderr
    for art, warned in ((tiny_int8, True), (tiny_onnx, False)):  # serve: the line comes before anything starts
        proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "serve", str(art.path), "--port", str(port),
                               "--port-out", str(port + 1 if port < 65535 else port - 1), "--curve-keys",
                               str(tmp_path / "no-keys")], capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "no server.key_secret" in lines[-1], proc.stderr
        assert sum("is batch-dependent" in line for line in lines) == (1 if warned else 0), proc.stderr


def test_served_bound_is_the_batch_dev_validate_recorded(cli, tiny_onnx, tmp_path):
    """Served-equals-validated tests hold served outputs to the artifact's own measured bound: none before
    validation (a stage's declaration is no measurement), 4x the recorded batch_dev after it."""
    import numpy as np
    from served_checks import served_deviation

    from bertopt.artifact import Artifact
    from bertopt.errors import UserError

    art = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False}, tmp_path / "int8")
    assert art.batch_invariance()["measured_by"] is None  # declared by the stage, not measured
    with pytest.raises(UserError, match=r"records no measured batch deviation; run 'bertopt validate .*int8'"):
        art.served_deviation_bound()
    code, _, err = cli("validate", art.path, "--targets", "cos_min=0.5", "--report-dir", tmp_path / "r", *FAST)
    assert code == 0, err
    again = Artifact.load(art.path)
    recorded = json.loads((art.path / "bertopt.json").read_text())["validation"]["batch_invariance"]["batch_dev"]
    assert again.measured_batch_dev() == recorded > 1e-6  # dynamic int8: well above float rounding
    assert again.served_deviation_bound() == pytest.approx(4 * recorded)

    want = Predictor(again).encode(corpus()[:8])
    assert served_deviation(want, want) < 1e-12
    turned = want.copy()
    turned[0] = np.roll(turned[0], 1)  # another vector in row 0: far outside any rounding bound
    assert served_deviation(turned, want) > again.served_deviation_bound()
