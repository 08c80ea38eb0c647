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
(``spark.sql.execution.arrow.maxRecordsPerBatch`` rows).

Then, without Spark (``--gather-only``: that part alone), shuffled batches against ordered ones, per column kind
(numbers, numbers with nulls, strings, arrays of 16 floats, Spark ML vectors of 16, arrays of 1 to 31 longs), at
two shard sizes (``--shard-mib``, default 64 and 256 MiB of the column): a shard written by the agent's shard
writer in record batches of 10,000 rows (Spark's ``maxRecordsPerBatch``), read by ``dataframe_shard()``'s
reader, batches of 1,024 over a whole epoch (after one to warm the page cache; the fastest of 3, ordered and
shuffled taking turns), each batch's values touched
(numbers summed, objects' lengths taken); beside it, for numbers and 2-D columns, NumPy's own random gather of
the same batches from the values in memory (a permutation per epoch, then ``values[rows]``: the least a shuffled
batch costs), and Arrow's ``ChunkedArray.take`` (the gather before) on 50 batches, with what one shuffled batch
allocates (Arrow's memory pool and NumPy's, at their peak). Run::

    .venv/bin/python benchmarks/dataframe_feed.py --rows 10000000 [--json out.json]
    .venv/bin/python benchmarks/dataframe_feed.py --gather-only [--shard-mib 64 256]
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


# --- shuffled against ordered batches, per column kind (no Spark) ---

GATHER_BATCH = 1024
RECORD_BATCH_ROWS = 10_000  # Spark's spark.sql.execution.arrow.maxRecordsPerBatch
BEFORE_BATCHES = 50
EPOCHS = 3  # of each, taking turns; the fastest of each counts (the machine may be shared)


def _column(kind: str, mib: int) -> Any:
    """An Arrow column of ``kind`` of about ``mib`` MiB."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    if kind == "numbers":
        return pa.array(np.arange((mib << 20) // 4, dtype=np.float32))
    if kind == "numbers, nulls":
        rows = (mib << 20) // 8
        return pa.array(np.arange(rows), mask=np.arange(rows) % 97 == 5)
    if kind == "strings":
        rows = (mib << 20) // 20
        lengths = 8 + np.arange(rows) % 17  # 8 to 24 bytes, 16 on average, and 4 of offsets
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        data = rng.integers(97, 123, size=int(offsets[-1]), dtype=np.uint8)
        return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data))
    if kind in ("arrays of 16", "vectors of 16"):
        width = 4 if kind == "arrays of 16" else 8
        rows = (mib << 20) // (16 * width + 4)
        offsets = pa.array(np.arange(0, 16 * rows + 1, 16, dtype=np.int32))
        values = rng.random(16 * rows, dtype=np.float32 if width == 4 else np.float64)
        if kind == "arrays of 16":
            return pa.ListArray.from_arrays(offsets, pa.array(values))
        no_indices = pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, dtype=np.int32)), pa.array([], pa.int32()))
        return pa.StructArray.from_arrays(
            [
                pa.array(np.ones(rows, dtype=np.int8)),
                pa.nulls(rows, pa.int32()),
                no_indices,
                pa.ListArray.from_arrays(offsets, pa.array(values)),
            ],
            names=["type", "size", "indices", "values"],  # Spark ML's VectorUDT, dense
        )
    assert kind == "ragged arrays"
    lengths = 1 + np.arange((mib << 20) // 132) % 31  # 1 to 31 longs, 16 on average
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(int(offsets[-1]))))


def _touch(batch: dict[str, Any]) -> None:
    for values in batch.values():
        if values.dtype == object:
            sum(map(len, (v for v in values if v is not None)))
        else:
            values.sum()


def _epoch_ms(shard: Any, shuffle: bool) -> float:
    """One epoch of batches, each touched: ms a batch."""
    started = time.perf_counter()
    count = 0
    for batch in shard.iter_batches(GATHER_BATCH, shuffle=shuffle, seed=count):
        _touch(batch)
        count += 1
    return (time.perf_counter() - started) * 1000 / count


def _allocated(take: Any) -> int:
    """The most ``take()`` held at once, in Arrow's memory pool and in NumPy (tracemalloc), in bytes."""
    import tracemalloc

    import pyarrow as pa

    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        take()
        numpy = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)
    return int(pool.max_memory()) + numpy


def gather_figures(kind: str, mib: int) -> dict[str, Any]:
    """One column of ``kind`` in a shard of about ``mib`` MiB: ordered and shuffled ms a batch, before and now."""
    import os

    import numpy as np
    import pyarrow as pa

    from airflow_provider_hvd.runner.agent.shard_writer import receive_shards
    from airflow_provider_hvd.runner.rank.arrow_columns import to_numpy
    from airflow_provider_hvd.runner.rank.dataframe import DataFrameShard
    from airflow_provider_hvd.runner.shared.shards import ROW_COLUMN, FeedSpec

    column = _column(kind, mib)
    rows = len(column)
    table = pa.table({"c": column})

    def batches() -> Any:
        for start in range(0, rows, RECORD_BATCH_ROWS):
            part = table.slice(start, RECORD_BATCH_ROWS).combine_chunks().to_batches()[0]
            yield part.append_column(ROW_COLUMN, pa.array(np.arange(start, start + part.num_rows)))

    with receive_shards(batches(), FeedSpec("bench", rows, 1), 0) as shards:
        shard = DataFrameShard(shards.shards[0].info)
        size = os.fstat(shards.shards[0].fd).st_size
        _epoch_ms(shard, False)  # (the page cache, the column's layout)
        rounds = [(_epoch_ms(shard, False), _epoch_ms(shard, True)) for _ in range(EPOCHS)]
        ordered, shuffled = min(r[0] for r in rounds), min(r[1] for r in rounds)  # (the least disturbed)
        order = shard._permutation(0)
        picked = order[:GATHER_BATCH].astype(np.int64)
        now = _allocated(lambda: shard.take(picked))
        col = shard._column("c")
        assert col.chunked is not None

        def before(rows: Any) -> Any:
            return to_numpy(col.chunked.take(pa.array(rows)), col.kind, col.dtype, col.ragged)

        floor = _numpy_floor(kind, shard, col)
        in_place = col.in_place is not None  # (numbers without nulls were gathered in place before too)
        started = time.perf_counter()
        for number in range(BEFORE_BATCHES if not in_place else 0):
            _touch({"c": before(order[number * GATHER_BATCH : (number + 1) * GATHER_BATCH])})
        before_ms = None if in_place else (time.perf_counter() - started) * 1000 / BEFORE_BATCHES
        before_bytes = None if in_place else _allocated(lambda: before(picked))
    return {
        "kind": kind,
        "shard_mib": size / (1 << 20),
        "rows": rows,
        "ordered_ms": ordered,
        "shuffled_ms": shuffled,
        "before_ms": before_ms,
        "numpy_ms": floor,
        "allocated": now,
        "before_allocated": before_bytes,
    }


def _numpy_floor(kind: str, shard: Any, column: Any) -> float | None:
    """An epoch of the same batches gathered from a NumPy array of the column's values in memory (numbers and
    2-D columns: NumPy's own random gather after a permutation of the rows, the least a shuffled epoch costs),
    each batch summed: ms a batch. None for columns of objects."""
    import numpy as np

    if kind in ("strings", "ragged arrays"):
        return None
    chunks = column.chunked.chunks
    values = np.concatenate([column.rows([(c, 0, len(chunk))]) for c, chunk in enumerate(chunks)])
    best = float("inf")
    for epoch in range(EPOCHS):
        started = time.perf_counter()
        order = np.random.default_rng(epoch).permutation(shard.num_rows)
        count = 0
        for start in range(0, shard.num_rows, GATHER_BATCH):
            values[order[start : start + GATHER_BATCH]].sum()
            count += 1
        best = min(best, (time.perf_counter() - started) * 1000 / count)
    return best


GATHER_KINDS = ("numbers", "numbers, nulls", "strings", "arrays of 16", "vectors of 16", "ragged arrays")


def format_gather(figures: list[dict[str, Any]]) -> str:
    def mib(size: int | None) -> str:
        return "n/a" if size is None else f"{size / (1 << 20):,.2f}"

    return markdown_table(
        [
            "column",
            "shard (MiB)",
            "ordered (ms/batch)",
            "shuffled",
            "shuffled / ordered",
            "NumPy's random gather",
            "before (`ChunkedArray.take`)",
            "a shuffled batch's memory (MiB)",
            "before",
        ],
        [
            [
                f["kind"],
                f"{f['shard_mib']:,.0f}",
                f"{f['ordered_ms']:.3f}",
                f"{f['shuffled_ms']:.3f}",
                f"{f['shuffled_ms'] / f['ordered_ms']:.1f}x",
                shown(f["numpy_ms"], 3),
                shown(f["before_ms"], 2),
                mib(f["allocated"]),
                mib(f["before_allocated"]),
            ]
            for f in figures
        ],
    )


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--gather-only", action="store_true", help="only shuffled against ordered (no Spark)")
    parser.add_argument("--shard-mib", type=int, nargs="+", default=[64, 256])
    options = parser.parse_args()
    quiet_logging()
    figures: dict[str, Any] = {"rows": options.rows}
    if not options.gather_only:
        spark = local_spark(2)
        try:
            figures.update(measure(spark, options.rows))
        finally:
            spark.stop()
        print(format_report(figures, options.rows))
    figures["gather"] = [gather_figures(kind, mib) for mib in options.shard_mib for kind in GATHER_KINDS]
    print(
        f"Shuffled against ordered batches of {GATHER_BATCH:,}, one column, each batch touched:\n"
        + format_gather(figures["gather"])
    )
    write_json(options.json, figures)


if __name__ == "__main__":
    main()
