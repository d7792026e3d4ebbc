"""``bertopt bench`` on tiny artifacts: it runs through the Predictor, prints a row per contender and writes what
it prints; FLOP counting; bad input. (No timing assertions: speed is measured in benchmarks/.)"""

from __future__ import annotations

import json

import pytest

from bertopt.bench import Contender, Settings, flops_per_sentence, measure
from bertopt.registry import run_stage
from bertopt.runtime import Predictor

TINY = ["--rounds", "1", "--texts", "8", "--mixed-texts", "12", "--latency-calls", "3", "--batch-size", "4",
        "--seq-len", "24", "--latency-seq-len", "8"]


@pytest.fixture(scope="module")
def tiny_int8(tiny_onnx, tmp_path_factory):
    return run_stage("quantize", tiny_onnx, {"mode": "int8-dynamic"}, tmp_path_factory.mktemp("bench") / "int8")


def test_bench_measures_artifacts_and_writes_json(tiny_onnx, tiny_int8, tmp_path, cli):
    out = tmp_path / "bench.json"
    code, stdout, err = cli("bench", tiny_onnx.path, tiny_int8.path, *TINY, "--json", out)
    assert code == 0, err
    # (the path may be folded at the terminal's width, mid-name)
    assert "art" in stdout and "int8" in stdout and f"wrote{out}" in "".join(stdout.split())
    data = json.loads(out.read_text())
    assert data["settings"]["batch_size"] == 4 and data["settings"]["seq_len"] == 24
    rows = {r["name"]: r for r in data["results"]}
    assert set(rows) == {"art", "int8"}
    assert rows["int8"]["precision"] == "int8-dynamic" and rows["art"]["backend"] == "onnxruntime"
    for r in rows.values():
        assert r["padded_texts_per_s"] > 0 and r["mixed_texts_per_s"] > 0
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert r["padded_gflop_per_s"] > 0
        # every printed throughput is in the JSON too
        assert f"{r['padded_texts_per_s']:.1f}" in stdout


def test_bench_reference_adds_pytorch_and_fidelity(tiny_onnx, tiny_int8, tmp_path, cli):
    out = tmp_path / "bench.json"
    code, stdout, err = cli("bench", tiny_onnx.path, tiny_int8.path, *TINY, "--reference", "--corpus-texts", "40",
                            "--json", out)
    assert code == 0, err
    assert "PyTorch fp32" in stdout and "PyTorch bf16 autocast" in stdout
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["PyTorch fp32", "PyTorch bf16 autocast", "art", "int8"]
    assert rows["PyTorch fp32"]["vs"]["pt-fp32"]["padded"] == pytest.approx(1.0)
    # the exported fp32 model is PyTorch to float precision on every set; int8 is close but not equal
    for key in ("corpus", "padded", "mixed"):
        assert rows["art"]["fidelity"][key]["cos_min"] > 0.99999
        assert rows["PyTorch fp32"]["fidelity"][key]["cos_min"] == pytest.approx(1.0)
    assert rows["int8"]["fidelity"]["corpus"]["max_abs"] > rows["art"]["fidelity"]["corpus"]["max_abs"]
    assert 0 <= rows["int8"]["fidelity"]["corpus"]["neighbour_agreement_at_10"] <= 1


def test_bench_workloads_have_the_requested_shapes(tiny_onnx):
    seen = []

    class Recording:
        """Wraps the real ORT session to record the shapes the benchmark feeds it."""

        def __init__(self, session):
            self.inner = session
            self.backend, self.provider = session.backend, session.provider
            self.input_names, self.output_names = session.input_names, session.output_names
            self.concurrent_runs, self.parallel_runs = session.concurrent_runs, session.parallel_runs

        def run(self, names, feeds):
            seen.append(feeds["input_ids"].shape)
            return self.inner.run(names, feeds)

    base = Predictor(tiny_onnx.path, batch_size=4)
    pred = Predictor(tiny_onnx.path, batch_size=4, session=Recording(base.session))
    s = Settings(batch_size=4, seq_len=24, latency_seq_len=8, padded_texts=8, mixed_texts=12, latency_calls=2,
                 rounds=1)
    measure([Contender("tiny", pred)], s)
    assert (4, 24) in seen and (1, 8) in seen
    assert all(shape[0] <= 4 for shape in seen)
    widths_mixed = {shape[1] for shape in seen if shape[1] not in (24, 8)}
    assert widths_mixed, "mixed-length batches are padded per bucket, not to a fixed width"


def test_flops_per_sentence_matches_bert_base_figure():
    base = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12}
    # BERT-base at 128 tokens: about 11.2 G multiply-adds = 22.35 GFLOP
    assert flops_per_sentence(base, 128) == pytest.approx(22.35e9, rel=1e-3)
    minilm = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
    assert flops_per_sentence(minilm, 128) == pytest.approx(2.869e9, rel=1e-3)
    # attention grows with the square of the length: doubling it costs a little more than double
    assert flops_per_sentence(minilm, 256) / flops_per_sentence(minilm, 128) == pytest.approx(2.105, rel=1e-3)


def test_bench_bad_input_is_one_line_exit_2(tiny_onnx, tmp_path, cli):
    code, _, err = cli("bench", tiny_onnx.path, "--rounds", "0")
    assert code == 2 and "bench: 'rounds' must be between 1 and 1000, got 0" in err
    code, _, err = cli("bench", tmp_path / "missing")
    assert code == 2 and "artifact not found" in err
    out = tmp_path / "never.json"
    code, _, err = cli("bench", tiny_onnx.path, "--runtime", "nonsense", "--json", out)
    assert code == 2 and "unknown runtime 'nonsense'" in err and not out.exists()
