"""NNCF static int8 for OpenVINO against the other CPU recipes of MiniLM, in one run (issue 28).

Contenders, each built once (reused afterwards; its build time is read from its manifest) and run through the
Predictor: OpenVINO bf16 (``minilm-fastest-cpu``, the yardstick), NNCF static int8 (``minilm-int8-static``),
OpenVINO int8-dynamic + GPTQ + the project's accuracy search (``minilm-int8-accurate``), and PyTorch fp32 (the
original model); ``--recipes`` adds others (``minilm-int8-cpu``, ``minilm-faithful-cpu``). For each:

* cos min / mean of the sentence embedding vs PyTorch fp32 on the built-in corpus and on ``mixed_text``;
* batch deviation: the largest 1 - cosine between a text alone and inside batches of 1 / 7 / 32;
* texts/s on the mixed-text workload (length-bucketed batches of 32) and padded 32 x 128, median of interleaved
  rounds, as a ratio to OpenVINO bf16 and to PyTorch fp32.

The bar: cos min >= 0.995 on both texts and batch deviation <= 1e-3; the issue's speed target for static int8 is
>= 1.3x the bf16 artifact on an AVX-512 VNNI CPU.

    .venv/bin/python benchmarks/static_int8.py
    .venv/bin/python benchmarks/static_int8.py --rounds 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_recipe_candidate_args, holds, measure_with_batch_dev, output_path, progress_printer  # noqa: E402

CANDIDATES = ["minilm-fastest-cpu", "minilm-int8-static", "minilm-int8-accurate"]
COS_MIN = 0.995
DEV_MAX = 1e-3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_candidate_args(parser, CANDIDATES, "the yardstick (OpenVINO bf16)")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from bertopt import machine, output_paths

    console = Console(width=200)
    say = progress_printer()
    results, host = measure_with_batch_dev(args, say, "bf16")
    for res in results:
        res["faithful"] = holds(res, COS_MIN, DEV_MAX)

    table = Table(title=f"static int8 vs the CPU recipes ({args.model}); faithful: cos min >= {COS_MIN} on both texts, "
                  f"batch dev <= {DEV_MAX:g}; speed as a ratio to {args.recipes[0]}", title_justify="left",
                  caption="cos: sentence embedding vs PyTorch fp32; batch dev: max 1 - cos, alone vs batches of "
                  "1 (padded) / 7 / 32 with other neighbours; mixed /s: mixed_text, length-bucketed batches of "
                  f"{args.batch_size}, median of {args.rounds} interleaved rounds", caption_justify="left")
    for col in ("candidate", "runtime", "precision", "cos min corpus", "cos min mixed", "batch dev corpus",
                "batch dev mixed", "mixed /s", "padded /s", "x bf16 mixed", "x bf16 padded", "x pt-fp32", "faithful"):
        table.add_column(col, justify="left" if col in ("candidate", "runtime", "precision") else "right")
    for r in results:
        fid = r["fidelity"]
        table.add_row(r["name"], str(r.get("backend", "")), str(r.get("precision", "")),
                      f"{fid['corpus']['cos_min']:.5f}", f"{fid['mixed']['cos_min']:.5f}",
                      f"{r['batch_dev']['corpus']:.2e}", f"{r['batch_dev']['mixed']:.2e}",
                      f"{r['mixed_texts_per_s']:.1f}", f"{r.get('padded_texts_per_s', float('nan')):.1f}",
                      f"{r['vs']['bf16']['mixed']:.2f}", f"{r['vs']['bf16'].get('padded', float('nan')):.2f}",
                      f"{r['vs']['pt-fp32']['mixed']:.2f}", "yes" if r["faithful"] else "no")
    console.print(table)
    say(f"load average after: {machine.machine_info().get('load_average')}")
    path = output_path(args, "static_int8")
    output_paths.write_json(path, {"benchmark": "static_int8", "settings": vars(args) | {"out": str(args.out)},
                            "machine": host, "results": results})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
