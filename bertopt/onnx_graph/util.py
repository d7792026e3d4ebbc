"""ONNX model files and graphs: load with clear errors, save (external data), count operators, describe
inputs and outputs, find the MatMuls that carry a weight. Used by the stages, the TensorFlow export and the fusions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from bertopt.errors import UserError

_ROLE_BY_NAME = {"input_ids": "input_ids", "attention_mask": "attention_mask", "input_mask": "attention_mask",
                 "token_type_ids": "token_type_ids", "segment_ids": "token_type_ids"}


MAX_ONNX_FILE_BYTES = 2 << 30


def load_onnx(path: Path):
    """The model with its weights (external data files next to it are read too), or a one-line UserError."""
    import onnx
    from google.protobuf.message import DecodeError

    from bertopt.artifact import onnx_external_data_files

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # what cannot be stat'ed is reported by the reader below
    if size > MAX_ONNX_FILE_BYTES:  # refused before it is read (and scanned) whole
        raise UserError(f"{path} is {size / (1 << 30):.1f} GiB, larger than an ONNX file can be (2 GiB, protobuf's "
                        "limit); a larger model keeps its weights in external data files: re-export it so")
    missing = [f for f in onnx_external_data_files(path) if not (path.parent / f).exists()]
    if missing:
        raise UserError(f"{path} keeps its weights in external data file {missing[0]}, which is not next to it; "
                        "copy it into the same folder")
    try:
        model = onnx.load(str(path))
    except onnx.checker.ValidationError as exc:  # e.g. external data reached through a link out of the folder
        raise UserError(f"{path} cannot be loaded: {str(exc).splitlines()[0]:.300}; keep the model's external "
                        "data as plain files next to it") from None
    except (DecodeError, ValueError, OSError) as exc:
        raise UserError(f"{path} is not a readable ONNX model ({type(exc).__name__}); "
                        "re-export it or check the file is complete") from None
    if not model.graph.node:
        raise UserError(f"{path} is not a usable ONNX model (its graph has no nodes); re-export it")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise UserError(f"{path} is not a valid ONNX model: {str(exc).splitlines()[0]}") from None
    return model


def ensure_node_names(graph) -> None:
    """Give every node a unique name (``{op_type}_{index}`` where one is missing or repeated): exclusion lists,
    the accuracy search and the reports name nodes."""
    seen = set()
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def weight_matmuls(model, op_types=("MatMul", "Attention")) -> list[tuple[Any, str]]:
    """(node, weight initialiser name) of every node of ``op_types`` that multiplies an activation (first input)
    by a 2-D initialiser (second input), in graph order: the MatMuls that carry a weight."""
    weights = {i.name for i in model.graph.initializer if len(i.dims) == 2}
    return [(node, node.input[1]) for node in model.graph.node
            if node.op_type in op_types and len(node.input) >= 2 and node.input[1] in weights
            and node.input[0] not in weights]


# protobuf cannot hold more than 2 GB; models near that keep their weights in an external data file
EXTERNAL_DATA_ABOVE_BYTES = 1_800_000_000


def save_onnx(model, path: Path, external: bool | None = None) -> None:
    """Save ``model``; with ``external`` (default: when it is too large for one protobuf) its weights go to
    ``<name>_data`` next to it, the layout ``torch.onnx.export`` and Optimum use for large models."""
    import onnx

    path = Path(path)
    if external is None:
        external = model.ByteSize() > EXTERNAL_DATA_ABOVE_BYTES
    data = path.with_name(path.name + "_data")
    if data.exists():
        data.unlink()  # onnx appends to an existing data file
    if external:
        # onnx moves the weights out of the model object it saves; the caller's model keeps them
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                  size_threshold=1024)
    else:
        onnx.save(model, str(path))


def uses_external_data(path: Path) -> bool:
    from bertopt.artifact import onnx_external_data_files

    return bool(onnx_external_data_files(Path(path)))


def match_external_data(path: Path, like: Path) -> None:
    """Re-save the model at ``path`` with external data when ``like`` (the stage's input) had it, so an artifact
    keeps the layout of its parent (tools such as ONNX Runtime's quantiser write one file)."""
    import onnx

    if uses_external_data(like) and not uses_external_data(path):
        save_onnx(onnx.load(str(path)), path, external=True)


def copy_onnx(src: Path, dest: Path) -> None:
    """Copy an ONNX file with its external data files (each named as a file next to it: a location that is
    absolute or climbs out of the folder is a UserError, so nothing outside is copied into an artifact)."""
    import shutil

    from bertopt.artifact import MANIFEST_NAME, onnx_external_data_files

    src, dest = Path(src), Path(dest)
    names = onnx_external_data_files(src)
    for name in names:
        # the artifact's own files (its manifest, model file, tokenizer) are written under fixed names: external
        # data under one of them overwrote it (an artifact written with exit 0 that no command could load)
        if name in (MANIFEST_NAME, dest.name) or name.split("/")[0] == "tokenizer" or (dest.parent / name).exists():
            raise UserError(f"{src} keeps external data in '{name}', a name the artifact uses for its own files; "
                            "save the model's external data under another name (e.g. model.onnx.data)")
    shutil.copy2(src, dest)
    for name in names:
        target = dest.parent / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.parent / name, target)


def op_counts(model) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


ORT_CONTRIB_DOMAIN = "com.microsoft"  # ONNX Runtime's fused operators (optimize's), which OpenVINO cannot read


def ort_contrib_ops(model) -> list[str]:
    """The ONNX Runtime contrib operator types in ``model``'s graph, sorted (none in a plain ONNX export)."""
    return sorted({n.op_type for n in model.graph.node if n.domain == ORT_CONTRIB_DOMAIN})


def graph_stats(model) -> dict[str, Any]:
    return {"nodes": len(model.graph.node), "initializers": len(model.graph.initializer),
            "ops": op_counts(model)}


def _dims(value_info) -> list:
    dims = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    return dims


_DTYPES = {1: "float32", 6: "int32", 7: "int64", 10: "float16", 16: "bfloat16"}
_ID_DTYPES = {7: "int64", 6: "int32"}
_DTYPE_NAMES = {**_DTYPES, 8: "strings", 9: "booleans", 11: "float64"}
# an output's width: a vocabulary (masked-LM logits: up to 250k for multilingual models) at the most; a declared
# width of a billion was a billion-entry label map built from a 176-byte file
MAX_OUTPUT_WIDTH = 1 << 20


# output names other exporters use (Optimum, sentence-transformers' ONNX export, bertopt) -> kind when pooled
_TOKEN_OUTPUTS = ("last_hidden_state", "token_embeddings")
_POOLED_OUTPUTS = {"sentence_embedding": "embedding", "sparse_embedding": "sparse", "pooler_output": "pooler"}


def describe_io(model, vocab_size: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """Input/output specs and the task, recognised from the graph's input/output names and shapes the way
    bertopt, Optimum and sentence-transformers name them: inputs ``input_ids``, ``attention_mask``
    [, ``token_type_ids``]; outputs ``last_hidden_state`` / ``token_embeddings`` (per token),
    ``sentence_embedding`` (pooled), ``logits`` (batch x labels: classification, or one score: rerank;
    batch x sequence x labels: token classification; batch x sequence x vocabulary: masked-LM logits, kind
    ``mlm-logits``, which the import turns into SPLADE), ``sparse_embedding``."""
    inits = {i.name for i in model.graph.initializer}
    inputs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        role = _ROLE_BY_NAME.get(vi.name)
        if role is None:
            raise UserError(f"ONNX input '{vi.name}' is not an encoder input (expected input_ids, attention_mask, "
                            "token_type_ids); re-export the model with those inputs")
        elem = vi.type.tensor_type.elem_type
        if elem not in _ID_DTYPES:  # the Predictor feeds int64 (int32) ids and masks: anything else fails later
            raise UserError(f"ONNX input '{vi.name}' holds {_DTYPE_NAMES.get(elem, f'element type {elem}')}, not "
                            "int64 or int32 token ids / masks; re-export the model with integer inputs")
        dims = _dims(vi) if vi.type.tensor_type.HasField("shape") else None
        if dims is not None and len(dims) != 2:
            raise UserError(f"ONNX input '{vi.name}' has {len(dims)} dimensions, not 2 (batch x sequence); "
                            "re-export the model with batch x sequence inputs")
        inputs.append({"name": vi.name, "role": role, "dtype": _ID_DTYPES[elem], "shape": ["batch", "sequence"]})
    if not any(i["role"] == "input_ids" for i in inputs):
        raise UserError("the ONNX model has no input_ids input; re-export it with input_ids and attention_mask")
    if not model.graph.output:
        raise UserError("the ONNX graph has no outputs; re-export the model with its outputs (last_hidden_state, "
                        "sentence_embedding or logits)")
    outputs = []
    hidden = None
    task = "embedding"
    for vi in model.graph.output:
        dims = _dims(vi)
        if dims and len(dims) not in (2, 3):  # no dims: the exporter wrote no shape
            raise UserError(f"ONNX output '{vi.name}' has {len(dims)} dimensions; an encoder's outputs are batch x "
                            "width or batch x sequence x width; re-export the model with such outputs")
        last = dims[-1] if dims and isinstance(dims[-1], int) else "?"  # a width torch.onnx left symbolic
        if last != "?" and not 1 <= last <= MAX_OUTPUT_WIDTH:
            raise UserError(f"ONNX output '{vi.name}' declares its last dimension as {last:,}, not a width from 1 to "
                            f"{MAX_OUTPUT_WIDTH:,} (hidden size, labels or vocabulary); re-export the model")
        if vi.name == "logits" or "logit" in vi.name:
            if len(dims) == 3:
                if vocab_size and last == vocab_size:
                    # masked-LM logits (a SparseEncoder's export): SPLADE once its pooling is appended
                    task = "sparse-embedding"
                    spec = {"name": vi.name, "shape": ["batch", "sequence", last], "kind": "mlm-logits"}
                else:
                    task = "token-classification"
                    spec = {"name": vi.name, "shape": ["batch", "sequence", last], "kind": "token-logits"}
            else:
                task = "rerank" if last == 1 else "classification"
                spec = {"name": vi.name, "shape": ["batch", last], "kind": "score" if last == 1 else "logits"}
        elif len(dims) == 3 or vi.name in _TOKEN_OUTPUTS:
            spec = {"name": vi.name, "shape": ["batch", "sequence", last], "kind": "token"}
            hidden = hidden or (last if isinstance(last, int) else None)
        else:
            kind = _POOLED_OUTPUTS.get(vi.name, "embedding")
            if kind == "sparse":
                task = "sparse-embedding"
            spec = {"name": vi.name, "shape": ["batch", last], "kind": kind}
        spec["dtype"] = "float32"
        outputs.append(spec)
    # a pooler output is BERT's next-sentence head input, not a sentence embedding: serve the pooled output
    # a sentence-transformers export names, else the per-token one
    primary = next((o["name"] for o in outputs if o["kind"] in ("embedding", "sparse", "logits", "score",
                                                                  "token-logits")), None)
    primary = primary or next((o["name"] for o in outputs if o["kind"] == "token"), outputs[-1]["name"])
    positions = [i.dims[0] for i in model.graph.initializer
                 if "position_embeddings" in i.name and len(i.dims) == 2]
    info = {"hidden_size": hidden, "task": task,
            "max_position_embeddings": int(positions[0]) if positions else 512,
            "primary_output": primary}
    return inputs, outputs, info


def set_dynamic_axis_names(model, batch: str = "batch", sequence: str = "sequence") -> None:
    """Name the dynamic axes of BERT inputs/outputs ``batch`` and ``sequence`` (not ``unk__N``)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        for i, d in enumerate(dims):
            if d.HasField("dim_value"):
                continue
            if i == 0:
                d.dim_param = batch
            elif i == 1 and len(dims) >= 2:
                d.dim_param = sequence
