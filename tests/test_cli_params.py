"""Every command's options are declared once, as Params: the command line is built from them, a bad value is
refused with the Param's message (one line, exit 2), and the API (ServeConfig, BridgeConfig, bench Settings,
spark_predict) checks against the same declarations."""

from __future__ import annotations

import pytest
import typer

from bertopt.bench import BENCH_PARAMS, Settings
from bertopt.cli import app
from bertopt.errors import UserError
from bertopt.kafka.bridge import BridgeConfig
from bertopt.kafka.params import KAFKA_PARAMS
from bertopt.messages import MAX_TEXT_CHARS_PARAM
from bertopt.params import Param
from bertopt.registry import get_stage, stage_names
from bertopt.serve.params import CLIENT_ENCODE_PARAMS, CLIENT_PREDICT_PARAMS, CLIENT_STATUS_PARAMS, SERVE_PARAMS
from bertopt.serve.server import ServeConfig
from bertopt.spark.params import SPARK_PREDICT_PARAMS
from bertopt.tune import TUNE_IO_PARAMS, TUNE_PARAMS
from bertopt.validate.cli import ARTIFACT as VALIDATE_ARTIFACT
from bertopt.validate.cli import REPORT_DIR as VALIDATE_REPORT_DIR
from bertopt.validate.params import VALIDATE_PARAMS

KAFKA_ARGS = ["--bootstrap", "127.0.0.1:9", "--request-topic", "a", "--response-topic", "b"]


def _param(params: list[Param], name: str) -> Param:
    return next(p for p in params if p.name == name)


def _message(where: str, p: Param, value) -> str:
    """What the Param's own bound check says about ``value``."""
    return f"{where}: '{p.name}' must be {p.span}, got {value}"


# (command words, the Param, a value outside its bounds, the other arguments the command needs)
CASES = [
    (["serve"], _param(SERVE_PARAMS, "max_batch_tokens"), "0", ["ART"]),
    (["serve"], _param(SERVE_PARAMS, "bulk_nice"), "20", ["ART"]),
    (["kafka"], _param(KAFKA_PARAMS, "max_wait_ms"), "-1", ["ART", *KAFKA_ARGS]),
    (["spark-predict"], _param(SPARK_PREDICT_PARAMS, "partitions"), "0", ["ART", "-i", "in.txt", "-o", "OUT"]),
    (["bench"], _param(BENCH_PARAMS, "latency_seq_len"), "2", ["ART"]),
    (["client", "status"], _param(CLIENT_STATUS_PARAMS, "port"), "65536", []),
]


@pytest.mark.parametrize("words, param, bad, rest", CASES, ids=lambda c: c.name if isinstance(c, Param) else None)
def test_out_of_bounds_value_is_refused_with_the_params_message(cli, tmp_path, words, param, bad, rest):
    rest = [str(tmp_path / a) if a in ("ART", "OUT") else a for a in rest]
    code, out, err = cli(*words, *rest, param.cli_flag, bad)
    assert code == 2
    assert err.strip() == f"error: {_message(' '.join(words), param, bad)}"
    assert not (tmp_path / "OUT").exists()


def test_help_teaches_each_declared_option_with_its_bound_and_default(cli):
    code, out, _ = cli("serve", "--help")
    assert code == 0
    flat = " ".join(out.replace("│", " ").split())  # the help's table cells, unwrapped
    assert "Most tokens in one mini-job" in flat
    assert "(default: 16384; at least 1)" in flat
    assert "(default: 5555; between 1 and 65535)" in flat


def _command(path: list[str]):
    group = typer.main.get_command(app)
    for word in path:
        group = group.commands[word]
    return group


DECLARED = {
    ("serve",): SERVE_PARAMS,
    ("client", "encode"): CLIENT_ENCODE_PARAMS,
    ("client", "predict"): CLIENT_PREDICT_PARAMS,
    ("client", "status"): CLIENT_STATUS_PARAMS,
    ("kafka",): KAFKA_PARAMS,
    ("spark-predict",): SPARK_PREDICT_PARAMS,
    ("bench",): BENCH_PARAMS,
    ("validate",): [VALIDATE_ARTIFACT, VALIDATE_REPORT_DIR, *VALIDATE_PARAMS],
    ("tune",): [*TUNE_IO_PARAMS, *TUNE_PARAMS],
}


@pytest.mark.parametrize("path", sorted(DECLARED), ids=" ".join)
def test_every_option_of_the_command_is_a_declared_param(path):
    """Nothing hand-written beside the declarations: the command's parameters are exactly its Params (plus the
    hidden old spelling of a positional argument)."""
    params = DECLARED[path]
    command = _command(list(path))
    built = {p.name for p in command.params if p.name != "help"}
    deprecated = {f"{p.name}__deprecated_option" for p in params if p.deprecated_flags}
    assert built == {p.name for p in params} | deprecated
    by_name = {p.name: p for p in command.params}
    for p in params:
        if not p.positional:
            assert p.cli_flag in by_name[p.name].opts + by_name[p.name].secondary_opts


def test_stage_and_validate_commands_are_built_from_the_params_recipes_take():
    for name in stage_names():
        built = {p.name for p in _command([name]).params}
        assert {p.name for p in get_stage(name).PARAMS} <= built, name
    assert {p.name for p in VALIDATE_PARAMS} <= {p.name for p in _command(["validate"]).params}


def test_api_configs_are_checked_against_the_same_declarations(cli, tmp_path):
    """A bound is stated once: the API's config objects refuse what the flag refuses, with the same message."""
    code, _, err = cli("serve", tmp_path / "art", "--max-request-bytes", "1000")
    expected = _message("serve", _param(SERVE_PARAMS, "max_request_bytes"), 1000)
    assert code == 2 and expected in err
    with pytest.raises(UserError) as exc:
        ServeConfig(artifact="art", max_request_bytes=1000).check()
    assert str(exc.value) == expected

    code, _, err = cli("kafka", tmp_path / "art", *KAFKA_ARGS, "--max-batch", "0")
    expected = _message("kafka", _param(KAFKA_PARAMS, "max_batch"), 0)
    assert code == 2 and expected in err
    with pytest.raises(UserError) as exc:
        BridgeConfig(bootstrap="127.0.0.1:9", request_topic="a", response_topic="b", max_batch=0).check()
    assert str(exc.value) == expected

    code, _, err = cli("bench", tmp_path / "art", "--rounds", "0")
    expected = _message("bench", _param(BENCH_PARAMS, "rounds"), 0)
    assert code == 2 and expected in err
    with pytest.raises(UserError) as exc:
        Settings(rounds=0).check()
    assert str(exc.value) == expected

    from bertopt.spark.job import spark_predict

    with pytest.raises(UserError) as exc:
        spark_predict(tmp_path / "art", tmp_path / "in.txt", tmp_path / "out", partitions=0)
    assert str(exc.value) == _message("spark-predict", _param(SPARK_PREDICT_PARAMS, "partitions"), 0)
    assert not (tmp_path / "out").exists()


def test_api_config_defaults_are_the_declared_ones():
    from bertopt.bench import SETTINGS_FIELDS
    from bertopt.kafka.params import BRIDGE_FIELDS
    from bertopt.serve.params import SERVE_FIELDS

    for fields, obj in ((SERVE_FIELDS, ServeConfig(artifact="art")),
                        (BRIDGE_FIELDS, BridgeConfig(bootstrap="b", request_topic="a", response_topic="c")),
                        (SETTINGS_FIELDS, Settings())):
        values = fields.values(obj)
        declared = [p for p in fields.params if not p.required]  # the required ones (topics) have no default
        assert declared and {p.name: values[p.name] for p in declared} == {p.name: p.default for p in declared}
    assert ServeConfig(artifact="art").grace_s == _param(SERVE_PARAMS, "grace").default == 60.0
    assert Settings().padded_texts == _param(BENCH_PARAMS, "texts").default == 256


def test_request_limits_serve_and_kafka_share_are_declared_once(cli, tmp_path):
    serve_p, kafka_p = _param(SERVE_PARAMS, "max_text_chars"), _param(KAFKA_PARAMS, "max_text_chars")
    for p in (serve_p, kafka_p, _param(SPARK_PREDICT_PARAMS, "max_text_chars")):
        assert (p.name, p.type, p.default, p.min) == (MAX_TEXT_CHARS_PARAM.name, int, MAX_TEXT_CHARS_PARAM.default,
                                                      MAX_TEXT_CHARS_PARAM.min)
    _, _, serve_err = cli("serve", tmp_path / "art", "--max-text-chars", "0")
    _, _, kafka_err = cli("kafka", tmp_path / "art", *KAFKA_ARGS, "--max-text-chars", "0")
    assert serve_err.strip() == "error: " + _message("serve", MAX_TEXT_CHARS_PARAM, 0)
    assert kafka_err.strip() == "error: " + _message("kafka", MAX_TEXT_CHARS_PARAM, 0)


def test_spark_predict_artifact_is_positional_and_the_old_option_still_works(cli, tmp_path):
    art, src = tmp_path / "art", tmp_path / "in.txt"
    src.write_text("hello\n")
    code, _, err = cli("spark-predict", art, "-i", src, "-o", tmp_path / "o")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"artifact not found: {art}" in lines[0]  # the argument arrived
    for old in ("--artifact", "-a"):
        code, _, err = cli("spark-predict", old, art, "-i", src, "-o", tmp_path / "o")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 2, err
        assert lines[0] == ("warning: --artifact/-a is deprecated; give ARTIFACT as the first argument: "
                            "bertopt spark-predict ARTIFACT ...")
        assert f"artifact not found: {art}" in lines[1]
    code, _, err = cli("spark-predict", tmp_path / "a", "--artifact", tmp_path / "b", "-i", src, "-o",
                       tmp_path / "o")
    assert code == 2 and err.strip() == ("error: spark-predict: ARTIFACT given twice (as an argument and as "
                                         "--artifact); give it once, as the argument")
    code, _, err = cli("spark-predict", "-i", src, "-o", tmp_path / "o")
    assert code == 2 and err.strip() == "error: spark-predict: 'artifact' is missing; give ARTIFACT"
    assert not (tmp_path / "o").exists()


def test_serve_applies_the_runtimes_max_sequence_length_rule(tiny_onnx):
    from bertopt.runtime.predictor import sequence_length
    from bertopt.serve.server import _model_facts

    info = tiny_onnx.model_info
    limit = int(info["max_position_embeddings"])
    assert _model_facts(str(tiny_onnx.path), None)["max_seq_len"] == sequence_length(info)
    assert _model_facts(str(tiny_onnx.path), 8)["max_seq_len"] == sequence_length(info, 8) == 8
    with pytest.raises(UserError) as served:
        _model_facts(str(tiny_onnx.path), limit + 1)
    with pytest.raises(UserError) as runtime:
        sequence_length(info, limit + 1)
    assert str(served.value) == str(runtime.value)
    assert f"exceeds the model's {limit} positions; use --max-seq-len {limit} or less" in str(served.value)
