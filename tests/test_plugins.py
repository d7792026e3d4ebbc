"""The plug-in helpers (bertopt.plugins): decorator registries and lazily imported module tables, on their own and
as the runtime, the stages and the gate use them."""

from __future__ import annotations

import sys

import pytest

from bertopt.errors import UserError
from bertopt.plugins import LazyModules, Registry, import_all, import_optional


def test_register_under_several_names_and_look_up():
    handlers = Registry("format handler")

    @handlers.register("keras", "tf-savedmodel")
    def freeze(x):
        return f"froze {x}"

    assert handlers.get("keras") is freeze and handlers.get("tf-savedmodel") is freeze
    assert handlers.find("onnx") is None
    assert "keras" in handlers and "onnx" not in handlers
    assert list(handlers) == ["keras", "tf-savedmodel"] and len(handlers) == 2
    assert handlers.items() == [("keras", freeze), ("tf-savedmodel", freeze)]
    assert freeze("m") == "froze m"  # the decorator hands its target back unchanged


def test_unknown_name_is_one_line_naming_the_known_ones():
    runtimes = Registry("runtime")
    runtimes.register("onnxruntime")(object)
    runtimes.register("openvino")(dict)
    with pytest.raises(UserError) as info:
        runtimes.get("tvm")
    assert str(info.value) == "unknown runtime 'tvm'; known runtimes: onnxruntime, openvino"
    with pytest.raises(UserError, match="unknown runtime 'tvm'; known runtimes: none"):
        Registry("runtime").get("tvm")


def test_a_taken_name_is_refused():
    checks = Registry("runner check")

    @checks.register("spark")
    def spark_check():
        return 1

    def other_check():
        return 2

    with pytest.raises(ValueError, match="runner check 'spark' is registered twice"):
        checks.register("spark")(other_check)
    assert checks.get("spark") is spark_check
    with pytest.raises(ValueError, match="at least one name"):
        checks.register()


def test_the_same_definition_imported_again_replaces_itself():
    source = "def handler():\n    return 'again'\n"
    first, second = {"__name__": "plugin_reloaded"}, {"__name__": "plugin_reloaded"}
    exec(source, first)
    exec(source, second)  # what importlib.reload does: the same module's code run again
    backends = Registry("backend")
    backends.register("mine")(first["handler"])
    backends.register("mine")(second["handler"])
    assert backends.get("mine") is second["handler"]


def test_load_runs_once_before_the_first_lookup():
    calls = []

    def load():
        calls.append(1)
        references.register("keras")(len)

    references: Registry = Registry("reference", load=load)
    assert calls == []
    assert references.get("keras") is len and references.names() == ["keras"] and "keras" in references
    assert calls == [1]


def test_import_optional_tells_an_absent_module_from_a_broken_one(tmp_path, monkeypatch):
    (tmp_path / "plugin_needs_absent.py").write_text("import bertopt_no_such_dependency\n")
    (tmp_path / "plugin_fine.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_optional("bertopt_no_such_plugin") is None
    with pytest.raises(ModuleNotFoundError, match="bertopt_no_such_dependency"):
        import_optional("plugin_needs_absent")
    assert [m.VALUE for m in import_all(["bertopt_no_such_plugin", "plugin_fine"], optional=True)] == [7]
    with pytest.raises(ModuleNotFoundError):
        import_all(["bertopt_no_such_plugin"])
    for name in ("plugin_fine", "plugin_needs_absent"):
        sys.modules.pop(name, None)


def test_lazy_modules_import_on_lookup(tmp_path, monkeypatch):
    (tmp_path / "plugin_lazy_stage.py").write_text("NAME = 'distill'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stages = LazyModules("stage", {"distill": "plugin_lazy_stage", "export": "bertopt.stages.export"})
    assert "plugin_lazy_stage" not in sys.modules
    assert stages.names() == ["distill", "export"] and list(stages) == ["distill", "export"]
    assert "distill" in stages and "prune" not in stages
    assert stages.get("distill").NAME == "distill"
    with pytest.raises(UserError) as info:
        stages.get("prune")
    assert str(info.value) == "unknown stage 'prune'; known stages: distill, export"
    sys.modules.pop("plugin_lazy_stage")


def test_the_package_registries_are_filled_and_checked(tiny_onnx):
    """The registries bertopt itself declares: backends (optional ones loaded on first lookup), TF format
    handlers and references (through the extensions), the gate's Spark check, stages by name."""
    from bertopt.registry import get_stage, stage_names
    from bertopt.runtime.backends import open_session
    from bertopt.stages.common import format_handler
    from bertopt.validate.gate import _RUNNER_CHECKS
    from bertopt.validate.reference import _REFERENCES

    with pytest.raises(UserError) as info:
        open_session(tiny_onnx.model_handle(), backend="tvm", provider="cpu")
    assert str(info.value) == "unknown runtime 'tvm'; known runtimes: onnxruntime, openvino, pytorch, tensorflow"
    session = open_session(tiny_onnx.model_handle(), backend="onnxruntime", provider="cpu", threads=1)
    assert session.backend == "onnxruntime" and session.input_names
    assert format_handler("freeze", "keras") is not None and format_handler("quantize", "onnx") is None
    assert {"keras", "tf-checkpoint", "tf-savedmodel"} <= set(_REFERENCES.names())
    assert "spark" in _RUNNER_CHECKS
    assert stage_names() == ["export", "freeze", "prune", "optimize", "quantize", "compile"]
    assert get_stage("optimize").NAME == "optimize"
    with pytest.raises(UserError, match="unknown stage 'distill'; known stages: export, freeze"):
        get_stage("distill")
