"""The reference a validated artifact is compared with: by default the original model recorded in the
artifact's lineage, run in its own framework (PyTorch for Hugging Face folders, TensorFlow for TF sources,
ONNX Runtime for ONNX files); or any model/artifact the user names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from bertopt.errors import UserError
from bertopt.extensions import load_extensions
from bertopt.plugins import Registry

# source kind -> builder of its reference Predictor, for kinds another part runs (bertopt.tf registers the
# TensorFlow ones), so validate/ never imports that part
_REFERENCES: Registry[Callable] = Registry("reference", load=load_extensions)


def register_reference(*kinds: str):
    return _REFERENCES.register(*kinds)


def reference_predictor(artifact, reference: str | os.PathLike | None = None, *, threads: int | None = None,
                        batch_size: int = 32, max_seq_len: int | None = None, length_bucketing: bool = True,
                        bf16: bool = False):
    from bertopt.artifact import Artifact, is_artifact
    from bertopt.runtime import Predictor
    from bertopt.sources import Source, resolve_source

    max_seq_len = max_seq_len or artifact.model_info.get("max_seq_len")
    if reference is not None and is_artifact(Path(reference)):
        return Predictor(Artifact.load(reference), threads=threads, batch_size=batch_size, max_seq_len=max_seq_len,
                         length_bucketing=length_bucketing)
    if reference is not None:
        source = resolve_source(str(reference))
    else:
        recorded = artifact.source
        if not recorded:
            raise UserError(f"{artifact.path} records no source model; name one with --reference")
        source = Source.from_manifest(recorded, str(artifact.path))
        if not source.path.exists():
            raise UserError(f"the source model recorded in {artifact.path} ({source.path}) is gone; "
                            "name a reference with --reference")
    pooling = _artifact_pooling(artifact)
    if source.kind == "hf":
        from bertopt.sources.hf import hf_reference

        return hf_reference(source.path, threads=threads, bf16=bf16, max_seq_len=max_seq_len, batch_size=batch_size,
                            pooling=pooling, length_bucketing=length_bucketing)
    builder = _REFERENCES.find(source.kind)
    if builder is not None:
        return builder(source, artifact, threads=threads, max_seq_len=max_seq_len,
                                        batch_size=batch_size, length_bucketing=length_bucketing)
    if source.kind == "onnx":
        from bertopt.model_handle import ModelHandle
        from bertopt.runtime import Predictor

        model_path, model_bytes = source.path, None
        appended = artifact.model_info.get("sentence_pipeline")
        if appended:  # the import appended the folder's sentence-transformers pipeline: the reference gets it too
            scratch, model_bytes = _onnx_with_pipeline(source.path, artifact.model_info, appended)
            model_path = scratch or source.path
        handle = ModelHandle(model_format="onnx", inputs=tuple(artifact.inputs), outputs=tuple(artifact.outputs),
                             tokenizer_path=artifact.tokenizer_path, model_info=artifact.model_info, path=source.path,
                             digest=f"onnx:{source.path}", model_path=model_path, model_bytes=model_bytes,
                             runtime="onnxruntime")
        return Predictor(handle, provider="cpu", threads=threads, batch_size=batch_size, max_seq_len=max_seq_len,
                         length_bucketing=length_bucketing)
    raise UserError(f"cannot run a {source.kind} reference")


def _onnx_with_pipeline(path: Path, info: dict, appended: dict):
    """The source ONNX with the same sentence-transformers pipeline the import appended: (None, its bytes), or
    (a scratch file, None) when it is too large for one protobuf."""
    import onnx

    from bertopt.output_paths import process_scratch
    from bertopt.sources.onnx_pipeline import append_pipeline

    if appended.get("folder") and not Path(appended["folder"]).exists():
        raise UserError(f"the sentence-transformers folder recorded in the artifact ({appended['folder']}) is gone; "
                        "name a reference with --reference")
    merged = append_pipeline(onnx.load(str(path)), info)
    if merged.ByteSize() < 1_800_000_000:
        return None, merged.SerializeToString()
    scratch = process_scratch("ref") / "model.onnx"
    onnx.save(merged, str(scratch), save_as_external_data=True, location="model.onnx_data")
    return scratch, None


def _artifact_pooling(artifact) -> str:
    for o in artifact.outputs:
        if o.get("kind") == "embedding" and o.get("pooling"):
            return o["pooling"]
    if any(o.get("kind") == "embedding" for o in artifact.outputs):
        return "auto"
    return "none"
