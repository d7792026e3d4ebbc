"""The UDF in a real local[2] Spark session: results equal the in-process runtime's, nulls, load counting,
CPU placement, the mapInPandas variant, the archive route and artifacts absent on executors."""

from __future__ import annotations

import shutil
import zipfile

import numpy as np
import pytest
from spark_testdata import TEXTS

from bertopt.errors import UserError
from bertopt.runtime import Predictor
from bertopt.runtime.backends import default_threads

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _frame(spark, texts, partitions=2):
    rows = [(i, t) for i, t in enumerate(texts)]
    return spark.createDataFrame(rows, "idx long, text string").repartition(partitions)


def _collect(df, column):
    from bertopt.spark.session import worker_errors

    with worker_errors():
        rows = df.collect()
    return {r["idx"]: r[column] for r in rows}


def test_udf_embeddings_equal_in_process_runtime_and_nulls_stay_null(spark, tiny_onnx):
    from bertopt.spark import predict_udf

    texts = TEXTS * 5 + [None, "", "   ", "\t\n"]
    udf = predict_udf(tiny_onnx.path, batch_size=4, spark=spark)
    assert udf.output == "sentence_embedding"
    got = _collect(_frame(spark, texts, 3).select("idx", udf("text").alias("emb")), "emb")
    expected = Predictor(tiny_onnx, batch_size=4).encode(TEXTS * 5)
    assert len(got) == len(texts)
    for i in range(len(TEXTS) * 5):
        assert len(got[i]) == expected.shape[1] == 32
        np.testing.assert_allclose(np.array(got[i], dtype=np.float32), expected[i], atol=1e-5, rtol=0)
    assert [got[i] for i in range(len(TEXTS) * 5, len(texts))] == [None, None, None, None]


def test_classifier_logits_and_label(spark, tiny_classifier):
    from bertopt.spark import predict_dataframe, predict_udf

    texts = TEXTS + [None]
    df = _frame(spark, texts)
    labels = _collect(df.select("idx", predict_udf(tiny_classifier.path, output="label", spark=spark)("text")
                                .alias("label")), "label")
    logits_ref = Predictor(tiny_classifier).encode(TEXTS)
    names = tiny_classifier.model_info["id2label"]
    expected = [names[str(int(np.argmax(row)))] for row in logits_ref]
    assert [labels[i] for i in range(len(TEXTS))] == expected
    assert labels[len(TEXTS)] is None
    # mapInPandas: every input column kept, logits, label and confidence appended
    out = predict_dataframe(df.withColumn("extra", df.idx * 10), tiny_classifier)
    assert out.columns == ["idx", "text", "extra", "logits", "label", "confidence", "error"]
    rows = {r["idx"]: r for r in out.collect()}
    for i in range(len(TEXTS)):
        assert rows[i]["extra"] == i * 10 and rows[i]["text"] == TEXTS[i]
        np.testing.assert_allclose(rows[i]["logits"], logits_ref[i], atol=1e-5, rtol=0)
        assert rows[i]["label"] == expected[i]
        softmax = np.exp(logits_ref[i]) / np.exp(logits_ref[i]).sum()
        assert rows[i]["confidence"] == pytest.approx(float(softmax.max()), abs=1e-5)
    assert rows[len(TEXTS)]["logits"] is None and rows[len(TEXTS)]["label"] is None


def test_model_loads_once_per_worker_across_batches_tasks_and_jobs(spark, tiny_onnx, fresh_copy, tmp_path):
    from bertopt.spark import predict_dataframe, predict_udf, read_load_log

    art = fresh_copy(tiny_onnx)
    log = tmp_path / "loads.log"
    df = _frame(spark, TEXTS * 30, partitions=6)  # 240 rows, 6 tasks, batch 4 -> 60 model batches
    udf = predict_udf(art.path, batch_size=4, window=4, spark=spark, load_log=str(log))
    first = _collect(df.select("idx", udf("text").alias("e")), "e")
    assert len(first) == 240 and all(v is not None for v in first.values())
    loads = read_load_log(log)
    pids = [row["pid"] for row in loads]
    assert 1 <= len(loads) <= 2, loads  # local[2]: at most one load per Python worker, not per task or batch
    assert len(set(pids)) == len(pids)
    assert all(row["path"] == str(art.path) for row in loads)
    # CPU placement: each of the 2 concurrent tasks gets an equal share of the cores, at least one thread
    assert {row["placement"] for row in loads} == {f"cpu ({max(1, default_threads() // 2)} threads)"}
    # a second job with a new UDF object and the mapInPandas variant reuse the same loaded model
    udf_again = predict_udf(art.path, batch_size=8, spark=spark, load_log=str(log))
    _collect(df.select("idx", udf_again("text").alias("e")), "e")
    predict_dataframe(df, art, load_log=str(log)).count()
    later = read_load_log(log)
    new_pids = {row["pid"] for row in later[len(loads):]}
    assert not new_pids & set(pids), "a worker that had the model loaded it again"


def test_archive_route_loads_from_sparkfiles_and_verifies(spark, tiny_onnx, fresh_copy, tmp_path):
    from bertopt.spark import predict_udf, read_load_log

    art = fresh_copy(tiny_onnx, "shipped")
    expected = Predictor(art).encode(TEXTS)
    log = tmp_path / "loads.log"
    udf = predict_udf(art.path, spark=spark, ship=True, load_log=str(log))
    assert udf.artifact_ref.archive.startswith("bertopt-")
    shutil.rmtree(art.path)  # from now on only the shipped archive has the model
    got = _collect(_frame(spark, TEXTS).select("idx", udf("text").alias("e")), "e")
    np.testing.assert_allclose(np.array([got[i] for i in range(len(TEXTS))]), expected, atol=1e-5, rtol=0)
    paths = {row["path"] for row in read_load_log(log)}
    assert paths and all("userFiles" in p and p.endswith(udf.artifact_ref.archive) for p in paths), paths

    # a tampered archive fails hash verification on the executor, with the artifact's own message
    bad = tmp_path / "tampered"
    shutil.copytree(tiny_onnx.path, bad)
    with open(bad / tiny_onnx.manifest["model_file"], "r+b") as fh:
        fh.seek(-8, 2)
        fh.write(b"\x00" * 8)
    archive = tmp_path / "tampered.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in bad.rglob("*"):
            zf.write(f, f.relative_to(bad).as_posix())
    spark.sparkContext.addArchive(f"{archive}#tampered-art")
    udf_bad = predict_udf(tiny_onnx.path, spark=spark, archive="tampered-art")
    with pytest.raises(UserError, match="corrupt: sha256 of model.onnx does not match"):
        _collect(_frame(spark, TEXTS).select("idx", udf_bad("text").alias("e")), "e")


def test_artifact_absent_on_executors_is_a_clear_error(spark, tiny_onnx, fresh_copy):
    from bertopt.spark import predict_udf

    art = fresh_copy(tiny_onnx, "vanishing")
    udf = predict_udf(art.path, spark=spark)  # the driver sees it ...
    shutil.rmtree(art.path)  # ... the executors do not
    with pytest.raises(UserError, match=f"artifact {art.path} is not present on executor .*--ship"):
        _collect(_frame(spark, TEXTS).select("idx", udf("text").alias("e")), "e")
    never_shipped = predict_udf(tiny_onnx.path, spark=spark, archive="bertopt-never-shipped")
    with pytest.raises(UserError, match="archive 'bertopt-never-shipped' is not present on executor"):
        _collect(_frame(spark, TEXTS).select("idx", never_shipped("text").alias("e")), "e")


def test_bad_udf_arguments_fail_on_the_driver(spark, tiny_onnx, tiny_classifier):
    from bertopt.spark import predict_dataframe, predict_udf

    with pytest.raises(UserError, match="output 'last_hidden_state' is per-token"):
        predict_udf(tiny_onnx.path, output="last_hidden_state", spark=spark)
    with pytest.raises(UserError, match="output 'label' needs a classifier"):
        predict_udf(tiny_onnx.path, output="label", spark=spark)
    with pytest.raises(UserError, match="unknown output 'nope'; this artifact has: logits, label, confidence"):
        predict_udf(tiny_classifier.path, output="nope", spark=spark)
    df = _frame(spark, TEXTS)
    with pytest.raises(UserError, match="input has no column 'body'; its columns are: idx, text"):
        predict_dataframe(df, tiny_onnx, text_col="body")
    with pytest.raises(UserError, match="column 'idx' holds bigint, not text"):
        predict_dataframe(df, tiny_onnx, text_col="idx")


def test_openvino_int8_artifact_runs_on_openvino_in_the_executors(spark, tiny_onnx, tmp_path):
    """One runtime: the executors build the backend the manifest names (OpenVINO here), so Spark gives what the
    in-process Predictor gives."""
    import openvino  # noqa: F401  (make test installs it: a broken install must fail, not skip)

    from bertopt.registry import run_stage
    from bertopt.spark import predict_udf

    art = run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "runtime": "openvino",
                                            "inference_precision": "f32"}, tmp_path / "ov")
    udf = predict_udf(art.path, batch_size=4, spark=spark)
    got = _collect(_frame(spark, TEXTS, 2).select("idx", udf("text").alias("emb")), "emb")
    expected = Predictor(art, batch_size=4).encode(TEXTS)
    assert Predictor(art).session.backend == "openvino"
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(np.array(got[i], dtype=np.float32), expected[i], atol=1e-4, rtol=0)
    # and it is not the fp32 parent's answer: the int8 model really ran
    parent = Predictor(tiny_onnx, batch_size=4).encode(TEXTS)
    assert np.abs(np.array([got[i] for i in range(len(TEXTS))], dtype=np.float32) - parent).max() > 1e-4
