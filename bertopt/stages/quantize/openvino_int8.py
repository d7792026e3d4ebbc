"""int8 for the OpenVINO runtime: int8 weights in the ONNX file, activations quantised by OpenVINO at run time
per token, in groups of ``activation_group_size`` channels.

``quantize --mode int8-dynamic --runtime openvino`` rewrites every weight MatMul of an un-fused ONNX model as
``MatMul(x, DequantizeLinear(W_int8, scale))`` with one symmetric scale per output channel (round-to-nearest or
GPTQ rounding). OpenVINO's CPU plugin reads that pattern as a FullyConnected layer with compressed int8 weights
and, with ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` set, quantises each token's activations to int8 per group of
channels inside the GEMM (VNNI int8 compute). The manifest records ``runtime: openvino`` and those options, so
every Predictor built on the artifact (validate, bench, Spark, the server) runs exactly this. With ``Gather`` in
``--op-types`` the embedding tables are stored int8 too, one scale per row (MiniLM's word embedding is 47 of
its 59 MB once the MatMuls are int8).

Why a second int8 path: ONNX Runtime's dynamic int8 uses one activation scale for the whole batch matrix, so a
single outlier token ([CLS]) or channel coarsens every other value; on the bundled MiniLM that costs cosine min
0.96, and the ONNX graph rewrites that fix it (per-token scaling, smoothing) cost 15-25% of the speed. A
per-token, per-group activation scale inside the int8 kernel removes that error at no extra passes
(docs/quantization.md has the measurements).

With ``--accuracy-target`` the search of :mod:`bertopt.stages.quantize.accuracy_aware` keeps the most sensitive weights
fp32 (plain MatMul, run in the chosen float precision) until the target holds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from bertopt.errors import UserError
from bertopt.params import STATIC_FULL_BATCH, Param
from bertopt.stages.compile import PARAMS as COMPILE_PARAMS
from bertopt.stages.compile import precision_label, refuse_ort_contrib_ops
from bertopt.stages.quantize.accuracy_aware import ACCURACY_GROUP
from bertopt.stages.quantize.gptq import WEIGHT_ROUNDING
from bertopt.stages.quantize.methods import Method

ACTIVATION_GROUP_SIZE = Param("activation_group_size", int, 32, "Channels per activation scale (each token's "
                              "activations are quantised to int8 in groups this wide inside the MatMul); 0 keeps "
                              "activations in the float precision (weights-only int8).", min=0)
KEEP_FFN_OUTPUT = Param("keep_ffn_output", bool, None, "Keep the FFN output projections in float activations "
                        "(their GELU-fed inputs are the ones int8 handles worst). Default: on for int8-static (one "
                        "fixed scale per tensor meets them), off for int8-dynamic (per-token scales mostly cope; on "
                        "MiniLM keeping them float lifts cos min from 0.993 to 0.997).")
# the compile stage's parameter, same meaning: the float precision of the OpenVINO execution the manifest records
# (compile leaves it unset to tell a given one from the default; here it always applies)
INFERENCE_PRECISION = next(p for p in COMPILE_PARAMS if p.name == "inference_precision").with_(default="bf16")


def ffn_output_names(art, names: list[str]) -> list[str]:
    """The FFN output projections among ``names`` (MatMul node names), as the artifact's family declares them."""
    from bertopt.families import family_by_name

    pattern = re.compile(family_by_name(art.model_info.get("family")).ffn_output_matmul)
    return [n for n in names if pattern.search(n)]


QMAX = 127  # symmetric int8 weights on [-127, 127], zero point 0 (the same grid as ONNX Runtime's quantiser)
MIN_OPSET = 13  # per-axis DequantizeLinear


def runtime_options(config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``runtime_options`` for an OpenVINO int8 artifact."""
    return {"inference_precision": config["inference_precision"], "performance_hint": "LATENCY",
            "dynamic_quantization_group_size": int(config["activation_group_size"])}


def check_config(art, model, config: dict[str, Any]) -> None:
    """Refuse, with the fix, what this path cannot do with this model (options of other methods are refused by
    the declaration)."""
    if not set(WEIGHT_INPUTS) & set(config["op_types"]):
        raise UserError("--runtime openvino quantises weight MatMuls and embedding tables (Gather); name MatMul "
                        "and/or Gather in --op-types")
    refuse_ort_contrib_ops(art, model, "quantise the exported or pruned artifact (before 'optimize') with "
                           "--runtime openvino")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < MIN_OPSET:
        raise UserError(f"{art.path} uses ONNX opset {opset}; per-channel int8 weights need opset {MIN_OPSET} or "
                        f"newer: re-export with 'bertopt export ... --opset 17'")


# op type -> (input that holds the weight, DequantizeLinear axis = the axis with one scale per entry): a MatMul's
# ``x @ W`` gets one scale per output column, an embedding table (Gather) one per row (token)
WEIGHT_INPUTS = {"MatMul": (1, 1), "Gather": (0, 0)}


def quantizable_weights(model, op_types) -> list[tuple[str, str, str]]:
    """(node name, weight initialiser, op type) of every MatMul (second input) and Gather (table) in ``op_types``
    that reads a 2-D float initialiser, in graph order: the candidates for int8 weights."""
    import onnx

    from bertopt.onnx_graph.util import weight_matmuls

    floats = {i.name for i in model.graph.initializer
              if len(i.dims) == 2 and i.data_type == onnx.TensorProto.FLOAT}
    # a node is known by its name and inputs (unnamed nodes share the empty name)
    matmuls = {(node.name, *node.input) for node, weight in weight_matmuls(model, ("MatMul",)) if weight in floats}
    found = []
    for n in model.graph.node:
        if n.op_type not in WEIGHT_INPUTS or n.op_type not in op_types or len(n.input) != 2:
            continue
        if n.op_type == "MatMul" and (n.name, *n.input) in matmuls:
            found.append((n.name, n.input[1], n.op_type))
        elif n.op_type == "Gather" and n.input[0] in floats and n.input[1] not in floats:
            found.append((n.name, n.input[0], n.op_type))
    return found


def channel_scales(weight: np.ndarray, axis: int) -> np.ndarray:
    """One symmetric scale per entry of ``axis`` (never zero)."""
    scale = np.abs(weight).max(axis=1 - axis).astype(np.float64) / QMAX
    scale[scale == 0] = 1.0
    return scale


def round_weight(weight: np.ndarray, axis: int, hessian: np.ndarray | None, cache: dict | None = None,
                 key: str | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None]:
    """(int8 values, float32 scales, GPTQ error row or None) of one weight; GPTQ when ``hessian`` is given (MatMul
    weights: GPTQ compensates along the input rows)."""
    if cache is not None and key in cache:
        return cache[key]
    scale = channel_scales(weight, axis)
    grid = scale if axis == 1 else scale[:, None]
    nearest = np.clip(np.round(weight / grid), -QMAX, QMAX).astype(np.int8)
    row = None
    q = nearest
    if hessian is not None and axis == 1:
        from bertopt.stages.quantize.gptq import round_with_report

        q, row = round_with_report(key, weight, nearest, scale, hessian)
    result = (q, scale.astype(np.float32), row)
    if cache is not None:
        cache[key] = result
    return result


def compress_weights(model, op_types, keep_fp32: set[str], hessians: dict[str, np.ndarray] | None = None,
                     cache: dict | None = None):
    """A copy of ``model`` with the weight of every quantisable node of ``op_types`` not in ``keep_fp32`` stored
    as int8 + per-channel (MatMul) or per-row (Gather) scale behind a ``DequantizeLinear``; returns (model,
    GPTQ rows, number compressed)."""
    import onnx
    from onnx import helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    targets = [t for t in quantizable_weights(out, op_types) if t[0] not in keep_fp32]
    by_node = {n.name: n for n in graph.node}
    made: dict[str, str] = {}  # weight -> its dequantised tensor (one int8 copy per weight, even if shared)
    new_inits, dq_nodes, rows = [], [], []
    for node_name, weight, op_type in targets:
        index, axis = WEIGHT_INPUTS[op_type]
        if weight not in made:
            w = numpy_helper.to_array(inits[weight]).astype(np.float32)
            q, scale, row = round_weight(w, axis, None if hessians is None else hessians.get(weight), cache, weight)
            if row is not None:
                rows.append(row)
            q_name, s_name, dq_name = f"{weight}_int8", f"{weight}_int8_scale", f"{weight}_dequantized"
            new_inits += [numpy_helper.from_array(q, q_name), numpy_helper.from_array(scale, s_name)]
            dq_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [dq_name], axis=axis,
                                             name=f"{weight}_DequantizeLinear"))
            made[weight] = dq_name
        by_node[node_name].input[index] = made[weight]
    still_used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name not in made or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    # the dequantisers read initialisers only, so they can lead the (topologically sorted) node list
    for i, dq in enumerate(dq_nodes):
        graph.node.insert(i, dq)
    return out, rows, len(targets)


def quantize_int8_openvino(art, config: dict[str, Any], out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require
    from bertopt.onnx_graph.util import ensure_node_names, graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.stages.common import check_against, settle_static_full_batch
    from bertopt.stages.quantize.calibration import calibration_statistics, load_calibration_texts

    require("openvino", "openvino", "int8 for the OpenVINO runtime")
    model = load_onnx(art.model_path)
    check_config(art, model, config)
    ensure_node_names(model.graph)  # exclusion and the search work by node name
    before = graph_stats(model)
    user_excluded = set(config["exclude_nodes"])
    op_types = list(config["op_types"])
    weights = quantizable_weights(model, op_types)
    if config.get("keep_ffn_output"):
        user_excluded |= set(ffn_output_names(art, [name for name, _, op in weights if op == "MatMul"]))
    candidates = [(name, op) for name, _, op in weights if name not in user_excluded]
    if not candidates:
        raise UserError(f"{art.path} has no {'/'.join(op_types)} with a weight to quantise (or all are in "
                        "--exclude-nodes)")
    # GPTQ's X^T X per weight (check_config has refused the graph rewrites, so the model is unchanged)
    model, _, _, hessians = calibration_statistics(art, model, config)
    texts = load_calibration_texts(config) if config["accuracy_target"] else None
    options = runtime_options(config)
    precision = precision_label("int8-dynamic", config["inference_precision"])
    cache: dict = {}
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        w.runtime = "openvino"
        w.extra["runtime_options"] = options
        search_report = None
        if config["accuracy_target"]:
            from bertopt.stages.quantize.accuracy_aware import accuracy_targets, node_costs, search

            targets = accuracy_targets(config, art)
            rows_by_path: dict[str, list] = {}

            def build(kept: list[str], path: Path) -> None:
                compressed, rows, _ = compress_weights(model, op_types, user_excluded | set(kept), hessians,
                                                             cache)
                rows_by_path[str(path)] = rows
                save_onnx(compressed, path)

            with w.scratch() as tmp:
                result, search_report = search(art, config, targets, texts, candidates, build, tmp,
                                        costs=node_costs(model, [n for n, _ in candidates]),
                                        runtime="openvino", runtime_options=options)
                (w.dir / "model.onnx").write_bytes(Path(result["model"]).read_bytes())
                gptq_rows = rows_by_path[str(result["model"])]
            kept = result["kept"]
        else:
            compressed, gptq_rows, _ = compress_weights(model, op_types, user_excluded, hessians, cache)
            save_onnx(compressed, w.dir / "model.onnx")
            kept = []
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=precision)
        settle_static_full_batch(w, config["static_full_batch"], config.get("threads"))
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        q = load_onnx(w.dir / "model.onnx")
        w.report.update({"before": before, "after": graph_stats(q), "runtime": "openvino",
                         "quantized_nodes": len(candidates) - len(kept),
                         "kept_fp32_nodes": sorted(user_excluded) + kept,
                         "activations": f"int8 per token in groups of {options['dynamic_quantization_group_size']} "
                                        "channels, at run time (OpenVINO dynamic quantisation)"
                                        if options["dynamic_quantization_group_size"] else
                                        f"{config['inference_precision']} (weights-only int8)",
                         "accuracy_vs_parent": stats})
        if search_report is not None:
            w.report["accuracy_search"] = search_report
        if hessians is not None:
            from bertopt.stages.quantize.gptq import report_section

            w.report["gptq"] = report_section(gptq_rows)
    return w.artifact


METHODS = (Method("OpenVINO int8", "int8-dynamic", "openvino",
                  (WEIGHT_ROUNDING, ACTIVATION_GROUP_SIZE, INFERENCE_PRECISION, KEEP_FFN_OUTPUT,
                   STATIC_FULL_BATCH, ACCURACY_GROUP),
                  quantize_int8_openvino),)
