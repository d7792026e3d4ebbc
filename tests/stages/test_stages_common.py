"""What every stage does after writing: compare itself with its input and tell the user when it broke it."""

from __future__ import annotations

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
