"""``benchmarks/compare.py --st-peers``: bertopt's artifacts against what a sentence-transformers user gets.

Contenders, each alone in its own process (``contender_worker.py``), rounds interleaved (A B C ... A B C ...) so a
noisy neighbour slows every contender alike, ``--threads`` (default 2) each, batch ``--batch-size`` (32):
  sentence-transformers PyTorch fp32 (the fidelity reference) and bf16 autocast (project venv);
  sentence-transformers ``backend="openvino"`` as a user calls it, and its static int8 OpenVINO model built with the
  recipe of ``export_static_quantized_openvino_model`` (OVQuantizer + OVQuantizationConfig(), calibrated offline on
  bertopt's built-in corpus, padded to max_length 384 as sentence-transformers does) -- both in the peer venv
  (``benchmarks/peer-venv.sh``; reported as skipped, with the reason, when it is absent);
  every artifact folder given with ``--artifacts`` through bertopt's Predictor (project venv).
Workloads: (a) padded: ``--texts`` texts of more than ``--seq-len`` tokens, so every batch is exactly batch x
seq-len; (b) mixed: ``bertopt.data.mixed_text()``, length-sorted batches (the Predictor's bucketing; ST's encode sorts
by length itself). Fidelity: cosine (min, mean) of each contender's outputs of its last timed pass against
sentence-transformers PyTorch fp32's, on both workloads.

    benchmarks/peer-venv.sh peer-venv
    .venv/bin/python benchmarks/compare.py --st-peers --peer-venv peer-venv --rounds 5 \\
        --artifacts artifacts/minilm-fastest-cpu/03-compile artifacts/minilm-int8-accurate/03-quantize
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import cpu_line, output_path, progress_printer

HERE = Path(__file__).resolve().parent
WORKER = HERE / "contender_worker.py"
REFERENCE = "sentence-transformers PyTorch fp32"
PEER_KINDS = ("st-openvino", "st-int8-static")


def add_args(parser) -> None:
    parser.add_argument("--st-peers", action="store_true", help="Measure against sentence-transformers' "
                        "contenders, each in its own process (benchmarks/peers.py).")
    parser.add_argument("--artifacts", nargs="*", type=Path, default=[], help="--st-peers: bertopt artifact "
                        "folders to measure.")
    parser.add_argument("--peer-venv", type=Path, default=HERE.parent / "peer-venv", help="--st-peers: the venv "
                        "with optimum-intel (benchmarks/peer-venv.sh makes it).")
    parser.add_argument("--st-bf16", action="store_true", help="--st-peers: run sentence-transformers' bf16 "
                        "autocast contender even where bf16 is not native (it is skipped there by default).")
    parser.add_argument("--peer-cache", type=Path, default=None, help="--st-peers: where the peer's static int8 "
                        "model is built (reused when present; default: under --out).")


def long_texts(n: int, min_words: int) -> list[str]:
    """``n`` texts of at least ``min_words`` words (built-in corpus sentences joined): longer than the padded
    workload's token count, so every contender truncates to exactly that many tokens."""
    from bertopt.data import corpus

    pool = [t.strip() for t in corpus() if t.strip()]
    out, k = [], 0
    for _ in range(n):
        parts = []
        while sum(len(p.split()) for p in parts) < min_words:
            parts.append(pool[k % len(pool)])
            k += 1
        out.append(" ".join(parts))
    return out


@dataclass
class Worker:
    name: str
    spec: dict[str, Any]
    python: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    describe: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"padded": [], "mixed": []})

    def start(self, work: Path) -> None:
        spec_file = work / f"{self.spec['slug']}.json"
        spec_file.write_text(json.dumps(self.spec))
        self.log = work / f"{self.spec['slug']}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "OMP_NUM_THREADS": str(self.spec["threads"]), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([self.python, str(WORKER), str(spec_file)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env,
                                     cwd=str(HERE.parent))

    def answer(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@bench "):
                return json.loads(line[len("@@bench "):])
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log else []
        return {"ok": False, "error": f"process ended (exit {self.proc.wait()}): {' | '.join(tail)}"}

    def ask(self, **cmd) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        got = self.answer()
        if not got.get("ok"):
            raise RuntimeError(f"{self.name}: {got.get('error')}")
        return got

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def contender_specs(args, threads: int, model_dir: str, texts_file: Path) -> list[tuple[str, dict, str]]:
    """(name, worker spec, python) for every contender, in table order."""
    common = {"threads": threads, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "texts_file": str(texts_file), "model": model_dir}
    peer_python = str(args.peer_venv / "bin" / "python")
    cache = args.peer_cache or (args.out / "st-int8-static")
    out = [(REFERENCE, {"kind": "st", "slug": "st-fp32"}, sys.executable),
           ("sentence-transformers PyTorch bf16 autocast", {"kind": "st", "bf16": True, "slug": "st-bf16"},
            sys.executable),
           ('sentence-transformers backend="openvino"', {"kind": "st-openvino", "slug": "st-openvino",
                                                         "precision": "OpenVINO default"}, peer_python),
           ("sentence-transformers static int8 OpenVINO", {"kind": "st-int8-static", "slug": "st-int8-static",
                                                           "precision": "int8 static", "build_dir": str(cache)},
            peer_python)]
    # a recipe's stage folder (NN-stage) is named after its recipe too: minilm-fastest-cpu/03-compile
    names = [f"{p.parent.name}/{p.name}" if p.name[:2].isdigit() and p.name[2:3] == "-" else p.name
             for p in (Path(a).resolve() for a in args.artifacts)]
    if len(set(names)) != len(names):
        names = [str(p) for p in args.artifacts]
    for i, (path, name) in enumerate(zip(args.artifacts, names)):
        out.append((f"bertopt {name}", {"kind": "artifact", "artifact": str(path), "slug": f"artifact-{i}",
                                        "name": name}, sys.executable))
    return [(name, {**common, **spec}, python) for name, spec, python in out]


def main(args) -> int:
    import numpy as np
    from rich.console import Console

    from bertopt.artifact import Artifact
    from bertopt.bench import mixed_texts
    from bertopt.cosine import cosine_rows
    from bertopt.data import corpus
    from bertopt.errors import UserError
    from bertopt.machine import has_native_bf16, machine_info
    from bertopt.output_paths import write_json
    from bertopt.sources import resolve_source

    console = Console(width=200)
    say = progress_printer()
    threads = args.threads or 2
    for path in args.artifacts:
        Artifact.load(path)  # a wrong folder fails here, in one line, before anything starts
    source = resolve_source(args.model)
    if source.kind != "hf":
        raise UserError(f"--st-peers needs a Hugging Face / sentence-transformers folder as --model, got {source.kind}")
    model_dir = str(source.path)
    mixed = mixed_texts(args.mixed_texts)
    padded = long_texts(args.texts, args.seq_len)
    machine = machine_info()
    say(f"CPU: {cpu_line(machine)}; load average before: {machine.get('load_average')}")

    with tempfile.TemporaryDirectory(prefix="bertopt-peers-") as tmp:
        work = Path(tmp)
        texts_file = work / "texts.json"
        texts_file.write_text(json.dumps({"mixed": mixed, "padded": padded, "calibration": corpus()}))
        workers = []
        for name, spec, python in contender_specs(args, threads, model_dir, texts_file):
            w = Worker(name, spec, python)
            if spec["kind"] in PEER_KINDS and not Path(python).exists():
                w.skipped = (f"no peer venv at {args.peer_venv}: create it with benchmarks/peer-venv.sh "
                             f"{args.peer_venv}")
            elif spec.get("bf16") and not has_native_bf16() and not args.st_bf16:
                # PyTorch emulates bf16 there (slower than its fp32): minutes a round, and no user's choice
                w.skipped = "bf16 is not native on this CPU (no AVX-512 BF16 / AMX); --st-bf16 runs it anyway"
            workers.append(w)
        try:
            for w in workers:
                if not w.skipped:
                    w.start(work)
            for w in workers:  # loading ran in parallel; collect them in order
                if w.skipped:
                    continue
                say(f"loading {w.name}")
                got = w.answer()
                if got.get("ok"):
                    w.describe = got["describe"]
                else:
                    w.skipped = f"failed to load: {got.get('error')}"
            live = [w for w in workers if not w.skipped]
            if not live or live[0].name != REFERENCE:
                raise UserError(f"the reference ({REFERENCE}) did not load: {workers[0].skipped}")
            for w in live:
                say(f"warm-up {w.name}")
                w.ask(cmd="warmup")
            for r in range(args.rounds):
                for workload in ("padded", "mixed"):
                    for w in live:
                        say(f"round {r + 1}/{args.rounds}: {workload} {w.name}")
                        w.seconds[workload].append(w.ask(cmd="time", workload=workload)["seconds"])
            outputs = {}
            for w in live:
                path = work / f"{w.spec['slug']}-out.npz"
                w.ask(cmd="dump", path=str(path))
                with np.load(path) as data:
                    outputs[w.name] = {k: data[k] for k in data.files}
        finally:
            for w in workers:
                w.stop()

    machine["load_average_after"] = machine_info().get("load_average")
    counts = {"padded": len(padded), "mixed": len(mixed)}
    ref = outputs[REFERENCE]
    results = []
    for w in workers:
        row: dict[str, Any] = {"name": w.name, "kind": w.spec["kind"], **w.describe}
        if w.skipped:
            row["skipped"] = w.skipped
            results.append(row)
            continue
        for workload in ("padded", "mixed"):
            secs = w.seconds[workload]
            row[f"{workload}_texts_per_s"] = counts[workload] / statistics.median(secs)
            row[f"{workload}_texts_per_s_rounds"] = [counts[workload] / s for s in secs]
            cos = cosine_rows(outputs[w.name][workload], ref[workload])
            row.setdefault("fidelity", {})[workload] = {"cos_min": float(cos.min()), "cos_mean": float(cos.mean())}
        results.append(row)
    for key, base in (("st-fp32", REFERENCE), ("st-bf16", "sentence-transformers PyTorch bf16 autocast"),
                      ("st-openvino", 'sentence-transformers backend="openvino"'),
                      ("st-int8", "sentence-transformers static int8 OpenVINO")):
        b = next((r for r in results if r["name"] == base and not r.get("skipped")), None)
        for r in results:
            if b is not None and not r.get("skipped"):
                r.setdefault("vs", {})[key] = {wl: r[f"{wl}_texts_per_s"] / b[f"{wl}_texts_per_s"]
                                               for wl in ("padded", "mixed")}
    console.print(peer_table(results, args, threads, machine))
    path = output_path(args, "compare-st-peers")
    write_json(path, {"script": "compare --st-peers", "model": args.model, "machine": machine,
                      "cpu": cpu_line(machine),
                      "settings": {"rounds": args.rounds, "batch_size": args.batch_size, "seq_len": args.seq_len,
                                   "threads": threads, "padded_texts": len(padded), "mixed_texts": len(mixed)},
                      "results": results})
    console.print(f"wrote {path}")
    return 0


def load(triple) -> str:
    return "/".join(f"{x:.1f}" for x in triple) if triple else "?"


def peer_table(results, args, threads: int, machine: dict[str, Any]):
    from rich.table import Table

    # a skipped contender's reason goes under the table, not into its narrow rate columns (where it wrapped)
    skipped = [f"{r['name']}: skipped: {r['skipped']}" for r in results if r.get("skipped")]
    table = Table(title=f"against sentence-transformers on {cpu_line(machine)} ({threads} threads, batch "
                  f"{args.batch_size}, {args.rounds} interleaved rounds, medians; load average "
                  f"{load(machine.get('load_average'))} -> {load(machine.get('load_average_after'))})",
                  title_justify="left",
                  caption=f"(a) padded: batches of exactly {args.batch_size} x {args.seq_len} tokens; (b) mixed: "
                  "mixed-length text in length-sorted batches; texts/s; x: ratio to the named contender in this run; "
                  f"cos: cosine of each output vs {REFERENCE} (min over the workload's texts)"
                  + "".join(f"\n{line}" for line in skipped),
                  caption_justify="left")
    for col in ("contender", "precision", "(a) /s", "(b) /s", "(a) x bf16", "(b) x bf16", "(a) x ST-OV",
                "(b) x ST-OV", "(a) x ST-int8", "(b) x ST-int8", "cos min (a)", "cos min (b)"):
        text = col in ("contender", "precision")
        table.add_column(col, justify="left" if text else "right", no_wrap=text)
    for r in results:
        if r.get("skipped"):
            table.add_row(r["name"], "skipped", *["-"] * 10)
            continue
        vs = r.get("vs", {})

        def ratio(key, wl, vs=vs):
            return f"{vs[key][wl]:.2f}" if key in vs else "-"

        f = r["fidelity"]
        table.add_row(r["name"], str(r.get("precision", "")), f"{r['padded_texts_per_s']:.1f}",
                      f"{r['mixed_texts_per_s']:.1f}", ratio("st-bf16", "padded"), ratio("st-bf16", "mixed"),
                      ratio("st-openvino", "padded"), ratio("st-openvino", "mixed"), ratio("st-int8", "padded"),
                      ratio("st-int8", "mixed"), f"{f['padded']['cos_min']:.5f}", f"{f['mixed']['cos_min']:.5f}")
    return table

