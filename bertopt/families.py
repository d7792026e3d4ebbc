"""One declaration per model family: what every stage and the runtime read about a model (tasks: ``bertopt.tasks``).

The idea is Optimum's per-model ONNX configs, written our way. A family says which inputs the model takes
(with or without ``token_type_ids``), how many tokens its position table allows, what kind of tokenizer it
uses and how ``tokenizer.json`` is built when a folder has none, which ONNX Runtime fusion model type
``optimize`` uses, and what the int8 / fp16 / OpenVINO paths must treat differently. Nothing else in bertopt
names a family or an input.

This module is the bottom of the house: it imports nothing from bertopt except the error type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bertopt.errors import UserError

INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS = "input_ids", "attention_mask", "token_type_ids"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # inputs the exported graph takes, in order; token_type_ids only where the model has a segment table
    inputs: tuple[str, ...]
    # how many leading rows of the position table real tokens cannot use (RoBERTa's ids start at padding_idx + 1)
    position_offset: str = "none"  # "none" | "padding_idx" | "relative"
    tokenizer_kind: str = "wordpiece"  # "wordpiece" | "bpe" (byte-level) | "unigram" (SentencePiece)
    # files from which tokenizer.json can be built when the folder has none (first match wins)
    tokenizer_sources: tuple[tuple[str, ...], ...] = (("vocab.txt",),)
    # onnxruntime.transformers optimize_model(model_type=...); None: no transformer fusions apply
    fusion_model_type: str | None = "bert"
    # transformer fusions ONNX Runtime cannot do for this family (recorded in the optimize report)
    fusion_notes: str = ""
    # bertopt's own attention fusion run after ONNX Runtime's (a module in bertopt.onnx_graph.fusions), or None
    attention_fusion: str | None = None
    # node names (as torch.onnx export writes them; a regex searched in each MatMul's name) of the FFN output
    # projections, whose GELU-fed inputs a fixed int8 scale handles worst: static int8 keeps them in float
    ffn_output_matmul: str = r"layer\.\d+/output/dense/MatMul$"
    # the class names of its heads (transformers), by task
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())

    def input_names(self, config: dict[str, Any]) -> list[str]:
        names = [n for n in self.inputs]
        # DeBERTa-v2/v3 with type_vocab_size 0 has no segment table: its tokenizer's type ids would be ignored
        if TOKEN_TYPE_IDS in names and not config.get("type_vocab_size", 2):
            names.remove(TOKEN_TYPE_IDS)
        return names

    def input_specs(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": n, "role": n, "dtype": "int64", "shape": ["batch", "sequence"]}
                for n in self.input_names(config)]

    def max_tokens(self, config: dict[str, Any]) -> int:
        """Tokens a text may have (special tokens included) given the model's position table."""
        table = int(config.get("max_position_embeddings") or 512)
        if self.position_offset == "padding_idx":
            # position ids run padding_idx + 1 .. padding_idx + n: 514 rows with padding_idx 1 allow 512 tokens
            return table - int(config.get("pad_token_id", 1)) - 1
        return table


FAMILIES: tuple[Family, ...] = (
    Family("bert", ("bert",), (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS)),
    Family("distilbert", ("distilbert",), (INPUT_IDS, ATTENTION_MASK),
           ffn_output_matmul=r"layer\.\d+/ffn/lin2/MatMul$",
           notes="no segment embeddings; attention fuses with the BERT patterns"),
    Family("roberta", ("roberta", "xlm-roberta", "camembert"), (INPUT_IDS, ATTENTION_MASK),
           position_offset="padding_idx", tokenizer_kind="bpe",
           tokenizer_sources=(("vocab.json", "merges.txt"), ("sentencepiece.bpe.model",), ("spm.model",)),
           notes="XLM-R / CamemBERT use a SentencePiece (Unigram / BPE) tokenizer; the position table is offset "
                 "by padding_idx + 1", aliases=("xlm-roberta", "camembert")),
    Family("mpnet", ("mpnet",), (INPUT_IDS, ATTENTION_MASK),
           position_offset="padding_idx", tokenizer_kind="wordpiece", attention_fusion="mpnet",
           fusion_notes="relative attention bias: ONNX Runtime fuses LayerNorm and GELU; bertopt fuses attention "
                        "into MultiHeadAttention with the bias",
           notes="relative attention bias shared by every layer"),
    Family("electra", ("electra",), (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS),
           notes="embedding size may differ from hidden size (a projection after the embeddings)"),
    Family("deberta-v2", ("deberta-v2",), (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS),
           position_offset="relative", tokenizer_kind="unigram", tokenizer_sources=(("spm.model",),),
           attention_fusion="deberta",
           fusion_notes="disentangled attention: ONNX Runtime fuses LayerNorm and GELU; bertopt fuses attention "
                        "(c2p and p2c by block Gathers through one index per model, masks folded in; "
                        "bertopt.onnx_graph.fusions.deberta)",
           notes="DeBERTa v3 is model type deberta-v2; relative positions (no absolute position table)"),
    Family("modernbert", ("modernbert",), (INPUT_IDS, ATTENTION_MASK),
           tokenizer_kind="bpe", tokenizer_sources=(),
           attention_fusion="modernbert", ffn_output_matmul=r"layers\.\d+/mlp/Wo/MatMul$",
           fusion_notes="rotary attention and GeGLU: ONNX Runtime fuses LayerNorm only; bertopt fuses the "
                        "attention into RotaryEmbedding + MultiHeadAttention (bertopt.onnx_graph.fusions.modernbert)",
           notes="rotary positions, alternating local/global attention"),
)

_BY_MODEL_TYPE = {mt: fam for fam in FAMILIES for mt in fam.model_types}


def supported_model_types() -> list[str]:
    return [mt for fam in FAMILIES for mt in fam.model_types]


def family_by_name(name: str | None) -> Family:
    """The family an artifact's manifest names; artifacts made before families existed are BERT."""
    for fam in FAMILIES:
        if fam.name == (name or "bert"):
            return fam
    raise UserError(f"unknown model family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def family_for_config(config: dict[str, Any], where: str = "the model") -> Family:
    """The family of a Hugging Face config, or a one-line refusal naming the supported families."""
    model_type = config.get("model_type")
    fam = _BY_MODEL_TYPE.get(model_type or "")
    if fam is None:
        archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise UserError(f"{where} is a {model_type or 'unknown'} model ({archs}), not an encoder bertopt supports; "
                        f"supported model types: {', '.join(supported_model_types())}")
    return fam
