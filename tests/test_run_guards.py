"""A run ends with its own error whatever goes wrong around it: a clean-up that raises, the driver channel's
loop failing, its Spark job killed from outside, its SparkContext stopped under it. Nothing is left running."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from jobs import assert_all_gone, fail_on_rank, sleep_and_record, wait_for_pids

from airflow_provider_hvd import HorovodRunner, RankFailedError, RunCancelledError
from airflow_provider_hvd.runner.driver.events import LaunchFailed, TaskEnded
from airflow_provider_hvd.runner.driver.launch.spark.barrier import SparkLauncher
from airflow_provider_hvd.runner.driver.watch import channel
from airflow_provider_hvd.runner.errors import HorovodRunnerError


def run_in_thread(runner: HorovodRunner, main, **kwargs) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = runner.run(main, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)  # a run that hangs must not hold the test session
    thread.start()
    return thread, outcome


def rendezvous_port(caplog) -> int:
    ports = [int(m[1]) for r in caplog.records if (m := re.search(r"Gloo rendezvous on \S+:(\d+)", r.getMessage()))]
    return ports[-1]


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def print_until_ended(pid_dir: str) -> None:
    import os
    import time

    import horovod.torch as hvd

    hvd.init()
    Path(pid_dir, f"rank-{hvd.rank()}.pid").write_text(str(os.getpid()))
    while True:
        print("tick", flush=True)
        time.sleep(0.2)


def test_a_failure_in_the_channels_loop_ends_the_run(monkeypatch, pid_dir, caplog):
    """Before: the loop's thread ended without a word, and run() waited forever for the ranks' reports."""
    ranks_run = threading.Event()
    update = channel.DriverChannel._update_listening

    def fail_once_the_ranks_run(self) -> None:
        if ranks_run.is_set():
            raise RuntimeError("a fault in the channel's loop")
        update(self)

    monkeypatch.setattr(channel.DriverChannel, "_update_listening", fail_once_the_ranks_run)
    thread, outcome = run_in_thread(HorovodRunner(np=-2), print_until_ended, pid_dir=pid_dir)
    pids = wait_for_pids(pid_dir, 2, timeout=180)
    ranks_run.set()  # the next line a rank prints wakes the loop
    thread.join(120)
    assert not thread.is_alive(), "run() still waits"
    error = outcome["error"]
    assert isinstance(error, RankFailedError)
    assert 'the driver channel failed: RuntimeError("a fault in the channel\'s loop")' in str(error)
    assert "the driver channel failed" in caplog.text  # with its traceback
    assert_all_gone(pids, within=15)


def test_a_clean_up_that_raises_neither_hides_the_runs_error_nor_skips_the_others(
    spark_local, monkeypatch, pid_dir, caplog
):
    """Before: cancelJobGroup's error replaced the rank's, and the Gloo rendezvous was left listening."""
    from pyspark import SparkContext

    def refuse(self, group_id: str) -> None:
        raise RuntimeError("cancelJobGroup refused")

    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    monkeypatch.setattr(SparkContext, "cancelJobGroup", refuse)
    with pytest.raises(RankFailedError, match="boom from rank 1"):
        HorovodRunner(np=2).run(fail_on_rank, bad_rank=1, pid_dir=pid_dir)
    assert not listening(rendezvous_port(caplog))
    assert "could not end a Spark barrier job of 2 tasks on local[2]" in caplog.text
    assert "cancelJobGroup refused" in caplog.text
    assert_all_gone([int(p.read_text()) for p in Path(pid_dir).glob("rank-*.pid")], within=15)


def kill_a_barrier_task(sc, reason: str, within: float = 60.0) -> int:
    """Kill one running task of the active barrier stage as the kill link of Spark's UI does; its index."""
    jvm, store = sc._jvm, sc._jsc.sc().statusStore()
    v1 = jvm.org.apache.spark.status.api.v1
    running = jvm.java.util.Collections.singletonList(v1.TaskStatus.RUNNING)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # (Spark's status store runs behind its scheduler)
        for stage_id in sc.statusTracker().getActiveStageIds():
            stage = store.lastStageAttempt(stage_id)
            tasks = store.taskList(stage_id, stage.attemptId(), 0, 10, v1.TaskSorting.ID, running)
            if tasks.nonEmpty():
                task = tasks.last()
                sc._jsc.sc().killTaskAttempt(task.taskId(), True, reason)
                return int(task.index())
        time.sleep(0.1)
    raise AssertionError(f"no task of the barrier stage ran within {within:g}s")


def test_a_task_of_a_dataframe_run_killed_from_outside_is_named_with_sparks_reason(spark_local, tmp_path):
    """Before: the run's status followed the first Spark job of its job group, the one adaptive execution runs
    for the DataFrame's shuffle, not the barrier job: a barrier task killed from outside went unnamed."""
    pid_dir = str(tmp_path)
    from pyspark.sql import functions

    def slow_first_row(i: int) -> int:
        import time

        if i == 0:  # the shuffle's job outlasts the status's first polls (once a second)
            time.sleep(3)
        return i

    # a shuffle: adaptive execution runs its job before the barrier job, in the run's group
    df = spark_local.range(0, 40, numPartitions=4).select(functions.udf(slow_first_row, "long")("id")).repartition(2)
    outcome: dict = {}

    def run() -> None:
        try:
            HorovodRunner(np=2).run_on_dataframe(sleep_and_record, df, pid_dir=pid_dir)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("rank-*.pid"))) < 2:
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.1)
    pids = wait_for_pids(pid_dir, 2)
    index = kill_a_barrier_task(spark_local.sparkContext, "killed via the Web UI")
    thread.join(120)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), HorovodRunnerError), outcome
    assert re.search(
        rf"Spark task {index} \(attempt 0\) was killed on executor driver \(\S+\): killed via the Web UI",
        str(outcome["error"]),
    ), str(outcome["error"])
    assert_all_gone(pids, within=15)


@pytest.mark.parametrize("attempt", [1, 2])  # which of the job's failure and the agents' loss comes first varies
def test_a_job_killed_from_outside_is_reported_as_killed_with_sparks_reason(spark_local, tmp_path, attempt):
    """Before: "Job 0 cancelled" or "its agent ... was lost: the connection was closed", by timing."""
    pid_dir = str(tmp_path)
    sc = spark_local.sparkContext
    thread, outcome = run_in_thread(HorovodRunner(np=2), sleep_and_record, pid_dir=pid_dir)
    pids = wait_for_pids(pid_dir, 2, timeout=180)
    (job_id,) = sc.statusTracker().getActiveJobsIds()
    sc._jsc.sc().cancelJob(job_id, "killed via the Web UI")  # what the kill link of Spark's UI does
    thread.join(120)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, HorovodRunnerError)
    # as the job's failure or as its agents' loss, whichever the driver hears first: killed, with Spark's reason
    assert re.search(
        r"(Spark task \d \(attempt 0\) was killed on executor driver \(\S+\): |its job was killed from "
        r"outside the run: ).*killed via the Web UI",
        str(error),
    ), str(error)
    assert_all_gone(pids, within=15)


def sleep_ignoring_sigterm(pid_dir: str) -> None:
    """Record the pid and sleep; SIGTERM is ignored: the reaper ends the rank with SIGKILL after its grace."""
    import os
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(pid_dir, f"rank-{os.environ['HOROVOD_RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_a_job_whose_tasks_outlive_its_cancel_is_named_and_keeps_its_broadcast(
    spark_local, monkeypatch, pid_dir, caplog
):
    """The run's end does not wait for ranks that ignore SIGTERM (ABORT_WAIT_S 0), nor their tasks for more than
    0.5 s (_JOB_END_WAIT_S, 60 s otherwise): they end seconds later (Spark kills their Python workers, the reaper
    its rank). Before: no word of the job left running, and the job's broadcast destroyed under its tasks."""
    from pyspark import SparkContext

    from airflow_provider_hvd.runner.driver.launch.spark import barrier
    from airflow_provider_hvd.runner.driver.watch import supervisor

    monkeypatch.setattr(supervisor, "ABORT_WAIT_S", 0.0)
    monkeypatch.setattr(barrier, "_JOB_END_WAIT_S", 0.5)
    broadcasts = []
    broadcast = SparkContext.broadcast

    def recorded(self, value):
        broadcasts.append(broadcast(self, value))
        return broadcasts[-1]

    monkeypatch.setattr(SparkContext, "broadcast", recorded)
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd")
    runner = HorovodRunner(np=2)
    thread, outcome = run_in_thread(runner, sleep_ignoring_sigterm, pid_dir=pid_dir)
    pids = wait_for_pids(pid_dir, 2, timeout=180)
    runner.cancel()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], RunCancelledError), outcome["error"]
    left = [r.getMessage() for r in caplog.records if "left to Spark" in r.getMessage()]
    assert len(left) == 1, caplog.text
    assert re.search(
        r"a Spark barrier job of 2 tasks on local\[2\], job group horovod-runner-\w+, "
        r"(was still running|still had tasks running) \d+s after the run ended and it was cancelled; "
        r"it is left to Spark",
        left[0],
    ), left[0]
    assert "The job's broadcast is unpersisted, not destroyed, for the tasks that still run" in left[0]
    assert broadcasts[0]._jbroadcast.isValid(), "the job's broadcast was destroyed under its tasks"
    assert_all_gone(pids, within=30)


def test_a_spark_context_stopped_under_a_run_ends_it_with_a_runner_error(spark_local, pid_dir):
    """Before: the launcher's poll of Spark's status raised py4j's error (or an AttributeError) into run().
    Runs last in this module: it stops the module's SparkContext."""
    launcher = SparkLauncher(spark_local, 2)
    assert launcher.poll() == []
    thread, outcome = run_in_thread(HorovodRunner(np=2), sleep_and_record, pid_dir=pid_dir)
    pids = wait_for_pids(pid_dir, 2, timeout=180)
    spark_local.stop()
    events = launcher.poll()  # what the supervisor asks every second
    [failure] = [event for event in events if isinstance(event, LaunchFailed)]
    assert "the SparkContext on local[2] stopped" in failure.reason
    assert not [event for event in events if isinstance(event, TaskEnded)]
    thread.join(120)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], HorovodRunnerError), outcome["error"]
    assert_all_gone(pids, within=15)
