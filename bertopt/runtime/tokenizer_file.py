"""A model's ``tokenizer.json``: user input that runs on every text, read here for every export, artifact load,
serve worker and HTTP front end (``read_tokenizer_json``).

Its JSON is checked before the tokenizers library builds anything: patterns that nest quantifiers (they backtrack
until the regex engine panics), normalizers that lengthen text (``normalizer_growth``: a 2 KB file of Replace steps
made each character 100,000), SentencePiece character maps that are not (a malformed trie size made the library
allocate 8.6 GB and abort the process). The tokenizer it returns (``GuardedTokenizer``) turns what the Rust
library raises on a text -- a panic, a BaseException no ``except Exception`` sees, or the plain ``Exception`` of a
word without an unknown token -- into a UserError naming it (``TokenizerFailure``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bertopt.artifact import read_regular_file
from bertopt.errors import UserError

# tokenizer.json files run to tens of megabytes (large multilingual vocabularies); far larger is not one
MAX_TOKENIZER_BYTES = 512 << 20
# how many times longer a tokenizer's normalizer may make a text: Unicode normalisation and the Replace steps real
# tokenizers carry (spaces to "▁", runs of spaces to one) stay near 1; five Replace steps each turning a character
# into ten made every character 100,000 (a 2 KB tokenizer.json: 200 s and 4.5 GB for export's check texts)
MAX_NORMALIZER_GROWTH = 64
# the tokenizers library's JSON reader stops at 128 levels; a real tokenizer.json nests a handful (the growth bound
# walks its Sequences by recursion, which a file nested 950 deep would exhaust)
MAX_TOKENIZER_DEPTH = 128


class GuardedTokenizer:
    """A ``tokenizers.Tokenizer`` whose Rust panics (a pattern that exceeds the regex engine's limits on some text:
    ``pyo3_runtime.PanicException``, a BaseException no ``except Exception`` sees) are a UserError naming the
    texts, so a request gets an error reply and a command one line, not a traceback or a dead server."""

    __slots__ = ("_tok",)

    def __init__(self, tok):
        object.__setattr__(self, "_tok", tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *args, **kwargs):
        return _unpanicked(self._tok.encode, args, kwargs)

    def encode_batch(self, *args, **kwargs):
        return _unpanicked(self._tok.encode_batch, args, kwargs)


def _unpanicked(method, args, kwargs):
    try:
        return method(*args, **kwargs)
    except BaseException as exc:
        if not _tokenizer_failure(exc):
            raise
        raise TokenizerFailure(" ".join(str(exc).split())[:200]) from None


class TokenizerFailure(UserError):
    """The tokenizers library could not encode a text; ``reason`` is its own words."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the model's tokenizer cannot encode this text ({reason}): its tokenizer.json holds a "
                         "pattern, normalizer or vocabulary that cannot handle it (an unknown token without an "
                         "unk token?); re-export the model with its original tokenizer")


def _tokenizer_failure(exc: BaseException) -> bool:
    """A Rust panic (``pyo3_runtime.PanicException``, a BaseException) or the plain ``Exception`` the tokenizers
    library raises for what its model cannot do (an unknown token and no unk token to stand for it)."""
    return type(exc).__name__ == "PanicException" or type(exc) is Exception


def is_library_error(exc: BaseException) -> bool:
    """Any error a tokenizer library raises on a file it cannot read: an Exception or a Rust panic (not an
    interrupt or an exit, which pass on)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


# a group holding a quantifier, itself quantified ("(a+)+"): the regex engine backtracks exponentially on a text that
# almost matches, until it gives up (its retry limit) by panicking: 0.25 s of CPU a text, then a failed request
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*[*+}](?:[^()\\]|\\.)*\)[*+{]")


def backtracking_patterns(spec: Any) -> list[str]:
    """The regular expressions of a tokenizer.json (normalizer Replace, pre-tokenizer Split) that nest quantifiers."""
    found, stack = [], [spec]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            regex = item.get("Regex")
            if isinstance(regex, str) and _NESTED_QUANTIFIER.search(regex):
                found.append(regex)
            stack.extend(v for k, v in item.items() if k != "model")  # the vocabulary holds no patterns
        elif isinstance(item, list):
            stack.extend(item)
    return found


# how much longer each normalizer step can make one character (measured over every code point with the tokenizers
# library); the Unicode forms map a character to its normal form, and a normal form normalises to itself, so a run
# of them (and one SentencePiece charsmap after them: ALBERT's NFKD, Lowercase, Precompiled) counts once, at its
# largest, where a Replace or a Prepend between them multiplies (a growth-1 Replace of a letter by U+FDFA before
# each of six NFKC steps made a character 66,000)
_UNICODE_FORM_GROWTH = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 2, "StripAccents": 1, "Strip": 1,
                        "Nmt": 1}
# steps that are no normal form: BertNormalizer puts spaces around each CJK character again on every pass (2,000 of
# them made one character 16,004); ByteLevel writes a character per UTF-8 byte
_FIXED_STEP_GROWTH = {"ByteLevel": 4, "BertNormalizer": 3}
CHARSMAP_FORM_GROWTH = 18  # a real charsmap (nmt_nfkc, nfkc_cf) is NFKC with extras: at most 18 (U+FDFA)


class _Growth:
    """The bound of normalizer_growth, and whether a run pairs Unicode forms with a charsmap after them (a claim
    that a charsmap is a normal form, which read_tokenizer_json then measures character by character)."""

    def __init__(self):
        self.total, self.run, self.run_has_map, self.run_has_form, self.to_measure = 1.0, 1.0, False, False, False

    def close_run(self):
        self.total *= self.run
        self.run, self.run_has_map, self.run_has_form = 1.0, False, False

    def multiply(self, factor: float):
        self.close_run()
        self.total *= max(1.0, factor)

    def step(self, spec: Any, where: str):
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "Sequence":
            steps = spec.get("normalizers")
            for item in steps if isinstance(steps, list) else []:
                self.step(item, where)
        elif kind in _UNICODE_FORM_GROWTH:
            factor = _UNICODE_FORM_GROWTH[kind]
            if self.run_has_map and factor > 1:  # a form after a charsmap expands what the charsmap wrote
                self.close_run()
            self.run = max(self.run, factor)
            self.run_has_form = self.run_has_form or factor > 1
        elif kind == "Precompiled":
            factor = charsmap_growth(spec, where)
            if factor > CHARSMAP_FORM_GROWTH or self.run_has_map:
                self.multiply(factor)
            else:
                self.to_measure = self.to_measure or self.run_has_form
                self.run, self.run_has_map = max(self.run, factor), True
        elif kind == "Replace":
            pattern = spec.get("pattern") or {}
            matched = len(pattern.get("String") or "") if isinstance(pattern, dict) else 0
            content = len(str(spec.get("content") or ""))
            # a pattern that matches the empty string inserts the content between every two characters: fourteen
            # Replace("" -> "a") steps doubled a text fourteen times
            empty = not matched and (not isinstance(pattern, dict) or _matches_empty(pattern.get("Regex")))
            self.multiply(1 + content if empty else content / max(1, matched))
        elif kind == "Prepend":
            self.multiply(1 + len(str(spec.get("prepend") or "")))  # on a one-character text
        elif kind is not None:
            self.multiply(_FIXED_STEP_GROWTH.get(kind, 1))


# what a pattern is tried on for an empty match: every printable ASCII character, spaces and line ends, letters of
# other scripts, and the pattern's own characters (a lookahead names what it looks for)
_EMPTY_MATCH_PROBE = ("".join(map(chr, range(0x20, 0x7F)))
                      + "\t\n\r\u00a0\u3000\u2581\u00e9\u00df\u0430\u05d0\u0644\u65e5\u672c")


def _matches_empty(regex: Any) -> bool:
    """Whether a Replace step's regex can match the empty string, judged by Python's engine on a probe (the
    tokenizers library's Oniguruma reads nearly the same syntax); a pattern Python cannot read counts as one
    that can."""
    if not isinstance(regex, str):
        return True
    try:
        pattern = re.compile(regex)
    except (re.error, RecursionError, OverflowError):
        return True
    probe = _EMPTY_MATCH_PROBE + regex
    return any(m.start() == m.end() for text in ("", probe, probe[::-1]) for m in pattern.finditer(text))


def charsmap_growth(spec: dict, where: str) -> float:
    """A Precompiled step's charsmap checked as bytes before the tokenizers library reads it (a malformed trie
    size made it allocate 8.6 GB, then abort the process), and how much longer it can make a text."""
    import base64
    import binascii

    from bertopt.untrusted import precompiled_charsmap_growth

    try:
        return precompiled_charsmap_growth(base64.b64decode(str(spec.get("precompiled_charsmap") or ""),
                                                            validate=True))
    except (ValueError, binascii.Error) as exc:
        raise UserError(f"{where}: its normalizer's precompiled_charsmap is not a SentencePiece character map "
                        f"({exc}); save the tokenizer again with the model (tokenizer.save_pretrained)") from None


def normalizer_growth(spec: Any, where: str = "tokenizer.json") -> float:
    """How many times longer a tokenizer.json's ``normalizer`` can make a text, at most: Replace steps their
    content over the shortest match, a Prepend its text, a charsmap its longest replacement, the Unicode forms
    what they reach on one code point; steps multiply, except a run of Unicode forms (``_UNICODE_FORM_GROWTH``)."""
    return _growth_of(spec, where).total


# pre-tokenizers that lengthen what they split: ByteLevel writes a character per UTF-8 byte (sixteen ByteLevel steps
# made a CJK character 98,304 and aborted the process on a 3,000-character text); Metaspace adds a "▁" before a word
_PRE_TOKENIZER_GROWTH = {"ByteLevel": 4, "Metaspace": 2}


def _times(growth: float) -> str:
    return f"{growth:,.0f}" if growth < 1e15 else "over 10^15"


def pre_tokenizer_growth(spec: Any) -> float:
    """How many times longer a tokenizer.json's ``pre_tokenizer`` can make a text, at most (its steps multiply)."""
    if not isinstance(spec, dict):
        return 1.0
    if spec.get("type") == "Sequence":
        growth = 1.0
        steps = spec.get("pretokenizers")
        for step in steps if isinstance(steps, list) else []:
            growth *= pre_tokenizer_growth(step)
        return growth
    return float(_PRE_TOKENIZER_GROWTH.get(spec.get("type"), 1))


def _growth_of(spec: Any, where: str) -> _Growth:
    growth = _Growth()
    growth.step(spec, where)
    growth.close_run()
    return growth


def _measured_growth(tok) -> tuple[float, str]:
    """The normalizer run on each code point of the Basic Multilingual Plane alone: the most it lengthened one,
    stopping at the first over the bound."""
    normalize = tok.normalizer.normalize_str
    worst = (1.0, "")
    for code in range(0x20, 0x10000):
        if 0xD800 <= code < 0xE000:
            continue
        grown = len(_unpanicked(normalize, (chr(code),), {}))
        if grown > worst[0]:
            worst = (float(grown), chr(code))
            if grown > MAX_NORMALIZER_GROWTH:
                break
    return worst


def read_tokenizer_json(file: Path, shown_as: Path | None = None):
    """A ``tokenizers.Tokenizer`` from ``file``: a regular file (no symlink, FIFO or device: nothing hangs) read
    once and parsed from what was read; a file that is not a tokenizer is one UserError naming it (as
    ``shown_as``: the user's file this one is a copy of) and the fix. Its JSON is checked before the tokenizers
    library builds it: patterns that backtrack, normalizers that lengthen text, character maps that are not."""
    import json

    from tokenizers import Tokenizer

    file = Path(file)
    shown = shown_as or file
    fix = "save the tokenizer again with the model (tokenizer.save_pretrained) or re-create the artifact"
    data = read_regular_file(file, max_bytes=MAX_TOKENIZER_BYTES, fix=fix, shown_as=shown,
                             too_large="too large for a tokenizer")
    from bertopt.untrusted import json_depth

    if json_depth(data, stop_above=MAX_TOKENIZER_DEPTH) > MAX_TOKENIZER_DEPTH:
        raise UserError(f"{shown} nests lists or objects more than {MAX_TOKENIZER_DEPTH} levels deep, deeper than the "
                        f"tokenizers library reads; {fix}")
    try:
        text = data.decode("utf-8")
        spec = json.loads(text)
    except UnicodeDecodeError:
        raise UserError(f"{shown} is not UTF-8 text, so not a tokenizer.json; {fix}") from None
    except (ValueError, RecursionError) as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise UserError(f"{shown} is not a tokenizer.json ({reason}); {fix}") from None
    if not isinstance(spec, dict):
        raise UserError(f"{shown} holds a JSON {type(spec).__name__}, not a tokenizer; {fix}")
    nested = backtracking_patterns({k: spec.get(k) for k in ("normalizer", "pre_tokenizer")})
    if nested:
        raise UserError(f"{shown}: its pattern {nested[0]!r:.80} nests quantifiers (a repeated group that itself "
                        "repeats), which backtracks without end on some texts; write the pattern without nesting, "
                        f"or {fix}")
    growth = _growth_of(spec.get("normalizer"), str(shown))
    if growth.total > MAX_NORMALIZER_GROWTH:
        raise UserError(f"{shown}: its normalizer can make a text {_times(growth.total)} times longer (steps that "
                        f"lengthen what they match), more than the {MAX_NORMALIZER_GROWTH} a tokenizer needs; {fix}")
    total = growth.total * pre_tokenizer_growth(spec.get("pre_tokenizer"))
    if total > MAX_NORMALIZER_GROWTH:
        raise UserError(f"{shown}: its normalizer and pre-tokenizer can make a text {_times(total)} times longer "
                        f"(ByteLevel steps write a character per byte), more than the {MAX_NORMALIZER_GROWTH} a "
                        f"tokenizer needs; {fix}")
    try:
        tok = Tokenizer.from_str(text)
    except BaseException as exc:  # plain Exception for a file it cannot read; a Rust panic for some
        if not is_library_error(exc):
            raise
        reason = " ".join(str(exc).split())[:160]
        raise UserError(f"{shown} is not a tokenizer the tokenizers library can read ({reason}); {fix}") from None
    if growth.to_measure:
        measured, char = _measured_growth(tok)
        if measured > MAX_NORMALIZER_GROWTH:
            raise UserError(f"{shown}: its normalizer makes the character U+{ord(char):04X} {measured:,.0f} "
                            f"characters long, more than the {MAX_NORMALIZER_GROWTH} a tokenizer needs; {fix}")
    return GuardedTokenizer(tok)


def read_tokenizer_json_str(text: str):
    """A copy of a tokenizer already read (``Tokenizer.to_str()``), to set other truncation on."""
    from tokenizers import Tokenizer

    return GuardedTokenizer(Tokenizer.from_str(text))
