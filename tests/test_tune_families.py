"""`bertopt tune` on every family and task head (tiny random models): a winner that passes the gate, written as an
artifact with its tune record, and the report beside it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tune_checks import TEXTS, check_reports

from bertopt.artifact import Artifact
from bertopt.cosine import cosine_rows
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.tiny_models import FAMILY_FIXTURES, build_tiny_family_model

CASES = [(family, "embedding") for family in FAMILY_FIXTURES] + [
    ("roberta", "classification"), ("xlm-roberta", "token-classification"), ("electra", "rerank"),
    ("distilbert", "sparse-embedding")]
STATUSES = {"passed", "failed", "refused", "not built", "skipped"}


@pytest.mark.parametrize("family,task", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_tune_picks_a_winner_that_passes(family, task, tmp_path, cli):
    hf = build_tiny_family_model(tmp_path / "hf", family, task)
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", hf, "--out", out, "--max-texts", "16", "--rounds", "1")
    assert code == 0, err + stdout
    art = Artifact.load(out)  # every file's hash checks
    record = art.manifest["tune"]
    assert record["task"] == task and art.model_info["task"] == task
    by_name = {c["name"]: c for c in record["candidates"]}
    winner = by_name[record["winner"]]
    assert winner["status"] == "passed" and winner["texts_per_s"] > 0
    assert art.runtime == winner["runtime"]
    # every candidate has a status, and one that did not pass says why (one line)
    for c in record["candidates"]:
        assert c["status"] in STATUSES
        if c["status"] != "passed":
            assert c["reason"] and "\n" not in c["reason"]
            assert f"{c['name']}: " in stdout  # and the user was told
    # the winner is the fastest that passed
    passed = [c for c in record["candidates"] if c["status"] == "passed"]
    assert winner["texts_per_s"] == max(c["texts_per_s"] for c in passed)
    # the gate's measured batch deviation sits where validate records it (the served-equals-validated bound)
    measured = art.manifest["validation"]["batch_invariance"]
    assert measured["measured_by"] == "validate" and measured["batch_dev"] <= 1e-3 and measured["invariant"]
    assert measured["bound"] == 1e-3 and winner["batch_dev"] == measured["batch_dev"]  # every output is bounded
    assert art.manifest["validation"]["gate"]["passed"] is True
    assert record["machine"]["cpu_features"] == sorted(record["machine"]["cpu_features"])
    check_reports(tmp_path / "tuned-report", record)
    # independently of the gate: the written artifact agrees with the original model
    pred = Predictor(art)
    ref = hf_reference(hf)
    pairs = TEXTS[1:] + TEXTS[:1] if task == "rerank" else None
    got = pred.run(TEXTS, pairs)[pred.primary_output]
    want = ref.run(TEXTS, pairs)[pred.primary_output]
    # (other texts than the gate's: a winner at the gate's 0.99 token agreement may sit a little below it here)
    if task == "token-classification":
        assert np.mean(np.concatenate([g.argmax(-1) == w.argmax(-1) for g, w in zip(got, want)])) >= 0.95
    elif task == "rerank":
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 0.05
    else:
        assert cosine_rows(np.asarray(got), np.asarray(want)).min() >= 0.99
    assert json.loads((out / "bertopt.json").read_text())["tune"]["winner"] == record["winner"]
