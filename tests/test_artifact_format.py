"""The artifact folder: manifest contents, hash verification, atomic writes, stages never touching their input."""

from __future__ import annotations

import json
import shutil

import pytest

from bertopt.artifact import MANIFEST_NAME, Artifact, ArtifactWriter, sha256_file
from bertopt.errors import ArtifactError, UserError


def test_manifest_records_format_io_precision_hashes_and_lineage(tiny_onnx):
    m = json.loads((tiny_onnx.path / MANIFEST_NAME).read_text())
    assert m["format_version"] == 1
    assert m["model_format"] == "onnx"
    assert m["precision"] == "fp32"
    assert [i["name"] for i in m["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i["shape"] == ["batch", "sequence"] for i in m["inputs"])
    assert [o["name"] for o in m["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    assert m["outputs"][0]["shape"][:2] == ["batch", "sequence"]
    # every file is hashed, the tokenizer travels with the model
    assert "model.onnx" in m["files"] and "tokenizer/tokenizer.json" in m["files"]
    for rel, info in m["files"].items():
        assert sha256_file(tiny_onnx.path / rel) == info["sha256"]
    lin = m["lineage"]
    assert lin["stage"] == "export" and lin["parent"] is None
    assert lin["source"]["kind"] == "hf"
    assert {"bertopt", "python", "torch", "onnx"} <= set(lin["tool_versions"])
    assert lin["wall_time_s"] > 0
    assert "torch.onnx.export" in lin["report"]["exporter"]
    assert m["model"]["num_attention_heads"] == 4


def test_every_precision_a_stage_writes_is_one_a_manifest_may_record(tmp_path):
    from bertopt.artifact import precision_problem
    from bertopt.stages.compile import PARAMS as COMPILE_PARAMS
    from bertopt.stages.compile import precision_label
    from bertopt.stages.quantize.stage import PARAMS as QUANTIZE_PARAMS

    modes = next(p for p in QUANTIZE_PARAMS if p.name == "mode").choices
    execution = next(p for p in COMPILE_PARAMS if p.name == "inference_precision").choices
    written = {"fp32", *modes}  # export, quantize
    written |= {precision_label(p, e) for p in written for e in execution}  # compile / quantize for OpenVINO
    written |= {precision_label(p, e) for p in written for e in execution}  # compiled again
    assert {"fp16", "int8-static", "bf16", "int8-dynamic+bf16", "int8-static+fp32"} <= written
    assert [p for p in written if precision_problem(p)] == []
    assert all(precision_problem(p) for p in ("int4", "int8", "fp16+bf16", "int8-dynamic+f32", "", "FP32"))
    with pytest.raises(ValueError, match="'precision' is 'int4', not one bertopt writes"):
        ArtifactWriter(tmp_path / "a", stage="test").set_model("model.onnx", "onnx", [], [], precision="int4")


def test_a_manifest_task_is_one_bertopt_knows_an_older_name_of_one_or_none(tiny_onnx, tmp_path):
    from bertopt.runtime.tasks import task_of

    folder = tmp_path / "a"
    shutil.copytree(tiny_onnx.path, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    for task in (None, "sentence-embedding", "encoder"):  # none: read from the outputs; older names: still read
        (folder / MANIFEST_NAME).write_text(json.dumps({**manifest, "model": {**manifest["model"], "task": task}}))
        assert task_of(Artifact.load(folder)) == "embedding"
    (folder / MANIFEST_NAME).write_text(json.dumps({**manifest, "model": {**manifest["model"], "task": "qa"}}))
    with pytest.raises(ArtifactError, match="'model.task' is 'qa', not a task bertopt knows .embedding, "):
        Artifact.load(folder)


def test_child_records_parent_digest_and_history(tiny_onnx, tmp_path):
    from bertopt.registry import run_stage

    child = run_stage("prune", tiny_onnx, {}, tmp_path / "pruned")
    assert child.lineage["parent"]["digest"] == tiny_onnx.digest
    assert [h["stage"] for h in child.history()] == ["export", "prune"]
    assert child.source == tiny_onnx.source


def _copy(art, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(art.path, dest)
    return dest


def test_tampered_file_is_refused(tiny_onnx, tmp_path):
    dest = _copy(tiny_onnx, tmp_path)
    data = bytearray((dest / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (dest / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256 of model.onnx does not match"):
        Artifact.load(dest)


def test_truncated_file_is_refused(tiny_onnx, tmp_path):
    dest = _copy(tiny_onnx, tmp_path)
    data = (dest / "model.onnx").read_bytes()
    (dest / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated or modified"):
        Artifact.load(dest)


def test_missing_file_is_refused(tiny_onnx, tmp_path):
    dest = _copy(tiny_onnx, tmp_path)
    (dest / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json is missing"):
        Artifact.load(dest)


@pytest.mark.parametrize("path", [None, "", 3])
def test_load_without_a_path_says_so(path):
    # Path(None) was a TypeError; Path("") is the working folder, which is not what a caller meant
    with pytest.raises(ArtifactError, match="Artifact.load needs the path of an artifact folder, got"):
        Artifact.load(path)


def test_folder_without_manifest_is_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="not a bertopt artifact"):
        Artifact.load(tmp_path)


def test_failed_stage_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with ArtifactWriter(out, stage="test") as w:
            (w.dir / "model.onnx").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_stage_that_forgets_its_model_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="did not call set_model"):
        with ArtifactWriter(tmp_path / "out", stage="test"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force_and_input_is_never_the_output(tiny_onnx, tmp_path):
    from bertopt.registry import run_stage

    out = tmp_path / "p"
    first = run_stage("prune", tiny_onnx, {}, out)
    with pytest.raises(UserError, match="already exists"):
        run_stage("prune", tiny_onnx, {}, out)
    again = run_stage("prune", tiny_onnx, {}, out, overwrite=True)
    assert again.digest == first.digest
    with pytest.raises(UserError, match="stages never modify their input"):
        run_stage("prune", tiny_onnx, {}, tiny_onnx.path, overwrite=True)
    Artifact.load(tiny_onnx.path)  # still intact


def test_run_stage_refuses_arguments_of_the_wrong_kind_before_writing(tiny_onnx, tmp_path):
    """The Python API as a user calls it: overwrite="no" replaced the artifact (a non-empty string is true), a
    list config was a ValueError from dict(), out_dir=None a bare TypeError, an empty model spec meant ".". """
    from bertopt.registry import run_stage
    from bertopt.sources import resolve_source

    out = tmp_path / "p"
    first = run_stage("prune", tiny_onnx, {}, out)
    stamp = (out / "bertopt.json").stat().st_mtime_ns
    with pytest.raises(UserError, match="^stage 'prune': overwrite must be True or False, got 'no'$"):
        run_stage("prune", tiny_onnx, {}, out, overwrite="no")
    with pytest.raises(UserError, match="^stage 'quantize': config must be a mapping .* got list$"):
        run_stage("quantize", tiny_onnx, ["mode"], tmp_path / "q")
    with pytest.raises(UserError, match="^stage 'prune': out_dir must be the path of the folder to write, got None$"):
        run_stage("prune", tiny_onnx, {}, None)
    for spec in ("", "  "):
        with pytest.raises(UserError, match="^no model given"):
            resolve_source(spec)
    assert (out / "bertopt.json").stat().st_mtime_ns == stamp and Artifact.load(out).digest == first.digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_validation_results_are_stored_without_breaking_hashes(tiny_onnx, tmp_path):
    dest = Artifact.load(_copy(tiny_onnx, tmp_path))
    dest.record_validation("unit", {"cos_min": 0.5})
    again = Artifact.load(dest.path)
    assert again.manifest["validation"]["unit"] == {"cos_min": 0.5}
