"""A run's progress in Airflow's task state store: the keys, their size bounds, and the sink that writes them.

The task state store (Airflow 3.3, ``context["task_state_store"]``) belongs to one task instance across all
its tries, so a retry finds there what the try before it left: the last checkpoint. Values are JSON, at most
65,535 bytes (``[state_store] max_value_storage_bytes``).

- ``hvd_metrics``: the metrics history of rank 0 (``log_metrics``), written at most once every
  ``HorovodRunner.progress_interval_s`` (5 s) while the run goes on, and at its end. At most 60,000 bytes:
  curves are thinned evenly (every 2nd, 4th... point, always with the last) to fit.
- ``hvd_checkpoint``: the last checkpoint reported (``report_checkpoint``), with the try that reported it.
  At most about 9 KB (the info is at most 8 KB). Once a try succeeds, it is marked ``"finished": true`` (also
  when that try reported no checkpoint of its own): a later try (the task cleared and run again) starts afresh
  instead of resuming from it.
- ``hvd_restarts``: a try's run that restarted (``max_restarts``): the record of each of its attempts (number,
  ranks, start and end, the kind and first line of its cause, the checkpoint it resumed from, the first step the
  metrics rank reported in it), written as each attempt starts and ends, with the try. Bounded like the metrics:
  a long cause or checkpoint info is cut, and where the attempts do not fit, the first and the latest are kept
  (``left_out`` counts those between).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

METRICS_KEY = "hvd_metrics"
CHECKPOINT_KEY = "hvd_checkpoint"
RESTARTS_KEY = "hvd_restarts"
RESTARTS_FORMAT = 1
_CAUSE_CHARS = 500  # an attempt's cause, at most, in hvd_restarts
_CHECKPOINT_BYTES = 1000  # the checkpoint an attempt resumed from, at most as JSON: else its path alone

log = logging.getLogger(__name__)


class StateStore(Protocol):
    """What this module uses of Airflow's task state store."""

    def get(self, key: str, default: Any = None) -> Any: ...
    def set(self, key: str, value: Any) -> None: ...


class TaskStateProgress:
    """A :class:`~airflow_provider_hvd.runner.settings.ProgressSink` on the task state store of one try."""

    def __init__(self, store: StateStore, try_number: int | None) -> None:
        self._store = store
        self.try_number = try_number
        self.max_bytes = snapshot_budget()

    def metrics(self, snapshot: dict[str, Any]) -> None:
        self._store.set(METRICS_KEY, {**snapshot, "try_number": self.try_number})

    def checkpoint(self, record: dict[str, Any]) -> None:
        self._store.set(CHECKPOINT_KEY, {**record, "try_number": self.try_number})

    def restarts(self, records: list[dict[str, Any]]) -> None:
        """The run restarted: the record of each attempt so far (:func:`restarts_value`)."""
        self._store.set(RESTARTS_KEY, restarts_value(records, self.try_number, self.max_bytes))

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint an earlier try left, or None (a value that is not one is ignored, with a warning)."""
        value = self._store.get(CHECKPOINT_KEY)
        if value is None:
            return None
        if not isinstance(value, Mapping) or not isinstance(value.get("path"), str):
            log.warning("The task state store's %r is not a checkpoint (%r): starting afresh", CHECKPOINT_KEY, value)
            return None
        if value.get("finished"):
            log.info("The last checkpoint, %s, is of a try that finished: starting afresh", value.get("path"))
            return None
        return dict(value)

    def mark_finished(self, record: dict[str, Any] | None) -> None:
        """The run succeeded: its last checkpoint is not to be resumed from, whether this try reported it
        (``record``: ``HorovodRunner.checkpoint``) or an earlier one (this try resumed and reported none).

        Never raises: the training succeeded, so a store that fails here is a warning, not a failed task.
        """
        try:
            if record is not None:
                self._store.set(CHECKPOINT_KEY, {**record, "try_number": self.try_number, "finished": True})
                return
            stored = self._store.get(CHECKPOINT_KEY)
            if isinstance(stored, Mapping) and isinstance(stored.get("path"), str) and not stored.get("finished"):
                self._store.set(CHECKPOINT_KEY, {**stored, "finished": True})  # with the try that reported it
        except Exception as exc:  # noqa: BLE001 - whatever the store raises, the task succeeded
            log.warning(
                "The run succeeded, but its checkpoint could not be marked finished in the task state store (%r): "
                "if this task is cleared and run again, it resumes from that checkpoint instead of starting afresh",
                exc,
            )


def snapshot_budget() -> int:
    """The most a metrics snapshot may take: 60,000 bytes, less where ``max_value_storage_bytes`` is lower."""
    from airflow.configuration import conf

    from airflow_provider_hvd.runner.settings import SNAPSHOT_MAX_BYTES

    limit = conf.getint("state_store", "max_value_storage_bytes", fallback=65535)
    return SNAPSHOT_MAX_BYTES if limit <= 0 else max(1000, min(SNAPSHOT_MAX_BYTES, limit - 500))


def _bounded_attempt(record: Mapping[str, Any]) -> dict[str, Any]:
    """An attempt's record with its cause and the checkpoint it resumed from bounded."""
    cause, point = record.get("cause"), record.get("resumed_from")
    if isinstance(point, Mapping) and len(json.dumps(point, default=str)) > _CHECKPOINT_BYTES:
        point = {"path": str(point.get("path"))[: _CHECKPOINT_BYTES // 2], "info_left_out": True}
    return {**record, "cause": None if cause is None else str(cause)[:_CAUSE_CHARS], "resumed_from": point}


def restarts_value(records: list[dict[str, Any]], try_number: int | None, max_bytes: int) -> dict[str, Any]:
    """What ``hvd_restarts`` holds: ``{"format", "try_number", "restarts", "attempts", "left_out"}``, at most
    ``max_bytes`` as JSON; where the attempts do not fit, those after the first go, oldest first."""
    attempts = [_bounded_attempt(record) for record in records]
    value: dict[str, Any] = {
        "format": RESTARTS_FORMAT,
        "try_number": try_number,
        "restarts": max(0, len(records) - 1),
        "attempts": [],
        "left_out": len(records),
    }
    sizes = [len(json.dumps(attempt, default=str)) + 2 for attempt in attempts]  # (", " between two)
    total, keep_from = len(json.dumps(value, default=str)) + sum(sizes), 1
    while total > max_bytes and keep_from < len(attempts) - 1:
        total -= sizes[keep_from]
        keep_from += 1
    value["attempts"], value["left_out"] = attempts[:1] + attempts[keep_from:], keep_from - 1
    return value
