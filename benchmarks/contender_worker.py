"""One contender of benchmarks/compare.py, alone in its process: loads its model, then answers the driver's
commands one line at a time, so the driver can interleave rounds over contenders that live in different
virtualenvs (sentence-transformers' OpenVINO contenders need optimum-intel, whose transformers pin conflicts with
bertopt's). Nothing of bertopt is imported at module level: the peer venv has no bertopt.

    python contender_worker.py SPEC_JSON      (SPEC_JSON: a file; see compare.py's ``contender_specs``)

Commands on stdin (JSON, one per line): ``{"cmd": "warmup"}``, ``{"cmd": "time", "workload": "mixed"|"padded"}``
(seconds of one pass), ``{"cmd": "dump", "path": ...}`` (the last outputs of both workloads as .npz),
``{"cmd": "quit"}``. Each answer is one stdout line starting with ``@@bench `` (libraries may print too).

Kinds: ``st`` (SentenceTransformer, PyTorch fp32 or ``bf16`` autocast), ``st-openvino`` (``backend="openvino"``
as a user calls it), ``st-int8-static`` (the static int8 OpenVINO model of ``export_static_quantized_openvino_model``,
built once into ``build_dir`` from calibration text given offline), ``artifact`` (a bertopt artifact through the
Predictor, in the project venv).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

MARK = "@@bench "


def reply(**payload) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


class SentenceTransformerRunner:
    """sentence-transformers' ``encode`` (it sorts a call's texts by length and batches them itself)."""

    def __init__(self, spec: dict, texts: dict):
        import torch

        torch.set_num_threads(int(spec["threads"]))
        self.torch = torch
        self.bf16 = bool(spec.get("bf16"))
        self.batch_size = int(spec["batch_size"])
        self.seq_len = int(spec["seq_len"])
        self.model = self.load(spec, texts)
        self.max_seq_len = self.model.max_seq_length
        self.describe = {"backend": spec["kind"], "precision": "bf16 autocast" if self.bf16 else spec.get(
            "precision", "fp32"), "max_seq_len": self.max_seq_len, **self.versions()}

    def load(self, spec: dict, texts: dict):
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(spec["model"], device="cpu")

    @staticmethod
    def versions() -> dict:
        import importlib.metadata as md

        out = {}
        for name in ("sentence-transformers", "transformers", "torch", "optimum-intel", "openvino", "nncf"):
            try:
                out[name] = md.version(name)
            except md.PackageNotFoundError:
                pass
        return {"versions": out}

    def encode(self, texts, max_seq_len):
        self.model.max_seq_length = max_seq_len
        ctx = self.torch.autocast("cpu", dtype=self.torch.bfloat16) if self.bf16 else self.torch.inference_mode()
        with ctx, self.torch.inference_mode():
            out = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True)
        return out.astype("float32")

    def mixed(self, texts):
        return self.encode(texts, self.max_seq_len)

    def padded(self, texts):  # every text is longer than seq_len tokens: each batch is exactly batch x seq_len
        return self.encode(texts, self.seq_len)


# oneDNN ISA caps that leave no native bf16 (an older CPU's kernels, emulated on a newer one); written out here,
# not read from bertopt.machine, since this worker also runs in the peer venv, which has no bertopt
_NO_BF16_CAPS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def ov_threads_config(threads: int) -> dict:
    """A user's call passes no config; only where the benchmark gives a contender fewer threads than the machine
    has is the number set (the same number every contender gets). Under an ISA cap below AVX-512 BF16, OpenVINO
    still reads the CPU's own bf16 flag, defaults to bf16 and finds no bf16 kernel ("Supported primitive
    descriptors list is empty for node ... Softmax"); the CPU the cap emulates defaults to f32, so that is set."""
    config = {} if threads >= (os.cpu_count() or 1) else {"INFERENCE_NUM_THREADS": threads}
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap in _NO_BF16_CAPS:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


class OpenVinoRunner(SentenceTransformerRunner):
    def load(self, spec: dict, texts: dict):
        from sentence_transformers import SentenceTransformer

        kwargs = {"ov_config": ov_threads_config(int(spec["threads"]))}
        return SentenceTransformer(spec["model"], device="cpu", backend="openvino", model_kwargs=kwargs)


class StaticInt8Runner(SentenceTransformerRunner):
    FILE = "openvino_model_qint8_quantized.xml"

    def load(self, spec: dict, texts: dict):
        from sentence_transformers import SentenceTransformer

        folder = Path(spec["build_dir"])
        if not (folder / "openvino" / self.FILE).exists():
            build_static_int8(spec["model"], folder, texts["calibration"])
        kwargs = {"file_name": f"openvino/{self.FILE}", "ov_config": ov_threads_config(int(spec["threads"]))}
        return SentenceTransformer(str(folder), device="cpu", backend="openvino", model_kwargs=kwargs)


def build_static_int8(model: str, folder: Path, calibration: list[str]) -> None:
    """``sentence_transformers.backend.export_static_quantized_openvino_model`` step by step, with the calibration
    set given here instead of glue/sst2 from the hub (not reachable offline): OVQuantizationConfig() defaults
    (num_samples None: the whole set, of which NNCF calibrates on 300), the text shuffled with the dataset
    builder's seed, tokenised padded to max_length 384."""
    from datasets import Dataset
    from optimum.intel.openvino import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.backend.utils import save_or_push_to_hub_model

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp, ignore=shutil.ignore_patterns("onnx", "openvino"))
    st = SentenceTransformer(str(tmp), device="cpu", backend="openvino",
                             model_kwargs={"ov_config": ov_threads_config(os.cpu_count() or 1)})
    quantization_config = OVQuantizationConfig()
    ov_config = OVConfig(quantization_config=quantization_config)
    quantization_config = ov_config.quantization_config
    quantizer = OVQuantizer.from_pretrained(st.transformers_model)
    seed = getattr(getattr(quantizer, "dataset_builder", None), "seed", 42)
    dataset = Dataset.from_dict({"sentence": list(calibration)}).shuffle(seed=seed)
    if quantization_config.num_samples:  # None (the default): every text, NNCF samples its own subset (300)
        dataset = dataset.take(min(quantization_config.num_samples, len(dataset)))
    dataset = dataset.map(lambda ex: st.tokenizer(ex["sentence"], padding="max_length", max_length=384,
                                                  truncation=True), batched=True)
    save_or_push_to_hub_model(
        export_function=lambda save_dir: quantizer.quantize(dataset, save_directory=save_dir, ov_config=ov_config),
        export_function_name="export_static_quantized_openvino_model", config=quantization_config,
        model_name_or_path=str(tmp), file_suffix="qint8_quantized", backend="openvino", model=st)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


class ArtifactRunner:
    """A bertopt artifact through the Predictor (the runtime that validates and serves it)."""

    def __init__(self, spec: dict, texts: dict):
        from bertopt.artifact import Artifact
        from bertopt.bench import Contender
        from bertopt.runtime import Predictor

        art = Artifact.load(spec["artifact"])
        pred = Predictor(art, provider="cpu", threads=int(spec["threads"]), batch_size=int(spec["batch_size"]))
        self.contender = Contender(spec["name"], pred)
        self.seq_len = int(spec["seq_len"])
        self.describe = {"artifact": str(art.path), "precision": art.precision, **pred.describe()}

    def mixed(self, texts):
        p = self.contender.predictor
        return p.run(texts, outputs=[p.primary_output])[p.primary_output]

    def padded(self, texts):
        v = self.contender.at_length(self.seq_len)
        return v.run(texts, outputs=[v.primary_output], pad_to=self.seq_len)[v.primary_output]


RUNNERS = {"st": SentenceTransformerRunner, "st-openvino": OpenVinoRunner, "st-int8-static": StaticInt8Runner,
           "artifact": ArtifactRunner}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    texts = json.loads(Path(spec["texts_file"]).read_text())
    try:
        runner = RUNNERS[spec["kind"]](spec, texts)
    except Exception as exc:  # the driver reports the contender as skipped with this reason
        reply(ok=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        return 1
    reply(ok=True, describe=runner.describe)
    last = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "warmup":
            # two batches: one per stream of a stream-per-core artifact, whole (a call of one batch is split between
            # the streams), so every shape the timed passes run is compiled before them
            runner.padded(texts["padded"][: 2 * int(spec["batch_size"])])
            runner.mixed(texts["mixed"][: 2 * int(spec["batch_size"])])
            reply(ok=True)
        elif cmd["cmd"] == "time":
            workload = cmd["workload"]
            t0 = time.perf_counter()
            last[workload] = getattr(runner, workload)(texts[workload])
            reply(ok=True, seconds=time.perf_counter() - t0)
        elif cmd["cmd"] == "dump":
            import numpy as np

            np.savez(cmd["path"], **last)
            reply(ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
