"""fp16 conversion of ONNX models: fp16 weights and compute, fp32 inputs/outputs, fp32 islands.

LayerNorm, Softmax, reductions and the attention-mask path stay fp32 (their ranges overflow fp16: the mask's
additive constant is about -3.4e38). With ``accuracy_target`` the search of
:mod:`bertopt.stages.quantize.accuracy_aware` picks further fp32 islands until the target holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import Param
from bertopt.stages.quantize.accuracy_aware import ACCURACY_GROUP
from bertopt.stages.quantize.methods import Method

KEEP_FP32_OPS = Param("keep_fp32_ops", list, ["LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization",
                      "Softmax", "ReduceMean", "ReduceSum", "ReduceL2", "ReduceMax", "Pow", "Sqrt", "Erf"],
                      "Operator types kept in fp32.")


def check_keep_fp32_ops(model, keep_fp32_ops: list[str], model_file) -> None:
    """An operator type in ``--keep-fp32-ops`` that the graph does not have (a typo: 'softmax', a fused op of an
    un-optimised graph) kept nothing fp32, while the list replaced the default one: refused, naming the type. The
    default types are exempt, so the default list with a type added suits any graph."""
    import difflib

    present = {node.op_type for node in model.graph.node}
    missing = [op for op in keep_fp32_ops if op not in present and op not in KEEP_FP32_OPS.default]
    if missing:
        close = difflib.get_close_matches(missing[0], sorted(present), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"--keep-fp32-ops {missing[0]}: {model_file} has no operator of that type{hint}, so it "
                        "would keep nothing fp32; name operator types of this graph ('bertopt inspect' lists them)")


def mask_path_nodes(graph, mask_inputs=("attention_mask", "input_mask")) -> set[str]:
    """Names of nodes computed only from the attention mask (and constants): the additive mask with its
    huge negative constant lives here and must stay fp32."""
    inits = {i.name for i in graph.initializer}
    derived = {m for m in mask_inputs}
    other_inputs = {i.name for i in graph.input if i.name not in derived and i.name not in inits}
    tainted = set(other_inputs)  # values that depend on a non-mask input
    names = set()
    for node in graph.node:
        ins = [i for i in node.input if i]
        if any(i in tainted for i in ins):
            tainted.update(node.output)
            continue
        if any(i in derived for i in ins):
            derived.update(node.output)
            names.add(node.name)
    return names


# operators a mask value passes through unchanged in kind (adds, layout moves): the additive mask's fill is still in
# their output, so they stay fp32 up to the operator that consumes the scores (Softmax, fused attention)
_MASK_CARRIERS = {"Add", "Sub", "Where", "Reshape", "Transpose", "Gather", "Expand", "Unsqueeze", "Squeeze",
                  "Concat", "Slice", "Identity"}


def mask_carrier_nodes(graph, mask_nodes: set[str]) -> set[str]:
    """Names of the add/layout nodes downstream of the mask path that carry its fill into the attention scores
    (a bias folded into a model's own scores, as bertopt's DeBERTa rewrite does): in fp16 the fill becomes -inf, and
    a row of -inf makes Softmax NaN."""
    carried = {o for n in graph.node if n.name in mask_nodes for o in n.output}
    names = set()
    for node in graph.node:
        if node.name in mask_nodes or node.op_type not in _MASK_CARRIERS:
            continue
        if any(i in carried for i in node.input if i):
            carried.update(node.output)
            names.add(node.name)
    return names


def unshare_initializers(graph, consumers: set[str]) -> int:
    """Give each of ``consumers`` its own copy of an initializer it shares with other nodes; returns how many
    copies were made. The exporter merges equal constants (a freshly initialised model's LayerNorms all share
    one ones/zeros pair), and ONNX Runtime's fp16 converter names the fp32 cast of a blocked node's initializer
    after the initializer, so two blocked nodes reading one initializer would get two casts of one name."""
    inits = {i.name: i for i in graph.initializer}
    seen: dict[str, int] = {}
    copies = 0
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name not in inits:
                continue
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1 and node.name in consumers:
                clone = graph.initializer.add()
                clone.CopyFrom(inits[name])
                clone.name = f"{name}__copy{copies}"
                node.input[k] = clone.name
                copies += 1
    return copies


def fp16_convert(model, keep_fp32_ops: list[str], keep_nodes: list[str]):
    """fp16 weights and compute, fp32 inputs/outputs and fp32 islands; returns (model, fp32 node names)."""
    from bertopt.errors import require_onnxruntime
    from bertopt.onnx_graph.util import ensure_node_names

    OnnxModel = require_onnxruntime("fp16 conversion", "onnxruntime.transformers.onnx_model").OnnxModel

    ensure_node_names(model.graph)
    mask_nodes = mask_path_nodes(model.graph)
    blocked_nodes = sorted(mask_nodes | mask_carrier_nodes(model.graph, mask_nodes) | set(keep_nodes))
    unshare_initializers(model.graph, set(blocked_nodes) | {n.name for n in model.graph.node
                                                            if n.op_type in keep_fp32_ops})
    wrapper = OnnxModel(model)
    wrapper.convert_float_to_float16(keep_io_types=True, op_block_list=list(keep_fp32_ops),
                                     node_block_list=blocked_nodes, use_symbolic_shape_infer=True)
    wrapper.topological_sort()  # casts inserted around many blocked nodes can land before their producers
    kept = sorted(n.name for n in model.graph.node if n.op_type in keep_fp32_ops) + blocked_nodes
    return wrapper.model, sorted(set(kept))


def _refuse_nan(stats: dict[str, dict]) -> None:
    bad = {k: v["nan_or_inf"] for k, v in stats.items() if v["nan_or_inf"]}
    if bad:
        raise UserError(f"fp16 model produced NaN/Inf on the built-in corpus ({bad}); keep more operators "
                        "in fp32 with --keep-fp32-ops")


def quantize_fp16(art, config: dict[str, Any], out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require_onnxruntime
    from bertopt.onnx_graph.util import graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.stages.common import check_against

    require_onnxruntime("fp16 conversion")
    if config["accuracy_target"]:
        return search_fp16_islands(art, config, out_dir, overwrite)
    model = load_onnx(art.model_path)
    check_keep_fp32_ops(model, config["keep_fp32_ops"], art.model_path)
    before = graph_stats(model)
    model, kept = fp16_convert(model, config["keep_fp32_ops"], config["exclude_nodes"])
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        save_onnx(model, w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision="fp16")
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        w.report.update({"before": before, "after": graph_stats(model), "kept_fp32_nodes": kept,
                         "accuracy_vs_parent": stats})
        _refuse_nan(stats)
    return w.artifact


def search_fp16_islands(art, config: dict[str, Any], out_dir: Path, overwrite: bool):
    """fp16 with fp32 islands: the most sensitive operators stay fp32 until ``accuracy_target`` holds."""
    import onnx

    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import ensure_node_names, graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.stages.common import check_against
    from bertopt.stages.quantize.accuracy_aware import accuracy_targets, node_costs, search
    from bertopt.stages.quantize.calibration import load_calibration_texts

    targets = accuracy_targets(config, art)
    texts = load_calibration_texts(config)
    model = load_onnx(art.model_path)
    check_keep_fp32_ops(model, config["keep_fp32_ops"], art.model_path)
    ensure_node_names(model.graph)
    before = graph_stats(model)
    user_excluded = list(config["exclude_nodes"])
    fixed = set(mask_path_nodes(model.graph)) | set(user_excluded)
    candidates = [(n.name, n.op_type) for n in model.graph.node
                  if n.op_type in config["op_types"] and n.op_type not in config["keep_fp32_ops"]
                  and n.name not in fixed]
    if not candidates:
        raise UserError(f"{art.path} has no {'/'.join(config['op_types'])} operators to convert; check --op-types")
    named = model.SerializeToString()
    kept_by_convert: dict[str, list[str]] = {}

    def build(kept: list[str], path: Path) -> None:
        fresh = onnx.load_from_string(named)
        converted, blocked = fp16_convert(fresh, config["keep_fp32_ops"], user_excluded + kept)
        kept_by_convert[str(path)] = blocked
        save_onnx(converted, path)

    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        with w.scratch() as tmp:
            result, report = search(art, config, targets, texts, candidates, build, tmp,
                                    costs=node_costs(model, [n for n, _ in candidates]))
            (w.dir / "model.onnx").write_bytes(Path(result["model"]).read_bytes())
            blocked = kept_by_convert[str(result["model"])]
        converted = load_onnx(w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision="fp16")
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        w.report.update({"before": before, "after": graph_stats(converted),
                         "kept_fp32_nodes": sorted(set(blocked)),
                         "fp32_islands": result["kept"],
                         "accuracy_search": report,
                         "accuracy_vs_parent": stats})
        _refuse_nan(stats)
    return w.artifact


METHODS = (Method("fp16 conversion", "fp16", "onnxruntime", (KEEP_FP32_OPS, ACCURACY_GROUP), quantize_fp16),)
