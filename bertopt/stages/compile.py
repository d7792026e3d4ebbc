"""compile: choose the runtime an artifact is served with and how it executes, recorded in the manifest.

The model file is copied unchanged; the manifest gets ``runtime`` (``openvino`` or ``onnxruntime``) and
``runtime_options`` (for OpenVINO: inference precision and performance hint). Every Predictor built on the
artifact (run, validate, bench, Spark, the server) then uses that backend, so what is validated is what is
served. The stage checks the compiled model against its input on the built-in corpus before writing.

OpenVINO on this kind of CPU: ``bf16`` runs the MatMuls on AVX-512 BF16 (AMX where present) at a cosine of
about 0.99998 to fp32; a static int8 QDQ parent runs its quantised MatMuls in int8 (VNNI/AMX) and the rest in
the chosen precision. OpenVINO cannot read ONNX Runtime's fused contrib ops, so compile the exported or
pruned artifact (or an int8-static one made from it), not the output of ``optimize``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import GPU_PARAMS, PROVIDER, STATIC_FULL_BATCH, Param

NAME = "compile"
HELP = ("Pick the runtime (openvino or onnxruntime) and its execution precision for an artifact; recorded in "
        "the manifest and checked against the input on the built-in corpus.")
RUNTIMES = ("openvino", "onnxruntime")


PARAMS = [
    Param("runtime", str, "openvino", "Backend the artifact is served with.", choices=RUNTIMES),
    Param("inference_precision", str, None, "OpenVINO: precision of floating-point compute (bf16, the default, uses "
          "AVX-512 BF16/AMX; f32 is exact; auto is OpenVINO's default for this CPU).",
          choices=("auto", "bf16", "f32")),
    Param("performance_hint", str, None, "OpenVINO: LATENCY (the default: one stream using every thread, the fastest "
          "single text) or THROUGHPUT (a stream per thread, the Predictor running a batch on each side by side: more "
          "texts/s, a single text slower).", choices=("LATENCY", "THROUGHPUT")),
    STATIC_FULL_BATCH,
    PROVIDER.with_(default="cpu", choices=("cpu", "cuda", "tensorrt"),
                   help="ONNX Runtime: the execution provider the artifact is served with, recorded in the manifest "
                   "(cuda, tensorrt: onnxruntime-gpu and a GPU here, where the check runs; docs/gpu.md)."),
    *GPU_PARAMS,
    Param("min_cosine", float, 0.999, "Refuse to write the artifact if any sentence embedding's cosine to the "
          "input artifact's falls below this on the built-in corpus.", min=0.0, max=1.0),
]



def gpu_runtime_options(config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``runtime_options`` of an ONNX Runtime artifact compiled for a GPU provider: the provider and
    the options that apply to it (runtime/backends.py GpuOptions reads them)."""
    provider = config["provider"]
    if provider == "cpu":
        return {}
    keys = ["cuda_tf32"] + (["trt_fp16", "trt_engine_cache", "trt_max_batch"] if provider == "tensorrt" else [])
    return {"provider": provider, **{k: config[k] for k in keys}}


def preflight(config: dict[str, Any], where: str) -> None:
    """Before any stage of a recipe runs: a GPU provider needs this machine's ONNX Runtime to have it (the check
    runs the compiled model on it), and only ONNX Runtime has these providers."""
    # an option of the other runtime or provider would be recorded in the lineage and do nothing: refused by name
    if config["runtime"] != "openvino":
        for name in ("inference_precision", "performance_hint"):
            if config[name] is not None:
                raise UserError(f"{where}: --{name.replace('_', '-')} applies to --runtime openvino only; drop it "
                                f"(--runtime {config['runtime']} computes in the artifact's own precision)")
        if config["static_full_batch"] == "on":
            raise UserError(f"{where}: --static-full-batch applies to --runtime openvino only; drop it")
    for name, providers in (("cuda_tf32", ("cuda", "tensorrt")), ("trt_fp16", ("tensorrt",))):
        if config[name] and config["provider"] not in providers:
            raise UserError(f"{where}: --{name.replace('_', '-')} applies to --provider {providers[0]} only; drop "
                            f"it or add --runtime onnxruntime --provider {providers[0]}")
    if config["provider"] == "cpu":
        return
    if config["runtime"] != "onnxruntime":
        raise UserError(f"{where}: --provider {config['provider']} is an ONNX Runtime provider; "
                        "use --runtime onnxruntime")
    from bertopt.errors import require_onnxruntime
    from bertopt.runtime.backends import choose_providers, usable_providers

    try:
        choose_providers(config["provider"], usable_providers(require_onnxruntime("compile").get_available_providers()))
    except UserError as exc:
        raise UserError(f"{where}: compiling for a GPU needs one here: {exc}") from None


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import copy_onnx, load_onnx
    from bertopt.stages.common import require_onnx_artifact, settle_static_full_batch

    art = require_onnx_artifact(input, NAME)
    if art.model_format == "openvino-ir":
        raise UserError(f"{art.path} is already an OpenVINO IR with its runtime recorded (static int8); it needs no "
                        "compile: serve, validate or bench it as it is, or compile the ONNX artifact it was "
                        "quantised from for another precision")
    if art.model_format != "onnx":
        raise UserError(f"compile works on ONNX artifacts; export {art.path} to ONNX first (bertopt export)")
    preflight(config, f"stage '{NAME}'")
    if config["runtime"] == "openvino":  # OpenVINO's defaults, recorded in the lineage as used
        config = {**config, "inference_precision": config["inference_precision"] or "bf16",
                  "performance_hint": config["performance_hint"] or "LATENCY"}
    options: dict[str, Any] = gpu_runtime_options(config)
    precision = art.precision
    if config["runtime"] == "openvino":
        refuse_ort_contrib_ops(art, load_onnx(art.model_path),
                               "compile the exported or pruned artifact (before 'optimize') instead")
        options = {"inference_precision": config["inference_precision"],
                   "performance_hint": config["performance_hint"]}
        group = (art.manifest.get("runtime_options") or {}).get("dynamic_quantization_group_size")
        if group is not None:  # an OpenVINO int8 parent keeps its activation quantisation
            options["dynamic_quantization_group_size"] = group
        precision = precision_label(art.precision, config["inference_precision"])
    with ArtifactWriter(out_dir, stage=NAME, params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        copy_onnx(art.model_path, w.dir / "model.onnx")  # with its external data files
        w.runtime = config["runtime"]
        w.extra["runtime_options"] = options
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=precision)
        if config["runtime"] == "openvino":
            settle_static_full_batch(w, config["static_full_batch"])
        stats, session = _check(w.staged(), art, corpus(), config["provider"])
        w.report["accuracy_vs_parent"] = stats
        w.report["runtime"] = config["runtime"]
        if hasattr(session, "inference_precision"):
            w.report["effective_inference_precision"] = session.inference_precision
        worst = min((s.get("cos_min", 1.0) for s in stats.values() if "cos_min" in s), default=1.0)
        bad = sum(s.get("nan_or_inf", 0) for s in stats.values())
        if bad or worst < config["min_cosine"]:
            # at f32 the drift is the input's own lower precision (an int8 or bf16 parent), not this compile's
            fix = "lower --min-cosine" if config["inference_precision"] == "f32" or config["runtime"] != "openvino" \
                else "use --inference-precision f32 or lower --min-cosine"
            raise UserError(f"the {config['runtime']} model drifts from its input on the built-in corpus "
                            f"(cosine min {worst:.6f} < {config['min_cosine']}, NaN/Inf {bad}); {fix}")
    return w.artifact


def refuse_ort_contrib_ops(art, model, fix: str) -> None:
    """A UserError naming ``fix`` when ``model`` holds ONNX Runtime fused operators, which OpenVINO's ONNX
    frontend cannot read."""
    from bertopt.onnx_graph.util import ort_contrib_ops

    fused = ort_contrib_ops(model)
    if fused:
        raise UserError(f"{art.path} contains ONNX Runtime contrib ops ({', '.join(fused)}) that OpenVINO cannot "
                        f"read; {fix}")


def precision_label(parent: str, inference_precision: str) -> str:
    compute = {"auto": "auto", "bf16": "bf16", "f32": "fp32"}[inference_precision]
    if parent.startswith("int8"):
        return f"{parent.split('+')[0]}+{compute}"  # int8 MatMuls, the rest in the chosen float precision
    return compute


def _check(view, parent, texts, provider: str = "cpu"):
    """The staged artifact (with its runtime options, on its provider) against its parent on the CPU; returns
    (stats, session). A TensorRT check builds its engines without a cache: the staged folder is temporary."""
    import dataclasses

    from bertopt.measure.compare import compare_runs
    from bertopt.runtime import Predictor
    from bertopt.stages.common import parent_outputs

    if provider != "cpu":
        handle = view.model_handle()
        view = dataclasses.replace(handle, runtime_options={**handle.runtime_options, "trt_engine_cache": "off"})
    new = Predictor(view, provider=provider, verify=False)
    names = [o for o in new.output_names if o in parent.output_names]
    return (compare_runs(new.run(texts, outputs=names), parent_outputs(parent, texts, names), parent.output_kinds),
            new.session)
