"""prune: keep only what the chosen outputs need.

ONNX: remove nodes and initializers no kept output depends on, drop Identity chains, fold nodes whose
inputs are all constants. TensorFlow graphs (``tf-graphdef``) are pruned by ``bertopt.tf.prune``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import Param

NAME = "prune"
HELP = "Remove everything the chosen outputs do not need; fold constants; report counts before/after."
PARAMS = [
    Param("outputs", list, None, "Outputs to keep, comma-separated (default: all), e.g. sentence_embedding."),
    Param("check_tolerance", float, 1e-5, "Max abs difference allowed against the input artifact.", min=0),
]
# A constant larger than this is not folded (folding would duplicate big weights).
_MAX_FOLD_ELEMENTS = 1 << 22


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.stages.common import format_handler, require_onnx_artifact

    art = require_onnx_artifact(input, NAME)
    if art.model_format in ("tf-graphdef", "tf-savedmodel"):
        return format_handler(NAME, art.model_format)(art, config, out_dir, overwrite)
    return prune_onnx_artifact(art, config, out_dir, overwrite)


def prune_onnx_artifact(art, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.stages.common import check_against, worst_abs_diff

    model = load_onnx(art.model_path)
    keep = config["outputs"] or art.output_names
    known = art.output_names
    unknown = [k for k in keep if k not in known]
    if unknown:
        raise UserError(f"unknown output '{unknown[0]}'; this artifact has {', '.join(known)}")
    before = graph_stats(model)
    prune_onnx(model, keep)
    after = graph_stats(model)
    outputs = [o for o in art.outputs if o["name"] in keep]
    with ArtifactWriter(out_dir, stage=NAME, params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        if w.model_info.get("primary_output") not in keep:
            w.model_info["primary_output"] = keep[-1]
        save_onnx(model, w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, outputs, precision=art.precision)
        w.report.update({"before": before, "after": after})
        stats = check_against(w, art, corpus()[:48], outputs=keep)
        w.report["max_abs_diff_vs_parent"] = worst_abs_diff(stats)
        if worst_abs_diff(stats) > config["check_tolerance"]:
            raise UserError(f"pruned model differs from its input by {worst_abs_diff(stats):.3g}; "
                            "this is a bertopt bug, please report it")
    return w.artifact


def prune_onnx(model, keep_outputs: list[str]) -> None:
    """In place: keep the named outputs, fold constants, remove Identity chains and dead nodes."""
    graph = model.graph
    for out in [o for o in graph.output if o.name not in keep_outputs]:
        graph.output.remove(out)
    _fold_constants(model)
    _remove_identities(graph)
    _remove_dead(graph)


def _remove_identities(graph) -> None:
    outputs = {o.name for o in graph.output}
    rename: dict[str, str] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Identity" and node.output[0] not in outputs:
            rename[node.output[0]] = node.input[0]
        else:
            kept.append(node)

    def resolve(name):
        while name in rename:
            name = rename[name]
        return name

    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = resolve(name)
    del graph.node[:]
    graph.node.extend(kept)


def _remove_dead(graph) -> None:
    needed = {o.name for o in graph.output}
    live = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraphs (If/Loop) read outer names too
                for sub in list(attr.g.node if attr.HasField("g") else []):
                    needed.update(sub.input)
    live.reverse()
    del graph.node[:]
    graph.node.extend(live)
    inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [i for i in graph.input if i.name in needed or i.name in {x.name for x in graph.input[:0]}]
    # never drop a model input the runtime feeds, even if unused: keep the artifact's interface stable
    for vi in graph.input:
        if vi not in inputs and vi.name in ("input_ids", "attention_mask", "token_type_ids"):
            inputs.append(vi)
    kept_names = {vi.name for vi in inputs}
    ordered = [vi for vi in graph.input if vi.name in kept_names]
    del graph.input[:]
    graph.input.extend(ordered)
    used = {n for node in graph.node for n in node.output} | needed
    vis = [v for v in graph.value_info if v.name in used]
    del graph.value_info[:]
    graph.value_info.extend(vis)


def _fold_constants(model) -> None:
    """Evaluate nodes whose inputs are all constants (initializers / Constant nodes) and store the result."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    consts = {i.name: i for i in graph.initializer}
    new_nodes = []
    opset = [o for o in model.opset_import]
    for node in graph.node:
        if node.op_type == "Constant" and len(node.output) == 1:
            try:
                value = _constant_value(node)
            except ValueError:
                new_nodes.append(node)
                continue
            t = numpy_helper.from_array(value, node.output[0])
            consts[node.output[0]] = t
            graph.initializer.append(t)
            continue
        inputs = [i for i in node.input if i]
        foldable = (inputs and all(i in consts for i in inputs) and node.domain in ("", "ai.onnx")
                    and node.op_type not in ("RandomNormal", "RandomUniform", "Dropout")
                    and not any(a.HasField("g") for a in node.attribute))
        if foldable and sum(int(np.prod(consts[i].dims)) for i in inputs) <= _MAX_FOLD_ELEMENTS:
            import onnx

            sub = onnx.helper.make_graph([node], "fold", [], [onnx.helper.make_tensor_value_info(o, 0, None)
                                                              for o in node.output if o],
                                         initializer=[consts[i] for i in set(inputs)])
            sub_model = onnx.helper.make_model(sub, opset_imports=opset)
            try:
                values = ReferenceEvaluator(sub_model).run(None, {})
            except Exception:  # the reference evaluator lacks some ops: keep the node as it is
                new_nodes.append(node)
                continue
            for name, value in zip([o for o in node.output if o], values):
                t = numpy_helper.from_array(np.asarray(value), name)
                consts[name] = t
                graph.initializer.append(t)
            continue
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _constant_value(node):
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
    raise ValueError("sparse or non-tensor Constant")
