"""The tiny models the suite is built on are the same on every run: a seeded model with a pinned tokenizer
(the WordPiece and Unigram trainers break ties in hash-map order, so a fresh training differs run to run)."""

from __future__ import annotations

import hashlib

import pytest

from bertopt.tiny_models import (
    FAMILY_FIXTURES,
    PINNED_VOCAB_SIZES,
    _family_recipe,
    build_tiny_family_model,
    pinned_tokenizer_file,
)


def _digests(folder):
    return {f.relative_to(folder).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("family", ["distilbert", "deberta-v2"])  # WordPiece, Unigram
def test_two_builds_of_a_family_are_identical(family, tmp_path):
    first = build_tiny_family_model(tmp_path / "a", family)
    second = build_tiny_family_model(tmp_path / "b", family)
    assert _digests(first) == _digests(second)


def test_every_family_whose_trainer_is_not_reproducible_has_its_tokenizer_pinned():
    from tokenizers import Tokenizer

    for family in FAMILY_FIXTURES:
        kind, specials, pair_style, lowercase, _, _ = _family_recipe(family)
        for vocab_size in PINNED_VOCAB_SIZES[kind]:
            file = pinned_tokenizer_file(kind, specials, vocab_size, lowercase, pair_style)
            assert file.is_file(), f"{family}: no pinned tokenizer; run python -m bertopt.tiny_models"
            tok = Tokenizer.from_file(str(file))
            assert type(tok.model).__name__.lower() == kind  # WordPiece / Unigram
            assert [tok.token_to_id(t) for t in specials] == list(range(len(specials)))
