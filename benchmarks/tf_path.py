"""The TensorFlow path on the real model: Keras BERT SavedModel -> freeze -> prune -> fp16 -> ONNX.

Prints, per stage: wall time, node count (TF graph nodes / ONNX nodes), accuracy against the TensorFlow original
(the SavedModel) and against PyTorch on the built-in corpus; then throughput at batch 32 on mixed-length text
for every artifact and both originals, measured interleaved in one process (compare the ratios, not the
absolute numbers: the machine is shared). Writes benchmarks/results/tf_path.json.

    .venv/bin/python benchmarks/tf_path.py [--model builtin:minilm] [--texts 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:minilm")
    parser.add_argument("--out", type=Path, default=None, help="Artifact folder (default: a temp folder).")
    parser.add_argument("--texts", type=int, default=256, help="Mixed-text lines per throughput pass.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS / "tf_path.json")
    parser.add_argument("--reuse", action="store_true", help="Reuse artifacts already in --out (no stage timing).")
    args = parser.parse_args()

    from bertopt.artifact import Artifact, is_artifact
    from bertopt.data import corpus, mixed_text
    from bertopt.measure.compare import compare_runs
    from bertopt.output_paths import write_json
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.sources import resolve_source
    from bertopt.sources.hf import hf_reference
    from bertopt.validate.reference import reference_predictor

    out = args.out or Path(tempfile.mkdtemp(prefix="bertopt-tf-path-"))
    plan = [("savedmodel", "export", {"to": "tf-savedmodel"}, None), ("frozen", "freeze", {}, "savedmodel"),
            ("pruned", "prune", {}, "frozen"), ("tf-fp16", "quantize", {"mode": "fp16"}, "pruned"),
            ("onnx-fp16", "export", {"to": "onnx"}, "tf-fp16"), ("onnx-fp32", "export", {"to": "onnx"}, "pruned")]
    arts, rows = {}, []
    for label, stage, cfg, parent in plan:
        t0 = time.perf_counter()
        if args.reuse and is_artifact(out / label):
            arts[label] = Artifact.load(out / label)
        else:
            arts[label] = run_stage(stage, arts[parent] if parent else args.model, cfg, out / label, overwrite=True)
        rep = arts[label].lineage["report"]
        nodes = rep.get("after", {}).get("nodes")
        row = {"artifact": label, "stage": stage, "wall_s": arts[label].lineage.get("wall_time_s"),
               "format": arts[label].model_format, "precision": arts[label].precision, "nodes": nodes}
        if stage == "freeze":
            row["nodes_before"] = rep["nodes_source_function"]
            row["variables_folded"] = rep["variables_folded"]
        elif "before" in rep:
            row["nodes_before"] = rep["before"]["nodes"]
        if stage == "prune":
            row["prune_steps"] = rep["steps"]
        if "kept_fp32_nodes" in rep:
            row["kept_fp32_nodes"] = len(rep["kept_fp32_nodes"])
        rows.append(row)
        print(f"{label:11s} {stage:8s} {row['wall_s']:6.1f}s nodes {row.get('nodes_before', '-')} -> {nodes}",
              flush=True)

    texts = corpus()
    tf_ref = reference_predictor(arts["frozen"])  # the SavedModel, run in TensorFlow
    torch_ref = hf_reference(resolve_source(args.model).path)
    preds = {label: Predictor(a) for label, a in arts.items()}
    ref_tf = tf_ref.run(texts, outputs=["sentence_embedding"])
    ref_pt = torch_ref.run(texts, outputs=["sentence_embedding"])
    kinds = {"sentence_embedding": "embedding"}
    for row in rows:
        got = preds[row["artifact"]].run(texts, outputs=["sentence_embedding"])
        for name, ref in (("vs_tf", ref_tf), ("vs_pytorch", ref_pt)):
            s = compare_runs(got, ref, kinds)["sentence_embedding"]
            row[f"{name}_cos_min"], row[f"{name}_max_abs"] = s["cos_min"], s["max_abs"]
            row[f"{name}_nan_or_inf"] = s["nan_or_inf"]

    mixed = mixed_text()[: args.texts]
    # the frozen graph runs like the pruned one; leaving it out keeps TensorFlow's per-graph memory in bounds
    contenders = {"pytorch-fp32": torch_ref, "tf-savedmodel (original)": tf_ref,
                  **{k: v for k, v in preds.items() if k != "frozen"}}
    del preds["frozen"]
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for p in contenders.values():
        p.run(mixed[:32], batch_size=32)
    for _ in range(args.rounds):
        for name, p in contenders.items():
            t0 = time.perf_counter()
            p.run(mixed, batch_size=32, outputs=["sentence_embedding"])
            times[name].append(time.perf_counter() - t0)
    speed = {k: len(mixed) / statistics.median(v) for k, v in times.items()}
    base = speed["tf-savedmodel (original)"]

    print(f"\n{'artifact':12s} {'nodes':>13s} {'cos min vs TF':>14s} {'max|d| vs TF':>12s} {'cos min vs PT':>14s} "
          f"{'max|d| vs PT':>12s}")
    for r in rows:
        print(f"{r['artifact']:12s} {str(r.get('nodes_before', '-')) + '->' + str(r['nodes']):>13s} "
              f"{r['vs_tf_cos_min']:14.7f} {r['vs_tf_max_abs']:12.2e} {r['vs_pytorch_cos_min']:14.7f} "
              f"{r['vs_pytorch_max_abs']:12.2e}")
    print(f"\nthroughput, batch 32, {len(mixed)} mixed-length texts, median of {args.rounds} interleaved rounds")
    for name, v in speed.items():
        print(f"  {name:26s} {v:8.1f} texts/s  {v / base:5.2f}x the TF original")
    write_json(args.json, {"model": args.model, "stages": rows, "throughput_texts_per_s": speed,
                           "relative_to_tf_original": {k: v / base for k, v in speed.items()},
                           "texts": len(mixed), "rounds": args.rounds,
                           "threads": getattr(tf_ref.session, "threads", None)})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
