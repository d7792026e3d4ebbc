"""DeBERTa-v2/v3 disentangled attention -> ONNX Runtime ``MultiHeadAttention`` with an additive bias.

The exported attention of each layer (transformers' ``DisentangledSelfAttention``) is, per head,
``softmax(where(mask, q k^T / s + c2p + p2c, min)) v`` with ``s = sqrt(head_dim * scale_factor)`` and

* ``c2p[i, j] = q_i . pos_key[idx_c2p[i, j]] / s``  (content to position),
* ``p2c[i, j] = k_j . pos_query[idx_p2c[j, i]] / s`` (position to content),

where ``pos_key``/``pos_query`` are the projections of the relative embedding table (constants: ONNX Runtime has
folded them into initializers of shape (heads, 2 * span, head_dim)) and the index tensors depend only on the
sequence length. The export computes both biases with Tile + Transpose + MatMul + Expand + GatherElements +
Transpose + Div per layer and the scores with further Reshape/Transpose/Div/Where nodes.

This module rewrites each layer to::

    c2p  = GatherElements(MatMul(heads(q), pos_key^T / s), idx_c, axis=3)       # (B, N, S, 2 span) -> (B, N, S, S)
    p2c  = GatherElements(MatMul(pos_query / s, heads(k)^T), idx_p, axis=2)     # (B, N, 2 span, S) -> (B, N, S, S)
    out  = MultiHeadAttention(q, k, v, attention_bias = c2p + p2c + mask_bias, scale = 1 / s)

where ``idx_c``/``idx_p`` (B, N, S, S) are the export's own relative-position indices (so the bucketing is
untouched; ``idx_p`` transposed, so p2c needs no transpose of its scores) expanded once per model instead of
twice per layer, and ``mask_bias`` is
0 where the export's boolean mask is true and the export's fill value elsewhere (built once per model; adding
the fill value -3.4e38 to a score gives the fill value again, so fully masked rows stay uniform as in the export).

A graph that does not have this shape in every Softmax (another family, a DeBERTa variant with other
``pos_att_type``, pos_key not folded to a constant) is left unchanged and ``{}`` is returned.
"""

from __future__ import annotations

import hashlib
from typing import Any

from bertopt.stages.fusions.graph import constant_array, remove_dead_nodes, topological_sort

_MS = "com.microsoft"


class _Graph:
    def __init__(self, model: Any):
        self.model = model
        self.g = model.graph
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.inits = {i.name: i for i in self.g.initializer}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def node(self, tensor: str, op: str):
        n = self.producer.get(tensor)
        if n is None or n.op_type != op:
            raise _NoMatch(f"{tensor} is not produced by {op}")
        return n

    def const(self, tensor: str):
        value = constant_array(self.inits, self.producer.get, tensor)
        if value is None:
            raise _NoMatch(f"{tensor} is not a constant")
        return value

    def only_consumer(self, tensor: str, op: str):
        users = [n for n in self.consumers.get(tensor, []) if n.op_type != "Shape"]  # shape chains die with it
        if len(users) != 1 or users[0].op_type != op:
            raise _NoMatch(f"{tensor} is not consumed by exactly one {op}")
        return users[0]


class _NoMatch(Exception):
    pass


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _heads_source(gr: _Graph, tensor: str) -> str:
    """(B*N, S, d) heads tensor -> the (B, S, H) projection it was reshaped from."""
    r = gr.node(tensor, "Reshape")
    t = gr.node(r.input[0], "Transpose")
    if list(_attr(t, "perm")) != [0, 2, 1, 3]:
        raise _NoMatch("heads transpose")
    return gr.node(t.input[0], "Reshape").input[0]


def _scale_factor(gr: _Graph, tensor: str) -> float:
    """Sqrt(Cast(head_dim) * c) -> c."""
    mul = gr.node(gr.node(tensor, "Sqrt").input[0], "Mul")
    for i in mul.input:
        try:
            return float(gr.const(i).reshape(()))
        except _NoMatch:
            continue
    raise _NoMatch("scale factor")


def _pos_table(gr: _Graph, tensor: str):
    """Transpose(Tile(pos (N, R, d))) -> the constant pos table."""
    t = gr.node(tensor, "Transpose")
    tile = gr.node(t.input[0], "Tile")
    return tile.input[0], gr.const(tile.input[0])


def _gather_index(gr: _Graph, tensor: str) -> str:
    """The (S, S) relative-position index that GatherElements' Expand broadcasts."""
    return gr.node(tensor, "Expand").input[0]


def _match_layer(gr: _Graph, softmax) -> dict:
    if _attr(softmax, "axis", -1) not in (-1, 3):
        raise _NoMatch("softmax axis")
    where = gr.node(softmax.input[0], "Where")
    mask, fill = where.input[0], where.input[2]
    fill_value = float(gr.const(fill).reshape(()))
    add_all = gr.node(gr.node(where.input[1], "Reshape").input[0], "Add")
    qk, rel = (gr.producer.get(i) for i in add_all.input)
    if qk is None or rel is None:
        raise _NoMatch("scores")
    if qk.op_type != "MatMul":
        qk, rel = rel, qk
    if qk.op_type != "MatMul" or rel.op_type != "Add":
        raise _NoMatch("scores add")
    q_heads = qk.input[0]
    kdiv = gr.node(qk.input[1], "Div")
    kt = gr.node(kdiv.input[0], "Transpose")
    k_heads = kt.input[0]
    factors = {_scale_factor(gr, kdiv.input[1])}
    c2p = p2c = None
    for term in rel.input:
        div = gr.node(term, "Div")
        factors.add(_scale_factor(gr, div.input[1]))
        src = gr.producer.get(div.input[0])
        if src is not None and src.op_type == "GatherElements":
            mm = gr.node(src.input[0], "MatMul")
            if mm.input[0] != q_heads:
                raise _NoMatch("c2p query")
            c2p = (_pos_table(gr, mm.input[1]), _gather_index(gr, src.input[1]))
        elif src is not None and src.op_type == "Transpose":
            ge = gr.node(src.input[0], "GatherElements")
            mm = gr.node(ge.input[0], "MatMul")
            if mm.input[0] != k_heads:
                raise _NoMatch("p2c key")
            p2c = (_pos_table(gr, mm.input[1]), _gather_index(gr, ge.input[1]))
        else:
            raise _NoMatch("relative term")
    if c2p is None or p2c is None or len(factors) != 1:
        raise _NoMatch("c2p and p2c")
    # softmax -> Reshape -> MatMul(v heads) -> Reshape -> Transpose -> Reshape (B, S, H)
    r13 = gr.only_consumer(softmax.output[0], "Reshape")
    pv = gr.only_consumer(r13.output[0], "MatMul")
    if pv.input[0] != r13.output[0]:
        raise _NoMatch("probs @ v")
    r14 = gr.only_consumer(pv.output[0], "Reshape")
    tr = gr.only_consumer(r14.output[0], "Transpose")
    if list(_attr(tr, "perm")) != [0, 2, 1, 3]:
        raise _NoMatch("context transpose")
    out = gr.only_consumer(tr.output[0], "Reshape").output[0]
    return {"q": _heads_source(gr, q_heads), "k": _heads_source(gr, k_heads), "v": _heads_source(gr, pv.input[1]),
            "mask": mask, "fill": fill_value, "factor": factors.pop(), "c2p": c2p, "p2c": p2c, "out": out}


def _signature(gr: _Graph, tensor: str, memo: dict) -> str:
    """A structural hash of how ``tensor`` is computed (initializers by value), to share per-model tensors."""
    if tensor in memo:
        return memo[tensor]
    if tensor in gr.inits:
        sig = "I" + hashlib.sha1(gr.inits[tensor].SerializeToString().replace(tensor.encode(), b"")).hexdigest()
    elif tensor not in gr.producer:
        sig = "G" + tensor
    else:
        n = gr.producer[tensor]
        attrs = sorted((a.name, a.SerializeToString()) for a in n.attribute)
        parts = [n.op_type, n.domain, str(list(n.output).index(tensor)), repr(attrs)]
        parts += [_signature(gr, i, memo) if i else "" for i in n.input]
        sig = "N" + hashlib.sha1("|".join(parts).encode()).hexdigest()
    memo[tensor] = sig
    return sig


def fuse(model: Any, num_heads: int, hidden_size: int) -> dict[str, int]:
    import numpy as np
    from onnx import helper, numpy_helper

    gr = _Graph(model)
    softmaxes = [n for n in gr.g.node if n.op_type == "Softmax"]
    if not softmaxes or hidden_size % num_heads:
        return {}
    try:
        layers = [_match_layer(gr, s) for s in softmaxes]
    except _NoMatch:
        return {}
    head_dim = hidden_size // num_heads
    for lay in layers:
        for (_, table), _idx in (lay["c2p"], lay["p2c"]):
            if table.ndim != 3 or table.shape[0] != num_heads or table.shape[2] != head_dim:
                return {}
    for lay in layers[1:]:
        if lay["c2p"][0][1].shape != layers[0]["c2p"][0][1].shape:
            return {}

    new_nodes: list = []
    new_inits: list = []
    memo: dict = {}
    shared: dict[str, str] = {}

    def init(name, value):
        new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, name, domain=None, **attrs):
        n = helper.make_node(op, inputs, [name + "_out"], name=name, domain=domain, **attrs)
        new_nodes.append(n)
        return n.output[0]

    pre = "DebertaAttn"
    i64 = np.int64
    heads_mul = init(f"{pre}_heads_mul", np.array([1, num_heads, 1, 1], i64))

    def expanded_index(idx_c: str, idx_p: str, mask: str) -> tuple[str, str]:
        """The (B, N, S, S) GatherElements indices of c2p and p2c, once per model (per distinct inputs)."""
        key = _signature(gr, idx_c, memo) + _signature(gr, idx_p, memo) + _signature(gr, mask, memo)
        if key in shared:
            return shared[key + "c"], shared[key + "p"]
        k = len(shared) // 3
        s1 = node("Shape", [idx_c], f"{pre}_idx{k}_shape", start=-1)  # [S]; the index is (S, S) or (1, S, S)
        square = node("Concat", [init(f"{pre}_idx{k}_m1", np.array([-1], i64)), s1], f"{pre}_idx{k}_SS", axis=0)
        # the mask is (B, 1, S, S): its shape times (1, N, 1, 1) is the scores' shape
        full = node("Mul", [node("Shape", [mask], f"{pre}_idx{k}_mshape"), heads_mul], f"{pre}_idx{k}_BNSS")
        ic = node("Expand", [node("Reshape", [idx_c, square], f"{pre}_idx{k}_c2d"), full], f"{pre}_idx{k}_c")
        # p2c[i, j] = (k_j . pos_query[idx_p[j, i]]): gathered along the rows of pos_query @ k^T (B, N, R, S)
        pt = node("Transpose", [node("Reshape", [idx_p, square], f"{pre}_idx{k}_p2d")], f"{pre}_idx{k}_pT",
                  perm=[1, 0])
        ip = node("Expand", [pt, full], f"{pre}_idx{k}_p")
        shared[key] = "1"
        shared[key + "c"], shared[key + "p"] = ic, ip
        return ic, ip

    mask_bias: dict[str, str] = {}
    heads_shape = init(f"{pre}_heads_shape", np.array([0, 0, num_heads, head_dim], i64))
    for li, lay in enumerate(layers):
        scale = float(np.sqrt(head_dim * lay["factor"]))
        mkey = _signature(gr, lay["mask"], memo) + repr(lay["fill"])
        if mkey not in mask_bias:
            mask_bias[mkey] = node("Where", [lay["mask"], init(f"{pre}_mb{len(mask_bias)}_z", np.array(0, np.float32)),
                                             init(f"{pre}_mb{len(mask_bias)}_f", np.array(lay["fill"], np.float32))],
                                   f"{pre}_maskbias{len(mask_bias)}")
        ic, ip = expanded_index(lay["c2p"][1], lay["p2c"][1], lay["mask"])
        terms = []
        for kind, src, ((table, _), _) in (("c2p", lay["q"], lay["c2p"]), ("p2c", lay["k"], lay["p2c"])):
            split = node("Reshape", [src, heads_shape], f"{pre}{li}_{kind}_split")  # (B, S, N, d)
            inv = init(f"{pre}{li}_{kind}_inv_scale", np.array(1.0 / scale, np.float32))
            # the pos tables (N, R, d) reach the MatMuls through Transpose/Mul nodes (ONNX Runtime folds them when
            # the session loads), not as initializers: the int8 quantizer must leave these MatMuls alone as it
            # left the export's (a per-head 3-D weight has no int8 kernel); plain MatMul keeps the graph readable
            # for the symbolic shape inference fp16 conversion relies on
            if kind == "c2p":  # (B, N, S, d) x (N, d, R) -> (B, N, S, R), gathered along R
                heads = node("Transpose", [split], f"{pre}{li}_c2p_heads", perm=[0, 2, 1, 3])
                pos = node("Mul", [node("Transpose", [table], f"{pre}{li}_c2p_posT", perm=[0, 2, 1]), inv],
                           f"{pre}{li}_c2p_pos")
                scores = node("MatMul", [heads, pos], f"{pre}{li}_c2p_mm")
                terms.append(node("GatherElements", [scores, ic], f"{pre}{li}_c2p_gather", axis=3))
            else:  # (N, R, d) x (B, N, d, S) -> (B, N, R, S), gathered along R: no transpose of the result
                heads = node("Transpose", [split], f"{pre}{li}_p2c_heads", perm=[0, 2, 3, 1])
                pos = node("Mul", [table, inv], f"{pre}{li}_p2c_pos")
                scores = node("MatMul", [pos, heads], f"{pre}{li}_p2c_mm")
                terms.append(node("GatherElements", [scores, ip], f"{pre}{li}_p2c_gather", axis=2))
        bias = node("Add", [node("Add", terms, f"{pre}{li}_rel"), mask_bias[mkey]], f"{pre}{li}_bias")
        new_nodes.append(helper.make_node("MultiHeadAttention", [lay["q"], lay["k"], lay["v"], "", "", bias],
                                          [lay["out"]], name=f"{pre}{li}_mha", domain=_MS,
                                          num_heads=num_heads, scale=1.0 / scale))

    # drop the replaced nodes (whatever now feeds nothing), then append the new ones in a valid order
    replaced_outputs = {lay["out"] for lay in layers}
    kept = [n for n in gr.g.node if not (set(n.output) & replaced_outputs)]
    del gr.g.node[:]
    gr.g.node.extend(kept)
    gr.g.initializer.extend(new_inits)
    gr.g.node.extend(new_nodes)
    topological_sort(gr.g)
    remove_dead_nodes(model)
    if not any(o.domain == _MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS, 1))
    return {"MultiHeadAttention": len(layers)}
