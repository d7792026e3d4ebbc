"""The README's stage-by-stage example is a real command sequence: run it as written (slow: real MiniLM)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_stage_commands() -> list[list[str]]:
    text = README.read_text()
    section = text.split("## Stage by stage", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("bertopt "):
            commands.append(shlex.split(line)[1:])
    return commands


def test_readme_block_is_found():
    commands = readme_stage_commands()
    assert [c[0] for c in commands][:4] == ["export", "prune", "optimize", "quantize"]
