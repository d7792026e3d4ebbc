"""bertopt.terminal.whole_cells: a table printed on a narrow console keeps every cell whole (folds, never cuts)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from bertopt.terminal import whole_cells

NAMES = ["openvino-f32", "onnxruntime-fp32", "onnxruntime-int8", "openvino-int8-accurate"]


def _tune_like_table() -> Table:
    table = Table(title="tune")
    for col in ("candidate", "status", "texts/s", "cos min alone", "cos min batched", "batch dev"):
        table.add_column(col, justify="right" if col not in ("candidate", "status") else "left")
    for i, name in enumerate(NAMES):
        table.add_row(f"[bold green]{name}[/]" if i == 0 else name, "not built" if i % 2 else "passed", "80.6",
                      "0.99999", "0.99998", "3.7e-14")
    return table


def _render(table: Table, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(whole_cells(table, console))
    return console.export_text().splitlines()


def test_cells_stay_whole_where_rich_would_cut_them():
    plain = Console(width=80, file=io.StringIO(), record=True)
    plain.print(_tune_like_table())
    assert "onnxruntime…" in plain.export_text()  # what Rich does alone: two candidates read the same
    lines = _render(_tune_like_table(), 80)
    text = "\n".join(lines)
    assert "…" not in text and max(map(len, lines)) <= 80
    for name in NAMES:
        assert f"│ {name} " in text
    assert "3.7e-14" in text and "not built" in text


def test_too_narrow_for_the_cells_folds_them():
    lines = _render(_tune_like_table(), 40)
    assert "…" not in "\n".join(lines) and max(map(len, lines)) <= 40
    first_column = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert first_column.startswith("".join(NAMES[:2]))  # folded, every character kept in order


def test_a_table_that_fits_is_left_as_it_is():
    table = _tune_like_table()
    lines = _render(table, 120)
    assert all(col.width is None for col in table.columns)
    assert any("cos min alone" in line for line in lines)  # headers on one line
