"""The task contract (``bertopt.tasks``): one list of tasks and their older names, read by every surface."""

from __future__ import annotations

import pytest

from bertopt.errors import UserError
from bertopt.runtime.tasks import task_output
from bertopt.tasks import FIDELITY_METRIC_TASK, TASKS, canonical_task, known_task, task_spec


@pytest.mark.parametrize("old, task", [
    ("sentence-embedding", "embedding"), ("encoder", "embedding"), ("classifier", "classification"),
    ("token-classifier", "token-classification"), ("ner", "token-classification"), ("cross-encoder", "rerank"),
    ("splade", "sparse-embedding")])
def test_every_older_name_is_read_by_both_the_strict_and_the_lenient_reader(old, task):
    assert canonical_task(old) == task
    assert known_task(old) == task


def test_an_unknown_task_is_one_line_naming_the_tasks():
    with pytest.raises(UserError, match="^unknown task 'summarization'; choose one of: embedding, classification, "
                                        "token-classification, rerank, sparse-embedding$"):
        canonical_task("summarization")
    assert known_task("summarization") is None
    assert canonical_task(None) == canonical_task("") == "embedding"


def test_each_fidelity_metric_belongs_to_the_task_that_declares_it():
    assert FIDELITY_METRIC_TASK == {"max_prob_diff": "classification", "token_label_agreement": "token-classification",
                                    "entity_f1": "token-classification", "ndcg_at_10": "rerank",
                                    "spearman": "rerank", "term_overlap_at_10": "sparse-embedding"}
    assert [task_spec(t).output_kind for t in TASKS] == ["embedding", "logits", "token-logits", "score", "sparse"]


def test_the_task_output_of_an_artifact_comes_from_the_contract(task_artifact):
    _, art = task_artifact("token-classification")
    assert task_output(art) == "logits"
    assert art.model_info["task"] == "token-classification"
