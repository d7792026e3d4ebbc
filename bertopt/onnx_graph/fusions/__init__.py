"""Attention fusions bertopt does itself, for the families ONNX Runtime's transformer optimizer fuses no attention
in (MPNet's relative position bias, DeBERTa-v2's disentangled attention, ModernBERT's rotary attention).

Each module here rewrites an ONNX graph that ONNX Runtime's ``optimize_model`` has already processed, in place,
and returns the counts of the operators it created (merged into the optimize report's ``fused_ops``). A family
names its module in ``bertopt.families.Family.attention_fusion``; ``optimize`` runs it and then checks the result
against its input as for every fusion.

Contract of a module: ``fuse(model: onnx.ModelProto, num_heads: int, hidden_size: int) -> dict[str, int]``.
A graph the module does not recognise is left unchanged (an empty dict), never half-rewritten.
"""

from __future__ import annotations

import importlib
from typing import Any

FUSIONS = ("mpnet", "deberta", "modernbert")


def apply_fusion(name: str, model: Any, num_heads: int, hidden_size: int) -> dict[str, int]:
    """Run the fusion module ``name`` (one of ``FUSIONS``) on ``model`` in place; the counts of fused operators."""
    if name not in FUSIONS:
        raise ValueError(f"unknown attention fusion {name!r}; known: {', '.join(FUSIONS)}")
    module = importlib.import_module(f"bertopt.onnx_graph.fusions.{name}")
    return {k: int(v) for k, v in module.fuse(model, num_heads, hidden_size).items() if v}
