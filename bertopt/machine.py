"""The machine a run is on: its CPU's vector features (which kernels the runtimes use) and the record of it that
benchmarks, validation reports and tune write down."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

_VECTOR_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")


def cpu_features() -> set[str]:
    """The x86 vector features of this CPU that decide which kernels the runtimes use (empty off Linux/x86)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return {f for f in line.split(":", 1)[1].split() if f in _VECTOR_FEATURES}
    return set()


def has_native_bf16(features: set[str] | None = None) -> bool:
    """AVX-512 BF16 or AMX: bf16 computed natively. Elsewhere OpenVINO runs a bf16 request as f32 and PyTorch
    emulates bf16 (slower than its fp32)."""
    return bool((cpu_features() if features is None else set(features)) & {"avx512_bf16", "amx_bf16"})


def has_int8_dot_product(features: set[str] | None = None) -> bool:
    """VNNI or AMX: an int8 dot product without 16-bit intermediates. Without it ONNX Runtime's u8s8 int8 kernels
    saturate (less faithful int8) and OpenVINO keeps activations float (no dynamic quantisation)."""
    return bool((cpu_features() if features is None else set(features)) & {"avx512_vnni", "avx_vnni", "amx_int8"})


def machine_info() -> dict[str, Any]:
    """The machine a measurement ran on: platform, cores (all and usable), CPU model, clock and vector features,
    memory and load."""
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "processor": platform.processor(), "python": platform.python_version(),
                            "cpus": os.cpu_count(), "cpu_count": os.cpu_count()}
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["usable_cores"] = os.cpu_count()
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        info["load_average"] = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        text = cpuinfo.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("model name") and "cpu_model" not in info:
                info["cpu_model"] = line.split(":", 1)[1].strip()
            if line.startswith("cpu MHz") and "cpu_mhz" not in info:
                info["cpu_mhz"] = float(line.split(":", 1)[1])
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        info["flags"] = sorted(f for f in set(flags) if f.startswith(("avx512", "amx", "avx_vnni")))
        info["cpu_features"] = sorted(cpu_features())
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info
