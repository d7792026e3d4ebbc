"""`bertopt tune` as a user meets it: the machine decides the candidates, the time budget bounds the work, a
candidate that cannot run is one line, no passing candidate is exit 1 with nothing written, Ctrl-C leaves no
half-written artifact, bad options are one line and exit 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tune_checks import check_reports

from bertopt.artifact import Artifact
from bertopt.tiny_models import build_tiny_family_model
from bertopt.tune import parse_duration, plan_candidates, run_tune

FAST = ["--max-texts", "16", "--rounds", "1"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_family_model(tmp_path_factory.mktemp("tune-cli") / "hf", "bert")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".tune-work-" in p.name or ".old-" in p.name)


def test_the_machine_decides_the_candidates():
    # an AVX2-only CPU without a GPU: no bf16 (OpenVINO would run it as f32), no OpenVINO int8 (no int8 dot
    # product: its int8 kernels are slower than f32 there); ONNX Runtime's dynamic int8 is built and gated anyway
    built, left = plan_candidates({"avx2"}, [], threads=2)
    assert [c.name for c in built] == ["openvino-f32", "openvino-f32-throughput", "onnxruntime-fp32",
                                       "onnxruntime-int8"]
    assert "can saturate" in built[3].why
    reasons = {o.name: o.reason for o in left}
    assert set(reasons) == {"openvino-bf16", "openvino-bf16-throughput", "onnxruntime-fp16-cuda",
                            "openvino-int8-static", "openvino-int8-dynamic", "openvino-int8-accurate"}
    assert "no AVX-512 BF16 / AMX" in reasons["openvino-bf16"]
    assert "no int8 dot product" in reasons["openvino-int8-accurate"]
    assert "slower than its f32" in reasons["openvino-int8-static"]
    assert "no CUDA provider" in reasons["onnxruntime-fp16-cuda"]
    # AVX-512 VNNI + BF16 (this project's CI host) and a CUDA provider: everything
    built, left = plan_candidates({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, ["CUDAExecutionProvider"],
                                  threads=2)
    # ONNX Runtime's CPU candidates after OpenVINO's int8: a short budget skips them, not the static int8
    assert [c.name for c in built] == ["openvino-f32", "openvino-bf16", "openvino-bf16-throughput",
                                       "onnxruntime-fp16-cuda", "openvino-int8-dynamic", "openvino-int8-static",
                                       "onnxruntime-fp32", "onnxruntime-int8", "openvino-int8-accurate"]
    assert [o.name for o in left] == ["openvino-f32-throughput"]  # the bf16 twin runs the streams here
    # the throughput twin is its precision's compile with a stream per thread
    twin = next(c for c in built if c.name == "openvino-bf16-throughput")
    assert twin.steps == [("compile", {"runtime": "openvino", "performance_hint": "THROUGHPUT",
                                       "inference_precision": "bf16", "min_cosine": 0.99})]
    # one thread: one stream, no twin
    built, left = plan_candidates({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, [], threads=1)
    assert "openvino-bf16-throughput" not in [c.name for c in built]
    assert "one thread" in {o.name: o.reason for o in left}["openvino-bf16-throughput"]
    dynamic = next(c for c in built if c.name == "openvino-int8-dynamic")
    # int8 weights and per-token int8 activations, the FFN outputs and the rest in f32 (docs/performance.md)
    assert dynamic.steps == [("quantize", {"mode": "int8-dynamic", "runtime": "openvino", "op_types": ["MatMul"],
                                           "keep_ffn_output": True, "inference_precision": "f32"})]
    static = next(c for c in built if c.name == "openvino-int8-static")
    assert static.steps == [("quantize", {"mode": "int8-static", "runtime": "openvino",
                                          "accuracy_target": "cos_min=0.997", "calibration_size": 192})]
    # AMX without AVX-512 BF16 flags still has native bf16 and int8
    assert "openvino-bf16" in [c.name for c in plan_candidates({"amx_bf16", "amx_int8"}, [])[0]]


def test_durations():
    assert parse_duration("10m") == 600 and parse_duration("90s") == 90 and parse_duration("1h30m") == 5400
    assert parse_duration("45") == 45


def test_budget_spent_before_anything_passed_goes_on(tiny_model, tmp_path):
    lines: list[str] = []
    result = run_tune(str(tiny_model), tmp_path / "tuned", {"candidates": ["openvino-f32"], "max_texts": 16,
                                                            "rounds": 1, "time_budget": "0.001s"}, say=lines.append)
    assert "time budget (0.001s) spent but no candidate has passed yet; going on with openvino-f32" in lines
    assert result.record["winner"] == "openvino-f32"


def test_budget_spent_keeps_the_first_passing_candidate(tiny_model, tmp_path, cli):
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--time-budget", "1s",
                            "--candidates", "openvino-f32,onnxruntime-fp32,onnxruntime-int8", *FAST)
    assert code == 0, err + stdout
    record = Artifact.load(out).manifest["tune"]
    status = {c["name"]: c["status"] for c in record["candidates"]}
    # building and gating the first candidate outlasts one second: the rest are skipped, each with a line (had
    # the budget run out before it, it would still run: nothing had passed yet)
    assert status == {"openvino-f32": "passed", "onnxruntime-fp32": "skipped", "onnxruntime-int8": "skipped"}
    assert "onnxruntime-fp32: skipped: time budget (1s) spent" in stdout
    # the table names each candidate and its fate whole on an 80-column console (not "onnxruntime…" twice)
    for name, fate in status.items():
        assert re.search(rf"│ {re.escape(name)} +│ {fate} ", stdout), stdout
    assert record["winner"] == "openvino-f32"
    # how the winner runs, as its stage decided it (the full-batch copy measured, not assumed), is in its record
    winner = next(c for c in record["candidates"] if c["name"] == "openvino-f32")
    assert winner["runtime_options"] == Artifact.load(out).manifest["runtime_options"]
    assert winner["static_full_batch"]["setting"] == "auto"
    assert winner["runtime_options"]["static_full_batch"] == winner["static_full_batch"]["on"]
    # a candidate that passed in batches is run alone too; the manifest keeps the batched run's record (the run
    # that measured the batch deviation served texts are held to), not the later one alone
    gates = tmp_path / "tuned-report" / "candidates" / "openvino-f32"
    assert (gates / "alone" / "validation.json").is_file() and winner["cos_min_alone"] >= 0.995
    validation = Artifact.load(out).manifest["validation"]
    assert Path(validation["gate"]["report_dir"]).name == "batched" and validation["batch_invariance"]["texts"] > 0
    check_reports(tmp_path / "tuned-report", record)


def test_a_candidate_that_cannot_run_is_one_line_and_tune_goes_on(tiny_model, tmp_path):
    # told there is a CUDA provider where ONNX Runtime has none: the fp16 GPU candidate is built, cannot be opened
    # on a GPU, and is refused with the runtime's one line; the CPU candidate wins
    lines: list[str] = []
    result = run_tune(str(tiny_model), tmp_path / "tuned",
                      {"candidates": ["onnxruntime-fp32", "onnxruntime-fp16-cuda"], "max_texts": 16, "rounds": 1},
                      say=lines.append, gpus=["CUDAExecutionProvider"])
    by_name = {c["name"]: c for c in result.record["candidates"]}
    assert by_name["onnxruntime-fp16-cuda"]["status"] == "refused"
    refusal = next(line for line in lines if line.startswith("onnxruntime-fp16-cuda: refused: "))
    assert "\n" not in refusal and "provider 'cuda' is not available in onnxruntime" in refusal
    assert "pip install 'bertopt[gpu]'" in refusal  # the runtime's one line names the extra that has CUDA
    assert result.record["winner"] == "onnxruntime-fp32"


@pytest.mark.gpu  # skipped where no GPU is visible (tests/conftest.py)
def test_on_a_gpu_the_fp16_cuda_candidate_is_gated_timed_and_recorded(tiny_model, tmp_path):
    lines: list[str] = []
    result = run_tune(str(tiny_model), tmp_path / "tuned",
                      {"candidates": ["onnxruntime-fp32", "onnxruntime-fp16-cuda"], "max_texts": 64, "rounds": 2},
                      say=lines.append)
    record = result.record
    assert "CUDAExecutionProvider" in record["gpu_providers"]
    fp16 = {c["name"]: c for c in record["candidates"]}["onnxruntime-fp16-cuda"]
    assert fp16["status"] == "passed", lines
    assert fp16["cos_min_alone"] >= 0.995 and fp16["cos_min_batched"] >= 0.995 and fp16["texts_per_s"] > 0
    winner = Artifact.load(tmp_path / "tuned")
    expected = "cuda" if record["winner"] == "onnxruntime-fp16-cuda" else None
    assert winner.manifest.get("runtime_options", {}).get("provider") == expected
    check_reports(tmp_path / "tuned-report", record)


def test_no_passing_candidate_exits_1_and_writes_no_artifact(tiny_model, tmp_path, cli):
    out = tmp_path / "tuned"
    # max_abs <= 1e-12 against PyTorch: no runtime meets it
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--candidates", "openvino-f32,onnxruntime-fp32",
                            "--targets", "max_abs<=1e-12", *FAST)
    assert code == 1, err + stdout
    assert "gate failed: no candidate passed the gate (max_abs<=1e-12)" in " ".join(err.split())
    assert not out.exists() and _leftovers(tmp_path) == []
    assert "openvino-f32: failed the gate: max_abs" in stdout
    report = (tmp_path / "tuned-report" / "tune.md").read_text()
    assert "Winner: **none**" in report and "| openvino-f32 | failed |" in report
    # the batched run (batch invariance included) goes first; a candidate that fails it is not run alone
    record = json.loads((tmp_path / "tuned-report" / "tune.json").read_text())
    for c in record["candidates"]:
        gates = tmp_path / "tuned-report" / "candidates" / c["name"]
        assert (gates / "batched" / "validation.json").is_file() and not (gates / "alone").exists(), c["name"]
        assert "cos_min_batched" in c and "batch_dev" in c and "cos_min_alone" not in c
        assert c["reason"].endswith("not run alone: it failed in batches")


@pytest.mark.parametrize("args, message", [
    (["--time-budget", "soon"], "write it like 10m, 90s or 1h30m"),
    (["--candidates", "openvino-int4"], "unknown candidate 'openvino-int4'"),
    (["--targets", "cos_min=high"], "cannot read target"),
    (["--rounds", "0"], "'rounds' must be at least 1"),
    # a gate with no target would fall back to validate's looser defaults and no batch-deviation bound
    (["--targets", ","], "',' names no target"),
    (["--task", "bogus"], "tune: 'task' must be one of embedding,"),
])
def test_bad_options_are_one_line(tiny_model, tmp_path, cli, args, message):
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", tiny_model, "--out", out, *args)
    assert code == 2 and message in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert not (tmp_path / "tuned-report").exists()


def test_a_report_folder_of_the_users_is_never_touched(tiny_model, tmp_path, cli):
    # a folder that merely holds names a tune report uses is not one (no tune.json of tune's): refused before any
    # work, with or without --force, and nothing in it removed
    mine = tmp_path / "reports"
    (mine / "candidates").mkdir(parents=True)
    (mine / "candidates" / "alice.txt").write_text("my CV")
    (mine / "tune.md").write_text("my notes")
    for force in ([], ["--force"]):
        code, _, err = cli("tune", tiny_model, "--out", tmp_path / "tuned", "--report-dir", mine, *force, *FAST)
        assert code == 2 and "--report-dir" in err and "is not a bertopt tune report" in " ".join(err.split()), err
    assert (mine / "candidates" / "alice.txt").read_text() == "my CV" and (mine / "tune.md").read_text() == "my notes"
    assert sorted(p.name for p in mine.iterdir()) == ["candidates", "tune.md"]
    assert not (tmp_path / "tuned").exists()


@pytest.mark.parametrize("out, report, message", [
    ("model/tuned", None, "--out {tmp}/model/tuned is inside the input"),
    ("tuned", "model/reports", "--report-dir {tmp}/model/reports is inside the input"),
    ("tuned", "tuned", "--report-dir {tmp}/tuned overlaps --out {tmp}/tuned"),
    ("tuned", "tuned/report", "overlaps --out"),
    ("reports/tuned", "reports", "overlaps --out"),
])
def test_outputs_in_the_model_or_in_each_other_are_refused(tiny_model, tmp_path, cli, out, report, message):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    before = sorted(p.name for p in model.iterdir())
    args = ["--report-dir", tmp_path / report] if report else []
    code, stdout, err = cli("tune", model, "--out", tmp_path / out, *args, *FAST)
    assert code == 2 and message.format(tmp=tmp_path) in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in model.iterdir()) == before  # no report, no scratch inside the model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_artifact_is_not_a_source(tiny_model, tmp_path, cli):
    code, _, err = cli("export", tiny_model, "--out", tmp_path / "art")
    assert code == 0, err
    code, _, err = cli("tune", tmp_path / "art", "--out", tmp_path / "tuned", *FAST)
    assert code == 2 and "is a bertopt artifact; tune starts from the model" in " ".join(err.split()), err
    assert f"its lineage names {tiny_model}" in " ".join(err.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    code, _, err = cli("export", tmp_path / "art", "--out", tmp_path / "again")
    assert code == 2 and "is already an ONNX artifact: export makes one from a model" in " ".join(err.split()), err


def test_an_existing_folder_is_not_replaced(tiny_model, tmp_path, cli):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = cli("tune", tiny_model, "--out", out, *FAST)
    assert code == 2 and "already exists" in err
    code, _, err = cli("tune", tiny_model, "--out", out, "--force", *FAST)
    assert code == 2 and "is not a bertopt artifact (it holds other files); refusing to replace it" in \
        " ".join(err.split())
    assert (out / "notes.txt").read_text() == "keep me"


def test_outputs_keeps_only_the_named_output_and_gates_it(tiny_model, tmp_path, cli):
    # a user who serves only sentence embeddings: the artifact keeps that output, and the gate (batch deviation
    # included) bounds that output alone
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--outputs", "sentence_embedding",
                            "--candidates", "onnxruntime-fp32", *FAST)
    assert code == 0, err + stdout
    art = Artifact.load(out)
    assert [o["name"] for o in art.outputs] == ["sentence_embedding"]
    record = art.manifest["tune"]
    assert record["outputs"] == ["sentence_embedding"] and record["primary_output"] == "sentence_embedding"
    assert list(art.manifest["validation"]["batch_invariance"]["outputs"]) == ["sentence_embedding"]


def test_an_unknown_output_is_one_line_and_leaves_nothing(tiny_model, tmp_path, cli):
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--outputs", "pooler_output",
                            "--candidates", "onnxruntime-fp32", *FAST)
    assert code == 2, err + stdout
    assert "unknown output 'pooler_output'; this artifact has last_hidden_state, sentence_embedding" in \
        " ".join(err.split())
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and _leftovers(tmp_path) == []
    assert not (tmp_path / "tuned-report").exists()  # the usage error is found before a report is written


def test_a_run_that_stops_early_keeps_the_earlier_report(tiny_model, tmp_path, cli):
    out = tmp_path / "tuned"
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--candidates", "onnxruntime-fp32", *FAST)
    assert code == 0, err + stdout
    report = tmp_path / "tuned-report"
    before = {p.relative_to(report): p.read_bytes() for p in report.rglob("*") if p.is_file()}
    assert Path("tune.json") in before and Path("gate-texts.jsonl") in before
    code, stdout, err = cli("tune", tiny_model, "--out", out, "--force", "--outputs", "pooler_output",
                            "--candidates", "onnxruntime-fp32", *FAST)
    assert code == 2 and "unknown output 'pooler_output'" in err, err + stdout
    after = {p.relative_to(report): p.read_bytes() for p in report.rglob("*") if p.is_file()}
    assert after == before and _leftovers(tmp_path) == []
    Artifact.load(out)  # the artifact of the first run, whole
    made = tmp_path / "made-for-it"  # an empty folder the user made for the report stays, empty
    made.mkdir()
    code, _, err = cli("tune", tiny_model, "--out", tmp_path / "other", "--report-dir", made, "--outputs", "nope",
                       "--candidates", "onnxruntime-fp32", *FAST)
    assert code == 2 and made.is_dir() and not any(made.iterdir()), err


def _default_sigint() -> None:
    # a process started from a non-interactive shell's background job inherits SIGINT ignored; a user's terminal
    # delivers it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_half_written_artifact(tiny_model, tmp_path):
    out = tmp_path / "tuned"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bertopt.cli", "tune", str(tiny_model), "--out", str(out), *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path, preexec_fn=_default_sigint)
    seen = []
    try:
        for line in proc.stdout:  # interrupt once the first candidate has been gated, mid-run
            seen.append(line)
            if "openvino-f32: passed the gate" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(seen) + rest
    assert not out.exists() and not (tmp_path / "tuned-report").exists()
    assert _leftovers(tmp_path) == []


def test_static_int8_candidate_is_built_and_gated(tiny_model, tmp_path):
    # NNCF static int8 builds on this machine's CPU (the candidate is planned only with VNNI / AMX): built from the
    # shared export + prune and held to the same gate as the others, never refused for being static int8
    lines: list[str] = []
    result = run_tune(str(tiny_model), tmp_path / "tuned", {"candidates": ["openvino-int8-static"], "max_texts": 16,
                                                            "rounds": 1}, say=lines.append,
                      features={"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
    static = next(c for c in result.record["candidates"] if c["name"] == "openvino-int8-static")
    assert static["status"] == "passed", static
    assert static["cos_min_alone"] >= 0.995 and static["cos_min_batched"] >= 0.995 and static["batch_dev"] <= 1e-3
    art = Artifact.load(tmp_path / "tuned")
    assert art.model_format == "openvino-ir" and art.precision == "int8-static+bf16"


def test_timing_warms_every_candidate_on_every_text_first(tiny_model, tmp_path, monkeypatch):
    # OpenVINO compiles kernels per new input shape and mixed text's length buckets are mostly new shapes: a warm-up
    # on a few batches left the first timed round timing compilation (MiniLM's static int8 at 0.65x bf16 in tune's
    # one round, 0.92x in bench). Each candidate's first run is the whole timing set, untimed, then one per round
    from bertopt.data import mixed_text
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.tune import Candidate, Outcome, time_side_by_side

    onnx = run_stage("export", tiny_model, {}, tmp_path / "onnx")
    outcomes = [Outcome("openvino-f32", "passed", artifact=run_stage(
                    "compile", onnx, {"runtime": "openvino", "inference_precision": "f32"}, tmp_path / "ov"),
                    candidate=Candidate("openvino-f32", [], "openvino", "f32")),
                Outcome("onnxruntime-fp32", "passed", artifact=onnx,
                        candidate=Candidate("onnxruntime-fp32", [], "onnxruntime", "fp32"))]
    texts = [t for t in mixed_text() if t.strip()][:40]
    runs: dict[int, list[int]] = {}
    real_run = Predictor.run

    def counted(self, texts, *args, **kwargs):
        runs.setdefault(id(self), []).append(len(texts))
        return real_run(self, texts, *args, **kwargs)

    monkeypatch.setattr(Predictor, "run", counted)
    done = time_side_by_side(outcomes, texts, None, rounds=2, threads=1, batch_size=8, deadline=float("inf"),
                             say=lambda line: None)
    assert done == 2 and len(runs) == 2
    assert all(calls == [40, 40, 40] for calls in runs.values()), runs
    assert all(len(o.figures["texts_per_s_rounds"]) == 2 and o.figures["texts_per_s"] > 0 for o in outcomes)


def test_a_budget_that_cut_timing_says_what_budget_would_time_every_round(tiny_model, tmp_path):
    # make demo on a slow CPU gets one timing round of three: the line says what --time-budget would give all three
    from bertopt.data import mixed_text
    from bertopt.registry import run_stage
    from bertopt.tune import Candidate, Outcome, time_side_by_side

    onnx = run_stage("export", tiny_model, {}, tmp_path / "onnx")
    outcomes = [Outcome("onnxruntime-fp32", "passed", artifact=onnx,
                        candidate=Candidate("onnxruntime-fp32", [], "onnxruntime", "fp32"))]
    texts = [t for t in mixed_text() if t.strip()][:24]
    lines: list[str] = []
    before = time.monotonic()
    started = before - 100  # a run that began 100 s ago, its deadline already passed
    done = time_side_by_side(outcomes, texts, None, rounds=3, threads=1, batch_size=8, deadline=0.0,
                             say=lines.append, started=started)
    ended = time.monotonic()
    assert done == 1 and len(lines) == 1, lines
    m = re.fullmatch(r"time budget spent: timing stopped after 1 of 3 rounds; --time-budget (\S+) would have timed "
                     r"all 3 here", lines[0])
    assert m, lines[0]
    round_s = len(texts) / outcomes[0].figures["texts_per_s_rounds"][0]
    suggested = parse_duration(m.group(1))  # a value the option takes
    # the time so far plus two more rounds at this pace, rounded up to half a minute
    assert before - started + 2 * round_s <= suggested <= ended - started + 2 * round_s + 31


@pytest.mark.parametrize("seconds,text", [(0.2, "1s"), (45, "45s"), (59.2, "1m"), (61, "1m30s"), (196.4, "3m30s"),
                                          (3599, "1h"), (3725, "1h2m30s")])
def test_format_duration_rounds_up_to_what_time_budget_reads(seconds, text):
    from bertopt.tune import format_duration, parse_duration

    assert format_duration(seconds) == text and parse_duration(text) >= seconds
