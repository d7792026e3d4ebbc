"""optimize: ONNX Runtime's transformer fusions (Attention, LayerNorm, GELU, EmbedLayerNorm).

The fusion model type comes from the artifact's family declaration (``bertopt.families``): BERT, DistilBERT,
RoBERTa / XLM-R and ELECTRA get every fusion; MPNet (relative attention bias), DeBERTa-v2 (disentangled
attention) and ModernBERT (rotary attention, GeGLU) get ONNX Runtime's LayerNorm and GELU fusions only, which the
report says. A family with ``attention_fusion`` then gets bertopt's own attention fusion
(``bertopt.onnx_graph.fusions``): MPNet's attention becomes one MultiHeadAttention per layer (the relative position
bias and the padding mask summed once into its attention_bias); DeBERTa-v2's disentangled attention gets its c2p +
p2c terms by block Gathers through one index per model instead of GatherElements through per-layer (B, N, S, S)
copies; ModernBERT's rotary attention becomes two RotaryEmbedding (q, k) + one MultiHeadAttention per layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bertopt.errors import UserError
from bertopt.params import Param

NAME = "optimize"
HELP = "Fuse attention, layer norm, GELU and embeddings with ONNX Runtime's BERT optimizer; report fused ops."
PARAMS = [
    Param("opt_level", int, 1, "ONNX Runtime graph optimisation level applied after fusion (0, 1, 2 or 99); "
          "1 keeps the model portable across execution providers.", check=lambda v: None if v in (0, 1, 2, 99)
          else "must be 0, 1, 2 or 99"),
    Param("check_tolerance", float, 1e-4, "Max abs difference allowed against the input artifact.", min=0),
]


def transformer_fusions(model, family, heads: int, hidden: int, opt_level: int):
    """ONNX Runtime's BERT optimizer on ``model`` (a path or a ModelProto) with ``family``'s fusion model type, then
    the family's own attention fusion where it declares one -> (fused ModelProto, {fused op: count})."""
    from bertopt.errors import ModelRunError, is_runtime_error, require_onnxruntime

    optimize_model = require_onnxruntime("the optimize stage", "onnxruntime.transformers.optimizer").optimize_model
    try:
        optimized = optimize_model(model, model_type=family.fusion_model_type, num_heads=heads, hidden_size=hidden,
                                   opt_level=opt_level, use_gpu=False, only_onnxruntime=False)
    except Exception as exc:  # ONNX Runtime opens the graph to optimise it: an operator it lacks, a 40 GB tensor
        if is_runtime_error(exc):
            raise ModelRunError.of(str(model) if not hasattr(model, "graph") else "the model", "ONNX Runtime's "
                                   "optimizer", exc) from None
        raise
    fused = {k: int(v) for k, v in optimized.get_fused_operator_statistics().items() if v}
    if family.attention_fusion:
        from bertopt.onnx_graph.fusions import apply_fusion

        fused.update(apply_fusion(family.attention_fusion, optimized.model, heads, hidden))
    return optimized.model, fused


def run(input, config: dict[str, Any], out_dir: Path, overwrite: bool = False):
    from bertopt.artifact import ArtifactWriter
    from bertopt.data import corpus
    from bertopt.onnx_graph.util import graph_stats, load_onnx, match_external_data, save_onnx
    from bertopt.stages.common import check_against, require_onnx_artifact, worst_abs_diff

    art = require_onnx_artifact(input, NAME)
    if art.model_format != "onnx":
        raise UserError(f"optimize works on ONNX artifacts; export {art.path} to ONNX first (bertopt export)")
    from bertopt.families import family_by_name

    info = art.model_info
    family = family_by_name(info.get("family"))
    if family.fusion_model_type is None:
        raise UserError(f"ONNX Runtime has no transformer fusions for {family.name} models; serve the exported "
                        "artifact as is (or compile it for OpenVINO)")
    heads, hidden = info.get("num_attention_heads"), info.get("hidden_size")
    if not heads or not hidden:
        raise UserError(f"{art.path}: the manifest does not record num_attention_heads/hidden_size, which "
                        "attention fusion needs; re-export from the Hugging Face folder")
    before = graph_stats(load_onnx(art.model_path))
    model, fused = transformer_fusions(str(art.model_path), family, int(heads), int(hidden), config["opt_level"])
    with ArtifactWriter(out_dir, stage=NAME, params=config, parent=art, overwrite=overwrite) as w:
        w.copy_tokenizer(art)
        save_onnx(model, w.dir / "model.onnx")
        match_external_data(w.dir / "model.onnx", art.model_path)  # keep the parent's layout
        w.set_model("model.onnx", "onnx", art.inputs, art.outputs, precision=art.precision)
        w.report.update({"fused_ops": fused, "before": before, "after": graph_stats(model),
                         "fusion_model_type": family.fusion_model_type, "family": family.name})
        if family.attention_fusion:
            w.report["attention_fusion"] = family.attention_fusion
        if family.fusion_notes:
            w.report["fusion_notes"] = family.fusion_notes
        stats = check_against(w, art, corpus()[:48])
        w.report["max_abs_diff_vs_parent"] = worst_abs_diff(stats)
        if worst_abs_diff(stats) > config["check_tolerance"]:
            raise UserError(f"optimized model differs from its input by {worst_abs_diff(stats):.3g} "
                            f"(> {config['check_tolerance']:g}); try --opt-level 0")
    return w.artifact
