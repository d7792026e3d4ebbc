"""Long inputs through Spark (real local[2] session): ``bertopt spark-predict --long-inputs chunk`` pools a long
text's windows exactly as the in-process Predictor does; ``truncate`` stays the default; ``error`` is refused in
one line (a row cannot be refused by its token count there)."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt.data import corpus
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_spark_predict_chunks_long_texts_like_the_predictor(spark, tiny_onnx, tmp_path, cli):
    import pandas as pd

    pred = Predictor(tiny_onnx, threads=1)
    long = " ".join(t for t in corpus()[:40] if t)  # hundreds of tokens; the tiny model's window is 48
    assert len(pred.untruncated_tokenizer().encode(long).ids) > 3 * pred.max_seq_len
    texts = ["the cat sat on the mat", long]
    src = tmp_path / "in.parquet"
    pd.DataFrame({"id": range(len(texts)), "text": texts}).to_parquet(src)
    for policy, expected in (("chunk", pred.encode(texts, long_inputs="chunk")), (None, pred.encode(texts))):
        out = tmp_path / f"out-{policy}.parquet"
        code, _, err = cli("spark-predict", tiny_onnx.path, "-i", src, "-o", out,
                           *(["--long-inputs", policy] if policy else []))
        assert code == 0, err
        got = pd.read_parquet(out).sort_values("id")
        np.testing.assert_allclose(np.stack(got["sentence_embedding"].to_list()), expected, atol=1e-5)
    assert not np.allclose(pred.encode([long], long_inputs="chunk"), pred.encode([long]), atol=1e-3)


def test_spark_predict_refuses_the_error_policy_in_one_line(tiny_onnx, tmp_path, cli):
    code, _, err = cli("spark-predict", tiny_onnx.path, "-i", tmp_path / "x.parquet", "-o", tmp_path / "o",
                       "--long-inputs", "error")
    assert code == 2
    assert "'long_inputs' must be one of truncate, chunk; got 'error'" in " ".join(err.split())
