"""``bertopt spark-predict`` end to end (the real CLI entry point, the folder's local[2] session)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from spark_testdata import TEXTS

from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _read(path) -> dict:
    table = pq.read_table(path)
    return table.to_pydict()


def _no_leftovers(folder) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "temporary output left behind"


def test_parquet_in_parquet_out_keeps_columns_and_nulls(spark, tiny_onnx, tmp_path, cli):
    texts = TEXTS * 3 + [None, ""]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts,
                             "score": [float(i) / 2 for i in range(len(texts))]}), src)
    out = tmp_path / "out.parquet"
    # the artifact's old spelling (--artifact) still works, with one deprecation line
    code, stdout, stderr = cli("spark-predict", "--artifact", tiny_onnx.path, "--input", src, "--output", out,
                               "--batch-size", "4")
    assert code == 0, stderr
    assert [line for line in stderr.splitlines() if "deprecated" in line] == [
        "warning: --artifact/-a is deprecated; give ARTIFACT as the first argument: bertopt spark-predict ARTIFACT "
        "..."]
    assert re.search(r"[\d.]+ rows/s \(26 rows in [\d.]+ s on local\[2\]", stdout), stdout
    assert "2 without a prediction: see column 'error'" in stdout
    got = _read(out)
    assert list(got) == ["id", "text", "score", "sentence_embedding", "error"]
    by_id = {i: (t, s, e) for i, t, s, e in zip(got["id"], got["text"], got["score"], got["sentence_embedding"])}
    assert sorted(by_id) == list(range(len(texts)))
    expected = Predictor(tiny_onnx).encode(TEXTS * 3)
    for i in range(len(TEXTS) * 3):
        text, score, emb = by_id[i]
        assert text == texts[i] and score == i / 2
        np.testing.assert_allclose(np.array(emb, dtype=np.float32), expected[i], atol=1e-5, rtol=0)
    assert by_id[len(texts) - 2][2] is None and by_id[len(texts) - 1][2] is None
    _no_leftovers(tmp_path)


def test_csv_with_text_col_partitions_and_classifier(spark, tiny_classifier, tmp_path, cli):
    src = tmp_path / "reviews.csv"
    src.write_text('id,body,stars\n1,"the cat, the dog",5\n2,hello world,3\n3,,1\n4,"good\nmodel",4\n')
    out = tmp_path / "reviews-out"
    code, stdout, stderr = cli("spark-predict", tiny_classifier.path, "-i", src, "-o", out,
                               "--text-col", "body", "--partitions", "3", "--batch-size", "2", "--prefix", "p_")
    assert code == 0, stderr
    assert "4 rows" in stdout and "3 partitions" in stdout
    got = _read(out)
    assert list(got) == ["id", "body", "stars", "p_logits", "p_label", "p_confidence", "p_error"]
    rows = {r: (b, lg, lb) for r, b, lg, lb in zip(got["id"], got["body"], got["p_logits"], got["p_label"])}
    assert rows["4"][0] == "good\nmodel" and rows["1"][0] == "the cat, the dog"
    assert rows["3"][1] is None and rows["3"][2] is None
    logits = Predictor(tiny_classifier).encode(["the cat, the dog", "hello world", "good\nmodel"])
    for key, ref in zip(["1", "2", "4"], logits):
        np.testing.assert_allclose(rows[key][1], ref, atol=1e-5, rtol=0)
        assert rows[key][2] == f"LABEL_{int(np.argmax(ref))}"


def test_text_file_input(spark, tiny_onnx, tmp_path, cli):
    src = tmp_path / "lines.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "lines-out"
    code, stdout, stderr = cli("spark-predict", tiny_onnx.path, "-i", src, "-o", out)
    assert code == 0, stderr
    got = _read(out)
    assert sorted(got["text"]) == sorted(TEXTS) and all(e is not None for e in got["sentence_embedding"])


def test_bad_inputs_fail_before_the_job_with_one_line(spark, tiny_onnx, tmp_path, cli):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": TEXTS}), src)
    out = tmp_path / "out"
    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", src, "-o", out)
    assert code == 2
    assert "input has no column 'text'; its columns are: body (choose one with --text-col)" in err
    assert not out.exists()

    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"this is not parquet at all" * 10)
    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", garbage, "-o", out)
    assert code == 2 and f"cannot read {garbage} as parquet: " in err, err  # read before Spark starts
    assert "check the file or pass --format" in err
    assert "magic bytes not found in footer" in err  # pyarrow names what is wrong with the file
    assert len(err.strip().splitlines()) <= 3  # one message (rich may wrap it), no traceback
    assert "Traceback" not in err

    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", tmp_path / "missing.parquet", "-o", out)
    assert code == 2 and "input" in err and "does not exist" in err

    code, _, err = cli("spark-predict", tmp_path / "no-artifact", "-i", src, "-o", out)
    assert code == 2 and "artifact not found" in err

    out.mkdir()
    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", src, "-o", out, "--text-col", "body")
    assert code == 2 and "already exists" in err and "--force" in err
    _no_leftovers(tmp_path)


def test_failure_on_executors_leaves_nothing_written(spark, tiny_onnx, tmp_path, cli, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": TEXTS}), src)
    out = tmp_path / "out"
    # the driver's own check (a local master: its executors are this machine) is what a user meets first; it is
    # passed here so that the executors, which count this machine's GPUs themselves, fail the job
    import bertopt.spark.placement

    monkeypatch.setattr(bertopt.spark.placement, "visible_gpu_count", lambda: 1)
    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", src, "-o", out, "--provider", "cuda")
    assert code == 2, err
    assert "provider 'cuda' requested but executor" in err and "has no visible GPU" in err
    assert not out.exists()
    _no_leftovers(tmp_path)
