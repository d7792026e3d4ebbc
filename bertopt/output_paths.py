"""Where a command may write: the one output-path policy of every command that writes (stages, recipes,
``validate --report-dir``, ``spark-predict --output``, ``bench --json``).

* ``check_output`` runs before any work: paths are compared after ``resolve()`` (so ``--out INPUT/tokenizer/..``
  and an input reached through a symlinked parent are seen for what they are); an output equal to or inside an
  input, or an input inside the output, is refused; an existing output is replaced only when the command may
  replace (``--force``; a report folder always) and only when it is recognisably this tool's own output of the
  same kind (``OWN_MARKERS``) or an empty folder; a regular file where a folder goes is refused by name.
* ``output_lock`` takes an exclusive ``flock`` on ``.NAME.lock`` beside the output for as long as a command
  writes it, so a second writer fails at once with "another bertopt is writing OUT" instead of both saying
  "wrote". It is re-entrant within a thread (``run_stage`` and the ``ArtifactWriter`` it leads to both take it)
  and the lock file is removed on release, with the folders made to hold it when the output never came (a
  command that failed leaves no empty ``--out`` parents behind).
* ``temp_sibling`` names the hidden folder an output is built in (``.NAME.tmp-<pid>-<random>``); ``sweep_stale``
  removes such folders whose owner process is gone (a writer killed by SIGKILL), under the lock.
* ``process_scratch`` makes a folder in the system temp dir for files a process needs until it exits (a tokenizer
  built from slow-tokenizer files, an artifact zipped for Spark's executors) and removes it at exit, where no
  ``with`` block can bound its life. A stage's scratch lives inside its output's temp folder instead
  (``ArtifactWriter.scratch``), so the sweep above removes it after a SIGKILL too.
* ``check_output_file`` / ``write_file``: a single new file (``client encode --out``), refused where it exists,
  lies inside an artifact or lacks its suffix, written to a temp file and renamed into place.
* ``write_json`` writes a JSON file (a manifest, a report, a result) to a temp file and renames it into place.
* ``cache_root`` is where bertopt keeps what it may rebuild (built-in models, OpenVINO blobs, TensorRT engines);
  ``one_at_a_time`` holds a lock file (blocking, with a bound) around writing a cache entry that other processes
  read as they find it.

Ground layer: imports nothing of bertopt but ``errors``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from bertopt.errors import UserError, check_interrupted, check_writable, signals_deferred

logger = logging.getLogger(__name__)

# kind -> the file that marks a folder as this tool's own output of that kind
OWN_MARKERS = {
    "artifact": "bertopt.json",
    "report": "validation.json",
    "tune-report": "tune.json",
    "spark-output": "_bertopt.json",  # '_' : Spark, pyarrow and pandas readers skip it
}
KIND_WORDS = {
    "artifact": "a bertopt artifact",
    "report": "a bertopt validation report",
    "tune-report": "a bertopt tune report",
    "spark-output": "a bertopt spark-predict output",
    "json": "a bertopt JSON result",
}


def _has_scheme(path: str) -> bool:
    return "://" in path


def real_path(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded, made absolute, every symlink and ``..`` resolved (it need not exist)."""
    return Path(path).expanduser().resolve()


def is_own_output(path: str | os.PathLike, kind: str) -> bool:
    """Whether ``path`` is a folder (or, for ``json``, a file) that this tool wrote as output of ``kind``."""
    path = Path(path)
    if kind == "json":
        return path.is_file() and _is_result_json(path)
    return path.is_dir() and not path.is_symlink() and (path / OWN_MARKERS[kind]).is_file()


def _is_result_json(path: Path) -> bool:
    import json

    try:
        if path.stat().st_size > 64 << 20:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "results" in data and "machine" in data


def _inside(child: Path, parent: Path) -> bool:
    return child != parent and parent in child.parents


def overlap(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two outputs' real paths are the same or one holds the other."""
    real_a, real_b = real_path(a), real_path(b)
    return real_a == real_b or _inside(real_a, real_b) or _inside(real_b, real_a)


def check_output(path: str | os.PathLike, *, kind: str, inputs: Iterable[str | os.PathLike | None] = (),
                 replace: bool = False, flag: str = "--out") -> Path:
    """Check, before any work, that ``path`` may be written as output of ``kind``; returns its real path.

    ``inputs``: what the command reads (artifact folders, model files or folders, data files; URLs and None are
    skipped). ``replace``: the command may replace an existing output (``--force``)."""
    shown = str(path)
    real = check_not_input(path, inputs, flag, kind)
    if real.exists():
        word = KIND_WORDS[kind]
        if kind == "json":
            if real.is_dir():
                raise UserError(f"{flag} {shown} is a folder; give the path of a .json file")
            if not is_own_output(real, kind):
                raise UserError(f"{flag} {shown} exists and is not {word}; refusing to replace it, choose another "
                                f"{flag}")
            return real
        if not real.is_dir():
            raise UserError(f"{flag} {shown} is an existing file, not {word} folder; remove it or choose another "
                            f"{flag}")
        own = is_own_output(real, kind)
        cwd = _cwd()
        if replace and cwd is not None and (cwd == real or _inside(cwd, real)):
            where = "the current folder" if cwd == real else f"a folder that holds the current folder ({cwd})"
            raise UserError(f"{flag} {shown} is {where}; replacing it would delete the folder you are working in, "
                            f"choose another {flag} (or run from another folder)")
        if not replace:
            what = word if own else "a folder"
            raise UserError(f"{flag} {shown} already exists ({what}); choose another {flag} or pass --force to "
                            "replace it")
        if not own and _has_entries(real):
            raise UserError(f"{flag} {shown} exists and is not {word} (it holds other files); refusing to replace "
                            f"it, choose another {flag}")
    check_writable(real, flag)
    return real


def check_output_file(path: str | os.PathLike, *, suffix: str, flag: str = "--out") -> Path:
    """Check, before any work, that a new file may be written at ``path`` (a command's single-file result that no
    marker can tell as its own, so an existing file is never replaced); returns its real path. Its name must end
    in ``suffix`` (a writer that adds the suffix itself would otherwise write another file than the one named),
    and it may not go inside an artifact folder (nothing unhashed sits in one)."""
    shown = str(path)
    if not shown.strip():
        raise UserError(f"{flag} is empty; give the path of a {suffix} file")
    if not shown.endswith(suffix) or Path(shown).name == suffix:
        raise UserError(f"{flag} {shown}: give the path of a {suffix} file (the name must end in {suffix})")
    real = real_path(path)
    marker = OWN_MARKERS["artifact"]
    holder = next((folder for folder in real.parents if (folder / marker).is_file()), None)
    if holder is not None:
        raise UserError(f"{flag} {shown} is inside the artifact {holder}, whose files are all hashed in its "
                        f"manifest; choose an {flag} outside it")
    if os.path.lexists(real):
        what = "a folder" if real.is_dir() else "an existing file"
        raise UserError(f"{flag} {shown} is {what}; choose a new file name (bertopt does not replace it)")
    check_writable(real, flag)
    return real


def write_file(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, then rename it into place (a reader never sees half a
    file; a failure or Ctrl-C leaves nothing)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def check_not_input(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], flag: str = "--out",
                    kind: str = "") -> Path:
    """Refuse an output that is, is inside, or holds one of ``inputs`` (real paths); returns its real path."""
    if not str(path).strip():  # Path('') is the current folder: never what an empty --out meant
        raise UserError(f"{flag} is empty; give the path to write to")
    real = real_path(path)
    never = "stages never modify their input" if kind == "artifact" else "bertopt never writes over its input"
    for given in inputs:
        if given is None or _has_scheme(str(given)) or not str(given).strip():  # an empty input is refused by name
            continue
        source = real_path(given)
        if real == source:
            raise UserError(f"{flag} {path} is the input {given}; {never}, choose another {flag}")
        if _inside(real, source):
            raise UserError(f"{flag} {path} is inside the input {given}; {never}, choose an {flag} outside it")
        if _inside(source, real):
            raise UserError(f"{flag} {path} holds the input {given}, which replacing it would delete; choose "
                            f"another {flag}")
    return real


def _cwd() -> Path | None:
    try:
        return real_path(os.getcwd())
    except OSError:  # the folder we were started in is gone: it cannot be replaced either
        return None


def _has_entries(folder: Path) -> bool:
    with os.scandir(folder) as entries:
        return any(True for _ in entries)


# -- locks ----------------------------------------------------------------------------------------------------
_held: dict[tuple[str, int], list] = {}  # (lock file, thread) -> [fd, depth]
_held_guard = threading.Lock()


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


@contextmanager
def output_lock(path: str | os.PathLike, flag: str = "--out") -> Iterator[Path]:
    """Hold an exclusive lock on writing ``path`` (its real path is yielded); refuses at once, with one line,
    when another process (or thread) holds it."""
    import fcntl

    real = real_path(path)
    lock = lock_path(real)
    key = (str(lock), threading.get_ident())
    with _held_guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
    if entry is not None:
        try:
            yield real
        finally:
            with _held_guard:
                entry[1] -= 1
        return
    made = _missing_folders(real.parent)  # made here for the lock: removed again if the output never comes
    real.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _acquire(lock, path, flag, fcntl)
    except BaseException:
        _remove_empty(made)
        raise
    with _held_guard:
        _held[key] = entry = [fd, 1]
    try:
        yield real
    finally:
        with _held_guard:
            del _held[key]
        try:
            os.unlink(lock)  # while still holding it: a waiter re-checks the inode and retries (see _acquire)
        except FileNotFoundError:
            pass  # removed by hand meanwhile: nothing to clean
        os.close(fd)
        if not os.path.lexists(real):  # the command failed: the folders made for it go too, when still empty
            _remove_empty(made)


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while each is empty; stop at the first that is not (another writer's)."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def _acquire(lock: Path, shown, flag: str, fcntl) -> int:
    for _ in range(20):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = _lock_owner(lock)
            raise UserError(f"another bertopt{owner} is writing {shown}; wait for it to finish or choose another "
                            f"{flag} (lock file {lock})") from None
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the previous holder removed the file between our open and flock: take the new one
    raise UserError(f"could not lock {lock} (it keeps being replaced); check what else writes {shown}")


CACHE_LOCK_WAIT_S = 900.0  # longer than any compile or engine build measured: a holder this long is hung


def cache_root() -> Path:
    """``$BERTOPT_CACHE_DIR``, default ``~/.cache/bertopt``."""
    return Path(os.environ.get("BERTOPT_CACHE_DIR") or (Path.home() / ".cache" / "bertopt"))


@contextmanager
def one_at_a_time(lock_file: Path, wait_s: float = CACHE_LOCK_WAIT_S) -> Iterator[bool]:
    """Hold ``lock_file`` (an exclusive ``flock``: processes and threads take it in turn; the file stays): yields
    True, or False when it was not got within ``wait_s`` seconds. Around writing a cache entry that other
    processes read as they find it (an OpenVINO blob, a TensorRT engine), so none reads one half-written."""
    import fcntl
    import time

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)  # a descriptor per call: threads exclude each other
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    held = False
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # closing the descriptor lets go of the lock


def _lock_owner(lock: Path) -> str:
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return ""
    return f" (pid {pid})" if pid > 0 else ""


# -- temporary folders ----------------------------------------------------------------------------------------
def temp_sibling(target: Path, tag: str = "tmp") -> Path:
    """A hidden name beside ``target`` for building (``tmp``) or moving aside (``old``) an output; it carries
    this process's pid so ``sweep_stale`` can tell an orphan from a folder a live writer is filling."""
    return target.parent / f".{target.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder ``tmp`` to ``target``: an existing ``target`` is moved aside first and removed
    after, so a reader sees the old output or the new one, never half of either. Refused (KeyboardInterrupt) once
    a SIGINT arrived, even one whose exception a library swallowed (``bertopt.errors.check_interrupted``)."""
    check_interrupted()
    old = None
    with signals_deferred():  # a Ctrl-C between the renames would leave neither output in place
        try:
            if target.exists():
                old = temp_sibling(target, "old")
                os.rename(target, old)
            os.rename(tmp, target)
        except BaseException:  # (an interrupt without the CLI's handlers) the old output goes back where it was
            if old is not None and os.path.lexists(old) and not os.path.lexists(target):
                os.rename(old, target)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_stale(target: Path) -> list[Path]:
    """Remove ``.NAME.tmp-<pid>-*`` / ``.NAME.old-<pid>-*`` beside ``target`` whose process is gone; returns what
    it removed or put back.
    An ``.old`` folder with no ``target`` beside it is the last output of a process killed between moving it
    aside and moving its new one in: it is put back, not removed. Call it holding ``output_lock(target)``."""
    target = Path(target)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}")
    removed = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or _pid_alive(int(found.group(2))):
            continue
        if found.group(1) == "old" and not os.path.lexists(target):
            os.rename(entry, target)
            logger.warning("put back %s: the output a killed bertopt (pid %s) was replacing", target, found.group(2))
            removed.append(entry)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


@contextmanager
def replaced_together(folder: Path, outputs: list[Path]) -> Iterator[None]:
    """Outputs inside ``folder`` that one run writes and that must agree with each other (a recipe's stage
    folders, each the parent of the next, and its gate report): the earlier run's are moved aside into one hidden
    folder beside ``folder`` while the block runs, and put back if the block fails or is interrupted, so that
    ``folder`` holds the earlier run's outputs or this run's, never some of each. What a killed run left aside is
    put back first. Call it holding ``output_lock(folder)``."""
    folder = Path(folder)
    put_back_set_aside(folder)
    present = [path for path in outputs if os.path.lexists(path)]
    aside = temp_sibling(folder, "aside")
    with signals_deferred():
        aside.mkdir(parents=True)
        for path in present:
            os.rename(path, aside / path.name)
    try:
        yield
    except BaseException:
        with signals_deferred():
            for path in outputs:  # this run's, unfinished
                if os.path.lexists(path):
                    _remove(path)
            _put_back(aside, folder)
        raise
    with signals_deferred():  # renamed first: a run killed while this is removed is not put back
        spent = temp_sibling(folder, "spent")
        os.rename(aside, spent)
    shutil.rmtree(spent, ignore_errors=True)


def put_back_set_aside(folder: Path) -> None:
    """Put back what a run killed inside ``replaced_together`` had moved aside (its new outputs, unfinished, are
    replaced), and remove what a killed run had finished with."""
    folder = Path(folder)
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(aside|spent)-(\d+)-[0-9a-f]{{8}}")
    try:
        entries = sorted(folder.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or _pid_alive(int(found.group(2))) or not entry.is_dir() or entry.is_symlink():
            continue
        if found.group(1) == "aside":
            _put_back(entry, folder)
            logger.warning("put back the outputs a killed bertopt (pid %s) was replacing in %s", found.group(2),
                           folder)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _put_back(aside: Path, folder: Path) -> None:
    for moved in sorted(aside.iterdir()):
        target = folder / moved.name
        if os.path.lexists(target):
            _remove(target)
        os.rename(moved, target)
    aside.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def process_scratch(what: str) -> Path:
    """A new folder ``$TMPDIR/bertopt-WHAT-*`` removed when this process exits (normally, by an exception, by
    SIGINT or SIGTERM through the CLI's handlers; a SIGKILL leaves it to the system's temp cleaning)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"bertopt-{what}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # at exit there is no one left to tell
    return folder


def check_links_inside(folder: Path, what: str) -> None:
    """Refuse a folder holding a symbolic link that points outside it: its target would be copied into (and
    hashed as part of) whatever is made from the folder."""
    folder = Path(folder)
    root = folder.resolve()
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                target = entry.resolve()
                if target != root and root not in target.parents:
                    rel = entry.relative_to(folder)
                    raise UserError(f"{what} {folder}: {rel} is a symbolic link to {os.readlink(entry)}, outside "
                                    "the folder; replace the link with the file itself or re-create the artifact")


def _plain(value: Any) -> Any:
    """A value JSON does not know: numpy scalars and arrays as numbers and lists, anything else as its string."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written to a temp file and renamed into place (a reader never sees
    half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_plain) + "\n", encoding="utf-8")
    os.replace(tmp, path)
