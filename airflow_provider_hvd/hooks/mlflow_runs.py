"""One MLflow run per try of a training task: the operator's ``mlflow=``, the Airflow tags, and each try's run (a
durable task's retry that attaches to the run an earlier try submitted goes on with that run's MLflow run).

The run of a try is recorded in the task state store under ``hvd_mlflow`` (``{"run_id", "url", "try_number"}``)
as soon as it is created. The next try reads it and hands it to the runner as ``previous_run_id``: its own run
is tagged ``hvd.previous_run_id`` with it, and a run that is still RUNNING there (its try was killed hard, with
no chance to end it) is ended KILLED.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_hvd.runner.mlflow_settings import (
    TRACKING_URI_ENV,
    MlflowSettings,
    credentials,
    mlflow_option,
    mlflow_settings,
)

if TYPE_CHECKING:
    from airflow_provider_hvd.hooks.task_state import StateStore

MLFLOW_KEY = "hvd_mlflow"

log = logging.getLogger(__name__)


def mask_credentials(option: Mapping[str, Any] | None) -> None:
    """Have Airflow mask MLflow's credentials wherever they would show (the task log, the rendered fields): the
    password of ``mlflow=``'s tracking URI (else of ``MLFLOW_TRACKING_URI``), MLflow's password and token."""
    if option is None:
        return
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover - older task SDKs
        return
    uri = option.get("tracking_uri") or os.environ.get(TRACKING_URI_ENV)
    for secret in credentials(uri if isinstance(uri, str) else None):
        mask_secret(secret)


def airflow_tags(dag_id: str, task_id: str, run_id: str, try_number: int | None, map_index: int) -> dict[str, str]:
    """The tags that say which task instance and try a run belongs to."""
    return {
        "airflow.dag_id": dag_id,
        "airflow.task_id": task_id,
        "airflow.run_id": run_id,
        "airflow.try_number": str(try_number),
        "airflow.map_index": str(map_index),
    }


def earlier_run_id(store: StateStore | None, try_number: int | None) -> str | None:
    """The MLflow run of an earlier try of this task instance, recorded in its task state store, or None."""
    if store is None:
        return None
    try:
        record = store.get(MLFLOW_KEY)
    except Exception as exc:  # noqa: BLE001 - the link to the earlier run is worth a warning, not a failed task
        log.warning("Could not read the earlier try's MLflow run from the task state store (%r): not linked", exc)
        return None
    if record is None:
        return None
    if not isinstance(record, Mapping) or not isinstance(record.get("run_id"), str):
        log.warning("The task state store's %r is not an MLflow run (%r): not linked", MLFLOW_KEY, record)
        return None
    if record.get("try_number") == try_number:  # this very try's (a value left by another run of the same try)
        return None
    return str(record["run_id"])


def record_run(store: StateStore, run_id: str, url: str | None, try_number: int | None) -> None:
    """Record a try's MLflow run under :data:`MLFLOW_KEY` (the Training tab's link, the next try's
    ``previous_run_id``); never raises."""
    try:
        store.set(MLFLOW_KEY, {"run_id": run_id, "url": url, "try_number": try_number})
    except Exception as exc:  # noqa: BLE001 - whatever the store raises, the training goes on
        log.warning(
            "Could not record MLflow run %s as %r (%r): the Training tab and the next try's run will not link to it",
            run_id,
            MLFLOW_KEY,
            exc,
        )


class TryMlflowRun:
    """The MLflow run of one try: its settings for the runner, and where it is recorded once created.

    :param option: ``mlflow=`` as :func:`~airflow_provider_hvd.runner.mlflow_settings.mlflow_option` returns it
        (not None).
    :param store: the task state store (None before Airflow 3.3: no link to the earlier try then).
    :param publish: called with the run's URL once it is created (the operator's link, while the try runs).
    """

    def __init__(
        self,
        option: Mapping[str, Any],
        *,
        dag_id: str,
        task_id: str,
        run_id: str,
        try_number: int | None,
        map_index: int,
        store: StateStore | None,
        publish: Callable[[str], None] | None = None,
    ) -> None:
        mlflow_option(option)  # as rendered
        mask_credentials(option)
        self._settings = mlflow_settings(dict(option)) or MlflowSettings()
        self.tags = {**self._settings.tags, **airflow_tags(dag_id, task_id, run_id, try_number, map_index)}
        self.run_name = self._settings.run_name or f"{dag_id}.{task_id}" + (f"[{map_index}]" if map_index >= 0 else "")
        self.try_number = try_number
        self._store = store
        self._publish = publish
        self.previous_run_id = earlier_run_id(store, try_number)
        self.run_id: str | None = None
        self.url: str | None = None

    def settings(self) -> MlflowSettings:
        """The runner's ``mlflow=``: :meth:`started` is its ``on_start``."""
        return dataclasses.replace(
            self._settings,
            run_name=self.run_name,
            tags=self.tags,
            previous_run_id=self.previous_run_id,
            on_start=self.started,
        )

    def started(self, run_id: str, url: str | None) -> None:
        """The runner's ``on_start``, or an attached run's MLflow run: record it for the next try, publish its link
        (never raises)."""
        self.run_id, self.url = run_id, url
        if run_id == self.previous_run_id:  # the run an earlier try submitted, attached to: still its one MLflow run
            log.info("Try %s goes on with MLflow run %s%s", self.try_number, run_id, f" at {url}" if url else "")
        elif self.previous_run_id:  # (the runner logs the run's URL)
            log.info(
                "MLflow run %s of try %s follows the earlier try's run %s",
                run_id,
                self.try_number,
                self.previous_run_id,
            )
        if self._store is not None:
            record_run(self._store, run_id, url, self.try_number)
        if self._publish is not None and url:
            try:
                self._publish(url)
            except Exception as exc:  # noqa: BLE001 - the link comes at the try's end anyway
                log.warning("Could not publish the MLflow run's link while the task runs (%r)", exc)
