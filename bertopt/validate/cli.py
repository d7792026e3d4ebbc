"""``bertopt validate``: the release gate as a command. Flags come from ``VALIDATE_PARAMS`` (the same parameters
a recipe's ``validate:`` section takes). Exit 0 when every check passes, 1 when any fails, 2 for usage errors."""

from __future__ import annotations

from pathlib import Path

import typer

from bertopt.params import Param, typer_command
from bertopt.validate.params import VALIDATE_PARAMS

_HELP_TEXT = """Gate an artifact for release: accuracy and latency against its reference, thresholds, CI reports.

The reference is the original model recorded in the artifact's lineage, run in its own framework (PyTorch for
Hugging Face models), unless --reference names another model or artifact. Data is the built-in corpus or a
.txt (one input a line) / .jsonl / .csv / .parquet file (--data, --text-column, --text-pair-column,
--label-column).

Targets are absolute or relative to the reference, e.g.
[bold]--targets cos_min=0.995,neighbour_agreement_at_10=0.9,speedup=1.2,latency_p99_ms@1x128<=20[/]
(`=` means "at least" for similarities and speedups, "at most" for errors, latencies and *_degradation).

Reports go to --report-dir: validation.json, junit.xml (one test case per check), summary.md and report.html
with plots. Exit code: 0 all checks pass, 1 a check failed, 2 usage error."""
# paragraphs as single lines: the terminal wraps them to its width
HELP = "\n\n".join(" ".join(par.split("\n")) for par in _HELP_TEXT.split("\n\n"))


ARTIFACT = Param("artifact", str, None, "Artifact folder to gate.", positional=True, required=True)
REPORT_DIR = Param("report_dir", str, None, "Folder for the reports (default: ARTIFACT-validation next to the "
                   "artifact); a previous report there is replaced.", aliases=("-r",))


def _validate(config) -> None:
    from bertopt.terminal import console
    from bertopt.validate.gate import validate_artifact

    given = {p.name: config[p.name] for p in VALIDATE_PARAMS if p.name in config.given}
    artifact = Path(config["artifact"])
    default_dir = artifact.absolute().parent / f"{artifact.absolute().name}-validation"
    report_dir = Path(config["report_dir"]) if config["report_dir"] else default_dir
    validate_artifact(str(artifact), given, report_dir, raise_on_fail=True, console=console)


def register(app: typer.Typer) -> None:
    app.command("validate", help=HELP)(typer_command("validate", [ARTIFACT, REPORT_DIR, *VALIDATE_PARAMS], _validate,
                                                     help=HELP))
