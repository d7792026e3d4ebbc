"""A sentence-transformers pipeline appended to an ONNX encoder that outputs token states only.

sentence-transformers' own ONNX export (``SentenceTransformer(..., backend="onnx")`` saves ``onnx/model.onnx``)
and Optimum's ``feature-extraction`` export stop at ``last_hidden_state``: Pooling, Dense and Normalize stay in
Python, in the modules of the folder above. ``append_sentence_pipeline`` traces that pipeline with
``sources.hf.build_sentence_pipeline`` (the very module the Hugging Face export puts behind the model), exports
it at the encoder's opset and joins it to the graph, so the graph computes what ``SentenceTransformer.encode``
returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError, require

PIPELINE_OUTPUT = "sentence_embedding"
_PREFIX = "sentence_pipeline/"
# the TorchScript exporter writes these opsets (its pooling ops differ between versions, so the appended part is
# exported at the encoder's own opset)
_EXPORTER_OPSETS = range(9, 21)


def onnx_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def append_sentence_pipeline(model, folder: Path | None, info: dict[str, Any], pooling: str | list, *,
                             token_output: str, mask_input: str, allow_bin: bool = False):
    """A copy of ``model`` whose graph also outputs ``sentence_embedding`` (batch, d): ``pooling`` of the
    ``token_output`` states over ``mask_input``, then ``info["dense"]`` (weights read from ``folder``) and
    ``info["normalize"]``."""
    import io

    onnx = require("onnx", "onnx", "importing ONNX models")
    torch = require("torch", "torch", "appending a sentence-transformers pipeline to an ONNX model")
    from onnx import TensorProto, helper

    from bertopt.sources.hf import build_sentence_pipeline

    graph = model.graph
    token = next((o for o in graph.output if o.name == token_output), None)
    mask = next((i for i in graph.input if i.name == mask_input), None)
    if token is None or mask is None:
        raise ValueError(f"{token_output} / {mask_input} not in the graph")
    dims = token.type.tensor_type.shape.dim
    hidden = dims[-1].dim_value if len(dims) == 3 and dims[-1].HasField("dim_value") else info.get("hidden_size")
    if not hidden:
        raise UserError(f"the ONNX output {token_output} does not say its width and no config.json beside the file "
                        "does either; put the model's config.json next to the ONNX file")
    opset = onnx_opset(model)
    if opset not in _EXPORTER_OPSETS:
        raise UserError(f"the ONNX model uses opset {opset}; bertopt appends the sentence-transformers pipeline at "
                        f"opsets {_EXPORTER_OPSETS[0]}-{_EXPORTER_OPSETS[-1]}; re-export it with --opset 17, or "
                        "pass --pooling none for the token states only")
    head = build_sentence_pipeline(folder or Path("."), info, pooling, allow_bin=allow_bin)
    dummy_hidden = torch.randn(2, 8, int(hidden))
    dummy_mask = torch.ones(2, 8, dtype=torch.long)
    dummy_mask[1, 5:] = 0
    buffer = io.BytesIO()
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(head, (dummy_hidden, dummy_mask), buffer, input_names=["hidden", "attention_mask"],
                          output_names=[PIPELINE_OUTPUT], opset_version=opset, dynamo=False,
                          do_constant_folding=True,
                          dynamic_axes={"hidden": {0: "batch", 1: "sequence"},
                                        "attention_mask": {0: "batch", 1: "sequence"}, PIPELINE_OUTPUT: {0: "batch"}})
    part = onnx.compose.add_prefix(onnx.load_from_string(buffer.getvalue()), _PREFIX)
    taken = {n for node in graph.node for n in node.output} | {i.name for i in graph.initializer} \
        | {i.name for i in graph.input} | {o.name for o in graph.output}
    if PIPELINE_OUTPUT in taken:
        raise UserError(f"the ONNX graph already has a value named {PIPELINE_OUTPUT}; re-export it without one")
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    nodes = []
    source = token_output
    if token.type.tensor_type.elem_type != TensorProto.FLOAT:  # an fp16 encoder: pool in fp32, as the runtime reads
        source = _PREFIX + "hidden_fp32"
        nodes.append(helper.make_node("Cast", [token_output], [source], to=TensorProto.FLOAT,
                                      name=_PREFIX + "cast_hidden"))
    mask_source = mask_input
    if mask.type.tensor_type.elem_type != TensorProto.INT64:  # int32 inputs: the pipeline was traced with int64
        mask_source = _PREFIX + "attention_mask_int64"
        nodes.append(helper.make_node("Cast", [mask_input], [mask_source], to=TensorProto.INT64,
                                      name=_PREFIX + "cast_mask"))
    rename = {_PREFIX + "hidden": source, _PREFIX + "attention_mask": mask_source,
              _PREFIX + PIPELINE_OUTPUT: PIPELINE_OUTPUT}
    for node in part.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        nodes.append(node)
    merged.graph.node.extend(nodes)
    merged.graph.initializer.extend(part.graph.initializer)
    merged.graph.value_info.extend(v for v in part.graph.value_info if v.name not in rename)
    merged.graph.output.append(helper.make_tensor_value_info(PIPELINE_OUTPUT, TensorProto.FLOAT,
                                                             ["batch", _pooled_width(part)]))
    return merged


def _pooled_width(part) -> int | str:
    out = part.graph.output[0].type.tensor_type.shape.dim
    return out[-1].dim_value if out and out[-1].HasField("dim_value") else "dim"
