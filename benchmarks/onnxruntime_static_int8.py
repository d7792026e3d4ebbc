"""Static int8 through ONNX Runtime's integer kernels, measured against an fp32 artifact (issue 28's AVX2 probe).

    .venv/bin/python benchmarks/onnxruntime_static_int8.py SOURCE [--baseline ART] [--kernel u8u8] [--fuse] [--rounds 5]

SOURCE is an ONNX artifact as exported (``bertopt export builtin:minilm --out SOURCE``); ``--baseline`` is the
artifact the speed is compared with (default: SOURCE; the tuned default, fused by ``optimize``, is the fair one).
NNCF's ONNX backend quantises SOURCE with the settings of ``quantize --mode int8-static`` (TRANSFORMER model
type, mixed preset, SmoothQuant alpha ``--alpha``, no bias correction, ``--calibration`` texts of the built-in
calibration set), and the graph is rewritten for ONNX Runtime:

* one QuantizeLinear / DequantizeLinear pair per consumer, each with its own scale and zero-point constants: NNCF
  gives query, key and value one shared activation quantiser, and without this ONNX Runtime 1.31 turned only 24
  of MiniLM's 42 quantised MatMuls into ``MatMulIntegerToFloat`` in the signed graph (all 42 with it; in the u8u8
  graph, whose pairs each get a new zero-point tensor, all 42 either way);
* ``--kernel u8u8``: weights and activations as uint8 (the same values, zero point + 128), which selects MLAS's
  u8u8 kernel: no 16-bit saturation, full 8-bit weights. ``u8s8``: int8 weights, full range; ``u8s8-7bit``:
  weights in 7 bits (NNCF's overflow fix), what keeps ``vpmaddubsw`` from saturating on a CPU without VNNI.

``--fuse`` applies ONNX Runtime's transformer fusions to each variant, as the ``optimize`` stage does for the fp32
default (LayerNorm, GELU; attention only where its Q / K / V MatMuls are float).

Each variant (``--variants``) puts the activations of some MatMul groups back to float (their weights stay int8):
``ffn-out`` is the family's FFN output projections, ``attn-out`` the attention output projections, ``qkv`` the
query / key / value projections, ``ffn-in`` the FFN input projections. For each: the number of MatMuls ONNX
Runtime runs in int8, cosine min of the primary output vs SOURCE (fp32; within 1e-5 of PyTorch) on the corpus
(each text alone) and on ``mixed_text`` (batches of 32), batch deviation (max 1 - cos, a corpus text alone vs in
batches of 32), and texts/s on padded 32 x 128 and on ``mixed_text`` (the Predictor's buckets; tokenised outside
the timing) as a ratio to the baseline, medians of interleaved rounds. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import output_path, progress_printer  # noqa: E402

KERNELS = ("u8u8", "u8s8", "u8s8-7bit")
DEFAULT_VARIANTS = "none;ffn-out;ffn-out,attn-out"
# BERT-style export names (MiniLM, MPNet, ...); ffn-out comes from the family declaration
GROUPS = {"attn-out": r"attention/(output/dense|o)/MatMul$",
          "qkv": r"attention/(self/)?(query|key|value|q|k|v)/MatMul$",
          "ffn-in": r"(intermediate/dense|ffn/lin1)/MatMul$"}
SEQ_LEN = 128


def quantize(art, texts: list[str], alpha: float, seven_bit: bool):
    import nncf
    import onnx
    from nncf.quantization.advanced_parameters import (
        AdvancedQuantizationParameters,
        AdvancedSmoothQuantParameters,
        OverflowFix,
    )

    from bertopt.runtime import Predictor

    predictor = Predictor(art, provider="cpu", verify=False)
    feeds = [predictor.feeds_for(predictor.tokenize([t]))[0] for t in texts]
    model = onnx.load(str(art.model_path))
    return nncf.quantize(model, nncf.Dataset(feeds), subset_size=len(feeds), model_type=nncf.ModelType.TRANSFORMER,
                         preset=nncf.QuantizationPreset.MIXED,
                         advanced_parameters=AdvancedQuantizationParameters(
                             disable_bias_correction=True,
                             smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha),
                             overflow_fix=OverflowFix.ENABLE if seven_bit else OverflowFix.DISABLE))


class Graph:
    """Name lookups over an ONNX graph: constants (initializers or Constant nodes), producers and consumers."""

    def __init__(self, model):
        from onnx import numpy_helper

        self.model, self.g, self._nh = model, model.graph, numpy_helper
        self.inits = {i.name: i for i in self.g.initializer}
        self.consts = {n.output[0]: n for n in self.g.node if n.op_type == "Constant"}
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers = collections.defaultdict(list)
        for n in self.g.node:
            for i, x in enumerate(n.input):
                self.consumers[x].append((n, i))

    def array(self, name: str):
        if name in self.inits:
            return self._nh.to_array(self.inits[name])
        return self._nh.to_array(self.consts[name].attribute[0].t)

    def is_constant(self, name: str) -> bool:
        return name in self.inits or name in self.consts

    def add(self, array, name: str) -> str:
        tensor = self._nh.from_array(array, name)
        self.g.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def activation_pair(self, name: str):
        """The (QuantizeLinear, DequantizeLinear) pair producing ``name`` from an activation, or None."""
        dq = self.producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or self.is_constant(dq.input[0]):
            return None
        q = self.producer.get(dq.input[0])
        return (q, dq) if q is not None and q.op_type == "QuantizeLinear" else None


def one_pair_per_consumer(model) -> int:
    """Give every consumer of a shared activation Q / DQ pair its own pair with its own scale and zero point."""
    from onnx import helper

    graph, nodes, copies = Graph(model), [], 0
    for node in graph.g.node:
        nodes.append(node)
        pair = graph.activation_pair(node.output[0]) if node.op_type == "DequantizeLinear" else None
        if pair is None:
            continue
        q = pair[0]
        for k, (consumer, slot) in enumerate(graph.consumers[node.output[0]][1:], 1):
            tag = f"_consumer{k}"
            scale = graph.add(graph.array(q.input[1]), q.input[1] + tag)
            zero = graph.add(graph.array(q.input[2]), q.input[2] + tag)
            q2 = helper.make_node("QuantizeLinear", [q.input[0], scale, zero], [q.output[0] + tag], name=q.name + tag)
            dq2 = helper.make_node("DequantizeLinear", [q2.output[0], scale, zero], [node.output[0] + tag],
                                   name=node.name + tag)
            q2.attribute.extend(q.attribute)
            dq2.attribute.extend(node.attribute)
            nodes += [q2, dq2]
            consumer.input[slot] = dq2.output[0]
            copies += 1
    del graph.g.node[:]
    graph.g.node.extend(nodes)
    return copies


def to_unsigned(model) -> int:
    """int8 MatMul weights and int8 activation pairs as uint8 with zero point + 128: the same values, u8u8 kernel."""
    import numpy as np

    graph, changed = Graph(model), 0

    def shifted(name: str, tag: str) -> str:
        return graph.add((graph.array(name).astype(np.int16) + 128).astype(np.uint8), f"{name}_u8{tag}")

    for k, node in enumerate(graph.g.node):
        if node.op_type != "DequantizeLinear":
            continue
        if graph.is_constant(node.input[0]):  # a weight
            if graph.array(node.input[0]).dtype == np.int8 and all(
                    c.op_type == "MatMul" for c, _ in graph.consumers[node.output[0]]):
                node.input[0], node.input[2] = shifted(node.input[0], ""), shifted(node.input[2], "")
                changed += 1
            continue
        pair = graph.activation_pair(node.output[0])
        if pair and graph.array(pair[0].input[2]).dtype == np.int8:
            zero = shifted(pair[0].input[2], f"_{k}")
            pair[0].input[2] = node.input[2] = zero
            changed += 1
    return changed


def float_activations(model, names: set[str]):
    """A copy whose MatMuls in ``names`` run in float: activations unquantised, weights the dequantised int8
    values as a float constant (ONNX Runtime does not fold a weight's DequantizeLinear; left in, it would
    dequantise the weight on every run)."""
    import numpy as np

    model = copy.deepcopy(model)
    graph = Graph(model)
    for node in graph.g.node:
        if node.op_type == "MatMul" and node.name in names:
            for slot, x in enumerate(node.input):
                pair = graph.activation_pair(x)
                dq = graph.producer.get(x)
                if pair:
                    node.input[slot] = pair[0].input[0]
                elif dq is not None and dq.op_type == "DequantizeLinear" and graph.is_constant(dq.input[0]):
                    q = graph.array(dq.input[0]).astype(np.float32)
                    scale, zero = graph.array(dq.input[1]), graph.array(dq.input[2]).astype(np.float32)
                    if scale.ndim:  # per channel along the DQ's axis
                        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) % q.ndim
                        shape = [-1 if d == axis else 1 for d in range(q.ndim)]
                        scale, zero = scale.reshape(shape), zero.reshape(shape)
                    node.input[slot] = graph.add(((q - zero) * scale).astype(np.float32), f"{x}_float")
    return model


def fuse(model, art):
    """The optimize stage's fusions applied to a quantised variant: LayerNorm / GELU always; attention only where
    its Q / K / V MatMuls are float."""
    from bertopt.families import family_by_name
    from bertopt.stages.optimize import transformer_fusions

    info = art.model_info
    family = family_by_name(info.get("family"))
    if family.fusion_model_type is None:
        return model, {}
    return transformer_fusions(model, family, int(info["num_attention_heads"]), int(info["hidden_size"]), 0)


def int8_matmuls(model, threads: int | None) -> int:
    """How many MatMuls ONNX Runtime runs as integer kernels once it has optimised ``model``."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from bertopt.onnx_graph.util import op_counts

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        ops = op_counts(onnx.load(options.optimized_model_filepath))
    return sum(ops.get(op, 0) for op in ("MatMulIntegerToFloat", "MatMulInteger", "QLinearMatMul"))


def cos_min(a, b) -> float:
    import numpy as np

    return float((np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def fidelity(art, session, reference: dict) -> dict:
    from bertopt.data import corpus, mixed_text
    from bertopt.runtime import Predictor

    out = art.primary_output
    alone = Predictor(art, session=session, verify=False, batch_size=1).run(corpus(), outputs=[out])[out]
    batched = Predictor(art, session=session, verify=False, batch_size=32).run(corpus(), outputs=[out])[out]
    mixed = Predictor(art, session=session, verify=False, batch_size=32).run(mixed_text(), outputs=[out])[out]
    return {"cos_min_corpus": cos_min(reference["corpus"], alone), "cos_min_mixed": cos_min(reference["mixed"], mixed),
            "batch_dev": 1.0 - cos_min(alone, batched)}


def workloads(predictor) -> dict[str, list]:
    """Padded 32 x 128 (the 32 longest mixed_text lines, cut to 128 tokens) and mixed_text in the Predictor's
    buckets, as feeds, tokenised once."""
    from bertopt.data import mixed_text

    texts = mixed_text()
    encodings = predictor.tokenize(texts)
    longest = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))[-32:]
    padded = {k: v[:, :SEQ_LEN] for k, v in predictor.feeds_for([encodings[i] for i in longest])[0].items()}
    mixed = [predictor.feeds_for([encodings[i] for i in b])[0]
             for b in predictor.plan_batches(encodings, predictor.batch_size)]
    return {"padded": [padded], "mixed": mixed, "texts": {"padded": len(longest), "mixed": len(texts)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="ONNX artifact as exported (fp32, unfused).")
    parser.add_argument("--baseline", default=None, help="Artifact the speed is compared with (default: SOURCE).")
    parser.add_argument("--kernel", choices=KERNELS, default="u8u8", help="Integer kernel to select (default u8u8).")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"';'-separated groups whose activations stay float (default {DEFAULT_VARIANTS!r}).")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant alpha (the stage's default 0.5).")
    parser.add_argument("--calibration", type=int, default=192, help="Calibration texts (default 192).")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds (medians are reported).")
    parser.add_argument("--threads", type=int, default=None, help="Threads (default: all cores).")
    parser.add_argument("--json", type=Path, default=None, help="JSON output (default: benchmarks/results/).")
    parser.add_argument("--fuse", action="store_true",
                        help="Apply ONNX Runtime's transformer fusions (the optimize stage's) to each variant.")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")
    args = parser.parse_args(argv)
    variants = [[g for g in v.split(",") if g and g != "none"] for v in args.variants.split(";")]
    unknown = sorted({g for v in variants for g in v} - {"ffn-out", *GROUPS})
    if unknown:
        parser.error(f"--variants: unknown group {unknown[0]!r}; use none, ffn-out, {', '.join(GROUPS)}")

    from bertopt.artifact import Artifact
    from bertopt.data import calibration_texts, corpus, mixed_text
    from bertopt.families import family_by_name
    from bertopt.machine import cpu_features
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import open_model

    say = progress_printer(not args.quiet)
    art = Artifact.load(args.source)
    if art.model_format != "onnx":
        parser.error(f"{args.source} is {art.model_format}; give an ONNX artifact as exported")
    out = art.primary_output
    say(f"quantising {art.path.name} with NNCF ({args.calibration} texts, kernel {args.kernel})")
    t0 = time.perf_counter()
    quantized = quantize(art, calibration_texts()[: args.calibration], args.alpha, args.kernel == "u8s8-7bit")
    build_s = time.perf_counter() - t0
    copies = one_pair_per_consumer(quantized)
    unsigned = to_unsigned(quantized) if args.kernel == "u8u8" else 0
    matmuls = [n.name for n in quantized.graph.node if n.op_type == "MatMul"]
    patterns = {"ffn-out": family_by_name(art.model_info.get("family")).ffn_output_matmul, **GROUPS}

    fp32 = Predictor(art, provider="cpu", threads=args.threads, batch_size=1)
    reference = {"corpus": fp32.run(corpus(), outputs=[out])[out],
                 "mixed": Predictor(art, provider="cpu", threads=args.threads).run(mixed_text(), outputs=[out])[out]}
    baseline = Predictor(args.baseline or art, provider="cpu", threads=args.threads)
    contenders = [("baseline", baseline)]
    rows = []
    for groups in variants:
        names = {n for n in matmuls for g in groups if re.search(patterns[g], n)}
        model = float_activations(quantized, names)
        fused_ops = {}
        if args.fuse:
            model, fused_ops = fuse(model, art)
        session = open_model(model, threads=args.threads)
        label = "+".join(groups) or "none"
        say(f"variant {label}: {len(names)} MatMuls with float activations; fused {fused_ops}")
        rows.append({"float_groups": groups, "float_matmuls": len(names), "fused_ops": fused_ops,
                     "int8_matmuls": int8_matmuls(model, args.threads), **fidelity(art, session, reference)})
        contenders.append((label, Predictor(art, session=session, verify=False)))

    feeds = {name: workloads(p) for name, p in contenders}
    for name, p in contenders:  # warm-up: every shape once
        for kind in ("padded", "mixed"):
            for f in feeds[name][kind]:
                p.run_batch(f, [out])
    rates = {(name, kind): [] for name, _ in contenders for kind in ("padded", "mixed")}
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}")
        for kind in ("padded", "mixed"):
            for name, p in contenders:
                start = time.perf_counter()
                for f in feeds[name][kind]:
                    p.run_batch(f, [out])
                rates[name, kind].append(feeds[name]["texts"][kind] / (time.perf_counter() - start))
    for row, (name, _) in zip(rows, contenders[1:]):
        for kind in ("padded", "mixed"):
            row[f"{kind}_texts_per_s"] = statistics.median(rates[name, kind])
            row[f"x_baseline_{kind}"] = statistics.median(
                x / b for x, b in zip(rates[name, kind], rates["baseline", kind]))
    features = sorted(cpu_features())
    print(f"\nONNX Runtime static int8 ({args.kernel}) of {art.path.name} vs {baseline.model.path.name}; "
          f"CPU features: {', '.join(features) or 'none reported'}")
    print(f"baseline: padded 32 x {SEQ_LEN} {statistics.median(rates['baseline', 'padded']):.1f} texts/s, mixed "
          f"{statistics.median(rates['baseline', 'mixed']):.1f} texts/s")
    print("| float activations | int8 MatMuls | cos min corpus (alone) | cos min mixed | batch dev | "
          "padded /s | x baseline | mixed /s | x baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {'+'.join(row['float_groups']) or 'none'} ({row['float_matmuls']}) | {row['int8_matmuls']} | "
              f"{row['cos_min_corpus']:.5f} | {row['cos_min_mixed']:.5f} | {row['batch_dev']:.1e} | "
              f"{row['padded_texts_per_s']:.1f} | {row['x_baseline_padded']:.2f} | {row['mixed_texts_per_s']:.1f} | "
              f"{row['x_baseline_mixed']:.2f} |")
    path = output_path(args, "onnxruntime-static-int8")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "cpu_features": features, "source": str(art.path), "baseline": str(baseline.model.path),
        "kernel": args.kernel, "fuse": args.fuse, "alpha": args.alpha, "calibration_texts": args.calibration,
        "rounds": args.rounds,
        "build_s": build_s, "consumer_pairs_added": copies, "tensors_made_unsigned": unsigned,
        "baseline_texts_per_s": {k: statistics.median(rates["baseline", k]) for k in ("padded", "mixed")},
        "results": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
