"""The model's own sentence-transformers pipeline (Pooling modes, Dense with its activation, Normalize) inside
the exported graph, equal to ``SentenceTransformer(folder).encode`` (the independent reference)."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt.data import corpus, mixed_text
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.tiny_models import build_tiny_family_model

TEXTS = [t for t in corpus() if t][:40] + mixed_text()[:8]
TANH, RELU, IDENTITY = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.activation.ReLU",
                        "torch.nn.modules.linear.Identity")

CASES = [
    ("bert", "cls", {"out_features": 24, "activation": TANH}, True),
    ("roberta", "max", None, False),
    ("mpnet", "mean_sqrt_len_tokens", {"out_features": 16, "activation": IDENTITY}, True),
    ("deberta-v2", "weightedmean", None, True),
    ("modernbert", "lasttoken", None, True),
    ("distilbert", ["mean", "max"], None, False),
    ("electra", "mean", {"out_features": 48, "activation": RELU}, False),
    ("xlm-roberta", "cls", None, True),
]


@pytest.mark.parametrize("family,pooling,dense,normalize", CASES,
                         ids=[f"{c[0]}-{'+'.join(c[1]) if isinstance(c[1], list) else c[1]}" for c in CASES])
def test_pipeline_equals_sentence_transformers(family, pooling, dense, normalize, tmp_path):
    from sentence_transformers import SentenceTransformer

    hf = build_tiny_family_model(tmp_path / "hf", family, pooling=pooling, dense=dense, normalize=normalize)
    st = SentenceTransformer(str(hf), device="cpu")
    want = st.encode(TEXTS, batch_size=8)
    art = run_stage("export", hf, {}, tmp_path / "onnx")
    out = next(o for o in art.outputs if o["name"] == "sentence_embedding")
    assert out["kind"] == "embedding" and out["normalized"] is normalize and out["pooling"] == pooling
    width = dense["out_features"] if dense else 32 * (len(pooling) if isinstance(pooling, list) else 1)
    assert out["shape"] == ["batch", width] == ["batch", st.get_embedding_dimension()]
    got = Predictor(art, provider="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, want, atol=5e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_unsupported_module_is_refused(tmp_path, cli, capsys):
    import json

    hf = build_tiny_family_model(tmp_path / "hf", "bert")
    modules = json.loads((hf / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_LSTM", "type": "sentence_transformers.models.LSTM"})
    (hf / "modules.json").write_text(json.dumps(modules))
    capsys.readouterr()
    code, _, err = cli("export", hf, "--out", tmp_path / "out")
    assert code == 2 and "sentence_transformers.models.LSTM is not supported" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_minilm_pipeline_equals_sentence_transformers(minilm_onnx):
    from sentence_transformers import SentenceTransformer

    from bertopt.sources import builtin_model_path

    texts = [t for t in corpus() if t]
    want = SentenceTransformer(str(builtin_model_path("minilm")), device="cpu").encode(texts, batch_size=32)
    got = Predictor(minilm_onnx, provider="cpu").encode(texts)
    np.testing.assert_allclose(got, want, atol=2e-5)
