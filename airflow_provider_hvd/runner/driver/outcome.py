"""How a run ends, decided in one place: the first real cause wins, and it alone names the error raised.

The supervisor feeds every event of a run to :class:`RunOutcome`. The first cause (a rank that failed, an
agent lost or failed, a launch that failed, a start that timed out, or ``cancel()``) ends the run; what
happens after it (ranks ended by the driver, the Spark job cancelled by the driver) is its collateral and
never replaces it. The run's own cancellation of its Spark job is never a cause.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError
from ..shared.messages import Done, RemoteError
from .kills import describe_kill
from .stalls import Stalled, stall_error

OTHERS_SHOWN = 20  # lines about other ranks in a RankFailedError's message


class Phase(enum.Enum):
    STARTING = "starting"  # agents are saying hello; no rank process yet
    RUNNING = "running"  # every rank was started
    ENDING = "ending"  # a cause was recorded, or every rank reported: the rest is collateral


# events


@dataclass(frozen=True)
class RankSucceeded:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    """A rank ended without a result (an exception, an exit code, a signal), or was ended by the driver."""

    rank: int
    where: str
    done: Done
    kill_evidence: dict[str, Any] | None = None  # killed by a signal the driver did not send: what was seen (.kills)


@dataclass(frozen=True)
class AgentLost:
    """An agent's connection ended before it reported (its Spark task, executor or host died)."""

    rank: int | None
    where: str
    detail: str
    task: tuple[int, int] | None = None  # (partition, attempt) of its Spark task, to look up Spark's reason


@dataclass(frozen=True)
class AgentFailed:
    """An agent raised (not its rank): e.g. a package missing on its executor."""

    rank: int | None
    where: str
    error: RemoteError


@dataclass(frozen=True)
class LaunchFailed:
    """The launch itself failed (Spark refused or failed the barrier job) before the run decided to end."""

    what: str
    reason: str
    exc: BaseException | None = None


@dataclass(frozen=True)
class StartTimedOut:
    started: int
    size: int
    seconds: float
    what: str


@dataclass(frozen=True)
class Cancelled:
    pass


Event = RankSucceeded | RankFailed | AgentLost | AgentFailed | LaunchFailed | StartTimedOut | Cancelled | Stalled


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _who(rank: int | None, where: str) -> str:
    return f"rank {rank}" if rank is not None else f"the agent {where}"


class RunOutcome:
    """The state machine of one run of ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.phase = Phase.STARTING
        self.cause: Event | None = None
        self.collateral: list[Event] = []
        self.succeeded: set[int] = set()
        self._phase_at_cause = Phase.STARTING

    def started(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.RUNNING

    @property
    def ending(self) -> bool:
        return self.phase is Phase.ENDING

    def record(self, event: Event) -> str | None:
        """Take an event; returns the reason to end the run's other ranks when this event ends the run."""
        if isinstance(event, RankSucceeded):
            self.succeeded.add(event.rank)
            if len(self.succeeded) == self.size:
                self.phase = Phase.ENDING
            return None
        if self.phase is Phase.ENDING:
            if not isinstance(event, (LaunchFailed, Cancelled)):  # the run's own doing: not worth a line
                self.collateral.append(event)
            return None
        self.cause = event
        self._phase_at_cause = self.phase
        self.phase = Phase.ENDING
        if isinstance(event, Cancelled):
            return "the run was cancelled"
        if isinstance(event, LaunchFailed):
            return f"{event.what} failed"
        if isinstance(event, StartTimedOut):
            return "the ranks did not all start in time"
        if isinstance(event, Stalled):
            return event.reason()
        return f"{_who(event.rank, event.where)} failed"

    def error(self, spark_reason: Callable[[tuple[int, int]], str | None] = lambda task: None) -> HorovodRunnerError | None:
        """The error the run raises (None: it succeeded). ``spark_reason`` says why Spark ended a task, if known."""
        cause = self.cause
        if cause is None:
            return None
        if isinstance(cause, Cancelled):
            return RunCancelledError("HorovodRunner: the run was cancelled; every rank was ended")
        if isinstance(cause, Stalled):
            return stall_error(cause)
        if isinstance(cause, StartTimedOut):
            return LaunchError(
                f"only {cause.started} of {cause.size} ranks had started after {cause.seconds:.0f}s ({cause.what}); "
                "the cluster may be short of task slots or the executors cannot reach this driver"
            )
        if isinstance(cause, LaunchFailed):
            error = LaunchError if self._phase_at_cause is Phase.STARTING else HorovodRunnerError
            exc = error(f"{cause.what} failed: {cause.reason}")
            exc.__cause__ = cause.exc
            return exc
        before_start = self._phase_at_cause is Phase.STARTING
        if isinstance(cause, AgentFailed):
            of_rank = f" of rank {cause.rank}" if cause.rank is not None else ""
            text = (
                f"the HorovodRunner agent{of_rank} {cause.where} failed: {cause.error.line()}\n"
                f"--- the agent's traceback ---\n{cause.error.traceback.rstrip()}"
            )
            if before_start:
                return LaunchError(text)
            return self._rank_failed(cause.rank, text, exit_code=None, traceback=cause.error.traceback, tail=[])
        if isinstance(cause, AgentLost):
            reason = (spark_reason(cause.task) if cause.task else None) or cause.detail
            text = (
                f"{_who(cause.rank, cause.where)} lost its agent {cause.where}: {reason}"
                if before_start or cause.rank is None
                else f"Horovod rank {cause.rank} of {self.size} failed: its agent {cause.where} was lost "
                f"(its Spark task, executor or host died): {reason}"
            )
            if before_start or cause.rank is None:
                return LaunchError(text)
            return self._rank_failed(cause.rank, text, exit_code=None, traceback=None, tail=[])
        assert isinstance(cause, RankFailed)
        done = cause.done
        parts = [f"Horovod rank {cause.rank} of {self.size} failed: {self._rank_line(done)}"]
        if cause.kill_evidence:
            parts.append(describe_kill(cause.kill_evidence))
        if done.error:
            parts.append(f"--- remote traceback (rank {cause.rank}) ---\n{done.error.traceback.rstrip()}")
        if done.tail:
            parts.append(f"--- last {len(done.tail)} lines of rank {cause.rank}'s output ---\n" + "\n".join(done.tail))
        return self._rank_failed(
            cause.rank, "\n".join(parts), done.exit_code, done.error.traceback if done.error else None, done.tail
        )

    @staticmethod
    def _rank_line(done: Done) -> str:
        if done.terminated_by:
            return f"ended by the driver ({done.terminated_by})"
        if done.error:
            return done.error.line()
        if done.exit_code == 0:
            return "exited without returning a result"
        return f"{describe_exit(done.exit_code)} without a Python exception"

    def _collateral_lines(self) -> list[str]:
        lines = []
        for event in self.collateral:
            if isinstance(event, RankFailed):
                lines.append(f"rank {event.rank}: {self._rank_line(event.done)}")
            elif isinstance(event, AgentLost):
                lines.append(f"{_who(event.rank, event.where)}: lost its agent {event.where}: {event.detail}")
            elif isinstance(event, AgentFailed):
                lines.append(f"{_who(event.rank, event.where)}: its agent failed: {event.error.line()}")
        return lines

    def _rank_failed(
        self, rank: int | None, text: str, exit_code: int | None, traceback: str | None, tail: list[str]
    ) -> RankFailedError:
        others = self._collateral_lines()
        if others:
            shown = others[:OTHERS_SHOWN]
            if len(others) > OTHERS_SHOWN:  # a run of 1,000 ranks: the error stays readable
                shown.append(f"... and {len(others) - OTHERS_SHOWN} more (all in the error's other_failures)")
            text += "\n--- other ranks ---\n" + "\n".join(shown)
        return RankFailedError(
            text, rank=rank, exit_code=exit_code, remote_traceback=traceback, output_tail=tail, other_failures=others
        )
