"""A DataFrame's shards through a real barrier job, as a run's tasks will receive them (this module travels by
value into the Spark tasks: the executors do not have the tests' modules)."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from airflow_provider_hvd.runner.driver.launch.spark.dataframe_plan import ShardPlan, plan_shards
from airflow_provider_hvd.runner.shared.shards import ROW_COLUMN, SHARD_ENV, FeedSpec

Read = Callable[[Any], Any]  # a shard (DataFrameShard) -> what the test checks (picklable)


@contextlib.contextmanager
def by_value(*functions: Callable[..., Any]) -> Iterator[None]:
    """This module, and those of ``functions`` (a test's), pickled by value into the tasks, for the duration."""
    from pyspark import cloudpickle

    modules = {sys.modules[__name__], *(sys.modules[f.__module__] for f in functions)}
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def shard_task(feed: FeedSpec, read: Read) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A barrier task that writes its shards and gives each to ``read``, as its rank would get it; yields one
    row per shard: its index and the pickled record of what the task saw."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        from airflow_provider_hvd.runner.agent.shard_writer import receive_shards
        from airflow_provider_hvd.runner.rank.dataframe import dataframe_shard

        ctx = BarrierTaskContext.get()
        records = []
        with receive_shards(batches, feed, ctx.partitionId()) as shards:
            for process, shard in enumerate(shards.shards):
                os.environ.update(shard.rank_env())
                try:
                    result = read(dataframe_shard())
                finally:
                    os.environ.pop(SHARD_ENV)
                record = {
                    "task": ctx.partitionId(),
                    "tasks": len(ctx.getTaskInfos()),
                    "process": process,
                    "info": shard.info,
                    "file": os.readlink(f"/proc/self/fd/{shard.fd}"),
                    "directory": shard.directory,
                    "result": result,
                }
                records.append((shard.info.index, pickle.dumps(record)))
        yield pa.RecordBatch.from_pydict(
            {"shard": [index for index, _ in records], "record": [data for _, data in records]},
            schema=pa.schema([("shard", pa.int64()), ("record", pa.binary())]),
        )

    return task


def run_shards(plan: ShardPlan, read: Read) -> dict[int, dict[str, Any]]:
    """Each shard's record (``task``, ``tasks``, ``process``, ``info``, ``file``, ``directory``, ``result``)."""
    with by_value(read):
        rows = plan.frame.mapInArrow(shard_task(plan.feed, read), "shard long, record binary", barrier=True).collect()
    return {row["shard"]: pickle.loads(row["record"]) for row in rows}


def shards_of(df: Any, spark: Any, ranks: int, read: Read, per_task: int = 1) -> dict[int, dict[str, Any]]:
    return run_shards(plan_shards(df, spark, ranks, per_task), read)


def arrow_rows(table: pa.Table, start: int = 0) -> Iterator[pa.RecordBatch]:
    """``table``'s batches with the plan's row index, from ``start`` (shards written without Spark)."""
    import numpy as np

    for batch in table.to_batches():
        yield batch.append_column(ROW_COLUMN, pa.array(np.arange(start, start + batch.num_rows)))
        start += batch.num_rows
