"""Accuracy-aware int8 against plain int8 on the bundled MiniLM, in one run, step by step.

Builds (or reuses) MiniLM -> ONNX -> pruned -> BERT-fused fp32, then int8 variants of it: dynamic per-tensor and
per-channel (plain), the accuracy-aware search alone, + SmoothQuant smoothing of the attention input, + the [CLS]
rows of the FFN MatMuls in fp32 and per-token activation scaling, the search on top of all of that, and those
last two steps again with GPTQ-rounded weights (smoothing, accuracy_aware and gptq in bertopt.stages.quantize),
and the OpenVINO path made from the pruned (un-fused) model: bf16 for scale, int8 weights with activations
quantised per token in groups of 32 channels (nearest, GPTQ, GPTQ + search; bertopt.stages.quantize.openvino_int8).
For each: cosine mean/min of the sentence embedding against PyTorch fp32 on the built-in corpus (the gate's
reference; the search only sees the calibration text), and throughput on mixed-length English text (length-bucketed
batches of 32), every contender measured in interleaved rounds (A B C ... A B C ...), medians reported.

"share" is the share of plain per-channel int8's speedup kept: the ratio of speedups over ORT fp32 (= ratio of
throughputs); "gain sh" is the stricter (speedup - 1) / (plain int8 speedup - 1).
The acceptance test of issue 4: accuracy-aware cos_min >= 0.995 on the built-in corpus while keeping >= 80% of
plain int8's speedup over fp32.

    .venv/bin/python benchmarks/accuracy_aware.py [--target cos_min=0.997] [--group 1] [--alpha 0.5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def build(work: Path, target: str, group: int, alpha: float, rebuild: bool, model: str = "builtin:minilm"):
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.registry import run_stage

    def stage(name, inp, cfg, out):
        if is_artifact(out) and not rebuild:
            art = Artifact.load(out)
            if art.lineage.get("params", {}) == {**art.lineage.get("params", {}), **cfg}:
                return art
        t0 = time.perf_counter()
        art = run_stage(name, inp, cfg, out, overwrite=True)
        print(f"  built {out.name} in {time.perf_counter() - t0:.0f} s")
        return art

    onnx = stage("export", model, {}, work / "onnx")
    pruned = stage("prune", onnx, {}, work / "pruned")
    fp32 = stage("optimize", pruned, {}, work / "fp32")
    dyn = {"mode": "int8-dynamic", "per_channel": True}
    ov = {"mode": "int8-dynamic", "runtime": "openvino"}  # always one scale per channel: no per_channel option
    outliers = {"smooth_alpha": alpha, "smooth_roles": ["attention"], "first_token_fp32": True, "per_token": True}
    variants = {
        "int8 per-tensor": stage("quantize", fp32, {"mode": "int8-dynamic", "per_channel": False},
                                 work / "int8-tensor"),
        "int8 per-channel": stage("quantize", fp32, dyn, work / "int8-channel"),
        # step 0: the search alone (no outlier handling)
        "aa search only": stage("quantize", fp32, {**dyn, "accuracy_target": target, "accuracy_group": 2},
                                work / "int8-accurate"),
        # step 1: SmoothQuant on the fused-attention input (the measured-best role set)
        "+ smoothing": stage("quantize", fp32, {**dyn, "smooth_alpha": alpha, "smooth_roles": ["attention"]},
                             work / "int8-smooth"),
        # step 2: + [CLS] rows of the FFN MatMuls in fp32 + per-token activation scaling
        "+ first-token + per-token": stage("quantize", fp32, {**dyn, **outliers}, work / "int8-outliers"),
        # step 3: the accuracy-aware search on top of all of it
        "+ search (accuracy-aware)": stage("quantize", fp32, {**dyn, **outliers, "accuracy_target": target,
                                                              "accuracy_group": group}, work / "int8-outliers-aa"),
        # step 2 and 3 again with GPTQ-rounded weights (same int8 kernels)
        "+ first/per-token + GPTQ": stage("quantize", fp32, {**dyn, **outliers, "weight_rounding": "gptq"},
                                          work / "int8-outliers-gptq"),
        "+ GPTQ + search": stage("quantize", fp32, {**dyn, **outliers, "weight_rounding": "gptq",
                                                    "accuracy_target": target, "accuracy_group": group},
                                 work / "int8-outliers-gptq-aa"),
        # OpenVINO from the un-fused pruned model: bf16 for scale, then int8 weights with activations quantised
        # per token in groups of 32 channels inside the int8 MatMul (bertopt.stages.quantize.openvino_int8)
        "openvino bf16 (no int8)": stage("compile", pruned, {"runtime": "openvino"}, work / "ov-bf16"),
        "openvino int8": stage("quantize", pruned, ov, work / "ov-int8"),
        "openvino int8 + GPTQ": stage("quantize", pruned, {**ov, "weight_rounding": "gptq"},
                                      work / "ov-int8-gptq"),
        # the recipe minilm-int8-accurate: embedding tables int8 too (59 -> 23 MB)
        "openvino + GPTQ + search": stage("quantize", pruned, {**ov,
                                                               "op_types": ["MatMul", "Gather"],
                                                               "weight_rounding": "gptq", "accuracy_target": target,
                                                               "accuracy_group": group}, work / "ov-int8-gptq-aa"),
        # the same search with a stricter target, so it has something to keep fp32
        "openvino search, 0.999": stage("quantize", pruned, {**ov,
                                                             "op_types": ["MatMul", "Gather"],
                                                             "weight_rounding": "gptq",
                                                             "accuracy_target": "cos_min=0.999",
                                                             "accuracy_group": group}, work / "ov-int8-gptq-aa999"),
    }
    return fp32, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="cos_min=0.997", help="accuracy target of the search (on calibration "
                        "text; a margin over the corpus goal of 0.995)")
    parser.add_argument("--group", type=int, default=1, help="operators kept fp32 per search step")
    parser.add_argument("--alpha", type=float, default=0.5, help="smoothing strength")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="builtin:minilm", help="model to export (a Hugging Face folder)")
    parser.add_argument("--mixed-texts", type=int, default=None, help="throughput texts (default: all)")
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench-accuracy-aware")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "accuracy_aware.json")
    args = parser.parse_args()


    from bertopt.cosine import cosine_rows
    from bertopt.data import corpus, mixed_text
    from bertopt.runtime import Predictor
    from bertopt.validate.reference import reference_predictor

    print("building artifacts (reused when present)")
    t0 = time.perf_counter()
    fp32, variants = build(args.work, args.target, args.group, args.alpha, args.rebuild, args.model)
    build_s = time.perf_counter() - t0
    contenders = {"pytorch fp32": reference_predictor(fp32), "onnxruntime fp32 (fused)": Predictor(fp32)}
    contenders.update({name: Predictor(art) for name, art in variants.items()})

    texts = corpus()
    reference = contenders["pytorch fp32"].encode(texts)
    fidelity = {}
    for name, p in contenders.items():
        cos = cosine_rows(p.encode(texts), reference)
        fidelity[name] = {"cos_mean": float(cos.mean()), "cos_min": float(cos.min())}

    work = mixed_text()[: args.mixed_texts]
    for p in contenders.values():  # warm-up
        p.run(work[:64], batch_size=32)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, p in contenders.items():
            t = time.perf_counter()
            p.run(work, batch_size=32)
            times[name].append(time.perf_counter() - t)
        print(f"  round {r + 1}/{args.rounds} done")
    tput = {name: len(work) / statistics.median(ts) for name, ts in times.items()}

    rows = []
    for name in contenders:
        art = variants.get(name)
        rep = art.lineage["report"] if art is not None else {}
        rows.append({"variant": name, **fidelity[name], "texts_per_s": tput[name],
                     "speedup_vs_pytorch_fp32": tput[name] / tput["pytorch fp32"],
                     "speedup_vs_ort_fp32": tput[name] / tput["onnxruntime fp32 (fused)"],
                     "kept_fp32": len(rep.get("kept_fp32_nodes", [])) if art is not None else None,
                     "size_bytes": (art if art is not None else fp32).size_bytes(),
                     "kept_fp32_nodes": rep.get("kept_fp32_nodes") if art is not None else None})
    by = {r["variant"]: r for r in rows}
    plain = by["int8 per-channel"]
    for r in rows:
        # "share of plain int8's speedup": the ratio of speedups over ORT fp32 (= ratio of throughputs), and the
        # stricter share of the speedup's gain above 1x
        r["speedup_share"] = r["speedup_vs_ort_fp32"] / plain["speedup_vs_ort_fp32"]
        r["gain_share"] = (r["speedup_vs_ort_fp32"] - 1) / (plain["speedup_vs_ort_fp32"] - 1)
    # the goal is judged on the best of the searches: meets cos_min first, then the larger share
    aa = max((by["+ search (accuracy-aware)"], by["+ GPTQ + search"], by["openvino + GPTQ + search"]),
             key=lambda r: (r["cos_min"] >= 0.995, r["speedup_share"]))
    goal = {"variant": aa["variant"], "cos_min_goal": 0.995, "cos_min": aa["cos_min"],
            "cos_min_met": aa["cos_min"] >= 0.995, "speedup_share_goal": 0.8,
            "speedup_share": aa["speedup_share"], "gain_share": aa["gain_share"],
            "speedup_share_met": aa["speedup_share"] >= 0.8,
            # the same runtime's own plain int8 and bf16, so a runtime's head start is visible
            "share_of_openvino_int8": aa["texts_per_s"] / by["openvino int8"]["texts_per_s"],
            "share_of_openvino_bf16": aa["texts_per_s"] / by["openvino bf16 (no int8)"]["texts_per_s"]}

    head = (f"{'variant':28} {'cos mean':>9} {'cos min':>8} {'texts/s':>8} {'x PT fp32':>9} {'x ORT fp32':>10} "
            f"{'share':>6} {'gain sh':>7} {'kept fp32':>9} {'MB':>6}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        kept = "-" if r["kept_fp32"] is None else str(r["kept_fp32"])
        print(f"{r['variant']:28} {r['cos_mean']:9.5f} {r['cos_min']:8.5f} {r['texts_per_s']:8.1f} "
              f"{r['speedup_vs_pytorch_fp32']:9.2f} {r['speedup_vs_ort_fp32']:10.2f} {r['speedup_share']:6.0%} "
              f"{r['gain_share']:7.0%} {kept:>9} {r['size_bytes'] / 1e6:6.1f}")
    search = variants[aa["variant"]].lineage["report"]["accuracy_search"]
    print(f"\naccuracy-aware: target {search['target']} on {search['measured_on']}; {search['evaluations']} "
          f"evaluations in {search['search_s']} s; kept fp32: {', '.join(aa['kept_fp32_nodes']) or 'none'}")
    print(f"goal: cos_min {aa['cos_min']:.5f} >= 0.995: {goal['cos_min_met']}; share of plain int8's speedup "
          f"{goal['speedup_share']:.0%} (ratio of speedups; {goal['gain_share']:.0%} of the gain above 1x) "
          f">= 80%: {goal['speedup_share_met']}")
    print(f"      its throughput is {goal['share_of_openvino_int8']:.0%} of OpenVINO int8 (nearest rounding, no "
          f"search) and {goal['share_of_openvino_bf16']:.0%} of OpenVINO bf16")

    result = {"benchmark": "accuracy_aware", "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
              "settings": {"target": args.target, "group": args.group, "alpha": args.alpha, "rounds": args.rounds,
                           "throughput_texts": len(work), "fidelity_texts": len(texts), "batch_size": 32},
              "build_s": round(build_s, 1), "rows": rows, "goal": goal,
              "search": {k: search[k] for k in ("target", "measured_on", "evaluations", "search_s", "steps",
                                                "kept_fp32")},
              "sensitivity": search["sensitivity"]}
    from bertopt.machine import machine_info
    from bertopt.output_paths import write_json
    from bertopt.validate.reports import package_versions

    result["machine"], result["versions"] = machine_info(), package_versions()
    write_json(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
