"""Prometheus metrics of ``bertopt serve`` (exposed at ``/metrics`` by the HTTP front end).

One registry per server. HTTP requests are counted by route and status (and by model and status); latency has
three histograms: time in the queue (a piece's wait from arrival to dispatch), inference (a mini-job's dispatch to
its DONE) and the total an HTTP client sees. The scheduler records every mini-job's texts and tokens, so ZeroMQ
traffic shows up in the batch, queue and worker metrics too. Everything the fleet does is labelled by ``model``
(the served model's name), so a server of several models shows each one's queue, batches and latency.
"""

from __future__ import annotations

from bertopt.errors import require

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TEXT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    def __init__(self) -> None:
        prom = require("prometheus_client", "serve", "bertopt serve --http-port")
        self._prom = prom
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter("bertopt_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.model_requests = prom.Counter("bertopt_model_requests", "HTTP requests by served model and status "
                                           "code", ["model", "status"], registry=r)
        self.request_seconds = prom.Histogram("bertopt_request_seconds", "Total HTTP request latency",
                                              ["route", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = prom.Histogram("bertopt_queue_seconds", "Time a request piece waits for a worker",
                                            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = prom.Histogram("bertopt_inference_seconds", "Time a worker spends on a "
                                                "mini-job", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_texts = prom.Histogram("bertopt_batch_texts", "Texts per mini-job", ["model"],
                                          buckets=TEXT_BUCKETS, registry=r)
        self.batch_tokens = prom.Histogram("bertopt_batch_tokens", "Tokens per mini-job", ["model"],
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = prom.Gauge("bertopt_queue_depth", "Request pieces waiting for a worker", ["model"],
                                      registry=r)
        self.in_flight = prom.Gauge("bertopt_http_requests_in_flight", "HTTP requests admitted and not yet "
                                    "answered", registry=r)
        self.worker_restarts = prom.Counter("bertopt_worker_restarts", "Worker processes restarted after dying",
                                            registry=r)

    def render(self) -> tuple[bytes, str]:
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
