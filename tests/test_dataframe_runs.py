"""A run on a DataFrame keeps run()'s guarantees: a stall ends it as a stall, and a failed run's retry resumes
from its last checkpoint with each rank's shard again; the time Spark spends on the rows is not the ranks' start
(classic Spark, local[2])."""

from __future__ import annotations

import logging
import re
import time

import pytest
from dataframe_jobs import by_value, horovod_ids, resume_on_the_shard, slow_row, stall_after_reading

from airflow_provider_hvd import HorovodRunner, RankFailedError, RunStalledError, TorchDistributor


def test_a_stalled_run_on_a_dataframe_ends_as_a_stall(spark_local):
    df = spark_local.range(0, 40, numPartitions=2)
    started = time.monotonic()
    with by_value(stall_after_reading), pytest.raises(RunStalledError) as stalled:
        TorchDistributor(2, local_mode=False, use_gpu=False, stall_timeout=5).train_on_dataframe(
            stall_after_reading, df
        )
    assert "stall_timeout" in str(stalled.value), stalled.value
    assert time.monotonic() - started < 120  # (a hang, not a speed, is what fails here)


def test_a_retry_on_a_dataframe_resumes_from_the_last_checkpoint_with_the_same_shards(spark_local, tmp_path):
    df = spark_local.range(0, 41, numPartitions=3)
    first = TorchDistributor(2, local_mode=False, use_gpu=False)
    with by_value(resume_on_the_shard):
        with pytest.raises(RankFailedError, match="rank 1 fails on the first try"):
            first.train_on_dataframe(resume_on_the_shard, df, str(tmp_path))
        assert first.checkpoint is not None and first.checkpoint["epoch"] == 1
        retry = TorchDistributor(2, local_mode=False, use_gpu=False, resume_from=first.checkpoint)
        value = retry.train_on_dataframe(resume_on_the_shard, df, str(tmp_path))
    assert value["resumed_from"] == 1 and sorted(value["rows"]) == [20, 21]  # every row, shards one row apart


def test_a_slow_dataframe_is_not_counted_in_the_ranks_start_timeout(spark_local, caplog):
    """A DataFrame whose rows take seconds to compute (a Python UDF of 0.5 s a row, 8 rows in each of 2
    partitions: 4 s a Spark task, in the count and again for the barrier job) trains with start_timeout=2: the
    ranks' clock runs only while Spark is not at work on the rows, and the log says when they were counted and
    when they were all in the shards, apart from the ranks' start. Before, no setting changed the 120 s start
    timeout, and a DataFrame slower than it failed as "only 0 of 2 ranks had started ... short of task slots"."""
    from pyspark.sql import functions as F

    with by_value(slow_row, horovod_ids), caplog.at_level(logging.INFO, logger="airflow_provider_hvd"):
        df = spark_local.range(0, 16, numPartitions=2).select(F.udf(slow_row, "long")("id").alias("id"))
        views = HorovodRunner(np=2, start_timeout=2).run_on_dataframe(horovod_ids, df)
    assert sorted(i for view in views for i in view["ids"]) == list(range(16))
    assert "HorovodRunner: the DataFrame has 16 rows in 2 partitions (counted in " in caplog.text
    shards = r"HorovodRunner: the DataFrame's 16 rows are in the ranks' shards \(\d+ B\), (\d+\.\d)s after the barrier"
    found = re.search(shards, caplog.text)
    assert found is not None and float(found.group(1)) > 2, caplog.text[-3000:]  # (longer than start_timeout)
