"""bertopt: turn a BERT-family encoder into a validated serving artifact, and serve it.

Python API (each reaches the same registry and runtime as the CLI)::

    import bertopt
    art = bertopt.run_stage("export", "builtin:minilm", {}, "artifacts/minilm-onnx")
    art = bertopt.run_stage("quantize", art, {"mode": "int8-dynamic"}, "artifacts/minilm-int8")
    emb = bertopt.Predictor(art).encode(["hello world"])
"""

from bertopt.version import __version__

__all__ = ["__version__", "Artifact", "Predictor", "run_stage", "run_recipe", "resolve_source"]


def __getattr__(name):  # lazy: `import bertopt` stays cheap
    if name == "Artifact":
        from bertopt.artifact import Artifact

        return Artifact
    if name == "Predictor":
        from bertopt.runtime import Predictor

        return Predictor
    if name == "run_stage":
        from bertopt.registry import run_stage

        return run_stage
    if name == "run_recipe":
        from bertopt.recipes import run_recipe

        return run_recipe
    if name == "resolve_source":
        from bertopt.sources import resolve_source

        return resolve_source
    raise AttributeError(name)
