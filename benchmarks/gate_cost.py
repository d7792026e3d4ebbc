"""What the batch-invariance check of the gate costs, and what running its batches side by side saves.

    .venv/bin/python benchmarks/gate_cost.py ART [ART ...] [--rounds 3] [--threads N] [--max-texts N]

For each artifact one Predictor (its manifest's runtime options) measures ``batch_deviation`` on the gate's texts
(the built-in corpus plus ``mixed_text``, each capped at ``--max-texts``) twice per round, interleaved: as the gate
runs it (a session with several streams, OpenVINO's THROUGHPUT, runs that many batches side by side) and one batch
at a time (the same compiled streams, ``parallel_runs`` set to 1: how the check ran before), medians. The figures
of both must be equal (each batch is one request on one stream either way); the script says so per artifact.
Prints a table naming the CPU's features and writes JSON under benchmarks/results/ (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_artifact_timing_args, print_table, progress_printer, write_results  # noqa: E402


def gate_texts(max_texts: int | None) -> list[str]:
    from bertopt.data import corpus, mixed_text

    def cap(texts: list[str]) -> list[str]:
        return texts if max_texts is None else texts[:max_texts]

    return cap([t for t in corpus() if t.strip()]) + cap([t for t in mixed_text() if t.strip()])


def measure(artifact: str, texts: list[str], rounds: int, threads: int | None, say) -> dict:
    from bertopt.measure.batch import batch_deviation
    from bertopt.runtime import Predictor

    predictor = Predictor(artifact, threads=threads, verify=False)
    streams = predictor.session.parallel_runs
    times: dict[str, list[float]] = {"side by side": [], "one at a time": []}
    found: dict[str, dict] = {}
    for r in range(rounds):
        order = ["side by side", "one at a time"] if r % 2 == 0 else ["one at a time", "side by side"]
        for way in order:
            say(f"{Path(artifact).name}: round {r + 1}, {way}")
            predictor.session.parallel_runs = streams if way == "side by side" else 1
            t0 = time.perf_counter()
            found[way] = batch_deviation(predictor, texts)
            times[way].append(time.perf_counter() - t0)
    predictor.session.parallel_runs = streams
    side, serial = statistics.median(times["side by side"]), statistics.median(times["one at a time"])
    return {"artifact": artifact, "runtime_options": predictor.model.runtime_options, "streams": streams,
            "texts": len(texts), "probes": found["side by side"]["texts"], "side_by_side_s": side,
            "one_at_a_time_s": serial, "x_one_at_a_time": serial / side, "rounds_s": times,
            "same_figures": found["side by side"] == found["one at a time"],
            "batch_dev": found["side by side"]["batch_dev"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="Artifact folders.")
    parser.add_argument("--max-texts", type=int, default=None, help="Cap on each built-in text set (as tune's).")
    add_artifact_timing_args(parser, rounds=3)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    from bertopt.machine import cpu_features

    say = progress_printer(not args.quiet)
    texts = gate_texts(args.max_texts)
    results = [measure(a, texts, args.rounds, args.threads, say) for a in args.artifacts]
    features = cpu_features()
    rows = [[Path(r["artifact"]).name, r["streams"], r["probes"], f"{r['one_at_a_time_s']:.2f}",
             f"{r['side_by_side_s']:.2f}", f"{r['x_one_at_a_time']:.2f}", "yes" if r["same_figures"] else "NO",
             f"{r['batch_dev']:.2g}"] for r in results]
    print_table("Batch-invariance check: its batches side by side vs one at a time; ", features,
                ["artifact", ">streams", ">probes", ">one at a time s", ">side by side s", ">x", "same figures",
                 ">batch_dev"], rows)
    write_results(args, "gate-cost", features, results)
    return 0 if all(r["same_figures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
