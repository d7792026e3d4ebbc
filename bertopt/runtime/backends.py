"""Runtime backends: a model handle (``bertopt.model_handle.ModelHandle``) -> a session with
``run(output_names, feeds)``.

The backend is the handle's ``runtime`` (an artifact's is recorded in its manifest) or the caller's override.
New backends register with ``@register_backend(name)``: a factory ``(handle, provider=, threads=[, device_id=])``
that reads the handle's fields and nothing else; the Predictor never branches on them.
"""

from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from bertopt.errors import ModelRunError, UserError, is_runtime_error, require_onnxruntime
from bertopt.model_handle import DEFAULT_RUNTIMES, ModelHandle
from bertopt.output_paths import cache_root, one_at_a_time
from bertopt.params import GPU_PARAMS, MAX_THREADS, PROVIDERS, resolve_config
from bertopt.plugins import Registry, import_all


class Session(Protocol):
    backend: str
    provider: str
    threads: int
    input_names: list[str]
    output_names: list[str]
    # whether one session may run calls from several threads at once (a worker's bulk and priority lanes)
    concurrent_runs: bool
    # how many runs proceed side by side to use the session's threads (OpenVINO's streams): the Predictor keeps
    # that many batches in flight
    parallel_runs: int

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...

    # optional (OpenVINO): ``expect_full_batches(batch, tokens)``, told by each Predictor opened on the session


def _load_optional_backends() -> None:
    # Backends living in their own modules register on import; importing is cheap (heavy imports are lazy).
    import_all(("bertopt.runtime.openvino_backend", "bertopt.runtime.tf_backend", "bertopt.runtime.torch_backend"),
               optional=True)


_BACKENDS: Registry[Callable[..., Session]] = Registry("runtime", load=_load_optional_backends)


def register_backend(name: str):
    return _BACKENDS.register(name)


def open_model(model, *, runtime: str = "onnxruntime", provider: str = "cpu", threads: int | None = None,
               runtime_options: dict[str, Any] | None = None) -> Session:
    """A session on a model that is no artifact (a candidate of the accuracy search, a probe copy of a graph with
    extra outputs): an in-memory ONNX model (``ModelProto``) or a model file path, through the backend registry."""
    if isinstance(model, (str, os.PathLike)):
        path, data, shown = Path(model), None, Path(model)
    else:
        path, data, shown = None, model.SerializeToString(), None
    handle = ModelHandle(model_format="onnx", inputs=(), outputs=(), tokenizer_path=None, model_info={}, path=shown,
                         digest="model", model_path=path, model_bytes=data, runtime=runtime,
                         runtime_options=dict(runtime_options or {}))
    return open_session(handle, provider=provider, threads=threads)


def open_session(model: ModelHandle, backend: str | None = None, provider: str = "auto",
                 threads: int | None = None, device_id: int | None = None) -> Session:
    """A session on ``model`` with its runtime (``model.runtime``) or ``backend``, the caller's choice."""
    if not isinstance(model, ModelHandle):
        raise TypeError(f"open_session opens a ModelHandle (artifact.model_handle()), not {type(model).__name__}")
    factory = _BACKENDS.get(backend or model.runtime)
    if provider not in PROVIDERS:
        raise UserError(f"unknown provider '{provider}'; choose one of {', '.join(PROVIDERS)}")
    # device_id (which GPU) is only passed when given, so backends without GPUs need not accept it
    extra = {"device_id": device_id} if device_id is not None else {}
    return factory(model, provider=provider, threads=threads, **extra)


THREADS_ENV = "BERTOPT_THREADS"


def default_threads() -> int:
    """The threads a runtime uses when not told (``--threads``): ``$BERTOPT_THREADS`` where set (several bertopt
    processes sharing one machine, each given its part: two servers on one host, the test suite's workers), else
    the cores this process may use (its affinity mask: taskset / container limits)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        count = int(raw) if raw.isdigit() and len(raw) < 8 else 0
        if not 1 <= count <= MAX_THREADS:
            raise UserError(f"{THREADS_ENV}={raw!r} is not a thread count; set a whole number from 1 to {MAX_THREADS} "
                            "(the threads each bertopt process uses by default), or unset it to use every core")
        return count
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


_ORT_OPT_LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}

# bertopt's provider names -> ONNX Runtime's; the GPU ones run through onnxruntime-gpu (docs/gpu.md)
ORT_PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                      "tensorrt": "TensorrtExecutionProvider"}
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def ort_build() -> str:
    """Which ONNX Runtime distribution is installed, for messages: ``onnxruntime 1.31.1``, ``onnxruntime-gpu
    1.31.1``, or both (they install one ``onnxruntime`` module, so the last one installed wins: a broken mix)."""
    from importlib import metadata

    found = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return " and ".join(found) or "an ONNX Runtime of unknown origin"


TENSORRT_LIBRARY = "libnvinfer.so.10"  # the TensorRT major version onnxruntime-gpu 1.31 links


@functools.lru_cache(maxsize=1)  # asked at every session start: load (or fail to load) libnvinfer once
def tensorrt_libraries_problem() -> str | None:
    """None when TensorRT itself can be loaded, else why not. onnxruntime-gpu lists TensorrtExecutionProvider
    whenever its own provider library is installed, with or without TensorRT (seen on an H100 machine: the
    session then falls back to CUDA after printing an error)."""
    import ctypes
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:  # the wheel of the tensorrt extra loads libnvinfer
        try:
            importlib.import_module("tensorrt")
            return None
        except Exception as exc:  # an ImportError or a loader error from its native part
            return f"the tensorrt package does not load ({str(exc).splitlines()[0] if str(exc) else exc!r})"
    try:
        ctypes.CDLL(TENSORRT_LIBRARY)
    except OSError:
        return f"TensorRT ({TENSORRT_LIBRARY}) is not installed"
    return None


def usable_providers(available: Sequence[str], tensorrt_problem: Callable[[], str | None] | None = None) -> list[str]:
    """``available`` (ONNX Runtime's list) less TensorRT when TensorRT itself cannot be loaded."""
    if "TensorrtExecutionProvider" in available and (tensorrt_problem or tensorrt_libraries_problem)():
        return [p for p in available if p != "TensorrtExecutionProvider"]
    return list(available)


def provider_unavailable(provider: str, available: Sequence[str], build: str) -> str:
    """The one line for a provider this ONNX Runtime does not have: what it has, and the extra to install."""
    has = ", ".join(p.removesuffix("ExecutionProvider").lower() for p in available)
    if " and " in build:  # both wheels: the CPU one shadows the GPU one
        return (f"provider '{provider}' is not available: {build} are both installed and share one module; "
                "pip uninstall -y onnxruntime onnxruntime-gpu, then pip install 'bertopt[gpu]'")
    if provider == "tensorrt" and "CUDAExecutionProvider" in available:  # the GPU build without TensorRT itself
        return (f"provider 'tensorrt' is not available: {build} has its TensorRT provider but "
                f"{tensorrt_libraries_problem() or 'TensorRT does not load'}; install it with: pip install "
                "'bertopt[tensorrt]' (or run in a TensorRT container), or use --provider cuda")
    extra = "tensorrt" if provider == "tensorrt" else "gpu"
    return (f"provider '{provider}' is not available in {build} (it has: {has}); on a machine with an NVIDIA GPU "
            f"install the GPU build with: pip install 'bertopt[{extra}]' (in place of 'bertopt[cpu]'), or use "
            "--provider cpu")


def choose_providers(provider: str, available: Sequence[str], recorded: str | None = None,
                     build: str | None = None) -> list[str]:
    """ONNX Runtime providers, in order of preference, for ``provider`` (``auto``, ``cpu``, ``cuda``, ``tensorrt``).

    An explicit GPU provider this runtime lacks is one UserError naming what it has and the extra to install.
    ``auto`` takes the artifact's ``recorded`` provider (compile --provider) when this runtime has it, else CUDA
    when it has CUDA, else the CPU: an artifact compiled for a GPU still runs, on the CPU, where there is none."""
    if provider not in PROVIDERS:
        raise UserError(f"unknown provider '{provider}'; choose one of {', '.join(PROVIDERS)}")
    if provider == "auto":
        if recorded and recorded != "cpu" and ORT_PROVIDER_NAMES.get(recorded) in available:
            provider = recorded
        else:
            provider = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    wanted = ORT_PROVIDER_NAMES[provider]
    if wanted not in available:
        raise UserError(provider_unavailable(provider, available, build or ort_build()))
    chain = [wanted] + [p for p in _GPU_PROVIDERS if p != wanted and p in available and provider == "tensorrt"]
    return chain + ([] if wanted == "CPUExecutionProvider" else ["CPUExecutionProvider"])


@dataclass(frozen=True)
class GpuOptions:
    """The GPU settings of one session: the artifact's ``runtime_options`` (GPU_PARAMS of params.py) and the
    device. ``provider_options`` turns them into each ONNX Runtime provider's own options."""

    device_id: int = 0
    cuda_tf32: bool = False
    trt_fp16: bool = False
    trt_engine_cache: str = "beside"
    trt_max_batch: int = 64

    @classmethod
    def from_runtime_options(cls, options: dict[str, Any], device_id: int | None = None) -> "GpuOptions":
        values = resolve_config(GPU_PARAMS, {k: v for k, v in options.items() if k in _GPU_KEYS},
                                "the artifact's runtime_options")
        return cls(device_id=device_id or 0, **values)

    def engine_cache_dir(self, model: ModelHandle) -> Path | None:
        """Where TensorRT keeps the engines it builds for ``model``: ``<artifact>.trt-cache/<digest>`` beside
        the artifact folder (never inside: an artifact's files are all hashed, an engine is built per GPU),
        ``$BERTOPT_CACHE_DIR/tensorrt/<digest>`` (``cache``, where OpenVINO keeps its compiled blobs), a folder of
        the user's own (a digest-named folder in it), or None (``off``, or a model that is no file)."""
        if self.trt_engine_cache == "off" or model.path is None:
            return None
        if self.trt_engine_cache == "beside":
            base = model.path.parent / f"{model.path.name}.trt-cache"
        elif self.trt_engine_cache == "cache":
            base = cache_root() / "tensorrt"
        else:
            base = Path(self.trt_engine_cache)
        return base / model.digest.replace(":", "-")[:32]

    def provider_options(self, name: str, model: ModelHandle, cache: Path | None = None) -> dict[str, str]:
        """ONNX Runtime's options (all strings) of provider ``name``; ``cache`` is the checked engine folder."""
        if name == "CUDAExecutionProvider":
            return {"device_id": str(self.device_id), "use_tf32": "1" if self.cuda_tf32 else "0"}
        if name != "TensorrtExecutionProvider":
            return {}
        out = {"device_id": str(self.device_id), "trt_fp16_enable": "1" if self.trt_fp16 else "0",
               "trt_layer_norm_fp32_fallback": "1" if self.trt_fp16 else "0",
               "trt_engine_cache_enable": "1" if cache else "0"}
        if cache:
            out.update({"trt_engine_cache_path": str(cache), "trt_timing_cache_enable": "1",
                        "trt_timing_cache_path": str(cache)})
        shapes = trt_profile_shapes(model, self.trt_max_batch)
        if shapes:
            out.update(shapes)
        return out


_GPU_KEYS = {p.name for p in GPU_PARAMS}


def trt_profile_shapes(model: ModelHandle, max_batch: int) -> dict[str, str]:
    """One TensorRT optimisation profile covering every batch up to ``max_batch`` and every length up to the
    artifact's sequence length, so that length-bucketed batches never trigger an engine rebuild."""
    names = [i["name"] for i in model.inputs]
    if not names:
        return {}
    info = model.model_info
    seq = int(info.get("max_seq_len") or info.get("max_position_embeddings") or 512)

    def shape(b: int, s: int) -> str:
        return ",".join(f"{n}:{b}x{s}" for n in names)

    return {"trt_profile_min_shapes": shape(1, 1), "trt_profile_opt_shapes": shape(min(32, max_batch), min(128, seq)),
            "trt_profile_max_shapes": shape(max_batch, seq)}


def private_cache_folder(folder: Path, what: str, unverified: str, elsewhere: str) -> Path:
    """A cache folder of files loaded without a hash (TensorRT engines, OpenVINO blobs), created private (0700).
    One that someone else owns, or that others may write to, is refused: they could put a file of their own
    there, and it would run in place of the validated model. ``what`` names the cache, ``unverified`` says what
    runs unverified, ``elsewhere`` how to use another folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UserError(f"{what} {folder} cannot be created ({exc.strerror}); {elsewhere}") from None
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UserError(f"{what} {folder} is owned by another user or writable by others, and {unverified}; "
                        f"chmod go-w {folder} (as its owner) or use another folder")
    return folder


def prepare_engine_cache(folder: Path) -> Path:
    """The TensorRT engine folder (``private_cache_folder``)."""
    return private_cache_folder(folder, "TensorRT engine cache", "an engine runs unverified",
                                "record another with bertopt compile --trt-engine-cache cache (or a writable "
                                "folder, or off)")


def bind_arguments(ort, feeds: dict[str, np.ndarray], output_names: Sequence[str], device: str,
                   device_id: int) -> tuple[dict[str, Any], list[tuple[str, str, int]]]:
    """The I/O binding of one call: each input as an OrtValue on ``device`` (copied there once), each output
    allocated by ONNX Runtime on ``device`` (no host buffer in between)."""
    inputs = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), device, device_id)
              for name, value in feeds.items()}
    return inputs, [(name, device, device_id) for name in output_names]


def run_bound(session, ort, output_names: Sequence[str], feeds: dict[str, np.ndarray], device: str,
              device_id: int) -> list[np.ndarray]:
    """Run ``session`` through an IOBinding on ``device`` and copy the outputs to host memory."""
    inputs, outputs = bind_arguments(ort, feeds, output_names, device, device_id)
    binding = session.io_binding()
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    for name, dev, dev_id in outputs:
        binding.bind_output(name, dev, dev_id)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()


_PRELOADED = False


def _load_gpu_libraries(ort, providers: Sequence[str]) -> None:
    """CUDA and cuDNN from the nvidia-* wheels of the ``gpu`` extra (onnxruntime.preload_dlls), and TensorRT
    from its wheel when installed, before the first GPU session. Once per process."""
    global _PRELOADED
    if _PRELOADED or not any(p in _GPU_PROVIDERS for p in providers):
        return
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    if "TensorrtExecutionProvider" in providers:
        import importlib.util

        if importlib.util.find_spec("tensorrt") is not None:  # the wheel loads libnvinfer; else the system's
            importlib.import_module("tensorrt")
    _PRELOADED = True


class OrtSession:
    """ONNX Runtime. ``runtime_options`` (manifest) may set ``graph_optimization_level`` (basic, extended, all;
    default all) and ``allow_spinning`` (default off): the benchmarks' session-option study uses them; and the
    GPU options of ``GpuOptions`` (``provider`` recorded by compile, ``cuda_tf32``, ``trt_*``: docs/gpu.md).
    On a GPU provider every call runs through an IOBinding (outputs allocated on the device)."""

    backend = "onnxruntime"
    concurrent_runs = True
    parallel_runs = 1

    def __init__(self, model: ModelHandle, provider: str = "auto", threads: int | None = None,
                 device_id: int | None = None):
        ort = require_onnxruntime("running ONNX artifacts")
        if model.model_format != "onnx":
            raise UserError(f"ONNX Runtime runs ONNX models, not {model.model_format} ({model.shown_as}); "
                            f"use --runtime {DEFAULT_RUNTIMES[model.model_format]}")
        runtime_options = model.runtime_options
        wanted = choose_providers(provider, usable_providers(ort.get_available_providers()),
                                  runtime_options.get("provider"))
        gpu = GpuOptions.from_runtime_options(runtime_options, device_id)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        level = runtime_options.get("graph_optimization_level", "all")
        options.graph_optimization_level = ort.GraphOptimizationLevel.__members__[_ORT_OPT_LEVELS[level]]
        # Spinning threads burn the other core between batches; on a shared 2-core box it costs more
        # than it saves, and it makes co-located workers (server, Spark) fight.
        spinning = "1" if runtime_options.get("allow_spinning") else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        options.log_severity_level = 4  # fatal only: its errors reach the user as our one line (ModelRunError)
        cache = None
        if "TensorrtExecutionProvider" in wanted and gpu.engine_cache_dir(model) is not None:
            cache = prepare_engine_cache(gpu.engine_cache_dir(model))
        providers = [(p, gpu.provider_options(p, model, cache)) for p in wanted]
        _load_gpu_libraries(ort, wanted)
        try:
            source = model.model_bytes or str(model.model_path)
            # TensorRT builds its engine as the session opens and writes it to the cache, where another worker
            # would read it half-written: one build at a time per engine folder (as OpenVINO's blobs; not run
            # on a GPU here)
            with one_at_a_time(cache / "build.lock") if cache else nullcontext():
                self._session = ort.InferenceSession(source, sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types for unloadable models
            raise UserError(f"ONNX Runtime cannot load {model.model_path or 'the model'}: "
                            f"{str(exc).splitlines()[0]}; re-create the artifact") from None
        got = self._session.get_providers()
        if provider in ("cuda", "tensorrt") and wanted[0] not in got:
            raise UserError(f"provider '{provider}' was requested but ONNX Runtime fell back to {got[0]} "
                            "(no GPU visible, or CUDA libraries missing: see docs/gpu.md); use --provider cpu")
        self._ort = ort
        self.provider = got[0]
        self.device_id = gpu.device_id if got[0] in _GPU_PROVIDERS else None
        # I/O binding only where outputs live on a GPU; on the CPU, run() is already zero-copy
        self.io_binding = got[0] in _GPU_PROVIDERS
        self.threads = options.intra_op_num_threads
        self.shown_as = model.shown_as
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        model.check_graph_io(self.input_names, self.output_names)

    def run(self, output_names, feeds):
        if self.io_binding:
            return run_bound(self._session, self._ort, output_names or self.output_names, feeds, "cuda",
                             self.device_id or 0)
        try:
            return self._session.run(output_names, feeds)
        except Exception as exc:
            if is_runtime_error(exc):
                raise ModelRunError.of(str(self.shown_as), "ONNX Runtime", exc) from None
            raise


register_backend("onnxruntime")(OrtSession)


def describe(session: Any) -> dict[str, Any]:
    return {"backend": session.backend, "provider": session.provider, "threads": session.threads}
