"""Issue 8: the fastest faithful CPU artifact against what a user would pick instead, side by side in one run.

Contenders (all through the Predictor: same tokenisation, same length-sorted batching):
  PyTorch fp32 eager, PyTorch bf16 autocast, ONNX Runtime fp32 as exported, ONNX Runtime fp32 transformer-optimised
  (recipe minilm-fp32-optimized), ONNX Runtime dynamic int8 per-channel (minilm-int8-cpu: the Optimum avx512_vnni
  configuration, per-channel, built with ONNX Runtime's own quantiser), ONNX Runtime fp16 (minilm-fp16), and the
  winning recipe minilm-fastest-cpu. ``--study`` adds the variants behind each optimisation step (intra-op
  spinning, graph optimisation level, OpenVINO f32 vs bf16, length bucketing off).

Measured interleaved (A B C ... A B C ...), medians of ``--rounds``:
  (a) batch 32 padded to 128 tokens, (b) bertopt.data.mixed_text() length-bucketed in batches of 32,
  batch-1 16-token latency p50/p99, fidelity (cosine mean/min, neighbour agreement@10) vs PyTorch fp32 on the
  built-in corpus and on both workloads. Prints one table with ratios to PyTorch fp32 and bf16, the goal check,
  and the best artifact's GFLOP/s next to the CPU's peak; writes JSON under benchmarks/results/.

    .venv/bin/python benchmarks/compare.py --rounds 5
    .venv/bin/python benchmarks/compare.py --study --rounds 3

``--st-peers`` measures instead against sentence-transformers (its PyTorch fp32/bf16, ``backend="openvino"`` and
static int8 OpenVINO model, in a separate venv) with the artifacts given by ``--artifacts``, each contender in its
own process: see benchmarks/peers.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from common import (  # noqa: E402
    ROOT,
    add_common_args,
    artifact_contender,
    build_recipe,
    gemm_ceiling,
    output_path,
    peak_gflops,
    progress_printer,
    settings_from,
)

RECIPES = [  # (recipe, label in the table)
    ("minilm-fp32-optimized", "ORT fp32 optimised"),
    ("minilm-int8-cpu", "ORT int8 dynamic per-channel"),
    ("minilm-fp16", "ORT fp16"),
    ("minilm-fastest-cpu", "bertopt fastest-cpu"),
]
GATE_COS_MIN = 0.995
GOAL = {"padded_vs_bf16": 1.5, "mixed_vs_bf16": 2.0, "latency_vs_fp32": 0.5}


def dtype_of(precision: str) -> str:
    return "int8" if "int8" in precision else "bf16" if "bf16" in precision else "fp32"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    peers.add_args(parser)
    parser.add_argument("--study", action="store_true", help="Add the variants behind each optimisation step.")
    parser.add_argument("--only", nargs="*", default=None, help="Measure only contenders whose name contains one "
                        "of these words (PyTorch fp32 and bf16 are always measured).")
    args = parser.parse_args(argv)
    if args.st_peers:
        return peers.main(args)

    from rich.console import Console

    from bertopt import bench
    from bertopt.artifact import Artifact
    from bertopt.machine import machine_info
    from bertopt.output_paths import write_json

    console = Console(width=220)
    say = progress_printer()
    settings = settings_from(args)
    threads = args.threads

    built = {}
    for recipe, _label in RECIPES:
        built[recipe] = build_recipe(ROOT / "recipes" / f"{recipe}.yaml", args.model, args.out, args.rebuild, say)[0]
    fastest = built["minilm-fastest-cpu"]
    exported = next(Artifact.load(h["path"]) for h in fastest.history() if h["stage"] == "prune")

    reference = bench.reference_contender(fastest, threads=threads, batch_size=args.batch_size)
    contenders = [reference, bench.reference_contender(fastest, bf16=True, threads=threads, batch_size=args.batch_size),
                  artifact_contender("ORT fp32 as exported", exported, threads, args.batch_size)]
    contenders += [artifact_contender(label, built[recipe], threads, args.batch_size) for recipe, label in RECIPES]
    if args.study:
        contenders += study_contenders(built, exported, fastest, threads, args.batch_size)
    if args.only:
        keep = [w.lower() for w in args.only]
        contenders = contenders[:2] + [c for c in contenders[2:] if any(w in c.name.lower() for w in keep)]

    machine = machine_info()
    say(f"load average before: {machine.get('load_average')}")
    machine["gemm_ceiling_gflop_per_s_before"] = gemm_ceiling(threads)
    results = bench.measure(contenders, settings, reference=reference, progress=say)
    bench.add_ratios(results, "PyTorch fp32", "pt-fp32")
    bench.add_ratios(results, "PyTorch bf16 autocast", "pt-bf16")
    machine["load_average_after"] = machine_info().get("load_average")
    machine["gemm_ceiling_gflop_per_s_after"] = gemm_ceiling(threads)
    bench.print_results(results, settings, f"issue 8: side by side ({args.model}, {len(contenders)} contenders, "
                        f"{settings.rounds} interleaved rounds, medians)", console, ["pt-fp32", "pt-bf16"])
    verdict = goal_check(results, machine)
    for line in verdict["lines"]:
        console.print(line)
    path = output_path(args, "compare")
    write_json(path, {"script": "compare", "model": args.model, "settings": asdict(settings), "machine": machine,
                      "goal": {k: v for k, v in verdict.items() if k != "lines"}, "results": results})
    console.print(f"wrote {path}")
    return 0


def study_contenders(built, exported, fastest, threads, batch_size):
    """Variants isolating one optimisation step each."""
    import dataclasses

    from bertopt.runtime.backends import open_model, open_session

    def wrap(name, art, session=None, **kw):
        return artifact_contender(name, art, threads, batch_size, session=session, **kw)

    def ort_variant(art, **options):  # the artifact's model with other ONNX Runtime session options
        return open_model(art.model_path, runtime_options=options, provider="cpu", threads=threads)

    out = []
    for recipe, label in (("minilm-fp32-optimized", "ORT fp32 optimised"), ("minilm-int8-cpu", "ORT int8 dynamic")):
        art = built[recipe]
        out.append(wrap(f"{label} +spinning", art, ort_variant(art, allow_spinning=True)))
    out.append(wrap("ORT fp32 exported, basic opt", exported,
                    ort_variant(exported, graph_optimization_level="basic")))
    fastest_model = fastest.model_handle()
    f32 = dataclasses.replace(fastest_model, precision="fp32",
                              runtime_options={**fastest_model.runtime_options, "inference_precision": "f32"})
    out.append(wrap("OpenVINO f32 (same ONNX)", f32, open_session(f32, threads=threads)))
    tput = dataclasses.replace(fastest_model,
                               runtime_options={**fastest_model.runtime_options, "performance_hint": "THROUGHPUT"})
    out.append(wrap("OpenVINO bf16 THROUGHPUT hint", tput, open_session(tput, threads=threads)))
    out.append(wrap("bertopt fastest, no bucketing", fastest, length_bucketing=False))
    return out


def goal_check(results, machine) -> dict:
    by = {r["name"]: r for r in results}
    fp32, bf16 = by["PyTorch fp32"], by["PyTorch bf16 autocast"]
    candidates = [r for r in results if r.get("backend") != "pytorch"
                  and r["fidelity"]["corpus"]["cos_min"] >= GATE_COS_MIN and "no bucketing" not in r["name"]]
    lines = []
    if not candidates:
        return {"met": False, "best": None, "lines": ["no artifact passes the fidelity gate"]}

    def score(r):
        return min(r["vs"]["pt-bf16"]["padded"] / GOAL["padded_vs_bf16"], r["vs"]["pt-bf16"]["mixed"]
                   / GOAL["mixed_vs_bf16"], GOAL["latency_vs_fp32"] / r["vs"]["pt-fp32"]["latency_p50"])

    best = max(candidates, key=score)
    a, b = best["vs"]["pt-bf16"]["padded"], best["vs"]["pt-bf16"]["mixed"]
    lat = best["latency_p50_ms"] / fp32["latency_p50_ms"]
    checks = {"padded_vs_bf16": (a, a >= GOAL["padded_vs_bf16"]), "mixed_vs_bf16": (b, b >= GOAL["mixed_vs_bf16"]),
              "latency_vs_fp32": (lat, lat <= GOAL["latency_vs_fp32"])}
    met = all(ok for _, ok in checks.values())
    lines.append(f"best artifact passing cos_min >= {GATE_COS_MIN} on the corpus: [bold]{best['name']}[/] "
                 f"(cos min {best['fidelity']['corpus']['cos_min']:.6f})")
    verdicts = {k: "met" if ok else "NOT met" for k, (_, ok) in checks.items()}
    lines.append(f"  (a) {a:.2f}x PyTorch bf16 (goal >= {GOAL['padded_vs_bf16']}) {verdicts['padded_vs_bf16']}; "
                 f"(b) {b:.2f}x PyTorch bf16 (goal >= {GOAL['mixed_vs_bf16']}) {verdicts['mixed_vs_bf16']}; "
                 f"batch-1 p50 {lat:.2f}x PyTorch fp32 (goal <= {GOAL['latency_vs_fp32']}) "
                 f"{verdicts['latency_vs_fp32']}")
    peak = peak_gflops(machine)
    dtype = dtype_of(str(best.get("precision", "")))
    achieved = best.get("padded_gflop_per_s") or 0.0
    peak_rate = peak.get(dtype, float("nan"))
    lines.append(f"  achieved {achieved:.0f} GFLOP/s on (a) vs the CPU's {dtype} peak {peak_rate:.0f} "
                 f"GFLOP/s ({peak['cores']} cores x {peak['ghz']:.2f} GHz; {peak['assumption']}) = "
                 f"{achieved / peak[dtype] * 100 if peak.get(dtype) else float('nan'):.0f}% "
                 f"(PyTorch bf16: {bf16['padded_gflop_per_s']:.0f}, PyTorch fp32: {fp32['padded_gflop_per_s']:.0f})")
    if best.get("mixed_gflop_per_s"):
        lines.append(f"  on (b), counting the padded shapes actually run: {best['mixed_gflop_per_s']:.0f} GFLOP/s = "
                     f"{best['mixed_gflop_per_s'] / peak_rate:.0%} of peak (PyTorch bf16: "
                     f"{bf16['mixed_gflop_per_s']:.0f}, PyTorch fp32: {fp32['mixed_gflop_per_s']:.0f})")
    ceiling = [machine.get(k) for k in ("gemm_ceiling_gflop_per_s_before", "gemm_ceiling_gflop_per_s_after")]
    ceiling = [c for c in ceiling if c]
    if ceiling:
        gemm = {k: max(c[k] for c in ceiling) for k in ceiling[0]}
        ref_type = dtype if dtype in gemm else ("bf16" if "bf16" in gemm else "fp32")
        rates = ", ".join(f"{k} {v:.0f}" for k, v in gemm.items())
        lines.append(f"  measured ceiling, one 2048^3 PyTorch matmul: {rates} "
                     f"GFLOP/s (best of before/after the run); best artifact reaches "
                     f"{achieved / gemm[ref_type] * 100:.0f}% of the {ref_type} one")
    lines.append(f"GOAL {'MET' if met else 'NOT MET'} in this run")
    return {"met": met, "best": best["name"], "checks": {k: {"value": v, "ok": ok} for k, (v, ok) in checks.items()},
            "peak_gflop_per_s": peak, "achieved_gflop_per_s": achieved, "dtype": dtype, "lines": lines}


if __name__ == "__main__":
    sys.exit(main())
