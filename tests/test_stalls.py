"""Stalls: ``stall_timeout`` ends a run whose ranks all went quiet, saying where each rank was; an interrupted
or cancelled driver logs where the ranks were before it ends them."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from jobs import assert_all_gone, cancel_once_running, sleep_and_record, wait_for_pids

from airflow_provider_hvd import HorovodRunner, RunCancelledError, RunStalledError

THIS_FILE = str(Path(__file__).resolve())
STALL_S = 5.0
# the feature's bound: the timeout, a tenth of it for the agents' reports, the stacks' answers (5 s at most),
# and margin for a loaded 2-core machine
DETECTED_WITHIN_S = STALL_S + 0.1 * STALL_S + 5.0 + 10.0


def hang_in_a_collective(marker: str, active_s: float = 0.0) -> None:
    """Rank 1 goes quiet in ``wait_forever``; rank 0 waits for it in an allreduce. Before that, both print: while
    they import torch and Horovod (tens of seconds on a loaded machine), then for ``active_s`` seconds (output
    only: activity the driver is not shown with the default verbosity)."""
    import os
    import threading
    import time

    starting = threading.Event()
    threading.Thread(
        target=lambda: [print("starting", flush=True) for _ in iter(lambda: starting.wait(0.5), True)], daemon=True
    ).start()
    import horovod.torch as hvd
    import torch

    hvd.init()
    until = time.monotonic() + active_s
    while time.monotonic() < until:
        print(f"rank {hvd.rank()} working", flush=True)
        time.sleep(0.3)
    starting.set()
    if hvd.rank() == 1:
        open(marker, "w").write(str(time.time()))  # quiet from here on
        wait_forever()
    hvd.allreduce(torch.ones(1), name="after_the_hang")
    os._exit(0)


def wait_forever() -> None:
    import time

    while True:
        time.sleep(3600)


def check_where(err: RunStalledError) -> None:
    text = str(err)
    assert err.ranks == [0, 1], text
    assert f"no rank wrote output or reported progress for {STALL_S:.0f}s (stall_timeout={STALL_S:g})" in text, text
    assert "Stalled: ranks 0, 1." in text, text
    # rank 1: its own code, first the user's frame, then the innermost frames (faulthandler's lines)
    assert "rank 1 (quiet for " in text and f"was in wait_forever ({THIS_FILE}, line " in text, text
    assert f'File "{THIS_FILE}", line ' in text and " in hang_in_a_collective" in text, text
    # rank 0: in Horovod's allreduce, called from the user's function
    rank0 = text[text.index("rank 0 (quiet for ") :]
    assert rank0.startswith("rank 0 (quiet for ") and f"was in hang_in_a_collective ({THIS_FILE}" in rank0, text
    assert "horovod/torch/mpi_ops.py" in rank0 and " in synchronize" in rank0, text
    assert "Current thread" in err.stacks[0] or "Thread 0x" in err.stacks[0]  # every thread, as faulthandler wrote them


def test_a_quiet_run_is_ended_with_where_each_rank_was(tmp_path):
    marker = tmp_path / "quiet-since"
    with pytest.raises(RunStalledError) as info:
        HorovodRunner(np=-2, stall_timeout=STALL_S).run(hang_in_a_collective, marker=str(marker))
    ended = time.time()
    quiet_for = ended - float(marker.read_text())
    assert STALL_S <= quiet_for < DETECTED_WITHIN_S, quiet_for
    check_where(info.value)
    print(f"\nstall → error: {quiet_for:.1f}s (stall_timeout={STALL_S:.0f}s)\n{info.value}")


def test_output_keeps_a_spark_run_alive_until_it_goes_quiet(spark_local, tmp_path, caplog):
    """np > 0 with the default verbosity: the driver sees no output line, only the agents' activity reports."""
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")
    marker = tmp_path / "quiet-since"
    started = time.monotonic()
    with pytest.raises(RunStalledError) as info:
        HorovodRunner(np=2, stall_timeout=STALL_S).run(hang_in_a_collective, marker=str(marker), active_s=1.5 * STALL_S)
    assert time.monotonic() - started > 1.5 * STALL_S, "ended while the ranks were still printing"
    assert not [r for r in caplog.records if r.name == "airflow_provider_hvd.ranks"], "lines were relayed"
    assert STALL_S <= time.time() - float(marker.read_text()) < DETECTED_WITHIN_S
    check_where(info.value)
    log = caplog.text
    assert (
        f"the run stalled: no rank wrote output or reported progress for {STALL_S:.0f}s (stall_timeout); "
        "the ranks' Python stacks" in log
    )
    assert "--- rank 0 ---" in log and "--- rank 1 ---" in log


def report_then_return(seconds: float) -> int:
    import time

    from airflow_provider_hvd import log_to_driver

    until = time.monotonic() + seconds
    while time.monotonic() < until:
        log_to_driver("still here")
        time.sleep(0.5)
    return 7


def test_messages_keep_a_run_alive():
    """Each rank logs every 0.5 s for more than twice the timeout (which covers the ranks' start under load)."""
    assert HorovodRunner(np=-2, stall_timeout=8).run(report_then_return, seconds=20) == 7


@pytest.mark.parametrize("bad", [0, -1.0, True, "600", float("nan")])
def test_a_bad_stall_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
        HorovodRunner(np=-2, stall_timeout=bad)


def test_an_interrupted_driver_logs_where_the_ranks_were(pid_dir, caplog):
    """What Airflow's execution_timeout does: an exception raised in run() (here KeyboardInterrupt)."""
    import _thread

    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd.runner")

    def interrupt_when_started() -> None:
        wait_for_pids(pid_dir, 2)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_started).start()
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=-2).run(sleep_and_record, pid_dir=pid_dir)
    assert_all_gone(wait_for_pids(pid_dir, 2, timeout=1), within=10)
    log = caplog.text
    assert "HorovodRunner: the driver was interrupted (KeyboardInterrupt); where the ranks were" in log, log
    assert "rank 0 (quiet for " in log and "rank 1 (quiet for " in log, log
    assert "was in sleep_and_record (" in log and "jobs.py, line " in log, log


def test_a_cancelled_run_logs_where_the_ranks_were(pid_dir, caplog):
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd.runner")
    error, pids, _ = cancel_once_running(HorovodRunner(np=-2), pid_dir)
    assert isinstance(error, RunCancelledError)
    assert_all_gone(pids, within=1)
    assert "HorovodRunner: the run was cancelled; where the ranks were" in caplog.text
    assert "was in sleep_and_record (" in caplog.text
