"""A static int8 artifact with its float-kept MatMuls as OpenVINO dynamic int8, side by side with the float form.

    .venv/bin/python benchmarks/hybrid_int8.py STATIC_INT8_ART PARENT_ART [--dynamic ART] [--rounds 5]

NNCF's static int8 (``quantize --mode int8-static --runtime openvino``) keeps some MatMuls' activations float: the
FFN outputs by design and those its ranked search restores to meet the accuracy target. Their weights are float.
This probe gives those weight MatMuls int8 weights (per output channel, symmetric, rounded to nearest) and compiles
with OpenVINO's per-token dynamic activation quantisation (``DYNAMIC_QUANTIZATION_GROUP_SIZE=32``), so they run
int8 kernels with a scale per token and group of 32 channels, while the static ones keep their calibrated scales.
The stage builds the first hybrid itself (``--restored-matmuls int8-dynamic``, the default on a VNNI / AMX CPU
with an f32 float part); give this probe an artifact built with ``--restored-matmuls float`` to see both forms of
the same search. Variants: the parent (float), the static int8 as built, the hybrid (restored MatMuls dynamic
int8), the hybrid with the FFN outputs dynamic int8 too, and ``--dynamic`` (an ``int8-dynamic --runtime openvino``
artifact). For each: cosine min / mean of the primary output against the parent on built-in text (each text
alone), and texts/s on a padded batch (``--batch`` x ``--tokens``), one stream, rounds interleaved, medians. Prints a
table naming the CPU's features and writes JSON under benchmarks/results/ (``--json`` for another path).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_artifact_timing_args, print_table, progress_printer, write_results  # noqa: E402

GROUP = 32  # channels per dynamic activation scale: the int8-dynamic candidate's


def with_int8_weights(model, keep_int8: set[str], ffn_out: re.Pattern | None):
    """A copy of ``model`` whose float-weight MatMuls (not in ``keep_int8``; not the FFN outputs unless ``ffn_out``
    is None) read int8 weights through OpenVINO's decompression pattern (Convert, Multiply by a per-channel
    scale); returns (model, how many)."""
    import openvino as ov
    from openvino import op as ov_op

    copy = model.clone()
    changed = 0
    for node in copy.get_ordered_ops():
        name = node.get_friendly_name()
        if node.get_type_name() != "MatMul" or name in keep_int8 or (ffn_out is not None and ffn_out.search(name)):
            continue
        weight = node.input_value(1).get_node()
        if weight.get_type_name() != "Constant":
            continue  # attention's activation x activation products stay float
        w = weight.get_data().astype(np.float32)
        reduce = 1 if node.get_transpose_b() else 0  # W is N x K with transpose_b, else K x N
        amax = np.abs(w).max(axis=reduce, keepdims=True)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        deq = ov.opset13.multiply(ov.opset13.convert(ov_op.Constant(q), "f32"), ov_op.Constant(scale))
        node.input(1).replace_source_output(deq.output(0))
        changed += 1
    copy.validate_nodes_and_infer_types()
    return copy, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("static", help="An OpenVINO static int8 artifact (quantize --mode int8-static).")
    parser.add_argument("parent", help="The float artifact it was quantised from (the reference).")
    parser.add_argument("--dynamic", default=None, help="An int8-dynamic OpenVINO artifact to time beside it.")
    parser.add_argument("--texts", type=int, default=300, help="Built-in texts the cosine is measured on.")
    parser.add_argument("--batch", type=int, default=32, help="Texts in the timed batch.")
    parser.add_argument("--tokens", type=int, default=128, help="Tokens each timed text is padded / cut to.")
    add_artifact_timing_args(parser, rounds=5)
    args = parser.parse_args(argv)
    import openvino as ov

    from bertopt.artifact import Artifact
    from bertopt.data import corpus, mixed_text
    from bertopt.families import family_by_name
    from bertopt.machine import cpu_features
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads
    from bertopt.stages.quantize.nncf_int8 import int8_matmuls

    say = progress_printer(not args.quiet)
    static_art, parent = Artifact.load(args.static), Artifact.load(args.parent)
    if static_art.runtime != "openvino" or not static_art.precision.startswith("int8-static"):
        raise SystemExit(f"{args.static} is {static_art.runtime} {static_art.precision}, not an OpenVINO static int8 "
                         "artifact (bertopt quantize --mode int8-static --runtime openvino)")
    core = ov.Core()
    static = core.read_model(str(static_art.model_path))
    int8, kept = int8_matmuls(static)
    ffn_out = re.compile(family_by_name(static_art.model_info.get("family")).ffn_output_matmul)
    precision = (static_art.manifest.get("runtime_options") or {}).get("inference_precision", "f32")
    threads = args.threads or default_threads()
    base = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": "f32" if precision == "auto" else precision}
    # the static int8's own setting (the runtime turns OpenVINO's fused int8 attention off where it is wrong)
    from bertopt.runtime.openvino_backend import int8_attention_fusion_is_wrong_here

    options = static_art.manifest.get("runtime_options") or {}
    fq = {**base, **({"SNIPPETS_MODE": "DISABLE"} if int8_attention_fusion_is_wrong_here(options) else {})}
    if options.get("dynamic_quantization_group_size") is not None:  # built with --restored-matmuls int8-dynamic
        fq["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = int(options["dynamic_quantization_group_size"])
    hybrid, n_hybrid = with_int8_weights(static, set(int8), ffn_out)
    hybrid_ffn, n_ffn = with_int8_weights(static, set(int8), None)
    variants = {"parent (float)": (core.read_model(str(parent.model_path)), base, 0),
                "static int8 as built": (static, fq, len(int8)),
                "hybrid: restored MatMuls dynamic int8": (hybrid, {**fq, "DYNAMIC_QUANTIZATION_GROUP_SIZE": GROUP},
                                                          len(int8) + n_hybrid),
                "hybrid + FFN outputs dynamic int8": (hybrid_ffn, {**fq, "DYNAMIC_QUANTIZATION_GROUP_SIZE": GROUP},
                                                      len(int8) + n_ffn)}
    if args.dynamic:
        dyn = Artifact.load(args.dynamic)
        variants["int8-dynamic artifact"] = (core.read_model(str(dyn.model_path)),
                                             {**base, "DYNAMIC_QUANTIZATION_GROUP_SIZE": GROUP}, None)
    pred = Predictor(parent, provider="cpu", threads=threads, verify=False)
    out = pred.primary_output
    texts = ([t for t in corpus() if t.strip()] + mixed_text())[: args.texts]
    alone = [pred.feeds_for([e])[0] for e in pred.tokenize(texts)]
    reference = [pred.run_batch(f, [out])[out][0] for f in alone]
    timed_pred = Predictor(parent, provider="cpu", threads=threads, verify=False, max_seq_len=args.tokens)
    long_text = " ".join(t for t in corpus() if t.strip())
    padded = timed_pred.feeds_for(timed_pred.tokenize([long_text] * args.batch), pad_to=args.tokens)[0]
    compiled, results = {}, []
    for name, (model, config, int8_count) in variants.items():
        say(f"compiling {name}")
        compiled[name] = core.compile_model(model, "CPU", config)
        port = compiled[name].output(out)
        cos = []
        for feeds, ref in zip(alone, reference):
            got = np.asarray(compiled[name](feeds)[port], np.float64).ravel()
            ref = np.asarray(ref, np.float64).ravel()
            cos.append(float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))))
        results.append({"variant": name, "int8_matmuls": int8_count, "config": config,
                        "cos_min": min(cos), "cos_mean": float(np.mean(cos))})
    rates: dict[str, list[float]] = {name: [] for name in compiled}
    for c in compiled.values():
        c(padded)  # first runs allocate and pick kernels
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}")
        for name, c in compiled.items():
            start = time.perf_counter()
            c(padded)
            rates[name].append(args.batch / (time.perf_counter() - start))
    first = statistics.median(rates[next(iter(rates))])
    for res in results:
        res["texts_per_s"] = statistics.median(rates[res["variant"]])
        res["x_parent"] = res["texts_per_s"] / first
        res["rounds"] = rates[res["variant"]]
    features = cpu_features()
    rows = [[res["variant"], "-" if res["int8_matmuls"] is None else res["int8_matmuls"], f"{res['cos_min']:.5f}",
             f"{res['cos_mean']:.6f}", f"{res['texts_per_s']:.1f}", f"{res['x_parent']:.2f}"] for res in results]
    print_table(f"Static int8 with its float-kept MatMuls as OpenVINO dynamic int8 ({args.batch} x {args.tokens}, "
                f"{threads} threads, one stream; cosine vs the parent on {len(texts)} texts alone); ", features,
                ["variant", ">int8 MatMuls", ">cos min", ">cos mean", ">texts/s", ">x parent"], rows)
    write_results(args, "hybrid-int8", features, [{"static": args.static, "parent": args.parent,
                                                   "kept_float": sorted(kept), "variants": results}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
