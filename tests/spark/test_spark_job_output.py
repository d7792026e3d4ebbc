"""``spark-predict --output``: the output-path policy with a real local Spark session. --force replaces only an
earlier spark-predict output (marked by ``_bertopt.json``), never a folder of user files, the artifact or the
input; the checks run before Spark does any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from spark_testdata import TEXTS

from bertopt.artifact import Artifact

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_force_replaces_only_an_earlier_spark_predict_output(spark, tiny_onnx, fresh_copy, tmp_path, cli):
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"text": TEXTS}), src / "part-0.parquet")
    out = tmp_path / "out"
    code, stdout, err = cli("spark-predict", "-a", tiny_onnx.path, "-i", src, "-o", out)
    assert code == 0, err
    marker = json.loads((out / "_bertopt.json").read_text())
    assert marker["written_by"] == "bertopt spark-predict" and marker["digest"] == tiny_onnx.digest
    assert pq.read_table(out).column_names == ["text", "sentence_embedding", "error"]  # readers skip the marker

    code, _, err = cli("spark-predict", "-a", tiny_onnx.path, "-i", src, "-o", out)
    assert code == 2 and "already exists (a bertopt spark-predict output)" in err and "--force" in err
    code, stdout, err = cli("spark-predict", "-a", tiny_onnx.path, "-i", src, "-o", out, "--force")
    assert code == 0, err
    assert pq.read_table(out).num_rows == len(TEXTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # nothing moved aside is left

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    code, _, err = cli("spark-predict", "-a", tiny_onnx.path, "-i", src, "-o", mine, "--force")
    assert code == 2 and "exists and is not a bertopt spark-predict output (it holds other files)" in err
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]

    art = fresh_copy(tiny_onnx, "art")
    code, _, err = cli("spark-predict", "-a", art.path, "-i", src, "-o", art.path, "--force")
    assert code == 2 and "is the input" in err
    Artifact.load(art.path)  # intact
    code, _, err = cli("spark-predict", "-a", tiny_onnx.path, "-i", src, "-o", src, "--force")
    assert code == 2 and "is the input" in err
    assert [p.name for p in src.iterdir()] == ["part-0.parquet"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _pyspark_workers(root: int) -> list[int]:
    """The Python workers among the descendants of ``root`` (the job's driver process): never another job's."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue  # the process ended while we looked
            parents[int(entry.name)] = int(stat[1])
    found = []
    for pid, command in commands.items():
        ancestor = parents.get(pid)
        for _ in range(64):  # bounded: a pid reused while we read could make a loop
            if not ancestor or ancestor == root:
                break
            ancestor = parents.get(ancestor)
        if ancestor == root and ("pyspark.daemon" in command or "pyspark.worker" in command):
            found.append(pid)
    return found


def test_a_spark_job_whose_workers_die_exits_3_and_writes_nothing(tiny_onnx, tmp_path, tmp_path_factory):
    """A backend failure (the Python workers killed mid-job) is exit 3 with one line of ours, never 0, 1 or a
    traceback; the temporary output is removed."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"sentence number {i} about cats and dogs" for i in range(100_000)]}), src)
    temp = tmp_path_factory.mktemp("TMPDIR")  # where the artifact is zipped for the executors
    env = {**os.environ, "COLUMNS": "300", "TMPDIR": str(temp),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "spark-predict", "-a", tiny_onnx.path, "-i", src,
                             "-o", tmp_path / "out", "--master", "local[1]", "--batch-size", "8", "--ship"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:  # every worker that starts dies
            for pid in _pyspark_workers(proc.pid):  # this job's workers: other Spark sessions are not ours to kill
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert killed, "no Python worker started"
    assert proc.returncode == 3, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: the Spark job failed: ") and "see the Spark executor logs" in last, last
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]  # no output, no .out.tmp-*, no lock
    assert [p.name for p in temp.iterdir() if p.name.startswith("bertopt")] == []  # the shipped zip is removed
