"""OpenVINO as a runtime backend: reads a model handle's ONNX file (or OpenVINO IR, model.xml with its model.bin)
and runs it on the CPU plugin.

An artifact is served with OpenVINO when its manifest says ``"runtime": "openvino"`` (written by
``bertopt compile --runtime openvino``) or when a caller passes ``runtime="openvino"``. Its
``runtime_options`` choose the inference precision (``bf16`` runs MatMuls with AVX-512 BF16 / AMX, ``f32``
keeps full precision; QDQ int8 models run their quantised MatMuls with VNNI/AMX int8) and the performance
hint. Compiled blobs are cached under ``$BERTOPT_CACHE_DIR/openvino`` (default ``~/.cache/bertopt``) so a
second load skips compilation; the cache is bounded (``$BERTOPT_OPENVINO_CACHE_MB``, default 2048; 0 turns it
off): after each compile the oldest blobs go until the rest fit. A blob loads without a hash, so the folder
must be the user's own and not writable by others (``private_cache_folder``). Processes sharing the cache (a
server's workers, Spark's executors, two tunes) compile a model one at a time (``compile_with_cache``).

OpenVINO cannot read ONNX Runtime's contrib ops (Attention, SkipLayerNormalization, ...); OpenVINO
artifacts are made from the exported or pruned ONNX, before ``optimize``.

With ``static_full_batch`` in its ``runtime_options`` a session also runs a full batch (a Predictor's batch size x
its window, every text at the window: long documents, padded input) on a copy of the model compiled for exactly
that shape (``FixedShapes``): OpenVINO's kernels for a known shape ran MiniLM's full batches 1.05x (f32) to 1.16x
(static int8) faster, MPNet's not at all, at the cost of a second executable's memory (about 0.3 GB for MiniLM at
256 tokens, 1.4 GB for MPNet at 384), so the stage that writes the artifact decides by measuring it
(:func:`static_full_batch_choice`; docs/performance.md).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bertopt.cosine import min_row_cosine
from bertopt.errors import ModelRunError, UserError, is_runtime_error, require
from bertopt.model_handle import (
    DEFAULT_RUNTIMES,
    FLOAT_MODEL_FILE,
    FLOAT_SHORT_TEXTS,
    ModelHandle,
    attention_mask_input,
)
from bertopt.output_paths import CACHE_LOCK_WAIT_S, cache_root, one_at_a_time
from bertopt.params import BATCH_DEV_BOUND, STATIC_FULL_BATCH
from bertopt.runtime.backends import default_threads, private_cache_folder, register_backend

PRECISIONS = ("auto", "bf16", "f32")
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")


CACHE_MB_DEFAULT = 2048  # a few models' blobs (MiniLM ~90 MB, MPNet ~270-440 MB each)


def cache_dir() -> Path:
    return cache_root() / "openvino"


def cache_limit_bytes() -> int:
    """The blob cache's bound: ``$BERTOPT_OPENVINO_CACHE_MB`` megabytes (0: no cache)."""
    raw = os.environ.get("BERTOPT_OPENVINO_CACHE_MB", str(CACHE_MB_DEFAULT)).strip()
    try:
        megabytes = int(raw)
    except ValueError:
        megabytes = -1
    if megabytes < 0:
        raise UserError(f"BERTOPT_OPENVINO_CACHE_MB={raw!r} is not a size; set a whole number of megabytes "
                        f"(0 turns the compiled-model cache off; default {CACHE_MB_DEFAULT})")
    return megabytes << 20


def trim_cache(folder: Path, limit: int) -> list[Path]:
    """Delete the oldest blobs in ``folder`` until the rest fit in ``limit`` bytes; the newest blob (the model
    just compiled) always stays. Returns what was deleted. Another process may be writing or reading a blob at the
    same time: a file that is gone already is skipped, and a blob being read stays readable until closed."""
    blobs = []
    for entry in folder.glob("*.blob"):
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue
        blobs.append((stat.st_mtime, stat.st_size, entry))
    blobs.sort(key=lambda b: b[0], reverse=True)  # newest first
    total, removed = 0, []
    for index, (_, size, entry) in enumerate(blobs):
        total += size
        if index > 0 and total > limit:
            try:
                entry.unlink()
                removed.append(entry)
            except FileNotFoundError:
                total -= size
    return removed


CACHE_LOCK_SHARDS = 64  # lock files in the cache: unrelated models share one 1 time in 64 (they then compile in turn)


def cache_lock_path(folder: Path, model_path: str) -> Path:
    """The lock file guarding ``model_path``'s blob in the cache ``folder``. OpenVINO 2026.4 names a blob after
    the model's absolute path and compile options (not NUM_STREAMS, nor the file's content), so one lock per
    resolved path covers every blob of that model."""
    key = int(hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest(), 16) % CACHE_LOCK_SHARDS
    return folder / "locks" / f"{key:02d}.lock"


def compile_with_cache(core, path: str, config: dict[str, Any], wait_s: float = CACHE_LOCK_WAIT_S):
    """``core.compile_model`` for the CPU, one process (or thread) at a time per model where ``config`` names a
    cache folder. OpenVINO writes a blob in place and the next process to find it reads it (memory-mapped) as it
    is: three processes opening one model with an empty shared cache failed 3 times in 75 (2 with an empty
    "core.cpp:132" error, 1 killed by SIGBUS), the way a server's workers or Spark's executors start; held to one
    compile at a time, the later ones load the finished blob."""
    folder = config.get("CACHE_DIR")
    if not folder:
        return core.compile_model(path, "CPU", config)
    with one_at_a_time(cache_lock_path(Path(folder), path), wait_s) as held:
        if not held:  # whoever holds it is stuck: compile without the cache rather than race its blob
            config = {k: v for k, v in config.items() if k != "CACHE_DIR"}
        return core.compile_model(path, "CPU", config)


def holds_fake_quantize(model) -> bool:
    """Whether an OpenVINO model (read, not compiled) has FakeQuantize nodes: static int8 activations (NNCF's
    IR)."""
    return any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())


def int8_attention_fusion_is_wrong_here(options: dict[str, Any], features: set[str] | None = None) -> bool:
    """Whether OpenVINO's fused int8 attention (its "snippets" MHA subgraph) must be turned off for a static int8
    model on this CPU. On AMX (amx_int8) with a bf16 float part, OpenVINO 2026.4's int8 MHA snippet gives wrong
    results for an unpadded batch of one: NNCF static int8 MiniLM measured cos min 0.928 alone against 0.984 in
    batches, 0.50 batch deviation on the token states; with the fusion off, 0.984 both ways and alone = batched to
    2e-16, at the same speed (0.99x padded 32 x 128, 1.1x short batches; docs/quantization.md). An f32 float part,
    or a CPU without AMX (AVX-512 VNNI: 4e-5), was not affected."""
    from bertopt.machine import cpu_features

    return "amx_int8" in (cpu_features() if features is None else features) and \
        options.get("inference_precision", "auto") != "f32"


def compile_config(options: dict[str, Any], threads: int, static_int8: bool = False) -> dict[str, Any]:
    """OpenVINO properties for the CPU plugin from an artifact's ``runtime_options``; ``static_int8``: the model
    has FakeQuantize nodes (:func:`holds_fake_quantize`)."""
    precision = options.get("inference_precision", "auto")
    if precision not in PRECISIONS:
        raise UserError(f"unknown OpenVINO inference precision {precision!r} in the manifest; "
                        f"re-create the artifact with one of {', '.join(PRECISIONS)}")
    hint = options.get("performance_hint", "LATENCY")
    if hint not in PERFORMANCE_HINTS:
        raise UserError(f"unknown OpenVINO performance hint {hint!r}; use one of {', '.join(PERFORMANCE_HINTS)}")
    config: dict[str, Any] = {"PERFORMANCE_HINT": hint, "INFERENCE_NUM_THREADS": int(threads)}
    if int(threads) < (os.cpu_count() or 1):
        # a session given part of the machine (one of several server workers, a Spark executor) must not pin its
        # threads: OpenVINO pins every process to the same first cores, so two 1-thread workers share one core
        config["ENABLE_CPU_PINNING"] = False
    if precision != "auto":
        config["INFERENCE_PRECISION_HINT"] = precision
    if hint == "LATENCY":
        config["NUM_STREAMS"] = 1
    group = options.get("dynamic_quantization_group_size")
    if group is not None:
        # int8-weight MatMuls: activations quantised to int8 per token, per group of channels (0 = stay float)
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = int(group)
    if static_int8 and int8_attention_fusion_is_wrong_here(options):
        config["SNIPPETS_MODE"] = "DISABLE"
    if options.get("profiling"):
        # per-node timings for request.profiling_info (benchmarks/profile_openvino.py); costs a little per node
        config["PERF_COUNT"] = True
    if options.get("cache", True) and cache_limit_bytes() > 0:
        folder = private_cache_folder(cache_dir(), "OpenVINO's compiled-model cache", "a blob loads unverified",
                                      "set BERTOPT_CACHE_DIR to a folder of your own, or BERTOPT_OPENVINO_CACHE_MB=0")
        config["CACHE_DIR"] = str(folder)
    return config


def _holds_onnxruntime_ops(path: str) -> bool:
    """Whether an ONNX file has ONNX Runtime's contrib ops (``optimize``'s fusions), which OpenVINO cannot read."""
    if not path.endswith(".onnx"):
        return False
    import onnx

    from bertopt.onnx_graph.util import ort_contrib_ops

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # not ONNX at all: the caller's line names the file and OpenVINO's own reason
        return False
    return bool(ort_contrib_ops(model))


def openvino_reason(exc: BaseException | str) -> str:
    """OpenVINO's reason without the "Exception from src/...cpp:NN:" lines it stacks before it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    told = [line for line in lines if not (line.startswith("Exception from ") and line.endswith(":"))]
    return " ".join(told)[-300:] or (lines[0] if lines else type(exc).__name__)


def _cannot_open(verb: str, path: str, exc: RuntimeError) -> UserError:
    first = openvino_reason(exc)
    if _holds_onnxruntime_ops(path):
        fix = "OpenVINO reads plain ONNX (compile the exported or pruned artifact, not the ONNX Runtime-optimised one)"
    else:
        fix = "re-create the artifact with the stage that wrote it, or run it with --runtime onnxruntime"
    return UserError(f"OpenVINO cannot {verb} {path}: {first}; {fix}")


_BRIDGE_LOCK = threading.Lock()
_BRIDGE_READY: list[bool] = []


def numpy_bridge_ready(ov) -> None:
    """Touch OpenVINO's numpy bridge once, on one thread, before any run. Its binding sets up pybind11's numpy
    API on first use inside a C++ function-static guard and runs Python there (letting go of the GIL); a second
    thread touching a tensor meanwhile takes the GIL and waits on the guard: a deadlock, every thread in futex
    wait. It struck the first call of a THROUGHPUT artifact (two batches side by side) in a fresh process: 12 of
    12 runs hung with a short GIL switch interval, none once touched here
    (tests/runtime/test_runtime_openvino_backend.py)."""
    with _BRIDGE_LOCK:
        if not _BRIDGE_READY:
            ov.Tensor(np.zeros((1,), np.float32)).data  # noqa: B018 (the conversion is the point)
            _BRIDGE_READY.append(True)


class Executable:
    """One compiled model and its idle infer requests (an infer request is not thread-safe: each run takes an idle
    one, one per run in flight, whichever thread runs it: the Predictor's helper threads come and go)."""

    def __init__(self, compiled, shown_as: str = "the model"):
        self.compiled = compiled
        self.shown_as = shown_as  # how an error names the model
        self.outputs: dict[str, Any] = {}
        for port in compiled.outputs:
            for name in port.get_names():
                self.outputs[name] = port
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def run(self, output_names, feeds, local) -> list[np.ndarray]:
        with self._lock:
            request = self._idle.pop() if self._idle else None
        if request is None:
            request = self.compiled.create_infer_request()
        try:
            try:
                results = request.infer({name: np.ascontiguousarray(arr) for name, arr in feeds.items()})
            except Exception as exc:
                if is_runtime_error(exc):  # OpenVINO's first lines name its source files: the reason is last
                    raise ModelRunError.of(self.shown_as, "OpenVINO", openvino_reason(exc)) from None
                raise
            return [np.array(results[self.outputs[n]], copy=True) for n in output_names]
        finally:
            local.last = request
            with self._lock:
                self._idle.append(request)


class FixedShapes:
    """The full-batch shapes a session runs on copies of its model compiled for that one shape. A Predictor
    names its own when it opens on the session (:meth:`OpenVinoSession.expect_full_batches`);
    the copy is compiled the first time a batch of that shape runs (a fraction of a second for MiniLM), and every
    batch of that shape runs on it from then on, so a shape's outputs never depend on what ran before."""

    def __init__(self, core, path: str, config: dict[str, Any]):
        self._core, self.path = core, path
        # no blob cache: OpenVINO names a blob after the model file, and these models are reshaped in memory
        self._config = {k: v for k, v in config.items() if k != "CACHE_DIR"}
        self.shapes: set[tuple[int, int]] = set()
        self.compiled: dict[tuple[int, int], Executable] = {}
        # shapes OpenVINO could not compile the model for (a graph whose ops cannot take a fixed shape), with its
        # reason: they run on the dynamic model, every time, so a shape's outputs still never change
        self.failed: dict[tuple[int, int], str] = {}
        self._lock = threading.Lock()

    def executable(self, shape: tuple[int, int]) -> Executable | None:
        """The copy for ``shape``, compiled on first use; None where it cannot be compiled (``failed``)."""
        with self._lock:  # one compile per shape, however many threads bring a full batch at once
            if shape in self.failed:
                return None
            found = self.compiled.get(shape)
            if found is None:
                try:
                    found = Executable(compile_for_shape(self._core, self.path, self._config, shape), self.path)
                except RuntimeError as exc:
                    # OpenVINO's first lines name its source files; the reason comes after them
                    self.failed[shape] = " ".join(str(exc).split())[-300:] or type(exc).__name__
                    return None
                self.compiled[shape] = found
            return found


def compile_for_shape(core, path: str, config: dict[str, Any], shape: tuple[int, int]):
    """The model at ``path`` compiled for inputs of exactly ``shape`` (batch, tokens)."""
    import openvino as ov

    model = core.read_model(path)
    model.reshape({port.get_any_name(): ov.PartialShape(list(shape)) for port in model.inputs})
    return core.compile_model(model, "CPU", config)


def fixed_shape_session(model: ModelHandle, threads: int | None = None) -> "OpenVinoSession":
    """A session on ``model`` that can run any shape on a copy compiled for it (``fixed_shapes.executable``), beside
    its dynamic model (``dynamic``), outside the blob cache: what the stage's measurement and
    ``benchmarks/fixed_shape.py`` time side by side."""
    import dataclasses

    options = {**model.runtime_options, "static_full_batch": True, "cache": False}
    return OpenVinoSession(dataclasses.replace(model, runtime_options=options), threads=threads)


class FullBatchTimer:
    """Texts/s of ``batch`` texts padded to ``tokens`` through an executable of ``session``: one batch per stream,
    side by side (as the Predictor runs whole batches)."""

    def __init__(self, session: "OpenVinoSession", batch: int, tokens: int):
        from bertopt.data import corpus
        from bertopt.runtime.predictor import Predictor

        self.session, self.batch = session, int(batch)
        predictor = Predictor(session.model, session=session, batch_size=batch, max_seq_len=tokens)
        texts = (corpus() * (batch // len(corpus()) + 1))[:batch]
        self.feeds, self.lengths = predictor.feeds_for(predictor.tokenize(texts), pad_to=tokens)
        self.names = session.output_names[:1]
        # the manifest's output names (a compiled port's first name may be another of its names)
        self.token_level = {name: predictor.is_token_level(name) for name in predictor.output_names}

    def deviation(self, executables: tuple[Executable, Executable]) -> tuple[float, str]:
        """The largest 1 - cosine between the two executables' outputs for this batch (each text's row; each real
        token's for token-level outputs) over every output, and the output it is in."""
        names = list(self.token_level)
        first, second = (self.session.run_on(e, names, self.feeds) for e in executables)
        worst, where = 0.0, names[0]
        for name, a, b in zip(names, first, second):
            for j, length in enumerate(self.lengths):
                moved = 1.0 - min_row_cosine(*(v[j][: int(length)] if self.token_level[name] else v[j]
                                                for v in (a, b)))
                if moved > worst:
                    worst, where = moved, name
        return worst, where

    def __call__(self, executable: Executable) -> float:
        from bertopt.runtime.predictor import side_by_side

        streams = self.session.parallel_runs
        start = time.perf_counter()
        side_by_side(lambda _: self.session.run_on(executable, self.names, self.feeds), range(streams), streams)
        return streams * self.batch / (time.perf_counter() - start)

    def interleaved(self, executables: dict[str, Executable], rounds: int) -> dict[str, list[float]]:
        """Each executable's rate per round, rounds interleaved (A B A B ...: the machine is shared and noisy)."""
        timed: dict[str, list[float]] = {name: [] for name in executables}
        for _ in range(rounds):
            for name, executable in executables.items():
                timed[name].append(self(executable))
        return timed


# ``auto`` turns it on at this measured gain or more: below it the second executable's memory buys too little
STATIC_FULL_BATCH_MIN_GAIN = 1.03
# ``auto`` does not measure a model whose full batch takes longer than this: such a batch is compute-bound, where
# the fixed shape's gain is gone (MPNet on AMX, 3 s: 0.99-1.02x at 32 x 128-384 tokens), and timing it would cost the
# stage many seconds. Below it the gain varies with the kernels, so it is measured: on the Xeon's oneDNN capped at
# AVX-512 VNNI (no AMX), MiniLM's dynamic int8 (0.7 s) gained 1.04x at 32 x 256, capped at AVX2 its f32 (1.1 s) 1.02x
STATIC_FULL_BATCH_MAX_BATCH_S = 1.0
# ... judged on this part of a batch (small batches run no faster per text, so the estimate errs long)
STATIC_FULL_BATCH_PROBE_PART = 8
# ... and timed in as many interleaved rounds (up to the caller's) as fit in about this many seconds of batches
STATIC_FULL_BATCH_TIMING_S = 2.0


def static_full_batch_choice(model: ModelHandle, setting: str, batch: int, threads: int | None = None,
                             rounds: int = 3) -> dict[str, Any]:
    """Whether the artifact's full batches (``batch`` texts x its window) should run on a copy of the model compiled
    for that shape. ``on`` / ``off``: as asked. ``auto``: measured here, one batch per stream side by side through
    each executable, rounds interleaved, medians: on when the fixed shape is at least
    ``STATIC_FULL_BATCH_MIN_GAIN`` times as fast and its outputs stay within ``BATCH_DEV_BOUND`` of the model's on
    that batch (``fixed_vs_dynamic_dev``). Returns the decision (``on``) with what it rests on."""
    from bertopt.runtime.predictor import sequence_length

    if setting not in STATIC_FULL_BATCH.choices:
        raise UserError(f"static_full_batch must be one of {', '.join(STATIC_FULL_BATCH.choices)}, not {setting!r}")
    tokens = sequence_length(model.model_info)
    found: dict[str, Any] = {"setting": setting, "batch": int(batch), "tokens": tokens}
    if setting != "auto":
        return {**found, "on": setting == "on", "why": f"--static-full-batch {setting}"}
    session = fixed_shape_session(model, threads)
    dynamic = session.dynamic
    full = FullBatchTimer(session, batch, tokens)
    probe_rows = int(batch) // STATIC_FULL_BATCH_PROBE_PART
    probe = FullBatchTimer(session, probe_rows, tokens) if probe_rows >= 1 else full
    probe(dynamic)  # first runs allocate and pick kernels
    seconds = batch / probe(dynamic)
    if seconds > STATIC_FULL_BATCH_MAX_BATCH_S:
        # judged on an eighth of the batch: a big model is left off without timing a whole batch (MPNet f32: 9 s)
        bound = f"> {STATIC_FULL_BATCH_MAX_BATCH_S:g} s"
        took = (f"would take about {seconds:.2f} s (timed on {probe_rows} texts; {bound})" if probe is not full
                else f"takes {seconds:.2f} s ({bound})")
        return {**found, "on": False, "dynamic_texts_per_s": round(batch / seconds, 1),
                "why": f"a full batch {took}: compute-bound, where a fixed shape gains nothing to pay for its memory; "
                       "not measured"}
    if probe is not full:
        full(dynamic)  # the full shape's first run
    fixed = session.fixed_shapes.executable((int(batch), tokens))
    if fixed is None:
        return {**found, "on": False, "why": "OpenVINO could not compile the model for that shape: "
                                            + session.fixed_shapes.failed[(int(batch), tokens)]}
    full(fixed)
    # a copy compiled for one shape fuses and blocks differently, so its float rounding differs; static int8
    # amplifies that where a value crosses a fixed quantisation step: NNCF static int8 MiniLM's copy moved its token
    # states 1.4e-3 from the model's on an AVX-512 VNNI + BF16 EPYC (the model's own batches: 1e-4), so the gate
    # failed what the stage had turned on. Such a copy is left off
    moved, where = full.deviation((dynamic, fixed))
    found["fixed_vs_dynamic_dev"] = float(f"{moved:.3g}")
    if moved > BATCH_DEV_BOUND:
        return {**found, "on": False,
                "why": f"the copy's outputs moved {moved:.1e} from the model's on a full batch of {batch} x {tokens} "
                       f"tokens ({where}), over the gate's batch deviation bound {BATCH_DEV_BOUND:g}; not timed"}
    # a slow batch gets fewer rounds: the measurement stays a few seconds of a stage (tune builds several)
    rounds = max(1, min(rounds, int(STATIC_FULL_BATCH_TIMING_S / (2 * seconds))))
    timed = full.interleaved({"dynamic": dynamic, "fixed": fixed}, rounds)
    dyn, fix = float(np.median(timed["dynamic"])), float(np.median(timed["fixed"]))
    on = fix >= STATIC_FULL_BATCH_MIN_GAIN * dyn
    return {**found, "on": on, "dynamic_texts_per_s": round(dyn, 1), "static_texts_per_s": round(fix, 1),
            "ratio": round(fix / dyn, 3), "rounds": rounds,
            "why": f"measured {fix / dyn:.2f}x ({fix:.1f} vs {dyn:.1f} texts/s) on full batches of {batch} x {tokens} "
                   f"tokens; {'on' if on else 'off'} at {STATIC_FULL_BATCH_MIN_GAIN:g}x or more"}


class ShortTexts(NamedTuple):
    """Where a static int8 artifact's short texts run: texts of at most ``max_tokens`` tokens (counted on the input
    ``mask``) on ``executable``, its float copy."""
    max_tokens: int
    mask: str
    executable: Executable


class OpenVinoSession:
    backend = "openvino"
    # one stream (LATENCY hint): runs from two threads wait for each other, so a caller that needs one run not to
    # wait behind another (the server's priority lane) opens a session of its own; with several streams
    # (THROUGHPUT) runs from several threads proceed side by side, one stream each
    concurrent_runs = False
    parallel_runs = 1

    def __init__(self, model: ModelHandle, provider: str = "auto", threads: int | None = None):
        ov = require("openvino", "openvino", "running artifacts with OpenVINO")
        if provider not in ("auto", "cpu"):
            raise UserError(f"provider '{provider}' is not available with the OpenVINO runtime (it runs on the "
                            "CPU here); use --provider cpu or --runtime onnxruntime")
        self.threads = threads or default_threads()
        if model.model_format not in ("onnx", "openvino-ir"):
            raise UserError(f"OpenVINO runs ONNX and OpenVINO IR models, not {model.model_format} ({model.shown_as}); "
                            f"use --runtime {DEFAULT_RUNTIMES[model.model_format]}")
        if model.model_path is None:
            raise UserError("the OpenVINO runtime opens model files, and this model is only in memory; save it "
                            "to a file first, or use --runtime onnxruntime")
        self.options = dict(model.runtime_options)
        self.model = model
        numpy_bridge_ready(ov)
        core = ov.Core()
        path = str(model.model_path)  # an IR's model.xml: OpenVINO reads the model.bin beside it (model_files)
        # the model is read to look for FakeQuantize only where that changes the compile (AMX)
        static_int8 = int8_attention_fusion_is_wrong_here(self.options) and holds_fake_quantize(self._read(core, path))
        config = compile_config(self.options, self.threads, static_int8)
        try:
            # compiling from the path (not a read model) lets OpenVINO use its blob cache
            self._compiled = compile_with_cache(core, path, config)
        except RuntimeError as exc:
            raise _cannot_open("load", path, exc) from None
        if "CACHE_DIR" in config:
            trim_cache(Path(config["CACHE_DIR"]), cache_limit_bytes())
        self.provider = "CPU"
        self.parallel_runs = max(1, int(self._compiled.get_property("NUM_STREAMS")))
        self.concurrent_runs = self.parallel_runs > 1
        precision = self._compiled.get_property("INFERENCE_PRECISION_HINT")
        self.inference_precision = precision.get_type_name() if hasattr(precision, "get_type_name") else str(precision)
        self.input_names = [p.get_any_name() for p in self._compiled.inputs]
        self.dynamic = Executable(self._compiled, str(model.shown_as))  # the model as read: every shape
        self._outputs = self.dynamic.outputs
        self.output_names = [p.get_any_name() for p in self._compiled.outputs]
        model.check_graph_io([p.get_names() for p in self._compiled.inputs], self._outputs)
        self.fixed_shapes = FixedShapes(core, path, config) if self.options.get("static_full_batch") else None
        self.short_texts = self._short_texts(core, model) if self.options.get(FLOAT_SHORT_TEXTS) else None
        self._local = threading.local()  # this thread's last request (profiling_info)

    def _short_texts(self, core, model: ModelHandle) -> "ShortTexts":
        """The float copy a static int8 artifact runs its short texts on (``runtime_options.float_short_texts``):
        compiled as the artifact's float part runs (its inference precision), with no quantisation options."""
        path = next((p for p in model.model_files if p.name == FLOAT_MODEL_FILE), None)
        if path is None:  # Artifact.load lists it among the model files: only a hand-made handle gets here
            raise UserError(f"{model.shown_as} runs short texts on a float copy ({FLOAT_MODEL_FILE}) it does not "
                            "have; re-create it with 'bertopt quantize --mode int8-static --runtime openvino'")
        mask = attention_mask_input(model.inputs)
        if mask is None:
            raise UserError(f"{model.shown_as} runs short texts on a float copy, but has no attention-mask input to "
                            "count a text's tokens by; re-create it with --float-short-texts off")
        options = {k: v for k, v in self.options.items()
                   if k not in (FLOAT_SHORT_TEXTS, "dynamic_quantization_group_size", "static_full_batch")}
        try:
            compiled = compile_with_cache(core, str(path), compile_config(options, self.threads))
        except RuntimeError as exc:
            raise _cannot_open("load", str(path), exc) from None
        return ShortTexts(int(self.options[FLOAT_SHORT_TEXTS]), mask,
                          Executable(compiled, f"{model.shown_as} (its float copy for short texts)"))

    @staticmethod
    def _read(core, path: str):
        try:
            return core.read_model(path)
        except RuntimeError as exc:
            raise _cannot_open("read", path, exc) from None

    def expect_full_batches(self, batch: int, tokens: int) -> None:
        """A Predictor on this session runs a full batch (every text at its window) as ``batch`` rows of ``tokens``
        tokens: where the artifact asks for it (``static_full_batch``), a batch of exactly that shape runs on a copy
        of the model compiled for it (or, where OpenVINO cannot compile one, on the dynamic model)."""
        if self.fixed_shapes is not None:
            self.fixed_shapes.shapes.add((int(batch), int(tokens)))

    def run(self, output_names, feeds):
        unknown = [n for n in output_names if n not in self._outputs]
        if unknown:
            raise UserError(f"unknown output {unknown[0]!r}; the model has {', '.join(self.output_names)}")
        if self.short_texts is not None and feeds:
            return self._run_routed(output_names, feeds)
        return self._run_int8(output_names, feeds)

    def _run_routed(self, output_names, feeds) -> list[np.ndarray]:
        """Each row by its own token count: at most ``short_texts.max_tokens`` on the float copy, the rest on the
        model, so a text takes the same path alone or in any batch (rows of a padded batch are independent)."""
        limit, mask, executable = self.short_texts
        short = np.asarray(feeds[mask]).sum(axis=1) <= limit
        if short.all():
            return self.run_on(executable, output_names, feeds)
        if not short.any():
            return self._run_int8(output_names, feeds)
        rows = {True: np.flatnonzero(short), False: np.flatnonzero(~short)}
        got = {True: self.run_on(executable, output_names, {k: v[rows[True]] for k, v in feeds.items()}),
               False: self._run_int8(output_names, {k: v[rows[False]] for k, v in feeds.items()})}
        merged = []
        for i in range(len(output_names)):
            first, second = got[True][i], got[False][i]
            out = np.empty((len(short), *second.shape[1:]), dtype=second.dtype)
            out[rows[True]] = first
            out[rows[False]] = second
            merged.append(out)
        return merged

    def _run_int8(self, output_names, feeds) -> list[np.ndarray]:
        executable = self.dynamic
        if self.fixed_shapes is not None and feeds:
            shape = tuple(next(iter(feeds.values())).shape)
            if shape in self.fixed_shapes.shapes:
                executable = self.fixed_shapes.executable(shape) or self.dynamic
        return self.run_on(executable, output_names, feeds)

    def run_on(self, executable: Executable, output_names, feeds) -> list[np.ndarray]:
        """``feeds`` through one of this session's executables (the dynamic model or a fixed-shape copy), the
        request kept as this thread's last (``profiling_info``)."""
        return executable.run(output_names, feeds, self._local)

    def profiling_info(self) -> list[Any]:
        """OpenVINO's per-node records (node name and type, exec type such as ``brgemm_avx512_i8``, real and CPU
        time) of this thread's last run; the artifact's ``runtime_options`` must have ``"profiling": true``."""
        if not self.options.get("profiling"):
            raise UserError("this OpenVINO session was compiled without profiling; set runtime_options "
                            "'profiling': true on the artifact it runs")
        last = getattr(self._local, "last", None)
        if last is None:
            raise UserError("no run of this OpenVINO session on this thread yet; run a batch, then read its profile")
        return list(last.profiling_info)

    def runtime_model(self):
        """The graph OpenVINO compiled (its nodes carry the layer type, precision and kernel chosen)."""
        return self._compiled.get_runtime_model()


register_backend("openvino")(OpenVinoSession)
