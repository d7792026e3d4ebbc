"""Hugging Face model folders: metadata, the PyTorch model with its task head, and the PyTorch reference (its
model handle, ``hf_model_handle``, run by the ``pytorch`` runtime backend).

``read_model_info`` recognises the family (``bertopt.families``) and the task from the folder: the config's
``architectures`` (a sequence / token classification or masked-LM head) and a sentence-transformers
``modules.json`` (Pooling, Dense, Normalize; SPLADE pooling; a CrossEncoder's config). ``build_encoder_module``
is that model plus everything its pipeline does after the transformer, as one module the exporter traces.

Weights load through transformers' safetensors path (or ``torch.load(weights_only=True)`` for
``pytorch_model.bin``); nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from bertopt.errors import UserError, require
from bertopt.families import family_by_name, family_for_config
from bertopt.model_handle import ModelHandle, reads_token_types
from bertopt.sources.files import check_source_file, check_source_files, folder_name_problem, read_source_text
from bertopt.tasks import MAX_LABEL_CHARS, MAX_LABELS, TASK_SPECS, TASKS, canonical_task, task_spec

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "spm.model", "sentencepiece.bpe.model",
                   "tokenizer_config.json", "special_tokens_map.json")
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' legacy boolean pooling keys -> mode names
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DENSE_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid",
                     "SiLU": "silu"}
# config keys some families name differently (DistilBERT)
_CONFIG_ALIASES = {"hidden_size": ("dim",), "num_attention_heads": ("n_heads",), "num_hidden_layers": ("n_layers",),
                   "intermediate_size": ("hidden_dim",)}


def _json_file(file: Path, fix: str, kind: type = dict, root: Path | None = None) -> Any:
    """A model folder's JSON file whose top level is a ``kind`` (an object, or a list for modules.json); anything
    else is one line naming the file and ending with ``fix``. Not ``artifact.read_json_file``: that one refuses
    symlinks (an artifact is a boundary), and a Hugging Face cache snapshot's files are symlinks to its blobs;
    here a link is followed where it stays in the model folder ``root`` (``sources.files``)."""
    text = read_source_text(root or file.parent, file, fix)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UserError(f"cannot read {file} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                        f"{fix}") from None
    if not isinstance(data, kind):
        raise UserError(f"{file} holds a JSON {type(data).__name__}, not {'an object' if kind is dict else 'a list'}; "
                        f"{fix}")
    return data


def _whole(value: Any, low: int = 1, high: int | None = None) -> bool:
    """Whether a JSON value is a whole number (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


MAX_DENSE_FEATURES = 1 << 16  # a Dense module's widths (real ones: 256-4096)
MAX_LAYERS = 256  # encoder layers (BERT-large: 24; the deepest BERT-family checkpoints: 48)
# config.json values that size the model: transformers fails deep inside (negative tensor sizes, modulo by zero)
_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
          "vocab_size")


def read_config(path: Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    config = _json_file(file, "is this a Hugging Face model folder?")
    for key in _SIZES:
        value = config.get(key)
        if value is not None and not _whole(value):
            raise UserError(f"{file}: '{key}' must be a positive whole number, got {value!r}; fix the config")
    layers = _config_value(config, "num_hidden_layers")
    if _whole(layers) and layers > MAX_LAYERS:
        # each layer is a module transformers builds before any weight is read (200,000 ran for minutes)
        raise UserError(f"{file}: 'num_hidden_layers' is {layers:,}, more than the {MAX_LAYERS} an encoder of "
                        "this kind has; fix the config")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError(f"{file}: 'architectures' must be a list of class names (e.g. [\"BertModel\"]), got "
                        f"{archs!r:.60}; fix the config")
    cross = config.get("sentence_transformers")
    if cross is not None and not isinstance(cross, dict):
        raise UserError(f"{file}: 'sentence_transformers' must be an object, got {cross!r:.60}; fix the config")
    for act in ((cross or {}).get("activation_fn"), config.get("sbert_ce_default_activation_function")):
        if act is not None and not isinstance(act, str):
            raise UserError(f"{file}: a cross-encoder's activation must be a class name such as "
                            f"torch.nn.modules.activation.Sigmoid, got {act!r:.60}; fix the config")
    labels = config.get("num_labels")
    if labels is not None and not _whole(labels, 1, MAX_LABELS):
        raise UserError(f"{file}: 'num_labels' must be a whole number from 1 to {MAX_LABELS:,}, got {labels!r:.40}; "
                        "fix the config (the classifier head's outputs)")
    for key in ("id2label", "label2id"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise UserError(f"{file}: '{key}' must be an object (label index -> name), got a "
                            f"{type(config[key]).__name__}; fix the config")
        if len(config.get(key) or {}) > MAX_LABELS:
            raise UserError(f"{file}: '{key}' names {len(config[key]):,} labels, more than the {MAX_LABELS:,} a "
                            "classifier may have; fix the config")
    id2label = config.get("id2label") or {}
    for index, name in id2label.items():  # transformers reads the keys as ints; the manifest keeps the names
        if not (isinstance(index, str) and index.isascii() and index.isdigit() and int(index) < len(id2label)):
            raise UserError(f"{file}: 'id2label' key {index!r:.40} is not a label index from 0 to "
                            f"{len(id2label) - 1}; fix the config (\"0\": \"NEGATIVE\", \"1\": ...)")
        if not isinstance(name, str) or not name or len(name) > MAX_LABEL_CHARS:
            raise UserError(f"{file}: 'id2label' names label {index} {name!r:.40}, not a name of 1 to "
                            f"{MAX_LABEL_CHARS} characters; fix the config")
    return config


def _config_value(config: dict[str, Any], key: str):
    if key in config:
        return config[key]
    for alias in _CONFIG_ALIASES.get(key, ()):
        if alias in config:
            return config[alias]
    return None


def _st_modules(path: Path) -> list[dict[str, Any]]:
    file = path / "modules.json"
    if not file.exists():
        return []
    modules = _json_file(file, "re-save the sentence-transformers model", list)
    if not all(isinstance(m, dict) for m in modules):
        raise UserError(f"{file} must list one object per module; re-save the sentence-transformers model")
    for module in modules:  # each module's folder is read (its config, a Dense layer's weights): it must be ours
        if not isinstance(module.get("type", ""), str):
            raise UserError(f"{file}: a module's 'type' must be a class name (e.g. "
                            f"sentence_transformers.models.Pooling), got {module['type']!r:.60}; re-save the "
                            "sentence-transformers model")
        problem = folder_name_problem(module.get("path", ""))
        if problem:
            raise UserError(f"{file}: module path {module.get('path')!r:.80} {problem}; a module's folder is a "
                            "relative path inside the model folder")
    return modules


def _module_config(path: Path, module: dict[str, Any]) -> dict[str, Any]:
    file = path / module.get("path", "") / "config.json"
    return _json_file(file, "re-save the sentence-transformers model", root=path)


def _pooling_modes(cfg: dict[str, Any], where: Path) -> list[str]:
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING.items() if cfg.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [mode]
    if not modes or any(not isinstance(m, str) or m not in POOLING_MODES for m in modes):
        raise UserError(f"{where}: unsupported sentence-transformers pooling {str(cfg):.200}; bertopt supports "
                        f"{', '.join(POOLING_MODES)}")
    if len(set(modes)) < len(modes):  # sentence-transformers has one flag per mode: a repeat is no model of its
        # (a 40 KB list of 5,000 "mean"s made a 160,000-wide embedding over minutes)
        raise UserError(f"{where}: pooling_mode lists a mode more than once ({len(modes):,} modes); name each of "
                        f"{', '.join(POOLING_MODES)} at most once")
    return modes


def _dense_info(path: Path, module: dict[str, Any]) -> dict[str, Any]:
    cfg = _module_config(path, module)
    where = path / module.get("path", "") / "config.json"
    for key in ("in_features", "out_features"):  # checked against the weights' shape as they load (_load_dense)
        value = cfg.get(key)
        if not _whole(value, 1, MAX_DENSE_FEATURES):
            raise UserError(f"{where}: '{key}' must be a whole number from 1 to {MAX_DENSE_FEATURES:,}, got "
                            f"{value!r:.40}; re-save the Dense module")
    if not isinstance(cfg.get("bias", True), bool):
        raise UserError(f"{where}: 'bias' must be true or false, got {cfg['bias']!r:.40}; re-save the Dense module")
    act_path = cfg.get("activation_function") or "torch.nn.modules.activation.Tanh"
    if not isinstance(act_path, str):
        raise UserError(f"{where}: 'activation_function' must be a class name such as "
                        f"torch.nn.modules.activation.Tanh, got {act_path!r:.40}; re-save the Dense module")
    act = DENSE_ACTIVATIONS.get(act_path.rsplit(".", 1)[-1])
    if act is None:
        raise UserError(f"{path / module['path']}: Dense activation {act_path} is not supported; bertopt supports "
                        f"{', '.join(DENSE_ACTIVATIONS)}")
    if cfg.get("use_residual"):
        raise UserError(f"{path / module['path']}: Dense with use_residual is not supported; export without it")
    return {"path": module.get("path", ""), "in_features": cfg["in_features"], "out_features": cfg["out_features"],
            "bias": cfg.get("bias", True), "activation": act}


def sentence_pipeline_info(path: Path, modules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a sentence-transformers folder's ``modules.json`` does after the Transformer: ``pooling`` (a mode,
    a list of modes, or None without a Pooling module), ``dense`` (each Dense's shape and activation) and
    ``normalize``. A module bertopt cannot put in a graph is refused with one line."""
    path = Path(path)
    modules = _st_modules(path) if modules is None else modules
    found: dict[str, Any] = {"pooling": None, "dense": [], "normalize": False}
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            modes = _pooling_modes(_module_config(path, module), path / module.get("path", ""))
            found["pooling"] = modes[0] if len(modes) == 1 else modes
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind == "Dense":
            found["dense"].append(_dense_info(path, module))
        elif kind not in ("Transformer", "MLMTransformer", "SpladePooling"):
            raise UserError(f"{path}: sentence-transformers module {module.get('type')} is not supported; "
                            "bertopt supports Transformer, Pooling, Dense and Normalize")
    return found


def head_tasks(config: dict[str, Any]) -> set[str]:
    """The tasks the weights' heads allow (embedding always: every head sits on an encoder)."""
    archs = config.get("architectures") or []
    found = {"embedding"}
    for spec in TASK_SPECS:
        if spec.head and any(a.endswith(spec.head) for a in archs):
            found.add(spec.name)
    return found


def _is_cross_encoder(config: dict[str, Any]) -> bool:
    return "sentence_transformers" in config or "sbert_ce_default_activation_function" in config


def read_model_info(path: Path, task: str | None = None) -> dict[str, Any]:
    """Family, task, head and pipeline of a Hugging Face (optionally sentence-transformers) folder.

    ``task`` overrides what the folder suggests; a task whose head the weights do not have is refused."""
    path = Path(path)
    config = read_config(path)
    family = family_for_config(config, str(path))
    modules = _st_modules(path)
    module_types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    heads = head_tasks(config)
    is_splade = "SpladePooling" in module_types
    # a bare masked-LM checkpoint makes embeddings unless --task sparse-embedding asks for SPLADE
    detected = "embedding"
    if "token-classification" in heads:
        detected = "token-classification"
    elif "classification" in heads:
        num = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        # one output: a relevance score (a cross-encoder), not a one-class classifier
        detected = "rerank" if num == 1 else "classification"
    elif is_splade:
        detected = "sparse-embedding"
    chosen = canonical_task(task) if task else detected
    if chosen not in heads:
        have = ", ".join(t for t in TASKS if t in heads)
        raise UserError(f"{path} has no {chosen} head (architectures: "
                        f"{', '.join(config.get('architectures') or []) or 'none'}); this model can do: {have}")
    info: dict[str, Any] = {
        "family": family.name,
        "model_type": config.get("model_type"),
        "hidden_size": _config_value(config, "hidden_size"),
        "num_attention_heads": _config_value(config, "num_attention_heads"),
        "num_hidden_layers": _config_value(config, "num_hidden_layers"),
        "intermediate_size": _config_value(config, "intermediate_size"),
        # the tokens a text may have: the position table less any offset (RoBERTa 514 -> 512)
        "max_position_embeddings": family.max_tokens(config),
        "position_table": config.get("max_position_embeddings"),
        "type_vocab_size": config.get("type_vocab_size"),
        "vocab_size": config.get("vocab_size"),
        "task": chosen,
        "pair_input": False,
        "pooling": None,
        "normalize": False,
        "dense": [],
    }
    if chosen in ("classification", "rerank", "token-classification"):
        id2label = config.get("id2label") or {}
        info["num_labels"] = len(id2label) or config.get("num_labels", 2)
        info["id2label"] = {str(k): v for k, v in id2label.items()} or \
            {str(i): f"LABEL_{i}" for i in range(info["num_labels"])}
        if chosen == "classification":
            info["problem_type"] = config.get("problem_type") or "single_label_classification"
            if info["problem_type"] == "regression":
                info["problem_type"] = "single_label_classification"
            info["pair_input"] = _is_cross_encoder(config)
        if chosen == "rerank":
            info["pair_input"] = True
            act = (config.get("sentence_transformers") or {}).get("activation_fn") \
                or config.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
            info["score_activation"] = "identity" if act.endswith("Identity") else "sigmoid"
    if chosen == "embedding":
        info.update(sentence_pipeline_info(path, modules))
    if chosen == "sparse-embedding":
        splade = [m for m in modules if m.get("type", "").endswith("SpladePooling")]
        cfg = _module_config(path, splade[0]) if splade else {}
        info["sparse_pooling"] = cfg.get("pooling_strategy", "max")
        info["sparse_activation"] = cfg.get("activation_function", "relu")
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.exists():
        info["max_seq_len"] = _json_file(st_cfg, "re-save the sentence-transformers model").get("max_seq_length")
        if info["max_seq_len"] is not None and (isinstance(info["max_seq_len"], bool) or not isinstance(
                info["max_seq_len"], (int, float)) or info["max_seq_len"] < 1 or info["max_seq_len"] % 1):
            raise UserError(f"{st_cfg}: 'max_seq_length' must be a positive whole number, got "
                            f"{info['max_seq_len']!r}; fix it (the most tokens per text, e.g. 256)")
    if modules and not info.get("max_seq_len"):
        # sentence-transformers 5+ saves the limit as the tokenizer's model_max_length, not in
        # sentence_bert_config.json (transformers writes ~1e30 there for "no limit")
        info["max_seq_len"] = _tokenizer_max_length(path)
    if info.get("max_seq_len"):
        info["max_seq_len"] = min(int(info["max_seq_len"]), info["max_position_embeddings"])
    return info


def _tokenizer_max_length(path: Path) -> int | None:
    file = path / "tokenizer_config.json"
    value = _json_file(file, "re-save the tokenizer").get("model_max_length") if file.exists() else None
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1_000_000 else None


# -- tokenizer -----------------------------------------------------------------------------------------------

def copy_tokenizer(src: Path, dest: Path, family: str | None = None, vocab_size: int | None = None,
                   type_vocab_size: int | None = None, inputs: Sequence[dict[str, Any]] = ()) -> None:
    """Copy tokenizer files, building ``tokenizer.json`` when the folder has none (from vocab.txt, from
    vocab.json + merges.txt, or from a SentencePiece model, as the family declares), and check that its
    vocabulary fits the model's embedding table and, given ``type_vocab_size`` and a model whose ``inputs`` read
    token type ids, that the token types it gives fit the token-type table."""
    fam = family_by_name(family)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.lexists(src / name):  # a link that leads out of the folder, a FIFO or /dev/zero: refused
            check_source_file(src, src / name, "replace it with the tokenizer file itself")
            shutil.copyfile(src / name, dest / name)
    if not (dest / "tokenizer.json").exists():
        build_tokenizer_json(src, fam).save(str(dest / "tokenizer.json"))
    from bertopt.runtime.tokenizer_file import read_tokenizer_json

    # read now (the copy: a regular file), so a tokenizer.json that is no tokenizer is named as the user's file
    tokenizer = read_tokenizer_json(dest / "tokenizer.json", shown_as=src / "tokenizer.json")
    check_tokenizer_fits(tokenizer, src, vocab_size)
    if type_vocab_size is not None and reads_token_types(inputs):
        check_token_types_fit(tokenizer, src, int(type_vocab_size))


def check_token_types_fit(tokenizer, src: Path, type_vocab_size: int) -> None:
    """The token types the tokenizer's post-processor gives a text and a text pair are rows of the model's
    token-type table: past it, ONNX Runtime fails the batch and OpenVINO's Gather reads zeros, a silently wrong
    embedding for every pair."""
    encodings = (("a text", tokenizer.encode("a")), ("the second text of a pair", tokenizer.encode("a", "b")))
    for which, encoding in encodings:
        largest = max(encoding.type_ids, default=0)
        if largest >= type_vocab_size:
            raise UserError(f"the tokenizer in {src} gives {which} the token type {largest}, but the model's "
                            f"token-type table has {type_vocab_size} row{'s' if type_vocab_size != 1 else ''} "
                            f"(types 0-{type_vocab_size - 1}); use the tokenizer the model was trained with, or "
                            "fix 'type_id' in the post_processor of its tokenizer.json")


# text no vocabulary covers whole: a rare script, an emoji, a word longer than WordPiece's 100-character limit
_UNCOVERED_TEXT = "the ¿ẞ 𝔘 ꙮ \U0001F9EA 龘 " + "x" * 120


def check_tokenizer_fits(tokenizer, src: Path, vocab_size: int | None) -> None:
    """A tokenizer that can encode any text, into ids the model's embedding table has rows for: its largest id
    (not its count: a sparse id, or a vocab.txt with a line twice, passed a count within the table), the ids of
    the special tokens its post-processor adds, and an unknown token for what its vocabulary lacks."""
    from bertopt.runtime.tokenizer_file import TokenizerFailure

    fix = "use the tokenizer the model was trained with"
    try:
        tokenizer.encode(_UNCOVERED_TEXT)
    except TokenizerFailure as exc:  # the tokenizers library's own words on what it lacks
        raise UserError(f"the tokenizer in {src} cannot encode text outside its vocabulary ({exc.reason}); "
                        f"{fix}") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if len(vocab) - len([t for t in tokenizer.get_added_tokens_decoder().values() if t.special]) < 1:
        raise UserError(f"the tokenizer in {src} holds only special tokens, so every word would be unknown; {fix}")
    if not vocab_size:
        return
    ids = [(token_id, repr(token)) for token, token_id in vocab.items()]
    ids += [(token_id, f"the post-processor's {name!r}")
            for name, token_id in _post_processor_ids(json.loads(tokenizer.to_str()).get("post_processor"))]
    largest, which = max(ids)
    if largest >= int(vocab_size):
        raise UserError(f"the tokenizer in {src} gives {which} the id {largest}, but the model's embedding table has "
                        f"{vocab_size} rows (ids 0-{int(vocab_size) - 1}); {fix}")


def _post_processor_ids(spec: Any):
    """(token, id) of every special token a tokenizer.json's post-processor inserts (TemplateProcessing's
    ``special_tokens``, BertProcessing / RobertaProcessing's ``cls`` and ``sep`` pairs, a Sequence's steps')."""
    stack = [spec]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key in ("cls", "sep"):
                pair = item.get(key)
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
                    yield str(pair[0]), pair[1]
            specials = item.get("special_tokens")
            for name, special in specials.items() if isinstance(specials, dict) else ():
                ids = special.get("ids") if isinstance(special, dict) else None
                yield from ((str(name), i) for i in ids or () if isinstance(i, int))
            stack.append(item.get("processors"))


def build_tokenizer_json(src: Path, fam):
    """A ``tokenizers.Tokenizer`` for a folder without tokenizer.json, from the family's slow-tokenizer files."""
    tok_cfg = {}
    if (src / "tokenizer_config.json").exists():
        tok_cfg = _json_file(src / "tokenizer_config.json", "re-save the tokenizer")
    flags = {key: tok_cfg.get(key, default) for key, default in (("do_lower_case", True),
                                                                  ("add_prefix_space", False))}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise UserError(f"{src / 'tokenizer_config.json'}: '{key}' must be true or false, got {value!r:.40}; "
                            "re-save the tokenizer")
    for files, build in ((("vocab.txt",), lambda: build_wordpiece_tokenizer(src / "vocab.txt",
                                                                             flags["do_lower_case"])),
                         (("vocab.json", "merges.txt"), lambda: build_bytelevel_bpe_tokenizer(
                             src / "vocab.json", src / "merges.txt", add_prefix_space=flags["add_prefix_space"]))):
        if all((src / name).exists() for name in files):
            try:
                return build()
            except Exception as exc:  # the tokenizers library raises plain Exception (and KeyError, TypeError)
                reason = " ".join(str(exc).split())[:160] or type(exc).__name__
                raise UserError(f"cannot build a tokenizer from {' + '.join(str(src / n) for n in files)} "
                                f"({type(exc).__name__}: {reason}); save the tokenizer again with the model "
                                "(tokenizer.save_pretrained writes tokenizer.json)") from None
    for name in ("spm.model", "sentencepiece.bpe.model"):
        if (src / name).exists():
            return _convert_sentencepiece(src)
    wanted = " or ".join(" + ".join(files) for files in fam.tokenizer_sources) or "tokenizer.json"
    raise UserError(f"{src} has no tokenizer.json (nor {wanted}); save the tokenizer with the model")


def build_wordpiece_tokenizer(vocab_file: Path, lowercase: bool):
    from tokenizers.implementations import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(vocab_file), lowercase=lowercase)._tokenizer


def build_bytelevel_bpe_tokenizer(vocab_file: Path, merges_file: Path, add_prefix_space: bool = False):
    """RoBERTa's tokenizer: byte-level BPE, ``<s> A </s></s> B </s>``, no segment ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merges_file)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    vocab = tok.get_vocab()
    tok.post_processor = processors.RobertaProcessing(("</s>", vocab["</s>"]), ("<s>", vocab["<s>"]),
                                                      add_prefix_space=add_prefix_space, trim_offsets=True)
    return tok


def _convert_sentencepiece(src: Path):
    """SentencePiece models convert through transformers' converters (they need the sentencepiece package), after
    the .model file is read here: an empty one parsed as a model of no pieces (every word became <unk>, and export
    and validate passed), a damaged one sent transformers to its tiktoken reader, and a malformed character map
    made the tokenizers library allocate 8.6 GB and abort the process."""
    from bertopt.runtime.tokenizer_file import is_library_error

    require("sentencepiece", "torch", "converting a SentencePiece tokenizer")
    transformers = require("transformers", "torch", "converting a SentencePiece tokenizer")
    # transformers reads whatever files the folder's tokenizer config names: each must be the folder's own
    check_source_files(src, fix="replace it with the file itself")
    for name in ("spm.model", "sentencepiece.bpe.model"):
        if (src / name).exists():
            check_sentencepiece_model(src, src / name)
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its fallback advice ("Falling back to TikToken") is not what is wrong
    try:
        # never the folder's own tokenizer code (auto_map): transformers would ask on stdin, and run it on "y"
        tok = transformers.AutoTokenizer.from_pretrained(str(src), use_fast=True, trust_remote_code=False)
    except BaseException as exc:  # transformers' and the tokenizers library's errors are plain Exception or panics
        if not is_library_error(exc):
            raise
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"cannot convert the SentencePiece tokenizer in {src} ({reason}); save the tokenizer again "
                        "with the model (tokenizer.save_pretrained writes tokenizer.json)") from None
    finally:
        logger.setLevel(level)
    return tok.backend_tokenizer


SENTENCEPIECE_MAX_BYTES = 64 << 20  # real ones are a few MB (XLM-R's 250,000 pieces: 5 MB)


def check_sentencepiece_model(src: Path, file: Path) -> None:
    """A SentencePiece ``.model`` file is a model of pieces, with character maps that are well formed."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    from bertopt.sources.files import read_source_bytes
    from bertopt.untrusted import precompiled_charsmap_growth

    fix = "save the tokenizer again with the model (tokenizer.save_pretrained writes tokenizer.json)"
    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(read_source_bytes(src, file, fix, max_bytes=SENTENCEPIECE_MAX_BYTES))
    except DecodeError:
        raise UserError(f"{file} is not a SentencePiece model (truncated or damaged?); {fix}") from None
    normal = sum(1 for piece in model.pieces if piece.type == piece.NORMAL)
    if not normal:
        only = f" ({len(model.pieces)} special ones only)" if model.pieces else ""
        raise UserError(f"{file} holds no pieces{only}, so every word would be an unknown token; {fix}")
    for spec in ("normalizer_spec", "denormalizer_spec"):
        charsmap = getattr(model, spec).precompiled_charsmap
        if charsmap:
            try:
                precompiled_charsmap_growth(charsmap)
            except ValueError as exc:
                raise UserError(f"{file}: its {spec} character map is not one ({exc}); {fix}") from None


# -- the PyTorch model with its head and pipeline --------------------------------------------------------------

def load_torch_model(path: Path, info: dict[str, Any]):
    torch = require("torch", "torch", "Hugging Face models")
    transformers = require("transformers", "torch", "Hugging Face models")
    cls = {
        "classification": transformers.AutoModelForSequenceClassification,
        "rerank": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
        "sparse-embedding": transformers.AutoModelForMaskedLM,
    }.get(info["task"], transformers.AutoModel)
    # bertopt shows its own progress; transformers' per-load bars and advisories only add noise
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for weights in weights_files(path):
        check_source_file(path, weights, "replace it with the weights file itself")
    try:
        # what config.json asks for, weighed on the meta device (no memory) before anything is allocated:
        # transformers fills weights a checkpoint lacks with random values, so a 120 KB folder whose config said
        # vocab_size 20,000,000 without the embeddings wrote a 2.5 GB artifact of random numbers (exit 0)
        with torch.device("meta"):
            meta = cls.from_config(transformers.AutoConfig.from_pretrained(str(path)), attn_implementation="eager")
        _check_against_checkpoint(Path(path), meta)
        # eager attention exports to the graph ONNX Runtime's BERT fusions recognise (SDPA does not fuse)
        model, loading = cls.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32,
                                             output_loading_info=True)
    except UserError:
        raise
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as exc:
        # a config whose values transformers cannot build a model from (read_config checks the common ones)
        raise UserError(f"cannot load the model in {path}: {(str(exc).splitlines() or [type(exc).__name__])[0]}; "
                        "check its config.json and weights") from None
    except Exception as exc:  # huggingface_hub's config validation errors derive from Exception only
        raise weights_error(path, exc) from None
    # an embedding model's pooler (BERT's next-sentence head input) is never run: checkpoints saved without it lose
    # nothing (a classifier's head does run it); any other weight the checkpoint lacks would be random in the artifact
    missing = sorted(k for k in loading.get("missing_keys") or ()
                     if not (cls is transformers.AutoModel and ".pooler." in f".{k}"))
    if missing:
        more = f" and {len(missing) - 1} more" if missing[1:] else ""
        raise UserError(f"{path} has no weights for {missing[0]}{more}, which its config.json asks for "
                        "(transformers would fill them with random values); use the "
                        "config.json saved with the weights, or a complete checkpoint")
    return model.eval()


def weights_files(path: Path) -> list[Path]:
    """A Hugging Face folder's weights files (safetensors, shards included, and pickles)."""
    return sorted([*Path(path).glob("*.safetensors"), *Path(path).glob("*.bin")])


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's shape in a folder's weights files, from the safetensors headers (read alone, not the tensors)
    or a pytorch_model.bin (memory-mapped, read with ``weights_only``: a pickle of more than tensors is refused
    here, nothing in it run); None: no weights file, or one too damaged to say (from_pretrained then says how)."""
    import struct

    files = weights_files(path)
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if file.suffix == ".bin":
            found = _pickled_shapes(path, file)
            if found is None:
                return None
            shapes.update(found)
            continue
        with open(file, "rb") as fh:
            head = fh.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= 100 << 20:  # safetensors' own bound on its header
                return None
            try:
                header = json.loads(fh.read(size))
            except (ValueError, RecursionError):
                return None
        for name, entry in header.items() if isinstance(header, dict) else ():
            shape = entry.get("shape") if isinstance(entry, dict) and name != "__metadata__" else None
            if isinstance(shape, list) and all(_whole(d, 0) for d in shape):
                shapes[name] = tuple(shape)
    return shapes


def _check_against_checkpoint(path: Path, meta) -> None:
    """The model config.json describes (built on the meta device: no memory) against the tensors its weights files
    hold: a tensor of another shape is named with both shapes, and a model far larger than what the files hold is
    refused before transformers allocates it (filling what is missing with random numbers)."""
    import math

    shapes = checkpoint_shapes(path)
    if shapes is None:
        return
    prefix = getattr(meta, "base_model_prefix", "") or ""
    for name, param in meta.state_dict().items():
        for key in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if key in shapes:
                if shapes[key] != tuple(param.shape):
                    raise UserError(f"{path}: the weights hold {key} as {list(shapes[key])}, but config.json "
                                    f"describes it as {list(param.shape)}; use the config.json saved with the weights")
                break
    needed = sum(p.numel() for p in meta.parameters())
    held = sum(math.prod(shape) for shape in shapes.values())
    if needed > held + held // 20 + 4096:
        raise UserError(f"{path}/config.json describes a model of {needed:,} weights, but its weights files hold "
                        f"{held:,}: the config does not match the weights (sizes such as num_hidden_layers, "
                        "vocab_size, hidden_size); use the config.json saved with them")


def _pickled_shapes(path: Path, file: Path) -> dict[str, tuple[int, ...]] | None:
    import pickle

    import torch

    try:
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (not zip) format cannot be memory-mapped: read, as from_pretrained will
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise weights_error(path, exc) from None
    except (RuntimeError, OSError, ValueError, EOFError):  # damaged: from_pretrained says how
        return None
    if not isinstance(state, dict):
        return None
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def weights_error(path: Path, exc: Exception) -> UserError:
    """A model's weights that cannot be read, as one line; re-raised as it is if the error is none of the input's
    kinds (a bug). A pickle (pytorch_model.bin) is read with ``weights_only``: one that holds more than tensors
    is refused, and the line does not repeat torch's advice to load it unsafely."""
    import pickle

    first = (str(exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, pickle.UnpicklingError):
        return UserError(f"cannot load the weights in {path}: pytorch_model.bin holds more than plain tensors (a "
                         "pickle bertopt never runs); re-save the model with safetensors "
                         "(save_pretrained(folder, safe_serialization=True)) from a source you trust")
    if type(exc).__name__ == "SafetensorError" or type(exc).__module__.split(".")[0] == "safetensors":
        return UserError(f"cannot load the weights in {path}: model.safetensors is damaged ({first:.200}); "
                         "download or save the model again")
    if isinstance(exc, OSError):
        return UserError(f"cannot read the weights in {path} ({exc.strerror or first}); check the folder's files")
    if type(exc).__module__.split(".")[0] == "huggingface_hub":
        return UserError(f"cannot load the model in {path}: {first}; check its config.json")
    raise exc


def dense_weights_file(path: Path, dense: dict[str, Any], allow_bin: bool = True) -> Path:
    """The file a Dense module's weights load from: ``model.safetensors``, or (``allow_bin``) a
    ``pytorch_model.bin`` read with ``weights_only=True``; one line when there is none it may read."""
    problem = folder_name_problem(dense["path"])
    if problem:
        raise UserError(f"{path}: the Dense module's path {dense['path']!r:.80} {problem}; a module's folder is a "
                        "relative path inside the model folder")
    folder = Path(path) / dense["path"]
    if (folder / "model.safetensors").exists():
        return check_source_file(path, folder / "model.safetensors", "replace it with the weights file itself")
    if (folder / "pytorch_model.bin").exists():
        if allow_bin:
            return check_source_file(path, folder / "pytorch_model.bin", "replace it with the weights file itself")
        raise UserError(f"{folder} keeps its Dense weights in pytorch_model.bin (a pickle), which bertopt does not "
                        "read beside an ONNX file; re-save the model with safetensors "
                        "(SentenceTransformer(folder).save(folder, safe_serialization=True)) or export the Hugging "
                        "Face folder itself")
    raise UserError(f"{folder} has no model.safetensors or pytorch_model.bin; re-save the Dense module")


def _load_dense(path: Path, dense: dict[str, Any], allow_bin: bool = True, width: int | None = None):
    """A Dense module as (Linear, activation); ``width``: what the module before it outputs. Its weights are read
    first and held to its config (a 60-byte config declaring 30000 x 30000 had torch allocate 3.6 GB before the
    file's 16 x 32 weights were found not to fit)."""
    import torch

    file = dense_weights_file(path, dense, allow_bin)
    where = Path(path) / dense["path"]
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged file, a pickle of more than tensors: weights_error says which
        raise weights_error(where, exc) from None
    state = {k.removeprefix("linear."): v for k, v in state.items()} if isinstance(state, dict) else {}
    out_f, in_f = dense["out_features"], dense["in_features"]
    want = {"weight": (out_f, in_f), **({"bias": (out_f,)} if dense["bias"] else {})}
    got = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    if got != want:
        said = ", ".join(f"{k} {list(v) if v is not None else 'not a tensor'}" for k, v in got.items()) or "nothing"
        raise UserError(f"{file}: the Dense weights hold {said:.200}, not those its config.json declares "
                        f"({', '.join(f'{k} {list(v)}' for k, v in want.items())}); re-save the Dense module")
    if width is not None and in_f != width:
        raise UserError(f"{where / 'config.json'}: 'in_features' is {in_f}, but the module before it outputs "
                        f"{width} values; re-save the sentence-transformers model")
    linear = torch.nn.Linear(in_f, out_f, bias=dense["bias"])
    linear.load_state_dict(state)
    act = {"identity": torch.nn.Identity(), "tanh": torch.nn.Tanh(), "relu": torch.nn.ReLU(),
           "gelu": torch.nn.GELU(), "sigmoid": torch.nn.Sigmoid(), "silu": torch.nn.SiLU()}[dense["activation"]]
    return torch.nn.Sequential(linear, act).eval()


def pool(hidden, attention_mask, mode: str):
    """sentence-transformers' Pooling, written so the TorchScript exporter traces it (right padding)."""
    import torch

    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, -1e9).max(1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        count = mask.sum(1).clamp(min=1e-9)
        return (hidden * mask).sum(1) / (count if mode == "mean" else torch.sqrt(count))
    if mode == "weightedmean":
        weights = torch.cumsum(torch.ones_like(attention_mask), 1).unsqueeze(-1).to(hidden.dtype) * mask
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    if mode == "lasttoken":
        last = (attention_mask.sum(1) - 1).clamp(min=0)
        index = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return torch.gather(hidden * mask, 1, index).squeeze(1)
    raise ValueError(mode)


def build_encoder_module(path: Path, info: dict[str, Any], pooling: str | list | None):
    """The model plus its head and pipeline as one module: (the family's inputs, in order) -> outputs."""
    torch = require("torch", "torch", "Hugging Face models")
    model = load_torch_model(path, info)
    family = family_by_name(info.get("family"))
    input_names = family.input_names({"type_vocab_size": info.get("type_vocab_size", 2)})
    task = canonical_task(info.get("task"))
    pipeline = build_sentence_pipeline(path, info, pooling) if task == "embedding" and pooling else None
    sparse = build_sparse_pipeline(info) if task == "sparse-embedding" else None

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.pipeline = pipeline
            self.sparse = sparse

        def forward(self, *inputs):
            feeds = dict(zip(input_names, inputs))
            out = self.model(**feeds)
            if task in ("classification", "rerank", "token-classification"):
                return (out.logits,)
            if task == "sparse-embedding":
                return (self.sparse(out.logits, feeds["attention_mask"]),)
            hidden = out.last_hidden_state
            if self.pipeline is None:
                return (hidden,)
            return hidden, self.pipeline(hidden, feeds["attention_mask"])

    # the wrapper must be in eval mode too: the exporter restores its training flag on every submodule
    return Encoder().eval()


def build_sparse_pipeline(info: dict[str, Any]):
    """SPLADE's pooling (sentence-transformers' SpladePooling) as a module: (masked-LM logits, attention mask) ->
    per-vocabulary weights: max (or sum) over real tokens of log(1 + relu(logits)) (log1p twice for
    ``log1p_relu``)."""
    torch = require("torch", "torch", "SPLADE pipelines")
    twice = info.get("sparse_activation") == "log1p_relu"
    summed = info.get("sparse_pooling") == "sum"

    class SparsePipeline(torch.nn.Module):
        def forward(self, logits, attention_mask):
            mask = attention_mask.unsqueeze(-1).to(logits.dtype)
            scores = torch.log1p(torch.relu(logits * mask))
            if twice:
                scores = torch.log1p(scores)
            return scores.sum(1) if summed else scores.max(1).values

    return SparsePipeline().eval()


def build_sentence_pipeline(path: Path, info: dict[str, Any], pooling: str | list, allow_bin: bool = True):
    """sentence-transformers' modules after the Transformer as one module: (token states, attention mask) ->
    sentence embedding: the Pooling mode(s) (several are concatenated), each Dense with its activation, and
    Normalize when ``info["normalize"]``. The Hugging Face export traces it behind the model; an imported ONNX
    file gets it appended (``sources.onnx_pipeline``)."""
    torch = require("torch", "torch", "sentence-transformers pipelines")
    modes = [pooling] if isinstance(pooling, str) else list(pooling)
    width = info["hidden_size"] * len(modes) if isinstance(info.get("hidden_size"), int) else None
    loaded = []
    for dense in info.get("dense") or []:
        loaded.append(_load_dense(Path(path), dense, allow_bin, width))
        width = dense["out_features"]
    denses = torch.nn.ModuleList(loaded)
    normalize = bool(info.get("normalize"))

    class SentencePipeline(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.denses = denses

        def forward(self, hidden, attention_mask):
            pooled = torch.cat([pool(hidden, attention_mask, m) for m in modes], dim=-1) if len(modes) > 1 \
                else pool(hidden, attention_mask, modes[0])
            for dense in self.denses:
                pooled = dense(pooled)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
            return pooled

    return SentencePipeline().eval()


def input_specs(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The inputs the exported graph takes (the family's, less token_type_ids where it has no segment table)."""
    family = family_by_name(info.get("family"))
    return family.input_specs({"type_vocab_size": info.get("type_vocab_size", 2)})


def output_specs(info: dict[str, Any], pooling: str | list | None) -> list[dict[str, Any]]:
    """The contract's outputs for the task (each with its kind); the primary output is the last."""
    task = canonical_task(info.get("task"))
    name, kind = task_spec(task).output, task_spec(task).output_kind
    if task in ("classification", "rerank"):
        return [{"name": name, "dtype": "float32", "shape": ["batch", 1 if task == "rerank" else info["num_labels"]],
                 "kind": kind}]
    if task == "token-classification":
        return [{"name": name, "dtype": "float32", "shape": ["batch", "sequence", info["num_labels"]], "kind": kind}]
    if task == "sparse-embedding":
        return [{"name": name, "dtype": "float32", "shape": ["batch", info["vocab_size"]], "kind": kind}]
    hidden = info["hidden_size"]
    specs = [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", hidden],
              "kind": "token"}]
    if pooling is not None:
        dim = info["dense"][-1]["out_features"] if info.get("dense") else \
            hidden * (len(pooling) if isinstance(pooling, list) else 1)
        specs.append({"name": name, "dtype": "float32", "shape": ["batch", dim], "kind": kind,
                      "pooling": pooling, "normalized": bool(info.get("normalize"))})
    return specs


# the inputs of a BERT (kept for code written before families: TensorFlow sources)
INPUT_SPECS = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
]


def hf_model_handle(path: Path, *, bf16: bool = False, pooling: str | list | None = "auto",
                    task: str | None = None) -> ModelHandle:
    """The Hugging Face model in ``path`` (with its task head and pooling) as a handle the ``pytorch`` runtime
    runs: the module is built here, its tokenizer is the folder's ``tokenizer.json`` (or one built from the slow
    tokenizer files in a scratch folder)."""
    from bertopt.output_paths import process_scratch

    path = Path(path)
    info = read_model_info(path, task=task)
    pool_mode = resolve_pooling(info, pooling)
    module = build_encoder_module(path, info, pool_mode)
    outputs = output_specs(info, pool_mode)
    info = {**info, "primary_output": outputs[-1]["name"]}
    tok_dir = path
    if not (path / "tokenizer.json").exists():  # build one from the slow-tokenizer files, in a scratch folder
        tok_dir = process_scratch("tok")
        copy_tokenizer(path, tok_dir, family=info["family"])
    return ModelHandle(model_format="pytorch", inputs=tuple(input_specs(info)), outputs=tuple(outputs),
                       tokenizer_path=tok_dir, model_info=info, path=path, digest=f"pytorch:{path}", module=module,
                       runtime_options={"bf16": bf16})


def hf_reference(path: Path, *, threads: int | None = None, bf16: bool = False, max_seq_len: int | None = None,
                 batch_size: int = 32, pooling: str | list | None = "auto", length_bucketing: bool = True,
                 task: str | None = None):
    """A Predictor running the original Hugging Face model (with its task head) in PyTorch."""
    from bertopt.runtime import Predictor

    return Predictor(hf_model_handle(path, bf16=bf16, pooling=pooling, task=task), threads=threads,
                     max_seq_len=max_seq_len, batch_size=batch_size, length_bucketing=length_bucketing)


def resolve_pooling(info: dict[str, Any], pooling: str | list | None) -> str | list | None:
    if canonical_task(info.get("task")) != "embedding":
        return None
    if pooling in (None, "none"):
        return None
    if pooling == "auto":
        return info.get("pooling") or "mean"
    if pooling not in POOLING_MODES:
        raise UserError(f"unknown pooling '{pooling}'; choose auto, none or one of {', '.join(POOLING_MODES)}")
    return pooling
