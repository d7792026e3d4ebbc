"""The command line: --help is instant and teaches; every user error is one line, exit 2, nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def test_help_does_not_import_heavy_libraries():
    code = ("import sys; from bertopt.cli import app; import typer; "
            "heavy = [m for m in ('torch', 'tensorflow', 'pyspark', 'onnxruntime', 'transformers') "
            "if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_stages_and_commands(cli):
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("export", "prune", "optimize", "quantize", "run", "inspect"):
        assert command in out
    code, out, _ = cli("quantize", "--help")
    assert code == 0 and "int8-dynamic" in out and "--accuracy-target" in out


def _one_line(err):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_model_path(cli, tmp_path):
    code, _, err = cli("export", tmp_path / "nope", "--out", tmp_path / "out")
    assert code == 2 and "model not found" in _one_line(err)
    assert not (tmp_path / "out").exists()


def test_folder_that_is_not_a_model(cli, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    code, _, err = cli("export", tmp_path / "junk", "--out", tmp_path / "out")
    assert code == 2 and "is not a model bertopt can read" in _one_line(err)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    code, _, err = cli("export", tmp_path / "cfg", "--out", tmp_path / "out")
    assert code == 2 and "no PyTorch weights" in _one_line(err)
    assert not (tmp_path / "out").exists()


def test_corrupt_onnx_file(cli, tmp_path, tiny_onnx):
    shutil.copytree(tiny_onnx.tokenizer_path, tmp_path / "m")
    (tmp_path / "m" / "model.onnx").write_bytes(b"\x08\x07garbage-not-a-protobuf" * 10)
    code, _, err = cli("export", tmp_path / "m" / "model.onnx", "--out", tmp_path / "out")
    assert code == 2 and "not a readable ONNX model" in _one_line(err) or "not a usable ONNX model" in err
    assert not (tmp_path / "out").exists()


def test_artifact_with_bad_hash(cli, tmp_path, tiny_onnx):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_onnx.path, bad)
    with open(bad / "model.onnx", "ab") as fh:
        fh.write(b"x")
    code, _, err = cli("quantize", bad, "--out", tmp_path / "out")
    assert code == 2 and "is corrupt" in _one_line(err) and "re-create the artifact" in err
    assert not (tmp_path / "out").exists()


def test_unknown_recipe_key_and_unknown_stage(cli, tmp_path):
    (tmp_path / "r.yaml").write_text("model: builtin:minilm\nstages: [export]\nmodle: x\n")
    code, _, err = cli("run", tmp_path / "r.yaml", "--out", tmp_path / "a")
    assert code == 2 and "unknown key 'modle'" in _one_line(err)
    (tmp_path / "s.yaml").write_text("stages: [{distill: {}}]\n")
    code, _, err = cli("run", tmp_path / "s.yaml", "--out", tmp_path / "a")
    assert code == 2 and "unknown stage 'distill'" in _one_line(err)
    code, _, err = cli("run", tmp_path / "missing.yaml")
    assert code == 2 and "recipe not found" in _one_line(err)
    assert not (tmp_path / "a").exists()


def test_bad_option_value_is_exit_2(cli, tiny_onnx, tmp_path):
    code, _, err = cli("quantize", tiny_onnx.path, "--out", tmp_path / "o", "--mode", "int4")
    assert code == 2 and "'mode' must be one of" in _one_line(err)
    code, _, err = cli("quantize", tiny_onnx.path, "--out", tmp_path / "o", "--calibration-size", "lots")
    assert code == 2
    assert not (tmp_path / "o").exists()


def test_stage_by_stage_and_inspect(cli, tiny_onnx, tmp_path):
    code, out, err = cli("optimize", tiny_onnx.path, "--out", tmp_path / "opt")
    assert code == 0, err
    assert "fused: EmbedLayerNormalization x1, Attention x2" in out.replace("\n", " ")
    code, out, err = cli("quantize", tmp_path / "opt", "--out", tmp_path / "fp16", "--mode", "fp16")
    assert code == 0, err
    code, out, err = cli("inspect", tmp_path / "fp16")
    assert code == 0, err
    for expected in ("fp16", "export", "optimize", "quantize", "SkipLayerNormalization", "sentence_embedding"):
        assert expected in out


@pytest.mark.parametrize("argv", [["stages"]])
def test_stages_lists_parameters(cli, argv):
    code, out, _ = cli(*argv)
    assert code == 0 and "check_tolerance" in out and "per_channel" in out


def test_export_self_check_failure_is_one_line_and_writes_nothing(cli, tiny_hf, tmp_path):
    # the export compares itself with PyTorch on real text; the tiny BERT's hidden states reach ~3.5, so the
    # check is relative to that magnitude (float32 summation order alone moves wide models' states by ~1e-4)
    code, out, err = cli("export", tiny_hf, "--check-tolerance", "0", "--out", tmp_path / "o")
    assert code == 2, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: exported ONNX differs from PyTorch by ") and "of the output's magnitude" in line
    assert not (tmp_path / "o").exists()
    code, out, err = cli("export", tiny_hf, "--out", tmp_path / "ok")
    assert code == 0 and "max abs diff vs pytorch" in out


# a real interpreter in which one optional package cannot be imported, running the CLI
_WITHOUT = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
from bertopt.cli import main
main(sys.argv[1:])
"""


def test_a_missing_optional_package_is_one_line_naming_the_extra(tiny_onnx, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "static"
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "300"}
    done = subprocess.run([sys.executable, "-c", _WITHOUT.replace("BLOCKED", "'nncf'"), "quantize",
                           str(tiny_onnx.path), "--mode", "int8-static", "--runtime", "openvino", "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180)
    assert done.returncode == 2, done.stderr
    assert _one_line(done.stderr) == ("error: Python package 'nncf' is not installed (needed for static int8 for "
                                      "the OpenVINO runtime); install it with: pip install 'bertopt[openvino]'")
    assert not out.exists()
