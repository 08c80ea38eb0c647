"""A run's progress on the driver: a bounded history of one rank's metrics and the last checkpoint reported.

Ranks report with ``log_metrics`` and ``report_checkpoint`` (:mod:`...rank.progress`); the channel's loop hands
each report here (:meth:`RunProgress.take`). A :class:`ProgressSink` (the Airflow layer's task state store)
gets a snapshot at most once every ``interval_s`` while the run goes on and the last one at the end
(:meth:`RunProgress.flush`). The writes happen on their own thread, ``hvd-progress-writer``, so that a store
that hangs never holds up the supervisor (abort, cancel, stall and start checks) nor the run's outcome for
more than ``FINAL_WRITE_S``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from ...rank.progress import LAST_CHECKPOINT_ENV
from ...settings import SNAPSHOT_MAX_BYTES, ProgressSink, describe_checkpoint
from ...shared.messages import Checkpoint, Message, Metrics
from ...shared.naming import HOROVOD_RUNNER
from ...shared.timing import FINAL_WRITE_S
from .writer import BoundedWriter

log = logging.getLogger("airflow_provider_hvd.runner")

MAX_POINTS = 1000  # per metric, kept on the driver
MAX_METRICS = 64  # names kept; more are counted, not kept
FORMAT_VERSION = 1

# The write worker's timings. A write that fails stays due and is tried again RETRY_FIRST_S later, then after
# twice as long each time up to RETRY_MAX_S: a store briefly unreachable gets the value moments later, one down
# for long is not hammered. At the run's end (flush) what is still due is tried once more, at once; the run's
# outcome waits at most FINAL_WRITE_S on the sink (Airflow's client retries for minutes while the API server is
# unreachable), then the write in progress is abandoned with one warning.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0

Point = tuple[float, float | None]


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")


def _every(points: list[Point], k: int) -> list[Point]:
    """Every ``k``-th point, and the last one."""
    if k <= 1 or len(points) <= 2:
        return points
    kept = points[::k]
    return kept if kept[-1] is points[-1] else [*kept, points[-1]]


class MetricSeries:
    """One metric's points, at most ``max_points``: evenly spread over its reports (each time it fills, every
    other point goes and only every ``stride``-th report is kept from then on); the latest one always shows."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max(4, max_points)
        self.kept: list[Point] = []
        self.stride = 1
        self.reports = 0
        self.last: Point | None = None

    def add(self, step: float, value: float | None) -> None:
        point = (step, value)
        if self.reports % self.stride == 0:
            self.kept.append(point)
            if len(self.kept) >= self.max_points:
                self.kept = self.kept[::2]
                self.stride *= 2
        self.reports += 1
        self.last = point

    def points(self) -> list[Point]:
        if self.last is None or (self.kept and self.kept[-1] is self.last):
            return list(self.kept)
        return [*self.kept, self.last]


class MetricsHistory:
    """The metrics one rank reported, per name, bounded in memory (:class:`MetricSeries`)."""

    def __init__(self, max_points: int = MAX_POINTS, max_metrics: int = MAX_METRICS) -> None:
        self.series: dict[str, MetricSeries] = {}
        self.max_points = max_points
        self.max_metrics = max_metrics
        self.reports = 0
        self.ignored_names: set[str] = set()
        self.updated: float | None = None

    def add(self, step: float, values: Mapping[str, float | None], at: float | None = None) -> None:
        for name, value in values.items():
            series = self.series.get(name)
            if series is None:
                if len(self.series) >= self.max_metrics:
                    self.ignored_names.add(name)
                    continue
                series = self.series[name] = MetricSeries(self.max_points)
            series.add(step, value)
        self.reports += 1
        self.updated = at if at is not None else time.time()

    def as_dict(self) -> dict[str, list[Point]]:
        """``{"loss": [(step, value), ...], ...}``; a value is None where the rank reported NaN or infinity."""
        return {name: series.points() for name, series in self.series.items()}

    def snapshot(self, max_bytes: int = SNAPSHOT_MAX_BYTES, **extra: Any) -> dict[str, Any]:
        """The history as JSON data of at most ``max_bytes`` (``json.dumps`` with its default separators).

        Values are rounded to 6 significant digits; past the bound, each curve keeps every 2nd, 4th, ...
        point (and its last), and where even that is too large, the curves that do not fit are left out
        (named in ``"left_out"``).
        """
        full = {name: [[step, _round(value)] for step, value in points] for name, points in self.as_dict().items()}
        value: dict[str, Any] = {
            "format": FORMAT_VERSION,
            **extra,
            "reports": self.reports,
            "updated": _utc(self.updated) if self.updated else None,
            "series": full,
            "thinned_by": 1,
            "left_out": sorted(self.ignored_names),
        }
        k = 1
        while len(json.dumps(value)) > max_bytes:
            longest = max((len(points) for points in full.values()), default=0)
            if longest <= 2:
                break
            k *= 2
            value["series"] = {name: _every(points, k) for name, points in full.items()}  # type: ignore[arg-type]
            value["thinned_by"] = k
        while len(json.dumps(value)) > max_bytes and value["series"]:
            name = next(reversed(value["series"]))
            del value["series"][name]
            value["left_out"] = sorted({*value["left_out"], name})
        if len(json.dumps(value)) > max_bytes:
            value["left_out"] = [*value["left_out"][:10], "..."]
        return value


def checkpoint_record(rank: int | None, message: Checkpoint) -> dict[str, Any]:
    return {"path": message.path, **message.info, "rank": rank, "reported_at": _utc(message.time)}


@dataclasses.dataclass
class _Due:
    """One key's write state: whether a newer value waits, when it was last tried, when it may be tried again."""

    dirty: bool = False
    tried_at: float = float("-inf")
    retry_at: float = float("-inf")
    failures: int = 0


class RunProgress:
    """One run's progress: the metrics history of ``rank``, the last checkpoint, and their writes to ``sink``.

    The writes go through one bounded writer thread, ``hvd-progress-writer`` (:mod:`.writer`): started by the
    first :meth:`tick`, ended by :meth:`flush`, which has it try what is still due once more and waits for it at
    most ``FINAL_WRITE_S`` (a write hung in the sink then is abandoned; the thread ends when the sink returns).
    """

    def __init__(
        self,
        rank: int = 0,
        sink: ProgressSink | None = None,
        interval_s: float = 5.0,
        resume_from: dict[str, Any] | None = None,
        runner: str = HOROVOD_RUNNER.runner,
    ) -> None:
        self.rank = rank
        self._runner = runner  # the first word of its log lines
        self.history = MetricsHistory()
        self.checkpoint: dict[str, Any] | None = None
        self.resume_from = resume_from
        self._sink = sink
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self.attempts: list[dict[str, Any]] = []  # the record of each attempt (..restarts.controller)
        self._first_steps: dict[int, float] = {}  # each attempt's first metrics step: where it resumed on the curve
        self._due = {"checkpoint": _Due(), "metrics": _Due(), "restarts": _Due()}  # the checkpoint first: _write_due
        self._writer = BoundedWriter(threading.Thread(target=self._write_loop, name="hvd-progress-writer", daemon=True))
        self._flushed = False
        self._writing: str | None = None  # the key whose write is in the sink now
        self._abandoned = False  # flush gave up on the sink: no write starts after that (the run has ended)
        self._warned = False

    def resume_point(self) -> dict[str, Any] | None:
        """The checkpoint the ranks resume from: the latest any attempt of this run reported (``max_restarts``;
        with the sink's ``try_number``, an Airflow task's), else ``resume_from``."""
        with self._lock:
            checkpoint = self.checkpoint
        if checkpoint is None:
            return self.resume_from
        return {**checkpoint, "try_number": getattr(self._sink, "try_number", None)}

    def rank_env(self) -> dict[str, str]:
        """What the ranks' environment gets: the checkpoint they resume from."""
        point = self.resume_point()
        return {LAST_CHECKPOINT_ENV: json.dumps(point)} if point else {}

    def take(self, rank: int | None, message: Message) -> None:
        """A rank's report (the channel's thread); never raises: a bad report must not cut the agent off."""
        try:
            if isinstance(message, Metrics):
                if rank == self.rank:
                    with self._lock:
                        self.history.add(message.step, message.values, message.time)
                        self._due["metrics"].dirty = True
                        attempt = self.attempts[-1]["attempt"] if self.attempts else 1
                        if attempt not in self._first_steps:
                            self._first_steps[attempt] = message.step
                            self._due["restarts"].dirty = self._restarts_due()
            elif isinstance(message, Checkpoint):
                record = checkpoint_record(rank, message)
                with self._lock:
                    self.checkpoint = record
                    self._due["checkpoint"].dirty = True
                log.info("%s: rank %s reported the checkpoint %s", self._runner, rank, describe_checkpoint(record))
        except Exception:  # noqa: BLE001
            log.exception("%s: could not take a progress report of rank %s", self._runner, rank)

    def take_attempts(self, records: list[dict[str, Any]]) -> None:
        """The record of each attempt so far (the run's controller, as each attempt starts and ends); once the run
        has restarted, it goes to a sink that keeps it (its ``restarts``) as the other keys do, each record with
        the first step the metrics rank reported in that attempt (``first_step``, None before its first report)."""
        with self._lock:
            self.attempts = records
            self._due["restarts"].dirty = self._restarts_due()

    def _restarts_due(self) -> bool:
        """Whether the run has restarted and the sink keeps its restarts (under the lock)."""
        return len(self.attempts) > 1 and hasattr(self._sink, "restarts")

    def _restarts(self) -> list[dict[str, Any]]:
        """What a sink's ``restarts`` gets: each attempt's record with its ``first_step`` (under the lock)."""
        return [{**record, "first_step": self._first_steps.get(record["attempt"])} for record in self.attempts]

    def tick(self) -> None:
        """Let the write worker write what changed, each key at most once every ``interval_s`` (the
        supervisor's loop); never waits on the sink."""
        if self._sink is None:
            return
        if not self._writer.closing:
            self._writer.start()
        self._writer.wake()

    def flush(self) -> None:
        """Write what is left (the run ended), waiting at most ``FINAL_WRITE_S`` on the sink; never raises."""
        if self._sink is None:
            return
        with self._lock:
            if self._flushed:
                return
            self._flushed = True
            due = any(due.dirty for due in self._due.values())
        if due:
            self._writer.start()  # (when no tick came: a no-op otherwise)
        if not self._writer.close(FINAL_WRITE_S):  # (no thread starts after it)
            with self._lock:
                left = [key for key, due in self._due.items() if due.dirty or key == self._writing]
                self._abandoned = True
                self._warned = True  # the one warning: nothing more is said of a write that ends later
            log.warning(
                "%s: the run's progress store did not answer within %.0fs of the run's end: gave up "
                "on its write (the run's last %s may not be recorded)",
                self._runner,
                FINAL_WRITE_S,
                " and ".join(left) or "progress",
            )

    def _write_loop(self) -> None:
        writer = self._writer
        while True:
            closing = writer.closing
            with self._lock:
                wait = self._next_due(time.monotonic())
            if closing:
                self._write_due()  # what is left, at once and once: the sink answers now or the run ends without it
                return
            if wait is None or wait > 0:
                writer.wait(wait)
                continue  # closing may have come meanwhile: then what is left is tried once, not twice
            self._write_due()

    def _next_due(self, now: float) -> float | None:
        """Seconds until a key is due (0: now), None when none waits (under the lock)."""
        times = [max(due.tried_at + self._interval_s, due.retry_at) for due in self._due.values() if due.dirty]
        return max(0.0, min(times) - now) if times else None

    def _write_due(self) -> None:
        assert self._sink is not None
        sink = self._sink
        writes = {"checkpoint": sink.checkpoint, "metrics": sink.metrics, "restarts": getattr(sink, "restarts", None)}
        # the checkpoint first: a run that fails right after reporting one must leave it behind
        for key, due in self._due.items():
            now = time.monotonic()
            with self._lock:
                ready = float("-inf") if self._writer.closing else max(due.tried_at + self._interval_s, due.retry_at)
                if self._abandoned:
                    return  # a write after the run's end could overwrite what the caller recorded since
                if not due.dirty or now < ready:
                    continue
                value: Any
                if key == "checkpoint":
                    value = dict(self.checkpoint) if self.checkpoint is not None else None
                elif key == "restarts":
                    value = self._restarts()
                else:
                    max_bytes = getattr(self._sink, "max_bytes", SNAPSHOT_MAX_BYTES)
                    value = self.history.snapshot(max_bytes, rank=self.rank)
                due.dirty, due.tried_at = False, now
            write = writes[key]
            if value is None or write is None:
                continue
            self._writing = key
            try:
                write(value)
            except Exception as exc:  # noqa: BLE001 - progress is best effort: the training goes on
                with self._lock:
                    self._writing = None
                    due.dirty = True  # still due: tried again after the backoff
                    due.failures += 1
                    backoff = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (due.failures - 1))
                    due.retry_at = time.monotonic() + backoff
                    warn, self._warned = not self._warned, True
                if warn:
                    log.warning(
                        "%s: could not record the run's progress (%s): %r; it is tried again "
                        "(every %.0f-%.0fs, and at the run's end), the training goes on",
                        self._runner,
                        key,
                        exc,
                        RETRY_FIRST_S,
                        RETRY_MAX_S,
                        exc_info=True,
                    )
                else:
                    log.debug("%s: could not record the run's %s (try %d): %r", self._runner, key, due.failures, exc)
            else:
                with self._lock:
                    self._writing = None
                    failures, due.failures, due.retry_at = due.failures, 0, float("-inf")
                if failures:
                    log.info("%s: the run's %s is recorded (after %d failed tries)", self._runner, key, failures)
