"""Gate reports, written together into one folder (a temporary sibling renamed into place, so a folder either
holds a complete report or the previous one):

* ``validation.json`` - everything measured, the config, package versions and machine info;
* ``junit.xml`` - one test case per check (a failed check is a ``<failure>``), for any CI's test view;
* ``summary.md`` - the checks, accuracy per output and the latency grid as Markdown tables;
* ``report.html`` - the same with PNG plots: latency per grid point and the error distributions.

``print_summary`` shows the checks as a Rich table in the terminal.
"""

from __future__ import annotations

import html
import json
import platform
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from bertopt.output_paths import write_json

_VERSION_PACKAGES = ("bertopt", "onnxruntime", "onnx", "numpy", "torch", "transformers", "tokenizers",
                     "tensorflow-cpu", "openvino", "pyspark", "matplotlib")


def package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in _VERSION_PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue  # not installed: nothing to record
    return versions


# -- writing --------------------------------------------------------------------------------------------
def write_reports(result: dict[str, Any], distributions: dict[str, dict[str, np.ndarray]], report_dir: Path) -> None:
    from bertopt.output_paths import move_into_place, sweep_stale, temp_sibling

    report_dir = Path(report_dir)
    report_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(report_dir)
    tmp = temp_sibling(report_dir)
    tmp.mkdir()
    try:
        result["error_histograms"] = _histograms(distributions)
        plots = _plots(result, distributions, tmp)
        result["plots"] = plots
        write_json(tmp / "validation.json", _jsonable(result))
        (tmp / "junit.xml").write_text(junit_xml(result), encoding="utf-8")
        (tmp / "summary.md").write_text(markdown_summary(result), encoding="utf-8")
        (tmp / "report.html").write_text(html_report(result), encoding="utf-8")
        move_into_place(tmp, report_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable instead of invalid
    if isinstance(value, Path):
        return str(value)
    return value


def _bins(values: np.ndarray, wanted: int) -> int:
    """``wanted`` bins, or one when the values span less than float resolution (an artifact compared with
    itself: cosines 1 +- 1e-16), where numpy cannot cut finite-sized bins."""
    if not values.size:
        return wanted
    return wanted if float(np.ptp(values)) > 1e-9 * max(1.0, float(np.max(np.abs(values)))) else 1


def _histograms(distributions) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, dist in distributions.items():
        out[name] = {}
        for key, values in dist.items():
            values = np.asarray(values, dtype=np.float64)
            values = values[np.isfinite(values)]
            if not values.size:
                continue
            counts, edges = np.histogram(values, bins=_bins(values, 30))
            out[name][key] = {"counts": counts.tolist(), "edges": edges.tolist(), "n": int(values.size)}
    return out


def _plots(result, distributions, folder: Path) -> dict[str, str]:
    """PNG plots; matplotlib (bertopt[report]) is imported here only, with the Agg backend."""
    try:
        import matplotlib
    except ImportError:
        return {"error": "matplotlib is not installed; install it with: pip install 'bertopt[report]'"}
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, str] = {}
    latency = result.get("latency")
    if latency and latency["grid"]:
        grid = latency["grid"]
        labels = [f"b{p['batch_size']}x{p['seq_len']}" for p in grid]
        x = np.arange(len(grid))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for offset, who in ((-0.2, "reference"), (0.2, "artifact")):
            p50 = [p[who]["p50_ms"] for p in grid]
            p99 = [p[who]["p99_ms"] for p in grid]
            ax1.bar(x + offset, p50, width=0.4, label=f"{who} p50")
            ax1.errorbar(x + offset, p50, yerr=[np.zeros(len(p50)), np.subtract(p99, p50)], fmt="none",
                         ecolor="black", capsize=3)
        ax1.set_xticks(x, labels)
        ax1.set_ylabel("ms per batch (bar p50, whisker p99)")
        ax1.set_yscale("log")
        ax1.legend()
        ax1.set_title("latency per grid point")
        ax2.bar(x, [p["speedup"] for p in grid], color="tab:green")
        ax2.axhline(1.0, color="black", linewidth=0.8)
        ax2.set_xticks(x, labels)
        ax2.set_ylabel("artifact / reference throughput")
        ax2.set_title("speedup")
        fig.tight_layout()
        fig.savefig(folder / "latency.png", dpi=90)
        plt.close(fig)
        plots["latency"] = "latency.png"
    if distributions:
        n = len(distributions)
        fig, axes = plt.subplots(n, 2, figsize=(11, 3.2 * n), squeeze=False)
        for row, (name, dist) in enumerate(distributions.items()):
            err = np.asarray(dist["abs_err"])
            err = err[np.isfinite(err)]
            ax = axes[row][0]
            if err.size:
                logs = np.log10(np.maximum(err, 1e-12))
                ax.hist(logs, bins=_bins(logs, 50), color="tab:blue")
            ax.set_title(f"{name}: log10 |artifact - reference|")
            ax.set_ylabel("count")
            ax = axes[row][1]
            if "cosine" in dist:
                cos = np.asarray(dist["cosine"])
                gaps = 1.0 - cos[np.isfinite(cos)]
                ax.hist(gaps, bins=_bins(gaps, 50), color="tab:orange")
                ax.set_title(f"{name}: 1 - cosine per input")
            else:
                ax.set_axis_off()
        fig.tight_layout()
        fig.savefig(folder / "errors.png", dpi=90)
        plt.close(fig)
        plots["errors"] = "errors.png"
    return plots


def junit_xml(result: dict[str, Any]) -> str:
    import xml.etree.ElementTree as ET

    checks = result["checks"]
    failures = sum(1 for c in checks if not c["passed"])
    name = Path(result["artifact"]["path"]).name
    suites = ET.Element("testsuites", name="bertopt validate", tests=str(len(checks)), failures=str(failures))
    suite = ET.SubElement(suites, "testsuite", name=f"bertopt.validate.{name}", tests=str(len(checks)),
                          failures=str(failures), errors="0", skipped="0", time=f"{result['wall_time_s']:.2f}")
    props = ET.SubElement(suite, "properties")
    for key, value in (("artifact", result["artifact"]["path"]), ("digest", result["artifact"]["digest"]),
                       ("reference", result["reference"]["framework"]), ("data", result["data"]["source"]),
                       ("texts", result["data"]["texts"])):
        ET.SubElement(props, "property", name=key, value=str(value))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=f"bertopt.validate.{name}", name=c["name"], time="0")
        if not c["passed"]:
            failure = ET.SubElement(case, "failure", message=c["message"], type="ThresholdMissed")
            failure.text = f"{c['name']}: {c['message']}"
        else:
            ET.SubElement(case, "system-out").text = c["message"]
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _accuracy_rows(result) -> list[list[str]]:
    rows = []
    for name, s in result["accuracy"].items():
        q = next((k for k in s if k.startswith("abs_err_p")), None)
        rows.append([name, s.get("kind", ""), _fmt(s.get("cos_mean")), _fmt(s.get("cos_p01")), _fmt(s.get("cos_min")),
                     _fmt(s.get("max_abs")), _fmt(s.get("mean_abs")), _fmt(s.get(q)) if q else "-",
                     _fmt(s.get("pass_fraction")), _fmt(s.get("neighbour_agreement_at_10")),
                     _fmt(s.get("top1_agreement")), _fmt(s.get("nan_or_inf"))])
    return rows


_ACC_HEAD = ["output", "kind", "cos mean", "cos p01", "cos min", "max abs", "mean abs", "abs err q", "pass frac",
             "NN agree@10", "top-1 agree", "NaN/Inf"]
_LAT_HEAD = ["batch", "tokens", "artifact p50 ms", "p90", "p99", "texts/s", "reference p50 ms", "reference p99",
             "reference texts/s", "speedup"]
# the terminal's columns (its header: the reports' header)
_LAT_TERMINAL = {"batch": "batch", "tokens": "tokens", "p50 ms": "artifact p50 ms", "p99 ms": "p99",
                 "texts/s": "texts/s", "reference p50 ms": "reference p50 ms", "reference texts/s": "reference texts/s",
                 "speedup": "speedup"}


def _latency_rows(result) -> list[list[str]]:
    lat = result.get("latency") or {}
    rows = []
    for p in lat.get("grid", []):
        a, r = p["artifact"], p["reference"]
        rows.append([str(p["batch_size"]), str(p["seq_len"]), f"{a['p50_ms']:.2f}", f"{a['p90_ms']:.2f}",
                     f"{a['p99_ms']:.2f}", f"{a['texts_per_s']:.1f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                     f"{r['texts_per_s']:.1f}", f"{p['speedup']:.2f}x"])
    return rows


def _md_table(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_summary(result: dict[str, Any]) -> str:
    verdict = "PASSED" if result["passed"] else "FAILED"
    art, ref = result["artifact"], result["reference"]
    parts = [f"# bertopt validate: {verdict}", "",
             f"- artifact: `{art['path']}` ({art['precision']}, {art['backend']} {art['provider']}, "
             f"digest `{art['digest'][:12]}`)",
             f"- reference: {ref['framework']} ({ref['spec']})",
             f"- data: {result['data']['source']}, {result['data']['texts']} texts",
             "", "## Checks", "",
             _md_table(["check", "measured", "result"],
                       [[c["name"], _fmt(c["measured"]), "pass" if c["passed"] else "**FAIL**"]
                        for c in result["checks"]]),
             "", "## Accuracy against the reference", "", _md_table(_ACC_HEAD, _accuracy_rows(result))]
    task = result.get("task")
    if task:
        parts += ["", "## Task metric", "",
                  _md_table(["model", "accuracy", "macro F1"],
                            [["artifact", _fmt(task["artifact"]["accuracy"]), _fmt(task["artifact"]["f1"])],
                             ["reference", _fmt(task["reference"]["accuracy"]), _fmt(task["reference"]["f1"])]])]
    if result.get("latency"):
        m = result["latency"]["metrics"]
        parts += ["", "## Latency", "", _md_table(_LAT_HEAD, _latency_rows(result)), "",
                  f"speedup (geometric mean) {m['speedup']:.2f}x, worst point {m['speedup_min']:.2f}x"]
    if result.get("default_targets"):
        parts += ["", f"No targets were given: {gated_by_default_line(result)}"]
    if result.get("batch_invariance"):
        parts += ["", "## Batch invariance", "", batch_invariance_line(result["batch_invariance"])]
    if result.get("spark"):
        s = result["spark"]
        parts += ["", "## Spark", "", f"max abs diff vs the runtime {_fmt(s.get('max_abs_diff'))}, "
                  f"{_fmt(s.get('rows'))} rows, {_fmt(s.get('rows_per_s'))} rows/s"]
    return "\n".join(parts) + "\n"


def _html_table(head, rows, classes=None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


def html_report(result: dict[str, Any]) -> str:
    verdict = "PASSED" if result["passed"] else "FAILED"
    art = result["artifact"]
    body = [f"<h1 class=\"{verdict.lower()}\">bertopt validate: {verdict}</h1>",
            f"<p>artifact <code>{html.escape(art['path'])}</code> ({html.escape(art['precision'])}) vs "
            f"{html.escape(result['reference']['framework'])} reference on "
            f"{html.escape(str(result['data']['source']))} ({result['data']['texts']} texts)</p>",
            "<h2>Checks</h2>",
            _html_table(["check", "measured", "result"],
                        [[c["name"], _fmt(c["measured"]), "pass" if c["passed"] else "FAIL"] for c in result["checks"]],
                        ["pass" if c["passed"] else "fail" for c in result["checks"]]),
            "<h2>Accuracy</h2>", _html_table(_ACC_HEAD, _accuracy_rows(result))]
    task = result.get("task")
    if task:
        body += ["<h2>Task metric</h2>",
                 _html_table(["model", "accuracy", "macro F1"],
                             [["artifact", _fmt(task["artifact"]["accuracy"]), _fmt(task["artifact"]["f1"])],
                              ["reference", _fmt(task["reference"]["accuracy"]), _fmt(task["reference"]["f1"])]])]
    plots = result.get("plots", {})
    if "errors" in plots:
        body.append(f'<img src="{plots["errors"]}" alt="error distributions">')
    if result.get("latency"):
        body += ["<h2>Latency</h2>", _html_table(_LAT_HEAD, _latency_rows(result))]
        if "latency" in plots:
            body.append(f'<img src="{plots["latency"]}" alt="latency per grid point">')
    if "error" in plots:
        body.append(f"<p>plots: {html.escape(plots['error'])}</p>")
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    body.append(f"<h2>Environment</h2><p>{html.escape(versions)}</p><p>"
                f"{html.escape(json.dumps(result['machine']))}</p>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}"
             ".fail td{background:#fdd}.pass td{background:#dfd}h1.failed{color:#b00}h1.passed{color:#070}"
             "img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>bertopt validate {verdict}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def print_summary(result: dict[str, Any], console) -> None:
    from rich.table import Table

    from bertopt.terminal import whole_cells

    table = Table(title=f"gate: {Path(result['artifact']['path']).name} vs {result['reference']['framework']} "
                  f"on {result['data']['texts']} texts", title_justify="left")
    for col in ("check", "measured", "needs", "result"):
        table.add_column(col, justify="right" if col in ("measured", "needs") else "left")
    for c in result["checks"]:
        table.add_row(c["name"], _fmt(c["measured"]), f"{c['op']} {c['threshold']:.10g}",
                      "[green]pass[/]" if c["passed"] else "[bold red]FAIL[/]")
    console.print(whole_cells(table, console))
    if result.get("latency"):
        # the terminal's table leaves out p90 and the reference's p99 (the report files keep them): the rest fits
        # 80 columns with every figure whole
        lat = Table(title="latency (ms per batch; p90 and the reference's p99 in the reports)", title_justify="left")
        for head in _LAT_TERMINAL:
            lat.add_column(head, justify="right")
        keep = [_LAT_HEAD.index(full) for full in _LAT_TERMINAL.values()]
        for row in _latency_rows(result):
            lat.add_row(*(row[i] for i in keep))
        console.print(whole_cells(lat, console))
    if result.get("default_targets"):
        console.print(f"no --targets given: {gated_by_default_line(result)}", highlight=False)
    if result.get("batch_invariance"):
        console.print(batch_invariance_line(result["batch_invariance"]), highlight=False)
    verdict = "[bold green]PASSED[/]" if result["passed"] else "[bold red]FAILED[/]"
    console.print(f"gate {verdict}: reports in {result['report_dir']} (validation.json, junit.xml, summary.md, "
                  "report.html)")


def gated_by_default_line(result: dict[str, Any]) -> str:
    kind = next((s.get("kind") for n, s in result["accuracy"].items() if n == result["primary_output"]), "")
    return (f"gated at the defaults for {kind or 'this'} outputs ({result['primary_output']}): "
            f"{result['default_targets']}; pass --targets to choose others")


def batch_invariance_line(batch: dict[str, Any]) -> str:
    verdict = "batch-invariant" if batch["invariant"] else "BATCH-DEPENDENT (a text's output changes with its batch)"
    shapes = " and ".join(f"{rows} x {tokens}" for rows, tokens in batch.get("full_batches") or [])
    full = f", full batches of {shapes} tokens" if shapes else ""
    return (f"batch invariance: batch_dev {batch['batch_dev']:.3g} (largest 1 - cosine, alone vs batches of "
            f"{'/'.join(map(str, batch['batch_sizes']))}{full}, {batch['texts']} texts): {verdict}, bound "
            f"{batch['bound']:g}")
