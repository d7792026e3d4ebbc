"""Each task's fidelity metric, artifact vs reference, from the two runs' raw outputs.

* classification: ``top1_agreement`` (same top class) and ``max_prob_diff`` (largest difference of any class
  probability, softmax or sigmoid as the task uses);
* token-classification: ``token_label_agreement`` (same label on every real, non-special token) and
  ``entity_f1`` (entities with the pipeline's simple aggregation; an entity counts when group, start and end
  all match);
* rerank: ``ndcg_at_10`` (the artifact's order scored with gains from the reference's order, per query) and
  ``spearman`` (rank correlation of the two score lists, per query, averaged);
* sparse-embedding: cosine (from ``compare``) and ``term_overlap_at_10`` (shared share of the 10 heaviest terms);
* embedding: cosine and ``neighbour_agreement_at_10`` (from ``compare``).

The reference ranks queries: rows are grouped by their first text (the query); when every query is distinct
the whole set is one ranking.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from bertopt.errors import UserError

RERANK_QUERIES = 16   # built-in data for a reranker: these many queries ...
RERANK_PASSAGES = 32  # ... each ranking the same passages


def rerank_pairs(texts: Sequence[str], queries: int = RERANK_QUERIES,
                 passages: int = RERANK_PASSAGES) -> tuple[list[str], list[str]]:
    """(query, passage) pairs from plain texts: the first texts as queries, each ranking the next ones."""
    texts = list(texts)
    if len(texts) < 3:
        raise UserError(f"a rerank model needs (query, passage) pairs; {len(texts)} text(s) cannot make them: give "
                        "a JSONL/CSV/Parquet file with --text-pair-column, or at least 3 texts")
    q = max(1, min(queries, len(texts) // 3))
    pool = texts[q:q + passages]
    return [t for t in texts[:q] for _ in pool], [p for _ in texts[:q] for p in pool]


def classification_metrics(got: np.ndarray, want: np.ndarray, model_info: dict[str, Any]) -> dict[str, float]:
    from bertopt.runtime.tasks import class_probabilities

    got, want = np.asarray(got), np.asarray(want)
    if not len(got):
        return {"top1_agreement": 1.0, "max_prob_diff": 0.0}
    pg, pw = class_probabilities(got, model_info), class_probabilities(want, model_info)
    return {"top1_agreement": float(np.mean(pg.argmax(1) == pw.argmax(1))),
            "max_prob_diff": float(np.max(np.abs(pg - pw)))}


def _entity_keys(entities: list[dict[str, Any]]) -> set[tuple]:
    return {(e.get("entity_group", e.get("entity")), e["start"], e["end"]) for e in entities}


def entity_f1(got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]]) -> float:
    """Micro F1 of exact entity matches (group, start, end); 1.0 when neither side finds an entity."""
    matched = found = expected = 0
    for g, w in zip(got, want):
        gk, wk = _entity_keys(g), _entity_keys(w)
        matched += len(gk & wk)
        found += len(gk)
        expected += len(wk)
    return 1.0 if found + expected == 0 else 2 * matched / (found + expected)


def token_metrics(predictor, texts: Sequence[str], got: list[np.ndarray], want: list[np.ndarray],
                  pairs: Sequence[str] | None = None) -> dict[str, float]:
    from bertopt.runtime.tasks import token_entities

    same = total = 0
    for enc, g, w in zip(predictor.tokenize(texts, pairs), got, want):
        real = ~np.asarray(enc.special_tokens_mask, dtype=bool)
        same += int(np.sum(g.argmax(-1)[real] == w.argmax(-1)[real]))
        total += int(real.sum())
    entities_got = token_entities(predictor, texts, got, aggregation="simple", pairs=pairs)
    entities_want = token_entities(predictor, texts, want, aggregation="simple", pairs=pairs)
    return {"token_label_agreement": same / total if total else 1.0,
            "entity_f1": entity_f1(entities_got, entities_want)}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), 0-based."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):
        tied = x == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = _ranks(np.asarray(a, dtype=np.float64)), _ranks(np.asarray(b, dtype=np.float64))
    if ra.std() == 0 or rb.std() == 0:
        return 1.0 if np.array_equal(ra, rb) else 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def ndcg_at(scores: np.ndarray, reference: np.ndarray, k: int = 10) -> float:
    """NDCG@k of the order ``scores`` gives, with graded gains from the reference order (best: n, next: n-1...)."""
    n = len(reference)
    ref_order = np.argsort(-reference, kind="stable")
    gain = np.empty(n)
    gain[ref_order] = np.arange(n, 0, -1, dtype=np.float64)
    discount = 1.0 / np.log2(np.arange(2, min(k, n) + 2))
    ideal = float(np.sum(gain[ref_order][:k] * discount))
    mine = float(np.sum(gain[np.argsort(-scores, kind="stable")][:k] * discount))
    return mine / ideal if ideal > 0 else 1.0


def rerank_metrics(queries: Sequence[str], got: np.ndarray, want: np.ndarray, k: int = 10) -> dict[str, float]:
    got = np.asarray(got, dtype=np.float64).reshape(len(queries), -1)[:, 0]
    want = np.asarray(want, dtype=np.float64).reshape(len(queries), -1)[:, 0]
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(queries):
        groups.setdefault(q, []).append(i)
    lists = [idx for idx in groups.values() if len(idx) > 1] or [list(range(len(queries)))]
    ndcg = [ndcg_at(got[idx], want[idx], k) for idx in lists]
    rho = [spearman(got[idx], want[idx]) for idx in lists]
    return {f"ndcg_at_{k}": float(np.mean(ndcg)), "spearman": float(np.mean(rho)), "rankings": len(lists)}


def term_overlap(got: np.ndarray, want: np.ndarray, k: int = 10) -> float:
    """Mean share of the reference's k heaviest terms that are also among the artifact's k heaviest."""
    got, want = np.asarray(got), np.asarray(want)
    shares = []
    for g, w in zip(got, want):
        kk = min(k, int(np.count_nonzero(w > 0)))
        if kk == 0:
            shares.append(1.0 if np.count_nonzero(g > 0) == 0 else 0.0)
            continue
        top_w = set(np.argsort(-w, kind="stable")[:kk].tolist())
        top_g = set(np.argsort(-g, kind="stable")[:kk].tolist())
        shares.append(len(top_w & top_g) / kk)
    return float(np.mean(shares)) if shares else 1.0


def task_fidelity(task: str, predictor, texts: Sequence[str], pairs: Sequence[str] | None, got, want
                  ) -> dict[str, float]:
    """The task's metrics for its output (``got`` the artifact's raw values, ``want`` the reference's)."""
    if task == "classification":
        return classification_metrics(got, want, predictor.model.model_info)
    if task == "token-classification":
        return token_metrics(predictor, texts, got, want, pairs)
    if task == "rerank":
        return rerank_metrics(texts, got, want)
    if task == "sparse-embedding":
        return {"term_overlap_at_10": term_overlap(got, want)}
    return {}
