"""How a run ends, as a table: (events in the order they happen) → the error raised, and what it says."""

from __future__ import annotations

import pytest

from airflow_provider_hvd import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError
from airflow_provider_hvd.runner.driver.outcome import (
    AgentFailed,
    AgentLost,
    Cancelled,
    LaunchFailed,
    RankFailed,
    RankSucceeded,
    RunOutcome,
    StartTimedOut,
)
from airflow_provider_hvd.runner.shared.messages import Done, RemoteError

SPARK_TASK_1 = "in Spark task 1 (attempt 0) on executor 10.0.0.2:41000 (10.0.0.2)"
SPARK_TASK_0 = "in Spark task 0 (attempt 0) on executor 10.0.0.1:41000 (10.0.0.1)"
BOOM = Done(exit_code=1, ok=False, error=RemoteError("ValueError", "boom", "Traceback ...\nValueError: boom\n"), tail=["step 9"])
ENDED = Done(exit_code=-15, ok=False, terminated_by="rank 1 failed")
JOB_CANCELLED = LaunchFailed("a Spark barrier job of 2 tasks on spark://m:7077", "[SPARK_JOB_CANCELLED] Job 0 cancelled")
NO_PSUTIL = RemoteError("ModuleNotFoundError", "No module named 'psutil'", "Traceback ...\nModuleNotFoundError\n")
STARTED = "started"  # not an event: every rank was started

CASES = {
    "all ranks succeed": ([STARTED, RankSucceeded(0), RankSucceeded(1)], None, None),
    "a rank raises; the other is ended by the driver": (
        [STARTED, RankFailed(1, SPARK_TASK_1, BOOM), RankFailed(0, SPARK_TASK_0, ENDED)],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom",
    ),
    "the driver's own cancellation of the job after a rank failed is not a cause": (
        [STARTED, RankFailed(1, SPARK_TASK_1, BOOM), JOB_CANCELLED, AgentLost(0, SPARK_TASK_0, "closed", (0, 0))],
        RankFailedError,
        "ValueError: boom",
    ),
    "a lost agent names its rank, executor and Spark's reason": (
        [STARTED, AgentLost(1, SPARK_TASK_1, "stream closed", (1, 0)), JOB_CANCELLED],
        RankFailedError,
        f"Horovod rank 1 of 2 failed: its agent {SPARK_TASK_1} was lost (its Spark task, executor or host died): "
        "Spark: Python worker exited unexpectedly",
    ),
    "cancel() wins over the ranks it ends": (
        [STARTED, Cancelled(), RankFailed(0, SPARK_TASK_0, ENDED), RankFailed(1, SPARK_TASK_1, ENDED), JOB_CANCELLED],
        RunCancelledError,
        "the run was cancelled",
    ),
    "cancel() during the start": ([Cancelled(), StartTimedOut(1, 2, 120, "x")], RunCancelledError, "cancelled"),
    "a failure before cancel() stays the cause": (
        [STARTED, RankFailed(1, SPARK_TASK_1, BOOM), Cancelled()],
        RankFailedError,
        "ValueError: boom",
    ),
    "the job fails while starting": ([JOB_CANCELLED], LaunchError, "failed: [SPARK_JOB_CANCELLED]"),
    "the job fails once running, no agent known lost": (
        [STARTED, JOB_CANCELLED, AgentLost(1, SPARK_TASK_1, "closed", (1, 0))],
        HorovodRunnerError,
        "failed: [SPARK_JOB_CANCELLED]",
    ),
    "an agent fails before its rank starts": (
        [AgentFailed(None, SPARK_TASK_1, NO_PSUTIL)],
        LaunchError,
        f"the HorovodRunner agent {SPARK_TASK_1} failed: ModuleNotFoundError: No module named 'psutil'",
    ),
    "an agent fails once running": (
        [STARTED, AgentFailed(1, SPARK_TASK_1, NO_PSUTIL), RankFailed(0, SPARK_TASK_0, ENDED)],
        RankFailedError,
        f"the HorovodRunner agent of rank 1 {SPARK_TASK_1} failed: ModuleNotFoundError",
    ),
    "the start times out": ([StartTimedOut(1, 2, 120.0, "a job")], LaunchError, "only 1 of 2 ranks had started after 120s"),
}


def spark_reason(task: tuple[int, int]) -> str | None:
    return "Spark: Python worker exited unexpectedly" if task == (1, 0) else None


@pytest.mark.parametrize("case", CASES)
def test_the_first_real_cause_decides(case):
    events, error_type, text = CASES[case]
    outcome = RunOutcome(2)
    for event in events:
        if event == STARTED:
            outcome.started()
        else:
            outcome.record(event)
    error = outcome.error(spark_reason)
    if error_type is None:
        assert error is None
        return
    assert type(error) is error_type
    assert text in str(error)


def test_only_the_first_cause_asks_to_end_the_others():
    outcome = RunOutcome(2)
    outcome.started()
    assert outcome.record(RankFailed(1, SPARK_TASK_1, BOOM)) == "rank 1 failed"
    assert outcome.record(RankFailed(0, SPARK_TASK_0, ENDED)) is None
    assert outcome.record(Cancelled()) is None


def test_the_failed_rank_error_carries_the_details():
    outcome = RunOutcome(2)
    outcome.started()
    outcome.record(RankFailed(1, SPARK_TASK_1, BOOM))
    outcome.record(RankFailed(0, SPARK_TASK_0, ENDED))
    error = outcome.error()
    assert isinstance(error, RankFailedError)
    assert (error.rank, error.exit_code, error.output_tail) == (1, 1, ["step 9"])
    assert error.remote_traceback.endswith("ValueError: boom\n")
    assert error.other_failures == ["rank 0: ended by the driver (rank 1 failed)"]
