"""The ``bertopt`` command line: a thin Typer layer over the registry, recipes and runtime.

Heavy libraries (onnx, torch, tensorflow, pyspark) are imported inside commands, so ``bertopt --help`` is
instant. A UserError becomes one red line and exit code 2; a failed gate exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from bertopt.errors import BackendFailed, GateFailed, Terminated, UserError
from bertopt.params import Param, path_given, typer_command
from bertopt.plugins import import_all
from bertopt.terminal import console, err_console

app = typer.Typer(
    name="bertopt",
    help="Turn a BERT-family encoder into a validated serving artifact, and serve it.\n\n"
    "Typical flow: [bold]bertopt tune builtin:minilm --out a/tuned[/] (every candidate that makes sense on this "
    "machine, gated and timed; the fastest that passes is kept), [bold]bertopt run recipes/minilm-faithful-cpu.yaml[/] "
    "(export -> prune -> compile -> compare -> gate), "
    "or stage by stage: [bold]bertopt export builtin:minilm --out a/onnx[/], "
    "[bold]bertopt quantize a/onnx --mode fp16 --out a/fp16[/], [bold]bertopt inspect a/fp16[/].",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _stage_io_params(name: str) -> list[Param]:
    """What every stage command takes besides the stage's own Params: its input, --out and --force."""
    takes = "MODEL (Hugging Face folder, .onnx, SavedModel, .keras, checkpoint folder or builtin:minilm)" \
        if name in ("export", "freeze") else "ARTIFACT folder"
    return [
        Param("input", str, None, f"Input: {takes}.", positional=True, required=True),
        Param("out", str, None, "Output artifact folder (must not exist unless --force).", required=True,
              aliases=("-o",), check=path_given),
        Param("force", bool, False, "Replace an existing output artifact.", negatable=False),
    ]


def _stage_command(name: str):
    from bertopt.registry import get_stage

    stage = get_stage(name)
    io = _stage_io_params(name)

    def run(config) -> None:
        from bertopt.registry import preflight_stage, run_stage

        given = {p.name: config[p.name] for p in stage.PARAMS if p.name in config.given}
        # every option is checked before the stage does any work; run_stage checks the output path
        preflight_stage(stage, {p.name: config[p.name] for p in stage.PARAMS}, name)
        with console.status(f"[bold]{name}[/] {config['input']} ..."):
            art = run_stage(name, config["input"], given, Path(config["out"]), overwrite=config["force"])
        _print_stage_result(art)

    return typer_command(name, io + list(stage.PARAMS), run, help=stage.HELP)


def _print_stage_result(art) -> None:
    rep = art.lineage.get("report", {})
    lines = [f"[green]wrote[/] {art.path}  ({art.model_format}, {art.precision}, "
             f"{art.size_bytes() / 1e6:.1f} MB, {art.lineage.get('wall_time_s', 0):.1f} s)"]
    before, after = rep.get("before"), rep.get("after")
    if before and after:
        lines.append(f"  nodes {before['nodes']} -> {after['nodes']}, initializers "
                     f"{before.get('initializers', '-')} -> {after.get('initializers', '-')}")
    if rep.get("fused_ops"):
        lines.append("  fused: " + ", ".join(f"{k} x{v}" for k, v in rep["fused_ops"].items()))
    for key in ("max_abs_diff_vs_pytorch", "max_abs_diff_pipeline_vs_pytorch", "max_abs_diff_vs_parent",
                "max_abs_diff_vs_source"):
        if key in rep:
            lines.append(f"  {key.replace('_', ' ')}: {rep[key]:.3g}")
    acc = rep.get("accuracy_vs_parent", {})
    for name, s in acc.items():
        if "cos_min" in s:
            lines.append(f"  {name} vs input: cos mean {s['cos_mean']:.6f} min {s['cos_min']:.6f}, "
                         f"max abs {s['max_abs']:.3g}")
    for note in rep.get("notes") or []:
        lines.append(f"  [yellow]note[/]: {escape(note)}")
    if rep.get("kept_fp32_nodes"):
        lines.append(f"  kept fp32: {len(rep['kept_fp32_nodes'])} nodes")
    console.print("\n".join(lines))


def _register_stage_commands() -> None:
    from bertopt.registry import stage_names

    for name in stage_names():
        app.command(name=name)(_stage_command(name))


_register_stage_commands()


RUN_PARAMS = [
    Param("recipe", str, None, "Recipe file or name in recipes/ (default: minilm-tuned).", positional=True),
    Param("model", str, None, "Source model, overriding the recipe's (Hugging Face folder, .onnx, SavedModel, "
          "checkpoint, builtin:minilm).", aliases=("-m",)),
    Param("out", str, None, "Folder for the artifacts; each stage writes OUT/<recipe>/<NN>-<stage> (default: the "
          "recipe's out:, else artifacts).", aliases=("-o",), check=path_given),
    Param("compare", bool, True, "Compare the final artifact with the original model on the built-in corpus."),
]
INSPECT_PARAMS = [Param("artifact", str, None, "Artifact folder.", positional=True, required=True)]


def _run(config) -> None:
    recipe, model, compare = config["recipe"], config["model"], config["compare"]
    out = Path(config["out"]) if config["out"] is not None else None
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from bertopt.recipes import find_recipe, load_recipe, run_recipe

    rec = load_recipe(find_recipe(recipe))
    console.print(f"[bold]recipe[/] {rec.name}: {rec.description or ''} (model {model or rec.model})")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("starting", total=1)

        def report(step: str, done: int, total: int) -> None:
            progress.update(task, description=step, completed=done, total=total)

        def say(line: str) -> None:
            progress.console.print(escape(line), highlight=False, soft_wrap=True)

        result = run_recipe(rec, model=model, out=out, progress=report, compare=compare, say=say)
    if result.tune is not None:
        from bertopt.tune import print_result

        print_result(result.tune, console)
        return
    from bertopt.terminal import print_recipe_summary

    print_recipe_summary(result, console)
    if result.validation is not None and not result.validation["passed"]:
        raise GateFailed(f"gate failed for {result.final.path}")


def _inspect(config) -> None:
    from bertopt.artifact import Artifact
    from bertopt.artifact_view import render

    render(Artifact.load(Path(config["artifact"])), console)


_RUN_HELP = "Run a recipe: its stages in order, then compare with the original model and apply its gate."
_INSPECT_HELP = "Show an artifact: manifest, lineage chain, size, ops by type, precision."
app.command("run", help=_RUN_HELP)(typer_command("run", RUN_PARAMS, _run, help=_RUN_HELP))
app.command("inspect", help=_INSPECT_HELP)(typer_command("inspect", INSPECT_PARAMS, _inspect, help=_INSPECT_HELP))


@app.command("stages")
def stages_command() -> None:
    """List the stages and their parameters (the same ones recipes accept)."""
    from rich.table import Table

    from bertopt.registry import get_stage, stage_names

    for name in stage_names():
        stage = get_stage(name)
        table = Table(title=f"{name}: {stage.HELP}", title_justify="left")
        for col in ("parameter", "type", "default", "help"):
            table.add_column(col)
        for p in stage.PARAMS:
            table.add_row(p.name, p.type.__name__, str(p.default), p.help)
        console.print(table)


# Commands that live with their feature; each module defines register(app) and keeps heavy imports inside.
_COMMAND_MODULES = (
    "bertopt.validate.cli",
    "bertopt.bench",
    "bertopt.tune",
    "bertopt.serve.cli",
    "bertopt.spark.cli",
    "bertopt.kafka.cli",
)
for _module in import_all(_COMMAND_MODULES, optional=True):
    _module.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: the exit-code contract of ``bertopt.errors`` (0 success, 1 gate failed, 2 usage error,
    3 backend failed, 130 interrupted, 143 terminated), each failure as one line on stderr."""
    import signal

    from bertopt.errors import INTERRUPTED

    _quiet_third_party_output()
    INTERRUPTED.clear()
    previous = _raise_on_sigterm()
    previous_int = _remember_sigint()
    code = None
    try:
        try:
            code = _run(argv)
        finally:
            if argv is None and code is not None and code not in (130, 143) and not INTERRUPTED.is_set():
                # the process's own command (not a caller's in-process one) is done and its output in place: an
                # interrupt from here on, while the interpreter shuts down, would land in a library's exit hook
                # (torch's: a KeyboardInterrupt traceback, exit still 0) or end the finished run as 130
                previous = previous_int = signal.SIG_IGN
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)
    except KeyboardInterrupt:  # delivered while the handlers were put back (signal.signal runs pending handlers)
        INTERRUPTED.set()
    except Exception:
        if not INTERRUPTED.is_set():
            raise
        # a library turned the KeyboardInterrupt into an error of its own (torch: "trying to pop from empty mode
        # stack"; a class body: "Error calling __set_name__"): the run was interrupted, not broken, and exit 1
        # would tell CI that the gate failed
    if INTERRUPTED.is_set() and code not in (130, 143):
        # the KeyboardInterrupt was swallowed on the way (see bertopt.errors) or came after _run: still interrupted
        err_console.print("interrupted", highlight=False, soft_wrap=True)
        code = 130
    if code == 130:
        _forget_interrupt_seen_by_pyrun()
    sys.exit(code)


def _forget_interrupt_seen_by_pyrun() -> None:
    """Under ``python -m``, CPython kills the process with SIGINT at exit (status -2, not our 130) when any
    KeyboardInterrupt once left a nested ``PyRun_String`` call, even one handled afterwards: it marks the interrupt
    unhandled in a process-wide flag. optree evaluates its lazy imports that way, so an interrupt that landed there
    turned a clean 'interrupted' exit into a signal death (seen in CI). Here the interrupt has been handled, so
    the flag is cleared where this CPython exports it (3.11; later versions keep it inside ``_PyRuntime``, and
    there the process ends by SIGINT, which shells also report as 130). The console script is not affected."""
    import ctypes

    try:
        flag = ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt")
    except ValueError:  # not exported by this CPython: nothing to clear
        return
    flag.value = 0


def _run(argv: list[str] | None) -> int:
    abort, exit_, click_error = _click_exception_types()
    command = typer.main.get_command(app)

    def say(prefix: str, exc: BaseException | str) -> None:
        err_console.print(f"[bold red]{prefix}[/] {escape(str(exc))}" if prefix else escape(str(exc)),
                          highlight=False, soft_wrap=True)

    try:
        # non-standalone mode: Typer returns the exit code of typer.Exit, and turns Ctrl-C into Exit(130)
        returned = command.main(args=argv, prog_name="bertopt", standalone_mode=False)
    except UserError as exc:
        say("error:", exc)
        return exc.exit_code
    except GateFailed as exc:
        say("gate failed:", exc)
        return GateFailed.exit_code
    except BackendFailed as exc:
        say("error:", exc)
        return BackendFailed.exit_code
    except OSError as exc:  # a full disk outside an artifact's writer (a report, a copy): one line, not a traceback
        from bertopt.errors import out_of_space

        full = out_of_space(exc, exc.filename) if exc.filename else None
        if not full:
            raise
        say("error:", f"could not write {exc.filename}: {full}; free space there or choose another output folder")
        return 2
    except KeyboardInterrupt:  # raised outside Typer's own handler (while it parses, say)
        say("", "interrupted")
        return 130
    except Terminated:
        say("", "terminated")
        return Terminated.exit_code
    except abort:
        say("", "aborted")
        return 130
    except exit_ as exc:
        return _exit_code(exc.exit_code)
    except click_error as exc:  # usage errors: bad option, missing argument, a number out of range
        if exc.format_message().strip():  # bare 'bertopt' printed its help already
            say("error:", _usage_line(exc))
        return 2
    code = _exit_code(returned)
    if code == 130:
        say("", "interrupted")
    return code


def _exit_code(returned: Any) -> int:
    """What Typer hands back in non-standalone mode: an int from typer.Exit (or Ctrl-C), else a command's
    return value (None: success)."""
    if isinstance(returned, int) and not isinstance(returned, bool):
        return returned
    return 0


def _raise_on_sigterm():
    """SIGTERM raises Terminated, so every ``with``/``finally`` on the way out runs (temporary output is removed)
    instead of the process vanishing mid-write. Commands that stop gracefully on SIGTERM (serve, kafka) install
    their own handler over this one. Returns the previous handler (None: not installed, not the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum, frame):
        from bertopt.errors import hold_signal

        if not hold_signal(Terminated(), signum, frame):  # inside an output swap or an import: raised after it
            raise Terminated()

    return signal.signal(signal.SIGTERM, on_sigterm)


def _remember_sigint():
    """SIGINT raises KeyboardInterrupt, as Python's own handler does, and sets ``bertopt.errors.INTERRUPTED`` so a
    swallowed exception cannot turn an interrupted run into a success. Left alone where SIGINT is ignored (a
    background job) or handled by someone else, and off the main thread. Returns the previous handler (None: not
    installed)."""
    import signal
    import threading

    from bertopt.errors import INTERRUPTED

    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def on_sigint(signum, frame):
        from bertopt.errors import hold_signal

        INTERRUPTED.set()
        if not hold_signal(KeyboardInterrupt(), signum, frame):  # inside an output swap or an import: raised after
            raise KeyboardInterrupt

    return signal.signal(signal.SIGINT, on_sigint)


def _usage_line(exc) -> str:
    """A click usage error as one line naming the problem and where to look for the fix."""
    message = " ".join(exc.format_message().split()).rstrip(".")  # click ends its sentences; ours go on after ';'
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "bertopt"
    return f"{message}; see '{command} --help'"


def _quiet_third_party_output() -> None:
    """Libraries' advisories (tracer warnings, quantiser hints on the root logger) are not the user's concern;
    commands that log (serve, kafka) configure their own handlers and levels."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean")
    warnings.filterwarnings("ignore", message="Exporting aten::index operator")
    warnings.filterwarnings("ignore", message="Detected pickle protocol")  # torch.load of a refused pickle
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if not logging.getLogger().handlers:
        logging.getLogger().setLevel(logging.ERROR)


def _click_exception_types():
    """Typer >= 0.29 vendors click as ``typer._click``; older Typer uses click itself."""
    try:
        from typer._click.exceptions import ClickException
    except ImportError:
        from click import ClickException
    return typer.Abort, typer.Exit, ClickException


if __name__ == "__main__":
    main()
