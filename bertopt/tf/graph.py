"""TensorFlow graphs as bertopt handles them: load/save a frozen GraphDef, check it is frozen, rename
nodes, count ops, and turn a graph, a SavedModel signature or a Keras model into a callable
(``dict of named tensors -> dict of named outputs``) that :class:`TFSession` runs for the runtime.

Convention for frozen graphs: an input named ``input_ids`` is the placeholder node ``input_ids``, an output
named ``last_hidden_state`` is the node ``last_hidden_state`` (freeze renames them so), so the manifest's
input/output names are enough to feed and fetch.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from bertopt.errors import UserError

GRAPH_FILE = "model.pb"
_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable", "ReadVariableOp", "AssignVariableOp",
                 "VarIsInitializedOp", "ResourceGather", "_Arg"}
_TF_DTYPES = {"int32": tf.int32, "int64": tf.int64}
_ROLE_BY_NAME = {"input_ids": "input_ids", "input_word_ids": "input_ids", "attention_mask": "attention_mask",
                 "input_mask": "attention_mask", "token_type_ids": "token_type_ids", "segment_ids": "token_type_ids",
                 "input_type_ids": "token_type_ids"}


# -- GraphDef files ----------------------------------------------------------------------------------------
def load_graph_def(path: Path, where: str | None = None):
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf raises DecodeError; anything unparsable is the user's file
        raise UserError(f"{where or path} is not a readable TensorFlow GraphDef ({type(exc).__name__}); "
                        "re-create it with 'bertopt freeze'") from None
    return graph_def


def save_graph_def(graph_def, path: Path) -> None:
    Path(path).write_bytes(graph_def.SerializeToString())


def check_frozen(graph_def, where: str) -> None:
    """A graph still reading variables cannot be pruned, cast or converted: say so and how to fix it."""
    live = sorted({n.op for n in graph_def.node if n.op in _VARIABLE_OPS}
                  | {n.op for n in graph_def.node if n.op == "Placeholder" and n.attr["dtype"].type == tf.resource})
    if live:
        raise UserError(f"{where} is not a frozen graph: it still reads variables ({', '.join(live)}); "
                        "freeze it first with 'bertopt freeze SAVEDMODEL --out DIR'")
    if graph_def.library.function:
        names = ", ".join(f.signature.name for f in graph_def.library.function[:3])
        raise UserError(f"{where} still calls TensorFlow functions ({names}); re-create it with 'bertopt freeze'")


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


# -- callables -------------------------------------------------------------------------------------------------
def graph_def_function(graph_def, input_names: list[str], output_names: list[str]) -> Callable:
    """A concrete function running a frozen GraphDef: positional inputs in ``input_names`` order -> list."""

    def _import():
        tf.compat.v1.import_graph_def(graph_def, name="")

    wrapped = tf.compat.v1.wrap_function(_import, [])
    g = wrapped.graph
    try:
        feeds = [g.as_graph_element(f"{n}:0") for n in input_names]
        fetches = [g.as_graph_element(f"{n}:0") for n in output_names]
    except (KeyError, ValueError) as exc:
        raise UserError(f"the graph has no tensor named in its manifest ({exc}); re-create the artifact") from None
    return wrapped.prune(feeds, fetches)


def signature_of(loaded, signature: str, where: str):
    sigs = getattr(loaded, "signatures", {}) or {}
    if not sigs:
        raise UserError(f"{where} has no serving signature; re-save it with "
                        "tf.saved_model.save(module, path, signatures={'serving_default': fn.get_concrete_function()})")
    if signature not in sigs:
        raise UserError(f"{where} has no signature '{signature}'; it has {', '.join(sorted(sigs))} "
                        "(choose one with --signature)")
    return sigs[signature]


def describe_signature(fn, where: str) -> tuple[list[dict], list[dict]]:
    """Manifest input/output specs of a signature function (inputs get their BERT role)."""
    _, kw = fn.structured_input_signature
    inputs = []
    for name, spec in kw.items():
        role = _ROLE_BY_NAME.get(name)
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


class TFSession:
    """A TensorFlow callable as a runtime session (``run(output_names, feeds)``): what the Predictor uses for
    TF artifacts and for TF reference models alike."""

    backend = "tensorflow"

    def __init__(self, call: Callable[[dict], dict], input_specs: list[dict], output_names: list[str],
                 threads: int | None = None, provider: str = "cpu"):
        self.threads = configure_threads(threads)
        self.provider = provider
        self._call = call
        self._dtypes = {s["name"]: _TF_DTYPES.get(s.get("dtype", "int64"), tf.int64) for s in input_specs}
        self.input_names = [s["name"] for s in input_specs]
        self.output_names = list(output_names)

    def run(self, output_names, feeds):
        tensors = {n: tf.constant(np.asarray(feeds[n]), dtype=self._dtypes[n]) for n in self.input_names}
        out = self._call(tensors, list(output_names))
        return [np.asarray(out[n].numpy(), dtype=np.float32) for n in output_names]


def configure_threads(threads: int | None) -> int:
    """TensorFlow's thread pools can be sized only before its runtime starts; afterwards the first size holds."""
    from bertopt.runtime.backends import default_threads

    wanted = threads or default_threads()
    current = tf.config.threading.get_intra_op_parallelism_threads()
    if current == 0:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(wanted)
            tf.config.threading.set_inter_op_parallelism_threads(1)
            return wanted
        except RuntimeError:  # the runtime is already initialised: it uses its default pool size
            return default_threads()
    return current


def graph_def_call(graph_def, input_names: list[str]) -> Callable[[dict, list], dict]:
    """A ``(tensors, output_names) -> dict`` call over a frozen graph; one pruned function per output set."""
    cache: dict[tuple, Callable] = {}

    def call(tensors, names):
        key = tuple(names)
        if key not in cache:
            cache[key] = graph_def_function(graph_def, input_names, list(names))
        outs = cache[key](*[tensors[n] for n in input_names])
        return dict(zip(names, outs))

    return call


def signature_call(fn) -> Callable[[dict, list], dict]:
    def call(tensors, names):
        out = fn(**tensors)
        return {n: out[n] for n in names}

    return call


def session_for_artifact(artifact, threads: int | None = None) -> TFSession:
    names = [o["name"] for o in artifact.outputs]
    if artifact.model_format == "tf-graphdef":
        graph_def = load_graph_def(artifact.model_path, where=str(artifact.model_path))
        check_frozen(graph_def, str(artifact.model_path))
        call = graph_def_call(graph_def, [i["name"] for i in artifact.inputs])
    elif artifact.model_format == "tf-savedmodel":
        signature = artifact.manifest.get("tensorflow", {}).get("signature", "serving_default")
        loaded = tf.saved_model.load(str(artifact.model_path))
        call = signature_call(signature_of(loaded, signature, str(artifact.model_path)))
        call.keep_alive = loaded  # the signature needs its SavedModel object alive
    else:
        raise UserError(f"the TensorFlow runtime runs tf-graphdef and tf-savedmodel artifacts, not "
                        f"{artifact.model_format}")
    return TFSession(call, artifact.inputs, names, threads=threads)
