"""Static int8 for the OpenVINO runtime through NNCF (OpenVINO's maintained post-training quantiser).

``quantize --mode int8-static --runtime openvino`` reads the exported or pruned ONNX as an OpenVINO model and
calls ``nncf.quantize(model_type=TRANSFORMER)`` with its SmoothQuant, calibrated on text (the built-in
calibration text or ``--calibration-data``, one sentence per sample, no padding). The FFN output projections
(named by the model family's declaration, :attr:`bertopt.families.Family.ffn_output_matmul`) are left out of
quantisation from the start: their GELU-fed inputs are the ones a fixed int8 scale handles worst. The result is
written as an OpenVINO IR (``model.xml`` + ``model.bin``, both hashed; ``model_format: openvino-ir``), whose
FakeQuantize pairs OpenVINO's CPU plugin runs as int8 MatMuls (VNNI / AMX); a text's activation scales never
depend on its batch-mates.

Short texts run on a float copy of the model (``--float-short-texts``, ``float.xml`` + ``float.bin`` beside the int8
IR, hashed like it; ``runtime_options.float_short_texts`` is the token count up to which a text runs float). A fixed
int8 scale hurts a short text most (its few rows carry no averaging of the rounding noise, and its [SEP] row is
outsized), and short texts take the least time: on MiniLM the texts over 8 tokens held cosine 0.9967 with every
MatMul but the FFN outputs int8, where the shorter fell to 0.983, so the search that used to put 14-22 MatMuls back
to float for all texts has nothing to do. Each text takes its path by its own length, alone or in any batch.

Then it is measured, never assumed: a quarter of the calibration text is held back (never calibrated on) and run
through the quantised model alone and in mixed-length padded batches, against the fp32 parent alone. It ships
only when the cosine target (``--accuracy-target``, default ``cos_min=0.997``: a margin over the release gate's
0.995 on text it never saw) holds both ways and the batch deviation is at most 1e-3. Otherwise a bounded ranked
search keeps more MatMuls' activations in float: every quantised MatMul is ranked once (its activation
quantisation removed alone, the held-back cosine measured), then the worst are put back to float in rank order,
at most ``--max-float-extra``, until the target holds; if it never does, the stage refuses with one line. A
MatMul put back this way keeps its int8 weights (per channel) and its SmoothQuant scaling on both sides, so it is
the same function in float activations (NNCF's own accuracy control restores the original weight while the
smoothing of its input stays, which is why it is not used: docs/quantization.md).

How a restored MatMul then runs is ``--restored-matmuls``: ``int8-dynamic`` keeps its int8 weights as NNCF stored
them and has OpenVINO quantise its activations per token and group of 32 channels as each batch runs (dynamic
quantisation, batch-invariant: a token's scale is its own), ``float`` stores its weights decompressed. ``auto``
(the default) is int8-dynamic where the CPU has an int8 dot product and the float part runs f32 (``--inference-precision
f32``, or bf16 where it is not native), float elsewhere: OpenVINO runs no dynamic quantisation without VNNI / AMX
(on an AVX2-only EPYC the outputs with and without it were bit-identical, and its int8-weight MatMuls ran at
0.88-0.94x float ones) nor on bf16 activations (on an AVX-512 VNNI + BF16 EPYC they ran as bf16 MatMuls
decompressing their weights), while with VNNI / AMX kernels and an f32 float part MiniLM's static int8 ran at 1.11x
its float-restored form at the same fidelity (docs/performance.md). The search measures the form it builds: every
candidate is compiled with the dynamic quantisation the artifact will run with.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bertopt.cosine import min_row_cosine
from bertopt.errors import UserError
from bertopt.model_handle import FLOAT_MODEL_FILE, FLOAT_SHORT_TEXTS, attention_mask_input
from bertopt.params import BATCH_DEV_BOUND, STATIC_FULL_BATCH, Param
from bertopt.stages.quantize.methods import Method
from bertopt.stages.quantize.openvino_int8 import (
    ACTIVATION_GROUP_SIZE,
    INFERENCE_PRECISION,
    KEEP_FFN_OUTPUT,
    ffn_output_names,
)
from bertopt.stages.quantize.smoothing import SMOOTH_ALPHA as SMOOTH_ALPHA_PARAM

MODEL_FILE = "model.xml"
MODEL_FORMAT = "openvino-ir"
DEFAULT_TARGET = "cos_min=0.997"
BATCH_DEV_MAX = BATCH_DEV_BOUND  # 1 - cosine of a held-back text alone vs inside a batch (the release gate's)
HELD_BACK_EVERY = 4  # every 4th calibration text is held back to measure the result
HELD_BATCH = 16  # held-back texts per padded batch in the batched measurement
RANK_TEXTS = 24  # held-back texts the ranking measures each candidate on
FEW_VALUES = 8  # a pooled output with fewer values (a score, a few logits) is compared over the whole held set
PRESETS = ("mixed", "performance")
# SmoothQuant strength on MatMuls: NNCF's transformer default (0.95) moves so much range into the weights that
# per-channel int8 weights alone cost cosine 0.995 on MiniLM; 0.5 balances them (0.9986 with weights only int8)
SMOOTH_ALPHA = 0.5
_DEFAULT_OP_TYPES = ["MatMul", "Attention", "Gemm"]
RESTORED_MODES = ("auto", "int8-dynamic", "float")
DYNAMIC_GROUP = ACTIVATION_GROUP_SIZE.default  # channels per dynamic activation scale of a restored MatMul
# --float-short-texts auto: texts of at most SHORT_TEXTS_MIN tokens run float, more where a longer held-back text
# misses the target, up to SHORT_TEXTS_MAX (past that the ranked search restores MatMuls as well). On MiniLM (Zen 4,
# FFN outputs float, nothing restored) the texts over 8 tokens of the corpus, mixed text and held-back text held
# cosine 0.9967 where the shorter fell to 0.983; 16 leaves a margin at a cost of 2-3% on mixed text
SHORT_TEXTS_MIN = 16
SHORT_TEXTS_MAX = 32


def _short_texts_problem(value: Any) -> str | None:
    text = str(value).strip()
    if text in ("auto", "off") or (text.isdigit() and 1 <= int(text) <= 4096):
        return None
    return "must be auto, off or a number of tokens (1 or more)"

# this method's own parameter group
NNCF_PARAMS = (
    Param("nncf_preset", str, "mixed", "NNCF's preset: mixed (symmetric weights, "
          "asymmetric activations: more faithful after GELU / softmax) or performance (symmetric both).",
          choices=PRESETS),
    KEEP_FFN_OUTPUT,
    Param("max_float_extra", int, 48, "At most this many more MatMuls the ranked "
          "search may put back to float activations when the measured cosine misses the target (0: none; the "
          "stage then refuses rather than ship an unfaithful model).", min=0),
    Param("float_short_texts", str, "auto", "Texts of at most this many tokens (special tokens counted) run on a "
          "float copy of the model kept in the artifact, longer ones int8: fixed int8 scales hurt a short text most, "
          "and short texts take the least time (MiniLM: texts over 8 tokens held cosine 0.9967 as quantised, shorter "
          "ones fell to 0.983). A text takes the same path alone or in any batch. auto: at least "
          f"{SHORT_TEXTS_MIN}, more where a longer held-back text misses the target (up to {SHORT_TEXTS_MAX}; at "
          "most half the model's window); off: every text int8; or a number of tokens.", check=_short_texts_problem),
    Param("restored_matmuls", str, "auto", "How the MatMuls the ranked search takes "
          "out of static int8 run. int8-dynamic: int8 weights, activations quantised per token and group of "
          f"{DYNAMIC_GROUP} channels as each batch runs (OpenVINO's dynamic quantisation; 1.11x the float form at "
          "the same fidelity on MiniLM with VNNI / AMX kernels, f32 float part); float: weights decompressed "
          "once. auto: int8-dynamic where the CPU has an int8 dot product (VNNI / AMX) and the float part runs "
          "f32, float elsewhere (OpenVINO quantises no bf16 activations, and none without VNNI / AMX).",
          choices=RESTORED_MODES),
)


def check_config(config: dict[str, Any]) -> None:
    """Refuse, with the fix, a shared option this method cannot honour (options of the other methods are refused
    by the stage's declaration)."""
    if list(config.get("op_types") or _DEFAULT_OP_TYPES) != _DEFAULT_OP_TYPES:
        raise UserError("--op-types does not apply to --mode int8-static --runtime openvino (NNCF quantises the "
                        "MatMuls its transformer patterns allow); keep MatMuls in float with --exclude-nodes")


def restored_mode(config: dict[str, Any]) -> str:
    """``--restored-matmuls`` resolved for this machine: int8-dynamic or float."""
    mode = config.get("restored_matmuls") or "auto"
    if mode != "auto":
        return mode
    from bertopt.machine import has_int8_dot_product, has_native_bf16

    # OpenVINO quantises f32 activations only: with a bf16 float part (OpenVINO 2026.4, AVX-512 VNNI + BF16 EPYC)
    # a restored MatMul ran as a bf16 one decompressing its int8 weights on every call, no faster than float
    # weights and less faithful (corpus cosine min 0.9958 against 0.9975). bf16 asked where it is not native runs f32
    bf16 = config.get("inference_precision", "bf16") == "bf16" and has_native_bf16()
    return "int8-dynamic" if has_int8_dot_product() and not bf16 else "float"


def runtime_options(config: dict[str, Any], dynamic: bool = False) -> dict[str, Any]:
    """The manifest's ``runtime_options``: int8 MatMuls from the IR's FakeQuantize pairs, the float rest in
    ``--inference-precision``; ``dynamic``: MatMuls with int8 weights and float activations (the restored ones)
    quantise their activations per token as they run."""
    options = {"inference_precision": config["inference_precision"], "performance_hint": "LATENCY"}
    if dynamic:
        options["dynamic_quantization_group_size"] = DYNAMIC_GROUP
    return options


def split_texts(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(calibration texts, held-back texts): every ``HELD_BACK_EVERY``-th text is held back, the first
    ``calibration_size`` of the others calibrate."""
    from bertopt.data import calibration_texts

    if config.get("calibration_data"):
        from bertopt.measure.data import load_texts

        texts = load_texts(config["calibration_data"], text_flag=None).texts
    else:
        texts = calibration_texts()
    texts = [t for t in texts if t.strip()]
    held = texts[HELD_BACK_EVERY - 1::HELD_BACK_EVERY]
    calib = [t for i, t in enumerate(texts) if i % HELD_BACK_EVERY != HELD_BACK_EVERY - 1]
    calib = calib[: config.get("calibration_size") or len(calib)]
    if not calib or not held:
        raise UserError(f"static int8 needs at least {HELD_BACK_EVERY} calibration texts (one of every "
                        f"{HELD_BACK_EVERY} is held back to measure the result), got {len(texts)}; give "
                        "--calibration-data FILE with one sentence a line")
    return calib, held


def cosine_target(config: dict[str, Any], art) -> float:
    """The cosine minimum the result must hold on the held-back text (``--accuracy-target``'s ``cos_min``)."""
    from bertopt.measure.targets import parse_targets

    targets = parse_targets(config.get("accuracy_target") or DEFAULT_TARGET)
    driven = [t for t in targets if t.metric == "cos_min" and t.op in (">=", ">")]
    other = [t for t in targets if t not in driven]
    if other or not driven:
        raise UserError(f"--accuracy-target for --mode int8-static --runtime openvino takes cos_min=VALUE only (the "
                        f"cosine of {art.primary_output} it measures alone and batched on held-back text); got "
                        f"'{config.get('accuracy_target')}'")
    return float(driven[0].value)


# data-movement ops between an activation quantiser and the MatMul it feeds (attention's Q / K / V heads)
_PASS_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Convert")


def _activation_fqs(op) -> list[tuple[Any, int]]:
    """(node, input port) pairs where an activation FakeQuantize (one whose data is not a constant weight) feeds
    the MatMul ``op``, directly or through reshapes / transposes (the attention MatMuls' Q, K and V)."""
    found = []
    for i in range(op.get_input_size()):
        node, port = op, i
        src = op.input_value(i).get_node()
        while src.get_type_name() in _PASS_THROUGH:
            node, port = src, 0
            src = src.input_value(0).get_node()
        if src.get_type_name() == "FakeQuantize" and src.input_value(0).get_node().get_type_name() != "Constant":
            found.append((node, port))
    return found


def int8_matmuls(ov_model) -> tuple[list[str], list[str]]:
    """(MatMuls that run int8, MatMuls left in float) of a quantised model: int8 when an activation input comes
    from a FakeQuantize."""
    int8, kept = [], []
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() == "MatMul":
            (int8 if _activation_fqs(op) else kept).append(op.get_friendly_name())
    return int8, kept


def _decompressed_weight(node) -> np.ndarray | None:
    """The float value of NNCF's compressed int8 weight ``node`` (Multiply(Convert(int8 Constant) [- zero point],
    scale)), computed as OpenVINO computes it; None when ``node`` is not one."""
    if node.get_type_name() != "Multiply":
        return None
    data, scale = (node.input_value(i).get_node() for i in range(2))
    if scale.get_type_name() != "Constant":
        return None
    zero = None
    if data.get_type_name() == "Subtract" and data.input_value(1).get_node().get_type_name() == "Constant":
        zero = data.input_value(1).get_node().get_data().astype(np.float32)
        data = data.input_value(0).get_node()
    if data.get_type_name() != "Convert" or data.input_value(0).get_node().get_type_name() != "Constant":
        return None
    weight = data.input_value(0).get_node().get_data().astype(np.float32)
    if zero is not None:
        weight = weight - zero
    return (weight * scale.get_data().astype(np.float32)).astype(np.float32)


def _reads_int8_weights(op) -> bool:
    """Whether the MatMul ``op`` has an input that is NNCF's compressed int8 weight."""
    return any(_decompressed_weight(op.input_value(i).get_node()) is not None for i in range(op.get_input_size()))


def to_float_activations(ov_model, names: set[str], keep_int8_weights: bool = False):
    """A copy of ``ov_model`` whose MatMuls ``names`` read their activations unquantised (the FakeQuantize is
    bypassed for that MatMul only: a quantiser shared with Q / K / V stays for the others). Their int8 weights are
    stored decompressed, the same values, unless ``keep_int8_weights`` (the model is then run with dynamic
    quantisation, which makes such a MatMul int8 again with per-token scales): without it OpenVINO runs a MatMul
    with float activations and int8 weights as a weight-compressed FullyConnected that decompresses its weights on
    every call (on an AMX Xeon, 14 such MatMuls of MiniLM took 1.5x the time of the same MatMuls with float
    weights)."""
    from openvino import op as ov_op

    model = ov_model.clone()
    for op in model.get_ordered_ops():
        if op.get_type_name() == "MatMul" and op.get_friendly_name() in names:
            for node, port in _activation_fqs(op):
                node.input(port).replace_source_output(node.input_value(port).get_node().input_value(0))
            if keep_int8_weights:
                continue
            for port in range(op.get_input_size()):
                weight = _decompressed_weight(op.input_value(port).get_node())
                if weight is not None:
                    op.input(port).replace_source_output(ov_op.Constant(weight).output(0))
    model.validate_nodes_and_infer_types()
    return model


class HeldBackMeter:
    """Runs a candidate OpenVINO model on the held-back texts, alone and in padded batches of mixed lengths: its
    primary output against the fp32 parent's (each text alone), and every output's batch deviation (a text alone
    vs inside a batch), as the release gate bounds them: MPNet's sentence embedding held 1e-3 where its token
    states moved 1.7e-3, and a meter that watched the primary output alone shipped what tune's gate refused."""

    def __init__(self, art, texts: list[str], config: dict[str, Any], core, dynamic: bool = False):
        from bertopt.runtime import Predictor
        from bertopt.runtime.backends import default_threads
        from bertopt.runtime.openvino_backend import compile_config

        self.core = core
        parent = Predictor(art, provider="cpu", threads=config.get("threads"), verify=False)
        self.window = parent.max_seq_len  # the most tokens a text runs with
        self.output = parent.primary_output
        self.outputs = [self.output, *(n for n in parent.output_names if n != self.output)]
        self.token_level = {name: parent.is_token_level(name) for name in self.outputs}
        encodings = parent.tokenize(texts)
        self.alone = [parent.feeds_for([e])[0] for e in encodings]
        self.lengths = [len(e.ids) for e in encodings]
        self.batches = []
        for s in range(0, len(encodings), HELD_BATCH):
            rows = list(range(s, min(s + HELD_BATCH, len(encodings))))
            self.batches.append((rows, parent.feeds_for([encodings[r] for r in rows])[0]))
        self.reference = [parent.run_batch(f, [self.output])[self.output][0] for f in self.alone]
        # a score or a few logits: one text's cosine is little more than its sign, so such an output is compared
        # over the held-back set's whole output matrix
        first = parent.run_batch(self.alone[0], self.outputs)
        self.few_values = {name: not self.token_level[name] and int(np.size(first[name][0])) < FEW_VALUES
                           for name in self.outputs}
        threads = config.get("threads") or default_threads()
        # no blob cache: every candidate of the search is a model compiled once (cached, MPNet's search alone wrote
        # tens of GB of blobs nobody loads again)
        # every candidate is static int8: compiled as the runtime will compile the artifact (``dynamic``: with the
        # dynamic quantisation its restored MatMuls run with)
        self.config = compile_config({**runtime_options(config, dynamic), "cache": False}, threads, static_int8=True)
        self.float_config = compile_config({**runtime_options(config), "cache": False}, threads)
        self.keep_int8_weights = dynamic
        self.mask = attention_mask_input(art.inputs)
        self.short: tuple[int, Any] | None = None  # (max tokens, the float model compiled) once routed

    def route_short_texts(self, max_tokens: int, float_model) -> None:
        """From now on every candidate runs texts of at most ``max_tokens`` tokens on ``float_model``, as the
        artifact will (``runtime_options.float_short_texts``)."""
        self.short = (max_tokens, self.core.compile_model(float_model, "CPU", self.float_config))

    def _row(self, name: str, out: np.ndarray, j: int, r: int) -> np.ndarray:
        return out[j, : self.lengths[r]] if self.token_level[name] else out[j]

    def compile(self, ov_model):
        compiled = self.core.compile_model(ov_model, "CPU", self.config)
        if self.short is None:
            return compiled
        return RoutedByLength(compiled, self.short[1], self.short[0], self.mask, self.outputs)

    @property
    def quick_bounds_full(self) -> bool:
        """Whether the quick measure (some texts alone) bounds the full one: a text's own cosine can only lower
        the minimum over more texts; an output of few values is compared over the whole set, which it does not."""
        return not self.few_values[self.output]

    def measure(self, compiled, rows: list[int] | None = None) -> dict[str, Any]:
        """cos_min alone / batched of the primary output vs the parent, batch_dev (1 - cos, alone vs batched; the
        worst output's, each output's in ``batch_dev_by_output``) and each text's cosine alone (``per_text``);
        ``compiled``: the candidate as :meth:`compile` compiled it; ``rows``: only these texts alone, primary output
        only (the ranking's quick measure)."""
        primary, few = self.output, self.few_values[self.output]
        names = [primary] if rows is not None else self.outputs
        ports = {name: compiled.output(name) for name in names}
        picked = list(range(len(self.alone))) if rows is None else list(rows)
        alone: dict[str, dict[int, np.ndarray]] = {name: {} for name in names}
        for r in picked:
            out = compiled(self.alone[r])
            for name in names:
                alone[name][r] = np.asarray(out[ports[name]], np.float32)[0]
        if few:  # per_text (which texts are worst) is then the largest difference
            per_text = {r: -float(np.abs(alone[primary][r] - self.reference[r]).max()) for r in picked}
            cos_alone = _whole_cos([alone[primary][r] for r in picked], [self.reference[r] for r in picked])
        else:
            per_text = {r: min_row_cosine(alone[primary][r], self.reference[r]) for r in picked}
            cos_alone = min(per_text.values())
        if rows is not None:
            return {"cos_min_alone": cos_alone}
        got: dict[str, dict[int, np.ndarray]] = {name: {} for name in names}
        for batch, feeds in self.batches:
            out = compiled(feeds)
            for name in names:
                values = np.asarray(out[ports[name]], np.float32)
                for j, r in enumerate(batch):
                    got[name][r] = self._row(name, values, j, r)
        if few:
            cos_batched = _whole_cos([got[primary][r] for r in picked], [self.reference[r] for r in picked])
        else:
            cos_batched = min(min_row_cosine(got[primary][r], self.reference[r]) for r in picked)
        dev = {name: 1.0 - _whole_cos([got[name][r] for r in picked], [alone[name][r] for r in picked])
               if self.few_values[name] else max(1.0 - min_row_cosine(got[name][r], alone[name][r]) for r in picked)
               for name in names}
        return {"cos_min_alone": cos_alone, "cos_min_batched": cos_batched, "batch_dev": max(dev.values()),
                "batch_dev_by_output": dev, "cos_min": min(cos_alone, cos_batched), "per_text": per_text}


class RoutedByLength:
    """A candidate as the runtime runs an artifact with ``float_short_texts``: each row of a batch by its own token
    count, the short ones on the float model. Called like a compiled model: ``output(name)`` is the key of
    ``self(feeds)``'s result."""

    def __init__(self, int8, float_, max_tokens: int, mask: str, outputs: list[str]):
        self.int8, self.float_, self.max_tokens, self.mask, self.outputs = int8, float_, max_tokens, mask, outputs

    def output(self, name: str) -> str:
        return name

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        short = np.asarray(feeds[self.mask]).sum(axis=1) <= self.max_tokens
        runs = {flag: (model(feeds) if (short == flag).any() else None) for flag, model in
                ((True, self.float_), (False, self.int8))}
        got = {}
        for name in self.outputs:
            parts = {flag: np.asarray(out[model.output(name)], np.float32) for flag, model, out in
                     ((True, self.float_, runs[True]), (False, self.int8, runs[False])) if out is not None}
            if len(parts) == 1:
                got[name] = next(iter(parts.values()))
            else:  # rows of a padded batch are independent: each row taken from its own path's run
                got[name] = np.where(short.reshape((-1,) + (1,) * (parts[False].ndim - 1)), parts[True], parts[False])
        return got


def short_texts_limit(setting: str, measured: dict[str, Any], meter: "HeldBackMeter", target: float) -> int | None:
    """The token count up to which texts run float (None: every text int8). ``auto``: at least
    ``SHORT_TEXTS_MIN``, raised to the longest held-back text that misses ``target`` as quantised (at most
    ``SHORT_TEXTS_MAX``); an output of a few values (a score) is measured over the whole set, so there it stays
    at the minimum."""
    if setting == "off":
        return None
    if setting != "auto":
        return int(setting)
    if not meter.quick_bounds_full:
        chosen = SHORT_TEXTS_MIN
    else:
        missed = [meter.lengths[r] for r, cos in measured["per_text"].items() if cos < target]
        chosen = min(max([SHORT_TEXTS_MIN, *missed]), SHORT_TEXTS_MAX)
    # a model whose window is this short would run every text float: there, texts of up to half of it
    return min(chosen, meter.window // 2) or None


def _short_words(short_tokens: int | None) -> str:
    return "" if short_tokens is None else f", texts of at most {short_tokens} tokens float"


def _whole_cos(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return min_row_cosine(np.concatenate([np.ravel(x) for x in a]), np.concatenate([np.ravel(x) for x in b]))


def _holds(m: dict[str, float], target: float) -> bool:
    return m["cos_min"] >= target and m["batch_dev"] <= BATCH_DEV_MAX


def _rounded(m: dict[str, Any]) -> dict[str, Any]:
    return {k: {n: round(x, 7) for n, x in v.items()} if isinstance(v, dict) else round(v, 7)
            for k, v in m.items() if k != "per_text"}


def _fmt(m: dict[str, Any]) -> str:
    by_output = m.get("batch_dev_by_output") or {}
    worst = f" ({max(by_output, key=by_output.get)})" if len(by_output) > 1 else ""
    return (f"cos min {m['cos_min_alone']:.5f} alone / {m['cos_min_batched']:.5f} batched, batch dev "
            f"{m['batch_dev']:.1e}{worst}")


def rank_and_restore(quantized, meter: HeldBackMeter, target: float, bound: int, base: dict[str, float]):
    """The bounded ranked search: rank every int8 MatMul once by how much the held-back cosine recovers with its
    activations in float alone, then find the shortest prefix of that ranking (at most ``bound``) whose MatMuls
    in float make the target hold. Returns ((model, its measurement) or None when the target never held, restored
    names, ranking, steps measured)."""
    if bound < 1:
        return None, [], [], []
    int8, _ = int8_matmuls(quantized)
    # ranked on the texts the quantised model gets most wrong
    worst = sorted(base["per_text"], key=base["per_text"].get)[:RANK_TEXTS]
    quick_base = min(base["per_text"][r] for r in worst)
    ranking = []
    # the longest part of the stage (MPNet: 60 MatMuls, minutes on 2 cores): shown as NNCF shows its own steps
    from nncf.common.logging.track_progress import track

    def compiled_without(name: str):
        return meter.compile(to_float_activations(quantized, {name}, meter.keep_int8_weights))

    # the next candidate compiles while this one runs (compiling is most of a small model's step, and mostly
    # one thread): MPNet's 72 steps took 103 s one after the other
    with ThreadPoolExecutor(1, thread_name_prefix="bertopt-compile") as pool:
        ahead = pool.submit(compiled_without, int8[0]) if int8 else None
        for i, name in enumerate(track(int8, description=f"Ranking {len(int8)} int8 MatMuls")):
            compiled = ahead.result()
            ahead = pool.submit(compiled_without, int8[i + 1]) if i + 1 < len(int8) else None
            got = meter.measure(compiled, rows=worst)["cos_min_alone"]
            del compiled
            ranking.append({"node": name, "cos_min_gain": round(got - quick_base, 7)})
    ranking.sort(key=lambda r: -r["cos_min_gain"])
    order = [r["node"] for r in ranking[:bound]]
    if not order:
        return None, [], ranking, []
    steps: list[dict[str, Any]] = []
    tried: dict[int, Any] = {}

    def attempt(k: int) -> bool:
        model = to_float_activations(quantized, set(order[:k]), meter.keep_int8_weights)
        compiled = meter.compile(model)
        if k < len(order) and meter.quick_bounds_full:
            # the texts the ranking measured first: where they miss the target, the whole held-back set does
            # (its minimum can only be lower), so the full measurement (every text alone and batched, every
            # output) is not needed to refuse this prefix. The same decisions, a fraction of the time
            quick = meter.measure(compiled, rows=worst)["cos_min_alone"]
            if quick < target:
                steps.append({"float": k, "node": order[k - 1], "cos_min": round(quick, 7),
                              "measured_on": f"the {len(worst)} ranking texts alone (missed there)"})
                tried[k] = None
                return False
        m = meter.measure(compiled)
        steps.append({"float": k, "node": order[k - 1], **_rounded(m)})
        tried[k] = (model, m) if _holds(m, target) else None
        return tried[k] is not None

    # the shortest prefix of the ranking that holds: doubling, then bisection (a handful of measurements
    # instead of one per MatMul)
    low, k = 0, 1
    while k < len(order) and not attempt(k):
        low, k = k, min(2 * k, len(order))
    if k >= len(order) and not attempt(len(order)):
        return None, order, ranking, steps
    high = k
    while high - low > 1:
        mid = (low + high) // 2
        if attempt(mid):
            high = mid
        else:
            low = mid
    return tried[high], order[:high], ranking, steps


def quantize_static_openvino(art, config: dict[str, Any], out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require
    from bertopt.onnx_graph.util import load_onnx
    from bertopt.stages.common import check_against, settle_static_full_batch
    from bertopt.stages.compile import precision_label, refuse_ort_contrib_ops

    ov = require("openvino", "openvino", "static int8 for the OpenVINO runtime")
    nncf = require("nncf", "openvino", "static int8 for the OpenVINO runtime")
    check_config(config)
    refuse_ort_contrib_ops(art, load_onnx(art.model_path),
                           "quantise the exported or pruned artifact (before 'optimize') with --runtime openvino")
    target = cosine_target(config, art)
    calib, held = split_texts(config)
    t0 = time.perf_counter()
    core = ov.Core()
    ov_model = core.read_model(str(art.model_path))
    matmuls = [op.get_friendly_name() for op in ov_model.get_ordered_ops() if op.get_type_name() == "MatMul"]
    missing = [n for n in config.get("exclude_nodes") or [] if n not in matmuls]
    if missing:
        raise UserError(f"--exclude-nodes names {missing[0]!r}, which is not a MatMul of {art.path}; name MatMul "
                        "nodes of the ONNX graph (see 'bertopt inspect')")
    # a fixed per-tensor scale meets the FFN outputs' GELU-fed inputs: float unless --no-keep-ffn-output
    ffn_out = ffn_output_names(art, matmuls) if config.get("keep_ffn_output") is not False else []
    ignored = sorted(set(ffn_out) | set(config.get("exclude_nodes") or []))
    restored_as = restored_mode(config)
    dynamic = restored_as == "int8-dynamic"
    meter = HeldBackMeter(art, held, config, core, dynamic=dynamic)
    from bertopt.stages.quantize.calibration import sentence_feeds

    encodings = sentence_feeds(art, calib, config.get("threads"))  # one sentence each: no padding in a statistic
    from nncf.quantization.advanced_parameters import AdvancedSmoothQuantParameters

    alpha = SMOOTH_ALPHA if config.get("smooth_alpha") is None else float(config["smooth_alpha"])
    from nncf.quantization.advanced_parameters import OverflowFix

    from bertopt.machine import has_int8_dot_product

    # without an int8 dot product (VNNI / AMX) the CPU multiplies u8 x s8 pairs into 16-bit sums that saturate:
    # weights in half the int8 range (NNCF's overflow fix) keep every sum in range there
    overflow_fix = OverflowFix.DISABLE if has_int8_dot_product() else OverflowFix.ENABLE
    # bias correction off: it fits each bias to the int8 activations, so a MatMul the search puts back to float
    # would keep a bias corrected for an error it no longer has
    advanced = nncf.AdvancedQuantizationParameters(
        disable_bias_correction=True, smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha),
        overflow_fix=overflow_fix)
    preset = {"mixed": nncf.QuantizationPreset.MIXED, "performance": nncf.QuantizationPreset.PERFORMANCE}
    previous = logging.getLogger("nncf").level
    logging.getLogger("nncf").setLevel(logging.ERROR)
    try:
        quantized = nncf.quantize(ov_model, nncf.Dataset(encodings), subset_size=len(encodings),
                                  preset=preset[config.get("nncf_preset", "mixed")],
                                  model_type=nncf.ModelType.TRANSFORMER,
                                  ignored_scope=nncf.IgnoredScope(names=ignored, validate=False),
                                  advanced_parameters=advanced)
    finally:
        logging.getLogger("nncf").setLevel(previous)
    quantize_s = time.perf_counter() - t0
    measured = meter.measure(meter.compile(quantized))
    short_setting = str(config.get("float_short_texts") or "auto").strip()
    if short_setting != "off" and meter.mask is None:
        if short_setting != "auto":
            raise UserError(f"--float-short-texts {short_setting} counts a text's tokens on the attention mask, and "
                            f"{art.path} has no attention-mask input; use --float-short-texts off")
        short_setting = "off"
    short_tokens = short_texts_limit(short_setting, measured, meter, target)
    if short_tokens is not None and short_tokens >= meter.window:
        raise UserError(f"--float-short-texts {short_tokens}: every text of {art.path} (at most {meter.window} "
                        "tokens) would run on the float copy, none int8; give fewer tokens, or off")
    as_quantised = measured
    if short_tokens is not None:
        meter.route_short_texts(short_tokens, core.read_model(str(art.model_path)))
        measured = meter.measure(meter.compile(quantized))
    search: dict[str, Any] = {"ranking": [], "steps": [], "restored": []}
    model = quantized
    if not _holds(measured, target):
        bound = int(config.get("max_float_extra", 48))
        found, restored, ranking, steps = rank_and_restore(quantized, meter, target, bound, measured)
        search = {"ranking": ranking, "steps": steps, "restored": restored}
        if found is None:
            last = steps[-1] if steps else measured
            restored_as_words, also = (("dynamic int8", "try --restored-matmuls float, ") if dynamic
                                       else ("float", ""))
            raise UserError(
                f"static int8 misses cos_min>={target:g} / batch_dev<={BATCH_DEV_MAX:g} on held-back calibration "
                f"text ({_fmt(measured)} as quantised; {_fmt(last)} with {len(restored)} more MatMuls in "
                f"{restored_as_words}, the bound{_short_words(short_tokens)}); raise --max-float-extra"
                f"{'' if short_tokens is None else ' or --float-short-texts'}, relax --accuracy-target, {also}or use "
                "--mode int8-dynamic --runtime openvino")
        model, measured = found
    build_s = time.perf_counter() - t0
    int8_ops, float_ops = int8_matmuls(model)
    # a restored weight MatMul runs dynamic int8; a restored activation x activation one (attention's scores and
    # context) has no weights to be int8 and runs float
    dynamic_ops = sorted(op.get_friendly_name() for op in model.get_ordered_ops()
                         if op.get_friendly_name() in search["restored"] and _reads_int8_weights(op)
                         ) if dynamic else []
    float_ops = [n for n in float_ops if n not in dynamic_ops]
    if not int8_ops:
        raise UserError(f"static int8 left no MatMul of {art.path} in int8; use --mode int8-dynamic --runtime "
                        "openvino or compile --inference-precision bf16")
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        w.runtime = "openvino"
        w.extra["runtime_options"] = runtime_options(config, dynamic=bool(dynamic_ops))
        # keep float weights float (save_model would store them fp16 by default); writes model.xml + model.bin
        ov.save_model(model, str(w.dir / MODEL_FILE), compress_to_fp16=False)
        if short_tokens is not None:  # the parent's model as OpenVINO read it, for the short texts
            ov.save_model(core.read_model(str(art.model_path)), str(w.dir / FLOAT_MODEL_FILE), compress_to_fp16=False)
            w.extra["runtime_options"][FLOAT_SHORT_TEXTS] = short_tokens
        w.set_model(MODEL_FILE, MODEL_FORMAT, art.inputs, art.outputs,
                    precision=precision_label("int8-static", config["inference_precision"]))
        settle_static_full_batch(w, config["static_full_batch"], config.get("threads"))
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        w.report.update({
            "runtime": "openvino", "quantizer": f"nncf {nncf.__version__}",
            "method": f"nncf.quantize(model_type=TRANSFORMER, preset={config.get('nncf_preset', 'mixed')}, "
                      "SmoothQuant) on the OpenVINO model",
            "smooth_quant_alpha": alpha,
            "weights": "int8, 7-bit range (NNCF overflow fix: built where the CPU has no VNNI / AMX)"
                       if overflow_fix == OverflowFix.ENABLE else "int8, full range",
            "after": {"ops": dict(Counter(op.get_type_name() for op in model.get_ops()).most_common())},
            "quantized_nodes": len(int8_ops), "kept_float_nodes": sorted(float_ops),
            "dynamic_int8_nodes": dynamic_ops, "ignored_scope": ignored,
            "restored_matmuls": {"mode": restored_as, "requested": config.get("restored_matmuls") or "auto",
                                 "nodes": search["restored"]},
            "activations": "int8, static (per-tensor scales calibrated on text)" + (
                f"; the {len(dynamic_ops)} restored MatMuls' int8 per token and group of {DYNAMIC_GROUP} channels, "
                "quantised as each batch runs" if dynamic_ops else ""),
            "calibration": {"texts": len(calib), "held_back": len(held),
                            "source": config.get("calibration_data") or "builtin calibration text"},
            "held_back": {"target": f"cos_min>={target:g},batch_dev<={BATCH_DEV_MAX:g}",
                          "measured_on": f"{len(held)} held-back calibration texts alone and in padded batches of "
                                         f"{HELD_BATCH}, vs the fp32 parent alone",
                          **_rounded(measured)},
            "search": search,
            "float_short_texts": {
                "requested": str(config.get("float_short_texts") or "auto"),
                "max_tokens": short_tokens,
                "held_back_texts_float": sum(n <= short_tokens for n in meter.lengths) if short_tokens else 0,
                "as_quantised_without": _rounded(as_quantised)},
            "timing_s": {"quantize": round(quantize_s, 1), "total": round(build_s, 1)},
            "accuracy_vs_parent": stats})
    return w.artifact


METHODS = (Method("OpenVINO static int8 (NNCF)", "int8-static", "openvino",
                  (*NNCF_PARAMS, SMOOTH_ALPHA_PARAM, INFERENCE_PRECISION, STATIC_FULL_BATCH),
                  quantize_static_openvino),)
