"""One way to fail.

* ``UserError``: bad input or usage. The CLI prints one line and exits 2.
* ``GateFailed``: a release-gate threshold was missed. The CLI exits 1.
* Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


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


class ArtifactError(UserError):
    """An artifact folder is missing, incomplete or tampered with."""


class GateFailed(Exception):
    """A validation threshold was not met."""

    exit_code = 1


def require(module: str, extra: str, what: str = ""):
    """Import an optional dependency or raise a MissingDependency naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # only the missing-module case becomes a user error
        if exc.name and exc.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingDependency(module, extra, what) from exc


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
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
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


class BackendFailed(Exception):
    """A long-running command's backend failed."""

    exit_code = 3
