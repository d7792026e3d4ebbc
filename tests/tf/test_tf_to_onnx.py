"""tf2onnx export of TensorFlow graph artifacts: names, dynamic axes, the Erfc gap, and the ONNX artifact
flowing through the existing ONNX stages."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.tf


def _erfc_graph():
    import tensorflow as tf

    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        tf.identity(tf.math.erfc(x), name="y")
    return g.as_graph_def()


def _ort(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_tf2onnx_leaves_erfc_unconverted_without_bertopt_handler():
    """The gap the handler closes: plain tf2onnx emits an Erfc node ONNX does not define."""
    import tf2onnx

    from bertopt.tf.to_onnx import invalid_ops

    model, _ = tf2onnx.convert.from_graph_def(_erfc_graph(), input_names=["x:0"], output_names=["y:0"], opset=17)
    assert invalid_ops(model) == ["Erfc"]


def test_erfc_handler_converts_to_one_minus_erf():
    from bertopt.tf.to_onnx import convert_graph_def

    model, report = convert_graph_def(_erfc_graph(), ["x"], ["y"], opset=17)
    assert report["tf_op_handlers_used"] == ["Erfc"]
    assert "Erfc" not in {n.op_type for n in model.graph.node}
    x = np.linspace(-4, 4, 101).astype(np.float32)
    (y,) = _ort(model, {"x": x})
    np.testing.assert_allclose(y, [math.erfc(v) for v in x], atol=2e-6)


def test_erfc_onnx_rewrite():
    import onnx
    from onnx import TensorProto, helper

    from bertopt.tf.to_onnx import apply_onnx_rewrites, invalid_ops

    graph = helper.make_graph([helper.make_node("Erfc", ["x"], ["y"], name="erfc0")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert invalid_ops(model) == ["Erfc"]
    assert apply_onnx_rewrites(model) == {"Erfc": 1}
    assert invalid_ops(model) == []
    onnx.checker.check_model(model)
    x = np.linspace(-3, 3, 25).astype(np.float32)
    np.testing.assert_allclose(_ort(model, {"x": x})[0], [math.erfc(v) for v in x], atol=2e-6)


def test_unconvertible_op_is_a_user_error():
    import tensorflow as tf

    from bertopt.errors import UserError
    from bertopt.tf.to_onnx import convert_graph_def

    with tf.Graph().as_default() as g:  # Igamma has no tf2onnx handler and none in bertopt
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        tf.identity(tf.math.igamma(x, x), name="y")
    with pytest.raises(UserError, match="Igamma"):
        convert_graph_def(g.as_graph_def(), ["x"], ["y"], opset=17)


def test_export_names_axes_and_accuracy(tiny_tf_onnx, tiny_pruned):
    import onnx

    from bertopt.validate.quick import compare_with_original

    art = tiny_tf_onnx
    model = onnx.load(art.model_path)
    assert model.opset_import[0].version >= 17
    io = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
          for vi in list(model.graph.input) + list(model.graph.output)}
    assert io == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                  "token_type_ids": ["batch", "sequence"], "last_hidden_state": ["batch", "sequence", 32],
                  "sentence_embedding": ["batch", 32]}
    assert {i["name"]: i["role"] for i in art.inputs} == {"input_ids": "input_ids", "attention_mask":
                                                          "attention_mask", "token_type_ids": "token_type_ids"}
    assert art.runtime == "onnxruntime" and art.model_info["num_attention_heads"] == 4
    assert art.lineage["report"]["max_abs_diff_vs_parent"] <= 1e-4
    assert art.lineage["report"]["tf_op_handlers_used"] == ["Erfc"]
    result = compare_with_original(art)  # against the SavedModel run in TensorFlow
    assert result["reference"]["framework"] == "tensorflow"
    assert result["accuracy"]["sentence_embedding"]["cos_min"] > 0.99999


def test_tf_onnx_flows_into_onnx_prune_optimize_and_int8(tiny_tf_onnx, tmp_path):
    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor

    pruned = run_stage("prune", tiny_tf_onnx, {}, tmp_path / "prune")
    optimized = run_stage("optimize", pruned, {}, tmp_path / "optimize")
    int8 = run_stage("quantize", optimized, {"mode": "int8-dynamic"}, tmp_path / "int8")
    assert int8.precision.startswith("int8") and int8.lineage["report"]["quantized_nodes"]
    texts = corpus()[:16]
    a, b = Predictor(int8).encode(texts), Predictor(tiny_tf_onnx).encode(texts)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.945  # measured 0.951 (per-channel dynamic int8 of the tiny encoder, 16 sentences)


def test_fp16_graph_to_onnx(tiny_tf_fp16, tmp_path):
    import onnx

    from bertopt.registry import run_stage

    art = run_stage("export", tiny_tf_fp16, {"to": "onnx"}, tmp_path / "onnx")
    assert art.precision == "fp16"
    model = onnx.load(art.model_path)
    half_inits = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
    assert half_inits
    assert all(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for vi in model.graph.output)
    assert art.lineage["report"]["max_abs_diff_vs_parent"] < 2e-2


def test_savedmodel_artifact_exports_to_onnx_directly(tiny_tf_savedmodel, tmp_path, cli):
    """A tf-savedmodel artifact is frozen in memory on the way to ONNX."""
    code, out, err = cli("export", tiny_tf_savedmodel.path, "--to", "onnx", "--out", tmp_path / "onnx")
    assert code == 0, err
    from bertopt.artifact import Artifact

    art = Artifact.load(tmp_path / "onnx")
    assert art.model_format == "onnx" and art.lineage["report"]["max_abs_diff_vs_parent"] <= 1e-4
    assert art.source["kind"] == "tf-savedmodel"  # validated against the SavedModel run in TensorFlow
    code, out, err = cli("inspect", tmp_path / "onnx")
    assert code == 0 and "Erf" in out


def test_inspect_shows_tf_graph_ops(tiny_pruned, cli):
    code, out, _ = cli("inspect", tiny_pruned.path)
    assert code == 0 and "tf-graphdef" in out and "BatchMatMulV2" in out
