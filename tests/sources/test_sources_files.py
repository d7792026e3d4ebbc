"""A model folder's files are read only where they are its own regular files (``bertopt.sources.files``): a link
that leads out of the folder (``vocab.txt -> ~/.ssh/id_rsa`` was copied into the artifact), a FIFO (hung the
export), a module path naming another folder, the folder's own tokenizer code (run on a "y" at a prompt), damaged
weights and pickles: each one line, exit 2, nothing written. A Hugging Face cache snapshot (links into its repo's
blobs) still exports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertopt.errors import UserError
from bertopt.sources.files import check_source_file, folder_name_problem

REPO = Path(__file__).resolve().parents[2]


def _copy(tiny_hf, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf, folder)
    return folder


def _refused(cli, folder, tmp_path, message: str, *args) -> None:
    code, out, err = cli("export", folder, "--out", tmp_path / "out", *args)
    assert code == 2 and message in err, (out, err)
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_links_inside_the_folder_or_into_a_hub_cache_blobs_folder_are_followed(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0123abcd").write_text("{}")
    snapshot = repo / "snapshots" / "rev1"
    (snapshot / "1_Pooling").mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/0123abcd")
    (snapshot / "1_Pooling" / "config.json").symlink_to("../../../blobs/0123abcd")
    (snapshot / "alias.json").symlink_to("config.json")
    for file in ("config.json", "1_Pooling/config.json", "alias.json"):
        assert check_source_file(snapshot, snapshot / file) == snapshot / file
    secret = tmp_path / "secret"
    secret.write_text("private")
    (snapshot / "vocab.txt").symlink_to(secret)
    with pytest.raises(UserError, match=f"vocab.txt is a link to {secret}, outside the model folder"):
        check_source_file(snapshot, snapshot / "vocab.txt")
    os.mkfifo(snapshot / "fifo.json")
    with pytest.raises(UserError, match="fifo.json is not a regular file"):
        check_source_file(snapshot, snapshot / "fifo.json")
    assert [folder_name_problem(p) for p in ("", "1_Pooling", "a/b")] == [None, None, None]
    assert all(folder_name_problem(p) for p in ("/etc", "../x", "a/../../x", 3, None))


def test_a_tokenizer_file_linked_outside_is_refused_not_copied(tiny_hf, tmp_path, cli):
    folder = _copy(tiny_hf, tmp_path)
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    (folder / "special_tokens_map.json").symlink_to(secret)
    _refused(cli, folder, tmp_path, f"special_tokens_map.json is a link to {secret}, outside the model folder")


@pytest.mark.parametrize("path", ["absolute", "../outside_dense"])
def test_a_module_path_that_leads_out_of_the_folder_is_refused(tiny_hf, tmp_path, cli, path):
    folder = _copy(tiny_hf, tmp_path)
    outside = tmp_path / "outside_dense"
    shutil.copytree(folder / "1_Pooling", outside)
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        if module.get("path") == "1_Pooling":
            module["path"] = str(outside) if path == "absolute" else path
    (folder / "modules.json").write_text(json.dumps(modules))
    _refused(cli, folder, tmp_path, "leads out of the model folder")


def test_a_fifo_in_the_folder_does_not_hang_the_export(tiny_hf, tmp_path, cli):
    folder = _copy(tiny_hf, tmp_path)
    (folder / "modules.json").unlink()
    os.mkfifo(folder / "modules.json")
    _refused(cli, folder, tmp_path, "modules.json is not a regular file")


def test_damaged_safetensors_and_a_pickle_are_one_line(tiny_hf, tmp_path, cli):
    import pickle

    folder = _copy(tiny_hf, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes((2**62).to_bytes(8, "little") + weights.read_bytes()[8:])
    _refused(cli, folder, tmp_path, "model.safetensors is damaged")

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    code, out, err = cli("export", folder, "--out", tmp_path / "out")
    assert code == 2 and "holds more than plain tensors" in err and "weights_only" not in err.split(";")[1], err
    assert not marker.exists()  # never unpickled


def test_the_folders_own_tokenizer_code_never_runs(tiny_onnx, tmp_path):
    """A folder without tokenizer.json whose tokenizer_config names its own class (auto_map): transformers asked
    "Do you wish to run the custom code? [y/N]" and ran it on a "y" from stdin."""
    folder = tmp_path / "onnx_rc"
    folder.mkdir()
    shutil.copy(tiny_onnx.path / "model.onnx", folder / "model.onnx")
    (folder / "spm.model").write_bytes(b"not really a sentencepiece model")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}}))
    marker = tmp_path / "pwned"
    (folder / "evil_tok.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                        "from transformers import PreTrainedTokenizerFast\n"
                                        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "export", str(folder / "model.onnx"), "--out",
                           str(tmp_path / "out")], input="y\ny\n", capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert not marker.exists(), proc.stderr
    assert proc.returncode == 2 and "custom code" not in proc.stdout + proc.stderr.lower().split("error:")[0]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_hub_cache_snapshot_still_exports(tiny_hf, tmp_path, cli):
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    for file in sorted(p for p in Path(tiny_hf).rglob("*") if p.is_file()):
        rel = file.relative_to(tiny_hf)
        blob = repo / "blobs" / f"{abs(hash(str(rel))):x}"
        shutil.copy(file, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    code, out, err = cli("export", snapshot, "--out", tmp_path / "out")
    assert code == 0, err
