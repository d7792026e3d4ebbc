"""Models bertopt cannot serve are refused before any work: one line naming the problem and the fix, exit 2,
nothing written."""

from __future__ import annotations

import shutil

import pytest

from bertopt.families import supported_model_types
from bertopt.tiny_models import build_tiny_family_model


def _tiny_decoder(path, kind):
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        model = transformers.T5ForConditionalGeneration(config)
    model.save_pretrained(path)
    return path


def _one_line_refusal(code, err, out_dir):
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert not out_dir.exists() and not list(out_dir.parent.glob(f".{out_dir.name}*"))
    return lines[0]


@pytest.mark.parametrize("kind,arch", [("gpt2", "GPT2LMHeadModel"), ("t5", "T5ForConditionalGeneration")])
def test_unsupported_architecture_is_refused_naming_the_families(kind, arch, tmp_path, cli, capsys):
    folder = _tiny_decoder(tmp_path / kind, kind)
    capsys.readouterr()
    code, _, err = cli("export", folder, "--out", tmp_path / "out")
    line = _one_line_refusal(code, err, tmp_path / "out")
    assert f"is a {kind} model ({arch})" in line
    for model_type in supported_model_types():
        assert model_type in line


def test_task_the_head_does_not_have(tmp_path, cli, capsys):
    hf = build_tiny_family_model(tmp_path / "hf", "roberta", "classification")
    capsys.readouterr()
    for task in ("token-classification", "sparse-embedding"):
        code, _, err = cli("export", hf, "--out", tmp_path / "out", "--task", task)
        line = _one_line_refusal(code, err, tmp_path / "out")
        assert f"has no {task} head" in line and "RobertaForSequenceClassification" in line
        assert "this model can do: embedding, classification, rerank" in line


def test_tokenizer_larger_than_the_embedding_table(tmp_path, cli, capsys):
    import json

    small = build_tiny_family_model(tmp_path / "small", "bert", vocab_size=300)
    big = build_tiny_family_model(tmp_path / "big", "bert", vocab_size=800)
    shutil.copy2(big / "tokenizer.json", small / "tokenizer.json")
    rows = json.loads((small / "config.json").read_text())["vocab_size"]
    assert rows < 800
    capsys.readouterr()
    code, _, err = cli("export", small, "--out", tmp_path / "out")
    line = _one_line_refusal(code, err, tmp_path / "out")
    # its largest id named (a count within the table can still hold an id past it)
    assert "the tokenizer" in line and "the id 799" in line and f"{rows} rows (ids 0-{rows - 1})" in line


def test_missing_tokenizer_names_the_files_the_family_builds_from(tmp_path, cli, capsys):
    hf = build_tiny_family_model(tmp_path / "hf", "roberta")
    (hf / "tokenizer.json").unlink()
    capsys.readouterr()
    code, _, err = cli("export", hf, "--out", tmp_path / "out")
    line = _one_line_refusal(code, err, tmp_path / "out")
    assert "no tokenizer.json" in line and "vocab.json + merges.txt" in line
