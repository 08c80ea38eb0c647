"""A rank's exit work after ``main`` returned (``exit_timeout``, an agent lost during it), ``cancel()`` at every
moment of a run, and nothing of a run left behind however its ranks are ended."""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from cancels import CancelAtLaunch
from jobs import alive, assert_all_gone, no_spark_job_left, wait_for_pids

from airflow_provider_hvd import HorovodRunner, RankFailedError, RunCancelledError
from airflow_provider_hvd.runner.errors import HorovodRunnerError


def return_then_exit_slowly(
    marker_dir: str,
    seconds: float | dict[int, float],
    crash_rank: int = -1,
    fail_rank0: bool = False,
    rank0_main_s: float = 0.0,
) -> int:
    """Each rank returns at once (rank 0 after ``rank0_main_s``), then its atexit handler works for ``seconds``
    (or ``seconds[rank]``, else 0.5); ``crash_rank`` then exits with 3.

    With ``fail_rank0``, rank 0 raises once rank 1 is in its exit work.
    """
    import atexit
    import os

    rank = int(os.environ["HOROVOD_RANK"])
    exit_s = seconds.get(rank, 0.5) if isinstance(seconds, dict) else seconds

    def exit_work() -> None:
        Path(marker_dir, f"exiting-{rank}").write_text(str(os.getpid()))
        time.sleep(exit_s)
        Path(marker_dir, f"exited-{rank}").write_text("")
        if rank == crash_rank:
            os._exit(3)

    if not (fail_rank0 and rank == 0):  # (a rank that raised is ended 10 s after its report if it does not exit)
        atexit.register(exit_work)
    if fail_rank0 and rank == 0:
        while not Path(marker_dir, "exiting-1").exists():
            time.sleep(0.05)
        raise ValueError("rank 0 failed after rank 1 returned")
    if rank == 0:
        time.sleep(rank0_main_s)
    return 42 + rank


def _exiting_pids(marker_dir: Path, ranks: int | list[int] = 2, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [marker_dir / f"exiting-{rank}" for rank in (range(ranks) if isinstance(ranks, int) else ranks)]
        if all(file.exists() and file.read_text() for file in files):
            return [int(file.read_text()) for file in files]
        time.sleep(0.05)
    raise TimeoutError("the ranks did not reach their exit work")


# exit work: exit_timeout


def test_exit_work_longer_than_the_old_10s_is_waited_for(tmp_path):
    """Before: RankFailedError ("it reported but had not exited 10s later") after 12.6 s, the exit work killed."""
    started = time.monotonic()
    assert HorovodRunner(np=-2).run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds=11) == 42
    assert (tmp_path / "exited-0").exists() and (tmp_path / "exited-1").exists()  # the exit work ran to its end
    assert time.monotonic() - started >= 11


def test_a_rank_still_exiting_after_exit_timeout_is_ended_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd")
    started = time.monotonic()
    runner = HorovodRunner(np=-2, exit_timeout=timedelta(seconds=2))
    assert runner.run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds=600) == 42
    took = time.monotonic() - started
    pids = [int((tmp_path / f"exiting-{rank}").read_text()) for rank in range(2)]
    assert_all_gone(pids, within=5)
    assert 2 <= took < 30, took
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for rank in (0, 1):
        assert any(f"rank {rank} " in text and "still exiting 2s after" in text for text in warnings), warnings


def test_a_rank_whose_exit_fails_after_every_rank_returned_does_not_fail_the_run(tmp_path, caplog):
    """Before: RankFailedError ("rank 1 ... exited with code 3 without a Python exception") for a finished run."""
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd")
    assert HorovodRunner(np=-2).run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds=1, crash_rank=1) == 42
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("rank 1 " in text and "exited with code 3" in text and "returned" in text for text in warnings), warnings


def test_a_rank_that_fails_after_a_peer_returned_ends_the_peers_exit_work(tmp_path):
    """The peer that returned is not waited for: the run failed, its exit work is ended with it."""
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed: ValueError: rank 0 failed after rank 1 returned"):
        HorovodRunner(np=-2).run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds=600, fail_rank0=True)
    assert time.monotonic() - started < 30  # not rank 1's 600 s of exit work, nor exit_timeout
    assert_all_gone([int((tmp_path / "exiting-1").read_text())], within=5)


def test_on_spark_exit_work_is_waited_for_and_a_rank_still_exiting_is_ended(spark_local, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd")
    runner = HorovodRunner(np=2, exit_timeout=4)
    assert runner.run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds={0: 1, 1: 600}) == 42
    assert (tmp_path / "exited-0").exists() and not (tmp_path / "exited-1").exists()
    assert_all_gone([int((tmp_path / f"exiting-{rank}").read_text()) for rank in range(2)], within=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [text for text in warnings if "still exiting" in text and "rank 1 in Spark task 1" in text], warnings
    assert not [text for text in warnings if "rank 0 " in text], warnings
    assert no_spark_job_left(spark_local)


def kill_the_agent_of(rank_pid: int) -> None:
    """SIGKILL the agent of the rank process ``rank_pid``: its Spark task's Python worker (agent > reaper > rank)."""
    agent = psutil.Process(rank_pid).parent().parent()
    assert "airflow_provider_hvd" not in " ".join(agent.cmdline()), agent.cmdline()  # (a Python worker, not a reaper)
    agent.kill()


@pytest.mark.parametrize("every_rank_returned", [True, False], ids=["after every rank returned", "before"])
def test_an_agent_lost_in_its_ranks_exit_work(spark_local, tmp_path, caplog, every_rank_returned):
    """Rank 1 returned; its agent (its Spark task's Python worker) is killed while its atexit handler runs. Once
    every rank returned (the driver says so), the run succeeded: one warning names the rank, and run() returns
    rank 0's value. While rank 0 is still in its main, the run fails, naming the lost agent and that it returned.
    Before: killed once the driver had both returns, 42 without a word of the lost agent; killed as soon as both
    exit works began (rank 0's return still on its way to the driver), RankFailedError "Horovod rank 1 of 2
    failed: its agent in Spark task 1 ... was lost" (tests/test_outcome.py has that order as a case)."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    thread, outcome = _run_in_thread(
        lambda: HorovodRunner(np=2).run(
            return_then_exit_slowly,
            marker_dir=str(tmp_path),
            seconds={0: 1, 1: 600},
            rank0_main_s=0 if every_rank_returned else 600,
        )
    )
    (rank1,) = _exiting_pids(tmp_path, ranks=[1])
    deadline = time.monotonic() + 60
    while every_rank_returned and "every rank returned: the run succeeded" not in caplog.text:
        assert time.monotonic() < deadline, "the driver did not say that every rank returned"
        time.sleep(0.05)
    kill_the_agent_of(rank1)
    thread.join(120)
    assert not thread.is_alive(), "run() did not end"
    lost = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "lost" in r.getMessage()]
    if every_rank_returned:
        assert outcome == {"value": 42}, outcome
        assert len(lost) == 1, lost
        assert re.search(r"rank 1 returned, then its agent in Spark task 1 .* was lost in the exit work", lost[0]), lost
    else:
        error = outcome["error"]
        assert isinstance(error, RankFailedError) and error.rank == 1, error
        assert re.search(
            r"rank 1 of 2 failed: its agent in Spark task 1 .* was lost \(.*, after its main returned", str(error)
        ), error
    assert_all_gone([rank1], within=15)
    assert no_spark_job_left(spark_local)


@pytest.mark.parametrize("bad", [0, -1, "120", float("nan"), True, timedelta(0)])
def test_a_bad_exit_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="exit_timeout must be a positive number of seconds"):
        HorovodRunner(np=-2, exit_timeout=bad)


def test_exit_timeout_reaches_the_runner_from_the_operator():
    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator

    with pytest.raises(ValueError, match="exit_timeout must be a positive number of seconds"):
        HorovodRunnerOperator(task_id="t", python_callable=print, np=2, exit_timeout=-5)
    operator = HorovodRunnerOperator(task_id="t", python_callable=print, np=2, exit_timeout=timedelta(minutes=5))
    assert operator.exit_timeout == 300.0
    assert HorovodRunner(np=2).exit_timeout == 120.0


def test_exit_timeout_is_checked_by_the_decorator_when_the_dag_is_parsed():
    from airflow.sdk import DAG

    from airflow_provider_hvd.decorators.horovod import horovod_task

    with DAG("exit_timeout_checked", schedule=None), pytest.raises(ValueError, match="exit_timeout must be"):
        horovod_task(np=2, exit_timeout=timedelta(seconds=-1))(write_marker)(marker="x")


# cancel() at every moment


class BlocksWhilePickled:
    """An argument whose pickling waits for the test: ``pickling`` is set once it started, ``go`` lets it end."""

    def __init__(self) -> None:
        self.pickling = threading.Event()
        self.go = threading.Event()

    def __reduce__(self):
        self.pickling.set()
        assert self.go.wait(60), "the test did not let the pickling end"
        return (str, ("pickled",))


def write_marker(marker: str, blocker: object = None) -> int:
    Path(marker).write_text("main ran")
    return 1


def _run_in_thread(run) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - the test checks which
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("door", ["runner", "hook"])
def test_cancel_while_the_job_is_pickled_ends_the_run_before_main(tmp_path, door):
    """Before: run() returned normally and main ran (the cancel came before the run was registered)."""
    marker, blocker = tmp_path / "ran", BlocksWhilePickled()
    if door == "runner":
        runner = HorovodRunner(np=-2)
        thread, outcome = _run_in_thread(lambda: runner.run(write_marker, marker=str(marker), blocker=blocker))
        cancel = runner.cancel
    else:
        from airflow_provider_hvd.hooks.horovod import HorovodHook

        hook = HorovodHook()
        kwargs = {"marker": str(marker), "blocker": blocker}
        thread, outcome = _run_in_thread(lambda: hook.run(write_marker, kwargs=kwargs, np=-2))
        cancel = hook.cancel
    assert blocker.pickling.wait(60)
    cancel()
    blocker.go.set()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), RunCancelledError), outcome
    assert not marker.exists(), "main ran"


def test_cancel_before_a_runners_first_run_cancels_it_and_the_runner_runs_again(tmp_path):
    """The hook's window: on_kill() as the hook hands the job to its new runner, before the run is registered."""
    runner = HorovodRunner(np=-2)
    runner.cancel()
    with pytest.raises(RunCancelledError, match="cancelled before its ranks started"):
        runner.run(write_marker, marker=str(tmp_path / "ran"))
    assert not (tmp_path / "ran").exists(), "main ran"
    assert runner.run(write_marker, marker=str(tmp_path / "ran")) == 1  # once: the next run is not cancelled


class BlockingStore:
    """A task state store whose reads wait for the test (``reading`` is set once one started, ``go`` ends it)."""

    def __init__(self) -> None:
        self.reading, self.go = threading.Event(), threading.Event()

    def get(self, key: str) -> None:
        self.reading.set()
        assert self.go.wait(60), "the test did not let the read end"

    def set(self, key: str, value: object) -> None:
        pass


def test_on_kill_while_the_task_reads_its_last_checkpoint_ends_it_before_main(tmp_path):
    """The window before the task's runner exists: its hook is told, and the job never starts."""
    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator

    marker, store = tmp_path / "ran", BlockingStore()
    kwargs = {"marker": str(marker)}
    operator = HorovodRunnerOperator(task_id="t", python_callable=write_marker, op_kwargs=kwargs, np=-2)
    thread, outcome = _run_in_thread(lambda: operator.execute({"task_state_store": store}))
    assert store.reading.wait(60)
    operator.on_kill()
    store.go.set()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), RunCancelledError), outcome
    assert not marker.exists(), "main ran"


def test_cancel_during_the_launch_ends_the_run_before_main(tmp_path):
    runner = HorovodRunner(np=-2)
    handler, logger = CancelAtLaunch(runner), logging.getLogger("airflow_provider_hvd.runner")
    logger.addHandler(handler)
    try:
        with pytest.raises(RunCancelledError, match="the run was cancelled"):
            runner.run(write_marker, marker=str(tmp_path / "ran"))
    finally:
        logger.removeHandler(handler)
    assert not (tmp_path / "ran").exists(), "main ran"


@pytest.mark.parametrize("launch", ["HorovodRunner local", "TorchDistributor local", "HorovodRunner on Spark"])
def test_cancel_as_the_last_agent_says_hello_ends_the_run_before_main(request, tmp_path, monkeypatch, launch):
    """Before: the watch read the cancel flag, then waited for the channel's next event; a cancel() in that wait
    followed by the last agent's hello started the ranks all the same: main ran, and run() raised
    RunCancelledError (seen under load with a 300 MB job). The cancel is forced into that window here: it comes
    once every agent has said hello, as the driver goes to start the ranks."""
    from airflow_provider_hvd import TorchDistributor
    from airflow_provider_hvd.runner.driver.watch.supervisor import Supervisor

    if launch == "HorovodRunner on Spark":
        request.getfixturevalue("spark_local")
    runner = (
        TorchDistributor(2, True, False)
        if launch.startswith("Torch")
        else HorovodRunner(np=-2 if "local" in launch else 2)
    )
    start_ranks = Supervisor._start_ranks

    def cancel_then_start(supervisor: Supervisor) -> None:
        runner.cancel()
        start_ranks(supervisor)

    monkeypatch.setattr(Supervisor, "_start_ranks", cancel_then_start)
    marker = tmp_path / "ran"
    with pytest.raises(RunCancelledError, match="the run was cancelled before its ranks started"):
        runner.run(write_marker, marker=str(marker))
    assert not marker.exists(), "main ran"


_HELD_BEFORE_ITS_JOB = """
import os, time

_release = os.environ.get("HVD_TEST_RELEASE_RANKS")
if _release and "HOROVOD_RANK" in os.environ:  # a rank process (its reaper runs without site): held at its start
    while not os.path.exists(_release):
        time.sleep(0.05)
"""


def test_cancel_as_the_ranks_start_ends_a_rank_still_waiting_for_its_job(tmp_path, monkeypatch):
    """Before: an agent heard nothing from the driver while it handed the job to its rank (a large job, a rank
    slow to read it: seen with 300 MB under load). The driver's cancel waited 5 s for that agent's answer with
    the stacks, its Abort waited for the job to be in, and the rank ran main after the cancel. Here each rank
    process is held before it reads its job (more than a pipe holds): run() ends, the ranks ended unread."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_HELD_BEFORE_ITS_JOB)
    release, marker = tmp_path / "release", tmp_path / "ran"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HVD_TEST_RELEASE_RANKS", str(release))
    runner = HorovodRunner(np=-2)
    handler, logger = CancelAtLaunch(runner, when="ranks started"), logging.getLogger("airflow_provider_hvd.runner")
    logger.addHandler(handler)
    try:
        thread, outcome = _run_in_thread(lambda: runner.run(write_marker, marker=str(marker), blocker=b"x" * 2**20))
        thread.join(30)
        ended_in_time = not thread.is_alive()
        release.touch()  # (before: the ranks read their job now, and the run ends)
        thread.join(90)
    finally:
        logger.removeHandler(handler)
    assert ended_in_time, "run() did not end within 30 s of the cancel"
    assert isinstance(outcome.get("error"), RunCancelledError), outcome
    assert not marker.exists(), "main ran"


def test_cancel_during_the_ranks_exit_work_ends_them_and_raises(tmp_path):
    runner = HorovodRunner(np=-2)
    thread, outcome = _run_in_thread(lambda: runner.run(return_then_exit_slowly, marker_dir=str(tmp_path), seconds=600))
    pids = _exiting_pids(tmp_path)
    runner.cancel()
    thread.join(30)
    assert not thread.is_alive(), "run() did not end within 30 s of cancel()"
    assert isinstance(outcome.get("error"), RunCancelledError), outcome
    assert_all_gone(pids, within=5)
    assert not [pid for pid in pids if alive(pid)]


# nothing a run creates outlives it, whoever ends its ranks


def record_then_sleep(pid_dir: str, way: str) -> None:
    """Each rank records its pid and its reaper's, then sleeps without a word; for ``way`` "abort", rank 1 raises."""
    import os

    rank = os.environ["HOROVOD_RANK"]
    Path(pid_dir, f"reaper-{rank}").write_text(str(os.getppid()))
    Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))
    if way == "abort" and rank == "1":
        raise ValueError("rank 1 failed")
    time.sleep(600)


WAYS = ["abort", "stall", "cancel", "rank killed", "agent killed"]


@pytest.mark.parametrize("np", [-2, 2], ids=["local", "local[2]"])
def test_nothing_a_run_creates_outlives_it_whoever_ends_its_ranks(request, tmp_path, monkeypatch, np):
    """Runs ended each way a rank is ended (rank 1 failed and rank 0 aborted; a stall; a cancel; rank 1 SIGKILLed;
    on Spark, rank 1's agent SIGKILLed), with TMPDIR a folder of the test's: nothing is left in it once the ranks
    and their reapers are gone. Before: the run whose agent was killed left hvd-rank1-stacks-<random>.txt (its
    agent's clean-up never ran), the others nothing."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the rank processes and their reapers, started from here
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # this process's (the local agents'), read once
    if np > 0:  # the Spark tasks' Python workers (a new daemon, for this environment)
        monkeypatch.setitem(request.getfixturevalue("spark_local").sparkContext.environment, "TMPDIR", str(temp))
    left: dict[str, list[str]] = {}
    seen: set[str] = set()
    for way in WAYS if np > 0 else WAYS[:-1]:  # (a local agent is a thread of this process)
        pid_dir = tmp_path / way.replace(" ", "-")
        pid_dir.mkdir()
        runner = HorovodRunner(np=np, stall_timeout=3 if way == "stall" else None)
        thread, outcome = _run_in_thread(
            functools.partial(runner.run, record_then_sleep, pid_dir=str(pid_dir), way=way)
        )
        if way != "abort":
            wait_for_pids(str(pid_dir), 2, timeout=180)
            rank1 = int((pid_dir / "rank-1.pid").read_text())
            if way == "cancel":
                runner.cancel()
            elif way == "rank killed":
                os.kill(rank1, signal.SIGKILL)
            elif way == "agent killed":
                kill_the_agent_of(rank1)
        thread.join(120)
        assert not thread.is_alive(), f"{way}: run() did not end"
        assert isinstance(outcome.get("error"), HorovodRunnerError), (way, outcome)
        assert_all_gone([int(file.read_text()) for file in pid_dir.iterdir()], within=30)  # ranks and reapers
        now = {path.name for path in temp.iterdir()}
        left[way], seen = sorted(now - seen), now
    assert left == {way: [] for way in left}, left
