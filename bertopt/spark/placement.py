"""Where a Spark task runs its model: which GPU, or how many CPU threads.

With GPUs, the task's partition index modulo the number of visible GPUs picks the device, so the partitions
of one executor spread over its GPUs instead of all landing on GPU 0 (when Spark's resource scheduling
assigned the task a GPU, that one is used). Without GPUs, every concurrent task on an executor gets an
equal share of its cores (at least one thread), so N tasks x ONNX Runtime's default of "all cores" threads
do not oversubscribe the machine.

Pure functions, no Spark import: the arithmetic is unit-tested, the worker side calls them per task.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

_GPU_COUNT: int | None = None  # per process: nvidia-smi is asked once


@dataclass(frozen=True)
class Placement:
    provider: str  # "cuda" or "cpu" (a bertopt.runtime provider name)
    device_id: int | None  # the GPU, for provider "cuda"
    threads: int  # ONNX Runtime intra-op threads for this task

    def describe(self) -> str:
        if self.provider == "cuda":
            return f"cuda:{self.device_id} ({self.threads} CPU threads)"
        return f"cpu ({self.threads} threads)"


def choose_placement(partition_id: int, n_gpus: int, cores: int, concurrent_tasks: int,
                     assigned_gpus: Sequence[str] | None = None, threads: int | None = None) -> Placement:
    """The device and thread count for one task.

    ``partition_id``: the task's partition index; ``n_gpus``: GPUs visible to the worker; ``cores``: CPU
    cores the worker may use; ``concurrent_tasks``: tasks an executor runs at once; ``assigned_gpus``: the
    GPU addresses Spark's resource scheduler gave the task (if any); ``threads``: an explicit override.
    """
    if partition_id < 0:
        raise ValueError(f"partition index must be >= 0, got {partition_id}")
    share = max(1, cores // max(1, concurrent_tasks))
    n_threads = max(1, int(threads)) if threads else share
    if assigned_gpus:
        return Placement("cuda", int(assigned_gpus[0]), n_threads)
    if n_gpus > 0:
        return Placement("cuda", partition_id % n_gpus, n_threads)
    return Placement("cpu", None, n_threads)


def concurrent_tasks_for(master: str, executor_cores: str | None = None, task_cpus: str | None = None,
                         cpu_count: int | None = None) -> int:
    """How many tasks one executor (or the local-mode JVM) runs at once, from the Spark configuration."""
    cpu_count = cpu_count or os.cpu_count() or 1
    per_task = max(1, int(task_cpus or 1))
    local = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", (master or "").strip())
    if local:
        n = local.group(1)
        slots = 1 if n is None else (cpu_count if n == "*" else int(n))
    elif (master or "").startswith("local-cluster"):
        found = re.fullmatch(r"local-cluster\[\s*\d+\s*,\s*(\d+)\s*,\s*\d+\s*\]", master.strip())
        slots = int(found.group(1)) if found else 1
    else:
        slots = int(executor_cores) if executor_cores else 1
    return max(1, slots // per_task)


def visible_gpu_count() -> int:
    """GPUs this process may use with ONNX Runtime: 0 unless onnxruntime has CUDA *and* a GPU is present.

    onnxruntime-gpu lists CUDAExecutionProvider even on machines without a GPU, so the provider list alone
    is not enough: CUDA_VISIBLE_DEVICES (when set) or ``nvidia-smi -L`` counts the devices.
    """
    global _GPU_COUNT
    if _GPU_COUNT is not None:
        return _GPU_COUNT
    count = 0
    from bertopt.errors import MissingDependency, require_onnxruntime

    try:
        has_cuda = "CUDAExecutionProvider" in require_onnxruntime().get_available_providers()
    except MissingDependency:  # no runtime at all: no GPU either
        has_cuda = False
    if has_cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
        elif shutil.which("nvidia-smi"):
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            count = sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
    _GPU_COUNT = count
    return count
