"""TensorFlow-path fixtures, built by the tests themselves and shared per session (TF tracing is slow):
the tiny HF BERT as a bertopt SavedModel and through freeze -> prune -> fp16; a SavedModel and a .keras file
NOT made by bertopt (standard Keras layers, TF-Hub-style input names); a tiny Google-format checkpoint
written with Google's variable names."""

from __future__ import annotations

import shutil
import sys  # noqa: E402
from pathlib import Path

import numpy as np
import pytest
import tensorflow  # noqa: E402,F401  (make test installs it: a broken install must fail, not skip)

sys.path.insert(0, str(Path(__file__).parent))
from tf_conftest_helpers import GOOGLE_CONFIG, TINY_VOCAB, write_google_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def google_weights(tiny_hf):
    """The tiny HF BERT's weights under Google's names, plus the pre-training heads a real release carries."""
    from bertopt.tf.keras_bert import hf_weights_as_google

    assert (tiny_hf / "vocab.txt").read_text().split() == TINY_VOCAB
    weights = hf_weights_as_google(tiny_hf)
    rng = np.random.default_rng(0)
    # 128 positions like a real release (the recipe measures latency at 128 tokens); the HF model has 64
    pos = weights["bert/embeddings/position_embeddings"]
    weights["bert/embeddings/position_embeddings"] = np.concatenate(
        [pos, rng.normal(scale=0.02, size=(128 - len(pos), pos.shape[1])).astype(np.float32)])
    weights["cls/predictions/output_bias"] = rng.normal(size=len(TINY_VOCAB)).astype(np.float32)
    weights["cls/seq_relationship/output_weights"] = rng.normal(size=(2, 32)).astype(np.float32)
    weights["global_step"] = np.array(1000, dtype=np.int64)
    return weights


@pytest.fixture(scope="session")
def tiny_ckpt(google_weights, tmp_path_factory):
    return write_google_checkpoint(tmp_path_factory.mktemp("ckpt") / "uncased_L-2_H-32_A-4", google_weights,
                                   GOOGLE_CONFIG)


@pytest.fixture(scope="session")
def tiny_tf_savedmodel(tiny_hf, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("export", tiny_hf, {"to": "tf-savedmodel"}, tmp_path_factory.mktemp("tf") / "savedmodel")


@pytest.fixture(scope="session")
def tiny_frozen(tiny_tf_savedmodel, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("freeze", tiny_tf_savedmodel, {}, tmp_path_factory.mktemp("tf") / "frozen")


@pytest.fixture(scope="session")
def tiny_pruned(tiny_frozen, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("prune", tiny_frozen, {}, tmp_path_factory.mktemp("tf") / "pruned")


@pytest.fixture(scope="session")
def tiny_tf_fp16(tiny_pruned, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("quantize", tiny_pruned, {"mode": "fp16"}, tmp_path_factory.mktemp("tf") / "fp16")


@pytest.fixture(scope="session")
def tiny_tf_onnx(tiny_pruned, tmp_path_factory):
    from bertopt.registry import run_stage

    return run_stage("export", tiny_pruned, {"to": "onnx"}, tmp_path_factory.mktemp("tf") / "onnx")


def build_foreign_keras(mask_name: str, ids_name: str, types_name: str, dtype: str, vocab: int = len(TINY_VOCAB),
                        hidden: int = 16):
    """A small encoder from standard Keras layers (no bertopt code): embeddings, one self-attention block,
    masked mean pooling. Dict inputs/outputs, so it saves as .keras and behind a SavedModel signature."""
    import keras

    keras.utils.set_random_seed(1)
    ids = keras.Input((None,), dtype=dtype, name=ids_name)
    mask = keras.Input((None,), dtype=dtype, name=mask_name)
    types = keras.Input((None,), dtype=dtype, name=types_name)
    x = keras.layers.Embedding(vocab, hidden)(ids) + keras.layers.Embedding(2, hidden)(types)
    x = keras.layers.LayerNormalization(epsilon=1e-12)(x)
    m = mask
    bool_mask = keras.ops.cast(m, "bool")
    attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=hidden // 2)(
        x, x, attention_mask=keras.ops.logical_and(bool_mask[:, None, :], bool_mask[:, :, None]))
    x = keras.layers.LayerNormalization(epsilon=1e-12)(x + attn)
    x = keras.layers.LayerNormalization(epsilon=1e-12)(x + keras.layers.Dense(hidden)(
        keras.layers.Dense(hidden * 2, activation="gelu")(x)))
    weights = keras.ops.expand_dims(keras.ops.cast(m, "float32"), -1)
    pooled = keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(keras.ops.sum(weights, axis=1), 1e-9)
    return keras.Model({ids_name: ids, mask_name: mask, types_name: types},
                       {"sequence_output": x, "pooled_output": pooled})


@pytest.fixture(scope="session")
def foreign_savedmodel(tmp_path_factory):
    """A SavedModel not made by bertopt: TF-Hub-style names (input_word_ids, input_mask, input_type_ids), int32."""
    import tensorflow as tf

    model = build_foreign_keras("input_mask", "input_word_ids", "input_type_ids", "int32")
    spec = {n: tf.TensorSpec([None, None], tf.int32, name=n) for n in ("input_word_ids", "input_mask",
                                                                         "input_type_ids")}

    class Serving(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        @tf.function(input_signature=[spec["input_word_ids"], spec["input_mask"], spec["input_type_ids"]])
        def serve(self, input_word_ids, input_mask, input_type_ids):
            return self.model({"input_word_ids": input_word_ids, "input_mask": input_mask,
                               "input_type_ids": input_type_ids})

    folder = tmp_path_factory.mktemp("foreign") / "encoder_savedmodel"
    module = Serving()
    tf.saved_model.save(module, str(folder), signatures={"serving_default": module.serve.get_concrete_function()})
    (folder / "assets").mkdir(exist_ok=True)
    (folder / "assets" / "vocab.txt").write_text("\n".join(TINY_VOCAB) + "\n")
    return folder


@pytest.fixture(scope="session")
def tiny_keras_file(tmp_path_factory):
    model = build_foreign_keras("attention_mask", "input_ids", "token_type_ids", "int64")
    folder = tmp_path_factory.mktemp("keras")
    model.save(folder / "encoder.keras")
    (folder / "vocab.txt").write_text("\n".join(TINY_VOCAB) + "\n")
    return folder / "encoder.keras"


@pytest.fixture
def copy_of():
    def copy(src: Path, dest: Path) -> Path:
        shutil.copytree(src, dest)
        return dest

    return copy
