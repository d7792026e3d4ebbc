"""The two plug-in mechanisms of bertopt, stated once.

* :class:`Registry` — implementations registered by name with a decorator (runtime backends, the format handlers
  of stages, reference builders, the gate's runner checks, the TF converter's op handlers). A name is taken once;
  a lookup of an unknown name is one line naming the known ones.
* :func:`import_optional` / :class:`LazyModules` — modules named in a list and imported when first needed (stage
  modules, the commands of the CLI, extensions, optional backends), so ``bertopt --help`` imports nothing heavy.

Ground layer: imports nothing of bertopt but ``errors``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Generic, Iterable, Iterator, Mapping, TypeVar

from bertopt.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one ``kind`` (the word the error messages use), filled by :meth:`register`.

    ``load`` (optional) imports the modules that register here; it runs before the first lookup, so the layer
    that owns the registry never imports the parts that plug into it.
    """

    def __init__(self, kind: str, load: Callable[[], object] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._load = load
        self._loaded = load is None

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator registering its target under each of ``names``; a name another implementation holds is
        refused (the same definition imported again, as by a reload, replaces itself)."""
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")

        def deco(entry: T) -> T:
            for name in names:
                held = self._entries.get(name)
                if held is not None and _origin(held) != _origin(entry):
                    raise ValueError(f"{self.kind} '{name}' is registered twice: {_origin(held)} and "
                                     f"{_origin(entry)}")
                self._entries[name] = entry
            return entry

        return deco

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._load()
            self._loaded = True

    def find(self, name: str) -> T | None:
        """The implementation registered as ``name``, or None."""
        self._ensure_loaded()
        return self._entries.get(name)

    def get(self, name: str) -> T:
        """The implementation registered as ``name``; an unknown name is a UserError listing the known ones."""
        entry = self.find(name)
        if entry is None:
            known = ", ".join(self.names()) or "none"
            raise UserError(f"unknown {self.kind} '{name}'; known {self.kind}s: {known}")
        return entry

    def names(self) -> list[str]:
        self._ensure_loaded()
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        self._ensure_loaded()
        return sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._entries)


def _origin(entry: object) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


def import_optional(module: str) -> ModuleType | None:
    """Import ``module``; None when that module itself is absent (an optional part not installed), while a
    missing dependency inside it still raises (its own ``require`` says which extra to install)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None


def import_all(modules: Iterable[str], optional: bool = False) -> list[ModuleType]:
    """Import each of ``modules`` in order (registrations run on import); ``optional`` skips absent ones."""
    if not optional:
        return [importlib.import_module(m) for m in modules]
    return [m for m in map(import_optional, modules) if m is not None]


class LazyModules:
    """A table ``name -> module path`` of one ``kind``, each module imported on its first lookup."""

    def __init__(self, kind: str, modules: Mapping[str, str]):
        self.kind = kind
        self.modules = dict(modules)

    def names(self) -> list[str]:
        """The names, in the table's order."""
        return list(self.modules)

    def get(self, name: str) -> ModuleType:
        if name not in self.modules:
            raise UserError(f"unknown {self.kind} '{name}'; known {self.kind}s: {', '.join(self.modules)}")
        return importlib.import_module(self.modules[name])

    def __contains__(self, name: object) -> bool:
        return name in self.modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)
