"""Checks of untrusted input shared by every front end and the artifact loader; each caller refuses in its own
words (its limit, its fix).

* ``json_depth``: ``json.loads`` recurses once per nested array/object, so JSON nested 100,000 deep (a ZeroMQ or
  HTTP request, a Kafka message, an artifact's manifest) ends in RecursionError; its depth is measured first.
* ``text_list``: what a Python caller gives as texts, as a list (a generator read once; a dict refused).
* ``lone_surrogate``: a JSON ``\\ud800`` escape decodes to a lone surrogate, which is not a Unicode character and
  which no tokenizer encodes; it is found before tokenising.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from bertopt.errors import UserError

_SURROGATE = re.compile("[\ud800-\udfff]")

_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_SCAN_CHUNK = 1 << 22


def json_depth(data: bytes, stop_above: int | None = None) -> int:
    """How deep JSON arrays and objects nest in ``data`` (brackets inside strings do not count), without
    parsing it. Exact for valid JSON; for invalid JSON exact up to the first error, which is where json.loads
    stops too. Linear, in C/numpy passes over ``data`` (tens of ms per MB); stops once past ``stop_above``."""
    # after these two replacements no escaped quote is left, so every '"' opens or closes a string
    # (an escaped backslash first: in '\\"' the quote is not escaped)
    structure = data.replace(b"\\\\", b"__").replace(b'\\"', b"__").translate(None, _NOT_STRUCTURE)
    codes = np.frombuffer(structure, dtype=np.uint8)
    depth = deepest = 0
    in_string = 0
    for start in range(0, len(codes), _SCAN_CHUNK):
        chunk = codes[start:start + _SCAN_CHUNK]
        quote = (chunk == ord('"')).view(np.uint8)
        parity = np.bitwise_xor.accumulate(quote) ^ in_string  # 1 inside a string (and on its opening quote)
        in_string = int(parity[-1])
        outside = (parity == 0) & (quote == 0)
        step = ((chunk == ord("[")) | (chunk == ord("{"))).astype(np.int8) - ((chunk == ord("]")) | (chunk == ord("}")))
        levels = np.cumsum(np.where(outside, step, 0), dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def lone_surrogate(text: str) -> int | None:
    """The position of the first lone surrogate in ``text`` (not a Unicode scalar value), or None."""
    bad = _SURROGATE.search(text)
    return None if bad is None else bad.start()


def text_list(texts: Any, what: str = "texts") -> list[Any]:
    """The caller's texts as a list: one string is one text; a list, tuple or any other iterable (a generator
    is read once, here) gives its items; a mapping, set, bytes or non-iterable is refused (a dict's keys or a
    set's order are no list of texts)."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (bytes, bytearray, dict, set, frozenset)) or texts is None \
            or not hasattr(texts, "__iter__") or hasattr(texts, "keys"):
        raise UserError(f"{what} must be a string or a list of strings, got {type(texts).__name__}")
    return list(texts)
