"""HTTP load on ``bertopt serve --http-port``, side by side with the same artifact run in-process.

    .venv/bin/python benchmarks/http_load.py [--artifact DIR] [--workers 2] [--clients 4] [--requests 6]

Measures, in one run on the same cores (ratios, because the machine is shared):
  1. in-process throughput: one Predictor with all cores encoding the whole workload (the ceiling; measured
     before and after the server run, the mean is the reference);
  2. saturation: C concurrent HTTP clients x R requests of mixed sizes (1-512 texts), all in flight at once,
     on OpenAI's POST /v1/embeddings with base64 vectors (what the official client asks for) -> throughput
     and its ratio to (1) (target >= 0.85);
  3. overload: ``--overload`` concurrent 64-text requests against --max-concurrent-requests
     ``--max-concurrent``: how many get 429, and whether any admitted request failed or timed out;
  4. a 1-sentence client's latency (POST /embed) on the idle server (measured first), then while other
     clients keep ``--flood-size`` sentences in flight in requests of ``--flood-request`` texts (target: p99
     under the flood <= 3x idle p99); the server is then killed rather than left to finish the flood.
The default artifact is all-MiniLM-L6-v2 exported to ONNX (built under artifacts/bench/ if absent).
Prints a table and writes benchmarks/results/http_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_load import SIZES, corpus, ensure_artifact, pct, stop_server  # noqa: E402

from bertopt.harness import free_port  # noqa: E402


def start_server(artifact: Path, workers: int, max_concurrent: int, log_dir: Path):
    port = free_port()
    out = log_dir / "http_load.server.out"
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(artifact), "--no-zmq",
                             "--http-port", str(port), "--num-worker", str(workers),
                             "--max-concurrent-requests", str(max_concurrent), "--request-timeout", "300"],
                            stdout=open(out, "w"), stderr=open(log_dir / "http_load.server.err", "w"),
                            stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 180
    while "ready on" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {(log_dir / 'http_load.server.err').read_text()}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def probe_latency(client, url: str, n: int, gap_s: float) -> list[float]:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.post(url + "/embed", json={"inputs": f"Is this sentence number {i} fast?"})
        lat.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        time.sleep(gap_s)
    return lat


def embed_b64(client, url: str, texts: list[str]) -> np.ndarray:
    import base64

    r = client.post(url + "/v1/embeddings", json={"input": texts, "model": "bench", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])


def saturation(url: str, workload: list[list[list[str]]]) -> tuple[float, dict[int, list[float]]]:
    import httpx

    latencies: dict[int, list[float]] = {}
    lock = threading.Lock()

    def one(texts):
        with httpx.Client(timeout=600) as client:
            t0 = time.perf_counter()
            out = embed_b64(client, url, texts)
            dt = time.perf_counter() - t0
        assert out.shape == (len(texts), 384)
        with lock:
            latencies.setdefault(len(texts), []).append(dt)

    requests = [req for client in workload for req in client]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(one, requests))
    return time.perf_counter() - t0, latencies


def flood_probe(url: str, flood_size: int, flood_request: int, probes: int) -> tuple[list[float], int]:
    """The probe's latencies while flooders keep ``flood_size`` sentences in flight. The flooders are left
    running (daemon threads): the server is killed next, which ends them, instead of waiting for the queue."""
    import httpx

    stop = threading.Event()
    answered = [0]

    def flooder(k: int):
        try:
            with httpx.Client(timeout=600) as client:
                while not stop.is_set():
                    embed_b64(client, url, corpus(flood_request, offset=k * 7919 + answered[0]))
                    answered[0] += flood_request
        except httpx.TransportError:  # the server was stopped under it
            return

    for k in range(max(1, flood_size // flood_request)):
        threading.Thread(target=flooder, args=(k,), daemon=True).start()
    time.sleep(2.0)  # let the flood fill the queue
    with httpx.Client(timeout=60) as small:
        flooded = probe_latency(small, url, probes, 0.05)
    stop.set()
    return flooded, answered[0]


def overload(url: str, n: int) -> dict:
    import httpx

    texts = corpus(64, offset=11)

    def one(_):
        with httpx.Client(timeout=600) as client:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/embeddings", json={"input": texts, "model": "bench",
                                                         "encoding_format": "base64"})
            return r.status_code, time.perf_counter() - t0, r.headers.get("retry-after")

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    codes = [c for c, _, _ in results]
    ok = [dt for c, dt, _ in results if c == 200]
    rejected = [dt for c, dt, _ in results if c == 429]
    return {"requests": n, "ok": len(ok), "rejected_429": len(rejected),
            "other": sorted({c for c in codes if c not in (200, 429)}),
            "retry_after": sorted({ra for c, _, ra in results if c == 429}),
            "admitted_max_s": max(ok) if ok else None, "rejected_p99_ms": pct(rejected, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=REPO / "artifacts/bench/minilm-onnx")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6, help="requests per client (sizes cycle 1,16,64,256,512,8)")
    ap.add_argument("--flood-size", type=int, default=10_000, help="sentences kept in flight by the flood")
    ap.add_argument("--flood-request", type=int, default=2000, help="texts per flood request")
    ap.add_argument("--probes", type=int, default=150)
    ap.add_argument("--max-concurrent", type=int, default=32)
    ap.add_argument("--overload", type=int, default=96)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/http_load.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import httpx

    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads

    cores = default_threads()
    art = ensure_artifact(args.artifact)
    workload = [[corpus(SIZES[(c + r) % len(SIZES)], offset=97 * c + 31 * r) for r in range(args.requests)]
                for c in range(args.clients)]
    all_texts = [t for client in workload for req in client for t in req]
    predictor = Predictor(art, threads=cores)
    predictor.encode(corpus(64))

    def inprocess() -> float:
        t0 = time.perf_counter()
        predictor.encode(all_texts)
        return len(all_texts) / (time.perf_counter() - t0)

    inproc_runs = [inprocess()]
    print(f"in-process: {inproc_runs[0]:.1f} texts/s ({len(all_texts)} texts, {cores} threads)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(art.path, args.workers, args.max_concurrent, args.out.parent)
    try:
        with httpx.Client(timeout=600) as warm:
            got = embed_b64(warm, url, corpus(64))
            np.testing.assert_allclose(got, predictor.encode(corpus(64)), atol=1e-4)  # same runtime, same values
            idle = probe_latency(warm, url, args.probes, 0.05)
        server_s, latencies = saturation(url, workload)
        server_tps = len(all_texts) / server_s
        print(f"server: {len(all_texts)} texts in {server_s:.2f} s = {server_tps:.1f} texts/s", flush=True)
        over = overload(url, args.overload)
        print(f"overload: {over}", flush=True)
        info = httpx.get(url + "/info").json()
        flooded, flood_texts = flood_probe(url, args.flood_size, args.flood_request, args.probes)
        print(f"flood: {flood_texts} texts answered while probing", flush=True)
    finally:
        stop_server(proc)
    inproc_runs.append(inprocess())
    inproc_tps = float(np.mean(inproc_runs))

    rows = [{"size": s, "requests": len(v), "p50_ms": pct(v, 50), "p99_ms": pct(v, 99)}
            for s, v in sorted(latencies.items())]
    result = {
        "artifact": str(art.path), "runtime": info["runtime"], "cores": cores, "workers": args.workers,
        "clients": args.clients, "requests_per_client": args.requests, "total_texts": len(all_texts),
        "inprocess_texts_per_s": inproc_tps, "inprocess_runs": inproc_runs, "server_texts_per_s": server_tps,
        "throughput_ratio": server_tps / inproc_tps, "throughput_target": 0.85, "latency_by_size": rows,
        "small_idle_p50_ms": pct(idle, 50), "small_idle_p99_ms": pct(idle, 99),
        "small_flood_p50_ms": pct(flooded, 50), "small_flood_p99_ms": pct(flooded, 99),
        "flood_size": args.flood_size, "flood_request": args.flood_request, "flood_texts_answered": flood_texts,
        "flood_p99_over_idle_p99": pct(flooded, 99) / pct(idle, 99), "flood_target": 3.0,
        "max_concurrent_requests": args.max_concurrent, "overload": over,
    }
    print()
    print(f"{'request size':>12} {'n':>4} {'p50 ms':>9} {'p99 ms':>9}")
    for r in rows:
        print(f"{r['size']:>12} {r['requests']:>4} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f}")
    print()
    print(f"throughput  in-process {inproc_tps:8.1f} texts/s | HTTP server {server_tps:8.1f} texts/s | "
          f"ratio {result['throughput_ratio']:.2f} (target >= 0.85)")
    print(f"1-sentence  idle p50 {result['small_idle_p50_ms']:.1f} ms p99 {result['small_idle_p99_ms']:.1f} ms | "
          f"under a {args.flood_size}-sentence flood p50 {result['small_flood_p50_ms']:.1f} ms "
          f"p99 {result['small_flood_p99_ms']:.1f} ms | ratio {result['flood_p99_over_idle_p99']:.2f} (target <= 3)")
    print(f"overload    {over['requests']} x 64 texts vs --max-concurrent-requests {args.max_concurrent}: "
          f"{over['ok']} answered 200 (slowest {over['admitted_max_s']:.1f} s), {over['rejected_429']} got 429 "
          f"(Retry-After {over['retry_after']}, p99 {over['rejected_p99_ms']:.1f} ms), other codes {over['other']}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
