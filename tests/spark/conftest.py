"""One local[2] Spark session for the whole folder (start-up costs ~7 s), and tiny artifacts to run in it."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def spark():
    from bertopt.spark.session import get_session

    session = get_session("local[2]", app_name="bertopt-tests", conf={"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory):
    """A tiny random BERT sequence classifier (3 labels) exported to ONNX."""
    from bertopt.registry import run_stage
    from bertopt.tiny_models import build_tiny_hf_bert

    hf = build_tiny_hf_bert(tmp_path_factory.mktemp("tiny-cls-hf") / "model", classifier=True, seed=1)
    return run_stage("export", hf, {}, tmp_path_factory.mktemp("tiny-cls") / "art")


@pytest.fixture
def fresh_copy(tmp_path):
    """A private copy of an artifact: a path no Python worker has loaded yet (the cache is keyed by path)."""

    def copy(artifact, name: str = "copy"):
        from bertopt.artifact import Artifact

        dest = tmp_path / name
        shutil.copytree(artifact.path, dest)
        return Artifact.load(dest)

    return copy

