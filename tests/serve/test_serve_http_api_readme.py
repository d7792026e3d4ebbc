"""The README's HTTP example runs as written: its `bertopt serve` line, its curl commands and its openai snippet
(on the tiny BERT instead of artifacts/minilm-int8, and on free ports instead of 8080/5555/5556)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def http_section() -> tuple[list[str], str]:
    section = README.read_text().split("### HTTP: OpenAI- and TEI-compatible", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return [line.split("  #", 1)[0].strip() for line in bash.splitlines() if line.strip()], python


def test_readme_http_block_is_found():
    lines, python = http_section()
    assert lines[0].startswith("bertopt serve artifacts/minilm-int8 --http-port 8080")
    assert sum(line.startswith("curl ") for line in lines) == 3 and "OpenAI(base_url=" in python


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_readme_http_example_runs(tiny_onnx, start_server):
    lines, python = http_section()
    serve_args = shlex.split(lines[0])[2:]
    serve_args[serve_args.index("artifacts/minilm-int8")] = str(tiny_onnx.path)
    serve_args = [a for a in serve_args if a != "--http-port" and a != "8080"]
    art = serve_args.pop(0)
    num_worker = int(serve_args[serve_args.index("--num-worker") + 1])
    server = start_server(art, http=True, num_worker=num_worker)
    port = str(server.http_port)
    outputs = []
    for line in lines[1:]:
        # the tiny BERT is 32 wide: ask it for 16 of its dimensions where the README asks MiniLM for 128
        cmd = [a.replace("8080", port).replace('"dimensions": 128', '"dimensions": 16') for a in shlex.split(line)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    health, embed, openai = outputs
    assert health["status"] == "ok"
    assert len(embed) == 1 and len(embed[0]) == 32  # the tiny BERT's width
    assert len(openai["data"][0]["embedding"]) == 16 and openai["usage"]["prompt_tokens"] == 4
    scope: dict = {}
    exec(python.replace("8080", port), scope)
    assert len(scope["vectors"]) == 1 and len(scope["vectors"][0]) == 32
