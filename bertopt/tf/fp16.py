"""quantize --mode fp16 for frozen TensorFlow graphs, with fp32 islands.

bert-as-service cast the whole graph to half; the attention mask's additive constant (-3.4e38 here, -1e4 in
Google's BERT) and LayerNorm's variance/epsilon then overflow or underflow, and outputs turn NaN/Inf. Here
weights and matrix products go fp16 while these stay fp32 (and are reported under ``kept_fp32_nodes``):

* LayerNorm (every node under a ``LayerNorm`` / ``layer_norm`` name scope), Softmax, reductions, Rsqrt/Sqrt/Pow,
  Erf/Erfc, and any TF op type or ONNX-style name given in ``keep_fp32_ops``;
* the attention-mask path (every node computed from the mask input and constants only) and the first nodes that
  consume it (the score + mask addition, the pooling weights);
* the graph outputs (inputs are integer ids) and nodes named in ``exclude_nodes``.

A Cast is inserted on every edge that crosses between fp16 and fp32.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tensorflow as tf

from bertopt.errors import UserError
from bertopt.runtime.tf_session import check_frozen, load_graph_def
from bertopt.tf.graph import GRAPH_FILE, graph_stats, node_output_dtypes, save_graph_def

_FLOAT, _HALF = tf.float32.as_datatype_enum, tf.float16.as_datatype_enum
# ONNX operator names (the quantize stage's shared default list) -> TensorFlow op types
_ONNX_TO_TF = {"LayerNormalization": [], "SkipLayerNormalization": [], "EmbedLayerNormalization": [],
               "Softmax": ["Softmax", "LogSoftmax"], "ReduceMean": ["Mean"], "ReduceSum": ["Sum"],
               "ReduceMax": ["Max"], "ReduceL2": ["EuclideanNorm"], "Pow": ["Pow"], "Sqrt": ["Sqrt", "Rsqrt"],
               "Erf": ["Erf", "Erfc"]}
_ALWAYS_FP32_OPS = {"Mean", "Sum", "Max", "Min", "Prod", "Softmax", "LogSoftmax", "Rsqrt", "Sqrt", "Pow",
                    "SquaredDifference", "Exp", "Log", "EuclideanNorm"}
_LAYER_NORM_SCOPE = re.compile(r"(?i)(^|/)(layer_?norm\w*|layer_normalization\w*)(/|$)")
_FP16_MAX = 65504.0


def quantize_tf_fp16(art, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.stages.common import check_against, worst_abs_diff

    if art.model_format != "tf-graphdef":
        raise UserError(f"fp16 works on frozen TensorFlow graphs; {art.path} is a {art.model_format}, run "
                        "'bertopt freeze' on it first")
    if config.get("accuracy_target"):
        raise UserError("--accuracy-target is not available for TensorFlow graphs; export to ONNX first, or "
                        "keep nodes in fp32 with --exclude-nodes")
    if art.precision != "fp32":
        raise UserError(f"{art.path} is already {art.precision}; fp16 conversion starts from an fp32 graph")
    graph_def = load_graph_def(art.model_path)
    check_frozen(graph_def, str(art.path))
    mask_inputs = [i["name"] for i in art.inputs if i.get("role") == "attention_mask"]
    half_graph, kept, counts = convert_graph_to_fp16(graph_def, mask_inputs, art.output_names,
                                                     config["keep_fp32_ops"], config["exclude_nodes"])
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        save_graph_def(half_graph, w.dir / GRAPH_FILE)
        w.set_model(GRAPH_FILE, "tf-graphdef", art.inputs, art.outputs, precision="fp16")
        w.extra["tensorflow"] = art.manifest.get("tensorflow", {})
        stats = check_against(w, art, corpus())
        w.report.update({"before": graph_stats(graph_def), "after": graph_stats(half_graph),
                         "kept_fp32_nodes": kept, **counts, "accuracy_vs_parent": stats,
                         "max_abs_diff_vs_parent": worst_abs_diff(stats)})
        bad = {k: v["nan_or_inf"] for k, v in stats.items() if v["nan_or_inf"]}
        if bad:
            raise UserError(f"fp16 graph produced NaN/Inf on the built-in corpus ({bad}); keep more operators in "
                            "fp32 with --keep-fp32-ops or --exclude-nodes")
    return w.artifact


def _float_attrs(node) -> list[str]:
    return [k for k, v in node.attr.items() if v.type == _FLOAT or (v.list.type and _FLOAT in v.list.type)]


def _topological(graph_def) -> list:
    by_name = {n.name: n for n in graph_def.node}
    order, state = [], {}
    for root in graph_def.node:
        stack = [(root.name, False)]
        while stack:
            name, done = stack.pop()
            if done:
                state[name] = 2
                order.append(by_name[name])
                continue
            if state.get(name):
                continue
            state[name] = 1
            stack.append((name, True))
            for inp in by_name[name].input:
                dep = inp.lstrip("^").split(":")[0]
                if dep in by_name and not state.get(dep):
                    stack.append((dep, False))
    return order


def _edge(inp: str) -> tuple[str, int]:
    name, _, port = inp.partition(":")
    return name, int(port or 0)


def convert_graph_to_fp16(graph_def, mask_inputs: list[str], outputs: list[str], keep_fp32_ops: list[str],
                          exclude_nodes: list[str], naive: bool = False):
    """Returns (fp16 GraphDef, names of float nodes kept fp32, counts). ``naive=True`` casts everything but the
    outputs, as bert-as-service did (kept only to show what the fp32 islands prevent)."""
    nodes = _topological(graph_def)
    by_name = {n.name: n for n in nodes}
    unknown = [n for n in exclude_nodes if n not in by_name]
    if unknown:
        raise UserError(f"--exclude-nodes: the graph has no node '{unknown[0]}' (see 'bertopt inspect' for names)")
    dtypes = node_output_dtypes(graph_def)
    keep_ops = set(_ALWAYS_FP32_OPS)
    for op in keep_fp32_ops:
        keep_ops.update(_ONNX_TO_TF.get(op, [op]))
    float_nodes = {n.name for n in nodes if _float_attrs(n)}
    consts = {n.name for n in nodes if n.op == "Const"}

    # the attention-mask path: computed from the mask input and constants only
    mask_path = set(mask_inputs)
    for node in nodes:
        data = [_edge(i)[0] for i in node.input if not i.startswith("^")]
        if data and node.name not in mask_path and all(d in mask_path or d in consts for d in data) \
                and any(d in mask_path for d in data):
            mask_path.add(node.name)
    mask_consumers = {n.name for n in nodes if n.name not in mask_path and any(
        _edge(i)[0] in mask_path for i in n.input if not i.startswith("^"))}

    fp32 = {n.name for n in nodes if n.op in keep_ops or _LAYER_NORM_SCOPE.search(n.name)}
    fp32 |= mask_path | mask_consumers | set(outputs) | set(exclude_nodes)
    if naive:
        fp32 = set(outputs)
    fp32 &= float_nodes
    half = float_nodes - fp32 - consts

    consumers: dict[str, set[str]] = {}
    for node in nodes:
        for inp in node.input:
            if not inp.startswith("^"):
                consumers.setdefault(_edge(inp)[0], set()).add(node.name)
    for name in consts & float_nodes:
        value = tf.make_ndarray(by_name[name].attr["value"].tensor)
        users = consumers.get(name, set())
        in_range = value.size == 0 or float(np.max(np.abs(value))) <= _FP16_MAX
        if users and users <= half and (in_range or naive):
            half.add(name)

    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    casts: dict[tuple[str, int, int], str] = {}
    cast_nodes = []

    def cast_of(inp: str, to: int) -> str:
        src, port = _edge(inp)
        key = (src, port, to)
        if key not in casts:
            name = f"{src}{'_' + str(port) if port else ''}/{'to_fp16' if to == _HALF else 'to_fp32'}"
            node = tf.compat.v1.NodeDef(name=name, op="Cast", input=[inp])
            node.attr["SrcT"].type = _FLOAT if to == _HALF else _HALF
            node.attr["DstT"].type = to
            node.attr["Truncate"].b = False
            casts[key] = name
            cast_nodes.append(node)
        return casts[key]

    for node in nodes:
        new = tf.compat.v1.NodeDef()
        new.CopyFrom(node)
        if node.name in half:
            for key in _float_attrs(node):
                attr = new.attr[key]
                if attr.type == _FLOAT:
                    attr.type = _HALF
                else:
                    attr.list.type[:] = [_HALF if t == _FLOAT else t for t in attr.list.type]
            if node.op == "Const":
                value = tf.make_ndarray(node.attr["value"].tensor).astype(np.float16)
                new.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
        mine = node.name in half
        for i, inp in enumerate(node.input):
            if inp.startswith("^"):
                continue
            src, port = _edge(inp)
            src_dtypes = dtypes.get(src, [])
            if port >= len(src_dtypes) or src_dtypes[port] != tf.float32:
                continue
            theirs = src in half
            if theirs != mine:
                new.input[i] = cast_of(inp, _HALF if mine else _FLOAT)
        out.node.append(new)
    out.node.extend(cast_nodes)
    kept = sorted(n for n in fp32 if n not in consts)
    counts = {"fp16_nodes": len(half - consts), "fp16_constants": len(half & consts),
              "fp32_constants": len((consts & float_nodes) - half), "casts_inserted": len(cast_nodes),
              "mask_path_nodes": sorted(mask_path - set(mask_inputs))}
    return out, kept, counts
