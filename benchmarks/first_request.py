"""First-request latency of ``bertopt serve`` with and without worker warm-up (``--no-warmup``).

    .venv/bin/python benchmarks/first_request.py [--artifact DIR] [--starts 5] [--workers 1]

Each start is a real server process (HTTP on a free 127.0.0.1 port); warm and cold starts alternate, so both
see the same machine load. Per start, after ``/health`` turns 200 (the HTTP connection is opened by the health
polls, so its set-up is not timed):
  1. the first request: one sentence (POST /embed);
  2. the first long request: 32 texts of about 250 tokens or more, cut to the window (a new, larger shape);
  3. the same two again: the steady-state reference.
Also the start-up time (process start to /health 200), which warm-up lengthens. Medians over the starts; the
ratios first / steady say what the first user pays. The default artifact is all-MiniLM-L6-v2 exported to ONNX
(built under artifacts/bench/ if absent); `--artifact` takes any other, e.g. an OpenVINO one made with `bertopt
compile`. Prints a table and writes benchmarks/results/first_request.json (`--out` for another name).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_load import corpus, ensure_artifact, stop_server, wait_until_healthy  # noqa: E402

from bertopt.harness import free_port  # noqa: E402

MODES = {"warm-up": [], "no warm-up": ["--no-warmup"]}
SHORT = ["Is the first request as fast as the rest?"]


def long_texts(n: int = 32) -> list[str]:
    lines = corpus(400)
    return [" ".join(lines[i * 8:(i + 1) * 8]) for i in range(n)]  # several sentences each: ~250 tokens


def one_start(artifact: Path, flags: list[str], workers: int, log_dir: Path) -> dict:
    import httpx

    port = free_port()
    out, err = log_dir / "first_request.server.out", log_dir / "first_request.server.err"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(artifact), "--no-zmq",
                             "--http-port", str(port), "--num-worker", str(workers), *flags],
                            stdout=open(out, "w"), stderr=open(err, "w"), stdin=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as client:
            wait_until_healthy(client, url, proc, err)
            ready_s = time.perf_counter() - t0
            timings = {}
            for name, texts in (("first_short", SHORT), ("first_long", long_texts()), ("steady_short", SHORT),
                                ("steady_long", long_texts())):
                t = time.perf_counter()
                r = client.post(url + "/embed", json={"inputs": texts, "truncate": True})
                timings[name] = (time.perf_counter() - t) * 1000
                assert r.status_code == 200, r.text
        warm_lines = [x for x in err.read_text().splitlines() if "warmed up in" in x]
    finally:
        stop_server(proc)
    return {"ready_s": ready_s, **timings, "warmup_log": warm_lines}


def summarize(runs: list[dict]) -> dict:
    keys = ("ready_s", "first_short", "steady_short", "first_long", "steady_long")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    med["first_over_steady_short"] = statistics.median(r["first_short"] / r["steady_short"] for r in runs)
    med["first_over_steady_long"] = statistics.median(r["first_long"] / r["steady_long"] for r in runs)
    return med


def main() -> None:
    from bertopt.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=REPO / "artifacts/bench/minilm-onnx")
    ap.add_argument("--starts", type=int, default=5, help="server starts per mode (interleaved)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/first_request.json")
    args = ap.parse_args()
    art = ensure_artifact(args.artifact)
    log_dir = Path(tempfile.mkdtemp(prefix="first_request-"))  # the servers' logs, removed at the end
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for i in range(args.starts):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = one_start(art.path, MODES[mode], args.workers, log_dir)
                runs[mode].append(run)
                print(f"start {i + 1}/{args.starts} {mode:>10}: ready {run['ready_s']:.2f} s, first 1-text "
                      f"{run['first_short']:.1f} ms, first 32-text {run['first_long']:.1f} ms", flush=True)
    finally:
        shutil.rmtree(log_dir)
    summary = {m: summarize(r) for m, r in runs.items()}
    result = {"artifact": str(art.path), "workers": args.workers, "starts": args.starts,
              "long_request_texts": len(long_texts()), "summary": summary, "runs": runs, "machine": machine_info()}
    print()
    print(f"{'mode':>10} {'ready s':>8} {'1st 1-text ms':>14} {'steady ms':>10} {'ratio':>6} "
          f"{'1st 32-text ms':>15} {'steady ms':>10} {'ratio':>6}")
    for mode, s in summary.items():
        print(f"{mode:>10} {s['ready_s']:>8.2f} {s['first_short']:>14.1f} {s['steady_short']:>10.1f} "
              f"{s['first_over_steady_short']:>6.2f} {s['first_long']:>15.1f} {s['steady_long']:>10.1f} "
              f"{s['first_over_steady_long']:>6.2f}")
    print(f"(medians of {args.starts} starts per mode; ratio = first request / the same request again)")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
