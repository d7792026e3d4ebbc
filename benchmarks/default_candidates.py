"""Which recipe should be the default? Faithfulness, batch invariance and speed of each candidate, in one run.

For every candidate recipe (built once, reused afterwards) and PyTorch fp32 (the original model), measured side
by side through the Predictor:

* cos min / mean of the sentence embedding vs PyTorch fp32 on the built-in corpus and on ``mixed_text``;
* batch deviation: the largest 1 - cosine between a text run alone and the same text inside batches of 1 (other
  padding), 7 and 32 (other neighbours, other lengths), on both texts (``bertopt.measure.batch``);
* throughput on the mixed-text workload (length-bucketed batches of 32), interleaved rounds, as a ratio to the
  first candidate (today's default) and to PyTorch fp32.

The default must reach cos min >= 0.995 on both texts, batch deviation <= 1e-4 and at least the old default's
mixed-text speed.

    .venv/bin/python benchmarks/default_candidates.py
    .venv/bin/python benchmarks/default_candidates.py --recipes minilm-int8-cpu minilm-fastest-cpu --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_recipe_candidate_args, holds, measure_with_batch_dev, output_path, progress_printer  # noqa: E402

CANDIDATES = ["minilm-int8-cpu", "minilm-int8-accurate", "minilm-fastest-cpu", "minilm-faithful-cpu"]
COS_MIN = 0.995
DEV_MAX = 1e-4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_candidate_args(parser, CANDIDATES, "the baseline (today's default)")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from bertopt import machine, output_paths

    console = Console(width=200)
    say = progress_printer()
    results, host = measure_with_batch_dev(args, say, "old-default")
    for res in results:
        res["meets_default_bar"] = holds(res, COS_MIN, DEV_MAX) and res["vs"]["old-default"]["mixed"] >= 1.0

    table = Table(title=f"default candidates ({args.model}); bar: cos min >= {COS_MIN} on both texts, batch dev <= "
                  f"{DEV_MAX:g}, mixed-text speed >= the old default ({args.recipes[0]})", title_justify="left",
                  caption="cos: sentence embedding vs PyTorch fp32; batch dev: max 1 - cos, alone vs batches of "
                  "1 (padded) / 7 / 32 with other neighbours; mixed /s: mixed_text, length-bucketed batches of "
                  f"{args.batch_size}, median of {args.rounds} interleaved rounds", caption_justify="left")
    for col in ("candidate", "runtime", "precision", "cos min corpus", "cos min mixed", "batch dev corpus",
                "batch dev mixed", "mixed /s", "x old default", "x pt-fp32", "meets bar"):
        table.add_column(col, justify="left" if col in ("candidate", "runtime", "precision") else "right")
    for r in results:
        fid = r["fidelity"]
        table.add_row(r["name"], str(r.get("backend", "")), str(r.get("precision", "")),
                      f"{fid['corpus']['cos_min']:.5f}", f"{fid['mixed']['cos_min']:.5f}",
                      f"{r['batch_dev']['corpus']:.2e}", f"{r['batch_dev']['mixed']:.2e}",
                      f"{r['mixed_texts_per_s']:.1f}", f"{r['vs']['old-default']['mixed']:.2f}",
                      f"{r['vs']['pt-fp32']['mixed']:.2f}", "yes" if r["meets_default_bar"] else "no")
    console.print(table)
    say(f"load average after: {machine.machine_info().get('load_average')}")
    path = output_path(args, "default_candidates")
    output_paths.write_json(path, {"benchmark": "default_candidates", "settings": vars(args) | {"out": str(args.out)},
                            "machine": host, "results": results})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
