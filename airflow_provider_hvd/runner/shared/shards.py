"""How a DataFrame's rows are split into the ranks' shards, and how a rank finds its own.

Shared by the driver's plan (:mod:`..driver.launch.spark.dataframe_plan`), the agent's writer
(:mod:`..agent.shard_writer`) and the rank's reader (:mod:`..rank.dataframe`). Standard library only: the rank
imports it.

Rank ``r`` of ``ranks`` gets the contiguous rows ``[floor(r*N/ranks), floor((r+1)*N/ranks))`` of the
DataFrame's ``N`` rows in Spark's order (partition index, then position): shards differ by at most one row,
and a DataFrame of ``ranks`` partitions of equal size gives rank ``i`` partition ``i``, as PySpark's
``_train_on_dataframe`` does. Spark task ``t`` of a run with ``per_task`` ranks in each task holds the shards
``t*per_task ... (t+1)*per_task - 1``, one after the other.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

SHARD_ENV = "HVD_RUNNER_DATAFRAME_SHARD"  # the rank's shard (ShardInfo, JSON), set by its agent
ROW_COLUMN = "__hvd_row"  # the global row index the plan adds, checked and dropped by the writer


def shard_start(shard: int, rows: int, shards: int) -> int:
    """The first global row of ``shard`` (of ``shards``, over ``rows`` rows)."""
    return shard * rows // shards


@dataclass(frozen=True)
class FeedSpec:
    """What each barrier task needs to receive its shards; made by the plan, pickled into the tasks."""

    run: str  # a token of this plan, in its files' names
    rows: int  # the DataFrame's rows, N
    ranks: int  # np, num_processes
    per_task: int = 1  # ranks (shards) in each Spark task

    @property
    def tasks(self) -> int:
        return self.ranks // self.per_task

    @property
    def min_rows(self) -> int:
        """The smallest shard's rows, floor(N/ranks): the rows every rank has (equal steps with drop_last)."""
        return self.rows // self.ranks

    def shard_range(self, shard: int) -> tuple[int, int]:
        """The global rows ``[start, stop)`` of ``shard``."""
        return shard_start(shard, self.rows, self.ranks), shard_start(shard + 1, self.rows, self.ranks)

    def task_shards(self, task: int) -> range:
        """The shards task ``task`` holds, in the order its rows come."""
        return range(task * self.per_task, (task + 1) * self.per_task)

    def task_range(self, task: int) -> tuple[int, int]:
        """The global rows ``[start, stop)`` of task ``task``."""
        shards = self.task_shards(task)
        return self.shard_range(shards[0])[0], self.shard_range(shards[-1])[1]


@dataclass(frozen=True)
class ShardInfo:
    """Where a rank's shard is and what it holds: in the rank's environment (:data:`SHARD_ENV`), as JSON."""

    path: str  # an Arrow IPC stream file (/proc/<pid>/fd/<fd>: the writer's process holds it open)
    rows: int  # rows in this shard
    index: int  # the shard's index (the rank's, in PySpark's assignment)
    shards: int  # shards in the run: np, num_processes
    total_rows: int  # the DataFrame's rows, N
    min_rows: int  # floor(N / shards): the rows every shard has

    def to_env(self) -> dict[str, str]:
        return {SHARD_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> ShardInfo | None:
        """This process's shard, or None where its run has none."""
        text = os.environ.get(SHARD_ENV)
        return None if text is None else cls(**json.loads(text))
