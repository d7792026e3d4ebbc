"""One way to fail: the exit-code contract of every ``bertopt`` command.

* 0: success.
* ``GateFailed``: a release-gate threshold was missed. The CLI prints one line and exits 1.
* ``UserError``: bad input or usage (a click usage error too). The CLI prints one line and exits 2; nothing is
  half-written.
* ``BackendFailed``: a long-running command's backend (a model server, a Spark job, a broker) failed after the
  command started, through no fault of the input. The CLI prints one line and exits 3.
* Interrupted: SIGINT (Ctrl-C) exits 130 with the line "interrupted"; SIGTERM raises ``Terminated`` (the CLI
  installs the handler) and exits 143 with the line "terminated". Either way temporary output is removed on the
  way out. A command that handles its own signals (serve, kafka: stop gracefully) exits 0 after a clean stop.
  The CLI also remembers a SIGINT (``INTERRUPTED``): Python drops an exception raised where it cannot propagate
  (a KeyboardInterrupt inside an import lock's callback: "Exception ignored in ..."), and such a lost interrupt
  let a gate run on, write its report and exit 0. Every writer calls ``check_interrupted()`` before it renames
  its output into place, and the CLI exits 130 whenever one arrived. An error a library raised from the interrupt
  (torch's "trying to pop from empty mode stack") is reported the same way, not as a traceback with exit 1.
* Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# set by the CLI's SIGINT handler (bertopt.cli): an interrupt stays known even where its exception was swallowed
INTERRUPTED = threading.Event()


def check_interrupted() -> None:
    """Raise KeyboardInterrupt when a SIGINT arrived: called by every writer just before its output is renamed
    into place, so nothing is written after an interrupt even where a library swallowed the first exception."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


# signals the CLI's handlers hold back while an output is swapped into place (signals_deferred)
_DEFERRED: dict = {"depth": 0, "pending": None}


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold a SIGINT / SIGTERM that arrives inside the block (through the CLI's handlers) until the block ends,
    then raise it: a few renames that must happen together (an old output moved aside, the new one moved in) are
    not cut in two. Where the block fails, its own exception goes on (the interrupt stays known: INTERRUPTED)."""
    _DEFERRED["depth"] += 1
    try:
        yield
    finally:
        _DEFERRED["depth"] -= 1
        pending = _DEFERRED["pending"] if _DEFERRED["depth"] == 0 else None
        if pending is not None:
            _DEFERRED["pending"] = None
    if pending is not None:
        raise pending


def defer_signal(exc: BaseException) -> bool:
    """For a signal handler: True (and ``exc`` kept to raise when the block ends) inside ``signals_deferred`` on
    the main thread, where the handlers run; False: raise it now."""
    if _DEFERRED["depth"] > 0 and threading.current_thread() is threading.main_thread():
        _DEFERRED["pending"] = _DEFERRED["pending"] or exc
        return True
    return False


def _inside_import_or_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside an ``import`` (a module's body, called by importlib) or a finalizer (an
    object's ``__del__``, a ``weakref.finalize`` callback: the garbage collector runs them wherever it runs)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__" or \
                (code.co_name in ("__call__", "_exitfunc") and code.co_filename.endswith("weakref.py")):
            return True
        frame = frame.f_back
    return False


def hold_signal(exc: BaseException, signum: int, frame) -> bool:
    """For the CLI's signal handlers: True where ``exc`` must not be raised now. Inside ``signals_deferred`` it is
    kept for the block's end; inside an import or a finalizer the signal is sent again 50 ms later, until it is
    done. Raised in a module's body while native code runs it (torch's C++ initialisers call back into Python), it
    went through pybind11 into std::terminate (exit 134, no ``finally`` run, the output lock left behind); raised
    in a ``__del__`` (the ``regex`` module's, as the collector ran it during ``bertopt tune``), Python cannot
    propagate it: it printed "Exception ignored in ..." with a traceback and the interrupt was lost."""
    if defer_signal(exc):
        return True
    if _inside_import_or_finalizer(frame):
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return True
    return False


class UserError(Exception):
    """A problem the user can fix: the message names the problem and the fix."""

    exit_code = 2


class MissingDependency(UserError):
    """An optional dependency is not installed."""

    def __init__(self, module: str, extra: str, what: str = ""):
        purpose = f" (needed for {what})" if what else ""
        super().__init__(
            f"Python package '{module}' is not installed{purpose}; "
            f"install it with: pip install 'bertopt[{extra}]'"
        )
        self.module = module
        self.extra = extra


class ModelRunError(UserError):
    """A model's graph failed inside its runtime (ONNX Runtime, OpenVINO): an operator it cannot run, a tensor it
    cannot allocate (a hand-made graph asking 40 GB), inputs of another type. The graph is the user's input, so
    this is one line and exit 2, not a traceback (exit 1 reads as "gate failed")."""

    @classmethod
    def of(cls, what: str, runtime: str, exc: BaseException | str) -> "ModelRunError":
        text = " ".join(str(exc).split())
        # ONNX Runtime prefixes "[ONNXRuntimeError] : 1 : FAIL : " and a kernel's failure "... Status Message:
        # /onnxruntime_src/...cc:360 void* Function(args) ": the reason is what follows
        reason = text.rsplit(" : ", 1)[-1] if text.startswith("[ONNXRuntimeError]") else text
        reason = reason.rsplit("Status Message: ", 1)[-1]
        if reason.startswith("/") and ") " in reason:
            reason = reason.split(") ", 1)[1]
        return cls(f"{what} failed to run in {runtime}: {reason[:300] or 'no reason given'}; the graph cannot run "
                   "as given: re-export the model (bertopt export from its Hugging Face folder)")


def is_runtime_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from ONNX Runtime's or OpenVINO's native code (not bertopt's own, nor an interrupt)."""
    module = type(exc).__module__ or ""
    return module.startswith(("onnxruntime", "openvino")) or type(exc) is RuntimeError


class ArtifactError(UserError):
    """An artifact folder is missing, incomplete or tampered with."""


class GateFailed(Exception):
    """A validation threshold was not met."""

    exit_code = 1


class BackendFailed(Exception):
    """A long-running command's backend failed after the command started (a serve cluster that stops answering,
    a Spark job or a broker that fails): not a usage error (2) and not a failed gate (1). Raise it with one line
    naming what failed and what to look at; the CLI prints it and exits 3, so a supervisor or CI sees the
    failure instead of a clean exit."""

    exit_code = 3


class Terminated(BaseException):
    """SIGTERM arrived (the CLI's handler raises it): a BaseException, like KeyboardInterrupt, so that ``except
    Exception`` does not swallow it and every ``with``/``finally`` on the way out removes its temporary output."""

    exit_code = 143


def require(module: str, extra: str, what: str = ""):
    """Import an optional dependency or raise a MissingDependency naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # only the missing-module case becomes a user error
        if exc.name and exc.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingDependency(module, extra, what) from exc


ORT_EXTRAS = ("cpu", "gpu")  # the two builds of ONNX Runtime, one pyproject extra each; bertopt itself needs neither


class MissingRuntime(MissingDependency):
    """Neither ONNX Runtime build is installed: the one line names both extras, since which one fits is the
    machine's choice (the CPU wheel, or onnxruntime-gpu for an NVIDIA GPU)."""

    def __init__(self, module: str, what: str = ""):
        purpose = f" (needed for {what})" if what else ""
        UserError.__init__(self, f"ONNX Runtime is not installed{purpose}; install it with: pip install "
                                 "'bertopt[cpu]' (or 'bertopt[gpu]' on a machine with an NVIDIA GPU)")
        self.module = module
        self.extra = "cpu"


def require_onnxruntime(what: str = "", module: str = "onnxruntime"):
    """Import ONNX Runtime (or one of its modules: ``onnxruntime.quantization``, ``onnxruntime.transformers...``);
    the one way bertopt imports it, so that a missing runtime is one line naming the extras ``cpu`` and ``gpu``."""
    try:
        return require(module, "cpu", what)
    except MissingDependency as exc:
        raise MissingRuntime(module, what) from exc.__cause__


def check_writable(path, flag: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be created: a parent that is a file, or a folder
    this process may not write (probed by creating and removing a file, which also catches read-only file
    systems and root on /proc)."""
    import os
    import tempfile
    from pathlib import Path

    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        return  # the caller decides what to do with an existing file (usually: refuse it by name)
    probe = _nearest_existing(target)
    if not probe.is_dir():
        raise UserError(f"{flag} {path}: {probe} is a file, so the folder cannot be created there; "
                        f"choose another {flag}")
    try:
        fd, name = tempfile.mkstemp(prefix=".bertopt-write-check-", dir=probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"{flag} {path} is not writable ({reason} in {probe}); choose a folder you can "
                        "write to") from None
    os.close(fd)
    os.unlink(name)


# the file system is full (or a quota / file size limit is reached): the user frees space or writes elsewhere
_NO_SPACE_ERRNOS = {"ENOSPC", "EDQUOT", "EFBIG"}
LOW_SPACE_BYTES = 1 << 20  # a write failing with less than this free beside it failed for want of space


def out_of_space(exc: BaseException, folder) -> str | None:
    """Why writing into ``folder`` failed, when it failed for want of space: an OSError saying so, or any error
    (a library's own, like OpenVINO's save_model) raised while the file system holding ``folder`` has almost no
    space left. None otherwise."""
    import errno
    import shutil
    from pathlib import Path

    codes = {getattr(errno, name) for name in _NO_SPACE_ERRNOS if hasattr(errno, name)}
    seen: BaseException | None = exc
    while seen is not None:  # a library may wrap the OSError
        if isinstance(seen, OSError) and seen.errno in codes:
            return seen.strerror or type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    try:
        free = shutil.disk_usage(_nearest_existing(Path(folder).absolute())).free
    except OSError:
        return None
    return f"no space left on the device ({free} bytes free)" if free < LOW_SPACE_BYTES else None


def _nearest_existing(path):
    """``path`` or its nearest ancestor that exists (the folder a new output would be created in)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
