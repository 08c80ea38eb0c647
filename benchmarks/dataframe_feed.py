"""A DataFrame's rows into the ranks: ours against PySpark's loader and against the memory-mapped NumPy limit.

``--rows`` rows (default 10 million) x 16 ``float`` columns on ``local[2]``, 2 processes, batches of 1,024; each
batch's columns are summed (every reader touches every value). Measured in each rank, side by side in one run:

- ours: ``TorchDistributor(num_processes=2, local_mode=False).train_on_dataframe`` with
  ``dataframe_shard().iter_batches(1024)``;
- PySpark's: ``pyspark.ml.torch.distributor.TorchDistributor._train_on_dataframe`` with its
  ``_get_spark_partition_data_loader(rows per rank, 1024)``;
- the limit: NumPy over the same Arrow file as ours, memory-mapped (in our ranks, after our two epochs).

rows/s and MB/s into each rank (the slower rank's), and the seconds from the call to rank 0's first batch. Run::

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


def measure(spark: Any, rows: int) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks
    from pyspark.sql import functions as F

    from airflow_provider_hvd import TorchDistributor

    df = spark.range(0, rows, numPartitions=2).select(
        *[(F.col("id") * (k + 1)).cast("float").alias(f"c{k}") for k in range(COLUMNS)]
    )
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
    return figures


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
                labels[name],
                f"{figure['rows_per_s']:,.0f}",
                f"{figure['mb_per_s']:,.0f}",
                shown(figure["first_batch_s"], 1),
            ]
            for name, figure in figures.items()
        ],
    )
    ours, again, theirs, limit = (figures[name]["rows_per_s"] for name in ("ours", "ours_again", "pyspark", "limit"))
    return (
        f"{rows:,} rows x {COLUMNS} float columns, local[2], 2 processes, batches of {BATCH}\n{table}\n"
        f"ours / PySpark's: {ours / theirs:.1f}x; ours / limit: {ours / limit:.2f}x (second epoch {again / limit:.2f}x)"
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
