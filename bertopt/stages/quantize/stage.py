"""quantize: fp16, dynamic int8, static int8 (calibrated), optionally accuracy-aware.

One method per precision and runtime, each declared by its module with the options only it reads
(:mod:`~bertopt.stages.quantize.methods`): ONNX Runtime dynamic and static int8 (``onnxruntime_int8.py``),
OpenVINO int8 (``openvino_int8.py``), OpenVINO static int8 through NNCF (``nncf_int8.py``) and fp16
(``fp16.py``). This module declares the options they all share and picks the method from ``--mode`` and
``--runtime``; an option of another method is refused when the config is resolved, and so is one the method would
not read as configured (``READ_WITH``: ``--calibration-data`` with plain dynamic int8). Each method calls the
accuracy search of :mod:`~bertopt.stages.quantize.accuracy_aware` when an ``accuracy_target`` is given. A new
method is one module with ``METHODS`` and one line in ``METHOD_MODULES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.measure.targets import targets_problem
from bertopt.params import THREADS, Param
from bertopt.stages.quantize import fp16, nncf_int8, onnxruntime_int8, openvino_int8
from bertopt.stages.quantize.calibration import CALIBRATION_READERS
from bertopt.stages.quantize.methods import ReadWith, compose

NAME = "quantize"
HELP = "Lower precision: fp16, int8-dynamic or int8-static (calibrated), with an optional accuracy target."

METHOD_MODULES = (
    fp16,
    onnxruntime_int8,  # ONNX Runtime dynamic int8, ONNX Runtime static int8
    openvino_int8,  # OpenVINO int8 (int8 weights, activations quantised per token at run time)
    nncf_int8,  # OpenVINO static int8 through NNCF (fixed activation scales, SmoothQuant, measured on held-back text)
)

# what every method reads
SHARED = (
    Param("op_types", list, ["MatMul", "Attention", "Gemm"], "int8: operator types to quantise (with --runtime "
          "openvino: weight MatMuls, and Gather for the embedding tables); with --accuracy-target also the "
          "operators the search may keep fp32.",
          check=lambda v: "is empty; name operator types like MatMul,Gemm, or leave it out for the default" if not v
          else None),
    Param("exclude_nodes", list, [], "Node names to keep in fp32 (int8) or fp32 islands (fp16)."),
    Param("calibration_data", str, None, "Calibration text for static int8, smoothing, GPTQ and the accuracy "
          "search: a text file, one sentence a line (default: bertopt's built-in calibration text).", file=True),
    Param("calibration_size", int, 128, "How many calibration sentences to use.", min=1),
    Param("accuracy_target", str, None, "Keep the most sensitive operators in fp32 until the target holds, "
          "e.g. 'cos_min=0.995' or 'cos_min=0.995,cos_mean=0.999'.", check=targets_problem),
    THREADS,
)

# options read only with another: where none of their triggers holds they would change nothing, so they are None in
# the resolved config (and the lineage) and refused when given
READ_WITH = (
    ReadWith("calibration_data", CALIBRATION_READERS),
    ReadWith("calibration_size", CALIBRATION_READERS),
    ReadWith("accuracy_group", (("accuracy_target", None),)),
    ReadWith("smooth_roles", (("smooth_alpha", None),)),
    # fp16 converts every operator but --keep-fp32-ops; its search picks fp32 islands among --op-types
    ReadWith("op_types", (("mode", "int8-dynamic"), ("mode", "int8-static"), ("accuracy_target", None))),
)

PARAMS = compose(
    "Precision to produce.", "int8-dynamic",
    "The runtime the quantised model is made for. onnxruntime: ONNX Runtime's int8 operators (one activation "
    "scale per batch matrix) or fp16. openvino: int8 weights (per channel) that OpenVINO runs with activations "
    "quantised per token in groups of --activation-group-size channels (far more faithful at the same speed); with "
    "--mode int8-static, fixed activation scales calibrated by NNCF (SmoothQuant, FFN outputs in float, measured "
    "on held-back text), written as an OpenVINO IR. Takes the exported or pruned ONNX, before 'optimize'.",
    "onnxruntime",
    SHARED, METHOD_MODULES, READ_WITH)


def preflight(config: dict[str, Any], where: str) -> None:
    """Checks that need no model, run before any stage of a recipe (or this stage's own work) starts."""
    if config.get("calibration_data"):
        from bertopt.measure.data import load_texts

        try:
            load_texts(config["calibration_data"], text_flag=None)
        except UserError as exc:
            raise UserError(f"{where}: calibration_data: {exc}") from None


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.stages.common import format_handler, require_onnx_artifact

    art = require_onnx_artifact(input, NAME)
    if art.model_format in ("tf-graphdef", "tf-savedmodel"):
        if config["mode"] != "fp16":
            raise UserError("TensorFlow graphs support --mode fp16; export to ONNX first for int8")
        return format_handler(NAME, art.model_format)(art, config, out_dir, overwrite)
    if config.get("exclude_nodes") and art.model_format == "onnx":
        _check_node_names(art.model_path, config["exclude_nodes"])
    return PARAMS.method(config).run(art, config, out_dir, overwrite)


def _check_node_names(model_file, names) -> None:
    """--exclude-nodes names nodes of the input graph: one that is not there (a typo, another export's name) was
    ignored, and what the user meant to keep in float was quantised."""
    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph
    known = {node.name for node in graph.node}
    missing = [n for n in names if n not in known]
    if missing:
        raise UserError(f"--exclude-nodes: no node named {missing[0]!r} in {model_file} ({len(known)} nodes; "
                        "'bertopt inspect' lists them by type); give node names of this artifact's graph")
