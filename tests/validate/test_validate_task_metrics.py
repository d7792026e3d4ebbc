"""Each task's fidelity metric: the metric functions on known inputs, and ``bertopt validate`` gating an int8
artifact of each task against its fp32 original with those metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertopt.measure.fidelity import (
    classification_metrics,
    entity_f1,
    ndcg_at,
    rerank_metrics,
    rerank_pairs,
    spearman,
    term_overlap,
)


# -- the metrics on inputs whose answer is known ------------------------------------------------------------
def test_ndcg_is_one_for_the_same_order_and_drops_when_the_top_moves():
    ref = np.array([0.9, 0.1, 0.5, 0.3])
    assert ndcg_at(ref * 2 + 1, ref) == pytest.approx(1.0)  # any monotone map keeps the order
    swapped = np.array([0.5, 0.1, 0.9, 0.3])  # the best and second best exchanged
    gains = np.array([4, 3, 2, 1]) / np.log2(np.arange(2, 6))
    want = (3 / np.log2(2) + 4 / np.log2(3) + 2 / np.log2(4) + 1 / np.log2(5)) / gains.sum()
    assert ndcg_at(swapped, ref) == pytest.approx(want)
    assert ndcg_at(-ref, ref) < want


def test_spearman_of_same_reversed_and_tied_orders():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a * 10) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert spearman(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(np.sqrt(3) / 2)


def test_rerank_metrics_group_rows_by_query():
    queries = ["q1"] * 3 + ["q2"] * 3
    ref = np.array([[3.0], [2.0], [1.0], [1.0], [2.0], [3.0]])
    got = ref.copy()
    got[3:] = -got[3:]  # q2 fully reversed, q1 intact
    m = rerank_metrics(queries, got, ref)
    assert m["rankings"] == 2
    assert m["spearman"] == pytest.approx(0.0)  # mean of 1 and -1
    assert 0.5 < m["ndcg_at_10"] < 1.0


def test_entity_f1_counts_exact_group_and_span_matches():
    want = [[{"entity_group": "PER", "start": 0, "end": 5}, {"entity_group": "LOC", "start": 9, "end": 12}], []]
    got = [[{"entity_group": "PER", "start": 0, "end": 5}, {"entity_group": "PER", "start": 9, "end": 12}],
           [{"entity_group": "LOC", "start": 1, "end": 2}]]
    assert entity_f1(got, want) == pytest.approx(2 * 1 / (3 + 2))
    assert entity_f1(want, want) == 1.0
    assert entity_f1([[]], [[]]) == 1.0


def test_term_overlap_and_probability_difference():
    ref = np.array([[0, 3, 2, 1, 0], [0, 0, 0, 0, 0]], dtype=np.float32)
    got = np.array([[0, 3, 0, 1, 2], [0, 0, 0, 0, 0]], dtype=np.float32)
    assert term_overlap(got, ref, k=2) == pytest.approx((1 / 2 + 1.0) / 2)  # {1,2} vs {1,4}; both empty
    logits = np.array([[2.0, 0.0], [0.0, 1.0]])
    m = classification_metrics(logits, logits[:, ::-1], {"problem_type": "single_label_classification"})
    assert m["top1_agreement"] == 0.0
    p = 1 / (1 + np.exp(-2.0))
    assert m["max_prob_diff"] == pytest.approx(2 * p - 1)


def test_rerank_pairs_from_plain_texts():
    texts = [f"t{i}" for i in range(12)]
    queries, passages = rerank_pairs(texts, queries=2, passages=3)
    assert list(zip(queries, passages)) == [("t0", "t2"), ("t0", "t3"), ("t0", "t4"),
                                            ("t1", "t2"), ("t1", "t3"), ("t1", "t4")]


# -- bertopt validate with task metrics -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def int8_of(task_artifact, tmp_path_factory):
    from bertopt.registry import run_stage

    made = {}

    def get(task):
        if task not in made:
            _, art = task_artifact(task)
            made[task] = (art, run_stage("quantize", art, {"mode": "int8-dynamic"},
                                         tmp_path_factory.mktemp(f"int8-{task}") / "art"))
        return made[task]

    return get


@pytest.mark.parametrize("task, targets, metrics", [
    ("classification", "top1_agreement=0.5,max_prob_diff<=0.5", ("top1_agreement", "max_prob_diff")),
    ("token-classification", "token_label_agreement=0.5,entity_f1=0.5", ("token_label_agreement", "entity_f1")),
    ("rerank", "ndcg_at_10=0.5,spearman=0.3", ("ndcg_at_10", "spearman")),
    ("sparse-embedding", "cos_min=0.9,term_overlap_at_10=0.5", ("cos_min", "term_overlap_at_10")),
])
def test_validate_gates_each_task_with_its_metric(cli, int8_of, tmp_path, task, targets, metrics):
    fp32, int8 = int8_of(task)
    report = tmp_path / "report"
    # the fp32 export against the original model with its head, in PyTorch (the lineage's reference)
    code, out, err = cli("validate", fp32.path, "--no-latency", "--max-texts", "48", "--targets", targets,
                         "--report-dir", tmp_path / "self")
    assert code == 0, out + err
    original = json.loads((tmp_path / "self" / "validation.json").read_text())
    assert original["reference"]["framework"] == "pytorch" and original["model_task"] == task
    same = original["metrics"]
    for m in metrics:
        assert same[m] == pytest.approx(0.0 if m == "max_prob_diff" else 1.0, abs=1e-4), m
    # int8 against fp32: measured, below exact, gated by the thresholds
    code, out, err = cli("validate", int8.path, "--reference", fp32.path, "--no-latency", "--max-texts", "48",
                         "--targets", targets, "--report-dir", report)
    result = json.loads((report / "validation.json").read_text())
    assert result["model_task"] == task
    assert code == (0 if result["passed"] else 1)
    measured = result["metrics"]
    assert all(m in measured for m in metrics)
    assert any(measured[m] != pytest.approx(same[m], abs=1e-9) for m in metrics), "int8 changed nothing?"
    # a threshold above what int8 reaches fails the gate (exit 1) and says which check failed
    worst = metrics[-1]
    strict = f"{worst}<={measured[worst] / 2:.6g}" if worst == "max_prob_diff" else f"{worst}={measured[worst] + 1e-3}"
    code, out, err = cli("validate", int8.path, "--reference", fp32.path, "--no-latency", "--max-texts", "48",
                         "--targets", strict, "--report-dir", report)
    assert code == 1
    assert worst in out + err


def test_rerank_on_plain_texts_ranks_query_groups(int8_of, tmp_path):
    from bertopt.validate.gate import validate_artifact

    fp32, int8 = int8_of("rerank")
    result = validate_artifact(int8, {"reference": str(fp32.path), "latency": False, "max_texts": 60},
                               tmp_path / "r", raise_on_fail=False)
    assert result["metrics"]["rankings"] == 16
    assert result["data"]["pairs"] is True and result["data"]["texts"] == 16 * 32


def test_a_metric_of_another_task_is_a_usage_error(cli, int8_of, tmp_path):
    fp32, _ = int8_of("classification")
    code, out, err = cli("validate", fp32.path, "--reference", fp32.path, "--no-latency", "--targets", "entity_f1=0.9",
                         "--report-dir", tmp_path / "r")
    assert code == 2
    assert "entity_f1 is measured for token-classification models; this artifact is a classification model" in err
    assert not (tmp_path / "r").exists()


def test_pairs_for_a_single_text_model_are_a_usage_error(cli, int8_of, tmp_path):
    fp32, _ = int8_of("classification")
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"text": "the cat", "pair": "a dog"}) for _ in range(4)) + "\n")
    code, out, err = cli("validate", fp32.path, "--reference", fp32.path, "--no-latency", "--data", data,
                         "--text-pair-column", "pair", "--report-dir", tmp_path / "r")
    assert code == 2
    assert "takes a single text, but text pairs were given" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_validate_help_names_the_task_metrics(cli):
    code, out, _ = cli("validate", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for metric in ("max_prob_diff", "token_label_agreement", "entity_f1", "ndcg_at_10", "spearman",
                   "term_overlap_at_10"):
        assert metric in flat.replace("│", "").replace(" ", "") or metric in flat


def test_run_comparison_carries_and_prints_the_task_figures(task_artifact):
    from rich.console import Console

    from bertopt.data import corpus
    from bertopt.terminal import print_recipe_summary
    from bertopt.validate.quick import compare_with_original

    _, art = task_artifact("rerank", "roberta")
    result = compare_with_original(art, texts=corpus()[:60])
    assert result["task"] == "rerank"
    stats = result["accuracy"]["logits"]
    assert stats["rankings"] == 16  # the first texts rank the next ones
    assert stats["ndcg_at_10"] == pytest.approx(1.0, abs=1e-3) and stats["spearman"] == pytest.approx(1.0, abs=1e-3)

    class Recipe:
        name = "t"

    class Result:
        recipe, artifacts, final, comparison, validation = Recipe(), [art], art, result, None

    console = Console(width=200, record=True)
    print_recipe_summary(Result(), console)
    shown = console.export_text()
    assert "logits ndcg at 10" in shown and "logits spearman" in shown
