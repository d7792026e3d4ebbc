"""The task contract, declared once: every task's name, the older names manifests and users may still give,
its primary output (name and kind), the transformers head its weights need, and its own fidelity metrics.

Families (``sources/hf.py`` reading a checkpoint), the runtime (``runtime/tasks.py``: the results of each task),
the artifact manifest (``artifact.canonical_model_info``), the messages of the front ends and validation all read
it; nothing else lists tasks. ``docs/tasks.md`` is its user-facing description.

This module is the bottom of the house: it imports nothing from bertopt except the error type.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertopt.errors import UserError


@dataclass(frozen=True)
class Task:
    name: str
    # older names (manifests written before the task contract, earlier spellings of --task); all still accepted
    synonyms: tuple[str, ...]
    # the output that carries the task's result, and its kind (the output kinds of docs/tasks.md)
    output: str
    output_kind: str
    # the transformers head class suffix the weights must have; None: the encoder alone (embedding)
    head: str | None
    # the fidelity metrics only this task measures on its output (beyond the per-output ones of
    # bertopt.measure.compare), usable as ``bertopt validate --targets``
    fidelity_metrics: tuple[str, ...] = ()
    # padded tokens per model call at most (None: the batch size alone bounds a call). A SPLADE head holds
    # [batch, tokens, vocabulary] float temporaries before its max-pool: one call of 32 texts x 512 tokens peaked
    # at 8.4 GB, calls of 4,096 tokens at 2.2 GB at the same speed (0.99-1.01x), 2,048 at 1.2 GB but 0.94x
    # (2-layer SPLADE, 30,522 terms, ONNX Runtime, 2 cores; benchmarks/sparse_batches.py)
    batch_tokens: int | None = None


TASK_SPECS: tuple[Task, ...] = (
    Task("embedding", ("sentence-embedding", "encoder"), "sentence_embedding", "embedding", None),
    Task("classification", ("classifier",), "logits", "logits", "ForSequenceClassification",
         ("max_prob_diff",)),
    Task("token-classification", ("token-classifier", "ner"), "logits", "token-logits", "ForTokenClassification",
         ("token_label_agreement", "entity_f1")),
    Task("rerank", ("cross-encoder",), "logits", "score", "ForSequenceClassification",
         ("ndcg_at_10", "spearman")),
    Task("sparse-embedding", ("splade",), "sparse_embedding", "sparse", "ForMaskedLM",
         ("term_overlap_at_10",), batch_tokens=4096),
)
# the task names, in the order help texts and errors list them
TASKS: tuple[str, ...] = tuple(t.name for t in TASK_SPECS)
# a manifest that names no task is an embedding model (artifacts made before tasks existed)
DEFAULT_TASK = "embedding"
# the most labels a classifier's head may have: each is named in the artifact's manifest (id2label, within its
# 16 MiB bound), and a config's num_labels of 10^10 built a ten-billion-entry label map (6.6 GB, then MemoryError)
MAX_LABELS = 65_536
MAX_LABEL_CHARS = 200  # a label's name

_BY_NAME = {t.name: t for t in TASK_SPECS}
_NAMES = {**{s: t.name for t in TASK_SPECS for s in t.synonyms}, **{t.name: t.name for t in TASK_SPECS}}
# fidelity metric -> the task that measures it
FIDELITY_METRIC_TASK: dict[str, str] = {m: t.name for t in TASK_SPECS for m in t.fidelity_metrics}
FIDELITY_METRICS: tuple[str, ...] = tuple(FIDELITY_METRIC_TASK)


def known_task(name: str | None) -> str | None:
    """The contract's name for ``name`` (a task or one of its older names), or None when it names no task.

    For readers that fall back on something else when a manifest's task is missing or unknown (``task_of``
    reads the outputs instead); everything that takes a task from a user calls ``canonical_task``."""
    if name is None:
        return None
    return _NAMES.get(str(name))


def canonical_task(name: str | None) -> str:
    """The contract's name for ``name``; no name is the default task (embedding). An unknown name is a
    ``UserError`` naming the tasks."""
    if not name:
        return DEFAULT_TASK
    task = known_task(name)
    if task is None:
        raise UserError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return task


def task_spec(name: str | None) -> Task:
    """The declaration of a task (any of its names)."""
    return _BY_NAME[canonical_task(name)]
