"""Spark strategy (``np > 0``): a barrier job of ``np`` tasks, each running one rank agent.

torch.distributed's runs with ``spark.task.resource.gpu.amount = k`` run ``k`` agents (ranks) in each task, one
of its GPUs each (as PySpark's ``TorchDistributor`` runs ``torchrun --nproc-per-node k`` in each task); with
``use_gpu=False`` its ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``, as PySpark's), unless the application sets
``spark.executorEnv.CUDA_VISIBLE_DEVICES``: then they see what that says.

On a classic session the pickled job travels as a Spark broadcast: the driver hands it to Spark once, each
executor fetches it once (from the driver or from other executors) and the ranks on that executor read that
local copy. What differs over Spark Connect is in :mod:`.connect`, behind :mod:`.app`'s seam.

What Spark's status store says of the job's tasks stays in here: :meth:`SparkLauncher.poll` turns it into the
run's launch events (:class:`~..launcher.Launcher`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ....agent.agent import AgentArgs, run_agent
from ....errors import RunCancelledError
from ....settings import DEFAULT_SLOT_WAIT_S
from ....shared.gpus import GPU
from ....shared.messages import Hello
from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ....shared.shards import FeedSpec
from ....shared.timing import FEED_LOG_S, LAUNCH_END_WAIT_S
from ...events import LaunchEvent, LaunchFailed, Task, TaskCounts, TaskEnded
from .app import BarrierTask, SparkApp
from .classic import ClassicApp
from .cluster import is_connect, summary
from .connect import ConnectApp
from .dataframe_plan import ShardPlan, count_partitions, plan_shards

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("airflow_provider_hvd.runner")

_TASK_FAILURE_POLL_S = 1.0
_TASK_REASON_WAIT_S = 5.0  # a killed task's end reaches Spark's status store seconds after its agent is lost
_JOB_END_WAIT_S = 60.0  # a cancelled job's end is waited for so long; then it is left to Spark
# once the job has ended, its killed tasks' ends are waited for so long: Spark kills their Python workers at once,
# but a task on a host that vanished ends only when Spark declares its executor lost (minutes): run() must not
# wait for that (a lost host is named within seconds, and the run ends with it)
_TASKS_END_WAIT_S = 5.0
_CANCEL_AGAIN_S = 2.0  # the cancel is sent again while the job runs on
_CANCEL_POLL_S = 0.1  # how often the row count's wait reads the run's cancel flag
_TASKS_END_POLL_S = 0.2  # the job has ended, its tasks are ending (a killed task's end comes seconds later)
EXECUTOR_CUDA_DEVICES = "spark.executorEnv.CUDA_VISIBLE_DEVICES"  # the executors' GPUs, set on purpose


def spark_app(spark: SparkSession, tag: str, naming: RunnerNaming = HOROVOD_RUNNER) -> SparkApp:
    """The application of ``spark``: a Spark Connect session's, or a classic session's SparkContext; its texts
    name the runner as ``naming`` says."""
    if is_connect(spark):
        return ConnectApp(spark, tag, naming)  # type: ignore[arg-type]  # (is_connect: it is one)
    return ClassicApp(spark.sparkContext, tag, naming)


def _task_agents(hello: Hello, per_task: int, use_gpus: bool) -> list[Hello]:
    """The hellos of a task's agents: one, or ``per_task`` sharing its cores, one of its GPUs each."""
    resources = hello.resources if use_gpus else {name: got for name, got in hello.resources.items() if name != GPU}
    if per_task == 1:
        return [dataclasses.replace(hello, resources=resources)]
    gpus = resources.get(GPU, [])
    if use_gpus and len(gpus) != per_task:
        raise RuntimeError(f"this task was given {len(gpus)} GPU(s) ({gpus}) for {per_task} ranks, one GPU each")
    cpus = None if hello.cpus is None else max(1, hello.cpus // per_task)
    return [
        dataclasses.replace(
            hello, process=process, cpus=cpus, resources={**resources, GPU: [gpus[process]]} if gpus else resources
        )
        for process in range(per_task)
    ]


def _barrier_task(
    args: AgentArgs,
    read_job: Callable[[], bytes],
    per_task: int = 1,
    use_gpus: bool = True,
    feed: FeedSpec | None = None,
) -> BarrierTask:
    """The barrier task: its agents (one, or ``per_task``). With ``feed``, the task's rows (its input's Arrow
    batches) are written to its ranks' shard files first (:mod:`....agent.shard_writer`), the driver told how
    far they got (:mod:`....agent.shard_report`), each rank told where its own is; the files go when the task
    ends, however it ends."""

    def task(batches: Iterator[Any]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        with contextlib.ExitStack() as held:
            shards = None
            if feed is not None:
                from ....agent.shard_report import ShardReport
                from ....agent.shard_writer import receive_shards

                with ShardReport(args, ctx.partitionId()) as report:  # the driver follows the rows as they come
                    shards = held.enter_context(receive_shards(batches, feed, ctx.partitionId(), progress=report))
                    report.done()
            hello = Hello(
                host="",  # the address it reaches the driver from, filled in by the agent
                pid=os.getpid(),
                executor=ctx.getTaskInfos()[ctx.partitionId()].address,
                partition=ctx.partitionId(),
                attempt=ctx.attemptNumber(),
                cpus=ctx.cpus(),
                resources={name: list(info.addresses) for name, info in ctx.resources().items()},
            )
            hellos = _task_agents(hello, per_task, use_gpus)
            envs = [{} if shards is None else shards.rank_env(process) for process in range(len(hellos))]

            def release(process: int) -> Callable[[], None]:  # a rank's shard goes as soon as the rank has ended
                return (lambda: None) if shards is None else (lambda: shards.release(process))

            if len(hellos) == 1:
                yield json.dumps(run_agent(args, read_job, hellos[0], envs[0], release(0)))
                return
            job = [read_job()]  # one copy for the task's agents, dropped once their ranks have ended
            ended: list[str] = [""] * len(hellos)

            def agent(index: int) -> None:
                ended[index] = run_agent(args, lambda: job[0], hellos[index], envs[index], release(index))

            threads = [
                threading.Thread(target=agent, args=(i,), name=f"hvd-task-agent-{i}") for i in range(1, per_task)
            ]
            for thread in threads:
                thread.start()
            try:
                agent(0)
            finally:
                for thread in threads:  # each ends with its rank (the driver's abort, or the channel's end)
                    thread.join()
                job.clear()
            yield json.dumps(ended)

    return task


class SparkLauncher:
    """Runs the agents as a Spark barrier job; the rank processes are children of the Python workers."""

    def __init__(
        self,
        spark: SparkSession,
        size: int,
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        cancelled: Callable[[], bool] = lambda: False,
        per_task: int = 1,
        use_gpus: bool = True,
        naming: RunnerNaming = HOROVOD_RUNNER,
        dataframe: DataFrame | None = None,
    ) -> None:
        self.naming = dataclasses.replace(naming, per_task=per_task)  # (its texts count the ranks of a task)
        self.group = f"{naming.job_group}-{uuid.uuid4().hex[:12]}"
        self.app = spark_app(spark, self.group, self.naming)
        self.cancelled = cancelled
        self.spark = spark
        self.shard_plan: ShardPlan | None = None  # a run on a DataFrame's (:meth:`plan`)
        self.size = size  # ranks: agents
        self.per_task = per_task  # ranks (agents) in each task
        self.tasks = size // per_task
        # False: the ranks are given none of their tasks' GPUs, and see none (CUDA_VISIBLE_DEVICES="", as PySpark's
        # TorchDistributor), unless the application sets the executors' CUDA_VISIBLE_DEVICES on purpose
        self.use_gpus = use_gpus
        self.slot_wait_timeout = slot_wait_timeout
        self.local = self.app.local
        self.driver = self.app.driver_address()  # a bad port setting fails here
        self._memory = self._read_memory_settings()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._task_failure: LaunchFailed | None = None
        self._next_poll = 0.0
        self._failure_told: LaunchFailed | None = None
        self._told: set[Task] = set()  # the tasks whose end was told (TaskEnded)
        self._status = self.app.status
        self._poll_error_logged = False
        self._stop_reason: str | None = None
        self._cancel_sent = False
        if dataframe is not None:
            self.plan(dataframe)

    def plan(self, dataframe: DataFrame) -> None:
        """A run on ``dataframe``: its rows counted here (one Spark job, which a cancel interrupts; its errors
        raise here), then each barrier task reads its ranks' rows from the planned DataFrame."""
        self.shard_plan = plan_shards(dataframe, self.spark, self.size, self.per_task, self.naming, self._count)

    def _count(self, df: DataFrame) -> list[int]:
        """:func:`.dataframe_plan.count_partitions` in a thread of its own, its Spark job in the run's count group
        (or tag), which the run's cancel interrupts as :meth:`close` does the barrier job's; RunCancelledError
        then, once the count has ended (or, after ``_JOB_END_WAIT_S``, been left to Spark)."""
        cancelled = RunCancelledError(
            f"{self.naming.runner}: the run was cancelled before its ranks started (as Spark counted the "
            "DataFrame's rows)"
        )
        if self.cancelled():
            raise cancelled
        group = f"{self.group}-count"  # (not the barrier job's group: its status reads that group's one job)
        counted: list[list[int]] = []
        failed: list[BaseException] = []

        def count() -> None:
            try:
                with self.app.tagged(group, f"{self.naming.runner}: counting the DataFrame's rows"):
                    counted.append(count_partitions(df))
            except BaseException as exc:  # noqa: BLE001 - raised in the run's thread
                failed.append(exc)

        thread = threading.Thread(target=count, name="hvd-spark-count", daemon=True)
        started = time.monotonic()
        next_log = started + FEED_LOG_S
        thread.start()
        while thread.is_alive() and not self.cancelled():
            thread.join(timeout=_CANCEL_POLL_S)
            if time.monotonic() >= next_log:  # a real table takes minutes: the log must not look hung
                next_log += FEED_LOG_S
                tasks = self.app.task_counts(group)
                log.info(
                    "%s: Spark counts the DataFrame's rows%s, %.0fs so far",
                    self.naming.runner,
                    "" if tasks is None else f" ({tasks.done} of its tasks done, {tasks.running} running)",
                    time.monotonic() - started,
                )
        if self.cancelled():
            self._cancel_count(thread, group)
            raise cancelled
        if failed:
            raise failed[0]
        rows = counted[0]
        log.info(
            "%s: the DataFrame has %s rows in %d partitions (counted in %.1fs; the barrier job computes them again)",
            self.naming.runner,
            f"{sum(rows):,}",
            len(rows),
            time.monotonic() - started,
        )
        return rows

    def _cancel_count(self, thread: threading.Thread, group: str) -> None:
        """Cancel the count's job until it has ended (a cancel that reached Spark before the job cancelled
        nothing), for ``_JOB_END_WAIT_S`` at most; then it is left to Spark, with a warning."""
        started = time.monotonic()
        while thread.is_alive() and time.monotonic() - started < _JOB_END_WAIT_S:
            try:
                self.app.cancel(group)
            except Exception as exc:  # noqa: BLE001 - the application is gone, and its jobs with it
                log.warning("%s: could not cancel the row count: %s", self.naming.runner, summary(exc, first_line=True))
                return
            thread.join(timeout=_CANCEL_AGAIN_S)
        if thread.is_alive():
            log.warning(
                "%s: the Spark job counting the DataFrame's rows, %s, was still running %.0fs after the run was "
                "cancelled; it is left to Spark (the Spark UI shows it)",
                self.naming.runner,
                self.app.name_of(group),
                time.monotonic() - started,
            )

    def spark_tasks(self) -> TaskCounts | None:
        """The barrier job's Spark tasks (every stage: those that compute a DataFrame's rows for it too) running
        and done, as Spark says now."""
        return self.app.task_counts(self.group)

    def describe(self) -> str:
        if self.per_task == 1:
            return f"a Spark barrier job of {self.size} tasks {self.app.where()}"
        return f"a Spark barrier job of {self.tasks} tasks of {self.per_task} ranks each {self.app.where()}"

    def memory_settings(self) -> dict[str, str]:
        """The application's memory settings that bound a rank's memory, for a killed rank (...verdict.kills):
        read as the launch begins, not when a rank is killed (over Spark Connect, a call to a server that may be
        in trouble then)."""
        return dict(self._memory)

    def _read_memory_settings(self) -> dict[str, str]:
        conf = self.app.conf
        if self.local:  # the executors are threads of the driver's JVM; the ranks run beside it
            return {"spark.driver.memory": conf("spark.driver.memory") or "1g (default)"}
        factor = conf("spark.executor.memoryOverheadFactor") or "0.10"
        return {
            "spark.executor.memory": conf("spark.executor.memory") or "1g (default)",
            "spark.executor.memoryOverhead": conf("spark.executor.memoryOverhead")
            or f"not set (max(384m, {factor} x spark.executor.memory))",
            "spark.executor.pyspark.memory": conf("spark.executor.pyspark.memory") or "not set",
        }

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        return AgentArgs(
            host,
            port,
            secret,
            relay_output=verbosity == "all",
            echo_output=True,
            echo_relayed=not self.app.shares_stderr,  # local executors' stderr is ours: relayed lines would show twice
            keep_omp_threads=self.app.conf("spark.executorEnv.OMP_NUM_THREADS") is not None,
            hide_gpus=not self.use_gpus and self.app.conf(EXECUTOR_CUDA_DEVICES) is None,
        )

    def _run_job(self, task: BarrierTask) -> None:
        if self._cancel_sent:  # cancelled as it started: nothing to submit
            return
        try:
            inputs = None if self.shard_plan is None else self.shard_plan.frame
            description = f"{self.naming.runner}: {self.size} ranks"
            self.app.run_barrier(self.tasks, task, self.group, description, inputs)
        except BaseException as exc:  # noqa: BLE001 - surfaced through poll()
            self._failure = exc
            return
        self.app.unship()  # every task has ended: the job is dropped everywhere before the run ends (ended())

    def start(self, args: AgentArgs, payload: bytes) -> None:
        """Wait (bounded) until the application has the job's task slots, refusing a job that can never fit; then
        submit the barrier job, unless the run was cancelled meanwhile."""
        self.app.check_slots(self.tasks, self.slot_wait_timeout, self.cancelled)
        if self.cancelled():
            return
        feed = None if self.shard_plan is None else self.shard_plan.feed
        task = _barrier_task(args, self.app.ship(payload), self.per_task, self.use_gpus, feed)
        self._thread = threading.Thread(target=self._run_job, args=(task,), name="hvd-spark-job", daemon=True)
        self._thread.start()

    def poll(self) -> list[LaunchEvent]:
        """What came of the barrier job since the last poll: its failure, or that of the first of its tasks that
        failed or was killed from outside (Spark may be about to retry it), as a :class:`LaunchFailed` each time
        its words change; Spark's reason for each task it ended (:class:`TaskEnded`). Spark's status store is read
        at most once a second, with the same few py4j calls whatever ``size``."""
        if (self._failure is not None or self._task_failure is None) and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + _TASK_FAILURE_POLL_S
            self._stop_reason = self._poll()
        events: list[LaunchEvent] = self._tasks_ended()
        failure = self._launch_failure()
        if failure is not None and failure != self._failure_told:
            self._failure_told = failure
            events.append(failure)
        return events

    def _tasks_ended(self) -> list[LaunchEvent]:
        """Spark's reason for each task of the job it ended, told once each."""
        ended = {task: reason for task, reason in self._status.ended().items() if task not in self._told}
        self._told.update(ended)
        return [TaskEnded(task, reason) for task, reason in ended.items()]

    def _launch_failure(self) -> LaunchFailed | None:
        if self._failure is not None:
            # a task killed from outside (the Spark UI, another thread) says more than "Job 0 cancelled ..."
            text = summary(self._failure)
            reason = (None if self._status.failed else self._status.first_failure()) or self._stop_reason
            if reason is None and "SPARK_JOB_CANCELLED" in text and self.group not in text:
                reason = f"its job was killed from outside the run: {text}"
            return LaunchFailed(self.describe(), reason or text, self._failure)
        if self._task_failure is None:
            failed = self._stop_reason or self._status.first_failure()
            if failed is not None:
                self._task_failure = LaunchFailed(self.describe(), failed)
        return self._task_failure

    def _stopped(self) -> str | None:
        """Why the run cannot go on when the application has stopped; None while it runs."""
        return self.app.stopped()

    def _poll(self) -> str | None:
        """Poll Spark's status store; the reason the run cannot go on when the SparkContext has stopped."""
        try:
            self._status.poll()
        except Exception as exc:  # noqa: BLE001 - py4j's errors, of a SparkContext stopped or of a JVM in trouble
            stopped = self._stopped()
            if stopped:
                return stopped
            if not self._poll_error_logged:  # the channel still watches the ranks: a nicety is missing, no more
                self._poll_error_logged = True
                log.warning(
                    "%s: could not read the Spark job's task status: %s",
                    self.naming.runner,
                    summary(exc, first_line=True),
                )
        return None

    def _await_task_ends(self) -> None:
        """Wait a little (at most ``_TASK_REASON_WAIT_S``) for the ends of the tasks still active to reach Spark's
        status store, so that the last :meth:`poll` has Spark's reason for each (a lost agent's error names it)."""
        deadline = time.monotonic() + _TASK_REASON_WAIT_S
        while self._stopped() is None and self._poll() is None and time.monotonic() < deadline:
            try:
                if not self._status.tasks_active():
                    return
            except Exception:  # noqa: BLE001 - the SparkContext is stopping: the reasons are a nicety
                return
            time.sleep(_TASK_FAILURE_POLL_S / 5)

    def ended(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def close(self, reason: str | None) -> None:
        """Wait for the barrier job and its tasks to end; cancel it first when the run did not complete (``reason``
        says why: None when it did). Spark's copies of the job are dropped then; a job still running after
        ``_JOB_END_WAIT_S``, or tasks still running ``_TASKS_END_WAIT_S`` after it ended (on a host that vanished,
        say), are left to Spark, with a warning naming the job, and keep what they need of the job. The reasons of
        the tasks Spark ended come with the next :meth:`poll`."""
        if self._thread is None:
            return
        cancel = reason is not None
        if not cancel:
            self._thread.join(timeout=LAUNCH_END_WAIT_S)  # the tasks are returning (the driver waited already)
        started = time.monotonic()
        job_ended_at: float | None = None
        running = True  # (an error below, the application gone: nothing is destroyed under what may still run)
        try:
            while (running := self._thread.is_alive() or self._tasks_running()) and (
                time.monotonic() - started < _JOB_END_WAIT_S
            ):
                if not self._thread.is_alive():  # the job has ended; its killed tasks end a moment later
                    job_ended_at = job_ended_at or time.monotonic()
                    if time.monotonic() - job_ended_at >= _TASKS_END_WAIT_S:
                        break
                    time.sleep(_TASKS_END_POLL_S)
                    continue
                self._cancel_sent = True
                self.app.cancel(self.group)  # its error (the application gone) ends the wait: the caller logs it
                # a cancel that reached Spark before the job did cancelled nothing: again until the job has ended
                self._thread.join(timeout=_CANCEL_AGAIN_S)
            if running:
                log.warning(
                    "%s: %s, %s, %s %.0fs after the run ended%s; it is left to Spark, which ends its tasks (the "
                    "Spark UI shows them); %s",
                    self.naming.runner,
                    self.describe(),
                    self.app.name_of(self.group),
                    "was still running" if self._thread.is_alive() else "still had tasks running",
                    time.monotonic() - started,
                    " and it was cancelled" if self._cancel_sent else "",
                    self.app.left_running(self.group),
                )
        finally:
            self.app.unship(tasks_running=running)
        if cancel and not running:
            self._await_task_ends()

    def _tasks_running(self) -> bool:
        """Whether Spark's status store shows tasks of the job running (they may outlive a cancelled job)."""
        try:
            return self._status.tasks_running()
        except Exception:  # noqa: BLE001 - the SparkContext stopped: its tasks went with it
            return False
