"""freeze from every TensorFlow input: a bertopt SavedModel artifact, a foreign SavedModel, a .keras file and a
Google-format checkpoint; the frozen graph must equal its source model run in TensorFlow within 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.tf


def _no_variables(art):
    from bertopt.runtime.tf_session import load_graph_def

    ops = {n.op for n in load_graph_def(art.model_path).node}
    assert not ops & {"VarHandleOp", "ReadVariableOp", "VariableV2"}
    return ops


def test_savedmodel_export_matches_pytorch(tiny_tf_savedmodel, tiny_hf):
    from bertopt.data import corpus
    from bertopt.runtime import Predictor
    from bertopt.sources.hf import hf_reference

    art = tiny_tf_savedmodel
    assert art.model_format == "tf-savedmodel" and (art.path / "saved_model" / "saved_model.pb").is_file()
    assert (art.path / "tokenizer" / "tokenizer.json").is_file()
    rep = art.lineage["report"]
    assert rep["max_abs_diff_vs_pytorch"] <= 1e-4
    assert rep["variables_loaded"] == 5 + 2 * 16  # embeddings (3 + LayerNorm 2) + 16 per layer
    assert art.model_info["num_attention_heads"] == 4 and art.model_info["hidden_size"] == 32
    pred = Predictor(art)
    assert pred.session.backend == "tensorflow"
    ref = hf_reference(tiny_hf)
    texts = corpus()[:20]
    np.testing.assert_allclose(pred.encode(texts), ref.encode(texts), atol=1e-4)


def test_freeze_bertopt_savedmodel(tiny_frozen, tiny_tf_savedmodel):
    art = tiny_frozen
    rep = art.lineage["report"]
    assert art.model_format == "tf-graphdef" and art.runtime == "tensorflow"
    assert rep["variables_folded"] == 37
    assert rep["max_abs_diff_vs_source"] <= 1e-6
    assert rep["after"]["nodes"] > 100
    _no_variables(art)
    # later stages are validated against the TF original: the lineage source is the SavedModel itself
    assert art.source["kind"] == "tf-savedmodel" and art.source["framework"] == "tensorflow"
    assert art.source["origin"]["kind"] == "hf"
    assert art.model_info == tiny_tf_savedmodel.model_info


def test_tf_reference_runs_the_savedmodel(tiny_frozen):
    from bertopt.data import corpus
    from bertopt.runtime import Predictor
    from bertopt.validate.reference import reference_predictor

    ref = reference_predictor(tiny_frozen)
    assert ref.session.backend == "tensorflow" and ref.artifact.model_format == "tensorflow"
    texts = corpus()[:16]
    np.testing.assert_allclose(Predictor(tiny_frozen).encode(texts), ref.encode(texts), atol=1e-6)


def test_freeze_foreign_savedmodel_any_encoder(foreign_savedmodel, tmp_path):
    """Not bertopt's model: TF-Hub input names, int32 ids, its own output names; through to ONNX."""
    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.validate.quick import compare_with_original

    frozen = run_stage("freeze", foreign_savedmodel, {}, tmp_path / "frozen")
    roles = {i["name"]: (i["role"], i["dtype"]) for i in frozen.inputs}
    assert roles == {"input_word_ids": ("input_ids", "int32"), "input_mask": ("attention_mask", "int32"),
                     "input_type_ids": ("token_type_ids", "int32")}
    assert {o["name"]: o["kind"] for o in frozen.outputs} == {"pooled_output": "embedding",
                                                              "sequence_output": "token"}
    assert frozen.model_info["primary_output"] == "pooled_output"
    assert frozen.lineage["report"]["max_abs_diff_vs_source"] <= 1e-6
    pruned = run_stage("prune", frozen, {}, tmp_path / "pruned")
    onnx_art = run_stage("export", pruned, {"to": "onnx"}, tmp_path / "onnx")
    assert [i["name"] for i in onnx_art.inputs] == [i["name"] for i in frozen.inputs]
    emb = Predictor(onnx_art).encode(corpus()[:8])
    assert emb.shape == (8, 16) and np.isfinite(emb).all()
    result = compare_with_original(onnx_art, texts=corpus()[:24])
    assert result["reference"]["framework"] == "tensorflow"
    assert result["accuracy"]["pooled_output"]["max_abs"] <= 1e-4


def test_freeze_keras_file(tiny_keras_file, tmp_path):
    import keras

    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor

    frozen = run_stage("freeze", tiny_keras_file, {}, tmp_path / "frozen")
    assert frozen.source["kind"] == "keras"
    assert frozen.lineage["report"]["max_abs_diff_vs_source"] <= 1e-6
    _no_variables(frozen)
    # independently of bertopt's own check: the frozen graph equals Keras' own forward pass
    pred = Predictor(frozen)
    feeds, _ = pred.feeds_for(pred.tokenize(corpus()[:6]))
    model = keras.saving.load_model(tiny_keras_file)
    expected = model(feeds)["pooled_output"].numpy()
    np.testing.assert_allclose(pred.run_batch(feeds)["pooled_output"], expected, atol=1e-6)


def test_freeze_google_checkpoint_matches_pytorch(tiny_ckpt, tiny_hf, tmp_path):
    """Rebuilt from Google-named variables, the checkpoint gives the same token outputs as the HF model."""
    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.sources.hf import hf_reference

    frozen = run_stage("freeze", tiny_ckpt, {}, tmp_path / "frozen")
    rep = frozen.lineage["report"]
    assert rep["variables_loaded"] == 37
    assert rep["variables_ignored"] == ["bert/pooler/dense/bias", "bert/pooler/dense/kernel",
                                        "cls/predictions/output_bias", "cls/seq_relationship/output_weights",
                                        "global_step"]
    assert [(i["name"], i["dtype"]) for i in frozen.inputs] == [("input_ids", "int32"), ("input_mask", "int32"),
                                                                ("token_type_ids", "int32")]
    assert frozen.model_info["num_hidden_layers"] == 2 and frozen.model_info["pooling"] == "mean"
    # same token ids into both (the tiny HF folder's own tokenizer.json differs from one built from vocab.txt)
    pred = Predictor(frozen, max_seq_len=64)  # the HF model has 64 positions, the checkpoint 128
    feeds, lengths = pred.feeds_for(pred.tokenize(corpus()[:16]))
    got = pred.run_batch(feeds, ["last_hidden_state"])["last_hidden_state"]
    torch_feeds = {"input_ids": feeds["input_ids"].astype(np.int64), "token_type_ids":
                   feeds["token_type_ids"].astype(np.int64), "attention_mask": feeds["input_mask"].astype(np.int64)}
    want = hf_reference(tiny_hf, pooling="none").session.run(["last_hidden_state"], torch_feeds)[0]
    real = np.arange(got.shape[1])[None, :] < lengths[:, None]
    assert float(np.abs(got - want)[real].max()) <= 1e-4


def test_checkpoint_to_savedmodel_signature(tiny_ckpt, tmp_path):
    import tensorflow as tf

    from bertopt.registry import run_stage

    art = run_stage("export", tiny_ckpt, {"to": "tf-savedmodel"}, tmp_path / "sm")
    sig = tf.saved_model.load(str(art.model_path)).signatures["serving_default"]
    assert sorted(sig.structured_input_signature[1]) == ["input_ids", "input_mask", "token_type_ids"]
    assert sorted(sig.structured_outputs) == ["last_hidden_state", "sentence_embedding"]
