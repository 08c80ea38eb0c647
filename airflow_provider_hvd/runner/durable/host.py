"""A submitted run's host: the one task of the run's own Connect operation, in an executor of the cluster.

It joins the run's session (the client's ``submit()`` made it) to publish its link there (:data:`.link.LINK_CONF`),
joins the ranks' session (a server-side clone of the submitting session, with its settings: ``submit()`` made it
too) for the ranks' barrier job and runs the supervisor over it with the Spark launcher, the driver's address
being this executor's: the ranks reach their supervisor inside the cluster. It
relays the run's log lines (numbered, :mod:`.ring`), its status and progress to every client attached over the
link, and ends the run when a client cancels it or nobody has been attached for ``detached_timeout`` (the
lease). It keeps the outcome until a client fetched it, or ``outcome_timeout`` after the run ended, then releases
both sessions: nothing of the run is left on the server (releasing the run's session ends this task's operation
too). A host that cannot start publishes why in place of its link, for ``submit()`` and ``attach()`` to say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import HorovodRunnerError, LaunchError, RunCancelledError
from ..mlflow_settings import MlflowSettings, auth_environment
from ..shared.liveness import Liveness
from ..shared.messages import Message
from ..shared.naming import RunnerNaming
from ..shared.timing import (
    CANCELLED_OUTCOME_GRACE_S,
    CREDENTIALS_WAIT_S,
    DEFAULT_OUTCOME_TIMEOUT_S,
    HOST_FAILURE_SHOWN_S,
    HOST_START_TIMEOUT_S,
    SESSION_KEEPALIVE_S,
)
from ..shared.tls import RunCertificate
from ..shared.wire import AuthenticationError, FrameStream, Pieces, new_secret
from . import link
from .outcome_parts import error_parts, first_line
from .ring import LineRing, entry_lines

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from ..driver.launch.spark.barrier import SparkLauncher
    from ..driver.restarts.controller import RunController
    from ..driver.tracking.mlflow_run import MlflowRun
    from ..driver.tracking.progress import RunProgress
    from ..driver.watch.supervisor import Supervisor
    from .dataframe_recipe import DataFrameRecipe

log = logging.getLogger("airflow_provider_hvd.runner")
_PACKAGE_LOG = "airflow_provider_hvd"
_WRITER_WAKE_S = 0.5  # a status change reaches the attached clients within this
_OUTCOME_WAKE_S = 0.2
_FAILURE_POLL_S = 0.25
_RELEASE_CALL_S = 10.0
SCHEMA = "ended string"  # the operation's one row
HOST_SLOTS = 1  # the run's host holds one task slot beside its ranks' for the whole run
SPEC_SCHEMA = "spec binary"  # its input's one row: the pickled HostSpec


@dataclass(frozen=True)
class HostSpec:
    """What the host needs to run the supervisor as the client's runner would: the input row of the host's task
    (:func:`spec_row`), which the server keeps as an artifact of the run's session (a cached local relation) and
    does not log, unlike the plan. No secret but the server's token (``connection``): the submitting session's
    settings are in the ranks' session (a clone), MLflow's credentials come over the link (:class:`.Credentials`)."""

    naming: RunnerNaming
    kind: str  # "Horovod" or "torch"
    size: int
    per_task: int
    use_gpus: bool
    verbosity: str
    start_timeout_s: float
    slot_wait_timeout: float
    stall_timeout: float | None
    exit_timeout: float
    liveness: Liveness
    channel_tls: bool
    metrics_rank: int
    progress_interval_s: float
    resume_from: dict[str, Any] | None
    detached_timeout: float
    #: the run's MLflow run, made and ended by the host: its settings (without the tracking URI, which comes over
    #: the link with the submitter's credentials; no ``on_start``) and params
    mlflow: MlflowSettings | None = None
    mlflow_params: dict[str, Any] = field(default_factory=dict)
    #: a run on a DataFrame: its recipe, which the host builds in the ranks' session (a DataFrame object of the
    #: submitter's session cannot be used in it), then plans and launches as ``run()`` on a DataFrame does
    dataframe: DataFrameRecipe | None = None
    #: the host's task has a profile of one CPU and no GPU (the ranks' tasks take GPUs): it holds no rank's slot
    cpu_only: bool = False
    connection: str = ""  # sc://host:port/;params, the server's token among them (in the task's input row)
    run_session: str = ""
    ranks_session: str = ""  # the ranks' session: a clone of the submitting one, without the client's address
    tag: str = ""
    #: how long the host keeps a finished run's outcome that nobody fetched (``outcome_timeout``)
    outcome_timeout: float = DEFAULT_OUTCOME_TIMEOUT_S
    keepalive_s: float = SESSION_KEEPALIVE_S  # a request in each of the host's sessions this often
    #: the run's restarts (``max_restarts``, ``restart_on_exceptions``): the host runs its attempts
    max_restarts: int = 0
    restart_on_exceptions: tuple[str, ...] = ()


def spec_row(spec: HostSpec) -> bytes:
    """``spec`` as the host task's input (``SPEC_SCHEMA``'s one value)."""
    import cloudpickle

    return bytes(cloudpickle.dumps(spec))


def read_spec(batches: Iterator[Any]) -> HostSpec:
    """The host's spec, from its task's input batches (one row)."""
    values = [value for batch in batches for value in batch.column(0).to_pylist()]
    spec = pickle.loads(values[0])
    assert isinstance(spec, HostSpec)
    return spec


class _Capture(logging.Handler):
    """The package's log records on the host, as ring entries (a rank's lines as they were relayed)."""

    def __init__(self, ring: LineRing) -> None:
        super().__init__(logging.INFO)
        self.ring = ring
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = getattr(record, "rank_lines", None)
            if lines is not None and isinstance(record.args, tuple) and record.args:
                attempt = getattr(record, "attempt", 1)  # (a later attempt's lines say so: [rank N, attempt K])
                self.ring.append(["rank", record.args[0], list(lines), *([attempt] if attempt > 1 else [])])
            else:
                self.ring.append(["log", record.name, record.levelno, self.format(record)])
        except Exception:  # noqa: BLE001 - logging never raises into the run
            self.handleError(record)


@contextlib.contextmanager
def _captured(ring: LineRing) -> Iterator[None]:
    package = logging.getLogger(_PACKAGE_LOG)
    handler, level = _Capture(ring), package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(level)


def open_session(connection: str, session_id: str | None) -> SparkSession:
    """A Connect session to the run's server (the run's own by its id, or a fresh one), not made this process's
    default or active one, and never released by this process's exit."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from ..driver.launch.spark.connect_client import keep_session_on_exit

    spark = ConnectSession(connection=connection + (f";session_id={session_id}" if session_id else ""))
    keep_session_on_exit(spark)
    return spark


def release(spark: SparkSession) -> None:
    """Release the session on the server (bounded), whatever it was doing."""
    from ..driver.launch.spark.connect_client import bound_release

    spark.release_session_on_close = True
    bound_release(spark, _RELEASE_CALL_S)
    spark.stop()


class _LinkSink:
    """The run's progress sink on the host: the latest write of each kind, for every attached client."""

    def __init__(self, host: Host) -> None:
        self._host = host

    def metrics(self, snapshot: dict[str, Any]) -> None:
        self._host.progress_write("metrics", snapshot)

    def checkpoint(self, record: dict[str, Any]) -> None:
        self._host.progress_write("checkpoint", record)

    def restarts(self, records: list[dict[str, Any]]) -> None:
        self._host.progress_write("restarts", records)


class Host:
    def __init__(self, spec: HostSpec, read_job: Callable[[], bytes]) -> None:
        self.spec = spec
        self._read_job = read_job
        self.ring = LineRing()
        self._lock = threading.Lock()
        self._attached = 0
        self._detached_since = time.monotonic()
        self._cancel_asked = False
        self._lease_ended = False
        self.fetched = threading.Event()  # a client fetched the outcome, and every attached one has it
        self._any_fetched = False
        self._waiting: set[object] = set()  # the attached peers that do not have the outcome yet
        self.ended = threading.Event()  # the host is done: its clients' threads end
        self.progress: dict[str, tuple[int, dict[str, Any] | list[Any]]] = {}
        self.outcome: tuple[link.Outcome, bytes | None] | None = None
        self._controller: RunController | None = None
        self._supervisor: Supervisor | None = None  # the current attempt's (or the last one's, once it ended)
        self._ended_status: link.Status | None = None
        self._credentials: link.Credentials | None = None  # the submitting client's, for the MLflow run
        self._credentials_came = threading.Event()

    # what the link's peers ask

    def status(self) -> link.Status:
        if self._ended_status is not None:
            return self._ended_status
        phase, started, attempt = self._controller.status() if self._controller is not None else ("starting", 0, 1)
        return link.Status("ending" if phase == "settling" else phase, started, self.spec.size, attempt=attempt)

    def progress_write(self, what: str, value: dict[str, Any] | list[Any]) -> None:
        with self.ring.changed:
            version = self.progress.get(what, (0, {}))[0] + 1
            self.progress[what] = (version, value)
            self.ring.changed.notify_all()

    def cancel(self) -> None:
        self._cancel_asked = True

    def take_credentials(self, credentials: link.Credentials) -> None:
        """The submitting client's MLflow credentials (the first that came are kept)."""
        if not self._credentials_came.is_set():
            self._credentials = credentials
            self._credentials_came.set()

    def attached(self, peer: object, joined: bool) -> None:
        with self._lock:
            self._attached += 1 if joined else -1
            if joined:
                self._waiting.add(peer)
            if self._attached == 0:
                self._detached_since = time.monotonic()
        if not joined:
            self.has_outcome(peer, fetched=False)

    def has_outcome(self, peer: object, fetched: bool) -> None:
        """``peer`` has the outcome: it fetched it (``fetched``: it holds rank 0's value or the run's error), or it
        watches and was sent it, or it detached. The host ends once one fetched it and every attached one has it."""
        with self._lock:
            self._waiting.discard(peer)
            self._any_fetched = self._any_fetched or fetched
            done = self._any_fetched and not self._waiting
        if done:
            self.fetched.set()

    def lease_over(self) -> bool:
        with self._lock:
            over = self._attached == 0 and time.monotonic() - self._detached_since > self.spec.detached_timeout
        return over

    def _cancelled(self) -> bool:
        if not self._cancel_asked and not self._lease_ended and self.lease_over():
            self._lease_ended = True
            log.warning(
                "%s: nobody has been attached to this run for %gs (detached_timeout): it ends",
                self.spec.naming.runner,
                self.spec.detached_timeout,
            )
        return self._cancel_asked or self._lease_ended

    # the run

    def run(self) -> str:
        spec = self.spec
        with _captured(self.ring):
            run_session = open_session(spec.connection, spec.run_session)
            try:
                server = self._serve_link(run_session)
                try:
                    keepalive = _KeepAlive([run_session], spec.keepalive_s)
                    try:
                        self._supervise(keepalive)
                        self._keep_outcome()
                    finally:
                        keepalive.stop()
                finally:
                    self.ended.set()
                    server.close()
            finally:
                try:
                    release(run_session)  # (ends this task's own operation: everything else is done)
                except Exception as exc:  # noqa: BLE001 - never in place of the run's own end, or its cause
                    log.warning("%s: could not release the run's session: %s", spec.naming.runner, first_line(exc))
        return "ended"

    def _serve_link(self, run_session: SparkSession) -> _LinkServer:
        """The link's server, its address published in the run's session; where it cannot start, the cause is
        published there instead (:meth:`_show_failure`) and raised."""
        server: _LinkServer | None = None
        try:
            server = _LinkServer(self, run_session)
            run_session.conf.set(link.LINK_CONF, server.address.to_conf())
            return server
        except BaseException as exc:
            if server is not None:
                self.ended.set()
                server.close()
            self._show_failure(run_session, exc)
            raise

    def _show_failure(self, run_session: SparkSession, error: BaseException) -> None:
        """Publish why the host could not start where its link's address belongs, for ``submit()`` (or an
        ``attach()``) to raise; keep it there until a client released the run's session, at most
        ``HOST_FAILURE_SHOWN_S`` (the caller releases it then)."""
        cause = first_line(error).removeprefix(f"{self.spec.naming.runner}: ")  # (the client's error names it)
        if not isinstance(error, HorovodRunnerError):
            cause = f"{type(error).__name__}: {cause}"
        log.error("%s: the run's host could not start: %s", self.spec.naming.runner, cause)
        try:
            run_session.conf.set(link.LINK_CONF, link.HostGone(cause).to_conf())
        except Exception:  # noqa: BLE001 - the session is gone: nothing is left to show it in
            return
        deadline = time.monotonic() + HOST_FAILURE_SHOWN_S
        while time.monotonic() < deadline:
            try:
                run_session.conf.get(link.LINK_CONF, None)
            except Exception:  # noqa: BLE001 - the client read it and released the session
                return
            time.sleep(_FAILURE_POLL_S)

    def _supervise(self, keepalive: _KeepAlive) -> None:
        # the submitter's MLflow credentials, once they came, where the run's MLflow run reads them: its client
        # here, rank 0's environment; as they were after the run
        with contextlib.ExitStack() as mlflow_auth:
            self._supervise_tracked(keepalive, mlflow_auth)

    def _mlflow_settings(self, mlflow_auth: contextlib.ExitStack) -> MlflowSettings | None:
        """The run's MLflow settings with the tracking URI and credentials the submitting client sent over the link
        (``mlflow_auth`` holds them in this process's environment); LaunchError when none came in time."""
        if self.spec.mlflow is None:
            return None
        deadline = time.monotonic() + CREDENTIALS_WAIT_S
        while not self._credentials_came.wait(0.2):
            if self._cancelled():
                raise RunCancelledError(f"{self.spec.naming.runner}: the run was cancelled before its ranks started")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.spec.naming.runner}: the submitting process did not hand the run's host its MLflow "
                    f"tracking URI and credentials within {CREDENTIALS_WAIT_S:g}s (it ended as the run started?): "
                    "the run did not start; submit it again"
                )
        credentials = self._credentials
        assert credentials is not None
        mlflow_auth.enter_context(auth_environment(credentials.env))
        return dataclasses.replace(self.spec.mlflow, tracking_uri=credentials.tracking_uri)

    def _supervise_tracked(self, keepalive: _KeepAlive, mlflow_auth: contextlib.ExitStack) -> None:
        from ..driver.tracking.mlflow_run import start_mlflow_run
        from ..driver.tracking.progress import RunProgress

        spec = self.spec
        progress = RunProgress(
            spec.metrics_rank, _LinkSink(self), spec.progress_interval_s, spec.resume_from, spec.naming.runner
        )
        result: bytes | None = None
        error: BaseException | None = None
        ranks: SparkSession | None = None
        tracking: MlflowRun | None = None
        try:
            ranks = open_session(spec.connection, spec.ranks_session)
            keepalive.add(ranks)
            tracking = start_mlflow_run(
                self._mlflow_settings(mlflow_auth),
                spec.naming.runner,
                spec.size,
                spec.mlflow_params,
                ranks.conf.get("spark.app.id", None),
                spec.metrics_rank,
            )
            if tracking is not None and tracking.run_id is not None:  # every client, attached now or later
                self.progress_write(link.MLFLOW_RUN, {"run_id": tracking.run_id, "url": tracking.url})
            self._controller = self._attempts(ranks, progress, tracking)
            body = self._controller.run_raw()
            result = body.read() if isinstance(body, Pieces) else bytes(body)
        except BaseException as exc:  # noqa: BLE001 - every end is the run's outcome, for the client
            error = exc
            if isinstance(exc, RunCancelledError) and self._lease_ended:
                error = RunCancelledError(
                    f"{spec.naming.runner}: the run ended itself: nobody was attached to it for "
                    f"{spec.detached_timeout:g}s (detached_timeout), and every rank was ended"
                )
        finally:
            progress.flush()
            if tracking is not None:
                tracking.end(error)
            if ranks is not None:
                keepalive.release(ranks)
        metrics = {name: [list(point) for point in points] for name, points in progress.history.as_dict().items()}
        attempts = self._controller.attempts() if self._controller is not None else []
        outcome = link.Outcome(
            None if error is None else error_parts(error), metrics, progress.checkpoint, len(result or b""), attempts
        )
        with self.ring.changed:
            cause = None if error is None else first_line(error)
            started = self._supervisor.status()[1] if self._supervisor is not None else 0
            self._ended_status = link.Status("ended", started, spec.size, cause, max(1, len(attempts)))
            self.outcome = (outcome, result)
            self.ring.changed.notify_all()
        if error is not None:
            log.info("%s: the run ended: %s", spec.naming.runner, first_line(error))

    def _attempts(self, ranks: SparkSession, progress: RunProgress, tracking: MlflowRun | None) -> RunController:
        """The run's attempts (``max_restarts``), each a launcher and a supervisor of its own; the job is read once
        and kept for the next attempts where the run may restart; one MLflow run records the restarts."""
        from ..driver.restarts.controller import KeptJob, RunController
        from ..driver.restarts.policy import RestartPolicy

        spec = self.spec
        job = KeptJob(self._read_job(), keep=spec.max_restarts > 0)
        launcher: SparkLauncher | None = None

        def attempt(number: int, size: int | None) -> Supervisor:
            nonlocal launcher
            assert size is None, "a submitted run restarts with its own size (no capacity: submit() refuses min_ranks)"
            launcher = self._launcher(ranks, launcher)
            self._supervisor = self._new_supervisor(launcher, job.take(), progress, tracking, number)
            return self._supervisor

        policy = RestartPolicy(spec.max_restarts, spec.restart_on_exceptions)
        listeners = [tracking] if tracking is not None else []
        return RunController(attempt, progress, policy, self._cancelled, spec.naming.runner, listeners=listeners)

    def _launcher(self, ranks: SparkSession, previous: SparkLauncher | None) -> SparkLauncher:
        """An attempt's launcher in the ranks' session; a run on a DataFrame builds and plans it for the first
        attempt, and the next ones read the same shards (``previous``: the last attempt's launcher)."""
        from ..driver.launch.spark.barrier import SparkLauncher

        spec = self.spec
        launcher = SparkLauncher(
            ranks,  # type: ignore[arg-type]  # (a Connect session has the classic one's API)
            spec.size,
            spec.slot_wait_timeout,
            cancelled=self._cancelled,
            per_task=spec.per_task,
            use_gpus=spec.use_gpus,
            naming=spec.naming,
            run_host_slots=HOST_SLOTS,  # this task's own: its ranks wait for slots beside it
        )
        if spec.cpu_only:  # this task holds a core and no GPU: no slot of the ranks' (capacity.CpuTasks)
            from ..driver.launch.spark.capacity import CpuTasks
            from ..driver.launch.spark.connect import ConnectApp

            assert isinstance(launcher.app, ConnectApp)
            launcher.app.beside = CpuTasks(running=1)
        if previous is not None:
            launcher.shard_plan = previous.shard_plan
        elif spec.dataframe is not None:  # a run on a DataFrame: built here from its recipe, then its shards planned
            self._plan_dataframe(spec.dataframe, ranks, launcher)
        return launcher

    def _new_supervisor(
        self, launcher: SparkLauncher, job: bytes, progress: RunProgress, tracking: MlflowRun | None, attempt: int
    ) -> Supervisor:
        """The supervisor of the run's attempt ``attempt``, with a new rank kind (its rendezvous or store)."""
        from ..driver.ranks.kind import RankKind, horovod_kind, torch_kind
        from ..driver.watch.supervisor import Supervisor

        spec = self.spec
        kind: RankKind = horovod_kind() if spec.kind == "Horovod" else torch_kind()
        return Supervisor(
            launcher,
            job,
            spec.verbosity,
            self._cancelled,
            spec.start_timeout_s,
            progress,
            spec.liveness,
            stall_timeout=spec.stall_timeout,
            channel_tls=spec.channel_tls,
            kind=kind,
            exit_timeout_s=spec.exit_timeout,
            tracking=tracking,
            attempt=attempt,
        )

    def _plan_dataframe(self, recipe: DataFrameRecipe, ranks: SparkSession, launcher: SparkLauncher) -> None:
        """The run's DataFrame, built from ``recipe`` in the ranks' session and planned by ``launcher`` (its row
        count a Spark job that a cancel interrupts; a cancel while the recipe builds takes effect once it has
        built: the Spark jobs a callable runs itself are not the run's); what fails is the run's LaunchError."""
        cancelled = RunCancelledError(
            f"{self.spec.naming.runner}: the run was cancelled before its ranks started (as its host built the "
            "DataFrame)"
        )
        with recipe.failures(self.spec.naming.runner):
            if self._cancelled():
                raise cancelled
            dataframe = recipe.build(ranks)
            if self._cancelled():
                raise cancelled
            launcher.plan(dataframe)

    def _keep_outcome(self) -> None:
        """Until a client fetched the outcome and every attached one has it, or ``outcome_timeout`` after the run
        ended, whoever is attached; a cancelled run's (a client's cancel, or its lease), for the clients attached
        now only (``CANCELLED_OUTCOME_GRACE_S``)."""
        now = time.monotonic()
        grace_over, kept_until = now + CANCELLED_OUTCOME_GRACE_S, now + self.spec.outcome_timeout
        while not self.fetched.wait(_OUTCOME_WAKE_S):
            now = time.monotonic()
            if (self._cancel_asked or self._lease_ended) and now > grace_over:
                return
            if now > kept_until:
                log.warning(
                    "%s: nobody fetched the run's outcome within %gs of its end (outcome_timeout): it is dropped",
                    self.spec.naming.runner,
                    self.spec.outcome_timeout,
                )
                return


class _KeepAlive:
    """An RPC in each of the host's sessions every ``interval`` seconds (``SESSION_KEEPALIVE_S``): a session idle
    for the server's session timeout would be closed with its operations. A session released leaves it."""

    def __init__(self, sessions: list[SparkSession], interval: float) -> None:
        self._sessions = list(sessions)
        self._lock = threading.Lock()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvd-host-keepalive", daemon=True)
        self._thread.start()

    def add(self, spark: SparkSession) -> None:
        with self._lock:
            self._sessions.append(spark)

    def release(self, spark: SparkSession) -> None:
        """Release ``spark`` on the server (a failure is left at that: the server's timeout ends it), renewed no
        more."""
        with self._lock:
            self._sessions.remove(spark)
        with contextlib.suppress(Exception):
            release(spark)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                sessions = list(self._sessions)
            for spark in sessions:
                try:
                    spark.conf.get(link.LINK_CONF, None)
                except Exception as exc:  # noqa: BLE001 - the next one may pass; the run does not depend on it
                    log.warning("could not renew the Spark Connect session %s: %s", spark.session_id, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _LinkServer:
    """Accepts the link's connections (``hvd-link``); each authenticated client gets a :class:`_Peer`."""

    def __init__(self, host: Host, run_session: SparkSession) -> None:
        from ..driver.launch.address import (
            CONNECT_BIND_CONF,
            CONNECT_HOST_CONF,
            connect_driver_address,
            listening_socket,
        )
        from ..driver.launch.spark.cluster import is_local, session_conf

        self._host = host
        conf = session_conf(run_session)
        spec = host.spec
        where = connect_driver_address(conf, run_session.client.host, is_local(conf("spark.master") or ""), spec.naming)
        self._certificate = RunCertificate.new()  # always: whatever Spark encrypts (docs/security.md)
        self._secret = new_secret()
        try:
            self._listener = listening_socket(where.bind, 0, 16)  # (any free port: the link is found by its session)
        except OSError as exc:
            settings = f" ({where.address_settings})" if where.address_settings else ""
            raise LaunchError(
                f"{spec.naming.runner}: the run's host cannot listen for its clients on {where.bind}{settings} in its "
                f"executor on {socket.gethostname()}: {exc.strerror or exc}. Unset {CONNECT_BIND_CONF} and "
                f"{CONNECT_HOST_CONF} in the Connect server's settings, or give an address of every executor's host."
            ) from exc
        self._listener.settimeout(0.5)
        self.address = link.LinkAddress(
            where.advertised,
            self._listener.getsockname()[1],
            self._secret.hex(),
            self._certificate.fingerprint,
            socket.gethostname(),
            os.getpid(),
            spec.liveness.interval_s,
            spec.liveness.timeout_s,
        )
        self._thread = threading.Thread(target=self._serve, name="hvd-link", daemon=True)
        self._thread.start()
        log.info(
            "%s: this run's host listens for its clients at %s:%d, TLS 1.3",
            spec.naming.runner,
            self.address.host,
            self.address.port,
        )

    def _serve(self) -> None:
        while not self._host.ended.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, peer), name="hvd-link-peer", daemon=True).start()

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        try:
            sock, stream = link.accept_link(sock, self._secret, self._certificate.context)
            try:
                attach = link.receive(stream)
            except EOFError:  # a probe (a later attempt of this host's task asks whether it is alive)
                sock.close()
                return
            if not isinstance(attach, link.Attach):
                raise AuthenticationError(f"it sent {type(attach).__name__} first, not Attach")
        except Exception as exc:  # noqa: BLE001 - not a client of this run: nothing of it was read
            log.warning("%s: refused a link connection from %s:%d: %s", self._host.spec.naming.runner, *peer[:2], exc)
            sock.close()
            return
        _Peer(self._host, sock, stream, attach, f"{peer[0]}:{peer[1]}").serve()

    def close(self) -> None:
        self._listener.close()
        self._thread.join()


class _Peer:
    """One attached client: its reads on the link's peer thread, its writes on ``hvd-link-writer``."""

    def __init__(self, host: Host, sock: socket.socket, stream: FrameStream, attach: link.Attach, peer: str) -> None:
        self._host = host
        self._sock = sock
        self._stream = stream
        self._logs = attach.logs
        self._fetch = attach.fetch
        self._cursor = host.ring.acked if attach.after is None else attach.after
        self._peer = peer
        self._gone = threading.Event()

    def serve(self) -> None:
        host = self._host
        host.attached(self, joined=True)
        log.info("%s: a client attached from %s", host.spec.naming.runner, self._peer)
        writer = threading.Thread(target=self._write, name="hvd-link-writer", daemon=True)
        writer.start()
        try:
            self._read()
        finally:
            self._gone.set()
            with host.ring.changed:
                host.ring.changed.notify_all()
            writer.join()
            self._stream.close()
            host.attached(self, joined=False)
            if not host.ended.is_set():
                log.info("%s: the client at %s detached", host.spec.naming.runner, self._peer)

    def _read(self) -> None:
        self._sock.settimeout(self._host.spec.liveness.timeout_s)
        while not self._gone.is_set() and not self._host.ended.is_set():
            try:
                message = link.receive(self._stream)
            except (OSError, EOFError, ValueError):
                return
            if isinstance(message, link.Ack):
                self._host.ring.ack(message.upto)
            elif isinstance(message, link.Cancel):
                log.warning("%s: the client at %s cancelled the run", self._host.spec.naming.runner, self._peer)
                self._host.cancel()
            elif isinstance(message, link.Fetched):
                self._host.has_outcome(self, fetched=True)
            elif isinstance(message, link.Credentials):
                self._host.take_credentials(message)

    def _write(self) -> None:
        host, ring = self._host, self._host.ring
        sent_status: link.Status | None = None
        sent_progress: dict[str, int] = {}
        outcome_sent = False
        next_beat = 0.0
        try:
            while not self._gone.is_set() and not host.ended.is_set():
                ended = host.outcome  # (before the status: once it is set, so is the status "ended", sent before it)
                status = host.status()  # (first: a client attached afresh has it before any backlog of lines)
                if status != sent_status:
                    self._send(status)
                    sent_status = status
                if self._logs:
                    first, entries, lost = ring.since(self._cursor)
                    if entries or lost:
                        self._send(link.Lines(first, entries, lost))
                        self._cursor = first + sum(entry_lines(entry) for entry in entries)
                for what, (version, value) in list(host.progress.items()):
                    if sent_progress.get(what) != version:
                        self._send(link.Progress(what, value))
                        sent_progress[what] = version
                lines_left = self._logs and bool(ring.since(self._cursor)[1])  # (every line goes before the outcome)
                if ended is not None and not outcome_sent and not lines_left:
                    outcome, result = ended
                    self._send(outcome)
                    if result is not None and self._fetch:  # (a watcher never gets the value: its size only)
                        self._send(link.LinkResult(result))
                    outcome_sent = True
                    if not self._fetch:
                        host.has_outcome(self, fetched=False)
                if time.monotonic() >= next_beat:
                    self._send(link.Alive())
                    next_beat = time.monotonic() + host.spec.liveness.interval_s
                with ring.changed:
                    ring.changed.wait(_WRITER_WAKE_S)
        except OSError:
            pass  # gone: its reader sees the end too
        finally:
            self._gone.set()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _send(self, message: Message) -> None:
        link.send(self._stream, message)


def host_task(read_job: Callable[[], bytes]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function of the run's one-task operation (``mapInArrow`` over its spec's row): the host, in an
    executor."""

    def task(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        spec = read_spec(batches)
        context = TaskContext.get()
        if context is not None and context.attemptNumber() > 0:
            later_attempt(spec.naming.runner, spec.connection, spec.run_session, spec.liveness)
        ended = Host(spec, read_job).run()
        yield pa.RecordBatch.from_pydict({"ended": [ended]})

    return task


def later_attempt(
    runner: str, connection: str, run_session: str, liveness: Liveness, start_wait: float = HOST_START_TIMEOUT_S
) -> NoReturn:
    """A later attempt of the host's task: Spark retried it (its first attempt failed, or its executor was lost) or
    runs a speculative copy beside a first attempt still running. It never starts the run a second time.

    While the first attempt's link answers (a copy), it waits beside it: it neither ends nor replaces that run,
    and never completes before it (Spark would kill the first attempt); Spark kills it once the first completes.
    Once the first attempt has not answered for the heartbeat timeout (or published no link within
    ``start_wait``), it marks the run lost in its session, with the first one's address for a client to
    try (``attach()`` then ends what is left of the run and says so), and fails. A host that published why it
    could not start keeps that cause."""
    message = (
        f"{runner}: the run's host was lost (its task or executor failed) and Spark retried it: a submitted run is "
        "not started again from scratch; submit it again (resume_from= resumes from a checkpoint)"
    )
    session = open_session(connection, run_session)  # (the session gone: the run has ended, attach() says so)
    try:
        first = link.published(session.conf.get(link.LINK_CONF, None))
        deadline = time.monotonic() + start_wait  # (a first attempt still starting publishes its link within it)
        while first is None and time.monotonic() < deadline:
            time.sleep(liveness.interval_s)
            first = link.published(session.conf.get(link.LINK_CONF, None))
        if isinstance(first, link.HostGone):
            raise RuntimeError(f"{message} ({first.cause})")
        if first is not None:
            _wait_while_it_answers(first, liveness, runner)
        lost = link.HostGone(message.split(": ", 1)[1], lost=True, was=first)
        with contextlib.suppress(Exception):  # (the session may be gone: then an attach says the run has ended)
            session.conf.set(link.LINK_CONF, lost.to_conf())
    finally:
        with contextlib.suppress(Exception):
            session.client.close()
    raise RuntimeError(message)


def _wait_while_it_answers(address: link.LinkAddress, liveness: Liveness, runner: str) -> None:
    """Return once the host at ``address`` has not answered for ``liveness.timeout_s``."""
    answered = False
    last = time.monotonic()
    while time.monotonic() - last <= liveness.timeout_s:
        if link.answers(address, liveness.timeout_s):
            if not answered:
                log.warning(
                    "%s: this later attempt of the run's host task (a speculative copy) waits beside the first one, "
                    "which runs the run at %s:%d: Spark ends it once the first completes",
                    runner,
                    address.host,
                    address.port,
                )
            answered, last = True, time.monotonic()
        time.sleep(liveness.interval_s)


def connection_string(spark: SparkSession) -> tuple[str, str, str]:
    """``sc://host:port/;params`` of the client's session (without its session id), the URL without token for
    the run's id, and the user id."""
    from ..driver.launch.spark.connect_client import connection_params, endpoint

    params = connection_params(spark)
    url = f"sc://{endpoint(spark)}"
    connection = url + "/;" + ";".join(f"{key}={value}" for key, value in params.items())
    public = {key: params[key] for key in ("use_ssl",) if key in params}
    if "token" in params:
        public["use_ssl"] = "true"  # (pyspark's token implies TLS)
    shown = url + ("/;" + ";".join(f"{key}={value}" for key, value in public.items()) if public else "")
    return connection, shown, params["user_id"]
