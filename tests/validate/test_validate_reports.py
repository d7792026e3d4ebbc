"""bertopt.validate.reports.print_summary: what the terminal shows of a gate run, on an 80-column console."""

from __future__ import annotations

import io

from rich.console import Console

from bertopt.validate.reports import print_summary


def _point(batch: int, seq: int, art_ms: float, ref_ms: float) -> dict:
    def side(ms):
        return {"p50_ms": ms, "p90_ms": ms * 1.04, "p99_ms": ms * 1.1, "texts_per_s": batch * 1000 / ms}

    return {"batch_size": batch, "seq_len": seq, "artifact": side(art_ms), "reference": side(ref_ms),
            "speedup": ref_ms / art_ms}


def test_the_latency_table_keeps_every_figure_whole_at_80_columns():
    grid = [_point(1, 16, 7.46, 15.06), _point(32, 16, 86.13, 91.57), _point(32, 128, 1234.56, 2345.67)]
    result = {"artifact": {"path": "/tmp/minilm-tuned"}, "reference": {"framework": "pytorch"},
              "data": {"texts": 320}, "passed": True, "report_dir": "/tmp/report", "latency": {"grid": grid},
              "checks": [{"name": "cos_min >= 0.99 (default)", "measured": 0.99999, "op": ">=", "threshold": 0.99,
                          "passed": True}]}
    console = Console(width=80, file=io.StringIO(), record=True)
    print_summary(result, console)
    lines = console.export_text().splitlines()
    text = "\n".join(lines)
    assert "…" not in text and max(map(len, lines)) <= 80
    for p in grid:
        for figure in (f"{p['speedup']:.2f}x", f"{p['artifact']['p50_ms']:.2f}", f"{p['artifact']['p99_ms']:.2f}",
                       f"{p['artifact']['texts_per_s']:.1f}", f"{p['reference']['p50_ms']:.2f}",
                       f"{p['reference']['texts_per_s']:.1f}"):
            assert figure in text, figure
    assert "gate PASSED" in text
