"""TensorFlow models as runtime sessions: a frozen GraphDef, a SavedModel signature or any TF callable
(``dict of named tensors -> dict of named outputs``) run by :class:`TFSession`. Imported by the ``tensorflow``
backend on first use (it imports TensorFlow).

Convention for frozen graphs: an input named ``input_ids`` is the placeholder node ``input_ids``, an output
named ``last_hidden_state`` is the node ``last_hidden_state`` (freeze renames them so), so the manifest's
input/output names are enough to feed and fetch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import tensorflow as tf

from bertopt.errors import ModelRunError, UserError
from bertopt.model_handle import ModelHandle

_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable", "ReadVariableOp", "AssignVariableOp",
                 "VarIsInitializedOp", "ResourceGather", "_Arg"}
_TF_DTYPES = {"int32": tf.int32, "int64": tf.int64}


def load_graph_def(path: Path, where: str | None = None):
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf raises DecodeError; anything unparsable is the user's file
        raise UserError(f"{where or path} is not a readable TensorFlow GraphDef ({type(exc).__name__}); "
                        "re-create it with 'bertopt freeze'") from None
    return graph_def


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
    sigs = loaded.signatures  # what tf.saved_model.load returns always has them (empty when none were saved)
    if not sigs:
        raise UserError(f"{where} has no serving signature; re-save it with "
                        "tf.saved_model.save(module, path, signatures={'serving_default': fn.get_concrete_function()})")
    if signature not in sigs:
        raise UserError(f"{where} has no signature '{signature}'; it has {', '.join(sorted(sigs))} "
                        "(choose one with --signature)")
    return sigs[signature]


class TFSession:
    """A TensorFlow callable as a runtime session (``run(output_names, feeds)``): what the Predictor uses for
    TF artifacts and for TF reference models alike."""

    backend = "tensorflow"
    concurrent_runs = True
    parallel_runs = 1

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
        try:
            out = self._call(tensors, list(output_names))
        except tf.errors.OpError as exc:  # the graph failed on these inputs (an id past its embedding table ...)
            raise ModelRunError.of("the TensorFlow model", "TensorFlow", tf_reason(exc.message)) from None
        return [np.asarray(out[n].numpy(), dtype=np.float32) for n in output_names]


def tf_reason(message: str) -> str:
    """What went wrong, from a TensorFlow error: its message wraps the reason ("indices[0,1] = 10000000 is not in
    [0, 65)") in where the node was defined (a Python stack) and the node's name."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    noise = ("Graph execution error", "Detected at node", "File ", "<stack traces", "[[")
    reasons = [line for line in lines if not line.startswith(noise)]
    return (reasons or lines or ["no reason given"])[-1]


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


def session_for_model(model: ModelHandle, threads: int | None = None) -> TFSession:
    """A session on a tf-graphdef or tf-savedmodel artifact's model, or on a TF model that is no artifact (a
    reference or a freeze source: format ``tensorflow``, a signature-style callable in ``model.module``, kept alive
    by ``model.keep_alive``)."""
    names = [o["name"] for o in model.outputs]
    if model.model_format == "tensorflow":
        call = signature_call(model.module)
        call.keep_alive = model.keep_alive
    elif model.model_format == "tf-graphdef":
        graph_def = load_graph_def(model.model_path, where=str(model.model_path))
        check_frozen(graph_def, str(model.model_path))
        call = graph_def_call(graph_def, [i["name"] for i in model.inputs])
    elif model.model_format == "tf-savedmodel":
        loaded = tf.saved_model.load(str(model.model_path))
        call = signature_call(signature_of(loaded, model.signature or "serving_default", str(model.model_path)))
        call.keep_alive = loaded  # the signature needs its SavedModel object alive
    else:  # the backend (tf_backend.refuse_other_formats) refuses other formats before TensorFlow loads
        raise ValueError(f"session_for_model got a {model.model_format} model; open it through the tensorflow "
                         "backend")
    return TFSession(call, list(model.inputs), names, threads=threads)
