"""A classic SparkContext in this process as the barrier job's application (:class:`.app.SparkApp`): the job
travels as a broadcast, the barrier job is an RDD's in a job group, Spark's status store tells of its tasks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ....shared.timing import BROADCAST_DROP_WAIT_S
from ...events import TaskCounts
from ..address import DriverAddress, spark_driver_address
from .app import BarrierTask, JobStatus, arrow_barrier
from .capacity import ClassicSlots, wait_for_restart_slots, wait_for_slots
from .cluster import is_local, summary
from .status import BarrierJobStatus

if TYPE_CHECKING:
    from pyspark import Broadcast, SparkContext
    from pyspark.sql import DataFrame

log = logging.getLogger("airflow_provider_hvd.runner")

DROP_WAIT_S = 5.0  # Spark takes the executors it was asked to kill out of its count within moments


def read_broadcast(payload: Broadcast[bytes]) -> bytes:
    """The job from this executor's copy of the broadcast, not cached in this Python worker afterwards."""
    job = payload.value
    # pyspark caches the value in the Python worker, which Spark reuses for later tasks: no copy of the job
    # should stay there while the rank trains, nor after the run
    vars(payload).pop("_value", None)
    return job


def _drop(payload: Broadcast[bytes], destroy: bool) -> None:
    """Destroy ``payload`` everywhere, each executor's answer awaited; or only unpersist the executors' copies."""
    try:
        if destroy:
            payload.destroy(blocking=True)
        else:
            payload.unpersist(blocking=False)
    except Exception:  # noqa: BLE001 - the SparkContext may be gone, and its copies with it
        pass


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
DECOMMISSION_KILL_CONFS = ("spark.executor.decommission.forceKillTimeout", "spark.executor.decommission.killInterval")


def spark_seconds(duration: str) -> float | None:
    """A duration as Spark writes it (``60s``, ``2min``, ``500ms``, ``90``: seconds) in seconds; None if not one."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", duration.lower())
    if match is None or match.group(2) not in ("", *_DURATION_UNITS):
        return None
    return float(match.group(1)) * _DURATION_UNITS.get(match.group(2), 1.0)


def decommission_deadline(conf: Callable[[str], str | None]) -> float | None:
    """Seconds a decommissioned executor has before it is killed (Spark's own force-kill timeout, or the interval
    after which the cluster kills it), the shorter where both are set; None where neither is."""
    found = [spark_seconds(value) for key in DECOMMISSION_KILL_CONFS if (value := conf(key))]
    known = [seconds for seconds in found if seconds is not None]
    return min(known) if known else None


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

    def restart_slots(
        self,
        tasks: int,
        min_tasks: int,
        lost_hosts: tuple[str, ...],
        waits: tuple[float, float],
        cancelled: Callable[[], bool],
    ) -> int:
        count = ClassicSlots(self.sc, self.naming)
        if lost_hosts and not self.local:
            self._drop_executors(lost_hosts)
            count.lost_hosts = lost_hosts
        return wait_for_restart_slots(count, tasks, min_tasks, *waits, cancelled, self.naming)

    def _drop_executors(self, hosts: tuple[str, ...]) -> None:
        """Ask Spark to kill the executors on ``hosts`` (lost: Spark would count their task slots until it declared
        them lost itself, a minute or two later, and a barrier job placed on them would never start), keeping
        the application's number of executors (the cluster manager may start others); wait until Spark no longer
        counts them."""
        jsc = self.sc._jsc.sc()
        scheduler, backend = jsc.taskScheduler(), jsc.schedulerBackend()
        try:
            executors = []
            for host in hosts:
                alive = scheduler.getExecutorsAliveOnHost(host)
                executors += [e for e in str(alive.get().mkString(",")).split(",") if e] if alive.isDefined() else []
                backend.killExecutorsOnHost(host)
            deadline = time.monotonic() + DROP_WAIT_S
            while any(backend.isExecutorActive(e) for e in executors) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001 - not a coarse-grained backend, or the SparkContext is stopping
            log.warning(
                "%s: could not remove the executors on the lost host(s) %s from Spark's count of task slots: %s",
                self.naming.runner,
                ", ".join(hosts),
                summary(exc, first_line=True),
            )
            return
        log.info(
            "%s: Spark was asked to kill executor(s) %s on the lost host(s) %s: their task slots are not counted",
            self.naming.runner,
            ", ".join(executors) or "(none left)",
            ", ".join(hosts),
        )

    def decommissioning(self) -> dict[str, tuple[float, str]]:
        # the scheduler's own record (the standalone master's word on a worker, an executor's on its SIGPWR, YARN's
        # on a node): the REST API and the status tracker show none of it
        jsc = self.sc._jsc
        if jsc is None or self.local:
            return {}
        scheduler = jsc.sc().taskScheduler()
        pending = scheduler.executorsPendingDecommission()
        if pending.isEmpty():
            return {}
        found: dict[str, tuple[float, str]] = {}
        hosts = scheduler.executorIdToHost()
        for executor in str(pending.keySet().mkString(",")).split(","):
            state, host = pending.get(executor), hosts.get(executor)
            if not executor or not state.isDefined() or not host.isDefined():
                continue  # (removed meanwhile)
            state = state.get()
            words = (
                "its worker is being decommissioned"
                if state.workerHost().isDefined()
                else "the executor is being decommissioned: its node or pod is going"
            )
            found[str(host.get())] = (int(state.startTime()) / 1000, f"executor {executor}: {words}")
        return found

    def decommission_deadline(self) -> float | None:
        return decommission_deadline(self.conf)

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
        if payload is None:
            return
        if tasks_running:  # a task reads the driver's copy: only the executors' cached copies go
            _drop(payload, destroy=False)
            return
        # the driver's and the executors' copies, each executor's answer awaited: one still on its way when the
        # application stops (an Airflow task's stops right after its run) is an error in Spark's log ("Still have 1
        # requests outstanding when connection ... is closed"). But not for long: an executor on a host that
        # vanished (Spark asks it until it declares it lost) answers only at Spark's ask timeout, minutes later
        drop = threading.Thread(target=_drop, args=(payload, True), name="hvd-broadcast-drop", daemon=True)
        drop.start()
        drop.join(timeout=BROADCAST_DROP_WAIT_S)
        if drop.is_alive():
            log.info(
                "%s: an executor did not answer within %.0fs that it dropped the job's broadcast (its host may be "
                "gone): the rest of its removal is left to Spark",
                self.naming.runner,
                BROADCAST_DROP_WAIT_S,
            )

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
