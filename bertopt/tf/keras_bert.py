"""Build bertopt's Keras BERT from Hugging Face weights or a Google BERT checkpoint, and save it.

Both weight sources are first expressed with Google's variable names (``bert/embeddings/word_embeddings``,
``bert/encoder/layer_0/attention/self/query/kernel`` ...); :func:`assign_weights` then loads every variable
by name and refuses a missing, unused or wrongly shaped one with a UserError naming it.

``export_hf_to_savedmodel`` is ``bertopt export MODEL --to tf-savedmodel``: its TensorFlow outputs are checked
against PyTorch on real sentences (``--check-tolerance``, 1e-4 by default) before the artifact is written.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from bertopt.errors import UserError, require

SAVEDMODEL_DIR = "saved_model"
# Variables a Google checkpoint carries that an encoder does not use: pre-training heads, the pooler (bertopt
# pools itself), the step counter and optimizer slots. They are listed in the report, never silently dropped.
_IGNORABLE = re.compile(r"^(cls/|bert/pooler/|global_step$|.*/adam_[mv]$|.*/Adam(_1)?$)")
ARCH_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings", "type_vocab_size")


def arch_from_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The architecture from a ``bert_config.json`` / HF ``config.json`` mapping (same key names)."""
    missing = [k for k in ARCH_KEYS if k not in config and k != "type_vocab_size"]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}; it is not a BERT config")
    act = config.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_python"):
        raise UserError(f"{where}: hidden_act '{act}' is not supported by bertopt's Keras BERT (exact gelu only)")
    arch = {}
    for key in ARCH_KEYS:
        value = config.get(key, 2)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {key} must be a positive whole number, got {value!r:.40}; is this the "
                            "bert_config.json released with the checkpoint?")
        arch[key] = value
    from bertopt.sources.hf import MAX_LAYERS

    if arch["num_hidden_layers"] > MAX_LAYERS:
        raise UserError(f"{where}: num_hidden_layers is {arch['num_hidden_layers']:,}, more than the {MAX_LAYERS} an "
                        "encoder has; is this the bert_config.json released with the checkpoint?")
    if arch["hidden_size"] % arch["num_attention_heads"]:
        raise UserError(f"{where}: hidden_size {arch['hidden_size']} is not a multiple of num_attention_heads "
                        f"{arch['num_attention_heads']}; is this the bert_config.json released with the checkpoint?")
    eps = config.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise UserError(f"{where}: layer_norm_eps must be a small positive number, got {eps!r:.40}")
    arch["layer_norm_eps"] = float(eps)
    return arch


def hf_weights_as_google(path: Path) -> dict[str, np.ndarray]:
    """A Hugging Face BERT's weights renamed to Google's variable names (Linear weights transposed)."""
    from bertopt.sources.files import check_source_file
    from bertopt.sources.hf import weights_error

    path = Path(path)
    fix = "replace it with the weights file itself"
    try:
        if (path / "model.safetensors").exists():
            from safetensors.numpy import load_file

            state = load_file(str(check_source_file(path, path / "model.safetensors", fix)))
        elif (path / "pytorch_model.bin").exists():
            torch = require("torch", "torch", "reading pytorch_model.bin")
            state = {k: v.numpy() for k, v in torch.load(check_source_file(path, path / "pytorch_model.bin", fix),
                                                           map_location="cpu", weights_only=True).items()}
        else:
            raise UserError(f"{path} has no model.safetensors or pytorch_model.bin")
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - weights_error re-raises what is not the input's fault
        raise weights_error(path, exc) from None
    out = {}
    for key, value in state.items():
        name = key[len("bert."):] if key.startswith("bert.") else key
        if name.endswith("position_ids"):
            continue  # a buffer, not a weight
        name = re.sub(r"layer\.(\d+)\.", r"layer_\1.", name)
        parts = name.split(".")
        last = parts[-1]
        base = "/".join(parts[:-1])
        if parts[-2] == "LayerNorm":
            gname = f"{base}/{'gamma' if last == 'weight' else 'beta'}"
        elif base.startswith("embeddings/") and last == "weight":
            gname = base
        elif last == "weight":
            gname, value = f"{base}/kernel", value.T
        else:
            gname = f"{base}/{last}"
        out["bert/" + gname if not gname.startswith(("cls/", "classifier")) else gname] = np.ascontiguousarray(
            value, dtype=np.float32)
    return out


def checkpoint_prefix(folder: Path) -> Path:
    """The checkpoint's file prefix (``bert_model.ckpt``): its ``.index`` and ``.data-*`` files are regular files
    of the folder. Never a folder: TensorFlow reads a folder's ``checkpoint`` state file and follows the path it
    names, anywhere on the machine."""
    from bertopt.sources.files import check_source_file

    indexes = sorted(Path(folder).glob("*.ckpt*.index"))
    if not indexes:
        raise UserError(f"{folder} has no *.ckpt.index file; copy bert_model.ckpt.index and .data-* into it")
    preferred = [p for p in indexes if p.name == "bert_model.ckpt.index"]
    index = (preferred or indexes)[0]
    prefix = index.with_suffix("")
    fix = "copy the checkpoint's own .index and .data-* files into the folder"
    if os.path.lexists(prefix):
        raise UserError(f"{prefix} exists beside {index.name} (TensorFlow would read it as a checkpoint folder and "
                        f"follow what it names); remove it, or {fix}")
    for file in [index, *sorted(Path(folder).glob(glob.escape(prefix.name) + ".data-*"))]:
        check_source_file(folder, file, fix)
    return prefix


def checkpoint_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every variable of a Google (TF1 name-based) checkpoint, read by name; nothing is unpickled."""
    reader, prefix = _checkpoint_reader(folder)
    try:
        return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt data file fails in TensorFlow's reader
        raise UserError(f"cannot read the checkpoint {prefix}: {str(exc).splitlines()[0] if str(exc) else exc!r:.200}"
                        "; are the .index and .data-* files complete?") from None


def _checkpoint_reader(folder: Path):
    import tensorflow as tf

    prefix = checkpoint_prefix(folder)
    try:
        return tf.train.load_checkpoint(str(prefix)), prefix
    except (tf.errors.OpError, ValueError) as exc:
        raise UserError(f"cannot read the checkpoint {prefix}: {str(exc).splitlines()[0]}; "
                        "are the .index and .data-* files complete?") from None


def check_checkpoint_matches_config(folder: Path, arch: dict[str, Any]) -> None:
    """Every variable the bert_config.json implies is in the checkpoint, in that shape and as numbers, checked from
    the index before any variable is made: the encoder is built zero-filled first, so a 100 kB folder whose config
    asked for 200,000 layers, or a vocabulary or FFN of millions without its table, took gigabytes and minutes."""
    from bertopt.tf._layers import variable_shapes

    reader, prefix = _checkpoint_reader(folder)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    wanted = variable_shapes(*(arch[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                 "intermediate_size", "max_position_embeddings", "type_vocab_size")))
    missing = sorted(name for name in wanted if name not in shapes)
    if missing:
        raise _missing_variables(prefix, missing)
    for name, expected in wanted.items():
        if tuple(shapes[name]) != tuple(expected):
            raise UserError(f"{prefix}: {name} is {list(shapes[name])} but bert_config.json says {list(expected)}; "
                            "the checkpoint does not match bert_config.json")
        if not (dtypes[name].is_floating or dtypes[name].is_integer):
            raise UserError(f"{prefix}: {name} holds {dtypes[name].name} values, not numbers; is this a BERT "
                            "checkpoint?")


def _missing_variables(where: Any, missing: list[str]) -> UserError:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return UserError(f"{where}: variable '{missing[0]}' is missing{more}; the checkpoint does not match "
                     "bert_config.json (num_hidden_layers?) or is not a BERT checkpoint")


def read_google_config(folder: Path) -> dict[str, Any]:
    from bertopt.sources.files import read_source_text

    file = Path(folder) / "bert_config.json"
    fix = "it must be the JSON bert_config.json released with the checkpoint"
    try:
        config = json.loads(read_source_text(folder, file, fix, max_bytes=1 << 20))
    except (ValueError, RecursionError) as exc:
        raise UserError(f"cannot read {file}: {str(exc).splitlines()[0]:.200}; {fix}") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} holds a JSON {type(config).__name__}, not an object; {fix}")
    return config


def build_encoder(arch: dict[str, Any], pooling: str | None, normalize: bool):
    from bertopt.tf._layers import BertEncoder

    return BertEncoder(**arch, pooling=pooling, normalize=normalize, name="bert_encoder")


def assign_weights(encoder, weights: dict[str, np.ndarray], where: str) -> dict[str, Any]:
    """Load every encoder variable from ``weights`` by Google name; any gap or mismatch is a UserError."""
    from bertopt.tf._layers import google_name

    expected = {google_name(w): w for w in encoder.weights}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise _missing_variables(where, missing)
    unused = sorted(n for n in set(weights) - set(expected) if not _IGNORABLE.match(n))
    if unused:
        raise UserError(f"{where}: variable '{unused[0]}' is not used by a BERT encoder with this config"
                        + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                        + "; check num_hidden_layers in the config")
    for name, var in expected.items():
        value = weights[name]
        if tuple(value.shape) != tuple(var.shape):
            raise UserError(f"{where}: variable '{name}' has shape {list(value.shape)} but the config implies "
                            f"{list(var.shape)}; the config does not match the checkpoint")
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            raise UserError(f"{where}: variable '{name}' holds {value.dtype} values, not numbers; is this a BERT "
                            "checkpoint?")
        value = value.astype(np.float32)
        if not np.isfinite(value).all():
            raise UserError(f"{where}: variable '{name}' holds NaN or infinite values; the weights are damaged "
                            "(a diverged training run?): use a checkpoint saved before it diverged")
        var.assign(value)
    return {"variables_loaded": len(expected),
            "variables_ignored": sorted(set(weights) - set(expected))}


def model_info_from_arch(arch: dict[str, Any], pooling: str | None, normalize: bool, task: str,
                         max_seq_len: int | None) -> dict[str, Any]:
    return {"model_type": "bert", **{k: arch[k] for k in ARCH_KEYS}, "task": task, "pooling": pooling,
            "normalize": normalize, "max_seq_len": max_seq_len or min(512, arch["max_position_embeddings"]),
            "primary_output": "sentence_embedding" if pooling else "last_hidden_state"}


def encoder_output_specs(hidden: int, pooling: str | None, normalize: bool) -> list[dict[str, Any]]:
    specs = [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", hidden],
              "kind": "token"}]
    if pooling:
        specs.append({"name": "sentence_embedding", "dtype": "float32", "shape": ["batch", hidden],
                      "kind": "embedding", "pooling": pooling, "normalized": bool(normalize)})
    return specs


def input_specs(mask_name: str, dtype: str) -> list[dict[str, Any]]:
    roles = {"input_ids": "input_ids", mask_name: "attention_mask", "token_type_ids": "token_type_ids"}
    return [{"name": n, "role": r, "dtype": dtype, "shape": ["batch", "sequence"]} for n, r in roles.items()]


def encoder_from_checkpoint(folder: Path, pooling: str | None = "mean", normalize: bool = False):
    """A Google checkpoint rebuilt in the Keras BERT; returns (encoder, arch, load report)."""
    folder = Path(folder)
    arch = arch_from_config(read_google_config(folder), str(folder / "bert_config.json"))
    check_checkpoint_matches_config(folder, arch)
    encoder = build_encoder(arch, pooling, normalize)
    report = assign_weights(encoder, checkpoint_weights(folder), str(checkpoint_prefix(folder)))
    return encoder, arch, report


# -- export stages -------------------------------------------------------------------------------------------
def export_hf_to_savedmodel(source, config, out_dir: Path, overwrite: bool):
    """``bertopt export HF --to tf-savedmodel``: Hugging Face BERT weights -> Keras BERT -> SavedModel."""
    require("tensorflow", "tf", "exporting to a TensorFlow SavedModel")
    import tensorflow as tf

    from bertopt.artifact import ArtifactWriter
    from bertopt.sources.hf import copy_tokenizer, read_model_info, resolve_pooling

    info = read_model_info(source.path)
    if info["task"] != "embedding":
        raise UserError(f"{source.path} is a {info['task']} model; the TensorFlow path exports encoders "
                        "(BertModel / sentence-transformers), export it to ONNX instead")
    if info.get("model_type") not in ("bert", None):
        raise UserError(f"{source.path} is a '{info['model_type']}' model; bertopt's Keras BERT covers BERT "
                        "(use --to onnx for other architectures)")
    hf_config = json.loads((source.path / "config.json").read_text())
    arch = arch_from_config(hf_config, str(source.path / "config.json"))
    pooling = resolve_pooling(info, config["pooling"])
    normalize = bool(info.get("normalize")) and pooling is not None
    encoder = build_encoder(arch, pooling, normalize)
    load_report = assign_weights(encoder, hf_weights_as_google(source.path), str(source.path))
    model_info = model_info_from_arch(arch, pooling, normalize, info["task"],
                                      config["max_seq_len"] or info.get("max_seq_len"))
    outputs = encoder_output_specs(arch["hidden_size"], pooling, normalize)
    inputs = input_specs("attention_mask", "int64")
    with ArtifactWriter(out_dir, stage="export", params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = model_info
        w.runtime = "tensorflow"
        copy_tokenizer(source.path, w.dir / "tokenizer", vocab_size=arch["vocab_size"],
                       type_vocab_size=arch["type_vocab_size"], inputs=inputs)
        from bertopt.tf._layers import ServingModule

        ServingModule(encoder, "attention_mask", tf.int64).save(str(w.dir / SAVEDMODEL_DIR))
        w.set_model(SAVEDMODEL_DIR, "tf-savedmodel", inputs, outputs, precision="fp32")
        w.extra["tensorflow"] = {"signature": "serving_default"}
        w.report.update({"exporter": f"bertopt Keras BERT, tensorflow {tf.__version__}", **load_report})
        diff = _max_abs_diff_vs_pytorch(w, source.path, pooling)
        w.report["max_abs_diff_vs_pytorch"] = diff
        if not np.isfinite(diff) or diff > config["check_tolerance"]:
            raise UserError(f"the TensorFlow model differs from PyTorch by {diff:.3g} (> "
                            f"{config['check_tolerance']:g}); the model uses something bertopt's Keras BERT does "
                            "not reproduce, please report it")
    return w.artifact


def export_checkpoint_to_savedmodel(source, config, out_dir: Path, overwrite: bool):
    """``bertopt export CKPT_FOLDER --to tf-savedmodel``: a Google checkpoint as a SavedModel whose signature
    takes ``input_ids``, ``input_mask`` and ``token_type_ids`` (int32, like Google's BERT)."""
    require("tensorflow", "tf", "reading Google BERT checkpoints")
    import tensorflow as tf

    from bertopt.artifact import ArtifactWriter
    from bertopt.sources.hf import copy_tokenizer
    from bertopt.tf._layers import ServingModule

    pooling = None if config["pooling"] == "none" else ("mean" if config["pooling"] == "auto" else config["pooling"])
    encoder, arch, load_report = encoder_from_checkpoint(source.path, pooling, normalize=False)
    with ArtifactWriter(out_dir, stage="export", params=config, source=source.to_manifest(),
                        overwrite=overwrite) as w:
        w.model_info = model_info_from_arch(arch, pooling, False, "encoder", config["max_seq_len"])
        w.runtime = "tensorflow"
        inputs = input_specs("input_mask", "int32")
        copy_tokenizer(source.path, w.dir / "tokenizer", vocab_size=arch["vocab_size"],
                       type_vocab_size=arch["type_vocab_size"], inputs=inputs)
        ServingModule(encoder, "input_mask", tf.int32).save(str(w.dir / SAVEDMODEL_DIR))
        w.set_model(SAVEDMODEL_DIR, "tf-savedmodel", inputs,
                    encoder_output_specs(arch["hidden_size"], pooling, False), precision="fp32")
        w.extra["tensorflow"] = {"signature": "serving_default"}
        w.report.update({"exporter": f"bertopt Keras BERT from {checkpoint_prefix(source.path).name}", **load_report})
    return w.artifact


def _max_abs_diff_vs_pytorch(writer, hf_path: Path, pooling: str | None) -> float:
    from bertopt.data import corpus
    from bertopt.measure.compare import compare_runs
    from bertopt.runtime import Predictor
    from bertopt.sources.hf import hf_reference
    from bertopt.stages.common import worst_abs_diff

    texts = corpus()[:48]
    tf_pred = Predictor(writer.staged(), provider="cpu")
    torch_pred = hf_reference(hf_path, pooling=pooling or "none", max_seq_len=tf_pred.max_seq_len)
    names = tf_pred.output_names
    kinds = writer.staged().output_kinds
    return worst_abs_diff(compare_runs(tf_pred.run(texts, outputs=names), torch_pred.run(texts, outputs=names), kinds))
