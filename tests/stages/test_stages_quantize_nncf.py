"""``quantize --mode int8-static --runtime openvino``: NNCF static int8 written as an OpenVINO IR artifact, for every
family and head (tiny random models), measured on held-back text, run by OpenVINO in every Predictor, and refused
(one line, nothing written) where it cannot work or cannot be faithful."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from task_models import TASK_TEXTS

from bertopt.artifact import Artifact
from bertopt.cosine import cosine_rows
from bertopt.data import corpus
from bertopt.errors import ArtifactError, UserError
from bertopt.families import family_by_name
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.stages.quantize.nncf_int8 import BATCH_DEV_MAX
from bertopt.tiny_models import FAMILY_FIXTURES, build_tiny_family_model

pytest.importorskip("nncf")  # the openvino extra; present wherever the suite runs with [all]

STATIC = {"mode": "int8-static", "runtime": "openvino", "calibration_size": 64}
TEXTS = [t for t in corpus() if t][:64]
# worst cosine of the sentence embedding to the fp32 parent over TEXTS on the tiny random models (hidden 32,
# 2 layers; int8 of a random 32-wide model loses more than of a trained one), measured 0.97-0.999 -> floor
FLOOR = 0.95


@pytest.fixture(scope="module")
def tiny_static(tiny_onnx, tmp_path_factory):
    return run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.99"},
                     tmp_path_factory.mktemp("static") / "art")


def _matmuls(art) -> list[str]:
    import onnx

    return [n.name for n in onnx.load(str(art.model_path)).graph.node if n.op_type == "MatMul"]


@pytest.mark.parametrize("family", FAMILY_FIXTURES)
def test_every_family_builds_keeps_ffn_outputs_float_and_meets_its_target(family, tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", family, pooling="mean", normalize=True)
    onnx_art = run_stage("export", hf, {}, tmp_path / "onnx")
    art = run_stage("quantize", onnx_art, {**STATIC, "accuracy_target": "cos_min=0.99"}, tmp_path / "s8")
    loaded = Artifact.load(art.path)  # both IR files hashed and verified
    assert loaded.model_format == "openvino-ir" and loaded.runtime == "openvino"
    assert {"model.xml", "model.bin"} <= set(loaded.manifest["files"])
    assert loaded.precision == "int8-static+bf16"
    assert [i["name"] for i in loaded.inputs] == [i["name"] for i in onnx_art.inputs]
    report = loaded.manifest["lineage"]["report"]
    # the FFN output projections the family declares are float, one per layer, and nothing else was ignored
    pattern = re.compile(family_by_name(onnx_art.model_info["family"]).ffn_output_matmul)
    ffn_out = [n for n in _matmuls(onnx_art) if pattern.search(n)]
    assert len(ffn_out) == 2 and report["ignored_scope"] == sorted(ffn_out), (family, report["ignored_scope"])
    assert set(ffn_out) <= set(report["kept_float_nodes"])
    assert report["quantized_nodes"] > 0
    from bertopt.stages.quantize.nncf_int8 import restored_mode

    mode = report["restored_matmuls"]["mode"]
    assert mode == restored_mode({"inference_precision": loaded.manifest["runtime_options"]["inference_precision"]})
    assert set(report["dynamic_int8_nodes"]) <= set(report["restored_matmuls"]["nodes"])
    assert ("dynamic_quantization_group_size" in loaded.manifest["runtime_options"]) == \
        bool(report["dynamic_int8_nodes"])
    held = report["held_back"]  # measured on calibration text it did not calibrate on, alone and batched
    assert held["cos_min_alone"] >= 0.99 and held["cos_min_batched"] >= 0.99, held
    assert held["batch_dev"] <= BATCH_DEV_MAX
    # every output's batch deviation is held, not the primary one's alone (the gate bounds them all)
    assert set(held["batch_dev_by_output"]) == {o["name"] for o in loaded.outputs} and len(loaded.outputs) == 2
    assert held["batch_dev"] == max(held["batch_dev_by_output"].values())
    predictor = Predictor(loaded)
    assert predictor.session.backend == "openvino"
    cos = cosine_rows(predictor.encode(TEXTS), Predictor(onnx_art).encode(TEXTS))
    assert cos.min() >= FLOOR, (family, float(cos.min()))
    # a text alone gives what it gives inside a padded batch, as served: on an AMX CPU OpenVINO's fused int8
    # attention gave BERT, DistilBERT, RoBERTa, MPNet and ELECTRA 1 - cos of 0.11-0.38 for a text alone until
    # the runtime turned that fusion off for static int8 models there (2e-16 since)
    alone = Predictor(loaded, batch_size=1).encode(TEXTS)
    moved = 1.0 - cosine_rows(alone, predictor.encode(TEXTS))
    assert moved.max() <= BATCH_DEV_MAX, (family, float(moved.max()))


@pytest.mark.parametrize("task", ["classification", "token-classification", "rerank", "sparse-embedding"])
def test_every_head_keeps_its_outputs(task_artifact, task, tmp_path):
    _, parent = task_artifact(task)
    # a head's few logits of a random 32-wide model are more fragile than an embedding: a looser target
    art = run_stage("quantize", parent, {**STATIC, "accuracy_target": "cos_min=0.95"}, tmp_path / "s8")
    assert art.outputs == parent.outputs  # no head or output lost
    assert art.manifest["model"]["task"] == parent.manifest["model"]["task"]
    got, want = Predictor(art), Predictor(parent)
    primary = parent.primary_output
    pairs = TASK_TEXTS[::-1] if parent.manifest["model"].get("pair_input") else None
    a = got.run(TASK_TEXTS, pairs=pairs)[primary]
    b = want.run(TASK_TEXTS, pairs=pairs)[primary]
    assert len(a) == len(b) == len(TASK_TEXTS)
    assert [np.shape(x) for x in a] == [np.shape(y) for y in b]  # token outputs: one row per token of each text
    # over every text's output at once: a rerank score is one value, whose cosine alone is only its sign
    x, y = np.concatenate([np.ravel(v) for v in a]), np.concatenate([np.ravel(v) for v in b])
    cos = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    assert cos >= 0.95, (task, cos)
    report = art.manifest["lineage"]["report"]
    assert report["quantized_nodes"] > 0 and report["held_back"]["cos_min"] >= 0.95


def test_unreachable_target_is_refused_not_shipped(tiny_onnx, tmp_path):
    # nothing may be put back to float and the target is out of reach for int8: one line, nothing written
    with pytest.raises(UserError, match=r"static int8 misses cos_min>=0.99999 .* held-back calibration text"):
        run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.99999", "max_float_extra": 0},
                  tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


def _int8_constants_above(node, depth=3) -> list[str]:
    """The int8 constants a MatMul input is computed from (NNCF's compressed weights: Convert, Multiply)."""
    import openvino as ov

    if node.get_type_name() == "Constant":
        return [node.get_friendly_name()] if node.get_element_type() == ov.Type.i8 else []
    if depth == 0 or node.get_type_name() == "MatMul":
        return []
    return [c for i in range(node.get_input_size())
            for c in _int8_constants_above(node.input_value(i).get_node(), depth - 1)]


def test_ranked_search_puts_matmuls_back_to_float_until_the_target_holds(tiny_onnx, tmp_path, monkeypatch):
    # without the FFN outputs in float the tiny model misses 0.999 at first: the search ranks every int8 MatMul
    # once and restores them in that order, bounded; what it restored is reported and really runs float
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path / "cache"))
    art = run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.999", "keep_ffn_output": False,
                                            "float_short_texts": "off",
                                            "max_float_extra": 16, "restored_matmuls": "float"}, tmp_path / "s8")
    report = art.manifest["lineage"]["report"]
    search = report["search"]
    assert report["ignored_scope"] == []
    assert search["restored"] and len(search["restored"]) <= 16
    assert search["restored"] == [r["node"] for r in search["ranking"][: len(search["restored"])]]
    # the shortest prefix: it holds, one fewer did not (unless it is the first)
    by_count = {s["float"]: s for s in search["steps"]}
    n = len(search["restored"])
    assert by_count[n]["cos_min"] >= 0.999 and report["held_back"]["cos_min"] >= 0.999
    assert n == 1 or by_count[n - 1]["cos_min"] < 0.999
    assert set(search["restored"]) <= set(report["kept_float_nodes"])
    # a restored MatMul's int8 weights are stored decompressed (the same values), so OpenVINO runs it as a plain
    # float MatMul rather than decompressing its weights on every call
    import openvino as ov

    ops = {op.get_friendly_name(): op for op in ov.Core().read_model(str(art.model_path)).get_ordered_ops()}
    weights = [ops[name].input_value(i).get_node() for name in search["restored"] for i in range(2)]
    assert any(w.get_type_name() == "Constant" and w.get_element_type() == ov.Type.f32 for w in weights)
    assert not [c for w in weights for c in _int8_constants_above(w)]
    assert report["restored_matmuls"] == {"mode": "float", "requested": "float", "nodes": search["restored"]}
    assert report["dynamic_int8_nodes"] == []
    assert "dynamic_quantization_group_size" not in art.manifest["runtime_options"]
    # the search compiles every candidate once: none of them lands in OpenVINO's blob cache (MPNet's search once
    # wrote tens of GB there); what is cached is what the writer's check opened, the artifacts themselves
    assert len(search["ranking"]) + len(search["steps"]) > 2
    assert len(list((tmp_path / "cache").rglob("*.blob"))) <= 2


def test_restored_matmuls_run_as_dynamic_int8(tiny_onnx, tmp_path):
    # --restored-matmuls int8-dynamic: a weight MatMul the search takes out of static int8 keeps NNCF's int8
    # weights and runs with OpenVINO's per-token dynamic quantisation (the manifest says so, so every Predictor
    # compiles it that way); the search measured that form, and the artifact holds the target it measured. Without
    # VNNI / AMX OpenVINO computes those MatMuls with float activations (it has no dynamic int8 there): the same
    # artifact, measured as this machine runs it
    import openvino as ov

    from bertopt.stages.quantize.nncf_int8 import int8_matmuls

    art = run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.999", "keep_ffn_output": False,
                                            "float_short_texts": "off",
                                            "max_float_extra": 16, "restored_matmuls": "int8-dynamic"},
                    tmp_path / "s8")
    loaded = Artifact.load(art.path)
    report = loaded.manifest["lineage"]["report"]
    restored = report["restored_matmuls"]["nodes"]
    assert report["restored_matmuls"]["mode"] == "int8-dynamic" and restored == report["search"]["restored"]
    # the restored weight MatMuls run dynamic int8; a restored attention product (no weights) runs float
    dynamic = report["dynamic_int8_nodes"]
    assert dynamic and set(dynamic) <= set(restored), restored
    assert not set(dynamic) & set(report["kept_float_nodes"])
    assert set(restored) <= set(dynamic) | set(report["kept_float_nodes"])
    assert loaded.manifest["runtime_options"]["dynamic_quantization_group_size"] == 32
    assert report["held_back"]["cos_min"] >= 0.999 and report["held_back"]["batch_dev"] <= BATCH_DEV_MAX
    # each of them reads int8 weights, and activations no FakeQuantize touches
    model = ov.Core().read_model(str(loaded.model_path))
    int8, kept = int8_matmuls(model)
    assert set(restored) <= set(kept) and report["quantized_nodes"] == len(int8)
    ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    assert all(_int8_constants_above(ops[name].input_value(1).get_node()) for name in dynamic)
    # what is served is what was measured: a text alone as inside a batch, the parent's meaning kept
    got = Predictor(loaded).encode(TEXTS)
    assert (1.0 - cosine_rows(Predictor(loaded, batch_size=1).encode(TEXTS), got)).max() <= BATCH_DEV_MAX
    assert cosine_rows(got, Predictor(tiny_onnx).encode(TEXTS)).min() >= FLOOR


def test_restored_matmuls_auto_is_dynamic_int8_where_the_cpu_has_an_int8_dot_product_and_f32_activations(
        monkeypatch):
    from bertopt.stages.quantize import nncf_int8

    vnni = {"avx2", "avx512f", "avx512_vnni"}
    monkeypatch.setattr("bertopt.machine.cpu_features", lambda: vnni)
    assert nncf_int8.restored_mode({"restored_matmuls": "auto"}) == "int8-dynamic"  # bf16 asked, runs f32 here
    # with native bf16 the float part runs bf16, whose activations OpenVINO never quantises dynamically
    monkeypatch.setattr("bertopt.machine.cpu_features", lambda: vnni | {"avx512_bf16"})
    assert nncf_int8.restored_mode({"restored_matmuls": "auto", "inference_precision": "bf16"}) == "float"
    assert nncf_int8.restored_mode({"restored_matmuls": "auto", "inference_precision": "f32"}) == "int8-dynamic"
    monkeypatch.setattr("bertopt.machine.cpu_features", lambda: {"avx2"})
    assert nncf_int8.restored_mode({}) == "float"
    assert nncf_int8.restored_mode({"restored_matmuls": "int8-dynamic"}) == "int8-dynamic"


def test_a_prefix_refused_on_the_ranking_texts_is_the_decision_the_full_measurement_makes(tiny_onnx, tmp_path,
                                                                                         monkeypatch):
    # a prefix of the ranking that misses the target on the texts the ranking measured misses it on the whole
    # held-back set (its minimum can only be lower), so the search refuses it without measuring every text alone,
    # batched and on every output: the same ranking, steps and restored MatMuls as with every step measured fully
    from bertopt.stages.quantize import nncf_int8

    config = {**STATIC, "accuracy_target": "cos_min=0.999", "keep_ffn_output": False, "max_float_extra": 16,
              "float_short_texts": "off"}
    quick = run_stage("quantize", tiny_onnx, config, tmp_path / "quick").manifest["lineage"]["report"]["search"]
    monkeypatch.setattr(nncf_int8.HeldBackMeter, "quick_bounds_full", property(lambda self: False))
    full = run_stage("quantize", tiny_onnx, config, tmp_path / "full").manifest["lineage"]["report"]["search"]
    refused = [s for s in quick["steps"] if "measured_on" in s]
    assert refused and not [s for s in full["steps"] if "measured_on" in s]
    assert quick["ranking"] == full["ranking"] and quick["restored"] == full["restored"]
    assert [s["float"] for s in quick["steps"]] == [s["float"] for s in full["steps"]]
    by_count = {s["float"]: s for s in full["steps"]}
    for step in refused:  # what the ranking texts measured bounds what every text measures
        assert 0.999 > step["cos_min"] >= by_count[step["float"]]["cos_min"]


def test_short_texts_run_on_the_float_copy_alone_or_in_any_batch(tiny_onnx, tmp_path):
    """--float-short-texts N: a text of at most N tokens runs on the float copy the artifact keeps (hashed beside
    model.xml), a longer one int8, each by its own length whatever its batch-mates; the held-back measurement is of
    that routing."""
    import dataclasses

    from bertopt.model_handle import FLOAT_SHORT_TEXTS

    art = Artifact.load(run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.99",
                                                          "float_short_texts": "12"}, tmp_path / "s8").path)
    assert art.manifest["runtime_options"][FLOAT_SHORT_TEXTS] == 12
    assert {"float.xml", "float.bin"} <= set(art.manifest["files"])
    report = art.manifest["lineage"]["report"]["float_short_texts"]
    assert report["requested"] == "12" and report["max_tokens"] == 12 and report["held_back_texts_float"] >= 1
    routed = Predictor(art, threads=1)
    handle = art.model_handle()
    int8_only = Predictor(dataclasses.replace(handle, runtime_options={
        k: v for k, v in handle.runtime_options.items() if k != FLOAT_SHORT_TEXTS}), threads=1)
    parent = Predictor(tiny_onnx, threads=1)
    texts = ["a short one", "hello", " ".join(corpus()[:3]), " ".join(corpus()[3:5])]
    lengths = [len(e.ids) for e in routed.tokenize(texts)]
    assert lengths[0] <= 12 and lengths[1] <= 12 and min(lengths[2:]) > 12, lengths
    together = routed.encode(texts)
    alone = np.stack([routed.encode([t])[0] for t in texts])
    reference, int8 = parent.encode(texts), int8_only.encode(texts)
    short_cos = cosine_rows(together[:2], reference[:2])
    # short texts: the float copy, as close to fp32 as the float part's precision allows, closer than int8 gets
    assert short_cos.min() >= 0.999 and short_cos.min() > cosine_rows(int8[:2], reference[:2]).min()
    # long texts: the int8 model's own outputs
    np.testing.assert_allclose(together[2:], int8[2:], atol=2e-3, rtol=0)
    # a text takes its path alone or batched with texts of the other kind
    assert 1 - cosine_rows(together, alone).min() <= BATCH_DEV_MAX
    off = run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.99", "float_short_texts": "off"},
                    tmp_path / "off")
    assert FLOAT_SHORT_TEXTS not in off.manifest["runtime_options"] and "float.xml" not in off.manifest["files"]
    assert off.manifest["lineage"]["report"]["float_short_texts"]["max_tokens"] is None


def test_float_short_texts_auto_starts_at_the_minimum(tiny_onnx, tmp_path):
    from bertopt.stages.quantize.nncf_int8 import SHORT_TEXTS_MAX, SHORT_TEXTS_MIN

    art = run_stage("quantize", tiny_onnx, {**STATIC, "accuracy_target": "cos_min=0.99"}, tmp_path / "s8")
    chosen = art.manifest["runtime_options"]["float_short_texts"]
    assert SHORT_TEXTS_MIN <= chosen <= SHORT_TEXTS_MAX
    assert art.manifest["lineage"]["report"]["float_short_texts"]["requested"] == "auto"


def test_ir_artifact_runs_only_on_openvino_and_is_verified(tiny_static, tmp_path):
    with pytest.raises(UserError, match="ONNX Runtime runs ONNX models, not openvino-ir .*use --runtime openvino"):
        Predictor(tiny_static, runtime="onnxruntime")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_static.path, copy)
    data = bytearray((copy / "model.bin").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model.bin").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.bin"):
        Artifact.load(copy)


def test_exclude_nodes_are_kept_float_and_the_report_says_so(tiny_onnx, tmp_path):
    first_qkv = next(n for n in _matmuls(tiny_onnx) if "attention/self/query" in n)
    art = run_stage("quantize", tiny_onnx, {**STATIC, "exclude_nodes": [first_qkv], "accuracy_target": "cos_min=0.99"},
                    tmp_path / "s8")
    report = art.manifest["lineage"]["report"]
    assert first_qkv in report["kept_float_nodes"] and first_qkv in report["ignored_scope"]
    assert report["calibration"] == {"texts": 64, "held_back": 64, "source": "builtin calibration text"}
    assert report["smooth_quant_alpha"] == 0.5 and report["quantizer"].startswith("nncf ")


@pytest.mark.parametrize("config, message", [
    ({"per_token": True}, r"--per-token applies to --mode int8-dynamic only .* not to --mode int8-static --runtime "
                          r"openvino \(OpenVINO static int8 \(NNCF\)\); drop --per-token"),
    ({"weight_rounding": "gptq"}, "--weight-rounding gptq applies to .* not to --mode int8-static --runtime openvino"),
    ({"calibration_method": "entropy"}, "--calibration-method entropy applies to --mode int8-static only"),
    ({"op_types": ["MatMul"]}, "--op-types does not apply"),
    ({"exclude_nodes": ["no-such-node"]}, "--exclude-nodes: no node named 'no-such-node'"),
    ({"accuracy_target": "max_abs<=0.1"}, "takes cos_min=VALUE only"),
])
def test_options_it_cannot_honour_are_refused(tiny_onnx, tmp_path, config, message):
    with pytest.raises(UserError, match=message):
        run_stage("quantize", tiny_onnx, {**STATIC, **config}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_cli_static_int8_and_what_other_stages_say_of_the_ir(tiny_onnx, tiny_optimized, tiny_static, tmp_path, cli):
    code, out, err = cli("quantize", tiny_onnx.path, "--mode", "int8-static", "--runtime", "openvino",
                         "--calibration-size", "32", "--accuracy-target", "cos_min=0.99", "--out", tmp_path / "s8")
    assert code == 0, err
    assert "openvino-ir" in out and "int8-static+bf16" in out
    assert Artifact.load(tmp_path / "s8").manifest["lineage"]["report"]["calibration"]["texts"] == 32
    code, out, _ = cli("inspect", tmp_path / "s8")
    assert code == 0 and "openvino-ir / openvino" in out and "FakeQuantize" in out
    # fused graphs cannot be read by OpenVINO: refused in one line, nothing written
    code, out, err = cli("quantize", tiny_optimized.path, "--mode", "int8-static", "--runtime", "openvino",
                         "--out", tmp_path / "x")
    assert code == 2 and "contrib ops" in err and "before 'optimize'" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))
    # the IR is the end of a chain: compile says it needs none, the other stages name the ONNX parent
    code, out, err = cli("compile", tiny_static.path, "--runtime", "openvino", "--out", tmp_path / "c")
    assert code == 2 and "already an OpenVINO IR" in err and "needs no compile" in err
    assert "export" not in err.lower()
    for stage in ("optimize", "quantize", "prune"):
        code, out, err = cli(stage, tiny_static.path, "--out", tmp_path / stage)
        assert code == 2 and "is an OpenVINO IR" in err and "ONNX artifact it was quantised from" in err, (stage, err)
        assert not (tmp_path / stage).exists()
