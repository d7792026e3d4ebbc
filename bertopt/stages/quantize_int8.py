"""int8 quantisation with ONNX Runtime's quantiser: dynamic (weights int8, activations quantised on the fly)
and static (QDQ, activation ranges calibrated on text)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bertopt.errors import UserError


def _quantizable_nodes(model, op_types) -> list[str]:
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in op_types and any(i in inits for i in n.input)]


def quantize_model_file(src: Path, dst: Path, config, exclude: list[str], calibration_texts=None, predictor=None):
    """Write an int8 model quantised per ``config`` with ``exclude`` node names kept fp32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    extra = {"DefaultTensorType": onnx.TensorProto.FLOAT}  # fused graphs lack some type info
    if config["mode"] == "int8-dynamic":
        quantize_dynamic(str(src), str(dst), per_channel=config["per_channel"], reduce_range=False,
                         weight_type=QuantType.QInt8, op_types_to_quantize=list(config["op_types"]),
                         nodes_to_exclude=list(exclude), extra_options=extra)
        return
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    reader = TextCalibrationReader(predictor, calibration_texts)
    static_ops = [t for t in config["op_types"] if t != "Attention"]  # fused Attention has no QDQ kernel
    quantize_static(str(src), str(dst), reader, quant_format=QuantFormat.QDQ, per_channel=config["per_channel"],
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=static_ops, nodes_to_exclude=list(exclude),
                    calibrate_method=methods[config["calibration_method"]],
                    extra_options={**extra, "ActivationSymmetric": False, "WeightSymmetric": True})


class TextCalibrationReader:
    """Feeds tokenised calibration sentences to ONNX Runtime's calibrator, one small batch at a time."""

    def __init__(self, predictor, texts, batch_size: int = 8):
        self.batches = []
        for start in range(0, len(texts), batch_size):
            feeds, _ = predictor.feeds_for(predictor.tokenize(texts[start:start + batch_size]))
            self.batches.append(feeds)
        self._it = iter(self.batches)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self.batches)


def load_calibration_texts(config) -> list[str]:
    from bertopt.data import calibration_texts

    if config["calibration_data"]:
        from bertopt.validate.data import load_texts

        texts = load_texts(config["calibration_data"]).texts
    else:
        texts = calibration_texts()
    texts = [t for t in texts if t.strip()][: config["calibration_size"]]
    if not texts:
        raise UserError("calibration data is empty; give a text file with one sentence a line")
    return texts


def quantize_int8(art, config, out_dir: Path, overwrite: bool):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.errors import require
    from bertopt.runtime import Predictor
    from bertopt.stages.common import check_against
    from bertopt.stages.onnx_util import graph_stats, load_onnx, save_onnx

    require("onnxruntime", "onnx", "int8 quantisation")
    if config["accuracy_target"]:
        from bertopt.stages.accuracy_aware import search_int8_fallback

        return search_int8_fallback(art, config, out_dir, overwrite)
    model = load_onnx(art.model_path)
    before = graph_stats(model)
    calib = None
    predictor = None
    if config["mode"] == "int8-static":
        calib = load_calibration_texts(config)
        predictor = Predictor(art, provider="cpu", verify=False)
    with ArtifactWriter(out_dir, stage="quantize", params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        with tempfile.TemporaryDirectory(prefix="bertopt-q-") as tmp:
            src = Path(tmp) / "in.onnx"
            save_onnx(model, src)
            quantize_model_file(src, w.dir / "model.onnx", config, config["exclude_nodes"], calib, predictor)
        q = load_onnx(w.dir / "model.onnx")
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=config["mode"])
        stats = check_against(w, art, corpus())
        w.report.update({"before": before, "after": graph_stats(q),
                         "quantized_nodes": len(_quantizable_nodes(model, config["op_types"]))
                         - len(config["exclude_nodes"]),
                         "kept_fp32_nodes": list(config["exclude_nodes"]),
                         "accuracy_vs_parent": stats})
    return w.artifact
