"""Terminal output shared by commands: the consoles (standard output, standard error) and tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

# emoji=False: a path or host a user typed (":fire:", "a:b:5555") is printed as typed, never as an emoji
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


def whole_cells(table, console):
    """``table`` laid out so that no cell is cut on ``console``: on an 80-column console Rich cuts cells to fit
    ("onnxruntime…" for two different candidates, "2.0…" for a speed-up). Where the natural layout is too wide,
    every column gets a fixed width, at least its widest cell, and the headers fold onto more lines; where even the
    cells do not fit, they fold too. Call it after the rows are added."""
    from rich.padding import Padding
    from rich.text import Text

    def width(text) -> int:
        return Text.from_markup(text).cell_len if isinstance(text, str) else 0

    def longest(text, split) -> int:
        return max((width(part) for part in split(text)), default=0) if isinstance(text, str) else 0

    columns = table.columns
    cells = [max([width(c) for c in col.cells] + [1]) for col in columns]
    natural = [max(c, longest(col.header, str.splitlines)) for c, col in zip(cells, columns)]
    words = [max(c, longest(col.header, str.split)) for c, col in zip(cells, columns)]
    _, right, _, left = Padding.unpack(table.padding)
    room = console.width - len(columns) * (left + right) - (len(columns) + 1)  # cell padding, then the rules
    if sum(natural) <= room:
        return table
    if sum(cells) > room:  # too narrow for the cells themselves: fold them rather than cut them
        for col in columns:
            col.overflow = "fold"
        return table
    widths = list(words if sum(words) <= room else cells)
    spare = room - sum(widths)
    for goal in (words, natural):  # spare room: whole header words first, then whole headers, left to right
        for i in range(len(columns)):
            need = goal[i] - widths[i]
            if 0 < need <= spare:
                widths[i], spare = goal[i], spare - need
    for col, w in zip(columns, widths):
        col.width, col.overflow = w, "fold"
    return table


def print_recipe_summary(result, console) -> None:
    from rich.table import Table

    folder = result.final.path.parent
    table = Table(title=f"recipe {result.recipe.name} (artifacts in {folder})", title_justify="left")
    for col in ("stage", "artifact", "precision", "size MB", "nodes", "time s", "notes"):
        table.add_column(col)
    for art in result.artifacts:
        lin = art.lineage
        rep = lin.get("report", {})
        nodes = rep.get("after", {}).get("nodes", "")
        notes = ""
        if rep.get("fused_ops"):
            notes = ", ".join(f"{k}x{v}" for k, v in rep["fused_ops"].items())
        elif "max_abs_diff_vs_pytorch" in rep:
            notes = f"max|diff| vs PyTorch {rep['max_abs_diff_vs_pytorch']:.2g}"
        elif rep.get("kept_fp32_nodes"):
            notes = f"{len(rep['kept_fp32_nodes'])} nodes kept fp32"
        table.add_row(lin.get("stage", ""), art.path.name, art.precision, f"{art.size_bytes() / 1e6:.1f}",
                      str(nodes), f"{lin.get('wall_time_s', 0):.1f}", notes)
    console.print(whole_cells(table, console))
    for art in result.artifacts:  # what a stage decided for the user (an import's appended pooling) is said
        for note in art.lineage.get("report", {}).get("notes") or []:
            console.print(f"{art.lineage.get('stage', '')} [yellow]note[/]: {escape(note)}")
    cmp = result.comparison
    if cmp:
        t = Table(title=f"{result.final.path.name} vs the original ({cmp['reference']['framework']}) on the "
                  f"built-in corpus, {cmp['texts']} texts", title_justify="left")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for name, s in cmp["accuracy"].items():
            if "cos_mean" in s and s.get("kind") == "embedding":
                t.add_row(f"{name} cosine mean", f"{s['cos_mean']:.6f}")
                t.add_row(f"{name} cosine min", f"{s['cos_min']:.6f}")
                t.add_row(f"{name} neighbour agreement@10", f"{s.get('neighbour_agreement_at_10', float('nan')):.3f}")
            t.add_row(f"{name} max abs diff" + (" (real tokens)" if s.get("kind") == "token" else ""),
                      f"{s['max_abs']:.3g}")
            for metric in ("top1_agreement", "max_prob_diff", "token_label_agreement", "entity_f1", "ndcg_at_10",
                           "spearman", "term_overlap_at_10"):  # the task's own fidelity figures
                if metric in s:
                    t.add_row(f"{name} {metric.replace('_', ' ')}", f"{s[metric]:.4f}")
            if s.get("nan_or_inf"):
                t.add_row(f"{name} NaN/Inf", str(s["nan_or_inf"]))
        tp = cmp["throughput"]
        t.add_row("original texts/s (batch 32)", f"{tp['reference_texts_per_s']:.1f}")
        t.add_row("artifact texts/s (batch 32)", f"{tp['artifact_texts_per_s']:.1f}")
        t.add_row("speedup", f"{tp['speedup']:.2f}x")
        console.print(whole_cells(t, console))
    console.print(f"[bold]final artifact:[/] {result.final.path}")
    if result.validation is not None:
        status = "[green]PASSED[/]" if result.validation["passed"] else "[red]FAILED[/]"
        console.print(f"gate {status}: reports in {result.validation.get('report_dir')}")
