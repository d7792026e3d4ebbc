"""Helpers for tests of bertopt and of code built on it: tiny random BERTs and loopback/process utilities.

Kept in the package (not in a conftest.py) so any test can import it unambiguously.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "the", "a", "is", "of", "and", "to", "in", "it", "hello", "world", "cat", "dog", "sat", "on", "mat", "run",
    "fast", "slow", "good", "bad", "model", "bert", "text", "##s", "##ing", "##ed", ".", ",", "!", "?", "0", "1",
    "2", "3"]


def build_tiny_hf_bert(path: Path, *, sentence_transformers: bool = False, classifier: bool = False,
                       seed: int = 0, layers: int = 2, hidden: int = 32, heads: int = 4) -> Path:
    """A random BERT saved with save_pretrained (safetensors) plus a WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    vocab_file = path / "vocab.txt"
    vocab_file.write_text("\n".join(TINY_VOCAB) + "\n")
    config = BertConfig(vocab_size=len(TINY_VOCAB), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=hidden * 2, max_position_embeddings=64,
                        num_labels=3, initializer_range=0.2)
    model = (BertForSequenceClassification if classifier else BertModel)(config).eval()
    model.save_pretrained(path)
    BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=True).save_pretrained(path)
    # transformers 5 writes a tokenizer.json whose WordPiece vocabulary is empty (every word -> [UNK]);
    # write one built from vocab.txt so the tiny model sees real tokens
    from tokenizers.implementations import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(vocab_file), lowercase=True)._tokenizer.save(str(path / "tokenizer.json"))
    if sentence_transformers:
        import json

        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (a /proc scan; Linux)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name may contain spaces; fields after the closing parenthesis are fixed
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def batch_compositions(texts: list[str], seed: int = 0) -> list[list[int]]:
    """The same texts cut into other batches, as lists of indices into ``texts``: one at a time, in shuffled
    groups of 7 (other neighbours, other padding) and 32 at a time in order."""
    import random

    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    return ([[i] for i in range(len(texts))] + [order[s:s + 7] for s in range(0, len(order), 7)]
            + [list(range(s, min(s + 32, len(texts)))) for s in range(0, len(texts), 32)])
