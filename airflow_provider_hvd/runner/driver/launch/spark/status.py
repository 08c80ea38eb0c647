"""What Spark's status store says of a run's barrier job (runs in the driver, for :mod:`.barrier`).

The barrier job is the one of the run's job group whose result stage is a barrier stage (a DataFrame's run has
others in the group before it). A poll reads the failed and killed task counters of the job's stage (a stage's,
not the job's: Spark stops counting a job's tasks once the job has ended, and a cancelled job ends before its
tasks do): the same few py4j calls whatever the number of ranks.
Only when a counter moved are the tasks listed, and then only those FAILED (filtered in the JVM), and those
KILLED when none failed (all of them then: a run whose job was killed from outside is ending).
A KILLED task is one that something other than its rank ended: Spark after another task of the barrier stage
failed, the run's own cancellation of its job group (Spark's reason names the group), or someone outside (the
Spark UI's kill link, another thread of the application): those are the run's cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...events import Task
from .cluster import summary

if TYPE_CHECKING:
    from pyspark import SparkContext

_MAX_TASKS = 1 << 20


class BarrierJobStatus:
    """The failed and killed tasks of the Spark job of ``group`` (one job: the run's barrier job)."""

    def __init__(self, sc: SparkContext, group: str) -> None:
        self._sc = sc
        self._group = group
        self._stage_ids: list[int] = []
        self._other_jobs: set[int] = set()  # jobs of the group that are not the barrier job (a DataFrame's)
        self._jvm_objects: tuple[Any, Any] | None = None  # the JVM's status tracker and store, asked for once
        self._counted: list[tuple[int, int]] = []  # per stage: (attempt, failed + killed tasks) when last listed
        self.failed: dict[Task, str] = {}
        self.killed: dict[Task, str] = {}
        self._ours: set[Task] = set()  # killed by the run's own cancellation of its job group

    def _jvm_status(self) -> tuple[Any, Any]:
        jsc = self._sc._jsc
        if jsc is None:
            raise RuntimeError("the SparkContext has stopped")
        if self._jvm_objects is None:
            self._jvm_objects = jsc.statusTracker(), jsc.sc().statusStore()
        return self._jvm_objects

    def poll(self) -> None:
        """Read the stage's counters; list its failed (and killed) tasks when they moved. Raises what py4j raises."""
        tracker, store = self._jvm_status()
        if not self._stage_ids and not self._find_barrier_job(tracker, store):
            return  # not submitted yet
        counted = self._stages(store)
        if counted is not None and counted != self._counted:
            self._list(tracker, store, counted)
            self._counted = counted

    def _find_barrier_job(self, tracker: Any, store: Any) -> bool:
        """Find the group's barrier job: a DataFrame's run has others before it (adaptive execution runs a
        shuffle's or a broadcast's own job first, in the same group), and the group lists them in no order."""
        for job_id in map(int, tracker.getJobIdsForGroup(self._group)):
            if job_id in self._other_jobs:
                continue
            info = tracker.getJobInfo(job_id)
            stage_ids = sorted(int(stage) for stage in info.stageIds()) if info is not None else []
            barrier = _is_barrier_stage(store, stage_ids[-1]) if stage_ids else None  # (the job's result stage)
            if barrier:
                self._stage_ids = stage_ids
                return True
            if barrier is False:
                self._other_jobs.add(job_id)
        return False

    def _stages(self, store: Any) -> list[tuple[int, int]] | None:
        """Each stage's latest attempt and its failed + killed tasks; None before the status store has them."""
        counted = []
        for stage_id in self._stage_ids:
            try:
                stage = store.lastStageAttempt(stage_id)
            except Exception:  # noqa: BLE001 - submitted, not in the status store yet (its listener runs behind)
                return None
            counted.append((int(stage.attemptId()), int(stage.numFailedTasks()) + int(stage.numKilledTasks())))
        return counted

    def tasks_active(self) -> bool:
        """Whether tasks of the job still run (their end, and Spark's reason for it, may be on its way)."""
        _, store = self._jvm_status()
        try:
            return not self._stage_ids or any(int(store.lastStageAttempt(s).numActiveTasks()) for s in self._stage_ids)
        except Exception:  # noqa: BLE001 - not in the status store yet
            return True

    def tasks_running(self) -> bool:
        """Whether tasks of the job are known to run now: a cancelled job ends before its tasks do. Polls first."""
        self.poll()
        return bool(self._stage_ids) and self.tasks_active()  # (no stage: the job was never submitted)

    def _list(self, tracker: Any, store: Any, counted: list[tuple[int, int]]) -> None:
        jvm = self._sc._jvm
        assert jvm is not None
        v1 = jvm.org.apache.spark.status.api.v1
        for stage_id, (last_attempt, _) in zip(self._stage_ids, counted, strict=False):
            for attempt in range(last_attempt + 1):
                for status, found in ((v1.TaskStatus.FAILED, self.failed), (v1.TaskStatus.KILLED, self.killed)):
                    if found is self.killed and self.failed:
                        continue  # a failure explains the kills
                    tasks = store.taskList(
                        stage_id,
                        attempt,
                        0,
                        _MAX_TASKS,
                        v1.TaskSorting.ID,
                        jvm.java.util.Collections.singletonList(status),
                    )
                    iterator = tasks.iterator()
                    while iterator.hasNext():
                        task = iterator.next()
                        key = (int(task.index()), int(task.attempt()))
                        if key in found or key in self._ours:
                            continue
                        described = self._describe(task, found is self.killed)
                        if found is self.killed and self._group in described:  # the run's own cancellation
                            self._ours.add(key)
                        else:
                            found[key] = described

    @staticmethod
    def _describe(task: Any, killed: bool) -> str:
        message = task.errorMessage()
        reason = summary(message.get()) if message.isDefined() else "no reason given"
        verb = "was killed" if killed else "failed"
        return (
            f"Spark task {task.index()} (attempt {task.attempt()}) {verb} on executor {task.executorId()} "
            f"({task.host()}): {reason}"
        )

    def first_failure(self) -> str | None:
        """Spark's reason for the first failed task, else for a task killed from outside the run; None if none."""
        for found in (self.failed, self.killed):
            if found:
                return found[min(found)]
        return None

    def ended(self) -> dict[Task, str]:
        """Spark's reason for each task it ended: failed, else killed from outside the run."""
        return {**self.killed, **self.failed}


def _is_barrier_stage(store: Any, stage_id: int) -> bool | None:
    """Whether the stage runs a barrier RDD (the graph Spark's UI draws tells: the stage's own RDD, an RDD's, or a
    DataFrame operation's within it); None before the store has it."""
    try:
        root = store.operationGraphForStage(stage_id).rootCluster()
        return bool(root.barrier() or root.getBarrierClusters().nonEmpty())
    except Exception:  # noqa: BLE001 - submitted, not in the status store yet (its listener runs behind)
        return None
