"""The ``tensorflow`` runtime backend: tf-savedmodel and tf-graphdef artifacts run in TensorFlow through the
same Predictor (tokenisation, bucketing, validation) as ONNX artifacts. TensorFlow is imported on first use."""

from __future__ import annotations

from bertopt.errors import UserError, require
from bertopt.model_handle import ModelHandle
from bertopt.runtime.backends import register_backend

TF_FORMATS = ("tensorflow", "tf-graphdef", "tf-savedmodel")


def refuse_other_formats(model: ModelHandle) -> None:
    if model.model_format not in TF_FORMATS:
        raise UserError(f"the TensorFlow runtime runs tf-graphdef and tf-savedmodel artifacts, not "
                        f"{model.model_format}")


@register_backend("tensorflow")
def open_tensorflow_session(model: ModelHandle, provider: str = "auto", threads: int | None = None):
    if provider not in ("auto", "cpu"):
        raise UserError(f"the TensorFlow runtime in bertopt runs on CPU; provider '{provider}' is not available "
                        "(use --provider cpu, or export the graph to ONNX for CUDA/TensorRT)")
    refuse_other_formats(model)  # before TensorFlow loads (its start-up lines would come first)
    require("tensorflow", "tf", "running TensorFlow artifacts")
    from bertopt.runtime.tf_session import session_for_model

    return session_for_model(model, threads=threads)
