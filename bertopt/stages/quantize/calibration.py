"""Calibration text and what is measured on it once for the quantisers: the outlier transforms' activation
maxima and GPTQ's input correlations. Feeds are one sentence each (no padding), so [PAD] positions never enter
a statistic."""

from __future__ import annotations

from bertopt.errors import UserError

# what makes a quantize method read the calibration text (--calibration-data, --calibration-size): static int8
# always; otherwise the accuracy search, and what ``calibration_statistics`` measures it for (GPTQ's input
# correlations, the outlier transforms of smoothing.py and their fp32 check). The stage refuses the calibration
# options given where none of these holds (methods.ReadWith)
CALIBRATION_READERS = (("mode", "int8-static"), ("accuracy_target", None), ("weight_rounding", "gptq"),
                       ("smooth_alpha", None), ("first_token_fp32", None), ("per_token", None))


def load_calibration_texts(config) -> list[str]:
    from bertopt.data import calibration_texts

    if config["calibration_data"]:
        from bertopt.measure.data import load_texts

        texts = load_texts(config["calibration_data"], text_flag=None).texts
    else:
        texts = calibration_texts()
    texts = [t for t in texts if t.strip()][: config["calibration_size"]]
    if not texts:
        raise UserError("calibration data is empty; give a text file with one sentence a line")
    return texts


def sentence_feeds(art, texts: list[str], threads: int | None = None) -> list[dict]:
    """Model feeds of ``texts``, one sentence each: what smoothing maxima and GPTQ's input correlations are
    measured on."""
    from bertopt.runtime import Predictor

    predictor = Predictor(art, provider="cpu", threads=threads, verify=False)
    return [predictor.feeds_for(predictor.tokenize([t]))[0] for t in texts]


def calibration_statistics(art, model, config):
    """What the outlier transforms and GPTQ need from the calibration text, measured once: returns
    (model after the configured outlier transforms, fp32 nodes they added, their report section or None,
    GPTQ's ``X^T X`` per weight of the transformed model or None for round-to-nearest)."""
    from bertopt.stages.quantize.smoothing import outlier_transforms_wanted, prepare_for_int8

    transforms = outlier_transforms_wanted(config)
    gptq = config.get("weight_rounding", "nearest") == "gptq"
    if not (transforms or gptq):
        return model, [], None, None
    threads = config.get("threads")
    feeds = sentence_feeds(art, load_calibration_texts(config), threads)
    fp32_added, outliers = [], None
    if transforms:
        model, fp32_added, outliers = prepare_for_int8(model, config, feeds)
    hessians = None
    if gptq:
        from bertopt.stages.quantize.gptq import input_hessians

        hessians = input_hessians(model, feeds, threads=threads)
    return model, fp32_added, outliers, hessians
