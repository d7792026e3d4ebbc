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

    .venv/bin/python benchmarks/http_load.py --two-models [--artifact DIR] [--cross-encoder DIR]

Two models on one fleet (``bertopt serve embed=EMB rerank=CE``, one worker each): the embedder and a MiniLM-L6
cross-encoder (the all-MiniLM-L6-v2 encoder with a seeded one-logit head, exported with --task rerank: the compute
of ms-marco-MiniLM-L-6-v2; built under artifacts/bench/ if absent). Measures, in one run:
  1. each model's one-request latency (/embed one sentence; /rerank one query with one passage) on the idle fleet,
     then while the *other* model is flooded (``--flood-size`` texts in flight) -> p99 ratio (target <= 3x);
  2. total throughput: both workloads sent at once over HTTP, against the two artifacts run one after the other
     in-process with all cores (target >= 0.85x).
Writes benchmarks/results/http_load_two_models.json.
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


def embed_b64(client, url: str, texts: list[str], model: str = "bench") -> np.ndarray:
    import base64

    r = client.post(url + "/v1/embeddings", json={"input": texts, "model": model, "encoding_format": "base64"})
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


def ensure_cross_encoder(path: Path):
    """A MiniLM-L6 cross-encoder artifact: the built-in all-MiniLM-L6-v2 encoder under a seeded one-logit head (a
    reranker's exact compute; its scores mean nothing), exported by ``bertopt export --task rerank``."""
    from bertopt.artifact import is_artifact

    if is_artifact(path):
        from bertopt.artifact import Artifact

        return Artifact.load(path)
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    from bertopt.registry import run_stage
    from bertopt.sources import resolve_source

    print(f"building {path} (all-MiniLM-L6-v2 + a seeded rerank head, bertopt export --task rerank) ...",
          flush=True)
    src = resolve_source("builtin:minilm").path
    hf = path.parent / (path.name + "-hf")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1).eval()
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, hf / name)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    art = run_stage("export", hf, {"task": "rerank"}, path)
    shutil.rmtree(hf)
    return art


def start_fleet(models: dict[str, Path], log_dir: Path):
    port = free_port()
    out = log_dir / "http_load_two_models.server.out"
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", *(f"{n}={p}" for n, p in models.items()),
                             "--no-zmq", "--http-port", str(port), "--num-worker", "1", "--request-timeout", "600",
                             "--max-concurrent-requests", "512"],
                            stdout=open(out, "w"), stderr=open(log_dir / "http_load_two_models.server.err", "w"),
                            stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 300
    while "ready on" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {(log_dir / 'http_load_two_models.server.err').read_text()}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


QUERY = "how do I serve several models on one machine?"


def _post_ok(client, url: str, route: str, body: dict):
    r = client.post(url + route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _one_request(model: str, client, url: str, i: int) -> None:
    if model == "embed":
        _post_ok(client, url, "/embed", {"inputs": f"Is this sentence number {i} fast?"})
    else:
        _post_ok(client, url, "/rerank", {"query": QUERY, "texts": [f"passage number {i} about serving"]})


def _flood_request(model: str, client, url: str, texts: list[str]) -> int:
    """Bulk work: the embedder's on /v1/embeddings with base64 vectors (what the openai client asks for; the texts
    fit the window, ``fitting``), the reranker's on /rerank cut to the window as the in-process Predictor does.
    Returns the texts answered."""
    if model == "embed":
        embed_b64(client, url, texts, "embed")
    else:
        _post_ok(client, url, "/rerank", {"query": QUERY, "texts": texts, "truncate": True})
    return len(texts)


def fitting(predictor, n: int, offset: int = 0) -> list[str]:
    """``n`` corpus lines that fit the model's window (the OpenAI route refuses longer ones), cycling."""
    lines = corpus(max(4 * n, 512), offset)
    fits = [t for t, e in zip(lines, predictor.tokenize(lines)) if len(e.ids) < predictor.max_seq_len]
    return [fits[i % len(fits)] for i in range(n)]


def probe_model(model: str, url: str, n: int, gap_s: float) -> list[float]:
    import httpx

    lat = []
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            t0 = time.perf_counter()
            _one_request(model, client, url, i)
            lat.append(time.perf_counter() - t0)
            time.sleep(gap_s)
    return lat


def probe_under_flood(probed: str, flooded: str, url: str, flood_size: int, flood_request: int, probes: int,
                      pool: list[str]):
    """``probed``'s one-request latencies while flooders keep ``flood_size`` texts of ``flooded`` (taken from
    ``pool``) in flight; the flood is then stopped and drained (its in-flight requests answered)."""
    import httpx

    stop = threading.Event()
    answered = [0]

    def flooder(k: int):
        with httpx.Client(timeout=900) as client:
            while not stop.is_set():
                start = (k * 7919 + answered[0]) % len(pool)
                n = _flood_request(flooded, client, url, (pool + pool)[start:start + flood_request])
                answered[0] += n  # after the call: the threads' sums must not read a stale total

    threads = [threading.Thread(target=flooder, args=(k,), daemon=True)
               for k in range(max(1, flood_size // flood_request))]
    for t in threads:
        t.start()
    time.sleep(2.0)  # let the flood fill the queue
    lat = probe_model(probed, url, probes, 0.05)
    stop.set()
    for t in threads:
        t.join()
    return lat, answered[0]


def steady_load(url: str, pools: dict[str, list[str]], seconds: float, clients: int) -> tuple[dict[str, int], float]:
    """Both models kept busy (``clients`` each, 32-text requests: enough that a model's queue is never empty while
    a reply travels back and the next request comes in) for ``seconds``, then drained: the texts each answered
    and the time from the first request to the last answer."""
    import httpx

    stop = threading.Event()
    answered = {m: 0 for m in pools}
    lock = threading.Lock()

    def client_loop(model: str, k: int):
        pool = pools[model] + pools[model]
        with httpx.Client(timeout=900) as client:
            i = 0
            while not stop.is_set():
                start = (k * 101 + 32 * i) % (len(pool) // 2)
                n = _flood_request(model, client, url, pool[start:start + 32])
                with lock:
                    answered[model] += n
                i += 1

    threads = [threading.Thread(target=client_loop, args=(m, k)) for m in pools for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return answered, time.perf_counter() - t0


def two_models(args) -> None:
    import httpx

    from bertopt.runtime import Predictor
    from bertopt.runtime.backends import default_threads

    cores = default_threads()
    arts = {"embed": ensure_artifact(args.artifact), "rerank": ensure_cross_encoder(args.cross_encoder)}
    embedder, reranker = Predictor(arts["embed"], threads=cores), Predictor(arts["rerank"], threads=cores)
    embed_texts = fitting(embedder, args.fleet_texts, offset=5)
    passages = corpus(args.fleet_texts, offset=501)
    pools = {"embed": embed_texts, "rerank": passages}
    embedder.encode(corpus(32))
    reranker.predict([QUERY] * 32, corpus(32))

    def inprocess() -> dict[str, float]:
        """Each model's texts/s alone in-process with every core."""
        t0 = time.perf_counter()
        embedder.encode(embed_texts)
        t1 = time.perf_counter()
        reranker.predict([QUERY] * len(passages), passages)
        t2 = time.perf_counter()
        return {"embed": len(embed_texts) / (t1 - t0), "rerank": len(passages) / (t2 - t1)}

    inproc_runs = [inprocess()]
    print(f"in-process, each alone with {cores} threads: {inproc_runs[0]['embed']:.1f} texts/s embed, "
          f"{inproc_runs[0]['rerank']:.1f} pairs/s rerank", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_fleet({n: a.path for n, a in arts.items()}, args.out.parent)
    try:
        with httpx.Client(timeout=120) as warm:
            got = np.array(_post_ok(warm, url, "/embed", {"inputs": corpus(16), "normalize": False, "truncate": True}))
            np.testing.assert_allclose(got, embedder.encode(corpus(16)), atol=1e-4)  # same runtime, same values
            ranked = _post_ok(warm, url, "/rerank", {"query": QUERY, "texts": corpus(16), "truncate": True})
            assert [r["index"] for r in ranked] == [r["index"] for r in reranker.rerank(QUERY, corpus(16))]
            info = warm.get(url + "/info").json()
        idle = {m: probe_model(m, url, args.probes, 0.05) for m in ("embed", "rerank")}
        flooded, flood_answered = {}, {}
        for probed, other in (("rerank", "embed"), ("embed", "rerank")):
            flooded[probed], flood_answered[other] = probe_under_flood(probed, other, url, args.flood_size,
                                                                       args.flood_request, args.probes, pools[other])
            print(f"{probed} probed while {other} flooded ({flood_answered[other]} texts answered)", flush=True)

        chunks = [("embed", embed_texts[i:i + 64]) for i in range(0, len(embed_texts), 64)]
        chunks += [("rerank", passages[i:i + 64]) for i in range(0, len(passages), 64)]

        def one(job):
            with httpx.Client(timeout=900) as client:
                _flood_request(job[0], client, url, job[1])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(chunks)) as pool:
            list(pool.map(one, chunks))
        fixed_s = time.perf_counter() - t0
        print(f"fleet, both workloads at once: {fixed_s:.1f} s", flush=True)
        steady, steady_s = steady_load(url, pools, args.steady_s, args.steady_clients)
        print(f"fleet, both models kept busy for {steady_s:.1f} s: {steady}", flush=True)
    finally:
        stop_server(proc)
    inproc_runs.append(inprocess())
    rate = {m: float(np.mean([r[m] for r in inproc_runs])) for m in ("embed", "rerank")}
    # the same work in-process, one model after the other with every core
    fixed_inproc_s = len(embed_texts) / rate["embed"] + len(passages) / rate["rerank"]
    steady_inproc_s = steady["embed"] / rate["embed"] + steady["rerank"] / rate["rerank"]
    rows = []
    for m in ("embed", "rerank"):
        rows.append({"model": m, "idle_p50_ms": pct(idle[m], 50), "idle_p99_ms": pct(idle[m], 99),
                     "other_flooded_p50_ms": pct(flooded[m], 50), "other_flooded_p99_ms": pct(flooded[m], 99),
                     "p99_ratio": pct(flooded[m], 99) / pct(idle[m], 99)})
    result = {"artifacts": {m: str(a.path) for m, a in arts.items()}, "cores": cores,
              "workers_per_model": 1, "threads_per_worker": [m["runtime"]["threads"] for m in info["models"]],
              "probes": args.probes, "flood_size": args.flood_size, "flood_request": args.flood_request,
              "flood_texts_answered": flood_answered, "latency": rows, "latency_target": 3.0,
              "inprocess_texts_per_s": rate, "inprocess_runs": inproc_runs,
              "fixed": {"embed_texts": len(embed_texts), "rerank_pairs": len(passages), "request_texts": 64,
                        "fleet_s": fixed_s, "inprocess_s": fixed_inproc_s, "ratio": fixed_inproc_s / fixed_s},
              "steady": {"answered": steady, "fleet_s": steady_s, "inprocess_s": steady_inproc_s,
                         "ratio": steady_inproc_s / steady_s, "clients_per_model": args.steady_clients,
                         "request_texts": 32},
              "throughput_ratio": steady_inproc_s / steady_s, "throughput_target": 0.85}
    print()
    print(f"{'model':>7} {'idle p50':>9} {'idle p99':>9} {'flooded p50':>12} {'flooded p99':>12} {'p99 ratio':>10}")
    for r in rows:
        print(f"{r['model']:>7} {r['idle_p50_ms']:>9.1f} {r['idle_p99_ms']:>9.1f} {r['other_flooded_p50_ms']:>12.1f} "
              f"{r['other_flooded_p99_ms']:>12.1f} {r['p99_ratio']:>10.2f}")
    print("(ms; 'flooded': while the other model has the flood in flight; target p99 ratio <= 3)")
    print(f"throughput, fixed work ({len(embed_texts)} texts + {len(passages)} pairs): in-process one model after the "
          f"other {fixed_inproc_s:.1f} s | fleet both at once {fixed_s:.1f} s | ratio "
          f"{result['fixed']['ratio']:.2f}")
    print(f"throughput, steady load ({steady['embed']} texts + {steady['rerank']} pairs answered in {steady_s:.1f} s):"
          f" in-process would take {steady_inproc_s:.1f} s | ratio {result['steady']['ratio']:.2f} (target >= 0.85)")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


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
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/http_load.json "
                    "(--two-models: http_load_two_models.json)")
    ap.add_argument("--two-models", action="store_true", help="the two-model fleet run (embedder + cross-encoder)")
    ap.add_argument("--cross-encoder", type=Path, default=REPO / "artifacts/bench/minilm-ce-onnx")
    ap.add_argument("--fleet-texts", type=int, default=1024, help="--two-models: texts and pairs of the fixed "
                    "throughput workload (each)")
    ap.add_argument("--steady-s", type=float, default=40.0, help="--two-models: seconds both models are kept busy")
    ap.add_argument("--steady-clients", type=int, default=4, help="--two-models: clients per model in the steady "
                    "load")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.two_models:
        args.out = args.out or REPO / "benchmarks/results/http_load_two_models.json"
        return two_models(args)
    args.out = args.out or REPO / "benchmarks/results/http_load.json"
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
