"""A DataFrame's rows into the ranks: the shard plan on Spark (classic local[2] and Spark Connect), the barrier
tasks' shard files, and the ranks' reads of them (dataframe_shard(), get_spark_partition_data_loader), against
PySpark's own loader on the same files."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pytest
import torch
from connect_server import connect_session
from dataframe_jobs import (
    arrow_rows,
    ask_for_a_shard,
    by_value,
    ddp_steps,
    held_after,
    horovod_ids,
    loader_rows,
    run_shards,
    shard_file_then,
    shards_of,
)
from pysparks import pysparks_result

from airflow_provider_hvd import dataframe_shard
from airflow_provider_hvd.runner import reaper
from airflow_provider_hvd.runner.agent.shard_writer import receive_shards
from airflow_provider_hvd.runner.driver.launch.spark.cluster import is_connect
from airflow_provider_hvd.runner.driver.launch.spark.connect_client import running_operations
from airflow_provider_hvd.runner.driver.launch.spark.dataframe_plan import murmur3_int, partition_keys, plan_shards
from airflow_provider_hvd.runner.rank import dataframe as shard_reader
from airflow_provider_hvd.runner.shared.arrow_views import fixed_width_view
from airflow_provider_hvd.runner.shared.naming import TORCH_DISTRIBUTOR
from airflow_provider_hvd.runner.shared.shards import ROW_COLUMN, SHARD_ENV, FeedSpec


@pytest.fixture(params=["local[2]", "connect"])
def spark(request):
    """The module's local[2] session, or a Spark Connect session to the local server (its own for the test)."""
    if request.param == "local[2]":
        yield request.getfixturevalue("spark_local")
        return
    with connect_session(request.getfixturevalue("connect_local")) as session:
        yield session


def ids_of(shard) -> list[int]:
    return [int(i) for batch in shard.iter_batches(16, columns=["id"]) for i in batch["id"]]


def functions_of(spark):
    """pyspark's column functions for a classic session, Spark Connect's for a Connect one."""
    if is_connect(spark):
        from pyspark.sql.connect import functions

        return functions
    from pyspark.sql import functions

    return functions


def uneven(spark):
    """113 rows in 5 partitions of 25, 26, 26, 26 and 10 rows: ids 0-102, then 1000-1009."""
    F = functions_of(spark)
    df = spark.range(0, 103, numPartitions=4).union(spark.range(1000, 1010, numPartitions=1))
    return df.select("id", (F.col("id") * 0.5).alias("half"))


def expected_shards(rows: list[int], ranks: int) -> list[list[int]]:
    n = len(rows)
    return [rows[r * n // ranks : (r + 1) * n // ranks] for r in range(ranks)]


# --- the plan, on Spark ---


def test_the_keys_fall_in_their_partitions_as_sparks_hash_partitioning_sends_them(spark_local):
    from pyspark.sql import functions as F

    hashes = spark_local.range(-500, 500).select("id", F.hash(F.col("id").cast("int")).alias("h")).collect()
    assert [murmur3_int(row["id"]) for row in hashes] == [row["h"] for row in hashes]
    keys = partition_keys(7)
    landed = (
        spark_local.createDataFrame([(k,) for k in keys], "k int")
        .repartition(7, "k")
        .select("k", F.spark_partition_id().alias("p"))
        .collect()
    )
    assert {row["k"]: row["p"] for row in landed} == {k: t for t, k in enumerate(keys)}


@pytest.mark.parametrize(("ranks", "per_task"), [(2, 1), (4, 2)])
def test_each_rank_gets_its_contiguous_rows_in_sparks_order(spark, ranks, per_task):
    """5 uneven partitions into 2 ranks, or into 4 ranks 2 per task (local[2] has 2 task slots): rank r gets the
    global rows [floor(r*N/np), floor((r+1)*N/np)) in Spark's order, in order; one barrier task per partition of
    the plan."""
    shards = shards_of(uneven(spark), spark, ranks, ids_of, per_task)
    rows = [*range(103), *range(1000, 1010)]
    assert {r: shards[r]["result"] for r in shards} == dict(enumerate(expected_shards(rows, ranks)))
    for r, shard in shards.items():
        assert (shard["task"], shard["process"], shard["tasks"]) == (r // per_task, r % per_task, ranks // per_task)
        assert shard["info"].rows == len(shard["result"]) and shard["info"].min_rows == 113 // ranks
    assert max(map(len, (s["result"] for s in shards.values()))) - min(len(s["result"]) for s in shards.values()) <= 1


def test_a_dataframe_of_np_equal_partitions_gives_rank_i_partition_i(spark_local):
    """PySpark's assignment, where the partitions already match the ranks."""
    from pyspark.sql import functions as F

    df = spark_local.range(0, 40, numPartitions=2).withColumn("p", F.spark_partition_id())
    shards = shards_of(df, spark_local, 2, lambda shard: sorted({int(p) for p in shard.take(range(20))["p"]}))
    assert {r: s["result"] for r, s in shards.items()} == {r: [r] for r in range(2)}


def test_the_count_sees_the_partitions_adaptive_execution_gives_the_job(spark_local):
    """A DataFrame that ends with a shuffle adaptive execution coalesces by its size: counted without its
    columns it would be one partition (measured: 1, against 42 in the job) and the tasks' rows would not be
    those planned."""
    from pyspark.sql import functions as F

    settings = {
        "spark.sql.adaptive.advisoryPartitionSizeInBytes": "16k",
        "spark.sql.adaptive.coalescePartitions.minPartitionSize": "16k",
    }
    before = {key: spark_local.conf.get(key) for key in settings}
    for key, value in settings.items():
        spark_local.conf.set(key, value)
    try:
        base = spark_local.range(0, 20000, numPartitions=2).select(
            (F.col("id") % 400).alias("k"), F.sha2(F.col("id").cast("string"), 512).alias("s")
        )
        df = base.groupBy("k").agg(F.collect_list(F.crc32("s")).alias("ss"))
        plan = plan_shards(df.select("k"), spark_local, 2)  # (no column beyond the key: pruned)
        assert len(plan.partition_rows) == 1
        plan = plan_shards(df, spark_local, 2)
        assert len(plan.partition_rows) > 2, plan.partition_rows
        shards = run_shards(plan, lambda shard: sorted(int(k) for k in shard.take(range(shard.num_rows))["k"]))
    finally:
        for key, value in before.items():
            spark_local.conf.set(key, value)
    assert sorted(shards[0]["result"] + shards[1]["result"]) == list(range(400))
    assert [s["info"].rows for s in shards.values()] == [200, 200]


def test_a_coalesced_dataframe_feeds_a_barrier_job(spark_local):
    """A barrier stage over a coalesced plan is refused by Spark (PySpark's _train_on_dataframe fails on it):
    the plan's own shuffle starts the barrier stage."""
    shards = shards_of(spark_local.range(0, 30, numPartitions=4).coalesce(1), spark_local, 2, ids_of)
    assert {r: s["result"] for r, s in shards.items()} == {0: list(range(15)), 1: list(range(15, 30))}


def test_the_plan_refuses_what_it_cannot_feed_in_one_sentence(spark_local):
    from pyspark.sql import functions as F

    page = (Path(__file__).parent.parent / "docs" / "dataframes.md").read_text()
    quoted = re.findall(r"`ValueError: (The DataFrame has [^`]+)`", re.sub(r"\s*\n\s*", " ", page))
    assert len(quoted) == 2, quoted  # (the page quotes both refusals, as the code says them)
    with pytest.raises(ValueError) as none:
        plan_shards(spark_local.range(0), spark_local, 2, naming=TORCH_DISTRIBUTOR)
    with pytest.raises(ValueError) as fewer:
        plan_shards(spark_local.range(3), spark_local, 4, naming=TORCH_DISTRIBUTOR)
    assert sorted(quoted) == sorted([str(none.value), str(fewer.value)])
    with pytest.raises(ValueError, match=r"^The DataFrame has no rows: HorovodRunner has nothing to give"):
        plan_shards(spark_local.range(0), spark_local, 2)
    other = spark_local.newSession()
    with pytest.raises(ValueError, match=r"^The DataFrame belongs to another SparkSession than the one Horovod"):
        plan_shards(other.range(4), spark_local, 2)
    one = spark_local.range(1)
    for column, type_name in [
        (F.create_map(F.lit("a"), F.col("id")), "map<string,bigint>"),
        (F.struct(F.col("id")), "struct<id:bigint>"),
        (F.array(F.lit("a")), "array<string>"),
        (F.array(F.array(F.lit(1.0))), "array<array<double>>"),
        (F.make_interval(F.lit(1)), "interval"),
        (F.parse_json(F.lit("{}")), "variant"),
    ]:
        with pytest.raises(ValueError, match=rf"^The DataFrame's column 'x' is of type {type_name}, which the ranks"):
            plan_shards(one.select(column.alias("x")), spark_local, 1)
    with pytest.raises(ValueError, match=r"two columns named 'id'"):
        plan_shards(one.select("id", "id"), spark_local, 1)
    with pytest.raises(ValueError, match=r"column '__hvd_row' has a name the runner uses itself"):
        plan_shards(one.withColumnRenamed("id", "__hvd_row"), spark_local, 1)


def test_a_dataframe_of_another_connect_session_is_refused(connect_local):
    from pyspark.sql.connect.session import SparkSession

    with connect_session(connect_local) as spark:
        other = SparkSession.builder.remote(connect_local).create()  # (getOrCreate() would give spark again)
        try:
            with pytest.raises(ValueError, match=r"^The DataFrame belongs to another SparkSession"):
                plan_shards(other.range(4), spark, 2)
        finally:
            other.stop()
        with pytest.raises(ValueError, match=r"^The DataFrame has no rows"):
            plan_shards(spark.range(0), spark, 2)


# --- the columns, as Spark's Arrow batches bring them ---


def read_types(shard) -> dict:
    batch = next(shard.iter_batches(8))
    tensors = {}
    for name in batch:
        try:
            tensors[name] = next(shard.iter_torch_batches(8, columns=[name]))[name]
        except TypeError as exc:
            tensors[name] = str(exc)
    return {"batch": batch, "tensors": tensors, "schema": shard.schema}


def test_every_column_type_arrives_as_numpy(spark_local):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType(
        [
            T.StructField("byte", T.ByteType()),
            T.StructField("short", T.ShortType()),
            T.StructField("int", T.IntegerType()),
            T.StructField("long", T.LongType()),
            T.StructField("float", T.FloatType()),
            T.StructField("double", T.DoubleType()),
            T.StructField("int_null", T.IntegerType()),
            T.StructField("bool", T.BooleanType()),
            T.StructField("decimal", T.DecimalType(10, 2)),
            T.StructField("string", T.StringType()),
            T.StructField("binary", T.BinaryType()),
            T.StructField("date", T.DateType()),
            T.StructField("timestamp", T.TimestampType()),
            T.StructField("timestamp_ntz", T.TimestampNTZType()),
            T.StructField("duration", T.DayTimeIntervalType()),
            T.StructField("floats", T.ArrayType(T.FloatType())),
            T.StructField("ragged", T.ArrayType(T.IntegerType())),
            T.StructField("dense", VectorUDT()),
            T.StructField("mixed", VectorUDT()),
        ]
    )
    when = datetime.datetime(2024, 5, 6, 7, 8, 9)
    rows = [
        (
            i,
            i * 100,
            i * 10_000,
            i * 10**10,
            i + 0.5,
            i + 0.25,
            None if i == 1 else i,
            i % 2 == 0,
            decimal.Decimal(f"{i}.25"),
            f"s{i}",
            bytes([i]),
            datetime.date(2024, 1, 1 + i),
            when + datetime.timedelta(seconds=i),
            when + datetime.timedelta(seconds=i),
            datetime.timedelta(seconds=i, microseconds=5),
            [float(i), i + 1.0],
            list(range(i)),
            Vectors.dense([i, i + 1.0, i + 2.0]),
            Vectors.dense([1.0, 2.0, 3.0]) if i % 2 else Vectors.sparse(3, [0, 2], [i + 0.5, 7.0]),
        )
        for i in range(4)
    ]
    df = spark_local.createDataFrame(rows, schema).repartition(2)
    got = shards_of(df, spark_local, 1, read_types)[0]["result"]
    batch, tensors = got["batch"], got["tensors"]
    order = np.argsort(batch["byte"])  # (repartition(2) spread the rows over the partitions)
    batch = {name: values[order] for name, values in batch.items()}
    for name, dtype in [("byte", np.int8), ("short", np.int16), ("int", np.int32), ("long", np.int64)]:
        assert batch[name].dtype == dtype and tensors[name].dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    assert batch["long"].tolist() == [0, 10**10, 2 * 10**10, 3 * 10**10]
    assert batch["float"].dtype == np.float32 and batch["float"].tolist() == [0.5, 1.5, 2.5, 3.5]
    assert batch["double"].dtype == np.float64 and tensors["double"].dtype == torch.float64
    assert np.isnan(batch["int_null"][1]) and batch["int_null"][[0, 2, 3]].tolist() == [0, 2, 3]
    assert batch["bool"].tolist() == [True, False, True, False] and tensors["bool"].dtype == torch.bool
    assert batch["decimal"].tolist() == [decimal.Decimal(f"{i}.25") for i in range(4)]
    assert batch["string"].tolist() == ["s0", "s1", "s2", "s3"] and batch["binary"].tolist() == [
        bytes([i]) for i in range(4)
    ]
    assert batch["date"].dtype == np.dtype("datetime64[D]") and str(batch["date"][1]) == "2024-01-02"
    assert batch["timestamp"].dtype.kind == batch["timestamp_ntz"].dtype.kind == "M"
    assert batch["timestamp_ntz"][2] == np.datetime64("2024-05-06T07:08:11")
    assert batch["duration"].dtype.kind == "m" and batch["duration"][3] == np.timedelta64(3_000_005, "us")
    assert batch["floats"].dtype == np.float32 and batch["floats"].shape == (4, 2)
    assert batch["floats"].tolist() == [[float(i), i + 1.0] for i in range(4)]
    assert batch["ragged"].dtype == object and [list(r) for r in batch["ragged"]] == [list(range(i)) for i in range(4)]
    assert batch["dense"].dtype == np.float64 and batch["dense"].tolist() == [[i, i + 1, i + 2] for i in range(4)]
    assert batch["mixed"].tolist() == [[0.5, 0, 7], [1, 2, 3], [2.5, 0, 7], [1, 2, 3]]
    assert tensors["mixed"].shape == (4, 3) and tensors["floats"].dtype == torch.float32
    for name, what in [("string", "objects"), ("ragged", "rows of different lengths"), ("timestamp", "timestamps")]:
        assert tensors[name].startswith(f"column {name!r} holds ") and what in tensors[name], tensors[name]


# --- the shard files ---


@contextlib.contextmanager
def local_shards(table: pa.Table, ranks: int, batch_rows: int = 100):
    """``table``'s rows in ``ranks`` shards written in this process (no Spark), one task each; yields a
    function that makes shard ``r`` this process's."""
    feed = FeedSpec("t", table.num_rows, ranks)
    written = []
    try:
        for task in range(ranks):
            start, stop = feed.task_range(task)
            part = pa.Table.from_batches(table.slice(start, stop - start).to_batches(max_chunksize=batch_rows))
            written.append(receive_shards(arrow_rows(part, start), feed, task))

        def use(rank: int):
            os.environ.update(written[rank].rank_env(0))
            return dataframe_shard()

        yield use
    finally:
        os.environ.pop(SHARD_ENV, None)
        shard_reader._opened = None  # (the next test's file may get this one's descriptor, and so its path)
        for shards in written:
            shards.close()


def numbers(rows: int) -> pa.Table:
    return pa.table({"x": np.arange(rows, dtype=np.float32), "s": [str(i) for i in range(rows)]})


def test_batches_shuffle_and_drop_last_keep_the_ranks_in_step():
    """1,003 rows in 4 shards of 250 and 251: without drop_last the last ranks have one batch more; with it every
    rank has floor(250 / batch_size) full batches. A seed (the epoch) gives the same order again, another seed
    another order; rows stay whole (each column's values of one row together)."""
    with local_shards(numbers(1003), 4) as shard_of:
        counts, dropped = [], []
        for rank in range(4):
            shard = shard_of(rank)
            start = rank * 1003 // 4
            batches = list(shard.iter_batches(30))  # (batches across the file's record batches of 100)
            assert np.concatenate([b["x"] for b in batches]).tolist() == list(range(start, start + shard.num_rows))
            assert [len(b["x"]) for b in batches[:-1]] == [30] * (len(batches) - 1)
            counts.append(len(list(shard.iter_batches(25))))
            epochs = [list(shard.iter_batches(25, shuffle=True, seed=epoch, drop_last=True)) for epoch in (0, 0, 1)]
            dropped.append(len(epochs[0]))
            orders = [np.concatenate([b["x"] for b in epoch]) for epoch in epochs]
            assert all(len(b["x"]) == 25 for b in epochs[0])
            assert orders[0].tolist() == orders[1].tolist() != orders[2].tolist()
            assert len(set(orders[0].tolist()) & set(range(start, start + shard.num_rows))) == 250
            assert orders[0].tolist() != sorted(orders[0].tolist())
            for batch in epochs[2]:
                assert batch["s"].tolist() == [str(int(x)) for x in batch["x"]]
            whole = np.concatenate([b["x"] for b in shard.iter_batches(64, shuffle=True)])
            assert sorted(whole.tolist()) == list(range(start, start + shard.num_rows))
            assert shard.num_batches(25) == counts[-1] and shard.num_batches(25, drop_last=True) == 10
        assert counts == [10, 11, 11, 11] and dropped == [10, 10, 10, 10]


def test_each_iteration_reads_the_mapped_file_in_place():
    with local_shards(numbers(500), 1) as shard_of:
        shard = shard_of(0)
        first, again = (list(shard.iter_batches(64, columns=["x"])) for _ in range(2))
        assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(first, again, strict=True))
        inside = first[0]["x"]  # a read-only view of the file, not a copy
        assert not inside.flags.writeable and not inside.flags.owndata
        assert dataframe_shard() is shard  # opened once in the process
        assert shard.take([5, 0, 499])["x"].tolist() == [5, 0, 499]


def test_every_fixed_width_type_is_read_in_place_as_arrows_own_conversion_gives_it():
    """Integers and floats of every width, timestamps (with a time zone too) and durations, from a slice of an
    array (an offset into its buffer): the in-place view, read-only, has Arrow's ``to_numpy`` values and dtype."""
    arrays = [pa.array([1, -2, 3, -4, 5], type=t) for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64())]
    arrays += [pa.array([1, 2, 3, 4, 5], type=t) for t in (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())]
    arrays += [pa.array(np.arange(5, dtype=dtype) / 2) for dtype in (np.float16, np.float32, np.float64)]
    arrays += [pa.array(range(5), type=pa.timestamp(unit)) for unit in ("s", "ms", "us", "ns")]
    arrays += [pa.array(range(5), type=pa.timestamp("us", tz="Europe/Paris")), pa.array(range(5), pa.duration("ms"))]
    for array in arrays:
        sliced = array.slice(1, 3)
        view, expected = fixed_width_view(sliced), sliced.to_numpy(zero_copy_only=True)
        assert view is not None and view.dtype == expected.dtype, array.type
        assert view.tolist() == expected.tolist(), array.type
        assert np.shares_memory(view, expected) and not view.flags.writeable, array.type  # in place, not a copy
    assert fixed_width_view(pa.array([1, None])) is None  # (nulls, booleans: not NumPy's layout)
    assert fixed_width_view(pa.array([True, False])) is None


def test_a_nullable_column_has_one_dtype_in_every_batch_of_the_shard():
    """A null in one record batch of the shard only: its integer column is float64 (NaN for the null) and its
    boolean column objects (None) in every batch, also those without a null, read in order, shuffled or taken;
    a column without a null keeps its own dtype. Torch batches then never switch from long to float partway
    through an epoch."""
    label = pa.array([None if i == 150 else i for i in range(300)], pa.int64())
    flag = pa.array([None if i == 150 else i % 2 == 0 for i in range(300)], pa.bool_())
    table = pa.table({"label": label, "flag": flag, "plain": np.arange(300, dtype=np.int32)})
    with local_shards(table, 1) as shard_of:  # (record batches of 100: the null is in the second)
        shard = shard_of(0)
        for batches in (
            list(shard.iter_batches(50)),
            list(shard.iter_batches(64, shuffle=True, seed=1)),
            [shard.take([0, 1, 2]), shard.take([150, 3])],
        ):
            assert {str(b["label"].dtype) for b in batches} == {"float64"}
            assert {str(b["flag"].dtype) for b in batches} == {"object"}
            assert {str(b["plain"].dtype) for b in batches} == {"int32"}
        assert np.isnan(shard.take([150])["label"][0]) and shard.take([150, 2])["flag"].tolist() == [None, True]
        tensors = list(shard.iter_torch_batches(50, columns=["label", "plain"]))
        assert len(tensors) == 6 and {(t["label"].dtype, t["plain"].dtype) for t in tensors} == {
            (torch.float64, torch.int32)
        }
        with pytest.raises(TypeError, match=r"^column 'flag' holds objects"):
            next(shard.iter_torch_batches(50, columns=["flag"]))  # (at the first batch, not partway)


def test_an_array_column_is_2d_or_objects_in_every_batch_of_the_shard():
    """Rows of one length in the first record batch, and of another (or a null) in the second: every batch is
    1-D objects, read in order, shuffled or taken; rows of one length throughout: every batch 2-D."""
    ragged = pa.array([[1.0, 2.0]] * 100 + [[1.0, 2.0, 3.0]] * 100, pa.list_(pa.float32()))
    with_null = pa.array([[1.0, 2.0]] * 150 + [None] + [[1.0, 2.0]] * 49, pa.list_(pa.float32()))
    even = pa.array([[float(i), 0.0] for i in range(200)], pa.list_(pa.float32()))
    with local_shards(pa.table({"ragged": ragged, "with_null": with_null, "even": even}), 1) as shard_of:
        shard = shard_of(0)  # (record batches of 100)
        for batches in (
            list(shard.iter_batches(50)),
            list(shard.iter_batches(64, shuffle=True, seed=1)),
            [shard.take([0, 1]), shard.take([150, 199])],
        ):
            assert {(b["ragged"].dtype, b["ragged"].ndim) for b in batches} == {(np.dtype(object), 1)}
            assert {(b["with_null"].dtype, b["with_null"].ndim) for b in batches} == {(np.dtype(object), 1)}
            assert {(b["even"].dtype, b["even"].shape[1:]) for b in batches} == {(np.dtype(np.float32), (2,))}
        assert shard.take([0])["ragged"][0].tolist() == [1.0, 2.0] and shard.take([150])["with_null"][0] is None


def test_an_array_column_with_a_null_element_has_one_element_dtype_in_every_batch():
    """A null element (not a null row) in the second record batch only: an array<bigint> column is float64 (NaN
    for the null element) in every batch, 2-D, also in the first batch, read in order, shuffled or taken; an
    array<boolean> one objects (None); one without a null element keeps int64. Before, the first batch was int64
    and the second float64."""
    ints = pa.array([[i, i + 1] for i in range(150)] + [[150, None]] + [[i, i + 1] for i in range(151, 200)])
    flags = pa.array([[True, False]] * 150 + [[None, True]] + [[False, True]] * 49, pa.list_(pa.bool_()))
    plain = pa.array([[i, -i] for i in range(200)], pa.list_(pa.int64()))
    with local_shards(pa.table({"ints": ints, "flags": flags, "plain": plain}), 1) as shard_of:
        shard = shard_of(0)  # (record batches of 100: the null element is in the second)
        for batches in (
            list(shard.iter_batches(50)),
            list(shard.iter_batches(64, shuffle=True, seed=1)),
            [shard.take([0, 1]), shard.take([150, 199])],
        ):
            assert {(b["ints"].dtype, b["ints"].shape[1:]) for b in batches} == {(np.dtype(np.float64), (2,))}
            assert {(b["flags"].dtype, b["flags"].shape[1:]) for b in batches} == {(np.dtype(object), (2,))}
            assert {(b["plain"].dtype, b["plain"].shape[1:]) for b in batches} == {(np.dtype(np.int64), (2,))}
        assert np.isnan(shard.take([150])["ints"][0][1]) and shard.take([150])["flags"][0].tolist() == [None, True]
        assert shard.take([0])["ints"].tolist() == [[0.0, 1.0]] and shard.take([3])["flags"][0].tolist() == [
            True,
            False,
        ]
        tensors = list(shard.iter_torch_batches(50, columns=["ints", "plain"]))
        assert {(t["ints"].dtype, t["plain"].dtype) for t in tensors} == {(torch.float64, torch.int64)}


def vectors(rows: list) -> pa.Array:
    """Spark ML vectors as they travel in Arrow (VectorUDT's struct): a list of floats is dense, a
    ``(size, indices, values)`` sparse, None null."""
    data = [
        None
        if row is None
        else {"type": 1, "size": None, "indices": None, "values": row}
        if isinstance(row, list)
        else {"type": 0, "size": row[0], "indices": row[1], "values": row[2]}
        for row in rows
    ]
    kind = pa.struct(
        [
            ("type", pa.int8()),
            ("size", pa.int32()),
            ("indices", pa.list_(pa.int32())),
            ("values", pa.list_(pa.float64())),
        ]
    )
    return pa.array(data, kind)


def every_kind(rows: int) -> pa.Table:
    """A column of each kind a gather reads, some with nulls (rows, elements), long and short strings and bytes."""
    ids = range(rows)
    return pa.table(
        {
            "number": pa.array(np.arange(rows, dtype=np.float32)),
            "label": pa.array([None if i % 97 == 5 else i for i in ids], pa.int64()),
            "flag": pa.array([None if i % 89 == 3 else i % 3 == 0 for i in ids], pa.bool_()),
            "text": pa.array([None if i % 83 == 1 else f"row {i} " * (i % 4) for i in ids]),
            "blob": pa.array([bytes([i % 256]) * (i % 300) for i in ids], pa.binary()),
            "price": pa.array([decimal.Decimal(i) / 100 for i in ids], pa.decimal128(12, 2)),
            "when": pa.array([None if i % 7 == 0 else i * 1000 for i in ids], pa.timestamp("us")),
            "features": pa.array([[i, i + 0.5, -i, 1.0] for i in ids], pa.list_(pa.float32())),
            "fixed": pa.array([[i, -i] for i in ids], pa.list_(pa.int32(), 2)),
            "tokens": pa.array([None if i % 50 == 7 else [i, None][: i % 3] for i in ids], pa.list_(pa.int64())),
            "dense": vectors([[float(i), 2.0, 3.0] for i in ids]),
            "mixed": vectors([None if i % 61 == 2 else [float(i), 1.0] if i % 2 else (3, [0], [i]) for i in ids]),
        }
    )


def same(a, b) -> bool:
    """Two values of a batch alike: NaN as NaN, NaT as NaT, arrays element by element."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f" and b.dtype.kind == "f":
            return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
        return a.shape == b.shape and all(same(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    if isinstance(a, np.datetime64 | np.timedelta64) and isinstance(b, np.datetime64 | np.timedelta64):
        return bool((np.isnat(a) and np.isnat(b)) or a == b)
    return bool(a == b) if a is not None and b is not None else a is b


def test_a_shuffled_batch_holds_the_rows_an_ordered_one_does():
    """Every kind of column, rows gathered from all over the shard (record batches of 100), give each row as the
    ordered batches give it, with the same dtype and shape."""
    table = every_kind(1000)
    with local_shards(table, 1) as shard_of:
        shard = shard_of(0)
        ordered = {name: [] for name in table.column_names}
        for batch in shard.iter_batches(128):
            for name, values in batch.items():
                ordered[name].extend(values)
        [first_ordered] = list(shard.iter_batches(1000))
        rows = np.random.default_rng(7).permutation(1000)[:300]
        taken = shard.take(rows)
        for name in table.column_names:
            assert taken[name].dtype == first_ordered[name].dtype, name
            assert taken[name].shape[1:] == first_ordered[name].shape[1:], name
            for k, row in enumerate(rows):
                assert same(taken[name][k], ordered[name][row]), (name, int(row), taken[name][k], ordered[name][row])
        shuffled = list(shard.iter_batches(256, shuffle=True, seed=3))
        assert {b["number"].dtype for b in shuffled} == {np.dtype(np.float32)}
        assert sorted(np.concatenate([b["number"] for b in shuffled]).tolist()) == list(range(1000))


def test_a_shuffled_batch_reads_only_its_rows_whatever_the_shard_size():
    """A batch of 64 rows gathered from all over a shard of 60,000 rows (its columns up to 9 MB each): what it
    allocates, in Arrow's memory pool and in NumPy (tracemalloc), is the batch's, not a column's. Arrow's
    ChunkedArray.take, used before, concatenated every record batch of the column first: a copy of the whole
    column per batch."""
    import tracemalloc

    table = every_kind(60_000)
    sizes = {name: table.column(name).nbytes for name in table.column_names}
    with local_shards(table, 1, batch_rows=1000) as shard_of:
        shard = shard_of(0)
        shard.take([0, 59_999])  # (the columns' layouts, made once)
        rows = np.random.default_rng(1).permutation(60_000)[:64]
        grew = {}
        for name in table.column_names:
            default = pa.default_memory_pool()
            pool = pa.proxy_memory_pool(default)
            pa.set_memory_pool(pool)
            tracemalloc.start()
            try:
                shard.take(rows, columns=[name])
                numpy = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
                pa.set_memory_pool(default)
            grew[name] = (pool.max_memory() + numpy, sizes[name])
    assert max(size for _, size in grew.values()) > 9_000_000, grew
    assert all(grown < 200_000 for grown, _ in grew.values()), grew  # (before: each column's size, and more)


def test_a_rank_asks_for_what_its_shard_cannot_give():
    os.environ.pop(SHARD_ENV, None)
    with pytest.raises(RuntimeError, match=r"^dataframe_shard\(\) works in the ranks of a run on a DataFrame"):
        dataframe_shard()
    table = pa.table({"x": [1, 2, 3], "m": pa.array([[("a", 1)]] * 3, pa.map_(pa.string(), pa.int64()))})
    with local_shards(table, 1) as shard_of:
        shard = shard_of(0)
        with pytest.raises(TypeError, match=r"^column 'm' is of Arrow type map<string, int64>, which"):
            next(shard.iter_batches(2))
        assert next(shard.iter_batches(2, columns=["x"]))["x"].tolist() == [1, 2]
        with pytest.raises(KeyError, match=r"the shard has no column 'y'; its columns: x, m"):
            next(shard.iter_batches(2, columns=["y"]))
        with pytest.raises(TypeError, match=r"columns must be a list of column names, not the string 'x'"):
            next(shard.iter_batches(2, columns="x"))
        with pytest.raises(ValueError, match=r"batch_size must be a positive int, not 0"):
            next(shard.iter_batches(0))
        with pytest.raises(IndexError, match=r"row indices must be in 0 ... 2"):
            shard.take([3])


def test_a_task_holds_a_few_batches_while_its_shard_streams_to_disk(spark_local):
    """A shard of 80 MB in batches of 2 MB: the task's process grows by a few batches at most."""
    from pyspark.sql import functions as F

    rows, batch_rows = 1_000_000, 25_000  # 8 doubles and the row index: 72 bytes a row, 1.8 MB a batch
    df = spark_local.range(0, rows, numPartitions=2).select(
        *[(F.col("id") * k).cast("double").alias(f"c{k}") for k in range(8)]
    )
    plan = plan_shards(df, spark_local, 1)
    feed = plan.feed

    def task(batches):
        import threading

        import psutil
        import pyarrow as pa

        from airflow_provider_hvd.runner.agent.shard_writer import receive_shards

        me = psutil.Process()
        before, peak, done = me.memory_info().rss, [0], threading.Event()

        def sample():
            while not done.wait(0.005):
                peak[0] = max(peak[0], me.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with receive_shards(batches, feed, 0) as shards:
                written = shards.shards[0].info.rows
        finally:
            done.set()
            sampler.join()
        yield pa.RecordBatch.from_pydict({"growth": [peak[0] - before], "rows": [written]})

    previous = spark_local.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark_local.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(batch_rows))
    try:
        [row] = plan.frame.mapInArrow(task, "growth long, rows long", barrier=True).collect()
    finally:
        spark_local.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", previous)
    batch_bytes = batch_rows * 72
    assert row["rows"] == rows
    assert row["growth"] < 4 * batch_bytes, (
        f"grew {row['growth'] / 2**20:.1f} MiB for batches of {batch_bytes / 2**20:.1f} MiB"
    )


FRESH_AGENT = """
import sys

import pyarrow as pa

from airflow_provider_hvd.runner.agent.shard_writer import receive_shards
from airflow_provider_hvd.runner.shared.shards import FeedSpec


def status(key):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))


at_first = []


def batches(stream):
    for batch in stream:
        if not at_first:  # the first batch is in, as in a Python worker reading its task's Arrow stream
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # the peak (VmHWM) starts again from here
            at_first.append(status("VmRSS"))
        yield batch


stream = pa.ipc.open_stream(pa.OSFile(sys.argv[1]))
with receive_shards(batches(stream), FeedSpec(run="t", rows=int(sys.argv[2]), ranks=1), 0, [sys.argv[3]]) as shards:
    print(shards.shards[0].info.rows, status("VmHWM") - at_first[0])
"""


def test_a_new_agent_grows_by_a_few_batches_while_its_shard_streams_in(tmp_path):
    """A new process (as a Python worker is when its task starts) writes a 29 MB shard that comes in batches of
    1.8 MB from an Arrow stream: once its first batch is in, it grows by less than 4 batches (nothing it does
    per batch imports a module: Arrow's own conversion to NumPy would import pandas, 45 MB)."""
    rows, batch_rows = 400_000, 25_000  # 8 doubles and the row index: 72 bytes a row
    with pa.OSFile(str(tmp_path / "task.arrow"), "wb") as sink:
        ids = np.arange(rows, dtype=np.int64)
        table = pa.table({**{f"c{k}": ids * float(k) for k in range(8)}, ROW_COLUMN: ids})
        with pa.ipc.new_stream(sink, table.schema) as stream:
            stream.write_table(table, max_chunksize=batch_rows)
    done = subprocess.run(
        [sys.executable, "-c", FRESH_AGENT, str(tmp_path / "task.arrow"), str(rows), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written, growth = map(int, done.stdout.split())
    assert written == rows
    batch_bytes = batch_rows * 72
    assert growth < 4 * batch_bytes, f"grew {growth / 2**20:.1f} MiB for batches of {batch_bytes / 2**20:.1f} MiB"


def holders(link: str) -> list[int]:
    """The processes that have the file ``link`` (as ``/proc/<pid>/fd/*`` shows it) open, or mapped."""
    found = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as maps:
                mapped = [line.split(maxsplit=5)[-1].rstrip("\n") for line in maps]
            if link in fds or link in mapped:
                found.append(pid)
    return found


def test_the_shard_files_go_with_their_task_whether_it_ends_or_fails(spark_local, tmp_path):
    """They have no name in the local directory, and no process holds them once the task has ended."""
    df = spark_local.range(0, 100, numPartitions=3)
    shards = shards_of(df, spark_local, 2, lambda shard: len(ids_of(shard)))
    for shard in shards.values():
        assert shard["file"].startswith(shard["directory"]) and shard["file"].endswith(" (deleted)")
        assert "blockmgr-" in shard["directory"]  # Spark's local directory (spark.local.dir)
        assert not [name for name in os.listdir(shard["directory"]) if name.startswith("hvd-")]
        assert holders(shard["file"]) == []

    seen = tmp_path / "seen"

    def fail(shard):
        with open(seen, "a") as out:
            out.write(os.readlink(shard.info.path) + "\n")
        raise RuntimeError("the rank failed")

    with pytest.raises(Exception, match="the rank failed"):
        shards_of(df, spark_local, 2, fail)
    links = seen.read_text().splitlines()
    assert links and all(holders(link) == [] for link in links)


AGENT = """
import os, subprocess, sys, time
import numpy as np, pyarrow as pa
from airflow_provider_hvd.runner import reaper
from airflow_provider_hvd.runner.agent.shard_writer import receive_shards
from airflow_provider_hvd.runner.shared.shards import FeedSpec, ROW_COLUMN
feed = FeedSpec("k", 1000, 1)
batch = pa.record_batch({"x": np.arange(1000.0), ROW_COLUMN: np.arange(1000)})
shards = receive_shards([batch], feed, 0)
read, write = os.pipe()
rank = (
    "import os, time\\n"
    "from airflow_provider_hvd import dataframe_shard\\n"
    "shard = dataframe_shard()\\n"
    "assert next(shard.iter_batches(10))['x'].tolist() == list(range(10))\\n"
    f"open({sys.argv[1]!r}, 'w').write(os.readlink(shard.info.path))\\n"
    "time.sleep(600)\\n"
)
env = {**os.environ, **shards.rank_env(0), reaper.CONTROL_FD_ENV: str(write)}
subprocess.Popen([sys.executable, "-I", "-S", reaper.__file__, str(os.getpid()), sys.executable, "-c", rank],
                 env=env, pass_fds=(write,))
time.sleep(600)
"""


def test_the_shard_goes_when_its_agent_is_killed(tmp_path):
    """The agent's process killed with SIGKILL: its reaper ends the rank, and the file, which no process holds
    any more, is freed by the kernel; nothing needed to remove it."""
    ready = tmp_path / "ready"
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(AGENT), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text():
            assert agent.poll() is None and time.monotonic() < deadline, "the rank did not read its shard"
            time.sleep(0.1)
        link = ready.read_text()
        held = holders(link)
        assert agent.pid in held and len(held) == 2, held  # the agent, and its rank (through /proc/<agent>/fd)
        rank = psutil.Process(next(pid for pid in held if pid != agent.pid))
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        rank.wait(timeout=reaper.TERMINATE_GRACE_S + 30)
        assert holders(link) == []
    finally:
        if agent.poll() is None:
            agent.kill()


# --- PySpark's loader ---


def compare_loaders(shard, schema_json: dict) -> dict:
    """PySpark's loader over this shard's file against ours, for fewer, as many and more samples than rows."""
    from pyspark.ml.torch.data import _SparkPartitionTorchDataset
    from pyspark.sql.types import StructType
    from torch.utils.data import DataLoader

    from airflow_provider_hvd import get_spark_partition_data_loader

    schema = StructType.fromJson(schema_json)
    out = {}
    for samples in (shard.num_rows - 3, shard.num_rows, 2 * shard.num_rows + 5):
        theirs = list(DataLoader(_SparkPartitionTorchDataset(shard.info.path, schema, samples), 8, num_workers=1))
        ours = list(get_spark_partition_data_loader(samples, 8))
        two = list(get_spark_partition_data_loader(samples, 8, num_workers=2)) if samples > shard.num_rows else ours
        out[samples] = (theirs, ours, two)
    return out


def test_get_spark_partition_data_loader_gives_pysparks_batches(spark_local):
    """The same batches (same rows, order, tensor types), column by column, as PySpark's own dataset over the
    same Arrow file: numbers, arrays of numbers, dense and sparse vectors; cycling past the shard's end; and
    with two loader workers (PySpark's refuses more than one)."""
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import functions as F

    rows = [
        (i + 0.5, i / 3, i, i * 10**9, i % 100, [i + 0.5, 1.5], [i / 7.0], [i, i + 1], vector)
        for i in range(50)
        for vector in [Vectors.sparse(3, [1], [i]) if i % 3 else Vectors.dense([i, 1.0, 2.0])]
    ]
    df = spark_local.createDataFrame(rows, ["f", "d", "i", "l", "s", "fs", "ds", "is", "v"]).select(
        F.col("f").cast("float"),
        "d",
        F.col("i").cast("int"),
        "l",
        F.col("s").cast("smallint"),
        F.col("fs").cast("array<float>"),
        "ds",
        F.col("is").cast("array<int>"),
        "v",
    )
    schema = df.schema.jsonValue()
    shards = shards_of(df.repartition(3), spark_local, 2, lambda shard: compare_loaders(shard, schema))
    for shard in shards.values():
        for samples, (theirs, ours, two) in shard["result"].items():
            assert len(theirs) == len(ours) == len(two) == -(-samples // 8)
            for mine, pysparks, by_two in zip(ours, theirs, two, strict=True):
                assert len(mine) == len(pysparks) == 9
                for a, b, c in zip(mine, pysparks, by_two, strict=True):
                    assert a.dtype == b.dtype == c.dtype and torch.equal(a, b) and torch.equal(a, c), (samples, a, b)


# --- runs on a DataFrame, through the runners (the user's door) ---


def pyspark_rows(spark):
    """40 rows in 2 partitions of 20: numbers and an array column, as PySpark's loader takes them."""
    from pyspark.sql import functions as F

    return spark.range(0, 40, numPartitions=2).select(
        "id", (F.col("id") * 0.5).alias("x"), F.array(F.col("id").cast("double"), F.lit(1.0)).alias("pair")
    )


def test_pysparks_own_usage_gives_the_rows_pysparks_class_gives(spark_local, capfd):
    """PySpark's code, with its import changed: _train_on_dataframe and get_spark_partition_data_loader give
    every rank the batches PySpark's own TorchDistributor._train_on_dataframe gives it, on the same DataFrame
    (fewer samples than rows, and more: both cycle over the shard)."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparks

    from airflow_provider_hvd import TorchDistributor

    df = pyspark_rows(spark_local)
    with by_value(loader_rows):
        ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
            loader_rows, df, True, 25, 8
        )
        theirs = pysparks_result(
            lambda: PySparks(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
                loader_rows, df, False, 25, 8
            ),
            capfd,
        )
    assert ours == theirs
    assert [batch[0] for batch in ours[1][:2]] == [list(range(20, 28)), list(range(28, 36))]
    assert ours[0][-1][0] == [4] and len(ours[0]) == 4  # the 25th sample of a shard of 20: its row 4 again


def test_ddp_on_uneven_partitions_takes_as_many_steps_on_every_rank_and_epochs_run_no_spark_job(spark_local):
    """113 rows in 5 uneven partitions into 2 ranks (56 and 57 rows): without drop_last their batches of 8 differ
    (7 and 8), with it DDP takes 7 steps an epoch on each and the run ends; no Spark stage starts while the
    later epochs run (they read the local file)."""
    from airflow_provider_hvd import TorchDistributor

    with by_value(ddp_steps):
        views = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).train_on_dataframe(
            ddp_steps, uneven(spark_local), 3, 8
        )
    assert [(v["rows"], v["batches"], v["steps"]) for v in views] == [(56, 7, 21), (57, 8, 21)]
    began, ended = views[0]["later"]
    submitted = stage_submissions(spark_local)
    assert submitted and not [t for t in submitted if began * 1000 <= t <= ended * 1000], (began, ended, submitted)


def stage_submissions(spark) -> list[int]:
    """When (ms since the epoch) each stage of each job the SparkContext's status tracker knows of was submitted
    (the JVM's tracker: pyspark's SparkStageInfo has no submission time)."""
    tracker = spark.sparkContext.statusTracker()
    stages = spark.sparkContext._jsc.sc().statusTracker()
    times, job = [], 0
    while (info := tracker.getJobInfo(job)) is not None:
        for stage in info.stageIds:
            found = stages.getStageInfo(stage)
            if found.isDefined() and found.get().submissionTime() > 0:
                times.append(found.get().submissionTime())
        job += 1
    return times


def holders_of_files(folder, ranks: int) -> tuple[list[str], list[int]]:
    links = [(folder / f"rank-{rank}").read_text() for rank in range(ranks)]
    return links, [pid for link in links for pid in holders(link)]


def test_horovod_ranks_read_their_shards_and_the_files_go_with_the_run(spark_local, tmp_path):
    from airflow_provider_hvd import HorovodRunner

    df = spark_local.range(0, 30, numPartitions=3)
    with by_value(horovod_ids):
        views = HorovodRunner(np=2).run_on_dataframe(horovod_ids, df)
    assert sorted((v["rank"], v["shard"], v["ids"]) for v in views) == [
        (0, 0, list(range(15))),
        (1, 1, list(range(15, 30))),
    ]
    with by_value(shard_file_then):
        assert HorovodRunner(np=2).run_on_dataframe(shard_file_then, df, folder=str(tmp_path), then="return") == list(
            range(15)
        )
    links, held = holders_of_files(tmp_path, 2)
    assert all(link.endswith(" (deleted)") and "blockmgr-" in link for link in links) and held == []


def test_the_shard_files_go_when_a_rank_fails_and_when_the_run_is_cancelled(spark_local, tmp_path):
    import threading

    from airflow_provider_hvd import RankFailedError, RunCancelledError, TorchDistributor

    df = spark_local.range(0, 30, numPartitions=2)
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    failed, cancelled = tmp_path / "failed", tmp_path / "cancelled"
    failed.mkdir()
    cancelled.mkdir()
    with by_value(shard_file_then):
        with pytest.raises(RankFailedError, match=r"failed after reading its shard"):
            distributor.train_on_dataframe(shard_file_then, df, str(failed), "fail")
        assert holders_of_files(failed, 2)[1] == []

        errors: list[BaseException] = []

        def run() -> None:
            try:
                distributor.train_on_dataframe(shard_file_then, df, str(cancelled), "wait")
            except BaseException as exc:  # noqa: BLE001 - the test checks it
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 120
            while len(list(cancelled.glob("rank-?"))) < 2:
                assert thread.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.1)
            assert holders_of_files(cancelled, 2)[1]  # the files are held while the ranks run
        finally:
            distributor.cancel()
            thread.join(120)
    assert isinstance(errors[0], RunCancelledError), errors
    assert holders_of_files(cancelled, 2)[1] == []


def waiting_rows(spark, started, release):
    """4 rows in 2 partitions whose column ``x`` (a Python UDF) waits in its Spark task until the file
    ``release`` exists (at most 5 minutes), after saying so in the file ``started``."""
    F = functions_of(spark)
    started, release = str(started), str(release)

    def wait(i):
        import os
        import time

        open(started, "a").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        return i

    return spark.range(0, 4, numPartitions=2).select("id", F.udf(wait, "long")(F.col("id")).alias("x"))


def spark_jobs_running(spark) -> int:
    """The Spark jobs (classic) or the session's operations (Spark Connect) running now."""
    if is_connect(spark):
        return running_operations(spark)
    return len(spark.sparkContext.statusTracker().getActiveJobsIds())


def test_a_cancel_ends_the_row_count_and_the_run_at_once(spark, tmp_path):
    """A cancel while the driver counts the DataFrame's rows (before the barrier job) interrupts that count: the
    run raises RunCancelledError within seconds, and no Spark job (or Connect operation) of it runs on."""
    import threading

    from airflow_provider_hvd import RunCancelledError, TorchDistributor

    started, release = tmp_path / "started", tmp_path / "release"
    df = waiting_rows(spark, started, release)
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with distributor._on_session(spark):  # (the thread's active session may be another: the hook's way)
                distributor.train_on_dataframe(ask_for_a_shard, df)
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            errors.append(exc)

    thread = threading.Thread(target=run)
    with by_value(ask_for_a_shard):
        thread.start()
        try:
            deadline = time.monotonic() + 120
            while not started.exists():  # the count's tasks wait for the release
                assert thread.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.1)
            assert spark_jobs_running(spark) > 0
            cancelled_at = time.monotonic()
            distributor.cancel()
            thread.join(10)
            ended_in = time.monotonic() - cancelled_at
            still_running = thread.is_alive()
            while spark_jobs_running(spark) and time.monotonic() < cancelled_at + 15:
                time.sleep(0.1)  # (Spark's status store hears of a job's end a moment after it)
            left = spark_jobs_running(spark)
        finally:
            release.touch()
            thread.join(120)
    assert not still_running, "the run went on for 10 s after its cancel, until its row count had ended"
    assert len(errors) == 1 and isinstance(errors[0], RunCancelledError), errors
    assert str(errors[0]).startswith("TorchDistributor: the run was cancelled before its ranks started"), errors
    assert ended_in < 10 and left == 0, (ended_in, left)


def test_a_cancel_while_spark_computes_the_rows_says_how_far_they_got(spark, tmp_path):
    """A cancel while Spark computes the DataFrame's rows for the barrier job (after their count, which goes free):
    the run raises RunCancelledError naming the DataFrame and how far it got, not the ranks. Over Spark Connect
    the driver knows it from the server's progress reports: the cancel waits for the first."""
    import threading

    from airflow_provider_hvd import RunCancelledError, TorchDistributor

    F = functions_of(spark)
    held, release = tmp_path / "held", tmp_path / "release"
    hold = held_after(str(tmp_path / "calls"), 4, str(held), str(release))  # (the count's 4 calls go free)
    distributor = TorchDistributor(2, local_mode=False, use_gpu=False, start_timeout=1)
    errors: list[BaseException] = []
    reported = threading.Event()

    def progress(stages, inflight_tasks, operation_id, done) -> None:
        if held.exists() and inflight_tasks:
            reported.set()

    def run() -> None:
        try:
            with distributor._on_session(spark):
                distributor.train_on_dataframe(ask_for_a_shard, df)
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            errors.append(exc)

    with by_value(ask_for_a_shard):
        df = spark.range(0, 4, numPartitions=2).select(F.udf(hold, "long")(F.col("id")).alias("id"))
        if is_connect(spark):
            spark.registerProgressHandler(progress)
        else:
            reported.set()  # (a classic session's status store has the stage as it starts)
        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 120
            while not held.exists() or not reported.is_set():  # the barrier job's computation waits for the release
                assert thread.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.1)
            distributor.cancel()
            thread.join(30)
        finally:
            release.touch()
            thread.join(120)
            if is_connect(spark):
                spark.removeProgressHandler(progress)
    assert len(errors) == 1 and isinstance(errors[0], RunCancelledError), errors
    assert re.match(
        r"TorchDistributor: the run was cancelled before its ranks started \(at that moment: Spark computes the "
        r"DataFrame's rows for the barrier job \(\d+ of its tasks done, \d+ running\)\)$",
        str(errors[0]),
    ), errors[0]


def test_a_run_on_a_dataframe_refuses_what_it_cannot_feed_naming_the_fix(spark_local):
    from airflow_provider_hvd import HorovodRunner, RankFailedError, TorchDistributor

    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(ValueError, match=r"^The DataFrame has no rows: TorchDistributor has nothing to give"):
        distributor.train_on_dataframe(ask_for_a_shard, spark_local.range(0))
    with pytest.raises(ValueError, match=r"^The DataFrame belongs to another SparkSession than the one Torch"):
        distributor.train_on_dataframe(ask_for_a_shard, spark_local.newSession().range(4))
    with pytest.raises(TypeError, match=r"takes a Spark DataFrame .* not list: make one with spark.table"):
        distributor.train_on_dataframe(ask_for_a_shard, [1, 2])
    local = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    with pytest.raises(ValueError, match=r"requires setting TorchDistributor.local_mode to False.*local_mode=False\)"):
        local._train_on_dataframe(ask_for_a_shard, spark_local.range(4))
    with pytest.raises(ValueError, match=r"runs on Spark.*use np=2 \(np>0\)"):
        HorovodRunner(np=-2).run_on_dataframe(ask_for_a_shard, spark_local.range(4))
    with by_value(ask_for_a_shard):
        with pytest.raises(RankFailedError, match=r"dataframe_shard\(\) works in the ranks of a run on a DataFrame"):
            TorchDistributor(num_processes=1, local_mode=True, use_gpu=False).run(ask_for_a_shard)


def test_a_run_over_spark_connect_reads_its_shards_and_leaves_no_file(connect_local, tmp_path):
    from airflow_provider_hvd import TorchDistributor

    with connect_session(connect_local) as spark, by_value(shard_file_then):
        df = spark.range(0, 30, numPartitions=3)
        got = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).train_on_dataframe(
            shard_file_then, df, str(tmp_path), "return"
        )
    assert got == list(range(15))
    links, held = holders_of_files(tmp_path, 2)
    assert all(link.endswith(" (deleted)") for link in links) and held == []
