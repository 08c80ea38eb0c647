"""The phase of each agent connection's rank, as the supervisor sees it (``AgentConnection.phase``).

``waiting`` (its agent said hello) → ``started`` (``Start`` sent) → ``returned`` (its ``main`` returned; its
process runs its exit work) → over: ``ended`` (its agent reported a rank that exited with a result), ``failed``
(its agent reported a failure: the rank's, or its own) or ``lost`` (its connection ended, or its host went
silent, before a report). A rank may be over from any phase; an over one stays so. Who ends a rank, and when, is
in docs/internals.md ("Who ends a rank").
"""

from __future__ import annotations

import enum


class RankPhase(enum.Enum):
    WAITING = "waiting"
    STARTED = "started"
    RETURNED = "returned"
    ENDED = "ended"
    FAILED = "failed"
    LOST = "lost"

    @property
    def running(self) -> bool:
        """Its rank process runs: its ``main``, or its exit work."""
        return self in (RankPhase.STARTED, RankPhase.RETURNED)

    @property
    def over(self) -> bool:
        """Its agent reported how the rank ended, or is lost: nothing more of it counts."""
        return self in OVER

    def may_become(self, phase: RankPhase) -> bool:
        return phase in _NEXT[self]


OVER = frozenset({RankPhase.ENDED, RankPhase.FAILED, RankPhase.LOST})
_NEXT = {
    RankPhase.WAITING: {RankPhase.STARTED, *OVER},
    RankPhase.STARTED: {RankPhase.RETURNED, *OVER},
    RankPhase.RETURNED: set(OVER),
    **{phase: set() for phase in OVER},
}
