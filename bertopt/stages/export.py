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
from bertopt.families import TASKS
from bertopt.params import Param

# sentence-transformers' pooling modes (kept here, not imported from sources.hf, so the CLI stays light)
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")

NAME = "export"
HELP = "Convert a model (Hugging Face folder, ONNX file, TF graph artifact) into a bertopt artifact."


def _opset_ok(v: int) -> str | None:
    return None if 17 <= v <= 21 else "must be between 17 and 21"


PARAMS = [
    Param("to", str, "onnx", "Target format.", choices=("onnx", "tf-savedmodel")),
    Param("opset", int, 17, "ONNX opset version (17-21).", check=_opset_ok),
    Param("task", str, None, "What the artifact computes (default: detected from the folder: the config's "
          "architectures and a sentence-transformers modules.json). embedding: sentence embeddings; "
          "classification: sequence-classification logits; token-classification: per-token logits (NER); rerank: "
          "a cross-encoder's relevance score for a text pair; sparse-embedding: SPLADE term weights from a "
          "masked-LM head.", choices=TASKS),
    Param("pooling", str, "auto", "Sentence pooling inside the graph: auto (the model's own sentence-transformers "
          "pooling, else mean), mean, cls, max, mean_sqrt_len_tokens, weightedmean, lasttoken or none.",
          choices=("auto", "none") + POOLING_MODES),
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
        build_encoder_module,
        copy_tokenizer,
        input_specs,
        output_specs,
        read_model_info,
        resolve_pooling,
    )

    # family and task first: an unsupported architecture or a missing head is refused before any work
    info = read_model_info(source.path, task=config.get("task"))
    torch = require("torch", "torch", "exporting Hugging Face models")
    require("onnx", "onnx", "exporting to ONNX")
    pooling = resolve_pooling(info, config["pooling"])
    outputs = output_specs(info, pooling)
    inputs = input_specs(info)
    info["primary_output"] = outputs[-1]["name"]
    # the runtime's default truncation: the user's choice, else the model's own (sentence-transformers) setting
    info["max_seq_len"] = config["max_seq_len"] or info.get("max_seq_len") or min(512, info["max_position_embeddings"])
    if info["max_seq_len"] > info["max_position_embeddings"]:
        raise UserError(f"--max-seq-len {info['max_seq_len']} exceeds the {info['max_position_embeddings']} tokens "
                        f"this {info['family']} model's positions allow; use {info['max_position_embeddings']} or less")
    names = [o["name"] for o in outputs]
    with ArtifactWriter(out_dir, stage=NAME, params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = info
        copy_tokenizer(source.path, w.dir / "tokenizer", family=info["family"], vocab_size=info.get("vocab_size"))
        module = build_encoder_module(source.path, info, pooling)
        dummy = tuple(torch.ones(2, 8, dtype=torch.long) if s["name"] != "token_type_ids"
                      else torch.zeros(2, 8, dtype=torch.long) for s in inputs)
        dynamic = {s["name"]: {0: "batch", 1: "sequence"} for s in inputs}
        for o in outputs:
            dynamic[o["name"]] = {0: "batch", 1: "sequence"} if "sequence" in o["shape"] else {0: "batch"}
        with torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(module, dummy, str(w.dir / "model.onnx"), input_names=[s["name"] for s in inputs],
                              output_names=names, dynamic_axes=dynamic, opset_version=config["opset"],
                              dynamo=False, do_constant_folding=True)
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="fp32")
        w.report["exporter"] = f"torch.onnx.export (TorchScript, dynamo=False), torch {torch.__version__}"
        w.report["opset"] = config["opset"]
        # Self-check on real sentences: the export must match PyTorch.
        texts = corpus()[:48]
        diff = _max_abs_diff_vs_torch(w, module, names, texts, info, inputs)
        w.report["max_abs_diff_vs_pytorch"] = diff
        if not np.isfinite(diff) or diff > config["check_tolerance"]:
            raise UserError(f"exported ONNX differs from PyTorch by {diff:.3g} (> {config['check_tolerance']:g}); "
                            "the model uses an op the exporter mishandles, please report it")
    return w.artifact


def _max_abs_diff_vs_torch(writer, module, names, texts, info, inputs) -> float:
    """Worst elementwise difference over real tokens between ONNX Runtime and PyTorch (text pairs for
    models that take two segments)."""
    import numpy as np

    from bertopt.runtime import Predictor
    from bertopt.sources.hf import SourceModel

    staged = writer.staged()
    onnx_pred = Predictor(staged, provider="cpu")
    spec = SourceModel(writer.dir, writer.dir / "tokenizer", inputs, staged.outputs, info, "pytorch", module=module)
    torch_pred = Predictor(spec, provider="cpu")
    pairs = texts[1:] + texts[:1] if info.get("pair_input") else None
    a, b = onnx_pred.run(texts, pairs), torch_pred.run(texts, pairs)
    worst = 0.0
    for name in names:
        xs, ys = a[name], b[name]
        items = zip(xs, ys) if isinstance(xs, list) else [(xs, ys)]
        for x, y in items:
            worst = max(worst, float(np.max(np.abs(x - y))) if x.size else 0.0)
    return worst


def _onnx_companion_folders(source, config) -> list[Path]:
    """Where an ONNX file's tokenizer and config live: --tokenizer, its own folder, or the folder above (the
    layout sentence-transformers and Optimum use for ``onnx/model.onnx``)."""
    folder = source.path.parent
    return [Path(config["tokenizer"])] if config["tokenizer"] else [folder, folder.parent]


def import_onnx(source, config, out_dir: Path, overwrite: bool):
    """An ONNX file (bertopt's, Optimum's, sentence-transformers' own export) as an artifact: inputs and task from
    the graph's names and shapes, family, labels and positions from the config.json beside it, tokenizer from
    its folder, external data files carried along."""
    import json

    from bertopt.artifact import ArtifactWriter
    from bertopt.errors import require
    from bertopt.families import family_for_config
    from bertopt.sources.hf import copy_tokenizer, read_model_info
    from bertopt.stages.onnx_util import copy_onnx, describe_io, load_onnx

    require("onnx", "onnx", "importing ONNX models")
    model = load_onnx(source.path)
    folders = _onnx_companion_folders(source, config)
    tokenizer_files = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "sentencepiece.bpe.model")
    tok_dir = next((f for f in folders if any((f / n).exists() for n in tokenizer_files)), None)
    if tok_dir is None:
        raise UserError(f"no tokenizer (tokenizer.json, vocab.txt, vocab.json + merges.txt) next to {source.path} "
                        "or in the folder above; pass --tokenizer FOLDER")
    cfg_dir = next((f for f in folders if (f / "config.json").exists()), None)
    hf_config = json.loads((cfg_dir / "config.json").read_text()) if cfg_dir else {}
    inputs, outputs, info = describe_io(model, vocab_size=hf_config.get("vocab_size"))
    if config.get("task") and config["task"] != info["task"]:
        raise UserError(f"{source.path} computes {info['task']} (outputs: {', '.join(o['name'] for o in outputs)}), "
                        f"not {config['task']}; export the Hugging Face folder with --task {config['task']}")
    if hf_config:
        family_for_config(hf_config, str(cfg_dir))  # refuse a decoder before any work
        try:
            detected = read_model_info(cfg_dir, task=info["task"])
        except UserError:
            detected = read_model_info(cfg_dir, task="embedding")  # the config names a base model only
        detected.update({k: v for k, v in info.items() if k in ("task", "primary_output")})
        if info["task"] in ("classification", "rerank", "token-classification") and "num_labels" not in detected:
            labels = int(next(o for o in outputs if o["name"] == info["primary_output"])["shape"][-1])
            detected.update(num_labels=labels, id2label={str(i): f"LABEL_{i}" for i in range(labels)},
                            pair_input=info["task"] == "rerank")
        info = detected
    else:
        info["family"] = "bert"
        info["pair_input"] = info["task"] == "rerank"
    if config["max_seq_len"]:
        info["max_seq_len"] = config["max_seq_len"]
    with ArtifactWriter(out_dir, stage=NAME, params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = info
        copy_tokenizer(tok_dir, w.dir / "tokenizer", family=info.get("family"), vocab_size=info.get("vocab_size"))
        copy_onnx(source.path, w.dir / "model.onnx")
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="fp32")
        w.report["exporter"] = "import (ONNX file copied as is, with its external data)"
        w.report["recognised"] = {"task": info["task"], "inputs": [i["name"] for i in inputs],
                                  "outputs": {o["name"]: o["kind"] for o in outputs},
                                  "config": str(cfg_dir / "config.json") if cfg_dir else None}
    return w.artifact
