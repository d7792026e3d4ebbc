"""export --to onnx for TensorFlow graph artifacts (frozen / pruned / fp16 GraphDef, or a SavedModel) via tf2onnx.

tf2onnx 1.17 lags TensorFlow 2.21: some ops convert "successfully" into nodes ONNX Runtime cannot load (exact
GELU's ``Erfc`` is one). Every such gap is closed by a registered handler, not an ``if`` in the driver:

* ``@tf_op_handler("Erfc")`` - a tf2onnx custom op handler, applied during conversion;
* ``@onnx_rewrite("Erfc")`` - an ONNX graph rewrite for the same op if it still reaches the ONNX graph.

After conversion any op that is not a valid ONNX operator is an error naming it. Inputs are renamed without
``:0``, outputs get the artifact's names, dynamic axes are called ``batch`` and ``sequence``, and the model is
checked against its TensorFlow parent on the built-in corpus before the artifact is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from bertopt.errors import UserError, require
from bertopt.plugins import Registry

TF_OP_HANDLERS: Registry[Callable] = Registry("tf2onnx op handler")
ONNX_REWRITES: Registry[Callable] = Registry("ONNX rewrite")


def tf_op_handler(op_type: str):
    """Register a tf2onnx custom-op handler ``fn(ctx, node, name, args)`` for a TensorFlow op."""
    return TF_OP_HANDLERS.register(op_type)


def onnx_rewrite(op_type: str):
    """Register a rewrite ``fn(model, node) -> list[new nodes]`` for a non-ONNX op left in the ONNX graph."""
    return ONNX_REWRITES.register(op_type)


@tf_op_handler("Erfc")
def _erfc_to_one_minus_erf(ctx, node, name, args):
    """Erfc(x) = 1 - Erf(x): exact GELU as TensorFlow writes it (0.5 x erfc(-x/sqrt 2))."""
    from tf2onnx import utils

    np_type = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
    erf = ctx.make_node("Erf", [node.input[0]], op_name_scope=node.name)
    one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype=np_type))
    node.type = "Sub"
    node.domain = ""
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


@onnx_rewrite("Erfc")
def _erfc_onnx(model, node):
    import onnx
    from onnx import helper, numpy_helper

    elem = _elem_type(model, node.input[0])
    one_name = f"{node.name or node.output[0]}_one"
    model.graph.initializer.append(numpy_helper.from_array(
        np.array(1, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem)), one_name))
    erf_out = f"{node.output[0]}_erf"
    return [helper.make_node("Erf", [node.input[0]], [erf_out], name=f"{node.name}_erf"),
            helper.make_node("Sub", [one_name, erf_out], [node.output[0]], name=f"{node.name}_sub")]


def _elem_type(model, tensor: str) -> int:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        if vi.name == tensor and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.FLOAT


def apply_onnx_rewrites(model) -> dict[str, int]:
    """Replace every node that has a registered rewrite; returns how many of each were rewritten."""
    done: dict[str, int] = {}
    new_nodes = []
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ONNX_REWRITES:
            new_nodes.extend(ONNX_REWRITES.get(node.op_type)(model, node))
            done[node.op_type] = done.get(node.op_type, 0) + 1
        else:
            new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return done


def invalid_ops(model) -> list[str]:
    import onnx

    opset = {o.domain or "": o.version for o in model.opset_import}
    bad = set()
    for node in model.graph.node:
        domain = node.domain or ""
        if domain not in ("", "ai.onnx", "com.microsoft"):
            bad.add(f"{domain}.{node.op_type}")
        elif domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type, max_inclusive_version=opset.get("", 17)):
            bad.add(node.op_type)
    return sorted(bad)


def convert_graph_def(graph_def, inputs: list[str], outputs: list[str], opset: int):
    """tf2onnx with bertopt's handlers and rewrites; returns (ONNX model, report)."""
    import tf2onnx

    handlers = {op: (fn, []) for op, fn in TF_OP_HANDLERS.items()}
    rename = {f"{n}:0": n for n in list(inputs) + list(outputs)}
    model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=[f"{n}:0" for n in inputs],
                                              output_names=[f"{n}:0" for n in outputs], opset=opset,
                                              custom_op_handlers=handlers, tensors_to_rename=rename)
    handled = sorted({n.op for n in graph_def.node if n.op in TF_OP_HANDLERS})
    rewritten = apply_onnx_rewrites(model)
    bad = invalid_ops(model)
    if bad:
        raise UserError(f"tf2onnx {tf2onnx.__version__} left operators ONNX cannot run: {', '.join(bad)}; "
                        "add a handler in bertopt.tf.to_onnx (@tf_op_handler) or report it")
    from bertopt.onnx_graph.util import set_dynamic_axis_names

    set_dynamic_axis_names(model)
    return model, {"tf_op_handlers_used": handled, "onnx_rewrites_applied": rewritten,
                   "converter": f"tf2onnx {tf2onnx.__version__}"}


def export_graphdef_to_onnx(art, config, out_dir: Path, overwrite: bool):
    require("tensorflow", "tf", "exporting TensorFlow graphs to ONNX")
    require("tf2onnx", "tf", "exporting TensorFlow graphs to ONNX")
    import onnx

    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import graph_stats, save_onnx
    from bertopt.runtime.tf_session import check_frozen, load_graph_def
    from bertopt.stages.common import check_against, worst_abs_diff
    from bertopt.tf.graph import graph_stats as tf_graph_stats

    source = None
    if art.model_format == "tf-savedmodel":
        from bertopt.tf.freeze import frozen_graph_of, savedmodel_source
        from bertopt.tf.sources import open_tf_model

        graph_def = frozen_graph_of(open_tf_model(art))
        source = savedmodel_source(art)
    else:
        graph_def = load_graph_def(art.model_path)
    check_frozen(graph_def, str(art.path))
    inputs = [i["name"] for i in art.inputs]
    outputs = art.output_names
    model, report = convert_graph_def(graph_def, inputs, outputs, config["opset"])
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise UserError(f"tf2onnx produced an invalid ONNX model: {str(exc).splitlines()[0]}; please report it") \
            from None
    with ArtifactWriter(out_dir, stage="export", params=config, parent=art, source=source,
                        overwrite=overwrite) as w:
        w.runtime = "onnxruntime"
        w.copy_tokenizer(art)
        save_onnx(model, w.dir / "model.onnx")
        w.set_model("model.onnx", "onnx", [dict(i) for i in art.inputs], art.outputs, precision=art.precision)
        w.report.update({"before": tf_graph_stats(graph_def), "after": graph_stats(model), "opset": config["opset"],
                         **report})
        stats = check_against(w, art, corpus()[:48])
        diff = worst_abs_diff(stats)
        w.report["max_abs_diff_vs_parent"] = diff
        # fp16 kernels differ between TensorFlow and ONNX Runtime (accumulation order), so fp16 graphs are held
        # to fp16's resolution rather than fp32's
        tolerance = config["check_tolerance"] if art.precision == "fp32" else max(config["check_tolerance"], 2e-2)
        if not diff <= tolerance:
            raise UserError(f"the ONNX model differs from its TensorFlow graph by {diff:.3g} (> {tolerance:g}); "
                            "an op is converted wrongly, please report it")
    return w.artifact
