"""Small ONNX graph helpers for the fusions: who produces and who reads a tensor, constants, clean-up."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any


class GraphIndex:
    """Producer and consumers of every tensor of ``model.graph`` at the time it was built."""

    def __init__(self, model):
        self.model = model
        self.inits = {i.name: i for i in model.graph.initializer}
        self._producer: dict[str, Any] = {}
        self._consumers: dict[str, list] = defaultdict(list)
        self.names: set[str] = set(self.inits) | {i.name for i in model.graph.input}
        for node in model.graph.node:
            self.names.add(node.name)
            for out in node.output:
                self._producer[out] = node
                self.names.add(out)
            for inp in node.input:
                self._consumers[inp].append(node)

    def producer(self, name: str):
        return self._producer.get(name)

    def consumers(self, name: str) -> list:
        return list(self._consumers.get(name, []))

    def reserve(self, name: str) -> None:
        self.names.add(name)

    def topological_sort(self) -> None:
        topological_sort(self.model.graph)


def topological_sort(graph) -> None:
    """Reorder ``graph.node`` so every node comes after the producers of its inputs (ONNX requires it)."""
    nodes = list(graph.node)
    # "" names an omitted optional input or output, not a tensor: it links no nodes
    made_by = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for src in {made_by[x] for x in node.input if x in made_by}:
            waiting[i] += 1
            readers[src].append(i)
    ready = deque(i for i, w in enumerate(waiting) if w == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(nodes[i])
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) != len(nodes):
        raise ValueError("the rewritten graph has a cycle")  # a fusion bug, not user input
    del graph.node[:]
    graph.node.extend(order)


def unique_name(index: GraphIndex, base: str) -> str:
    name, k = base, 0
    while name in index.names:
        k += 1
        name = f"{base}_{k}"
    index.reserve(name)
    return name


def transpose_perm(node) -> list[int] | None:
    from onnx import helper

    for a in node.attribute:
        if a.name == "perm":
            return list(helper.get_attribute_value(a))
    return None


def constant_array(inits: dict, producer, name: str):
    """The value of a constant tensor (an initializer in ``inits`` or a Constant node's ``value``), else None;
    ``producer(name)`` gives the node that makes a tensor."""
    from onnx import numpy_helper

    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producer(name)
    if node is None or node.op_type != "Constant":
        return None
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
    return None


def constant_scalar(index: GraphIndex, name: str) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    arr = constant_array(index.inits, index.producer, name)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(-1)[0])


def remove_dead_nodes(model) -> int:
    """Drop nodes none of whose outputs is read (by a node or as a graph output), and then unused initializers."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    removed = 0
    while True:
        read = outputs | {i for n in graph.node for i in n.input}
        dead = [n for n in graph.node if not any(o in read for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
        removed += len(dead)
    read = {i for n in graph.node for i in n.input} | outputs
    for init in [i for i in graph.initializer if i.name not in read]:
        graph.initializer.remove(init)
    return removed
