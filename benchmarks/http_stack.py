"""Which HTTP stack for ``bertopt serve --http-port``: per-request overhead of a one-sentence-sized JSON call.

Starts each candidate app (a raw ASGI callable, Starlette, FastAPI with a pydantic body) under uvicorn in its
own process on 127.0.0.1, sends sequential POSTs of a one-sentence /embed body from one keep-alive httpx
client, and reports the median and p99 round trip. The app answers a fixed 384-float JSON vector, so what is
measured is the stack (parse, route, validate, serialise), not a model. Prints a table and writes JSON under
benchmarks/results/.

    python benchmarks/http_stack.py --requests 2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

APPS = r'''
import json
VECTOR = [0.0123456] * 384
BODY = json.dumps([VECTOR]).encode()

async def raw(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    req = json.loads(body)
    assert isinstance(req["inputs"], str)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

async def embed(request):
    req = json.loads(await request.body())
    assert isinstance(req["inputs"], str)
    return Response(BODY, media_type="application/json")

starlette_app = Starlette(routes=[Route("/embed", embed, methods=["POST"])])

from fastapi import FastAPI
from pydantic import BaseModel

class EmbedRequest(BaseModel):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False

fastapi_app = FastAPI()

@fastapi_app.post("/embed")
async def fastapi_embed(req: EmbedRequest):
    return [VECTOR]
'''


def measure(app: str, port: int, n: int, workdir: Path) -> dict:
    import httpx

    env = dict(os.environ, PYTHONPATH=str(workdir) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"stack_apps:{app}", "--port", str(port),
                             "--log-level", "warning"], env=env, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/embed"
        body = {"inputs": "A one-sentence request, about as long as a search query."}
        with httpx.Client() as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.post(url, json=body)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for _ in range(200):  # warm-up
                client.post(url, json=body)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = client.post(url, json=body)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200
        times.sort()
        return {"app": app, "requests": n, "median_ms": 1e3 * times[n // 2], "p99_ms": 1e3 * times[int(n * 0.99)],
                "requests_per_s": n / sum(times)}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the stacks this many times")
    ap.add_argument("--out", default="benchmarks/results/http_stack.json")
    args = ap.parse_args()
    import tempfile

    from bertopt.harness import free_port

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "stack_apps.py").write_text(APPS)
        rows = []
        for _ in range(args.rounds):
            for app in ("raw", "starlette_app", "fastapi_app"):
                rows.append(measure(app, free_port(), args.requests, Path(tmp)))
    print(f"{'stack':16} {'median ms':>10} {'p99 ms':>8} {'req/s':>8}")
    for r in rows:
        print(f"{r['app']:16} {r['median_ms']:10.3f} {r['p99_ms']:8.3f} {r['requests_per_s']:8.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
