"""How the TensorFlow path plugs into bertopt (loaded by :func:`bertopt.extensions.load_extensions`): the stage
handlers for TensorFlow models and graphs, and the TensorFlow reference model for ``validate``. Nothing heavy is
imported here; each handler imports its module (and TensorFlow) when it runs."""

from __future__ import annotations

from bertopt.stages.common import register_format_handler
from bertopt.validate.reference import register_reference

TF_GRAPHS = ("tf-graphdef", "tf-savedmodel")
TF_SOURCES = ("tf-savedmodel", "keras", "tf-checkpoint")


@register_format_handler("freeze", *TF_SOURCES)
def freeze(input, config, out_dir, overwrite):
    from bertopt.tf.freeze import freeze

    return freeze(input, config, out_dir, overwrite)


@register_format_handler("prune", *TF_GRAPHS)
def prune(art, config, out_dir, overwrite):
    from bertopt.tf.prune import prune_tf_artifact

    return prune_tf_artifact(art, config, out_dir, overwrite)


@register_format_handler("quantize", *TF_GRAPHS)
def quantize(art, config, out_dir, overwrite):
    from bertopt.tf.fp16 import quantize_tf_fp16

    return quantize_tf_fp16(art, config, out_dir, overwrite)


@register_format_handler("export", "hf->tf-savedmodel")
def export_hf(source, config, out_dir, overwrite):
    from bertopt.tf.keras_bert import export_hf_to_savedmodel

    return export_hf_to_savedmodel(source, config, out_dir, overwrite)


@register_format_handler("export", "tf-checkpoint->tf-savedmodel")
def export_checkpoint(source, config, out_dir, overwrite):
    from bertopt.tf.keras_bert import export_checkpoint_to_savedmodel

    return export_checkpoint_to_savedmodel(source, config, out_dir, overwrite)


@register_format_handler("export", *(f"{graph}->onnx" for graph in TF_GRAPHS))
def export_graph(art, config, out_dir, overwrite):
    from bertopt.tf.to_onnx import export_graphdef_to_onnx

    return export_graphdef_to_onnx(art, config, out_dir, overwrite)


@register_reference(*TF_SOURCES)
def reference(source, artifact, **options):
    from bertopt.tf.reference import tf_reference

    return tf_reference(source, artifact, **options)
