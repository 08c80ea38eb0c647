"""Spark's own output (the driver JVM's stdout and stderr) as ``logging`` records at the level each line has.

Left alone, the JVM writes to the task's stderr, which Airflow records as errors: every run's log would show
Spark's start-up notices as ERROR lines. Here the JVM is started with its output piped, and each line is
logged under the ``spark`` logger: log4j's lines at their own level (``WARN`` as a warning) under
``spark.<log4j logger>``, the JVM's ``WARNING:`` notices as warnings, the rest (Spark's start-up banner, the
output of executors that run in the driver's JVM on a local master) as info.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark import SparkConf

LOGGER = "spark"
# log4j's layout in Spark's default profile: "%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex"
_LOG4J = re.compile(r"\d{2}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) ([^:\s]+): ?(.*)")
_LEVELS = {
    "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
    "WARN": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL,
}
# lines that carry on the record above them: a stack trace (its exception, frames and causes), a call site
_CONTINUATION = re.compile(
    r"\s|Caused by: |Suppressed: |\.\.\. \d+ more"
    r"|[\w$.]+(?:Exception|Error|Throwable)\b"  # org.apache.spark.SparkException: ...
    r"|[\w$./<>-]+\((?:[\w$.-]+:\d+|Native Method|Unknown Source)\)$"  # a frame without "at "
)


def classify(lines: Iterable[str]) -> Iterable[tuple[str, int, str]]:
    """``(logger, level, message)`` for each line of JVM output; a stack trace keeps its record's level."""
    last: tuple[str, int] | None = None
    for raw in lines:
        line = raw.rstrip("\r\n").rsplit("\r", 1)[-1]  # a console progress bar redraws itself with \r
        if not line.strip():
            continue
        match = _LOG4J.fullmatch(line)
        if match is not None:
            last = (f"{LOGGER}.{match.group(2)}", _LEVELS[match.group(1)])
            yield (*last, match.group(3))
        elif last is not None and _CONTINUATION.match(line):
            yield (*last, line)
        else:
            last = None
            yield LOGGER, logging.WARNING if line.startswith("WARNING: ") else logging.INFO, line


def _relay(stream: Iterable[bytes]) -> None:
    lines = (raw.decode("utf-8", errors="replace") for raw in stream)
    for name, level, message in classify(lines):
        logging.getLogger(name).log(level, "%s", message)


def launch_logged_gateway(conf: SparkConf) -> None:
    """Start pyspark's JVM gateway with ``conf``, its output relayed to ``logging``; no-op if one is running.

    Called before the SparkSession is built: pyspark starts one gateway per process and reuses it.
    """
    from pyspark import SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        gateway = launch_gateway(conf, popen_kwargs={"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT})
        SparkContext._ensure_initialized(gateway=gateway)
    threading.Thread(target=_relay, args=(gateway.proc.stdout,), name="spark-output", daemon=True).start()
