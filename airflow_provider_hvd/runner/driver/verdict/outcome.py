"""How a run ends, decided in one place (the driver's state machine; :mod:`.report` words the error).

The supervisor feeds every event of a run to :class:`RunOutcome`. ``cancel()``, a launch that failed and a
start that timed out end the run at once; an agent not of the job (``Intruded``) ends it even once every rank
returned. A rank or agent that fails once the ranks run opens a short window (:data:`SETTLE_S`): the reports
that race it arrive, and the cause is the earliest *real* failure by the time it happened at its source.
Horovod's shutdown errors on the other ranks are consequences (:mod:`.consequences`); one is the cause only
when no real failure is reported. What happens after the decision (ranks ended by the driver, the Spark job
cancelled by the driver) is collateral and never replaces the cause, except that a real failure which
happened before the decision, reported late, still wins over a consequence. The run's own cancellation of its
Spark job is never a cause. The rule is in docs/failures.md.
"""

from __future__ import annotations

import enum
import math
import time

from ...shared.timing import SETTLE_S
from ..events import (
    FAILURES,
    AgentFailed,
    AgentLost,
    Cancelled,
    Event,
    Failure,
    HostLost,
    Intruded,
    RankFailed,
    RankSucceeded,
)
from .consequences import is_consequence


class Phase(enum.Enum):
    STARTING = "starting"  # agents are saying hello; no rank process yet
    RUNNING = "running"  # every rank was started
    SETTLING = "settling"  # a rank failed: the reports racing it are awaited for SETTLE_S before naming the cause
    ENDING = "ending"  # a cause was recorded, or every rank reported: the rest is collateral


def source_time(event: Failure) -> float | None:
    """When ``event`` happened where it happened, by that host's wall clock (time.time()).

    A rank's exception is stamped when the rank process caught it; a rank that died without one, when its
    agent saw it end; an agent's own exception, when it caught it; a lost agent, when the driver saw its
    connection end (nobody else can tell). Hosts' clocks differ by the error of their time sync, milliseconds
    with NTP: that orders two real failures fairly unless they happened within that error of each other, and
    then either is a fair cause. Consequences are told apart by what they are, not by their time.
    """
    if isinstance(event, RankFailed):
        done = event.done
        stamped = done.error.at if done.error is not None else done.ended_at
    elif isinstance(event, AgentFailed):
        stamped = event.error.at
    else:
        stamped = None
    return stamped if stamped is not None else event.received_at


def after_return(event: Failure) -> bool:
    """The failure came after the rank's main returned (of every rank on a lost host): in its exit work."""
    return not isinstance(event, AgentFailed) and event.after_return


def is_consequence_event(event: Failure) -> bool:
    """A rank that failed because another did (Horovod shut down under it); agents' failures are their own."""
    return isinstance(event, RankFailed) and is_consequence(event.done)


def _driver_ended(event: Failure) -> bool:
    """The driver ended this rank (after the run's cause was decided); it did not fail on its own."""
    return isinstance(event, RankFailed) and event.done.terminated_by is not None and event.done.error is None


class RunOutcome:
    """The state machine of one run of ``size`` ranks."""

    def __init__(self, size: int, settle_s: float = SETTLE_S) -> None:
        self.size = size
        self.settle_s = settle_s
        self.phase = Phase.STARTING
        self.cause: Event | None = None  # what ended the run, as decided (the other ranks were told this)
        self.collateral: list[Event] = []  # the other failures, in the order they arrived
        self.succeeded: set[int] = set()
        self.settle_until: float | None = None  # (time.monotonic()) the window after the first failure ends
        self.decided_at: float | None = None  # (time.time()) when the cause was decided
        self._phase_at_cause = Phase.STARTING
        self._candidates: list[Failure] = []  # failures that may be the cause, in the order they arrived

    def started(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.RUNNING

    @property
    def ending(self) -> bool:
        return self.phase is Phase.ENDING

    @property
    def started_before_cause(self) -> bool:
        """The ranks had all started when the cause happened (else the run failed while starting)."""
        return self._phase_at_cause is not Phase.STARTING

    def record(self, event: Event, now: float | None = None) -> Event | None:
        """Take an event (``now``: its time.monotonic()); returns the run's cause when this event decides it:
        then the run's other ranks are to be ended."""
        if isinstance(event, Intruded) and self.cause is None:  # whatever the ranks did: rank 0's result is not read
            self._end(event)
            return event
        if isinstance(event, RankSucceeded):
            self.succeeded.add(event.rank)
            if self.phase is not Phase.SETTLING and len(self.succeeded) == self.size:
                self.phase = Phase.ENDING
            return self._decide_if_all_reported()
        if isinstance(event, Cancelled) and self.phase is Phase.ENDING and self.cause is None:
            self._end(event)  # every rank returned, and their exit work is cancelled: the run did not complete
            return event
        if self.phase is Phase.ENDING:
            if isinstance(event, FAILURES):  # not LaunchFailed or Cancelled: the run's own doing, not worth a line
                self.collateral.append(event)
                if self._happened_before_decision(event):
                    self._candidates.append(event)
            return None
        if isinstance(event, FAILURES) and self.phase is not Phase.STARTING:
            self._candidates.append(event)
            if isinstance(event, RankFailed) and event.after_return and self.phase is Phase.RUNNING:
                return None  # its training was done: a cause only if the run fails otherwise (_first_failure)
            if self.phase is Phase.RUNNING:
                self.phase = Phase.SETTLING
                self.settle_until = (time.monotonic() if now is None else now) + self.settle_s
            return self._decide_if_all_reported()
        if self.phase is Phase.SETTLING:
            if isinstance(event, Cancelled):  # no more waiting; the failure that came first is still the cause
                cause = self._decide()
                if cause is None:  # (none: every rank returned) the exit work is cancelled
                    self._end(event)
                return cause or event
            return None  # a launch failure now is the rank failure's doing (Spark failed the job after it)
        if isinstance(event, FAILURES):  # before the ranks start: no Horovod yet, so no consequences to wait for
            self._candidates.append(event)
        self._end(event)
        return event

    def due(self, now: float | None = None) -> Event | None:
        """The cause, once the window after the first failure has passed (``now``: time.monotonic())."""
        if self.phase is not Phase.SETTLING:
            return None
        assert self.settle_until is not None
        if (time.monotonic() if now is None else now) < self.settle_until:
            return None
        return self._decide()

    def verdict(self) -> tuple[Event | None, list[Event]]:
        """The cause the run's error names, and the run's other failures in the order they arrived.

        That is the decided cause, unless a failure reported after the decision happened before it and comes
        first by the same rule: a rank that raised but reported after the window closed on its consequences.
        """
        cause = self.cause
        if isinstance(cause, FAILURES):
            cause = self._first_failure()
        others = [event for event in self.collateral if event is not cause]
        if cause is not self.cause and self.cause is not None:
            others.insert(0, self.cause)
        return cause, others

    def _end(self, cause: Event) -> None:
        self.cause = cause
        self._phase_at_cause = self.phase
        self.phase = Phase.ENDING
        self.decided_at = time.time()

    def _decide(self) -> Event | None:
        if len(self.succeeded) == self.size and all(map(after_return, self._candidates)):
            # every rank returned, the last within the window of an agent or host lost in its exit work after
            # its main returned: the run succeeded (the supervisor warned of each)
            self.collateral = self._candidates + self.collateral
            self.phase = Phase.ENDING
            return None
        cause = self._first_failure()
        self.collateral = [event for event in self._candidates if event is not cause] + self.collateral
        self._end(cause)
        return cause

    def _decide_if_all_reported(self) -> Event | None:
        if self.phase is not Phase.SETTLING:
            return None
        failed = {
            rank
            for event in self._candidates
            for rank in (event.ranks if isinstance(event, HostLost) else [event.rank])
        }
        if len(self.succeeded | failed) < self.size:
            return None
        return self._decide()

    def _first_failure(self) -> Failure:
        """The earliest real failure by its source time; then the earliest of a rank that failed in its exit work
        after its main returned (it may have brought Horovod down under the others); the earliest consequence if
        neither. Failures without a time keep the order they arrived in, after those with one."""

        def key(indexed: tuple[int, Failure]) -> tuple[int, float, int]:
            index, event = indexed
            at = source_time(event)
            return 2 if is_consequence_event(event) else int(after_return(event)), math.inf if at is None else at, index

        return min(enumerate(self._candidates), key=key)[1]

    def _happened_before_decision(self, event: Failure) -> bool:
        """A failure reported after the decision may still be the cause if it happened before it, at its source
        (not a lost agent: only the driver's receive time tells when that happened, which is after)."""
        if _driver_ended(event) or isinstance(event, AgentLost | HostLost):
            return False
        at = source_time(event)
        return at is not None and self.decided_at is not None and at < self.decided_at
