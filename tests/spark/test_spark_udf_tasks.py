"""Task results through Spark (real local[2] session): label + confidence for classifiers, entities as
array<struct>, rerank scores from two columns, SPLADE as struct or SparseVector; through the UDF factory, the
mapInPandas variant and ``bertopt spark-predict``; each equal to ``Predictor.predict`` on the same artifact."""

from __future__ import annotations

import numpy as np
import pytest
from task_models import TASK_TEXTS

from bertopt.errors import UserError
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.spark]

TEXTS = TASK_TEXTS + [None, "  "]


def _frame(spark, texts, pairs=None):
    if pairs is None:
        return spark.createDataFrame([(i, t) for i, t in enumerate(texts)], "idx long, text string").repartition(2)
    return spark.createDataFrame([(i, t, p) for i, (t, p) in enumerate(zip(texts, pairs))],
                                 "idx long, text string, passage string").repartition(2)


def _rows(df):
    from bertopt.spark.session import worker_errors

    with worker_errors():
        return {r["idx"]: r for r in df.collect()}


def _entities_equal(got_rows, want):
    assert len(got_rows) == len(want)
    for g, w in zip(got_rows, want):
        assert (g["entity_group"], g["word"], g["start"], g["end"]) == (w["entity_group"], w["word"], w["start"],
                                                                          w["end"])
        assert g["score"] == pytest.approx(w["score"], abs=1e-6)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_classifier_label_and_confidence_columns(spark, task_artifact, family):
    from bertopt.spark import predict_dataframe, predict_udf

    _, art = task_artifact("classification", family)
    want = Predictor(art).predict(TASK_TEXTS)
    out = predict_dataframe(_frame(spark, TEXTS), art, batch_size=4)
    assert out.columns == ["idx", "text", "logits", "label", "confidence", "error"]
    assert dict(out.dtypes)["confidence"] == "double" and dict(out.dtypes)["label"] == "string"
    rows = _rows(out)
    for i, w in enumerate(want):
        assert rows[i]["label"] == w["label"]
        assert rows[i]["confidence"] == pytest.approx(w["score"], abs=1e-6)
    assert rows[len(TASK_TEXTS)]["label"] is None and rows[len(TASK_TEXTS)]["confidence"] is None
    udf = predict_udf(art, output="confidence", batch_size=4, spark=spark)
    got = _rows(_frame(spark, TEXTS).select("idx", udf("text").alias("c")))
    assert [got[i]["c"] for i in range(len(TASK_TEXTS))] == pytest.approx([w["score"] for w in want], abs=1e-6)
    assert got[len(TASK_TEXTS) + 1]["c"] is None


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_entities_are_an_array_of_structs(spark, task_artifact, family):
    from bertopt.spark import predict_dataframe, predict_udf

    _, art = task_artifact("token-classification", family)
    for aggregation in ("simple", "first"):
        want = Predictor(art).predict(TASK_TEXTS, aggregation=aggregation)
        out = predict_dataframe(_frame(spark, TEXTS), art, batch_size=4, aggregation=aggregation)
        assert dict(out.dtypes)["entities"] == ("array<struct<entity_group:string,score:double,word:string,"
                                                "start:int,end:int>>")
        rows = _rows(out)
        for i, w in enumerate(want):
            _entities_equal(rows[i]["entities"], w)
        assert rows[len(TASK_TEXTS)]["entities"] is None
    udf = predict_udf(art, batch_size=4, spark=spark, aggregation="none")
    assert udf.output == "entities"
    rows = _rows(_frame(spark, TEXTS).select("idx", udf("text").alias("e")))
    want = Predictor(art).predict(TASK_TEXTS, aggregation="none")
    for i, w in enumerate(want):
        _entities_equal(rows[i]["e"], [{**e, "entity_group": e["entity"]} for e in w])
    assert sum(len(w) for w in want) > 0


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_rerank_scores_come_from_two_columns(spark, task_artifact, family):
    from bertopt.spark import predict_dataframe, predict_udf

    _, art = task_artifact("rerank", family)
    queries = ["the cat sat on a mat"] * len(TASK_TEXTS)
    want = Predictor(art).predict(queries, TASK_TEXTS)
    df = _frame(spark, queries, TASK_TEXTS)
    rows = _rows(predict_dataframe(df, art, text_col="text", pair_col="passage", batch_size=4))
    assert [rows[i]["score"] for i in range(len(want))] == pytest.approx(want, abs=1e-6)
    udf = predict_udf(art, pairs=True, batch_size=4, spark=spark)
    rows = _rows(df.select("idx", udf("text", "passage").alias("s")))
    assert [rows[i]["s"] for i in range(len(want))] == pytest.approx(want, abs=1e-6)
    with pytest.raises(UserError, match="rerank model scores \\(query, passage\\) pairs; give the passage column"):
        predict_dataframe(df, art)


@pytest.mark.parametrize("sparse_format", ["struct", "vector"])
def test_sparse_vectors_as_struct_or_spark_ml_vector(spark, task_artifact, sparse_format):
    from pyspark.ml.linalg import SparseVector

    from bertopt.spark import predict_dataframe, predict_udf

    _, art = task_artifact("sparse-embedding")
    want = Predictor(art).predict(TASK_TEXTS)
    vocab = art.model_info["vocab_size"]
    for df in (predict_dataframe(_frame(spark, TEXTS), art, batch_size=4, sparse_format=sparse_format),
               _frame(spark, TEXTS).select("idx", predict_udf(art, batch_size=4, spark=spark,
                                                              sparse_format=sparse_format)("text").alias("sparse"))):
        rows = _rows(df)
        for i, w in enumerate(want):
            got = rows[i]["sparse"]
            if sparse_format == "vector":
                assert isinstance(got, SparseVector) and got.size == vocab
                indices, values = got.indices.tolist(), got.values.tolist()
            else:
                indices, values = got["indices"], got["values"]
            assert indices == w["indices"]
            np.testing.assert_allclose(values, w["values"], atol=1e-6)
        assert rows[len(TASK_TEXTS)]["sparse"] is None


def test_result_column_is_predictor_predict_as_json(spark, task_artifact):
    import json

    from bertopt.spark import predict_dataframe

    for task, family, aggregation in (("token-classification", "roberta", "none"),
                                      ("classification", "bert", "simple")):
        _, art = task_artifact(task, family)
        want = json.loads(json.dumps(Predictor(art).predict(TASK_TEXTS, aggregation=aggregation)))
        out = predict_dataframe(_frame(spark, TEXTS), art, outputs=["result"], batch_size=4, aggregation=aggregation)
        assert dict(out.dtypes)["result"] == "string"
        rows = _rows(out)
        got = [json.loads(rows[i]["result"]) for i in range(len(TASK_TEXTS))]
        assert len(got) == len(want) and any(got)
        for g, w in zip(got, want):  # every field: per-token entities keep "entity" and "index"; all class scores
            if task == "classification":
                assert g["label"] == w["label"] and g["scores"] == pytest.approx(w["scores"], abs=1e-6)
            else:
                assert [{k: e[k] for k in e if k != "score"} for e in g] == \
                    [{k: e[k] for k in e if k != "score"} for e in w]
                assert [e["score"] for e in g] == pytest.approx([e["score"] for e in w], abs=1e-6)
        assert rows[len(TASK_TEXTS)]["result"] is None and rows[len(TASK_TEXTS) + 1]["result"] is None


def test_spark_predict_cli_writes_task_columns(spark, task_artifact, tmp_path, cli):
    import pandas as pd

    _, art = task_artifact("token-classification")
    src = tmp_path / "in.parquet"
    pd.DataFrame({"id": range(len(TASK_TEXTS)), "body": TASK_TEXTS}).to_parquet(src)
    out = tmp_path / "out.parquet"
    code, stdout, err = cli("spark-predict", art.path, "-i", src, "-o", out, "--text-col", "body",
                            "--aggregation", "average")
    assert code == 0, err
    assert "columns + entities" in " ".join(stdout.split())
    got = pd.read_parquet(out).sort_values("id")
    want = Predictor(art).predict(TASK_TEXTS, aggregation="average")
    for entities, w in zip(got["entities"], want):
        _entities_equal(list(entities), w)


def test_spark_predict_task_mistakes_are_one_line(task_artifact, tmp_path, cli):
    import pandas as pd

    _, rerank_art = task_artifact("rerank")
    _, cls_art = task_artifact("classification")
    src = tmp_path / "in.parquet"
    pd.DataFrame({"text": ["a"], "passage": ["b"]}).to_parquet(src)
    for args, message in (
        ((rerank_art.path,), "give the passage column too"),
        ((cls_art.path, "--pair-col", "passage"), "takes a single text, but a second text column was given"),
        ((cls_art.path, "--outputs", "entities"), "output 'entities' needs a token-classification model"),
        ((cls_art.path, "--aggregation", "mean"), "unknown aggregation 'mean'"),
    ):
        out = tmp_path / "out.parquet"
        code, _, err = cli("spark-predict", args[0], "-i", src, "-o", out, *args[1:])
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_spark_check_compares_task_columns(spark, task_artifact):
    from bertopt.spark.validate import spark_check

    _, art = task_artifact("token-classification", "roberta")
    result = spark_check(art, TEXTS, spark=spark, batch_size=4)
    assert result["output"] == "entities" and result["max_abs_diff"] <= 1e-6 and result["null_rows_ok"]
    _, art = task_artifact("rerank")
    result = spark_check(art, TASK_TEXTS, pairs=TASK_TEXTS[::-1], spark=spark, batch_size=4)
    assert result["output"] == "score" and result["max_abs_diff"] <= 1e-6
