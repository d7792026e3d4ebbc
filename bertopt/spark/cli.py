"""``bertopt spark-predict``: batch inference over a table with Spark (heavy imports inside the command)."""

from __future__ import annotations

from pathlib import Path

import typer

from bertopt.params import typer_command

HELP = (
    "Run an artifact over a table with Spark and write Parquet with the input columns plus the predictions.\n\n"
    "A row whose text is null, empty, not valid UTF-8 or over --max-text-chars gets null predictions and the reason "
    "in the 'error' column (null where the row was predicted), never a failed job. The model is loaded once per "
    "Python worker and reused for every batch and task; on CPU each task gets (cores / concurrent tasks) threads, "
    "with GPUs partition i runs on GPU i mod #GPUs. Progress is shown per Spark task; rows/s is printed at the end.\n\n"
    "Example: [bold]bertopt spark-predict art/int8 -i reviews.parquet -o reviews-emb.parquet --text-col body "
    "--master local[2][/]\n\n"
    "On a cluster the executors must read the artifact: give a path on a shared file system, or pass --ship "
    "(zipped and sent with SparkContext.addArchive); see docs/spark.md."
)


def _spark_predict(config) -> None:
    """Run an artifact over a table with Spark and write Parquet with the predictions appended."""
    import warnings

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bertopt.spark.job import spark_predict
    from bertopt.terminal import console

    # pyspark warns about pandas 3 on every UDF; it works, and the warning would bury the progress bar
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    kwargs = dict(config)
    artifact, input, output = Path(kwargs.pop("artifact")), kwargs.pop("input"), Path(kwargs.pop("output"))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("spark-predict: starting Spark", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, description="spark-predict: tasks", completed=done, total=total)

        result = spark_predict(artifact, input, output, progress=report, **kwargs)
    prefix = config["prefix"]
    console.print(f"[green]wrote[/] {result['output']}: {result['rows']} rows ({result['null_rows']} without a "
                  f"prediction: see column '{prefix}error'), columns + "
                  f"{', '.join(prefix + o for o in result['outputs'])}, {prefix}error")
    console.print(f"{result['rows_per_s']:.1f} rows/s ({result['rows']} rows in {result['seconds']:.1f} s on "
                  f"{result['master']}, {result['partitions']} partitions; Spark start-up "
                  f"{result['startup_s']:.1f} s)")


def register(app: typer.Typer) -> None:
    from bertopt.spark.params import SPARK_PREDICT_PARAMS

    app.command("spark-predict", help=HELP)(typer_command("spark-predict", SPARK_PREDICT_PARAMS, _spark_predict,
                                                          help=HELP))
