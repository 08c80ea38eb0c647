"""A run on a DataFrame, as the driver follows its rows before the ranks start: Spark computing them for the
barrier job (its tasks running before any barrier task streams), then each barrier task streaming its rows into
its ranks' shards (its :class:`...shared.messages.ShardProgress` reports, from a connection of its own).

While that goes on the ranks' start clock waits (:meth:`DataFrameProgress.preparing`): a real table takes
minutes, the ranks' start seconds. The log says how far the rows got every ``FEED_LOG_S``, and once they are all
in the shards; a start timeout's or a cancel's error says it too (:meth:`DataFrameProgress.describe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...shared.messages import ShardProgress
from ...shared.timing import FEED_LOG_S
from ..events import TaskCounts
from ..verdict.kills import size

log = logging.getLogger("airflow_provider_hvd.runner")

_READ_EVERY_S = 1.0  # what Spark says of the job's tasks is read so often


class DataFrameProgress:
    """The DataFrame's ``rows`` on their way into the shards of the barrier job's ``tasks`` tasks; ``spark_tasks``
    says how many tasks of the run's Spark job run and are done (None where Spark does not say)."""

    def __init__(
        self, rows: int, tasks: int, spark_tasks: Callable[[], TaskCounts | None], runner: str, now: float
    ) -> None:
        self.rows = rows
        self.tasks = tasks
        self._spark_tasks = spark_tasks
        self._runner = runner
        self._began = now  # the barrier job was submitted
        self._next_log = now + FEED_LOG_S
        self._spark: TaskCounts | None = None
        self._next_read = now
        self._streamed: dict[int, ShardProgress] = {}  # each barrier task's latest report
        self._done_at: float | None = None

    def take(self, report: ShardProgress, now: float) -> None:
        """A barrier task's report of its rows streamed into its shards so far."""
        if self._done_at is not None or not 0 <= report.task < self.tasks:
            return  # (a re-run task's, after the rows were all in)
        self._streamed[report.task] = report
        if len(self._streamed) == self.tasks and all(seen.done for seen in self._streamed.values()):
            self._done_at = now
            log.info(
                "%s: the DataFrame's %s rows are in the ranks' shards (%s), %.1fs after the barrier job was "
                "submitted (not counted in start_timeout)",
                self._runner,
                f"{self.rows:,}",
                size(self._bytes()),
                now - self._began,
            )

    @property
    def done(self) -> bool:
        """Every task has its rows in its shards."""
        return self._done_at is not None

    def preparing(self, now: float, fresh: bool = False) -> bool:
        """Whether Spark is at work on the rows now (the ranks' start clock waits then): a barrier task still
        streaming them, or tasks of the run's Spark job running beyond the barrier tasks heard from (those that
        compute the DataFrame for the barrier job, or barrier tasks about to report). ``fresh``: what Spark says
        now (else as it said within the last second)."""
        if self.done:
            return False
        if fresh or now >= self._next_read:  # (a few calls to Spark: once a second)
            self._next_read = now + _READ_EVERY_S
            self._spark = self._spark_tasks()
        if any(not seen.done for seen in self._streamed.values()):
            return True
        spark = self._spark
        return spark is not None and (spark.stages > 0 or spark.running > len(self._streamed))

    def tick(self, now: float) -> None:
        """Log how far the rows got, every ``FEED_LOG_S`` until they are all in the shards."""
        if self.done or now < self._next_log:
            return
        self._next_log = now + FEED_LOG_S
        log.info("%s: %s, %.0fs after the barrier job was submitted", self._runner, self.describe(), now - self._began)

    def describe(self) -> str:
        """How far the rows got, in words: ``1,024 of the DataFrame's 4,096 rows are in the ranks' shards ...``."""
        if self.done:
            return f"the DataFrame's {self.rows:,} rows are in the ranks' shards ({size(self._bytes())})"
        spark = self._spark
        if not self._streamed:
            if spark is not None and (spark.running or spark.stages):
                return (
                    f"Spark computes the DataFrame's rows for the barrier job ({spark.done} of its tasks done, "
                    f"{spark.running} running)"
                )
            ran = "" if spark is None else f" (Spark's job: {spark.done} tasks done, none running)"
            return f"no row of the DataFrame is in the ranks' shards yet{ran}"
        rows = sum(seen.rows for seen in self._streamed.values())
        finished = sum(seen.done for seen in self._streamed.values())
        return (
            f"{rows:,} of the DataFrame's {self.rows:,} rows are in the ranks' shards ({size(self._bytes())}; "
            f"{finished} of {self.tasks} tasks done)"
        )

    def _bytes(self) -> int:
        return sum(seen.bytes for seen in self._streamed.values())
