"""The TensorFlow reference: the source model of a TF-path artifact (SavedModel, .keras, Google checkpoint)
run in TensorFlow through the same Predictor as the artifact, so validation compares like with like."""

from __future__ import annotations

from bertopt.errors import UserError, require


def tf_reference(source, artifact, *, threads=None, max_seq_len=None, batch_size=32, length_bucketing=True):
    require("tensorflow", "tf", "running the TensorFlow reference model")
    from bertopt.model_handle import ModelHandle
    from bertopt.runtime import Predictor
    from bertopt.tf.sources import open_tf_model

    pooling = next((o.get("pooling") for o in artifact.outputs if o.get("kind") == "embedding" and o.get("pooling")),
                   None)
    # the signature freeze used (recorded in the lineage), so the reference is the function that was frozen
    frozen_with = [h.get("params") or {} for h in artifact.history() if h.get("stage") == "freeze"]
    signature = (frozen_with[0].get("signature") if frozen_with else None) or "serving_default"
    model = open_tf_model(source, signature=signature,
                          pooling=pooling or ("mean" if source.kind == "tf-checkpoint" else None))
    have = {o["name"] for o in model.outputs}
    outputs = [o for o in artifact.outputs if o["name"] in have]
    if not outputs:
        raise UserError(f"the TensorFlow source {source.path} has none of the outputs of {artifact.path} "
                        f"({', '.join(o['name'] for o in artifact.outputs)}); name a reference with --reference")
    info = {**model.model_info, **{k: v for k, v in artifact.model_info.items() if k in ("max_seq_len",
                                                                                          "primary_output")}}
    handle = ModelHandle(model_format="tensorflow", inputs=tuple(model.inputs), outputs=tuple(outputs),
                         tokenizer_path=artifact.tokenizer_path, model_info=info, path=source.path,
                         digest=f"tensorflow:{source.path}", module=model.function, keep_alive=model.keep_alive)
    return Predictor(handle, threads=threads, max_seq_len=max_seq_len, batch_size=batch_size,
                     length_bucketing=length_bucketing)
