"""The machine a run is on: its CPU's vector features (which kernels the runtimes use) and the record of it that
benchmarks, validation reports and tune write down."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

_VECTOR_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")


# oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, older name DNNL_MAX_CPU_ISA): OpenVINO's CPU plugin and PyTorch's oneDNN
# kernels use no instruction set above it, so a capped run has the kernels of a CPU without the features above the
# cap (AMX off on a Sapphire Rapids: the kernels, not the cores, of an AVX-512 VNNI + BF16 CPU such as Zen 5).
# Each cap: the features it keeps. ONNX Runtime's own kernels (MLAS) ignore the cap.
_AVX2 = {"avx2"}
_AVX512_VNNI = _AVX2 | {"avx_vnni", "avx512f", "avx512_vnni"}
_ISA_CAPS: dict[str, set[str] | None] = {
    "SSE41": set(), "AVX": set(), "AVX2": _AVX2, "AVX2_VNNI": _AVX2 | {"avx_vnni"},
    "AVX2_VNNI_2": _AVX2 | {"avx_vnni"}, "AVX512_CORE": _AVX2 | {"avx_vnni", "avx512f"},
    "AVX512_CORE_VNNI": _AVX512_VNNI, "AVX512_CORE_BF16": _AVX512_VNNI | {"avx512_bf16"},
    "AVX512_CORE_FP16": _AVX512_VNNI | {"avx512_bf16"}, "AVX10_1_512": _AVX512_VNNI | {"avx512_bf16"},
    "AVX512_CORE_AMX": None, "AVX512_CORE_AMX_FP16": None, "AVX10_1_512_AMX": None,
    "AVX10_1_512_AMX_FP16": None, "AVX10_2_512": None, "AVX10_2_512_AMX_2": None, "ALL": None, "DEFAULT": None,
}


def isa_cap() -> str | None:
    """The oneDNN ISA cap this process runs under (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``), upper-cased, or
    None. A value oneDNN does not know is returned as it is (oneDNN ignores it; so does :func:`cpu_features`)."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return value.strip().upper() if value and value.strip() else None


def cpu_features(flags: set[str] | None = None, cap: str | None = None) -> set[str]:
    """The x86 vector features that decide which kernels the runtimes use: this CPU's (``flags``: the flags
    /proc/cpuinfo lists; empty off Linux/x86) less those above the oneDNN ISA cap (``cap``, default
    :func:`isa_cap`), since OpenVINO and PyTorch then use no kernel that needs them."""
    if flags is None:
        flags = _cpuinfo_flags()
    features = {f for f in flags if f in _VECTOR_FEATURES}
    kept = _ISA_CAPS.get(cap if cap is not None else (isa_cap() or "ALL"))
    return features if kept is None else features & kept


def _cpuinfo_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    return _flags_of(cpuinfo.read_text(errors="replace")) if cpuinfo.exists() else set()


def _flags_of(cpuinfo_text: str) -> set[str]:
    """The first CPU's ``flags`` line of /proc/cpuinfo's text."""
    for line in cpuinfo_text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
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
            # vendor, family and model number name the core generation where "model name" does not ("AMD EPYC")
            if line.startswith("vendor_id") and "cpu_vendor" not in info:
                info["cpu_vendor"] = line.split(":", 1)[1].strip()
            for key, field in (("cpu family", "cpu_family"), ("model\t", "cpu_model_number")):
                if line.startswith(key) and field not in info and line.split(":", 1)[1].strip().isdigit():
                    info[field] = int(line.split(":", 1)[1])
        flags = _flags_of(text)
        info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni")))
        info["cpu_features"] = sorted(cpu_features(flags))
    cap = isa_cap()
    if cap:
        # the features above are the ones the kernels use under this cap; "flags" are the CPU's own
        info["isa_cap"] = cap
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info
