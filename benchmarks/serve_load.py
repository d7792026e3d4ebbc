"""Load on ``bertopt serve`` over loopback, side by side with the same artifact run in-process.

    .venv/bin/python benchmarks/serve_load.py [--workers 2] [--clients 4] [--requests 6] [--flood-size 10000]

Measures, in one run on the same cores:
  1. in-process throughput: one Predictor with all cores encoding the whole workload (the ceiling);
  2. saturation: C concurrent clients x R requests of mixed sizes (closed loop) -> throughput, p50/p99 per size,
     and the ratio to (1) (target >= 0.85);
  3. a 1-sentence client's latency on an idle server, then while another client floods it with
     ``--flood-size``-sentence requests (target: p99 under flood <= 3x idle p99).
The artifact is all-MiniLM-L6-v2 exported to ONNX (built under artifacts/bench/ if absent).
Prints a table and writes benchmarks/results/serve_load.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bertopt.harness import descendants, free_port

REPO = Path(__file__).resolve().parents[1]
SIZES = (1, 16, 64, 256, 512, 8)


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def ensure_artifact(path: Path):
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.registry import run_stage

    if is_artifact(path):
        return Artifact.load(path)
    print(f"building {path} (bertopt export builtin:minilm) ...", flush=True)
    return run_stage("export", "builtin:minilm", {}, path)


def corpus(n: int, offset: int = 0) -> list[str]:
    lines = [t for t in (REPO / "bertopt/data/corpus.txt").read_text().splitlines() if t.strip()]
    return [lines[(offset + i) % len(lines)] for i in range(n)]


def start_server(artifact: Path, workers: int, log_dir: Path):
    port, port_out = free_port(), free_port()
    out = open(log_dir / "serve_load.server.out", "w")
    err = open(log_dir / "serve_load.server.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(artifact), "--port", str(port),
                             "--port-out", str(port_out), "--num-worker", str(workers)],
                            stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 180
    while "ready on" not in (log_dir / "serve_load.server.out").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {(log_dir / 'serve_load.server.err').read_text()}")
        time.sleep(0.2)
    return proc, port, port_out


def wait_until_healthy(client, url: str, proc, err_file: Path, timeout_s: float = 300, poll_s: float = 0.01) -> None:
    """Poll ``url``/health with the httpx ``client`` until it answers 200; the server's stderr (``err_file``) in
    the error when the process exits or ``timeout_s`` passes first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {err_file.read_text()[-2000:]}")
        try:
            if client.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)


def stop_server(proc) -> None:
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)  # the flood is still queued; graceful stop would finish it first
    proc.wait(10)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def probe_latency(client, n: int, gap_s: float) -> list[float]:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        client.encode([f"Is this sentence number {i} fast?"])
        lat.append(time.perf_counter() - t0)
        time.sleep(gap_s)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=REPO / "artifacts/bench/minilm-onnx")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6, help="requests per client (sizes cycle 1,16,64,256,512,8)")
    ap.add_argument("--flood-size", type=int, default=10_000)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serve_load.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from bertopt.client import Client
    from bertopt.output_paths import write_json
    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads

    cores = default_threads()
    art = ensure_artifact(args.artifact)
    workload = [[corpus(SIZES[(c + r) % len(SIZES)], offset=97 * c + 31 * r) for r in range(args.requests)]
                for c in range(args.clients)]
    total_texts = sum(len(t) for client in workload for t in client)

    # 1. in-process ceiling, same artifact, all cores; measured before and after the server run (the mean is
    # the reference) because this machine is shared and its speed drifts
    predictor = Predictor(art, threads=cores)
    predictor.encode(corpus(64))
    all_texts = [t for client in workload for req in client for t in req]

    def inprocess() -> float:
        t0 = time.perf_counter()
        predictor.encode(all_texts)
        return total_texts / (time.perf_counter() - t0)

    inproc_runs = [inprocess()]
    print(f"in-process: {inproc_runs[0]:.1f} texts/s ({total_texts} texts, {cores} threads)", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, port, port_out = start_server(art.path, args.workers, args.out.parent)
    try:
        with Client("127.0.0.1", port, port_out, timeout=600) as warm:
            warm.encode(corpus(64))
            status = warm.status()
        # 3a. idle latency of a 1-sentence client
        with Client("127.0.0.1", port, port_out, timeout=60) as small:
            idle = probe_latency(small, args.probes, 0.05)

        # 2. saturation: C clients, each with all its R requests in flight at once (open loop)
        latencies: dict[int, list[float]] = {}
        lock = threading.Lock()

        def run_client(requests) -> None:
            with Client("127.0.0.1", port, port_out, timeout=600) as client:
                sent = []
                for texts in requests:
                    fut = client.encode_async(texts)
                    t = time.perf_counter()
                    fut.add_done_callback(lambda f, t=t, n=len(texts): sent.append((n, time.perf_counter() - t)))
                    sent.append(fut)
                for item in list(sent):
                    if not isinstance(item, tuple):
                        assert item.result().shape[1] == 384
                with lock:
                    for item in sent:
                        if isinstance(item, tuple):
                            latencies.setdefault(item[0], []).append(item[1])

        threads = [threading.Thread(target=run_client, args=(w,)) for w in workload]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        server_s = time.perf_counter() - t0
        server_tps = total_texts / server_s
        print(f"server: {total_texts} texts in {server_s:.2f} s = {server_tps:.1f} texts/s "
              f"({args.workers} workers x {status['threads_per_worker']} threads, {args.clients} clients)",
              flush=True)
        with Client("127.0.0.1", port, port_out, timeout=60) as c:
            status = c.status()

        # 3b. the same 1-sentence client while another client floods the server
        with Client("127.0.0.1", port, port_out, timeout=3600) as flooder, \
                Client("127.0.0.1", port, port_out, timeout=60) as small:
            floods = [flooder.encode_async(corpus(args.flood_size, offset=k)) for k in range(2)]
            deadline = time.monotonic() + 60
            while flooder.status()["mini_jobs_done"] <= status["mini_jobs_done"] + 1 \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            busy = flooder.status()
            flooded = probe_latency(small, args.probes, 0.05)
            flood_pending = sum(not f.done() for f in floods)
    finally:
        stop_server(proc)
    inproc_runs.append(inprocess())
    inproc_tps = float(np.mean(inproc_runs))
    print(f"in-process again: {inproc_runs[1]:.1f} texts/s", flush=True)

    rows = []
    for size in sorted(latencies):
        lat = latencies[size]
        rows.append({"size": size, "requests": len(lat), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)})
    result = {
        "artifact": str(art.path), "cores": cores, "workers": args.workers, "clients": args.clients,
        "requests_per_client": args.requests, "total_texts": total_texts,
        "inprocess_texts_per_s": inproc_tps, "inprocess_runs": inproc_runs, "server_texts_per_s": server_tps,
        "throughput_ratio": server_tps / inproc_tps, "throughput_target": 0.85,
        "latency_by_size": rows,
        "small_idle_p50_ms": pct(idle, 50), "small_idle_p99_ms": pct(idle, 99),
        "small_flood_p50_ms": pct(flooded, 50), "small_flood_p99_ms": pct(flooded, 99),
        "flood_size": args.flood_size, "flood_requests_pending_after_probes": flood_pending,
        "queue_at_flood_start": busy["queue_length"],
        "flood_p99_over_idle_p99": pct(flooded, 99) / pct(idle, 99), "flood_target": 3.0,
    }
    print()
    print(f"{'request size':>12} {'n':>4} {'p50 ms':>9} {'p99 ms':>9}")
    for r in rows:
        print(f"{r['size']:>12} {r['requests']:>4} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f}")
    print()
    print(f"throughput  in-process {inproc_tps:8.1f} texts/s | server {server_tps:8.1f} texts/s | "
          f"ratio {result['throughput_ratio']:.2f} (target >= 0.85)")
    print(f"1-sentence  idle p50 {result['small_idle_p50_ms']:.1f} ms p99 {result['small_idle_p99_ms']:.1f} ms | "
          f"under {args.flood_size}-sentence flood p50 {result['small_flood_p50_ms']:.1f} ms "
          f"p99 {result['small_flood_p99_ms']:.1f} ms | ratio {result['flood_p99_over_idle_p99']:.2f} "
          f"(target <= 3; flood requests still pending at the end: {flood_pending}/2)")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
