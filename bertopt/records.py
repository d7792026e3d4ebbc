"""What bertopt writes down about a run: the machine it ran on (benchmarks, validation reports) and JSON files,
written atomically (manifests, results)."""

from __future__ import annotations

import json
import os
import platform
import uuid
from pathlib import Path
from typing import Any


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
        info["cpu_features"] = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                               "amx_bf16", "amx_int8", "avx_vnni"))
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info


def _plain(value: Any) -> Any:
    """A value JSON does not know: numpy scalars and arrays as numbers and lists, anything else as its string."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written to a temp file and renamed into place (a reader never sees
    half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_plain) + "\n", encoding="utf-8")
    os.replace(tmp, path)
