"""Errors raised by HorovodRunner on the driver, and the kind of cause each one names (:class:`CauseKind`)."""

from __future__ import annotations

import enum
from typing import Any


class CauseKind(enum.StrEnum):
    """What ended a run, as a fact a program can read (``error.cause_kind``): the cause the driver decided (the
    first real failure, never a consequence of it; docs/failures.md). ``max_restarts`` restarts a run on the kinds
    that are not the code's own (docs/restarts.md)."""

    EXCEPTION = "exception"  #: an exception raised in ``main`` (the code's own)
    EXIT = "exit"  #: a rank's process exited without a result or an exception (``sys.exit``, ``os._exit``: its own)
    SIGNAL = "signal"  #: a rank's process was killed by a signal (from outside, or a native crash)
    OOM = "oom"  #: a rank's process was killed by the kernel's OOM killer (its host showed the kill)
    AGENT_LOST = "agent_lost"  #: a rank's agent was lost: its Spark task, executor or host died
    HOST_LOST = "host_lost"  #: nothing heard from any agent on a host for the heartbeat timeout
    PEER_LOST = "peer_lost"  #: ranks failed as they do when a peer is gone, and no rank reported a failure of its own
    AGENT_FAILED = "agent_failed"  #: a rank's agent raised (its executor's environment: a package missing...)
    STALL = "stall"  #: no rank was active for ``stall_timeout``
    NOT_STARTED = "not_started"  #: the ranks did not all start within the start timeout
    SPARK_JOB = "spark_job"  #: Spark failed or killed the barrier job's task once the ranks ran
    LAUNCH = "launch"  #: the launch or its configuration failed: no attempt can get past it
    CANCELLED = "cancelled"  #: ``cancel()``, or the run's lease ran out


class HorovodRunnerError(RuntimeError):
    """Base class of HorovodRunner's errors.

    ``cause_kind`` says what kind of cause ended the run (:class:`CauseKind`; None for an error no run's cause
    decided); ``attempts``, for a run with ``max_restarts``, is the record of each attempt (docs/restarts.md).
    """

    cause_kind: CauseKind | None = None
    attempts: list[dict[str, Any]] | None = None


class LaunchError(HorovodRunnerError):
    """The ranks could not be started (too few task slots, Spark refused the barrier job, a start timeout)."""

    cause_kind: CauseKind | None = CauseKind.LAUNCH


class HostSlotError(LaunchError):
    """A submitted run's ranks fit the cluster, but not with the task slot its host holds beside them for the
    whole run; ``run()``, whose supervisor is the calling process, needs no such slot. ``reason`` is what does not
    fit, without the advice (a caller that runs the job otherwise says its own)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RunCancelledError(HorovodRunnerError):
    """The run was cancelled with :meth:`HorovodRunner.cancel`; every rank was ended."""

    cause_kind: CauseKind | None = CauseKind.CANCELLED


class RunDetachedError(HorovodRunnerError):
    """``job.close()`` detached this process from a submitted run while it waited: the run goes on (``attach()``
    finds it again until its ``detached_timeout``)."""


class JobNotFoundError(HorovodRunnerError, LookupError):
    """``attach()`` found no run for the id: it ended (its host released its session), or the id is unknown."""


class RankFailedError(HorovodRunnerError):
    """A rank failed; the other ranks were ended.

    ``rank`` is the first rank that failed, ``remote_traceback`` its Python traceback (None when it died
    without one), ``exception_types`` the names of its exception's class and bases (``"builtins.ValueError"``,
    ``"builtins.Exception"``; empty without one), ``output_tail`` its last lines of output, and
    ``other_failures`` one line per other rank that did not succeed.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        exit_code: int | None,
        remote_traceback: str | None,
        output_tail: list[str],
        other_failures: list[str],
        exception_types: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exception_types = exception_types
        self.exit_code = exit_code
        self.remote_traceback = remote_traceback
        self.output_tail = output_tail
        self.other_failures = other_failures


class RunStalledError(HorovodRunnerError):
    """No rank wrote output or reported progress for ``stall_timeout`` seconds; every rank was ended.

    ``ranks`` are the ranks that were running, ``stacks`` each one's Python stacks (every thread, as
    faulthandler wrote them, or why there are none); the message says where each one was.
    """

    cause_kind: CauseKind | None = CauseKind.STALL

    def __init__(self, message: str, *, stall_timeout: float, ranks: list[int], stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stall_timeout = stall_timeout
        self.ranks = ranks
        self.stacks = stacks
