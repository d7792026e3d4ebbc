"""Metrics against the data's labels (``bertopt validate --label-column``): the labels read as class numbers of
the model, then accuracy and macro F1 of a classifier's predictions."""

from __future__ import annotations

from typing import Any

import numpy as np

from bertopt.errors import UserError


def label_indices(labels: list[Any], model_info: dict[str, Any], num_classes: int, source: str) -> np.ndarray:
    """The data's labels (class numbers, numeric strings or the model's label names) as class numbers; a label the
    model does not know is a ``UserError`` naming the row and the model's labels."""
    id2label = {int(k): str(v) for k, v in (model_info.get("id2label") or {}).items()}
    label2id = {v: k for k, v in id2label.items()}
    out = []
    for row, value in enumerate(labels, 1):
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if isinstance(value, str):
            if value not in label2id:
                known = ", ".join(label2id) or "none (the model records no label names; use class numbers)"
                raise UserError(f"{source}: row {row} has label {value!r}, which the model does not know "
                                f"(labels: {known}); use the model's label names or class numbers")
            value = label2id[value]
        if not isinstance(value, int) or not 0 <= value < num_classes:
            raise UserError(f"{source}: row {row} has label {value!r}; labels must be class numbers 0.."
                            f"{num_classes - 1} or the model's label names")
        out.append(value)
    return np.asarray(out, dtype=np.int64)


def label_metrics(pred: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy and macro F1 of predicted class numbers against the labels (``targets.LABEL_METRICS``)."""
    accuracy = float(np.mean(pred == labels)) if len(labels) else 0.0
    f1s = []
    for c in range(num_classes):
        tp = int(np.sum((pred == c) & (labels == c)))
        fp = int(np.sum((pred == c) & (labels != c)))
        fn = int(np.sum((pred != c) & (labels == c)))
        if tp + fp + fn == 0:
            continue  # a class neither predicted nor present does not count in the macro average
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": accuracy, "f1": float(np.mean(f1s)) if f1s else 0.0}
