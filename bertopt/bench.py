"""``bertopt bench``: throughput and latency of artifacts, measured through the Predictor (the runtime that
serves them), side by side and interleaved so a noisy neighbour slows every contender alike.

Three measurements per contender, each repeated for several rounds (A B C A B C ...), medians reported:

* padded: batch ``batch_size`` of real sentences, truncated and padded to exactly ``seq_len`` tokens;
* mixed: ``bertopt.data.mixed_text()`` (one sentence to a paragraph), length-bucketed batches;
* latency: batch 1, exactly ``latency_seq_len`` tokens, p50/p99 over every call.

Each call asks for the primary output only (the sentence embedding for MiniLM), as a serving client would.

Fidelity (cosine mean/min, neighbour agreement@10 of the primary output) is measured against a reference
contender (PyTorch fp32 of the source model with ``--reference``) on the built-in corpus and both workloads.
The same functions back ``benchmarks/bench_recipes.py`` and ``benchmarks/compare.py``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import typer

from bertopt.errors import UserError
from bertopt.measure.latency import percentile, time_call
from bertopt.params import BATCH_SIZE, RUNTIME, THREADS, ConfigFields, Param, typer_command

ProgressFn = Callable[[str], None]


# The measurement settings, declared once: `bertopt bench` flags and Settings.check; a Param's name is the Settings
# field's unless SETTINGS_FIELDS says otherwise.
SETTINGS_PARAMS = [
    BATCH_SIZE,
    Param("seq_len", int, 128, "Tokens per sentence of the padded workload.", min=1),
    Param("latency_seq_len", int, 16, "Tokens of the batch-1 latency input ([CLS] text [SEP]: at least 3).", min=3),
    Param("texts", int, 256, "Sentences per padded pass.", min=1, max=100_000),
    Param("mixed_texts", int, None, "Lines of mixed-length text per pass (default: all 512).", min=1, max=100_000),
    Param("latency_calls", int, 30, "Batch-1 calls per round.", min=1, max=100_000),
    Param("corpus_texts", int, None, "Built-in corpus sentences used for fidelity with --reference (default: all).",
          min=2),
    Param("rounds", int, 3, "Interleaved rounds; medians are reported.", min=1, max=1000),
]
SETTINGS_FIELDS = ConfigFields(SETTINGS_PARAMS, {"texts": "padded_texts"})
_DEFAULT = SETTINGS_FIELDS.defaults()


@dataclass
class Settings:
    batch_size: int = _DEFAULT["batch_size"]
    seq_len: int = _DEFAULT["seq_len"]
    latency_seq_len: int = _DEFAULT["latency_seq_len"]
    padded_texts: int = _DEFAULT["padded_texts"]
    mixed_texts: int | None = _DEFAULT["mixed_texts"]  # None: all of bertopt.data.mixed_text()
    latency_calls: int = _DEFAULT["latency_calls"]
    rounds: int = _DEFAULT["rounds"]
    fidelity: bool = True
    corpus_texts: int | None = _DEFAULT["corpus_texts"]  # None: the whole built-in corpus for fidelity

    def check(self) -> None:
        """Each setting against its declaration (SETTINGS_PARAMS: the flags' bounds, stated once)."""
        SETTINGS_FIELDS.check(self, "bench")


BENCH_PARAMS = [
    Param("artifacts", list, None, "Artifact folders to measure side by side.", positional=True, required=True),
    Param("reference", bool, False, "Also measure the first artifact's source model in PyTorch fp32 and bf16 "
          "autocast; ratios and fidelity (cosine, neighbour agreement) are then given against PyTorch fp32."),
    *SETTINGS_PARAMS,
    THREADS,
    RUNTIME,
    Param("json_out", str, None, "Also write the results to this JSON file.", flag="--json"),
]


@dataclass
class Contender:
    """Something to measure: a name and a Predictor (its session is shared by the per-length views)."""

    name: str
    predictor: Any
    info: dict[str, Any] = field(default_factory=dict)
    _views: dict[int, Any] = field(default_factory=dict, repr=False)

    def at_length(self, max_seq_len: int):
        """A Predictor on the same session that truncates to ``max_seq_len`` tokens (no second model load)."""
        from bertopt.runtime import Predictor
        from bertopt.runtime.predictor import position_limit

        if max_seq_len not in self._views:
            base = self.predictor
            limit = position_limit(base.artifact.model_info)
            if max_seq_len > limit:  # said here: the Predictor's own line names --max-seq-len, which bench has not
                raise UserError(f"{base.artifact.path}: {max_seq_len} tokens per text exceed the model's {limit} "
                                "positions; use --seq-len and --latency-seq-len of at most that")
            self._views[max_seq_len] = Predictor(base.artifact, session=base.session, max_seq_len=max_seq_len,
                                                 batch_size=base.batch_size, length_bucketing=base.length_bucketing,
                                                 verify=False)
        return self._views[max_seq_len]


def contender_for_artifact(path, *, name: str | None = None, threads: int | None = None, runtime: str | None = None,
                           provider: str = "cpu", batch_size: int = 32) -> Contender:
    from bertopt.artifact import Artifact
    from bertopt.runtime import Predictor

    art = Artifact.load(path)
    pred = Predictor(art, provider=provider, threads=threads, runtime=runtime, batch_size=batch_size)
    return Contender(name or Path(art.path).name, pred, {
        "artifact": str(art.path), "precision": art.precision, **pred.describe()})


def reference_contender(artifact_or_source, *, bf16: bool = False, threads: int | None = None,
                        batch_size: int = 32) -> Contender:
    """PyTorch running the original model (fp32, or bf16 autocast), through the same Predictor code path."""
    from bertopt.artifact import Artifact
    from bertopt.sources import resolve_source
    from bertopt.sources.hf import hf_reference
    from bertopt.validate.reference import reference_predictor

    if isinstance(artifact_or_source, Artifact):
        pred = reference_predictor(artifact_or_source, threads=threads, batch_size=batch_size, bf16=bf16)
    else:
        source = resolve_source(str(artifact_or_source))
        pred = hf_reference(source.path, threads=threads, bf16=bf16, batch_size=batch_size)
    label = "PyTorch bf16 autocast" if bf16 else "PyTorch fp32"
    return Contender(label, pred, {"artifact": str(pred.artifact.path), **pred.describe(), "backend": "pytorch",
                                   "precision": "bf16 autocast" if bf16 else "fp32"})


# -- workloads ------------------------------------------------------------------------------------------------
def padded_texts(n: int) -> list[str]:
    """``n`` real sentences from the built-in corpus (cycled), for the fixed-shape workload."""
    from bertopt.data import corpus

    pool = [t for t in corpus() if t.strip()]
    return [pool[i % len(pool)] for i in range(n)]


def mixed_texts(n: int | None = None) -> list[str]:
    from bertopt.data import mixed_text

    texts = mixed_text()
    return texts if n is None else texts[:n]


def latency_texts(n: int) -> list[str]:
    """Sentences long enough to fill the latency sequence length when truncated."""
    from bertopt.data import corpus

    pool = sorted((t for t in corpus() if len(t.split()) >= 12), key=len) or [t for t in corpus() if t.strip()]
    return [pool[i % len(pool)] for i in range(n)]


# -- FLOPs ------------------------------------------------------------------------------------------------------
def flops_per_sentence(model_info: dict[str, Any], seq_len: int) -> float:
    """Multiply-adds x 2 of a BERT encoder on one ``seq_len``-token sentence, from its shapes.

    Per layer: Q, K, V, output projections 4*(2*S*H*H), feed-forward 2*(2*S*H*I), attention scores and
    weighted sum 2*(2*S*S*H). Embeddings, LayerNorm, softmax and pooling are negligible and not counted.
    """
    h = int(model_info.get("hidden_size") or 0)
    i = int(model_info.get("intermediate_size") or 4 * h)
    layers = int(model_info.get("num_hidden_layers") or 0)
    s = int(seq_len)
    return float(layers * (8 * s * h * h + 4 * s * h * i + 4 * s * s * h))


def executed_flops(predictor, texts: Sequence[str], batch_size: int) -> float:
    """FLOPs the hardware actually runs for ``texts`` in ``predictor``'s batches: each batch is padded to its
    longest text, so padding counts (it is computed) and mixed-length text is priced by its real shapes."""
    info = predictor.model.model_info
    encodings = predictor.tokenize(texts)
    return sum(len(b) * flops_per_sentence(info, max(len(encodings[i].ids) for i in b))
               for b in predictor.plan_batches(encodings, batch_size))


def measure(contenders: list[Contender], settings: Settings, reference: Contender | None = None,
            progress: ProgressFn | None = None) -> list[dict[str, Any]]:
    """Interleaved rounds over every contender; returns one result dict per contender (input order)."""
    settings.check()
    s = settings
    padded = padded_texts(s.padded_texts)
    mixed = mixed_texts(s.mixed_texts)
    lat_texts = latency_texts(s.latency_calls)
    say = progress or (lambda _msg: None)
    runs: dict[str, dict[str, list[float]]] = {c.name: {"padded": [], "mixed": [], "latency": []} for c in contenders}

    # warm-up: first calls allocate, compile (OpenVINO shapes) and fault in pages
    for c in contenders:
        say(f"warm-up {c.name}")
        c.at_length(s.seq_len).run(padded[: s.batch_size], pad_to=s.seq_len, batch_size=s.batch_size)
        c.predictor.run(mixed[: s.batch_size * 2], batch_size=s.batch_size)
        view = c.at_length(s.latency_seq_len)
        for t in lat_texts[:3]:
            view.run([t], pad_to=s.latency_seq_len, batch_size=1)

    for r in range(s.rounds):
        for c in contenders:
            say(f"round {r + 1}/{s.rounds}: padded {c.name}")
            view = c.at_length(s.seq_len)
            runs[c.name]["padded"].append(time_call(
                lambda v=view: v.run(padded, outputs=[v.primary_output], pad_to=s.seq_len, batch_size=s.batch_size)))
        for c in contenders:
            say(f"round {r + 1}/{s.rounds}: mixed {c.name}")
            runs[c.name]["mixed"].append(time_call(
                lambda p=c.predictor: p.run(mixed, outputs=[p.primary_output], batch_size=s.batch_size)))
        for c in contenders:
            say(f"round {r + 1}/{s.rounds}: latency {c.name}")
            view = c.at_length(s.latency_seq_len)
            for t in lat_texts:
                runs[c.name]["latency"].append(time_call(
                    lambda v=view, t=t: v.run([t], outputs=[v.primary_output], pad_to=s.latency_seq_len, batch_size=1)))

    results = []
    for c in contenders:
        m = runs[c.name]
        padded_rate = len(padded) / statistics.median(m["padded"])
        flops = flops_per_sentence(c.predictor.model.model_info, s.seq_len)
        mixed_flops = executed_flops(c.predictor, mixed, s.batch_size) if flops else 0.0
        results.append({
            "name": c.name,
            **c.info,
            "padded_texts_per_s": padded_rate,
            "padded_texts_per_s_rounds": [len(padded) / t for t in m["padded"]],
            "mixed_texts_per_s": len(mixed) / statistics.median(m["mixed"]),
            "mixed_texts_per_s_rounds": [len(mixed) / t for t in m["mixed"]],
            "latency_p50_ms": percentile(m["latency"], 50) * 1e3,
            "latency_p99_ms": percentile(m["latency"], 99) * 1e3,
            "padded_gflop_per_s": padded_rate * flops / 1e9 if flops else None,
            "mixed_gflop_per_s": mixed_flops / statistics.median(m["mixed"]) / 1e9 if flops else None,
        })
    if reference is not None and s.fidelity:
        fidelity_against(results, contenders, reference, s, say)
    return results


def fidelity_against(results, contenders, reference: Contender, s: Settings, say: ProgressFn) -> None:
    """Cosine and neighbour agreement of each contender's primary output vs the reference's, on three sets."""
    from bertopt.data import corpus
    from bertopt.measure.compare import compare_output

    texts = corpus() if s.corpus_texts is None else corpus()[: s.corpus_texts]
    sets = {"corpus": (texts, None, None), "padded": (padded_texts(s.padded_texts), s.seq_len, s.seq_len),
            "mixed": (mixed_texts(s.mixed_texts), None, None)}
    ref_out = {}
    for key, (texts, length, pad) in sets.items():
        say(f"fidelity reference on {key}")
        pred = reference.at_length(length) if length else reference.predictor
        ref_out[key] = pred.run(texts, outputs=[pred.primary_output], pad_to=pad)[pred.primary_output]
    for res, c in zip(results, contenders):
        res["fidelity"] = {}
        for key, (texts, length, pad) in sets.items():
            say(f"fidelity {c.name} on {key}")
            pred = c.at_length(length) if length else c.predictor
            name = pred.primary_output
            # the reference against itself is exact by definition; do not run it twice
            got = ref_out[key] if c is reference else pred.run(texts, outputs=[name], pad_to=pad)[name]
            kind = pred.outputs[name].get("kind", "embedding")
            stats = compare_output(name, kind, got, ref_out[key])
            res["fidelity"][key] = {k: stats[k] for k in ("cos_mean", "cos_min", "neighbour_agreement_at_10",
                                                          "max_abs", "nan_or_inf") if k in stats}
    task_fidelity_against(results, contenders, reference, sets["corpus"][0], say)


def task_fidelity_against(results, contenders, reference: Contender, texts: list[str], say: ProgressFn) -> None:
    """The task's own figures on the corpus (top-1 / entity F1 / NDCG@10 / term overlap; bertopt.measure.
    fidelity) in ``fidelity["task"]``; nothing for sentence embeddings (cosine says it all)."""
    from bertopt.measure.fidelity import rerank_pairs, task_fidelity
    from bertopt.runtime.tasks import task_of, task_output

    task = task_of(reference.predictor.model)
    if task == "embedding":
        return
    pairs = None
    if task == "rerank":
        texts, pairs = rerank_pairs(texts)
    say(f"{task} fidelity reference")
    ref_name = task_output(reference.predictor.model, task)
    want = reference.predictor.run(texts, pairs, outputs=[ref_name])[ref_name]
    for res, c in zip(results, contenders):
        say(f"{task} fidelity {c.name}")
        name = task_output(c.predictor.model, task)
        got = want if c is reference else c.predictor.run(texts, pairs, outputs=[name])[name]
        res["fidelity"]["task"] = {"task": task, **task_fidelity(task, c.predictor, texts, pairs, got, want)}


def task_figures(fidelity: dict[str, Any]) -> str:
    """The task's fidelity figures in a few characters, for tables."""
    t = fidelity.get("task") if fidelity else None
    if not t:
        return "-"
    short = {"top1_agreement": "top1", "max_prob_diff": "dprob", "token_label_agreement": "tok",
             "entity_f1": "F1", "ndcg_at_10": "ndcg", "spearman": "rho", "term_overlap_at_10": "terms"}
    return " ".join(f"{short[k]} {v:.3f}" for k, v in t.items() if k in short)


def add_ratios(results: list[dict[str, Any]], baseline: str, key: str) -> None:
    """``result['vs'][key]``: padded/mixed throughput ratios and latency ratio to the named baseline."""
    base = next((r for r in results if r["name"] == baseline), None)
    if base is None:
        return
    for r in results:
        r.setdefault("vs", {})[key] = {
            "padded": r["padded_texts_per_s"] / base["padded_texts_per_s"],
            "mixed": r["mixed_texts_per_s"] / base["mixed_texts_per_s"],
            "latency_p50": r["latency_p50_ms"] / base["latency_p50_ms"],
        }


def results_tables(results: list[dict[str, Any]], settings: Settings, title: str, ratio_keys: Sequence[str] = ()):
    """The results as tables of a few columns each (speed; ratios to the references; cosine fidelity; the task's
    own figures where a model has a task), so that each reads on an 80-column terminal once laid out with
    ``bertopt.terminal.whole_cells``."""
    from rich.table import Table

    def table(name: str, caption: str, cols: list[str]) -> Table:
        t = Table(title=f"{title}: {name}", title_justify="left", caption=caption, caption_justify="left")
        for col in cols:
            text = col in ("contender", "runtime", "precision", "task")  # left; numbers right
            t.add_column(col, justify="left" if text else "right")
        return t

    speed = table("speed", f"(a) batch {settings.batch_size} padded to {settings.seq_len} tokens, texts/s; (b) "
                  f"mixed-length text, length-bucketed batches of {settings.batch_size}, texts/s; p50/p99: batch 1, "
                  f"{settings.latency_seq_len} tokens; GFLOP/s on (a)",
                  ["contender", "runtime", "precision", "(a) /s", "(b) /s", "p50 ms", "p99 ms", "GFLOP/s"])
    ratios = table("ratios", "x: throughput over the reference's (higher is faster); /: batch-1 p50 latency over the "
                   "reference's (lower is faster)",
                   ["contender"] + [c for key in ratio_keys for c in (f"(a) x {key}", f"(b) x {key}", f"p50 / {key}")])
    fidelity = table("fidelity", "cosine of the primary output vs the reference on the built-in corpus (mean, min), "
                     "on (a) and (b) (min); nbr@10: neighbour agreement@10 (corpus)",
                     ["contender", "cos mean", "cos min", "cos min (a)", "cos min (b)", "nbr@10"])
    task = table("task fidelity", "the task's figures vs the reference on the corpus (top1: top-1 agreement, dprob: "
                 "largest probability difference, tok: token-label agreement, F1: entity F1, ndcg: NDCG@10, rho: "
                 "Spearman, terms: term overlap@10)", ["contender", "task"])
    for r in results:
        speed.add_row(r["name"], str(r.get("backend", "")), str(r.get("precision", "")),
                      f"{r['padded_texts_per_s']:.1f}", f"{r['mixed_texts_per_s']:.1f}", f"{r['latency_p50_ms']:.2f}",
                      f"{r['latency_p99_ms']:.2f}",
                      f"{r['padded_gflop_per_s']:.0f}" if r.get("padded_gflop_per_s") else "-")
        row = [r["name"]]
        for key in ratio_keys:
            v = r.get("vs", {}).get(key)
            row += [f"{v['padded']:.2f}", f"{v['mixed']:.2f}", f"{v['latency_p50']:.2f}"] if v else ["-"] * 3
        ratios.add_row(*row)
        f = r.get("fidelity")
        if f:
            nan = float("nan")  # a rerank score has no cosine: its figures are in the task table
            fidelity.add_row(r["name"], f"{f['corpus'].get('cos_mean', nan):.6f}",
                             f"{f['corpus'].get('cos_min', nan):.6f}", f"{f['padded'].get('cos_min', nan):.5f}",
                             f"{f['mixed'].get('cos_min', nan):.5f}",
                             f"{f['corpus'].get('neighbour_agreement_at_10', nan):.3f}")
        else:
            fidelity.add_row(r["name"], *["-"] * 5)
        task.add_row(r["name"], task_figures(f))
    tasks = any(r.get("fidelity") and r["fidelity"].get("task") for r in results)
    return [speed, *([ratios] if ratio_keys else []), fidelity, *([task] if tasks else [])]


def print_results(results: list[dict[str, Any]], settings: Settings, title: str, console,
                  ratio_keys: Sequence[str] = ()) -> None:
    from bertopt.terminal import whole_cells

    for table in results_tables(results, settings, title, ratio_keys):
        console.print(whole_cells(table, console))


BENCH_HELP = ("Measure artifacts through the Predictor: throughput at batch 32 padded to 128 tokens, on mixed-length "
              "text (length-bucketed), batch-1 latency p50/p99; interleaved rounds, medians. Speed is noisy on a "
              "shared machine: compare the ratios of contenders measured in the same run.")


def _bench(config) -> None:
    from rich.console import Console

    console = Console(emoji=False)
    settings = Settings(**SETTINGS_FIELDS.kwargs(config))
    artifacts = [Path(a) for a in config["artifacts"]]
    json_out = Path(config["json_out"]) if config["json_out"] else None
    threads, runtime, batch_size = config["threads"], config["runtime"], config["batch_size"]
    if json_out is not None:  # before the measurement: never a finished bench lost to an unwritable path
        from bertopt.output_paths import check_output

        check_output(json_out, kind="json", inputs=artifacts, flag="--json")
    names = [p.name for p in artifacts]
    if len(set(names)) != len(names):
        names = [str(p) for p in artifacts]
    with console.status("loading ...") as status:
        contenders = [contender_for_artifact(p, name=n, threads=threads, runtime=runtime, batch_size=batch_size)
                      for p, n in zip(artifacts, names)]
        ref = None
        if config["reference"]:
            first = contenders[0].predictor.artifact
            if not first.source:
                raise UserError(f"{first.path} records no source model to compare with; drop --reference")
            ref = reference_contender(first, threads=threads, batch_size=batch_size)
            contenders = [ref, reference_contender(first, bf16=True, threads=threads, batch_size=batch_size),
                          *contenders]
        results = measure(contenders, settings, reference=ref, progress=lambda m: status.update(m))
    ratio_keys = []
    if ref is not None:
        add_ratios(results, "PyTorch fp32", "pt-fp32")
        add_ratios(results, "PyTorch bf16 autocast", "pt-bf16")
        ratio_keys = ["pt-fp32", "pt-bf16"]
    print_results(results, settings, "bertopt bench", console, ratio_keys)
    if json_out is not None:
        from dataclasses import asdict

        from bertopt.machine import machine_info
        from bertopt.output_paths import write_json

        write_json(json_out, {"settings": asdict(settings), "machine": machine_info(), "results": results})
        console.print(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    app.command("bench", help=BENCH_HELP)(typer_command("bench", BENCH_PARAMS, _bench, help=BENCH_HELP))
