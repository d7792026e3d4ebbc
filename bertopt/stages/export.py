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
from bertopt.tasks import MAX_LABELS, TASKS

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
    Param("check_tolerance", float, 1e-4, "Max difference allowed between the exported model and the "
          "original on real sentences (absolute; relative to the output's largest magnitude where that exceeds "
          "1); the export fails above it.", min=0),
    Param("tokenizer", str, None, "Tokenizer folder for an ONNX file input (default: the file's folder)."),
]

def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.artifact import Artifact
    from bertopt.stages.common import format_handler

    kind = input.model_format if isinstance(input, Artifact) else input.kind
    if isinstance(input, Artifact) and kind == "onnx":  # else the ONNX importer reads the folder as a file
        raise UserError(f"{input.path} is already an ONNX artifact: export makes one from a model; go on with "
                        "prune, optimize, quantize or compile")
    # ONNX exports live here; the TensorFlow ones are registered by bertopt.tf as "<kind>-><target>"
    exporter = {("hf", "onnx"): export_hf_to_onnx, ("onnx", "onnx"): import_onnx}.get((kind, config["to"])) \
        or format_handler(NAME, f"{kind}->{config['to']}")
    if config.get("tokenizer") and kind != "onnx":  # was ignored: the artifact got the model's own tokenizer
        raise UserError(f"--tokenizer is for an ONNX file input; a {kind} model brings its own tokenizer (the one "
                        "it was trained with): drop --tokenizer")
    if exporter is None:
        hint = ""
        if kind in ("tf-savedmodel", "keras", "tf-checkpoint") and not isinstance(input, Artifact):
            hint = "; TensorFlow models go through 'bertopt freeze' first, then export"
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
        copy_tokenizer(source.path, w.dir / "tokenizer", family=info["family"], vocab_size=info.get("vocab_size"),
                       type_vocab_size=info.get("type_vocab_size"), inputs=inputs)
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
        diff, scaled = _max_abs_diff_vs_torch(w, module, names, texts, info, inputs)
        w.report["max_abs_diff_vs_pytorch"] = diff
        if not np.isfinite(scaled) or scaled > config["check_tolerance"]:
            raise UserError(f"exported ONNX differs from PyTorch by {diff:.3g} ({scaled:.3g} of the output's "
                            f"magnitude, > {config['check_tolerance']:g}); the model uses an op the exporter "
                            "mishandles, please report it")
    return w.artifact


def _max_abs_diff_vs_torch(writer, module, names, texts, info, inputs) -> tuple[float, float]:
    """Worst elementwise difference over real tokens between ONNX Runtime and PyTorch (text pairs for
    models that take two segments): absolute, and relative to the output's largest magnitude where that exceeds 1
    (hidden states of wide models reach 10-50, where float32 summation order alone moves values by ~1e-4)."""
    import numpy as np

    from bertopt.model_handle import ModelHandle
    from bertopt.runtime import Predictor

    staged = writer.staged()
    onnx_pred = Predictor(staged, provider="cpu")
    torch_pred = Predictor(ModelHandle(model_format="pytorch", inputs=inputs, outputs=staged.outputs,
                                       tokenizer_path=writer.dir / "tokenizer", model_info=info, path=writer.dir,
                                       digest="pytorch", module=module), provider="cpu")
    pairs = texts[1:] + texts[:1] if info.get("pair_input") else None
    a, b = onnx_pred.run(texts, pairs), torch_pred.run(texts, pairs)
    worst = scaled = 0.0
    for name in names:
        xs, ys = a[name], b[name]
        items = list(zip(xs, ys) if isinstance(xs, list) else [(xs, ys)])
        magnitude = max([1.0] + [float(np.max(np.abs(y))) for _, y in items if y.size])
        for x, y in items:
            d = float(np.max(np.abs(x - y))) if x.size else 0.0
            worst, scaled = max(worst, d), max(scaled, d / magnitude)
    return worst, scaled


def _onnx_companion_folders(source, config) -> list[Path]:
    """Where an ONNX file's tokenizer and config live: --tokenizer, its own folder, or the folder above (the
    layout sentence-transformers and Optimum use for ``onnx/model.onnx``)."""
    folder = source.path.parent
    return [Path(config["tokenizer"])] if config["tokenizer"] else [folder, folder.parent]


def import_onnx(source, config, out_dir: Path, overwrite: bool):
    """An ONNX file (bertopt's, Optimum's, sentence-transformers' own export) as an artifact: inputs and task from
    the graph's names and shapes, family, labels and positions from the config.json beside it, tokenizer from
    its folder, external data files carried along. A graph that stops at token states gets the folder's
    sentence-transformers pipeline (modules.json: Pooling, Dense, Normalize) appended, else mean pooling
    (``--pooling`` picks another, ``none`` keeps the token states only)."""

    from bertopt.artifact import ArtifactWriter
    from bertopt.errors import require
    from bertopt.families import family_for_config
    from bertopt.onnx_graph.util import copy_onnx, describe_io, load_onnx, save_onnx, uses_external_data
    from bertopt.sources.hf import copy_tokenizer, read_config, read_model_info

    require("onnx", "onnx", "importing ONNX models")
    model = load_onnx(source.path)
    folders = _onnx_companion_folders(source, config)
    tokenizer_files = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "sentencepiece.bpe.model")
    tok_dir = next((f for f in folders if any((f / n).exists() for n in tokenizer_files)), None)
    if tok_dir is None and config["tokenizer"]:
        raise UserError(f"--tokenizer {config['tokenizer']} holds no tokenizer (tokenizer.json, vocab.txt, vocab.json "
                        "+ merges.txt, spm.model); give the folder the model's tokenizer was saved in")
    if tok_dir is None:
        raise UserError(f"no tokenizer (tokenizer.json, vocab.txt, vocab.json + merges.txt) next to {source.path} "
                        "or in the folder above; pass --tokenizer FOLDER")
    cfg_dir = next((f for f in folders if (f / "config.json").exists()), None)
    hf_config = read_config(cfg_dir) if cfg_dir else {}
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
            labels = next(o for o in outputs if o["name"] == info["primary_output"])["shape"][-1]
            if not isinstance(labels, int):
                raise UserError(f"{source.path}: the {info['task']} output '{info['primary_output']}' does not declare "
                                "how many labels it has; put num_labels (and id2label) in the config.json beside it")
            if labels > MAX_LABELS:  # each named in the manifest (id2label)
                raise UserError(f"{source.path}: the {info['task']} output declares {labels:,} labels, more than "
                                f"the {MAX_LABELS:,} a classifier may have; re-export the model")
            detected.update(num_labels=labels, id2label={str(i): f"LABEL_{i}" for i in range(labels)},
                            pair_input=info["task"] == "rerank")
        detected["hidden_size"] = detected.get("hidden_size") or info["hidden_size"]
        info = detected
    else:
        info["family"] = "bert"
        info["pair_input"] = info["task"] == "rerank"
    if config["max_seq_len"]:
        info["max_seq_len"] = config["max_seq_len"]
    plan = _pipeline_plan(source, config, folders, inputs, outputs, info)
    appended = bool(plan and plan["append"])
    if appended:
        from bertopt.sources.onnx_pipeline import append_pipeline

        model = append_pipeline(model, info)
        if plan["kind"] == "sparse":  # sparse_embedding replaces the (batch, sequence, vocabulary) logits
            outputs = [o for o in outputs if o["name"] != plan["token_output"]]
        outputs = outputs + [plan["output"]]
        info["primary_output"] = plan["output"]["name"]
    with ArtifactWriter(out_dir, stage=NAME, params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = info
        copy_tokenizer(tok_dir, w.dir / "tokenizer", family=info.get("family"), vocab_size=info.get("vocab_size"),
                       type_vocab_size=info.get("type_vocab_size"), inputs=inputs)
        if appended:
            save_onnx(model, w.dir / "model.onnx", external=uses_external_data(source.path))
            w.report["exporter"] = ("import (ONNX file as is, with its external data) + the sentence-transformers "
                                    "pipeline appended (torch.onnx.export, TorchScript)")
        else:
            copy_onnx(source.path, w.dir / "model.onnx")
            w.report["exporter"] = "import (ONNX file copied as is, with its external data)"
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="fp32")
        w.report["recognised"] = {"task": info["task"], "inputs": [i["name"] for i in inputs],
                                  "outputs": {o["name"]: o["kind"] for o in outputs},
                                  "config": str(cfg_dir / "config.json") if cfg_dir else None}
        if plan:
            w.report["notes"] = [plan["note"]]
        _first_run(w.staged(), source.path)
        if appended:
            w.report["sentence_pipeline"] = plan["recorded"]
            diff = _pipeline_diff_vs_pytorch(w, source.path, info)
            w.report["max_abs_diff_pipeline_vs_pytorch"] = diff
            if not diff <= config["check_tolerance"]:
                raise UserError(f"the appended sentence-transformers pipeline differs from PyTorch by {diff:.3g} "
                                f"(> {config['check_tolerance']:g}); please report it, or pass --pooling none")
    return w.artifact


def _first_run(staged, source_file: Path) -> None:
    """Run an imported graph once, before its artifact exists: two texts of different lengths alone and then in
    one batch, so a graph that cannot run (an operator its runtime lacks, a 4 TB allocation) or computes other
    shapes than it declares (a "pooled" output as wide as the text) is refused here, with nothing written, and not
    by every command that loads the artifact later."""
    from bertopt.errors import ModelRunError
    from bertopt.runtime import Predictor

    texts = ["Hello.", "A second, longer text: the shapes of a graph's outputs must not follow the text's length."]
    pairs = texts[::-1] if staged.model_info.get("pair_input") else None
    try:
        predictor = Predictor(staged, threads=1)  # where later commands run it by default (a GPU, if any)
        predictor.run(texts, pairs, batch_size=1)
        predictor.run(texts, pairs)
    except ModelRunError as exc:  # it names the folder being written, which is about to go: name the source
        raise ModelRunError(str(exc).replace(str(staged.path), str(source_file))) from None


def _pipeline_plan(source, config, folders, inputs, outputs, info) -> dict | None:
    """What to append to an imported graph that stops before its sentence-transformers pipeline: None when it
    computes its task's output already; else the plan (``append``, ``kind`` sentence or sparse, the output spec,
    the note the report and the CLI show), recorded in ``info`` (``sentence_pipeline``, pooling, Dense,
    Normalize or SPLADE settings) for the appending and for validation's reference."""
    pooled = [o for o in outputs if o["kind"] in ("embedding", "sparse", "logits", "score", "token-logits")]
    mlm = next((o for o in outputs if o["kind"] == "mlm-logits"), None)
    token = next((o for o in outputs if o["kind"] == "token"), None)
    mode = config["pooling"]
    # the pipeline sits with the model's files: beside the ONNX file or above it, whatever --tokenizer names
    places = list(dict.fromkeys(folders + [source.path.parent, source.path.parent.parent]))
    st_dir = next((f for f in places if (f / "modules.json").exists()), None)
    if mlm is not None:
        return _sparse_plan(source, config, inputs, info, mlm, st_dir)
    if pooled or token is None or info["task"] != "embedding":
        if mode not in ("auto", "none"):
            what = ", ".join(o["name"] for o in pooled) or "no token states"
            raise UserError(f"{source.path} outputs {what}, so there is nothing to pool; drop --pooling {mode}")
        return None
    name = source.path.name
    if mode == "none":
        return {"append": False, "kind": "sentence",
                "note": f"{name} outputs token states only ({token['name']}); kept per token (--pooling none): "
                        "encode() and the servers' embeddings need a pooled output, so run() it or export again "
                        "without --pooling none"}
    from bertopt.sources.hf import dense_weights_file, sentence_pipeline_info

    mask = _mask_input(source, inputs)
    st = sentence_pipeline_info(st_dir) if st_dir else {"pooling": None, "dense": [], "normalize": False}
    pooling = st["pooling"] if mode == "auto" else mode
    if st_dir and pooling:
        where = f"the sentence-transformers pipeline of {st_dir / 'modules.json'}"
        if mode != "auto":
            where += f" with --pooling {mode}"
        note = f"{name} outputs token states only; appended {where} ({_pipeline_words(pooling, st)})"
    elif st_dir:
        pooling = "mean"
        note = (f"{name} outputs token states only and {st_dir / 'modules.json'} has no Pooling module; appended "
                f"mean pooling ({_pipeline_words(pooling, st)}); --pooling picks another, none keeps tokens")
    elif mode == "auto":
        pooling = "mean"
        note = (f"{name} outputs token states only and no sentence-transformers modules.json is beside it; appended "
                "mean pooling, as for a Hugging Face folder without one (--pooling cls|max|... picks another, "
                "--pooling none keeps the token states only)")
    else:
        note = f"{name} outputs token states only; appended {pooling} pooling (--pooling {mode})"
    for dense in st["dense"]:
        dense_weights_file(st_dir, dense, allow_bin=False)  # safetensors only: a .bin is a pickle
    width = (info.get("hidden_size") or 0) * (len(pooling) if isinstance(pooling, list) else 1)
    if st["dense"] and width and st["dense"][0]["in_features"] != width:
        raise UserError(f"{st_dir / st['dense'][0]['path']} takes {st['dense'][0]['in_features']} features but "
                        f"{pooling} pooling gives {width}; use the model's own pooling (drop --pooling)")
    info.update(pooling=pooling, dense=st["dense"], normalize=st["normalize"])
    dim = st["dense"][-1]["out_features"] if st["dense"] else (width or "dim")
    output = {"name": "sentence_embedding", "dtype": "float32", "shape": ["batch", dim], "kind": "embedding",
              "pooling": pooling, "normalized": bool(st["normalize"])}
    info["sentence_pipeline"] = {"kind": "sentence", "folder": str(st_dir) if st_dir else None,
                                 "token_output": token["name"], "mask_input": mask}
    return {"append": True, "kind": "sentence", "token_output": token["name"], "output": output, "note": note,
            "recorded": {"from": str(st_dir / "modules.json") if st_dir else None, "pooling": pooling,
                         "dense": st["dense"], "normalize": st["normalize"]}}


def _mask_input(source, inputs) -> str:
    mask = next((i["name"] for i in inputs if i["role"] == "attention_mask"), None)
    if mask is None:
        raise UserError(f"{source.path} has no attention_mask input, which sentence pooling needs; re-export it "
                        "with attention_mask, or pass --pooling none for the token states only")
    return mask


_SPLADE_POOLINGS, _SPLADE_ACTIVATIONS = ("max", "sum"), ("relu", "log1p_relu")


def _sparse_plan(source, config, inputs, info, mlm, st_dir) -> dict:
    """A SparseEncoder's export (masked-LM logits): its SpladePooling appended, from the folder's modules.json or
    (``--task sparse-embedding``) SPLADE's default max of log(1 + relu)."""
    from bertopt.sources.hf import _module_config, _st_modules

    splade = [m for m in (_st_modules(st_dir) if st_dir else []) if m.get("type", "").endswith("SpladePooling")]
    if not splade and config.get("task") != "sparse-embedding":
        raise UserError(f"{source.path} outputs masked-LM logits (one per vocabulary entry and token) and no SPLADE "
                        "modules.json (SpladePooling) is beside it; pass --task sparse-embedding for SPLADE pooling, "
                        "or export a model with the head you want")
    if config["pooling"] not in ("auto", "none"):
        raise UserError(f"--pooling {config['pooling']} is for sentence embeddings; {source.path} is a masked-LM "
                        "(SPLADE) model, drop --pooling")
    cfg = _module_config(st_dir, splade[0]) if splade else {}
    strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
    if strategy not in _SPLADE_POOLINGS or activation not in _SPLADE_ACTIVATIONS:
        raise UserError(f"{st_dir / splade[0].get('path', '')}: SpladePooling {strategy} / {activation} is not "
                        f"supported; bertopt supports pooling {', '.join(_SPLADE_POOLINGS)} with activation "
                        f"{', '.join(_SPLADE_ACTIVATIONS)}")
    mask = _mask_input(source, inputs)
    vocab = mlm["shape"][-1]
    info.update(task="sparse-embedding", sparse_pooling=strategy, sparse_activation=activation,
                sentence_pipeline={"kind": "sparse", "folder": str(st_dir) if st_dir else None,
                                   "token_output": mlm["name"], "mask_input": mask})
    where = f"the SpladePooling of {st_dir / 'modules.json'}" if splade else "SPLADE pooling (--task sparse-embedding)"
    note = (f"{source.path.name} outputs masked-LM logits; appended {where} ({strategy} over tokens of "
            f"{'log(1 + log(1 + relu))' if activation == 'log1p_relu' else 'log(1 + relu)'}), output sparse_embedding")
    return {"append": True, "kind": "sparse", "token_output": mlm["name"], "note": note,
            "output": {"name": "sparse_embedding", "dtype": "float32", "shape": ["batch", vocab], "kind": "sparse"},
            "recorded": {"from": str(st_dir / "modules.json") if splade else None, "pooling": strategy,
                         "activation": activation}}


def _pipeline_words(pooling, st) -> str:
    parts = [f"{'+'.join(pooling) if isinstance(pooling, list) else pooling} pooling"]
    parts += [f"Dense {d['in_features']}->{d['out_features']} {d['activation']}" for d in st["dense"]]
    if st["normalize"]:
        parts.append("Normalize")
    return ", ".join(parts)


def _pipeline_diff_vs_pytorch(writer, source_file: Path, info) -> float:
    """The appended graph part against the same sentence-transformers modules in PyTorch, both on the source
    graph's own token states (or logits) of real sentences, each text alone: the worst elementwise difference."""
    import numpy as np
    import torch

    from bertopt.data import corpus
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import open_model
    from bertopt.sources.onnx_pipeline import PIPELINE_OUTPUTS, pipeline_module

    recorded = info["sentence_pipeline"]
    output = PIPELINE_OUTPUTS[recorded["kind"]]
    predictor = Predictor(writer.staged(), provider="cpu")
    original = open_model(source_file, provider="cpu")
    head = pipeline_module(info)
    worst = 0.0
    with torch.no_grad():
        for text in corpus()[:48]:
            feeds, _ = predictor.feeds_for(predictor.tokenize([text]))
            states = original.run([recorded["token_output"]], feeds)[0]
            got = predictor.run_batch(feeds, [output])[output]
            mask = torch.from_numpy(np.asarray(feeds[recorded["mask_input"]], dtype=np.int64))
            want = head(torch.from_numpy(np.asarray(states, dtype=np.float32)), mask).numpy()
            diff = float(np.max(np.abs(got - want)))
            if not np.isfinite(diff):
                return float("inf")
            worst = max(worst, diff)
    return worst
