"""Task-level results from a Predictor's raw outputs: what a user of each kind of model asks for.

* ``embedding``: the sentence vector (the ``embedding`` output).
* ``classification``: ``{"label", "score", "scores"}``: softmax over the logits, or sigmoid when the model is
  multi-label (``problem_type``) or has a single logit, exactly as transformers' ``text-classification`` pipeline
  decides; label names from ``id2label``.
* ``token-classification``: entities ``{"entity_group" | "entity", "score", "word", "start", "end"}`` with the
  transformers ``token-classification`` pipeline's aggregation strategies (none / simple / first / average /
  max), with character offsets into the original text taken from the tokenizer's offsets (WordPiece,
  byte-level BPE and SentencePiece alike). The grouping rules are the pipeline's, so the results equal it.
* ``rerank``: one relevance score per (query, passage) pair; sigmoid of the logit like sentence-transformers'
  ``CrossEncoder`` unless the model records another activation; ``rerank(query, passages)`` sorts passages.
* ``sparse-embedding``: ``{"indices", "values"}`` of the non-zero entries of the SPLADE vector.

A text over the model's window follows the Predictor's ``long_inputs`` policy (``Predictor.run``): with
``chunk``, classification gets the token-weighted mean of its windows' logits (then softmax / sigmoid as
above), token classification the windows' token logits joined over the whole text (entities anywhere in it,
offsets into it), sparse embedding the element-wise max of its windows; rerank pairs are not chunked.

Nothing here runs a model: the Predictor does, and these functions turn its outputs into results, so the
server, Spark, Kafka and validation all get the same post-processing.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from bertopt.errors import UserError
from bertopt.tasks import DEFAULT_TASK, TASK_SPECS, known_task, task_spec
from bertopt.untrusted import text_list

AGGREGATIONS = ("none", "simple", "first", "average", "max")
DEFAULT_IGNORE_LABELS = ("O",)


# -- which task, which output (the tasks themselves: bertopt.tasks) ------------------------------------------
def task_of(model) -> str:
    """The task of an artifact (or reference spec): the manifest's ``task``, else read from its outputs."""
    task = known_task(model.model_info.get("task"))
    if task is not None:
        return task
    kinds = {o.get("kind") for o in model.outputs}
    for spec in TASK_SPECS:
        if spec.name != DEFAULT_TASK and spec.output_kind in kinds:
            return spec.name
    return DEFAULT_TASK


def task_output(model, task: str | None = None) -> str:
    """The name of the output that carries the task's result."""
    task = task or task_of(model)
    kind = task_spec(task).output_kind
    names = [o["name"] for o in model.outputs if o.get("kind") == kind]
    if not names and task == "classification":  # older classifiers without a kind
        names = [o["name"] for o in model.outputs if o["name"] == "logits"]
    if not names:
        primary = model.model_info.get("primary_output")
        have = ", ".join(f"{o['name']} ({o.get('kind', '?')})" for o in model.outputs)
        if task == "embedding" and primary:
            raise UserError(f"{model.path} has no sentence-embedding output (outputs: {have}); export it with "
                            "pooling (--pooling mean) to get one vector per text")
        raise UserError(f"{model.path} is a {task} model but has no output of kind {kind} (outputs: {have}); "
                        "re-create the artifact with 'bertopt export'")
    primary = model.model_info.get("primary_output")
    return primary if primary in names else names[-1]


def label_names(model_info: dict[str, Any], count: int) -> list[str]:
    """``id2label`` as a list (keys may be ints or strings); transformers' default names where it has none."""
    id2label = {int(k): str(v) for k, v in (model_info.get("id2label") or {}).items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(count)]


def check_pairs(model, task: str, pairs) -> None:
    if pairs is None:
        if task == "rerank":
            raise UserError("a rerank model scores (query, passage) pairs; pass pairs= (one passage per text) "
                            "or call rerank(query, passages)")
        return
    if task != "rerank" and model.model_info.get("pair_input") is False:
        raise UserError(f"this {task} model takes a single text, but text pairs were given; drop the second "
                        "text (pairs= in Python, --pair with 'bertopt client predict', --pair-col with "
                        "spark-predict, --text-pair-column with validate)")


# -- classification ------------------------------------------------------------------------------------------
def score_function(model_info: dict[str, Any], num_labels: int) -> str:
    """transformers' text-classification rule: regression -> none; multi-label or one logit -> sigmoid;
    otherwise softmax."""
    problem = model_info.get("problem_type")
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def class_probabilities(logits: np.ndarray, model_info: dict[str, Any]) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    fn = score_function(model_info, logits.shape[-1])
    if fn == "sigmoid":
        return sigmoid(logits)
    if fn == "softmax":
        return softmax(logits)
    return logits


def classify(logits: np.ndarray, model_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row: the top label, its score (the confidence) and every label's score."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise UserError(f"classification logits must be (texts, labels), got shape {logits.shape}")
    probs = class_probabilities(logits, model_info)
    names = label_names(model_info, logits.shape[1])
    out = []
    for row in probs:
        best = int(row.argmax())
        out.append({"label": names[best], "score": float(row[best]),
                    "scores": {name: float(v) for name, v in zip(names, row)}})
    return out


# -- rerank --------------------------------------------------------------------------------------------------
def rerank_activation(model_info: dict[str, Any]) -> str:
    """sentence-transformers' CrossEncoder applies sigmoid to a single logit unless the model says otherwise
    (``score_activation`` in the manifest, from the CrossEncoder's config: sigmoid, identity)."""
    name = str(model_info.get("score_activation") or model_info.get("activation") or "sigmoid").lower()
    if name.endswith("identity") or name == "none":
        return "identity"
    if name.endswith("sigmoid"):
        return "sigmoid"
    raise UserError(f"unknown rerank activation {name!r} in the manifest; expected sigmoid or identity")


def rerank_scores(scores: np.ndarray, model_info: dict[str, Any]) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    scores = scores.reshape(len(scores), -1)[:, 0] if scores.ndim > 1 else scores
    return sigmoid(scores) if rerank_activation(model_info) == "sigmoid" else scores


# -- sparse --------------------------------------------------------------------------------------------------
def sparse_vectors(values: np.ndarray) -> list[dict[str, list]]:
    """The non-zero entries of each SPLADE row, indices ascending."""
    out = []
    for row in np.asarray(values):
        idx = np.flatnonzero(row > 0)
        out.append({"indices": idx.astype(int).tolist(), "values": row[idx].astype(float).tolist()})
    return out


# -- token classification ------------------------------------------------------------------------------------
class TokenSpans:
    """What entity grouping needs from the tokenizer: token strings, the unknown-token id, the decoder (to
    join sub-word pieces back into words) and whether the model marks word continuations."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        model = tokenizer.model
        self.word_aware = bool(getattr(model, "continuing_subword_prefix", None))
        self.unk_id = self._unk_id(tokenizer)

    @staticmethod
    def _unk_id(tokenizer) -> int | None:
        unk = getattr(tokenizer.model, "unk_token", None)
        if unk:
            return tokenizer.token_to_id(unk)
        spec = json.loads(tokenizer.to_str()).get("model", {})
        unk_id = spec.get("unk_id")  # Unigram (SentencePiece)
        return int(unk_id) if unk_id is not None else None

    def to_string(self, tokens: list[str]) -> str:
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def pre_entities(self, text: str, encoding, probs: np.ndarray, segment: int = 0) -> list[dict[str, Any]]:
        """Every real token of the first segment with its scores, offsets and whether it continues a word
        (transformers' ``gather_pre_entities``)."""
        out = []
        seq_ids = encoding.sequence_ids
        for idx, (token_id, special) in enumerate(zip(encoding.ids, encoding.special_tokens_mask)):
            if special or (seq_ids[idx] is not None and seq_ids[idx] != segment):
                continue
            word = self.tokenizer.id_to_token(token_id)
            start, end = encoding.offsets[idx]
            word_ref = text[start:end]
            if self.word_aware:
                is_subword = len(word) != len(word_ref)
            else:  # byte-level BPE, SentencePiece: the pipeline's fallback heuristic
                is_subword = start > 0 and " " not in text[start - 1:start + 1]
            if token_id == self.unk_id:
                word = word_ref
                is_subword = False
            out.append({"word": word, "scores": probs[idx], "start": int(start), "end": int(end), "index": idx,
                        "is_subword": is_subword})
        return out


def _tag(entity: str) -> tuple[str, str]:
    if entity.startswith("B-"):
        return "B", entity[2:]
    if entity.startswith("I-"):
        return "I", entity[2:]
    return "I", entity


def aggregate_entities(spans: TokenSpans, pre: list[dict[str, Any]], names: list[str],
                       aggregation: str) -> list[dict[str, Any]]:
    """transformers' ``aggregate``: per token (none), grouped adjacent tokens (simple), or word-level first /
    average / max, then grouped."""
    if aggregation in ("none", "simple"):
        entities = []
        for p in pre:
            best = int(p["scores"].argmax())
            entities.append({"entity": names[best], "score": float(p["scores"][best]), "index": p["index"],
                             "word": p["word"], "start": p["start"], "end": p["end"]})
    else:
        entities = []
        group: list[dict[str, Any]] = []
        for p in pre:
            if group and not p["is_subword"]:
                entities.append(_aggregate_word(spans, group, names, aggregation))
                group = []
            group.append(p)
        if group:
            entities.append(_aggregate_word(spans, group, names, aggregation))
    if aggregation == "none":
        return entities
    grouped: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for e in entities:
        if run:
            bi, tag = _tag(e["entity"])
            _, last_tag = _tag(run[-1]["entity"])
            if not (tag == last_tag and bi != "B"):
                grouped.append(_group(spans, run))
                run = []
        run.append(e)
    if run:
        grouped.append(_group(spans, run))
    return grouped


def _aggregate_word(spans: TokenSpans, group: list[dict[str, Any]], names: list[str], how: str) -> dict[str, Any]:
    if how == "first":
        scores = group[0]["scores"]
    elif how == "max":
        scores = max(group, key=lambda p: p["scores"].max())["scores"]
    else:  # average
        scores = np.nanmean(np.stack([p["scores"] for p in group]), axis=0)
    best = int(scores.argmax())
    return {"entity": names[best], "score": float(scores[best]), "word": spans.to_string([p["word"] for p in group]),
            "start": group[0]["start"], "end": group[-1]["end"]}


def _group(spans: TokenSpans, run: list[dict[str, Any]]) -> dict[str, Any]:
    return {"entity_group": run[0]["entity"].split("-", 1)[-1],
            "score": float(np.nanmean([e["score"] for e in run])),
            "word": spans.to_string([e["word"] for e in run]), "start": run[0]["start"], "end": run[-1]["end"]}


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise UserError(f"unknown aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    return aggregation


def token_entities(predictor, texts: Sequence[str], token_logits: Sequence[np.ndarray], *,
                   aggregation: str = "simple", ignore_labels: Sequence[str] | None = None,
                   pairs: Sequence[str] | None = None, whole: bool = False) -> list[list[dict[str, Any]]]:
    """Entities of each text from its per-token logits (as ``Predictor.run`` returns them); ``whole``: the
    logits are of untruncated texts (chunked: ``long_inputs="chunk"``)."""
    check_aggregation(aggregation)
    ignore = set(DEFAULT_IGNORE_LABELS if ignore_labels is None else ignore_labels)
    encodings = predictor.tokenize(texts, pairs, truncate=False) if whole else predictor.tokenize(texts, pairs)
    spans = TokenSpans(predictor.tokenizer)
    out = []
    for text, enc, logits in zip(texts, encodings, token_logits):
        if len(enc.ids) != len(logits):
            raise UserError(f"got {len(logits)} token results for a text of {len(enc.ids)} tokens; "
                            "the tokenizer does not match the model's outputs")
        names = label_names(predictor.model.model_info, logits.shape[-1])
        probs = softmax(logits)  # the pipeline always uses softmax per token
        pre = spans.pre_entities(text, enc, probs)
        entities = aggregate_entities(spans, pre, names, aggregation)
        out.append([e for e in entities if e.get("entity", e.get("entity_group")) not in ignore])
    return out


def jsonable(value: Any) -> Any:
    """Results as plain JSON values: numpy arrays and scalars become lists and numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# -- the Predictor's task-level calls ------------------------------------------------------------------------
def predict(predictor, texts: Sequence[str] | str, pairs: Sequence[str] | None = None, *,
            aggregation: str = "simple", ignore_labels: Sequence[str] | None = None,
            long_inputs: str | None = None) -> list[Any]:
    """One task result per text (see the module docstring), in the caller's order."""
    texts = text_list(texts)
    pairs = None if pairs is None else text_list(pairs, "pairs")
    model = predictor.model
    task = task_of(model)
    check_predict_args(model, task, pairs, aggregation)
    name = task_output(model, task)
    policy = predictor.long_input_policy(long_inputs)
    values = predictor.run(texts, pairs, outputs=[name], long_inputs=policy)[name]
    return results_from_outputs(predictor, task, texts, values, pairs=pairs, aggregation=aggregation,
                                ignore_labels=ignore_labels, whole=policy == "chunk")


def check_predict_args(model, task: str, pairs, aggregation: str) -> None:
    """What ``predict`` refuses before running the model (pairs the model cannot take, or a rerank model without
    them; an unknown aggregation for token classification); the Spark Kafka backend checks the same way."""
    check_pairs(model, task, pairs)
    if task == "token-classification":
        check_aggregation(aggregation)


def results_from_outputs(predictor, task: str, texts: Sequence[str], values, *, pairs=None,
                         aggregation: str = "simple", ignore_labels: Sequence[str] | None = None,
                         whole: bool = False) -> list[Any]:
    """Task results from the task output's raw values (``Predictor.run(...)[task_output]``; ``whole``: run
    with ``long_inputs="chunk"``, token outputs span the untruncated texts)."""
    info = predictor.model.model_info
    if task == "classification":
        return classify(values, info)
    if task == "token-classification":
        return token_entities(predictor, texts, values, aggregation=aggregation, ignore_labels=ignore_labels,
                              pairs=pairs, whole=whole)
    if task == "rerank":
        return [float(s) for s in rerank_scores(values, info)]
    if task == "sparse-embedding":
        return sparse_vectors(values)
    return list(np.asarray(values, dtype=np.float32))


def rerank(predictor, query: str, passages: Sequence[str], top_k: int | None = None,
           long_inputs: str | None = None) -> list[dict[str, Any]]:
    """Passages sorted by relevance to ``query``: ``[{"index", "score", "text"}, ...]`` best first
    (``index`` is the passage's position in ``passages``); ties keep the input order."""
    model = predictor.model
    task = task_of(model)
    if task != "rerank":
        raise UserError(f"rerank() needs a rerank (cross-encoder) model; this artifact is a {task} model")
    if not isinstance(query, str):
        raise UserError(f"the query must be a string, got {type(query).__name__}")
    if isinstance(passages, str):
        raise UserError("passages must be a list of strings, got one string; wrap it in a list")
    passages = list(passages)
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be at least 1, got {top_k}")
    if not passages:
        return []
    scores = predict(predictor, [query] * len(passages), passages, long_inputs=long_inputs)
    order = sorted(range(len(passages)), key=lambda i: -scores[i])
    ranked = [{"index": i, "score": scores[i], "text": passages[i]} for i in order]
    return ranked[:top_k] if top_k else ranked
