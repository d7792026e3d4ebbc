"""Tiny random task models (classification, token classification, rerank, SPLADE) of two families with their
own tokenizer kinds, saved with save_pretrained, and a small ONNX export of each into a bertopt artifact with
the task contract's manifest fields. Imported by the runtime, validate, spark, serve and kafka tests."""

from __future__ import annotations

import json
from pathlib import Path

NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
CLASS_LABELS = ["negative", "neutral", "positive"]
TASK_TEXTS = [
    "hello world, the cat sat on the mat.",
    "Bert runs fast and the dog is slow!",
    "a model of text is good",
    "unbelievable tokenization of xyzzy words",
    "the cat",
    "is it good? 3 dogs sat in 2 cats.",
]
_BPE_CORPUS = [
    "hello world the cat sat on the mat", "a good model is fast and a bad model is slow", "the dog runs in the text",
    "bert and roberta read words", "tokens of words of text", "is it good? 3 dogs sat in 2 cats.",
] * 20

HEADS = {"classification": "ForSequenceClassification", "multi-label": "ForSequenceClassification",
         "token-classification": "ForTokenClassification", "rerank": "ForSequenceClassification",
         "sparse-embedding": "ForMaskedLM"}


def _bert_tokenizer(path: Path) -> None:
    from tokenizers.implementations import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    from bertopt.testing import TINY_VOCAB

    vocab_file = path / "vocab.txt"
    vocab_file.write_text("\n".join(TINY_VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=True).save_pretrained(path)
    # transformers 5 writes an empty WordPiece vocabulary into tokenizer.json; write a real one
    BertWordPieceTokenizer(str(vocab_file), lowercase=True)._tokenizer.save(str(path / "tokenizer.json"))


def _roberta_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer trained on a few lines, saved as RoBERTa's (tokenizer.json + config)."""
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    bpe.train_from_iterator(_BPE_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok = bpe._tokenizer
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")), trim_offsets=True,
                                                      add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(path)
    return tok.get_vocab_size()


def build_task_model(path: Path, task: str, family: str = "bert", seed: int = 0) -> Path:
    """A random ``{Bert,Roberta}For<Head>`` with its tokenizer in ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    if family == "bert":
        from bertopt.testing import TINY_VOCAB

        _bert_tokenizer(path)
        config = transformers.BertConfig(vocab_size=len(TINY_VOCAB), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                         initializer_range=0.2)
        prefix = "Bert"
    elif family == "roberta":
        vocab = _roberta_tokenizer(path)
        config = transformers.RobertaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64, max_position_embeddings=66,
                                            pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                            initializer_range=0.2)
        prefix = "Roberta"
    else:
        raise ValueError(family)
    if task == "token-classification":
        config.id2label = dict(enumerate(NER_LABELS))
        config.label2id = {v: k for k, v in config.id2label.items()}
    elif task in ("classification", "multi-label"):
        config.id2label = dict(enumerate(CLASS_LABELS))
        config.label2id = {v: k for k, v in config.id2label.items()}
        config.problem_type = "multi_label_classification" if task == "multi-label" else "single_label_classification"
    elif task == "rerank":
        config.num_labels = 1
    cls = getattr(transformers, prefix + HEADS[task])
    cls(config).eval().save_pretrained(path)
    return path


def export_task_artifact(hf_dir: Path, out_dir: Path, task: str):
    """The model with its head as an ONNX artifact whose manifest follows the task contract.

    Used until the families export emits task heads; the reference for validation is still the HF folder."""
    import torch
    import transformers

    from bertopt.artifact import ArtifactWriter
    from bertopt.sources import resolve_source
    from bertopt.sources.hf import copy_tokenizer

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    takes_types = config.get("model_type") == "bert"
    contract = "classification" if task == "multi-label" else task

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            kw = {"token_type_ids": token_type_ids} if takes_types else {}
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **kw).logits
            if contract == "sparse-embedding":
                weights = torch.log1p(torch.relu(logits)) * attention_mask.unsqueeze(-1).to(logits.dtype)
                return weights.max(dim=1).values
            return logits

    wrapper = Wrapper().eval()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if takes_types else [])
    inputs = [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in names]
    n_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    out = {"classification": ("logits", ["batch", n_labels], "logits"),
           "token-classification": ("logits", ["batch", "sequence", n_labels], "token-logits"),
           "rerank": ("logits", ["batch", 1], "score"),
           "sparse-embedding": ("sparse_embedding", ["batch", config["vocab_size"]], "sparse")}[contract]
    outputs = [{"name": out[0], "dtype": "float32", "shape": out[1], "kind": out[2]}]
    info = {"model_type": config["model_type"], "family": config["model_type"], "task": contract,
            "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
            "max_position_embeddings": config["max_position_embeddings"] - (2 if config["model_type"] == "roberta"
                                                                            else 0),
            "max_seq_len": 48, "primary_output": out[0], "pair_input": contract == "rerank",
            "id2label": {str(k): v for k, v in (config.get("id2label") or {}).items()} if contract in (
                "classification", "token-classification") else None,
            "problem_type": config.get("problem_type")}
    dummy = tuple(torch.ones(2, 8, dtype=torch.long) for _ in names)
    dynamic = {n: {0: "batch", 1: "sequence"} for n in names}
    dynamic[out[0]] = {0: "batch", 1: "sequence"} if contract == "token-classification" else {0: "batch"}
    with ArtifactWriter(out_dir, stage="export", params={"test_export": task},
                        source=resolve_source(str(hf_dir)).to_manifest()) as w:
        w.model_info = info
        copy_tokenizer(hf_dir, w.dir / "tokenizer")
        with torch.no_grad():
            torch.onnx.export(wrapper, dummy, str(w.dir / "model.onnx"), input_names=names, output_names=[out[0]],
                              dynamic_axes=dynamic, opset_version=17, dynamo=False)
        w.set_model("model.onnx", "onnx", inputs, outputs, precision="fp32")
    return w.artifact
