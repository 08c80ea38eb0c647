"""The Spark application a run's barrier job runs in, as :mod:`.barrier` sees it: a classic SparkContext
(here) or a Spark Connect session (:mod:`.connect`). Only what differs between the two is behind this seam:
the conf, the driver's address, the slot count, how the job reaches the tasks, how the barrier job is
submitted and cancelled, what Spark says of its tasks. The tasks, the agents and the failure rules are shared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ..address import DriverAddress, spark_driver_address
from .capacity import wait_for_slots
from .cluster import is_connect, is_local
from .status import BarrierJobStatus, Task

if TYPE_CHECKING:
    from pyspark import Broadcast, SparkContext
    from pyspark.sql import SparkSession

BarrierTask = Callable[[Iterator[Any]], Iterator[str]]  # a partition's agents; yields how each ended (JSON)


class JobStatus(Protocol):
    """What Spark says of the barrier job's tasks (:class:`.status.BarrierJobStatus`)."""

    failed: dict[Task, str]

    def poll(self) -> None: ...
    def first_failure(self) -> str | None: ...
    def reason(self, task: Task) -> str | None: ...
    def tasks_active(self) -> bool: ...
    def tasks_running(self) -> bool:
        """Whether tasks of the job are known to run now (a cancelled job ends before its tasks do)."""


class SparkApp(Protocol):
    """One Spark application, classic or over Spark Connect, as the launcher uses it."""

    master: str
    local: bool  # the executors are threads of the application's driver JVM (this one's, or the Connect server's)
    shares_stderr: bool  # the executors' stderr is this process's: relayed rank lines are not echoed there too
    status: JobStatus

    def conf(self, key: str) -> str | None: ...
    def where(self) -> str:
        """Where the job runs, for the texts: ``on local[2]``, ``over Spark Connect sc://host:port (local[2])``."""

    def driver_address(self) -> DriverAddress: ...
    def check_slots(self, tasks: int, timeout: float, cancelled: Callable[[], bool]) -> None: ...
    def ship(self, payload: bytes) -> Callable[[], bytes]:
        """Hand the pickled job to Spark; the task's way to read it (pickled into the task)."""

    def run_barrier(self, tasks: int, task: BarrierTask, tag: str, description: str) -> None:
        """Run ``task`` in a barrier job of ``tasks`` tasks, cancellable by ``tag``; returns when it ends."""

    def cancel(self, tag: str) -> None: ...
    def name_of(self, tag: str) -> str:
        """The job's handle in Spark's words: ``job group horovod-runner-...``, ``operation tag ...``."""

    def left_running(self, tag: str) -> str:
        """What of the run is left with a job that outlived its cancel, and how to end it, in words."""

    def unship(self, tasks_running: bool = False) -> None:
        """Drop the copies of the job that Spark holds for this run, where they can be dropped; with
        ``tasks_running``, only those that the tasks still running do not need."""

    def stopped(self) -> str | None:
        """Why the run cannot go on when the application has stopped; None while it runs."""


def read_broadcast(payload: Broadcast[bytes]) -> bytes:
    """The job from this executor's copy of the broadcast, not cached in this Python worker afterwards."""
    job = payload.value
    # pyspark caches the value in the Python worker, which Spark reuses for later tasks: no copy of the job
    # should stay there while the rank trains, nor after the run
    vars(payload).pop("_value", None)
    return job


class ClassicApp:
    """A SparkContext in this process: the job is a broadcast, the barrier job an RDD's in a job group."""

    def __init__(self, sc: SparkContext, group: str, naming: RunnerNaming = HOROVOD_RUNNER) -> None:
        self.sc = sc
        self.naming = naming
        self.master = sc.master or ""
        self.local = self.shares_stderr = is_local(self.master)
        self.status: JobStatus = BarrierJobStatus(sc, group)
        self._payload: Broadcast[bytes] | None = None

    def conf(self, key: str) -> str | None:
        return self.sc.getConf().get(key)

    def where(self) -> str:
        return f"on {self.sc.master}"

    def driver_address(self) -> DriverAddress:
        return spark_driver_address(self.conf, self.local, self.naming)

    def check_slots(self, tasks: int, timeout: float, cancelled: Callable[[], bool]) -> None:
        wait_for_slots(self.sc, tasks, timeout, cancelled, self.naming)

    def ship(self, payload: bytes) -> Callable[[], bytes]:
        self._payload = self.sc.broadcast(payload)  # Spark's copy (its driver-side blocks), the only one kept
        return functools.partial(read_broadcast, self._payload)

    def run_barrier(self, tasks: int, task: BarrierTask, tag: str, description: str) -> None:
        self.sc.setJobGroup(tag, description, interruptOnCancel=True)
        rdd = self.sc.parallelize(range(tasks), tasks)
        rdd.barrier().mapPartitions(task).collect()  # type: ignore[arg-type]  # the partition's ints go unread

    def cancel(self, tag: str) -> None:
        self.sc.cancelJobGroup(tag)  # (Spark's reason for the kills names the group: not a cause)

    def name_of(self, tag: str) -> str:
        return f"job group {tag}"

    def left_running(self, tag: str) -> str:
        return (
            f"SparkContext.cancelJobGroup({tag!r}) cancels it again. The job's broadcast is unpersisted, not "
            "destroyed, for the tasks that still run: Spark's clean-up drops it once the job is gone"
        )

    def unship(self, tasks_running: bool = False) -> None:
        if self._payload is not None:
            try:
                if tasks_running:  # a task reads the driver's copy: only the executors' cached copies go
                    self._payload.unpersist(blocking=False)
                else:
                    self._payload.destroy()  # the driver's and the executors' copies
            except Exception:  # noqa: BLE001 - the SparkContext may be gone, and its copies with it
                pass
            self._payload = None

    def stopped(self) -> str | None:
        try:
            stopped = self.sc._jsc is None or self.sc._jsc.sc().isStopped()
        except Exception:  # noqa: BLE001 - its JVM is gone too
            stopped = True
        if not stopped:
            return None
        return (
            f"the SparkContext on {self.sc.master} stopped while the ranks ran (stopped by the application, "
            "or the cluster manager ended the application: see Spark's log above)"
        )


def spark_app(spark: SparkSession, tag: str, naming: RunnerNaming = HOROVOD_RUNNER) -> SparkApp:
    """The application of ``spark``: a Spark Connect session's, or a classic session's SparkContext; its texts
    name the runner as ``naming`` says."""
    if is_connect(spark):
        from .connect import ConnectApp

        return ConnectApp(spark, tag, naming)  # type: ignore[arg-type]  # (is_connect: it is one)
    return ClassicApp(spark.sparkContext, tag, naming)
