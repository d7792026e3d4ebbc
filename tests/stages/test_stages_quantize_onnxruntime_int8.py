"""ONNX Runtime's quantiser reports a failed write (a full disk) as 'INVALID_PROTOBUF : Protobuf serialization
failed'; bertopt says what happened in one line instead of a traceback. /dev/full fails every write with ENOSPC, so
a real ONNX Runtime session writing its optimised model there fails exactly as a full disk does."""

from __future__ import annotations

import pytest

from bertopt.errors import BackendFailed
from bertopt.stages.quantize.onnxruntime_int8 import _write_failures_named


def _relu_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_failed_write_is_one_line_naming_the_free_space(tmp_path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = "/dev/full"  # every write fails with ENOSPC
    with pytest.raises(BackendFailed) as failed:
        with _write_failures_named(tmp_path / "model.int8.onnx"):
            ort.InferenceSession(_relu_model_bytes(), options, providers=["CPUExecutionProvider"])
    said = str(failed.value)
    assert said.startswith("ONNX Runtime could not write the quantised model (")
    assert "Protobuf serialization failed" in said and f"GiB free in {tmp_path}" in said
    assert "free disk space" in said and "\n" not in said


def test_other_failures_pass_through_unchanged(tmp_path):
    import onnxruntime as ort

    with pytest.raises(Exception) as failed:  # noqa: B017  (ORT's own pybind exception type)
        with _write_failures_named(tmp_path / "model.int8.onnx"):
            ort.InferenceSession(b"not a model", providers=["CPUExecutionProvider"])
    assert not isinstance(failed.value, BackendFailed) and "INVALID_PROTOBUF" in str(failed.value)
