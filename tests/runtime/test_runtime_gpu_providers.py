"""The GPU install path on a machine without a GPU: the cpu/gpu extras, the one-line message of a missing ONNX
Runtime, provider choice, the CUDA/TensorRT options, the TensorRT engine cache, I/O binding on CPU OrtValues,
and the GPU recipes' refusal. The tests marked ``gpu`` run where onnxruntime-gpu sees a GPU and are skipped
elsewhere (no GPU was available to run them when they were written: docs/gpu.md)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tomllib

from bertopt.errors import UserError
from bertopt.runtime import Predictor
from bertopt.runtime.backends import (
    TENSORRT_LIBRARY,
    GpuOptions,
    bind_arguments,
    choose_providers,
    open_session,
    prepare_engine_cache,
    provider_unavailable,
    run_bound,
    tensorrt_libraries_problem,
    usable_providers,
)

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = ["AzureExecutionProvider", "CPUExecutionProvider"]
WITH_CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
WITH_TRT = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()



# -- the extras ------------------------------------------------------------------------------------------------
def test_base_package_depends_on_no_onnx_runtime_and_the_extras_pick_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("onnxruntime")]
    extras = project["optional-dependencies"]
    assert extras["cpu"] == ["onnxruntime==1.31.1"]
    assert extras["gpu"] == ["onnxruntime-gpu[cuda,cudnn]==1.31.1"]
    assert "bertopt[gpu]" in extras["tensorrt"]
    # `all` keeps the CPU build, so `pip install -e '.[all,dev]'` (Makefile, README) installs a runtime
    assert extras["all"][0].startswith("bertopt[cpu,")
    assert not any("onnxruntime-gpu" in d or "gpu" in d.split("[")[-1] for d in extras["all"])


# -- a missing runtime: a real interpreter in which `import onnxruntime` fails --------------------------------
_BLOCKED = """
import sys
class _NoOnnxRuntime:
    def find_spec(self, name, path=None, target=None):
        if name == "onnxruntime" or name.startswith("onnxruntime."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoOnnxRuntime())
from bertopt.cli import main
main(sys.argv[1:])
"""


def _bertopt_without_onnxruntime(*argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-c", _BLOCKED, *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=180)


def _one_line_naming_both_extras(err: str, what: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f"ONNX Runtime is not installed (needed for {what})" in lines[0]
    assert "pip install 'bertopt[cpu]'" in lines[0] and "'bertopt[gpu]'" in lines[0]
    assert "Traceback" not in err


def test_a_stage_without_onnx_runtime_names_the_extras_and_exits_2(tiny_onnx, tmp_path):
    out = tmp_path / "optimized"
    done = _bertopt_without_onnxruntime("optimize", tiny_onnx.path, "--out", out, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line_naming_both_extras(done.stderr, "the optimize stage")
    assert not out.exists()


def test_running_an_artifact_without_onnx_runtime_names_the_extras_and_exits_2(tiny_onnx, tmp_path):
    done = _bertopt_without_onnxruntime("validate", tiny_onnx.path, "--provider", "cpu", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line_naming_both_extras(done.stderr, "running ONNX artifacts")


def test_a_gpu_recipe_without_onnx_runtime_names_the_extras_before_any_stage(tmp_path):
    out = tmp_path / "artifacts"
    done = _bertopt_without_onnxruntime("run", ROOT / "recipes" / "minilm-gpu-fp16.yaml", "--out", out,
                                        cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "ONNX Runtime is not installed (needed for compile)" in done.stderr
    assert "pip install 'bertopt[cpu]'" in done.stderr and not out.exists()


# -- provider choice -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("provider, available, recorded, expected", [
    ("cpu", WITH_TRT, None, ["CPUExecutionProvider"]),
    ("auto", CPU_ONLY, None, ["CPUExecutionProvider"]),
    ("auto", WITH_CUDA, None, ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("auto", WITH_TRT, None, ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    # an artifact compiled for TensorRT gets it under auto where it is available...
    ("auto", WITH_TRT, "tensorrt", WITH_TRT),
    # ... CUDA where only CUDA is, and the CPU on a machine with neither: it still runs
    ("auto", WITH_CUDA, "tensorrt", ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("auto", CPU_ONLY, "tensorrt", ["CPUExecutionProvider"]),
    ("auto", WITH_TRT, "cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("cuda", WITH_TRT, "tensorrt", ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("tensorrt", WITH_TRT, None, WITH_TRT),
    ("tensorrt", ["TensorrtExecutionProvider", "CPUExecutionProvider"], None,
     ["TensorrtExecutionProvider", "CPUExecutionProvider"]),
])
def test_provider_choice(provider, available, recorded, expected):
    assert choose_providers(provider, available, recorded, build="onnxruntime-gpu 1.31.1") == expected


@pytest.mark.parametrize("provider, available, extra", [
    ("cuda", CPU_ONLY, "gpu"),
    ("tensorrt", CPU_ONLY, "tensorrt"),
])
def test_an_unavailable_provider_names_what_there_is_and_the_extra(provider, available, extra):
    with pytest.raises(UserError) as caught:
        choose_providers(provider, available, build="onnxruntime 1.31.1")
    message = str(caught.value)
    has = ", ".join(p.removesuffix("ExecutionProvider").lower() for p in available)
    assert message == (f"provider '{provider}' is not available in onnxruntime 1.31.1 (it has: {has}); on a machine "
                       f"with an NVIDIA GPU install the GPU build with: pip install 'bertopt[{extra}]' (in place of "
                       "'bertopt[cpu]'), or use --provider cpu")


def test_the_gpu_build_without_tensorrt_itself_names_the_tensorrt_extra():
    # onnxruntime-gpu lists its TensorRT provider whether or not TensorRT is installed (seen on an H100 machine):
    # the provider is dropped when libnvinfer cannot be loaded, and asking for it says what is missing
    missing = lambda: "TensorRT (libnvinfer.so.10) is not installed"  # noqa: E731
    assert usable_providers(WITH_TRT, missing) == WITH_CUDA
    assert usable_providers(WITH_TRT, lambda: None) == WITH_TRT
    assert usable_providers(CPU_ONLY, missing) == CPU_ONLY
    with pytest.raises(UserError) as caught:
        choose_providers("tensorrt", usable_providers(WITH_TRT, missing), build="onnxruntime-gpu 1.31.1")
    message = str(caught.value)
    assert message.startswith("provider 'tensorrt' is not available: onnxruntime-gpu 1.31.1 has its TensorRT "
                              "provider but ")
    assert message.endswith("install it with: pip install 'bertopt[tensorrt]' (or run in a TensorRT container), "
                            "or use --provider cuda")
    # an artifact compiled for TensorRT still runs on CUDA under auto
    assert choose_providers("auto", usable_providers(WITH_TRT, missing), "tensorrt") == WITH_CUDA


def test_tensorrt_libraries_problem_names_the_library_where_it_does_not_load():
    import ctypes

    try:
        ctypes.CDLL(TENSORRT_LIBRARY)
        loads = True
    except OSError:
        loads = False
    problem = tensorrt_libraries_problem()
    assert (problem is None) == (loads or _tensorrt_package_loads())
    if problem is not None and not _tensorrt_package_loads():
        assert problem == f"TensorRT ({TENSORRT_LIBRARY}) is not installed"


def _tensorrt_package_loads() -> bool:
    try:
        import tensorrt  # noqa: F401
    except Exception:  # absent, or its native part does not load
        return False
    return True


def test_both_builds_installed_is_named_with_the_fix():
    line = provider_unavailable("cuda", CPU_ONLY, "onnxruntime 1.31.1 and onnxruntime-gpu 1.31.1")
    assert "are both installed and share one module" in line
    assert "pip uninstall -y onnxruntime onnxruntime-gpu, then pip install 'bertopt[gpu]'" in line


def test_unknown_provider_is_refused_with_the_choices():
    with pytest.raises(UserError, match="unknown provider 'rocm'; choose one of auto, cpu, cuda, tensorrt"):
        choose_providers("rocm", CPU_ONLY)


@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has CUDA")
@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_this_machines_runtime_refuses_a_gpu_provider_in_one_line(tiny_onnx, provider):
    with pytest.raises(UserError) as caught:
        Predictor(tiny_onnx.path, provider=provider)
    message = str(caught.value)
    assert message.startswith(f"provider '{provider}' is not available in onnxruntime ")
    assert "(it has: " in message and "cpu)" in message and "\n" not in message


@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has CUDA")
def test_the_cli_refuses_a_gpu_provider_with_exit_2(tiny_onnx, cli):
    code, out, err = cli("validate", tiny_onnx.path, "--provider", "cuda")
    assert code == 2
    assert "provider 'cuda' is not available" in err and "pip install 'bertopt[gpu]'" in err


# -- options reaching the real ONNX Runtime session ------------------------------------------------------------
def test_a_cpu_session_gets_the_cpu_provider_and_the_session_options(tiny_onnx):
    session = open_session(tiny_onnx.model_handle(), provider="cpu", threads=1)
    real = session._session
    assert real.get_providers() == ["CPUExecutionProvider"]
    assert set(real.get_provider_options()) == {"CPUExecutionProvider"}
    assert real.get_session_options().intra_op_num_threads == 1
    assert session.provider == "CPUExecutionProvider" and session.device_id is None and not session.io_binding


@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has CUDA")
def test_an_artifact_compiled_for_tensorrt_runs_on_the_cpu_under_auto(tiny_onnx):
    handle = tiny_onnx.model_handle()
    compiled = dataclasses.replace(handle, runtime_options={"provider": "tensorrt", "trt_fp16": True})
    predictor = Predictor(compiled, provider="auto", threads=1)
    assert predictor.session._session.get_providers() == ["CPUExecutionProvider"]
    plain = Predictor(handle, provider="cpu", threads=1)
    texts = ["a GPU artifact on a CPU", "still the same numbers"]
    np.testing.assert_array_equal(predictor.encode(texts), plain.encode(texts))


def test_cuda_and_tensorrt_options(tiny_onnx):
    handle = tiny_onnx.model_handle()
    options = GpuOptions.from_runtime_options({"provider": "tensorrt", "trt_fp16": True, "trt_max_batch": 16,
                                               "graph_optimization_level": "all"}, device_id=1)
    assert options.provider_options("CUDAExecutionProvider", handle) == {"device_id": "1", "use_tf32": "0"}
    assert options.provider_options("CPUExecutionProvider", handle) == {}
    cache = Path("/tmp/cache")
    trt = options.provider_options("TensorrtExecutionProvider", handle, cache)
    names = [i["name"] for i in handle.inputs]
    seq = handle.model_info["max_seq_len"]
    assert trt == {
        "device_id": "1", "trt_fp16_enable": "1", "trt_layer_norm_fp32_fallback": "1",
        "trt_engine_cache_enable": "1", "trt_engine_cache_path": str(cache), "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": str(cache),
        "trt_profile_min_shapes": ",".join(f"{n}:1x1" for n in names),
        "trt_profile_opt_shapes": ",".join(f"{n}:16x{min(128, seq)}" for n in names),
        "trt_profile_max_shapes": ",".join(f"{n}:16x{seq}" for n in names),
    }
    no_cache = GpuOptions.from_runtime_options({"cuda_tf32": True})
    assert no_cache.provider_options("CUDAExecutionProvider", handle)["use_tf32"] == "1"
    assert no_cache.provider_options("TensorrtExecutionProvider", handle)["trt_engine_cache_enable"] == "0"
    assert no_cache.provider_options("TensorrtExecutionProvider", handle)["trt_fp16_enable"] == "0"


def test_bad_gpu_options_in_a_manifest_are_one_line():
    with pytest.raises(UserError, match="'trt_engine_cache' must be beside, cache, off or an absolute folder; "
                                        "got 'engines'"):
        GpuOptions.from_runtime_options({"trt_engine_cache": "engines"})
    with pytest.raises(UserError, match="'trt_max_batch' must be at least 1"):
        GpuOptions.from_runtime_options({"trt_max_batch": 0})


# -- the TensorRT engine cache: beside the artifact, never inside it, private -----------------------------------
def test_the_engine_cache_lives_beside_the_artifact_keyed_by_digest(tiny_onnx, tmp_path, monkeypatch):
    handle = tiny_onnx.model_handle()
    art = Path(tiny_onnx.path)
    beside = GpuOptions().engine_cache_dir(handle)
    assert beside.parent == art.parent / f"{art.name}.trt-cache"
    assert beside.name == handle.digest.replace(":", "-")[:32]
    assert art not in beside.parents  # the artifact's hashed files stay exactly what was validated
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path / "bertopt-cache"))
    cached = GpuOptions(trt_engine_cache="cache").engine_cache_dir(handle)
    assert cached == tmp_path / "bertopt-cache" / "tensorrt" / beside.name
    mine = GpuOptions(trt_engine_cache=str(tmp_path / "engines")).engine_cache_dir(handle)
    assert mine.parent == tmp_path / "engines"
    assert GpuOptions(trt_engine_cache="off").engine_cache_dir(handle) is None
    folder = prepare_engine_cache(mine)
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700


def test_an_engine_cache_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError) as caught:
        prepare_engine_cache(shared)
    assert str(caught.value) == (f"TensorRT engine cache {shared} is owned by another user or writable by others, "
                                 f"and an engine runs unverified; chmod go-w {shared} (as its owner) or use another "
                                 "folder")


def test_an_engine_cache_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="TensorRT engine cache .* cannot be created .*--trt-engine-cache"):
        prepare_engine_cache(blocker / "engines")


# -- I/O binding: the GPU path's arguments and run, here on CPU OrtValues --------------------------------------
def test_io_binding_on_cpu_ortvalues_gives_the_plain_run(tiny_onnx):
    predictor = Predictor(tiny_onnx.path, provider="cpu", threads=1)
    feeds, _ = predictor.feeds_for(predictor.tokenize(["bound outputs", "a second, longer text to pad the batch"]))
    real = predictor.session._session
    names = predictor.session.output_names
    inputs, outputs = bind_arguments(ort, feeds, names, "cpu", 0)
    assert set(inputs) == set(feeds) and outputs == [(n, "cpu", 0) for n in names]
    for name, value in inputs.items():
        assert value.device_name() == "cpu" and value.shape() == list(feeds[name].shape)
        np.testing.assert_array_equal(value.numpy(), feeds[name])
    bound = run_bound(real, ort, names, feeds, "cpu", 0)
    plain = real.run(names, feeds)
    assert len(bound) == len(plain) == len(names)
    for b, p in zip(bound, plain):
        np.testing.assert_array_equal(b, p)


# -- compile and the GPU recipes refuse where there is no GPU -------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has CUDA")
@pytest.mark.parametrize("provider, extra", [("cuda", "gpu"), ("tensorrt", "tensorrt")])
def test_compile_for_a_gpu_refuses_without_one(tiny_onnx, cli, tmp_path, provider, extra):
    out = tmp_path / "compiled"
    code, _, err = cli("compile", tiny_onnx.path, "--runtime", "onnxruntime", "--provider", provider, "--out", out)
    assert code == 2
    assert f"compile: compiling for a GPU needs one here: provider '{provider}' is not available" in err
    assert f"pip install 'bertopt[{extra}]'" in err and not out.exists()


def test_a_gpu_provider_is_onnx_runtimes_only(tiny_onnx, cli, tmp_path):
    code, _, err = cli("compile", tiny_onnx.path, "--runtime", "openvino", "--provider", "cuda",
                       "--out", tmp_path / "c")
    assert code == 2 and "--provider cuda is an ONNX Runtime provider; use --runtime onnxruntime" in err


def test_compile_for_the_cpu_records_no_gpu_options(tiny_onnx, cli, tmp_path):
    from bertopt.artifact import Artifact

    code, _, err = cli("compile", tiny_onnx.path, "--runtime", "onnxruntime", "--out", tmp_path / "c")
    assert code == 0, err
    assert Artifact.load(tmp_path / "c").manifest.get("runtime_options") == {}


@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has CUDA")
@pytest.mark.parametrize("recipe, provider", [("minilm-gpu-fp16", "cuda"), ("minilm-gpu-tensorrt", "tensorrt")])
def test_the_gpu_recipes_refuse_before_their_first_stage(cli, tmp_path, recipe, provider):
    out = tmp_path / "artifacts"
    code, _, err = cli("run", ROOT / "recipes" / f"{recipe}.yaml", "--out", out)
    assert code == 2
    assert "compile: compiling for a GPU needs one here" in err and f"provider '{provider}' is not available" in err
    assert not out.exists()  # refused at pre-flight: export, prune and quantize never ran


def test_the_recorded_gpu_options_are_what_compile_writes():
    from bertopt.params import resolve_config
    from bertopt.stages import compile as compile_stage

    config = resolve_config(compile_stage.PARAMS, {"runtime": "onnxruntime", "provider": "tensorrt",
                                                   "trt_fp16": True}, "compile")
    recorded = compile_stage.gpu_runtime_options(config)
    assert recorded == {"provider": "tensorrt", "cuda_tf32": False, "trt_fp16": True, "trt_engine_cache": "beside",
                        "trt_max_batch": 64}
    assert GpuOptions.from_runtime_options(recorded) == GpuOptions(trt_fp16=True)
    cuda = resolve_config(compile_stage.PARAMS, {"runtime": "onnxruntime", "provider": "cuda"}, "compile")
    assert compile_stage.gpu_runtime_options(cuda) == {"provider": "cuda", "cuda_tf32": False}


# -- on a GPU (skipped here) -----------------------------------------------------------------------------------
@pytest.mark.gpu  # skipped where no GPU is visible (tests/conftest.py)
def test_cuda_session_binds_outputs_and_matches_the_cpu(tiny_onnx):
    gpu = Predictor(tiny_onnx.path, provider="cuda")
    cpu = Predictor(tiny_onnx.path, provider="cpu")
    assert gpu.session.provider == "CUDAExecutionProvider" and gpu.session.io_binding
    options = gpu.session._session.get_provider_options()["CUDAExecutionProvider"]
    assert options["device_id"] == "0" and options["use_tf32"] == "0"
    texts = ["on the GPU", "through an IOBinding"]
    np.testing.assert_allclose(gpu.encode(texts), cpu.encode(texts), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif("TensorrtExecutionProvider" not in ort.get_available_providers()
                    or tensorrt_libraries_problem() is not None, reason="no TensorRT")
def test_tensorrt_session_caches_its_engine_beside_the_artifact(tiny_onnx):
    handle = tiny_onnx.model_handle()
    compiled = dataclasses.replace(handle, runtime_options={"provider": "tensorrt"})
    predictor = Predictor(compiled, provider="tensorrt")
    options = predictor.session._session.get_provider_options()["TensorrtExecutionProvider"]
    cache = GpuOptions().engine_cache_dir(handle)
    assert options["trt_engine_cache_path"] == str(cache)
    predictor.encode(["build the engine"])
    assert any(cache.iterdir())


def test_validate_takes_the_device_id_and_refuses_a_negative_one(tiny_onnx, cli):
    code, _, err = cli("validate", tiny_onnx.path, "--device-id", "-1")
    assert code == 2 and "'device_id' must be at least 0, got -1" in err


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_libraries_problem() is None, reason="TensorRT is installed here")
def test_tensorrt_without_tensorrt_installed_is_one_line_naming_the_extra(tiny_onnx):
    # onnxruntime-gpu without TensorRT itself: one line before any session (no fallback to CUDA behind the back)
    with pytest.raises(UserError) as caught:
        Predictor(tiny_onnx.path, provider="tensorrt")
    assert "pip install 'bertopt[tensorrt]'" in str(caught.value) and "\n" not in str(caught.value)
    assert Predictor(tiny_onnx.path, provider="cuda").session.provider == "CUDAExecutionProvider"


@pytest.mark.gpu
def test_the_device_id_reaches_the_cuda_provider(tiny_onnx):
    predictor = Predictor(tiny_onnx.path, provider="cuda", device_id=0)
    assert predictor.session._session.get_provider_options()["CUDAExecutionProvider"]["device_id"] == "0"
    assert predictor.session.device_id == 0


@pytest.mark.gpu
def test_compile_for_cuda_records_the_provider_and_serves_on_it(tiny_onnx, cli, tmp_path):
    from bertopt.artifact import Artifact

    code, _, err = cli("compile", tiny_onnx.path, "--runtime", "onnxruntime", "--provider", "cuda",
                       "--out", tmp_path / "cuda")
    assert code == 0, err
    compiled = Artifact.load(tmp_path / "cuda")
    assert compiled.manifest["runtime_options"] == {"provider": "cuda", "cuda_tf32": False}
    assert Predictor(compiled, provider="auto").session.provider == "CUDAExecutionProvider"


def test_commands_that_run_no_model_work_without_onnx_runtime(tiny_onnx, tmp_path):
    helped = _bertopt_without_onnxruntime("--help", cwd=tmp_path)
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stderr
    inspected = _bertopt_without_onnxruntime("inspect", tiny_onnx.path, cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert tiny_onnx.digest[:12] in inspected.stdout
