"""Parameters declared once (name, type, default, help) and reused by the CLI, recipes and the API.

A stage module exposes ``PARAMS: list[Param]``. ``resolve_config`` turns whatever the caller gave
(CLI options, a recipe step's mapping, API keyword arguments) into a checked, complete config dict.
``typer_command`` / ``typer_parameters`` build every command's arguments and options from Params (the one
Param -> Typer builder), so a bad value gets the same one-line message from the CLI, a recipe or the API. The
runtime settings every command that runs a model shares (provider, threads, batch size, max sequence length,
runtime) are declared here once.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Sequence

from bertopt.errors import UserError


def not_blank(fix: str) -> Callable[[Any], str | None]:
    """A ``Param`` check refusing an empty or blank value, the message ending in ``fix`` (what to give instead)."""

    def check(value: Any) -> str | None:
        return None if value is None or str(value).strip() else f"is empty; {fix}"

    return check


# an empty path is refused: ``Path('')`` is the current folder, never what an empty --out meant
path_given = not_blank("give a path")


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
    # how the command line spells it (typer_parameters); recipes and the API use ``name``
    flag: str | None = None  # the long flag when it is not --<name> (e.g. --json for as_json)
    aliases: tuple[str, ...] = ()  # short flags, e.g. ("-p",)
    envvar: str | None = None  # read from this environment variable when the flag is not given
    negatable: bool = True  # bool: --x/--no-x (False: a plain --x switch)
    repeat: bool = False  # list: given by repeating the flag (-X a -X b) instead of comma-separated
    positional: bool = False  # a command-line argument, not an option
    required: bool = False  # no default: the caller must give it
    hidden: bool = False  # accepted but left out of --help
    deprecated_flags: tuple[str, ...] = ()  # old option spellings of a positional argument, still accepted
    metavar: str | None = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def cli_name(self) -> str:
        """How an error line names it to a command-line user: ARTIFACT for an argument, the flag for an option."""
        return self.metavar or self.name.upper() if self.positional else self.cli_flag

    @property
    def cli_help(self) -> str:
        return self.help + (f" Choices: {', '.join(self.choices)}." if self.choices else "")

    @property
    def span(self) -> str:
        """The numeric bounds in words ('' when there are none), for messages and --help."""
        low, high = self.min, self.max
        if low is not None and high is not None:
            return f"between {low:g} and {high:g}"
        return f"at least {low:g}" if low is not None else f"at most {high:g}" if high is not None else ""

    def with_(self, **changes: Any) -> "Param":
        """The same parameter with some fields changed (a feature that allows fewer choices, say)."""
        return replace(self, **changes)

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
            if self.type is str and isinstance(value, (list, tuple, dict, set)):  # a recipe's [x] is no name
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
                shown = value if isinstance(value, int) else format(value, "g")
                raise UserError(f"{where}: '{self.name}' must be {self.span}, got {shown}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise UserError(f"{where}: '{self.name}' {problem}")
        return value


_OPTION_TYPES = {str: Optional[str], int: Optional[int], float: Optional[float], list: Optional[str]}


def _deprecated_key(p: Param) -> str:
    return f"{p.name}__deprecated_option"


def typer_parameters(params: Sequence[Param]) -> list[inspect.Parameter]:
    """Typer arguments and options for ``params`` (a command's signature: stages, validate, serve, kafka,
    spark-predict, bench): arguments first, then keyword-only options. Each defaults to None, so only what the user
    gave reaches ``resolve_config``, which applies defaults and checks (one declaration: one message, CLI or API)."""
    import typer

    args, options = [], []
    for p in params:
        if p.positional:
            many = p.type is list
            default = ... if p.required and not p.deprecated_flags else None
            argument = typer.Argument(default, help=p.cli_help, show_default=False, metavar=p.cli_name)
            args.append(inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                          annotation=Optional[List[str]] if many else Optional[str],
                                          default=argument))
            if p.deprecated_flags:  # the old spelling: accepted, hidden, and answered with a deprecation line
                old = typer.Option(None, *p.deprecated_flags, hidden=True, show_default=False)
                options.append(inspect.Parameter(_deprecated_key(p), inspect.Parameter.KEYWORD_ONLY,
                                                 annotation=Optional[str], default=old))
            continue
        common = dict(show_default=False, hidden=p.hidden, envvar=p.envvar, metavar=p.metavar)
        if p.type is bool:
            flags = f"{p.cli_flag}/--no-{p.cli_flag[2:]}" if p.negatable else p.cli_flag
            option = typer.Option(None, flags, *p.aliases, help=p.cli_help + (
                f" (default: {'on' if p.default else 'off'})" if p.negatable else ""), **common)
            annotation = Optional[bool]
        else:
            default = ",".join(p.default) if isinstance(p.default, list) else p.default
            notes = [f"default: {default}"] if default not in (None, "") and not p.required else []
            notes += [p.span] if p.span else []
            shown = f" ({'; '.join(notes)})" if notes else ""
            option = typer.Option(... if p.required else None, p.cli_flag, *p.aliases, help=p.cli_help + shown,
                                  **common)
            annotation = Optional[List[str]] if p.repeat else _OPTION_TYPES[p.type]
        options.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                         default=option))
    return args + options


class Config(dict):
    """A checked config (every Param's value, defaults filled in) that also knows which ones the user gave."""

    given: frozenset = frozenset()


def typer_command(where: str, params: Sequence[Param], run: Callable[[Config], Any], *,
                  help: str | None = None) -> Callable[..., Any]:
    """A Typer command whose arguments and options are ``params``: the values the user gave are checked by
    ``resolve_config`` (defaults filled in), then ``run(config)`` (a ``Config``: it knows what was given).
    A positional Param's ``deprecated_flags`` still work, with one deprecation line on stderr."""

    def command(**kwargs: Any) -> Any:
        given = {}
        for p in params:
            value = kwargs.get(p.name)
            old = kwargs.get(_deprecated_key(p)) if p.deprecated_flags else None
            if old is not None:
                if value is not None:
                    raise UserError(f"{where}: {p.cli_name} given twice (as an argument and as "
                                    f"{p.deprecated_flags[0]}); give it once, as the argument")
                print(f"warning: {'/'.join(p.deprecated_flags)} is deprecated; give {p.cli_name} as the first "
                      f"argument: bertopt {where} {p.cli_name} ...", file=sys.stderr, flush=True)
                value = old
            if value is not None:
                given[p.name] = value
        config = Config(resolve_config(params, given, where))
        config.given = frozenset(given)
        return run(config)

    command.__signature__ = inspect.Signature(typer_parameters(params))
    command.__name__ = where.replace("-", "_")
    command.__doc__ = help
    return command


@dataclass(frozen=True)
class ConfigFields:
    """A config object (ServeConfig, BridgeConfig, bench Settings) whose fields are declared by ``params``: a
    field is named like its Param unless ``renamed`` maps the Param's name to it (the flag --grace, the field
    grace_s). Its defaults are the Params', its keyword arguments come from a checked config, and ``check``
    holds an object made through the API to the same declarations."""

    params: Sequence[Param]
    renamed: dict[str, str] = field(default_factory=dict)

    def field_of(self, p: Param) -> str:
        return self.renamed.get(p.name, p.name)

    def defaults(self) -> dict[str, Any]:
        return {self.field_of(p): p.default for p in self.params}

    def kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        return {self.field_of(p): config[p.name] for p in self.params}

    def values(self, obj: Any) -> dict[str, Any]:
        return {p.name: getattr(obj, self.field_of(p)) for p in self.params}

    def check(self, obj: Any, where: str, values: dict[str, Any] | None = None) -> None:
        check_values(self.params, values if values is not None else self.values(obj), where)


PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")
PROVIDER = Param("provider", str, "auto", "Execution provider (auto: CUDA when the runtime has it, else CPU).",
                 choices=PROVIDERS)
# upper bounds: a runtime that cannot make 100,000 threads crashes (SIGSEGV in ONNX Runtime), and a batch of 10^8
# rows was allocated whole for a hundred texts
MAX_THREADS = 1024
MAX_BATCH_SIZE = 4096
MAX_WORKERS = 256  # serve: worker processes of one model, each holding a copy of it
THREADS = Param("threads", int, None, "CPU threads per model session (default: every core this process may use).",
                min=1, max=MAX_THREADS)
BATCH_SIZE = Param("batch_size", int, 32, "Texts per model call (length-bucketed: texts are sorted by length "
                   "first).", min=1, max=MAX_BATCH_SIZE)
# the release gate's bound on batch deviation: 1 - cosine of a text's output alone vs inside a batch (a token's, for
# token states). tune's gate, the static int8 search and a full batch's fixed-shape copy are all held to it
BATCH_DEV_BOUND = 1e-3
# an OpenVINO artifact's runtime option, written by the stages that make one (compile, quantize --runtime openvino)
STATIC_FULL_BATCH = Param("static_full_batch", str, "auto", "OpenVINO: also compile the model for the one shape of a "
                          "full batch (batch size x the window: long documents, padded input) and run such batches "
                          "on it; its kernels were 1.05-1.16x faster on MiniLM, no faster on MPNet, for a second "
                          "executable's memory. auto: measured by the stage, on at 1.03x or more if the copy's "
                          "outputs stay within the gate's batch deviation of the model's (a static int8 copy moved "
                          "1.4e-3).",
                          choices=("auto", "on", "off"))
MAX_SEQ_LEN = Param("max_seq_len", int, None, "Truncate texts to this many tokens (default: the artifact's).",
                    min=1)
# ONNX Runtime's GPU execution providers (docs/gpu.md). The artifact's manifest records them (``bertopt compile
# --runtime onnxruntime --provider cuda|tensorrt``) as ``runtime_options``, so what was validated is what is served;
# runtime/backends.py turns them into the providers' own options.
DEVICE_ID = Param("device_id", int, None, "GPU ordinal for --provider cuda/tensorrt (default 0; a serve worker's "
                  "--device-map entry).", min=0)
CUDA_TF32 = Param("cuda_tf32", bool, False, "CUDA: let fp32 MatMuls run in TF32 (faster on Ampere and later, "
                  "about 3 significant digits; off keeps fp32 results close to the CPU's).")
TRT_FP16 = Param("trt_fp16", bool, False, "TensorRT: build fp16 engines; the Pow/ReduceMean of LayerNorm stay "
                 "fp32 (trt_layer_norm_fp32_fallback).")
TRT_ENGINE_CACHE_CHOICES = ("beside", "cache", "off")
TRT_ENGINE_CACHE = Param("trt_engine_cache", str, "beside", "TensorRT: where built engines are kept, per artifact "
                         "digest: beside (the folder ARTIFACT.trt-cache next to the artifact, outside its hashed "
                         "files), cache ($BERTOPT_CACHE_DIR/tensorrt: for an artifact on a read-only mount), off, "
                         "or an absolute folder of your own.",
                         check=lambda v: None if v in TRT_ENGINE_CACHE_CHOICES or v.startswith("/") else
                         f"must be beside, cache, off or an absolute folder; got {v!r}")
TRT_MAX_BATCH = Param("trt_max_batch", int, 64, "TensorRT: the largest batch the engine's shape profile covers "
                      "(sequence: the artifact's max_seq_len); keep it at least the batch size it is served with, "
                      "since TensorRT refuses a batch outside its profile.", min=1)
GPU_PARAMS = (CUDA_TF32, TRT_FP16, TRT_ENGINE_CACHE, TRT_MAX_BATCH)

# what happens to a text longer than the model's window (runtime.predictor.sequence_length): the one policy of the
# Python API, serve, spark-predict and the Kafka bridge (docs/serving.md, "Long inputs")
LONG_INPUT_POLICIES = ("error", "truncate", "chunk")
LONG_INPUTS = Param("long_inputs", str, "truncate", "A text longer than the model's window (--max-seq-len tokens): "
                    "truncate (cut it to the window), error (refuse it, naming the limit and its length) or chunk "
                    "(run it as overlapping windows and pool them: a token-weighted mean of embeddings or logits).",
                    choices=LONG_INPUT_POLICIES)
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
        if value is None and p.required:
            raise UserError(f"{where}: '{p.name}' is missing; give {p.cli_name}")
        config[p.name] = p.coerce(value, where) if value is not None else None
    return config


def check_values(params: Sequence[Param], values: dict[str, Any], where: str) -> None:
    """Check values a caller built itself (a config object made through the API) against the same declarations
    the command line checks, so each bound is stated once; a missing key is not checked."""
    for p in params:
        value = values.get(p.name)
        if value is not None:
            p.coerce(value, where)


def check_input_files(params: Sequence[Param], config: dict[str, Any], where: str) -> None:
    """Every parameter that names an input file must name one that exists (checked before any work)."""
    from pathlib import Path

    for p in params:
        value = config.get(p.name)
        if p.file and value and value != "builtin" and not Path(str(value)).is_file():
            path = Path(str(value))
            what = "a folder" if path.is_dir() else "not a regular file (a FIFO, device or socket)" \
                if path.exists() else "not found"
            raise UserError(f"{where}: '{p.name}' file {value} is {what}; give an existing file")
