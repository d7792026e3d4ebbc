"""int8 quantisation with ONNX Runtime's quantiser: dynamic (weights int8, activations quantised on the fly)
and static (QDQ, activation ranges calibrated on text with MinMax, Entropy or Percentile).

Static calibration feeds one sentence at a time, so padding never widens an activation range (a padded batch
puts [PAD] positions - values the model never uses - into every histogram). The ranges are computed once and
cached in a JSON file, so the accuracy-aware search re-quantises without re-calibrating.

With ``accuracy_target`` (:func:`search_int8_fallback`) the search of
:mod:`bertopt.stages.quantize.accuracy_aware` keeps the most sensitive operators fp32 until the target holds.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from bertopt.errors import BackendFailed, UserError
from bertopt.params import Param
from bertopt.stages.quantize.accuracy_aware import ACCURACY_GROUP
from bertopt.stages.quantize.gptq import WEIGHT_ROUNDING
from bertopt.stages.quantize.methods import Method
from bertopt.stages.quantize.smoothing import OUTLIER_PARAMS

PER_CHANNEL = Param("per_channel", bool, True, "One scale per output channel of each weight (more faithful than "
                    "per-tensor at the same speed).")
PER_TOKEN = Param("per_token", bool, False, "Per-token activation scaling for weight MatMuls (each row divided by its "
                  "max before the int8 MatMul and multiplied back), so one outlier token in a batch does not coarsen "
                  "every other text's; costs a few elementwise ops per MatMul.")
CALIBRATION_METHOD = Param("calibration_method", str, "minmax", "How activation ranges are chosen.",
                           choices=("minmax", "entropy", "percentile"))

# Percentile keeps 99.999% of values; Entropy and Percentile reduce outliers' pull on the range. Histogram
# calibrators stack each collected batch into one array, which fails for sentences of different lengths, so they
# collect one sentence per call (CalibStridedMinMax=1: ORT's range-by-range collection, used by every method).
_CALIB_OPTIONS = {"minmax": {}, "entropy": {"CalibNumBins": 512, "CalibStridedMinMax": 1},
                  "percentile": {"CalibPercentile": 99.999, "CalibStridedMinMax": 1}}


def quantizable_nodes(model, op_types, weights_only: bool = True) -> list[tuple[str, str]]:
    """(name, op type) of the nodes of ``op_types``, in graph order: with ``weights_only`` those that carry a weight
    (dynamic int8 quantises only those); static QDQ also quantises activation x activation MatMuls (attention
    scores), so they are candidates too."""
    inits = {i.name for i in model.graph.initializer}
    return [(n.name, n.op_type) for n in model.graph.node
            if n.op_type in op_types and (not weights_only or any(i in inits for i in n.input))]


def quantize_model_file(src: Path, dst: Path, config, exclude: list[str], calibration_texts=None, predictor=None,
                        calibration_cache: Path | None = None):
    """Write an int8 model quantised per ``config`` with ``exclude`` node names kept fp32."""
    import onnx

    from bertopt.errors import require_onnxruntime

    quantization = require_onnxruntime("int8 quantisation", "onnxruntime.quantization")
    QuantType, quantize_dynamic = quantization.QuantType, quantization.quantize_dynamic

    extra = {"DefaultTensorType": onnx.TensorProto.FLOAT}  # fused graphs lack some type info
    if config["mode"] == "int8-dynamic":
        with _write_failures_named(dst):
            quantize_dynamic(str(src), str(dst), per_channel=config["per_channel"], reduce_range=False,
                             weight_type=QuantType.QInt8, op_types_to_quantize=list(config["op_types"]),
                             nodes_to_exclude=list(exclude), extra_options=extra)
        return
    CalibrationMethod, QuantFormat = quantization.CalibrationMethod, quantization.QuantFormat
    quantize_static = quantization.quantize_static
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    cached = calibration_cache is not None and Path(calibration_cache).is_file()
    reader = None if cached else TextCalibrationReader(predictor, calibration_texts)
    static_ops = [t for t in config["op_types"] if t != "Attention"]  # fused Attention has no QDQ kernel
    with _write_failures_named(dst):
        quantize_static(str(src), str(dst), reader, quant_format=QuantFormat.QDQ,
                        per_channel=config["per_channel"], activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8, op_types_to_quantize=static_ops, nodes_to_exclude=list(exclude),
                        calibrate_method=methods[config["calibration_method"]],
                        extra_options={**extra, "ActivationSymmetric": False, "WeightSymmetric": True,
                                       **_CALIB_OPTIONS[config["calibration_method"]]},
                        calibration_cache_path=str(calibration_cache) if calibration_cache is not None else None)


@contextlib.contextmanager
def _write_failures_named(dst: Path):
    """ONNX Runtime's quantiser writes models (its own scratch copies in the temporary folder, then ``dst``) and
    reports a failed write as 'INVALID_PROTOBUF : Protobuf serialization failed' (a full disk, in practice): say
    that in one line with the free space where it writes, not as a traceback."""
    try:
        yield
    except Exception as exc:  # ORT raises its own pybind exception types
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "serialization failed" not in first:
            raise
        free = {str(d): shutil.disk_usage(d).free / 2**30 for d in {Path(tempfile.gettempdir()), Path(dst).parent}
                if d.exists()}
        where = ", ".join(f"{gb:.1f} GiB free in {d}" for d, gb in sorted(free.items()))
        raise BackendFailed(f"ONNX Runtime could not write the quantised model ({first}; {where}); free disk space "
                            "(or point TMPDIR at a larger disk) and run again") from None


class TextCalibrationReader:
    """Feeds tokenised calibration sentences to ONNX Runtime's calibrator, one sentence (no padding) per call."""

    def __init__(self, predictor, texts, batch_size: int = 1):
        if predictor is None or not texts:
            raise UserError("static int8 needs calibration text; give --calibration-data FILE")
        self.batches = []
        for start in range(0, len(texts), batch_size):
            feeds, _ = predictor.feeds_for(predictor.tokenize(texts[start:start + batch_size]))
            self.batches.append(feeds)
        self._it = iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._it = iter(self.batches[start_index:end_index])

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self.batches)


def declared_batch_dependence(config) -> dict | None:
    """ONNX Runtime's dynamic int8 picks one activation scale per batch matrix, so a text's output depends on
    its neighbours: said in the manifest when the artifact is made (``validate`` replaces it with a figure)."""
    if config["mode"] != "int8-dynamic":
        return None
    return {"invariant": False, "batch_dev": None, "measured_by": None,
            "why": "ONNX Runtime dynamic int8: one activation scale per batch matrix"}


def quantize_int8(art, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require_onnxruntime
    from bertopt.onnx_graph.util import graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.runtime import Predictor
    from bertopt.stages.common import check_against
    from bertopt.stages.quantize.calibration import calibration_statistics, load_calibration_texts

    require_onnxruntime("int8 quantisation")
    if config["accuracy_target"]:
        return search_int8_fallback(art, config, out_dir, overwrite)
    model = load_onnx(art.model_path)
    before = graph_stats(model)
    model, fp32_added, outliers, hessians = calibration_statistics(art, model, config)
    calib = None
    predictor = None
    op_types = list(config["op_types"])
    if config["mode"] == "int8-static":
        calib = load_calibration_texts(config)
        predictor = Predictor(art, provider="cpu", threads=config.get("threads"), verify=False)
        op_types = [t for t in op_types if t != "Attention"]
    candidates = [n for n, _ in quantizable_nodes(model, op_types, weights_only=config["mode"] != "int8-static")
                  if n not in fp32_added]
    gptq_report = None
    if not candidates:
        raise UserError(f"{art.path} has no {'/'.join(op_types)} operators with weights to quantise; "
                        "check --op-types")
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        if declared_batch_dependence(config):
            w.extra["batch_invariance"] = declared_batch_dependence(config)
        w.copy_tokenizer(art)
        with w.scratch() as tmp:
            src = tmp / "in.onnx"
            save_onnx(model, src)
            quantize_model_file(src, w.dir / "model.onnx", config, list(config["exclude_nodes"]) + fp32_added, calib,
                                predictor)
            if hessians is not None:
                from bertopt.stages.quantize.gptq import apply_gptq

                gptq_report = apply_gptq(model, w.dir / "model.onnx", hessians)
        q = load_onnx(w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=config["mode"])
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        excluded = [n for n in config["exclude_nodes"] if n in candidates]
        w.report.update({"before": before, "after": graph_stats(q),
                         "quantized_nodes": len(candidates) - len(excluded),
                         "kept_fp32_nodes": list(config["exclude_nodes"]),
                         "accuracy_vs_parent": stats})
        if outliers is not None:
            w.report["outliers"] = outliers
        if gptq_report is not None:
            w.report["gptq"] = gptq_report
        if config["mode"] == "int8-static":
            w.report["calibration"] = {"method": config["calibration_method"], "texts": len(calib),
                                       "source": config["calibration_data"] or "builtin calibration text"}
    return w.artifact


def search_int8_fallback(art, config, out_dir: Path, overwrite: bool):
    """int8 (dynamic or static) with the most sensitive operators kept fp32 until ``accuracy_target`` holds."""
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import ensure_node_names, graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.runtime import Predictor
    from bertopt.stages.common import check_against
    from bertopt.stages.quantize.accuracy_aware import accuracy_targets, node_costs, search
    from bertopt.stages.quantize.calibration import calibration_statistics, load_calibration_texts

    targets = accuracy_targets(config, art)
    texts = load_calibration_texts(config)
    model = load_onnx(art.model_path)
    before = graph_stats(model)
    op_types = list(config["op_types"])
    static = config["mode"] == "int8-static"
    if static:
        op_types = [t for t in op_types if t != "Attention"]  # fused Attention has no QDQ kernel
    user_excluded = list(config["exclude_nodes"])
    ensure_node_names(model.graph)  # exclusion works by node name
    # measured once: every candidate model of the search shares the transforms and GPTQ's statistics
    model, fp32_added, outliers, hessians = calibration_statistics(art, model, config)
    candidates = [(n, op) for n, op in quantizable_nodes(model, op_types, weights_only=not static)
                  if n not in user_excluded and n not in fp32_added]
    if not candidates:
        raise UserError(f"{art.path} has no {'/'.join(op_types)} operators with weights to quantise; "
                        "check --op-types")
    predictor = Predictor(art, provider="cpu", threads=config.get("threads"), verify=False) if static else None
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        if declared_batch_dependence(config):
            w.extra["batch_invariance"] = declared_batch_dependence(config)
        w.copy_tokenizer(art)
        with w.scratch() as tmp:
            src = tmp / "in.onnx"
            save_onnx(model, src)
            cache = tmp / "calibration.json"  # static: calibrate once, reuse the ranges for every candidate

            gptq_reports: dict[str, dict] = {}
            gptq_cache: dict = {}

            def build(kept: list[str], path: Path) -> None:
                quantize_model_file(src, path, config, user_excluded + fp32_added + kept, texts, predictor,
                                    calibration_cache=cache)
                if hessians is not None:
                    from bertopt.stages.quantize.gptq import apply_gptq

                    gptq_reports[str(path)] = apply_gptq(model, path, hessians, gptq_cache)

            result, report = search(art, config, targets, texts, candidates, build, tmp,
                                    costs=node_costs(model, [n for n, _ in candidates]))
            (w.dir / "model.onnx").write_bytes(Path(result["model"]).read_bytes())
            chosen_gptq = gptq_reports.get(str(result["model"]))
        q = load_onnx(w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=config["mode"])
        stats = check_against(w, art, corpus(), threads=config.get("threads"))
        w.report.update({"before": before, "after": graph_stats(q),
                         "quantized_nodes": len(candidates) - len(result["kept"]),
                         "kept_fp32_nodes": user_excluded + result["kept"],
                         "accuracy_search": report,
                         "accuracy_vs_parent": stats})
        if outliers is not None:
            w.report["outliers"] = outliers
        if hessians is not None:
            w.report["gptq"] = chosen_gptq
    return w.artifact


METHODS = (
    Method("ONNX Runtime dynamic int8", "int8-dynamic", "onnxruntime",
           (PER_CHANNEL, PER_TOKEN, WEIGHT_ROUNDING, *OUTLIER_PARAMS, ACCURACY_GROUP), quantize_int8),
    Method("ONNX Runtime static int8", "int8-static", "onnxruntime",
           (PER_CHANNEL, CALIBRATION_METHOD, *OUTLIER_PARAMS, ACCURACY_GROUP), quantize_int8),
)
