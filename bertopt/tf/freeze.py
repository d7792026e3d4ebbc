"""freeze: a TensorFlow model -> a frozen GraphDef artifact (variables folded into constants).

The model's serving function is frozen with ``convert_variables_to_constants_v2``; its placeholders are named
after the signature's inputs and an Identity named after each output is added, so the artifact's input/output
names are the graph's tensor names. The frozen graph is then run next to the source model on the built-in
corpus and must match it within ``check_tolerance`` (1e-6).

The lineage source of a frozen graph is the TensorFlow model itself (for a tf-savedmodel artifact, its
``saved_model`` folder), so every later artifact of the TF path is validated against the TF original.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tensorflow as tf

from bertopt.errors import UserError
from bertopt.runtime.tf_session import check_frozen
from bertopt.tf.graph import GRAPH_FILE, graph_stats, rename_nodes, save_graph_def

NAME = "freeze"


def freeze(input, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import Artifact, ArtifactWriter
    from bertopt.sources.hf import copy_tokenizer
    from bertopt.tf.sources import embedding_rows, open_tf_model

    pooling = None if config.get("pooling") in (None, "none") else config.get("pooling")
    model = open_tf_model(input, signature=config["signature"], pooling=pooling, max_seq_len=config["max_seq_len"])
    if model.tokenizer_dir is None:
        raise UserError(f"no tokenizer.json or vocab.txt found with {input.path}; put the model's vocab.txt "
                        "next to it (or in the SavedModel's assets/ folder)")
    fn = model.function.concrete if hasattr(model.function, "concrete") else model.function
    variables = len(fn.variables)
    graph_def, source_nodes = frozen_graph_of(model, with_count=True)
    parent = input if isinstance(input, Artifact) else None
    source = savedmodel_source(parent) if parent is not None else input.to_manifest()
    with ArtifactWriter(out_dir, stage=NAME, params=config, parent=parent, source=source,
                        overwrite=overwrite) as w:
        w.model_info = dict(model.model_info)
        if config["max_seq_len"]:
            w.model_info["max_seq_len"] = config["max_seq_len"]
        w.runtime = "tensorflow"
        # a graph that reads token types from a table of known size: the tokenizer's types must be rows of it
        copy_tokenizer(model.tokenizer_dir, w.dir / "tokenizer", vocab_size=embedding_rows(model),
                       type_vocab_size=model.model_info.get("type_vocab_size"), inputs=model.inputs)
        save_graph_def(graph_def, w.dir / GRAPH_FILE)
        w.set_model(GRAPH_FILE, "tf-graphdef", model.inputs, model.outputs, precision="fp32")
        stats = graph_stats(graph_def)
        w.report.update({"source": model.description, "variables_folded": variables,
                         "nodes_source_function": source_nodes, "after": stats, **model.report})
        diff = _max_abs_diff_vs_source(w, model)
        w.report["max_abs_diff_vs_source"] = diff
        if not np.isfinite(diff):
            raise UserError(f"{model.description} gives NaN or infinite outputs on the built-in text; its weights "
                            "are damaged (a diverged training run?): use a model saved before it diverged")
        if not diff <= config["check_tolerance"]:
            raise UserError(f"the frozen graph differs from {model.description} by {diff:.3g} "
                            f"(> {config['check_tolerance']:g}); please report it")
    return w.artifact


def savedmodel_source(art) -> dict:
    """Lineage source for artifacts made from a tf-savedmodel artifact: the SavedModel itself (run in TensorFlow
    by the reference), with the artifact's own source kept as ``origin``."""
    return {"kind": "tf-savedmodel", "path": str(art.model_path.absolute()), "spec": str(art.model_path.absolute()),
            "framework": "tensorflow", "artifact": str(art.path.absolute()), "origin": art.source}


def frozen_graph_of(model, with_count: bool = False):
    """The model's function with variables folded into constants, inputs/outputs named as in the manifest."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    fn = model.function.concrete if hasattr(model.function, "concrete") else model.function
    try:
        frozen = convert_variables_to_constants_v2(fn)
    except (ValueError, TypeError, tf.errors.OpError) as exc:
        raise UserError(f"cannot freeze {model.description}: {str(exc).splitlines()[0]}") from None
    graph_def = frozen.graph.as_graph_def()
    count = len(graph_def.node)
    _name_inputs_and_outputs(graph_def, frozen, model)
    check_frozen(graph_def, model.description)
    return (graph_def, count) if with_count else graph_def


def _name_inputs_and_outputs(graph_def, frozen, model) -> None:
    """Placeholders get the signature's input names; an Identity named after each output reads it."""
    input_names = {i["name"] for i in model.inputs}
    placeholders = [t.op.name for t in frozen.inputs]
    mapping = {}
    for ph in placeholders:
        if ph in input_names:
            continue
        base = ph.rsplit("_", 1)[0] if ph.rsplit("_", 1)[-1].isdigit() else ph
        if base in input_names:  # TF uniquified the name (input_ids_1)
            mapping[ph] = base
    if mapping:
        rename_nodes(graph_def, mapping)
    present = {n.name for n in graph_def.node}
    missing = sorted(input_names - present)
    if missing:
        raise UserError(f"{model.description}: could not find the placeholder for input '{missing[0]}' in the "
                        "frozen graph; please report it")
    out_names = sorted(model.function.structured_outputs)  # frozen.outputs follow the sorted dict keys
    wanted = {o["name"] for o in model.outputs}
    # move aside any node already using an output's name, then add an Identity per output reading its tensor
    moved = rename_nodes(graph_def, {n: n for n in out_names if n in wanted})
    for name, tensor in zip(out_names, frozen.outputs):
        if name not in wanted:
            continue
        base, _, port = tensor.name.partition(":")
        node = graph_def.node.add()
        node.name = name
        node.op = "Identity"
        node.input.append(moved.get(base, base) + ("" if port in ("", "0") else f":{port}"))
        node.attr["T"].type = tensor.dtype.as_datatype_enum


def _max_abs_diff_vs_source(writer, model) -> float:
    from bertopt.artifact import output_kinds
    from bertopt.data import corpus
    from bertopt.measure.compare import compare_runs
    from bertopt.model_handle import ModelHandle
    from bertopt.runtime import Predictor
    from bertopt.stages.common import worst_abs_diff

    texts = corpus()[:48]
    frozen_pred = Predictor(writer.staged(), provider="cpu")
    source = ModelHandle(model_format="tensorflow", inputs=model.inputs, outputs=model.outputs,
                         tokenizer_path=writer.dir / "tokenizer", model_info=writer.model_info, path=writer.dir,
                         digest=model.description, module=model.function, keep_alive=model.keep_alive)
    source_pred = Predictor(source, max_seq_len=frozen_pred.max_seq_len)
    names = frozen_pred.output_names
    kinds = output_kinds(model.outputs)
    try:
        got = frozen_pred.run(texts, outputs=names)
    except UserError:
        raise
    except Exception as exc:  # TensorFlow's InvalidArgumentError from a position lookup past the table
        found = re.search(r"not in \[0, (\d+)\)", str(exc))
        if not found:
            raise
        raise UserError(f"{model.description} has only {found.group(1)} positions but texts of up to "
                        f"{frozen_pred.max_seq_len} tokens were fed (no config.json says its limit); pass "
                        f"--max-seq-len {found.group(1)} or less") from None
    return worst_abs_diff(compare_runs(got, source_pred.run(texts, outputs=names), kinds))
