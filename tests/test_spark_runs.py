"""np > 0 on a local[2] SparkSession: a barrier job of 2 tasks, each running one rank."""

from __future__ import annotations

import threading
import time

import pytest
from jobs import (
    alive,
    allreduce_sum,
    assert_all_gone,
    fail_on_rank,
    no_spark_job_left,
    sleep_and_record,
    train_linear,
    wait_for_pids,
)

from airflow_provider_hvd import HorovodRunner, HorovodRunnerError, RankFailedError


def test_allreduce_in_a_barrier_job(spark_local):
    assert HorovodRunner(np=2).run(allreduce_sum) == {"rank": 0, "size": 2, "local_size": 2, "sum": 3.0}


def test_training_in_a_barrier_job(spark_local):
    result = HorovodRunner(np=2, driver_log_verbosity="all").run(train_linear)
    assert result["final_loss"] < 0.01
    assert result["weights"][0] == result["weights"][1]


def test_failing_rank_fails_the_run_once_without_spark_retrying(spark_local, pid_dir):
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed: ValueError: boom from rank 1") as info:
        HorovodRunner(np=2).run(fail_on_rank, bad_rank=1, pid_dir=pid_dir)
    assert time.monotonic() - started < 30
    assert "rank 1 is about to fail" in info.value.output_tail  # whatever the verbosity
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1))
    assert no_spark_job_left(spark_local)


def test_rank_exit_in_spark_task(spark_local, pid_dir):
    with pytest.raises(RankFailedError, match="exited with code 3"):
        HorovodRunner(np=2).run(fail_on_rank, bad_rank=1, pid_dir=pid_dir, how="exit")
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1))


def test_killing_the_spark_job_leaves_no_rank_behind(spark_local, pid_dir):
    outcome: dict = {}

    def run() -> None:
        try:
            HorovodRunner(np=2).run(sleep_and_record, pid_dir=pid_dir)
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    pids = wait_for_pids(pid_dir, 2)
    assert all(alive(pid) for pid in pids)
    spark_local.sparkContext.cancelAllJobs()  # as a user or the cluster would: the tasks are killed
    thread.join(60)
    assert not thread.is_alive()
    assert_all_gone(pids)
    error = outcome.get("error")
    assert type(error) is HorovodRunnerError  # Spark's doing, not a rank's, nor the driver's own cancellation
    assert str(error).startswith(
        "a Spark barrier job of 2 tasks on local[2] failed: its job was killed from outside the run: "
        "[SPARK_JOB_CANCELLED] Job "
    )
    assert "\tat org.apache" not in str(error) and "py4j" not in str(error)
