"""Outlier handling before dynamic int8: graph rewrites that leave the fp32 function unchanged but give ONNX
Runtime's int8 kernels narrower activation ranges.

ONNX Runtime's dynamic int8 quantises a MatMul's activation with ONE scale per batch matrix. In BERT two kinds of
outliers then crush ordinary values into a few int8 levels:

- per channel: a few hidden channels (LayerNorm outputs) run 5-15x the median. SmoothQuant-style smoothing
  (``smooth_model``) divides them out of the activation and folds them into the weight rows:
  ``s_j = max|X_j|^alpha / max|W_j,:|^(1-alpha)``, ``X @ W == (X * (1/s)) @ (diag(s) W)``;
- per token: the first token ([CLS]) reaches 20-30 where the others stay under 5-10, and any outlier token of any
  text in the batch sets the scale for all. ``split_first_token`` computes position 0 in fp32;
  ``per_token_scaling`` divides each row by its max before the int8 MatMul and multiplies it back.

Activation maxima come from a copy of the model with the MatMul inputs added as graph outputs, run one sentence at
a time (no padding, so [PAD] positions never widen a maximum). ``prepare_for_int8`` applies what the config asks
and checks the rewritten fp32 graph against the original.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bertopt.params import Param

ROLES = ("attention", "ffn-in", "ffn-out", "other")
# the options of the ONNX Runtime int8 methods (dynamic and static) that switch these rewrites on
SMOOTH_ALPHA = Param("smooth_alpha", float, None, "SmoothQuant-style smoothing strength (0-1, e.g. 0.5): activation "
                     "outlier channels measured on the calibration text are divided out and folded into the weight "
                     "rows before quantising (same function in fp32). Default: off.", min=0.0, max=1.0)
SMOOTH_ROLES = Param("smooth_roles", list, ["attention", "ffn-in"], "With --smooth-alpha: which operators to smooth: "
                     "attention (fused QKV), ffn-in, ffn-out (the GELU-fed down-projection), other (unfused QKV, "
                     "attention output).")
FIRST_TOKEN_FP32 = Param("first_token_fp32", bool, False, "Compute the first token ([CLS], whose activations dwarf "
                         "the others') of the FFN MatMuls in fp32, so the int8 activation range fits the ordinary "
                         "tokens.")
OUTLIER_PARAMS = (SMOOTH_ALPHA, SMOOTH_ROLES, FIRST_TOKEN_FP32)
# ops whose output is a GELU activation: fused (ORT transformers optimizer) or an exported exact GELU (has an Erf)
_GELU_OPS = ("Gelu", "BiasGelu", "FastGelu", "QuickGelu")
_WEIGHT_OPS = ("MatMul", "Gemm", "Attention", "MatMulInteger", "QAttention")
ROW_NORMALIZE_SUFFIX = "_RowNormalize"  # the Div of per_token_scaling; GPTQ traces it back to the raw rows


def _near_gelu(start: str, step, limit: int = 4) -> bool:
    """Whether a GELU (fused op or an Erf of an exported one) is within ``limit`` nodes of ``start``, walking with
    ``step(name) -> [(node, next names)]`` (upstream or downstream)."""
    frontier, seen = [(start, 0)], set()
    while frontier:
        name, depth = frontier.pop(0)
        for node, nexts in step(name):
            if node.op_type in _GELU_OPS or node.op_type == "Erf":
                return True
            # a GELU behind another weight MatMul belongs to that MatMul (the attention output projection reaches
            # the next FFN's GELU through SkipLayerNormalization and the FFN input MatMul)
            if node.op_type in _WEIGHT_OPS:
                continue
            if depth + 1 < limit and node.name not in seen:
                seen.add(node.name)
                frontier.extend((n, depth + 1) for n in nexts)
    return False


def node_roles(model) -> dict[str, str]:
    """Role of each weight MatMul / fused Attention: ``attention`` (fused QKV), ``ffn-in`` (feeds the GELU),
    ``ffn-out`` (fed by the GELU: the down-projection) or ``other`` (unfused QKV projections, attention output)."""
    from bertopt.onnx_graph.util import weight_matmuls

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def up(name):
        node = producers.get(name)
        return [(node, list(node.input))] if node is not None else []

    def down(name):
        return [(node, list(node.output)) for node in consumers.get(name, [])]

    roles = {}
    for node, _ in weight_matmuls(model):
        if node.op_type == "Attention":
            roles[node.name] = "attention"
        elif _near_gelu(node.input[0], up, 1) or (producers.get(node.input[0]) is not None
                                                   and producers[node.input[0]].op_type == "Mul"
                                                   and _near_gelu(node.input[0], up, 4)):
            roles[node.name] = "ffn-out"
        elif _near_gelu(node.output[0], down, 3):
            roles[node.name] = "ffn-in"
        else:
            roles[node.name] = "other"
    return roles


def probe_session(model, tensors: list[str], threads: int | None = None):
    """A runtime session of a copy of ``model`` that also outputs the intermediate ``tensors`` (calibration
    statistics: activation maxima, GPTQ's input correlations)."""
    import onnx

    from bertopt.runtime.backends import open_model

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in tensors:
        if name not in existing:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return open_model(probe, provider="cpu", threads=threads)


def probed_activations(model, tensors: list[str], feeds_list: list[dict[str, np.ndarray]],
                       threads: int | None = None):
    """(tensor name, value) of each intermediate tensor in ``tensors``, for every feed in turn."""
    if not tensors:
        return
    session = probe_session(model, tensors, threads)
    for feeds in feeds_list:
        yield from zip(tensors, session.run(tensors, feeds))


def channel_absmax(model, feeds_list: list[dict[str, np.ndarray]], node_names: list[str],
                   skip_first_token: bool = False, threads: int | None = None) -> dict[str, np.ndarray]:
    """Per input channel max |X| of each named node's activation input over every feed (one sentence each);
    with ``skip_first_token`` position 0 ([CLS]) is left out."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    tensors = list(dict.fromkeys(nodes[n].input[0] for n in node_names))
    maxima: dict[str, np.ndarray] = {}
    for name, value in probed_activations(model, tensors, feeds_list, threads):
        value = np.abs(np.asarray(value, dtype=np.float32))
        rows = value.reshape(value.shape[0], -1, value.shape[-1]) if value.ndim == 3 else value[None]
        if skip_first_token and rows.shape[1] > 1:
            rows = rows[:, 1:]
        m = rows.reshape(-1, rows.shape[-1]).max(axis=0)
        maxima[name] = m if name not in maxima else np.maximum(maxima[name], m)
    return {n: maxima[nodes[n].input[0]] for n in node_names}


def smoothing_scales(act_max: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j,:|^(1-alpha), normalised to a geometric mean of 1 and clipped to 1/100..100
    of it, so a channel that was (nearly) silent on the calibration text cannot blow up on other text; channels
    with no signal keep s_j = 1."""
    w_max = np.abs(weight).max(axis=1).astype(np.float64)
    a = act_max.astype(np.float64)
    s = np.ones_like(a)
    live = (a > 0) & (w_max > 0)
    if live.any():
        s[live] = a[live] ** alpha / w_max[live] ** (1.0 - alpha)
        s[live] /= np.exp(np.log(s[live]).mean())
    return np.clip(s, 1e-2, 1e2).astype(np.float32)


def smooth_model(model, act_max: dict[str, np.ndarray], alpha: float) -> list[dict[str, Any]]:
    """Insert ``Mul(X, 1/s)`` before each node of ``act_max`` and scale its weight rows by ``s`` (in place).
    Returns one report row per smoothed node."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    rows = []
    new_nodes = []
    for node in graph.node:
        if node.name in act_max:
            weight_init = inits[node.input[1]]
            weight = numpy_helper.to_array(weight_init).astype(np.float32)
            s = smoothing_scales(act_max[node.name], weight, alpha)
            shared = uses[weight_init.name] > 1
            scaled = numpy_helper.from_array((weight * s[:, None]).astype(np.float32),
                                             name=f"{weight_init.name}_smoothed" if shared else weight_init.name)
            if shared:  # give this node its own scaled copy
                graph.initializer.append(scaled)
                node.input[1] = scaled.name
            else:
                weight_init.CopyFrom(scaled)
            inv = numpy_helper.from_array((1.0 / s).astype(np.float32), name=f"{node.name}_smooth_inv_scale")
            graph.initializer.append(inv)
            smoothed = f"{node.name}_smoothed_input"
            new_nodes.append(helper.make_node("Mul", [node.input[0], inv.name], [smoothed],
                                              name=f"{node.name}_Smooth"))
            node.input[0] = smoothed
            a = act_max[node.name]
            rows.append({"node": node.name, "op_type": node.op_type, "channels": int(len(s)),
                         "act_max": float(a.max()), "act_outlier_ratio": float(a.max() / max(np.median(a), 1e-12)),
                         "scale_min": float(s.min()), "scale_max": float(s.max())})
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    return rows


def split_first_token(model, names: set[str]) -> list[str]:
    """Compute position 0 ([CLS], whose activations are 5-10x every other token's in BERT) of each named MatMul
    in a separate fp32 MatMul, so the int8 MatMul's per-batch activation range is set by ordinary tokens:
    ``Y = Concat(X[:, :1] @ W, X[:, 1:] @ W)``. The int8 part keeps the node's name; returns the fp32 nodes' names
    (to exclude from quantisation)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(np.array(v, dtype=np.int64), name) for name, v in
                              (("bertopt_first_token_0", [0]), ("bertopt_first_token_1", [1]),
                               ("bertopt_first_token_axis", [1]), ("bertopt_first_token_end", [2 ** 62]))])
    new_nodes, fp32 = [], []
    for node in graph.node:
        if node.name not in names:
            new_nodes.append(node)
            continue
        n, x, w, y = node.name, node.input[0], node.input[1], node.output[0]
        new_nodes += [
            helper.make_node("Slice", [x, "bertopt_first_token_0", "bertopt_first_token_1", "bertopt_first_token_axis"],
                             [f"{n}_first_x"], name=f"{n}_SliceFirst"),
            helper.make_node("Slice", [x, "bertopt_first_token_1", "bertopt_first_token_end",
                                       "bertopt_first_token_axis"], [f"{n}_rest_x"], name=f"{n}_SliceRest"),
            helper.make_node("MatMul", [f"{n}_first_x", w], [f"{n}_first_y"], name=f"{n}_first_token"),
            helper.make_node("MatMul", [f"{n}_rest_x", w], [f"{n}_rest_y"], name=n),
            helper.make_node("Concat", [f"{n}_first_y", f"{n}_rest_y"], [y], name=f"{n}_Concat", axis=1)]
        fp32.append(f"{n}_first_token")
    del graph.node[:]
    graph.node.extend(new_nodes)
    return fp32


def per_token_scaling(model, names: set[str]) -> None:
    """Per-token activation scaling for dynamic int8: ONNX Runtime quantises a MatMul's activation with one scale
    for the whole batch, so one token's outlier (from any text in the batch) coarsens every other token. Each row
    is divided by its max |x| before the MatMul and the result multiplied back (exact in fp32):
    ``Y = ((X / r) @ W) * r`` with ``r = max(max_j |X_ij|, 1e-12)``."""
    from onnx import helper, numpy_helper

    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(1e-12, dtype=np.float32), "bertopt_per_token_eps"))
    new_nodes = []
    for node in graph.node:
        if node.name not in names:
            new_nodes.append(node)
            continue
        n, x, y = node.name, node.input[0], node.output[0]
        new_nodes += [helper.make_node("Abs", [x], [f"{n}_abs_x"], name=f"{n}_Abs"),
                      helper.make_node("ReduceMax", [f"{n}_abs_x"], [f"{n}_row_max0"], name=f"{n}_RowMax",
                                       axes=[-1], keepdims=1),
                      helper.make_node("Max", [f"{n}_row_max0", "bertopt_per_token_eps"], [f"{n}_row_max"],
                                       name=f"{n}_RowMaxFloor"),
                      helper.make_node("Div", [x, f"{n}_row_max"], [f"{n}_row_x"], name=f"{n}{ROW_NORMALIZE_SUFFIX}")]
        node.input[0] = f"{n}_row_x"
        node.output[0] = f"{n}_row_y"
        new_nodes += [node, helper.make_node("Mul", [f"{n}_row_y", f"{n}_row_max"], [y], name=f"{n}_RowRescale")]
    del graph.node[:]
    graph.node.extend(new_nodes)


def outlier_transforms_wanted(config) -> bool:
    return bool(config.get("smooth_alpha") is not None or config.get("first_token_fp32")
                or config.get("per_token"))


def prepare_for_int8(model, config, feeds: list[dict[str, np.ndarray]]):
    """Apply the configured outlier transforms (smoothing, first token in fp32, per-token scaling) to a copy of
    ``model``, measuring activations on ``feeds`` (calibration sentences, one each); checks the fp32 result still
    computes the same function. Returns (model, fp32 node names that must not be quantised, report)."""
    import onnx

    from bertopt.errors import UserError

    threads = config.get("threads")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    roles = node_roles(model)
    report: dict[str, Any] = {}
    split = ({n for n, r in roles.items() if r in ("ffn-in", "ffn-out")} if config.get("first_token_fp32")
             else set())
    if config.get("smooth_alpha") is not None:
        unknown = [r for r in config["smooth_roles"] if r not in ROLES]
        if unknown or not config["smooth_roles"]:
            raise UserError(f"'smooth_roles' must name roles among {', '.join(ROLES)}; got {config['smooth_roles']}")
        names = [n for n, r in roles.items() if r in config["smooth_roles"]]
        if not names:
            raise UserError(f"no operator has a role in {config['smooth_roles']} to smooth; use --smooth-roles with "
                            f"some of {', '.join(ROLES)}")
        whole = channel_absmax(model, feeds, [n for n in names if n not in split], threads=threads)
        rest = channel_absmax(model, feeds, [n for n in names if n in split], skip_first_token=True,
                              threads=threads)
        rows = smooth_model(out, {**whole, **rest}, config["smooth_alpha"])
        report["smoothing"] = {"alpha": config["smooth_alpha"], "roles": list(config["smooth_roles"]),
                               "calibration_texts": len(feeds), "smoothed": rows}
    fp32_nodes = split_first_token(out, split) if split else []
    if split:
        report["first_token_fp32"] = sorted(split)
    if config.get("per_token"):
        names = {n for n, r in roles.items() if r != "attention"}
        per_token_scaling(out, names)
        report["per_token"] = sorted(names)
    report["fp32_max_change"] = _fp32_change(model, out, feeds[:16], threads)
    change = report["fp32_max_change"]
    if not change <= 1e-3:
        raise UserError(f"the outlier transforms changed the fp32 model's outputs by {change:.3g}; lower "
                        "--smooth-alpha or turn smoothing off")
    return out, fp32_nodes, report


def _fp32_change(before, after, feeds, threads: int | None = None) -> float:
    """Largest difference of any output between two fp32 graphs on ``feeds``, absolute for outputs within +-1
    (embeddings) and relative to the output's largest magnitude otherwise (hidden states reach 10-50)."""
    from bertopt.runtime.backends import open_model

    sessions = [open_model(m, provider="cpu", threads=threads) for m in (before, after)]
    worst = 0.0
    for f in feeds:
        a, b = (s.run(s.output_names, f) for s in sessions)
        worst = max([worst] + [float(np.abs(x - y).max()) / max(1.0, float(np.abs(x).max()))
                                for x, y in zip(a, b)])
    return worst
