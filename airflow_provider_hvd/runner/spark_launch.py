"""Spark strategy (``np > 0``): a barrier job of ``np`` tasks, each running one rank agent."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .agent import AgentArgs, run_agent
from .errors import LaunchError
from .local_launch import LOOPBACK
from .slots import DEFAULT_SLOT_WAIT_S, wait_for_slots

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession


def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``...: the executors are threads of the driver's JVM, on this host."""
    return master.startswith("local")


def default_executor_python(master: str) -> None:
    """On a local master the executors run on this host: give them this interpreter unless told otherwise."""
    if is_local(master):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def active_session() -> SparkSession:
    """The active SparkSession, or a new one on ``local[*]`` when there is none."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None and SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.getOrCreate()
    if spark is None:
        default_executor_python("local[*]")
        spark = SparkSession.builder.master("local[*]").appName("HorovodRunner").config(
            "spark.ui.showConsoleProgress", "false"  # a progress bar is noise in a task log
        ).getOrCreate()
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        raise LaunchError(
            "HorovodRunner(np>0) needs a classic SparkSession (a barrier job on a SparkContext); the active "
            "session is a Spark Connect one (sc://). Use a spark://, yarn, k8s:// or local master, or np<0."
        )
    return spark


def _barrier_task(args: AgentArgs) -> Callable[[Iterator[Any]], Iterator[str]]:
    def task(_: Iterator[Any]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        info = {
            "partition": ctx.partitionId(),
            "attempt": ctx.attemptNumber(),
            "executor": ctx.getTaskInfos()[ctx.partitionId()].address,
        }
        yield json.dumps(run_agent(args, task=info))

    return task


class SparkLauncher:
    """Runs the agents as a Spark barrier job; the rank processes are children of the Python workers."""

    def __init__(
        self,
        spark: SparkSession,
        size: int,
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.sc = spark.sparkContext
        self.size = size
        self.slot_wait_timeout = slot_wait_timeout
        self.cancelled = cancelled
        self.group = f"horovod-runner-{uuid.uuid4().hex[:12]}"
        self.local = is_local(self.sc.master)
        self.driver_host = LOOPBACK if self.local else socket.gethostbyname(
            self.sc.getConf().get("spark.driver.host") or socket.gethostname()
        )
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def describe(self) -> str:
        return f"a Spark barrier job of {self.size} tasks on {self.sc.master}"

    def check_slots(self) -> None:
        """Wait (bounded) until the application has ``size`` task slots; refuse a job that can never fit."""
        wait_for_slots(self.sc, self.size, self.slot_wait_timeout, self.cancelled)

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        # local executors' stderr is the driver's own: relayed lines would show twice
        return AgentArgs(host, port, secret, relay_output=verbosity == "all", echo_output=True, echo_relayed=not self.local)

    def _run_job(self, args: AgentArgs) -> None:
        try:
            self.sc.setJobGroup(self.group, f"HorovodRunner: {self.size} ranks", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.size), self.size)
            rdd.barrier().mapPartitions(_barrier_task(args)).collect()
        except BaseException as exc:  # noqa: BLE001 - surfaced through failure()
            self._failure = exc

    def start(self, args: AgentArgs) -> None:
        self._thread = threading.Thread(target=self._run_job, args=(args,), name="hvd-spark-job", daemon=True)
        self._thread.start()

    def failure(self) -> BaseException | None:
        return self._failure

    def stop(self, cancel: bool) -> None:
        """Wait for the barrier job to end; cancel it first when the run did not complete."""
        if self._thread is None:
            return
        if not cancel:
            self._thread.join(timeout=30)  # the tasks are returning
        if self._thread.is_alive():
            self.sc.cancelJobGroup(self.group)
        self._thread.join(timeout=60)
