"""`bertopt validate` on tiny BERTs: passing and failing gates, every report read back, task metrics with
labels, sentence pairs, relative bounds, usage errors (exit 2)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from bertopt.tiny_models import build_tiny_hf_bert

FAST_GRID = ["--batch-sizes", "1,4", "--seq-lens", "8,16", "--repeats", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def tiny_int8(tiny_onnx, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "per_channel": False},
                     tmp_path_factory.mktemp("gate") / "int8")


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    from bertopt.registry import run_stage

    hf = build_tiny_hf_bert(tmp_path_factory.mktemp("cls") / "hf", classifier=True, seed=3)
    return hf, run_stage("export", hf, {}, tmp_path_factory.mktemp("cls") / "onnx")


def _junit(path):
    suite = ET.parse(path).getroot().find("testsuite")
    cases = suite.findall("testcase")
    return suite, {c.get("name"): c.find("failure") for c in cases}


def test_passing_gate_writes_every_report_and_exits_0(cli, tiny_int8, tmp_path):
    report = tmp_path / "report"
    code, out, err = cli("validate", tiny_int8.path, "--report-dir", report, "--targets",
                         "cos_min=0.99,cos_mean=0.999,neighbour_agreement_at_10=0.5,last_hidden_state.max_abs<=1,"
                         "abs_err_p99<=0.1,speedup=0.01,latency_p99_ms<=60000", *FAST_GRID)
    assert code == 0, err
    assert "PASSED" in out and "cos_min >= 0.99" in out
    assert sorted(p.name for p in report.iterdir()) == ["errors.png", "junit.xml", "latency.png", "report.html",
                                                        "summary.md", "validation.json"]
    result = json.loads((report / "validation.json").read_text())
    assert result["passed"] is True and result["reference"]["framework"] == "pytorch"
    emb = result["accuracy"]["sentence_embedding"]
    assert 0.99 <= emb["cos_min"] <= emb["cos_p01"] <= emb["cos_mean"] <= 1.0
    assert result["metrics"]["cos_min"] == emb["cos_min"]  # unprefixed metrics are the primary output's
    assert result["accuracy"]["last_hidden_state"]["kind"] == "token"
    assert {"max_abs", "mean_abs", "abs_err_p99", "pass_fraction", "nan_or_inf"} <= set(emb)
    grid = result["latency"]["grid"]
    assert [(p["batch_size"], p["seq_len"]) for p in grid] == [(1, 8), (1, 16), (4, 8), (4, 16)]
    for p in grid:
        for who in ("artifact", "reference"):
            assert 0 < p[who]["p50_ms"] <= p[who]["p90_ms"] <= p[who]["p99_ms"] and p[who]["calls"] == 3
        assert p["speedup"] == pytest.approx(p["artifact"]["texts_per_s"] / p["reference"]["texts_per_s"])
    speedups = [p["speedup"] for p in grid]
    for p in grid:  # the terminal's latency table keeps every figure whole on an 80-column console
        assert f"{p['speedup']:.2f}x" in out and f"{p['artifact']['p50_ms']:.2f}" in out
    assert max(map(len, out.splitlines())) <= 80
    assert result["metrics"]["speedup"] == pytest.approx(float(np.exp(np.mean(np.log(speedups)))))
    assert result["metrics"]["speedup_min"] == pytest.approx(min(speedups))
    assert result["versions"]["onnxruntime"] and result["machine"]["cpu_count"] >= 1
    assert result["data"] == {"source": "builtin", "texts": 320, "pairs": False, "labels": False}
    suite, cases = _junit(report / "junit.xml")
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(result["checks"]) == len(cases) == 9
    assert all(f is None for f in cases.values()) and "sentence_embedding: no NaN/Inf" in cases
    assert "# bertopt validate: PASSED" in (report / "summary.md").read_text()
    page = (report / "report.html").read_text()
    assert 'src="latency.png"' in page and 'src="errors.png"' in page
    assert (report / "latency.png").read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((tiny_int8.path / "bertopt.json").read_text())
    assert manifest["validation"]["gate"]["passed"] is True
    assert manifest["validation"]["gate"]["report_dir"] == str(report.absolute())


def test_failing_gate_exits_1_and_reports_the_failure(cli, tiny_int8, tmp_path):
    report = tmp_path / "report"
    code, out, err = cli("validate", tiny_int8.path, "--report-dir", report, "--targets",
                         "cos_min=0.9999999,cos_mean=0.9", "--no-latency", "--max-texts", "96")
    assert code == 1
    assert "gate failed" in err and "1 of 4 checks failed" in err and "cos_min >= 0.9999999" in err
    result = json.loads((report / "validation.json").read_text())
    assert result["passed"] is False and result["latency"] is None
    failed = [c for c in result["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["cos_min >= 0.9999999"]
    assert failed[0]["measured"] == result["accuracy"]["sentence_embedding"]["cos_min"] < 0.9999999
    suite, cases = _junit(report / "junit.xml")
    assert suite.get("failures") == "1"
    failure = cases["cos_min >= 0.9999999"]
    assert failure is not None and "needs >= 0.9999999" in failure.get("message")
    assert cases["cos_mean >= 0.9"] is None
    assert "**FAIL**" in (report / "summary.md").read_text()
    assert json.loads((tiny_int8.path / "bertopt.json").read_text())["validation"]["gate"]["passed"] is False


def test_api_without_raising_returns_the_verdict(tiny_int8, tmp_path):
    from bertopt.validate.gate import validate_artifact

    strict = {"targets": "cos_min=0.9999999", "latency": False, "max_texts": 48}
    result = validate_artifact(tiny_int8, strict, tmp_path / "r", raise_on_fail=False)
    assert result["passed"] is False and (tmp_path / "r" / "junit.xml").exists()
    loose = {"targets": "cos_min=0.5", "latency": False, "max_texts": 48}
    again = validate_artifact(tiny_int8, loose, tmp_path / "r", raise_on_fail=False)
    assert again["passed"] is True  # a previous report in the folder is replaced
    assert json.loads((tmp_path / "r" / "validation.json").read_text())["passed"] is True


def test_labels_give_task_metrics_of_both_models_and_relative_bounds(cli, tiny_classifier, tmp_path):
    from bertopt.sources.hf import hf_reference

    hf, art = tiny_classifier
    texts = ["the cat sat on the mat", "a dog is fast", "hello world", "bad model", "good text", "run slow",
             "the bert model is good", "a cat and a dog"]
    labels = [0, 1, 2, 0, 1, 2, 1, 0]
    data = tmp_path / "labelled.csv"
    data.write_text("sentence,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels)))
    report = tmp_path / "report"
    code, out, err = cli("validate", art.path, "--data", data, "--text-column", "sentence", "--label-column", "label",
                         "--targets", "accuracy_degradation<=0.0,f1_degradation<=0.0,top1_agreement=1.0",
                         "--report-dir", report, "--no-latency")
    assert code == 0, err
    result = json.loads((report / "validation.json").read_text())
    logits = hf_reference(hf).run(texts)["logits"]
    expected = float(np.mean(logits.argmax(1) == np.array(labels)))
    assert result["task"]["reference"]["accuracy"] == pytest.approx(expected)
    assert result["task"]["artifact"]["accuracy"] == pytest.approx(expected)  # fp32 export: same predictions
    assert result["metrics"]["accuracy_degradation"] == pytest.approx(0.0)
    assert "Task metric" in (report / "summary.md").read_text()


def test_sentence_pairs_are_fed_as_two_segments(cli, task_artifact, tmp_path):
    # a model that takes pairs (a cross-encoder); a single-text classifier refuses them (test_validate_tasks)
    _, art = task_artifact("rerank")
    data = tmp_path / "pairs.jsonl"
    rows = [{"a": "the cat", "b": "sat on the mat"}, {"a": "hello", "b": "world"}, {"a": "a dog", "b": "is fast"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "report"
    code, out, err = cli("validate", art.path, "--data", data, "--text-column", "a", "--text-pair-column", "b",
                         "--targets", "spearman=0.99,max_abs<=0.001", "--report-dir", report, "--no-latency")
    assert code == 0, err
    result = json.loads((report / "validation.json").read_text())
    assert result["data"]["pairs"] is True and result["data"]["texts"] == 3
    # the second segment reaches the model: changing it (or dropping it) changes the logits the gate compared
    from bertopt.runtime import Predictor

    pred = Predictor(art)
    firsts, seconds = [r["a"] for r in rows], [r["b"] for r in rows]
    with_pairs = pred.encode(firsts, seconds)
    assert np.abs(with_pairs - pred.encode(firsts, list(reversed(seconds)))).max() > 1e-3
    assert np.abs(with_pairs - pred.encode(firsts)).max() > 1e-3
    feeds, _ = pred.feeds_for(pred.tokenize(firsts, seconds))
    assert (feeds["token_type_ids"] == 1).any(axis=1).all()  # every row has a second segment


@pytest.mark.parametrize("args, message", [
    (["--targets", "cos_min=0.9,bogus=1"], "unknown metric 'bogus'"),
    (["--targets", "speedup=1.2", "--no-latency"], "latency is off"),
    (["--targets", "accuracy=0.9"], "needs labels"),
    (["--targets", "top1_agreement=0.9"], "classifier logits"),
    (["--targets", "pooled.cos_min=0.9"], "names output 'pooled'"),
    (["--targets", "speedup@8x999=1"], "grid point 8x999 is not measured"),
    (["--seq-lens", "999"], "latency sequence length 999 exceeds the 48 tokens"),
    (["--batch-sizes", "one"], "'batch_sizes' takes whole numbers like 1,32; got 'one'"),
    (["--seq-lens", "0"], "'seq_lens' values must be at least 1, got 0"),
    (["--seq-lens", "2,16"], "latency sequence length 2 is too short; use at least 3"),
    (["--data", "missing.txt"], "data file not found"),
])
def test_usage_errors_exit_2(cli, tiny_int8, tmp_path, args, message):
    code, out, err = cli("validate", tiny_int8.path, "--report-dir", tmp_path / "r", *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "r").exists()


def test_the_default_latency_grid_is_capped_at_the_tokens_the_model_takes(cli, tiny_int8, tmp_path):
    from bertopt.runtime.predictor import sequence_length

    longest = sequence_length(tiny_int8.model_info)  # 48: the default 16 and 128 are timed at 16 and 48, not refused
    assert 16 < longest < 128
    code, out, err = cli("validate", tiny_int8.path, "--report-dir", tmp_path / "r", "--max-texts", "16",
                         "--batch-sizes", "1", "--repeats", "2", "--warmup", "1")
    assert code == 0, err
    grid = json.loads((tmp_path / "r" / "validation.json").read_text())["latency"]["grid"]
    assert [(p["batch_size"], p["seq_len"]) for p in grid] == [(1, 16), (1, longest)]


@pytest.mark.slow
@pytest.mark.spark
def test_spark_check_runs_the_udf_and_adds_a_check(cli, tiny_int8, tmp_path):
    report = tmp_path / "report"
    code, out, err = cli("validate", tiny_int8.path, "--spark", "--max-texts", "64", "--no-latency",
                         "--report-dir", report)
    assert code == 0, err
    result = json.loads((report / "validation.json").read_text())
    assert result["spark"]["rows"] == 64 and result["spark"]["max_abs_diff"] <= 1e-5
    check = next(c for c in result["checks"] if c["name"] == "spark_matches_runtime")
    assert check["passed"] and check["measured"] == result["spark"]["max_abs_diff"]
    _, cases = _junit(report / "junit.xml")
    assert "spark_matches_runtime" in cases
