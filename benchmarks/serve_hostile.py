"""How fast ``bertopt serve`` refuses hostile requests, side by side with a good one, over ZeroMQ and HTTP.

    .venv/bin/python benchmarks/serve_hostile.py [--repeat 3]

Starts one server (tiny BERT built under a temp folder: the refusals happen before any tokenizing, so the
model does not matter) with ZeroMQ and HTTP, then times, from send to the answer: a good one-text request, a
50 MB string (refused by --max-text-chars after the size and depth checks), a JSON nested 100,000 deep, a lone
surrogate, and over HTTP a 100 MB Content-Length (refused before the body is sent). Also the in-process speed
of the depth scan (``protocol.json_depth``) on 60 MB worst cases, and the server's peak RSS (VmHWM).
Prints a table and writes benchmarks/results/serve_hostile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bertopt.harness import descendants, free_port  # noqa: E402
from bertopt.tiny_models import build_tiny_hf_bert  # noqa: E402

BIG = 50_000_000


def start_server(artifact: Path, log_dir: Path) -> tuple[subprocess.Popen, int, int, int]:
    port, port_out, http = free_port(), free_port(), free_port()
    out = log_dir / "server.out"
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "serve", str(artifact), "--port", str(port),
                             "--port-out", str(port_out), "--http-port", str(http), "--num-worker", "1"],
                            stdout=open(out, "w"), stderr=open(log_dir / "server.err", "w"),
                            stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 300
    while "ready on" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start:\n{(log_dir / 'server.err').read_text()}")
        time.sleep(0.1)
    return proc, port, port_out, http


def zmq_round_trip(push, sub, identity: bytes, payload: bytes, rid: int) -> tuple[float, str]:
    started = time.perf_counter()
    push.send_multipart([identity, payload, b"%d" % rid, b"1"])
    assert sub.poll(120_000), "no reply"
    frames = sub.recv_multipart()
    took = time.perf_counter() - started
    info = json.loads(frames[1])
    return took, ("error: " + info["error"][:60]) if "error" in info else f"ok {info['shape']}"


def http_round_trip(port: int, route: str, body: bytes, declared: int | None = None) -> tuple[float, str]:
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if declared is None else declared}\r\n\r\n").encode()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
    took = time.perf_counter() - started
    return took, data.split(b"\r\n", 1)[0].decode()


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import numpy as np
    import zmq

    from bertopt.protocol import json_depth
    from bertopt.registry import run_stage

    rows: list[dict] = []
    deep = b"[" * 100_000 + b"]" * 100_000
    surrogate = json.dumps(["fine", "a\ud800b"]).encode()
    huge = json.dumps(["y" * BIG]).encode()
    scans = {"60 MB of '[]'": b"[" + b"[]," * 20_000_000 + b"[]]",
             "60 MB of short strings": b"[" + b'"ab",' * 12_000_000 + b'"a"]',
             "60 MB of escapes": b'["' + b"\\n" * 30_000_000 + b'"]',
             "60 MB of one plain string": json.dumps(["x" * 60_000_000]).encode()}
    for name, data in scans.items():
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            json_depth(data, 16)
            times.append(time.perf_counter() - t)
        rows.append({"case": f"json_depth scan, {name}", "front": "in-process", "median_s": float(np.median(times)),
                     "answer": f"{len(data) / 1e6 / np.median(times):.0f} MB/s"})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = build_tiny_hf_bert(tmp / "hf")
        art = run_stage("export", str(hf), {}, tmp / "art")
        proc, port, port_out, http = start_server(art.path, tmp)
        ctx = zmq.Context()
        push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"bench")
        push.connect(f"tcp://127.0.0.1:{port}")
        sub.connect(f"tcp://127.0.0.1:{port_out}")
        time.sleep(0.5)
        try:
            rid = 0
            zmq_cases = {"good one-text request": b'["the cat sat"]', "50 MB string": huge,
                         "JSON nested 100,000 deep": deep, "lone surrogate": surrogate}
            http_cases = {"good one-text request": (b'{"inputs": "the cat sat"}', None),
                          "50 MB string": (b'{"inputs": ' + huge + b"}", None),
                          "JSON nested 100,000 deep": (b'{"inputs": ' + deep + b"}", None),
                          "lone surrogate": (b'{"inputs": ' + surrogate + b"}", None),
                          "Content-Length 100 MB, no body": (b"", 100_000_000)}
            for _ in range(args.repeat):  # interleaved rounds: the cases share the machine's noise
                for name, payload in zmq_cases.items():
                    rid += 1
                    took, answer = zmq_round_trip(push, sub, b"bench", payload, rid)
                    rows.append({"case": name, "front": "zmq", "s": took, "answer": answer})
                for name, (body, declared) in http_cases.items():
                    took, answer = http_round_trip(http, "/embed", body, declared)
                    rows.append({"case": name, "front": "http", "s": took, "answer": answer})
            hwm = vm_hwm_mib(proc.pid)
        finally:
            push.close(0)
            sub.close(0)
            ctx.term()
            children = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    table: dict[tuple[str, str], dict] = {}
    for r in rows:
        if "s" in r:
            entry = table.setdefault((r["front"], r["case"]), {"times": [], "answer": r["answer"]})
            entry["times"].append(r["s"])
    results = [r for r in rows if "median_s" in r] + [
        {"front": f, "case": c, "median_s": float(np.median(e["times"])), "answer": e["answer"]}
        for (f, c), e in table.items()]
    print(f"{'front':11} {'case':40} {'median s':>9}  answer")
    for r in results:
        print(f"{r['front']:11} {r['case']:40} {r['median_s']:9.3f}  {r['answer']}")
    print(f"server peak RSS (VmHWM): {hwm:.0f} MiB")
    out = REPO / "benchmarks/results/serve_hostile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from bertopt.machine import machine_info

    out.write_text(json.dumps({"results": results, "server_vm_hwm_mib": hwm, "repeat": args.repeat,
                               "machine": machine_info(), "python": platform.python_version()}, indent=2,
                              default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
