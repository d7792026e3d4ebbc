"""What every tune test checks of a report folder: tune.json, the Markdown table, the HTML page with its plot."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from bertopt.data import corpus

TEXTS = [t for t in corpus() if t][:48]


def check_reports(report_dir: Path, record: dict) -> None:
    saved = json.loads((report_dir / "tune.json").read_text())
    assert saved["winner"] == record["winner"]
    assert [c["name"] for c in saved["candidates"]] == [c["name"] for c in record["candidates"]]
    markdown = (report_dir / "tune.md").read_text()
    assert "| candidate | status | texts/s |" in markdown
    for c in record["candidates"]:  # one row per candidate, with its status
        assert re.search(rf"^\| {re.escape(c['name'])} \| {c['status']} \|", markdown, re.M), c["name"]
    assert f"Winner: **{record['winner']}**" in markdown
    page = (report_dir / "tune.html").read_text()
    for c in record["candidates"]:  # a stage's measured decision on full batches is part of a candidate's speed
        if c.get("static_full_batch"):
            fate = "on" if c["static_full_batch"]["on"] else "off"
            assert f"- {c['name']}: {fate} ({c['static_full_batch']['why']})" in markdown, c["name"]
            assert f"<p>- {c['name']}: {fate} (" in page.split("</table>")[1], c["name"]  # under the table
    found = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert found, "the speed-vs-fidelity plot is embedded"
    assert base64.b64decode(found.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["winner"] in page
