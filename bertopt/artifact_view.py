"""``bertopt inspect``: a Rich view of an artifact's manifest, lineage chain, size, ops and precision."""

from __future__ import annotations

from collections import Counter
from typing import Any


def op_histogram(artifact) -> dict[str, int]:
    if artifact.model_format != "onnx":
        return artifact.lineage.get("report", {}).get("after", {}).get("ops", {})
    import onnx
    from google.protobuf.message import DecodeError

    try:  # read as binary protobuf whatever the file's name (onnx guesses JSON or text from a suffix)
        model = onnx.load(str(artifact.model_path), format="protobuf", load_external_data=False)
    except (DecodeError, ValueError, OSError):
        return {"(not a readable ONNX graph)": 0}
    return dict(Counter(n.op_type for n in model.graph.node).most_common())


def render(artifact, console) -> None:
    from rich.table import Table
    from rich.tree import Tree

    m = artifact.manifest
    head = Table.grid(padding=(0, 2))
    head.add_row("artifact", str(artifact.path))
    head.add_row("digest", artifact.digest[:16])
    head.add_row("format / runtime", f"{artifact.model_format} / {artifact.runtime}")
    if m.get("runtime_options"):
        head.add_row("runtime options", ", ".join(f"{k}={v}" for k, v in m["runtime_options"].items()))
    head.add_row("precision", artifact.precision)
    head.add_row("size", f"{artifact.size_bytes() / 1e6:.1f} MB in {len(m['files'])} files")
    src = artifact.source
    head.add_row("source", f"{src.get('spec')} ({src.get('kind')}, {src.get('framework')})")
    info = artifact.model_info
    head.add_row("model", ", ".join(f"{k}={info[k]}" for k in ("task", "hidden_size", "num_hidden_layers",
                                                               "num_attention_heads", "max_seq_len") if k in info))
    head.add_row("batch invariance", batch_invariance_text(artifact))
    console.print(head)
    io = Table(title="inputs / outputs")
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for spec in artifact.inputs:
        io.add_row("in", spec["name"], str(spec.get("dtype", "")), str(spec.get("shape", "")))
    for spec in artifact.outputs:
        io.add_row("out", spec["name"], str(spec.get("dtype", "")), str(spec.get("shape", "")))
    console.print(io)
    tree = Tree("lineage (oldest first)")
    for step in artifact.history():
        params = _short(step.get("params") or {})
        tree.add(f"[bold]{step['stage']}[/] {params} -> {step.get('precision')} {step.get('digest', '')[:12]}")
    console.print(tree)
    ops = Table(title="ops by type")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in op_histogram(artifact).items():
        ops.add_row(op, str(n))
    console.print(ops)
    if m.get("validation"):
        console.print("validation: " + ", ".join(sorted(m["validation"])))


def batch_invariance_text(artifact) -> str:
    """Whether a text's output depends on what it is batched with, with the measured figure when there is one."""
    info = artifact.batch_invariance()
    if not info:
        return "not measured (run 'bertopt validate' to measure batch_dev)"
    dev = info.get("batch_dev")
    figure = f"batch_dev {dev:.3g} (1 - cosine, alone vs batches of " \
             f"{'/'.join(map(str, info.get('batch_sizes') or []))}), bound {info.get('bound', 1e-4):g}" \
        if isinstance(dev, (int, float)) else info.get("why", "declared by the stage that made it")
    return ("batch-invariant: " if info.get("invariant") else "BATCH-DEPENDENT: ") + figure


def _short(params: dict[str, Any]) -> str:
    items = [f"{k}={v}" for k, v in params.items() if v not in (None, [], "")]
    text = " ".join(items)
    return text if len(text) < 100 else text[:97] + "..."
