"""A model folder's tokenizer.json is user input that runs on every text: one whose normalizer multiplies a text's
length, or whose pattern backtracks without end, is refused where it is read; a text that still makes the Rust
tokenizer panic (pyo3's PanicException, a BaseException) is a UserError naming it, in a command and in a served
request, not a traceback or a dead worker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertopt.errors import UserError
from bertopt.runtime.predictor import Predictor
from bertopt.runtime.tokenizer_file import read_tokenizer_json

# a pattern that passes the nested-quantifier check but still exhausts the regex engine's retry limit on this text
PANICKING_SPLIT = "(a|a)*$"
PANICKING_TEXT = "a" * 40 + "!"


def _with_tokenizer(tiny_hf: Path, dest: Path, edit) -> Path:
    shutil.copytree(tiny_hf, dest)
    file = dest / "tokenizer.json"
    spec = json.loads(file.read_text())
    edit(spec)
    file.write_text(json.dumps(spec))
    return dest


def _split_first(pattern: str):
    def edit(spec):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, spec["pre_tokenizer"]]}
    return edit


def _replace_steps(steps: int, content: str = "abcdefghij"):
    def edit(spec):
        spec["normalizer"] = {"type": "Sequence", "normalizers": [spec["normalizer"]] + [
            {"type": "Replace", "pattern": {"Regex": "."}, "content": content}] * steps}
    return edit


def test_a_normalizer_that_multiplies_text_is_refused(tiny_hf, tmp_path):
    # five Replace steps each turning a character into ten: 100,000 characters each (export's check texts took
    # 200 s and 4.5 GB; after the BertNormalizer, which can triple a character: 300,000); one such step (10x) is a
    # tokenizer's own business
    folder = _with_tokenizer(tiny_hf, tmp_path / "m5", _replace_steps(5))
    with pytest.raises(UserError, match="its normalizer can make a text 300,000 times longer"):
        read_tokenizer_json(folder / "tokenizer.json")
    read_tokenizer_json(_with_tokenizer(tiny_hf, tmp_path / "m1", _replace_steps(1)) / "tokenizer.json")


def test_a_pattern_that_nests_quantifiers_is_refused(tiny_hf, tmp_path):
    folder = _with_tokenizer(tiny_hf, tmp_path / "m", _split_first("(a+)+$"))
    with pytest.raises(UserError, match=r"its pattern '\(a\+\)\+\$' nests quantifiers"):
        read_tokenizer_json(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def panicking_artifact(tiny_hf, tmp_path_factory):
    from bertopt.registry import run_stage

    root = tmp_path_factory.mktemp("panicking")
    folder = _with_tokenizer(tiny_hf, root / "hf", _split_first(PANICKING_SPLIT))
    return run_stage("export", str(folder), {}, root / "art")


def test_a_text_that_panics_the_tokenizer_is_a_user_error_and_the_predictor_goes_on(panicking_artifact):
    predictor = Predictor(panicking_artifact)
    with pytest.raises(UserError, match=r"the model's tokenizer cannot encode this text \(.*retry-limit"):
        predictor.encode(["fine", PANICKING_TEXT])
    assert predictor.encode(["fine"]).shape == (1, predictor.embedding_dim)


def test_validate_on_such_a_text_exits_2_with_its_line_last(panicking_artifact, tmp_path):
    data = tmp_path / "texts.txt"
    data.write_text(f"a fine text\n{PANICKING_TEXT}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "validate", str(panicking_artifact.path), "--data",
                           str(data), "--no-latency", "--report-dir", str(tmp_path / "r")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # Rust's own panic message goes to stderr before Python sees the panic; what follows is the one line
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the model's tokenizer cannot encode this text"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def _nfkc_charsmap() -> str:
    """The precompiled_charsmap of a real SentencePiece model (its default rule, nmt_nfkc), as tokenizer.json holds
    it: what XLM-R, ALBERT and T5 tokenizers normalise with."""
    import base64
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["0123456789 hello world 1 22 333"] * 20), model_writer=buf,
                                   vocab_size=30, model_type="unigram", minloglevel=2, hard_vocab_limit=False)
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(buf.getvalue())
    return base64.b64encode(model.normalizer_spec.precompiled_charsmap).decode()


def test_real_sentencepiece_normalizers_are_read_and_bounded(tiny_hf, tmp_path):
    # ALBERT's normalizer (NFKD, StripAccents, Lowercase, then the charsmap) and XLM-R's (the charsmap, a Replace of
    # runs of spaces): a run of Unicode forms counts once, so neither multiplies its steps past the bound
    from bertopt.runtime.tokenizer_file import normalizer_growth

    charsmap = {"type": "Precompiled", "precompiled_charsmap": _nfkc_charsmap()}
    spaces = {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"}
    albert = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "``"}, "content": "\""},
        {"type": "Replace", "pattern": {"String": "''"}, "content": "\""}, {"type": "NFKD"},
        {"type": "StripAccents"}, {"type": "Lowercase"}, charsmap, spaces]}
    xlmr = {"type": "Sequence", "normalizers": [charsmap, spaces]}
    assert normalizer_growth(albert) == 18 and normalizer_growth(xlmr) == 18  # U+FDFA: 18 characters
    for name, normalizer in (("albert", albert), ("xlmr", xlmr)):
        folder = _with_tokenizer(tiny_hf, tmp_path / name, lambda spec, n=normalizer: spec.update(normalizer=n))
        tok = read_tokenizer_json(folder / "tokenizer.json")
        assert tok.normalizer.normalize_str("Ｈｅｌｌｏ  ﬁne") in ("hello\u2581fine", "Hello\u2581fine")
    # a charsmap after a Replace that feeds it, or a Unicode form after a charsmap, multiply
    assert normalizer_growth({"type": "Sequence", "normalizers": [charsmap, {"type": "NFKC"}]}) == 18 * 18


def test_a_text_the_tokenizer_has_no_token_for_is_a_user_error(tmp_path):
    # a Unigram model without unk_id raises the tokenizers library's plain Exception on a character it lacks (export
    # refuses such a tokenizer; one already in an artifact still answers in one line)
    from tokenizers import Tokenizer, models

    file = tmp_path / "tokenizer.json"
    file.write_text(Tokenizer(models.Unigram([("a", -1.0), ("b", -2.0)], unk_id=None, byte_fallback=False)).to_str())
    tok = read_tokenizer_json(file)
    assert tok.encode("ab").ids == [0, 1]
    with pytest.raises(UserError, match=r"cannot encode this text \(Encountered an unknown token but `unk_id` is "
                                        r"missing\)"):
        tok.encode("abc")
    with pytest.raises(UserError, match="unk_id"):
        tok.encode_batch(["a", "zzz"])


@pytest.mark.parametrize("edit, message", [
    # a pattern matching the empty string inserts its content between every two characters: each step doubled
    (lambda spec: spec.update(normalizer={"type": "Sequence", "normalizers": [spec["normalizer"]] + [
        {"type": "Replace", "pattern": {"Regex": ""}, "content": "a"}] * 14}), "a text 49,152 times longer"),
    # BertNormalizer is no normal form: each pass puts spaces around every CJK character again
    (lambda spec: spec.update(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}] + [
        {"type": "BertNormalizer"}] * 2000}), r"a text over 10\^15 times longer"),
    # ByteLevel pre-tokenizers each write a character per UTF-8 byte (sixteen aborted the process)
    (lambda spec: spec.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}] * 16}),
     "its normalizer and pre-tokenizer can make a text"),
])
def test_growth_that_gets_past_a_count_of_steps_is_refused(tiny_hf, tmp_path, edit, message):
    folder = _with_tokenizer(tiny_hf, tmp_path / "m", edit)
    with pytest.raises(UserError, match=message):
        read_tokenizer_json(folder / "tokenizer.json")


def test_regex_replaces_of_real_tokenizers_count_as_what_they_match(tiny_hf, tmp_path):
    # SeamlessM4T's normalizer (transformers' converter): regex Replaces that cannot match the empty string around
    # NFKC; each counted as doubling, it was refused (144)
    from bertopt.runtime.tokenizer_file import normalizer_growth

    seamless = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"Regex": "[\\n\\r\\t]"}, "content": " "}, {"type": "NFKC"},
        {"type": "Strip", "strip_left": False, "strip_right": True},
        {"type": "Replace", "pattern": {"Regex": " +\u2581"}, "content": "\u2581"},
        {"type": "Replace", "pattern": {"Regex": "^\u2581+$"}, "content": ""},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"}]}
    assert normalizer_growth(seamless) == 18
    folder = _with_tokenizer(tiny_hf, tmp_path / "m", lambda spec: spec.update(normalizer=seamless))
    assert read_tokenizer_json(folder / "tokenizer.json").normalizer.normalize_str("a\tb  c") == "a b\u2581c"
    for pattern in ("", "x?", "(?=a)", "\\b"):  # each can match the empty string
        assert normalizer_growth({"type": "Replace", "pattern": {"Regex": pattern}, "content": "ab"}) == 3


def test_a_tokenizer_nested_past_what_the_library_reads_is_refused(tmp_path):
    # a normalizer Sequence nested 950 deep parsed in Python, then the growth bound recursed past Python's limit (a
    # RecursionError traceback); the tokenizers library itself reads 128 levels
    nested = '{"type": "Sequence", "normalizers": [' * 950 + '{"type": "NFC"}' + "]}" * 950
    file = tmp_path / "tokenizer.json"
    file.write_text('{"version": "1.0", "normalizer": ' + nested + ', "model": {"type": "WordPiece", "vocab": {}}}')
    with pytest.raises(UserError, match="nests lists or objects more than 128 levels deep"):
        read_tokenizer_json(file)
