"""ONNX graph tools that are not stages: ``util`` (load/save with external data, graph statistics, input/output
description, node naming, the finder of weight MatMuls) and ``fusions`` (bertopt's own attention fusions).

Imports only ``errors`` and ``artifact`` of bertopt, so the stages, the runtime and the TensorFlow path can all
use it.
"""
