"""The Spark application a run's barrier job runs in, as the Spark launcher (:mod:`.barrier`) sees it: a classic
SparkContext (:mod:`.classic`) or a Spark Connect session (:mod:`.connect`). Only what differs between the two is
behind this seam: the conf, the driver's address, the slot count, how the job reaches the tasks, how the barrier
job (and a DataFrame's row count before it) is submitted and cancelled, what Spark says of its tasks. The tasks,
the agents and the failure rules are shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from ...events import Task, TaskCounts
    from ..address import DriverAddress

BarrierTask = Callable[[Iterator[Any]], Iterator[str]]  # a partition's agents; yields how each ended (JSON)
ENDED_SCHEMA = "ended string"  # what a barrier task run by mapInArrow yields: how each of its agents ended


class JobStatus(Protocol):
    """What Spark says of the barrier job's tasks (:class:`.status.BarrierJobStatus`)."""

    failed: dict[Task, str]

    def poll(self) -> None: ...
    def first_failure(self) -> str | None: ...
    def ended(self) -> dict[Task, str]:
        """Spark's reason for each task it ended: failed, or killed from outside the run (not by its cancel)."""

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
    def restart_slots(
        self,
        tasks: int,
        min_tasks: int,
        lost_hosts: tuple[str, ...],
        waits: tuple[float, float],
        cancelled: Callable[[], bool],
    ) -> int:
        """A restart's tasks, ``min_tasks`` to ``tasks``, once their slots are free
        (:func:`.capacity.wait_for_restart_slots`; ``waits``: its ``shrink_timeout`` and ``slot_wait_timeout``), the
        executors on ``lost_hosts`` not counted."""

    def ship(self, payload: bytes) -> Callable[[], bytes]:
        """Hand the pickled job to Spark; the task's way to read it (pickled into the task)."""

    def tagged(self, tag: str, description: str) -> AbstractContextManager[None]:
        """Within, the Spark jobs this thread starts are ``tag``'s (described as ``description`` where Spark
        shows that): :meth:`cancel` of ``tag`` interrupts them. For a thread of the launcher's own."""

    def run_barrier(
        self, tasks: int, task: BarrierTask, tag: str, description: str, inputs: DataFrame | None = None
    ) -> None:
        """Run ``task`` in a barrier job of ``tasks`` tasks, cancellable by ``tag``; returns when it ends.

        ``inputs``: a DataFrame of ``tasks`` partitions whose partition each task reads (its Arrow batches are
        ``task``'s input), instead of ``range(tasks)``, whose rows the tasks do not read.
        """

    def task_counts(self, tag: str) -> TaskCounts | None:
        """The tasks of ``tag``'s Spark jobs (every stage) running now and done, as Spark last said; None where
        it says nothing (for a run on a DataFrame: its rows are computed in them before the barrier tasks run)."""

    def cancel(self, tag: str) -> None: ...
    def name_of(self, tag: str) -> str:
        """The job's handle in Spark's words: ``job group horovod-runner-...``, ``operation tag ...``."""

    def left_running(self, tag: str) -> str:
        """What of the run is left with a job that outlived its cancel, and how to end it, in words."""

    def unship(self, tasks_running: bool = False) -> None:
        """Drop the copies of the job that Spark holds for this run, where they can be dropped; with
        ``tasks_running``, only those that the tasks still running do not need. Without, it returns once every
        executor has dropped its copy, or after ``BROADCAST_DROP_WAIT_S`` (an executor whose host vanished answers
        only at Spark's ask timeout)."""

    def stopped(self) -> str | None:
        """Why the run cannot go on when the application has stopped; None while it runs."""

    def decommissioning(self) -> dict[str, tuple[float, str]]:
        """The hosts whose executors Spark is decommissioning: when it began (``time.time()``) and Spark's words
        (empty where the application cannot tell: over Spark Connect)."""

    def decommission_deadline(self) -> float | None:
        """How long a decommissioned executor has before it is killed, where Spark's settings say (seconds)."""


def arrow_task(task: BarrierTask, reads_input: bool) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """``task`` as ``mapInArrow`` runs it: its lines out as one-column record batches; the partition's Arrow
    batches in where it ``reads_input`` (an input DataFrame's), else none (a range's rows go unread)."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for ended in task(batches if reads_input else iter(())):
            yield pa.RecordBatch.from_pydict({"ended": [ended]})

    return run


def arrow_barrier(frame: DataFrame, task: BarrierTask, reads_input: bool) -> None:
    """Run ``task`` over each partition of ``frame`` in one barrier stage (``mapInArrow(barrier=True)``, which
    classic sessions and Spark Connect both have); returns when the job ends."""
    frame.mapInArrow(arrow_task(task, reads_input), ENDED_SCHEMA, barrier=True).collect()
