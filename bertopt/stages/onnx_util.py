"""Shared ONNX helpers for the stages: load with clear errors, save, count ops, describe inputs/outputs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from bertopt.errors import UserError

_ROLE_BY_NAME = {"input_ids": "input_ids", "attention_mask": "attention_mask", "input_mask": "attention_mask",
                 "token_type_ids": "token_type_ids", "segment_ids": "token_type_ids"}


def load_onnx(path: Path):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path))
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


def save_onnx(model, path: Path) -> None:
    import onnx

    # models above protobuf's 2 GB limit need external data; BERT-base is far below
    onnx.save(model, str(path))


def op_counts(model) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


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


def describe_io(model) -> tuple[list[dict], list[dict], dict]:
    """Input/output specs and what can be inferred about the architecture from an ONNX graph."""
    inits = {i.name for i in model.graph.initializer}
    inputs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        role = _ROLE_BY_NAME.get(vi.name)
        if role is None:
            raise UserError(f"ONNX input '{vi.name}' is not a BERT input (expected input_ids, attention_mask, "
                            "token_type_ids); rename it when exporting")
        dims = ["batch", "sequence"]
        inputs.append({"name": vi.name, "role": role, "dtype": _DTYPES.get(vi.type.tensor_type.elem_type, "int64"),
                       "shape": dims})
    outputs = []
    hidden = None
    for vi in model.graph.output:
        dims = _dims(vi)
        if len(dims) == 3:
            spec = {"name": vi.name, "dtype": "float32", "shape": ["batch", "sequence", dims[2]], "kind": "token"}
        else:
            spec = {"name": vi.name, "dtype": "float32", "shape": ["batch", dims[-1] if dims else "?"],
                    "kind": "logits" if "logit" in vi.name else "embedding"}
        if isinstance(dims[-1] if dims else None, int):
            hidden = hidden or dims[-1]
        outputs.append(spec)
    positions = [i.dims[0] for i in model.graph.initializer
                 if "position_embeddings" in i.name and len(i.dims) == 2]
    info = {"hidden_size": hidden, "task": "encoder",
            "max_position_embeddings": int(positions[0]) if positions else 512,
            "primary_output": outputs[-1]["name"] if outputs else None}
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
