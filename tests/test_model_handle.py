"""The one model handle: what an artifact, a staged artifact and a source model produce and every backend opens
(real ONNX Runtime, OpenVINO and PyTorch sessions on the tiny BERT)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bertopt.artifact import Artifact, ArtifactWriter
from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.model_handle import ModelHandle
from bertopt.runtime import Predictor
from bertopt.runtime.backends import open_session


@pytest.fixture(scope="module")
def texts():
    return corpus()[:24]


def test_an_artifact_produces_a_handle_of_its_verified_files(tiny_onnx, texts):
    art = Artifact.load(tiny_onnx.path)
    handle = art.model_handle()
    assert (handle.model_format, handle.runtime, handle.model_path) == ("onnx", "onnxruntime", art.model_path)
    assert handle.model_files == (art.model_path,) and handle.model_path.parent == art.path
    assert (handle.path, handle.digest, handle.tokenizer_path) == (art.path, art.digest, art.tokenizer_path)
    assert handle.model_info == art.model_info and list(handle.outputs) == art.outputs
    assert handle.primary_output == art.primary_output == "sentence_embedding"
    by_handle = Predictor(handle)
    assert by_handle.model is handle and by_handle.describe()["digest"] == art.digest
    assert np.array_equal(by_handle.encode(texts), Predictor(tiny_onnx.path).encode(texts))


def test_a_handle_is_frozen_and_a_variant_is_a_new_handle(tiny_onnx, texts):
    handle = tiny_onnx.model_handle()
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.runtime = "openvino"
    basic = dataclasses.replace(handle, runtime_options={"graph_optimization_level": "basic"})
    assert handle.runtime_options == {} and basic.runtime_options == {"graph_optimization_level": "basic"}
    assert np.allclose(Predictor(basic).encode(texts), Predictor(handle).encode(texts), atol=1e-5)


def test_artifact_with_external_data_carries_every_file(tiny_onnx, tmp_path, texts):
    import onnx

    from bertopt.onnx_graph.util import save_onnx

    with ArtifactWriter(tmp_path / "ext", stage="test", parent=tiny_onnx) as w:
        save_onnx(onnx.load(str(tiny_onnx.model_path)), w.dir / "model.onnx", external=True)
        w.copy_tokenizer(tiny_onnx)
        w.set_model("model.onnx", "onnx", tiny_onnx.inputs, tiny_onnx.outputs, "fp32")
    handle = Artifact.load(tmp_path / "ext").model_handle()
    assert handle.model_files == (tmp_path / "ext" / "model.onnx", tmp_path / "ext" / "model.onnx_data")
    assert np.allclose(Predictor(handle).encode(texts), Predictor(tiny_onnx).encode(texts), atol=1e-6)


def test_a_staged_artifact_produces_a_handle(tiny_onnx, tmp_path, texts):
    import shutil

    with ArtifactWriter(tmp_path / "staged", stage="test", parent=tiny_onnx) as w:
        shutil.copy(tiny_onnx.model_path, w.dir / "model.onnx")
        w.copy_tokenizer(tiny_onnx)
        w.set_model("model.onnx", "onnx", tiny_onnx.inputs, tiny_onnx.outputs, "fp32")
        handle = w.staged().model_handle()
        assert handle.model_path == w.dir / "model.onnx" and handle.digest == "staging"
        assert np.array_equal(Predictor(handle).encode(texts), Predictor(tiny_onnx).encode(texts))


def test_a_source_model_produces_a_pytorch_handle(tiny_hf, tiny_onnx, texts):
    from bertopt.sources.hf import hf_model_handle

    handle = hf_model_handle(tiny_hf)
    assert (handle.model_format, handle.runtime, handle.model_path) == ("pytorch", "pytorch", None)
    assert handle.digest == f"pytorch:{tiny_hf}" and handle.runtime_options == {"bf16": False}
    pred = Predictor(handle)
    assert pred.session.backend == "pytorch" and pred.artifact is handle
    got, want = pred.encode(texts), Predictor(tiny_onnx).encode(texts)
    assert np.max(np.abs(got - want)) < 1e-4


def test_a_backend_refuses_a_format_it_cannot_open(tiny_hf, tiny_onnx):
    from bertopt.sources.hf import hf_model_handle

    with pytest.raises(UserError, match=r"^ONNX Runtime runs ONNX models, not pytorch \(.*\); use --runtime pytorch$"):
        Predictor(hf_model_handle(tiny_hf), runtime="onnxruntime")
    with pytest.raises(UserError, match="holds no PyTorch module to run; the pytorch runtime runs reference models"):
        Predictor(tiny_onnx, runtime="pytorch")
    with pytest.raises(TypeError, match="open_session opens a ModelHandle"):
        open_session(tiny_onnx)


def test_a_handle_refuses_what_it_cannot_carry(tiny_onnx):
    fields = dict(inputs=tiny_onnx.inputs, outputs=tiny_onnx.outputs, tokenizer_path=tiny_onnx.tokenizer_path,
                  model_info=tiny_onnx.model_info, path=tiny_onnx.path, digest="x")
    with pytest.raises(ValueError, match="unknown model format 'caffe'"):
        ModelHandle(model_format="caffe", model_path=tiny_onnx.model_path, **fields)
    with pytest.raises(ValueError, match="needs model_path or model_bytes"):
        ModelHandle(model_format="onnx", **fields)
    with pytest.raises(ValueError, match="carries its model in memory"):
        ModelHandle(model_format="pytorch", **fields)


@pytest.mark.usefixtures("private_openvino_cache")
def test_an_openvino_ir_handle_carries_both_files(tiny_onnx, tmp_path, texts):
    """A format of more than one file (model.xml + model.bin): the handle names both, the OpenVINO backend opens it
    and its outputs match ONNX Runtime's on the same weights."""
    import openvino as ov

    xml = tmp_path / "model.xml"
    ov.save_model(ov.Core().read_model(str(tiny_onnx.model_path)), str(xml), compress_to_fp16=False)
    handle = ModelHandle(model_format="openvino-ir", inputs=tiny_onnx.inputs, outputs=tiny_onnx.outputs,
                         tokenizer_path=tiny_onnx.tokenizer_path, model_info=tiny_onnx.model_info, path=tmp_path,
                         digest="ir", model_path=xml, model_files=(xml, xml.with_suffix(".bin")),
                         runtime_options={"inference_precision": "f32", "cache": False})
    assert handle.runtime == "openvino" and handle.model_files[1].is_file()
    pred = Predictor(handle)
    assert pred.session.backend == "openvino"
    assert np.allclose(pred.encode(texts), Predictor(tiny_onnx).encode(texts), atol=1e-4)
    with pytest.raises(UserError, match=r"^ONNX Runtime runs ONNX models, not openvino-ir .*--runtime openvino$"):
        Predictor(handle, runtime="onnxruntime")
