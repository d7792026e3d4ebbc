"""The graph helpers the attention fusions share: ordering and clean-up of a rewritten ONNX graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bertopt.onnx_graph.fusions.graph import remove_dead_nodes, topological_sort


def _graph_out_of_order() -> onnx.ModelProto:
    # Clip leaves its optional min out ("") and Dropout leaves its optional mask output out (""): an omitted
    # name must not link them, or Clip -> Relu -> Dropout -> Clip looks like a cycle
    nodes = [helper.make_node("Dropout", ["a"], ["b", ""], name="drop"),
             helper.make_node("Relu", ["c"], ["a"], name="relu"),
             helper.make_node("Identity", ["c"], ["unused"], name="dead"),
             helper.make_node("Clip", ["x", "", "hi"], ["c"], name="clip")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.array(1.0, np.float32), "hi"),
                               numpy_helper.from_array(np.array(3.0, np.float32), "never_read")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_topological_sort_ignores_omitted_optional_names_and_dead_nodes_go():
    model = _graph_out_of_order()
    topological_sort(model.graph)
    assert [n.name for n in model.graph.node if n.name != "dead"] == ["clip", "relu", "drop"]
    assert remove_dead_nodes(model) == 1
    assert [n.name for n in model.graph.node] == ["clip", "relu", "drop"]
    assert [i.name for i in model.graph.initializer] == ["hi"]
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"x": np.array([-2.0, 5.0], np.float32)})[0]
    np.testing.assert_allclose(out, [0.0, 1.0])
