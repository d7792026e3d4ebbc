"""What several stages share: checking the staged (not yet renamed) artifact against its parent."""

from __future__ import annotations

from typing import Any

from bertopt.artifact import Artifact


def check_against(writer, reference: Artifact, texts: list[str], outputs: list[str] | None = None,
                  threads: int | None = None) -> dict[str, Any]:
    """Run ``texts`` through the staged model and ``reference``; return per-output accuracy stats."""
    from bertopt.runtime import Predictor
    from bertopt.validate.compare import compare_runs

    new = Predictor(writer.staged(), provider="cpu", threads=threads)
    old = Predictor(reference, provider="cpu", threads=threads, verify=False)
    names = outputs or [o for o in new.output_names if o in old.output_names]
    got, ref = new.run(texts, outputs=names), old.run(texts, outputs=names)
    kinds = {o["name"]: o.get("kind", "embedding") for o in reference.outputs}
    return compare_runs(got, ref, kinds)


def worst_abs_diff(stats: dict[str, dict]) -> float:
    return max((s.get("max_abs", float("inf")) for s in stats.values()), default=0.0)


def require_onnx_artifact(input, stage: str) -> Artifact:
    from bertopt.errors import UserError

    if not isinstance(input, Artifact):
        raise UserError(f"{stage} takes a bertopt artifact; turn {input.path} into one first with "
                        f"'bertopt export {input.spec} --out DIR'")
    return input
