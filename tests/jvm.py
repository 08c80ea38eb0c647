"""Cheaper JVM starts for the tests: the suite starts about 120 Spark JVMs (drivers, masters, workers,
executors), and on 2 cores their start-up was the largest share of its CPU time (docs/development.md).

- Spark's classes come from a class-data-sharing archive made once from a real local session (JDK 17's
  dynamic CDS), instead of being parsed and verified again by every JVM;
- the client compiler only (``TieredStopAtLevel=1``) and the serial collector: the tests' JVMs live seconds
  to minutes and run little code, where C2's and G1's threads cost more than they save.

Neither changes what Spark does. The archive is kept under ~/.cache/airflow-provider-hvd, one per Java and
pyspark version and Spark jar set; a JVM whose archive does not match just loads its classes the usual way.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pyspark

_LEAN = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
_QUIET = "-Xlog:cds*=off"  # nothing from CDS on the JVM's output, which the task logs show
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "airflow-provider-hvd" / "jvm"

# a local session that runs a Python job, then lets its JVM exit normally: the archive is written at that exit
_MAKE_ARCHIVE = """
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
assert spark.sparkContext.parallelize(range(100), 2).map(lambda x: x + 1).sum() == 5050
gateway = spark.sparkContext._gateway
spark.stop()
gateway.proc.stdin.close()  # the gateway JVM exits once its standard input closes
gateway.proc.wait(300)
"""


def _archive_path() -> Path:
    java_home = os.environ.get("JAVA_HOME")  # the Java that Spark's scripts start, as they pick it
    java_bin = os.path.join(java_home, "bin", "java") if java_home else "java"
    java = subprocess.run([java_bin, "-version"], capture_output=True, text=True).stderr
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    key = hashlib.sha256("\n".join([java, pyspark.__version__, *jars]).encode()).hexdigest()[:16]
    return _CACHE / f"spark-{pyspark.__version__}-{key}.jsa"


def _make_archive(path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # this process's own: test runs at once may share the cache
    env = {**os.environ, "SPARK_SUBMIT_OPTS": " ".join([*_LEAN, _QUIET, f"-XX:ArchiveClassesAtExit={tmp}"])}
    try:
        done = subprocess.run([sys.executable, "-c", _MAKE_ARCHIVE], env=env, capture_output=True, timeout=600)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or not os.path.exists(tmp):
        if os.path.exists(tmp):
            os.unlink(tmp)
        return False
    os.replace(tmp, path)  # whole or absent
    return True


def lean_jvm_options() -> str:
    """The options for the tests' JVMs; the CDS archive is made on first use (about half a minute)."""
    path = _archive_path()
    if path.exists() or _make_archive(path):
        return " ".join([*_LEAN, f"-XX:SharedArchiveFile={path}", _QUIET])
    return " ".join(_LEAN)


def use_lean_jvms() -> None:
    """Every Spark driver this process or its children start (spark-submit reads ``SPARK_SUBMIT_OPTS``) gets
    :func:`lean_jvm_options`; the standalone clusters pass them on with :func:`daemon_env`."""
    os.environ["SPARK_SUBMIT_OPTS"] = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {lean_jvm_options()}".strip()


def daemon_env() -> dict[str, str]:
    """For a standalone master or worker: the drivers' options for it and the executors it starts (every JVM
    reads ``JAVA_TOOL_OPTIONS``; the notice it prints goes to the daemons' and executors' own logs)."""
    return {"JAVA_TOOL_OPTIONS": os.environ["SPARK_SUBMIT_OPTS"]} if "SPARK_SUBMIT_OPTS" in os.environ else {}
