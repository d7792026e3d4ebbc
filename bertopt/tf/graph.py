"""TensorFlow graphs as bertopt handles them: save a frozen GraphDef, rename nodes, count ops, describe a
SavedModel signature. Loading a graph, checking it is frozen and running it are the runtime's
(:mod:`bertopt.runtime.tf_session`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import tensorflow as tf

from bertopt.errors import UserError

GRAPH_FILE = "model.pb"
ROLE_BY_NAME = {"input_ids": "input_ids", "input_word_ids": "input_ids", "attention_mask": "attention_mask",
                 "input_mask": "attention_mask", "token_type_ids": "token_type_ids", "segment_ids": "token_type_ids",
                 "input_type_ids": "token_type_ids"}


def save_graph_def(graph_def, path: Path) -> None:
    Path(path).write_bytes(graph_def.SerializeToString())


def op_counts(graph_def) -> dict[str, int]:
    return dict(sorted(Counter(n.op for n in graph_def.node).items()))


def graph_stats(graph_def) -> dict[str, Any]:
    consts = [n for n in graph_def.node if n.op == "Const"]
    return {"nodes": len(graph_def.node), "initializers": len(consts), "ops": op_counts(graph_def)}


def tensor_node(name: str) -> str:
    """``^a`` / ``a:1`` / ``a`` -> ``a``."""
    return name.lstrip("^").split(":")[0]


def rename_nodes(graph_def, mapping: dict[str, str]) -> dict[str, str]:
    """In place: rename nodes and every reference to them; a node already holding a target name moves aside.
    Returns every rename done (old -> new), the moved-aside nodes included."""
    names = {n.name for n in graph_def.node}
    full = dict(mapping)
    for old, new in mapping.items():
        if new != old and new in names and new not in mapping:
            i = 0
            while f"{new}_orig{i or ''}" in names:
                i += 1
            full[new] = f"{new}_orig{i or ''}"
    for node in graph_def.node:
        if node.name in full:
            node.name = full[node.name]
        for i, inp in enumerate(node.input):
            base = tensor_node(inp)
            if base in full:
                ctrl = "^" if inp.startswith("^") else ""
                port = inp[len(ctrl) + len(base):]
                node.input[i] = f"{ctrl}{full[base]}{port}"
    return full


def node_output_dtypes(graph_def) -> dict[str, list]:
    """Output dtypes of every node, from importing the graph (no op runs)."""
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(graph_def, name="")
    return {op.name: [t.dtype for t in op.outputs] for op in g.get_operations()}


def describe_signature(fn, where: str) -> tuple[list[dict], list[dict]]:
    """Manifest input/output specs of a signature function (inputs get their BERT role)."""
    _, kw = fn.structured_input_signature
    inputs = []
    for name, spec in kw.items():
        role = ROLE_BY_NAME.get(name)
        if role is None:
            raise UserError(f"{where}: signature input '{name}' is not a BERT input (expected input_ids, "
                            "attention_mask/input_mask, token_type_ids/segment_ids)")
        if spec.dtype not in (tf.int32, tf.int64):
            raise UserError(f"{where}: signature input '{name}' is {spec.dtype.name}, expected int32 or int64")
        if spec.shape.rank is not None and spec.shape.rank != 2:
            raise UserError(f"{where}: signature input '{name}' has rank {spec.shape.rank}; expected "
                            "[batch, sequence]")
        inputs.append({"name": name, "role": role, "dtype": spec.dtype.name, "shape": ["batch", "sequence"]})
    if "input_ids" not in [i["role"] for i in inputs] or "attention_mask" not in [i["role"] for i in inputs]:
        raise UserError(f"{where}: the signature needs input_ids and an attention mask; it takes "
                        f"{', '.join(kw) or 'nothing'}")
    outputs = []
    for name, spec in fn.structured_outputs.items():
        outputs.append(output_spec(name, spec.shape, spec.dtype, where))
    return inputs, outputs


def output_spec(name: str, shape, dtype, where: str) -> dict[str, Any]:
    dims = shape.as_list() if shape.rank is not None else None
    if dtype not in (tf.float32, tf.float16):
        raise UserError(f"{where}: output '{name}' is {dtype.name}; bertopt serves float outputs")
    if dims is None or len(dims) not in (2, 3):
        raise UserError(f"{where}: output '{name}' has shape {dims}; expected [batch, sequence, hidden] or "
                        "[batch, hidden]")
    if len(dims) == 3:
        return {"name": name, "dtype": "float32", "shape": ["batch", "sequence", dims[2]], "kind": "token"}
    return {"name": name, "dtype": "float32", "shape": ["batch", dims[1]],
            "kind": "logits" if "logit" in name else "embedding"}


