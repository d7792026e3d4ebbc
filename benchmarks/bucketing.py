"""How the Predictor's length buckets trade padding against batch count, measured side by side.

    .venv/bin/python benchmarks/bucketing.py ART [ART ...] [--rounds 6] [--plans 1.25:8,1.05:0,1.0:0]

Each artifact runs ``bertopt.data.mixed_text()`` (512 lines, a sentence to a paragraph) through its own
Predictor, once per plan: a plan ``GROWTH:SLACK`` ends a batch before a text longer than GROWTH x the batch's
first text + SLACK tokens (``Predictor.plan_batches``; the first plan is the baseline the ratios are taken
against, the Predictor's default is marked). The batches are tokenised and padded once, outside the timing, so
only the model's time is compared; plans are interleaved (A B C ... A B C ...) for ``--rounds`` rounds and
medians reported, each ratio the median of per-round ratios (the machine is shared and noisy). Prints a table
and writes JSON under benchmarks/results/ (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_artifact_timing_args, print_table, progress_printer, write_results  # noqa: E402

DEFAULT_PLANS = "1.25:8,1.1:2,1.05:0,1.0:0"


def parse_plans(text: str) -> list[tuple[float, int]]:
    plans = []
    for part in text.split(","):
        growth, _, slack = part.strip().partition(":")
        try:
            plans.append((float(growth), int(slack or 0)))
        except ValueError:
            raise SystemExit(f"--plans: {part!r} is not GROWTH:SLACK (for example 1.05:0)") from None
    return plans


def measure(artifact: str, plans: list[tuple[float, int]], rounds: int, threads: int | None, say) -> dict:
    from bertopt.data import mixed_text
    from bertopt.runtime import Predictor

    texts = mixed_text()
    predictor = Predictor(artifact, threads=threads)
    encodings = predictor.tokenize(texts)
    feeds = {}
    for growth, slack in plans:
        batches = predictor.plan_batches(encodings, predictor.batch_size, growth=growth, slack=slack)
        feeds[growth, slack] = [predictor.feeds_for([encodings[i] for i in b])[0] for b in batches]
    output = [predictor.primary_output]
    for batch_feeds in feeds.values():  # warm-up: every shape once
        for f in batch_feeds:
            predictor.run_batch(f, output)
    rates: dict[tuple[float, int], list[float]] = {plan: [] for plan in plans}
    for r in range(rounds):
        say(f"{Path(artifact).name}: round {r + 1}/{rounds}")
        for plan in plans:
            t0 = time.perf_counter()
            for f in feeds[plan]:
                predictor.run_batch(f, output)
            rates[plan].append(len(texts) / (time.perf_counter() - t0))
    base = rates[plans[0]]
    return {
        "artifact": artifact, "backend": predictor.describe().get("backend"), "texts": len(texts),
        "real_tokens": int(sum(len(e.ids) for e in encodings)),
        "plans": [{"growth": g, "slack": s, "batches": len(feeds[g, s]),
                   # every input of a batch is (texts, width): any one's size is the padded token count
                   "padded_tokens": int(sum(next(iter(f.values())).size for f in feeds[g, s])),
                   "texts_per_s": statistics.median(rates[g, s]),
                   "x_first_plan": statistics.median(x / b for x, b in zip(rates[g, s], base)),
                   "rounds": rates[g, s]}
                  for g, s in plans],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="Artifact folders to run.")
    parser.add_argument("--plans", default=DEFAULT_PLANS, help=f"GROWTH:SLACK,... (default {DEFAULT_PLANS}).")
    add_artifact_timing_args(parser, rounds=6)
    args = parser.parse_args(argv)
    from bertopt.machine import cpu_features
    from bertopt.runtime.predictor import BUCKET_GROWTH, BUCKET_SLACK_TOKENS

    plans = parse_plans(args.plans)
    say = progress_printer(not args.quiet)
    results = [measure(a, plans, args.rounds, args.threads, say) for a in args.artifacts]
    features = cpu_features()
    rows = [[Path(res["artifact"]).name, res["backend"],
             f"{p['growth']:g}:{p['slack']}"
             + (" (default)" if (p["growth"], p["slack"]) == (BUCKET_GROWTH, BUCKET_SLACK_TOKENS) else ""),
             p["batches"], p["padded_tokens"], f"{p['texts_per_s']:.1f}", f"{p['x_first_plan']:.3f}"]
            for res in results for p in res["plans"]]
    print_table("Length buckets on mixed_text, ", features, ["artifact", "backend", "plan (growth:slack)", ">batches",
                ">padded tokens", ">texts/s", ">x first plan"], rows)
    write_results(args, "bucketing", features, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
