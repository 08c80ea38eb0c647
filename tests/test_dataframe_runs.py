"""A run on a DataFrame keeps run()'s guarantees: a stall ends it as a stall, and a failed run's retry resumes
from its last checkpoint with each rank's shard again (classic Spark, local[2])."""

from __future__ import annotations

import time

import pytest
from dataframe_jobs import by_value, resume_on_the_shard, stall_after_reading

from airflow_provider_hvd import RankFailedError, RunStalledError, TorchDistributor


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
