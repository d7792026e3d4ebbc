"""TensorFlow model sources opened as one thing: a concrete function taking named int tensors and returning
a dict of named float outputs, plus what the manifest needs (inputs with roles, outputs, model info,
tokenizer folder). Used by ``freeze`` (which folds it into a GraphDef) and by the TF reference (which runs it).

* SavedModel (any encoder with a serving signature of BERT inputs), or a bertopt tf-savedmodel artifact
* ``.keras`` file (loaded with ``safe_mode=True``: no lambda deserialisation, nothing unpickled)
* Google BERT checkpoint folder, rebuilt in bertopt's Keras BERT with every variable loaded by name
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tensorflow as tf

from bertopt.errors import UserError
from bertopt.runtime.tf_session import signature_of
from bertopt.tf.graph import ROLE_BY_NAME, describe_signature, output_spec


@dataclass
class TFModel:
    function: Any  # concrete function: kwargs of named tensors -> dict of outputs
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    model_info: dict[str, Any]
    tokenizer_dir: Path | None
    description: str
    report: dict[str, Any] = field(default_factory=dict)
    keep_alive: Any = None  # the SavedModel/Keras object the function's variables belong to


def open_tf_model(input, *, signature: str = "serving_default", pooling: str | None = "mean",
                  max_seq_len: int | None = None) -> TFModel:
    from bertopt.artifact import Artifact

    if isinstance(input, Artifact):
        model = _open_savedmodel(input.model_path, signature, str(input.path))
        model.model_info = dict(input.model_info)
        model.tokenizer_dir = input.tokenizer_path
        _check_matches_manifest(model, input)
        return model
    if input.kind == "tf-savedmodel":
        model = _open_savedmodel(input.path, signature, str(input.path))
    elif input.kind == "keras":
        model = _open_keras(input.path)
    elif input.kind == "tf-checkpoint":
        model = _open_checkpoint(input.path, pooling)
    else:
        raise UserError(f"{input.path} is a {input.kind} model, not a TensorFlow one")
    apply_position_limit(model, max_seq_len)
    return model


def _table_rows(model: TFModel, name_part: str) -> int | None:
    """Rows of the model's rank-2 graph variable whose name holds ``name_part`` (the smallest, if several)."""
    fn = model.function.concrete if hasattr(model.function, "concrete") else model.function
    sizes = [int(v.shape[0]) for v in getattr(fn, "variables", ())
             if name_part in v.name.lower() and len(v.shape) == 2 and v.shape[0] is not None]
    return min(sizes) if sizes else None


def position_limit(model: TFModel) -> int | None:
    """Rows of the model's absolute position table (a rank-2 variable named like ``position_embeddings``), read
    from the graph's variables: a foreign SavedModel has no config saying how many positions it has."""
    return _table_rows(model, "position")


def embedding_rows(model: TFModel) -> int | None:
    """Rows of the model's word-embedding table: its config's ``vocab_size``, else the rank-2 variable named like
    ``word_embeddings`` in the graph (a foreign SavedModel), so the tokenizer is held to what the table can look up
    (TensorFlow fails on a larger id on a CPU, and returns zeros for it on a GPU)."""
    if isinstance(model.model_info.get("vocab_size"), int):
        return model.model_info["vocab_size"]
    return _table_rows(model, "word_embeddings")


def apply_position_limit(model: TFModel, max_seq_len: int | None) -> None:
    """Record the real position limit (read from the graph) and refuse a --max-seq-len beyond it."""
    limit = position_limit(model)
    info = model.model_info
    if limit is not None:
        info["max_position_embeddings"] = limit
        info["max_seq_len"] = min(int(info.get("max_seq_len") or limit), limit)
        if max_seq_len and max_seq_len > limit:
            raise UserError(f"--max-seq-len {max_seq_len} exceeds the {limit} positions of {model.description}'s "
                            f"position table; use --max-seq-len {limit} or less")
    if max_seq_len:
        info["max_seq_len"] = max_seq_len


def _check_matches_manifest(model: TFModel, art) -> None:
    declared = {o["name"] for o in art.outputs}
    have = {o["name"] for o in model.outputs}
    if not declared <= have:
        raise UserError(f"{art.path}: the SavedModel lacks outputs {sorted(declared - have)} its manifest "
                        "declares; re-create the artifact")


def _open_savedmodel(path: Path, signature: str, where: str) -> TFModel:
    if not (Path(path) / "saved_model.pb").exists():
        raise UserError(f"{path} has no saved_model.pb; give a SavedModel folder")
    try:
        loaded = tf.saved_model.load(str(path))
    except (tf.errors.OpError, ValueError, OSError, IndexError, KeyError) as exc:  # IndexError: a truncated file
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"TensorFlow cannot load the SavedModel {path}: {reason}; is the folder complete (its "
                        "variables/ files as saved)?") from None
    fn = signature_of(loaded, signature, where)
    inputs, outputs = describe_signature(fn, where)
    folder = Path(path)
    return TFModel(fn, inputs, outputs, infer_model_info(folder, outputs), find_tokenizer_dir(folder),
                   f"SavedModel {path} ({signature})", keep_alive=loaded)


# a .keras file's JSON members are a few kB; the weights hold every parameter (at 2 bytes or more each)
KERAS_JSON_MAX_BYTES = 16 << 20
_ENCODER_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                  "type_vocab_size")


def check_keras_archive(path: Path) -> None:
    """Before Keras reads it: a .keras file is a zip whose JSON members are small (a 1.5 MB file whose config.json
    unpacked to 1.5 GiB took 3.8 GB of memory), and whose BERT encoder's sizes agree with the weights it carries
    (a config of a 50-million-token vocabulary allocated 5 GB before any weight was read)."""
    import zipfile

    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{path} is not a .keras archive ({exc}); save the model with model.save('x.keras')") from None
    with archive:
        members = {info.filename: info for info in archive.infolist()}
        for name, info in members.items():
            if name.endswith(".json") and info.file_size > KERAS_JSON_MAX_BYTES:
                raise UserError(f"{path}: {name} unpacks to {info.file_size} bytes, far more than a Keras config "
                                "(a zip bomb?); save the model again with model.save('x.keras')")
        if "config.json" not in members:
            return  # Keras says what is missing
        try:
            config = json.loads(archive.read("config.json"))
        except RecursionError:
            raise UserError(f"{path}: its config.json nests deeper than Python can read (a Keras config is a few "
                            "levels deep); save the model again with model.save('x.keras')") from None
        except (ValueError, zipfile.BadZipFile, OSError):
            return  # Keras says what is wrong with it
    weights = sum(info.file_size for name, info in members.items() if name.endswith(".h5"))
    declared = sum(_layer_parameters(layer) for layer in _dicts_with(config, "class_name")
                   if isinstance(layer.get("config"), dict) and "vocab_size" not in layer["config"]
                   and layer.get("class_name") != "__keras_tensor__")  # a layer's inputs, not a layer
    if 2 * declared > 2 * weights + (64 << 20):
        raise UserError(f"{path}: its layers' sizes in config.json describe some {declared:,} parameters, but the "
                        f"archive's weights hold {weights:,} bytes; the config does not belong to these weights")
    for encoder in _dicts_with(config, "vocab_size"):
        sizes = {key: encoder.get(key, 1) for key in _ENCODER_SIZES}
        bad = next((k for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1), None)
        if bad:
            raise UserError(f"{path}: the encoder's {bad} is {sizes[bad]!r:.40}, not a positive whole number; save "
                            "the model again with model.save('x.keras')")
        h = sizes["hidden_size"]
        params = (sizes["vocab_size"] + sizes["max_position_embeddings"] + sizes["type_vocab_size"]) * h \
            + sizes["num_hidden_layers"] * (4 * h * h + 2 * h * sizes["intermediate_size"])
        if 2 * params > 2 * weights + (64 << 20):
            raise UserError(f"{path}: its config describes an encoder of {params:,} parameters, but the archive's "
                            f"weights hold {weights:,} bytes; the config does not belong to these weights")


def _layer_parameters(layer: dict) -> int:
    """A bound on the parameters one layer of a Keras config makes when Keras builds it, before reading any weight:
    the product of the sizes in its config (an Embedding's rows and width, a Dense's units, a convolution's filters
    and kernel size, attention heads and head size) and its input's width (the last size of its build_config's
    input shape: the sequence length makes no weights), times 4 x units more for a recurrent layer (its recurrent
    kernel). Keras fills every variable before loading weights, so an 11 kB file whose Embedding said 50,000,000
    rows took 3.8 GB."""
    config = layer.get("config")
    sizes: list[int] = []
    stack: list[Any] = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item is not config and "class_name" in item:
                continue  # a nested layer or initializer: counted on its own
            stack.extend(v for k, v in item.items() if k != "seed")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item > 1:
            sizes.append(item)
    shape = (layer.get("build_config") or {}).get("input_shape") if isinstance(layer.get("build_config"), dict) \
        else None
    while isinstance(shape, list) and shape and isinstance(shape[0], list):
        shape = shape[0]  # several inputs: the first one's
    # an Embedding's input is ids: its last size is the text's length, no width
    takes_ids = isinstance(config, dict) and "input_dim" in config
    if not takes_ids and isinstance(shape, list) and shape and isinstance(shape[-1], int) and shape[-1] > 1:
        sizes.append(shape[-1])
    product = 1
    for size in sizes:
        product *= size
    units = config.get("units") if isinstance(config, dict) else None
    if isinstance(units, int) and not isinstance(units, bool) and "recurrent_initializer" in config:
        product *= 4 * max(1, units)
    return product


def _dicts_with(value, key: str):
    """Every mapping inside ``value`` (a JSON document) that has ``key``, walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if key in item:
                yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _open_keras(path: Path) -> TFModel:
    import keras

    import bertopt.tf._layers  # noqa: F401  registers bertopt's layers so their .keras files load

    check_keras_archive(path)
    try:
        model = keras.saving.load_model(str(path), safe_mode=True, compile=False)
    except (ValueError, TypeError, OSError, KeyError, MemoryError, tf.errors.OpError) as exc:
        text = str(exc)
        # Keras wraps the reason in advice about from_config(); the reason comes after "Exception encountered:"
        cause = text.split("Exception encountered:", 1)[1] if "Exception encountered:" in text else text
        reason = " ".join(cause.split())[:300] or type(exc).__name__
        raise UserError(f"Keras cannot load {path}: {reason}; save the model again with model.save('x.keras')"
                        ) from None
    names = [t.name for t in model.inputs]
    for n in names:
        if n not in ROLE_BY_NAME:
            raise UserError(f"{path}: Keras input '{n}' is not a BERT input (name the inputs input_ids, "
                            "attention_mask/input_mask, token_type_ids/segment_ids)")
    dtypes = {t.name: tf.as_dtype(t.dtype) for t in model.inputs}
    spec = {n: tf.TensorSpec([None, None], dtypes[n], name=n) for n in names}

    @tf.function(input_signature=[spec])
    def serve(inputs):
        out = model(inputs, training=False)
        if isinstance(out, dict):
            return dict(out)
        outs = out if isinstance(out, (list, tuple)) else [out]
        default = ["last_hidden_state", "sentence_embedding"]
        labels = list(getattr(model, "output_names", None) or [])
        if len(labels) != len(outs):
            labels = [default[int(len(o.shape) == 2)] for o in outs]
        return dict(zip(labels, outs))

    concrete = serve.get_concrete_function()
    inputs = [{"name": n, "role": ROLE_BY_NAME[n], "dtype": dtypes[n].name, "shape": ["batch", "sequence"]}
              for n in names]
    outputs = [output_spec(k, v.shape, v.dtype, str(path)) for k, v in sorted(concrete.structured_outputs.items())]
    info = infer_model_info(path.parent, outputs)
    from bertopt.tf._layers import BertEncoder

    for layer in model.layers:
        if isinstance(layer, BertEncoder):  # a bertopt Keras BERT knows its own architecture
            cfg = layer.get_config()
            info.update({k: cfg[k] for k in ("num_attention_heads", "num_hidden_layers", "hidden_size",
                                             "max_position_embeddings", "vocab_size", "intermediate_size")})
            info.update({"pooling": cfg["pooling"], "normalize": cfg["normalize"]})
    return TFModel(_KwargsAdapter(concrete, names), inputs, outputs, info, find_tokenizer_dir(path.parent),
                   f"Keras model {path}", keep_alive=model)


class _KwargsAdapter:
    """Call a dict-input concrete function with keyword tensors, like a SavedModel signature."""

    def __init__(self, concrete, names):
        self.concrete = concrete
        self.names = names
        self.structured_outputs = concrete.structured_outputs

    def __call__(self, **tensors):
        return self.concrete(tensors)


def _open_checkpoint(folder: Path, pooling: str | None) -> TFModel:
    from bertopt.tf._layers import ServingModule
    from bertopt.tf.keras_bert import encoder_from_checkpoint, encoder_output_specs, input_specs, model_info_from_arch

    encoder, arch, report = encoder_from_checkpoint(folder, pooling, normalize=False)
    module = ServingModule(encoder, "input_mask", tf.int32)
    fn = module.serve.get_concrete_function()
    info = model_info_from_arch(arch, pooling, False, "encoder", None)
    return TFModel(fn, input_specs("input_mask", "int32"), encoder_output_specs(arch["hidden_size"], pooling, False),
                   info, find_tokenizer_dir(folder), f"Google BERT checkpoint {folder}", report=report,
                   keep_alive=module)


def infer_model_info(folder: Path, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """What can be known about a foreign model: a bert_config.json / config.json next to it, else its outputs."""
    cfg: dict[str, Any] = {}
    for name in ("bert_config.json", "config.json"):
        for where in (folder, folder / "assets"):
            if (where / name).is_file():
                try:
                    cfg = json.loads((where / name).read_text())
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where / name} is not valid JSON ({exc})") from None
                break
        if cfg:
            break
    hidden = next((o["shape"][-1] for o in outputs if isinstance(o["shape"][-1], int)), None)
    embedding = [o for o in outputs if o["kind"] == "embedding"]
    token = [o for o in outputs if o["kind"] == "token"]
    primary = (embedding or outputs)[-1]["name"] if (embedding or outputs) else None
    if not embedding and token:
        primary = token[0]["name"]
    max_pos = int(cfg.get("max_position_embeddings", 512))
    return {"model_type": cfg.get("model_type", "bert"), "hidden_size": cfg.get("hidden_size", hidden),
            "num_attention_heads": cfg.get("num_attention_heads"), "num_hidden_layers": cfg.get("num_hidden_layers"),
            "max_position_embeddings": max_pos, "max_seq_len": min(512, max_pos),
            "task": "sentence-embedding" if embedding else "encoder", "pooling": None, "normalize": False,
            "primary_output": primary}


def find_tokenizer_dir(folder: Path) -> Path | None:
    for where in (folder, folder / "assets"):
        if (where / "tokenizer.json").is_file() or (where / "vocab.txt").is_file():
            return where
    return None
