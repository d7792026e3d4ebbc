"""Kafka bridge with the Spark backend: messages/s of `bertopt kafka --backend spark` against `--backend local` and
the in-process runtime, side by side in one run, with Spark's per-batch overhead measured on its own.

    .venv/bin/python benchmarks/kafka_spark.py                      # MiniLM fp32 (exported on the fly)
    .venv/bin/python benchmarks/kafka_spark.py --artifact PATH --requests 2000 --max-batch 64 --master local[2]

1. in-process: ``Predictor.encode`` over the requests in batches of ``--max-batch`` (also the reference values);
2. Spark alone (no Kafka): a ``SparkBackend`` (the bridge's spark backend) in this process runs the same batches;
   its per-batch time minus the in-process per-batch time is Spark's overhead per batch, and an empty Spark job of
   the same shape (the texts in, a constant out) is its fixed part; session start and model warm-up are timed
   separately; the session is stopped before step 3;
3. a tansu broker on loopback, the requests produced once; ``bertopt kafka --backend local`` and then
   ``--backend spark`` each answer all of them (own consumer group, own response topic); every response is checked
   (every id, values equal to the in-process runtime within 1e-5).

Bridge messages/s are reported in steady state (first to last response, from the messages' timestamps) and over
the whole run (process start, Spark start, group join included). Prints a table and writes
benchmarks/results/kafka_spark.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kafka_throughput import start_tansu, stop  # noqa: E402 - the broker helpers of the bridge benchmark


def spark_alone(artifact, batches: list[list[str]], master: str, partitions: int | None, threads: int | None):
    """Seconds per batch through the spark backend, and per empty Spark job of the same shape."""
    from bertopt.kafka.spark_backend import SparkBackend

    t0 = time.perf_counter()
    backend = SparkBackend(artifact, master=master, partitions=partitions, threads=threads)
    ready_s = time.perf_counter() - t0
    try:
        backend.encode(batches[0])  # the first job after warm-up still pays for JIT and worker set-up
        per_batch, values = [], []
        for batch in batches:
            t = time.perf_counter()
            values.append(backend.encode(batch))
            per_batch.append(time.perf_counter() - t)
        spark = backend.spark
        from pyspark.sql import functions as F
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        schema = StructType([StructField("i", LongType(), False), StructField("text", StringType(), True)])
        empty_jobs = []
        for batch in batches[: min(len(batches), 10)]:
            t = time.perf_counter()
            rows = spark.sparkContext.parallelize(list(enumerate(batch)), min(backend.partitions, len(batch)))
            spark.createDataFrame(rows, schema).select("i", F.length("text")).collect()
            empty_jobs.append(time.perf_counter() - t)
        return {"session_start_s": backend.startup_s, "ready_s": ready_s, "partitions": backend.partitions,
                "per_batch_s": per_batch, "empty_job_s": statistics.median(empty_jobs),
                "values": np.concatenate(values)}
    finally:
        backend.close()


def run_bridge(artifact, bootstrap: str, req_topic: str, n: int, backend_args: list[str], max_batch: int,
               threads: int | None, work: Path, name: str) -> dict:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    tag = uuid.uuid4().hex[:8]
    resp_topic = f"bench-resp-{name}-{tag}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the topic exists
    for fut in admin.create_topics([NewTopic(resp_topic, 1, 1)]).values():
        fut.result(15)
    log_path = work / f"bridge-{name}.log"
    cmd = [sys.executable, "-m", "bertopt.cli", "kafka", str(artifact.path), "--bootstrap", bootstrap,
           "--request-topic", req_topic, "--response-topic", resp_topic, "--group-id", f"bench-{name}-{tag}",
           "--max-batch", str(max_batch), "--stats-interval", "5", *backend_args]
    if threads:
        cmd += ["--threads", str(threads)]
    started = time.time()
    with open(log_path, "wb") as out:
        bridge = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{tag}", "enable.auto.commit": False})
    reader.assign([TopicPartition(resp_topic, 0, OFFSET_BEGINNING)])
    got: dict[int, np.ndarray] = {}
    stamps: list[float] = []
    responses = 0
    deadline = time.monotonic() + 600
    try:
        while len(got) < n:
            if time.monotonic() > deadline or bridge.poll() is not None:
                raise RuntimeError(f"{name}: {len(got)} of {n} answered; log:\n{log_path.read_text()[-3000:]}")
            for msg in reader.consume(1000, timeout=0.5):
                if msg.error():
                    raise RuntimeError(str(msg.error()))
                body = json.loads(msg.value())
                if "error" in body or body["artifact"] != artifact.digest:
                    raise RuntimeError(f"{name}: unexpected response {str(body)[:200]}")
                got[body["id"]] = np.asarray(body["embedding"], dtype=np.float32)
                stamps.append(msg.timestamp()[1] / 1000)
                responses += 1
        code = stop(bridge, signal.SIGTERM, grace_s=60)
    finally:
        reader.close()
        stop(bridge, signal.SIGKILL)
    stats_lines = [ln for ln in log_path.read_text().splitlines() if "final stats " in ln]
    wall_s = max(stamps) - started
    steady_s = max(stamps) - min(stamps)
    return {"values": np.stack([got[i] for i in range(n)]), "msgs_per_s_wall": n / wall_s,
            "msgs_per_s_steady": (n - 1) / steady_s if steady_s > 0 else None, "wall_s": wall_s,
            "first_response_after_s": min(stamps) - started, "duplicates": responses - n, "exit_code": code,
            "final_stats": json.loads(stats_lines[-1].split("final stats ", 1)[1]) if stats_lines else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", help="artifact folder (default: export builtin:minilm to a temp folder)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--partitions", type=int, default=3, help="request topic partitions")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--spark-partitions", type=int, default=None, help="--partitions of the spark backend")
    ap.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores / per task)")
    ap.add_argument("--out", default=str(HERE / "results" / "kafka_spark.json"))
    args = ap.parse_args()

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from bertopt.artifact import Artifact
    from bertopt.data import corpus
    from bertopt.output_paths import write_json
    from bertopt.runtime import Predictor

    work = Path(tempfile.mkdtemp(prefix="kafka-spark-bench-"))
    if args.artifact:
        artifact = Artifact.load(args.artifact)
    else:
        from bertopt.registry import run_stage

        print("exporting builtin:minilm ...", flush=True)
        artifact = run_stage("export", "builtin:minilm", {}, work / "minilm")
    sentences = [s for s in corpus() if s.strip()]
    texts = [sentences[i % len(sentences)] for i in range(args.requests)]
    batches = [texts[i:i + args.max_batch] for i in range(0, len(texts), args.max_batch)]

    # 1. in-process
    predictor = Predictor(artifact, threads=args.threads)
    predictor.encode(batches[0])
    in_process_batch_s = []
    outs = []
    for batch in batches:
        t = time.perf_counter()
        outs.append(predictor.encode(batch))
        in_process_batch_s.append(time.perf_counter() - t)
    reference = np.concatenate(outs)
    in_process_s = sum(in_process_batch_s)
    del predictor
    print(f"in-process: {len(texts) / in_process_s:.0f} texts/s", flush=True)

    # 2. Spark alone
    alone = spark_alone(artifact, batches, args.master, args.spark_partitions, args.threads)
    spark_alone_s = sum(alone["per_batch_s"])
    alone_diff = float(np.abs(alone.pop("values") - reference).max())
    overhead = [s - i for s, i in zip(alone["per_batch_s"], in_process_batch_s)]
    print(f"spark backend alone: {len(texts) / spark_alone_s:.0f} texts/s, overhead "
          f"{statistics.median(overhead) * 1000:.0f} ms/batch", flush=True)

    # 3. the bridges
    broker, bootstrap = start_tansu(work / "tansu.log")
    try:
        tag = uuid.uuid4().hex[:8]
        req_topic = f"bench-req-{tag}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for fut in admin.create_topics([NewTopic(req_topic, args.partitions, 1)]).values():
            fut.result(15)
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
        local = run_bridge(artifact, bootstrap, req_topic, len(texts), ["--backend", "local"], args.max_batch,
                           args.threads, work, "local")
        print(f"bridge, local backend: {local['msgs_per_s_steady']:.0f} msgs/s steady", flush=True)
        spark_args = ["--backend", "spark", "--master", args.master]
        if args.spark_partitions:
            spark_args += ["--partitions", str(args.spark_partitions)]
        spark = run_bridge(artifact, bootstrap, req_topic, len(texts), spark_args, args.max_batch, args.threads,
                           work, "spark")
        print(f"bridge, spark backend: {spark['msgs_per_s_steady']:.0f} msgs/s steady", flush=True)
    finally:
        stop(broker, signal.SIGINT, grace_s=5)  # tansu ignores SIGTERM

    diffs = {name: float(np.abs(r.pop("values") - reference).max()) for name, r in (("local", local),
                                                                                       ("spark", spark))}
    in_rate = len(texts) / in_process_s
    result = {
        "artifact": str(artifact.path), "digest": artifact.digest, "precision": artifact.precision,
        "requests": len(texts), "topic_partitions": args.partitions, "max_batch": args.max_batch,
        "master": args.master, "threads": args.threads, "cpu_count": os.cpu_count(),
        "in_process_texts_per_s": in_rate,
        "in_process_batch_s_median": statistics.median(in_process_batch_s),
        "spark_alone": {**alone, "texts_per_s": len(texts) / spark_alone_s,
                        "batch_s_median": statistics.median(alone["per_batch_s"]),
                        "overhead_per_batch_s_median": statistics.median(overhead),
                        "max_abs_diff_vs_in_process": alone_diff},
        "bridge_local": {**local, "max_abs_diff_vs_in_process": diffs["local"]},
        "bridge_spark": {**spark, "max_abs_diff_vs_in_process": diffs["spark"]},
    }
    rows = [
        ("in-process Predictor.encode (same batches)", in_rate),
        ("spark backend alone, no Kafka (same batches)", result["spark_alone"]["texts_per_s"]),
        ("bertopt kafka --backend local, steady", local["msgs_per_s_steady"] or 0),
        ("bertopt kafka --backend spark, steady", spark["msgs_per_s_steady"] or 0),
        ("bertopt kafka --backend local, wall", local["msgs_per_s_wall"]),
        ("bertopt kafka --backend spark, wall", spark["msgs_per_s_wall"]),
    ]
    print(f"\nKafka bridge backends, {len(texts)} requests, {args.partitions} topic partitions, --max-batch "
          f"{args.max_batch}, spark {args.master} x {alone['partitions']} partitions, artifact {artifact.path.name} "
          f"({artifact.precision})")
    print(f"| {'path':46} | {'msgs/s':>8} | {'x in-process':>12} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 14}|")
    for label, rate in rows:
        print(f"| {label:46} | {rate:8.0f} | {rate / in_rate:12.2f} |")
    print(f"Spark per batch of {args.max_batch}: {result['spark_alone']['batch_s_median'] * 1000:.0f} ms vs "
          f"{result['in_process_batch_s_median'] * 1000:.0f} ms in-process (overhead "
          f"{result['spark_alone']['overhead_per_batch_s_median'] * 1000:.0f} ms, of which an empty Spark job "
          f"{alone['empty_job_s'] * 1000:.0f} ms); session start {alone['session_start_s']:.1f} s, ready (model "
          f"loaded in the workers) {alone['ready_s']:.1f} s; spark bridge's first response after "
          f"{spark['first_response_after_s']:.1f} s (local: {local['first_response_after_s']:.1f} s)")
    print(f"max |diff| vs in-process: spark alone {alone_diff:.1e}, local bridge {diffs['local']:.1e}, spark bridge "
          f"{diffs['spark']:.1e}; duplicates {local['duplicates']} / {spark['duplicates']}; exit codes "
          f"{local['exit_code']} / {spark['exit_code']}")
    out = Path(args.out)
    write_json(out, result)
    print(f"wrote {out}")
    if max(diffs.values()) > 1e-5 or local["exit_code"] or spark["exit_code"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
