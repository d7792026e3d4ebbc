"""Shared fixtures: tiny random BERTs built by the tests themselves, and the real MiniLM.

Fixtures that build models are session-scoped: a tiny BERT exports in a couple of seconds, MiniLM in ~10.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bertopt.tiny_models import TINY_VOCAB, build_tiny_hf_bert  # noqa: E402,F401  (re-exported)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny sentence-transformers-style BERT (mean pooling + normalise)."""
    return build_tiny_hf_bert(tmp_path_factory.mktemp("tiny-hf") / "model", sentence_transformers=True)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_hf, tmp_path_factory):
    """The tiny BERT exported to an ONNX artifact."""
    from bertopt.registry import run_stage

    return run_stage("export", tiny_hf, {}, tmp_path_factory.mktemp("tiny-onnx") / "art")


@pytest.fixture(scope="session")
def tiny_optimized(tiny_onnx, tmp_path_factory):
    """The tiny BERT after 'optimize' (ONNX Runtime's BERT fusions: Attention, SkipLayerNormalization, ...)."""
    from bertopt.registry import run_stage

    return run_stage("optimize", tiny_onnx, {}, tmp_path_factory.mktemp("tiny-optimized") / "art")


@pytest.fixture(scope="session")
def minilm_onnx(tmp_path_factory):
    """The real all-MiniLM-L6-v2 exported to ONNX (shared by the slow tests)."""
    from bertopt.registry import run_stage

    return run_stage("export", "builtin:minilm", {}, tmp_path_factory.mktemp("minilm") / "onnx")


@pytest.fixture(scope="session")
def minilm_optimized(minilm_onnx, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("optimize", minilm_onnx, {}, tmp_path_factory.mktemp("minilm") / "optimized")


@pytest.fixture(scope="session")
def minilm_int8(minilm_optimized, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("quantize", minilm_optimized, {"mode": "int8-dynamic"}, tmp_path_factory.mktemp("minilm") / "int8")


@pytest.fixture(scope="module")
def private_openvino_cache(tmp_path_factory):
    """OpenVINO's compiled-model cache in a temp folder, not the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("ov-cache")
    mp.setenv("BERTOPT_CACHE_DIR", str(cache))
    yield cache
    mp.undo()


def run_cli(args: list[str], capsys=None) -> tuple[int, str, str]:
    """Run the real CLI entry point in-process; returns (exit code, stdout, stderr)."""
    from bertopt.cli import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = ("", "")
    if capsys is not None:
        captured = capsys.readouterr()
        out, err = captured.out, captured.err
    return code, out, err


@pytest.fixture
def cli(capsys):
    return lambda *args: run_cli(list(args), capsys)



@pytest.fixture(scope="session")
def task_artifact(tmp_path_factory):
    """``task_artifact(task, family="bert") -> (hf folder, artifact)``: a tiny random task model (classification,
    multi-label, token-classification, rerank, sparse-embedding) of a family with its own tokenizer kind
    (``bertopt.tiny_models.build_tiny_family_model``), exported by ``bertopt export``; built once a session."""
    from bertopt.registry import run_stage
    from bertopt.tiny_models import build_tiny_family_model

    built: dict = {}

    def get(task: str, family: str = "bert"):
        if (task, family) not in built:
            root = tmp_path_factory.mktemp(f"{family}-{task}")
            head = "classification" if task == "multi-label" else task
            hf = build_tiny_family_model(root / "hf", family, head, multi_label=task == "multi-label")
            built[task, family] = (hf, run_stage("export", hf, {}, root / "art"))
        return built[task, family]

    return get


# The files that take minutes, longest first (serial run on 2 cores, --durations, 2026-11-27). Under pytest-xdist
# (make test: two workers, whole files) they are handed out before the rest, so the workers end together instead
# of one finishing a long file alone; the second starts the default tune run the served-equals-validated files wait
# for, early.
LONG_FILES = (
    "tests/stages/test_stages_quantize_nncf_real.py",
    "tests/kafka/test_kafka_bridge_default_artifact.py",
    "tests/test_tune_real_models.py",
    "tests/test_tune_families.py",
    "tests/stages/test_stages_real_mpnet.py",
    "tests/kafka/test_kafka_spark_backend_tasks.py",
    "tests/test_benchmark_scripts.py",
    "tests/kafka/test_kafka_spark_backend.py",
    "tests/test_cli_readme.py",
    "tests/stages/test_stages_quantize_nncf.py",
    "tests/tf/test_tf_minilm.py",
    "tests/stages/test_stages_minilm.py",
    "tests/serve/test_serve_fleet_models.py",
)


def pytest_collection_modifyitems(config, items):
    from bertopt.spark.placement import visible_gpu_count  # onnxruntime-gpu's CUDA provider and a visible device

    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and visible_gpu_count() == 0:
        skip = pytest.mark.skip(reason="no GPU visible to onnxruntime-gpu on this machine")
        for item in gpu_tests:
            item.add_marker(skip)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a serial run keeps pytest's order
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # stable: the rest as collected


_RUN_CACHE: list[str] = []


def pytest_configure(config):
    # OpenVINO's compiled blobs (and TensorRT's engines) in a folder of this test process, handed down to the
    # servers, Spark workers and CLIs it starts: the suite compiles hundreds of models, which kept the user's
    # ~/.cache/bertopt at its 2 GiB bound, every process trimming it while others loaded from it
    if "BERTOPT_CACHE_DIR" not in os.environ:
        import tempfile

        _RUN_CACHE.append(tempfile.mkdtemp(prefix="bertopt-test-cache-"))
        os.environ["BERTOPT_CACHE_DIR"] = _RUN_CACHE[0]
    # each xdist worker gets its share of the cores as bertopt's default thread count (BERTOPT_THREADS, inherited
    # by the servers, Spark workers and CLIs it starts): two workers each running 2-thread sessions on 2 cores
    # wait on each other's threads (two concurrent MiniLM tunes: 94 s at 2 threads each, 75 s at 1). Tests that
    # need more threads say so (--threads / threads=)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1 and "BERTOPT_THREADS" not in os.environ:
        os.environ["BERTOPT_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_unconfigure(config):
    import shutil

    for folder in _RUN_CACHE:
        shutil.rmtree(folder, ignore_errors=True)  # a temp folder: what a straggling child still holds goes with /tmp


def pytest_addoption(parser):
    parser.addoption("--default-recipe", default=None,
                     help="Recipe the default_artifact fixture builds instead of bertopt's default (e.g. "
                     "minilm-fastest-cpu: the served-equals-validated tests on a bf16 artifact).")


class RecipeRun(NamedTuple):
    """One ``bertopt run`` in a process of its own: exit code, what it printed, and where it wrote. (No
    dataclass: some test modules load this conftest by path, outside sys.modules, where a dataclass cannot
    resolve its annotations.)"""

    code: int
    stdout: str
    stderr: str
    out: Path


@pytest.fixture(scope="session")
def default_recipe_run(tmp_path_factory) -> RecipeRun:
    """``bertopt run recipes/<default>.yaml`` (the main job of ``make demo``), run once per test run by the real
    CLI in its own process (pytest-xdist workers share it through a file lock): the recipe test reads what it
    printed and wrote, the served-equals-validated tests serve the artifact it made (one tune of MiniLM instead of
    one per test file or worker)."""
    import json
    import subprocess
    import sys

    from filelock import FileLock

    from bertopt.recipes import DEFAULT_RECIPE

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each xdist worker's own: the workers share one tune
    record = root / "default-run.json"
    with FileLock(str(root / "default-run.lock")):
        if not record.exists():
            out = root / "default-run"
            out.mkdir()
            proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "run", f"recipes/{DEFAULT_RECIPE}.yaml",
                                   "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
            record.write_text(json.dumps({"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                                          "out": str(out)}))
    run = json.loads(record.read_text())
    return RecipeRun(run["code"], run["stdout"], run["stderr"], Path(run["out"]))


@pytest.fixture(scope="session")
def default_artifact(tmp_path_factory, pytestconfig, request):
    """The final artifact of the default recipe (what ``make demo`` builds), validated by the recipe's gate (the
    latency grid left out; a tune recipe's own gate), so its manifest records the batch deviation that served
    outputs are held to."""
    from bertopt.artifact import Artifact
    from bertopt.recipes import DEFAULT_RECIPE, load_recipe, run_recipe
    from bertopt.validate.gate import validate_artifact

    name = pytestconfig.getoption("--default-recipe") or DEFAULT_RECIPE
    recipe = load_recipe(REPO_ROOT / "recipes" / f"{name}.yaml")
    if name == DEFAULT_RECIPE:
        run = request.getfixturevalue("default_recipe_run")
        assert run.code == 0, run.stderr[-3000:] + run.stdout[-3000:]
        final = Artifact.load(run.out / name)
    else:
        final = run_recipe(recipe, out=tmp_path_factory.mktemp("default"), compare=False, gate=False).final
    if recipe.tune is None:  # a tune recipe gates its winner itself and records the bound it held it to
        validate_artifact(final, {**(recipe.validate or {}), "latency": False},
                          report_dir=final.path.parent / "validation")
    return final

