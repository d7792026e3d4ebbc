"""The one runtime: ``Predictor(artifact)`` is how every command runs a model."""

from bertopt.runtime.predictor import DEFAULT_BATCH_SIZE, Predictor, load_tokenizer

__all__ = ["Predictor", "load_tokenizer", "DEFAULT_BATCH_SIZE"]
