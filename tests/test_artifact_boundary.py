"""An artifact folder is a trust boundary: hostile manifests and folders are refused through the real CLI with one
line and exit 2, before anything outside the folder (or anything that is not a regular file) is opened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertopt.artifact import MANIFEST_NAME, Artifact, _digest_of_files, sha256_file  # noqa
from bertopt.errors import ArtifactError

# Python-level opens recorded while a case runs (an audit hook cannot be removed, so it records only when armed)
_OPENED: list[str] | None = None


def _audit(event, args):
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _rehash(folder: Path, manifest: dict, *names: str) -> dict:
    """List ``names`` (paths inside ``folder``, following links as a careless hasher would) with their true size
    and sha256, and set the digest to match, so that only the check under test can refuse the artifact."""
    for name in names:
        file = folder / name
        manifest["files"][name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    manifest["digest"] = _digest_of_files(manifest["files"])
    return manifest


class Hostile:
    def __init__(self, tiny: Path, tmp: Path):
        self.tiny, self.tmp = tiny, tmp
        self.outside = tmp / "outside"
        self.outside.mkdir()
        self.secret = self.outside / "secret"
        self.secret.write_text("a file outside the artifact\n")
        shutil.copy2(tiny / "model.onnx", self.outside / "model.onnx")

    def copy(self) -> tuple[Path, dict]:
        dest = self.tmp / "art"
        shutil.copytree(self.tiny, dest)
        return dest, json.loads((dest / MANIFEST_NAME).read_text())

    @staticmethod
    def save(dest: Path, manifest: dict) -> Path:
        (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
        return dest


def _files_escape(h: Hostile):
    dest, m = h.copy()
    (dest / "sub").mkdir()
    m["files"]["../outside/secret"] = {"size": h.secret.stat().st_size, "sha256": sha256_file(h.secret)}
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "lists '../outside/secret', which climbs out of the artifact folder"


def _files_absolute(h: Hostile):
    dest, m = h.copy()
    m["files"][str(h.secret)] = {"size": h.secret.stat().st_size, "sha256": sha256_file(h.secret)}
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "which is an absolute path"


def _dev_zero_absolute(h: Hostile):
    dest, m = h.copy()
    m["files"]["/dev/zero"] = {"size": 0, "sha256": "0" * 64}
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "'/dev/zero', which is an absolute path"


def _dev_zero_link(h: Hostile):
    dest, m = h.copy()
    os.symlink("/dev/zero", dest / "zero")
    m["files"]["zero"] = {"size": 0, "sha256": "0" * 64}
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "zero is a symbolic link"


def _fifo_listed(h: Hostile):
    dest, m = h.copy()
    os.mkfifo(dest / "pipe")
    m["files"]["pipe"] = {"size": 0, "sha256": "0" * 64}
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "pipe is a device, FIFO or socket, not a file"


def _model_file_escape(h: Hostile):
    dest, m = h.copy()
    m["model_file"] = "../outside/model.onnx"
    return h.save(dest, m), "'model_file' '../outside/model.onnx' climbs out of the artifact folder"


def _model_file_absolute(h: Hostile):
    dest, m = h.copy()
    m["model_file"] = str(h.outside / "model.onnx")
    return h.save(dest, m), "is an absolute path"


def _model_file_unlisted(h: Hostile):
    dest, m = h.copy()
    shutil.copy2(h.outside / "model.onnx", dest / "other.onnx")
    m["model_file"] = "other.onnx"
    return h.save(dest, m), "'model_file' 'other.onnx' is not in 'files', so it was never hashed"


def _model_is_link_out(h: Hostile):
    dest, m = h.copy()
    (dest / "model.onnx").unlink()
    os.symlink(h.outside / "model.onnx", dest / "model.onnx")
    return h.save(dest, _rehash(dest, m, "model.onnx")), "model.onnx is a symbolic link"


def _through_linked_folder(h: Hostile):
    dest, m = h.copy()
    os.symlink(h.outside, dest / "sub")
    return h.save(dest, _rehash(dest, m, "sub/secret")), "reached through the symbolic link sub"


def _tokenizer_folder_link(h: Hostile):
    dest, m = h.copy()
    shutil.copytree(dest / "tokenizer", h.outside / "tokenizer")
    shutil.rmtree(dest / "tokenizer")
    os.symlink(h.outside / "tokenizer", dest / "tokenizer")
    return h.save(dest, m), "reached through the symbolic link tokenizer"


def _tokenizer_unlisted_file(h: Hostile):
    dest, m = h.copy()
    (dest / "tokenizer" / "tokenizer_config.json").write_text("{}")
    m["files"].pop("tokenizer/tokenizer_config.json", None)
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "tokenizer/tokenizer_config.json is not listed in the manifest"


def _swapped_model_old_digest(h: Hostile):
    """The model replaced and its sha256 and size updated, the digest (the one validation and /info report) kept."""
    dest, m = h.copy()
    data = bytearray((dest / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (dest / "model.onnx").write_bytes(bytes(data))
    digest = m["digest"]
    m = _rehash(dest, m, "model.onnx")
    m["digest"] = digest
    return h.save(dest, m), "'digest' is not the digest of the file hashes it lists"


def _deep_manifest(h: Hostile):
    dest, _ = h.copy()
    (dest / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    return dest, "nests lists or objects deeper than 64 levels"


def _deep_but_parsable(h: Hostile):
    dest, m = h.copy()
    nested: list = []
    for _ in range(200):
        nested = [nested]
    m["model"]["note"] = nested
    return h.save(dest, m), "nests lists or objects deeper than 64 levels"


def _huge_manifest(h: Hostile):
    dest, m = h.copy()
    m["model"]["padding"] = "x" * (17 << 20)
    return h.save(dest, m), "is larger than 16 MiB"


def _manifest_fifo(h: Hostile):
    dest, _ = h.copy()
    (dest / MANIFEST_NAME).unlink()
    os.mkfifo(dest / MANIFEST_NAME)
    return dest, "bertopt.json is not a regular file"


def _manifest_link_out(h: Hostile):
    dest, m = h.copy()
    (h.outside / MANIFEST_NAME).write_text(json.dumps(m))
    (dest / MANIFEST_NAME).unlink()
    os.symlink(h.outside / MANIFEST_NAME, dest / MANIFEST_NAME)
    return dest, "bertopt.json is not a regular file"


def _bad_sha(h: Hostile):
    dest, m = h.copy()
    m["files"]["model.onnx"]["sha256"] = "../../etc/hostname"
    m["digest"] = _digest_of_files(m["files"])
    return h.save(dest, m), "must be a mapping with a 'size' (bytes) and a 'sha256' (64 hex digits)"


def _external_data_unlisted(h: Hostile):
    """The model keeps its weights in model.onnx_data, which the manifest does not list (never hashed)."""
    import onnx

    from bertopt.onnx_graph.util import save_onnx

    dest, m = h.copy()
    save_onnx(onnx.load(str(dest / "model.onnx")), dest / "model.onnx", external=True)
    return h.save(dest, _rehash(dest, m, "model.onnx")), \
        "reads external data 'model.onnx_data' that the manifest does not list"


def _external_data_escape(h: Hostile):
    """The (listed, hashed) model names external data outside the folder: ../outside/weights."""
    dest, m = h.copy()
    _point_external_data_outside(dest / "model.onnx", h.outside)
    return h.save(dest, _rehash(dest, m, "model.onnx")), "which climbs out of the model's folder (..)"


def _external_data_in_subgraph(h: Hostile):
    """External data named by an initialiser inside an If node's branch (a subgraph), pointing outside."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    dest, m = h.copy()
    weight = numpy_helper.from_array(np.zeros((4,), np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../outside/secret"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    branch = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "then", [], [out], [weight])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "else", [], [out])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", 1, [4])],
        [out])
    onnx.save(helper.make_model(graph), str(dest / "model.onnx"))
    return h.save(dest, _rehash(dest, m, "model.onnx")), "'../outside/secret', which climbs out of the model's folder"


def _model_named_otherwise_with_unlisted_data(h: Hostile):
    """An ONNX model file not named *.onnx still has its external data checked."""
    import onnx

    from bertopt.onnx_graph.util import save_onnx

    dest, m = h.copy()
    save_onnx(onnx.load(str(dest / "model.onnx")), dest / "model.bin", external=True)
    m["model_file"] = "model.bin"
    return h.save(dest, _rehash(dest, m, "model.bin")), \
        "reads external data 'model.bin_data' that the manifest does not list"


def _external_data_key_spelt_long(h: Hostile):
    """The "location" key's length written as a two-byte varint (legal protobuf: every parser reads the key as
    "location"), so that a search for the usual bytes of the key finds none; the runtime still reads the file."""
    import onnx

    from bertopt.onnx_graph.util import save_onnx

    dest, m = h.copy()
    save_onnx(onnx.load(str(dest / "model.onnx")), dest / "model.onnx", external=True)
    model = onnx.load(str(dest / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.key = "locationX"  # as many bytes as the long spelling of "location", so no length changes
    data = model.SerializeToString().replace(b"\x0a\x09locationX", b"\x0a\x88\x00location")
    assert b"\x0a\x08location" not in data
    (dest / "model.onnx").write_bytes(data)
    assert onnx.load(str(dest / "model.onnx"), load_external_data=False).graph.initializer[0].external_data
    return h.save(dest, _rehash(dest, m, "model.onnx")), \
        "reads external data 'model.onnx_data' that the manifest does not list"


def _external_data_in_a_local_function(h: Hostile):
    """External data named by a Constant inside one of the model's local functions (which a runtime inlines)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    dest, m = h.copy()
    weight = numpy_helper.from_array(np.zeros((4,), np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "hidden.bin"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    (dest / "hidden.bin").write_bytes(bytes(16))
    function = helper.make_function("local", "AddW", ["x"], ["y"],
                                    [helper.make_node("Constant", [], ["w"], value=weight),
                                     helper.make_node("Add", ["x", "w"], ["y"])],
                                    [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("AddW", ["x"], ["y"], domain="local")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    onnx.save(model, str(dest / "model.onnx"))
    return h.save(dest, _rehash(dest, m, "model.onnx")), \
        "reads external data 'hidden.bin' that the manifest does not list"


def _openvino_ir_that_is_onnx(h: Hostile):
    """A manifest saying openvino-ir whose model file is an ONNX graph (OpenVINO reads either, by content) with
    external data the ONNX check would not look at in an IR."""
    dest, m = h.copy()
    _point_external_data_outside(dest / "model.onnx", h.outside)
    (dest / "model.onnx").rename(dest / "model.xml")
    (dest / "model.bin").write_bytes(b"weights")
    del m["files"]["model.onnx"]
    m.update(model_format="openvino-ir", runtime="openvino", model_file="model.xml")
    return h.save(dest, _rehash(dest, m, "model.xml", "model.bin")), \
        "its manifest says openvino-ir, but model.xml is not XML"


def _openvino_ir_named_onnx(h: Hostile):
    dest, m = h.copy()
    (dest / "model.bin").write_bytes(b"weights")
    m.update(model_format="openvino-ir", runtime="openvino")
    return h.save(dest, _rehash(dest, m, "model.bin")), "'model_file' 'model.onnx' is no .xml file"


def _onnx_that_is_openvino_xml(h: Hostile):
    """A manifest saying onnx whose model file is OpenVINO IR XML (OpenVINO would read the unlisted model.bin)."""
    dest, m = h.copy()
    (dest / "model.onnx").write_text('<?xml version="1.0"?>\n<net name="x" version="11"><layers/></net>\n')
    m["runtime"] = "openvino"
    return h.save(dest, _rehash(dest, m, "model.onnx")), "its manifest says onnx, but model.onnx is XML"


def _point_external_data_outside(model_file: Path, outside: Path) -> None:
    import onnx

    from bertopt.onnx_graph.util import save_onnx

    save_onnx(onnx.load(str(model_file)), model_file, external=True)
    data = model_file.with_name(model_file.name + "_data")
    shutil.move(data, outside / "weights")
    model = onnx.load(str(model_file), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside/weights"
    onnx.save(model, str(model_file))


def _float_copy_linked_out(h: Hostile):
    """A static int8 IR whose float copy for short texts (``runtime_options.float_short_texts``) is a link to a
    model outside, unlisted: refused before OpenVINO could read it."""
    import openvino as ov

    dest, m = h.copy()
    model = ov.Core().read_model(str(dest / "model.onnx"))
    ov.save_model(model, str(dest / "model.xml"))
    ov.save_model(model, str(h.outside / "float.xml"))
    (dest / "model.onnx").unlink()
    del m["files"]["model.onnx"]
    for name in ("float.xml", "float.bin"):
        os.symlink(h.outside / name, dest / name)
    m.update(model_format="openvino-ir", runtime="openvino", model_file="model.xml",
             runtime_options={"float_short_texts": 16})
    return h.save(dest, _rehash(dest, m, "model.xml", "model.bin")), \
        "'runtime_options.float_short_texts' runs short texts on float.xml, which 'files' does not list"


def _float_copy_on_onnx(h: Hostile):
    dest, m = h.copy()
    m["runtime_options"] = {"float_short_texts": 16}
    return h.save(dest, m), "'runtime_options.float_short_texts' is for OpenVINO IR artifacts"


CASES = {f.__name__.lstrip("_"): f for f in (
    _files_escape, _files_absolute, _dev_zero_absolute, _dev_zero_link, _fifo_listed, _model_file_escape,
    _model_file_absolute, _model_file_unlisted, _model_is_link_out, _through_linked_folder, _tokenizer_folder_link,
    _tokenizer_unlisted_file, _swapped_model_old_digest, _deep_manifest, _deep_but_parsable, _huge_manifest,
    _manifest_fifo, _manifest_link_out, _bad_sha, _external_data_unlisted, _external_data_escape,
    _external_data_in_subgraph, _model_named_otherwise_with_unlisted_data, _external_data_key_spelt_long,
    _external_data_in_a_local_function, _openvino_ir_that_is_onnx, _openvino_ir_named_onnx,
    _onnx_that_is_openvino_xml, _float_copy_linked_out, _float_copy_on_onnx)}


@pytest.mark.parametrize("command", ["inspect", "validate"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_artifact_is_refused_with_one_line_and_nothing_outside_is_opened(case, command, tiny_onnx,
                                                                                   tmp_path, cli):
    global _OPENED
    hostile = Hostile(tiny_onnx.path, tmp_path)
    folder, message = CASES[case](hostile)
    args = ["inspect", folder] if command == "inspect" else \
        ["validate", folder, "--report-dir", tmp_path / "reports"]
    _OPENED = []
    try:
        code, out, err = cli(*args)
    finally:
        opened, _OPENED = _OPENED, None
    assert code == 2, (out, err)
    assert message in err, err
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out
    outside = [p for p in opened if Path(p).absolute().is_relative_to(hostile.outside)
               or p.startswith("/dev/")]
    assert outside == []
    assert not (tmp_path / "reports").exists()  # validate wrote no report for an artifact it refused


@pytest.mark.parametrize("case", ["dev_zero_link", "fifo_listed", "manifest_fifo", "deep_manifest"])
def test_special_files_never_hang_the_real_command(case, tiny_onnx, tmp_path):
    """As a separate process (a hang would be caught by the timeout): exit 2 and the one line."""
    folder, message = CASES[case](Hostile(tiny_onnx.path, tmp_path))
    bertopt = Path(sys.executable).with_name("bertopt")
    proc = subprocess.run([str(bertopt), "inspect", str(folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_not_a_tokenizer_is_one_line_naming_the_file(tiny_onnx, tmp_path, cli):
    """A tokenizer.json that is valid JSON (listed and hashed) but no tokenizer: refused where it is loaded."""
    dest = tmp_path / "art"
    shutil.copytree(tiny_onnx.path, dest)
    (dest / "tokenizer" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "nope"}}))
    m = _rehash(dest, json.loads((dest / MANIFEST_NAME).read_text()), "tokenizer/tokenizer.json")
    (dest / MANIFEST_NAME).write_text(json.dumps(m))
    code, out, err = cli("validate", dest, "--report-dir", tmp_path / "reports")
    assert code == 2, err
    assert f"{dest / 'tokenizer' / 'tokenizer.json'} is not a tokenizer the tokenizers library can read" in err
    assert "save the tokenizer again" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "reports").exists()


def test_export_from_onnx_whose_external_data_points_outside_is_refused(tiny_onnx, tmp_path, cli):
    """Importing an ONNX file (bertopt export model.onnx) whose external data climbs out of its folder."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(tiny_onnx.path / "model.onnx", src / "model.onnx")
    (tmp_path / "outside").mkdir()
    _point_external_data_outside(src / "model.onnx", tmp_path / "outside")
    code, out, err = cli("export", src / "model.onnx", "--tokenizer", tiny_onnx.tokenizer_path,
                         "--out", tmp_path / "out")
    assert code == 2, err
    assert "keeps weights in external data '../outside/weights', which climbs out of the model's folder" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_good_artifacts_still_load_with_external_data_listed(tiny_onnx, tmp_path):
    """The checks refuse what they should and nothing else: an artifact written with external data loads, and so
    does a verified copy reached through a symlinked parent folder (the user's own path, not the manifest's)."""
    import onnx

    from bertopt.artifact import ArtifactWriter
    from bertopt.onnx_graph.util import save_onnx

    with ArtifactWriter(tmp_path / "ext", stage="test", parent=tiny_onnx) as w:
        save_onnx(onnx.load(str(tiny_onnx.model_path)), w.dir / "model.onnx", external=True)
        w.copy_tokenizer(tiny_onnx)
        w.set_model("model.onnx", "onnx", tiny_onnx.inputs, tiny_onnx.outputs, "fp32")
    art = Artifact.load(tmp_path / "ext")
    assert art.manifest["external_data"] == ["model.onnx_data"] and "model.onnx_data" in art.manifest["files"]
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
    try:
        assert Artifact.load(tmp_path.parent / f"{tmp_path.name}-link" / "ext").digest == art.digest
    finally:
        (tmp_path.parent / f"{tmp_path.name}-link").unlink()


def test_manifest_loader_refuses_without_verify_too(tiny_onnx, tmp_path):
    """Path and digest checks are on the manifest alone: even a load that skips hashing refuses them."""
    hostile = Hostile(tiny_onnx.path, tmp_path)
    folder, message = _swapped_model_old_digest(hostile)
    with pytest.raises(ArtifactError, match="'digest' is not the digest"):
        Artifact.load(folder, verify=False)


def test_export_names_the_source_tokenizer_that_is_no_tokenizer(tiny_hf, tmp_path, cli):
    """bertopt export of a Hugging Face folder whose tokenizer.json is valid JSON but no tokenizer: the user's
    file is named (not a temporary copy), exit 2, nothing written."""
    src = tmp_path / "hf"
    shutil.copytree(tiny_hf, src)
    (src / "tokenizer.json").write_text(json.dumps({"version": "1.0", "truncation": None}))
    code, out, err = cli("export", src, "--out", tmp_path / "out")
    assert code == 2, err
    assert f"error: {src / 'tokenizer.json'} is not a tokenizer the tokenizers library can read" in err
    assert "save the tokenizer again" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_serve_refuses_a_hostile_artifact_before_starting_anything(tiny_onnx, tmp_path, cli):
    from bertopt.harness import free_port

    hostile = Hostile(tiny_onnx.path, tmp_path)
    folder, message = _model_is_link_out(hostile)
    port = free_port()
    port_out = free_port()
    while port_out == port:
        port_out = free_port()
    code, out, err = cli("serve", folder, "--port", port, "--port-out", port_out)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "ready on" not in out
