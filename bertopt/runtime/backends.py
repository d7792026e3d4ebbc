"""Runtime backends: an artifact's model file -> something with ``run(output_names, feeds)``.

Backends are chosen per artifact (``artifact.runtime``, recorded in the manifest) or overridden by the
caller. New backends register with ``@register_backend``; the Predictor never branches on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from bertopt.errors import UserError, require
from bertopt.params import PROVIDERS


class Session(Protocol):
    backend: str
    provider: str
    input_names: list[str]
    output_names: list[str]

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...


_BACKENDS: dict[str, Callable[..., Session]] = {}


def register_backend(name: str):
    def deco(factory):
        _BACKENDS[name] = factory
        return factory

    return deco


def _load_optional_backends() -> None:
    # Backends living in their own modules register on import; importing is cheap (heavy imports are lazy).
    import importlib

    for module in ("bertopt.runtime.openvino_backend", "bertopt.runtime.tf_backend",
                   "bertopt.runtime.torch_backend"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


@dataclass
class ModelFile:
    """A model to open without an artifact around it (a candidate of the accuracy search, a probe copy of a
    graph with extra outputs): its file, or its serialised bytes, and the runtime (and options) to run it on."""

    model_path: Path | None = None
    runtime: str = "onnxruntime"
    runtime_options: dict[str, Any] = field(default_factory=dict)
    model_bytes: bytes | None = None
    model_format: str = "onnx"

    @property
    def manifest(self) -> dict[str, Any]:
        return {"runtime_options": self.runtime_options}


def open_model(model, *, runtime: str = "onnxruntime", provider: str = "cpu", threads: int | None = None,
               runtime_options: dict[str, Any] | None = None) -> Session:
    """A session on an in-memory ONNX model (``ModelProto``) or a model file path, through the backend registry."""
    if isinstance(model, (str, os.PathLike)):
        file = ModelFile(Path(model), runtime=runtime, runtime_options=dict(runtime_options or {}))
    else:
        file = ModelFile(None, runtime=runtime, runtime_options=dict(runtime_options or {}),
                         model_bytes=model.SerializeToString())
    return open_session(file, provider=provider, threads=threads)


def open_session(artifact, backend: str | None = None, provider: str = "auto",
                 threads: int | None = None, device_id: int | None = None) -> Session:
    _load_optional_backends()
    name = backend or artifact.runtime
    if artifact.model_format in ("tf-graphdef", "tf-savedmodel") and backend is None:
        name = "tensorflow"
    if name not in _BACKENDS:
        raise UserError(f"unknown runtime '{name}'; available: {', '.join(sorted(_BACKENDS))}")
    if getattr(artifact, "model_format", "onnx") == "openvino-ir" and name != "openvino":
        raise UserError(f"this artifact is an OpenVINO IR (static int8), which only OpenVINO runs; use --runtime "
                        f"openvino (not {name}), or quantise with --runtime onnxruntime for an ONNX model")
    if provider not in PROVIDERS:
        raise UserError(f"unknown provider '{provider}'; choose one of {', '.join(PROVIDERS)}")
    # device_id (which GPU) is only passed when given, so backends without GPUs need not accept it
    extra = {"device_id": device_id} if device_id is not None else {}
    return _BACKENDS[name](artifact, provider=provider, threads=threads, **extra)


def default_threads() -> int:
    """Physical cores we may use: the affinity mask (respects taskset / container limits)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


_ORT_OPT_LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


class OrtSession:
    """ONNX Runtime. ``runtime_options`` (manifest) may set ``graph_optimization_level`` (basic, extended, all;
    default all) and ``allow_spinning`` (default off): the benchmarks' session-option study uses them."""

    backend = "onnxruntime"

    def __init__(self, artifact, provider: str = "auto", threads: int | None = None,
                 device_id: int | None = None):
        ort = require("onnxruntime", "onnx", "running ONNX artifacts")
        available = ort.get_available_providers()
        wanted = _ort_providers(provider, available)
        runtime_options = (getattr(artifact, "manifest", None) or {}).get("runtime_options") or {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        level = runtime_options.get("graph_optimization_level", "all")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _ORT_OPT_LEVELS[level])
        # Spinning threads burn the other core between batches; on a shared 2-core box it costs more
        # than it saves, and it makes co-located workers (server, Spark) fight.
        spinning = "1" if runtime_options.get("allow_spinning") else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        options.log_severity_level = 3
        try:
            gpu_options = {"device_id": str(device_id)} if device_id is not None else {}
            providers = [(p, gpu_options) if gpu_options and p in _GPU_PROVIDERS else p for p in wanted]
            model = getattr(artifact, "model_bytes", None) or str(artifact.model_path)
            self._session = ort.InferenceSession(model, sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types for unloadable models
            raise UserError(f"ONNX Runtime cannot load {artifact.model_path or 'the model'}: "
                            f"{str(exc).splitlines()[0]}; re-create the artifact") from None
        got = self._session.get_providers()
        if provider in ("cuda", "tensorrt") and wanted[0] not in got:
            raise UserError(f"provider '{provider}' was requested but ONNX Runtime fell back to {got[0]} "
                            "(CUDA libraries missing?); use --provider cpu")
        self.provider = got[0]
        self.device_id = device_id if got[0] in _GPU_PROVIDERS else None
        self.threads = options.intra_op_num_threads
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, output_names, feeds):
        return self._session.run(output_names, feeds)


_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def _ort_providers(provider: str, available: list[str]) -> list[str]:
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise UserError("provider 'cuda' requested but this ONNX Runtime has no CUDA support "
                            "(install onnxruntime-gpu on a machine with a GPU, or use --provider cpu)")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if provider == "tensorrt":
        if "TensorrtExecutionProvider" not in available:
            raise UserError("provider 'tensorrt' requested but ONNX Runtime has no TensorRT support; "
                            "use --provider cuda or cpu")
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    # auto: CUDA when this ONNX Runtime has it, else CPU
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


register_backend("onnxruntime")(OrtSession)


def describe(session: Any) -> dict[str, Any]:
    return {"backend": session.backend, "provider": session.provider,
            "threads": getattr(session, "threads", None)}
