"""A sentence-transformers pipeline appended to an ONNX encoder that stops before it.

sentence-transformers' own ONNX export (``SentenceTransformer(..., backend="onnx")`` saves ``onnx/model.onnx``)
and Optimum's ``feature-extraction`` export stop at ``last_hidden_state``: Pooling, Dense and Normalize stay in
Python, in the modules of the folder above. A ``SparseEncoder``'s export (Optimum's ``fill-mask``) likewise stops at
the masked-LM logits, its SpladePooling in Python. ``append_pipeline`` traces that part with
``sources.hf.build_sentence_pipeline`` / ``build_sparse_pipeline`` (the very modules the Hugging Face export puts
behind the model), exports it at the encoder's opset and joins it to the graph, so the graph computes what
``SentenceTransformer.encode`` / ``SparseEncoder.encode`` return. The import records what it appended in the
model info (``sentence_pipeline``), and validation's reference appends the same to the source file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError, require

_PREFIX = "sentence_pipeline/"
# the TorchScript exporter writes opsets 9-20; the appended part is exported at the encoder's own opset (reduce
# ops changed signature at 13 and 18), or at 20 for a newer graph (the ops pooling uses have kept their meaning
# since; the import's self-check runs the joined graph in ONNX Runtime)
_LOWEST_OPSET, _HIGHEST_EXPORTED_OPSET = 9, 20
# what is appended -> the graph output it adds
PIPELINE_OUTPUTS = {"sentence": "sentence_embedding", "sparse": "sparse_embedding"}


def onnx_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def pipeline_module(info: dict[str, Any], allow_bin: bool = False):
    """The torch module of the pipeline ``info["sentence_pipeline"]`` records: (token states or masked-LM logits,
    attention mask) -> the pooled output."""
    from bertopt.sources.hf import build_sentence_pipeline, build_sparse_pipeline

    recorded = info["sentence_pipeline"]
    if recorded["kind"] == "sparse":
        return build_sparse_pipeline(info)
    folder = Path(recorded["folder"]) if recorded.get("folder") else Path(".")
    return build_sentence_pipeline(folder, info, info["pooling"], allow_bin=allow_bin)


def append_pipeline(model, info: dict[str, Any], allow_bin: bool = False):
    """A copy of ``model`` with the pipeline ``info["sentence_pipeline"]`` records (``kind`` sentence or sparse,
    ``folder``, ``token_output``, ``mask_input``) appended: the graph also outputs ``sentence_embedding``
    (batch, d), or ``sparse_embedding`` (batch, vocab) in place of the masked-LM logits."""
    import io

    onnx = require("onnx", "onnx", "importing ONNX models")
    torch = require("torch", "torch", "appending a sentence-transformers pipeline to an ONNX model")
    from onnx import TensorProto, helper

    recorded = info["sentence_pipeline"]
    token_output, mask_input = recorded["token_output"], recorded["mask_input"]
    output_name = PIPELINE_OUTPUTS[recorded["kind"]]
    graph = model.graph
    token = next((o for o in graph.output if o.name == token_output), None)
    mask = next((i for i in graph.input if i.name == mask_input), None)
    if token is None or mask is None:
        raise UserError(f"the ONNX model has no output {token_output} or no input {mask_input} any more; "
                        "re-export the artifact from the ONNX file")
    dims = token.type.tensor_type.shape.dim
    fallback = info.get("vocab_size") if recorded["kind"] == "sparse" else info.get("hidden_size")
    width = dims[-1].dim_value if len(dims) == 3 and dims[-1].HasField("dim_value") else fallback
    if not width:
        raise UserError(f"the ONNX output {token_output} does not say its width and no config.json beside the file "
                        "does either; put the model's config.json next to the ONNX file")
    opset = onnx_opset(model)
    if opset < _LOWEST_OPSET:
        raise UserError(f"the ONNX model uses opset {opset}; bertopt appends sentence-transformers pooling from opset "
                        f"{_LOWEST_OPSET}; re-export it at opset 17")
    taken = {n for node in graph.node for n in node.output} | {i.name for i in graph.initializer} \
        | {i.name for i in graph.input} | {o.name for o in graph.output}
    if output_name in taken:
        raise UserError(f"the ONNX graph already has a value named {output_name}; re-export it without one")
    head = pipeline_module(info, allow_bin=allow_bin)
    dummy_mask = torch.ones(2, 8, dtype=torch.long)
    dummy_mask[1, 5:] = 0
    buffer = io.BytesIO()
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(head, (torch.randn(2, 8, int(width)), dummy_mask), buffer,
                          input_names=["hidden", "attention_mask"], output_names=[output_name],
                          opset_version=min(opset, _HIGHEST_EXPORTED_OPSET),
                          dynamo=False, do_constant_folding=True,
                          dynamic_axes={"hidden": {0: "batch", 1: "sequence"},
                                        "attention_mask": {0: "batch", 1: "sequence"}, output_name: {0: "batch"}})
    part = onnx.compose.add_prefix(onnx.load_from_string(buffer.getvalue()), _PREFIX)
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
              _PREFIX + output_name: output_name}
    for node in part.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        nodes.append(node)
    merged.graph.node.extend(nodes)
    merged.graph.initializer.extend(part.graph.initializer)
    merged.graph.value_info.extend(v for v in part.graph.value_info if v.name not in rename)
    out_dims = part.graph.output[0].type.tensor_type.shape.dim
    merged.graph.output.append(helper.make_tensor_value_info(
        output_name, TensorProto.FLOAT,
        ["batch", out_dims[-1].dim_value if out_dims and out_dims[-1].HasField("dim_value") else "dim"]))
    if recorded["kind"] == "sparse":  # the contract's sparse output replaces (batch, sequence, vocab) logits
        keep = [o for o in merged.graph.output if o.name != token_output]
        del merged.graph.output[:]
        merged.graph.output.extend(keep)
    return merged
