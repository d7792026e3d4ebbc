"""The artifact: a folder with model file(s), tokenizer files and a ``bertopt.json`` manifest.

The manifest records what the model is (format, inputs/outputs, precision), a sha256 of every file,
and its lineage (source model, parent artifact and digest, stage, parameters, tool versions, wall time)
plus validation results when present. ``Artifact.load`` verifies every hash.

``ArtifactWriter`` is how every stage produces an artifact: files go into a hidden temporary folder
next to the destination, the manifest is written last, and the folder is renamed into place. A failed
or interrupted stage leaves at most a ``.<name>.tmp-*`` folder, never something that looks like an
artifact.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bertopt.errors import ArtifactError, UserError
from bertopt.records import write_json

FORMAT_VERSION = 1
MANIFEST_NAME = "bertopt.json"
TOKENIZER_DIR = "tokenizer"
MODEL_FORMATS = ("onnx", "tf-savedmodel", "tf-graphdef")

# Packages whose versions are worth recording when they took part in making an artifact.
_TRACKED_PACKAGES = {
    "onnx": "onnx",
    "onnxruntime": "onnxruntime",
    "torch": "torch",
    "transformers": "transformers",
    "tensorflow": "tensorflow",
    "tf2onnx": "tf2onnx",
    "onnxconverter_common": "onnxconverter-common",
    "onnxscript": "onnxscript",
    "openvino": "openvino",
    "numpy": "numpy",
}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def primary_output(model) -> str | None:
    """The output ``encode`` returns: the manifest's ``primary_output``, else the last output (``model`` is an
    Artifact or a reference model's spec with ``model_info`` and ``outputs``)."""
    return model.model_info.get("primary_output") or (model.outputs[-1]["name"] if model.outputs else None)


def output_kinds(outputs: list[dict[str, Any]]) -> dict[str, str]:
    """Output name -> kind (embedding, token, logits, ...); an output that records none is an embedding."""
    return {o["name"]: o.get("kind", "embedding") for o in outputs}


def tool_versions() -> dict[str, str]:
    """Versions of bertopt, Python and every tracked package that is already imported."""
    from importlib import metadata

    from bertopt.version import __version__

    versions = {"bertopt": __version__, "python": platform.python_version()}
    for module, dist in _TRACKED_PACKAGES.items():
        if module in sys.modules:
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                versions[dist] = getattr(sys.modules[module], "__version__", "unknown")
    return versions


def onnx_external_data_files(model_file: Path) -> list[str]:
    """Files (relative to the model's folder) holding an ONNX model's external data, read from the graph alone."""
    import onnx

    model_file = Path(model_file)
    if model_file.suffix != ".onnx" or not model_file.is_file():
        return []
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except (DecodeError, ValueError, OSError):
        return []  # not a readable ONNX graph: load_onnx reports that, with the fix, where the model is used
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        tensors.extend(a.t for a in node.attribute if a.HasField("t"))
    names = {e.value for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL
             for e in t.external_data if e.key == "location"}
    return sorted(names)


def _digest_of_files(files: dict[str, dict[str, Any]]) -> str:
    """One digest naming the artifact's content: the hash of the sorted per-file hashes."""
    canon = json.dumps({k: v["sha256"] for k, v in sorted(files.items())}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


class Artifact:
    """A loaded (and verified) artifact folder."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, verify: bool = True) -> "Artifact":
        path = Path(path)
        if not path.exists():
            raise ArtifactError(f"artifact not found: {path} (give the folder a bertopt stage wrote)")
        if not path.is_dir():
            raise ArtifactError(
                f"{path} is a file, not an artifact folder; to use a model file as input, "
                "pass it as --model/SOURCE"
            )
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.exists():
            raise ArtifactError(
                f"{path} is not a bertopt artifact (no {MANIFEST_NAME}); create one with "
                "'bertopt export' or 'bertopt run'"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{manifest_path} is not valid JSON ({exc}); re-create the artifact") from None
        if not isinstance(manifest, dict):
            check_manifest(manifest, manifest_path)  # names the problem
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{path}: artifact format version {version!r} is not supported by this bertopt "
                f"(expects {FORMAT_VERSION}); re-create it with this version"
            )
        check_manifest(manifest, manifest_path)
        artifact = cls(path, manifest)
        if verify:
            artifact.verify()
        return artifact

    def verify(self) -> None:
        """Check that every file the manifest lists is present with the recorded size and sha256."""
        external = set(self.manifest.get("external_data", []))
        for rel, info in sorted(self.manifest.get("files", {}).items()):
            file = self.path / rel
            if not file.exists():
                if rel in external:
                    raise ArtifactError(
                        f"artifact {self.path} is incomplete: {rel}, the external data holding the weights of "
                        f"{self.manifest.get('model_file')}, is missing; copy it back or re-create the artifact"
                    )
                raise ArtifactError(
                    f"artifact {self.path} is incomplete: {rel} is missing; re-create the artifact"
                )
            size = file.stat().st_size
            if size != info["size"]:
                raise ArtifactError(
                    f"artifact {self.path} is corrupt: {rel} has {size} bytes, the manifest says "
                    f"{info['size']} (truncated or modified); re-create the artifact"
                )
            if sha256_file(file) != info["sha256"]:
                raise ArtifactError(
                    f"artifact {self.path} is corrupt: sha256 of {rel} does not match the manifest "
                    "(the file was modified); re-create the artifact"
                )

    # -- accessors ---------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def model_format(self) -> str:
        return self.manifest["model_format"]

    @property
    def model_path(self) -> Path:
        return self.path / self.manifest["model_file"]

    @property
    def precision(self) -> str:
        return self.manifest.get("precision", "fp32")

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return self.manifest.get("inputs", [])

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return self.manifest.get("outputs", [])

    @property
    def model_info(self) -> dict[str, Any]:
        """Architecture facts (family, hidden size, heads, layers, pooling, task, labels) carried from the source.

        Manifests written before the task contract name tasks differently ("classifier", "sentence-embedding",
        "encoder") and name no family (they are all BERT); both are read in today's terms."""
        return canonical_model_info(self.manifest.get("model", {}))

    @property
    def primary_output(self) -> str | None:
        return primary_output(self)

    @property
    def output_kinds(self) -> dict[str, str]:
        return output_kinds(self.outputs)

    @property
    def lineage(self) -> dict[str, Any]:
        return self.manifest.get("lineage", {})

    @property
    def source(self) -> dict[str, Any]:
        return self.lineage.get("source", {})

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_DIR

    @property
    def runtime(self) -> str:
        """The runtime backend this artifact is meant to be served with (``onnxruntime`` by default)."""
        return self.manifest.get("runtime", "onnxruntime")

    def history(self) -> list[dict[str, Any]]:
        """The lineage chain, oldest first, ending with this artifact's own step."""
        return list(self.manifest.get("history", [])) + [self.lineage_summary()]

    def lineage_summary(self) -> dict[str, Any]:
        lin = self.lineage
        return {
            "stage": lin.get("stage"),
            "params": lin.get("params"),
            "path": str(self.path),
            "digest": self.digest,
            "precision": self.precision,
            "model_format": self.model_format,
        }

    def size_bytes(self) -> int:
        return sum(info["size"] for info in self.manifest.get("files", {}).values())

    def batch_invariance(self) -> dict[str, Any] | None:
        """Whether a text's output depends on its batch: ``{"invariant": bool, "batch_dev": float | None,
        "bound": float, ...}`` as measured by ``validate`` (or declared by the stage that made the artifact,
        e.g. ONNX Runtime dynamic int8); None when nobody has said."""
        measured = (self.manifest.get("validation") or {}).get("batch_invariance")
        return measured or self.manifest.get("batch_invariance")

    def measured_batch_dev(self) -> float:
        """The batch deviation ``validate`` measured for this artifact and recorded in its manifest: the largest
        1 - cosine between a text's output alone and the same text inside other batches (``validate/batch.py``).
        Raises UserError when no validation has measured it (a stage's declaration is no measurement)."""
        found = (self.manifest.get("validation") or {}).get("batch_invariance") or {}
        dev = found.get("batch_dev")
        if found.get("measured_by") != "validate" or not isinstance(dev, (int, float)):
            raise UserError(f"{self.path} records no measured batch deviation; run 'bertopt validate {self.path}' "
                            "(batch check on, the default) to measure and record it")
        return float(dev)

    def served_deviation_bound(self) -> float:
        """The largest 1 - cosine by which two servings of one text may differ (served vs in-process, batch A vs
        batch B), from ``measured_batch_dev``: each lies within the measured deviation of the text alone and
        angles add, 1 - cos(2a) <= 4 (1 - cos a). Never below 1e-9: an f32 artifact measures ~1e-12 on the
        validation probes and other batch shapes may land a little above 4x that; 1e-9 is still stricter than
        the elementwise 1e-5 these comparisons used before (up to ~2e-8 in 1 - cosine for a 384-d unit vector)."""
        return max(4.0 * self.measured_batch_dev(), 1e-9)

    def batch_dependence_warning(self) -> str | None:
        """One line for servers to print at start-up when this artifact is known to be batch-dependent."""
        info = self.batch_invariance()
        if not info or info.get("invariant", True):
            return None
        dev = info.get("batch_dev")
        figure = f" (up to {dev:.2g} 1-cosine measured)" if isinstance(dev, (int, float)) else ""
        return (f"warning: {self.path} is batch-dependent: a text's output changes with what it is batched "
                f"with{figure}; for outputs that match validation use a batch-invariant artifact "
                "(bertopt run recipes/minilm-faithful-cpu.yaml)")

    def record_validation(self, key: str, results: dict[str, Any]) -> None:
        """Store validation results in the manifest (atomically; hashed files are untouched)."""
        self.manifest.setdefault("validation", {})[key] = results
        write_json(self.path / MANIFEST_NAME, self.manifest)

    def __repr__(self) -> str:
        return f"Artifact({str(self.path)!r}, {self.model_format}, {self.precision})"


def canonical_model_info(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with the task in the contract's names and the family, id2label, problem_type and pair_input set."""
    from bertopt.families import OLD_TASK_NAMES

    if not info:
        return info
    out = dict(info)
    out["task"] = OLD_TASK_NAMES.get(out.get("task") or "embedding", out.get("task") or "embedding")
    out.setdefault("family", "bert")
    out.setdefault("pair_input", out["task"] == "rerank")
    if out["task"] in ("classification", "rerank", "token-classification"):
        out.setdefault("id2label", None)
    if out["task"] == "classification":
        out.setdefault("problem_type", "single_label_classification")
    return out


# key -> (type(s), required): what a manifest must hold for loading, inspecting and serving it
_MANIFEST_SCHEMA: dict[str, tuple[tuple[type, ...], bool]] = {
    "format_version": ((int,), True),
    "model_file": ((str,), True),
    "model_format": ((str,), True),
    "inputs": ((list,), True),
    "outputs": ((list,), True),
    "precision": ((str,), False),
    "runtime": ((str,), False),
    "runtime_options": ((dict,), False),
    "model": ((dict,), False),
    "digest": ((str,), True),
    "files": ((dict,), True),
    "lineage": ((dict,), False),
    "history": ((list,), False),
    "validation": ((dict,), False),
    "batch_invariance": ((dict,), False),
    "external_data": ((list,), False),
}
_TYPE_NAMES = {int: "a whole number", str: "a string", list: "a list", dict: "a mapping", float: "a number"}


def check_manifest(manifest: Any, where: Path | str) -> None:
    """Keys and types of a manifest, checked on load: one line naming the first problem, never a traceback
    later in whatever reads the field."""
    fix = "re-create the artifact with 'bertopt export' or 'bertopt run'"

    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{where}: {what}; {fix}")

    if not isinstance(manifest, dict):
        raise bad(f"the manifest must be a JSON object, got {type(manifest).__name__}")
    for key, (types, required) in _MANIFEST_SCHEMA.items():
        if key not in manifest:
            if required:
                raise bad(f"'{key}' is missing")
            continue
        value = manifest[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise bad(f"'{key}' must be {_TYPE_NAMES[types[0]]}, got {type(value).__name__} {value!r:.40}")
    if manifest["model_format"] not in MODEL_FORMATS:
        raise bad(f"'model_format' is {manifest['model_format']!r}, not one of {', '.join(MODEL_FORMATS)}")
    for section in ("inputs", "outputs"):
        if not manifest[section]:
            raise bad(f"'{section}' is empty (an artifact has at least one)")
    for section in ("inputs", "outputs"):
        for i, entry in enumerate(manifest[section]):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise bad(f"{section}[{i}] must be a mapping with a string 'name', got {entry!r:.40}")
            for key, types in (("kind", (str,)), ("shape", (list,)), ("dtype", (str,)), ("role", (str,))):
                if key in entry and not isinstance(entry[key], types):
                    raise bad(f"{section}[{i}].{key} must be {_TYPE_NAMES[types[0]]}, got {entry[key]!r:.40}")
    for rel, info in manifest["files"].items():
        if (not isinstance(info, dict) or not isinstance(info.get("size"), int)
                or not isinstance(info.get("sha256"), str)):
            raise bad(f"files[{rel!r}] must be a mapping with an integer 'size' and a string 'sha256'")


def is_artifact(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


class ArtifactWriter:
    """Context manager producing one artifact atomically.

    with ArtifactWriter(out_dir, stage="quantize", params=cfg, parent=art) as w:
        save model into w.dir / "model.onnx"
        w.copy_tokenizer(art)
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="int8")
        w.report["nodes_before"] = ...
    -> w.artifact is the loaded result
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        stage: str,
        params: dict[str, Any] | None = None,
        parent: Artifact | None = None,
        source: dict[str, Any] | None = None,
        overwrite: bool = False,
    ):
        self.out_dir = Path(out_dir).absolute()
        self.stage = stage
        self.params = dict(params or {})
        self.parent = parent
        self.source = source if source is not None else (parent.source if parent else {})
        self.overwrite = overwrite
        self.report: dict[str, Any] = {}
        self.model_info: dict[str, Any] = dict(parent.model_info) if parent else {}
        self.extra: dict[str, Any] = {}
        self.runtime = parent.runtime if parent else "onnxruntime"
        self._model: dict[str, Any] | None = None
        self.artifact: Artifact | None = None
        self.dir: Path = Path()

    def __enter__(self) -> "ArtifactWriter":
        if self.parent is not None and self.out_dir == self.parent.path.absolute():
            raise UserError(
                f"output folder {self.out_dir} is the input artifact; stages never modify their input, "
                "choose another --out"
            )
        if self.out_dir.exists() and not self.overwrite:
            what = "an artifact" if is_artifact(self.out_dir) else "a folder"
            raise UserError(
                f"output folder {self.out_dir} already exists ({what}); choose another --out "
                "or pass --force to replace it"
            )
        if self.out_dir.exists() and not is_artifact(self.out_dir) and any(self.out_dir.iterdir()):
            raise UserError(
                f"output folder {self.out_dir} exists and is not a bertopt artifact; refusing to replace it"
            )
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self._t0 = time.perf_counter()
        return self

    def copy_tokenizer(self, artifact_or_dir: Artifact | Path) -> None:
        src = artifact_or_dir.tokenizer_path if isinstance(artifact_or_dir, Artifact) else Path(artifact_or_dir)
        if src.is_dir():
            shutil.copytree(src, self.dir / TOKENIZER_DIR)

    def set_model(
        self,
        model_file: str,
        model_format: str,
        inputs: list[dict[str, Any]],
        outputs: list[dict[str, Any]],
        precision: str,
    ) -> None:
        if model_format not in MODEL_FORMATS:
            raise ValueError(f"unknown model format {model_format}")
        self._model = {
            "model_file": model_file,
            "model_format": model_format,
            "inputs": inputs,
            "outputs": outputs,
            "precision": precision,
        }

    def staged(self) -> Artifact:
        """A view of the artifact being written (the temp folder; no digest, files not yet hashed), for the
        self-checks a stage runs before the artifact is renamed into place."""
        if self._model is None:
            raise RuntimeError(f"stage {self.stage} did not call set_model()")
        return Artifact(self.dir, {**self._model, "model": self.model_info, "runtime": self.runtime, **self.extra,
                                   "digest": "staging", "files": {}})

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return False
        try:
            self._finish()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return False

    def _finish(self) -> None:
        if self._model is None:
            raise RuntimeError(f"stage {self.stage} did not call set_model()")
        files = {}
        for file in sorted(self.dir.rglob("*")):
            if file.is_file():
                rel = file.relative_to(self.dir).as_posix()
                files[rel] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
        if self._model["model_file"] not in files and not (self.dir / self._model["model_file"]).is_dir():
            raise RuntimeError(f"model file {self._model['model_file']} was not written")
        # an ONNX model's external data files are part of the artifact: listed, hashed, and checked present
        model_file = self.dir / self._model["model_file"]
        base = Path(self._model["model_file"]).parent
        external = [(base / name).as_posix() for name in onnx_external_data_files(model_file)]
        absent = [name for name in external if name not in files]
        if absent:
            raise UserError(f"{self._model['model_file']} keeps its weights in {absent[0]}, which the artifact does "
                            "not have; put the external data file next to the model")
        parent = self.parent
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            **self._model,
            "runtime": self.runtime,
            "model": self.model_info,
            "digest": _digest_of_files(files),
            "files": files,
            "external_data": external,
            "lineage": {
                "source": self.source,
                "parent": {"path": str(parent.path.absolute()), "digest": parent.digest} if parent else None,
                "stage": self.stage,
                "params": self.params,
                "tool_versions": tool_versions(),
                "wall_time_s": round(time.perf_counter() - self._t0, 3),
                "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "report": self.report,
            },
            "history": parent.history() if parent else [],
            "validation": {},
            **self.extra,
        }
        write_json(self.dir / MANIFEST_NAME, manifest)
        # Rename into place; an existing artifact (overwrite) is moved aside first, then removed.
        old = None
        if self.out_dir.exists():
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.out_dir, old)
        os.rename(self.dir, self.out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.artifact = Artifact(self.out_dir, manifest)
