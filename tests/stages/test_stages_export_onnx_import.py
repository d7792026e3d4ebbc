"""ONNX files from other exporters (Optimum's layout, sentence-transformers' own export): inputs and task from the
graph's names and shapes, tokenizer and config from the folder, values equal to the original model."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt.data import corpus
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.tiny_models import build_tiny_family_model

TEXTS = [t for t in corpus() if t][:32]


def optimum_style_export(hf, onnx_path, task="embedding", sentence_transformers=False):
    """What Optimum's exporter writes for a model folder: the bare AutoModel (or head) traced with input names
    input_ids / attention_mask [/ token_type_ids] and outputs last_hidden_state or logits; with
    ``sentence_transformers`` the ST export's token_embeddings + sentence_embedding (mean pooling)."""
    import torch
    import transformers

    cls = {"embedding": transformers.AutoModel,
           "classification": transformers.AutoModelForSequenceClassification,
           "token-classification": transformers.AutoModelForTokenClassification}[task]
    model = cls.from_pretrained(hf, attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if model.config.model_type == "bert" else [])

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            out = self.model(**dict(zip(names, args)))
            if task != "embedding":
                return out.logits
            hidden = out.last_hidden_state
            if not sentence_transformers:
                return hidden
            mask = args[1].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return hidden, torch.nn.functional.normalize(pooled, dim=1)

    outputs = {"embedding": ["token_embeddings", "sentence_embedding"] if sentence_transformers
               else ["last_hidden_state"]}.get(task, ["logits"])
    dummy = tuple(torch.ones(2, 8, dtype=torch.long) for _ in names)
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names}
    for o in outputs:
        axes[o] = {0: "batch_size", 1: "sequence_length"} if o != "sentence_embedding" and \
            (task != "classification") else {0: "batch_size"}
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(Wrapped().eval(), dummy, str(onnx_path), input_names=names, output_names=outputs,
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    return onnx_path


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_optimum_feature_extraction_layout(family, tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", family)
    onnx_file = optimum_style_export(hf, tmp_path / "hf" / "onnx" / "model.onnx")
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    assert [i["name"] for i in art.inputs] == (["input_ids", "attention_mask", "token_type_ids"]
                                              if family == "bert" else ["input_ids", "attention_mask"])
    # the graph stops at token states; the folder's sentence-transformers pipeline (mean, Normalize) is appended
    assert [(o["name"], o["kind"]) for o in art.outputs] == [("last_hidden_state", "token"),
                                                             ("sentence_embedding", "embedding")]
    info = art.model_info
    assert info["task"] == "embedding" and info["family"] == family and info["num_attention_heads"] == 4
    assert info["max_position_embeddings"] == 128  # from the config beside it: RoBERTa's table less its offset
    got = Predictor(art, provider="cpu").run(TEXTS)["last_hidden_state"]
    want = hf_reference(hf, pooling="none").run(TEXTS)["last_hidden_state"]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(TEXTS), hf_reference(hf).encode(TEXTS),
                               atol=1e-4)
    # and it goes on through the stages (optimize reads heads and fusion type from the recorded family)
    opt = run_stage("optimize", art, {}, tmp_path / "opt")
    assert opt.manifest["lineage"]["report"]["fused_ops"].get("SkipLayerNormalization")


def test_sentence_transformers_onnx_export_layout(tmp_path):
    hf = build_tiny_family_model(tmp_path / "hf", "mpnet")
    onnx_file = optimum_style_export(hf, tmp_path / "hf" / "onnx" / "model.onnx", sentence_transformers=True)
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    assert [(o["name"], o["kind"]) for o in art.outputs] == [("token_embeddings", "token"),
                                                             ("sentence_embedding", "embedding")]
    info = art.model_info
    assert (info["task"], info["primary_output"], info["family"], info["pooling"]) == \
        ("embedding", "sentence_embedding", "mpnet", "mean")
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(TEXTS), hf_reference(hf).encode(TEXTS),
                               atol=1e-4)


@pytest.mark.parametrize("task,kind", [("classification", "logits"), ("token-classification", "token-logits")])
def test_optimum_heads_are_recognised_from_shapes(task, kind, tmp_path, cli, capsys):
    hf = build_tiny_family_model(tmp_path / "hf", "distilbert", task)
    onnx_file = optimum_style_export(hf, tmp_path / "hf" / "onnx" / "model.onnx", task=task)
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    assert [(o["name"], o["kind"]) for o in art.outputs] == [("logits", kind)]
    info = art.model_info
    assert info["task"] == task and len(info["id2label"]) == info["num_labels"] > 1
    assert info["id2label"]["0"] != "LABEL_0"  # the labels come from the config beside the file
    got = Predictor(art, provider="cpu").run(TEXTS)["logits"]
    want = hf_reference(hf).run(TEXTS)["logits"]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)
    capsys.readouterr()
    code, _, err = cli("export", onnx_file, "--out", tmp_path / "wrong", "--task", "rerank")
    assert code == 2 and f"computes {task}" in err and not (tmp_path / "wrong").exists()
