"""The artifact: a folder with model file(s), tokenizer files and a ``bertopt.json`` manifest.

The manifest records what the model is (format, inputs/outputs, precision), a sha256 of every file,
and its lineage (source model, parent artifact and digest, stage, parameters, tool versions, wall time)
plus validation results when present. ``Artifact.load`` verifies every hash.

An artifact folder is a trust boundary (docs/security.md): loading one reads only what its manifest lists and
hashes. The manifest is read with size and nesting limits; every path it names is a plain relative path that
stays inside the folder and is a regular file (no symlink, device or FIFO: checked before anything is opened);
the model file and an ONNX model's external data must be listed (and so hashed); files the runtime would read
without asking the manifest (the tokenizer folder, a SavedModel folder) may hold nothing unlisted; and the
``digest`` is recomputed from the file hashes, so a file swapped with its hash updated cannot keep the digest
it was validated under.

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
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator

from bertopt.errors import ArtifactError, UserError, out_of_space
from bertopt.model_handle import (
    FLOAT_MODEL_FILE,
    FLOAT_SHORT_TEXTS,
    ModelHandle,
    output_kinds,
    primary_output,
    primary_output_problem,
)
from bertopt.output_paths import write_json
from bertopt.tasks import DEFAULT_TASK, TASKS, known_task
from bertopt.untrusted import json_depth

FORMAT_VERSION = 1
MANIFEST_NAME = "bertopt.json"
TOKENIZER_DIR = "tokenizer"
# openvino-ir: an OpenVINO IR (model.xml + its model.bin, both hashed), written by the NNCF static int8 quantiser
MODEL_FORMATS = ("onnx", "tf-savedmodel", "tf-graphdef", "openvino-ir")
# the precisions a manifest records: export and the TF stages write fp32, quantize fp16 or its int8 mode; an
# OpenVINO artifact's float execution precision follows (compile, quantize --runtime openvino): alone for a float
# model ("bf16"), after the int8 one for an int8 model ("int8-dynamic+bf16")
INT8_PRECISIONS = ("int8-dynamic", "int8-static")
FLOAT_PRECISIONS = ("fp32", "fp16")
EXECUTION_PRECISIONS = ("auto", "bf16", "fp32")  # OpenVINO's inference_precision auto, bf16, f32 as recorded


def precision_problem(precision: Any) -> str | None:
    """Why ``precision`` is not one a manifest may record (None: it is)."""
    base, *execution = str(precision).split("+")
    if execution and base in INT8_PRECISIONS and all(e in EXECUTION_PRECISIONS for e in execution):
        return None
    if not execution and base in (*FLOAT_PRECISIONS, *INT8_PRECISIONS, *EXECUTION_PRECISIONS):
        return None
    shown = ", ".join(dict.fromkeys((*FLOAT_PRECISIONS, *INT8_PRECISIONS, *EXECUTION_PRECISIONS)))
    return (f"'precision' is {precision!r:.40}, not one bertopt writes ({shown}, or an int8 one with its OpenVINO "
            "execution precision: int8-dynamic+bf16)")


_STAGING = "staging"  # the digest of ArtifactWriter.staged(): files written by this stage, not yet hashed
# a manifest is a few kilobytes (tens with validation results and a long history); far larger or deeper is not one
MAX_MANIFEST_BYTES = 16 << 20
MAX_MANIFEST_DEPTH = 64

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
    "nncf": "nncf",
    "numpy": "numpy",
}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def open_regular_file(path: Path):
    """``path`` opened for reading (binary) if it is a regular file; ``None`` if it is a symlink, device, FIFO,
    socket or folder. Checked on the open descriptor (no symlink followed, no blocking open), so what is checked
    is what is read, and ``/dev/zero`` or a FIFO never hangs the reader."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            return None  # O_NOFOLLOW refused a symlink (ELOOP)
        raise exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def read_regular_file(path: Path, *, max_bytes: int, fix: str, error: type[Exception] = UserError,
                      shown_as: Path | None = None, too_large: str = "too large to be what it should be") -> bytes:
    """The bytes of ``path``, read once: a regular file (no symlink, FIFO or device: nothing hangs) of at most
    ``max_bytes``; anything else is one ``error`` line naming the file (as ``shown_as``) and ending with ``fix``."""
    shown = shown_as or path
    try:
        fh = open_regular_file(path)
    except OSError as exc:
        raise error(f"{shown} cannot be read ({exc.strerror or type(exc).__name__}); {fix}") from None
    if fh is None:
        raise error(f"{shown} is not a regular file (a symlink, device, FIFO or folder); {fix}")
    with fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{shown} is larger than {max_bytes >> 20} MiB, {too_large}; {fix}")
    return data


def read_json_file(path: Path, *, max_bytes: int, max_depth: int, fix: str, error: type[Exception] = UserError) -> Any:
    """A JSON file read with limits: a regular file (see ``open_regular_file``) of at most ``max_bytes``, nested
    at most ``max_depth`` deep; anything else is one ``error`` line naming the file and ending with ``fix``."""
    path = Path(path)
    data = read_regular_file(path, max_bytes=max_bytes, fix=fix, error=error)
    if json_depth(data, max_depth) > max_depth:  # before parsing: json.loads recurses once per level
        raise error(f"{path} nests lists or objects deeper than {max_depth} levels; {fix}")
    try:
        value = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise error(f"{path} is not valid JSON ({str(exc).splitlines()[0]:.200}); {fix}") from None
    return value


def member_path_problem(rel: Any, folder: str = "the artifact folder") -> str | None:
    """Why ``rel`` is not a path a manifest (or a model file, of its ``folder``) may name: a plain relative POSIX
    path that stays in the folder; else None. Syntax only; ``Artifact.verify`` checks what is on disk."""
    if not isinstance(rel, str) or not rel:
        return "is not a file name"
    if "\x00" in rel or "\\" in rel:
        return "holds a NUL or backslash"
    pure = PurePosixPath(rel)
    if pure.is_absolute() or PureWindowsPath(rel).drive or PureWindowsPath(rel).root:
        return "is an absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return f"climbs out of {folder} (..)"
    if "." in parts or "" in parts:
        return "is not a plain relative path"
    return None


def external_data_locations(model_file: Path, any_suffix: bool = False) -> list[str]:
    """The external data locations an ONNX file names, each checked to be a plain relative path inside the
    model's folder: one that is absolute or climbs out (``../``) is a one-line UserError. Files that are no
    readable ONNX graph name none (the loader reports them); so do files not named ``*.onnx`` unless
    ``any_suffix`` (an artifact's model file is read as ONNX whatever its name)."""
    names = _raw_external_data_files(model_file, any_suffix)
    for name in names:
        problem = member_path_problem(name, "the model's folder")
        if problem:
            raise UserError(f"{model_file} keeps weights in external data {name!r:.80}, which {problem}; external "
                            "data must be a file next to the model: re-save the model with its data beside it "
                            "(onnx.save(..., save_as_external_data=True, location='model.onnx_data'))")
    return names


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
    """Files (relative to the model's folder) holding an ONNX model's external data, read from the graph alone;
    a location outside the model's folder is a one-line UserError (``external_data_locations``)."""
    return external_data_locations(model_file)


def _raw_external_data_files(model_file: Path, any_suffix: bool = False) -> list[str]:
    import onnx

    model_file = Path(model_file)
    if ((model_file.suffix != ".onnx" and not any_suffix) or not model_file.is_file()
            or not _may_name_external_data(model_file)):
        return []
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except (DecodeError, ValueError, OSError):
        return []  # not a readable ONNX graph: load_onnx reports that, with the fix, where the model is used
    names = {e.value for t in _graph_tensors(model.graph, model.functions)
             if t.data_location == onnx.TensorProto.EXTERNAL for e in t.external_data if e.key == "location"}
    return sorted(names)


def _graph_tensors(graph, functions=()):
    """Every tensor a graph holds: initialisers (sparse ones too), node attributes, and those of subgraphs (If,
    Loop, Scan bodies) and of the model's local functions (a runtime inlines them), walked without recursion."""
    graphs = [graph, *functions]  # a FunctionProto holds nodes as a graph does, and nothing else that is a tensor
    while graphs:
        g = graphs.pop()
        yield from getattr(g, "initializer", ())
        for sparse in getattr(g, "sparse_initializer", ()):
            yield sparse.values
            yield sparse.indices
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


def _may_name_external_data(model_file: Path) -> bool:
    """False when the file cannot name external data: the word ``location`` (the key of an external-data entry)
    is nowhere in its bytes. Protobuf stores a string's bytes as they are, so no encoding hides it (its tag and
    length can be spelt in more than one way, so they are not part of what is looked for). Spares parsing a large
    single-file model just to find none."""
    import mmap

    with open(model_file, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return False
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return mapped.find(_LOCATION_KEY) >= 0


# the key of a TensorProto's external_data entry naming its file, as it stands in the model's bytes
_LOCATION_KEY = b"location"


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
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ArtifactError(f"Artifact.load needs the path of an artifact folder, got {path!r:.60}")
        path = Path(path)
        if not path.exists():
            raise ArtifactError(f"artifact not found: {path} (give the folder a bertopt stage wrote)")
        if not path.is_dir():
            raise ArtifactError(
                f"{path} is a file, not an artifact folder; to use a model file as input, "
                "pass it as --model/SOURCE"
            )
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.exists() and not manifest_path.is_symlink():
            raise ArtifactError(
                f"{path} is not a bertopt artifact (no {MANIFEST_NAME}); create one with "
                "'bertopt export' or 'bertopt run'"
            )
        manifest = read_json_file(manifest_path, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH,
                                  fix="re-create the artifact", error=ArtifactError)
        if not isinstance(manifest, dict):
            check_manifest(manifest, manifest_path)  # names the problem
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{path}: artifact format version {version!r:.40} is not supported by this bertopt "
                f"(expects {FORMAT_VERSION}); re-create it with this version"
            )
        check_manifest(manifest, manifest_path)
        artifact = cls(path, manifest)
        if verify:
            artifact.verify()
        return artifact

    def verify(self) -> None:
        """Check what is on disk against the manifest, opening nothing the manifest does not name: every listed
        file is a regular file inside the folder (no symlink on the way) with the recorded size and sha256;
        the folders the runtime reads whole (tokenizer, a SavedModel) hold nothing unlisted; an ONNX model's
        external data is listed (and so was hashed)."""
        files = self.manifest.get("files", {})
        external = set(self.manifest.get("external_data", []))
        names_external_data = False  # whether the model file's bytes hold a "location" key (seen while hashing)
        model_head = b""  # the model file's first bytes: what it is, whatever its name says
        for rel, info in sorted(files.items()):
            kind = self._member_kind(rel)
            if kind == "missing":
                if rel in external:
                    raise ArtifactError(
                        f"artifact {self.path} is incomplete: {rel}, the external data holding the weights of "
                        f"{self.manifest.get('model_file')}, is missing; copy it back or re-create the artifact"
                    )
                raise ArtifactError(
                    f"artifact {self.path} is incomplete: {rel} is missing; re-create the artifact"
                )
            if kind != "file":
                raise ArtifactError(f"artifact {self.path}: {rel} is {kind}; an artifact holds regular files only "
                                    "(copy it with the file contents, not links), or re-create the artifact")
            try:
                fh = open_regular_file(self.path / rel)  # checked again on the descriptor: what is hashed is a file
            except OSError as exc:
                raise ArtifactError(f"artifact {self.path}: {rel} cannot be read ({exc.strerror}); fix its "
                                    "permissions or re-create the artifact") from None
            if fh is None:
                raise ArtifactError(f"artifact {self.path}: {rel} changed into something other than a file while "
                                    "it was being checked; re-create the artifact")
            with fh:
                size = os.fstat(fh.fileno()).st_size
                if size != info["size"]:
                    raise ArtifactError(
                        f"artifact {self.path} is corrupt: {rel} has {size} bytes, the manifest says "
                        f"{info['size']} (truncated or modified); re-create the artifact"
                    )
                digest = hashlib.sha256()
                tail = b""
                while block := fh.read(1 << 20):
                    digest.update(block)
                    if rel == self.manifest["model_file"] and not model_head:
                        model_head = block[:64]
                    if rel == self.manifest["model_file"] and not names_external_data:
                        names_external_data = _LOCATION_KEY in tail + block[:len(_LOCATION_KEY)] or \
                            _LOCATION_KEY in block
                        tail = block[-len(_LOCATION_KEY):]
            if digest.hexdigest() != info["sha256"]:
                raise ArtifactError(
                    f"artifact {self.path} is corrupt: sha256 of {rel} does not match the manifest "
                    "(the file was modified); re-create the artifact"
                )
        folders = [TOKENIZER_DIR] + ([self.manifest["model_file"]] if self.model_format == "tf-savedmodel" else [])
        for folder in folders:
            self._check_nothing_unlisted(folder)
        if self.model_format == "openvino-ir":
            weights = PurePosixPath(self.manifest["model_file"]).with_suffix(".bin").as_posix()
            if weights not in files:  # OpenVINO reads model.bin beside model.xml: it must have been hashed
                raise ArtifactError(f"artifact {self.path}: the OpenVINO IR's weights {weights} are not listed in the "
                                    "manifest, so they were never hashed; re-create the artifact")
        self._check_model_kind(model_head)
        if self.model_format == "onnx" and names_external_data:
            model_file = PurePosixPath(self.manifest["model_file"])
            try:
                names = external_data_locations(self.model_path, any_suffix=True)
            except UserError as exc:
                raise ArtifactError(f"artifact {self.path}: {exc}") from None
            for name in names:
                rel = (model_file.parent / name).as_posix()
                if rel not in files:
                    raise ArtifactError(
                        f"artifact {self.path}: {model_file} reads external data {name!r:.80} that the manifest "
                        "does not list, so it was never hashed; re-create the artifact (bertopt writes and hashes "
                        "external data next to the model)"
                    )

    def _check_model_kind(self, head: bytes) -> None:
        """The model file is what its format says by its bytes, not only by its name: OpenVINO picks its reader
        from the content, so an IR's "model.xml" holding an ONNX graph would be read with external data this
        check never saw, and an ONNX "model.onnx" holding IR XML with a weights file beside it."""
        if self.model_format not in ("onnx", "openvino-ir"):
            return
        is_xml = head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"<")
        if is_xml != (self.model_format == "openvino-ir"):
            found = "XML (an OpenVINO IR)" if is_xml else "not XML"
            raise ArtifactError(f"artifact {self.path}: its manifest says {self.model_format}, but "
                                f"{self.manifest['model_file']} is {found}; re-create the artifact")

    def _member_kind(self, rel: str) -> str:
        """What ``rel`` (already a plain relative path) is on disk, looking at every component without following
        links: "file", "missing", or what it is instead ("a symbolic link", "a device or FIFO", ...)."""
        current = self.path
        parts = rel.split("/")
        for i, part in enumerate(parts):
            current = current / part
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                return "missing"
            except OSError as exc:
                return f"unreadable ({exc.strerror})"
            last = i == len(parts) - 1
            if stat.S_ISLNK(mode):
                return "a symbolic link" if last else f"reached through the symbolic link {'/'.join(parts[:i + 1])}"
            if not last and not stat.S_ISDIR(mode):
                return "missing"
            if last and not stat.S_ISREG(mode):
                return "a folder" if stat.S_ISDIR(mode) else "a device, FIFO or socket, not a file"
        root = self.path.resolve()
        if not current.resolve().is_relative_to(root):  # cannot happen without a link; checked all the same
            return "outside the artifact folder"
        return "file"

    def _check_nothing_unlisted(self, folder: str) -> None:
        """Every file under ``folder`` (read whole by a library: the tokenizer, a SavedModel) is listed; nothing
        in it is a link or special file."""
        base = self.path / folder
        if base.is_symlink():
            raise ArtifactError(f"artifact {self.path}: {folder} is a symbolic link; an artifact holds regular "
                                "files only, re-create the artifact")
        if not base.is_dir():
            return
        files = self.manifest.get("files", {})
        for root, dirs, names in os.walk(base):
            for name in sorted(dirs + names):
                full = Path(root) / name
                rel = full.relative_to(self.path).as_posix()
                mode = os.lstat(full).st_mode
                if stat.S_ISDIR(mode):
                    continue
                if not stat.S_ISREG(mode):
                    what = "a symbolic link" if stat.S_ISLNK(mode) else "a device, FIFO or socket"
                    raise ArtifactError(f"artifact {self.path}: {rel} is {what}; an artifact holds regular files "
                                        "only, remove it or re-create the artifact")
                if rel not in files:
                    raise ArtifactError(f"artifact {self.path}: {rel} is not listed in the manifest, so it was "
                                        f"never hashed, but {folder}/ is read whole; remove it or re-create the "
                                        "artifact")

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
    def output_names(self) -> list[str]:
        return [o["name"] for o in self.outputs]

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

    def model_handle(self) -> ModelHandle:
        """What a runtime opens for this artifact (``runtime.open_session``, ``Predictor``): its model file and
        every file the runtime reads with it (external data; an OpenVINO IR's weights), which ``load`` verified,
        the runtime and options the manifest records, inputs, outputs, tokenizer folder and model info."""
        model_format = self.model_format
        model_file = PurePosixPath(self.manifest["model_file"])
        listed = self.manifest.get("files", {})
        companions = list(self.manifest.get("external_data", []))
        if model_format == "openvino-ir":  # the weights beside model.xml
            companions.append(model_file.with_suffix(".bin").as_posix())
            if FLOAT_SHORT_TEXTS in (self.manifest.get("runtime_options") or {}):  # the float copy, for short texts
                companions += [FLOAT_MODEL_FILE, PurePosixPath(FLOAT_MODEL_FILE).with_suffix(".bin").as_posix()]
        companions = [rel for rel in companions if rel in listed or self.digest == _STAGING]
        runtime = "tensorflow" if model_format in ("tf-graphdef", "tf-savedmodel") else self.runtime
        tensorflow = self.manifest.get("tensorflow")
        signature = tensorflow.get("signature") if isinstance(tensorflow, dict) else None
        return ModelHandle(
            model_format=model_format, inputs=tuple(self.inputs), outputs=tuple(self.outputs),
            tokenizer_path=self.tokenizer_path, model_info=self.model_info, path=self.path, digest=self.digest,
            model_path=self.model_path, model_files=(self.model_path, *(self.path / rel for rel in companions)),
            runtime=runtime, runtime_options=dict(self.manifest.get("runtime_options") or {}),
            signature=signature if isinstance(signature, str) else None, precision=self.precision)

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
        1 - cosine between a text's output alone and the same text inside other batches (``measure/batch.py``).
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
    if not info:
        return info
    out = dict(info)
    task = out.get("task") or DEFAULT_TASK
    # an unknown name stays as written (a manifest's is refused on load; task_of falls back on the outputs)
    out["task"] = known_task(task) or task
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
# what a model input may be fed (an input without a role is fed by its name): the Predictor's feeds
INPUT_ROLES = ("input_ids", "attention_mask", "token_type_ids", "input_mask", "segment_ids")
_TYPE_NAMES = {int: "a whole number", str: "a string", list: "a list", dict: "a mapping", float: "a number",
               bool: "true or false", type(None): "null"}
_NUMBER = (int, float)
_NONE = type(None)
# (section, key) -> types: nested fields that loading, inspecting, validating and serving read
_NESTED_SCHEMA: dict[tuple[str, str], tuple[type, ...]] = {
    ("lineage", "source"): (dict,), ("lineage", "parent"): (dict, _NONE), ("lineage", "params"): (dict, _NONE),
    ("lineage", "report"): (dict,), ("lineage", "stage"): (str, _NONE),
    ("model", "task"): (str, _NONE), ("model", "family"): (str,), ("model", "max_position_embeddings"): (int,),
    ("model", "max_seq_len"): (int, _NONE), ("model", "hidden_size"): (int, _NONE),
    ("model", "primary_output"): (str, _NONE), ("model", "id2label"): (dict, list, _NONE),
    ("model", "pair_input"): (bool,), ("model", "problem_type"): (str, _NONE),
}
_BATCH_INVARIANCE_SCHEMA: dict[str, tuple[type, ...]] = {
    "invariant": (bool,), "batch_dev": (*_NUMBER, _NONE), "bound": _NUMBER, "batch_sizes": (list,),
    "full_batches": (list,),
    "why": (str,),
}


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and (not isinstance(value, bool) or bool in types)


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
    for i, entry in enumerate(manifest["inputs"]):
        role = entry.get("role", entry["name"])
        if role not in INPUT_ROLES:
            raise bad(f"inputs[{i}] ('{entry['name']}') has role {role!r}, which bertopt cannot feed (roles: "
                      f"{', '.join(INPUT_ROLES)})")
    for (section, key), types in _NESTED_SCHEMA.items():
        if section in manifest and key in manifest[section] and not _type_ok(manifest[section][key], types):
            raise bad(f"'{section}.{key}' must be {' or '.join(_TYPE_NAMES[t] for t in types)}, got "
                      f"{manifest[section][key]!r:.40}")
    if "precision" in manifest and precision_problem(manifest["precision"]):
        raise bad(precision_problem(manifest["precision"]))
    info = manifest.get("model", {})
    if info.get("task") is not None and known_task(info["task"]) is None:  # no task: an embedding model
        raise bad(f"'model.task' is {info['task']!r:.40}, not a task bertopt knows ({', '.join(TASKS)})")
    problem = primary_output_problem(info.get("primary_output"), manifest["outputs"])
    if problem:
        raise bad(problem)
    for i, step in enumerate(manifest.get("history", [])):
        if not isinstance(step, dict) or not _type_ok(step.get("params"), (dict, _NONE)) \
                or not _type_ok(step.get("stage"), (str, _NONE)):
            raise bad(f"history[{i}] must be a mapping with a string 'stage' and a mapping 'params', got {step!r:.40}")
    for where_, info in (("batch_invariance", manifest.get("batch_invariance")),
                         ("validation.batch_invariance", manifest.get("validation", {}).get("batch_invariance"))):
        if info is None:
            continue
        if not isinstance(info, dict):
            raise bad(f"'{where_}' must be a mapping, got {info!r:.40}")
        for key, types in _BATCH_INVARIANCE_SCHEMA.items():
            if key in info and not _type_ok(info[key], types):
                raise bad(f"'{where_}.{key}' must be {_TYPE_NAMES[types[0]]}, got {info[key]!r:.40}")
    files = manifest["files"]
    for rel, info in files.items():
        problem = member_path_problem(rel)
        if problem:
            raise bad(f"'files' lists {rel!r:.80}, which {problem}; an artifact names only files inside its folder")
        if (not isinstance(info, dict) or isinstance(info.get("size"), bool) or not isinstance(info.get("size"), int)
                or info["size"] < 0 or not isinstance(info.get("sha256"), str)
                or len(info["sha256"]) != 64 or not set(info["sha256"]) <= set("0123456789abcdef")):
            raise bad(f"files[{rel!r:.80}] must be a mapping with a 'size' (bytes) and a 'sha256' (64 hex digits)")
    model_file = manifest["model_file"]
    problem = member_path_problem(model_file)
    if problem:
        raise bad(f"'model_file' {model_file!r:.80} {problem}; it must name a file the artifact lists")
    if manifest["model_format"] == "tf-savedmodel":  # a folder: its files are listed under it
        if not any(rel.startswith(model_file + "/") for rel in files):
            raise bad(f"'model_file' {model_file!r:.80} is a SavedModel folder of which 'files' lists nothing, so "
                      "nothing of it was hashed")
    elif model_file not in files:
        raise bad(f"'model_file' {model_file!r:.80} is not in 'files', so it was never hashed")
    if manifest["model_format"] == "openvino-ir" and not model_file.endswith(".xml"):
        raise bad(f"'model_file' {model_file!r:.80} is no .xml file, which an openvino-ir artifact's model is "
                  "(OpenVINO reads its weights from the .bin beside it)")
    for name in manifest.get("external_data", []):
        problem = member_path_problem(name)
        if problem or name not in files:
            raise bad(f"'external_data' names {name!r:.80}, which {problem or 'is not in files (never hashed)'}")
    short = (manifest.get("runtime_options") or {}).get(FLOAT_SHORT_TEXTS)
    if short is not None:
        if isinstance(short, bool) or not isinstance(short, int) or short < 1:
            raise bad(f"'runtime_options.{FLOAT_SHORT_TEXTS}' must be a whole number of tokens (at least 1), got "
                      f"{short!r:.40}")
        if manifest["model_format"] != "openvino-ir":
            raise bad(f"'runtime_options.{FLOAT_SHORT_TEXTS}' is for OpenVINO IR artifacts (static int8 with a float "
                      f"copy), not {manifest['model_format']}")
        for name in (FLOAT_MODEL_FILE, PurePosixPath(FLOAT_MODEL_FILE).with_suffix(".bin").as_posix()):
            if name not in files:
                raise bad(f"'runtime_options.{FLOAT_SHORT_TEXTS}' runs short texts on {name}, which 'files' does not "
                          "list (never hashed)")
    if manifest["digest"] != _digest_of_files(files):
        raise bad("'digest' is not the digest of the file hashes it lists (a file's hash was changed after the "
                  "artifact was made, so it is not the artifact that digest names)")


def is_artifact(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


class ArtifactWriter:
    """Context manager producing one artifact atomically.

    with ArtifactWriter(out_dir, stage="quantize", params=cfg, parent=art) as w:
        save model into w.dir / "model.onnx"
        w.copy_tokenizer(art)
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="int8-dynamic")
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
        from bertopt.output_paths import check_links_inside, check_output, output_lock, sweep_stale, temp_sibling

        if self.parent is not None:
            inputs = [self.parent.path]
        else:  # the source model a first stage reads (a built-in model lives in bertopt's cache)
            builtin = str(self.source.get("spec") or "").startswith("builtin:")
            inputs = [self.source.get("path") if not builtin else None]
        self.out_dir = check_output(self.out_dir, kind="artifact", inputs=inputs, replace=self.overwrite)
        if self.parent is not None:  # whatever a stage copies from its input must be the input's own files
            check_links_inside(self.parent.path, "input artifact")
        self._lock = output_lock(self.out_dir)
        self._lock.__enter__()
        try:
            if sweep_stale(self.out_dir) and not self.overwrite:  # it may have put back an interrupted output
                check_output(self.out_dir, kind="artifact", inputs=inputs, replace=False)
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.dir = temp_sibling(self.out_dir)
            self.dir.mkdir()
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        self._t0 = time.perf_counter()
        return self

    @contextmanager
    def scratch(self) -> Iterator[Path]:
        """A scratch folder for intermediate models, inside the folder the artifact is built in and removed when the
        block ends: a writer killed by SIGKILL leaves it where the next run's sweep removes it with the rest, not
        in the system temp dir."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix=".scratch-", dir=self.dir) as folder:
            yield Path(folder)

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
        if precision_problem(precision):
            raise ValueError(precision_problem(precision))
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
                                   "digest": _STAGING, "files": {}})

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is not None:
                full = out_of_space(exc, self.dir) if isinstance(exc, Exception) else None
                shutil.rmtree(self.dir, ignore_errors=True)
                if isinstance(exc, UserError) and len(exc.args) == 1 and str(self.dir) in str(exc.args[0]):
                    # a check that ran on the folder being written named it: it is gone, name the output instead
                    exc.args = (str(exc.args[0]).replace(str(self.dir), f"{self.out_dir} (being written)"),)
                if full:  # one line, not a library's traceback from deep inside its writer
                    raise UserError(f"could not write the artifact {self.out_dir}: {full}; free space there or "
                                    "choose another --out") from exc
                return False
            try:
                self._finish()
            except BaseException:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise
            return False
        finally:
            self._lock.__exit__(None, None, None)

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
        # Rename into place; an existing artifact (overwrite) is moved aside first, then removed. Checked again
        # under the lock: something may have appeared there while the stage ran (not another bertopt: it would
        # have needed the lock).
        from bertopt.output_paths import check_output, move_into_place

        if self.out_dir.exists():
            check_output(self.out_dir, kind="artifact", replace=self.overwrite)
        move_into_place(self.dir, self.out_dir)
        self.artifact = Artifact(self.out_dir, manifest)
