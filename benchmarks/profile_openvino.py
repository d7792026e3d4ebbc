"""Where an OpenVINO artifact's time goes: per-node profiling (OpenVINO's PERF_COUNT, ``request.profiling_info``) of
the artifact run through bertopt's runtime (its own ``runtime_options``, plus ``profiling``), at 2 threads.

Prints and writes to JSON (benchmarks/results/profile-openvino-*.json):
  1. time by node type and exec type (the kernel OpenVINO picked: brgemm_avx512_i8 / jit_avx512_bf16 / ref ...)
     on (a) batches of 32 x 128 tokens and (b) mixed_text in the Predictor's length-sorted batches of 32;
  2. the share of time that runs in int8, bf16 and f32, and which float node types remain (attention, softmax,
     GELU, LayerNorm ...);
  3. the model's multiply-accumulates counted from its graph at 32 x 128 (every MatMul: weight projections and
     attention's QK^T / PV) and the achieved GOPS (2 ops per MAC) against the CPU's int8 peak
     cores x GHz x 256 (two 512-bit VNNI pipes, 64 int8 MACs each per cycle) or 2048 on AMX, and the bf16 peak
     (``common.peak_gflops``);
  4. on short texts, the Predictor's time split into tokenisation, feed building and inference (shares of the
     three timed back to back) and the rest of a ``run`` call (Python; quiet machine only), at batch 32 and 1.

    .venv/bin/python benchmarks/profile_openvino.py ARTIFACT [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, cpu_line, peak_gflops  # noqa: E402
from peers import long_texts  # noqa: E402

FLOAT_KINDS = ("f32", "bf16", "f16")


def precision_of(exec_type: str) -> str:
    """int8 / bf16 / f32 / f16 / other from an exec type such as ``brgemm_avx512_I8`` or ``jit_avx512_bf16``."""
    e = exec_type.lower()
    if "i8" in e or "u8" in e:
        return "int8"
    for kind in ("bf16", "f16", "f32"):
        if kind in e:
            return kind
    return "other"


def profiled_predictor(art, threads: int, batch_size: int):
    """A Predictor on ``art`` compiled by the OpenVINO backend with profiling on (the artifact's own options kept)."""
    import dataclasses

    from bertopt.runtime import Predictor

    handle = art.model_handle()
    profiled = dataclasses.replace(handle, runtime_options={**handle.runtime_options, "profiling": True})
    return Predictor(profiled, provider="cpu", threads=threads, runtime="openvino", batch_size=batch_size)


def collect(pred, batches: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Sum of real time (ms) and node count per (node type, exec type) over running every feed in ``batches``."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "nodes": 0})
    for feeds in batches:
        pred.run_batch(feeds, [pred.primary_output])
        for rec in pred.session.profiling_info():
            if str(rec.status).endswith("NOT_RUN") or str(rec.status).endswith("OPTIMIZED_OUT"):
                continue
            key = (rec.node_type, rec.exec_type)
            out[key]["ms"] += rec.real_time.total_seconds() * 1e3
            out[key]["nodes"] += 1
    return out


def graph_macs(model_path: Path, batch: int, seq: int) -> dict[str, float]:
    """Multiply-accumulates of every MatMul of the model at ``batch`` x ``seq`` tokens, read from OpenVINO's own
    graph after shape inference: rank-4 x rank-4 products are attention (QK^T, PV), the rest weight projections."""
    import openvino as ov

    model = ov.Core().read_model(str(model_path))
    model.reshape({p.get_any_name(): ov.PartialShape([batch, seq]) for p in model.inputs})
    macs = {"weight_matmul": 0.0, "attention_matmul": 0.0}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        a = list(op.input(0).get_partial_shape().to_shape())
        b = list(op.input(1).get_partial_shape().to_shape())
        attrs = op.get_attributes()
        k = a[-2] if attrs.get("transpose_a") else a[-1]
        out = 1
        for d in op.output(0).get_partial_shape().to_shape():
            out *= int(d)
        kind = "attention_matmul" if len(a) == 4 and len(b) == 4 else "weight_matmul"
        macs[kind] += float(out) * int(k)
    macs["total"] = macs["weight_matmul"] + macs["attention_matmul"]
    return macs


def overhead_split(pred, texts: list[str], batch: int, reps: int) -> dict[str, float]:
    """Median ms per call of the Predictor on ``texts`` in calls of ``batch``: the whole ``run`` and its parts
    (tokenize, feeds_for, run_batch); ``python_ms`` is what the run spends outside the three."""
    calls = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    parts: dict[str, list[float]] = {"run_ms": [], "tokenize_ms": [], "feeds_ms": [], "infer_ms": []}
    for _ in range(reps):
        for chunk in calls:
            t0 = time.perf_counter()
            pred.run(chunk, outputs=[pred.primary_output])
            t1 = time.perf_counter()
            enc = pred.tokenize(chunk)
            t2 = time.perf_counter()
            feeds, _lengths = pred.feeds_for(enc)
            t3 = time.perf_counter()
            pred.run_batch(feeds, [pred.primary_output])
            t4 = time.perf_counter()
            for key, dt in (("run_ms", t1 - t0), ("tokenize_ms", t2 - t1), ("feeds_ms", t3 - t2),
                            ("infer_ms", t4 - t3)):
                parts[key].append(dt * 1e3)
    out = {k: statistics.median(v) for k, v in parts.items()}
    # the remainder compares medians of separate calls: meaningful on a quiet machine only
    out["python_ms"] = max(out["run_ms"] - out["tokenize_ms"] - out["feeds_ms"] - out["infer_ms"], 0.0)
    # shares of the three parts timed back to back in one call sequence (robust to load between calls)
    steps = out["tokenize_ms"] + out["feeds_ms"] + out["infer_ms"]
    for key in ("tokenize_ms", "feeds_ms", "infer_ms"):
        out[key.replace("_ms", "_share")] = out[key] / steps if steps else float("nan")
    out["batch"] = batch
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5, help="Profiled passes over each workload.")
    parser.add_argument("--mixed-texts", type=int, default=None, help="Lines of mixed_text (default: all).")
    parser.add_argument("--short-texts", type=int, default=256, help="Short texts for the overhead split.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from bertopt.artifact import Artifact
    from bertopt.bench import mixed_texts
    from bertopt.data import corpus
    from bertopt.machine import machine_info
    from bertopt.output_paths import write_json
    from bertopt.runtime import Predictor

    console = Console(width=200)
    art = Artifact.load(args.artifact)
    machine = machine_info()
    threads, bs, seq = args.threads, args.batch_size, args.seq_len
    prof = profiled_predictor(art, threads, bs)
    plain = Predictor(art, provider="cpu", threads=threads, runtime="openvino", batch_size=bs)
    padded_view = Predictor(prof.artifact, session=prof.session, max_seq_len=seq, batch_size=bs, verify=False)

    padded = long_texts(bs, seq)
    padded_feeds = [padded_view.feeds_for(padded_view.tokenize(padded), pad_to=seq)[0]]
    mixed = mixed_texts(args.mixed_texts)
    enc = prof.tokenize(mixed)
    mixed_feeds = [prof.feeds_for([enc[i] for i in b])[0] for b in prof.plan_batches(enc, bs)]
    collect(prof, padded_feeds + mixed_feeds[:2])  # warm-up (first shapes compile)
    profiles = {"padded": collect(prof, padded_feeds * args.reps), "mixed": collect(prof, mixed_feeds * args.reps)}

    # wall time of the same padded batch without profiling, for the achieved rate
    plain_view = Predictor(art, session=plain.session, max_seq_len=seq, batch_size=bs, verify=False)
    plain_view.run(padded, pad_to=seq)
    walls = []
    for _ in range(max(args.reps, 5)):
        t0 = time.perf_counter()
        plain_view.run_batch(padded_feeds[0], [plain_view.primary_output])
        walls.append(time.perf_counter() - t0)
    wall_s = statistics.median(walls)
    macs = graph_macs(art.model_path, bs, seq)
    peak = peak_gflops(machine, cores=threads)
    achieved_gops = 2 * macs["total"] / wall_s / 1e9

    short_pool = sorted((t for t in corpus() if t.strip()), key=len)[: args.short_texts]
    overhead = [overhead_split(plain, short_pool, b, reps=3) for b in (bs, 1)]

    # -- tables ------------------------------------------------------------------------------------------------
    rows_out: dict[str, list[dict[str, Any]]] = {}
    precision_share: dict[str, dict[str, float]] = {}
    for workload, prof_rows in profiles.items():
        total = sum(v["ms"] for v in prof_rows.values()) or float("nan")
        rows = sorted(({"node_type": k[0], "exec_type": k[1], "precision": precision_of(k[1]),
                        "ms_per_pass": v["ms"] / args.reps, "share": v["ms"] / total,
                        "nodes_per_pass": v["nodes"] / args.reps} for k, v in prof_rows.items()),
                      key=lambda r: -r["share"])
        rows_out[workload] = rows
        shares: dict[str, float] = defaultdict(float)
        for r in rows:
            shares[r["precision"]] += r["share"]
        precision_share[workload] = dict(shares)
        table = Table(title=f"{art.path.name} ({art.precision}), {workload}: time by node type and exec type "
                      f"({threads} threads, {args.reps} profiled passes)", title_justify="left")
        for col in ("node type", "exec type", "precision", "ms/pass", "share", "nodes/pass"):
            table.add_column(col, justify="left" if col in ("node type", "exec type", "precision") else "right")
        for r in rows[:25]:
            table.add_row(r["node_type"], r["exec_type"], r["precision"], f"{r['ms_per_pass']:.2f}",
                          f"{r['share']:.1%}", f"{r['nodes_per_pass']:.0f}")
        console.print(table)
        console.print(f"  {workload}: share of node time by precision: " +
                      ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))
    float_types: dict[str, float] = defaultdict(float)
    for r in rows_out["padded"]:
        if r["precision"] in FLOAT_KINDS:
            float_types[r["node_type"]] += r["share"]
    float_list = sorted(float_types.items(), key=lambda kv: -kv[1])
    console.print("  float node types on (a), by share: " + ", ".join(f"{k} {v:.1%}" for k, v in float_list[:12]))

    int8_peak = peak.get("int8")
    console.print(f"CPU: {cpu_line(machine)}; {peak['ghz']:.2f} GHz (cpu MHz of /proc/cpuinfo)")
    console.print(f"MACs at {bs} x {seq}: {macs['total'] / 1e9:.2f} G (weight MatMuls "
                  f"{macs['weight_matmul'] / 1e9:.2f} G, attention {macs['attention_matmul'] / 1e9:.2f} G); one "
                  f"unprofiled pass {wall_s * 1e3:.1f} ms -> {achieved_gops:.0f} GOPS (2 ops/MAC)")
    if int8_peak:
        per_cycle = int8_peak / (threads * peak["ghz"])
        unit = {128: "2 x 256-bit VNNI pipes x 32 MACs x 2 (Zen 4)"}.get(
            round(per_cycle), "AMX tiles" if per_cycle > 256 else "2 x 512-bit VNNI pipes x 64 MACs x 2")
        console.print(f"  int8 peak = {threads} cores x {peak['ghz']:.2f} GHz x {per_cycle:.0f} ops/cycle ({unit}) "
                      f"= {int8_peak:.0f} GOPS -> {achieved_gops / int8_peak:.1%} of peak")
        if peak.get("bf16"):
            console.print(f"  bf16 peak = {peak['bf16']:.0f} GFLOPS -> {achieved_gops / peak['bf16']:.1%} of peak")
    else:
        console.print("  no int8 dot-product instructions (VNNI/AMX) on this CPU: no int8 peak to compare with")
    table = Table(title="Predictor on short texts: where a call's time goes (median ms per call; shares of "
                  "tokenize + feeds + infer)", title_justify="left")
    for col in ("batch", "run", "tokenize", "feeds", "infer", "python", "tokenize share", "infer share"):
        table.add_column(col, justify="right")
    for o in overhead:
        table.add_row(str(o["batch"]), f"{o['run_ms']:.2f}", f"{o['tokenize_ms']:.2f}", f"{o['feeds_ms']:.2f}",
                      f"{o['infer_ms']:.2f}", f"{o['python_ms']:.2f}", f"{o['tokenize_share']:.1%}",
                      f"{o['infer_share']:.1%}")
    console.print(table)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.json or RESULTS / f"profile-openvino-{art.path.name}-{stamp}.json"
    write_json(path, {"script": "profile_openvino", "artifact": str(art.path), "precision": art.precision,
                      "runtime_options": art.manifest.get("runtime_options"), "machine": machine,
                      "cpu": cpu_line(machine), "settings": vars(args) | {"artifact": str(args.artifact),
                                                                          "json": str(args.json)},
                      "nodes": rows_out, "precision_share": precision_share, "float_node_types_padded": float_list,
                      "macs": macs, "padded_wall_s": wall_s, "achieved_gops": achieved_gops, "peak": peak,
                      "peak_formula": "cores x GHz x 256 int8 ops/cycle (2 x 512-bit VNNI pipes x 64 MACs x 2)",
                      "overhead_short_texts": overhead})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
