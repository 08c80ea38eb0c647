"""The run above its attempts: one attempt at a time (a launcher and a supervisor each), a new one after a failure
that the policy says a new attempt can get past (``max_restarts``, :mod:`.policy`).

The :class:`~..watch.supervisor.Supervisor` stays one attempt's policy: its outcome and its cause. What lasts
across attempts is here or handed in: the run's progress (its metrics history and the latest checkpoint, which
the next attempt's ranks resume from: :meth:`~..tracking.progress.RunProgress.resume_point`), its MLflow run (the
caller's, fed by each supervisor), the cancel flag, and the record of each attempt. Each attempt's supervisor
ends every rank, its launch (processes, Spark job, shard files, the job's broadcast) and its rendezvous before
it returns or raises: nothing of an attempt is left when the next starts. The controller runs on the caller's
thread and starts none of its own.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import HorovodRunnerError, RunCancelledError
from ...settings import describe_checkpoint
from ...shared.wire import Body
from ..tracking.progress import RunProgress
from .policy import RestartPolicy

log = logging.getLogger("airflow_provider_hvd.runner")


class AttemptsListener(Protocol):
    """What hears the record of each attempt, as each attempt starts and ends (the run's progress, its MLflow
    run)."""

    def take_attempts(self, records: list[dict[str, Any]]) -> None:
        """The record of each attempt so far (:meth:`AttemptRecord.as_dict`), the current one last."""


class Attempt(Protocol):
    """One attempt of the run: what the controller asks of its :class:`~..watch.supervisor.Supervisor`."""

    size: int

    def run_raw(self) -> Body:
        """Run the attempt to its end: rank 0's pickled value, or the error naming the attempt's cause."""

    def status(self) -> tuple[str, int]:
        """The attempt's phase and how many agents have said hello, from any thread."""


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@dataclass
class AttemptRecord:
    """One attempt: its number (from 1), its ranks, when it ran, the checkpoint it resumed from, how it ended."""

    number: int
    started_at: float  # time.time()
    resumed_from: dict[str, Any] | None
    size: int | None = None  # its ranks (None: it failed before its launch was made)
    ended_at: float | None = None
    cause_kind: str | None = None  # (CauseKind's value) None while it runs, and when it succeeded
    cause: str | None = None  # the first line of its error

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON data (``HorovodRunner.attempts``, a progress sink's ``restarts``)."""
        return {
            "attempt": self.number,
            "size": self.size,
            "started_at": _utc(self.started_at),
            "ended_at": None if self.ended_at is None else _utc(self.ended_at),
            "cause_kind": self.cause_kind,
            "cause": self.cause,
            "resumed_from": self.resumed_from,
        }

    def line(self) -> str:
        """The attempt in one line, for the run's error."""
        start = "from the start" if self.resumed_from is None else f"from {describe_checkpoint(self.resumed_from)}"
        ranks = "" if self.size is None else f"{self.size} ranks, "
        end = "succeeded" if self.ended_at is not None and self.cause is None else f"{self.cause} [{self.cause_kind}]"
        return f"attempt {self.number} ({ranks}{start}): {end}"


class RunController:
    """Runs attempts made by ``start_attempt(number)`` until one succeeds, the policy says no new one can get past
    the last one's cause, the budget is spent, or ``cancelled()``; ``progress`` lasts across them. ``progress``
    and ``listeners`` hear the record of each attempt as each one starts (its size known) and ends."""

    def __init__(
        self,
        start_attempt: Callable[[int], Attempt],
        progress: RunProgress,
        policy: RestartPolicy,
        cancelled: Callable[[], bool],
        runner: str,
        listeners: Sequence[AttemptsListener] = (),
    ) -> None:
        self._start_attempt = start_attempt
        self._progress = progress
        self._listeners: list[AttemptsListener] = [progress, *listeners]
        self._policy = policy
        self._cancelled = cancelled
        self._runner = runner
        self.records: list[AttemptRecord] = []
        self._current: Attempt | None = None

    def status(self) -> tuple[str, int, int]:
        """The current attempt's phase, how many of its agents have said hello, and its number, from any thread."""
        current, number = self._current, len(self.records)
        phase, started = current.status() if current is not None else ("starting", 0)
        return phase, started, max(1, number)

    def attempts(self) -> list[dict[str, Any]]:
        """The record of each attempt so far, as JSON data."""
        return [record.as_dict() for record in self.records]

    def run_raw(self) -> Body:
        """Rank 0's value (still pickled) from the attempt that succeeded; else the last attempt's error, its
        message saying, where the run could restart, why it did not and how each attempt ended."""
        while True:
            record = AttemptRecord(len(self.records) + 1, time.time(), self._progress.resume_point())
            self.records.append(record)
            try:
                self._current = attempt = self._start_attempt(record.number)
                record.size = attempt.size
                self._tell_listeners()
                body = attempt.run_raw()
            except HorovodRunnerError as error:
                self._ended(record, error)
                error.attempts = self.attempts()
                why_not = self._why_not(error)
                if why_not is not None:
                    self._tell(error, why_not)
                    raise
                self._restart(error)
                continue
            except BaseException as error:  # an interrupt (Ctrl-C, Airflow's timeout): the run ends with it
                self._ended(record, error)
                raise
            self._ended(record, None)
            return body

    def _ended(self, record: AttemptRecord, error: BaseException | None) -> None:
        record.ended_at = time.time()
        if error is not None:
            kind = getattr(error, "cause_kind", None)
            record.cause_kind, record.cause = (kind.value if kind is not None else None), _first_line(error)
        self._tell_listeners()
        self._current = None

    def _tell_listeners(self) -> None:
        records = self.attempts()
        for listener in self._listeners:
            listener.take_attempts(records)

    def _why_not(self, error: HorovodRunnerError) -> str | None:
        """Why the run does not restart after ``error``; None when it does."""
        why = self._policy.why_not(error)
        if why is None and len(self.records) > self._policy.max_restarts:
            why = f"its {self._policy.max_restarts} restart(s) are spent (max_restarts={self._policy.max_restarts})"
        return why

    def _tell(self, error: HorovodRunnerError, why_not: str) -> None:
        """Put in ``error``'s message, after its first line, why the run did not restart and how each attempt
        ended (not for a run without ``max_restarts``: its error stays as it always was)."""
        if self._policy.max_restarts == 0:
            return
        if len(self.records) == 1:
            note = f"Not restarted (max_restarts={self._policy.max_restarts}): {why_not}."
        else:
            attempts = [f"  {record.line()}" for record in self.records]
            note = "\n".join([f"Not restarted: {why_not}. {len(self.records)} attempts ran:", *attempts])
        first, newline, rest = str(error).partition("\n")
        error.args = (f"{first}\n{note}{newline}{rest}", *error.args[1:])

    def _restart(self, error: HorovodRunnerError) -> None:
        """Say the restart (and what it resumes from); a cancel that came meanwhile ends the run here."""
        point = self._progress.resume_point()
        resume = f"resuming from {describe_checkpoint(point)}" if point else "starting afresh (no checkpoint reported)"
        restarts = len(self.records)
        log.warning(
            "%s: restart %d of %d after %s: %s",
            self._runner,
            restarts,
            self._policy.max_restarts,
            _first_line(error),
            resume,
        )
        if self._cancelled():
            cancelled = RunCancelledError(
                f"{self._runner}: the run was cancelled between attempts: attempt {restarts} had ended "
                f"({_first_line(error)}), and no attempt {restarts + 1} started; every rank was ended"
            )
            cancelled.attempts = self.attempts()
            raise cancelled from error


class KeptJob:
    """The pickled job, for each attempt's supervisor: kept for the next attempts only where the run may restart
    (else the first attempt's launcher has the one copy)."""

    def __init__(self, payload: bytes, keep: bool) -> None:
        self._payload: bytes | None = payload
        self._keep = keep

    def take(self) -> bytes:
        payload = self._payload
        assert payload is not None, "a run without max_restarts has one attempt"
        if not self._keep:
            self._payload = None
        return payload
