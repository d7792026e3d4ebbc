"""Long texts for the long-input tests: built-in corpus paragraphs joined to a given token count."""

from __future__ import annotations


def text_of(predictor, tokens: int) -> str:
    """Built-in corpus paragraphs joined until the text holds at least ``tokens`` tokens (special ones included)."""
    from bertopt.data import corpus

    full = predictor.untruncated_tokenizer()
    paragraphs = [t for t in corpus() if t]
    out, i = "", 0
    while len(full.encode(out).ids) < tokens:
        out += (" " if out else "") + paragraphs[i % len(paragraphs)]
        i += 1
    return out
