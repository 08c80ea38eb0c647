"""A classic SparkContext in this process as the barrier job's application (:class:`.app.SparkApp`): the job
travels as a broadcast, the barrier job is an RDD's in a job group, Spark's status store tells of its tasks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ...events import TaskCounts
from ..address import DriverAddress, spark_driver_address
from .app import BarrierTask, JobStatus, arrow_barrier
from .capacity import wait_for_slots
from .cluster import is_local
from .status import BarrierJobStatus

if TYPE_CHECKING:
    from pyspark import Broadcast, SparkContext
    from pyspark.sql import DataFrame


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
        self._job_stages: dict[int, list[int]] = {}  # (task_counts) each job's stages, as Spark planned them

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

    @contextlib.contextmanager
    def tagged(self, tag: str, description: str) -> Iterator[None]:
        # (the group stays this thread's afterwards: each thread the launcher starts runs one group's jobs)
        self.sc.setJobGroup(tag, description, interruptOnCancel=True)
        yield

    def run_barrier(
        self, tasks: int, task: BarrierTask, tag: str, description: str, inputs: DataFrame | None = None
    ) -> None:
        with self.tagged(tag, description):
            if inputs is not None:
                arrow_barrier(inputs, task, reads_input=True)
                return
            rdd = self.sc.parallelize(range(tasks), tasks)
            rdd.barrier().mapPartitions(task).collect()  # type: ignore[arg-type]  # the partition's ints go unread

    def task_counts(self, tag: str) -> TaskCounts | None:
        # a stage's status is written to Spark's status store as it starts and ends, its task counts only now and
        # then (a running stage may show none for seconds): a stage that runs is told by its status
        try:
            tracker = self.sc.statusTracker()
            store = self.sc._jsc.sc().statusStore()
            running = done = stages = 0
            for job in tracker.getJobIdsForGroup(tag):
                if job not in self._job_stages:
                    info = tracker.getJobInfo(job)
                    self._job_stages[job] = sorted(info.stageIds) if info is not None else []
                ids = self._job_stages[job]
                for stage_id in ids[:-1] if len(ids) > 1 else ids:  # (not a job's last stage: the barrier stage)
                    try:
                        stage = store.lastStageAttempt(stage_id)
                    except Exception:  # noqa: BLE001, S112 - submitted, not in the status store yet
                        continue
                    running += int(stage.numActiveTasks())
                    done += int(stage.numCompleteTasks())
                    stages += str(stage.status().toString()) == "ACTIVE"
        except Exception:  # noqa: BLE001 - the SparkContext stopped: its jobs went with it
            return None
        return TaskCounts(running, done, stages)

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
        payload, self._payload = self._payload, None
        if payload is not None:
            try:
                if tasks_running:  # a task reads the driver's copy: only the executors' cached copies go
                    payload.unpersist(blocking=False)
                else:
                    # the driver's and the executors' copies, each executor's answer awaited: one still on its way
                    # when the application stops (an Airflow task's stops right after its run) is an error in
                    # Spark's log ("Still have 1 requests outstanding when connection ... is closed")
                    payload.destroy(blocking=True)
            except Exception:  # noqa: BLE001 - the SparkContext may be gone, and its copies with it
                pass

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
