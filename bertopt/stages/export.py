"""export: a model source -> an artifact.

* Hugging Face folder -> ONNX (``torch.onnx.export``, TorchScript exporter, eager attention: the graph
  ONNX Runtime's BERT fusions recognise), pooling and normalisation inside the graph.
* ONNX file -> an ONNX artifact (imported as is, with its tokenizer).
* Hugging Face folder -> TensorFlow SavedModel (``--to tf-savedmodel``, bertopt's own Keras BERT).
* TensorFlow graph artifact (frozen / pruned / fp16) -> ONNX via tf2onnx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import Param

NAME = "export"
HELP = "Convert a model (Hugging Face folder, ONNX file, TF graph artifact) into a bertopt artifact."


def _opset_ok(v: int) -> str | None:
    return None if 17 <= v <= 21 else "must be between 17 and 21"


PARAMS = [
    Param("to", str, "onnx", "Target format.", choices=("onnx", "tf-savedmodel")),
    Param("opset", int, 17, "ONNX opset version (17-21).", check=_opset_ok),
    Param("pooling", str, "auto", "Sentence pooling inside the graph: auto (the model's own sentence-transformers "
          "pooling, else mean), mean, cls, max or none.", choices=("auto", "mean", "cls", "max", "none")),
    Param("max_seq_len", int, None, "Default max tokens per text recorded for the runtime "
          "(default: the model's own setting).", min=1),
    Param("check_tolerance", float, 1e-4, "Max abs difference allowed between the exported model and the "
          "original on real sentences; the export fails above it.", min=0),
    Param("tokenizer", str, None, "Tokenizer folder for an ONNX file input (default: the file's folder)."),
]

def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.artifact import Artifact
    from bertopt.stages.common import format_handler

    kind = input.model_format if isinstance(input, Artifact) else input.kind
    # ONNX exports live here; the TensorFlow ones are registered by bertopt.tf as "<kind>-><target>"
    exporter = {("hf", "onnx"): export_hf_to_onnx, ("onnx", "onnx"): import_onnx}.get((kind, config["to"])) \
        or format_handler(NAME, f"{kind}->{config['to']}")
    if exporter is None:
        hint = ""
        if kind in ("tf-savedmodel", "keras", "tf-checkpoint") and not isinstance(input, Artifact):
            hint = "; TensorFlow models go through 'bertopt freeze' first, then export"
        elif isinstance(input, Artifact) and kind == "onnx":
            hint = "; this artifact is already ONNX, use prune/optimize/quantize"
        raise UserError(f"export cannot turn a {kind} input into {config['to']}{hint}")
    return exporter(input, config, out_dir, overwrite)


def export_hf_to_onnx(source, config, out_dir: Path, overwrite: bool):
    import numpy as np

    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require
    from bertopt.sources.hf import (
        INPUT_SPECS,
        build_encoder_module,
        copy_tokenizer,
        output_specs,
        read_model_info,
        resolve_pooling,
    )

    torch = require("torch", "torch", "exporting Hugging Face models")
    require("onnx", "onnx", "exporting to ONNX")
    info = read_model_info(source.path)
    pooling = resolve_pooling(info, config["pooling"])
    module = build_encoder_module(source.path, info, pooling)
    outputs = output_specs(info, pooling)
    info["primary_output"] = outputs[-1]["name"]
    # the runtime's default truncation: the user's choice, else the model's own (sentence-transformers) setting
    info["max_seq_len"] = config["max_seq_len"] or info.get("max_seq_len") or min(512, info["max_position_embeddings"])
    names = [o["name"] for o in outputs]
    with ArtifactWriter(out_dir, stage=NAME, params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = info
        copy_tokenizer(source.path, w.dir / "tokenizer")
        dummy = (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long),
                 torch.zeros(2, 8, dtype=torch.long))
        dynamic = {n["name"]: {0: "batch", 1: "sequence"} for n in INPUT_SPECS}
        for o in outputs:
            dynamic[o["name"]] = {0: "batch", 1: "sequence"} if o["kind"] == "token" else {0: "batch"}
        with torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(module, dummy, str(w.dir / "model.onnx"), input_names=[s["name"] for s in INPUT_SPECS],
                              output_names=names, dynamic_axes=dynamic, opset_version=config["opset"],
                              dynamo=False, do_constant_folding=True)
        w.set_model("model.onnx", "onnx", INPUT_SPECS, outputs, precision="fp32")
        w.report["exporter"] = f"torch.onnx.export (TorchScript, dynamo=False), torch {torch.__version__}"
        w.report["opset"] = config["opset"]
        # Self-check on real sentences: the export must match PyTorch.
        diff = _max_abs_diff_vs_torch(w, module, names, corpus()[:48], info)
        w.report["max_abs_diff_vs_pytorch"] = diff
        if not np.isfinite(diff) or diff > config["check_tolerance"]:
            raise UserError(f"exported ONNX differs from PyTorch by {diff:.3g} (> {config['check_tolerance']:g}); "
                            "the model uses an op the exporter mishandles, please report it")
    return w.artifact


def _max_abs_diff_vs_torch(writer, module, names, texts, info) -> float:
    """Worst elementwise difference over real tokens between ONNX Runtime and PyTorch."""
    import numpy as np

    from bertopt.runtime import Predictor
    from bertopt.sources.hf import INPUT_SPECS, SourceModel

    staged = writer.staged()
    onnx_pred = Predictor(staged, provider="cpu")
    spec = SourceModel(writer.dir, writer.dir / "tokenizer", INPUT_SPECS, staged.outputs, info, "pytorch",
                       module=module)
    torch_pred = Predictor(spec, provider="cpu")
    a, b = onnx_pred.run(texts), torch_pred.run(texts)
    worst = 0.0
    for name in names:
        xs, ys = a[name], b[name]
        pairs = zip(xs, ys) if isinstance(xs, list) else [(xs, ys)]
        for x, y in pairs:
            worst = max(worst, float(np.max(np.abs(x - y))) if x.size else 0.0)
    return worst


def import_onnx(source, config, out_dir: Path, overwrite: bool):
    import shutil

    from bertopt.artifact import ArtifactWriter
    from bertopt.errors import require
    from bertopt.sources.hf import copy_tokenizer
    from bertopt.stages.onnx_util import describe_io, load_onnx

    require("onnx", "onnx", "importing ONNX models")
    model = load_onnx(source.path)
    tok_dir = Path(config["tokenizer"]) if config["tokenizer"] else source.path.parent
    if not ((tok_dir / "tokenizer.json").exists() or (tok_dir / "vocab.txt").exists()):
        raise UserError(f"no tokenizer.json or vocab.txt next to {source.path}; pass --tokenizer FOLDER")
    inputs, outputs, info = describe_io(model)
    if config["max_seq_len"]:
        info["max_seq_len"] = config["max_seq_len"]
    with ArtifactWriter(out_dir, stage=NAME, params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = info
        copy_tokenizer(tok_dir, w.dir / "tokenizer")
        shutil.copy2(source.path, w.dir / "model.onnx")
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="fp32")
        w.report["exporter"] = "import (ONNX file copied as is)"
    return w.artifact
