"""``bertopt spark-predict`` options, declared once: the command line is built from them (``params.typer_command``)
and ``spark_predict`` (the API) checks its keyword arguments against the same ones."""

from __future__ import annotations

from bertopt.messages import MAX_TEXT_CHARS_PARAM
from bertopt.params import BATCH_SIZE, MAX_SEQ_LEN, Param
from bertopt.spark.udf import SPARK_LONG_INPUTS, SPARK_PROVIDER

SPARK_PREDICT_PARAMS = [
    Param("artifact", str, None, "Artifact folder to run (every executor must be able to read it, or pass --ship).",
          positional=True, required=True, deprecated_flags=("--artifact", "-a")),
    Param("input", str, None, "Parquet, CSV (with a header) or text file (one text per line), or a folder of them.",
          required=True, aliases=("-i",)),
    Param("output", str, None, "Parquet folder to write: the input columns plus one column per prediction.",
          required=True, aliases=("-o",)),
    Param("text_col", str, "text", "Column holding the text (text files: the name given to their single column)."),
    Param("pair_col", str, None, "Second text column, for sentence-pair models."),
    Param("master", str, "local[2]", "Spark master URL: local[N] runs N tasks in this machine; spark://host:7077, "
          "yarn, k8s://... for a cluster."),
    Param("partitions", int, None, "Repartition the input into N parts (default: at least one per task slot).",
          min=1),
    BATCH_SIZE,
    MAX_SEQ_LEN,
    SPARK_LONG_INPUTS,
    Param("fmt", str, "auto", "Input format: auto (from the file name), parquet, csv, text.", flag="--format"),
    Param("outputs", list, None, "Comma-separated outputs to add (default: the task's result: the sentence "
          "embedding; logits,label,confidence for classifiers; entities for token classification; score for rerank, "
          "with --pair-col; sparse for SPLADE)."),
    Param("prefix", str, "", "Prefix for the prediction column names."),
    Param("ship", bool, False, "Zip the artifact and send it to the executors with SparkContext.addArchive (for "
          "clusters without a shared file system).", negatable=False),
    SPARK_PROVIDER,
    Param("force", bool, False, "Replace an existing --output.", negatable=False),
    Param("aggregation", str, "simple", "Token classification: how tokens become entities, as in the transformers "
          "pipeline: none, simple, first, average, max."),
    Param("sparse_format", str, "struct", "SPLADE models: 'struct' (indices and values arrays) or 'vector' (Spark ML "
          "SparseVector)."),
    MAX_TEXT_CHARS_PARAM.with_(help="Longer texts get no prediction and the reason in the 'error' column (the model "
                               "reads only its first --max-seq-len tokens anyway)."),
]
