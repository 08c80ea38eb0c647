"""The client's ``submit()`` over Spark Connect: a Connect session for the run (same server, token and user as
the client's, a fresh session id), its one-task operation that is the run's host (:mod:`.host`), not
reattachable, so that it outlives this process, and the wait (bounded) until the host says where it listens.

The operation runs in ``hvd-durable-operation``: its ``collect()`` returns (or fails, once the host released
the run's session) when the run is over; the run's outcome comes over the link, never from it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import LaunchError, RunCancelledError
from ..shared.timing import HOST_START_TIMEOUT_S
from .host import HOST_SLOTS, SCHEMA, HostSpec, connection_string, host_task, open_session, release, session_settings
from .link import LINK_CONF, LinkAddress

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from ..jobs import Job
    from ..settings import ProgressSink

log = logging.getLogger("airflow_provider_hvd.runner")

_LINK_POLL_S = 0.25


class _Operation:
    """The run's operation, in a thread: its error when it failed."""

    def __init__(self, session: SparkSession, spec: HostSpec, payload: bytes) -> None:
        from ..driver.launch.spark.connect import ShippedJob

        self.error: BaseException | None = None
        self._frame = session.range(1, numPartitions=1).mapInArrow(host_task(spec, ShippedJob(payload)), SCHEMA)
        self._session = session
        self._tag = spec.tag
        self.thread = threading.Thread(target=self._run, name="hvd-durable-operation", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._session.addTag(self._tag)  # (this thread's operations only)
        try:
            self._frame.collect()
        except BaseException as exc:  # noqa: BLE001 - read by submit(); after the link, the outcome says it all
            self.error = exc


def submit_run(
    spark: SparkSession,
    spec: HostSpec,
    payload: bytes,
    progress_sink: ProgressSink | None,
    cancelled: Callable[[], bool],
    announce: Callable[[str], None] | None = None,
    on_mlflow_run: Callable[[str, str | None], None] | None = None,
) -> Job:
    """Start the run's host on the server of ``spark`` and return the run's handle, attached; ``announce`` is
    told the run's id before the host starts, ``on_mlflow_run`` its MLflow run once the host made it."""
    from ..driver.launch.spark.connect import CANCEL_CALL_S, ConnectApp, job_limit, job_too_large
    from ..driver.launch.spark.connect_client import interrupt_tag
    from ..jobs import Job, JobId

    runner = spec.naming.runner
    app = ConnectApp(spark, "", spec.naming)
    limit, bound_by = job_limit(app.conf)
    size = len(payload) + (spec.dataframe.size if spec.dataframe is not None else 0)  # (both in the host's plan)
    if size > limit:
        raise job_too_large(size, limit, bound_by, app.url, submitted=True)
    # its ranks' tasks and its host's, named apart (HostSlotError where only the host's does not fit)
    app.check_slots(spec.size // spec.per_task, spec.slot_wait_timeout, cancelled, HOST_SLOTS)
    connection, shown, user_id = connection_string(spark)
    settings = session_settings(spark)  # (before the run's session: nothing to release when it fails)
    session_id, tag = str(uuid.uuid4()), f"{spec.naming.job_group}-{uuid.uuid4().hex[:12]}"
    run_session = open_session(connection, session_id)
    run_session.client.disable_reattachable_execute()  # an operation that outlives this process (FACTS)
    spec = dataclasses.replace(spec, connection=connection, run_session=session_id, tag=tag, session_conf=settings)
    ident = JobId(shown, session_id, user_id, tag, runner, spec.detached_timeout)
    if announce is not None:
        try:
            announce(ident.dumps())
        except BaseException:
            release(run_session)
            raise
    operation = _Operation(run_session, spec, payload)
    del payload
    deadline = time.monotonic() + HOST_START_TIMEOUT_S
    try:
        while True:
            value = run_session.conf.get(LINK_CONF, None)
            if value:
                address = LinkAddress.from_conf(str(value))
                break
            if operation.error is not None or not operation.thread.is_alive():
                from ..driver.launch.spark.cluster import summary

                raise LaunchError(
                    f"{runner}: the run's host could not start on {app.where()}: "
                    f"{summary(operation.error or 'its operation ended', first_line=True)}"
                )
            if cancelled():
                raise RunCancelledError(f"{runner}: the run was cancelled before its ranks started")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{runner}: the run's host did not start within {HOST_START_TIMEOUT_S:g}s on {app.where()}: "
                    "its one task waits for a free task slot, or its executor cannot start Python."
                )
            time.sleep(_LINK_POLL_S)
        log.info("%s: submitted; its host runs at %s:%d (%s)", runner, address.host, address.port, ident.describe())
        job = Job(ident, run_session, address, progress_sink, on_mlflow_run=on_mlflow_run)
        job._connect()
    except BaseException:
        try:
            interrupt_tag(run_session, tag, CANCEL_CALL_S)
        finally:
            release(run_session)
        raise
    return job
