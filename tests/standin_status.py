"""A stand-in for the JVM side of Spark's status tracker and status store, for barrier jobs too large to run here.

It answers what :class:`~airflow_provider_hvd.runner.driver.launch.spark.status.BarrierJobStatus` (and the code before
it) asks Spark's JVM through py4j, and counts each answer as one py4j call, as py4j would make one round trip
for each: a method called on a JVM object, or an element read from a JVM array or iterator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class Calls:
    count: int = 0


class _Java:
    """A JVM object whose methods each cost one call."""

    def __init__(self, calls: Calls, **methods: Any) -> None:
        self._calls = calls
        self._methods = methods

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("_methods", {})
        if name not in methods:
            raise AttributeError(name)
        value = methods[name]

        def call(*args: Any) -> Any:
            self._calls.count += 1
            return value(*args) if callable(value) else value

        return call


class _JavaArray(list):
    """A JVM array as py4j hands it over: reading its length and each element is a call."""

    def __init__(self, calls: Calls, items: list[Any]) -> None:
        super().__init__(items)
        self._calls = calls

    def __len__(self) -> int:
        self._calls.count += 1
        return super().__len__()

    def __iter__(self):  # type: ignore[no-untyped-def]
        for item in super().__iter__():
            self._calls.count += 1
            yield item


def _iterator(calls: Calls, items: list[Any]) -> _Java:
    position = [0]

    def has_next() -> bool:
        return position[0] < len(items)

    def next_item() -> Any:
        position[0] += 1
        return items[position[0] - 1]

    return _Java(calls, hasNext=has_next, next=next_item)


@dataclass
class StandInJob:
    """One barrier job of ``tasks`` tasks in one stage; ``failed`` and ``killed``: task indexes so ended."""

    group: str
    tasks: int
    failed: set[int] = field(default_factory=set)
    killed: set[int] = field(default_factory=set)
    kill_reason: str = "killed via the Web UI"
    job_id: int = 0
    stage_id: int = 0
    submitted: bool = True  # the barrier job is in the group
    other_jobs: list[int] = field(default_factory=list)  # before it, in its group: a DataFrame's (one stage each)


class StandInSparkContext:
    """What a SparkContext's Python side offers the launcher, backed by the stand-in JVM objects."""

    def __init__(self, job: StandInJob) -> None:
        self.calls = Calls()
        self.job = job
        self.master = "spark://stand-in:7077"
        calls = self.calls

        def status(index: int) -> str:
            return "FAILED" if index in job.failed else "KILLED" if index in job.killed else "RUNNING"

        def task(index: int) -> _Java:
            reason = "boom" if index in job.failed else job.kill_reason
            return _Java(
                calls,
                index=index,
                attempt=0,
                status=status(index),
                executorId=str(index % 250),
                host=f"10.0.{index // 250}.1",
                errorMessage=SimpleNamespace(isDefined=lambda: True, get=lambda: reason),
            )

        def task_list(stage_id: int, attempt: int, *args: Any) -> _Java:
            if len(args) == 1:  # taskList(stage, attempt, maxTasks): every task
                chosen = list(range(job.tasks))
            elif stage_id != job.stage_id:
                chosen = []
            else:  # taskList(stage, attempt, offset, length, sortBy, statuses): filtered in the JVM
                offset, length, _, statuses = args
                chosen = [i for i in range(job.tasks) if status(i) in statuses][offset : offset + length]
            return _Java(calls, iterator=lambda: _iterator(calls, [task(i) for i in chosen]))

        def graph(stage_id: int) -> _Java:  # (one barrier stage: an RDD's; the others' stages are not)
            return _Java(calls, rootCluster=_Java(calls, barrier=stage_id == job.stage_id))

        def job_ids(group: str) -> _JavaArray:
            ids = ([job.job_id] if job.submitted else []) + job.other_jobs  # (newest first, as Spark lists them)
            return _JavaArray(calls, ids if group == job.group else [])

        jtracker = _Java(
            calls,
            getJobIdsForGroup=job_ids,
            getJobInfo=lambda job_id: _Java(
                calls,
                jobId=job_id,
                stageIds=_JavaArray(calls, [job.stage_id if job_id == job.job_id else job_id]),
                status="RUNNING",
            ),
            getStageInfo=lambda stage_id: _Java(
                calls,
                stageId=stage_id,
                currentAttemptId=0,
                name="barrier",
                numTasks=job.tasks,
                numActiveTasks=job.tasks - len(job.failed | job.killed),
                numCompletedTasks=0,
                numFailedTasks=len(job.failed),
            ),
        )
        store = _Java(
            calls,
            taskList=task_list,
            operationGraphForStage=graph,
            lastStageAttempt=lambda stage_id: _Java(  # (the other jobs' stages: done, none failed)
                calls,
                attemptId=0,
                numFailedTasks=len(job.failed) if stage_id == job.stage_id else 0,
                numKilledTasks=len(job.killed) if stage_id == job.stage_id else 0,
                numActiveTasks=job.tasks - len(job.failed | job.killed) if stage_id == job.stage_id else 0,
            ),
        )
        self._jsc = _Java(calls, statusTracker=jtracker, sc=_Java(calls, statusStore=store))
        v1 = SimpleNamespace(
            TaskStatus=SimpleNamespace(FAILED="FAILED", KILLED="KILLED"), TaskSorting=SimpleNamespace(ID="ID")
        )
        collections = SimpleNamespace(singletonList=lambda item: [item])
        self._jvm = SimpleNamespace(
            org=SimpleNamespace(
                apache=SimpleNamespace(spark=SimpleNamespace(status=SimpleNamespace(api=SimpleNamespace(v1=v1))))
            ),
            java=SimpleNamespace(util=SimpleNamespace(Collections=collections)),
        )
        self._jtracker = jtracker

    def getConf(self) -> Any:
        return SimpleNamespace(get=lambda key, default=None: default)

    def statusTracker(self) -> Any:
        from pyspark.status import StatusTracker

        return StatusTracker(self._jtracker)


def standin_launcher(job: StandInJob) -> tuple[Any, StandInSparkContext]:
    """A SparkLauncher of ``job.tasks`` ranks on the stand-in, as if its barrier job were running."""
    from airflow_provider_hvd.runner.driver.launch.spark.barrier import SparkLauncher

    sc = StandInSparkContext(job)
    launcher = SparkLauncher(SimpleNamespace(sparkContext=sc), job.tasks)  # type: ignore[arg-type]
    job.group = launcher.group
    return launcher, sc
