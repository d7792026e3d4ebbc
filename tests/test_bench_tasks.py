"""``bertopt bench`` records each task's own fidelity figures (top-1, entity F1, NDCG, term overlap) next to the
cosine, and prints them. (Speed itself is measured in benchmarks/, never asserted.)"""

from __future__ import annotations

import pytest

from bertopt.bench import Contender, Settings, measure, print_results, task_figures
from bertopt.registry import run_stage
from bertopt.runtime import Predictor

TASK_FIGURES = {"classification": ("top1_agreement", "max_prob_diff"),
                "token-classification": ("token_label_agreement", "entity_f1"),
                "rerank": ("ndcg_at_10", "spearman"), "sparse-embedding": ("term_overlap_at_10",)}


@pytest.mark.parametrize("task", list(TASK_FIGURES))
def test_bench_records_the_task_figures(task_artifact, tmp_path, task):
    from rich.console import Console

    _, art = task_artifact(task)
    int8 = run_stage("quantize", art, {"mode": "int8-dynamic"}, tmp_path / "int8")
    fp32 = Contender("fp32", Predictor(art, batch_size=4))
    contenders = [fp32, Contender("int8", Predictor(int8, batch_size=4))]
    s = Settings(batch_size=4, seq_len=24, latency_seq_len=8, padded_texts=8, mixed_texts=8, latency_calls=2,
                 rounds=1, corpus_texts=48)
    results = measure(contenders, s, reference=fp32)
    exact, quantized = results[0]["fidelity"]["task"], results[1]["fidelity"]["task"]
    assert exact["task"] == quantized["task"] == task
    for metric in TASK_FIGURES[task]:
        assert exact[metric] == pytest.approx(0.0 if metric == "max_prob_diff" else 1.0)
        assert 0.0 <= quantized[metric] <= 1.0
    assert any(quantized[m] != pytest.approx(exact[m], abs=1e-9) for m in TASK_FIGURES[task])
    console = Console(width=80, record=True)  # a plain terminal: every figure shown whole, none cut
    print_results(results, s, "bench", console)
    shown = console.export_text()
    assert "…" not in shown
    for r in results:
        assert task_figures(r["fidelity"]) in shown
        cos_min = r["fidelity"]["corpus"].get("cos_min", float("nan"))  # a rerank score has no cosine
        assert f"{r['padded_texts_per_s']:.1f}" in shown and f"{cos_min:.6f}" in shown
    assert "F1" in shown if task == "token-classification" else "top1" in shown or "ndcg" in shown or "terms" in shown


def test_bench_cli_reference_prints_and_records_the_task_figures(task_artifact, tmp_path, cli):
    import json

    _, art = task_artifact("token-classification", "roberta")
    out = tmp_path / "bench.json"
    code, stdout, err = cli("bench", art.path, "--rounds", "1", "--texts", "8", "--mixed-texts", "8",
                            "--latency-calls", "2", "--batch-size", "4", "--seq-len", "24", "--latency-seq-len", "8",
                            "--reference", "--corpus-texts", "24", "--json", out)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    task = rows["art"]["fidelity"]["task"]
    assert task["task"] == "token-classification"
    assert task["entity_f1"] == pytest.approx(1.0, abs=1e-3)  # the fp32 export against PyTorch with its head
    assert "F1" in stdout and f"{task['entity_f1']:.3f}" in stdout  # the task column (the table may wrap it)
