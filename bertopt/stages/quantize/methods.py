"""How the quantize stage is put together: one method per precision and runtime, each with its own options.

A method module (``fp16.py``, ``onnxruntime_int8.py``, ``openvino_int8.py``, ...) declares ``METHODS``: one
:class:`Method` per (``mode``, ``runtime``) pair it implements, with the parameter group that only it reads and
the function that makes the artifact. The stage (``stage.py``) lists the method modules and declares the options
every method shares; :func:`compose` turns that into the stage's ``PARAMS``: every option once, so the CLI, recipes
and the Python API see one flat parameter list, plus :meth:`MethodParams.resolve`, which
:func:`bertopt.params.resolve_config` calls: it picks the method from ``mode`` and ``runtime`` and refuses an
option given for another method (one line naming the option, the methods it belongs to and the fix). An option
that does not apply is ``None`` in the resolved config (and so in the artifact's lineage). So is an option a method
reads only with another (:class:`ReadWith`: the calibration text without static int8, GPTQ, smoothing or the
accuracy search; ``--smooth-roles`` without ``--smooth-alpha``), and given there it is refused the same way.

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


@dataclass(frozen=True)
class ReadWith:
    """An option the methods that take it read only when one of ``triggers`` holds: (option name, value) pairs,
    value None for any value given (a switch: on). Where none holds the option would change nothing: it is None in
    the resolved config, and refused when given (naming the triggers the picked method has)."""
    name: str
    triggers: tuple[tuple[str, Any], ...]


def _holds(value: Any, wanted: Any) -> bool:
    return value is not None and value is not False if wanted is None else value == wanted


def _either(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


class MethodParams(list):
    """A quantize stage's ``PARAMS``: the selectors (``mode``, ``runtime``), the shared options and every method's
    group, each option once; a method's option's help starts with the methods it applies to."""

    def __init__(self, mode: Param, runtime: Param, shared: Sequence[Param], methods: Sequence[Method],
                 read_with: Sequence[ReadWith] = ()):
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
        self.by_name = {p.name: p for p in self}
        for rule in read_with:
            unknown = [n for n in (rule.name, *(t for t, _ in rule.triggers)) if n not in self.by_name]
            if unknown:
                raise ValueError(f"quantize option '{unknown[0]}' of a ReadWith rule is not declared")
        self.read_with = tuple(read_with)

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
        applies = self._applies(method)
        named = {str(k).replace("-", "_") for k, v in (given or {}).items() if v is not None}
        for p in self:
            if p.name in named and p.name not in applies:
                raise UserError(f"{where}: {self._not_for(p, config[p.name], method)}")
        config = {k: (v if k in applies else None) for k, v in config.items()}
        for rule in self.read_with:
            if rule.name not in applies or any(_holds(config[n], v) for n, v in rule.triggers):
                continue
            if rule.name in named:
                raise UserError(f"{where}: {self._unread(rule, config[rule.name], method)}")
            config[rule.name] = None  # not read: the lineage says so
        return config

    def _applies(self, method: Method) -> set[str]:
        return {p.name for p in (*self.common, *method.params)}

    def _no_method(self, mode: str, runtime: str) -> str:
        modes = [m.mode for m in self.methods.values() if m.runtime == runtime]
        runtimes = [m.runtime for m in self.methods.values() if m.mode == mode]
        fix = (f"use --runtime {' or --runtime '.join(runtimes)} for --mode {mode}" if runtimes
               else f"choose --mode {' or --mode '.join(modes)}")
        return f"--runtime {runtime} quantises with --mode {' or --mode '.join(modes)}, not --mode {mode}; {fix}"

    @staticmethod
    def _shown(p: Param, value: Any) -> str:
        """The option with ``value`` as a user types it: --per-token, --no-per-channel, --op-types MatMul,Gemm."""
        if p.type is bool:
            return p.cli_flag if value else f"--no-{p.cli_flag[2:]}"
        return f"{p.cli_flag} {','.join(value) if isinstance(value, list) else value}"

    def _not_for(self, p: Param, value: Any, method: Method) -> str:
        owners = self.owners[p.name]
        shown = self._shown(p, value)
        return (f"{shown} applies to {self._flags(owners)} only ({', '.join(m.title for m in owners)}), not to "
                f"{self.flags(method)} ({method.title}); drop {shown.split()[0]}")

    def _unread(self, rule: ReadWith, value: Any, method: Method) -> str:
        """The line refusing ``rule``'s option given where none of its triggers holds: the triggers that would make
        ``method`` read it (a mode that always reads it is named apart), and the fix."""
        applies = self._applies(method)
        live = [(n, v) for n, v in rule.triggers if n in applies]
        selectors = [f"--{n} {v}" for n, v in live if n in ("mode", "runtime")]
        options = [self.by_name[n].cli_flag if v is None else self._shown(self.by_name[n], v)
                   for n, v in live if n not in ("mode", "runtime")]
        shown = self._shown(self.by_name[rule.name], value)
        flag = shown.split()[0]
        picked = f"{self.flags(method)} ({method.title})"
        unlike = f", unlike {_either(selectors)}" if selectors else ""
        if not options:
            return f"{shown} would be ignored: {picked} does not read it{unlike}; drop {flag}"
        add = options[0] if len(options) == 1 else "one of them"
        return (f"{shown} would be ignored: {picked} reads it only with {_either(options)}{unlike}; add {add} or drop "
                f"{flag}")


def compose(mode_help: str, default_mode: str, runtime_help: str, default_runtime: str, shared: Sequence[Param],
            method_modules: Sequence[Any], read_with: Sequence[ReadWith] = ()) -> MethodParams:
    """The stage's PARAMS from the method modules (each with ``METHODS``), the shared options and the options read
    only with another (``read_with``); the choices of ``mode`` and ``runtime`` are those the methods implement."""
    methods = [m for module in method_modules for m in module.METHODS]
    modes = tuple(dict.fromkeys(m.mode for m in methods))
    runtimes = tuple(dict.fromkeys(m.runtime for m in methods))
    mode = Param("mode", str, default_mode, mode_help, choices=modes)
    runtime = Param("runtime", str, default_runtime, runtime_help, choices=runtimes)
    return MethodParams(mode, runtime, shared, methods, read_with)
