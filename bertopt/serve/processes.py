"""How the server starts its worker and sink processes: isolated, with only the environment they need."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bertopt.errors import UserError

# what a worker or the sink takes from the server's environment (the rest, API keys included, stays behind):
# locale, home and temp folders, the loader and GPU selection, thread-pool and runtime settings
_CHILD_ENV_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
                    "LD_LIBRARY_PATH", "SYSTEMROOT", "XDG_CACHE_HOME", "TOKENIZERS_PARALLELISM",
                    "BERTOPT_CACHE_DIR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}  # not HF_TOKEN: a secret
_CHILD_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "TBB_",
                       "ORT_", "OV_", "OPENVINO_", "TF_", "TORCH_", "PYTORCH_")


def how_it_ended(returncode: int | None) -> str:
    """How a worker or the sink ended, in words: a signal by its name (it wrote nothing: "see the log" would point
    at nothing), an exit code with where its reason is."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = " (the kernel's out-of-memory killer sends it, or another process did)" if name == "SIGKILL" else ""
        return f"was killed by {name}{why}"
    return f"exited with code {returncode}; see the log above"


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker or the sink starts with: only what running a model needs."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in _CHILD_ENV_NAMES or k.startswith(_CHILD_ENV_PREFIXES)}


def start_child(module: str, config: dict, **popen_kw) -> subprocess.Popen:
    """Start ``python -I -m MODULE`` and hand it ``config`` as one JSON line on stdin (not on the command line,
    where every local user could read a CurveZMQ secret with ``ps``). ``-I``: isolated, so a ``zlib.py`` or
    ``json.py`` in the folder the server was started from, PYTHONPATH and user site-packages are never
    imported by a worker or the sink."""
    proc = subprocess.Popen([sys.executable, "-I", "-m", module], stdin=subprocess.PIPE, env=child_env(),
                            **popen_kw)
    data = json.dumps(config) + "\n"
    proc.stdin.write(data if popen_kw.get("text") else data.encode())
    proc.stdin.close()
    return proc


def check_children_import_this_bertopt() -> None:
    """Before any child starts: ``python -I`` must import the very bertopt package this server runs. Run from a
    source tree through PYTHONPATH (which ``-I`` ignores), a child would find none, or another installed version
    that would serve with other code than the server validated; either way one line says how to install it."""
    here = Path(__file__).resolve().parents[1]
    probe = subprocess.run([sys.executable, "-I", "-c", "import bertopt; print(bertopt.__file__)"],
                           capture_output=True, text=True, env=child_env(), timeout=120)
    found = Path(probe.stdout.strip()).resolve().parent if probe.returncode == 0 and probe.stdout.strip() else None
    if found == here:
        return
    where = f"finds bertopt at {found}" if found else "cannot import bertopt"
    raise UserError(f"bertopt serve starts its workers with '{sys.executable} -I' (isolated: PYTHONPATH and the "
                    f"current folder are not read), which {where}, not {here} that this server runs; install it "
                    f"into that Python: pip install -e {here.parent} (or pip install bertopt)")


def read_config(argv: list[str]) -> dict:
    """A child's configuration: the JSON line on stdin (or, run by hand, the first argument)."""
    return json.loads(argv[0] if argv else sys.stdin.readline())
