"""``bertopt tune``: the fastest artifact that passes the gate, on the machine it runs on.

It reads the machine (CPU vector features, GPU providers ONNX Runtime really has) and builds only the candidates
that make sense there, from one shared prefix (export, prune) and, for ONNX Runtime, one shared ``optimize``:

* ``openvino-f32`` (every CPU), ``openvino-bf16`` (AVX-512 BF16 or AMX: where bf16 is native),
* ``openvino-int8-static`` and ``openvino-int8-accurate`` (VNNI / AMX int8 dot product),
* ``onnxruntime-fp32`` (fused) and ``onnxruntime-int8`` (dynamic, per channel),
* ``onnxruntime-fp16-cuda`` (only where ONNX Runtime has a CUDA provider).

Each candidate is held against the ORIGINAL model by the release gate (``bertopt.validate.gate``), on the built-in
corpus plus ``mixed_text`` (plus the user's texts): once in batches of 32 with the batch-invariance check and,
if that passed, once with every text alone (batch 1). The default targets (embeddings): cosine min >= 0.995 both
ways and ``batch_dev <= 1e-3``; task models: the gate's defaults for their output plus the task's own metric (see
``default_tune_targets``). A candidate a stage refuses (``UserError``) is one line, "refused: <reason>", and tune
goes on. The candidates that pass are timed side by side, rounds interleaved, on the user's texts (``--data``) or
the built-in mixed text; the fastest is written to ``--out`` atomically (temp folder + rename), its manifest
recording the machine, every candidate's figures and why it won, and a report goes beside it (tune.json,
tune.md, tune.html with a speed-vs-fidelity plot).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from bertopt.errors import GateFailed, UserError
from bertopt.measure.targets import targets_problem
from bertopt.params import BATCH_DEV_BOUND, BATCH_SIZE, THREADS, Param, path_given, typer_command
from bertopt.stages.prune import PARAMS as PRUNE_PARAMS
from bertopt.tasks import TASKS

SAY = Callable[[str], None]


def parse_duration(value: str) -> float:
    """'10m', '90s', '1h', '1h30m' or a plain number of seconds -> seconds."""
    text = str(value).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*(h|m|s)", text)
        if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*(h|m|s)", "", text).strip():
            raise UserError(f"time budget {value!r} is not a duration; write it like 10m, 90s or 1h30m")
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if seconds <= 0:
        raise UserError(f"time budget {value!r} must be more than 0 seconds; write it like 10m or 90s")
    return seconds


def format_duration(seconds: float) -> str:
    """A duration as --time-budget takes it, rounded up: whole seconds under a minute, else half minutes
    ('45s', '4m', '3m30s', '1h2m30s')."""
    if math.ceil(seconds) < 60:
        return f"{max(1, math.ceil(seconds))}s"
    halves = math.ceil(seconds / 30)
    hours, rest = divmod(halves * 30, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")


def _duration_ok(value: str) -> str | None:
    try:
        parse_duration(value)
    except UserError as exc:
        return str(exc).replace(f"time budget {value!r} ", "")
    return None




CANDIDATE_NAMES = ("openvino-f32", "openvino-f32-throughput", "openvino-bf16", "openvino-bf16-throughput",
                   "onnxruntime-fp32", "onnxruntime-int8", "onnxruntime-fp16-cuda", "openvino-int8-dynamic",
                   "openvino-int8-static", "openvino-int8-accurate")


def tune_targets_problem(value: str) -> str | None:
    """``targets_problem``, and no speed metric: tune's gate is fidelity, its speed figures are its own timing (the
    fastest candidate that passes wins), so a latency target could only fail every candidate at the end."""
    problem = targets_problem(value)
    if problem:
        return problem
    from bertopt.measure.targets import LATENCY_METRICS, parse_targets

    timed = [t.metric for t in parse_targets(value) if t.parts[1] in LATENCY_METRICS]
    if timed:
        return (f"names a speed target, '{timed[0]}'; tune's --targets are fidelity thresholds (tune times every "
                "candidate itself and keeps the fastest that passes): drop it, or gate speed afterwards with "
                "'bertopt validate ARTIFACT --targets ...'")
    return None


TUNE_PARAMS = [
    Param("task", str, None, "What the model computes (default: detected from the folder), as for 'bertopt export "
          "--task'.", choices=TASKS),
    Param("data", str, None, "Your texts (.txt one a line / .jsonl / .csv / .parquet): the candidates are timed on "
          "their lengths and gated on them too (default: the built-in mixed text).", file=True),
    Param("text_column", str, "text", "Text column of a JSONL/CSV/Parquet --data file."),
    Param("targets", str, None, "Gate thresholds every candidate must meet, alone and in batches, as for 'bertopt "
          "validate --targets' (default for embeddings: cos_min>=0.995,batch_dev<=1e-3; task models: their task "
          "metric, see docs/tune.md).", check=tune_targets_problem),
    Param("time_budget", str, "10m", "Bound on the whole run (10m, 90s, 1h): when it is spent the remaining "
          "candidates are skipped, once at least one has passed.", check=_duration_ok),
    Param("candidates", list, None, "Only these candidates, comma-separated (default: every one that makes sense "
          "on this machine). Names: " + ", ".join(CANDIDATE_NAMES) + ".",
          check=lambda v: None if v is None else
          f"is empty; name one or more of {', '.join(CANDIDATE_NAMES)}, or leave it out for every one" if not v else
          next((f"names unknown candidate '{c}'; known: {', '.join(CANDIDATE_NAMES)}" for c in v
                if c not in CANDIDATE_NAMES), None)),
    Param("rounds", int, 5, "Timing rounds (interleaved: A B C A B C ...); the median round counts.", min=1),
    Param("max_texts", int, None, "Use at most this many texts of each set (built-in corpus, mixed text, --data) "
          "for the gate and the timing (default: all).", min=8),
    # prune's own option, applied to the shared prefix: an artifact that keeps only sentence_embedding is gated
    # (and bounded in batch deviation) on that output alone
    next(p for p in PRUNE_PARAMS if p.name == "outputs"),
    THREADS,
    BATCH_SIZE,
]

# accuracy target the int8 quantisers aim at on their calibration text: a margin over the gate's 0.995 on texts
# they never see (recipes/minilm-int8-accurate.yaml)
INT8_ACCURACY_TARGET = "cos_min=0.997"
GATE_BATCH_DEV = BATCH_DEV_BOUND
GATE_COS_MIN = 0.995


def default_tune_targets(task: str, kind: str) -> str:
    """What a candidate must meet when --targets is not given: the gate's defaults for the output's kind, the
    task's own fidelity metric, and batch invariance at 1e-3 (1 - cosine of a text alone vs in batches)."""
    from bertopt.validate.gate import default_targets

    if task == "embedding":
        return f"cos_min>={GATE_COS_MIN},batch_dev<={GATE_BATCH_DEV:g}"
    extra = {"classification": "", "token-classification": "token_label_agreement>=0.99",
             "rerank": "spearman>=0.99", "sparse-embedding": "term_overlap_at_10>=0.9"}.get(task, "")
    return ",".join(t for t in (default_targets(kind), extra, f"batch_dev<={GATE_BATCH_DEV:g}") if t)


@dataclass
class Candidate:
    name: str
    steps: list[tuple[str, dict[str, Any]]]  # after the shared prefix (export, prune)
    runtime: str
    precision: str
    provider: str = "cpu"
    why: str = ""  # why it is built on this machine


@dataclass
class Outcome:
    name: str
    status: str  # passed, failed, refused, skipped, not built
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    artifact: Any = None
    candidate: Candidate | None = None
    build_s: float = 0.0
    gate_s: float = 0.0

    def record(self) -> dict[str, Any]:
        out = {"name": self.name, "status": self.status, "reason": self.reason, **self.figures,
               "build_s": round(self.build_s, 2), "gate_s": round(self.gate_s, 2)}
        if self.candidate is not None:
            out.update(runtime=self.candidate.runtime, precision=self.candidate.precision,
                       provider=self.candidate.provider,
                       steps=[{name: cfg} for name, cfg in self.candidate.steps])
        if self.artifact is not None:
            # how the runtime runs what was built: a stage may have decided part of it by measuring (an OpenVINO
            # artifact's full batches on a copy compiled for their shape), which is part of its speed
            out["runtime_options"] = dict(self.artifact.manifest.get("runtime_options") or {})
            decided = (self.artifact.manifest.get("lineage", {}).get("report") or {}).get("static_full_batch")
            if decided:
                out["static_full_batch"] = decided
        return out


def gpu_providers() -> list[str]:
    """The GPU execution providers the installed ONNX Runtime really has (CUDA, TensorRT)."""
    from bertopt.errors import MissingDependency, require_onnxruntime

    try:
        ort = require_onnxruntime()
    except MissingDependency:  # no runtime at all: no GPU provider either
        return []
    return [p for p in ort.get_available_providers() if p in ("CUDAExecutionProvider", "TensorrtExecutionProvider")]


def plan_candidates(features: set[str] | None = None, gpus: list[str] | None = None, only: list[str] | None = None,
                    calibration_data: str | None = None, threads: int | None = None
                    ) -> tuple[list[Candidate], list[Outcome]]:
    """The candidates worth building on this machine (cheapest first, so a passing one exists early when the
    budget is short; ONNX Runtime's CPU ones after OpenVINO's int8 where those are built), and those left out with
    why; ``threads``: what the artifact will run with (default: the cores this process may use)."""
    from bertopt.machine import cpu_features, has_int8_dot_product, has_native_bf16
    from bertopt.runtime.backends import default_threads

    threads = threads or default_threads()
    features = cpu_features() if features is None else set(features)
    gpus = gpu_providers() if gpus is None else gpus
    int8_dot = has_int8_dot_product(features)
    bf16 = has_native_bf16(features)
    named = ", ".join(sorted(features)) or "no AVX-512/VNNI/AMX features read"
    ov = {"runtime": "openvino", "performance_hint": "LATENCY"}
    # NNCF static int8 (stages/quantize/nncf_int8.py): calibrated on every built-in calibration text not held back to
    # measure it; it refuses (one line) when the target cannot be met within its bounded search
    static = {"mode": "int8-static", "runtime": "openvino", "accuracy_target": INT8_ACCURACY_TARGET,
              "calibration_size": 192}
    if calibration_data:
        static["calibration_data"] = calibration_data
    dynamic = {"mode": "int8-dynamic", "runtime": "openvino", "op_types": ["MatMul"], "keep_ffn_output": True,
               "inference_precision": "f32"}
    accurate = {"mode": "int8-dynamic", "runtime": "openvino", "op_types": ["MatMul", "Gather"],
                "weight_rounding": "gptq", "accuracy_target": INT8_ACCURACY_TARGET, "accuracy_group": 1}
    ov_f32 = {**ov, "inference_precision": "f32"}
    ov_bf16 = {**ov, "inference_precision": "bf16", "min_cosine": 0.99}
    streams = {"performance_hint": "THROUGHPUT"}
    one_thread = "one thread: one stream, nothing runs side by side" if threads < 2 else None
    table = [
        (Candidate("openvino-f32", [("compile", ov_f32)], "openvino", "f32",
                   why="every CPU"), None),
        # the gate decides fidelity; compile's own drift check would refuse at 0.999 what the gate accepts
        (Candidate("openvino-bf16", [("compile", ov_bf16)],
                   "openvino", "bf16", why="bf16 is native (AVX-512 BF16 / AMX)"),
         None if bf16 else "bf16 is not native on this CPU (no AVX-512 BF16 / AMX): OpenVINO would run it as f32"),
        # the same model as the one above it, compiled with a stream per thread: the Predictor keeps a batch in
        # flight on each (a call of one batch is split between them), measured 1.08x / 1.27x texts/s on padded /
        # mixed-length batches (AMX Xeon, 2 threads) with the same outputs, for a single text ~1.4x slower
        # (one thread each); only the bf16 twin where bf16 is native, else the f32 one
        (Candidate("openvino-f32-throughput", [("compile", {**ov_f32, **streams})], "openvino", "f32",
                   why=f"{threads} threads: a batch in flight per stream"),
         one_thread or ("bf16 is native here: its bf16 twin is built instead" if bf16 else None)),
        (Candidate("openvino-bf16-throughput", [("compile", {**ov_bf16, **streams})], "openvino", "bf16",
                   why=f"{threads} threads: a batch in flight per stream"),
         "bf16 is not native on this CPU (no AVX-512 BF16 / AMX)" if not bf16 else one_thread),
        (Candidate("onnxruntime-fp32", [("optimize", {})], "onnxruntime", "fp32", why="every CPU"), None),
        # built on every CPU: its int8 kernels are the fastest ONNX Runtime has with or without VNNI, and whether
        # it is faithful (it saturates without VNNI; its activation scale is the whole batch's) is the gate's call
        (Candidate("onnxruntime-int8", [("optimize", {}), ("quantize", {"mode": "int8-dynamic", "per_channel": True})],
                   "onnxruntime", "int8-dynamic",
                   why="every CPU" + ("" if int8_dot else " (no VNNI: its u8s8 kernels can saturate)")), None),
        # compiled for CUDA: the manifest records the provider it was gated and timed on, so serve's `auto` runs it
        # there (an fp16 model on a CPU would be neither fast nor what was validated)
        (Candidate("onnxruntime-fp16-cuda", [("optimize", {}), ("quantize", {"mode": "fp16"}),
                                             ("compile", {"runtime": "onnxruntime", "provider": "cuda"})],
                   "onnxruntime", "fp16", provider="cuda", why="ONNX Runtime has " + ", ".join(gpus)),
         None if "CUDAExecutionProvider" in gpus else "no CUDA provider in this ONNX Runtime (no usable GPU)"),
        # int8 weights (per channel, rounded) and int8 activations quantised per token and group of 32 as each
        # batch runs, FFN outputs and the rest f32: built in seconds (so before the static int8's minute, for a
        # short budget); where bf16 is slower than f32 (AVX-512 BF16 without AMX on an Intel core) it was the
        # fastest faithful candidate (docs/performance.md)
        (Candidate("openvino-int8-dynamic", [("quantize", dynamic)], "openvino", "int8-dynamic",
                   why="int8 dot product (VNNI / AMX)"),
         None if int8_dot else "no int8 dot product (VNNI / AMX) on this CPU"),
        # without VNNI / AMX OpenVINO runs int8 MatMuls with oneDNN's jit_gemm kernels, not brgemm: on an AVX2-only
        # CPU MiniLM's static int8 ran at 0.77x its f32 (docs/performance.md), so there is no speed to win
        (Candidate("openvino-int8-static", [("quantize", static)], "openvino", "int8-static",
                   why="int8 dot product (VNNI / AMX)"),
         None if int8_dot else "no int8 dot product (VNNI / AMX) on this CPU: OpenVINO's int8 kernels there are "
                               "slower than its f32 ones"),
        (Candidate("openvino-int8-accurate", [("quantize", accurate)], "openvino", "int8-dynamic",
                   why="int8 dot product (VNNI / AMX)"),
         None if int8_dot else "no int8 dot product (VNNI / AMX) on this CPU"),
    ]
    chosen, left_out = [], []
    for cand, missing in table:
        if only is not None and cand.name not in only:
            continue
        if missing:
            left_out.append(Outcome(cand.name, "not built", f"{missing} (CPU: {named})", candidate=cand))
        else:
            chosen.append(cand)
    rank = {c.name: i for i, c in enumerate(chosen)}
    last_openvino_int8 = rank.get("openvino-int8-static", rank.get("openvino-int8-dynamic"))
    if last_openvino_int8 is not None:
        # with an int8 dot product ONNX Runtime's CPU candidates have never been the fastest that passed (its fp32
        # well behind OpenVINO's bf16 / int8, its int8 failing the gate): after OpenVINO's int8, so a short budget
        # (make demo's, on a slow day) skips them rather than the static int8
        chosen.sort(key=lambda c: last_openvino_int8 + 0.5 if (c.runtime, c.provider) == ("onnxruntime", "cpu")
                    else rank[c.name])
    return chosen, left_out


class _MemoReference:
    """The reference Predictor, each run kept: every candidate is gated against the same outputs of the original
    model, computed once."""

    def __init__(self, predictor):
        self._predictor = predictor
        self._runs: dict[Any, Any] = {}

    def run(self, texts, pairs=None, outputs=None, **kwargs):
        key = (tuple(texts), tuple(pairs) if pairs is not None else None, tuple(outputs or ()),
               tuple(sorted(kwargs.items())))
        if key not in self._runs:
            self._runs[key] = self._predictor.run(texts, pairs, outputs=outputs, **kwargs)
        return self._runs[key]

    def __getattr__(self, name):
        return getattr(self._predictor, name)


def _target_string(targets) -> str:
    return ",".join(f"{t.metric}{t.op}{t.value:.10g}" for t in targets)


def _figures(alone: dict[str, Any] | None, batched: dict[str, Any], primary: str) -> dict[str, Any]:
    """The numbers a reader compares candidates by: fidelity alone and batched, batch deviation, task metrics
    (``alone`` None: a candidate that failed in batches is not run alone)."""
    keep = ("cos_min", "cos_mean", "max_abs", "top1_agreement", "max_prob_diff", "token_label_agreement",
            "entity_f1", "ndcg_at_10", "spearman", "term_overlap_at_10", "neighbour_agreement_at_10")
    out: dict[str, Any] = {"primary_output": primary}
    runs = [("alone", alone), ("batched", batched)] if alone is not None else [("batched", batched)]
    for label, result in runs:
        metrics = result["metrics"]
        for key in keep:
            if key in metrics:
                out[f"{key}_{label}"] = metrics[key]
    if batched.get("batch_invariance"):  # the worst over every output, as the manifest records it
        out["batch_dev"] = batched["batch_invariance"]["batch_dev"]
        out["batch_dev_primary"] = batched["metrics"]["batch_dev"]
    cos = [out[k] for k in ("cos_min_alone", "cos_min_batched") if k in out]
    if cos:
        out["cos_min"] = min(cos)
    out["failed_checks"] = [f"{c['name']} ({label}: {c['message']})"
                            for label, result in runs for c in result["checks"] if not c["passed"]]
    if alone is None:
        out["failed_checks"].append("not run alone: it failed in batches")
    return out


def gate_candidate(artifact, *, data_file: Path, targets: str, reference, report_dir: Path, threads: int | None,
                   provider: str, batch_size: int) -> tuple[bool, dict[str, Any]]:
    """The release gate twice: in batches of ``batch_size`` with the batch invariance check (recorded in the
    manifest: ``validation.gate`` and ``validation.batch_invariance``), then, only if that passed, every text alone
    (batch 1; reports only). The batched run goes first because it decides most failures (batch deviation, and a
    batch's cosine is rarely better than a text's alone): a candidate that fails it is not run alone, which spares
    a gate per failing candidate (ONNX Runtime's dynamic int8 on MiniLM, AVX2 EPYC: 26.6 s gated, now 17.8 s)."""
    from bertopt.measure.targets import BATCH_METRICS, Target, parse_targets
    from bertopt.validate.gate import validate_artifact

    parsed = parse_targets(targets)
    # a bare batch_dev bounds every output, not just the primary one: the manifest records the worst over all
    # of them, and that is the bound a served text of any output is held to
    bare = [t for t in parsed if t.metric == "batch_dev"]
    for t in bare:
        parsed += [Target(f"{o['name']}.batch_dev", t.op, t.value) for o in artifact.outputs]
    targets = _target_string(parsed)
    alone_targets = _target_string([t for t in parsed if t.parts[1] not in BATCH_METRICS])
    common = {"data": str(data_file), "latency": False, "threads": threads, "provider": provider}
    batched = validate_artifact(artifact, {**common, "targets": targets, "batch_size": batch_size,
                                           "batch_check": True},
                                report_dir / "batched", raise_on_fail=False, reference=reference)
    if not batched["passed"]:
        return False, _figures(None, batched, batched["primary_output"])
    alone = validate_artifact(artifact, {**common, "targets": alone_targets or None, "batch_size": 1,
                                         "batch_check": False},
                              report_dir / "alone", raise_on_fail=False, reference=reference, record=False)
    return alone["passed"], _figures(alone, batched, batched["primary_output"])


def time_side_by_side(outcomes: list[Outcome], texts: list[str], pairs: list[str] | None, *, rounds: int,
                      threads: int | None, batch_size: int, deadline: float, say: SAY,
                      progress: Callable[[], None] | None = None, started: float | None = None) -> int:
    """texts/s of each passing candidate on ``texts``: a warm-up pass over all of them, then rounds interleaved
    (the order rotates each round so none is always first); the median round counts. Stops after the round in
    which the deadline passes (at least one round), saying what budget would have timed every round (counted
    from ``started``, the run's start). Returns the rounds run.

    The warm-up runs every text because OpenVINO compiles kernels for each new input shape, and the length buckets
    of mixed text are mostly new shapes: warmed on two batches only, MiniLM's static int8 ran its first pass at 167
    texts/s and the next at 272-349 (AMX Xeon), so a budget that left one round timed the candidates' compiling,
    not their running (tune measured the static int8 at 0.65x bf16, bench at 0.92x)."""
    from bertopt.measure.latency import time_call
    from bertopt.runtime import Predictor

    preds = {o.name: Predictor(o.artifact, provider=o.candidate.provider, threads=threads, batch_size=batch_size,
                               verify=False) for o in outcomes}
    for o in outcomes:
        p = preds[o.name]
        p.run(texts, pairs, outputs=[p.primary_output])
    times: dict[str, list[float]] = {o.name: [] for o in outcomes}
    done = 0
    for r in range(rounds):
        order = outcomes[r % len(outcomes):] + outcomes[: r % len(outcomes)]
        for o in order:
            p = preds[o.name]
            times[o.name].append(time_call(lambda p=p: p.run(texts, pairs, outputs=[p.primary_output])))
        done += 1
        if progress:
            progress()
        if time.monotonic() > deadline and r + 1 < rounds:
            line = f"time budget spent: timing stopped after {done} of {rounds} rounds"
            if started is not None:
                # what this run took so far plus the rounds left at the pace of those run: the budget that would
                # have timed them all here (a run's other steps vary too, so it is rounded up, not promised)
                round_s = sum(sum(t) for t in times.values()) / done  # a round: each candidate's timed pass
                enough = time.monotonic() - started + (rounds - done) * round_s
                line += f"; --time-budget {format_duration(enough)} would have timed all {rounds} here"
            say(line)
            break
    for o in outcomes:
        rates = [len(texts) / t for t in times[o.name]]
        o.figures.update(texts_per_s=len(texts) / statistics.median(times[o.name]), texts_per_s_rounds=rates)
    return done


def _gate_data(data: str | None, text_column: str, max_texts: int | None, work: Path) -> tuple[Path, list[str], str]:
    """The gate's texts written to one JSONL file (built-in corpus + mixed text + the user's texts) and the
    timing texts (the user's, or the built-in mixed text)."""
    from bertopt.data import corpus, mixed_text
    from bertopt.measure.data import load_texts

    def cap(texts: list[str]) -> list[str]:
        return texts if max_texts is None else texts[:max_texts]

    built_in = cap([t for t in corpus() if t.strip()]) + cap([t for t in mixed_text() if t.strip()])
    user = cap(load_texts(data, text_column).texts) if data else []
    timing = user or cap([t for t in mixed_text() if t.strip()])
    file = work / "gate-texts.jsonl"
    with open(file, "w", encoding="utf-8") as fh:
        for text in built_in + user:
            fh.write(json.dumps({"text": text}) + "\n")
    source = "built-in corpus + mixed_text" + (f" + {data}" if data else "")
    return file, timing, source


def _why_won(winner: Outcome, passed: list[Outcome]) -> str:
    ranked = sorted(passed, key=lambda o: -o.figures["texts_per_s"])
    rate = winner.figures["texts_per_s"]
    parts = [f"fastest of {len(passed)} candidate(s) that passed the gate: {rate:.1f} texts/s"]
    if len(ranked) > 1:
        second = ranked[1]
        ratio = rate / second.figures["texts_per_s"]
        parts.append(f"{ratio:.2f}x the next ({second.name}, {second.figures['texts_per_s']:.1f} texts/s)")
        if ratio < 1.03:
            parts.append("a margin within timing noise on a shared machine")
    f32 = next((o for o in passed if o.name == "openvino-f32" and o is not winner and o is not ranked[1]), None)
    if f32 is not None:
        parts.append(f"{rate / f32.figures['texts_per_s']:.2f}x openvino-f32")
    return "; ".join(parts)


def _check_outputs(source: str, out: Path, report_dir: Path, overwrite: bool, data: str | None) -> None:
    """The output-path policy (``output_paths``) for both of tune's outputs, before anything is built or written:
    neither may be, sit inside or hold the model or the data; ``--out`` is replaced only with ``--force`` and only
    when it is an artifact; the report folder only when it is an earlier tune report (its ``tune.json``) or empty,
    never a folder of the user's; and the report goes beside the artifact, never in it (or it around the
    artifact)."""
    from bertopt.output_paths import check_output, overlap
    from bertopt.registry import input_paths

    inputs = [*input_paths(source), data]
    check_output(out, kind="artifact", inputs=inputs, replace=overwrite)
    check_output(report_dir, kind="tune-report", inputs=inputs, replace=True, flag="--report-dir")
    if overlap(out, report_dir):
        raise UserError(f"--report-dir {report_dir} overlaps --out {out}: the report goes beside the artifact "
                        "(whose folder holds only hashed files); choose another --report-dir")


def _recorded_source(artifact) -> str:
    """What an artifact's lineage names as its source model, in words."""
    source = artifact.source
    named = source.get("spec") or source.get("path") if isinstance(source, dict) else None
    return f"its lineage names {named}" if isinstance(named, str) and named else "its lineage names none"


@contextmanager
def _report_folder(report_dir: Path) -> Iterator[None]:
    """This run's report folder: an earlier tune report there is set aside and put back if the run stops before
    writing its own (a usage error, Ctrl-C), so a report folder is either the old report or the new one; one this
    run created is removed then. A run that gates every candidate writes its report (also when none passed)."""
    from bertopt.errors import signals_deferred
    from bertopt.output_paths import temp_sibling

    old = None
    empty_before = report_dir.exists() and not any(report_dir.iterdir())  # a folder made for it: kept
    with signals_deferred():  # a Ctrl-C here would leave the old report aside and no folder in its place
        if report_dir.exists() and not empty_before:
            old = temp_sibling(report_dir, "old")
            os.replace(report_dir, old)
        report_dir.mkdir(parents=True, exist_ok=True)
    done = False
    try:
        yield
        done = True
    finally:
        with signals_deferred():  # nor a second Ctrl-C while the old one is put back
            if done:
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            else:
                shutil.rmtree(report_dir, ignore_errors=True)
                if old is not None:
                    os.replace(old, report_dir)
                elif empty_before:
                    report_dir.mkdir()


def _write_chosen(winner: Outcome, out: Path, record: dict[str, Any]) -> Path:
    """The winner's folder moved next to ``out`` under a temp name, the tune record added to its manifest, checked,
    then renamed into place (an existing artifact there is moved aside first): a reader never sees half an
    artifact, and an interruption leaves only a hidden temp folder that is removed."""
    from bertopt.artifact import MANIFEST_NAME, Artifact
    from bertopt.output_paths import move_into_place, write_json

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(winner.artifact.path, tmp)
        manifest = json.loads((tmp / MANIFEST_NAME).read_text())
        manifest["tune"] = record
        write_json(tmp / MANIFEST_NAME, manifest)
        Artifact.load(tmp)  # every file's hash, as a user will load it
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass
class TuneResult:
    artifact: Any
    record: dict[str, Any]
    report_dir: Path


def run_tune(source: str, out: str | os.PathLike, config: dict[str, Any] | None = None, *,
             report_dir: str | os.PathLike | None = None, overwrite: bool = False, say: SAY | None = None,
             progress: Callable[[str, float, float], None] | None = None, features: set[str] | None = None,
             gpus: list[str] | None = None) -> TuneResult:
    """Build, gate and time the candidates for ``source``; write the fastest that passes to ``out`` and the report
    to ``report_dir`` (default ``<out>-report``). Raises GateFailed when no candidate passes (the report is
    written first). ``say`` gets one line per event; ``progress(description, done, total)``."""
    from bertopt.artifact import Artifact
    from bertopt.machine import machine_info
    from bertopt.params import resolve_config
    from bertopt.registry import get_stage, preflight_stage, resolve_input, run_stage

    t_start = time.monotonic()
    config = resolve_config(TUNE_PARAMS, config, "tune")
    say = say or (lambda _line: None)
    out = Path(out).absolute()
    report_dir = Path(report_dir).absolute() if report_dir else out.parent / f"{out.name}-report"
    budget = parse_duration(config["time_budget"])
    deadline = t_start + budget
    _check_outputs(source, out, report_dir, overwrite, config["data"])
    if config["data"]:
        from bertopt.measure.data import load_texts

        load_texts(config["data"], config["text_column"])  # a bad file fails now, before any model work
    candidates, outcomes = plan_candidates(features, gpus, config["candidates"], config["data"], config["threads"])
    refused: list[Outcome] = []
    for cand in list(candidates):
        try:
            for name, cfg in cand.steps:
                preflight_stage(get_stage(name), resolve_config(get_stage(name).PARAMS, cfg, f"{cand.name}: {name}"),
                                f"{cand.name}: {name}")
        except UserError as exc:
            if cand.provider == "cpu":
                raise  # the user's options: nothing is built
            # a GPU this machine cannot open: that candidate is refused in one line, the others go on
            candidates.remove(cand)
            refused.append(Outcome(cand.name, "refused", str(exc), candidate=cand))
    if not candidates:
        raise UserError("no candidate can be built on this machine with the given --candidates; "
                        "drop --candidates or name one of " + ", ".join(CANDIDATE_NAMES[:3])
                        + "".join(f" ({o.name}: {o.reason})" for o in refused))
    source_input = resolve_input(source)  # an unreadable model fails here, before anything is written
    if isinstance(source_input, Artifact):
        raise UserError(f"{source} is a bertopt artifact; tune starts from the model (a Hugging Face folder, an "
                        "ONNX file, a TensorFlow model or builtin:NAME) and builds every candidate from it: give "
                        f"the model it came from ({_recorded_source(source_input)})")
    for o in outcomes:
        say(f"{o.name}: not built: {o.reason}")
    for o in refused:
        say(f"{o.name}: refused: {o.reason}")

    work = out.parent / f".{out.name}.tune-work-{uuid.uuid4().hex[:8]}"
    total = len(candidates) + 2
    step = [0.0]

    def tick(text: str, amount: float = 0.0) -> None:
        step[0] += amount
        if progress:
            progress(text, step[0], total)

    try:
        work.mkdir(parents=True)
        with _report_folder(report_dir):
            gate_file, timing_texts, data_source = _gate_data(config["data"], config["text_column"],
                                                              config["max_texts"], report_dir)
            tick("export + prune (shared by every candidate)")
            export_cfg = {"opset": 17, **({"task": config["task"]} if config["task"] else {})}
            t0 = time.monotonic()
            exported = run_stage("export", source_input, export_cfg, work / "01-export")
            pruned = run_stage("prune", exported, {"outputs": config["outputs"]}, work / "02-prune")
            prefix_s = time.monotonic() - t0
            say(f"export + prune: {prefix_s:.1f} s ({exported.model_info.get('family')}, "
                f"{exported.model_info.get('task')})")
            task = pruned.model_info.get("task", "embedding")
            from bertopt.runtime.tasks import task_of, task_output

            primary = pruned.primary_output if task_of(pruned) == "embedding" else task_output(pruned, task_of(pruned))
            targets = config["targets"] or default_tune_targets(task, pruned.output_kinds.get(primary, "embedding"))
            from bertopt.validate.reference import reference_predictor

            reference = _MemoReference(reference_predictor(pruned, threads=config["threads"], batch_size=32))
            tick("candidates", 1)
            built: dict[tuple, Any] = {}

            def build(cand: Candidate):
                current, key = pruned, ()
                for name, cfg in cand.steps:
                    key = key + ((name, json.dumps(cfg, sort_keys=True)),)
                    if key not in built:
                        folder = work / f"{len(built) + 3:02d}-{cand.name}-{name}"
                        built[key] = run_stage(name, current, cfg, folder)
                    current = built[key]
                return current

            ran: list[Outcome] = list(refused)
            for cand in candidates:
                passed_so_far = [o for o in ran if o.status == "passed"]
                if time.monotonic() > deadline:
                    if passed_so_far:
                        line = f"time budget ({config['time_budget']}) spent"
                        ran.append(Outcome(cand.name, "skipped", line, candidate=cand))
                        say(f"{cand.name}: skipped: {line}")
                        tick(f"skipped {cand.name}", 1)
                        continue
                    say(f"time budget ({config['time_budget']}) spent but no candidate has passed yet; going on with "
                        f"{cand.name}")
                tick(f"{cand.name}: build")
                outcome = Outcome(cand.name, "refused", candidate=cand)
                t0 = time.monotonic()
                try:
                    outcome.artifact = build(cand)
                except UserError as exc:
                    outcome.reason = str(exc)
                    outcome.build_s = time.monotonic() - t0
                    say(f"{cand.name}: refused: {exc}")
                    ran.append(outcome)
                    tick(f"{cand.name}: refused", 1)
                    continue
                outcome.build_s = time.monotonic() - t0
                tick(f"{cand.name}: gate (batched, then alone)")
                t0 = time.monotonic()
                try:
                    ok, figures = gate_candidate(outcome.artifact, data_file=gate_file, targets=targets,
                                                 reference=reference, report_dir=report_dir / "candidates" / cand.name,
                                                 threads=config["threads"], provider=cand.provider,
                                                 batch_size=config["batch_size"])
                except UserError as exc:  # e.g. the runtime cannot open it on this machine
                    outcome.reason = f"the gate could not run it: {exc}"
                    outcome.gate_s = time.monotonic() - t0
                    say(f"{cand.name}: refused: {outcome.reason}")
                    ran.append(outcome)
                    tick(f"{cand.name}: refused", 1)
                    continue
                outcome.gate_s = time.monotonic() - t0
                outcome.figures = figures
                outcome.status = "passed" if ok else "failed"
                summary = _figure_line(figures)
                if ok:
                    say(f"{cand.name}: passed the gate ({summary})")
                else:
                    outcome.reason = "; ".join(figures["failed_checks"])
                    say(f"{cand.name}: failed the gate: {outcome.reason}")
                ran.append(outcome)
                tick(f"{cand.name}: {outcome.status}", 1)

            passed = [o for o in ran if o.status == "passed"]
            rounds = 0
            if passed:
                tick(f"timing {len(passed)} candidate(s) side by side")
                per_round = 1.0 / config["rounds"]
                rounds = time_side_by_side(passed, timing_texts, _timing_pairs(pruned, timing_texts),
                                           rounds=config["rounds"], threads=config["threads"],
                                           batch_size=config["batch_size"], deadline=deadline, say=say,
                                           progress=lambda: tick("timing", per_round), started=t_start)
            winner = max(passed, key=lambda o: o.figures["texts_per_s"]) if passed else None
            record = {
                "source": str(source),
                "family": pruned.model_info.get("family"),
                "task": task,
                "primary_output": primary,
                "outputs": pruned.output_names,
                "targets": targets,
                "gate": {"data": data_source, "texts": len(gate_file.read_text(encoding="utf-8").splitlines()),
                         "runs": [f"batches of {config['batch_size']} + batch invariance (alone vs batches 1/7/32)",
                                  "every text alone (batch 1), for a candidate that passed in batches"],
                         "reference": f"{reference.session.backend} (the original model)"},
                "timing": {"texts": len(timing_texts), "data": config["data"] or "built-in mixed_text",
                           "rounds": rounds, "batch_size": config["batch_size"], "threads": config["threads"],
                           "interleaved": True},
                "machine": machine_info(),
                "gpu_providers": gpus if gpus is not None else gpu_providers(),
                "time_budget_s": budget,
                "prefix_s": round(prefix_s, 2),
                "candidates": [o.record() for o in ran + outcomes],
                "winner": winner.name if winner else None,
                "why": _why_won(winner, passed) if winner else "no candidate passed the gate",
            }
            artifact = None
            if winner is not None:
                tick(f"writing {winner.name} to {out}")
                record["wall_time_s"] = round(time.monotonic() - t_start, 1)
                artifact = Artifact.load(_write_chosen(winner, out, record))
            record["wall_time_s"] = round(time.monotonic() - t_start, 1)
            write_reports(record, report_dir, out if winner else None)
            tick("done", 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if winner is None:
        raise GateFailed(f"no candidate passed the gate ({targets}); figures and reasons in "
                         f"{report_dir / 'tune.md'}")
    return TuneResult(artifact, record, report_dir)


def _timing_pairs(artifact, texts: list[str]) -> list[str] | None:
    """A reranker is timed on (query, passage) pairs: each text paired with the next."""
    from bertopt.runtime.tasks import task_of

    if task_of(artifact) != "rerank":
        return None
    return texts[1:] + texts[:1]


def _figure_line(f: dict[str, Any]) -> str:
    parts = []
    if "cos_min_alone" in f:
        parts.append(f"cos min alone {f['cos_min_alone']:.5f}, batched {f.get('cos_min_batched', float('nan')):.5f}")
    for key in ("top1_agreement", "token_label_agreement", "spearman", "term_overlap_at_10"):
        if f"{key}_batched" in f:
            parts.append(f"{key.replace('_', ' ')} {f[f'{key}_batched']:.4f}")
    if "batch_dev" in f:
        parts.append(f"batch dev {f['batch_dev']:.2g}")
    return ", ".join(parts)


# -- reports -------------------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def markdown_table(record: dict[str, Any]) -> str:
    rows = ["| candidate | status | texts/s | cos min alone | cos min batched | batch dev | task metric | "
            "build s | gate s | why |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in record["candidates"]:
        task_metric = next((f"{k[:-8]} {c[k]:.4f}" for k in ("top1_agreement_batched",
                            "token_label_agreement_batched", "spearman_batched", "term_overlap_at_10_batched")
                            if k in c), "-")
        why = c["reason"] or ("**winner**: " + record["why"] if c["name"] == record["winner"] else "")
        rows.append(f"| {c['name']} | {c['status']} | {_fmt(c.get('texts_per_s'), '.1f')} | "
                    f"{_fmt(c.get('cos_min_alone'), '.5f')} | {_fmt(c.get('cos_min_batched'), '.5f')} | "
                    f"{_fmt(c.get('batch_dev'), '.2g')} | {task_metric} | {_fmt(c.get('build_s'), '.1f')} | "
                    f"{_fmt(c.get('gate_s'), '.1f')} | {why.replace('|', '/')} |")
    m = record["machine"]
    head = [f"# bertopt tune: {record['source']}", "",
            f"Winner: **{record['winner'] or 'none'}** — {record['why']}.", "",
            f"Machine: {m.get('cpu_model', m.get('processor', '?'))}, {m.get('usable_cores')} usable cores, CPU "
            f"features {', '.join(m.get('cpu_features', [])) or 'none read'}"
            + (f" (under ONEDNN_MAX_CPU_ISA={m['isa_cap']}; the CPU's own: {', '.join(m.get('flags', []))})"
               if m.get("isa_cap") else "") + "; GPU providers: "
            f"{', '.join(record['gpu_providers']) or 'none'}.", "",
            f"Gate ({record['task']}, output `{record['primary_output']}`): `{record['targets']}` against "
            f"{record['gate']['reference']} on {record['gate']['texts']} texts ({record['gate']['data']}), "
            f"{' and '.join(record['gate']['runs'])}.", "",
            f"Timing: {record['timing']['texts']} texts ({record['timing']['data']}), batch "
            f"{record['timing']['batch_size']}, {record['timing']['rounds']} interleaved rounds, median. "
            f"Wall time {record.get('wall_time_s', 0):.0f} s (budget {record['time_budget_s']:.0f} s).", ""]
    decided = [f"- {c['name']}: {'on' if c['static_full_batch']['on'] else 'off'} ({c['static_full_batch']['why']})"
               for c in record["candidates"] if c.get("static_full_batch")]
    tail = ["", "Full batches on a copy of the model compiled for their shape (`--static-full-batch`, decided by "
            "the stage that built the candidate):", *decided] if decided else []
    return "\n".join(head + rows + tail) + "\n"


def _plot(record: dict[str, Any]) -> bytes | None:
    """Speed (texts/s) against distance from the original (1 - cos min, worst of alone and batched); candidates
    that failed the gate are not timed and sit on the floor of the plot."""
    try:
        import matplotlib
    except ImportError:
        return None
    import io

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gated = [c for c in record["candidates"] if "cos_min" in c]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    floor = 0.0
    for c in gated:
        x = max(1.0 - c["cos_min"], 1e-9)
        if "texts_per_s" in c:
            winner = c["name"] == record["winner"]
            ax.scatter([x], [c["texts_per_s"]], s=90 if winner else 50, marker="*" if winner else "o",
                       color="tab:green" if winner else "tab:blue", zorder=3)
            ax.annotate(c["name"], (x, c["texts_per_s"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
        else:
            ax.scatter([x], [floor], marker="x", color="tab:red", zorder=3)
            ax.annotate(f"{c['name']} (failed)", (x, floor), textcoords="offset points", xytext=(5, 5), fontsize=8,
                        color="tab:red")
    from bertopt.measure.targets import parse_targets

    bound = next((t.value for t in parse_targets(record["targets"]) if t.metric == "cos_min" and t.op == ">="), None)
    if bound is not None:
        ax.axvline(1.0 - bound, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(f"gate: cos min >= {bound:g}", (1.0 - bound, 0), textcoords="offset points", xytext=(-4, 20),
                    rotation=90, fontsize=8, ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("1 - cosine min vs the original (worst of alone and batched; log)")
    ax.set_ylabel("texts/s (median of interleaved rounds)")
    ax.set_title("bertopt tune: speed vs fidelity")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def html_page(record: dict[str, Any], markdown: str, png: bytes | None) -> str:
    import base64
    import html

    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [html.escape(c.strip().replace("**", "")) for c in line.strip("|").split("|")]
            tag = "th" if not rows else "td"
            rows.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
    lines = markdown.splitlines()[1:]
    table_end = max((i for i, line in enumerate(lines) if line.startswith("|")), default=-1)
    intro, after = ([f"<p>{html.escape(line.replace('**', ''))}</p>" for line in part if line and
                     not line.startswith("|")] for part in (lines[:table_end], lines[table_end + 1:]))
    img = (f'<img alt="speed vs fidelity" src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png
           else "<p>(plot: matplotlib is not installed; pip install 'bertopt[report]')</p>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>bertopt tune</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:4px 8px;font-size:90%}</style></head><body>"
            f"<h1>bertopt tune: {html.escape(record['source'])}</h1>{''.join(intro)}{img}"
            f"<table>{''.join(rows)}</table>{''.join(after)}</body></html>\n")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_reports(record: dict[str, Any], report_dir: Path, artifact_path: Path | None) -> None:
    from bertopt.output_paths import write_json

    report_dir.mkdir(parents=True, exist_ok=True)
    write_json(report_dir / "tune.json", {**record, "artifact": str(artifact_path) if artifact_path else None})
    markdown = markdown_table(record)
    _write_text(report_dir / "tune.md", markdown)
    _write_text(report_dir / "tune.html", html_page(record, markdown, _plot(record)))


# -- command -------------------------------------------------------------------------------------------------------
_HELP = ("Build the candidates that make sense on this machine (OpenVINO f32 / bf16 / int8, ONNX Runtime fp32 / "
         "int8, fp16 on a GPU), gate each against the original model (alone and in batches), time the ones that "
         "pass side by side on your texts, and write the fastest to --out with a report (tune.json, tune.md, "
         "tune.html) beside it. Exit 0: an artifact was written; 1: no candidate passed; 2: usage error.")


def print_result(result: TuneResult, console) -> None:
    from rich.table import Table

    from bertopt.terminal import whole_cells

    record = result.record
    table = Table(title=f"bertopt tune: {record['source']} ({record['task']}, gate {record['targets']})",
                  title_justify="left")
    for col in ("candidate", "status", "texts/s", "cos min alone", "cos min batched", "batch dev"):
        table.add_column(col, justify="right" if col not in ("candidate", "status") else "left")
    for c in record["candidates"]:
        name = f"[bold green]{c['name']}[/]" if c["name"] == record["winner"] else c["name"]
        table.add_row(name, c["status"], _fmt(c.get("texts_per_s"), ".1f"), _fmt(c.get("cos_min_alone"), ".5f"),
                      _fmt(c.get("cos_min_batched"), ".5f"), _fmt(c.get("batch_dev"), ".2g"))
    console.print(whole_cells(table, console))
    console.print(f"[green]wrote[/] {result.artifact.path} ({record['winner']}: {record['why']}); report "
                  f"{result.report_dir / 'tune.html'}; {record['wall_time_s']:.0f} s", highlight=False)


TUNE_IO_PARAMS = [
    Param("source", str, None, "Model: Hugging Face folder, .onnx, builtin:minilm ...", positional=True,
          required=True),
    Param("out", str, None, "Folder for the chosen artifact (must not exist unless --force).", required=True,
          aliases=("-o",), check=path_given),
    Param("report_dir", str, None, "Folder for tune.json / tune.md / tune.html and each candidate's gate reports "
          "(default: OUT-report).", aliases=("-r",)),
    Param("force", bool, False, "Replace an existing output artifact.", negatable=False),
]


def _tune_command(config) -> None:
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from bertopt.terminal import console

    given = {p.name: config[p.name] for p in TUNE_PARAMS if p.name in config.given}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        job = bar.add_task("tune", total=1)

        def say(line: str) -> None:
            bar.console.print(escape(line), highlight=False, soft_wrap=True)

        def progress(text: str, done: float, total: float) -> None:
            bar.update(job, description=escape(text), completed=done, total=total)

        report_dir = Path(config["report_dir"]) if config["report_dir"] else None
        result = run_tune(config["source"], Path(config["out"]), given, report_dir=report_dir,
                          overwrite=config["force"], say=say, progress=progress)
    print_result(result, console)


def register(app) -> None:
    app.command("tune", help=_HELP)(typer_command("tune", [*TUNE_IO_PARAMS, *TUNE_PARAMS], _tune_command,
                                                  help=_HELP))
