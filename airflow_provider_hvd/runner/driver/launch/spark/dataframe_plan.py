"""The shard plan, on the driver: a DataFrame's rows into one partition per barrier task, each rank its shard.

:func:`plan_shards` checks the DataFrame (its session, its columns), counts its rows per partition (one Spark
job) and returns a DataFrame of exactly ``ranks / per_task`` partitions whose partition ``t`` holds, in
Spark's order, the rows of ranks ``t*per_task ...`` (:mod:`....shared.shards` says which rows). It uses the
DataFrame API only (Spark Connect has no RDDs):

- the count job references every column (a hash of each row), so that Spark plans the DataFrame as the
  barrier job will: a count that reads no column lets Spark prune what feeds a shuffle, and adaptive query
  execution then coalesces that shuffle differently (measured: 1 partition counted, 42 in the job);
- each row's global index is its partition's offset plus its position (``monotonically_increasing_id()``'s
  lower 33 bits); its task follows from it;
- ``repartition(tasks, key)`` with, for each task ``t``, a key whose Murmur3 hash (Spark's hash partitioning:
  seed 42, as SQL's ``hash()``) falls in partition ``t``; an explicit partition count, which adaptive query
  execution neither coalesces nor splits; then a sort within each partition by the global index, since a
  shuffle read keeps no order between the blocks it fetches;
- always through that shuffle, even where the partitions already match: a barrier stage over the user's own
  plan fails for a coalesced or unioned DataFrame (``BarrierJobUnsupportedRDDChainException``), and the
  barrier tasks then read shuffle files instead of recomputing the DataFrame when a stage is retried.

The global index travels as the column :data:`....shared.shards.ROW_COLUMN`; the writer checks that each task
got exactly its rows, in order, and drops it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ....errors import SettingError
from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ....shared.shards import ROW_COLUMN, FeedSpec
from .cluster import is_connect

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

KEY_COLUMN = "__hvd_key"  # the shuffle key, dropped after the shuffle
_POSITION_BITS = 33  # monotonically_increasing_id(): the partition index above, the position in the lower bits
_HASH_SEED = 42  # Spark's HashPartitioning and SQL hash(): Murmur3Hash(seed=42)
_FIX = "select the columns to train on (df.select(...)), or convert this one (e.g. to_json, or a cast)"


@dataclass(frozen=True)
class ShardPlan:
    """A DataFrame ready for the barrier job: ``frame`` has ``feed.tasks`` partitions, task ``t``'s rows in
    partition ``t`` (with :data:`ROW_COLUMN`); ``feed`` goes into the tasks; ``partition_rows`` are the source
    DataFrame's rows per partition, as counted."""

    frame: DataFrame
    feed: FeedSpec
    partition_rows: list[int]


def murmur3_int(value: int, seed: int = _HASH_SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashInt(value, seed)`` (MurmurHash3 of a 4-byte block), as a signed int."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = (value & mask) * 0xCC9E2D51 & mask
    k1 = rotl(k1, 15) * 0x1B873593 & mask
    h1 = rotl(seed ^ k1, 13)
    h1 = (h1 * 5 + 0xE6546B64) & mask
    h1 ^= 4  # the length in bytes
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_keys(partitions: int) -> list[int]:
    """For each partition ``t``, the smallest int key that Spark's hash partitioning into ``partitions`` sends
    to ``t``: ``pmod(hash(key), partitions) == t``."""
    keys: dict[int, int] = {}
    key = 0
    while len(keys) < partitions:
        keys.setdefault(murmur3_int(key) % partitions, key)
        key += 1
    return [keys[t] for t in range(partitions)]


def _functions(df: DataFrame) -> Any:
    """The column functions of ``df``'s kind of session: pyspark's own build classic columns only (they need a
    SparkContext in this process), Spark Connect's its columns."""
    if is_connect(df.sparkSession):
        from pyspark.sql.connect import functions as connect_functions

        return connect_functions
    from pyspark.sql import functions

    return functions


def _column(F: Any, name: str) -> Column:
    column: Column = F.col("`" + name.replace("`", "``") + "`")
    return column


def _is_vector(data_type: Any) -> bool:
    return type(data_type).__name__ == "VectorUDT" and type(data_type).__module__ in (
        "pyspark.ml.linalg",
        "pyspark.mllib.linalg",
    )


def unsupported_type(data_type: Any) -> bool:
    """Whether the ranks cannot read a column of this Spark type (:mod:`..rank.arrow_columns` is the rank's
    side of the same rule)."""
    from pyspark.sql import types as T

    if _is_vector(data_type):
        return False
    if isinstance(data_type, T.ArrayType):
        element = data_type.elementType
        return not isinstance(element, (T.NumericType, T.BooleanType)) or isinstance(element, T.DecimalType)
    scalars = (
        T.NumericType,  # (DecimalType too: Decimal objects)
        T.BooleanType,
        T.StringType,
        T.CharType,
        T.VarcharType,
        T.BinaryType,
        T.DateType,
        T.TimestampType,
        T.TimestampNTZType,
        T.DayTimeIntervalType,
        T.NullType,
    )
    return not isinstance(data_type, scalars)


def check_session(df: DataFrame, spark: Any, naming: RunnerNaming = HOROVOD_RUNNER) -> None:
    """Refuse a DataFrame of another SparkSession than the run's (another server, session, or kind)."""
    session = df.sparkSession
    if is_connect(session) != is_connect(spark):
        same = False
    elif is_connect(spark):
        same = session.session_id == spark.session_id  # type: ignore[attr-defined]
    else:
        same = session is spark or bool(session._jsparkSession.equals(spark._jsparkSession))
    if not same:
        raise SettingError(
            f"The DataFrame belongs to another SparkSession than the one {naming.runner} runs on: build it "
            "with the run's session (spark.table, spark.read, spark.sql of that session)."
        )


def check_columns(df: DataFrame) -> None:
    """Refuse what the ranks cannot read: no columns, duplicate or reserved names, unsupported types."""
    fields = df.schema.fields
    if not fields:
        raise SettingError("The DataFrame has no columns: select the columns to train on.")
    seen: set[str] = set()
    for field in fields:
        if field.name in (ROW_COLUMN, KEY_COLUMN):
            raise SettingError(f"The DataFrame's column {field.name!r} has a name the runner uses itself: rename it.")
        if field.name in seen:
            raise SettingError(f"The DataFrame has two columns named {field.name!r}: rename one (toDF, or alias).")
        seen.add(field.name)
        if unsupported_type(field.dataType):
            raise SettingError(
                f"The DataFrame's column {field.name!r} is of type {field.dataType.simpleString()}, which the "
                f"ranks cannot read as arrays: {_FIX}."
            )


def count_partitions(df: DataFrame) -> list[int]:
    """Rows per partition of ``df``, as the barrier job will see them (one Spark job)."""
    F = _functions(df)
    every_column = F.xxhash64(*[_column(F, name) for name in df.columns])  # (see the module's docstring)
    counted = (
        df.select(F.spark_partition_id().alias("p"), every_column.alias("h"))
        .groupBy("p")
        .agg(F.count(F.lit(1)).alias("n"), F.bit_xor("h").alias("h"))
        .collect()
    )
    rows = [0] * (max((row["p"] for row in counted), default=-1) + 1)
    for row in counted:
        rows[row["p"]] = row["n"]
    return rows


def shard_frame(df: DataFrame, partition_rows: list[int], feed: FeedSpec) -> DataFrame:
    """``df`` in ``feed.tasks`` partitions, task ``t``'s rows in partition ``t`` in order, with ROW_COLUMN."""
    F = _functions(df)

    offsets = [sum(partition_rows[:p]) for p in range(len(partition_rows))]
    offset = F.element_at(F.array(*[F.lit(o).cast("long") for o in offsets]), F.spark_partition_id() + 1)
    position = F.monotonically_increasing_id().bitwiseAND(F.lit((1 << _POSITION_BITS) - 1))
    indexed = df.select("*", (offset + position).alias(ROW_COLUMN))
    # the rank of row g: the largest r with floor(r*N/np) <= g; its task: rank div per_task
    task = F.expr(f"(({ROW_COLUMN} + 1) * {feed.ranks} - 1) div {feed.rows} div {feed.per_task}")
    keys = F.array(*[F.lit(k).cast("int") for k in partition_keys(feed.tasks)])
    return (
        indexed.withColumn(KEY_COLUMN, F.element_at(keys, task.cast("int") + 1))
        .repartition(feed.tasks, KEY_COLUMN)
        .sortWithinPartitions(ROW_COLUMN)
        .drop(KEY_COLUMN)
    )


def plan_shards(
    df: DataFrame,
    spark: Any,
    ranks: int,
    per_task: int = 1,
    naming: RunnerNaming = HOROVOD_RUNNER,
    count: Callable[[DataFrame], list[int]] = count_partitions,
) -> ShardPlan:
    """The barrier job's DataFrame for a run of ``ranks`` ranks, ``per_task`` in each Spark task, on ``spark``.

    Raises ValueError for a DataFrame of another session, without rows, with fewer rows than ranks, or with a
    column the ranks cannot read. Runs one Spark job (the count: :func:`count_partitions`, or ``count``, which
    the launcher gives to make it cancellable).
    """
    if ranks % per_task:
        raise SettingError(f"{ranks} ranks do not fill Spark tasks of {per_task} ranks each")
    check_session(df, spark, naming)
    check_columns(df)
    partition_rows = count(df)
    rows = sum(partition_rows)
    if rows == 0:
        raise ValueError(f"The DataFrame has no rows: {naming.runner} has nothing to give its ranks.")
    if rows < ranks:
        raise ValueError(
            f"The DataFrame has {rows} row{'s' if rows > 1 else ''} for {naming.call(ranks)}: each rank needs at "
            f"least one. Lower {naming.size} to at most {rows}, or train on more rows."
        )
    feed = FeedSpec(run=uuid.uuid4().hex[:12], rows=rows, ranks=ranks, per_task=per_task)
    return ShardPlan(shard_frame(df, partition_rows, feed), feed, partition_rows)


def resize_plan(plan: ShardPlan, df: DataFrame, ranks: int, per_task: int = 1) -> ShardPlan:
    """``plan`` for a restart of ``ranks`` ranks (``min_ranks``): the same rows, counted once, shared out among
    them (no Spark job here: the count of each partition is the plan's)."""
    if ranks % per_task:
        raise ValueError(f"{ranks} ranks do not fill Spark tasks of {per_task} ranks each")
    feed = FeedSpec(run=uuid.uuid4().hex[:12], rows=plan.feed.rows, ranks=ranks, per_task=per_task)
    return ShardPlan(shard_frame(df, plan.partition_rows, feed), feed, plan.partition_rows)
