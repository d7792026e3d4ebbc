"""freeze: TensorFlow SavedModel / .keras / Google BERT checkpoint -> frozen GraphDef artifact.

Variables become constants (``convert_variables_to_constants_v2``); the work lives in ``bertopt.tf.freeze``.
A Google checkpoint is first rebuilt in bertopt's Keras BERT (every variable loaded by name).

    bertopt freeze my_savedmodel/ --out art/frozen
    bertopt freeze uncased_L-12_H-768_A-12/ --out art/frozen --pooling mean
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import Param

NAME = "freeze"
HELP = "Fold a TensorFlow model's variables into constants: SavedModel/.keras/Google checkpoint -> GraphDef."
PARAMS = [
    Param("signature", str, "serving_default", "SavedModel signature to freeze."),
    Param("max_seq_len", int, None, "Default max tokens per text recorded for the runtime.", min=1),
    Param("check_tolerance", float, 1e-6, "Max abs difference allowed between frozen graph and the source model.",
          min=0),
    Param("pooling", str, "mean", "Google checkpoint only: sentence pooling added after the encoder "
          "(bert-as-service's default is mean).", choices=("mean", "cls", "max", "none")),
]


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.artifact import Artifact
    from bertopt.errors import require
    from bertopt.stages.common import format_handler

    if isinstance(input, Artifact):
        if input.model_format != "tf-savedmodel":
            raise UserError(f"freeze takes a TensorFlow model; {input.path} is already {input.model_format}")
    elif input.kind not in ("tf-savedmodel", "keras", "tf-checkpoint"):
        raise UserError(f"freeze takes a TensorFlow SavedModel, .keras file or Google BERT checkpoint; "
                        f"{input.path} is a {input.kind} model (use 'bertopt export' for it)")
    require("tensorflow", "tf", "the freeze stage")
    kind = input.model_format if isinstance(input, Artifact) else input.kind
    return format_handler(NAME, kind)(input, config, out_dir, overwrite)
