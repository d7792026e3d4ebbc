"""bertopt's Keras BERT: embeddings, N encoder layers (exact GELU, LayerNorm eps 1e-12) and optional
sentence pooling + L2 normalisation, with every weight addressable by its Google BERT checkpoint name.

Keras 3 forbids ``/`` in weight names, so a weight is named with ``.`` and mapped back to the Google name
(``bert/encoder/layer_0/attention/self/query/kernel``) by :func:`google_name`.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

# HF adds the dtype's minimum to masked scores; the same constant here keeps outputs equal to PyTorch's, and it
# is exactly the constant fp16 cannot hold (it becomes -inf), which is why the fp16 stage keeps the mask path fp32.
MASK_VALUE = -3.4028234663852886e38
POOLINGS = (None, "mean", "cls", "max")


def google_name(weight) -> str:
    return weight.name.replace(".", "/")


def _layer_norm(x, gamma, beta, eps):
    with tf.name_scope("LayerNorm"):  # the name lets the fp16 stage find (and keep fp32) every LayerNorm node
        return _layer_norm_ops(x, gamma, beta, eps)


def _layer_norm_ops(x, gamma, beta, eps):
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=-1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + eps) * gamma + beta


# each block's weights: (key in BertEncoder.blocks, Google name under layer_i/, the pair's two variables)
_BLOCK_WEIGHTS = (("q", "attention/self/query", "/kernel", "/bias"),
                  ("k", "attention/self/key", "/kernel", "/bias"),
                  ("v", "attention/self/value", "/kernel", "/bias"),
                  ("o", "attention/output/dense", "/kernel", "/bias"),
                  ("ln1", "attention/output", "/LayerNorm/gamma", "/LayerNorm/beta"),
                  ("i", "intermediate/dense", "/kernel", "/bias"), ("out", "output/dense", "/kernel", "/bias"),
                  ("ln2", "output", "/LayerNorm/gamma", "/LayerNorm/beta"))


def variable_shapes(vocab_size: int, hidden_size: int, num_hidden_layers: int, intermediate_size: int,
                    max_position_embeddings: int, type_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every variable of a BERT encoder of these sizes, by Google name, in the order BertEncoder makes them: what a
    checkpoint is held to before anything is allocated."""
    h, inter = hidden_size, intermediate_size
    emb = "bert/embeddings/"
    shapes = {emb + "word_embeddings": (vocab_size, h), emb + "position_embeddings": (max_position_embeddings, h),
              emb + "token_type_embeddings": (type_vocab_size, h), emb + "LayerNorm/gamma": (h,),
              emb + "LayerNorm/beta": (h,)}
    sizes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "i": (h, inter), "out": (inter, h)}
    for i in range(num_hidden_layers):
        for key, name, first, second in _BLOCK_WEIGHTS:
            kernel = sizes.get(key, (h,))
            shapes[f"bert/encoder/layer_{i}/{name}{first}"] = kernel
            shapes[f"bert/encoder/layer_{i}/{name}{second}"] = (kernel[-1],)
    return shapes


@keras.saving.register_keras_serializable(package="bertopt")
class BertEncoder(keras.layers.Layer):
    """Takes a dict ``{input_ids, attention_mask|input_mask, token_type_ids}``; returns a dict with
    ``last_hidden_state`` and, when pooling is set, ``sentence_embedding``."""

    def __init__(self, vocab_size: int, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                 intermediate_size: int, max_position_embeddings: int = 512, type_vocab_size: int = 2,
                 layer_norm_eps: float = 1e-12, pooling: str | None = None, normalize: bool = False, **kwargs):
        super().__init__(**kwargs)
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads "
                             f"{num_attention_heads}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.layer_norm_eps = layer_norm_eps
        self.pooling = pooling
        self.normalize = normalize
        self._create_weights()

    def _w(self, google: str, shape, init="zeros"):
        return self.add_weight(name=google.replace("/", "."), shape=tuple(shape), initializer=init,
                               trainable=True, dtype="float32")

    def _create_weights(self) -> None:
        shapes = variable_shapes(self.vocab_size, self.hidden_size, self.num_hidden_layers, self.intermediate_size,
                                 self.max_position_embeddings, self.type_vocab_size)
        made = {name: self._w(name, shape, "ones" if name.endswith("/gamma") else "zeros")
                for name, shape in shapes.items()}  # in this order: a saved .keras numbers its variables by it
        emb = "bert/embeddings/"
        self.word, self.position, self.token_type = (made[emb + n] for n in ("word_embeddings", "position_embeddings",
                                                                             "token_type_embeddings"))
        self.emb_ln = (made[emb + "LayerNorm/gamma"], made[emb + "LayerNorm/beta"])
        self.blocks = []
        for i in range(self.num_hidden_layers):
            p = f"bert/encoder/layer_{i}/"
            pair = {key: (made[p + name + first], made[p + name + second])
                    for key, name, first, second in _BLOCK_WEIGHTS}
            self.blocks.append(pair)
        self.built = True

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
                "type_vocab_size": self.type_vocab_size, "layer_norm_eps": self.layer_norm_eps,
                "pooling": self.pooling, "normalize": self.normalize}

    def build(self, input_shape=None):
        self.built = True

    def call(self, inputs):
        ids = inputs["input_ids"]
        mask = inputs["attention_mask"] if "attention_mask" in inputs else inputs["input_mask"]
        types = inputs["token_type_ids"] if "token_type_ids" in inputs else inputs.get("segment_ids")
        if types is None:
            types = tf.zeros_like(ids)
        h, heads = self.hidden_size, self.num_attention_heads
        head_dim = h // heads
        eps = self.layer_norm_eps
        batch, seq = tf.shape(ids)[0], tf.shape(ids)[1]
        x = (tf.gather(self.word, ids) + tf.gather(self.position, tf.range(seq))[tf.newaxis]
             + tf.gather(self.token_type, types))
        x = _layer_norm(x, *self.emb_ln, eps)
        mask_f = tf.cast(mask, tf.float32)
        additive_mask = (1.0 - mask_f[:, tf.newaxis, tf.newaxis, :]) * MASK_VALUE
        x = tf.reshape(x, [-1, h])  # 2-D between layers, like Google's BERT: MatMul, not BatchMatMul

        def heads_first(t):
            return tf.transpose(tf.reshape(t, [batch, seq, heads, head_dim]), [0, 2, 1, 3])

        for blk in self.blocks:
            q = heads_first(tf.matmul(x, blk["q"][0]) + blk["q"][1])
            k = heads_first(tf.matmul(x, blk["k"][0]) + blk["k"][1])
            v = heads_first(tf.matmul(x, blk["v"][0]) + blk["v"][1])
            scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim))
            probs = tf.nn.softmax(scores + additive_mask, axis=-1)
            context = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [-1, h])
            attn = tf.matmul(context, blk["o"][0]) + blk["o"][1]
            x = _layer_norm(attn + x, *blk["ln1"], eps)
            inter = tf.nn.gelu(tf.matmul(x, blk["i"][0]) + blk["i"][1], approximate=False)  # exact (erf) GELU
            out = tf.matmul(inter, blk["out"][0]) + blk["out"][1]
            x = _layer_norm(out + x, *blk["ln2"], eps)
        hidden = tf.reshape(x, [batch, seq, h])
        result = {"last_hidden_state": hidden}
        if self.pooling is not None:
            m = mask_f[:, :, tf.newaxis]
            if self.pooling == "mean":
                pooled = tf.reduce_sum(hidden * m, axis=1) / tf.maximum(tf.reduce_sum(m, axis=1), 1e-9)
            elif self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = tf.reduce_max(tf.where(m > 0, hidden, tf.fill(tf.shape(hidden), -1e9)), axis=1)
            if self.normalize:
                norm = tf.sqrt(tf.reduce_sum(tf.square(pooled), axis=1, keepdims=True))
                pooled = pooled / tf.maximum(norm, 1e-12)
            result["sentence_embedding"] = pooled
        return result


class ServingModule(tf.Module):
    """What is saved as a SavedModel: the encoder behind a ``serving_default`` signature of named tensors
    (Keras 3 ``model.export`` cannot save a call taking several positional tensors)."""

    def __init__(self, encoder: BertEncoder, mask_name: str = "attention_mask", dtype=tf.int64):
        super().__init__()
        self.encoder = encoder
        spec = [tf.TensorSpec([None, None], dtype, name=n) for n in ("input_ids", mask_name, "token_type_ids")]
        if mask_name == "attention_mask":
            def serve(input_ids, attention_mask, token_type_ids):
                return self.encoder({"input_ids": input_ids, "attention_mask": attention_mask,
                                     "token_type_ids": token_type_ids})
        else:
            def serve(input_ids, input_mask, token_type_ids):
                return self.encoder({"input_ids": input_ids, "input_mask": input_mask,
                                     "token_type_ids": token_type_ids})
        self.serve = tf.function(serve, input_signature=spec)

    def save(self, path: str) -> None:
        tf.saved_model.save(self, path, signatures={"serving_default": self.serve.get_concrete_function()})
