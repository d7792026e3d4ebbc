"""``bertopt serve`` on an NVIDIA GPU: a real server process whose workers run the artifact on CUDA, asked over
ZeroMQ and HTTP (TEI and OpenAI routes). Marked ``gpu``: skipped where onnxruntime-gpu sees no GPU
(tests/conftest.py); run on a GPU machine with ``pytest -m gpu`` (docs/gpu.md)."""

from __future__ import annotations

import subprocess

import httpx
import numpy as np
import pytest

from bertopt.harness import descendants

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TEXTS = ["served on the GPU", "a second, somewhat longer sentence for a second length bucket of the batch",
         "and a third"]


def _gpu_pids() -> set[int]:
    """Processes that hold a CUDA context, as the driver lists them."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


@pytest.fixture(scope="module")
def cuda_artifact(tiny_onnx, tmp_path_factory):
    """The tiny BERT compiled for CUDA (its manifest records the provider, so serve's ``auto`` picks it)."""
    from bertopt.registry import run_stage

    return run_stage("compile", tiny_onnx, {"runtime": "onnxruntime", "provider": "cuda"},
                     tmp_path_factory.mktemp("cuda") / "art")


@pytest.mark.parametrize("flags", [(), ("--device-map", "0")], ids=["auto", "device-map"])
def test_serve_runs_its_workers_on_the_gpu_and_answers_like_the_runtime(cuda_artifact, start_server, flags):
    from bertopt.runtime import Predictor

    server = start_server(cuda_artifact.path, *flags, http=True, num_worker=2)
    on_gpu = _gpu_pids() & descendants(server.proc.pid)
    assert len(on_gpu) == 2, f"workers holding a CUDA context: {sorted(on_gpu)}\n{server.log()}"

    gpu = Predictor(cuda_artifact, provider="cuda").encode(TEXTS)
    cpu = Predictor(cuda_artifact, provider="cpu").encode(TEXTS)
    with server.client() as client:
        by_zmq = client.encode(TEXTS)
    tei = httpx.post(server.url + "/embed", json={"inputs": TEXTS, "normalize": False}, timeout=60)
    assert tei.status_code == 200, tei.text
    openai = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "model": "m"}, timeout=60)
    assert openai.status_code == 200, openai.text
    by_openai = np.array([row["embedding"] for row in openai.json()["data"]], dtype=np.float32)
    # served = the in-process CUDA session up to batch composition; the GPU = the CPU within fp32 GEMM order
    np.testing.assert_allclose(by_zmq, gpu, atol=1e-5)
    np.testing.assert_allclose(np.array(tei.json(), dtype=np.float32), gpu, atol=1e-5)
    np.testing.assert_allclose(by_openai, gpu, atol=1e-5)
    np.testing.assert_allclose(gpu, cpu, atol=1e-4)
    assert server.terminate() == 0
