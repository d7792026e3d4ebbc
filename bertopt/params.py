"""Parameters declared once (name, type, default, help) and reused by the CLI, recipes and the API.

A stage module exposes ``PARAMS: list[Param]``. ``resolve_config`` turns whatever the caller gave
(CLI options, a recipe step's mapping, API keyword arguments) into a checked, complete config dict.
``typer_parameters`` builds a generated command's options from Params; ``Param.typer_option`` one option of a
hand-written command. The runtime settings every command that runs a model shares (provider, threads, batch
size, max sequence length, runtime) are declared here once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from bertopt.errors import UserError


@dataclass(frozen=True)
class Param:
    name: str
    type: type  # str, int, float, bool, list (of str)
    default: Any
    help: str
    choices: Sequence[str] | None = None
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)  # returns an error or None
    min: float | None = None  # numeric bounds (inclusive), checked wherever the value comes from
    max: float | None = None
    file: bool = False  # names an input file: a recipe checks it exists before its first stage runs

    @property
    def cli_flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def cli_help(self) -> str:
        return self.help + (f" Choices: {', '.join(self.choices)}." if self.choices else "")

    def with_(self, **changes: Any) -> "Param":
        """The same parameter with some fields changed (a feature that allows fewer choices, say)."""
        return replace(self, **changes)

    def typer_option(self, *aliases: str, flag: str | None = None):
        """This parameter as an option of a hand-written Typer command (its default, flag and help)."""
        import typer

        bounds = {k: v for k, v in (("min", self.min), ("max", self.max)) if v is not None}
        return typer.Option(self.default, flag or self.cli_flag, *aliases, help=self.cli_help, **bounds)

    def coerce(self, value: Any, where: str) -> Any:
        if value is None:
            return None
        try:
            if self.type is bool:
                if isinstance(value, str):
                    low = value.lower()
                    if low in ("true", "yes", "1", "on"):
                        return True
                    if low in ("false", "no", "0", "off"):
                        return False
                    raise ValueError(value)
                if not isinstance(value, bool):
                    raise ValueError(value)
                return value
            if self.type is list:
                if isinstance(value, str):
                    items = [v.strip() for v in value.split(",") if v.strip()]
                elif isinstance(value, (list, tuple)):
                    items = [str(v) for v in value]
                else:
                    raise ValueError(value)
                out = items
                return self._checked(out, where)
            if self.type is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if self.type in (int, float) and isinstance(value, bool):
                raise ValueError(value)
            out = self.type(value)
        except (TypeError, ValueError):
            raise UserError(
                f"{where}: '{self.name}' must be {self.type.__name__}, got {value!r}"
            ) from None
        if self.choices is not None and out not in self.choices:
            raise UserError(
                f"{where}: '{self.name}' must be one of {', '.join(self.choices)}; got {out!r}"
            )
        return self._checked(out, where)

    def _checked(self, value: Any, where: str) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != value:  # NaN passes every comparison
                raise UserError(f"{where}: '{self.name}' must be a number, got nan")
            if value in (float("inf"), float("-inf")):  # inf passes every upper bound: a check switched off
                raise UserError(f"{where}: '{self.name}' must be a finite number, got {value}")
            low, high = self.min, self.max
            if (low is not None and value < low) or (high is not None and value > high):
                span = (f"between {low:g} and {high:g}" if low is not None and high is not None
                        else f"at least {low:g}" if low is not None else f"at most {high:g}")
                raise UserError(f"{where}: '{self.name}' must be {span}, got {value:g}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise UserError(f"{where}: '{self.name}' {problem}")
        return value


_OPTION_TYPES = {str: Optional[str], int: Optional[int], float: Optional[float], list: Optional[str]}


def typer_parameters(params: Sequence[Param]) -> list[inspect.Parameter]:
    """Keyword-only Typer options for ``params`` (a generated command's signature: stage commands, validate);
    each defaults to None, so only what the user gave reaches ``resolve_config``."""
    import typer

    out = []
    for p in params:
        if p.type is bool:
            option = typer.Option(None, f"{p.cli_flag}/--no-{p.cli_flag[2:]}", show_default=False,
                                  help=p.cli_help + f" (default: {'on' if p.default else 'off'})")
            annotation = Optional[bool]
        else:
            default = ",".join(p.default) if isinstance(p.default, list) else p.default
            option = typer.Option(None, p.cli_flag, show_default=False,
                                  help=p.cli_help + (f" (default: {default})" if default is not None else ""))
            annotation = _OPTION_TYPES[p.type]
        out.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option))
    return out


PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")
PROVIDER = Param("provider", str, "auto", "Execution provider (auto: CUDA when the runtime has it, else CPU).",
                 choices=PROVIDERS)
THREADS = Param("threads", int, None, "CPU threads per model session (default: every core this process may use).",
                min=1)
BATCH_SIZE = Param("batch_size", int, 32, "Texts per model call (length-bucketed: texts are sorted by length "
                   "first).", min=1)
MAX_SEQ_LEN = Param("max_seq_len", int, None, "Truncate texts to this many tokens (default: the artifact's).",
                    min=1)
RUNTIME = Param("runtime", str, None, "Run with this backend instead of the one in the artifact's manifest "
                "(onnxruntime, openvino, tensorflow).")


def resolve_config(params: Sequence[Param], given: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Complete and check a config; unknown keys are an error naming the key and the known ones. A declaration
    with a ``resolve(given, where)`` of its own (the quantize stage's per-method groups) resolves itself."""
    if hasattr(params, "resolve"):
        return params.resolve(given, where)
    given = dict(given or {})
    known = {p.name: p for p in params}
    # accept the CLI spelling (max-seq-len) as well as the Python one (max_seq_len)
    normalised = {}
    for key, value in given.items():
        normalised[str(key).replace("-", "_")] = value
    unknown = sorted(set(normalised) - set(known))
    if unknown:
        raise UserError(
            f"{where}: unknown parameter '{unknown[0]}'; known parameters: "
            + (", ".join(sorted(known)) or "none")
        )
    config = {}
    for p in params:
        value = normalised.get(p.name, p.default)
        config[p.name] = p.coerce(value, where) if value is not None else None
    return config


def check_input_files(params: Sequence[Param], config: dict[str, Any], where: str) -> None:
    """Every parameter that names an input file must name one that exists (checked before any work)."""
    from pathlib import Path

    for p in params:
        value = config.get(p.name)
        if p.file and value and value != "builtin" and not Path(str(value)).is_file():
            what = "a folder" if Path(str(value)).is_dir() else "not found"
            raise UserError(f"{where}: '{p.name}' file {value} is {what}; give an existing file")
