"""The quantize stage composed of methods: each method's options apply to it alone, refused for every other method
by the declaration (API, recipe and CLI alike), and a new method is one more module in the composition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bertopt.errors import UserError
from bertopt.params import Param, resolve_config
from bertopt.registry import get_stage, run_stage
from bertopt.stages.quantize.methods import Method, compose

STAGE = get_stage("quantize")
PARAMS = STAGE.PARAMS
METHODS = list(PARAMS.methods.values())


def _given_value(p: Param):
    """A valid value for ``p`` that a user could mean (never None)."""
    if p.type is bool:
        return not p.default
    if p.choices:
        return next(c for c in p.choices if c != p.default)
    if p.default is not None:
        return p.default
    return 0.5 if p.type is float else 1


FOREIGN = [(m, p) for m in METHODS for p in PARAMS
           if p.name in PARAMS.owners and m not in PARAMS.owners[p.name]]


def test_every_method_is_reachable_and_every_option_is_declared_once():
    assert {(m.mode, m.runtime) for m in METHODS} == {("fp16", "onnxruntime"), ("int8-dynamic", "onnxruntime"),
                                                       ("int8-static", "onnxruntime"), ("int8-dynamic", "openvino"),
                                                       ("int8-static", "openvino")}
    names = [p.name for p in PARAMS]
    assert len(names) == len(set(names))
    # the CLI's help says which method reads an option, from the declaration
    assert next(p for p in PARAMS if p.name == "per_token").help.startswith("Only with --mode int8-dynamic. ")
    assert next(p for p in PARAMS if p.name == "weight_rounding").help.startswith(
        "Only with --mode int8-dynamic or --mode int8-dynamic --runtime openvino. ")
    # each method refuses at least one option of another method
    assert {m.title for m, _ in FOREIGN} == {m.title for m in METHODS}


@pytest.mark.parametrize("method, param", FOREIGN, ids=[f"{m.title}-{p.name}" for m, p in FOREIGN])
def test_an_option_of_another_method_is_refused(method, param):
    given = {"mode": method.mode, "runtime": method.runtime, param.name: _given_value(param)}
    with pytest.raises(UserError) as err:
        resolve_config(PARAMS, given, "quantize")
    message = str(err.value)
    owners = PARAMS.owners[param.name]
    shown = message.split(" applies to ")[0]  # the option as the user gave it: --per-token, --weight-rounding gptq
    assert shown.startswith("quantize: --") and param.cli_flag[2:] in shown
    assert f" applies to {' or '.join(PARAMS.flags(m) for m in owners)} only " in message
    assert f"({', '.join(m.title for m in owners)}), not to {PARAMS.flags(method)} ({method.title})" in message
    assert message.endswith(f"; drop {message.split(': ', 1)[1].split()[0]}")
    assert "\n" not in message


def test_options_that_do_not_apply_are_none_and_a_resolved_config_resolves_again():
    config = resolve_config(PARAMS, {"mode": "fp16", "keep_fp32_ops": "Softmax"}, "q")
    assert config["keep_fp32_ops"] == ["Softmax"] and config["threads"] is None and config["exclude_nodes"] == []
    assert config["per_token"] is None and config["per_channel"] is None and config["activation_group_size"] is None
    # a recipe resolves its steps when it is read and run_stage resolves them again
    assert resolve_config(PARAMS, config, "q") == config
    ov = resolve_config(PARAMS, {"runtime": "openvino"}, "q")
    assert ov["activation_group_size"] == 32 and ov["weight_rounding"] == "nearest" and ov["per_channel"] is None


# (given, the line refusing it): an option the picked method reads only with another, given without it
UNREAD = [
    ({"smooth_roles": "ffn-out"}, "quantize: --smooth-roles ffn-out would be ignored: --mode int8-dynamic (ONNX "
     "Runtime dynamic int8) reads it only with --smooth-alpha; add --smooth-alpha or drop --smooth-roles"),
    ({"mode": "int8-static", "smooth_roles": "attention"}, "quantize: --smooth-roles attention would be ignored: "
     "--mode int8-static (ONNX Runtime static int8) reads it only with --smooth-alpha; add --smooth-alpha or drop "
     "--smooth-roles"),
    ({"calibration_size": 64}, "quantize: --calibration-size 64 would be ignored: --mode int8-dynamic (ONNX Runtime "
     "dynamic int8) reads it only with --accuracy-target, --weight-rounding gptq, --smooth-alpha, --first-token-fp32 "
     "or --per-token, unlike --mode int8-static; add one of them or drop --calibration-size"),
    ({"mode": "fp16", "calibration_data": "c.txt"}, "quantize: --calibration-data c.txt would be ignored: --mode fp16 "
     "(fp16 conversion) reads it only with --accuracy-target, unlike --mode int8-static; add --accuracy-target or "
     "drop --calibration-data"),
    ({"runtime": "openvino", "calibration_data": "c.txt"}, "quantize: --calibration-data c.txt would be ignored: "
     "--mode int8-dynamic --runtime openvino (OpenVINO int8) reads it only with --accuracy-target or "
     "--weight-rounding gptq, unlike --mode int8-static; add one of them or drop --calibration-data"),
    ({"accuracy_group": 1}, "quantize: --accuracy-group 1 would be ignored: --mode int8-dynamic (ONNX Runtime dynamic "
     "int8) reads it only with --accuracy-target; add --accuracy-target or drop --accuracy-group"),
    ({"mode": "fp16", "op_types": "MatMul"}, "quantize: --op-types MatMul would be ignored: --mode fp16 (fp16 "
     "conversion) reads it only with --accuracy-target, unlike --mode int8-dynamic or --mode int8-static; add "
     "--accuracy-target or drop --op-types"),
]


@pytest.mark.parametrize("given, line", UNREAD, ids=[", ".join(g) for g, _ in UNREAD])
def test_an_option_read_only_with_another_is_refused_without_it(given, line):
    with pytest.raises(UserError) as err:
        resolve_config(PARAMS, given, "quantize")
    assert str(err.value) == line


@pytest.mark.parametrize("given", [
    {"mode": "int8-static", "calibration_data": "c.txt", "calibration_size": 64},
    {"mode": "int8-static", "runtime": "openvino", "calibration_size": 64},
    {"per_token": True, "calibration_size": 16}, {"first_token_fp32": True, "calibration_data": "c.txt"},
    {"weight_rounding": "gptq", "calibration_size": 16}, {"runtime": "openvino", "weight_rounding": "gptq",
                                                          "calibration_data": "c.txt"},
    {"smooth_alpha": 0.0, "smooth_roles": "ffn-out", "calibration_size": 16},
    {"mode": "fp16", "accuracy_target": "cos_min=0.99", "op_types": "MatMul", "accuracy_group": 1,
     "calibration_size": 16}])
def test_an_option_read_only_with_another_is_taken_with_it(given):
    config = resolve_config(PARAMS, given, "quantize")
    assert all(config[k] is not None for k in given)
    assert resolve_config(PARAMS, config, "quantize") == config


def test_an_option_not_read_is_none_in_the_resolved_config():
    config = resolve_config(PARAMS, {"mode": "fp16"}, "q")
    assert [config[k] for k in ("calibration_data", "calibration_size", "accuracy_group", "op_types")] == [None] * 4
    assert resolve_config(PARAMS, config, "q") == config  # a recipe's resolved step resolves again
    dynamic = resolve_config(PARAMS, {}, "q")
    assert dynamic["calibration_size"] is None and dynamic["smooth_roles"] is None and dynamic["op_types"]
    assert resolve_config(PARAMS, {"smooth_alpha": 0.5}, "q")["smooth_roles"] == ["attention", "ffn-in"]


def test_a_keep_fp32_op_the_graph_has_not_is_refused_before_any_work(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match=r"^--keep-fp32-ops Gelu: .*model.onnx has no operator of that type, so it "
                                        r"would keep nothing fp32; name operator types of this graph"):
        run_stage("quantize", tiny_onnx, {"mode": "fp16", "keep_fp32_ops": ["Softmax", "Gelu"]}, tmp_path / "x")
    with pytest.raises(UserError, match=r"has no operator of that type \(did you mean Softmax\?\)"):
        run_stage("quantize", tiny_onnx, {"mode": "fp16", "keep_fp32_ops": ["softmax"]}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_method_pair_nobody_implements_names_the_choices(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="^--runtime openvino quantises with --mode int8-dynamic or --mode "
                                        "int8-static, not --mode fp16; use --runtime onnxruntime for --mode fp16$"):
        run_stage("quantize", tiny_onnx, {"mode": "fp16", "runtime": "openvino"}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_the_artifact_records_what_the_method_read(tiny_onnx, tmp_path):
    from bertopt.stages.quantize.fp16 import KEEP_FP32_OPS

    # the default list names fused types this un-optimised graph has not (SkipLayerNormalization): taken as given
    art = run_stage("quantize", tiny_onnx, {"mode": "fp16", "keep_fp32_ops": KEEP_FP32_OPS.default}, tmp_path / "f")
    params = art.lineage["params"]
    assert params["mode"] == "fp16" and params["keep_fp32_ops"] == KEEP_FP32_OPS.default
    assert params["per_token"] is None and params["calibration_method"] is None
    assert params["calibration_size"] is None and params["op_types"] is None  # read only with an accuracy target


def test_refused_on_the_api_before_any_work(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="--no-per-channel applies to"):
        run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic", "runtime": "openvino", "per_channel": False},
                  tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_new_method_is_one_module_in_the_composition():
    group = Param("group_size", int, 128, "Weights per int4 scale.", min=1)
    int4 = SimpleNamespace(METHODS=(Method("test int4", "int4", "onnxruntime", (group,), lambda *a: None),))
    params = compose("Precision.", "int8-dynamic", "Runtime.", "onnxruntime", STAGE.SHARED,
                     [*STAGE.METHOD_MODULES, int4])
    assert "int4" in next(p for p in params if p.name == "mode").choices
    assert resolve_config(params, {"mode": "int4", "group_size": 64}, "q")["group_size"] == 64
    with pytest.raises(UserError, match="--group-size 64 applies to --mode int4 only .test int4., not to --mode "
                                        "int8-dynamic"):
        resolve_config(params, {"group_size": 64}, "q")


def test_one_name_is_one_declaration():
    other = Param("per_token", bool, True, "another per_token")
    clash = SimpleNamespace(METHODS=(Method("clash", "int4", "onnxruntime", (other,), lambda *a: None),))
    with pytest.raises(ValueError, match="'per_token' is declared twice"):
        compose("m", "int8-dynamic", "r", "onnxruntime", STAGE.SHARED, [*STAGE.METHOD_MODULES, clash])
    threads = next(p for p in STAGE.SHARED if p.name == "threads")
    shared = SimpleNamespace(METHODS=(Method("again", "int4", "onnxruntime", (threads,), lambda *a: None),))
    with pytest.raises(ValueError, match="'threads' is shared by every method"):
        compose("m", "int8-dynamic", "r", "onnxruntime", STAGE.SHARED, [*STAGE.METHOD_MODULES, shared])
    twin = SimpleNamespace(METHODS=(Method("twin", "fp16", "onnxruntime", (), lambda *a: None),))
    with pytest.raises(ValueError, match="share one mode and runtime"):
        compose("m", "int8-dynamic", "r", "onnxruntime", STAGE.SHARED, [*STAGE.METHOD_MODULES, twin])
