"""The client's ``submit()`` over Spark Connect: the run's two sessions on the client's server (same token and user
as the client's), its one-task operation that is the run's host (:mod:`.host`), not reattachable, so that it
outlives this process, and the wait (bounded) until the host says where it listens.

- The run's session, fresh: the host's operation runs there, and the host publishes its link in its conf.
- The ranks' session: a clone of the submitting session on the server (``cloneSession``), with its settings (also
  those Spark hides from its clients: an object store's keys), temporary views and functions, less the settings
  of this client's own address (:data:`..driver.launch.address.CLIENT_ADDRESS_SETTINGS`): the host runs the
  barrier job there, as ``run()`` would in the submitting session.
- The host's spec is its task's input row, a cached local relation: the server keeps it as an artifact of the
  run's session and logs only its hash, where it may log the plan whole (the spec holds the server's token).
  MLflow's tracking URI and credentials are not in it: they go over the link once this client is attached.
- Where the ranks' tasks take GPUs (or another resource), the host's task has a profile of one CPU and nothing
  else: it takes no GPU from the ranks.

The operation runs in ``hvd-durable-operation``: its ``collect()`` returns (or fails, once the host released
the run's session) when the run is over; the run's outcome comes over the link, never from it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..driver.launch.address import CLIENT_ADDRESS_SETTINGS
from ..errors import HostSlotError, LaunchError, RunCancelledError
from ..shared.timing import HOST_START_TIMEOUT_S, SESSION_KEEPALIVE_S
from .host import (
    HOST_SLOTS,
    SCHEMA,
    SPEC_SCHEMA,
    HostSpec,
    connection_string,
    host_task,
    open_session,
    release,
    spec_row,
)
from .link import LINK_CONF, RANKS_CONF, Credentials, HostGone, LinkAddress, published

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from ..driver.launch.spark.connect import ConnectApp
    from ..jobs import Job
    from ..settings import ProgressSink

log = logging.getLogger("airflow_provider_hvd.runner")

_LINK_POLL_S = 0.25
_OPERATION_END_WAIT_S = 2.0  # a released session's operation fails at once: its error may name the cause
#: pyspark sends local data of this size or more as an artifact of the session (a cached local relation)
_CACHE_THRESHOLD_CONF = "spark.sql.session.localRelationCacheThreshold"
_TASK_RESOURCE = re.compile(r"spark\.task\.resource\.[^.]+\.amount")


class _Operation:
    """The run's operation, in a thread: its error when it failed."""

    def __init__(self, session: SparkSession, spec: HostSpec, payload: bytes, profile: Any) -> None:
        from ..driver.launch.spark.connect import ShippedJob

        self.error: BaseException | None = None
        session.conf.set(_CACHE_THRESHOLD_CONF, "0")  # the spec's row goes as an artifact, not inside the plan
        spec_frame = session.createDataFrame([(spec_row(spec),)], SPEC_SCHEMA)
        self._frame = spec_frame.mapInArrow(host_task(ShippedJob(payload)), SCHEMA, profile=profile)
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


def cpu_only_host(spark: SparkSession, master: str) -> bool:
    """Whether the run's host takes a task profile of one CPU: the application's tasks take another resource (a
    GPU) that the host must leave to the ranks, and its master has task profiles without dynamic allocation
    (standalone, YARN, Kubernetes; a local master has none, nor such resources for its tasks)."""
    from ..driver.launch.spark.cluster import is_local

    if is_local(master):
        return False
    return any(_TASK_RESOURCE.fullmatch(key) and float(value or 0) > 0 for key, value in spark.conf.getAll.items())


def check_host_slot(
    app: ConnectApp, tasks: int, timeout: float, cancelled: Callable[[], bool], cpu_only: bool = False
) -> None:
    """The slot check of a submitted run: its ranks' tasks and its host's, named apart (HostSlotError where only
    the host's does not fit): one slot more, or a core beside the ranks' slots where its task has a profile of
    one CPU."""
    from ..driver.launch.spark.capacity import CpuTasks

    if not cpu_only:
        app.check_slots(tasks, timeout, cancelled, HOST_SLOTS)
        return
    app.beside = CpuTasks(pending=HOST_SLOTS)
    try:
        app.check_slots(tasks, timeout, cancelled)
    except HostSlotError:
        raise
    except LaunchError as exc:
        raise LaunchError(
            f"{exc} A submitted run needs a core beside its ranks' slots, for its host (where its supervisor runs) "
            "for the whole run: see docs/durable-runs.md."
        ) from None


def _ranks_session(spark: SparkSession) -> SparkSession:
    """A clone of ``spark`` on the server for the ranks (its settings, temporary views and functions), without the
    settings of this client's own address; this process's exit does not release it (the run's host does)."""
    from ..driver.launch.spark.connect_client import keep_session_on_exit

    ranks = spark.cloneSession()
    keep_session_on_exit(ranks)
    try:
        for key in CLIENT_ADDRESS_SETTINGS:
            ranks.conf.unset(key)
    except BaseException:
        release(ranks)
        raise
    return ranks


def _run_session(connection: str, session_id: str, ranks: SparkSession) -> SparkSession:
    """The run's own session, where its host's operation runs (not reattachable: it outlives this process, FACTS)
    and publishes its link; without the client's address settings the server may give every session."""
    run_session = open_session(connection, session_id)
    try:
        run_session.client.disable_reattachable_execute()
        for key in CLIENT_ADDRESS_SETTINGS:
            run_session.conf.unset(key)
        run_session.conf.set(RANKS_CONF, ranks.session_id)  # (a cancel without a link releases it)
    except BaseException:
        release(run_session)
        raise
    return run_session


def submit_run(
    spark: SparkSession,
    spec: HostSpec,
    payload: bytes,
    progress_sink: ProgressSink | None,
    cancelled: Callable[[], bool],
    announce: Callable[[str], None] | None = None,
    on_mlflow_run: Callable[[str, str | None], None] | None = None,
    credentials: Credentials | None = None,
) -> Job:
    """Start the run's host on the server of ``spark`` and return the run's handle, attached; ``announce`` is
    told the run's id before the host starts, ``on_mlflow_run`` its MLflow run once the host made it; the host
    gets ``credentials`` (MLflow's) over the link."""
    from ..driver.launch.spark.connect import ConnectApp, job_limit, job_too_large
    from ..driver.launch.spark.connect_client import cpu_task_profile
    from ..jobs import Job, JobId, _close_channel

    runner = spec.naming.runner
    app = ConnectApp(spark, "", spec.naming)
    limit, bound_by = job_limit(app.conf)
    size = len(payload) + (spec.dataframe.size if spec.dataframe is not None else 0)  # (the recipe, in the spec, too)
    if size > limit:
        raise job_too_large(size, limit, bound_by, app.url, submitted=True)
    cpu_only = cpu_only_host(spark, app.master)
    check_host_slot(app, spec.size // spec.per_task, spec.slot_wait_timeout, cancelled, cpu_only)
    connection, shown, user_id = connection_string(spark)
    session_id, tag = str(uuid.uuid4()), f"{spec.naming.job_group}-{uuid.uuid4().hex[:12]}"
    ranks_session = _ranks_session(spark)
    try:
        run_session = _run_session(connection, session_id, ranks_session)
    except BaseException:
        _release(ranks_session)
        raise
    ident = JobId(shown, session_id, user_id, tag, runner, spec.detached_timeout, spec.outcome_timeout)
    try:
        profile = cpu_task_profile(run_session) if cpu_only else None
        spec = dataclasses.replace(
            spec,
            connection=connection,
            run_session=session_id,
            ranks_session=ranks_session.session_id,
            tag=tag,
            cpu_only=profile is not None,
            keepalive_s=SESSION_KEEPALIVE_S,
        )
        if announce is not None:
            announce(ident.dumps())
        operation = _Operation(run_session, spec, payload, profile)
        del payload
        log.info(
            "%s: starting the run's host %s: one Spark task, which says where it listens once it runs (seconds; "
            "the first Python task on a fresh server waits for its Python worker to start)",
            runner,
            app.where(),
        )
        address = _host_address(run_session, operation, runner, app.where(), cancelled)
        log.info("%s: submitted; its host runs at %s:%d (%s)", runner, address.host, address.port, ident.describe())
        job = Job(ident, run_session, progress_sink, on_mlflow_run=on_mlflow_run)
        job._connect(address)
        if credentials is not None:
            _hand_over(job, credentials)
    except BaseException:
        _end(run_session, tag, ranks_session)
        raise
    _close_channel(ranks_session)  # (the session stays: the host has it)
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


def _end(run_session: SparkSession, tag: str, ranks_session: SparkSession) -> None:
    """End the run's operation and release its two sessions, after a failure that is the caller's to raise: an
    error here is logged, never raised in its place."""
    from ..driver.launch.spark.connect import CANCEL_CALL_S
    from ..driver.launch.spark.connect_client import interrupt_tag

    try:
        interrupt_tag(run_session, tag, CANCEL_CALL_S)
    except Exception as exc:  # noqa: BLE001 - the session may be gone already (the host released it)
        log.debug("interrupting the run's operation after its start failed: %s", exc)
    _release(run_session, ranks_session)


def _release(*sessions: SparkSession) -> None:
    for session in sessions:
        try:
            release(session)
        except Exception as exc:  # noqa: BLE001 - released already (the host's end releases both)
            log.debug("releasing a session of the run after its start failed: %s", exc)


def _hand_over(job: Job, credentials: Credentials) -> None:
    """Give the run's host MLflow's credentials over the link (TLS, after both proved its secret): it waits for
    them before it makes the run's MLflow run."""
    client = job._client
    assert client is not None
    client.send(credentials)
