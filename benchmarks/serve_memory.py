"""What a running server's workers hold in memory, and how fast they answer, for long documents.

    .venv/bin/python benchmarks/serve_memory.py ART [ART ...] [--requests 5] [--batch-size 32] [--batches 3]

Each artifact gets a real server process (``bertopt serve``, HTTP on a free 127.0.0.1 port, one worker). Then,
over HTTP (``/embed``, ``truncate: true``): a few short requests; requests of one full batch (``--batch-size``
texts longer than the window, so each is cut to it: the shape an OpenVINO artifact with ``static_full_batch`` runs
on a copy compiled for it); requests of ``--batches`` full batches, which a worker runs side by side. After each
phase the resident memory (VmRSS) of the server and of its workers is read from /proc. Per phase: the first
request's time (a new shape: kernels picked, a copy compiled) and the median of the rest. Compare an artifact with
``--static-full-batch on`` and the same compile with ``off`` to see what the copy costs a server (docs/deploy.md).
Prints a table and writes JSON under benchmarks/results/ (``--json`` for another path). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import print_table, write_results  # noqa: E402
from peers import long_texts  # noqa: E402
from serve_load import stop_server, wait_until_healthy  # noqa: E402

from bertopt.harness import descendants, free_port  # noqa: E402


def rss_gb(pid: int) -> float:
    """Resident memory of one process in GB (0 where it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return kb / 2**20


def memory(proc) -> dict[str, float]:
    workers = sorted(descendants(proc.pid))
    return {"server_gb": rss_gb(proc.pid), "workers_gb": sum(rss_gb(p) for p in workers), "processes": len(workers)}


def measure(artifact: str, args, log_dir: Path, say) -> dict:
    import httpx

    from bertopt.artifact import Artifact
    from bertopt.runtime.predictor import sequence_length

    art = Artifact.load(artifact)
    window = sequence_length(art.model_info)
    one = long_texts(args.batch_size, 2 * window)  # more words than the window has tokens: every text is cut
    many = long_texts(args.batch_size * args.batches, 2 * window)
    port = free_port()
    err = log_dir / f"serve_memory.{Path(artifact).name}.err"
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", artifact, "--no-zmq", "--http-port",
                             str(port), "--num-worker", "1"], stdout=subprocess.DEVNULL, stderr=open(err, "w"),
                            stdin=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    phases = []
    try:
        with httpx.Client(timeout=300) as client:
            wait_until_healthy(client, url, proc, err, poll_s=0.05)
            phases.append({"phase": "ready", **memory(proc)})
            for name, texts in (("short", ["A short text to embed."] * 8), (f"1 x {args.batch_size}", one),
                                (f"{args.batches} x {args.batch_size}", many)):
                say(f"{Path(artifact).name}: {name}")
                seconds = []
                for _ in range(args.requests):
                    t = time.perf_counter()
                    reply = client.post(url + "/embed", json={"inputs": texts, "truncate": True})
                    seconds.append(time.perf_counter() - t)
                    if reply.status_code != 200:
                        raise SystemExit(f"{artifact}: {name} request answered {reply.status_code}: {reply.text}")
                phases.append({"phase": name, "texts": len(texts), "first_s": seconds[0],
                               "steady_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
                               **memory(proc)})
    finally:
        stop_server(proc)
    return {"artifact": artifact, "precision": art.precision, "runtime": art.runtime, "window": window,
            "runtime_options": art.manifest.get("runtime_options") or {}, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="Artifact folders, each served in turn.")
    parser.add_argument("--requests", type=int, default=5, help="Requests per phase (the first is timed alone).")
    parser.add_argument("--batch-size", type=int, default=32, help="Texts in a full batch (the server's Predictor "
                        "batch: 32).")
    parser.add_argument("--batches", type=int, default=3, help="Full batches in one request of the last phase.")
    parser.add_argument("--json", type=Path, default=None, help="JSON output (default: benchmarks/results/).")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.batch_size < 1 or args.batches < 1:
        raise SystemExit("--requests, --batch-size and --batches must be at least 1")
    from common import progress_printer

    from bertopt.machine import cpu_features

    say = progress_printer(not args.quiet)
    with tempfile.TemporaryDirectory(prefix="bertopt-serve-memory-") as logs:
        results = [measure(a, args, Path(logs), say) for a in args.artifacts]
    features = cpu_features()
    rows = []
    for res in results:
        options = ", ".join(f"{k}={v}" for k, v in res["runtime_options"].items()) or "-"
        for p in res["phases"]:
            rows.append([Path(res["artifact"]).name, options, p["phase"],
                         f"{p['first_s']:.2f}" if "first_s" in p else "-",
                         f"{p['steady_s']:.2f}" if "steady_s" in p else "-",
                         f"{p['workers_gb']:.3f}", f"{p['server_gb']:.3f}"])
    print_table("One server worker's memory (VmRSS) and request time, long texts cut to the window; ", features,
                ["artifact", "runtime options", "phase", ">first s", ">steady s", ">workers GB", ">server GB"], rows)
    write_results(args, "serve-memory", features, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
