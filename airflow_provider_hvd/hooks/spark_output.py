"""Spark's own output (the driver JVM's stdout and stderr) as ``logging`` records at the level each line has.

Left alone, the JVM writes to the task's stderr, which Airflow records as errors: every run's log would show
Spark's start-up notices as ERROR lines. Here the JVM is started with its output piped, and each line is
logged under the ``spark`` logger: log4j's lines at their own level (``WARN`` as a warning) under
``spark.<log4j logger>``, the JVM's ``WARNING:`` notices as warnings, the rest (Spark's start-up banner, the
output of executors that run in the driver's JVM on a local master) as info, an uncaught JVM exception as
an error.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from airflow_provider_hvd.runner.spark import summary

if TYPE_CHECKING:
    from py4j.java_gateway import JavaGateway
    from pyspark import SparkConf

LOGGER = "spark"
# log4j's layout in Spark's default profile: "%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex"
_LOG4J = re.compile(r"\d{2}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) ([^:\s]+): ?(.*)")
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
# lines that carry on the record above them: a stack trace (its exception, frames and causes), a call site
_CONTINUATION = re.compile(
    r"\s|Caused by: |Suppressed: |\.\.\. \d+ more"
    r"|[\w$.]+(?:Exception|Error|Throwable)\b"  # org.apache.spark.SparkException: ...
    r"|[\w$./<>-]+\((?:[\w$.-]+:\d+|Native Method|Unknown Source)\)$"  # a frame without "at "
)


class SparkStartError(RuntimeError):
    """The Spark driver's JVM exited before its gateway was up; the message is the JVM's own reason."""


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
        elif line.startswith("Exception in thread "):  # the JVM's last words
            last = (LOGGER, logging.ERROR)
            yield (*last, line)
        else:
            last = None
            yield LOGGER, logging.WARNING if line.startswith("WARNING: ") else logging.INFO, line


class _Relay(threading.Thread):
    """Logs what the JVM writes to a pipe, keeping the last lines to explain a JVM that did not start."""

    def __init__(self, read_fd: int) -> None:
        super().__init__(name="spark-output", daemon=True)
        self._read_fd = read_fd
        self.last_lines: deque[str] = deque(maxlen=50)

    def _lines(self) -> Iterator[str]:
        with open(self._read_fd, "rb") as stream:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace")
                self.last_lines.append(line.strip())
                yield line

    def run(self) -> None:
        for name, level, message in classify(self._lines()):
            logging.getLogger(name).log(level, "%s", message)

    def reason(self) -> str:
        """Why the JVM exited, in its own words: its last exception or error line."""
        lines = summary("\n".join(self.last_lines)).splitlines() if any(self.last_lines) else []
        errors = [line for line in lines if re.search(r"Exception|Error", line)]
        said = errors[-1] if errors else lines[-1] if lines else ""
        return summary(said, first_line=True) if said else ""


def launch_logged_gateway(conf: SparkConf) -> JavaGateway | None:
    """Start pyspark's JVM gateway with ``conf``, its output relayed to ``logging``; None if one is running.

    Called before the SparkSession is built: pyspark starts one gateway per process and reuses it.
    Raises SparkStartError with the JVM's own reason when it exits before the gateway is up.
    """
    from pyspark import SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return None
        read_fd, write_fd = os.pipe()
        relay = _Relay(read_fd)
        relay.start()  # read from the start: a JVM with much to say would block on a full pipe
        try:
            gateway = launch_gateway(conf, popen_kwargs={"stdout": write_fd, "stderr": write_fd})  # type: ignore[no-untyped-call]
        except Exception as exc:
            os.close(write_fd)
            relay.join(timeout=5)  # the JVM is gone: its last lines are in
            raise SparkStartError(f"the Spark driver's JVM exited: {relay.reason() or exc}") from exc
        os.close(write_fd)  # the JVM holds its own copy; the relay ends when the JVM does
        SparkContext._ensure_initialized(gateway=gateway)
        return gateway


def stop_gateway(gateway: JavaGateway) -> None:
    """End a gateway from :func:`launch_logged_gateway` once its SparkContext has stopped.

    The next SparkContext of this process starts a JVM of its own, with its own driver settings
    (``spark.driver.memory``...: a running JVM would ignore them), instead of one that outlived its task.
    """
    from pyspark import SparkContext

    with SparkContext._lock:
        if SparkContext._active_spark_context is not None or SparkContext._gateway is not gateway:
            return  # in use by someone else
        SparkContext._gateway = None
        SparkContext._jvm = None
    assert gateway is not None  # (the comparison above left mypy thinking it may be SparkContext's None)
    gateway.shutdown()
    gateway.proc.stdin.close()  # the JVM ends when its stdin closes
    try:
        gateway.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        gateway.proc.kill()
        gateway.proc.wait()
