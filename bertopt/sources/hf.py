"""Hugging Face model folders: metadata, the PyTorch model with pooling, and the PyTorch reference (run by the
``pytorch`` runtime backend).

Weights load through transformers' safetensors path (or ``torch.load(weights_only=True)`` for
``pytorch_model.bin``); nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bertopt.errors import UserError, require

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def read_model_info(path: Path) -> dict[str, Any]:
    """Architecture, task and pooling of a Hugging Face (optionally sentence-transformers) folder."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path / 'config.json'}: {exc}; is this a Hugging Face model folder?") from None
    archs = config.get("architectures") or []
    task = "classifier" if any(a.endswith("ForSequenceClassification") for a in archs) else "encoder"
    info: dict[str, Any] = {
        "model_type": config.get("model_type", "bert"),
        "hidden_size": config.get("hidden_size"),
        "num_attention_heads": config.get("num_attention_heads"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "intermediate_size": config.get("intermediate_size"),
        "max_position_embeddings": config.get("max_position_embeddings", 512),
        "vocab_size": config.get("vocab_size"),
        "task": task,
        "pooling": None,
        "normalize": False,
    }
    if task == "classifier":
        info["num_labels"] = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        info["id2label"] = config.get("id2label")
    modules_file = path / "modules.json"
    if modules_file.exists():
        modules = json.loads(modules_file.read_text())
        info["task"] = "sentence-embedding"
        for module in modules:
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                pool_cfg = json.loads((path / module["path"] / "config.json").read_text())
                if pool_cfg.get("pooling_mode_mean_tokens"):
                    info["pooling"] = "mean"
                elif pool_cfg.get("pooling_mode_cls_token"):
                    info["pooling"] = "cls"
                elif pool_cfg.get("pooling_mode_max_tokens"):
                    info["pooling"] = "max"
                else:
                    raise UserError(f"{path}: unsupported sentence-transformers pooling {pool_cfg}; "
                                    "bertopt supports mean, cls and max pooling")
            elif kind.endswith("Normalize"):
                info["normalize"] = True
            elif kind.endswith("Dense"):
                raise UserError(f"{path}: sentence-transformers Dense modules are not supported yet; "
                                "export the transformer alone with --pooling mean")
        st_cfg = path / "sentence_bert_config.json"
        if st_cfg.exists():
            info["max_seq_len"] = json.loads(st_cfg.read_text()).get("max_seq_length")
    return info


def copy_tokenizer(src: Path, dest: Path) -> None:
    """Copy tokenizer files, building ``tokenizer.json`` from ``vocab.txt`` when the folder has none."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    if not (dest / "tokenizer.json").exists():
        if not (src / "vocab.txt").exists():
            raise UserError(f"{src} has neither tokenizer.json nor vocab.txt; save the tokenizer with the model")
        lower = True
        cfg_file = src / "tokenizer_config.json"
        if cfg_file.exists():
            lower = json.loads(cfg_file.read_text()).get("do_lower_case", True)
        build_wordpiece_tokenizer(src / "vocab.txt", lower).save(str(dest / "tokenizer.json"))


def build_wordpiece_tokenizer(vocab_file: Path, lowercase: bool):
    from tokenizers.implementations import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(vocab_file), lowercase=lowercase)._tokenizer


def load_torch_model(path: Path, info: dict[str, Any]):
    torch = require("torch", "torch", "Hugging Face models")
    transformers = require("transformers", "torch", "Hugging Face models")
    cls = transformers.AutoModelForSequenceClassification if info["task"] == "classifier" else transformers.AutoModel
    # bertopt shows its own progress; transformers' per-load bars and advisories only add noise
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        # eager attention exports to the graph ONNX Runtime's BERT fusions recognise (SDPA does not fuse)
        model = cls.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the model in {path}: {str(exc).splitlines()[0]}") from None
    return model.eval()


def build_encoder_module(path: Path, info: dict[str, Any], pooling: str | None):
    """The model plus pooling (and normalisation) as one module: (ids, mask, types) -> outputs."""
    torch = require("torch", "torch", "Hugging Face models")
    model = load_torch_model(path, info)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            if info["task"] == "classifier":
                return (out.logits,)
            hidden = out.last_hidden_state
            if pooling is None:
                return (hidden,)
            if pooling == "mean":
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            elif pooling == "cls":
                pooled = hidden[:, 0]
            elif pooling == "max":
                mask = attention_mask.unsqueeze(-1)
                pooled = hidden.masked_fill(mask == 0, -1e9).max(1).values
            else:
                raise ValueError(pooling)
            if info.get("normalize"):
                pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
            return hidden, pooled

    # the wrapper must be in eval mode too: the exporter restores its training flag on every submodule
    return Encoder().eval()


def output_specs(info: dict[str, Any], pooling: str | None) -> list[dict[str, Any]]:
    hidden = info["hidden_size"]
    if info["task"] == "classifier":
        return [{"name": "logits", "dtype": "float32", "shape": ["batch", info["num_labels"]], "kind": "logits"}]
    specs = [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", hidden],
              "kind": "token"}]
    if pooling is not None:
        specs.append({"name": "sentence_embedding", "dtype": "float32", "shape": ["batch", hidden],
                      "kind": "embedding", "pooling": pooling, "normalized": bool(info.get("normalize"))})
    return specs


INPUT_SPECS = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
]


class SourceModel:
    """What a Predictor needs to know about a model that is not (yet) an artifact."""

    def __init__(self, path: Path, tokenizer_path: Path, inputs, outputs, model_info, label: str, module=None,
                 runtime_options: dict[str, Any] | None = None):
        self.path = path
        self.tokenizer_path = tokenizer_path
        self.inputs = inputs
        self.outputs = outputs
        self.model_info = model_info
        self.digest = label
        self.precision = "fp32"
        self.model_format = "pytorch"
        self.runtime = "pytorch"
        self.module = module  # the torch module the ``pytorch`` runtime backend runs
        self.manifest = {"runtime_options": dict(runtime_options or {})}


def hf_reference(path: Path, *, threads: int | None = None, bf16: bool = False, max_seq_len: int | None = None,
                 batch_size: int = 32, pooling: str | None = "auto", length_bucketing: bool = True):
    """A Predictor running the original Hugging Face model in PyTorch."""
    import tempfile

    from bertopt.runtime import Predictor

    info = read_model_info(path)
    pool = resolve_pooling(info, pooling)
    module = build_encoder_module(path, info, pool)
    outputs = output_specs(info, pool)
    info = {**info, "primary_output": outputs[-1]["name"]}
    tok_dir = path
    if not (path / "tokenizer.json").exists():  # build one from vocab.txt, in a scratch folder
        tok_dir = Path(tempfile.mkdtemp(prefix="bertopt-tok-"))
        copy_tokenizer(path, tok_dir)
    spec = SourceModel(path, tok_dir, INPUT_SPECS, outputs, info, label=f"pytorch:{path}", module=module,
                       runtime_options={"bf16": bf16})
    return Predictor(spec, threads=threads, max_seq_len=max_seq_len, batch_size=batch_size,
                     length_bucketing=length_bucketing)


def resolve_pooling(info: dict[str, Any], pooling: str | None) -> str | None:
    if info["task"] == "classifier":
        return None
    if pooling in (None, "none"):
        return None
    if pooling == "auto":
        return info.get("pooling") or "mean"
    if pooling not in ("mean", "cls", "max"):
        raise UserError(f"unknown pooling '{pooling}'; choose auto, mean, cls, max or none")
    return pooling
