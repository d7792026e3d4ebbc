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
