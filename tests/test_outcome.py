"""How a run ends, as a table: (events in the order they reach the driver) → the error raised, and what it says."""

from __future__ import annotations

import math

import pytest

from airflow_provider_hvd import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError
from airflow_provider_hvd.runner.driver.events import (
    AgentFailed,
    AgentLost,
    Cancelled,
    HostLost,
    LaunchFailed,
    RankFailed,
    RankSucceeded,
    StartTimedOut,
)
from airflow_provider_hvd.runner.driver.verdict.outcome import RunOutcome
from airflow_provider_hvd.runner.driver.verdict.report import abort_reason, run_error
from airflow_provider_hvd.runner.shared.messages import Done, RemoteError

SPARK_TASK_1 = "in Spark task 1 (attempt 0) on executor 10.0.0.2:41000 (10.0.0.2)"
SPARK_TASK_0 = "in Spark task 0 (attempt 0) on executor 10.0.0.1:41000 (10.0.0.1)"
BOOM = Done(
    exit_code=1, ok=False, error=RemoteError("ValueError", "boom", "Traceback ...\nValueError: boom\n"), tail=["step 9"]
)
ENDED = Done(exit_code=-15, ok=False, terminated_by="rank 1 failed")
JOB_CANCELLED = LaunchFailed(
    "a Spark barrier job of 2 tasks on spark://m:7077", "[SPARK_JOB_CANCELLED] Job 0 cancelled"
)
NO_PSUTIL = RemoteError("ModuleNotFoundError", "No module named 'psutil'", "Traceback ...\nModuleNotFoundError\n")
STARTED = "started"  # not an event: every rank was started
WINDOW = "window"  # not an event: the settle window after the first failure has passed

# real training: rank 1 raised at T; Horovod shut down under the others, whose errors often reach the driver first
T = 1_700_000_000.0
SHUTDOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to allreduce, "
    "allgather or broadcast a tensor after one of the ranks finished execution."
)


def shut_down(at: float, type_: str = "HorovodInternalError") -> Done:
    return Done(exit_code=1, ok=False, error=RemoteError(type_, SHUTDOWN_MESSAGE, f"Traceback ...\n{type_}\n", at=at))


def boom(at: float, terminated_by: str | None = None) -> Done:
    error = RemoteError("ValueError", "boom", "Traceback ...\nValueError: boom\n", at=at)
    return Done(exit_code=1, ok=False, error=error, terminated_by=terminated_by, tail=["step 20"])


GLOO_ABORT = Done(
    exit_code=-6,
    ok=False,
    ended_at=T + 0.2,
    tail=[
        "terminate called after throwing an instance of 'gloo::IoException'",
        "  what():  [gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:43125: Connection reset by peer",
    ],
)
OOM_KILLED = Done(exit_code=-9, ok=False, ended_at=T, tail=["step 20"])
EXITED_3 = Done(exit_code=3, ok=False, ended_at=T)  # e.g. os._exit(3) in an atexit handler

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
    "the start times out": (
        [StartTimedOut(1, 2, 120.0, "a job")],
        LaunchError,
        "only 1 of 2 ranks had started after 120s",
    ),
    # the first failure opens a window; the earliest real failure in it, by its time at its source, is the cause
    "another rank's shutdown error arrives first: the rank that raised is named": (
        [STARTED, RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)), RankFailed(1, SPARK_TASK_1, boom(T))],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom\n--- remote traceback (rank 1) ---",
    ),
    "the others are listed as its consequences": (
        [STARTED, RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)), RankFailed(1, SPARK_TASK_1, boom(T))],
        RankFailedError,
        "--- other ranks ---\nrank 0: HorovodInternalError: Horovod has been shut down. (a consequence of rank 1's",
    ),
    "TensorFlow's wording of the shutdown is a consequence too": (
        [
            STARTED,
            RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05, "UnknownError")),
            RankFailed(1, SPARK_TASK_1, boom(T)),
        ],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom",
    ),
    "a rank aborted by Gloo after its peer died is a consequence": (
        [STARTED, RankFailed(0, SPARK_TASK_0, GLOO_ABORT), RankFailed(1, SPARK_TASK_1, OOM_KILLED)],
        RankFailedError,
        "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception",
    ),
    "of two real failures, the earlier at its source is named, whatever order they arrive in": (
        [STARTED, RankFailed(0, SPARK_TASK_0, boom(T + 0.5)), RankFailed(1, SPARK_TASK_1, boom(T))],
        RankFailedError,
        "Horovod rank 1 of 2 failed",
    ),
    "a real failure reported after the window still wins over a consequence": (
        [
            STARTED,
            RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)),
            WINDOW,
            RankFailed(1, SPARK_TASK_1, boom(T, terminated_by="rank 0 failed")),
        ],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom",
    ),
    "only consequences: the first is named, and the message says no rank reported its own failure": (
        [STARTED, RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)), WINDOW, RankFailed(1, SPARK_TASK_1, ENDED)],
        RankFailedError,
        "no rank reported a failure of its own",
    ),
    "a lost agent is a real failure: the shutdown it caused is not named": (
        [STARTED, RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)), AgentLost(1, SPARK_TASK_1, "closed", (1, 0))],
        RankFailedError,
        f"Horovod rank 1 of 2 failed: its agent {SPARK_TASK_1} was lost",
    ),
    "an agent lost after the window (the driver ended it) does not replace the cause": (
        [
            STARTED,
            RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)),
            WINDOW,
            AgentLost(1, SPARK_TASK_1, "closed", (1, 0)),
        ],
        RankFailedError,
        "Horovod rank 0 of 2 failed: HorovodInternalError",
    ),
    "a launch failure in the window is not a cause": (
        [STARTED, RankFailed(1, SPARK_TASK_1, boom(T)), JOB_CANCELLED, WINDOW],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom",
    ),
    "cancel() in the window names the failure at once": (
        [STARTED, RankFailed(1, SPARK_TASK_1, boom(T)), Cancelled()],
        RankFailedError,
        "Horovod rank 1 of 2 failed: ValueError: boom",
    ),
    # a rank's main returned (RankSucceeded), then its process failed in its exit work (driver/verdict/exits.py)
    "every rank returned: a failure in the exit work does not fail the run": (
        [STARTED, RankSucceeded(0), RankSucceeded(1), RankFailed(1, SPARK_TASK_1, EXITED_3, after_return=True)],
        None,
        None,
    ),
    "every rank returned, then an agent is lost in the exit work: the run succeeded": (
        [STARTED, RankSucceeded(0), RankSucceeded(1), AgentLost(1, SPARK_TASK_1, "closed", (1, 0), after_return=True)],
        None,
        None,
    ),
    "an agent lost after its rank returned, as the last rank's return is on its way: the run succeeded": (
        [STARTED, RankSucceeded(1), AgentLost(1, SPARK_TASK_1, "closed", (1, 0), after_return=True), RankSucceeded(0)],
        None,
        None,
    ),
    "a host lost after its ranks returned, as the last rank's return is on its way: the run succeeded": (
        [STARTED, RankSucceeded(1), HostLost((1,), "10.0.0.2", "h2", "for 10s", after_return=True), RankSucceeded(0)],
        None,
        None,
    ),
    "an agent lost after its rank returned while another rank trains on fails the run": (
        [
            STARTED,
            RankSucceeded(1),
            AgentLost(1, SPARK_TASK_1, "closed", (1, 0), after_return=True),
            WINDOW,
            RankFailed(0, SPARK_TASK_0, ENDED),
        ],
        RankFailedError,
        "Horovod rank 1 of 2 failed: its agent in Spark task 1 (attempt 0) on executor 10.0.0.2:41000 (10.0.0.2) was "
        "lost (its Spark task, executor or host died, after its main returned, in its exit work: atexit handlers...)",
    ),
    "cancel() in the window of an agent lost after every rank returned cancels the run": (
        [
            STARTED,
            RankSucceeded(1),
            AgentLost(1, SPARK_TASK_1, "closed", (1, 0), after_return=True),
            RankSucceeded(0),
            Cancelled(),
        ],
        RunCancelledError,
        "the run was cancelled",
    ),
    "cancel() during the exit work, after every rank returned, cancels the run": (
        [STARTED, RankSucceeded(0), RankSucceeded(1), Cancelled(), RankFailed(0, SPARK_TASK_0, ENDED)],
        RunCancelledError,
        "the run was cancelled",
    ),
    "a rank that failed in its exit work is named over the shutdown errors it caused": (
        [
            STARTED,
            RankSucceeded(1),
            RankFailed(1, SPARK_TASK_1, EXITED_3, after_return=True),
            RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)),
        ],
        RankFailedError,
        "Horovod rank 1 of 2 failed: exited with code 3 without a Python exception (after its main returned",
    ),
    "a real failure is named over an earlier failure in a returned rank's exit work": (
        [
            STARTED,
            RankSucceeded(1),
            RankFailed(1, SPARK_TASK_1, EXITED_3, after_return=True),
            RankFailed(0, SPARK_TASK_0, boom(T + 1)),
        ],
        RankFailedError,
        "Horovod rank 0 of 2 failed: ValueError: boom",
    ),
}


def spark_reason(task: tuple[int, int]) -> str | None:
    return "Spark: Python worker exited unexpectedly" if task == (1, 0) else None


@pytest.mark.parametrize("case", CASES)
def test_the_first_real_cause_decides(case):
    events, error_type, text = CASES[case]
    outcome = RunOutcome(2, settle_s=60.0)
    for event in events:
        if event == STARTED:
            outcome.started()
        elif event == WINDOW:
            outcome.due(now=math.inf)
        else:
            outcome.record(event, now=0.0)
    outcome.due(now=math.inf)  # the supervisor waits for the window's end before it raises
    error = run_error(outcome, spark_reason)
    if error_type is None:
        assert error is None
        return
    assert type(error) is error_type
    assert text in str(error)


def test_the_cause_is_named_once_the_window_has_passed():
    outcome = RunOutcome(3, settle_s=1.0)
    outcome.started()
    assert outcome.record(RankFailed(0, "on h", shut_down(T + 0.05)), now=10.0) is None
    assert outcome.record(RankFailed(2, "on h", boom(T)), now=10.4) is None
    assert outcome.due(now=10.9) is None
    cause = outcome.due(now=11.0)
    assert cause is not None and abort_reason(cause) == "rank 2 failed"  # what the other ranks are told
    assert outcome.due(now=12.0) is None
    assert outcome.record(RankFailed(1, "on h", Done(exit_code=-15, ok=False, terminated_by="rank 2 failed"))) is None
    assert outcome.record(Cancelled()) is None
    error = run_error(outcome)
    assert error.rank == 2
    assert error.other_failures == [
        "rank 0: HorovodInternalError: Horovod has been shut down. (a consequence of rank 2's failure)",
        "rank 1: ended by the driver (rank 2 failed)",
    ]


def test_the_window_ends_when_every_rank_has_reported():
    outcome = RunOutcome(2, settle_s=60.0)
    outcome.started()
    assert outcome.record(RankFailed(0, SPARK_TASK_0, shut_down(T + 0.05)), now=0.0) is None
    cause = outcome.record(RankFailed(1, SPARK_TASK_1, boom(T)), now=0.1)
    assert isinstance(cause, RankFailed) and cause.rank == 1


def test_a_failure_before_the_ranks_start_ends_the_run_at_once():
    outcome = RunOutcome(2, settle_s=60.0)
    assert outcome.record(AgentFailed(None, SPARK_TASK_1, NO_PSUTIL), now=0.0) is not None


def test_the_failed_rank_error_carries_the_details():
    outcome = RunOutcome(2)
    outcome.started()
    outcome.record(RankFailed(1, SPARK_TASK_1, BOOM))
    outcome.record(RankFailed(0, SPARK_TASK_0, ENDED))
    error = run_error(outcome)
    assert isinstance(error, RankFailedError)
    assert (error.rank, error.exit_code, error.output_tail) == (1, 1, ["step 9"])
    assert error.remote_traceback.endswith("ValueError: boom\n")
    assert error.other_failures == ["rank 0: ended by the driver (rank 1 failed)"]
