"""TrainingJobTrigger: a deferred training task's link to its run, held in the triggerer while the run trains.

The operator submits the run (over Spark Connect, where it outlives the task) and defers; this trigger attaches
as a watcher: the ranks' lines go to the task log, the progress and the MLflow run to the Training tab, and
once the run ended it fires, leaving the run's outcome on its host for the task, resumed on a worker, to fetch.
A user's mark-failed or clear of the deferred task ends the run (:meth:`on_kill`), as does the deferral's timeout
(what is left of the task's ``execution_timeout``: :meth:`cleanup`); a triggerer that restarts attaches again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_hvd.hooks.horovod import HorovodHook
from airflow_provider_hvd.hooks.mlflow_runs import record_run
from airflow_provider_hvd.hooks.task_state import TaskStateProgress
from airflow_provider_hvd.runner import Job, JobNotFoundError


class XComStore:
    """The deferred task's XComs as the task state store that :class:`TaskStateProgress` writes (a trigger has no
    task state store): the Training tab reads them while the task is deferred; the task, resumed, writes the
    run's last progress to the store itself."""

    def __init__(self, ti: Any) -> None:
        self._where = {
            "dag_id": ti.dag_id,
            "task_id": ti.task_id,
            "run_id": ti.run_id,
            "map_index": ti.map_index if ti.map_index is not None else -1,
        }

    def get(self, key: str, default: Any = None) -> Any:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_one(key=key, **self._where)
        return default if value is None else value

    def set(self, key: str, value: Any) -> None:
        from airflow.sdk.execution_time.xcom import XCom

        XCom.set(key, value, **self._where)


class TrainingJobTrigger(BaseTrigger):
    """Watches a submitted run (``job_id``, on the ``spark_connect`` connection ``conn_id``) until it ended.

    :param job_id: the run's id (``job.id``).
    :param conn_id: the connection the run was submitted on (its token, where it has one, attaches).
    :param deadline: when the task's ``execution_timeout`` is over (a POSIX timestamp; None: never): the deferral
        times out then, and the triggerer drops the trigger without ``on_kill()``; its ``cleanup()`` past the
        deadline ends the run.

    Its event: ``job_id``, ``outcome`` (``"succeeded"``, ``"failed"``, or ``"gone"``: nothing of the run was left
    to attach to) and ``cause`` (the first line of the run's error, or why it is gone).
    """

    def __init__(self, job_id: str, conn_id: str, deadline: float | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.job_id = job_id
        self.conn_id = conn_id
        self.deadline = deadline
        self._job: Job | None = None
        self._ended = False  # the run ended (or is gone): nothing of it to end any more

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.{type(self).__name__}", {
            "job_id": self.job_id,
            "conn_id": self.conn_id,
            "deadline": self.deadline,
        }

    def _attach(self, logs: bool) -> Job:
        ti = self.task_instance
        if not logs or ti is None:
            return HorovodHook(self.conn_id).attach_job(self.job_id, logs=logs, fetch=False)
        store, try_number = XComStore(ti), ti.try_number
        return HorovodHook(self.conn_id).attach_job(
            self.job_id,
            TaskStateProgress(store, try_number),
            fetch=False,
            on_mlflow_run=lambda run_id, url: record_run(store, run_id, url, try_number),  # (the tab's link)
        )

    def _event(self, outcome: str, cause: str | None) -> TriggerEvent:
        self._ended = True
        return TriggerEvent({"job_id": self.job_id, "outcome": outcome, "cause": cause})  # type: ignore[no-untyped-call]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            self._job = await asyncio.to_thread(self._attach, True)  # (a thread keeps the log context)
        except JobNotFoundError as exc:  # the task, resumed, says so
            yield self._event("gone", str(exc))
            return
        status = await asyncio.to_thread(self._job.watch)
        yield self._event("succeeded" if status.cause is None else "failed", status.cause)

    async def on_kill(self) -> None:
        """The deferred task was marked failed or success, or cleared: end every rank (within seconds)."""
        await self._cancel()

    async def _cancel(self) -> None:
        job = self._job
        if job is None:
            job = self._job = await asyncio.to_thread(self._attach, False)
        await asyncio.to_thread(job.cancel)

    async def cleanup(self) -> None:
        """Detach (the run goes on: a restarted triggerer attaches again); past the ``deadline``, the deferral
        timed out (Airflow calls no ``on_kill()`` then): end the run."""
        if self.deadline is not None and time.time() >= self.deadline and not self._ended:
            self.log.warning("The task's execution_timeout has passed while it was deferred: ending the run")
            with contextlib.suppress(JobNotFoundError):  # (gone already)
                await self._cancel()
        if self._job is not None:
            self._job.close()
