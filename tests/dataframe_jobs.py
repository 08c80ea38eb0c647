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
        from airflow_provider_hvd.runner.rank import dataframe as shard_reader
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
                    # a rank's process ends with its run; this Python worker lives on (Spark reuses it): let the
                    # shard it opened go, as the rank's end would
                    shard_reader._opened = None
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


# --- functions the runs' ranks call (this module travels by value into them: see by_value) ---


def slow_row(value):  # (no type hints: pyspark would try to infer a pandas UDF from them)
    """A Python UDF's body that takes half a second a row: a DataFrame slow to compute."""
    import time

    time.sleep(0.5)
    return value


def held_after(calls: str, free: int, held: str, release: str) -> Callable[[int], int]:
    """A Python UDF's body whose first ``free`` calls return at once (counted in the file ``calls``), and whose
    later ones say so in the file ``held`` and wait until the file ``release`` exists (5 minutes at most)."""

    def hold(value):  # (no type hints: see slow_row)
        import os
        import time

        with open(calls, "a") as counted:
            counted.write("x")
        if os.path.getsize(calls) > free:
            open(held, "a").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return value

    return hold


def loader_rows(ours: bool, num_samples: int, batch_size: int) -> list:
    """Each rank's batches from PySpark's loader (``ours``: airflow_provider_hvd's), as lists; every rank's."""
    import torch.distributed as dist

    if ours:
        from airflow_provider_hvd import get_spark_partition_data_loader as loader
    else:
        from pyspark.ml.torch.distributor import _get_spark_partition_data_loader as loader
    dist.init_process_group("gloo")
    batches = [[column.tolist() for column in batch] for batch in loader(num_samples, batch_size)]
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, batches)
    dist.destroy_process_group()
    return views


def ddp_steps(epochs: int, batch_size: int) -> list:
    """DDP on iter_torch_batches(drop_last=True), reshuffled each epoch: every rank's steps, rows and batches
    without drop_last, and when (time.time()) the later epochs began and ended."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from airflow_provider_hvd import dataframe_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = dataframe_shard()
    steps, later = 0, []
    for epoch in range(epochs):
        if epoch == 1:
            later.append(time.time())
        for batch in shard.iter_torch_batches(batch_size, columns=["half"], shuffle=True, seed=epoch, drop_last=True):
            x = batch["half"].unsqueeze(1)
            loss = torch.nn.functional.mse_loss(model(x), 2 * x)
            optimizer.zero_grad()
            loss.backward()  # (an all-reduce: a rank with a step more would wait here forever)
            optimizer.step()
            steps += 1
    later.append(time.time())
    own = {"steps": steps, "rows": shard.num_rows, "batches": shard.num_batches(batch_size), "later": later}
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, own)
    dist.destroy_process_group()
    return views


def record_shard_file(folder: str, shard: Any) -> str:
    """Write where this rank's shard file is (as /proc shows it) to ``folder``/rank-N; this rank (N)."""
    rank = os.environ["HVD_RUNNER_RANK"]
    with open(os.path.join(folder, f"rank-{rank}.tmp"), "w") as out:
        out.write(os.readlink(shard.info.path))
    os.rename(os.path.join(folder, f"rank-{rank}.tmp"), os.path.join(folder, f"rank-{rank}"))
    return rank


def shard_file_then(folder: str, then: str) -> list[int]:
    """Write where this rank's shard file is (as /proc shows it) to ``folder``/rank-N; then return its ids,
    fail (``then="fail"``) or wait to be ended (``"wait"``)."""
    import time

    from airflow_provider_hvd import dataframe_shard

    shard = dataframe_shard()
    ids = [int(i) for batch in shard.iter_batches(64, columns=["id"]) for i in batch["id"]]
    rank = record_shard_file(folder, shard)
    if then == "fail":
        raise RuntimeError(f"rank {rank} failed after reading its shard")
    if then == "wait":
        time.sleep(600)
    return ids


def horovod_ids(also: str | None = None) -> list:
    """Each Horovod rank's ids from its shard (hvd.allgather_object), rank 0's view; with ``also``, the values that
    column holds in the shard too."""
    import horovod.torch as hvd

    from airflow_provider_hvd import dataframe_shard

    hvd.init()
    shard = dataframe_shard()
    ids = [int(i) for batch in shard.iter_batches(10, columns=["id"]) for i in batch["id"]]
    view = {"rank": hvd.rank(), "shard": shard.index, "ids": ids}
    if also is not None:
        view["also"] = sorted({str(v) for batch in shard.iter_batches(10, columns=[also]) for v in batch[also]})
    return hvd.allgather_object(view)


def ddp_ids_and_hosts(folder: str) -> list:
    """Each DDP rank's host (its UTS name) and its shard's ids, gathered to rank 0; where its shard file is (as
    /proc shows it) in ``folder``/rank-N."""
    import torch.distributed as dist

    from airflow_provider_hvd import dataframe_shard

    dist.init_process_group("gloo")
    shard = dataframe_shard()
    ids = [int(i) for batch in shard.iter_batches(256, columns=["id"]) for i in batch["id"]]
    record_shard_file(folder, shard)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, {"rank": dist.get_rank(), "host": os.uname().nodename, "ids": ids})
    dist.destroy_process_group()
    return views


def ask_for_a_shard() -> None:
    from airflow_provider_hvd import dataframe_shard

    dataframe_shard()


def stall_after_reading() -> None:
    """Read the shard, then say nothing: a stall (the run's ``stall_timeout`` ends it)."""
    import time

    from airflow_provider_hvd import dataframe_shard

    for _ in dataframe_shard().iter_batches(16):
        pass
    time.sleep(300)


def resume_on_the_shard(checkpoint_dir: str) -> dict:
    """Each rank counts its shard's rows; the first try reports a checkpoint, then rank 1 fails; a retry resumes
    from it (``last_checkpoint()``) and reads its shard again."""
    import os

    import torch.distributed as dist

    from airflow_provider_hvd import dataframe_shard, last_checkpoint, report_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = sum(len(batch["id"]) for batch in dataframe_shard().iter_batches(16))
    resumed = last_checkpoint()
    if resumed is None:
        dist.barrier()
        if rank == 0:
            path = os.path.join(checkpoint_dir, "epoch-1")
            open(path, "w").close()
            report_checkpoint(path, epoch=1)
        dist.barrier()
        if rank == 1:
            raise RuntimeError("rank 1 fails on the first try, after the checkpoint")
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, rows)
    dist.destroy_process_group()
    return {"resumed_from": None if resumed is None else resumed["epoch"], "rows": counts}
