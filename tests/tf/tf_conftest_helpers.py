"""Importable helpers of the TF tests (conftest modules all share the name ``conftest`` and cannot be imported)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "the", "a", "is", "of", "and", "to", "in", "it", "hello", "world", "cat", "dog", "sat", "on", "mat", "run",
    "fast", "slow", "good", "bad", "model", "bert", "text", "##s", "##ing", "##ed", ".", ",", "!", "?", "0", "1",
    "2", "3"]

GOOGLE_CONFIG = {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                 "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                 "max_position_embeddings": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "type_vocab_size": 2, "vocab_size": len(TINY_VOCAB)}


def write_google_checkpoint(folder: Path, weights: dict[str, np.ndarray], config: dict) -> Path:
    """A TF1 name-based checkpoint like Google's releases: bert_model.ckpt.{index,data-*}, bert_config.json,
    vocab.txt. Written with SaveV2, so the variable names are exactly the given ones."""
    import tensorflow as tf

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    tf.raw_ops.SaveV2(prefix=str(folder / "bert_model.ckpt"), tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(weights[n]) for n in names])
    (folder / "bert_config.json").write_text(json.dumps(config))
    (folder / "vocab.txt").write_text("\n".join(TINY_VOCAB) + "\n")
    return folder
