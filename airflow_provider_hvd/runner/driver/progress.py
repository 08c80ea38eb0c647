"""A run's progress on the driver: a bounded history of one rank's metrics and the last checkpoint reported.

Ranks report with ``log_metrics`` and ``report_checkpoint`` (:mod:`..rank.progress`); the channel's loop hands
each report here (:meth:`RunProgress.take`). A :class:`ProgressSink` (the Airflow layer's task state store)
gets a snapshot at most once every ``interval_s`` while the run goes on (:meth:`RunProgress.tick`, from the
supervisor's thread) and the last one at the end (:meth:`RunProgress.flush`).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from ..rank.progress import LAST_CHECKPOINT_ENV, RESERVED_INFO
from ..shared.messages import Checkpoint, Message, Metrics

log = logging.getLogger("airflow_provider_hvd.runner")

MAX_POINTS = 1000  # per metric, kept on the driver
MAX_METRICS = 64  # names kept; more are counted, not kept
SNAPSHOT_MAX_BYTES = 60_000  # a snapshot as JSON: under the task state store's 65,535-byte values
FORMAT_VERSION = 1

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


class ProgressSink(Protocol):
    """Where a run's progress goes while it runs (the Airflow layer writes it to the task state store).

    A sink may have a ``max_bytes`` attribute: the most a metrics snapshot may take as JSON (default 60,000).
    """

    def metrics(self, snapshot: dict[str, Any]) -> None:
        """The metrics history so far (:meth:`MetricsHistory.snapshot`), at most once every few seconds."""

    def checkpoint(self, record: dict[str, Any]) -> None:
        """The last checkpoint reported: ``{"path", **info, "rank", "reported_at"}``."""


def checkpoint_record(rank: int | None, message: Checkpoint) -> dict[str, Any]:
    return {"path": message.path, **message.info, "rank": rank, "reported_at": _utc(message.time)}


def describe_checkpoint(record: Mapping[str, Any]) -> str:
    """``/ckpt/epoch-3.pt (epoch=3), reported by try 1``: for the log."""
    info = {key: value for key, value in record.items() if key not in RESERVED_INFO}
    text = str(record.get("path"))
    if info:
        text += " (" + ", ".join(f"{key}={value}" for key, value in info.items()) + ")"
    if record.get("try_number") is not None:
        text += f", reported by try {record['try_number']}"
    return text


def resume_value(resume_from: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """``HorovodRunner(resume_from=...)`` as the dict ``last_checkpoint()`` returns (a str is a path)."""
    if resume_from is None:
        return None
    if isinstance(resume_from, str):
        resume_from = {"path": resume_from}
    if not isinstance(resume_from, Mapping) or not isinstance(resume_from.get("path"), str):
        raise TypeError(
            "resume_from must be None, a checkpoint's path, or a dict with a 'path' (e.g. a runner's .checkpoint), "
            f"not {resume_from!r}"
        )
    value = {"try_number": None, **resume_from}
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"resume_from must be JSON data (it travels to every rank): {exc}") from None
    return value


class RunProgress:
    """One run's progress: the metrics history of ``rank``, the last checkpoint, and their writes to ``sink``."""

    def __init__(
        self,
        rank: int = 0,
        sink: ProgressSink | None = None,
        interval_s: float = 5.0,
        resume_from: dict[str, Any] | None = None,
    ) -> None:
        self.rank = rank
        self.history = MetricsHistory()
        self.checkpoint: dict[str, Any] | None = None
        self.resume_from = resume_from
        self._sink = sink
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._metrics_dirty = False
        self._checkpoint_dirty = False
        self._written_at = {"metrics": float("-inf"), "checkpoint": float("-inf")}
        self._sink_failed = False

    def rank_env(self) -> dict[str, str]:
        """What the ranks' environment gets: the checkpoint they resume from."""
        return {LAST_CHECKPOINT_ENV: json.dumps(self.resume_from)} if self.resume_from else {}

    def take(self, rank: int | None, message: Message) -> None:
        """A rank's report (the channel's thread); never raises: a bad report must not cut the agent off."""
        try:
            if isinstance(message, Metrics):
                if rank == self.rank:
                    with self._lock:
                        self.history.add(message.step, message.values, message.time)
                        self._metrics_dirty = True
            elif isinstance(message, Checkpoint):
                record = checkpoint_record(rank, message)
                with self._lock:
                    self.checkpoint = record
                    self._checkpoint_dirty = True
                log.info("HorovodRunner: rank %s reported the checkpoint %s", rank, describe_checkpoint(record))
        except Exception:  # noqa: BLE001
            log.exception("HorovodRunner: could not take a progress report of rank %s", rank)

    def tick(self) -> None:
        """Write to the sink what changed, each key at most once every ``interval_s`` (the supervisor's loop)."""
        self._write(force=False)

    def flush(self) -> None:
        """Write what is left (the run ended)."""
        self._write(force=True)

    def _write(self, force: bool) -> None:
        if self._sink is None:
            return
        now = time.monotonic()

        def due(key: str) -> bool:
            return force or now - self._written_at[key] >= self._interval_s

        with self._lock:
            checkpoint = (
                dict(self.checkpoint) if self.checkpoint and self._checkpoint_dirty and due("checkpoint") else None
            )
            max_bytes = getattr(self._sink, "max_bytes", SNAPSHOT_MAX_BYTES)
            snapshot = (
                self.history.snapshot(max_bytes, rank=self.rank) if self._metrics_dirty and due("metrics") else None
            )
            if checkpoint is not None:
                self._checkpoint_dirty, self._written_at["checkpoint"] = False, now
            if snapshot is not None:
                self._metrics_dirty, self._written_at["metrics"] = False, now
        # the checkpoint first: a run that fails right after reporting one must leave it behind
        for write, value in ((self._sink.checkpoint, checkpoint), (self._sink.metrics, snapshot)):
            if value is None:
                continue
            try:
                write(value)
            except Exception as exc:  # noqa: BLE001 - progress is best effort: the training goes on
                if not self._sink_failed:
                    log.warning("HorovodRunner: could not record the run's progress: %r", exc, exc_info=True)
                self._sink_failed = True
