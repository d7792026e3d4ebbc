"""A full disk (or a file size limit) while a stage writes its artifact: one line naming the folder and the fix,
exit 2, and nothing half-written left behind, whichever library was writing (onnx, OpenVINO's save_model)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _bertopt(*args, limit_bytes: int | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    def limit():  # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG ("File too large")
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "bertopt.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=600, preexec_fn=limit if limit_bytes else None)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_file_size_limit_hit_while_writing_an_artifact_is_one_line_and_exit_2(tiny_onnx, tmp_path):
    # prune writes model.onnx (the tiny model's weights, far over 64 KB) into its temp folder: the write fails
    out = tmp_path / "pruned"
    done = _bertopt("prune", tiny_onnx.path, "--out", out, limit_bytes=64 * 1024)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert f"could not write the artifact {out}: File too large; free space there or choose another --out" in \
        " ".join(lines[0].split())
    assert _leftovers(tmp_path) == []  # no artifact, no temp folder


@pytest.fixture
def small_file_system(tmp_path):
    """A 16 KiB tmpfs, smaller than any model file (needs root and mount rights: skipped where neither is given)."""
    mount = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_under_openvinos_own_writer_is_one_line_and_exit_2(tiny_onnx, small_file_system):
    # OpenVINO's save_model reports a full disk as its own RuntimeError (no errno): still one line, exit 2
    pytest.importorskip("nncf")
    out = small_file_system / "s8"
    done = _bertopt("quantize", tiny_onnx.path, "--mode", "int8-static", "--runtime", "openvino",
                    "--calibration-size", "16", "--accuracy-target", "cos_min=0.5", "--out", out)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"could not write the artifact {out}: " in lines[0] and "free space there or choose another --out" in \
        lines[0]
    assert _leftovers(small_file_system) == []
