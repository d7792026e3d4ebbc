"""A full batch on the model OpenVINO compiled for dynamic shapes against a copy compiled for that one shape.

    .venv/bin/python benchmarks/fixed_shape.py ART [ART ...] [--shapes 32x16,32x64,32x128] [--rounds 5]

Each OpenVINO artifact opens one session (its manifest's runtime options, outside the blob cache) that can run a
shape on a copy of its model compiled for it (``static_full_batch``, docs/performance.md); for every shape
(texts x tokens, built-in corpus text padded to the length) it times the dynamic model and the copy, one batch per
stream side by side, rounds interleaved, medians: what the stage's ``--static-full-batch auto`` measures at the
artifact's own full batch, here at any shape. Prints a table naming the CPU's features and writes JSON under
benchmarks/results/ (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_artifact_timing_args, print_table, progress_printer, write_results  # noqa: E402

DEFAULT_SHAPES = "32x16,32x64,32x128"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        rows, _, tokens = part.strip().partition("x")
        try:
            shapes.append((int(rows), int(tokens)))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not TEXTSxTOKENS (for example 32x128)") from None
    return shapes


def measure(artifact: str, shapes: list[tuple[int, int]], rounds: int, threads: int | None, say) -> dict:
    from bertopt.artifact import Artifact
    from bertopt.runtime.openvino_backend import FullBatchTimer, fixed_shape_session

    art = Artifact.load(artifact)
    if art.runtime != "openvino":
        raise SystemExit(f"{artifact} runs on {art.runtime}, not OpenVINO: a fixed shape is an OpenVINO compile")
    session = fixed_shape_session(art.model_handle(), threads)
    rows = []
    for batch, tokens in shapes:
        say(f"{Path(artifact).name}: {batch} x {tokens}")
        timer = FullBatchTimer(session, batch, tokens)
        fixed = session.fixed_shapes.executable((batch, tokens))
        if fixed is None:
            rows.append({"batch": batch, "tokens": tokens, "error": session.fixed_shapes.failed[(batch, tokens)]})
            continue
        executables = {"dynamic": session.dynamic, "fixed": fixed}
        timer.interleaved(executables, 1)  # warm-up: first runs allocate and pick kernels
        timed = timer.interleaved(executables, rounds)
        dyn, fix = statistics.median(timed["dynamic"]), statistics.median(timed["fixed"])
        rows.append({"batch": batch, "tokens": tokens, "dynamic_texts_per_s": dyn, "fixed_texts_per_s": fix,
                     "x_dynamic": fix / dyn, "rounds": timed})
    return {"artifact": artifact, "runtime_options": art.manifest.get("runtime_options") or {},
            "streams": session.parallel_runs, "shapes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="OpenVINO artifact folders.")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"TEXTSxTOKENS,... (default {DEFAULT_SHAPES}).")
    add_artifact_timing_args(parser, rounds=5)
    args = parser.parse_args(argv)
    from bertopt.machine import cpu_features

    shapes = parse_shapes(args.shapes)
    say = progress_printer(not args.quiet)
    results = [measure(a, shapes, args.rounds, args.threads, say) for a in args.artifacts]
    features = cpu_features()
    rows = []
    for res in results:
        for row in res["shapes"]:
            head = [Path(res["artifact"]).name, res["streams"], f"{row['batch']} x {row['tokens']}"]
            rows.append(head + (["-", "-", row["error"]] if "error" in row else
                                [f"{row['dynamic_texts_per_s']:.1f}", f"{row['fixed_texts_per_s']:.1f}",
                                 f"{row['x_dynamic']:.3f}"]))
    print_table("A full batch, dynamic model vs a copy compiled for its shape; ", features,
                ["artifact", ">streams", "shape", ">dynamic texts/s", ">fixed texts/s", ">x"], rows)
    write_results(args, "fixed-shape", features, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
