"""ModernBERT attention fusion: rotary attention -> ``RotaryEmbedding`` x2 + ``MultiHeadAttention`` (com.microsoft).

The exported ModernBERT layer computes its attention as dozens of small operators: the packed ``Wqkv`` MatMul,
Reshape to [B, S, 3, N, H], Split, Squeeze, Transpose; rotary position embedding on q and k (``rotate_half``:
two Slices, Neg, Concat, two Muls by the cos/sin tables, Add); ``q @ k^T``, the scale, the additive mask (padding
on global layers, padding + sliding window on local layers; the export already builds each kind once and shares
it between layers), Softmax, ``probs @ v``, Transpose, Reshape and ``Wo``. This module rewrites each such block
into ONNX Runtime contrib operators with CPU kernels:

- three MatMuls for q, k, v [B, S, D] (D = N * H: the column blocks of the packed ``Wqkv`` weight; measured a
  little faster than one MatMul + Split, as int8-dynamic then quantises their shared input once);
- ``RotaryEmbedding`` (non-interleaved, i.e. ``rotate_half``) on q and on k, with cos/sin caches [P, H/2] computed
  here from the layer's own inverse frequencies (``rope_theta`` differs between global and local layers; layers
  with the same frequencies share one cache); positions are 0..S-1 as in the model;
- ``MultiHeadAttention`` with the model's scale and the layer's additive mask as ``attention_bias``
  [B, 1, S, S]; its [B, S, D] output feeds ``Wo`` directly.

Measured and not kept: one ``Split`` instead of GeGLU's two Slices (no measurable gain in the whole model).

A layer is rewritten only when every piece matches; a graph with no such layer (e.g. BERT's) is left unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bertopt.onnx_graph.fusions.graph import GraphIndex, constant_array, remove_dead_nodes, topological_sort

# Longest sequence the rotary caches cover: the largest ModernBERT context (8192 tokens) with headroom.
CACHE_POSITIONS = 8192


class _Graph(GraphIndex):
    """GraphIndex plus the matcher's lookups, each None where the pattern does not hold."""

    def __init__(self, model: Any):
        from onnx import numpy_helper

        super().__init__(model)
        self.graph = model.graph
        self.nh = numpy_helper
        self.outputs = {o.name for o in self.graph.output}

    def const(self, name: str) -> np.ndarray | None:
        return constant_array(self.inits, self.producer, name)

    def prod(self, name: str, op: str) -> Any | None:
        node = self.producer(name)
        return node if node is not None and node.op_type == op else None

    def only_consumer(self, name: str, op: str) -> Any | None:
        users = self.consumers(name)
        if len(users) == 1 and users[0].op_type == op and name not in self.outputs:
            return users[0]
        return None

    def ancestors(self, name: str, stop: set[str], limit: int = 60) -> list[Any]:
        """Nodes upstream of ``name`` (breadth first, at most ``limit``), not walking past the tensors in ``stop``."""
        seen, out, todo = set(), [], [name]
        while todo and len(out) < limit:
            t = todo.pop(0)
            if t in stop:
                continue
            node = self.producer(t)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            todo.extend(node.input)
        return out


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _match_layer(g: _Graph, softmax: Any, num_heads: int, hidden_size: int) -> dict[str, Any] | None:
    """The pieces of one rotary attention block ending in ``softmax``, or None when it is not one."""
    if _attr(softmax, "axis", -1) not in (-1, 3):
        return None
    add = g.prod(softmax.input[0], "Add")
    if add is None:
        return None
    scaled, mask = None, None
    for a, b in ((0, 1), (1, 0)):
        m = g.prod(add.input[a], "Mul")
        if m is not None and g.prod(m.input[0], "MatMul") is not None:
            scaled, mask = m, add.input[b]
            break
    if scaled is None or mask in g.inits:
        return None
    scale = g.const(scaled.input[1])
    qk = g.prod(scaled.input[0], "MatMul")
    head = hidden_size // num_heads
    if scale is None or scale.size != 1 or qk is None:
        return None
    # probs @ v -> Transpose -> Reshape [B, S, D] -> Wo
    pv = g.only_consumer(softmax.output[0], "MatMul")
    if pv is None or pv.input[0] != softmax.output[0]:
        return None
    tr_out = g.only_consumer(pv.output[0], "Transpose")
    if tr_out is None or list(_attr(tr_out, "perm", [])) != [0, 2, 1, 3]:
        return None
    reshape_out = g.only_consumer(tr_out.output[0], "Reshape")
    if reshape_out is None:
        return None
    # v: Split output 2 -> Squeeze -> Transpose [B, N, S, H]
    v_tr = g.prod(pv.input[1], "Transpose")
    v_sq = g.prod(v_tr.input[0], "Squeeze") if v_tr is not None else None
    split = g.prod(v_sq.input[0], "Split") if v_sq is not None else None
    if v_tr is None or list(_attr(v_tr, "perm", [])) != [0, 2, 1, 3] or split is None or len(split.output) != 3:
        return None
    if split.output[2] != v_sq.input[0] or _attr(split, "axis") not in (-3, 2):
        return None
    sizes = g.const(split.input[1]) if len(split.input) > 1 and split.input[1] else None
    if sizes is None or list(sizes) != [1, 1, 1]:
        return None
    qkv_reshape = g.prod(split.input[0], "Reshape")
    qkv_mm = g.prod(qkv_reshape.input[0], "MatMul") if qkv_reshape is not None else None
    if qkv_mm is None:
        return None
    w = g.const(qkv_mm.input[1])
    if w is None or w.shape != (hidden_size, 3 * hidden_size):
        return None
    # q and k must each come from their Split output through rotary ops only, with cos/sin from one Concat(f, f)
    stop = {split.output[0], split.output[1], split.output[2]}
    q_nodes = g.ancestors(qk.input[0], stop)
    k_nodes = g.ancestors(qk.input[1], stop)
    q_inputs = {i for n in q_nodes for i in n.input}
    k_inputs = {i for n in k_nodes for i in n.input}
    if split.output[0] not in q_inputs or split.output[1] not in k_inputs:
        return None
    if split.output[1] in q_inputs or split.output[0] in k_inputs:
        return None
    trig = [n for n in q_nodes + k_nodes if n.op_type in ("Cos", "Sin")]
    if not trig or len({n.input[0] for n in trig}) != 1:
        return None
    freqs = _inv_freq(g, trig[0].input[0], head)
    if freqs is None:
        return None
    for n in q_nodes + k_nodes:  # the rotary subgraph is elementwise/slicing only (no other weights)
        if n.op_type not in {"Squeeze", "Transpose", "Shape", "Gather", "Div", "Unsqueeze", "Slice", "Neg",
                             "Concat", "Mul", "Add", "Cos", "Sin", "Cast", "Range", "Constant", "Split"}:
            return None
    return {"softmax": softmax, "mask": mask, "scale": float(scale.reshape(())), "qkv_mm": qkv_mm,
            "reshape_out": reshape_out, "inv_freq": freqs}


def _inv_freq(g: _Graph, emb: str, head: int) -> np.ndarray | None:
    """The inverse frequencies [H/2] of ``emb = Concat(pos * inv_freq, pos * inv_freq)`` with pos = 0..S-1."""
    cat = g.prod(emb, "Concat")
    if cat is None or len(cat.input) != 2 or cat.input[0] != cat.input[1]:
        return None
    mul = g.prod(cat.input[0], "Mul")
    if mul is None:
        return None
    for a, b in ((0, 1), (1, 0)):
        f = g.const(mul.input[b])
        if f is not None and f.size == head // 2:
            pos = g.ancestors(mul.input[a], set(), limit=10)
            rng = [n for n in pos if n.op_type == "Range"]
            if len(rng) != 1:
                return None
            start, step = g.const(rng[0].input[0]), g.const(rng[0].input[2])
            if start is None or step is None or int(start) != 0 or int(step) != 1:
                return None
            return f.astype(np.float32).reshape(-1)
    return None


def fuse(model: Any, num_heads: int, hidden_size: int) -> dict[str, int]:
    from onnx import TensorProto, helper

    if num_heads <= 0 or hidden_size % num_heads:
        return {}
    g = _Graph(model)
    layers = [m for m in (_match_layer(g, n, num_heads, hidden_size) for n in g.graph.node
                          if n.op_type == "Softmax") if m is not None]
    if not layers:
        return {}
    new_nodes: list[Any] = []
    new_inits: list[Any] = []
    caches: dict[bytes, tuple[str, str]] = {}
    pos_name = "modernbert_rotary_position_offset"
    new_inits.append(helper.make_tensor(pos_name, TensorProto.INT64, [1], [0]))
    replace: dict[str, str] = {}  # old tensor -> new tensor
    for k, layer in enumerate(layers):
        key = layer["inv_freq"].tobytes()
        if key not in caches:
            c = len(caches)
            pos = np.arange(CACHE_POSITIONS, dtype=np.float32)[:, None]
            f = pos * layer["inv_freq"][None, :]  # float32 as the model computes it
            cos_n, sin_n = f"modernbert_rotary_cos_{c}", f"modernbert_rotary_sin_{c}"
            new_inits.append(g.nh.from_array(np.cos(f).astype(np.float32), cos_n))
            new_inits.append(g.nh.from_array(np.sin(f).astype(np.float32), sin_n))
            caches[key] = (cos_n, sin_n)
        cos_n, sin_n = caches[key]
        p = f"modernbert_attn_{k}"
        q, kk, v = f"{p}_q", f"{p}_k", f"{p}_v"
        w = g.const(layer["qkv_mm"].input[1])
        x = layer["qkv_mm"].input[0]
        for j, t in enumerate((q, kk, v)):  # three MatMuls: int8 quantises their shared input once, no Split copy
            new_inits.append(g.nh.from_array(np.ascontiguousarray(w[:, j * hidden_size:(j + 1) * hidden_size]),
                                             f"{t}_weight"))
            new_nodes.append(helper.make_node("MatMul", [x, f"{t}_weight"], [t], name=f"{t}_MatMul"))
        for t in (q, kk):
            new_nodes.append(helper.make_node("RotaryEmbedding", [t, pos_name, cos_n, sin_n], [f"{t}_rot"],
                                              name=f"{t}_RotaryEmbedding", domain="com.microsoft",
                                              interleaved=0, num_heads=num_heads))
        out = f"{p}_out"
        new_nodes.append(helper.make_node("MultiHeadAttention", [f"{q}_rot", f"{kk}_rot", v, "", "", layer["mask"]],
                                          [out], name=f"{p}_MultiHeadAttention", domain="com.microsoft",
                                          num_heads=num_heads, scale=layer["scale"]))
        replace[layer["reshape_out"].output[0]] = out
    counts = {"RotaryEmbedding": 2 * len(layers), "MultiHeadAttention": len(layers)}
    if any(o.name in replace for o in g.graph.output):
        return {}  # a graph output would be renamed: leave the graph as it is (nothing has been changed yet)
    for node in g.graph.node:
        for i, name in enumerate(node.input):
            if name in replace:
                node.input[i] = replace[name]
    g.graph.node.extend(new_nodes)
    g.graph.initializer.extend(new_inits)
    remove_dead_nodes(model)
    topological_sort(g.graph)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return counts
