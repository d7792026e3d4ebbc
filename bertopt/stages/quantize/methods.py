"""How the quantize stage is put together: one method per precision and runtime, each with its own options.

A method module (``fp16.py``, ``onnxruntime_int8.py``, ``openvino_int8.py``, ...) declares ``METHODS``: one
:class:`Method` per (``mode``, ``runtime``) pair it implements, with the parameter group that only it reads and
the function that makes the artifact. The stage (``stage.py``) lists the method modules and declares the options
every method shares; :func:`compose` turns that into the stage's ``PARAMS``: every option once, so the CLI, recipes
and the Python API see one flat parameter list, plus :meth:`MethodParams.resolve`, which
:func:`bertopt.params.resolve_config` calls: it picks the method from ``mode`` and ``runtime`` and refuses an
option given for another method (one line naming the option, the methods it belongs to and the fix). An option
that does not apply is ``None`` in the resolved config (and so in the artifact's lineage).

A parameter two methods read (per-channel scales, GPTQ rounding, smoothing) is one ``Param`` object placed in
both groups; two different ``Param`` objects with one name are a declaration error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from bertopt.errors import UserError
from bertopt.params import Param, resolve_config


@dataclass(frozen=True)
class Method:
    title: str  # how help and messages name it: "ONNX Runtime dynamic int8"
    mode: str  # the value of --mode that picks it (with runtime)
    runtime: str  # the value of --runtime that picks it
    params: tuple[Param, ...]  # the options only this method (or a few, sharing the same Param) reads
    run: Callable[..., Any]  # run(artifact, config, out_dir, overwrite) -> Artifact


class MethodParams(list):
    """A quantize stage's ``PARAMS``: the selectors (``mode``, ``runtime``), the shared options and every method's
    group, each option once; a method's option's help starts with the methods it applies to."""

    def __init__(self, mode: Param, runtime: Param, shared: Sequence[Param], methods: Sequence[Method]):
        self.methods = {(m.mode, m.runtime): m for m in methods}
        if len(self.methods) != len(methods):
            raise ValueError("two quantize methods share one mode and runtime")
        self.default_runtime = runtime.default
        self.common = (mode, runtime, *shared)
        declared: dict[str, Param] = {p.name: p for p in self.common}
        if len(declared) != len(self.common):
            raise ValueError("a quantize option is declared twice among the shared options")
        self.owners: dict[str, list[Method]] = {}
        for m in methods:
            for p in m.params:
                if any(p.name == c.name for c in self.common):
                    raise ValueError(f"quantize option '{p.name}' is shared by every method; leave it out of "
                                     f"{m.title}'s group")
                if p.name in declared and declared[p.name] is not p:
                    raise ValueError(f"quantize option '{p.name}' is declared twice; share one Param object")
                declared[p.name] = p
                self.owners.setdefault(p.name, []).append(m)
        super().__init__([*self.common, *(declared[name].with_(help=f"Only with {self._flags(owners)}. "
                                                                    f"{declared[name].help}")
                                          for name, owners in self.owners.items())])

    def flags(self, method: Method) -> str:
        """The options that pick ``method`` as a user types them (the default runtime left out)."""
        return f"--mode {method.mode}" + ("" if method.runtime == self.default_runtime
                                          else f" --runtime {method.runtime}")

    def _flags(self, methods: Iterable[Method]) -> str:
        return " or ".join(self.flags(m) for m in methods)

    def method(self, config: dict[str, Any]) -> Method:
        """The method a resolved config picks; a mode and runtime no method implements is refused here, when the
        stage runs (a ``bertopt tune`` candidate for a method this build lacks fails alone, not the whole tune)."""
        method = self.methods.get((config["mode"], config["runtime"]))
        if method is None:
            raise UserError(self._no_method(config["mode"], config["runtime"]))
        return method

    def resolve(self, given: dict[str, Any] | None, where: str) -> dict[str, Any]:
        """``resolve_config`` for this declaration: types, bounds and names as for any Param list, then the method
        from mode and runtime; an option of another method is refused, and every option the method does not read
        is None."""
        config = resolve_config(list(self), given, where)
        method = self.methods.get((config["mode"], config["runtime"]))
        if method is None:
            return config  # refused by method() when the stage runs
        applies = {p.name for p in (*self.common, *method.params)}
        named = {str(k).replace("-", "_") for k, v in (given or {}).items() if v is not None}
        for p in self:
            if p.name in named and p.name not in applies:
                raise UserError(f"{where}: {self._not_for(p, config[p.name], method)}")
        return {k: (v if k in applies else None) for k, v in config.items()}

    def _no_method(self, mode: str, runtime: str) -> str:
        modes = [m.mode for m in self.methods.values() if m.runtime == runtime]
        runtimes = [m.runtime for m in self.methods.values() if m.mode == mode]
        fix = (f"use --runtime {' or --runtime '.join(runtimes)} for --mode {mode}" if runtimes
               else f"choose --mode {' or --mode '.join(modes)}")
        return f"--runtime {runtime} quantises with --mode {' or --mode '.join(modes)}, not --mode {mode}; {fix}"

    def _not_for(self, p: Param, value: Any, method: Method) -> str:
        owners = self.owners[p.name]
        if p.type is bool:
            shown = p.cli_flag if value else f"--no-{p.cli_flag[2:]}"
        else:
            shown = f"{p.cli_flag} {','.join(value) if isinstance(value, list) else value}"
        return (f"{shown} applies to {self._flags(owners)} only ({', '.join(m.title for m in owners)}), not to "
                f"{self.flags(method)} ({method.title}); drop {shown.split()[0]}")


def compose(mode_help: str, default_mode: str, runtime_help: str, default_runtime: str, shared: Sequence[Param],
            method_modules: Sequence[Any]) -> MethodParams:
    """The stage's PARAMS from the method modules (each with ``METHODS``) and the shared options; the choices of
    ``mode`` and ``runtime`` are those the methods implement."""
    methods = [m for module in method_modules for m in module.METHODS]
    modes = tuple(dict.fromkeys(m.mode for m in methods))
    runtimes = tuple(dict.fromkeys(m.runtime for m in methods))
    mode = Param("mode", str, default_mode, mode_help, choices=modes)
    runtime = Param("runtime", str, default_runtime, runtime_help, choices=runtimes)
    return MethodParams(mode, runtime, shared, methods)
