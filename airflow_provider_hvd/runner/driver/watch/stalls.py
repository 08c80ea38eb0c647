"""Stalls (runs in the driver): the stall clock and asking the ranks for their stacks (where each rank was, in
words: :mod:`..verdict.stacks`).

The clock runs on what the ranks do. Each agent watches its rank: every line of output (whatever the
verbosity, except Horovod's own stall warning) and every message on its control pipe (``log_to_driver``,
reported metrics and checkpoints, its result) counts; while there is any, it sends a bare
:class:`...shared.messages.RankState` every so often (:mod:`...agent.activity`), which sets its connection's
``last_active`` (and starting the rank does). When no running rank has been
active for ``stall_timeout`` seconds, the driver asks every running rank for its Python stacks
(:class:`...shared.messages.DumpStacks`), waits for the answers (at most :data:`STACKS_WAIT_S`), and the run
ends with :class:`~...errors.RunStalledError`, naming each rank and where it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...shared.timing import STACKS_WAIT_S
from ..events import Stalled, StalledRank

if TYPE_CHECKING:
    from .channel import AgentConnection

_POLL_S = 0.05


def activity_period(stall_timeout: float) -> float:
    """How often an agent reports its rank's activity: the stall clock is off by at most a tenth of the timeout."""
    return min(10.0, max(0.5, stall_timeout / 10))


# asking for stacks


def ask_for_stacks(conns: Sequence[AgentConnection]) -> None:
    for conn in conns:
        conn.dump_stacks()


def answers(conns: Sequence[AgentConnection], now: float) -> tuple[StalledRank, ...]:
    """Each connection's answer so far (a missing one says so)."""
    found = []
    for conn in conns:
        answer = conn.stacks_answer
        found.append(
            StalledRank(
                conn.rank,  # type: ignore[arg-type]
                max(0.0, now - conn.last_active),
                answer.stacks if answer else None,
                answer.no_stacks if answer else f"its agent did not answer within {STACKS_WAIT_S:.0f}s",
            )
        )
    return tuple(found)


def collect_stacks(conns: Sequence[AgentConnection]) -> tuple[StalledRank, ...]:
    """Ask every connection's rank for its stacks and wait for the answers (at most :data:`STACKS_WAIT_S`)."""
    asked_at = time.monotonic()
    ask_for_stacks(conns)
    while time.monotonic() - asked_at < STACKS_WAIT_S and not all(conn.stacks_answer or conn.done for conn in conns):
        time.sleep(_POLL_S)
    return answers(conns, asked_at)


class StallWatch:
    """The stall clock of one run; :meth:`check` is called from the supervisor's loop."""

    def __init__(self, stall_timeout: float) -> None:
        self.timeout = stall_timeout
        self._asked: list[AgentConnection] | None = None
        self._asked_at = 0.0

    def check(self, running: Sequence[AgentConnection], now: float) -> Stalled | None:
        """The Stalled event once the ranks quiet for ``timeout`` have answered with their stacks (or not in time)."""
        if self._asked is None:
            if running and now - max(conn.last_active for conn in running) >= self.timeout:
                self._asked, self._asked_at = list(running), now
                ask_for_stacks(self._asked)
            return None
        if now - self._asked_at < STACKS_WAIT_S and not all(conn.stacks_answer or conn.done for conn in self._asked):
            return None
        return Stalled(self.timeout, answers(self._asked, self._asked_at))
