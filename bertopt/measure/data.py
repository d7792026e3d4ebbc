"""Validation and calibration data: a text file (one input a line), JSONL, CSV or Parquet with named columns,
or ``builtin`` (the corpus shipped with bertopt).

Every problem with a file (missing, empty, undecodable, unknown extension, missing column, non-text cell) is a
``UserError`` naming the file and the fix, raised before anything is run or written.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertopt.data import corpus
from bertopt.errors import UserError, require
from bertopt.untrusted import json_depth

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")
PARQUET_SUFFIXES = (".parquet", ".pq")
KNOWN = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + CSV_SUFFIXES + PARQUET_SUFFIXES)
# a validation or calibration set is thousands of texts; these bound what a data file may make this process hold
# (a 3 GB file was read whole, a 113 KB Parquet file unpacked to 30 million rows of Python dicts)
MAX_DATA_BYTES = 256 << 20
MAX_DATA_ROWS = 1_000_000
MAX_DATA_ROW_DEPTH = 32  # a JSONL row is an object of strings and numbers: nested a level or two
_SAMPLE = "take a sample of it (e.g. head -n 100000)"


@dataclass
class Dataset:
    texts: list[str]
    pairs: list[str] | None = None
    labels: list[Any] | None = None
    source: str = "builtin"

    def __len__(self) -> int:
        return len(self.texts)

    def head(self, n: int | None) -> "Dataset":
        if n is None or n >= len(self.texts):
            return self
        return Dataset(self.texts[:n], self.pairs[:n] if self.pairs is not None else None,
                       self.labels[:n] if self.labels is not None else None, self.source)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "texts": len(self.texts), "pairs": self.pairs is not None,
                "labels": self.labels is not None}


def load_texts(path: str | os.PathLike, text_column: str = "text", text_pair_column: str | None = None,
               label_column: str | None = None, text_flag: str | None = "--text-column") -> Dataset:
    """Read validation/calibration inputs. ``"builtin"`` is the shipped corpus (``bertopt.data.corpus()``).
    ``text_flag``: the option that names the text column, for the error that lacks it (None: the caller has no
    such option, and the file's rows must have a ``text`` column)."""
    text_column = text_column or "text"
    if str(path) == "builtin":
        if text_pair_column or label_column:
            raise UserError("the built-in corpus has neither sentence pairs nor labels; give a JSONL/CSV/Parquet "
                            "file with --data to use --text-pair-column or --label-column")
        return Dataset(corpus(), source="builtin")
    file = Path(path).expanduser()
    if not file.exists():
        raise UserError(f"data file not found: {file}; give a .txt/.jsonl/.csv/.parquet file or 'builtin'")
    if file.is_dir():
        raise UserError(f"{file} is a folder; give a data file ({KNOWN}) or 'builtin'")
    if not file.is_file():  # a FIFO would block the read for ever, /dev/zero fill the memory
        raise UserError(f"{file} is not a regular file (a FIFO, device or socket); give a data file ({KNOWN}) or "
                        "'builtin'")
    suffix = file.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        if text_pair_column or label_column:
            raise UserError(f"{file}: a .txt file has one input a line and no columns; use a JSONL, CSV or Parquet "
                            "file for sentence pairs or labels")
        lines = _read_text(file).split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last line, it is not an input
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        if not any(line.strip() for line in lines):
            raise UserError(f"{file} has no text (empty file); write one input a line")
        _require_real_text(file, lines)
        return Dataset(lines, source=str(file))
    if suffix in JSONL_SUFFIXES:
        rows = _read_jsonl(file)
    elif suffix in CSV_SUFFIXES:
        rows = _read_csv(file, delimiter="\t" if suffix == ".tsv" else ",")
    elif suffix in PARQUET_SUFFIXES:
        rows = _read_parquet(file, [c for c in (text_column, text_pair_column, label_column) if c])
    else:
        raise UserError(f"{file}: unknown data file type '{suffix or '(none)'}'; use one of {KNOWN} "
                        "(a .txt file has one input a line)")
    if not rows:
        raise UserError(f"{file} has no rows (empty file); add at least one row with a '{text_column}' column")
    columns = list(rows[0].keys())
    for name, flag in ((text_column, "--text-column"), (text_pair_column, "--text-pair-column"),
                       (label_column, "--label-column")):
        if name is not None and not all(name in row for row in rows):
            row_no = next(i for i, row in enumerate(rows, 1) if name not in row)
            fix = f"pass {flag} NAME" if flag != "--text-column" or text_flag else (
                f"give each row a '{name}' column, or use a .txt file with one text a line")
            raise UserError(f"{file} has no column '{name}'" + (f" in row {row_no}" if row_no > 1 else "")
                            + f" (columns: {', '.join(map(str, columns))}); {fix}")
    texts = _text_column(file, rows, text_column)
    _require_real_text(file, texts)
    pairs = _text_column(file, rows, text_pair_column) if text_pair_column else None
    labels = [row[label_column] for row in rows] if label_column else None
    if labels is not None:
        missing = [i for i, v in enumerate(labels, 1) if v is None or (isinstance(v, float) and v != v)]
        if missing:
            raise UserError(f"{file}: row {missing[0]} has no label in column '{label_column}'; "
                            "fill it or drop the row")
    return Dataset(texts, pairs, labels, source=str(file))


def has_real_text(text: str) -> bool:
    """At least one visible character: control bytes (NUL, ...) and whitespace alone are no text."""
    return any(ch.isprintable() and not ch.isspace() for ch in text)


def _require_real_text(file: Path, texts: list[str]) -> None:
    if not any(has_real_text(t) for t in texts):
        raise UserError(f"{file} holds no real text (only control bytes or whitespace, e.g. NUL bytes); give a "
                        "file of text inputs")


def _read_text(file: Path) -> str:
    from bertopt.untrusted import read_user_file

    data = read_user_file(file, max_bytes=MAX_DATA_BYTES, what="data file", fix=_SAMPLE, decode=False)
    if data.count(b"\n") > MAX_DATA_ROWS:  # counted before a str is made per line
        raise UserError(f"{file} has more than {MAX_DATA_ROWS:,} lines; {_SAMPLE}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{file} is not UTF-8 text (undecodable byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start}); re-save it as UTF-8") from None


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(_read_text(file).splitlines(), 1):
        if not line.strip():
            continue
        if json_depth(line.encode("utf-8", "surrogatepass"), MAX_DATA_ROW_DEPTH) > MAX_DATA_ROW_DEPTH:
            raise UserError(f"{file}: line {number} nests lists or objects more than {MAX_DATA_ROW_DEPTH} levels "
                            "deep; write one flat JSON object a line like {\"text\": \"...\"}")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{file}: line {number} is not JSON ({exc.msg}); write one JSON object a line") from None
        if not isinstance(row, dict):
            raise UserError(f"{file}: line {number} is a JSON {type(row).__name__}, not an object; write one "
                            "object a line like {\"text\": \"...\"}")
        rows.append(row)
    return rows


def _read_csv(file: Path, delimiter: str) -> list[dict[str, Any]]:
    text = _read_text(file)
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
        rows = [dict(row) for row in reader]
    except csv.Error as exc:
        raise UserError(f"{file} is not a readable CSV file ({exc}); check its quoting") from None
    for number, row in enumerate(rows, 2):
        if None in row:
            raise UserError(f"{file}: line {number} has more fields than the header; quote fields that "
                            "contain the delimiter")
    return rows


def _read_parquet(file: Path, columns: list[str]) -> list[dict[str, Any]]:
    """The rows of ``columns`` (those of them the file has), bounded by the file's own metadata before anything
    is unpacked: Parquet compresses repeated values to nearly nothing."""
    pq = require("pyarrow.parquet", "report", "Parquet data files")
    if file.stat().st_size > MAX_DATA_BYTES:
        raise UserError(f"{file} is larger than {MAX_DATA_BYTES >> 20} MiB, too large for a data file; {_SAMPLE}")
    try:
        meta = pq.ParquetFile(str(file)).metadata
        unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_DATA_ROWS or unpacked > MAX_DATA_BYTES:
            raise UserError(f"{file} holds {meta.num_rows:,} rows ({unpacked >> 20} MiB unpacked), more than "
                            f"{MAX_DATA_ROWS:,} rows or {MAX_DATA_BYTES >> 20} MiB; {_SAMPLE}")
        names = set(meta.schema.to_arrow_schema().names)
        table = pq.read_table(str(file), columns=[c for c in columns if c in names] or None)
    except UserError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for damaged files
        raise UserError(f"{file} is not a readable Parquet file ({str(exc).splitlines()[0]}); "
                        "re-write it or use JSONL/CSV") from None
    return table.to_pylist()


def _text_column(file: Path, rows: list[dict[str, Any]], column: str) -> list[str]:
    values = []
    for number, row in enumerate(rows, 1):
        value = row[column]
        if not isinstance(value, str):
            raise UserError(f"{file}: row {number} column '{column}' is {type(value).__name__} ({value!r}), "
                            "not text; every input must be a string")
        values.append(value)
    return values
