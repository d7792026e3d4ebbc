"""prune and fp16 on frozen TensorFlow graphs."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.tf


def test_prune_strips_and_folds(tiny_pruned, tiny_frozen):
    from bertopt.runtime.tf_session import load_graph_def

    rep = tiny_pruned.lineage["report"]
    steps = rep["steps"]
    assert steps["frozen"] == tiny_frozen.lineage["report"]["after"]["nodes"]
    assert steps["strip_identity_noop_assert"] < steps["extract_sub_graph"]
    assert steps["grappler_constfold_arithmetic"] < steps["strip_identity_noop_assert"]
    assert rep["after"]["nodes"] == steps["grappler_constfold_arithmetic"] + 0
    assert rep["max_abs_diff_vs_parent"] <= 1e-5
    ops = [n.op for n in load_graph_def(tiny_pruned.model_path).node]
    assert "NoOp" not in ops and "Assert" not in ops
    # the only Identity nodes left are the named outputs
    identities = sorted(n.name for n in load_graph_def(tiny_pruned.model_path).node if n.op == "Identity")
    assert identities == ["last_hidden_state", "sentence_embedding"]
    assert rep["before"]["ops"]["Identity"] > 2


def test_prune_keeps_only_the_chosen_output(tiny_frozen, tiny_pruned, tmp_path):
    from bertopt.data import corpus
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor

    art = run_stage("prune", tiny_frozen, {"outputs": ["sentence_embedding"]}, tmp_path / "p")
    assert [o["name"] for o in art.outputs] == ["sentence_embedding"]
    assert art.model_info["primary_output"] == "sentence_embedding"
    texts = corpus()[:12]
    np.testing.assert_allclose(Predictor(art).encode(texts), Predictor(tiny_frozen).encode(texts), atol=1e-5)


def test_fp16_keeps_islands_and_has_no_nan(tiny_tf_fp16, tiny_pruned):
    from bertopt.runtime.tf_session import load_graph_def

    art = tiny_tf_fp16
    assert art.precision == "fp16"
    rep = art.lineage["report"]
    kept = set(rep["kept_fp32_nodes"])
    nodes = {n.name: n for n in load_graph_def(art.model_path).node}
    kept_ops = {nodes[k].op for k in kept}
    assert {"Softmax", "Mean", "Rsqrt", "SquaredDifference", "Sum"} <= kept_ops
    assert any("LayerNorm" in k for k in kept)
    assert rep["mask_path_nodes"] and set(rep["mask_path_nodes"]) <= kept
    assert {"last_hidden_state", "sentence_embedding"} <= kept
    half = tf_half_nodes(nodes)
    assert {"MatMul", "BatchMatMulV2"} <= {nodes[n].op for n in half}
    assert not kept & half
    for name, stats in rep["accuracy_vs_parent"].items():
        assert stats["nan_or_inf"] == 0
        assert stats["cos_min"] > 0.9999, name


def tf_half_nodes(nodes):
    import tensorflow as tf

    half = tf.float16.as_datatype_enum
    return {name for name, n in nodes.items() if any(v.type == half for k, v in n.attr.items() if k != "SrcT")}


def test_naive_fp16_gives_nan_that_islands_prevent(tiny_pruned, tmp_path):
    """Everything-to-half (bert-as-service's way) turns the additive mask into NaN; bertopt's islands do not."""
    from bertopt.data import corpus
    from bertopt.runtime import Predictor
    from bertopt.runtime.tf_session import graph_def_function, load_graph_def
    from bertopt.tf.fp16 import convert_graph_to_fp16

    gd = load_graph_def(tiny_pruned.model_path)
    pred = Predictor(tiny_pruned)
    feeds, _ = pred.feeds_for(pred.tokenize(corpus()[:8]))
    names = [i["name"] for i in tiny_pruned.inputs]

    def run(graph):
        import tensorflow as tf

        fn = graph_def_function(graph, names, ["sentence_embedding"])
        return fn(*[tf.constant(feeds[n]) for n in names])[0].numpy()

    naive, _, _ = convert_graph_to_fp16(gd, ["attention_mask"], ["last_hidden_state", "sentence_embedding"], [], [],
                                        naive=True)
    islands, _, _ = convert_graph_to_fp16(gd, ["attention_mask"], ["last_hidden_state", "sentence_embedding"], [], [])
    assert not np.isfinite(run(naive)).all()
    assert np.isfinite(run(islands)).all()


def test_fp16_rejects_unknown_exclude_node(tiny_pruned, tmp_path, cli):
    code, out, err = cli("quantize", tiny_pruned.path, "--mode", "fp16", "--exclude-nodes", "no_such_node",
                         "--out", tmp_path / "x")
    assert code == 2 and "no_such_node" in err
    assert not (tmp_path / "x").exists()


def test_fp16_exclude_node_is_kept_fp32(tiny_pruned, tmp_path):
    from bertopt.registry import run_stage
    from bertopt.runtime.tf_session import load_graph_def

    matmul = next(n.name for n in load_graph_def(tiny_pruned.model_path).node if n.op == "MatMul")
    art = run_stage("quantize", tiny_pruned, {"mode": "fp16", "exclude_nodes": [matmul]}, tmp_path / "q")
    assert matmul in art.lineage["report"]["kept_fp32_nodes"]
    nodes = {n.name: n for n in load_graph_def(art.model_path).node}
    assert matmul not in tf_half_nodes(nodes)
