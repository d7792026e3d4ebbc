"""quantize: fp16, dynamic int8, static int8 (calibrated, QDQ), optionally accuracy-aware.

The stage declares the parameters and picks the quantiser: :mod:`bertopt.stages.fp16`,
:mod:`bertopt.stages.quantize_int8` (ONNX Runtime) or :mod:`bertopt.stages.quantize_openvino`; each calls the
accuracy search of :mod:`bertopt.stages.accuracy_aware` when an ``accuracy_target`` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import THREADS, Param
from bertopt.stages.quantize_nncf import NNCF_PARAMS
from bertopt.validate.targets import targets_problem

NAME = "quantize"
HELP = "Lower precision: fp16, int8-dynamic or int8-static (calibrated), with an optional accuracy target."
MODES = ("fp16", "int8-dynamic", "int8-static")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")




WEIGHT_ROUNDINGS = ("nearest", "gptq")
INT8_RUNTIMES = ("onnxruntime", "openvino")


def _compile_param(name: str) -> Param:
    """A parameter the compile stage declares (same meaning here: the OpenVINO execution it records)."""
    from bertopt.stages.compile import PARAMS as COMPILE_PARAMS

    return next(p for p in COMPILE_PARAMS if p.name == name)


PARAMS = [
    Param("mode", str, "int8-dynamic", "Precision to produce.", choices=MODES),
    Param("per_channel", bool, True, "int8: one scale per output channel of each weight (more faithful than "
          "per-tensor at the same speed)."),
    Param("op_types", list, ["MatMul", "Attention", "Gemm"], "int8: operator types to quantise (with "
          "--runtime openvino: weight MatMuls, and Gather for the embedding tables)."),
    Param("exclude_nodes", list, [], "Node names to keep in fp32 (int8) or fp32 islands (fp16)."),
    Param("calibration_data", str, None, "int8-static: a text file, one sentence a line "
          "(default: bertopt's built-in calibration text).", file=True),
    Param("calibration_method", str, "minmax", "int8-static: how activation ranges are chosen.",
          choices=CALIBRATION_METHODS),
    Param("calibration_size", int, 128, "int8-static: how many calibration sentences to use.", min=1),
    Param("accuracy_target", str, None, "Keep the most sensitive operators in fp32 until the target holds, "
          "e.g. 'cos_min=0.995' or 'cos_min=0.995,cos_mean=0.999'.", check=targets_problem),
    Param("accuracy_group", int, 2, "With --accuracy-target: how many of the most sensitive operators are kept "
          "fp32 per search step (smaller: fewer kept, more steps).", min=1),
    Param("smooth_alpha", float, None, "int8: SmoothQuant-style smoothing strength (0-1, e.g. 0.5): activation "
          "outlier channels measured on the calibration text are divided out and folded into the weight rows "
          "before quantising (same function in fp32). Default: off.",
          min=0.0, max=1.0),
    Param("smooth_roles", list, ["attention", "ffn-in"], "int8 with --smooth-alpha: which operators to smooth: "
          "attention (fused QKV), ffn-in, ffn-out (the GELU-fed down-projection), other (unfused QKV, "
          "attention output)."),
    Param("first_token_fp32", bool, False, "int8: compute the first token ([CLS], whose activations dwarf the "
          "others') of the FFN MatMuls in fp32, so the int8 activation range fits the ordinary tokens."),
    Param("per_token", bool, False, "int8-dynamic: per-token activation scaling for weight MatMuls (each row divided "
          "by its max before the int8 MatMul and multiplied back), so one outlier token in a batch does not "
          "coarsen every other text's; costs a few elementwise ops per MatMul."),
    Param("weight_rounding", str, "nearest", "int8-dynamic: how weights are rounded to int8: 'nearest', or "
          "'gptq' (each rounding error compensated on the weights not yet rounded, weighted by the calibration "
          "text's activations; same int8 format and speed, less output error).", choices=WEIGHT_ROUNDINGS),
    Param("runtime", str, "onnxruntime", "int8: the runtime the int8 model is made for. onnxruntime: "
          "int8 operators, one activation scale per batch matrix (static: QDQ). openvino: int8-dynamic stores int8 "
          "weights (per channel) that OpenVINO runs with activations quantised per token in groups of "
          "--activation-group-size channels; int8-static calibrates fixed activation scales with NNCF (SmoothQuant, "
          "FFN outputs in float, measured on held-back text) and writes an OpenVINO IR. Takes the exported or "
          "pruned ONNX, before 'optimize'.",
          choices=INT8_RUNTIMES),
    Param("activation_group_size", int, 32, "int8 with --runtime openvino: channels per activation scale (each "
          "token's activations are quantised to int8 in groups this wide inside the MatMul); 0 keeps activations "
          "in the float precision (weights-only int8).", min=0),
    _compile_param("inference_precision"),
    THREADS,
    Param("keep_fp32_ops", list, ["LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization",
          "Softmax", "ReduceMean", "ReduceSum", "ReduceL2", "ReduceMax", "Pow", "Sqrt", "Erf"],
          "fp16: operator types kept in fp32."),
    *NNCF_PARAMS,
]


def preflight(config: dict[str, Any], where: str) -> None:
    """Checks that need no model, run before any stage of a recipe (or this stage's own work) starts."""
    if config.get("calibration_data"):
        from bertopt.validate.data import load_texts

        try:
            load_texts(config["calibration_data"])
        except UserError as exc:
            raise UserError(f"{where}: calibration_data: {exc}") from None


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.stages.common import format_handler, require_onnx_artifact

    art = require_onnx_artifact(input, NAME)
    if art.model_format in ("tf-graphdef", "tf-savedmodel"):
        if config["mode"] != "fp16":
            raise UserError("TensorFlow graphs support --mode fp16; export to ONNX first for int8")
        return format_handler(NAME, art.model_format)(art, config, out_dir, overwrite)
    if config["runtime"] == "openvino" and config["mode"] == "int8-static":
        from bertopt.stages.quantize_nncf import quantize_static_openvino

        return quantize_static_openvino(art, config, out_dir, overwrite)
    if config["runtime"] == "openvino":
        from bertopt.stages.quantize_openvino import quantize_int8_openvino

        return quantize_int8_openvino(art, config, out_dir, overwrite)
    if config["mode"] == "fp16":
        from bertopt.stages.fp16 import quantize_fp16

        return quantize_fp16(art, config, out_dir, overwrite)
    from bertopt.stages.quantize_int8 import quantize_int8

    return quantize_int8(art, config, out_dir, overwrite)
