"""The comparison ``bertopt run`` prints after a recipe: final artifact vs the original model on the
built-in corpus (accuracy) and throughput at batch 32, measured alternately in the same process."""

from __future__ import annotations

from typing import Any

from bertopt.measure.compare import compare_runs
from bertopt.measure.fidelity import rerank_pairs, task_fidelity
from bertopt.measure.latency import measure_throughput


def compare_with_original(artifact, texts: list[str] | None = None, reference=None,
                          threads: int | None = None) -> dict[str, Any]:
    from bertopt.data import corpus
    from bertopt.runtime import Predictor
    from bertopt.validate.reference import reference_predictor

    texts = texts if texts is not None else corpus()
    art = Predictor(artifact, threads=threads, verify=False)
    ref = reference_predictor(artifact, reference, threads=threads)
    from bertopt.runtime.tasks import task_of, task_output

    names = [n for n in art.output_names if n in ref.output_names]
    kinds = artifact.output_kinds
    task = task_of(artifact)
    inputs, pairs = texts, None
    if task == "rerank":  # a cross-encoder scores pairs: the first texts rank the next ones
        inputs, pairs = rerank_pairs(texts)
    got, want = art.run(inputs, pairs, outputs=names), ref.run(inputs, pairs, outputs=names)
    accuracy = compare_runs(got, want, kinds)
    out = task_output(artifact, task)
    if out in accuracy and "error" not in accuracy[out]:
        accuracy[out].update(task_fidelity(task, art, inputs, pairs, got[out], want[out]))
    # alternate the two so a noisy neighbour hurts both alike
    tp_art, tp_ref = [], []
    for _ in range(2):
        tp_ref.append(measure_throughput(ref, texts, repeats=1))
        tp_art.append(measure_throughput(art, texts, repeats=1))
    result = {
        "data": "builtin corpus",
        "texts": len(texts),
        "task": task,
        "reference": ref.describe() | {"framework": ref.session.backend},
        "artifact": art.describe(),
        "accuracy": accuracy,
        "throughput": {"batch_size": 32, "reference_texts_per_s": max(tp_ref), "artifact_texts_per_s": max(tp_art),
                       "speedup": max(tp_art) / max(tp_ref)},
    }
    return result
