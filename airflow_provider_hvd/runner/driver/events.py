"""The events of a run, as the supervisor feeds them to its outcome (:mod:`.verdict.outcome`): what the agents,
the launcher and the supervisor's own checks saw. Plain data: this module imports nothing of the driver, so
that a launcher (which reports :class:`LaunchFailed` and :class:`TaskEnded`) depends on no part of the
supervision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..shared.messages import Done, RemoteError

Task = tuple[int, int]  # a Spark task: (partition, attempt)


# what a launcher's poll() reports (:mod:`.launch.launcher`)


@dataclass(frozen=True)
class LaunchFailed:
    """The launch itself failed (Spark refused or failed the barrier job) before the run decided to end."""

    what: str
    reason: str
    exc: BaseException | None = None


@dataclass(frozen=True)
class Intruded(LaunchFailed):
    """An agent not of the job proved the run's secret (two agents for one Spark task, or one that found its
    task's place taken): the run fails, also once every rank returned, and rank 0's result is not read."""


@dataclass(frozen=True)
class TaskEnded:
    """Spark ended a task of the barrier job (it failed, or was killed from outside the run), for this reason: what
    a lost agent's error says of its task."""

    task: Task
    reason: str


LaunchEvent = LaunchFailed | TaskEnded


@dataclass(frozen=True)
class TaskCounts:
    """What Spark says of the stages of a run's Spark job that compute a DataFrame's rows for it: their tasks
    running and done, and how many of them it runs now (0 where it does not tell them from the barrier stage:
    over Spark Connect, where ``running`` counts the barrier stage's tasks too)."""

    running: int
    done: int
    stages: int = 0


# what the channel's agents and the supervisor's checks report


@dataclass(frozen=True)
class RankSucceeded:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    """A rank ended without a result (an exception, an exit code, a signal), or was ended by the driver."""

    rank: int
    where: str
    done: Done
    received_at: float | None = None  # when the driver got it (time.time()); its source time is in ``done``
    kill_evidence: dict[str, Any] | None = None  # killed by a signal not the driver's: what was seen (.verdict.kills)
    after_return: bool = False  # its main had returned: it failed in its exit work (see RunOutcome.record)


@dataclass(frozen=True)
class AgentLost:
    """An agent's connection ended before it reported (its Spark task, executor or host died)."""

    rank: int | None
    where: str
    detail: str
    task: tuple[int, int] | None = None  # (partition, attempt) of its Spark task, to look up Spark's reason
    received_at: float | None = None  # when the driver saw the connection end (time.time()): no agent can say
    after_return: bool = False  # its rank's main had returned: only its exit work was lost (see RunOutcome._decide)


@dataclass(frozen=True)
class AgentFailed:
    """An agent raised (not its rank): e.g. a package missing on its executor."""

    rank: int | None
    where: str
    error: RemoteError
    received_at: float | None = None  # when the driver got it (time.time()); its source time is ``error.at``


@dataclass(frozen=True)
class StartTimedOut:
    started: int
    size: int
    seconds: float
    what: str
    dataframe: str | None = None  # a run on a DataFrame: how far its rows got (DataFrameProgress.describe)


@dataclass(frozen=True)
class Cancelled:
    dataframe: str | None = None  # before the ranks started, in a run on a DataFrame: how far its rows got


@dataclass(frozen=True)
class HostLost:
    """Nothing came for the heartbeat timeout from any agent on one host: it vanished, or was cut off."""

    ranks: tuple[int, ...]
    address: str
    hostname: str | None
    detail: str  # how long it was silent, and what that means
    received_at: float | None = None  # when the driver decided it (time.time()): the host cannot say
    after_return: bool = False  # the main of every rank on it had returned: only their exit work was lost

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def where(self) -> str:
        return f"on host {self.host()}"

    def host(self) -> str:
        return f"{self.hostname} ({self.address})" if self.hostname and self.hostname != self.address else self.address


Failure = RankFailed | AgentLost | AgentFailed | HostLost
FAILURES = (RankFailed, AgentLost, AgentFailed, HostLost)


@dataclass(frozen=True)
class StalledRank:
    rank: int
    quiet_s: float  # since its last output or message
    stacks: str | None  # faulthandler's dump of every thread
    no_stacks: str | None = None  # why there is none


@dataclass(frozen=True)
class Stalled:
    """The run's event: no rank was active for ``seconds`` (stall_timeout); the running ranks and their stacks."""

    seconds: float
    ranks: tuple[StalledRank, ...]

    def dumps(self) -> str:
        """Every rank's full stacks (all threads), for the log."""
        return "\n".join(
            f"--- rank {r.rank} ---\n{(r.stacks or f'(none: {r.no_stacks})').rstrip()}"
            for r in sorted(self.ranks, key=lambda r: r.rank)
        )

    def reason(self) -> str:
        return f"the run stalled: no rank wrote output or reported progress for {self.seconds:.0f}s (stall_timeout)"


Event = (
    RankSucceeded | RankFailed | AgentLost | AgentFailed | LaunchFailed | StartTimedOut | Cancelled | HostLost | Stalled
)
