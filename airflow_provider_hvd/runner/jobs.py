"""A submitted run's handle (``submit()`` returns one, :func:`attach` gives one in any process): its id, its
outcome, status, cancel, and the ranks' lines relayed while attached. See docs/durable-runs.md."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import HorovodRunnerError, JobNotFoundError, LaunchError, RunCancelledError, RunDetachedError
from .shared.liveness import Liveness
from .shared.timing import DEFAULT_OUTCOME_TIMEOUT_S, HOST_START_TIMEOUT_S, HOST_UNREACHABLE_WAIT_S

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from .durable.client import LinkClient
    from .durable.link import HostGone, LinkAddress
    from .settings import ProgressSink

log = logging.getLogger("airflow_provider_hvd.runner")

_ID_KEYS = ("server", "session_id", "user_id", "tag", "runner", "detached_timeout", "outcome_timeout")
_FIND_POLL_S = 0.25
_CANCEL_CALL_S = 10.0


@dataclass(frozen=True)
class JobStatus:
    """Where a submitted run is: ``phase`` is ``"starting"`` (its host starts, or waits for a task slot; agents
    saying hello), ``"running"``, ``"ending"`` (a cause was recorded, or every rank returned), ``"ended"`` (the
    outcome is known), or ``"lost"`` (this client's link to the run's host ended before its outcome came);
    ``ranks_started``: how many of its ``size`` ranks were started; ``cause``: the first line of the error the run
    ended with, or why the link was lost; ``attempt``: the run's attempt (from 1; a run with ``max_restarts``
    restarts in its host: its phase and ranks are the current attempt's)."""

    phase: str
    ranks_started: int
    size: int
    cause: str | None = None
    attempt: int = 1

    @property
    def ended(self) -> bool:
        return self.phase == "ended"


@dataclass(frozen=True)
class JobId:
    """What ``job.id`` holds (as compact JSON): the Connect server's URL without token, the run's session id, the
    user id it was opened with, its operation tag, the runner, the lease and how long its outcome is kept. No
    secret."""

    server: str
    session_id: str
    user_id: str
    tag: str
    runner: str
    detached_timeout: float
    outcome_timeout: float = DEFAULT_OUTCOME_TIMEOUT_S

    def dumps(self) -> str:
        return json.dumps({key: getattr(self, key) for key in _ID_KEYS}, separators=(",", ":"))

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> JobId:
        try:
            data = json.loads(value) if isinstance(value, str) else dict(value)
            data.setdefault("outcome_timeout", DEFAULT_OUTCOME_TIMEOUT_S)  # (an id made without it: the default)
            return cls(**{key: data[key] for key in _ID_KEYS})
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{value!r} is not a run's id: give job.id as submit() returned it (JSON with {', '.join(_ID_KEYS)})"
            ) from exc

    def connection(self, token: str | None) -> str:
        """The connection string of the run's server for this user: the token given, else pyspark's own
        (``SPARK_CONNECT_AUTHENTICATE_TOKEN``), never from the id."""
        params = f";user_id={self.user_id}" + (f";token={token}" if token else "")
        return (self.server if "/;" in self.server else self.server + "/") + params

    def describe(self) -> str:
        return f"the {self.runner} run of session {self.session_id} on {self.server}"

    def kept(self) -> str:
        """How long its host keeps the run and its outcome, in words (for the errors of a run that is gone)."""
        return (
            "a run's host releases its session once a client fetched its outcome, or when nobody did within its "
            f"outcome_timeout of {self.outcome_timeout:g}s after the run ended, or when nobody was attached to the "
            f"running run for its detached_timeout of {self.detached_timeout:g}s"
        )


class Job:
    """A run started by ``submit()`` (or found by :func:`attach`), which goes on without this process.

    While attached, the ranks' lines and the runner's messages reach this process's loggers as ``run()``'s do (on
    stderr where the application set up no logging), and progress its ``progress_sink``. :meth:`close` (or
    leaving a ``with``) detaches: the run goes on, and ends itself once nobody has been attached for its
    ``detached_timeout``. A handle that does not ``fetch`` only watches: :meth:`watch` says when the run ended and
    leaves its outcome on the host for a fetching one. A handle of a run whose host has not started yet (its one
    task waits for a task slot) attaches once it has, in :meth:`wait` or :meth:`watch`.
    """

    def __init__(
        self,
        ident: JobId,
        session: SparkSession,
        progress_sink: ProgressSink | None = None,
        logs: bool = True,
        fetch: bool = True,
        on_mlflow_run: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self._ident = ident
        self.id = ident.dumps()
        self._session = session
        self._sink = progress_sink
        self._logs = logs
        self._fetch = fetch
        self._client: LinkClient | None = None  # None: not attached yet (its host has not said where it listens)
        self._host_wait_until = time.monotonic() + HOST_START_TIMEOUT_S
        self._value: Any = None
        self._finished = False
        self._detached = False  # close() came: a wait ends with RunDetachedError, not a re-attach
        self._cancelled = False  # cancel() found no link: the run's operation was interrupted, its sessions released
        #: after the outcome: the metrics history ``{"loss": [(step, value), ...]}``, the last checkpoint, and the
        #: record of each attempt (as ``HorovodRunner.attempts``)
        self.metrics: dict[str, list[tuple[float, float | None]]] = {}
        self.checkpoint: dict[str, Any] | None = None
        self.attempts: list[dict[str, Any]] = []
        #: the run's MLflow run (``mlflow=``), which its host made, once the host said so: its id and UI URL
        self.mlflow_run_id: str | None = None
        self.mlflow_run_url: str | None = None
        self._on_mlflow_run = on_mlflow_run

    def _mlflow_run(self, run_id: str, url: str | None) -> None:
        """The host named the run's MLflow run (each attach hears it again): ``on_mlflow_run`` hears it once."""
        if run_id == self.mlflow_run_id:
            return
        self.mlflow_run_id, self.mlflow_run_url = run_id, url
        if self._on_mlflow_run is not None:
            self._on_mlflow_run(run_id, url)

    def _connect(self, address: LinkAddress, after: int | None = None) -> None:
        """Attach to the host at ``address`` (OSError where it does not take the connection)."""
        from .durable.client import LinkClient

        liveness = Liveness(address.interval_s, address.timeout_s)
        client = LinkClient(address, liveness, self._logs, self._sink, after, self._fetch, self._mlflow_run)
        client.connect()
        self._client = client

    def _reach(self, start_wait: float, after: int | None = None) -> bool:
        """Attach to the run's host where its session says it listens; False when it has not said so within
        ``start_wait`` seconds (:func:`_reach_host` for the errors)."""
        return _reach_host(self._session, self._ident, lambda address: self._connect(address, after), start_wait)

    def wait(self, timeout: float | None = None) -> Any:
        """Rank 0's return value, once the run ended; or the error ``run()`` would raise (RankFailedError naming
        the rank, RunCancelledError, RunStalledError, LaunchError). ``TimeoutError`` after ``timeout`` seconds
        with the run still going on (it goes on). The run's host lets the outcome go once this process holds it."""
        if not self._fetch:
            raise HorovodRunnerError(f"{self._ident.describe()}: this handle only watches (fetch=False): use watch()")
        if not self._finished:
            self._finish(self._until_outcome(timeout))
        return self._value

    def watch(self, timeout: float | None = None) -> JobStatus:
        """Relay the run's lines and progress until it ended, and return its last status (``cause``: what it
        ended with); its outcome stays on the host for a handle that fetches it (:meth:`wait`). The errors of
        :meth:`wait` but the run's own."""
        client = self._until_outcome(timeout)
        assert client.outcome is not None
        error = client.outcome.error
        status = client.status
        size, started, attempt = (status.size, status.ranks_started, status.attempt) if status else (0, 0, 1)
        cause = None if error is None else str(error["message"]).splitlines()[0]
        return JobStatus("ended", started, size, cause, attempt)

    def _until_outcome(self, timeout: float | None) -> LinkClient:
        """The client once the outcome came to it, re-attaching where the link was lost before."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            client = self._client or self._await_host(deadline)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not client.ended.wait(left):
                raise TimeoutError(f"{self._ident.describe()} is still running after {timeout:g}s")
            if client.outcome is not None:
                return client
            if self._cancelled:
                raise self._cancel_error()
            if self._detached:
                raise RunDetachedError(
                    f"{self._ident.describe()}: detached from it (job.close()); it goes on, and attach() finds it "
                    f"again until nobody has been attached for its detached_timeout of "
                    f"{self._ident.detached_timeout:g}s"
                )
            self._reattach(client)

    def _await_host(self, deadline: float | None) -> LinkClient:
        """Attach once the run's host has said where it listens (its one task waits for a task slot, or its
        executor starts Python): ``HOST_START_TIMEOUT_S`` from ``attach()`` at most, then the run is ended, nothing
        of it left, and LaunchError; TimeoutError at ``deadline`` (the run goes on)."""
        if self._cancelled:
            raise self._cancel_error()
        if self._detached:
            raise RunDetachedError(f"{self._ident.describe()}: detached from it (job.close()) before it attached")
        log.info(
            "%s: its host has not started yet (its one task waits for a free task slot, or its executor starts "
            "Python): waiting for it, %.0fs at most",
            self._ident.describe(),
            max(0.0, self._host_wait_until - time.monotonic()),
        )
        until = self._host_wait_until if deadline is None else min(deadline, self._host_wait_until)
        if self._reach(until - time.monotonic()):
            assert self._client is not None
            return self._client
        if time.monotonic() < self._host_wait_until:
            raise TimeoutError(
                f"{self._ident.describe()}: its host has not started yet (its one task waits for a free task slot); "
                "it goes on"
            )
        _end_remains(self._session, self._ident)
        raise LaunchError(
            f"{self._ident.describe()}: its host did not start within {HOST_START_TIMEOUT_S:g}s of attach(): its one "
            "task waited for a free task slot (the cluster's slots are busy), or its executor could not start "
            "Python. The run was ended and nothing of it is left on the server: submit it again."
        )

    def _finish(self, client: LinkClient) -> None:
        """Take the outcome: the run's error raised, or rank 0's value kept; only then is the host told that this
        process holds it (a value that cannot be unpickled here stays on the host for another client)."""
        from .durable.outcome_parts import rebuild_error
        from .shared.messages import unpickle

        outcome = client.outcome
        assert outcome is not None
        self.metrics = {name: [(float(p[0] or 0), p[1]) for p in points] for name, points in outcome.metrics.items()}
        self.checkpoint = None if outcome.checkpoint is None else {"try_number": None, **outcome.checkpoint}
        self.attempts = outcome.attempts
        try:
            if outcome.error is not None:
                error = rebuild_error(outcome.error)
                client.acknowledge()
                raise error
            assert client.result is not None
            self._value = unpickle(client.result)
            self._finished = True
            client.result = None  # (the value is held: its pickle goes)
            client.acknowledge()
        finally:
            self._release()  # (the host releases the run's session once every attached client has the outcome)

    def _reattach(self, lost: LinkClient) -> None:
        """The link ended before the outcome came whole: attach again where the host is (it may be gone, with the
        run), the lines resuming after the last one shown here."""
        try:
            if not self._reach(HOST_START_TIMEOUT_S, after=lost.next_line):
                raise HorovodRunnerError("its session holds no address of its host")
        except HorovodRunnerError as exc:
            raise HorovodRunnerError(f"{self._ident.describe()}: {lost.lost}; {exc}") from None

    def status(self) -> JobStatus:
        """The run's status as its host last said it (it says each change within a second; ``attach()`` returns
        once it has said it); never blocks."""
        client = self._client
        status = None if client is None else client.status
        if client is not None and client.lost is not None and client.outcome is None:
            started, size, attempt = (status.ranks_started, status.size, status.attempt) if status else (0, 0, 1)
            return JobStatus("lost", started, size, client.lost, attempt)
        if status is None:
            return JobStatus("starting", 0, 0)
        return JobStatus(status.phase, status.ranks_started, status.size, status.cause, status.attempt)

    def done(self) -> bool:
        """Whether the outcome is here (then :meth:`wait` returns or raises at once)."""
        return self._finished or (self._client is not None and self._client.outcome is not None)

    def cancel(self) -> None:
        """End the run: every rank is ended within seconds; :meth:`wait` then raises RunCancelledError. Returns
        once the run's host has taken the cancel (its status is "ending" or "ended"), 10 s at most. Without a link
        to its host (not started yet, or not reachable from here), the run's operation is interrupted and its
        sessions released: nothing of it is left."""
        from .durable import link

        client = self._client
        if client is not None and client.outcome is not None:
            return  # (the run is over)
        try:
            if client is None or client.ended.is_set():
                raise OSError("not attached")
            client.send(link.Cancel())
            deadline = time.monotonic() + _CANCEL_CALL_S
            while time.monotonic() < deadline and not client.ended.wait(_FIND_POLL_S):
                if client.status is not None and client.status.phase in ("ending", "ended"):
                    return
        except OSError:
            self._cancelled = True
            _end_remains(self._session, self._ident)

    def _cancel_error(self) -> RunCancelledError:
        return RunCancelledError(
            f"{self._ident.describe()}: cancelled without a link to its host (its operation was interrupted and its "
            "sessions released)"
        )

    def close(self) -> None:
        """Detach from the run (it goes on); a :meth:`wait` or :meth:`watch` in another thread (or the signal
        handler's caller) raises RunDetachedError."""
        self._detached = True
        self._release()

    def _release(self) -> None:
        if self._client is not None:
            self._client.close()
        _close_channel(self._session)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_channel(session: SparkSession) -> None:
    """Close this process's channel to the session (the session stays: it is the run's)."""
    try:
        session.client.close()
    except Exception:  # noqa: BLE001 - closing is best effort (the session may be released already)
        pass


def _session_gone(error: BaseException) -> bool:
    return "SESSION_CLOSED" in str(error) or "SESSION_NOT_FOUND" in str(error)


def _release_ranks(session: SparkSession, ranks_id: str) -> None:
    """Release the ranks' own session (its barrier job ends with it), with this session's connection."""
    from .durable.host import connection_string, open_session, release

    try:
        release(open_session(connection_string(session)[0], ranks_id))
    except Exception:  # noqa: BLE001 - released already (the host's end releases it too)
        pass


def _end_remains(session: SparkSession, ident: JobId) -> None:
    """End what is left of a run on the server: its operation (its host, or a later attempt of the host's task),
    its ranks' session (their barrier job ends with it) and its own session. Each step is best effort: it may be
    gone already."""
    from .driver.launch.spark.connect_client import interrupt_tag
    from .durable.host import release
    from .durable.link import RANKS_CONF

    ranks_id = None
    with contextlib.suppress(Exception):
        ranks_id = session.conf.get(RANKS_CONF, None)
    with contextlib.suppress(Exception):
        interrupt_tag(session, ident.tag, _CANCEL_CALL_S)
    if ranks_id:
        _release_ranks(session, str(ranks_id))
    with contextlib.suppress(Exception):
        release(session)


def _ended(ident: JobId, why: str) -> JobNotFoundError:
    return JobNotFoundError(
        f"{ident.describe()} has ended: {why} ({ident.kept()}); nothing of it is left on the server."
    )


def _look(session: SparkSession, ident: JobId) -> tuple[LinkAddress | HostGone | None, int | None]:
    """What the run's host published in its session, and how many of the session's operations run (None: pyspark
    cannot tell); JobNotFoundError when the session is gone."""
    from .driver.launch.spark.connect_client import running_operations
    from .durable.link import LINK_CONF, published

    try:
        value = session.conf.get(LINK_CONF, None)
        running = running_operations(session)
    except Exception as exc:
        if _session_gone(exc):
            raise _ended(ident, "its Spark Connect session was closed") from None
        raise
    return published(value), running


def _reach_host(session: SparkSession, ident: JobId, connect: Callable[[LinkAddress], None], start_wait: float) -> bool:
    """``connect`` to the run's host where its session says it listens; False when it has not said so within
    ``start_wait`` seconds while its operation is there (its one task waits for a task slot, or starts).

    JobNotFoundError when nothing of the run is left, having ended what was (:func:`_end_remains`): its session
    was closed, its host could not start, its host's operation is no longer running, or a later attempt of the
    host's task marked it lost and its first host does not answer here either. HorovodRunnerError when its host
    does not take the connection while Spark still runs it, for ``HOST_UNREACHABLE_WAIT_S``: no route from here,
    or a loss Spark has not noticed yet.
    """
    from .durable.link import HostGone, LinkAddress

    start_over = time.monotonic() + start_wait
    unanswered: tuple[float, OSError] | None = None
    while True:
        value, running = _look(session, ident)
        if isinstance(value, HostGone) and not value.lost:
            _end_remains(session, ident)
            raise JobNotFoundError(
                f"{ident.describe()}: its host could not start: {value.cause}. Nothing of it is left on the server."
            )
        if isinstance(value, HostGone) and (value.was is None or running == 0):  # lost, no first host to try
            _end_remains(session, ident)
            raise _ended(ident, value.cause)
        if running == 0:
            _end_remains(session, ident)  # (for an unknown id: the empty session this look opened)
            if value is None:
                raise JobNotFoundError(
                    f"There is no run with the id {ident.dumps()}: its session {ident.session_id} on {ident.server} "
                    "holds no run (the id is of another server or user, or the run ended long ago)."
                )
            raise _ended(ident, "its host's operation is no longer running (its task failed, or its executor was lost)")
        address = value if isinstance(value, LinkAddress) else value.was if value is not None else None
        if address is not None:
            try:
                connect(address)
                return True
            except OSError as exc:
                unanswered = unanswered or (time.monotonic(), exc)
        if isinstance(value, HostGone):  # lost, and its first host does not answer here either
            _end_remains(session, ident)
            raise _ended(ident, value.cause)
        if unanswered is not None and time.monotonic() - unanswered[0] > HOST_UNREACHABLE_WAIT_S:
            assert address is not None
            raise HorovodRunnerError(
                f"{ident.describe()}: its host at {address.host}:{address.port} does not take this process's "
                f"connection ({unanswered[1]}), while Spark still runs it after {HOST_UNREACHABLE_WAIT_S:g}s: this "
                "process needs a route to the cluster's executors to attach (docs/durable-runs.md), or the host's "
                "executor was lost and Spark has not noticed yet (an attach once it has finds the run ended)."
            )
        if address is None and time.monotonic() >= start_over:
            return False
        time.sleep(_FIND_POLL_S)


def attach(
    job_id: str | Mapping[str, Any],
    *,
    token: str | None = None,
    progress_sink: ProgressSink | None = None,
    logs: bool = True,
    fetch: bool = True,
    on_mlflow_run: Callable[[str, str | None], None] | None = None,
) -> Job:
    """The handle of a submitted run, in any process, from its ``job.id``.

    :param token: the Spark Connect server's token, when it takes one (else pyspark's own setting,
        ``SPARK_CONNECT_AUTHENTICATE_TOKEN``); the id holds none.
    :param progress_sink: where the run's metrics and checkpoints go while attached.
    :param logs: relay the ranks' lines and the runner's messages to this process's loggers (they resume after
        the last line any client relayed); False for a client that only cancels or waits.
    :param fetch: False for a handle that only watches the run (:meth:`Job.watch`) and leaves its outcome to a
        later one (Airflow's trigger, then the task resumed on a worker); it never downloads rank 0's value.
    :param on_mlflow_run: called with the run's MLflow run id and UI URL (None where there is none) once its
        host names it, for a run with ``mlflow=`` (also ``job.mlflow_run_id`` and ``job.mlflow_run_url``).

    Returns once attached, with the run's status (:meth:`Job.status`); for a run whose host has not started yet
    (its one task waits for a task slot), a handle that attaches once it has (:meth:`Job.wait`). Raises
    :class:`JobNotFoundError` when nothing of the run is left on the server (it ended: its outcome fetched, or
    kept for its ``outcome_timeout``; its host lost; or the id is unknown): a new run may be started safely. A
    :class:`HorovodRunnerError` when its host cannot be reached from here; ValueError for what is not a run's id.
    """
    from .durable.host import open_session

    ident = JobId.parse(job_id)
    session = open_session(ident.connection(token), ident.session_id)
    job = Job(ident, session, progress_sink, logs, fetch, on_mlflow_run)
    try:
        job._reach(0.0)
    except BaseException:
        _close_channel(session)
        raise
    return job
