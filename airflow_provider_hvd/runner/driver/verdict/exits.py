"""A rank's exit work, after its ``main`` returned: ``exit_timeout``, the grace the driver gives it.

Once a rank's ``main`` returned, its process still runs its exit work (``atexit`` handlers, an experiment
tracker's flush, DataLoader workers, TensorBoard writers). Its agent tells the driver at once (``Returned``),
and once every rank has returned the run has succeeded: the driver waits for the exit work up to
``exit_timeout``, then ends the ranks still exiting, with a warning naming each.
"""

from __future__ import annotations

from ...shared.naming import HOROVOD_RUNNER
from ...shared.timing import DEFAULT_EXIT_TIMEOUT_S as DEFAULT_EXIT_TIMEOUT_S  # (imported from here too)


def still_exiting(rank: int | None, where: str, seconds: float, runner: str = HOROVOD_RUNNER.runner) -> str:
    """The warning about a rank ended because its exit work outlasted ``exit_timeout``."""
    return (
        f"{runner}: rank {rank} {where} was still exiting {seconds:g}s after every rank returned "
        "(exit_timeout): its exit work (atexit handlers, trackers' flushes...) is ended; the run succeeded"
    )


def exit_failed(rank: int | None, where: str, how: str, runner: str = HOROVOD_RUNNER.runner) -> str:
    """The warning about a rank whose process failed in its exit work, after its ``main`` returned."""
    return f"{runner}: rank {rank} {where} returned, then its process {how} in its exit work (atexit handlers...)"


def exit_work_awaited(ranks: int, seconds: float, runner: str = HOROVOD_RUNNER.runner) -> str:
    """The line that says the run succeeded while ``ranks`` ranks still run their exit work."""
    return (
        f"{runner}: every rank returned: the run succeeded; the exit work (atexit handlers...) of {ranks} "
        f"rank(s) is waited for, {seconds:g}s at most (exit_timeout)"
    )
