"""The default recipes against the original model, in one run.

PyTorch fp32 (the original model) and the final artifact of each default recipe, measured side by side and
interleaved through the Predictor: throughput at batch 32 / seq 128, on mixed-length text (length-bucketed),
batch-1 latency p50/p99, and cosine vs the original. Prints ratios to PyTorch fp32; writes JSON under
benchmarks/results/.

    .venv/bin/python benchmarks/bench_recipes.py            # or: make bench
    .venv/bin/python benchmarks/bench_recipes.py --rounds 3 --recipes minilm-int8-cpu
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_common_args, output_path, progress_printer, recipe_contenders, settings_from  # noqa: E402

DEFAULT_RECIPES = ["minilm-int8-cpu", "minilm-fp16", "minilm-fp32-optimized"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES, help="Recipes to build and measure.")
    args = parser.parse_args(argv)

    from rich.console import Console

    from bertopt import bench
    from bertopt.machine import machine_info
    from bertopt.output_paths import write_json

    console = Console(width=200)
    say = progress_printer()
    settings = settings_from(args)
    reference, contenders = recipe_contenders(args, say)
    contenders.insert(0, reference)
    machine = machine_info()
    say(f"load average before: {machine.get('load_average')}")
    results = bench.measure(contenders, settings, reference=reference, progress=say)
    bench.add_ratios(results, reference.name, "pt-fp32")
    title = f"default recipes vs PyTorch fp32 ({args.model})"
    bench.print_results(results, settings, title, console, ["pt-fp32"])
    path = output_path(args, "bench_recipes")
    write_json(path, {"script": "bench_recipes", "model": args.model, "settings": asdict(settings),
                      "machine": machine | {"load_average_after": machine_info().get("load_average")},
                      "results": results})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
