"""Text shipped with bertopt: the validation corpus, calibration text and mixed-length English."""

from __future__ import annotations

from importlib import resources


def _lines(name: str) -> list[str]:
    text = resources.files("bertopt.data").joinpath(name).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's final newline, not an entry
    return lines


def corpus() -> list[str]:
    """The built-in validation corpus: varied sentences, long ones, non-English, emoji and one empty line."""
    return _lines("corpus.txt")


def calibration_texts() -> list[str]:
    """Calibration text for static int8 (disjoint from the validation corpus)."""
    return _lines("calibration.txt")


def mixed_text() -> list[str]:
    """Mixed-length English text, one sentence to a paragraph, for throughput measurements."""
    return _lines("mixed_text.txt")
