"""What the batch-invariance check of the gate costs, and what running its batches side by side saves.

    .venv/bin/python benchmarks/gate_cost.py ART [ART ...] [--rounds 3] [--threads N] [--max-texts N]

For each artifact one Predictor (its manifest's runtime options) measures ``batch_deviation`` on the gate's texts
(the built-in corpus plus ``mixed_text``, each capped at ``--max-texts``) twice per round, interleaved: as the gate
runs it (a session with several streams, OpenVINO's THROUGHPUT, runs that many batches side by side) and one batch
at a time (the same compiled streams, ``parallel_runs`` set to 1: how the check ran before), medians. The figures
of both must be equal (each batch is one request on one stream either way); the script says so per artifact.

Then the gate's statistics on the same artifact's outputs (its run on the texts in batches of 32 against its run in
batches of 7: two real sets of every output, token states included): ``measure_output`` as the gate computes them
(float64, a slice of rows at a time, one pass for statistics and plot sample) against the whole-array form the gate
used before (both sides cast to float64 whole, the plot's errors computed again), interleaved, medians, and the
peak memory each allocates (tracemalloc, a run of its own); the figures must be equal.
Prints tables naming the CPU's features and writes JSON under benchmarks/results/ (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
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


def whole_array_figures(name: str, kind: str, got, ref, atol: float = 1e-3, rtol: float = 1e-3,
                        quantile: float = 0.99) -> tuple[dict, dict]:
    """The gate's statistics and plot sample the way it computed them before (the baseline of this benchmark)."""
    import numpy as np

    from bertopt.measure.compare import COSINE_KINDS, flatten_outputs, neighbour_agreement

    def cosines(a, b):
        na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
        denom = na * nb
        cos = np.divide((a * b).sum(axis=1), denom, out=np.ones_like(denom), where=denom > 0)
        cos[(na == 0) ^ (nb == 0)] = 0.0
        return cos

    g, r = flatten_outputs(got).astype(np.float64), flatten_outputs(ref).astype(np.float64)
    err = np.abs(g - r)
    stats = {"name": name, "kind": kind, "count": int(g.size), "nan_or_inf": int((~np.isfinite(g)).sum()),
             "max_abs": float(err.max()), "mean_abs": float(err.mean()),
             f"abs_err_p{int(quantile * 100)}": float(np.quantile(err, quantile)),
             "pass_fraction": float(np.mean(err <= atol + rtol * np.abs(r))), "atol": atol, "rtol": rtol}
    if kind in COSINE_KINDS and g.ndim == 2 and g.shape[0]:
        cos = cosines(g.astype(np.float64), r.astype(np.float64))
        stats.update({"cos_mean": float(cos.mean()), "cos_p01": float(np.quantile(cos, 0.01)),
                      "cos_min": float(cos.min())})
    if kind == "embedding" and not isinstance(got, list):
        stats["neighbour_agreement_at_10"] = neighbour_agreement(g, r, 10)
    if kind in ("logits", "token-logits") and g.ndim == 2:
        stats["top1_agreement"] = float(np.mean(g.argmax(1) == r.argmax(1)))
    # the plot's sample: flattened and cast again, as the gate's error plot did
    g, r = flatten_outputs(got).astype(np.float64), flatten_outputs(ref).astype(np.float64)
    flat = np.abs(g - r).ravel()
    dist = {"abs_err": np.random.default_rng(0).choice(flat, 200_000, replace=False) if flat.size > 200_000 else flat}
    if kind != "token" and g.ndim == 2 and len(g):
        dist["cosine"] = cosines(g, r)
    return stats, dist


def measure_statistics(artifact: str, texts: list[str], rounds: int, threads: int | None, say) -> dict:
    import numpy as np

    from bertopt.measure.compare import measure_output
    from bertopt.runtime import Predictor

    say(f"{Path(artifact).name}: outputs in batches of 32 and of 7")
    got = Predictor(artifact, threads=threads, batch_size=32, verify=False)
    kinds = got.model.output_kinds
    a = got.run(texts)
    b = Predictor(artifact, threads=threads, batch_size=7, verify=False).run(texts)
    ways = {"slices": measure_output, "whole arrays": whole_array_figures}
    times: dict[str, list[float]] = {way: [] for way in ways}
    found: dict[str, dict] = {}
    for r in range(rounds):
        for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            found[way] = {name: ways[way](name, kinds.get(name, "embedding"), a[name], b[name]) for name in a}
            times[way].append(time.perf_counter() - t0)
    same = all(found["slices"][n][0] == found["whole arrays"][n][0]
               and found["slices"][n][1].keys() == found["whole arrays"][n][1].keys()
               and all(np.array_equal(found["slices"][n][1][k], found["whole arrays"][n][1][k], equal_nan=True)
                       for k in found["slices"][n][1]) for n in a)
    values = sum(found["slices"][n][0]["count"] for n in a)
    peak_mib = {}
    for way, fn in ways.items():  # memory in a run of its own: tracing allocations slows the timed ones
        tracemalloc.start()
        for name in a:
            fn(name, kinds.get(name, "embedding"), a[name], b[name])
        peak_mib[way] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    new, old = statistics.median(times["slices"]), statistics.median(times["whole arrays"])
    return {"artifact": artifact, "outputs": sorted(a), "values": values, "slices_s": new, "whole_arrays_s": old,
            "x_whole_arrays": old / new, "rounds_s": times, "peak_mib": peak_mib, "same_figures": same}


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
    stats = [measure_statistics(a, texts, args.rounds, args.threads, say) for a in args.artifacts]
    features = cpu_features()
    rows = [[Path(r["artifact"]).name, r["streams"], r["probes"], f"{r['one_at_a_time_s']:.2f}",
             f"{r['side_by_side_s']:.2f}", f"{r['x_one_at_a_time']:.2f}", "yes" if r["same_figures"] else "NO",
             f"{r['batch_dev']:.2g}"] for r in results]
    print_table("Batch-invariance check: its batches side by side vs one at a time; ", features,
                ["artifact", ">streams", ">probes", ">one at a time s", ">side by side s", ">x", "same figures",
                 ">batch_dev"], rows)
    rows = [[Path(r["artifact"]).name, ", ".join(r["outputs"]), f"{r['values'] / 1e6:.1f} M",
             f"{r['whole_arrays_s']:.2f}", f"{r['slices_s']:.2f}", f"{r['x_whole_arrays']:.2f}",
             f"{r['peak_mib']['whole arrays']:.0f}", f"{r['peak_mib']['slices']:.0f}",
             "yes" if r["same_figures"] else "NO"] for r in stats]
    print_table("The gate's statistics: a slice of rows at a time vs whole float64 arrays; ", features,
                ["artifact", "outputs", ">values", ">whole arrays s", ">slices s", ">x", ">whole arrays peak MiB",
                 ">slices peak MiB", "same figures"], rows)
    write_results(args, "gate-cost", features, results, statistics=stats)
    return 0 if all(r["same_figures"] for r in results + stats) else 1


if __name__ == "__main__":
    sys.exit(main())
