"""The README's stage-by-stage example is a real command sequence: run it as written (slow: real MiniLM)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_stage_commands() -> list[list[str]]:
    text = README.read_text()
    section = text.split("## Stage by stage", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():  # a trailing backslash continues the command
        line = line.split("#", 1)[0].strip()
        if line.startswith("bertopt "):
            commands.append(shlex.split(line)[1:])
    return commands


def test_readme_block_is_found():
    commands = readme_stage_commands()
    assert [c[0] for c in commands][:4] == ["export", "prune", "optimize", "quantize"]


@pytest.mark.slow
def test_readme_stage_commands_run_as_written(tmp_path):
    # the commands as a user would type them, in a fresh folder, each its own `bertopt` process
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args in readme_stage_commands():
        proc = subprocess.run([sys.executable, "-m", "bertopt.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"bertopt {' '.join(args)} failed:\n{proc.stderr[-2000:]}"
    art = tmp_path / "artifacts"
    assert sorted(p.name for p in art.iterdir()) == ["minilm-emb", "minilm-fp16", "minilm-fused", "minilm-int8",
                                                     "minilm-int8-openvino", "minilm-onnx"]
    manifest = json.loads((art / "minilm-int8" / "bertopt.json").read_text())
    assert manifest["precision"] == "int8-dynamic"
    assert [o["name"] for o in manifest["outputs"]] == ["sentence_embedding"]  # pruned to the embedding
    assert manifest["lineage"]["parent"]["path"].endswith("minilm-fused")
    accurate = json.loads((art / "minilm-int8-openvino" / "bertopt.json").read_text())
    assert accurate["runtime"] == "openvino" and accurate["precision"].startswith("int8-dynamic")
    assert accurate["lineage"]["report"]["accuracy_vs_parent"]["sentence_embedding"]["cos_min"] >= 0.995
