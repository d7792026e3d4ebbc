"""A Spark session set up for bertopt, and turning errors raised on executors into one-line UserErrors."""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager

from bertopt.errors import UserError, require

# A bertopt error raised inside a Python worker reaches the driver as a Java/Python exception whose text
# holds the worker's traceback; its last "bertopt.errors.X: message" line is what the user needs to see.
_WORKER_ERROR = re.compile(r"bertopt\.errors\.(?:UserError|ArtifactError|MissingDependency|MissingRuntime): ([^\n]+)")


def is_local(master: str) -> bool:
    return master.strip().startswith("local")


# the forms SparkContext accepts (it refuses anything else after starting the JVM)
_MASTER = re.compile(r"local(\[(\*|\d+)(,\s*\d+)?\])?|local-cluster\[.+\]|yarn|(spark|k8s|mesos)://\S+")


def get_session(master: str = "local[2]", app_name: str = "bertopt", conf: dict[str, str] | None = None):
    """A SparkSession (the active one if it exists, else a new one) tuned for model inference.

    Local masters bind the driver to 127.0.0.1 and run Python workers with this interpreter (the one that
    has bertopt installed). Python worker reuse is switched on explicitly: bertopt's per-process model cache
    (and Spark's own ModelCache) only avoid re-loading the model when workers outlive a task.
    """
    if not _MASTER.fullmatch(str(master)):  # said before the JVM starts (it prints a stack trace of its own)
        raise UserError(f"--master {master!r} is not a Spark master; give local[N], spark://HOST:PORT, yarn or "
                        "k8s://URL")
    require("pyspark", "spark", "Spark batch inference")
    from pyspark.sql import SparkSession

    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.python.worker.reuse": "true",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.shuffle.partitions": "4",
    }
    if is_local(master):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no "hostname resolves to loopback" probing
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        settings["spark.driver.host"] = "127.0.0.1"
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start (a malformed --master, no Java): py4j / pyspark errors only
        if type(exc).__module__.split(".")[0] not in ("pyspark", "py4j"):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"Spark did not start with --master {master!r} ({first[:200]}); give local[N], "
                        "spark://HOST:PORT, yarn or k8s://URL, and check that Java 17 is installed") from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def worker_reuse_enabled(spark) -> bool:
    return spark.sparkContext.getConf().get("spark.python.worker.reuse", "true").lower() == "true"


def bertopt_error_in(exc: BaseException) -> str | None:
    """The message of a bertopt UserError raised on an executor, if ``exc`` carries one."""
    found = _WORKER_ERROR.findall(str(exc))
    return found[-1].strip() if found else None


@contextmanager
def worker_errors():
    """Run Spark actions; a bertopt UserError raised on an executor becomes a UserError on the driver."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # Py4JJavaError / PythonException / SparkException carry the worker's traceback
        message = bertopt_error_in(exc)
        if message is None:
            raise
        raise UserError(message) from None
