"""Measuring tools, apart from any gate: comparing two runs' outputs (``compare``: per-output metrics;
``fidelity``: each task's own metrics; ``labels``: against the data's labels), the target grammar
(``targets``), validation / calibration text (``data``), timing (``latency``: ``time_call``, throughput, the
latency grid) and batch invariance (``batch``).

Stages, validate (the release gate and its reports), bench and tune all measure with these; measure/ itself
imports nothing above the runtime (never stages, validate, serve, spark, kafka, tune or cli).
"""
