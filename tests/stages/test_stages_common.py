"""What every stage does after writing: compare itself with its input and tell the user when it broke it."""

from __future__ import annotations

import numpy as np

from bertopt.stages.common import FIDELITY_WARNING_COS_MEAN, fidelity_notes


def test_fidelity_notes_name_the_broken_output_and_the_int8_fix():
    stats = {"sentence_embedding": {"cos_mean": 0.02, "cos_min": -0.153},
             "last_hidden_state": {"cos_mean": 0.97, "cos_min": 0.90},
             "logits": {"max_abs": 0.1}}  # no cosine: nothing to say
    notes = fidelity_notes(stats, "quantize")
    assert notes == ["sentence_embedding differs from the input model (cos mean 0.020, min -0.153): this artifact "
                     "will not pass 'bertopt validate'; for ONNX Runtime int8 try --per-token (one activation scale "
                     "per token) or --runtime openvino"]
    # other stages get the fact without the int8 advice; a faithful output gets nothing
    assert fidelity_notes(stats, "fp16")[0].endswith("will not pass 'bertopt validate'")
    assert fidelity_notes({"x": {"cos_mean": FIDELITY_WARNING_COS_MEAN, "cos_min": 0.5}}, "quantize") == []


def test_a_parent_is_run_once_for_the_stages_that_check_against_it(tiny_onnx, tmp_path, monkeypatch):
    # tune compiles one parent into several candidates; each compile's check reads the parent's run on the corpus
    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.stages import common

    monkeypatch.setattr(common, "_PARENT_RUNS", common.OrderedDict())
    names = [o["name"] for o in tiny_onnx.outputs]
    first = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32"}, tmp_path / "a")
    kept = common.parent_outputs(tiny_onnx, corpus(), names)
    assert len(common._PARENT_RUNS) == 1
    second = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                              "performance_hint": "THROUGHPUT"}, tmp_path / "b")
    assert len(common._PARENT_RUNS) == 1 and common.parent_outputs(tiny_onnx, corpus(), names) is kept
    # what the memo handed out is the parent's run: the checks' figures are those of a fresh run
    fresh = Predictor(tiny_onnx, provider="cpu").run(corpus(), outputs=names)
    for name in names:
        assert all(np.array_equal(a, b) for a, b in zip(kept[name], fresh[name])) if isinstance(kept[name], list) \
            else np.array_equal(kept[name], fresh[name])
    for art in (first, second):  # f32 on OpenVINO against the same model on ONNX Runtime
        assert art.manifest["lineage"]["report"]["accuracy_vs_parent"]["sentence_embedding"]["cos_min"] > 0.9999


def test_the_parent_memo_runs_again_when_what_decides_the_values_changes(tiny_onnx, tmp_path, monkeypatch):
    import shutil

    from bertopt.artifact import Artifact
    from bertopt.registry import run_stage
    from bertopt.runtime.backends import default_threads
    from bertopt.stages import common

    monkeypatch.setattr(common, "_PARENT_RUNS", common.OrderedDict())
    texts = ["a short text", "and a second, longer one with more words in it"]
    folder = tmp_path / "parent"
    shutil.copytree(tiny_onnx.path, folder)
    parent = Artifact.load(folder)
    before = common.parent_outputs(parent, texts, ["sentence_embedding"])
    other = default_threads() + 1
    assert common.parent_outputs(parent, texts, ["sentence_embedding"], threads=other) is not before  # threads
    assert common.parent_outputs(parent, texts[:1], ["sentence_embedding"]) is not before  # other texts
    assert len(common._PARENT_RUNS) == common.PARENT_RUNS_KEPT  # the oldest run let go
    # the same folder rewritten with other weights (a --force rebuild): its digest differs, so it is run again
    int8 = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic"}, tmp_path / "int8")
    shutil.rmtree(folder)
    shutil.copytree(int8.path, folder)
    after = common.parent_outputs(Artifact.load(folder), texts, ["sentence_embedding"])
    assert not np.array_equal(after["sentence_embedding"], before["sentence_embedding"])
