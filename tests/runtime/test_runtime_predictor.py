"""The one runtime: length bucketing, padding, truncation, order, providers."""

from __future__ import annotations

import numpy as np
import pytest

from bertopt.data import corpus
from bertopt.errors import UserError
from bertopt.runtime import Predictor
from bertopt.runtime.predictor import BUCKET_GROWTH, BUCKET_SLACK_TOKENS


@pytest.fixture(scope="module")
def texts():
    return corpus()[:120]


def test_bucketing_changes_speed_not_values(tiny_onnx, texts):
    bucketed = Predictor(tiny_onnx, length_bucketing=True, batch_size=16).run(texts)
    plain = Predictor(tiny_onnx, length_bucketing=False, batch_size=16).run(texts)
    assert np.allclose(bucketed["sentence_embedding"], plain["sentence_embedding"], atol=1e-5)
    for a, b in zip(bucketed["last_hidden_state"], plain["last_hidden_state"]):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-5)


def test_results_come_back_in_caller_order(tiny_onnx, texts):
    pred = Predictor(tiny_onnx, batch_size=8)
    all_at_once = pred.encode(texts)
    one_by_one = np.stack([pred.encode([t])[0] for t in texts[:20]])
    assert np.allclose(all_at_once[:20], one_by_one, atol=1e-5)


def test_padding_to_fixed_length_does_not_change_real_tokens(tiny_onnx):
    pred = Predictor(tiny_onnx)
    texts = ["hello world", "the cat sat on the mat"]
    padded = pred.run(texts, pad_to=40)
    tight = pred.run(texts)
    assert np.allclose(padded["sentence_embedding"], tight["sentence_embedding"], atol=1e-5)
    assert padded["last_hidden_state"][0].shape == tight["last_hidden_state"][0].shape


def test_token_outputs_are_trimmed_and_long_texts_truncated(tiny_onnx):
    pred = Predictor(tiny_onnx)
    assert pred.max_seq_len == 48  # the sentence-transformers config of the tiny model
    out = pred.run(["hello", "the cat " * 200, ""])
    lens = [x.shape[0] for x in out["last_hidden_state"]]
    assert lens == [3, 48, 2]  # [CLS] hello [SEP]; truncated; [CLS] [SEP]
    assert Predictor(tiny_onnx, max_seq_len=10).run(["the cat " * 200])["last_hidden_state"][0].shape[0] == 10


def test_bad_inputs_are_clear_errors(tiny_onnx):
    pred = Predictor(tiny_onnx)
    with pytest.raises(UserError, match="text 0 is a NoneType, not a string"):
        pred.encode([None])
    # a lone surrogate (JSON's "\\ud800" decodes to one) is refused before the tokenizer sees it
    with pytest.raises(UserError, match=r"^text 1 holds a lone surrogate \(U\+D800\) at character 1, which is not"):
        pred.encode(["fine", "a\ud800b"])
    with pytest.raises(UserError, match=r"text 0 \(second text\) holds a lone surrogate \(U\+DFFF\)"):
        pred.run(["q"], pairs=["\udfff"])
    assert pred.encode(["a\U0001F600b"]).shape == (1, 32)  # a real astral character is fine
    with pytest.raises(UserError, match="exceeds the model's 64 positions"):
        Predictor(tiny_onnx, max_seq_len=1000)
    # below [CLS] + [SEP] + one token the tokenizer truncates nothing: texts would run past the positions
    with pytest.raises(UserError, match=r"a maximum of 2 tokens per text leaves no room for the text \(the tokenizer "
                       r"adds 2 special tokens to each\); use 3 or more"):
        Predictor(tiny_onnx, max_seq_len=2)
    with pytest.raises(UserError, match="a maximum of -5 tokens per text is no length"):
        Predictor(tiny_onnx, max_seq_len=-5)
    assert Predictor(tiny_onnx, max_seq_len=3).tokenize(["a b c d e f"])[0].ids.__len__() == 3
    with pytest.raises(UserError, match="unknown output 'logits'"):
        pred.run(["x"], outputs=["logits"])
    assert pred.encode([]).shape == (0, 32)


def test_texts_are_taken_as_a_python_caller_gives_them(tiny_onnx):
    """A generator is read once (it came back empty when a check walked it first); one string is one text in
    run() as in encode() (run walked it character by character); a dict or set is refused (its keys, in no
    order the caller chose, were encoded without a word)."""
    pred = Predictor(tiny_onnx)
    texts = ["hello world", "the cat sat on the mat"]
    expected = pred.encode(texts)
    np.testing.assert_array_equal(pred.encode(t for t in texts), expected)
    np.testing.assert_array_equal(pred.encode(tuple(texts)), expected)
    np.testing.assert_array_equal(pred.run("hello world")["sentence_embedding"], expected[:1])
    assert [e.ids for e in pred.tokenize(iter(texts))] == [e.ids for e in pred.tokenize(texts)]
    for given, name in (({"hello world": 1}, "dict"), ({"hello world"}, "set"), (b"hello", "bytes"), (None, "NoneType"),
                        (3, "int")):
        with pytest.raises(UserError, match=f"^texts must be a string or a list of strings, got {name}$"):
            pred.encode(given)
    with pytest.raises(UserError, match="^pairs must be a string or a list of strings, got dict$"):
        pred.run(["q"], pairs={"p": 1})


def test_asking_for_cuda_without_it_is_an_error_not_a_silent_cpu_run(tiny_onnx):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=r"provider 'cuda' is not available in onnxruntime .*'bertopt\[gpu\]'"):
        Predictor(tiny_onnx, provider="cuda")
    with pytest.raises(UserError, match="unknown provider"):
        Predictor(tiny_onnx, provider="gpu")
    auto = Predictor(tiny_onnx, provider="auto", threads=1)
    assert auto.describe()["provider"] == "CPUExecutionProvider" and auto.describe()["threads"] == 1


def test_plan_bounds_padding_by_the_growth_and_slack_it_is_given(tiny_onnx):
    # lengths 4..40 tokens, 4 texts each: a looser bound plans fewer, more padded batches; every plan covers each
    # text once and keeps every batch within its own bound
    pred = Predictor(tiny_onnx, batch_size=32)
    texts = [" ".join(["word"] * k) for k in range(2, 39) for _ in range(4)]
    encodings = pred.tokenize(texts)
    lengths = [len(e.ids) for e in encodings]
    plans = {}
    for growth, slack in ((BUCKET_GROWTH, BUCKET_SLACK_TOKENS), (1.25, 8), (1.0, 0)):
        batches = pred.plan_batches(encodings, 32, growth=growth, slack=slack)
        assert sorted(i for b in batches for i in b) == list(range(len(texts)))
        for b in batches:
            assert len(b) <= 32 and max(lengths[i] for i in b) <= growth * min(lengths[i] for i in b) + slack
        plans[growth, slack] = batches
    assert len(plans[1.0, 0]) == len(set(lengths))  # exact: one batch per distinct length (4 texts each)
    assert len(plans[1.25, 8]) < len(plans[BUCKET_GROWTH, BUCKET_SLACK_TOKENS]) < len(plans[1.0, 0])
    assert pred.plan_batches(encodings, 32) == plans[BUCKET_GROWTH, BUCKET_SLACK_TOKENS]  # the defaults


def test_stats_count_texts_and_batches(tiny_onnx):
    pred = Predictor(tiny_onnx, batch_size=4)
    pred.encode(["a"] * 10)
    assert pred.stats["texts"] == 10 and pred.stats["batches"] == 3


def test_batches_bound_padding_on_long_tailed_text(tiny_onnx):
    # 40 short sentences and 2 paragraphs: fixed 32-text batches would pad 30 short texts to paragraph length
    pred = Predictor(tiny_onnx, batch_size=32)
    texts = [f"short sentence {i}" for i in range(40)] + ["a long paragraph " * 10, "another long one " * 9]
    encodings = pred.tokenize(texts)
    lengths = [len(e.ids) for e in encodings]
    batches = pred.plan_batches(encodings, 32)
    assert sorted(i for b in batches for i in b) == list(range(len(texts)))  # each text exactly once
    assert all(len(b) <= 32 for b in batches)
    for b in batches:  # no batch pads a text to more than BUCKET_GROWTH x + BUCKET_SLACK_TOKENS of its shortest
        assert max(lengths[i] for i in b) <= BUCKET_GROWTH * min(lengths[i] for i in b) + BUCKET_SLACK_TOKENS
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.3 * sum(lengths)
    # with a fixed pad length there is nothing to save: plain 32-text batches
    assert [len(b) for b in pred.plan_batches(encodings, 32, bounded_padding=False)] == [32, 10]
    # and values do not depend on the plan
    assert np.allclose(pred.encode(texts), Predictor(tiny_onnx, batch_size=32, length_bucketing=False).encode(texts),
                       atol=1e-5)


def test_a_sparse_model_bounds_the_tokens_of_each_call(task_artifact):
    # SPLADE holds [batch, tokens, vocabulary] float temporaries: the task declares a token bound per call, every
    # batch plan keeps to it (bucketed or not), a text is never split, and the values do not depend on the plan
    from bertopt.tasks import task_spec

    _, art = task_artifact("sparse-embedding")
    cap = task_spec("sparse-embedding").batch_tokens
    pred = Predictor(art, batch_size=128)
    assert pred.batch_tokens == cap and Predictor(task_artifact("classification")[1]).batch_tokens is None
    long = "a long paragraph about rivers " * 14
    texts = [long] * 80 + [f"short sentence {i}" for i in range(140)]
    encodings = pred.tokenize(texts)
    lengths = [len(e.ids) for e in encodings]
    assert max(lengths) * 128 > cap  # 128 long texts in one call would exceed the bound
    for bucketing in (True, False):
        pred.length_bucketing = bucketing
        batches = pred.plan_batches(encodings, 128)
        assert sorted(i for b in batches for i in b) == list(range(len(texts)))
        assert all(len(b) * max(lengths[i] for i in b) <= cap for b in batches), batches
        assert all(len(b) <= 128 for b in batches) and max(len(b) for b in batches) > cap // max(lengths)
    got = pred.encode(texts)
    one_by_one = Predictor(art, batch_size=1).encode(texts)
    np.testing.assert_allclose(got, one_by_one, atol=1e-5)
