"""A folder saved without tokenizer.json: export builds one from the files the family's tokenizer is made of
(vocab.txt, vocab.json + merges.txt, a SentencePiece model), and it must tokenise exactly as the original."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from bertopt.data import corpus
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.tiny_models import build_tiny_family_model

TEXTS = corpus()[:40] + ["Ünïcödé and  double  spaces", "MiXeD CaSe, punctuation!?"]


def _ids(tok: Tokenizer, texts, pairs=None):
    inputs = list(zip(texts, pairs)) if pairs else list(texts)
    return [e.ids for e in tok.encode_batch(inputs)]


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_slow_tokenizer_files_become_the_same_tokenizer(family, tmp_path):
    fast = build_tiny_family_model(tmp_path / "fast", family)
    original = Tokenizer.from_file(str(fast / "tokenizer.json"))
    slow = tmp_path / "slow"
    shutil.copytree(fast, slow)
    (slow / "tokenizer.json").unlink()
    if family == "bert":  # the files a BERT folder is saved with by slow-tokenizer tools
        vocab = sorted(original.get_vocab().items(), key=lambda kv: kv[1])
        (slow / "vocab.txt").write_text("\n".join(t for t, _ in vocab) + "\n")
    else:
        original.model.save(str(slow))  # vocab.json + merges.txt
    art = run_stage("export", slow, {}, tmp_path / "art")
    built = Tokenizer.from_file(str(art.tokenizer_path / "tokenizer.json"))
    assert _ids(built, TEXTS) == _ids(original, TEXTS)
    assert _ids(built, TEXTS[:10], TEXTS[10:20]) == _ids(original, TEXTS[:10], TEXTS[10:20])  # pair template too
    # the same weights behind either tokenizer give the same embeddings
    reference = run_stage("export", fast, {}, tmp_path / "ref")
    np.testing.assert_allclose(Predictor(art).encode(TEXTS), Predictor(reference).encode(TEXTS), atol=1e-6)


def test_validating_against_a_slow_tokenizer_folder_leaves_no_scratch_behind(tmp_path, tmp_path_factory):
    """The PyTorch reference of a folder without tokenizer.json builds one in a scratch folder of the system temp
    dir: the real ``bertopt validate`` removes it when it exits."""
    fast = build_tiny_family_model(tmp_path / "fast", "bert")
    slow = tmp_path / "slow"
    shutil.copytree(fast, slow)
    original = Tokenizer.from_file(str(slow / "tokenizer.json"))
    (slow / "tokenizer.json").unlink()
    vocab = sorted(original.get_vocab().items(), key=lambda kv: kv[1])
    (slow / "vocab.txt").write_text("\n".join(t for t, _ in vocab) + "\n")
    art = run_stage("export", slow, {}, tmp_path / "art")
    temp = tmp_path_factory.mktemp("TMPDIR")
    env = {**os.environ, "TMPDIR": str(temp),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "validate", str(art.path), "--reference", str(slow),
                           "--report-dir", str(tmp_path / "report"), "--no-latency", "--max-texts", "16"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "report" / "validation.json").is_file()
    assert [p.name for p in temp.iterdir() if p.name.startswith("bertopt")] == []


def test_sentencepiece_model_converts_like_sentencepiece(tmp_path):
    """DeBERTa-v2 folders ship spm.model: the converted tokenizer.json gives SentencePiece's own pieces,
    between [CLS] and [SEP]."""
    import sentencepiece as spm

    model = build_tiny_family_model(tmp_path / "m", "deberta-v2")
    (model / "tokenizer.json").unlink()
    corpus_file = tmp_path / "train.txt"
    corpus_file.write_text("\n".join(corpus()) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus_file), model_prefix=str(tmp_path / "spm"), vocab_size=300,
                                   model_type="unigram", pad_id=0, unk_id=3, bos_id=1, eos_id=2,
                                   user_defined_symbols=["[MASK]"], pad_piece="[PAD]", unk_piece="[UNK]",
                                   bos_piece="[CLS]", eos_piece="[SEP]", minloglevel=2)
    (tmp_path / "spm.model").rename(model / "spm.model")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update({"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    art = run_stage("export", model, {}, tmp_path / "art")
    built = Tokenizer.from_file(str(art.tokenizer_path / "tokenizer.json"))
    processor = spm.SentencePieceProcessor(model_file=str(model / "spm.model"))
    expected = [[1] + processor.encode(t) + [2] for t in TEXTS]
    assert _ids(built, TEXTS) == expected
    assert max(max(ids) for ids in expected) < 300  # the model's table fits the tokenizer
