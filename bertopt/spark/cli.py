"""``bertopt spark-predict``: batch inference over a table with Spark (heavy imports inside the command)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bertopt.messages import MAX_TEXT_CHARS
from bertopt.params import BATCH_SIZE, MAX_SEQ_LEN
from bertopt.spark.udf import SPARK_PROVIDER

HELP = (
    "Run an artifact over a table with Spark and write Parquet with the input columns plus the predictions.\n\n"
    "A row whose text is null, empty, not valid UTF-8 or over --max-text-chars gets null predictions and the reason "
    "in the 'error' column (null where the row was predicted), never a failed job. The model is loaded once per "
    "Python worker and reused for every batch and task; on CPU each task gets (cores / concurrent tasks) threads, "
    "with GPUs partition i runs on GPU i mod #GPUs. Progress is shown per Spark task; rows/s is printed at the end.\n\n"
    "Example: [bold]bertopt spark-predict -a art/int8 -i reviews.parquet -o reviews-emb.parquet --text-col body "
    "--master local[2][/]\n\n"
    "On a cluster the executors must read the artifact: give a path on a shared file system, or pass --ship "
    "(zipped and sent with SparkContext.addArchive); see docs/spark.md."
)


def register(app: typer.Typer) -> None:
    @app.command("spark-predict", help=HELP)
    def spark_predict_command(
        artifact: Path = typer.Option(..., "--artifact", "-a", help="Artifact folder to run (every executor must "
                                      "be able to read it, or pass --ship)."),
        input: str = typer.Option(..., "--input", "-i", help="Parquet, CSV (with a header) or text file (one text "
                                  "per line), or a folder of them."),
        output: Path = typer.Option(..., "--output", "-o", help="Parquet folder to write: the input columns plus "
                                    "one column per prediction."),
        text_col: str = typer.Option("text", "--text-col", help="Column holding the text (text files: the name "
                                     "given to their single column)."),
        pair_col: Optional[str] = typer.Option(None, "--pair-col", help="Second text column, for sentence-pair "
                                               "models."),
        master: str = typer.Option("local[2]", "--master", help="Spark master URL: local[N] runs N tasks in this "
                                   "machine; spark://host:7077, yarn, k8s://... for a cluster."),
        partitions: Optional[int] = typer.Option(None, "--partitions", min=1, help="Repartition the input into N parts "
                                                 "(default: at least one per task slot)."),
        batch_size: int = BATCH_SIZE.typer_option(),
        max_seq_len: Optional[int] = MAX_SEQ_LEN.typer_option(),
        fmt: str = typer.Option("auto", "--format", help="Input format: auto (from the file name), parquet, csv, "
                                "text."),
        outputs: Optional[str] = typer.Option(None, "--outputs", help="Comma-separated outputs to add (default: "
                                              "the task's result: the sentence embedding; logits,label,confidence "
                                              "for classifiers; entities for token classification; score for "
                                              "rerank, with --pair-col; sparse for SPLADE)."),
        prefix: str = typer.Option("", "--prefix", help="Prefix for the prediction column names."),
        ship: bool = typer.Option(False, "--ship", help="Zip the artifact and send it to the executors with "
                                  "SparkContext.addArchive (for clusters without a shared file system)."),
        provider: str = SPARK_PROVIDER.typer_option(),
        force: bool = typer.Option(False, "--force", help="Replace an existing --output."),
        aggregation: str = typer.Option("simple", "--aggregation", help="Token classification: how tokens become "
                                        "entities, as in the transformers pipeline: none, simple, first, average, "
                                        "max."),
        sparse_format: str = typer.Option("struct", "--sparse-format", help="SPLADE models: 'struct' "
                                          "(indices and values arrays) or 'vector' (Spark ML SparseVector)."),
        max_text_chars: int = typer.Option(MAX_TEXT_CHARS, "--max-text-chars", min=1, help="Longer texts get no "
                                           "prediction and the reason in the 'error' column (the model reads "
                                           "only its first --max-seq-len tokens anyway)."),
    ) -> None:
        """Run an artifact over a table with Spark and write Parquet with the predictions appended."""
        import warnings

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from bertopt.spark.job import spark_predict
        from bertopt.terminal import console

        # pyspark warns about pandas 3 on every UDF; it works, and the warning would bury the progress bar
        warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
        names = [o.strip() for o in outputs.split(",") if o.strip()] if outputs else None
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("spark-predict: starting Spark", total=None)

            def report(done: int, total: int) -> None:
                progress.update(task, description="spark-predict: tasks", completed=done, total=total)

            result = spark_predict(artifact, input, output, text_col=text_col, pair_col=pair_col, master=master,
                                   partitions=partitions, batch_size=batch_size, max_seq_len=max_seq_len, fmt=fmt,
                                   outputs=names, prefix=prefix, force=force, ship=ship, provider=provider,
                                   progress=report, aggregation=aggregation, sparse_format=sparse_format,
                                   max_text_chars=max_text_chars)
        console.print(f"[green]wrote[/] {result['output']}: {result['rows']} rows ({result['null_rows']} without a "
                      f"prediction: see column '{prefix}error'), columns + "
                      f"{', '.join(prefix + o for o in result['outputs'])}, {prefix}error")
        console.print(f"{result['rows_per_s']:.1f} rows/s ({result['rows']} rows in {result['seconds']:.1f} s on "
                      f"{result['master']}, {result['partitions']} partitions; Spark start-up "
                      f"{result['startup_s']:.1f} s)")
