"""A submitted run's handle (``submit()`` returns one, :func:`attach` gives one in any process): its id, its
outcome, status, cancel, and the ranks' lines relayed while attached. See docs/durable-runs.md."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import HorovodRunnerError, JobNotFoundError, RunDetachedError
from .shared.liveness import Liveness
from .shared.timing import HOST_START_TIMEOUT_S

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

    from .durable.client import LinkClient
    from .durable.link import LinkAddress
    from .settings import ProgressSink

_ID_KEYS = ("server", "session_id", "user_id", "tag", "runner", "detached_timeout")
_FIND_POLL_S = 0.25
_CANCEL_CALL_S = 10.0
_HOST_END_WAIT_S = 15.0  # a host that is ending releases its session within its 10 s release call


@dataclass(frozen=True)
class JobStatus:
    """Where a submitted run is: ``phase`` is ``"starting"`` (agents saying hello), ``"running"``, ``"ending"``
    (a cause was recorded, or every rank returned), ``"ended"`` (the outcome is known), or ``"lost"`` (this
    client's link to the run's host ended before its outcome came); ``cause``: the first line of the error the
    run ended with, or why the link was lost."""

    phase: str
    ranks_started: int
    size: int
    cause: str | None = None

    @property
    def ended(self) -> bool:
        return self.phase == "ended"


@dataclass(frozen=True)
class JobId:
    """What ``job.id`` holds (as compact JSON): the Connect server's URL without token, the run's session id, the
    user id it was opened with, its operation tag, the runner and the lease. No secret."""

    server: str
    session_id: str
    user_id: str
    tag: str
    runner: str
    detached_timeout: float

    def dumps(self) -> str:
        return json.dumps({key: getattr(self, key) for key in _ID_KEYS}, separators=(",", ":"))

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> JobId:
        try:
            data = json.loads(value) if isinstance(value, str) else dict(value)
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


class Job:
    """A run started by ``submit()`` (or found by :func:`attach`), which goes on without this process.

    While attached, the ranks' lines and the runner's messages reach this process's loggers as ``run()``'s do,
    and progress its ``progress_sink``. :meth:`close` (or leaving a ``with``) detaches: the run goes on, and ends
    itself once nobody has been attached for its ``detached_timeout``. A handle that does not ``fetch`` only
    watches: :meth:`watch` says when the run ended and leaves its outcome on the host for a fetching one.
    """

    def __init__(
        self,
        ident: JobId,
        session: SparkSession,
        address: LinkAddress,
        progress_sink: ProgressSink | None = None,
        logs: bool = True,
        fetch: bool = True,
        on_mlflow_run: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self._ident = ident
        self.id = ident.dumps()
        self._session = session
        self._address = address
        self._sink = progress_sink
        self._logs = logs
        self._fetch = fetch
        self._client: LinkClient | None = None
        self._value: Any = None
        self._finished = False
        self._detached = False  # close() came: a wait ends with RunDetachedError, not a re-attach
        #: after the outcome: the metrics history ``{"loss": [(step, value), ...]}`` and the last checkpoint
        self.metrics: dict[str, list[tuple[float, float | None]]] = {}
        self.checkpoint: dict[str, Any] | None = None
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

    def _connect(self, after: int | None = None) -> None:
        from .durable.client import LinkClient

        liveness = Liveness(self._address.interval_s, self._address.timeout_s)
        client = LinkClient(self._address, liveness, self._logs, self._sink, after, self._fetch, self._mlflow_run)
        client.connect()
        self._client = client
        client.heard.wait()  # (the run's status is among the host's first frames: status() is the host's from now on)

    def wait(self, timeout: float | None = None) -> Any:
        """Rank 0's return value, once the run ended; or the error ``run()`` would raise (RankFailedError naming
        the rank, RunCancelledError, RunStalledError, LaunchError). ``TimeoutError`` after ``timeout`` seconds
        with the run still going on (it goes on)."""
        from .driver.watch.channel import rank_logs_visible

        if not self._fetch:
            raise HorovodRunnerError(f"{self._ident.describe()}: this handle only watches (fetch=False): use watch()")
        with rank_logs_visible():
            if not self._finished:
                self._finish(self._until_outcome(timeout))
        return self._value

    def watch(self, timeout: float | None = None) -> JobStatus:
        """Relay the run's lines and progress until it ended, and return its last status (``cause``: what it
        ended with); its outcome stays on the host for a handle that fetches it (:meth:`wait`). The errors of
        :meth:`wait` but the run's own."""
        from .driver.watch.channel import rank_logs_visible

        with rank_logs_visible():
            client = self._until_outcome(timeout)
        assert client.outcome is not None
        error = client.outcome.error
        size = client.status.size if client.status is not None else 0
        started = client.status.ranks_started if client.status is not None else 0
        return JobStatus("ended", started, size, None if error is None else str(error["message"]).splitlines()[0])

    def _until_outcome(self, timeout: float | None) -> LinkClient:
        """The client once the outcome came to it, re-attaching where the link was lost before."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            client = self._require_client()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not client.ended.wait(left):
                raise TimeoutError(f"{self._ident.describe()} is still running after {timeout:g}s")
            if client.outcome is not None:
                return client
            if self._detached:
                raise RunDetachedError(
                    f"{self._ident.describe()}: detached from it (job.close()); it goes on, and attach() finds it "
                    f"again until nobody has been attached for its detached_timeout of "
                    f"{self._ident.detached_timeout:g}s"
                )
            left = HOST_START_TIMEOUT_S if deadline is None else max(0.0, deadline - time.monotonic())
            self._reattach(client, min(HOST_START_TIMEOUT_S, left))

    def _finish(self, client: LinkClient) -> None:
        from .durable.outcome_parts import rebuild_error
        from .shared.messages import unpickle

        outcome = client.outcome
        assert outcome is not None
        self._release()  # the host releases the run's session now: nothing here is needed any more
        self.metrics = {name: [(float(p[0] or 0), p[1]) for p in points] for name, points in outcome.metrics.items()}
        self.checkpoint = None if outcome.checkpoint is None else {"try_number": None, **outcome.checkpoint}
        if outcome.error is not None:
            raise rebuild_error(outcome.error)
        assert client.result is not None
        self._value = unpickle(client.result)
        self._finished = True

    def _reattach(self, lost: LinkClient, timeout: float) -> None:
        """The link ended before the outcome: attach again where the host is (it may be gone, with the run)."""
        try:
            self._address = find_link(self._session, self._ident, timeout)
            self._connect(after=lost.next_line)
        except JobNotFoundError as exc:
            raise HorovodRunnerError(f"{self._ident.describe()}: {lost.lost}; {exc}") from None
        except OSError as exc:
            raise HorovodRunnerError(
                f"{self._ident.describe()}: {lost.lost}, and its host at {self._address.host}:{self._address.port} "
                f"cannot be reached again ({exc}): the run ended with its host (its ranks end once they lose it)"
            ) from None

    def status(self) -> JobStatus:
        """The run's status as its host last said it (it says each change within a second); never blocks."""
        client = self._client
        status = None if client is None else client.status
        if client is not None and client.lost is not None and client.outcome is None:
            started, size = (status.ranks_started, status.size) if status else (0, 0)
            return JobStatus("lost", started, size, client.lost)
        if status is None:
            return JobStatus("starting", 0, 0)
        return JobStatus(status.phase, status.ranks_started, status.size, status.cause)

    def done(self) -> bool:
        """Whether the outcome is here (then :meth:`wait` returns or raises at once)."""
        return self._finished or (self._client is not None and self._client.outcome is not None)

    def cancel(self) -> None:
        """End the run: every rank is ended within seconds; :meth:`wait` then raises RunCancelledError. Returns
        once the run's host has taken the cancel (its status is "ending" or "ended"), 10 s at most."""
        from .durable import link

        client = self._client
        try:
            if client is None or client.ended.is_set():
                raise OSError("not attached")
            client.send(link.Cancel())
            deadline = time.monotonic() + _CANCEL_CALL_S
            while time.monotonic() < deadline and not client.ended.wait(_FIND_POLL_S):
                if client.status is not None and client.status.phase in ("ending", "ended"):
                    return
        except OSError:  # no link: the run's operation is interrupted, and its ranks' session released
            from .driver.launch.spark.connect_client import interrupt_tag
            from .durable.link import RANKS_CONF

            ranks_id = self._session.conf.get(RANKS_CONF, None)
            interrupt_tag(self._session, self._ident.tag, _CANCEL_CALL_S)
            if ranks_id:
                _release_ranks(self._session, str(ranks_id))

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

    def _require_client(self) -> LinkClient:
        if self._client is None:
            self._connect()
        assert self._client is not None
        return self._client


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


def _ended(ident: JobId, why: str) -> JobNotFoundError:
    return JobNotFoundError(
        f"{ident.describe()} has ended: {why} (a run's host releases its session once its outcome was fetched, "
        f"or once nobody was attached for its detached_timeout of {ident.detached_timeout:g}s); nothing of it is "
        "left on the server."
    )


def _unreachable(session: SparkSession, ident: JobId, address: LinkAddress, exc: OSError) -> HorovodRunnerError:
    """The error for a host that published its link but does not take the connection: a run whose host is
    ending releases its session within moments (then it has ended); otherwise its host cannot be reached."""
    deadline = time.monotonic() + _HOST_END_WAIT_S
    while time.monotonic() < deadline:
        try:
            session.conf.get("spark.app.id", None)
        except Exception as error:  # noqa: BLE001 - the session's end is what is looked for
            if _session_gone(error):
                return _ended(ident, "its Spark Connect session was closed")
            break
        time.sleep(_FIND_POLL_S)
    return HorovodRunnerError(
        f"{ident.describe()}: its host at {address.host}:{address.port} cannot be reached from here ({exc}): this "
        "process needs a route to the cluster's executors to attach."
    )


def find_link(session: SparkSession, ident: JobId, timeout: float) -> LinkAddress:
    """Where the run's host is, from its session's conf; JobNotFoundError when the run ended or is unknown."""
    from .driver.launch.spark.connect_client import running_operations
    from .durable.host import release
    from .durable.link import HOST_LOST, LINK_CONF, LinkAddress

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = session.conf.get(LINK_CONF, None)
            running = running_operations(session)
        except Exception as exc:
            if _session_gone(exc):
                raise _ended(ident, "its Spark Connect session was closed") from None
            raise
        if value == HOST_LOST or (running == 0 and value):
            release(session)  # (what is left of the run: its operation has failed, or fails now)
            why = "its host's operation is no longer running (its executor was lost)"
            if value == HOST_LOST:
                why = "its host was lost (its task or executor failed) and the run is not started again"
            raise _ended(ident, why)
        if running == 0:
            release(session)  # the empty session this look-up opened
            raise JobNotFoundError(
                f"There is no run with the id {ident.dumps()}: its session {ident.session_id} on {ident.server} "
                "holds no run (the id is of another server or user, or the run ended long ago)."
            )
        if value:
            return LinkAddress.from_conf(str(value))
        if time.monotonic() > deadline:
            raise JobNotFoundError(
                f"{ident.describe()} did not publish where its host listens within {timeout:g}s: its one task waits "
                "for a free task slot, or its executor cannot start Python."
            )
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
        later one (Airflow's trigger, then the task resumed on a worker).
    :param on_mlflow_run: called with the run's MLflow run id and UI URL (None where there is none) once its
        host names it, for a run with ``mlflow=`` (also ``job.mlflow_run_id`` and ``job.mlflow_run_url``).

    Returns once the run's host said where the run is: ``job.status()`` is the host's (``ended``, with the
    ``cause`` of a failed run, for a run whose outcome it still holds). Raises :class:`JobNotFoundError` for an
    ended run (its session released) or an unknown id, and ValueError for what is not a run's id.
    """
    from .durable.host import open_session

    ident = JobId.parse(job_id)
    session = open_session(ident.connection(token), ident.session_id)
    try:
        address = find_link(session, ident, HOST_START_TIMEOUT_S)
        job = Job(ident, session, address, progress_sink, logs, fetch, on_mlflow_run)
        try:
            job._connect()
        except OSError as exc:
            raise _unreachable(session, ident, address, exc) from None
    except BaseException:
        _close_channel(session)
        raise
    return job
