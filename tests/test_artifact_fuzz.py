"""A bounded fuzz run of the manifest loader (hypothesis, a few hundred cases): every mutated manifest either loads
(and then names only regular files inside its folder) or is refused with ArtifactError/UserError; no other
exception, no hang, and nothing outside the folder (or under /dev) is opened."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bertopt.artifact import MANIFEST_NAME, Artifact, _digest_of_files
from bertopt.errors import UserError

_OPENED: list[str] | None = None
# 300 seeded cases in the suite (well under a minute); BERTOPT_FUZZ_EXAMPLES=5000 for a longer, random run
FUZZ_EXAMPLES = int(os.environ.get("BERTOPT_FUZZ_EXAMPLES", "300"))


def _audit(event, args):
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)

# names that exist in (or next to) the fuzzed folder as what they claim to be hostile about
HOSTILE = ["../outside/secret", "/dev/zero", "/etc/hostname", "", ".", "..", "a/../../outside/secret",
           "tokenizer/../../outside/secret", "model.onnx", "tokenizer", "tokenizer/tokenizer.json", MANIFEST_NAME,
           "C:\\outside", "with\x00nul", "tokenizer//tokenizer.json", "./model.onnx", "zero", "pipe", "link",
           "linkdir/secret", "model.onnx_data", "nope.onnx"]
_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(HOSTILE))
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(HOSTILE)), inner, max_size=4)), max_leaves=16)


def _paths(value, prefix=()):
    """Every key path into a JSON value (the places a mutation can hit)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def _delete(doc, path):
    if not path:
        return doc
    target = doc
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return doc


@st.composite
def mutated_manifests(draw, base: dict) -> bytes:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "delete", "add_file", "hostile_field", "rehash"]))
        paths = list(_paths(doc))
        if op == "set":
            doc = _set(doc, draw(st.sampled_from(paths)), draw(_value))
        elif op == "delete" and len(paths) > 1:
            doc = _delete(doc, draw(st.sampled_from(paths[1:])))
        elif op == "add_file" and isinstance(doc, dict) and isinstance(doc.get("files"), dict):
            info = draw(st.one_of(st.sampled_from(list(base["files"].values())), _value))
            doc["files"][draw(st.sampled_from(HOSTILE))] = copy.deepcopy(info)  # never an alias into base
        elif op == "hostile_field" and isinstance(doc, dict):
            key = draw(st.sampled_from(["model_file", "external_data", "digest", "format_version"]))
            doc[key] = draw(st.one_of(st.sampled_from(HOSTILE), st.lists(st.sampled_from(HOSTILE), max_size=3)))
        elif op == "rehash" and isinstance(doc, dict) and isinstance(doc.get("files"), dict):
            try:  # a consistent digest, so the checks after the digest are reached too
                doc["digest"] = _digest_of_files(doc["files"])
            except (TypeError, KeyError, AttributeError):
                pass  # the files section is no longer a mapping of mappings: the loader refuses it
    text = json.dumps(doc, allow_nan=True).encode()
    if draw(st.booleans()) and draw(st.integers(0, 3)) == 0:  # sometimes damage the bytes themselves
        at = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:at] + draw(st.binary(max_size=4)) + text[at + draw(st.integers(0, 8)):]
    return text


@pytest.fixture(scope="module")
def fuzz_folder(tiny_onnx, tmp_path_factory):
    """A copy of the tiny artifact next to a folder 'outside', holding a symlink out, a FIFO and a link to
    /dev/zero, so hostile names in a manifest name real hostile things."""
    root = tmp_path_factory.mktemp("fuzz")
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret").write_text("outside\n")
    art = root / "art"
    shutil.copytree(tiny_onnx.path, art)
    os.symlink(outside / "secret", art / "link")
    os.symlink(outside, art / "linkdir")
    os.symlink("/dev/zero", art / "zero")
    os.mkfifo(art / "pipe")
    return art, outside


@pytest.mark.timeout(300)
def test_mutated_manifests_load_or_are_refused_cleanly(fuzz_folder, tiny_onnx):
    global _OPENED
    art, outside = fuzz_folder
    base = json.loads((tiny_onnx.path / MANIFEST_NAME).read_text())
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FUZZ_EXAMPLES == 300, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated_manifests(base))
    def check(text: bytes):
        global _OPENED
        (art / MANIFEST_NAME).write_bytes(text)
        _OPENED = []
        try:
            loaded = Artifact.load(art)
        except UserError:  # ArtifactError is one
            outcomes["refused"] += 1
            loaded = None
        finally:
            opened, _OPENED = _OPENED, None
        strays = [p for p in opened if Path(p).absolute().is_relative_to(outside) or p.startswith("/dev/")]
        assert strays == [], text[:300]
        if loaded is not None:
            outcomes["loaded"] += 1
            root = art.resolve()
            for rel in loaded.manifest["files"]:
                file = art / rel
                assert not file.is_symlink() and file.is_file() and file.resolve().is_relative_to(root)
            assert loaded.model_path.resolve().is_relative_to(root) and loaded.digest == base["digest"]
            from rich.console import Console

            from bertopt.artifact_view import render

            render(loaded, Console(file=io.StringIO(), width=100))  # what `bertopt inspect` shows

    try:
        check()
    finally:
        (art / MANIFEST_NAME).write_text(json.dumps(base))
    # the run explored both sides: manifests that still load and ones refused
    assert outcomes["refused"] > FUZZ_EXAMPLES // 3 and outcomes["loaded"] > 0, outcomes


def test_deep_or_undecodable_manifest_is_a_one_line_error():
    """Nesting deeper than the limit yet parsable by Python, and bytes that are no JSON text: ArtifactError."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "a"
        folder.mkdir()
        (folder / MANIFEST_NAME).write_text("[" * 5000 + "]" * 5000)
        with pytest.raises(UserError, match="deeper than 64 levels"):
            Artifact.load(folder)
        (folder / MANIFEST_NAME).write_bytes(b"\xff\xfe{")
        with pytest.raises(UserError, match="is not valid JSON"):
            Artifact.load(folder)
