"""Shared fixtures: tiny random BERTs built by the tests themselves, and the real MiniLM.

Fixtures that build models are session-scoped: a tiny BERT exports in a couple of seconds, MiniLM in ~10.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny sentence-transformers-style BERT (mean pooling + normalise)."""
    return build_tiny_hf_bert(tmp_path_factory.mktemp("tiny-hf") / "model", sentence_transformers=True)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_hf, tmp_path_factory):
    """The tiny BERT exported to an ONNX artifact."""
    from bertopt.registry import run_stage

    return run_stage("export", tiny_hf, {}, tmp_path_factory.mktemp("tiny-onnx") / "art")


@pytest.fixture(scope="session")
def minilm_onnx(tmp_path_factory):
    """The real all-MiniLM-L6-v2 exported to ONNX (shared by the slow tests)."""
    from bertopt.registry import run_stage

    return run_stage("export", "builtin:minilm", {}, tmp_path_factory.mktemp("minilm") / "onnx")


@pytest.fixture(scope="session")
def minilm_optimized(minilm_onnx, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("optimize", minilm_onnx, {}, tmp_path_factory.mktemp("minilm") / "optimized")


@pytest.fixture(scope="session")
def minilm_int8(minilm_optimized, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("quantize", minilm_optimized, {"mode": "int8-dynamic"}, tmp_path_factory.mktemp("minilm") / "int8")


def run_cli(args: list[str], capsys=None) -> tuple[int, str, str]:
    """Run the real CLI entry point in-process; returns (exit code, stdout, stderr)."""
    from bertopt.cli import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = ("", "")
    if capsys is not None:
        captured = capsys.readouterr()
        out, err = captured.out, captured.err
    return code, out, err


@pytest.fixture
def cli(capsys):
    return lambda *args: run_cli(list(args), capsys)


sys.path.insert(0, str(Path(__file__).parent))
