"""Served = validated: the batch compositions the serving tests send, and the deviation they hold against the
artifact's recorded bound (``Artifact.served_deviation_bound()``), and the server's ``/metrics`` values."""

from __future__ import annotations


def batch_compositions(texts: list[str], seed: int = 0) -> list[list[int]]:
    """The same texts cut into other batches, as lists of indices into ``texts``: one at a time, in shuffled
    groups of 7 (other neighbours, other padding) and 32 at a time in order."""
    import random

    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    return ([[i] for i in range(len(texts))] + [order[s:s + 7] for s in range(0, len(order), 7)]
            + [list(range(s, min(s + 32, len(texts)))) for s in range(0, len(texts), 32)])


def served_deviation(got, want) -> float:
    """The largest 1 - cosine between matching rows of two outputs (what ``validate`` measures as batch_dev), to
    hold against ``Artifact.served_deviation_bound()``."""
    import numpy as np

    from bertopt.cosine import cosine_rows

    got, want = np.atleast_2d(np.asarray(got)), np.atleast_2d(np.asarray(want))
    if got.shape != want.shape:
        raise AssertionError(f"served shape {got.shape} != in-process shape {want.shape}")
    return float(np.max(1.0 - cosine_rows(got, want))) if len(got) else 0.0


def metric_value(metrics: str, name: str, **labels: str) -> float:
    """One series' value in a Prometheus text page (``/metrics``), labels in the order the server declares them;
    0 if absent."""
    series = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def encode_flood(client, texts: list[str], n: int, wait_s: float = 60) -> list:
    """``n`` encode requests of ``texts`` sent at once by bertopt's ``Client``; each outcome is the array or the
    ``ServerBusy`` the request was refused with (a full queue, ``--max-queued-requests``)."""
    from bertopt.client import ServerBusy

    futures = [client.encode_async(texts) for _ in range(n)]
    outcomes = []
    for fut in futures:
        try:
            outcomes.append(fut.result(wait_s))
        except ServerBusy as exc:
            outcomes.append(exc)
    return outcomes
