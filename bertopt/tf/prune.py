"""prune for frozen TensorFlow graphs: keep only what the chosen outputs need, strip the nodes serving never
runs (Identity/Snapshot/StopGradient chains, NoOp, Assert, CheckNumerics, training-only ops), then let
Grappler fold constants and simplify arithmetic. Node counts by op type are reported for each step.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from bertopt.errors import UserError
from bertopt.runtime.tf_session import check_frozen, load_graph_def
from bertopt.tf.graph import GRAPH_FILE, graph_stats, save_graph_def, tensor_node

# forward their first input unchanged: consumers are rewired to that input
_PASS_THROUGH = {"Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics",
                 "EnsureShape", "DebugIdentity"}
# produce nothing serving needs
_DROP = {"NoOp", "Assert", "Print", "PrintV2", "SaveV2", "RestoreV2", "MergeSummary", "ScalarSummary",
         "HistogramSummary", "WriteScalarSummary"}
_GRAPPLER_PASSES = ["constfold", "arithmetic", "dependency", "constfold"]


def prune_tf_artifact(art, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.stages.common import check_against, worst_abs_diff

    if art.model_format != "tf-graphdef":
        raise UserError(f"prune works on frozen TensorFlow graphs; {art.path} is a {art.model_format}, "
                        "run 'bertopt freeze' on it first")
    graph_def = load_graph_def(art.model_path)
    check_frozen(graph_def, str(art.path))
    known = art.output_names
    keep = config["outputs"] or known
    unknown = [k for k in keep if k not in known]
    if unknown:
        raise UserError(f"prune: unknown output '{unknown[0]}'; this artifact has {', '.join(known)}")
    inputs = [i["name"] for i in art.inputs]
    pruned, steps = prune_graph_def(graph_def, inputs, keep)
    outputs = [o for o in art.outputs if o["name"] in keep]
    with ArtifactWriter(out_dir, stage="prune", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        if w.model_info.get("primary_output") not in keep:
            w.model_info["primary_output"] = keep[-1]
        save_graph_def(pruned, w.dir / GRAPH_FILE)
        w.set_model(GRAPH_FILE, "tf-graphdef", art.inputs, outputs, precision=art.precision)
        w.extra["tensorflow"] = art.manifest.get("tensorflow", {})
        w.report.update({"before": graph_stats(graph_def), "after": graph_stats(pruned), "steps": steps})
        stats = check_against(w, art, corpus()[:48], outputs=keep)
        w.report["max_abs_diff_vs_parent"] = worst_abs_diff(stats)
        if not worst_abs_diff(stats) <= config["check_tolerance"]:
            raise UserError(f"pruned graph differs from its input by {worst_abs_diff(stats):.3g} "
                            f"(> {config['check_tolerance']:g}); this is a bertopt bug, please report it")
    return w.artifact


def prune_graph_def(graph_def, inputs: list[str], outputs: list[str]):
    """Returns the pruned GraphDef and the node count after each step."""
    from tensorflow.python.util import deprecation

    with deprecation.silence():  # extract_sub_graph is "TF1 API" but is exactly the tool for a frozen graph
        return _prune(graph_def, inputs, outputs)


def _prune(graph_def, inputs: list[str], outputs: list[str]):
    protected = set(inputs) | set(outputs)
    steps = {"frozen": len(graph_def.node)}
    gd = tf.compat.v1.graph_util.extract_sub_graph(graph_def, list(outputs))
    steps["extract_sub_graph"] = len(gd.node)
    gd = strip_serving_noise(gd, protected)
    gd = tf.compat.v1.graph_util.extract_sub_graph(gd, list(outputs))
    steps["strip_identity_noop_assert"] = len(gd.node)
    gd = grappler_optimize(gd, inputs, outputs)
    gd = tf.compat.v1.graph_util.extract_sub_graph(gd, list(outputs))
    steps["grappler_constfold_arithmetic"] = len(gd.node)
    missing = [n for n in inputs if n not in {x.name for x in gd.node}]
    if missing:  # an input no kept output reads: keep its placeholder so the interface stays the same
        for node in graph_def.node:
            if node.name in missing:
                gd.node.add().CopyFrom(node)
    return gd, steps


def strip_serving_noise(graph_def, protected: set[str]):
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    forward: dict[str, str] = {}
    dropped: set[str] = set()
    for node in graph_def.node:
        if node.name in protected:
            continue
        if node.op in _PASS_THROUGH and node.input and not node.input[0].startswith("^"):
            forward[node.name] = node.input[0]
        elif node.op in _DROP:
            dropped.add(node.name)

    def resolve(name: str) -> str:
        seen = set()
        while tensor_node(name) in forward and ":" not in name.lstrip("^") and name not in seen:
            seen.add(name)
            name = forward[tensor_node(name)]
        return name

    for node in graph_def.node:
        if node.name in forward or node.name in dropped:
            continue
        new = out.node.add()
        new.CopyFrom(node)
        del new.input[:]
        for inp in node.input:
            if inp.startswith("^"):
                target = tensor_node(inp)
                if target in dropped or target in forward:
                    continue  # control edges only ordered the removed nodes
                new.input.append(inp)
            else:
                base = inp if ":" not in inp or inp.endswith(":0") else None
                new.input.append(resolve(inp[:-2] if inp.endswith(":0") else inp) if base else inp)
    return out


def grappler_optimize(graph_def, inputs: list[str], outputs: list[str]):
    """Grappler's constant folding and arithmetic simplification, keeping the inputs and outputs by name."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer

    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True), graph=graph)
    fetch = meta_graph_pb2.CollectionDef()
    for name in list(inputs) + list(outputs):
        fetch.node_list.value.append(f"{name}:0")
    meta.collection_def["train_op"].CopyFrom(fetch)
    cfg = config_pb2.ConfigProto()
    rewrite = cfg.graph_options.rewrite_options
    rewrite.optimizers.extend(_GRAPPLER_PASSES)
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrite.min_graph_nodes = -1  # optimise small graphs too
    return tf_optimizer.OptimizeGraph(cfg, meta)
