"""The OpenVINO backend and the compile stage that selects it, on a tiny random BERT (real OpenVINO, real ORT)."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import openvino  # noqa: E402,F401  (make test installs it: a broken install must fail, not skip)
import pytest

from bertopt.artifact import Artifact
from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.machine import cpu_features
from bertopt.registry import run_stage
from bertopt.runtime import Predictor

pytestmark = pytest.mark.usefixtures("private_openvino_cache")


@pytest.fixture(scope="module")
def texts():
    return corpus()[:64]


@pytest.fixture(scope="module")
def ov_f32(tiny_onnx, tmp_path_factory):
    return run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32"},
                     tmp_path_factory.mktemp("ov") / "f32")


@pytest.fixture(scope="module")
def ov_bf16(tiny_onnx, tmp_path_factory):
    return run_stage("compile", tiny_onnx, {"inference_precision": "bf16"}, tmp_path_factory.mktemp("ov") / "bf16")


def _flat(values):
    return np.concatenate([np.ravel(v) for v in values])


def test_openvino_f32_matches_onnxruntime(tiny_onnx, ov_f32, texts):
    ov = Predictor(ov_f32.path)
    ort = Predictor(tiny_onnx.path)
    assert ov.session.backend == "openvino" and ort.session.backend == "onnxruntime"
    got, ref = ov.run(texts), ort.run(texts)
    assert set(got) == set(ref) == {"last_hidden_state", "sentence_embedding"}
    assert got["sentence_embedding"].shape == ref["sentence_embedding"].shape == (len(texts), 32)
    assert np.allclose(got["sentence_embedding"], ref["sentence_embedding"], atol=1e-5)
    assert [a.shape for a in got["last_hidden_state"]] == [b.shape for b in ref["last_hidden_state"]]
    assert np.allclose(_flat(got["last_hidden_state"]), _flat(ref["last_hidden_state"]), atol=1e-4)


def test_bf16_is_close_but_not_identical(tiny_onnx, ov_bf16, texts):
    got = Predictor(ov_bf16.path).encode(texts)
    ref = Predictor(tiny_onnx.path).encode(texts)
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() > 0.99
    report = ov_bf16.lineage["report"]
    assert report["effective_inference_precision"] in ("bf16", "f32")  # f32 where the CPU has no bf16 support
    if report["effective_inference_precision"] == "bf16":
        assert not np.allclose(got, ref, atol=1e-7)  # bf16 really ran


def test_compile_records_runtime_and_predictor_uses_it(tiny_onnx, ov_f32):
    manifest = json.loads((ov_f32.path / "bertopt.json").read_text())
    assert manifest["runtime"] == "openvino"
    options = manifest["runtime_options"]
    assert {k: options[k] for k in ("inference_precision", "performance_hint")} == {"inference_precision": "f32",
                                                                                   "performance_hint": "LATENCY"}
    # static_full_batch auto: measured by the stage, the decision and what it rests on recorded
    decided = manifest["lineage"]["report"]["static_full_batch"]
    assert options["static_full_batch"] is decided["on"] and decided["setting"] == "auto"
    assert (decided["batch"], decided["tokens"]) == (32, Predictor(ov_f32.path).max_seq_len)
    assert decided["why"].startswith("measured ") and "full batches of 32 x" in decided["why"]
    if abs(decided["ratio"] - 1.03) > 0.002:  # the record rounds the ratio: at the bound either way may be right
        assert decided["on"] == (decided["ratio"] >= 1.03)
    assert manifest["precision"] == "fp32"
    assert manifest["lineage"]["stage"] == "compile"
    assert manifest["lineage"]["parent"]["digest"] == tiny_onnx.digest
    assert manifest["lineage"]["report"]["accuracy_vs_parent"]["sentence_embedding"]["cos_min"] > 0.9999
    loaded = Artifact.load(ov_f32.path)  # hashes verify
    assert loaded.runtime == "openvino"
    pred = Predictor(loaded)
    assert pred.describe()["backend"] == "openvino"
    # a caller may still override the manifest's choice
    assert Predictor(loaded, runtime="onnxruntime").session.backend == "onnxruntime"


def test_compile_for_onnxruntime_records_it(tiny_onnx, tmp_path):
    art = run_stage("compile", tiny_onnx, {"runtime": "onnxruntime"}, tmp_path / "ort")
    assert art.runtime == "onnxruntime" and Predictor(art.path).session.backend == "onnxruntime"


def test_compile_refuses_fused_onnxruntime_graph(tiny_optimized, tmp_path, cli):
    fused = tiny_optimized
    out = tmp_path / "ov"
    code, _, err = cli("compile", fused.path, "--out", out)
    assert code == 2
    assert "contrib ops" in err and "before 'optimize'" in err
    assert not out.exists() and not list(tmp_path.glob(".ov.tmp-*"))


@pytest.mark.skipif(not cpu_features() & {"avx512_bf16", "amx_bf16"},
                    reason="OpenVINO runs bf16 as f32 on a CPU without native bf16: nothing drifts to refuse")
def test_compile_drift_refusal_names_the_fix_that_applies(tiny_onnx, ov_bf16, tmp_path, cli):
    code, _, err = cli("compile", tiny_onnx.path, "--out", tmp_path / "a", "--inference-precision", "bf16",
                       "--min-cosine", "1")
    assert code == 2 and "drifts from its input" in err and "use --inference-precision f32 or lower --min-cosine" in err
    # already f32: the drift is the bf16 parent's, so f32 is no fix to offer
    code, _, err = cli("compile", ov_bf16.path, "--out", tmp_path / "b", "--inference-precision", "f32",
                       "--min-cosine", "1")
    assert code == 2 and err.strip().endswith("lower --min-cosine") and "--inference-precision" not in err
    assert not list(tmp_path.iterdir())


def test_a_model_openvino_cannot_open_is_one_line_with_a_fix_that_applies(ov_f32, tmp_path):
    # the advice for ONNX Runtime's fused graphs (use the unfused artifact) is kept for graphs that have its
    # contrib ops; it came with every failure before, a cache race's included
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ov_f32.path, broken)
    (broken / ov_f32.manifest["model_file"]).write_bytes(b"not an ONNX model\n" * 8)
    with pytest.raises(UserError) as damaged:
        Predictor(Artifact(broken, ov_f32.manifest), verify=False)
    assert str(damaged.value).startswith("OpenVINO cannot ")
    assert str(damaged.value).endswith("re-create the artifact with the stage that wrote it, or run it with "
                                       "--runtime onnxruntime") and "\n" not in str(damaged.value)


def test_compile_cli_writes_artifact(tiny_onnx, tmp_path, cli):
    out = tmp_path / "ov-cli"
    code, stdout, _ = cli("compile", tiny_onnx.path, "--out", out, "--inference-precision", "f32")
    assert code == 0, stdout
    assert "wrote" in stdout and "vs input: cos mean" in stdout
    assert Artifact.load(out).runtime == "openvino"
    code, _, err = cli("compile", tiny_onnx.path, "--out", tmp_path / "x", "--inference-precision", "int4")
    assert code == 2 and "inference_precision" in err


def test_openvino_refuses_gpu_provider(ov_f32):
    with pytest.raises(UserError, match="not available with the OpenVINO runtime"):
        Predictor(ov_f32.path, provider="cuda")


def test_openvino_caches_compiled_model(ov_f32, private_openvino_cache):
    Predictor(ov_f32.path)
    assert any(p.is_file() for p in (private_openvino_cache / "openvino").rglob("*"))


def test_openvino_session_is_thread_safe(ov_f32, texts):
    pred = Predictor(ov_f32.path, batch_size=8)
    expected = pred.encode(texts)
    results, errors = {}, []

    def work(i):
        try:
            results[i] = pred.encode(texts)
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert all(np.allclose(results[i], expected, atol=1e-6) for i in range(3))


def test_profiling_option_gives_per_node_kernels(ov_f32, texts):
    """runtime_options 'profiling' (benchmarks/profile_openvino.py): the last run's per-node records name the
    kernel of every weight MatMul; the same values as without profiling; a session compiled without it says how."""
    plain = Predictor(ov_f32.path, threads=1)
    with pytest.raises(UserError, match="compiled without profiling; set runtime_options 'profiling': true"):
        plain.session.profiling_info()
    options = {**ov_f32.manifest["runtime_options"], "profiling": True}
    profiled = Predictor(Artifact(ov_f32.path, {**ov_f32.manifest, "runtime_options": options}), threads=1,
                         verify=False)
    got = profiled.encode(texts[:8])
    np.testing.assert_allclose(got, plain.encode(texts[:8]), atol=1e-6)
    records = profiled.session.profiling_info()
    executed = [r for r in records if str(r.status).endswith("EXECUTED")]
    assert executed and all(r.real_time.total_seconds() >= 0 for r in executed)
    matmuls = [r for r in executed if r.node_type.startswith(("FullyConnected", "MatMul"))]
    assert matmuls and all("f32" in r.exec_type.lower() for r in matmuls)  # f32 pinned: no bf16/int8 kernel
    assert any(op.get_type_name() for op in profiled.session.runtime_model().get_ordered_ops())


def test_the_blob_cache_is_bounded_oldest_first(ov_f32, tmp_path, monkeypatch):
    # every compile of a new model writes a blob (MPNet's: ~270 MB); unbounded, they once filled a CI disk
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BERTOPT_OPENVINO_CACHE_MB", "2")
    folder = tmp_path / "openvino"
    folder.mkdir(mode=0o700)
    old = folder / "0000.blob"
    old.write_bytes(b"\0" * (3 << 20))  # an older model's blob: over the bound on its own
    os.utime(old, (1_000_000_000, 1_000_000_000))
    want = Predictor(ov_f32.path).encode(["a sentence"])
    blobs = list(folder.glob("*.blob"))
    assert not old.exists() and len(blobs) == 1  # the oldest went, the one just compiled stayed
    assert sum(b.stat().st_size for b in blobs) <= 2 << 20
    np.testing.assert_array_equal(Predictor(ov_f32.path).encode(["a sentence"]), want)  # loaded from the blob


def test_a_zero_bound_turns_the_blob_cache_off(ov_f32, tmp_path, monkeypatch):
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BERTOPT_OPENVINO_CACHE_MB", "0")
    Predictor(ov_f32.path).encode(["a sentence"])
    assert not list(tmp_path.rglob("*.blob"))


def test_a_cache_lock_held_too_long_is_bypassed_by_compiling_without_the_cache(ov_f32, tmp_path):
    # a process stuck holding a model's lock must not stop every other from opening it: after the wait, the model
    # is compiled without the cache (nothing read from it, nothing written to it)
    import openvino as ov

    from bertopt.output_paths import one_at_a_time
    from bertopt.runtime.openvino_backend import cache_lock_path, compile_with_cache

    folder = tmp_path / "openvino"
    model = str(ov_f32.model_path)
    with one_at_a_time(cache_lock_path(folder, model), wait_s=0):
        compiled = compile_with_cache(ov.Core(), model, {"CACHE_DIR": str(folder)}, wait_s=0.5)
    assert compiled.inputs and not list(folder.glob("*.blob"))
    compile_with_cache(ov.Core(), model, {"CACHE_DIR": str(folder)}, wait_s=0.5)  # free: compiled into the cache
    assert len(list(folder.glob("*.blob"))) == 1


def test_a_blob_cache_others_may_write_is_refused_in_one_line(ov_f32, tmp_path, monkeypatch, cli):
    # a blob loads without a hash: whoever can write the folder could have another model served in place of the
    # validated one. bertopt creates it private; a shared one is refused, naming the folder and the fixes
    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path))
    Predictor(ov_f32.path)
    assert ((tmp_path / "openvino").stat().st_mode & 0o777) == 0o700  # created private
    (tmp_path / "openvino").chmod(0o777)
    code, out, err = cli("bench", ov_f32.path, "--texts", "4", "--mixed-texts", "4", "--rounds", "1")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: OpenVINO's compiled-model cache {tmp_path / 'openvino'} is owned by another user or writable by "
        f"others, and a blob loads unverified; chmod go-w {tmp_path / 'openvino'} (as its owner) or use another "
        "folder")
    monkeypatch.setenv("BERTOPT_OPENVINO_CACHE_MB", "0")  # no cache: nothing is loaded from it
    Predictor(ov_f32.path).encode(["a sentence"])


def test_a_bad_cache_bound_is_one_line_naming_the_variable(ov_f32, monkeypatch):
    monkeypatch.setenv("BERTOPT_OPENVINO_CACHE_MB", "2GB")
    with pytest.raises(UserError, match=r"BERTOPT_OPENVINO_CACHE_MB='2GB' is not a size; set a whole number of "
                                        r"megabytes \(0 turns the compiled-model cache off; default 2048\)"):
        Predictor(ov_f32.path)


def test_a_model_is_compiled_into_the_shared_cache_by_one_process_at_a_time(ov_f32, tmp_path, monkeypatch):
    # processes sharing the blob cache (a server's workers, Spark's executors) read a blob OpenVINO was still
    # writing: three processes opening one model with an empty cache failed 3 times in 75 (an empty "core.cpp:132"
    # error, or killed by SIGBUS). The one holding the model's lock compiles; another waits, then loads the blob
    from bertopt.output_paths import one_at_a_time
    from bertopt.runtime.openvino_backend import cache_dir, cache_lock_path

    monkeypatch.setenv("BERTOPT_CACHE_DIR", str(tmp_path))
    opened, errors = [], []

    def open_model():
        try:
            opened.append(Predictor(ov_f32.path).encode(["a sentence"]))
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    with one_at_a_time(cache_lock_path(cache_dir(), str(ov_f32.model_path)), wait_s=0) as held:
        assert held  # as another process compiling this model holds it
        opener = threading.Thread(target=open_model)
        opener.start()
        opener.join(timeout=5)  # the tiny model compiles in well under a second when nothing holds it
        assert opener.is_alive() and not opened and not list(tmp_path.rglob("*.blob"))
    opener.join(timeout=60)
    assert not errors and len(opened) == 1
    assert len(list((tmp_path / "openvino").glob("*.blob"))) == 1


def test_fused_int8_attention_is_turned_off_only_where_it_is_wrong(ov_f32):
    # OpenVINO's fused int8 attention gave a text alone wrong results on AMX with a bf16 float part (static int8
    # MiniLM: cos min 0.928 alone vs 0.984 batched): the compile turns it off there, for FakeQuantize models only
    from bertopt.runtime.openvino_backend import (
        compile_config,
        holds_fake_quantize,
        int8_attention_fusion_is_wrong_here,
    )

    amx = {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}
    assert int8_attention_fusion_is_wrong_here({"inference_precision": "bf16"}, amx)
    assert int8_attention_fusion_is_wrong_here({}, amx)  # auto is bf16 on such a CPU
    assert not int8_attention_fusion_is_wrong_here({"inference_precision": "f32"}, amx)  # measured 5e-5 there
    assert not int8_attention_fusion_is_wrong_here({"inference_precision": "bf16"}, amx - {"amx_int8", "amx_bf16"})
    options = {"inference_precision": "bf16", "cache": False}
    here = int8_attention_fusion_is_wrong_here(options)
    assert compile_config(options, 2, static_int8=True).get("SNIPPETS_MODE") == ("DISABLE" if here else None)
    assert "SNIPPETS_MODE" not in compile_config(options, 2, static_int8=False)
    # a float model holds no FakeQuantize: its fused bf16 attention stays (2.2e-5 alone vs batched on AMX)
    assert not holds_fake_quantize(openvino.Core().read_model(str(ov_f32.model_path)))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one OpenVINO stream per thread")
def test_throughput_streams_run_batches_side_by_side_with_the_same_outputs(tiny_onnx, ov_f32, texts, tmp_path):
    """performance_hint THROUGHPUT (tune's *-throughput candidates): a stream per thread, the Predictor keeps a
    batch in flight on each and splits a call of one batch between them; the outputs are those of the one-stream
    artifact, in the caller's order."""
    streams = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                               "performance_hint": "THROUGHPUT"}, tmp_path / "streams")
    assert streams.manifest["runtime_options"]["performance_hint"] == "THROUGHPUT"
    one, two = Predictor(ov_f32.path, threads=2, batch_size=8), Predictor(streams.path, threads=2, batch_size=8)
    assert (one.session.parallel_runs, one.session.concurrent_runs) == (1, False)
    assert (two.session.parallel_runs, two.session.concurrent_runs) == (2, True)
    mixed = texts[::-1]  # not in length order: results must come back in the caller's order
    np.testing.assert_allclose(two.encode(mixed), one.encode(mixed), atol=1e-6)
    before = one.stats["batches"], two.stats["batches"]
    five = ["a short one", "a somewhat longer text than that", "three words here", "four", "and the fifth text"]
    tokens_one = one.run(five, batch_size=8, pad_to=32)["last_hidden_state"]  # padded: no length buckets
    tokens_two = two.run(five, batch_size=8, pad_to=32)["last_hidden_state"]
    assert [t.shape for t in tokens_two] == [t.shape for t in tokens_one]
    assert max(float(np.abs(a - b).max()) for a, b in zip(tokens_one, tokens_two)) <= 1e-5
    # one batch of five texts: in two parts, one per stream
    assert (one.stats["batches"] - before[0], two.stats["batches"] - before[1]) == (1, 2)


def test_side_by_side_keeps_order_and_raises_the_first_error():
    from bertopt.runtime.predictor import side_by_side

    seen = []

    def double(x):
        seen.append(threading.current_thread().name)
        return 2 * x

    assert side_by_side(double, list(range(20)), 2) == [2 * x for x in range(20)]
    assert "bertopt-stream" in seen  # a helper ran some of them

    def fails_on_seven(x):
        if x == 7:
            raise UserError("text 7 is bad")
        return x

    with pytest.raises(UserError, match="text 7 is bad"):
        side_by_side(fails_on_seven, list(range(20)), 2)
    assert side_by_side(double, [3], 2) == [6]  # one item: run here, no helper


def test_bertopt_threads_is_the_default_thread_count_and_threads_still_win(ov_f32, monkeypatch):
    # several bertopt processes on one machine (the test suite's workers, two servers on a host) each take their
    # part of the cores without passing --threads to every command
    monkeypatch.setenv("BERTOPT_THREADS", "1")
    session = Predictor(ov_f32.path).session
    assert session.threads == 1 and int(session._compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert Predictor(ov_f32.path, threads=2).session.threads == 2


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5", "100000"])
def test_a_bad_bertopt_threads_is_one_line_exit_2(ov_f32, cli, monkeypatch, value):
    monkeypatch.setenv("BERTOPT_THREADS", value)
    code, stdout, err = cli("bench", ov_f32.path, "--rounds", "1")
    assert code == 2, err + stdout
    said = " ".join(err.split())
    assert f"BERTOPT_THREADS={value!r} is not a thread count; set a whole number from 1 to 1024" in said
    assert "Traceback" not in err


FIRST_CALL_SIDE_BY_SIDE = """
import sys
sys.setswitchinterval(1e-6)  # the GIL changes hands as often as it can: the race, every time
from bertopt.runtime import Predictor
p = Predictor(sys.argv[1], threads=2, batch_size=8)
assert p.session.parallel_runs == 2
p.run(["a first text", "a second one", "three", "and a fourth text here"] * 2, pad_to=32)  # split in two
print("answered")
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one OpenVINO stream per thread")
def test_the_first_call_of_a_fresh_process_runs_its_streams_without_deadlock(tiny_onnx, tmp_path):
    # OpenVINO's numpy bridge, first touched by two threads at once, deadlocked (a THROUGHPUT artifact's first
    # call hung its process: every thread in futex wait); the session touches it once before any run. Without
    # that, this test hung in its first process (a timeout, not a pass)
    import subprocess
    import sys

    streams = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                               "performance_hint": "THROUGHPUT"}, tmp_path / "streams")
    for _ in range(3):  # a fresh process each time: the bridge is set up once per process
        done = subprocess.run([sys.executable, "-c", FIRST_CALL_SIDE_BY_SIDE, str(streams.path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "answered", done.stderr[-2000:]


def test_full_batches_run_on_a_copy_compiled_for_their_shape(tiny_onnx, texts, tmp_path):
    """static_full_batch on: a batch of the Predictor's batch size x its window runs on a copy of the model compiled
    for that shape (compiled when the first one comes, then reused); every other shape on the dynamic model; the
    outputs are the dynamic model's."""
    fixed = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                             "static_full_batch": "on"}, tmp_path / "fixed")
    plain = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                             "static_full_batch": "off"}, tmp_path / "plain")
    assert fixed.manifest["runtime_options"]["static_full_batch"] is True
    assert plain.manifest["runtime_options"]["static_full_batch"] is False
    assert fixed.lineage["report"]["static_full_batch"]["why"] == "--static-full-batch on"
    on, off = Predictor(fixed.path, batch_size=8), Predictor(plain.path, batch_size=8)
    window = on.max_seq_len
    assert off.session.fixed_shapes is None and on.session.fixed_shapes.shapes == {(8, window)}
    assert on.full_batches == off.full_batches == [(8, window)]
    assert on.session.fixed_shapes.compiled == {}  # nothing compiled before a full batch comes
    np.testing.assert_allclose(on.encode(texts), off.encode(texts), atol=1e-5)  # short texts: never a full batch
    assert on.session.fixed_shapes.compiled == {}
    full_on = on.run(texts[:16], pad_to=window)["sentence_embedding"]  # two full batches
    assert set(on.session.fixed_shapes.compiled) == {(8, window)}
    np.testing.assert_allclose(full_on, off.run(texts[:16], pad_to=window)["sentence_embedding"], atol=1e-5)
    # a view at a shorter window on the same session (bench's padded workloads) brings its own full shape
    short = Predictor(fixed, session=on.session, batch_size=8, max_seq_len=32, verify=False)
    short.run(texts[:8], pad_to=32)
    assert set(on.session.fixed_shapes.compiled) == {(8, window), (8, 32)}
    # the gate measures the copy: its batch-invariance check runs one full batch
    from bertopt.measure.batch import batch_deviation

    fresh = Predictor(fixed.path)
    found = batch_deviation(fresh, texts)
    assert set(fresh.session.fixed_shapes.compiled) == {(32, window)}
    assert found["outputs"]["sentence_embedding"]["by_batch_size"][f"32x{window}"] < 1e-6


def test_static_full_batch_auto_is_measured_and_a_slow_full_batch_is_left_off(ov_f32, monkeypatch):
    from bertopt.runtime import openvino_backend

    handle = Artifact.load(ov_f32.path).model_handle()
    found = openvino_backend.static_full_batch_choice(handle, "auto", 32, rounds=1)
    assert found["dynamic_texts_per_s"] > 0 and found["static_texts_per_s"] > 0 and found["rounds"] == 1
    ratio = found["static_texts_per_s"] / found["dynamic_texts_per_s"]
    if abs(ratio - 1.03) > 0.01:  # the record rounds the rates: at the bound either way may be right
        assert found["on"] == (ratio >= 1.03)
    # the rounds asked for fit the timing budget here (a tiny model); where they would not, fewer are run
    assert openvino_backend.static_full_batch_choice(handle, "auto", 32, rounds=2)["rounds"] == 2
    monkeypatch.setattr(openvino_backend, "STATIC_FULL_BATCH_TIMING_S", 0.0)
    assert openvino_backend.static_full_batch_choice(handle, "auto", 32, rounds=3)["rounds"] == 1
    # a model whose full batch takes longer than the bound is compute-bound: not measured, left off
    monkeypatch.setattr(openvino_backend, "STATIC_FULL_BATCH_MAX_BATCH_S", 0.0)
    slow = openvino_backend.static_full_batch_choice(handle, "auto", 32)
    assert slow["on"] is False and "static_texts_per_s" not in slow and "compute-bound" in slow["why"]
    # judged on an eighth of the batch first, so a big model does not time a whole batch to be left off
    assert "a full batch would take about" in slow["why"] and "timed on 4 texts" in slow["why"]
    # a batch too small to take a part of is timed whole
    monkeypatch.setattr(openvino_backend, "STATIC_FULL_BATCH_PROBE_PART", 64)
    whole = openvino_backend.static_full_batch_choice(handle, "auto", 32)
    assert whole["on"] is False and whole["why"].startswith("a full batch takes ") and "(> 0 s)" in whole["why"]
    with pytest.raises(UserError, match="static_full_batch must be one of auto, on, off"):
        openvino_backend.static_full_batch_choice(handle, "yes", 32)


def test_a_copy_whose_outputs_move_past_the_gates_bound_is_left_off(ov_f32, monkeypatch):
    # on an AVX-512 VNNI + BF16 EPYC the fixed-shape copy of NNCF static int8 MiniLM moved its token states 1.4e-3
    # to 2.7e-3 from the model's, and tune's gate then failed the candidate the stage had built: auto compares the
    # two executables' outputs on the full batch before timing them
    from bertopt.runtime import openvino_backend

    handle = Artifact.load(ov_f32.path).model_handle()
    found = openvino_backend.static_full_batch_choice(handle, "auto", 32, rounds=1)
    assert 0.0 <= found["fixed_vs_dynamic_dev"] < 1e-6  # f32: the copy agrees with the model
    # a bound the copy cannot meet (any difference, even none, is over -1): left off, the output named, not timed
    monkeypatch.setattr(openvino_backend, "BATCH_DEV_BOUND", -1.0)
    moved = openvino_backend.static_full_batch_choice(handle, "auto", 32, rounds=1)
    assert moved["on"] is False and "static_texts_per_s" not in moved
    assert moved["why"].startswith("the copy's outputs moved "), moved["why"]
    assert "(last_hidden_state)" in moved["why"] or "(sentence_embedding)" in moved["why"], moved["why"]
    assert "over the gate's batch deviation bound -1; not timed" in moved["why"]


def test_a_bad_static_full_batch_is_one_line_exit_2(tiny_onnx, tmp_path, cli):
    code, out, err = cli("compile", tiny_onnx.path, "--out", tmp_path / "x", "--static-full-batch", "always")
    assert code == 2 and err.strip() == "error: compile: 'static_full_batch' must be one of auto, on, off; got 'always'"
    assert "Traceback" not in err and not (tmp_path / "x").exists()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one OpenVINO stream per thread")
def test_a_full_batch_split_between_streams_runs_on_a_copy_for_its_part(tiny_onnx, texts, tmp_path):
    """With a stream per thread a call of one full batch is split between the streams: the part's shape (a server
    worker's batch) gets its copy too, a call of several full batches the whole batch's; the gate runs both."""
    streams = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                               "performance_hint": "THROUGHPUT", "static_full_batch": "on"},
                        tmp_path / "streams")
    pred = Predictor(streams.path, threads=2, batch_size=8)
    window = pred.max_seq_len
    assert pred.session.parallel_runs == 2 and pred.full_batches == [(8, window), (4, window)]
    pred.run(texts[:8], pad_to=window)  # one batch: two parts of 4, side by side
    assert set(pred.session.fixed_shapes.compiled) == {(4, window)}
    pred.run(texts[:16], pad_to=window)  # two whole batches, one per stream
    assert set(pred.session.fixed_shapes.compiled) == {(4, window), (8, window)}
    from bertopt.measure.batch import batch_deviation

    found = batch_deviation(Predictor(streams.path, threads=2), texts)
    assert found["full_batches"] == [[32, window], [16, window]]
    by_shape = found["outputs"]["sentence_embedding"]["by_batch_size"]
    assert by_shape[f"32x{window}"] < 1e-6 and by_shape[f"16x{window}"] < 1e-6


def test_a_shape_openvino_cannot_compile_runs_on_the_dynamic_model(tiny_onnx, texts, tmp_path, monkeypatch):
    """A model OpenVINO cannot compile for a fixed shape: that shape runs on the dynamic model, every time (never an
    error on a request), and the stage's auto measurement says why it left the option off."""
    from bertopt.runtime import openvino_backend

    def cannot(*args):
        raise RuntimeError("Exception from src/core/src/shape_util.cpp:65:\nthis graph takes no static shape")

    monkeypatch.setattr(openvino_backend, "compile_for_shape", cannot)
    fixed = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32",
                                             "static_full_batch": "on"}, tmp_path / "fixed")
    pred = Predictor(fixed.path, batch_size=8)
    window = pred.max_seq_len
    first = pred.run(texts[:8], pad_to=window)["sentence_embedding"]
    again = pred.run(texts[:8], pad_to=window)["sentence_embedding"]
    assert pred.session.fixed_shapes.compiled == {}
    reason = "Exception from src/core/src/shape_util.cpp:65: this graph takes no static shape"
    assert pred.session.fixed_shapes.failed == {(8, window): reason}
    np.testing.assert_array_equal(first, again)
    auto = run_stage("compile", tiny_onnx, {"runtime": "openvino", "inference_precision": "f32"}, tmp_path / "auto")
    decided = auto.lineage["report"]["static_full_batch"]
    assert decided["on"] is False and auto.manifest["runtime_options"]["static_full_batch"] is False
    assert decided["why"] == f"OpenVINO could not compile the model for that shape: {reason}"
