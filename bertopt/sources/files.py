"""The files of a model folder the user gives (a source, not an artifact), read or copied only when they are
regular files that stay inside it.

A model folder from a git clone or an archive can hold symbolic links: ``vocab.txt -> ~/.ssh/id_rsa`` was copied
into the artifact's tokenizer folder (and from there into whatever the artifact is shipped with), a link to
``/dev/zero`` filled the disk, a FIFO hung the reader. A link is followed only where it stays inside the folder,
or, in a Hugging Face cache snapshot (``.../snapshots/<revision>/...``), inside the same repository's ``blobs/``
(how the hub lays out a download). A path a model file names (``modules.json``: a module's folder) must be a
plain relative path inside the folder, as an artifact's are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from bertopt.errors import UserError


def _allowed_roots(root: Path) -> list[Path]:
    real = root.resolve()
    allowed = [real]
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots":  # <repo>/snapshots/<revision>: the files are links into <repo>/blobs
            allowed.append(folder.parent.parent / "blobs")
            break
    return allowed


def source_file_problem(root: Path, file: Path) -> str | None:
    """Why ``file`` (a path inside the model folder ``root``) may not be read, or None: a link that leads out of
    the folder, or anything but a regular file at its end (a FIFO, a device, a folder)."""
    file = Path(file)
    real = file.resolve()
    if file.is_symlink() or real != file.absolute():
        if not any(real == a or a in real.parents for a in _allowed_roots(Path(root))):
            return f"is a link to {real}, outside the model folder"
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, device or folder)"
    return None


def check_source_file(root: Path, file: Path, fix: str = "replace it with the file itself") -> Path:
    """``file``, if it may be read (``source_file_problem``); else one UserError naming it and ``fix``."""
    problem = source_file_problem(root, file)
    if problem:
        raise UserError(f"{file} {problem}; {fix}")
    return Path(file)


def check_source_files(root: Path, folder: Path | None = None, fix: str = "replace it with the file itself") -> None:
    """Every entry directly in ``folder`` (default ``root``) that a reader may open by itself (a tokenizer
    library reads whatever files its config names): checked as ``check_source_file``; sub-folders are left to
    the readers that name them."""
    folder = Path(folder or root)
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            continue
        check_source_file(root, entry, fix)


def folder_name_problem(rel: object) -> str | None:
    """Why ``rel`` (a folder a model file names, e.g. a module's ``path`` in ``modules.json``) is not a plain
    relative path inside the model folder, or None ("" is the folder itself)."""
    if not isinstance(rel, str):
        return "is not a folder name"
    if "\x00" in rel or "\\" in rel:
        return "holds a NUL or backslash"
    if rel.startswith("/") or ".." in rel.split("/"):
        return "leads out of the model folder"
    return None


def read_source_bytes(root: Path, file: Path, fix: str, max_bytes: int = 64 << 20) -> bytes:
    """A model folder's file, checked first (``check_source_file``) and read with a size bound; a problem is one
    UserError naming the file and ``fix``."""
    check_source_file(root, file, fix)
    try:
        with open(file, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"cannot read {file} ({exc.strerror}); {fix}") from None
    if len(data) > max_bytes:
        raise UserError(f"{file} is larger than {max_bytes >> 20} MiB, too large for what it should be; {fix}")
    return data


def read_source_text(root: Path, file: Path, fix: str, max_bytes: int = 64 << 20) -> str:
    """A model folder's text file (UTF-8), read as ``read_source_bytes`` does."""
    data = read_source_bytes(root, file, fix, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{file} is not UTF-8 text; {fix}") from None
