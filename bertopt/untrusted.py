"""Checks of untrusted input shared by every front end and the artifact loader; each caller refuses in its own
words (its limit, its fix).

* ``json_depth``: ``json.loads`` recurses once per nested array/object, so JSON nested 100,000 deep (a ZeroMQ or
  HTTP request, a Kafka message, an artifact's manifest) ends in RecursionError; its depth is measured first.
* ``text_list``: what a Python caller gives as texts, as a list (a generator read once; a dict refused).
* ``lone_surrogate``: a JSON ``\\ud800`` escape decodes to a lone surrogate, which is not a Unicode character and
  which no tokenizer encodes; it is found before tokenising.
* ``read_user_file`` / ``load_yaml_bounded``: a small file the user names (a recipe, a fleet file) read as a regular
  file with a size bound (a FIFO or ``/dev/zero`` never hangs the reader), and YAML whose aliases could expand to
  billions of values ("billion laughs") measured before it is built.
* ``precompiled_charsmap_growth``: a SentencePiece normalizer's compiled character map (in a ``.model`` file or a
  tokenizer.json) read as bytes: its declared trie size fits the blob (the tokenizers library allocates what a
  malformed one declares, 8.6 GB, then aborts the process or panics), and how much longer it can make a text.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
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


YAML_MAX_NODES = 100_000  # scalars, lists and mappings after expanding every alias: a config is a few dozen
YAML_MAX_DEPTH = 64


def read_user_file(path: str | os.PathLike, *, max_bytes: int, what: str, fix: str, decode: bool = True) -> Any:
    """The UTF-8 text (the bytes, unless ``decode``) of a small file the user named (``what``: "recipe", "fleet
    file", "data file"): links are followed (the user chose the path), but only a regular file is read, opened
    without blocking (a FIFO would wait for a writer for ever, a device never end), and at most ``max_bytes``.
    Every problem is one UserError ending with ``fix``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not a {what}; {fix}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}; {fix}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"{path} is a folder, not a {what}; {fix}")
        if stat.S_ISREG(info.st_mode):  # refused by its size, before a byte is read
            raise UserError(f"{path} is larger than {_size(max_bytes)}, too large for a {what}; {fix}")
        raise UserError(f"{path} is not a regular file (a FIFO, socket or device), not a {what}; {fix}")
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(max_bytes + 1)  # a file that grows (or lies about its size, as /proc files do) stops here
    if len(raw) > max_bytes:
        raise UserError(f"{path} is larger than {_size(max_bytes)}, too large for a {what}; {fix}")
    if not decode:
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a UTF-8 text file, not a {what}; {fix}") from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def load_yaml_bounded(text: str, where: str, what: str = "a config") -> Any:
    """YAML with the safe loader, refusing before construction a document that expands (through aliases:
    "billion laughs") to more than YAML_MAX_NODES values, nests deeper than YAML_MAX_DEPTH, or refers to itself:
    each is one line naming ``where`` (``what`` says what the file should be: "a recipe"), never a MemoryError,
    a RecursionError or minutes of work."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expanded_size(node, where, what)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise UserError(f"{where} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise UserError(f"{where}: the YAML nests too deeply (more than {YAML_MAX_DEPTH} levels); {what} is a "
                        "few levels deep") from None


def _check_expanded_size(root, where: str, what: str) -> None:
    """The node count of the document with every alias expanded, computed on the composed graph (where an alias
    is one shared node) without expanding it; iterative, so depth cannot overflow the stack."""
    import yaml

    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if depth > YAML_MAX_DEPTH:
            raise UserError(f"{where}: the YAML nests more than {YAML_MAX_DEPTH} levels deep; {what} is a few "
                            "levels deep")
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            sizes[key] = 1
            continue
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > YAML_MAX_NODES:
                raise UserError(f"{where}: the YAML expands to more than {YAML_MAX_NODES} values (aliases "
                                "repeating aliases); refusing it, write it out plainly")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise UserError(f"{where}: the YAML refers to itself (an alias inside its own anchor); write it out "
                            "plainly")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def precompiled_charsmap_growth(blob: bytes) -> float:
    """How many times longer a SentencePiece ``precompiled_charsmap`` can make a text (its longest replacement, in
    characters: the trie matches one or more characters and writes one replacement for them), or ValueError when
    it is not one: a little-endian u32 trie size in bytes (whole u32 units), the trie, then the NUL-separated
    replacements. Real ones (nmt_nfkc) reach 18: U+FDFA is an 18-character phrase."""
    if len(blob) < 4:
        raise ValueError(f"{len(blob)} bytes, too short for a character map")
    trie_size = int.from_bytes(blob[:4], "little")
    if trie_size % 4 or 4 + trie_size > len(blob):
        raise ValueError(f"it declares a trie of {trie_size:,} bytes in a map of {len(blob):,}")
    replacements = blob[4 + trie_size:].split(b"\0")
    return float(max([1, *(len(r.decode("utf-8", "replace")) for r in replacements)]))
