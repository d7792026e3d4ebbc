"""Validation data files: every format read back, every bad file a one-line error naming the file and the fix
(exit 2 from `bertopt validate`, nothing written)."""

from __future__ import annotations

import json
import os

import pytest

from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.measure.data import load_texts


def test_builtin_is_the_shipped_corpus():
    data = load_texts("builtin")
    assert data.texts == corpus() and data.pairs is None and data.labels is None


def test_text_file_one_input_a_line_keeps_empty_lines_and_strips_crlf(tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes("first line\r\n\r\nthird ünïcode\n".encode())
    assert load_texts(f).texts == ["first line", "", "third ünïcode"]


def test_jsonl_with_pairs_and_labels(tmp_path):
    f = tmp_path / "in.jsonl"
    rows = [{"q": "a cat", "p": "a dog", "y": 1}, {"q": "hello", "p": "world", "y": 0}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    data = load_texts(f, text_column="q", text_pair_column="p", label_column="y")
    assert data.texts == ["a cat", "hello"] and data.pairs == ["a dog", "world"] and data.labels == [1, 0]


def test_csv_with_quoted_commas(tmp_path):
    f = tmp_path / "in.csv"
    f.write_text('sentence,label\n"one, two",pos\nthree,neg\n')
    data = load_texts(f, text_column="sentence", label_column="label")
    assert data.texts == ["one, two", "three"] and data.labels == ["pos", "neg"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["x y", "z"], "label": [0, 1]}), f)
    data = load_texts(f, label_column="label")
    assert data.texts == ["x y", "z"] and data.labels == [0, 1]


BAD_FILES = {
    "missing column": ("rows.jsonl", b'{"sentence": "a"}\n', ["no column 'text'", "sentence", "--text-column"]),
    "missing csv column": ("rows.csv", b"sentence\na\n", ["no column 'text'", "--text-column"]),
    "empty text file": ("empty.txt", b"", ["empty file"]),
    "blank text file": ("blank.txt", b"\n \n", ["no text"]),
    "empty csv": ("empty.csv", b"", ["no rows"]),
    "undecodable bytes": ("latin.txt", "caf\u00e9 au lait\n".encode("latin-1"), ["not UTF-8", "0xe9", "re-save"]),
    "unknown extension": ("data.xlsx", b"PK\x03\x04", ["unknown data file type '.xlsx'", ".jsonl"]),
    "not json": ("bad.jsonl", b'{"text": "a"}\nnot json\n', ["line 2 is not JSON"]),
    "non-text cell": ("nums.jsonl", b'{"text": 5}\n', ["row 1", "not text"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_a_user_error_naming_file_and_fix(tmp_path, case):
    name, content, fragments = BAD_FILES[case]
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(UserError) as info:
        load_texts(f)
    message = str(info.value)
    assert name in message and ";" in message  # "<problem>; <fix>"
    for fragment in fragments:
        assert fragment in message


def test_txt_cannot_have_label_columns(tmp_path):
    f = tmp_path / "in.txt"
    f.write_text("a\n")
    with pytest.raises(UserError, match="use a JSONL, CSV or Parquet"):
        load_texts(f, label_column="label")


@pytest.fixture(scope="module")
def tiny_int8(tiny_onnx, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic"}, tmp_path_factory.mktemp("v") / "int8")


@pytest.mark.parametrize("case", ["missing column", "empty text file", "undecodable bytes", "unknown extension"])
def test_validate_with_a_bad_data_file_exits_2_with_one_line_and_writes_nothing(cli, tiny_int8, tmp_path, case):
    name, content, fragments = BAD_FILES[case]
    f = tmp_path / name
    f.write_bytes(content)
    report = tmp_path / "report"
    code, out, err = cli("validate", tiny_int8.path, "--data", f, "--report-dir", report)
    assert code == 2
    assert err.startswith("error:") and name in err and fragments[0] in err
    assert len(err.strip().splitlines()) == 1
    assert not report.exists()
    assert "gate" not in json.loads((tiny_int8.path / "bertopt.json").read_text())["validation"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_data_path_that_is_not_a_regular_file_is_refused_without_reading_it(cli, tiny_int8, tmp_path, kind):
    # a FIFO would block the read for ever and a link to /dev/zero fill the memory: both are one line, exit 2,
    # found before anything is opened
    data = tmp_path / "texts.txt"
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"texts.txt is not a regular file \(a FIFO, device or socket\); give a data"):
        load_texts(data)
    report = tmp_path / "report"
    code, out, err = cli("validate", tiny_int8.path, "--data", data, "--report-dir", report)
    assert code == 2 and "is not a regular file" in err and len(err.strip().splitlines()) == 1, err
    assert not report.exists()
    code, out, err = cli("quantize", tiny_int8.path, "--mode", "int8-static", "--calibration-data", data,
                         "--out", tmp_path / "q")
    assert code == 2 and "is not a regular file" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "q").exists()
