"""Tiny random models of every supported family and task head (Hugging Face folders with their own tokenizers),
built in seconds: the fixtures of the test suite and the stand-ins of the benchmark scripts' smoke runs.

torch, transformers and tokenizers are imported by the builders that need them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# trained tokenizers the tiny models load instead of training their own (see train_tiny_tokenizer)
PINNED_TOKENIZERS = Path(__file__).resolve().parent / "data" / "tiny_tokenizers"

TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "the", "a", "is", "of", "and", "to", "in", "it", "hello", "world", "cat", "dog", "sat", "on", "mat", "run",
    "fast", "slow", "good", "bad", "model", "bert", "text", "##s", "##ing", "##ed", ".", ",", "!", "?", "0", "1",
    "2", "3"]


def build_tiny_hf_bert(path: Path, *, sentence_transformers: bool = False, classifier: bool = False,
                       seed: int = 0, layers: int = 2, hidden: int = 32, heads: int = 4) -> Path:
    """A random BERT saved with save_pretrained (safetensors) plus a WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    vocab_file = path / "vocab.txt"
    vocab_file.write_text("\n".join(TINY_VOCAB) + "\n")
    config = BertConfig(vocab_size=len(TINY_VOCAB), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=hidden * 2, max_position_embeddings=64,
                        num_labels=3, initializer_range=0.2)
    model = (BertForSequenceClassification if classifier else BertModel)(config).eval()
    model.save_pretrained(path)
    BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=True).save_pretrained(path)
    # transformers 5 writes a tokenizer.json whose WordPiece vocabulary is empty (every word -> [UNK]);
    # write one built from vocab.txt so the tiny model sees real tokens
    from tokenizers.implementations import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(vocab_file), lowercase=True)._tokenizer.save(str(path / "tokenizer.json"))
    if sentence_transformers:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return path


# -- tiny random models of every family, each with its own tokenizer kind ----------------------------------------

FAMILY_FIXTURES = ("bert", "distilbert", "roberta", "xlm-roberta", "mpnet", "electra", "deberta-v2", "modernbert")
# special tokens per tokenizer style, in id order (the pad id matters: RoBERTa-style position tables start after it)
_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
_MPNET_SPECIALS = ["<s>", "<pad>", "</s>", "[UNK]", "<mask>"]
_DEBERTA_SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
_MODERNBERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _training_text() -> list[str]:
    from bertopt.data import calibration_texts, corpus, mixed_text

    return [t for t in corpus() + calibration_texts() + mixed_text() if t]


def pinned_tokenizer_file(kind: str, specials: list[str], vocab_size: int, lowercase: bool, pair_style: str) -> Path:
    key = json.dumps([kind, list(specials), vocab_size, lowercase, pair_style])
    return PINNED_TOKENIZERS / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def train_tiny_tokenizer(kind: str, specials: list[str], vocab_size: int = 800, lowercase: bool = True,
                         pair_style: str = "bert", pinned: bool = True):
    """A ``tokenizers.Tokenizer`` trained on bertopt's built-in text: ``wordpiece``, ``bpe`` (byte-level) or
    ``unigram`` (SentencePiece), with the post-processing of the family (``bert``: [CLS] A [SEP] B [SEP] with
    segment ids; ``roberta``: <s> A </s></s> B </s>).

    The WordPiece and Unigram trainers break ties in hash-map order, so two trainings with the same settings give
    different vocabularies, and every seeded tiny model and every figure measured on it moved from run to run.
    With ``pinned``, a tokenizer trained once and stored under ``bertopt/data/tiny_tokenizers/`` is loaded where
    its settings match (``python -m bertopt.tiny_models`` writes those of every family)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    stored = pinned_tokenizer_file(kind, specials, vocab_size, lowercase, pair_style)
    if pinned and stored.is_file():
        return Tokenizer.from_file(str(stored))

    unk = next(t for t in specials if "unk" in t.lower())
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token=unk)
    else:
        raise ValueError(kind)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in specials}
    if pair_style == "roberta":
        bos, eos = specials[0], specials[2]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
            special_tokens=[(bos, ids[bos]), (eos, ids[eos])])
    else:
        cls_tok = next(t for t in specials if "CLS" in t)
        sep_tok = next(t for t in specials if "SEP" in t)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls_tok} $A {sep_tok}", pair=f"{cls_tok} $A {sep_tok} $B:1 {sep_tok}:1",
            special_tokens=[(cls_tok, ids[cls_tok]), (sep_tok, ids[sep_tok])])
    return tok


def _family_recipe(family: str):
    """(tokenizer kind, specials, pair style, lowercase, transformers config class name, extra config)."""
    return {
        "bert": ("wordpiece", _BERT_SPECIALS, "bert", True, "BertConfig", {"type_vocab_size": 2}),
        "distilbert": ("wordpiece", _BERT_SPECIALS, "bert", True, "DistilBertConfig", {}),
        "electra": ("wordpiece", _BERT_SPECIALS, "bert", True, "ElectraConfig", {"type_vocab_size": 2}),
        "mpnet": ("wordpiece", _MPNET_SPECIALS, "roberta", True, "MPNetConfig", {}),
        "roberta": ("bpe", _ROBERTA_SPECIALS, "roberta", False, "RobertaConfig", {"type_vocab_size": 1}),
        "xlm-roberta": ("unigram", _ROBERTA_SPECIALS, "roberta", False, "XLMRobertaConfig", {"type_vocab_size": 1}),
        "deberta-v2": ("unigram", _DEBERTA_SPECIALS, "bert", False, "DebertaV2Config", {}),
        "modernbert": ("bpe", _MODERNBERT_SPECIALS, "bert", False, "ModernBertConfig", {}),
    }[family]


def _family_config(family: str, vocab_size: int, ids: dict[str, int], hidden: int, layers: int, heads: int,
                   positions: int, extra: dict, intermediate: int | None = None):
    import transformers

    cls_name = _family_recipe(family)[4]
    cfg_cls = getattr(transformers, cls_name)
    pad = next(i for t, i in ids.items() if "pad" in t.lower())
    common = {"vocab_size": vocab_size, "pad_token_id": pad, "initializer_range": 0.2}
    if family == "distilbert":
        return cfg_cls(dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=intermediate or hidden * 2,
                       max_position_embeddings=positions, **common)
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              intermediate_size=intermediate or hidden * 2,
              **common, **extra)
    if family in ("roberta", "xlm-roberta", "mpnet"):
        # RoBERTa-style positions start at padding_idx + 1: the table has two rows real tokens never use
        kw.update(max_position_embeddings=positions + pad + 1, bos_token_id=ids[_ROBERTA_SPECIALS[0]],
                  eos_token_id=ids[_ROBERTA_SPECIALS[2]])
    elif family == "electra":
        kw.update(embedding_size=hidden // 2, max_position_embeddings=positions)
    elif family == "deberta-v2":
        # DeBERTa-v3's shape: relative positions only, no segment table
        kw.update(max_position_embeddings=positions, type_vocab_size=0, relative_attention=True,
                  position_biased_input=False, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                  position_buckets=16, norm_rel_ebd="layer_norm", share_att_key=True, hidden_act="gelu")
    elif family == "modernbert":
        kw.update(max_position_embeddings=positions, cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"],
                  bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], local_attention=16,
                  initializer_cutoff_factor=2.0)
    else:
        kw.update(max_position_embeddings=positions)
    return cfg_cls(**kw)


def build_tiny_family_model(path: Path, family: str, task: str = "embedding", *, pooling: str | list = "mean",
                            normalize: bool = True, dense: dict | None = None, seed: int = 0, layers: int = 2,
                            hidden: int = 32, heads: int = 4, positions: int = 128, vocab_size: int = 800,
                            num_labels: int = 3, multi_label: bool = False, slow_tokenizer_only: bool = False,
                            intermediate: int | None = None, max_seq_length: int = 64) -> Path:
    """A random model of ``family`` with ``task``'s head, its own tokenizer kind trained on bertopt's built-in
    text, saved as its users save it: ``save_pretrained`` (safetensors) plus, for embeddings, a
    sentence-transformers pipeline (Pooling ``pooling``, optional ``dense`` {"out_features", "activation"},
    Normalize); rerank as a sentence-transformers CrossEncoder; sparse-embedding as a SPLADE SparseEncoder.

    ``slow_tokenizer_only`` leaves out tokenizer.json and writes the files it is built from (vocab.txt, or
    vocab.json + merges.txt). ``max_seq_length``: the sentence-transformers pipeline's limit (at most
    ``positions``; short by default to keep tests fast, MiniLM's 256 where speed is compared)."""
    import torch
    import transformers

    kind, specials, pair_style, lowercase, _, extra = _family_recipe(family)
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(kind, specials, vocab_size=vocab_size, lowercase=lowercase, pair_style=pair_style)
    ids = {t: tok.token_to_id(t) for t in specials}
    config = _family_config(family, tok.get_vocab_size(), ids, hidden, layers, heads, positions, extra,
                            intermediate)
    head = {"embedding": transformers.AutoModel, "classification": transformers.AutoModelForSequenceClassification,
            "rerank": transformers.AutoModelForSequenceClassification,
            "token-classification": transformers.AutoModelForTokenClassification,
            "sparse-embedding": transformers.AutoModelForMaskedLM}[task]
    if task == "classification":
        config.num_labels = num_labels
        config.id2label = {i: f"class_{chr(97 + i)}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
        config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    elif task == "rerank":
        config.num_labels = 1
        config.id2label = {0: "LABEL_0"}
        config.label2id = {"LABEL_0": 0}
    elif task == "token-classification":
        config.num_labels = len(NER_LABELS)
        config.id2label = dict(enumerate(NER_LABELS))
        config.label2id = {v: k for k, v in config.id2label.items()}
    model = head.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(path)
    if task == "rerank":  # what sentence-transformers' CrossEncoder.save adds to config.json
        cfg = json.loads((path / "config.json").read_text())
        cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    names = {"pad": "pad", "unk": "unk", "cls": "cls" if pair_style == "bert" else "<s>",
             "sep": "sep" if pair_style == "bert" else "</s>", "mask": "mask"}
    tok_cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": positions,
                     "do_lower_case": lowercase}
    for key, needle in names.items():
        tok_cfg[f"{key}_token"] = next(t for t in specials if needle.lower() in t.lower())
    if pair_style == "roberta":
        tok_cfg.update(bos_token=specials[0], eos_token=specials[2])
    from bertopt.families import family_for_config

    fam = family_for_config(config.to_dict())
    tok_cfg["model_input_names"] = fam.input_names(config.to_dict())
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if slow_tokenizer_only:
        if kind == "wordpiece":
            vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
            (path / "vocab.txt").write_text("\n".join(t for t, _ in vocab) + "\n")
        elif kind == "bpe":
            tok.model.save(str(path))  # vocab.json + merges.txt
        else:
            raise ValueError(f"{kind} tokenizers have no slow-file form here (SentencePiece needs its own trainer)")
    else:
        tok.save(str(path / "tokenizer.json"))
    modules: list[dict] = []
    if task == "embedding":
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"embedding_dimension": hidden, "pooling_mode": pooling, "include_prompt": True}))
        width = hidden * (len(pooling) if isinstance(pooling, list) else 1)
        if dense:
            from safetensors.torch import save_file

            linear = torch.nn.Linear(width, dense["out_features"])
            (path / "2_Dense").mkdir(exist_ok=True)
            act = dense.get("activation", "torch.nn.modules.activation.Tanh")
            (path / "2_Dense" / "config.json").write_text(json.dumps(
                {"in_features": width, "out_features": dense["out_features"], "bias": True,
                 "activation_function": act}))
            save_file({"linear.weight": linear.weight.detach().contiguous(), "linear.bias": linear.bias.detach()},
                      str(path / "2_Dense" / "model.safetensors"))
            modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        if normalize:
            modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
    elif task == "sparse-embedding":
        # the layout sentence-transformers' SparseEncoder.save writes
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer"},
                   {"idx": 1, "name": "1", "path": "1_SpladePooling",
                    "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}]
        (path / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "SparseEncoder"}))
        (path / "1_SpladePooling").mkdir(exist_ok=True)
        (path / "1_SpladePooling" / "config.json").write_text(json.dumps(
            {"pooling_strategy": "max", "activation_function": "relu", "word_embedding_dimension": config.vocab_size}))
    if modules:
        (path / "modules.json").write_text(json.dumps(modules, indent=2))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": min(positions, max_seq_length)}))
    return path


# the vocabulary sizes the tests build (300: a second, smaller BERT vocabulary; Unigram needs 800 for every char)
PINNED_VOCAB_SIZES = {"wordpiece": (800, 300), "unigram": (800,), "bpe": ()}


def pin_tokenizers() -> list[Path]:
    """Train and store the tokenizer of every family whose trainer is not reproducible (WordPiece, Unigram)."""
    written = []
    for family in FAMILY_FIXTURES:
        kind, specials, pair_style, lowercase, _, _ = _family_recipe(family)
        for vocab_size in PINNED_VOCAB_SIZES[kind]:
            file = pinned_tokenizer_file(kind, specials, vocab_size, lowercase, pair_style)
            if file in written:
                continue
            file.parent.mkdir(parents=True, exist_ok=True)
            train_tiny_tokenizer(kind, specials, vocab_size, lowercase, pair_style, pinned=False).save(str(file))
            written.append(file)
    return written


if __name__ == "__main__":
    for written_file in pin_tokenizers():
        print(written_file)
