"""HorovodRunner: the API of Databricks' ``sparkdl.HorovodRunner``, on open-source Horovod and Spark."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .driver.channel import rank_log
from .driver.local_launch import LocalLauncher
from .driver.slots import DEFAULT_SLOT_WAIT_S, check_slot_wait_timeout
from .driver.spark_cluster import active_session
from .driver.spark_launch import SparkLauncher
from .driver.stalls import CodeFiles, check_stall_timeout
from .driver.supervisor import Launcher, Supervisor
from .shared.payload import WARN_BYTES, dumps_job

VERBOSITIES = ("all", "log_callback_only")


def check_verbosity(driver_log_verbosity: str) -> None:
    if driver_log_verbosity not in VERBOSITIES:
        raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}, not {driver_log_verbosity!r}")


_console_lock = threading.Lock()
_console_users = 0
_console_handler = logging.StreamHandler(sys.stderr)
_console_handler.setFormatter(logging.Formatter("%(message)s"))


@contextlib.contextmanager
def _rank_logs_visible() -> Iterator[None]:
    """Show relayed rank lines on stderr while runs are going on, if the application set up no logging."""
    global _console_users
    with _console_lock:
        ours = _console_users > 0 or not rank_log.hasHandlers()
        if ours:
            if _console_users == 0:
                rank_log.addHandler(_console_handler)
            _console_users += 1
    try:
        yield
    finally:
        if ours:
            with _console_lock:
                _console_users -= 1
                if _console_users == 0:
                    rank_log.removeHandler(_console_handler)


@dataclass
class _Run:
    """One run in progress; ``cancel()`` sets its flag (a plain attribute: safe in a signal handler)."""

    cancelled: bool = False


class HorovodRunner:
    """Run a Horovod training function on ``|np|`` ranks and return rank 0's result.

    :param np: ``np < 0``: ``-np`` processes on this host (for debugging; every rank's output is shown).
        ``np > 0``: a Spark barrier job of ``np`` tasks on the active SparkSession (``local[*]`` if none).
    :param driver_log_verbosity: for ``np > 0``: ``"all"`` relays every rank's stdout and stderr to the
        driver's log; ``"log_callback_only"`` (default) relays only :func:`log_to_driver` messages and
        ``LogCallback`` lines, the rest staying in the executors' stderr.
    :param slot_wait_timeout: for ``np > 0``: how long to wait, in seconds, for ``np`` free task slots on a
        busy cluster before raising :class:`LaunchError` (a job that can never fit is refused at once).
    :param stall_timeout: seconds (or a timedelta); when no rank has written output or reported progress
        (``log_to_driver``, metrics) for that long, the ranks' Python stacks are collected, every rank is ended
        and ``run`` raises :class:`RunStalledError` saying where each one was. ``None`` (default): off.
    """

    start_timeout_s: float = 120.0
    #: a pickled job (``main`` and its arguments) larger than this logs a warning naming its largest parts
    payload_warning_bytes: int = WARN_BYTES

    def __init__(
        self,
        *,
        np: int,
        driver_log_verbosity: str = "log_callback_only",
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        stall_timeout: float | timedelta | None = None,
    ) -> None:
        if isinstance(np, bool) or not isinstance(np, int):
            raise ValueError(f"np must be a non-zero int, not {np!r} ({type(np).__name__})")
        if np == 0:
            raise ValueError("np must be non-zero: np<0 runs -np processes on this host, np>0 a Spark job of np tasks")
        check_verbosity(driver_log_verbosity)
        self.slot_wait_timeout = check_slot_wait_timeout(slot_wait_timeout)
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self._runs: list[_Run] = []

    def run(self, main: Callable[..., Any], /, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank; return rank 0's return value.

        ``main`` and ``kwargs`` are pickled once with cloudpickle; ``main`` must call ``hvd.init()`` itself.
        Raises :class:`RankFailedError` (with the remote traceback) when a rank fails, after ending the others.
        """
        return self.run_with_args(main, (), kwargs)

    def run_with_args(self, main: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """:meth:`run` with positional arguments too: ranks call ``main(*args, **kwargs)``."""
        if not callable(main):
            raise TypeError(f"main must be callable, not {type(main).__name__}")
        try:
            inspect.signature(main).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"the arguments do not fit {getattr(main, '__name__', main)!r}: {exc}") from None
        except ValueError:
            pass  # no signature to check (some builtins)
        payload = dumps_job(main, args, kwargs, warn_bytes=self.payload_warning_bytes)
        run = _Run()
        self._runs.append(run)
        try:
            launcher: Launcher
            if self.num_processor < 0:
                launcher = LocalLauncher(-self.num_processor)
            else:
                launcher = SparkLauncher(
                    active_session(), self.num_processor, self.slot_wait_timeout, cancelled=lambda: run.cancelled
                )
            supervisor = Supervisor(
                launcher, payload, self.driver_log_verbosity, lambda: run.cancelled, self.start_timeout_s,
                stall_timeout=self.stall_timeout, code_files=CodeFiles(main, args, kwargs),
            )
            del payload  # the launcher gets it; on Spark the driver keeps no copy beside the broadcast's
            with _rank_logs_visible():
                return supervisor.run()
        finally:
            self._runs.remove(run)

    def cancel(self) -> None:
        """End the runs in progress from another thread or a signal handler; ``run`` then raises RunCancelledError.

        Only sets a flag (safe in a signal handler); the running ``run`` ends the ranks within moments. The
        runner can run again afterwards.
        """
        for run in list(self._runs):
            run.cancelled = True
