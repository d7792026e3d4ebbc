"""Rows whose text cannot be predicted (null, empty, bytes that are not UTF-8 such as an encoded lone surrogate,
over the length bound) in a real local Spark session: each gets null predictions and its reason in the error
column, the other rows their values, and neither the stage nor the job fails."""

from __future__ import annotations

import numpy as np
import pytest
from spark_testdata import TEXTS

from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.spark]

MAX_CHARS = 60
# row index -> (text as hex of its bytes, or None for a null; the error expected, or None for a prediction)
ROWS = {
    0: (TEXTS[0].encode().hex(), None),
    1: (None, "text is null"),
    2: ("61EDA08062", "text is not valid UTF-8"),   # "a\ud800b" as CESU-8: an encoded lone surrogate
    3: (TEXTS[1].encode().hex(), None),
    4: ("61FF62", "text is not valid UTF-8"),       # a byte that starts no UTF-8 sequence
    5: ("2009", "text is empty or whitespace-only"),              # " \t"
    6: (("x" * (MAX_CHARS + 1)).encode().hex(), f"text: {MAX_CHARS + 1} characters, over the limit of {MAX_CHARS}"),
    7: (("y" * MAX_CHARS).encode().hex(), None),    # exactly at the bound: predicted
    8: ("C3A9 6C C3A8 76 65".replace(" ", ""), None),  # "élève": valid multi-byte UTF-8
}


def _frame(spark):
    from pyspark.sql import functions as F

    df = spark.createDataFrame([(i, h) for i, (h, _) in ROWS.items()], "idx long, hex string")
    # unhex + cast keeps the bytes as they are: a Spark string column holding invalid UTF-8, as a Parquet file
    # written by another tool can
    return df.select("idx", F.unhex("hex").cast("string").alias("text"), F.lit("kept").alias("other")) \
        .repartition(2)


def _expected(art) -> dict[int, np.ndarray]:
    valid = {i: bytes.fromhex(h).decode() for i, (h, err) in ROWS.items() if err is None}
    values = Predictor(art, threads=1).encode(list(valid.values()))
    return dict(zip(valid, values))


def test_predict_dataframe_and_predict_udf_answer_invalid_rows_with_an_error_not_a_failed_stage(spark, tiny_onnx):
    from pyspark.sql import functions as F

    from bertopt.spark import predict_dataframe, predict_udf
    from bertopt.spark.udf import text_error

    df = _frame(spark)
    expected = _expected(tiny_onnx)
    out = predict_dataframe(df, tiny_onnx, batch_size=2, max_text_chars=MAX_CHARS)
    assert out.columns == ["idx", "text", "other", "sentence_embedding", "error"]
    rows = {r["idx"]: r for r in out.withColumn("hex", F.hex("text")).collect()}
    assert sorted(rows) == sorted(ROWS)
    for i, (hex_text, error) in ROWS.items():
        row = rows[i]
        assert row["other"] == "kept"
        assert row["hex"] == (None if hex_text is None else hex_text.upper())  # the text column is untouched
        if error is None:
            assert row["error"] is None
            np.testing.assert_allclose(np.array(row["sentence_embedding"], dtype=np.float32), expected[i],
                                       rtol=0, atol=1e-5)
        else:
            assert row["sentence_embedding"] is None
            assert row["error"] is not None and row["error"].startswith(error), (i, row["error"])

    # the column function: null for those rows, and text_error says why
    embed = predict_udf(tiny_onnx, batch_size=2, spark=spark, max_text_chars=MAX_CHARS)
    got = {r["idx"]: r for r in df.select("idx", embed("text").alias("emb"),
                                          text_error("text", max_text_chars=MAX_CHARS).alias("why")).collect()}
    for i, (_, error) in ROWS.items():
        if error is None:
            assert got[i]["why"] is None
            np.testing.assert_allclose(np.array(got[i]["emb"], dtype=np.float32), expected[i], rtol=0, atol=1e-5)
        else:
            assert got[i]["emb"] is None and got[i]["why"].startswith(error), (i, got[i]["why"])


def test_spark_predict_writes_the_reason_per_row_and_exits_0(spark, tiny_onnx, tmp_path, cli):
    import pyarrow.parquet as pq

    src = tmp_path / "in.parquet"
    _frame(spark).write.parquet(str(src))  # a Parquet string column with invalid UTF-8, written by Spark
    out = tmp_path / "out.parquet"
    code, stdout, stderr = cli("spark-predict", "--artifact", tiny_onnx.path, "--input", src, "--output", out,
                               "--batch-size", "2", "--max-text-chars", str(MAX_CHARS))
    assert code == 0, stderr
    n_errors = sum(err is not None for _, err in ROWS.values())
    assert f"{n_errors} without a prediction: see column 'error'" in stdout
    table = pq.read_table(out).to_pydict()  # every column readable: the text column is valid UTF-8 (U+FFFD)
    texts = dict(zip(table["idx"], table["text"]))
    assert texts[4] == "a\ufffdb" and texts[0] == TEXTS[0] and texts[1] is None
    errors = dict(zip(table["idx"], table["error"]))
    embeddings = dict(zip(table["idx"], table["sentence_embedding"]))
    expected = _expected(tiny_onnx)
    for i, (_, error) in ROWS.items():
        if error is None:
            assert errors[i] is None
            np.testing.assert_allclose(np.array(embeddings[i], dtype=np.float32), expected[i], rtol=0, atol=1e-5)
        else:
            assert embeddings[i] is None and errors[i].startswith(error), (i, errors[i])
