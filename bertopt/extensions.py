"""Parts that plug into a lower layer by registering themselves: the TensorFlow path registers its stage handlers
and its reference model with ``stages/`` and ``validate/``; Spark registers the gate's ``--spark`` check.

A lower layer calls :func:`load_extensions` before it looks a registration up, so it never imports the part
that plugs in. The modules named here import nothing heavy: TensorFlow and pyspark load when a handler runs.
"""

from __future__ import annotations

from bertopt.plugins import import_all

EXTENSION_MODULES = ("bertopt.tf.extension", "bertopt.spark.extension")


def load_extensions() -> None:
    import_all(EXTENSION_MODULES)
