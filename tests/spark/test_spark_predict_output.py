"""``spark-predict --output``: the output-path policy with a real local Spark session. --force replaces only an
earlier spark-predict output (marked by ``_bertopt.json``), never a folder of user files, the artifact or the
input; the checks run before Spark does any work."""

from __future__ import annotations

import json

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
    assert pq.read_table(out).column_names == ["text", "sentence_embedding"]  # readers skip the marker

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
