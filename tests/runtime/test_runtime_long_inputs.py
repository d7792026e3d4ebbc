"""Long inputs (a text over the model's window): the one policy of the runtime (``long_inputs``: truncate, error,
chunk), on the real MiniLM with texts of 1x, 3x and 10x its 256-token window, and per family / per task on the
tiny models (WordPiece, byte-level BPE and SentencePiece tokenizers: every window carries the family's special
tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from long_texts import text_of

from bertopt.errors import UserError
from bertopt.runtime import Predictor
from bertopt.tiny_models import FAMILY_FIXTURES


def fitting_text(predictor: Predictor) -> str:
    """The longest prefix of a long text (whole words) that still fits the window: 1x the window."""
    full = predictor.untruncated_tokenizer()
    words = text_of(predictor, 2 * predictor.max_seq_len).split()
    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if len(full.encode(" ".join(words[:mid])).ids) <= predictor.max_seq_len:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def windows_of(predictor: Predictor, text: str):
    """The windows, made here from the tokenizer file directly: max_seq_len tokens, overlapping by a quarter of a
    window's text tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(predictor.model.tokenizer_path / "tokenizer.json"))
    specials = tok.num_special_tokens_to_add(False)
    tok.no_padding()
    tok.enable_truncation(max_length=predictor.max_seq_len, stride=(predictor.max_seq_len - specials) // 4)
    first = tok.encode(text)
    return [first, *first.overflowing]


def window_rows(predictor: Predictor, windows, output: str) -> np.ndarray:
    rows = []
    for w in windows:
        feeds, _ = predictor.feeds_for([w])
        rows.append(predictor.run_batch(feeds, [output])[output][0])
    return np.stack(rows)


@pytest.fixture(scope="module")
def minilm(minilm_onnx):
    return Predictor(minilm_onnx, threads=2)


@pytest.fixture(scope="module")
def minilm_texts(minilm):
    assert minilm.max_seq_len == 256
    return {1: fitting_text(minilm), 3: text_of(minilm, 3 * 256), 10: text_of(minilm, 10 * 256)}


def test_minilm_text_that_fits_is_the_same_under_every_policy(minilm, minilm_texts):
    text = minilm_texts[1]
    assert len(minilm.untruncated_tokenizer().encode(text).ids) in range(250, 257)
    plain = minilm.encode([text])
    for policy in ("error", "truncate", "chunk"):
        np.testing.assert_array_equal(minilm.encode([text], long_inputs=policy), plain)


@pytest.mark.parametrize("times", [3, 10])
def test_minilm_error_names_the_window_and_the_length(minilm, minilm_texts, times):
    text = minilm_texts[times]
    length = len(minilm.untruncated_tokenizer().encode(text).ids)
    assert length >= times * 256
    with pytest.raises(UserError, match=rf"^text 1 has {length} tokens, more than this model's window of 256 "
                                        r"tokens; shorten it, or set long inputs to truncate"):
        minilm.encode(["short", text], long_inputs="error")
    strict = Predictor(minilm.artifact, session=minilm.session, long_inputs="error")
    with pytest.raises(UserError, match=f"has {length} tokens"):
        strict.encode([text])


@pytest.mark.parametrize("times", [3, 10])
def test_minilm_truncate_is_todays_behaviour(minilm, minilm_texts, times):
    text = minilm_texts[times]
    default = minilm.encode([text])  # the Predictor's default policy is truncate, as before
    np.testing.assert_array_equal(minilm.encode([text], long_inputs="truncate"), default)
    # truncation keeps the first window: the text cut to its first 254 word pieces, embedded whole
    first = windows_of(minilm, text)[0]
    np.testing.assert_allclose(default[0], window_rows(minilm, [first], "sentence_embedding")[0], atol=1e-6)


@pytest.mark.parametrize("times", [3, 10])
def test_minilm_chunk_is_the_token_weighted_mean_of_overlapping_windows(minilm, minilm_texts, times):
    text = minilm_texts[times]
    windows = windows_of(minilm, text)
    assert len(windows) >= times + 1  # overlapping windows: more of them than whole windows of text
    assert all(len(w.ids) <= 256 and w.tokens[0] == "[CLS]" and w.tokens[-1] == "[SEP]" for w in windows)
    rows = window_rows(minilm, windows, "sentence_embedding")
    weights = np.array([len(w.ids) for w in windows], dtype=np.float64)
    want = (rows * weights[:, None]).sum(0) / weights.sum()
    want /= np.linalg.norm(want)  # MiniLM normalises its embeddings, so the pooled one is re-normalised
    got = minilm.encode(["a short one", text, "another"], long_inputs="chunk")
    np.testing.assert_allclose(got[1], want, atol=2e-6)
    assert abs(float(np.linalg.norm(got[1])) - 1.0) < 1e-5
    np.testing.assert_allclose(got[[0, 2]], minilm.encode(["a short one", "another"]), atol=1e-6)  # unchanged
    # against the model's own behaviour: the text's parts embedded one by one (each window's words, re-tokenized)
    # and averaged stay close to the chunked vector; the truncated vector (the first part only) is further away
    parts = [text[w.offsets[1][0]:w.offsets[len(w.ids) - 2][1]] for w in windows]
    part_mean = minilm.encode(parts).mean(0)
    part_mean /= np.linalg.norm(part_mean)
    truncated = minilm.encode([text])[0]
    to_parts, to_truncated = float(got[1] @ part_mean), float(got[1] @ truncated)
    # measured: 3x 0.981 / 0.731, 10x 0.997 / 0.595
    assert to_parts > 0.97
    assert to_truncated < to_parts - 0.15


def test_minilm_chunked_token_states_cover_the_whole_text(minilm, minilm_texts):
    text = minilm_texts[3]
    whole = minilm.untruncated_tokenizer().encode(text)
    windows = windows_of(minilm, text)
    states = minilm.run([text], outputs=["last_hidden_state"], long_inputs="chunk")["last_hidden_state"][0]
    assert states.shape == (len(whole.ids), 384)
    first = window_rows(minilm, windows[:1], "last_hidden_state")[0]
    overlap = (256 - 2) // 4
    keep = 256 - 1 - (overlap - overlap // 2)  # [CLS] + the first window's text tokens before the shared tail
    np.testing.assert_allclose(states[:keep], first[:keep], atol=1e-5)
    last = window_rows(minilm, windows[-1:], "last_hidden_state")[0]
    np.testing.assert_allclose(states[-1], last[len(windows[-1].ids) - 1], atol=1e-5)  # the final [SEP]


def test_policy_is_checked_once_with_its_choices(tiny_onnx):
    with pytest.raises(UserError, match=r"^Predictor: 'long_inputs' must be one of error, truncate, chunk; got "
                                        r"'split'$"):
        Predictor(tiny_onnx, long_inputs="split")
    with pytest.raises(UserError, match="'long_inputs' must be one of error, truncate, chunk"):
        Predictor(tiny_onnx).encode(["x"], long_inputs="cut")


# -- every family: its tokenizer kind, its special tokens -----------------------------------------------------
# the first and last token each family's tokenizer puts around one text (its post-processor's template)
SPECIALS = {"bert": ("[CLS]", "[SEP]"), "distilbert": ("[CLS]", "[SEP]"), "electra": ("[CLS]", "[SEP]"),
            "deberta-v2": ("[CLS]", "[SEP]"), "modernbert": ("[CLS]", "[SEP]"), "roberta": ("<s>", "</s>"),
            "xlm-roberta": ("<s>", "</s>"), "mpnet": ("<s>", "</s>")}


@pytest.mark.parametrize("family", FAMILY_FIXTURES)
def test_family_windows_keep_special_tokens_and_pool(family, tmp_path):
    from bertopt.registry import run_stage
    from bertopt.tiny_models import build_tiny_family_model

    hf = build_tiny_family_model(tmp_path / "hf", family, pooling="mean", normalize=True)
    art = run_stage("export", hf, {}, tmp_path / "onnx")
    pred = Predictor(art, provider="cpu", threads=1, max_seq_len=24)
    whole = pred.untruncated_tokenizer()
    text = text_of(pred, 3 * 24)
    length = len(whole.encode(text).ids)
    with pytest.raises(UserError, match=f"^text 0 has {length} tokens, more than this model's window of 24 tokens"):
        pred.encode([text], long_inputs="error")
    windows = windows_of(pred, text)
    head, tail = SPECIALS[family]
    assert (whole.encode(text).tokens[0], whole.encode(text).tokens[-1]) == (head, tail)
    for w in windows:
        assert len(w.ids) <= 24 and w.tokens[0] == head and w.tokens[-1] == tail
        assert w.sequence_ids[0] is None and w.sequence_ids[-1] is None
    rows = window_rows(pred, windows, "sentence_embedding")
    weights = np.array([len(w.ids) for w in windows], dtype=np.float64)
    want = (rows * weights[:, None]).sum(0) / weights.sum()
    got = pred.encode(["the cat", text], long_inputs="chunk")
    np.testing.assert_allclose(got[1], want / np.linalg.norm(want), atol=2e-5)
    np.testing.assert_allclose(got[0], pred.encode(["the cat"])[0], atol=1e-6)  # batched beside the windows
    states = pred.run([text], outputs=["last_hidden_state"], long_inputs="chunk")["last_hidden_state"][0]
    assert states.shape[0] == length


# -- every task ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "roberta", "deberta-v2"])
def test_classification_chunk_averages_window_logits_by_tokens(task_artifact, family):
    from bertopt.runtime.tasks import classify

    _, art = task_artifact("classification", family)
    pred = Predictor(art, provider="cpu", threads=1, max_seq_len=20)
    text = text_of(pred, 60)
    windows = windows_of(pred, text)
    rows = window_rows(pred, windows, "logits")
    weights = np.array([len(w.ids) for w in windows], dtype=np.float64)
    want = (rows * weights[:, None]).sum(0) / weights.sum()
    got = pred.predict([text, "the cat"], long_inputs="chunk")
    assert got[0] == classify(want[None].astype(np.float32), art.model_info)[0]
    assert got[1] == pred.predict(["the cat"])[0]
    with pytest.raises(UserError, match="more than this model's window of 20 tokens"):
        pred.predict([text], long_inputs="error")
    assert pred.predict([text]) == pred.predict([text], long_inputs="truncate")


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_token_classification_chunk_finds_entities_over_the_whole_text(task_artifact, family):
    _, art = task_artifact("token-classification", family)
    pred = Predictor(art, provider="cpu", threads=1, max_seq_len=20)
    text = text_of(pred, 80)
    whole = pred.untruncated_tokenizer().encode(text)
    entities = pred.predict([text], aggregation="none", ignore_labels=[], long_inputs="chunk")[0]
    tokens = [i for i, s in enumerate(whole.sequence_ids) if s is not None]
    assert len(entities) == len(tokens)  # one per text token of the whole text, none lost at a window's edge
    assert [e["index"] for e in entities] == tokens
    assert entities[-1]["end"] == whole.offsets[tokens[-1]][1] > 3 * len(text) // 4
    truncated = pred.predict([text], aggregation="none", ignore_labels=[])[0]
    assert len(truncated) == 20 - 2
    # the first window's tokens before the shared tail are the truncated run's own
    keep = 18 - (18 // 4 - 18 // 8)
    assert [e["entity"] for e in entities[:keep]] == [e["entity"] for e in truncated[:keep]]
    np.testing.assert_allclose([e["score"] for e in entities[:keep]], [e["score"] for e in truncated[:keep]],
                               atol=1e-5)


def test_sparse_chunk_is_the_max_over_windows(task_artifact):
    _, art = task_artifact("sparse-embedding", "bert")
    pred = Predictor(art, provider="cpu", threads=1, max_seq_len=20)
    text = text_of(pred, 60)
    windows = windows_of(pred, text)
    rows = window_rows(pred, windows, pred.primary_output)
    want = rows.max(0)
    got = pred.run([text], outputs=[pred.primary_output], long_inputs="chunk")[pred.primary_output][0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    found = pred.predict([text], long_inputs="chunk")[0]
    assert found["indices"] == np.flatnonzero(want > 0).tolist()


def test_rerank_pairs_are_refused_not_chunked(task_artifact):
    _, art = task_artifact("rerank", "bert")
    pred = Predictor(art, provider="cpu", threads=1, max_seq_len=20)
    long = text_of(pred, 60)
    with pytest.raises(UserError, match=r"^chunking splits single texts, not text pairs \(rerank, pair "
                                        r"classification\); a pair over the model's window cannot be chunked"):
        pred.rerank("what is a cat", ["the cat", long], long_inputs="chunk")
    with pytest.raises(UserError, match=r"^text 1 has \d+ tokens, more than this model's window of 20 tokens"):
        pred.rerank("what is a cat", ["the cat", long], long_inputs="error")
    fits = pred.rerank("what is a cat", ["the cat", "a dog"], long_inputs="chunk")
    assert fits == pred.rerank("what is a cat", ["the cat", "a dog"])
    assert pred.rerank("q", [long], long_inputs="truncate") == pred.rerank("q", [long])
