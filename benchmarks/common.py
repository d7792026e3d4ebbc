"""Shared by the benchmark scripts: building recipe artifacts (reused when already built), the machine's peak
arithmetic rate, printing the table and writing JSON under benchmarks/results/.

Timing itself lives in ``bertopt.bench`` (the same code ``bertopt bench`` runs), so scripts and CLI agree.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the Rust tokenizer may use every core between batches (no fork here); same for every contender
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:minilm", help="Source model for the recipes.")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench",
                        help="Where recipe artifacts are built (reused if present).")
    parser.add_argument("--rebuild", action="store_true", help="Rebuild recipe artifacts even if present.")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds (medians are reported).")
    parser.add_argument("--texts", type=int, default=256, help="Sentences per padded (batch x seq) pass.")
    parser.add_argument("--mixed-texts", type=int, default=None, help="Lines of mixed text per pass (all: 512).")
    parser.add_argument("--latency-calls", type=int, default=40, help="Batch-1 calls per round.")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--latency-seq-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="Threads per contender (default: all cores).")
    parser.add_argument("--json", type=Path, default=None, help="JSON output (default: benchmarks/results/).")


def settings_from(args):
    from bertopt.bench import Settings

    return Settings(batch_size=args.batch_size, seq_len=args.seq_len, latency_seq_len=args.latency_seq_len,
                    padded_texts=args.texts, mixed_texts=args.mixed_texts, latency_calls=args.latency_calls,
                    rounds=args.rounds)


def build_recipe(recipe: str | Path, model: str, out: Path, rebuild: bool = False, say=print):
    """The final artifact of a recipe run on ``model`` (stages only: benchmarks do their own comparison).

    An existing final artifact made from the same source and recipe stages is reused."""
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.recipes import find_recipe, load_recipe, run_recipe

    rec = load_recipe(find_recipe(str(recipe)))
    final_dir = out / rec.name / f"{len(rec.stages):02d}-{rec.stages[-1][0]}"
    if not rebuild and is_artifact(final_dir):
        art = Artifact.load(final_dir)
        history = art.history()
        same_stages = [(h["stage"], h["params"]) for h in history[-len(rec.stages):]] == \
            [(name, cfg) for name, cfg in rec.stages]
        if art.source.get("spec") == model and same_stages:
            say(f"reusing {final_dir}")
            return art, rec
    say(f"building {rec.name} on {model} ...")
    result = run_recipe(rec, model=model, out=out, compare=False, gate=False)
    return result.final, rec


def cpu_line(machine: dict[str, Any]) -> str:
    """The CPU of ``bertopt.machine.machine_info()`` in one line: model, usable cores, the vector features that
    decide which precisions are fast, and which of VNNI / BF16 / AMX it lacks."""
    feats = set(machine.get("cpu_features") or [])
    named = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
             if f in feats]
    missing = [f for f in ("avx512_vnni", "avx512_bf16", "amx_int8") if f not in feats]
    cap = machine.get("isa_cap")
    capped = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
              if f in (machine.get("flags") or []) and f not in feats]
    return (f"{machine.get('cpu_model', '?')}, {machine.get('usable_cores')} usable cores, "
            f"{', '.join(named) or 'no AVX2'}" + (f"; no {', '.join(missing)}" if missing else "")
            + (f" (ONEDNN_MAX_CPU_ISA={cap}: the CPU's {', '.join(capped) or 'features'} unused)" if cap else ""))


def peak_gflops(machine: dict[str, Any], cores: int | None = None) -> dict[str, Any]:
    """Peak arithmetic rate per data type from the clock and the vector/matrix units the CPU reports.

    Assumes two 512-bit FMA pipes per core (Zen 5, Sapphire Rapids and later), or two 256-bit ones on an AVX2-only
    CPU (fp32 2 x 8 x 2; no int8 or bf16 peak is given there: neither has a dot-product instruction) and on a Zen 4
    (AMD family 25 with AVX-512: it runs a 512-bit instruction on 256-bit units, so half the AVX-512 figures).
    FLOPs per cycle per core: fp32 FMA 2 pipes x 16 lanes x 2; bf16 dot product (VDPBF16PS) 2 x 16 x 4; int8 VNNI
    (VPDPBUSD) 2 x 16 x 8 ops; AMX tiles (where present) bf16 1024 and int8 2048 per cycle.
    """
    ghz = (machine.get("cpu_mhz") or 0) / 1000
    cores = cores or machine.get("cpus") or 1
    # the features the kernels use (under a oneDNN ISA cap, fewer than the CPU has); older records: the CPU's flags
    flags = set(machine["cpu_features"] if "cpu_features" in machine else machine.get("flags") or [])
    per_cycle = {"fp32": 64 if "avx512f" in flags else 32}
    if "avx512_bf16" in flags:
        per_cycle["bf16"] = 128
    if "avx512_vnni" in flags:
        per_cycle["int8"] = 256
    pipes = "2x512-bit" if "avx512f" in flags else "2x256-bit (AVX2)"
    if "avx512f" in flags and machine.get("cpu_vendor") == "AuthenticAMD" and machine.get("cpu_family") == 25:
        per_cycle = {kind: rate // 2 for kind, rate in per_cycle.items()}
        pipes = "2x256-bit (Zen 4: AVX-512 on 256-bit units)"
    if "amx_bf16" in flags:
        per_cycle["bf16"] = 1024
    if "amx_int8" in flags:
        per_cycle["int8"] = 2048
    return {"ghz": ghz, "cores": cores, "assumption": f"{pipes} FMA pipes/core; AMX if flagged",
            **{k: v * ghz * cores for k, v in per_cycle.items()}}


def output_path(args, name: str) -> Path:
    if args.json:
        return args.json
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{name}-{stamp}.json"


def add_artifact_timing_args(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options of a script that times artifact folders side by side (bucketing.py, fixed_shape.py)."""
    parser.add_argument("--rounds", type=int, default=rounds, help="Interleaved rounds (medians are reported).")
    parser.add_argument("--threads", type=int, default=None, help="Threads (default: all cores).")
    parser.add_argument("--json", type=Path, default=None, help="JSON output (default: benchmarks/results/).")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")


def write_results(args, name: str, features, results: list[dict[str, Any]], **more: Any) -> Path:
    """The JSON of such a script (CPU features, rounds, results, and ``more`` top-level entries) at
    ``output_path``; prints where."""
    path = output_path(args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    rounds = getattr(args, "rounds", None)  # a script that does not time rounds (serve_memory.py) records none
    path.write_text(json.dumps({"cpu_features": sorted(features), "rounds": rounds, "results": results, **more},
                                indent=2))
    print(f"\nwrote {path}")
    return path


def print_table(title: str, features, columns: list[str], rows: list[list[Any]]) -> None:
    """A Markdown table under one line: ``title`` followed by the CPU's features (every speed figure names them).
    A column named with a leading ``>`` is right-aligned (numbers)."""
    print(f"\n{title}CPU features: {', '.join(sorted(features)) or 'none reported'}")
    print("| " + " | ".join(c.lstrip(">") for c in columns) + " |")
    print("|" + "|".join("---:" if c.startswith(">") else "---" for c in columns) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def progress_printer(enabled: bool = True):
    def say(message: str) -> None:
        if enabled:
            print(f"  .. {message}", file=sys.stderr, flush=True)

    return say


def gemm_ceiling(threads: int | None = None, n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Measured GFLOP/s of one large square matmul in PyTorch (oneDNN), fp32 and bf16: the practical ceiling
    for this CPU, next to the theoretical peak (``peak_gflops``). Median of ``repeats``."""
    import statistics
    import time

    import torch

    from bertopt.machine import has_native_bf16

    if threads:
        torch.set_num_threads(threads)
    out = {}
    kinds = [("fp32", torch.float32)]
    # without AVX-512 BF16 / AMX, a bf16 matmul runs a scalar fallback: minutes for one 2048^3 product, and no
    # ceiling worth reporting
    if has_native_bf16():
        kinds.append(("bf16", torch.bfloat16))
    for name, dtype in kinds:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        out[name] = 2 * n**3 / statistics.median(times) / 1e9
    return out


def recipe_contenders(args, say):
    """Each of ``args.recipes`` (names in recipes/ or paths) built on ``args.model`` (reused when built) as a bench
    Contender, and the PyTorch fp32 reference of the first one's source: (reference, contenders)."""
    from bertopt import bench

    contenders = []
    for recipe in args.recipes:
        art, rec = build_recipe(ROOT / "recipes" / f"{recipe}.yaml" if "/" not in recipe else recipe,
                                args.model, args.out, args.rebuild, say)
        contenders.append(artifact_contender(rec.name, art, args.threads, args.batch_size))
    reference = bench.reference_contender(contenders[0].predictor.artifact, threads=args.threads,
                                          batch_size=args.batch_size)
    return reference, contenders


def measure_with_batch_dev(args, say, first_key: str):
    """Build ``args.recipes``, measure them with their PyTorch fp32 reference side by side (ratios to the first
    recipe under ``first_key`` and to PyTorch fp32 under "pt-fp32"), and each one's batch deviation on the corpus
    and mixed_text: (results, the machine record taken before)."""
    from bertopt import bench, machine
    from bertopt.data import corpus, mixed_text
    from bertopt.measure.batch import batch_deviation

    settings = settings_from(args)
    reference, contenders = recipe_contenders(args, say)
    host = machine.machine_info()
    say(f"load average before: {host.get('load_average')}")
    everyone = [reference, *contenders]
    results = bench.measure(everyone, settings, reference=reference, progress=say)
    bench.add_ratios(results, contenders[0].name, first_key)
    bench.add_ratios(results, reference.name, "pt-fp32")
    texts = {"corpus": corpus(), "mixed": mixed_text()}
    for res, c in zip(results, everyone):
        res["batch_dev"] = {}
        for key, data in texts.items():
            say(f"batch deviation {c.name} on {key}")
            res["batch_dev"][key] = batch_deviation(c.predictor, data, outputs=[c.predictor.primary_output],
                                                    probes=args.probes)["batch_dev"]
    return results, host


def artifact_contender(name: str, art, threads: int | None, batch_size: int, **predictor_options):
    """A bench Contender running ``art`` through bertopt's runtime (the same Predictor validate and serve use)."""
    from bertopt.bench import Contender
    from bertopt.runtime import Predictor

    pred = Predictor(art, provider="cpu", threads=threads, batch_size=batch_size, **predictor_options)
    return Contender(name, pred, {"artifact": str(art.path), "precision": art.precision, **pred.describe()})


def add_recipe_candidate_args(parser, recipes: list[str], first_is: str) -> None:
    """The recipe-candidate scripts' options (static_int8.py, default_candidates.py): which recipes, and how many
    probe texts the batch-deviation check uses; their shared defaults for rounds and texts."""
    add_common_args(parser)
    parser.add_argument("--recipes", nargs="+", default=recipes, help=f"Candidate recipes; the first is {first_is}.")
    parser.add_argument("--probes", type=int, default=64, help="Texts per set in the batch-deviation check.")
    parser.set_defaults(rounds=3, texts=64, latency_calls=10)


def holds(result: dict, cos_min: float, dev_max: float) -> bool:
    """A measured candidate's fidelity bar: cosine min >= ``cos_min`` on the corpus and the mixed text, and batch
    deviation <= ``dev_max`` on every probe set."""
    fid = result["fidelity"]
    return bool(min(fid["corpus"]["cos_min"], fid["mixed"]["cos_min"]) >= cos_min
                and max(result["batch_dev"].values()) <= dev_max)
