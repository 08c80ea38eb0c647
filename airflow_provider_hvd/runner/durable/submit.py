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
from ..shared.timing import HOST_START_TIMEOUT_S, SESSION_KEEPALIVE_S
from .host import HOST_SLOTS, SCHEMA, HostSpec, connection_string, host_task, open_session, release, session_settings
from .link import LINK_CONF, HostGone, LinkAddress, published

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from ..jobs import Job
    from ..settings import ProgressSink

log = logging.getLogger("airflow_provider_hvd.runner")

_LINK_POLL_S = 0.25
_OPERATION_END_WAIT_S = 2.0  # a released session's operation fails at once: its error may name the cause


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
    from ..driver.launch.spark.connect import ConnectApp, job_limit, job_too_large
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
    spec = dataclasses.replace(
        spec,
        connection=connection,
        run_session=session_id,
        tag=tag,
        session_conf=settings,
        keepalive_s=SESSION_KEEPALIVE_S,
    )
    ident = JobId(shown, session_id, user_id, tag, runner, spec.detached_timeout, spec.outcome_timeout)
    if announce is not None:
        try:
            announce(ident.dumps())
        except BaseException:
            _end(run_session, tag)
            raise
    operation = _Operation(run_session, spec, payload)
    del payload
    try:
        address = _host_address(run_session, operation, runner, app.where(), cancelled)
        log.info("%s: submitted; its host runs at %s:%d (%s)", runner, address.host, address.port, ident.describe())
        job = Job(ident, run_session, progress_sink, on_mlflow_run=on_mlflow_run)
        job._connect(address)
    except BaseException:
        _end(run_session, tag)
        raise
    return job


def _host_address(
    run_session: SparkSession, operation: _Operation, runner: str, where: str, cancelled: Callable[[], bool]
) -> LinkAddress:
    """Where the run's host listens, once it published it; LaunchError naming why it could not start (what it
    published in its place, or its operation's error), RunCancelledError, or LaunchError after
    ``HOST_START_TIMEOUT_S``."""
    from ..driver.launch.spark.cluster import summary

    deadline = time.monotonic() + HOST_START_TIMEOUT_S
    while True:
        session_gone: Exception | None = None
        try:
            value = published(run_session.conf.get(LINK_CONF, None))
        except Exception as exc:  # noqa: BLE001 - the session was released: the operation's end says why
            value, session_gone = None, exc
            operation.thread.join(_OPERATION_END_WAIT_S)
        if isinstance(value, LinkAddress):
            return value
        if isinstance(value, HostGone):
            raise LaunchError(f"{runner}: the run's host could not start {where}: {value.cause}")
        if session_gone is not None or operation.error is not None or not operation.thread.is_alive():
            why = summary(operation.error or session_gone or "its operation ended", first_line=True)
            raise LaunchError(f"{runner}: the run's host could not start {where}: {why}")
        if cancelled():
            raise RunCancelledError(f"{runner}: the run was cancelled before its ranks started")
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{runner}: the run's host did not start within {HOST_START_TIMEOUT_S:g}s {where}: its one "
                "task waits for a free task slot, or its executor cannot start Python."
            )
        time.sleep(_LINK_POLL_S)


def _end(run_session: SparkSession, tag: str) -> None:
    """End the run's operation and release its session, after a failure that is the caller's to raise: an error
    here is logged, never raised in its place."""
    from ..driver.launch.spark.connect import CANCEL_CALL_S
    from ..driver.launch.spark.connect_client import interrupt_tag

    try:
        interrupt_tag(run_session, tag, CANCEL_CALL_S)
    except Exception as exc:  # noqa: BLE001 - the session may be gone already (the host released it)
        log.debug("interrupting the run's operation after its start failed: %s", exc)
    try:
        release(run_session)
    except Exception as exc:  # noqa: BLE001 - as above
        log.debug("releasing the run's session after its start failed: %s", exc)
