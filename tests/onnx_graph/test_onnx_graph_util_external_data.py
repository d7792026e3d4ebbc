"""ONNX external data (``model.onnx`` + ``model.onnx_data``, how exports over 2 GB come): imported, kept, hashed
and carried by every stage; an artifact without its external data fails its check with a clear line."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from bertopt.artifact import Artifact
from bertopt.cosine import cosine_rows
from bertopt.data import corpus
from bertopt.errors import ArtifactError
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.tiny_models import build_tiny_family_model

TEXTS = [t for t in corpus() if t][:48]


@pytest.fixture(scope="module")
def external_onnx(tmp_path_factory):
    """A tiny RoBERTa exported by bertopt, then saved the way large exports come: graph + one data file."""
    import onnx

    root = tmp_path_factory.mktemp("ext")
    hf = build_tiny_family_model(root / "hf", "roberta")
    plain = run_stage("export", hf, {}, root / "plain")
    folder = root / "external"  # the model folder's files (config, tokenizer, pipeline) without its PyTorch weights
    shutil.copytree(hf, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    onnx.save(onnx.load(str(plain.model_path)), str(folder / "model.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=0)
    assert (folder / "model.onnx").stat().st_size < 60_000 < (folder / "model.onnx_data").stat().st_size
    return hf, folder / "model.onnx"


def _carries_external_data(art: Artifact) -> None:
    files = art.manifest["files"]
    assert art.manifest["external_data"] == ["model.onnx_data"]
    assert files["model.onnx_data"]["size"] == (art.path / "model.onnx_data").stat().st_size > 40_000
    # the graph alone: the weights stayed outside (int8 keeps small fp32 scales and biases inline)
    assert files["model.onnx"]["size"] < files["model.onnx_data"]["size"]


def test_every_stage_keeps_and_hashes_external_data(external_onnx, tmp_path):
    from bertopt.validate.gate import validate_artifact

    hf, onnx_file = external_onnx
    ref = hf_reference(hf).encode(TEXTS)
    imported = run_stage("export", onnx_file, {}, tmp_path / "imported")
    _carries_external_data(imported)
    assert imported.model_info["family"] == "roberta"
    arts = {"imported": imported, "optimize": run_stage("optimize", imported, {}, tmp_path / "opt")}
    arts["int8"] = run_stage("quantize", arts["optimize"], {"mode": "int8-dynamic"}, tmp_path / "int8")
    arts["fp16"] = run_stage("quantize", arts["optimize"], {"mode": "fp16"}, tmp_path / "fp16")
    arts["int8-openvino"] = run_stage("quantize", imported, {"mode": "int8-dynamic", "runtime": "openvino"},
                                      tmp_path / "ov8")
    arts["compile"] = run_stage("compile", imported, {}, tmp_path / "compiled")
    arts["prune"] = run_stage("prune", imported, {"outputs": ["sentence_embedding"]}, tmp_path / "pruned")
    floors = {"imported": 0.99999, "optimize": 0.99999, "int8": 0.95, "fp16": 0.999, "int8-openvino": 0.999,
              "compile": 0.999, "prune": 0.99999}
    for name, art in arts.items():
        _carries_external_data(Artifact.load(art.path))  # hashes verified on load
        cos = cosine_rows(Predictor(art, provider="cpu").encode(TEXTS), ref)
        assert cos.min() >= floors[name], (name, float(cos.min()))
    result = validate_artifact(arts["int8"], {"targets": "cos_min=0.95", "latency": False, "max_texts": 48},
                               tmp_path / "report", raise_on_fail=False)
    assert result["passed"] is True, result["checks"]


def test_artifact_without_its_external_data_fails_its_check(external_onnx, tmp_path, cli, capsys):
    hf, onnx_file = external_onnx
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    (art.path / "model.onnx_data").unlink()
    with pytest.raises(ArtifactError, match="model.onnx_data, the external data holding the weights of model.onnx, "
                                            "is missing"):
        Artifact.load(art.path)
    capsys.readouterr()
    code, _, err = cli("quantize", art.path, "--out", tmp_path / "q")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "external data" in err
    assert not (tmp_path / "q").exists()


def test_onnx_file_missing_its_external_data_is_refused(external_onnx, tmp_path, cli, capsys):
    _, onnx_file = external_onnx
    lonely = tmp_path / "lonely"
    shutil.copytree(onnx_file.parent, lonely, ignore=shutil.ignore_patterns("model.onnx_data"))
    capsys.readouterr()
    code, _, err = cli("export", lonely / "model.onnx", "--out", tmp_path / "out")
    assert code == 2 and "external data file model.onnx_data, which is not next to it" in err
    assert not (tmp_path / "out").exists()


def test_large_models_are_saved_with_external_data(tmp_path, monkeypatch):
    """save_onnx moves weights out of the protobuf once a model nears its 2 GB limit (threshold lowered here)."""
    import onnx

    from bertopt.onnx_graph import util as onnx_util

    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "w")]))
    monkeypatch.setattr(onnx_util, "EXTERNAL_DATA_ABOVE_BYTES", 1000)
    onnx_util.save_onnx(model, tmp_path / "m.onnx")
    assert onnx_util.uses_external_data(tmp_path / "m.onnx") and (tmp_path / "m.onnx_data").exists()
    onnx_util.save_onnx(model, tmp_path / "m.onnx")  # saving again replaces the data file, never appends
    assert (tmp_path / "m.onnx_data").stat().st_size == 64 * 64 * 4
    loaded = onnx.numpy_helper.to_array(onnx_util.load_onnx(tmp_path / "m.onnx").graph.initializer[0],
                                        base_dir=str(tmp_path))
    np.testing.assert_array_equal(loaded, np.ones((64, 64), np.float32))  # loads with its weights
    assert model.graph.initializer[0].raw_data  # the caller's model still holds its weights
