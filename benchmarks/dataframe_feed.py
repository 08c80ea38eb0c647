"""A DataFrame's rows into the ranks: ours against PySpark's loader and against the memory-mapped NumPy limit.

``--rows`` rows (default 10 million) x 16 ``float`` columns on ``local[2]``, 2 processes, batches of 1,024; each
batch's columns are summed (every reader touches every value). Measured in each rank, side by side in one run:

- ours: ``TorchDistributor(num_processes=2, local_mode=False).train_on_dataframe`` with
  ``dataframe_shard().iter_batches(1024)``;
- PySpark's: ``pyspark.ml.torch.distributor.TorchDistributor._train_on_dataframe`` with its
  ``_get_spark_partition_data_loader(rows per rank, 1024)``;
- the limit: NumPy over the same Arrow file as ours, memory-mapped (in our ranks, after our two epochs).

rows/s and MB/s into each rank (the slower rank's), and the seconds from the call to rank 0's first batch. Then
an agent's memory while its shard streams in: the barrier job over the same shard plan, each task running the
agent's shard writer (``receive_shards``, as the agent does before its rank starts); its peak resident memory
(``VmHWM``, reset once the task's first batch is in: its imports done) beyond the task's memory then (measured
first, in Python workers that have not yet held a shard's batches), against the largest Arrow batch it got
(``spark.sql.execution.arrow.maxRecordsPerBatch`` rows). Run::

    .venv/bin/python benchmarks/dataframe_feed.py --rows 10000000 [--json out.json]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable

import time  # noqa: E402
from typing import Any  # noqa: E402

from rounds import benchmark_parser, local_spark, markdown_table, quiet_logging, shown, write_json  # noqa: E402

COLUMNS = 16
BATCH = 1024
ROW_BYTES = COLUMNS * 4  # float32


def read_ours(batch_size: int) -> dict[str, float]:
    """A rank: our shard's batches, then the limit over the same file; when its first batch came."""
    import time

    import numpy as np
    import pyarrow as pa

    from airflow_provider_hvd import dataframe_shard

    shard = dataframe_shard()
    first = None
    passes = []
    for _ in range(2):  # the first epoch, and the next (the file in the page cache, the columns' views made)
        started = time.perf_counter()
        for batch in shard.iter_batches(batch_size):
            first = first or time.time()
            for values in batch.values():
                values.sum()
        passes.append(time.perf_counter() - started)
    pa.array([0.0]).to_numpy()  # Arrow's first conversion to NumPy imports pandas: not the limit's to pay
    started = time.perf_counter()
    for record_batch in pa.ipc.open_stream(pa.memory_map(shard.info.path)):
        columns = [np.asarray(column.to_numpy(zero_copy_only=True)) for column in record_batch.columns]
        for start in range(0, record_batch.num_rows, batch_size):
            for values in columns:
                values[start : start + batch_size].sum()
    limit = time.perf_counter() - started
    return {
        "rows": shard.num_rows,
        "ours_s": passes[0],
        "ours_again_s": passes[1],
        "limit_s": limit,
        "first_batch_at": first or 0.0,
    }


def read_pysparks(rows: int, batch_size: int) -> dict[str, float]:
    """A rank of PySpark's run: its loader's batches; when its first batch came."""
    import time

    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    first = None
    started = time.perf_counter()
    for batch in _get_spark_partition_data_loader(rows, batch_size):
        first = first or time.time()
        for values in batch:
            values.sum()
    return {"rows": rows, "pyspark_s": time.perf_counter() - started, "first_batch_at": first or 0.0}


def gathered(function: Any) -> Any:
    """``function`` on every rank, every rank's figures gathered (rank 0 returns them)."""

    def on_every_rank(*args: Any) -> list[dict[str, float]]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        own = function(*args)
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, own)
        dist.destroy_process_group()
        return views

    return on_every_rank


def agent_memory(spark: Any, df: Any, ranks: int) -> list[dict[str, int]]:
    """Each barrier task's growth while the agent's shard writer takes its rows: its peak beyond what it held
    once the first batch was in (its imports done), in bytes; the shard's rows; the Arrow batches it got (each
    with the plan's row index, which the shard file leaves out) and the largest one's bytes."""
    from airflow_provider_hvd.runner.driver.launch.spark.dataframe_plan import plan_shards

    plan = plan_shards(df, spark, ranks)
    feed = plan.feed  # (what the tasks need: the plan's DataFrame stays here)

    def task(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from airflow_provider_hvd.runner.agent.shard_writer import receive_shards

        def status(key: str) -> int:
            with open("/proc/self/status") as lines:
                return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))

        largest, before, count = [0], [0], [0]

        def measured(batches: Any) -> Any:
            for batch in batches:
                if not count[0]:  # the first batch is in: the task's imports are done, its reader running
                    with open("/proc/self/clear_refs", "w") as clear:
                        clear.write("5")  # the peak (VmHWM) starts again from what the task holds now
                    before[0] = status("VmRSS")
                largest[0] = max(largest[0], batch.nbytes)
                count[0] += 1
                yield batch

        with receive_shards(measured(batches), feed, BarrierTaskContext.get().partitionId()) as shards:
            written = shards.shards[0].info.rows
        growth = status("VmHWM") - before[0]
        yield pa.RecordBatch.from_pydict(
            {"before": before, "growth": [growth], "rows": [written], "batches": count, "batch_bytes": largest}
        )

    schema = "before long, growth long, rows long, batches long, batch_bytes long"
    frame = plan.frame.mapInArrow(task, schema, barrier=True)
    return [row.asDict() for row in frame.collect()]


def measure(spark: Any, rows: int) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks
    from pyspark.sql import functions as F

    from airflow_provider_hvd import TorchDistributor

    df = spark.range(0, rows, numPartitions=2).select(
        *[(F.col("id") * (k + 1)).cast("float").alias(f"c{k}") for k in range(COLUMNS)]
    )
    memory = agent_memory(spark, df, 2)  # first: in Python workers that have not yet held a shard's batches
    called = time.time()
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).train_on_dataframe(
        gathered(read_ours), df, BATCH
    )
    ours_first = ours[0]["first_batch_at"] - called
    called = time.time()
    theirs = PySparks(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
        gathered(read_pysparks), df, rows // 2, BATCH
    )
    theirs_first = theirs[0]["first_batch_at"] - called

    def rate(views: list[dict[str, float]], key: str) -> float:
        return min(view["rows"] / view[key] for view in views)  # the slower rank's

    figures = {
        "ours": {"rows_per_s": rate(ours, "ours_s"), "first_batch_s": ours_first},
        "ours_again": {"rows_per_s": rate(ours, "ours_again_s"), "first_batch_s": None},
        "pyspark": {"rows_per_s": rate(theirs, "pyspark_s"), "first_batch_s": theirs_first},
        "limit": {"rows_per_s": rate(ours, "limit_s"), "first_batch_s": None},
    }
    for figure in figures.values():
        figure["mb_per_s"] = figure["rows_per_s"] * ROW_BYTES / 1e6
    return {"agent_memory": memory, **figures}


def format_report(figures: dict[str, Any], rows: int) -> str:
    labels = {
        "ours": "ours (`iter_batches`), first epoch",
        "ours_again": "ours, second epoch",
        "pyspark": "PySpark's loader",
        "limit": "NumPy, memory-mapped (limit)",
    }
    table = markdown_table(
        ["reader", "rows/s per rank", "MB/s per rank", "call → rank 0's first batch (s)"],
        [
            [
                label,
                f"{figures[name]['rows_per_s']:,.0f}",
                f"{figures[name]['mb_per_s']:,.0f}",
                shown(figures[name]["first_batch_s"], 1),
            ]
            for name, label in labels.items()
        ],
    )
    ours, again, theirs, limit = (figures[name]["rows_per_s"] for name in ("ours", "ours_again", "pyspark", "limit"))
    memory = markdown_table(
        ["task", "shard (MB)", "Arrow batches", "largest (MB)", "at the first (MB)", "peak growth (MB)", "(batches)"],
        [
            [
                str(task),
                f"{task_figures['rows'] * ROW_BYTES / 1e6:,.0f}",
                f"{task_figures['batches']:,}",
                f"{task_figures['batch_bytes'] / 1e6:.2f}",
                f"{task_figures['before'] / 1e6:.0f}",
                f"{task_figures['growth'] / 1e6:.1f}",
                f"{task_figures['growth'] / task_figures['batch_bytes']:.1f}",
            ]
            for task, task_figures in enumerate(figures["agent_memory"])
        ],
    )
    return (
        f"{rows:,} rows x {COLUMNS} float columns, local[2], 2 processes, batches of {BATCH}\n{table}\n"
        f"ours / PySpark's: {ours / theirs:.1f}x; ours / limit: {ours / limit:.2f}x "
        f"(second epoch {again / limit:.2f}x)\nAn agent's memory while its shard streams in:\n{memory}"
    )


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    options = parser.parse_args()
    quiet_logging()
    spark = local_spark(2)
    try:
        figures = measure(spark, options.rows)
    finally:
        spark.stop()
    print(format_report(figures, options.rows))
    write_json(options.json, {"rows": options.rows, **figures})


if __name__ == "__main__":
    main()
