"""The run's MLflow run, made by the driver when a runner has ``mlflow`` set (docs/mlflow-openlineage.md).

One MLflow run per ``run()``: created before the ranks start (its id goes to rank 0's environment, with the
driver's MLflow credentials, so that ``mlflow.log_*`` and ``mlflow.autolog()`` there log into it; credentials
never show in a log line or a link), fed the metrics rank's ``log_metrics`` reports and
the checkpoints reported, and ended with the run: FINISHED, FAILED (tag ``hvd.failure``) or KILLED (cancelled).
Every MLflow call is made on one thread, ``hvd-mlflow-writer`` (:mod:`.writer`), and the driver waits on it a
bounded time only: a tracking server that is down, hangs or fails costs the run one warning, never its
training. MLflow (the ``mlflow`` extra) is imported only when a runner asks for it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from ...errors import RunCancelledError
from ...mlflow_settings import (
    EXPERIMENT_ID_ENV,
    EXPERIMENT_NAME_ENV,
    MASKED,
    PASSWORD_ENV,
    RUN_ID_ENV,
    TRACKING_URI_ENV,
    USERNAME_ENV,
    MlflowSettings,
    auth_env,
    credentials,
    import_mlflow,
    shown_uri,
    user_info,
    without_user,
)
from ...settings import describe_checkpoint
from ...shared.messages import Checkpoint, Message, Metrics
from ...shared.timing import FINAL_WRITE_S
from .writer import BoundedWriter

log = logging.getLogger("airflow_provider_hvd.runner")

# A tracking server's address that takes longer than this to accept a connection is taken as unreachable.
MLFLOW_CONNECT_S = 3.0
# The run's start waits this long for its MLflow run to be created; later, the run goes on without one (and the
# MLflow run, once created, is ended KILLED at once).
START_WAIT_S = 10.0
# The metrics are sent at most once every this many seconds (and what is left at the run's end).
BATCH_EVERY_S = 3.0
_BATCH_MAX = 1000  # MLflow's most metrics (and entities) in one log_batch
_MAX_DUE = 100_000  # metric points waiting for a tracking server that does not take them: past this, dropped
_VALID_NAME = re.compile(r"^[/\w.\- :]+$")  # the metric names MLflow accepts
_TAG_MAX = 5000  # a tag value's most characters here (MLflow takes 8,000)
_ATTEMPT_TEXT_MAX = 1000  # an attempt's cause and checkpoint, each, in its tag
RESTARTS_METRIC = "hvd.restarts"  # a restarted run's restarts so far (its step: their count)


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI, for an http(s) tracking server (without the URI's user and password)."""
    if urllib.parse.urlsplit(tracking_uri).scheme not in ("http", "https"):
        return None
    return f"{without_user(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _absolute(uri: str) -> str:
    """A local store's URI with an absolute path (rank 0 may run in another directory)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file://" + os.path.abspath(uri[len("file:") :])
    if "://" not in uri and ":" not in uri.split("/", 1)[0]:
        return os.path.abspath(uri)
    return uri


def resolved_tracking_uri(settings: MlflowSettings) -> str:
    """The tracking server a run's MLflow run goes to: its settings', else MLflow's of this process (its
    ``MLFLOW_TRACKING_URI``, else its default), a local store's path made absolute."""
    return _absolute(settings.tracking_uri or import_mlflow().get_tracking_uri())


def _unreachable(tracking_uri: str) -> str | None:
    """Why an http(s) tracking server cannot be reached (a connection within ``MLFLOW_CONNECT_S``), or None."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=MLFLOW_CONNECT_S).close()
    except OSError as exc:
        return f"no connection to {parts.hostname}:{port} within {MLFLOW_CONNECT_S:g}s ({exc})"
    return None


def attempt_tag(record: Mapping[str, Any]) -> str:
    """An attempt's record (``HorovodRunner.attempts``') as its tag's value: JSON, the checkpoint it resumed
    from in words, its cause and checkpoint bounded."""
    point = record.get("resumed_from")
    cause = record.get("cause")
    shown = {
        **record,
        "cause": None if cause is None else str(cause)[:_ATTEMPT_TEXT_MAX],
        "resumed_from": None if point is None else describe_checkpoint(point)[:_ATTEMPT_TEXT_MAX],
    }
    return json.dumps(shown, default=str)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:_TAG_MAX]


class MlflowRun:
    """One runner run's MLflow run; a context manager around the run, which ends it as the run ended.

    :meth:`start` creates it (waiting at most ``START_WAIT_S``); :meth:`take` gets the ranks' reports (from the
    channel's thread), :meth:`rank_env` the ranks' environment; leaving the ``with`` ends it, waiting at most
    ``FINAL_WRITE_S``. The tracking server's errors never raise into the run: they are one warning.
    """

    def __init__(
        self,
        settings: MlflowSettings,
        runner: str,
        size: int,
        params: Mapping[str, Any],
        spark_app_id: str | None = None,
        metrics_rank: int = 0,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics_rank = metrics_rank
        self.params = {key: str(value)[:_TAG_MAX] for key, value in params.items()}
        self.tags = {
            **settings.tags,
            "hvd.runner": runner,
            "hvd.np": str(size),
            **({"hvd.spark_app_id": spark_app_id} if spark_app_id else {}),
            **({"hvd.previous_run_id": settings.previous_run_id} if settings.previous_run_id else {}),
        }
        self.run_id: str | None = None
        self.url: str | None = None
        self.tracking_uri: str | None = None  # as given: never shown (it may hold a password), see _shown
        self.experiment_id: str | None = None
        self._secrets: list[str] = []  # the tracking server's credentials, never shown
        self._client: Any = None
        self._lock = threading.Lock()
        self._metrics: list[Any] = []  # mlflow.entities.Metric, due
        self._tags: dict[str, str] = {}  # due
        self._created = threading.Event()
        self._gave_up = False  # the start waited too long: the run goes on without MLflow
        self._status: tuple[str, str | None] | None = None  # (status, failure) once the run ended
        self._warned = False
        self._skipped_names: set[str] = set()
        self._dropped = 0
        self._attempt_tags: dict[str, str] = {}  # the attempts' tags queued so far (only a change is sent again)
        self._writer = BoundedWriter(threading.Thread(target=self._write_loop, name="hvd-mlflow-writer", daemon=True))

    # -- the driver's side ---------------------------------------------------------------------------------

    def start(self) -> bool:
        """Create the run (on the writer thread), waiting at most ``START_WAIT_S``; whether there is one."""
        self.tracking_uri = resolved_tracking_uri(self.settings)
        self._secrets = credentials(self.tracking_uri)
        uri = shown_uri(self.tracking_uri)
        why = _unreachable(self.tracking_uri)
        if why is not None:
            self._warn_once(f"the MLflow tracking server {uri} is unreachable: {why}; the run goes on without MLflow")
            return False
        self._writer.start()
        self._created.wait(START_WAIT_S)
        with self._lock:  # (the writer reads it once the run is created: a late one is ended at once)
            self._gave_up = missing = self.run_id is None
        if missing:
            if not self._warned:
                self._warn_once(
                    f"the MLflow tracking server {uri} did not create the run within {START_WAIT_S:g}s; the run "
                    "goes on without MLflow"
                )
            return False
        run_id, experiment_id = self.run_id, self.experiment_id
        assert run_id is not None and experiment_id is not None
        self.url = run_url(self.tracking_uri, experiment_id, run_id)
        log.info("%s: MLflow run %s%s", self.runner, self.run_id, f" at {self.url}" if self.url else f" in {uri}")
        if self.settings.on_start is not None:
            try:
                self.settings.on_start(run_id, self.url)
            except Exception:  # noqa: BLE001 - the caller's hook must not stop the training
                log.exception("%s: the MLflow run's on_start failed", self.runner)
        return True

    def rank_env(self, rank: int) -> dict[str, str]:
        """Rank 0 logs into the run (``mlflow.log_*``, ``mlflow.autolog()``) with the driver's MLflow credentials
        (:data:`AUTH_ENV`: they go to it over the run's channel, as its whole environment does); the other ranks
        get nothing."""
        if rank != 0 or self.run_id is None or self.tracking_uri is None or self.experiment_id is None:
            return {}
        uri, auth = self.tracking_uri, auth_env()
        parts = user_info(uri)
        if parts is not None and ":" in parts[1] and urllib.parse.urlsplit(uri).scheme in ("http", "https"):
            # MLflow prints an http(s) run's URL as the run ends ("View run ... at <tracking URI>/#/..."): the URI's
            # user and password go to MLflow's basic-auth settings instead, which it sends the same way (and which
            # win over the URI's where both are set, as for the driver's client)
            uri = without_user(uri)
            if not (auth.get(USERNAME_ENV) and auth.get(PASSWORD_ENV)):
                user, _, password = parts[1].partition(":")
                auth.update({USERNAME_ENV: urllib.parse.unquote(user), PASSWORD_ENV: urllib.parse.unquote(password)})
        return {**auth, RUN_ID_ENV: self.run_id, TRACKING_URI_ENV: uri, EXPERIMENT_ID_ENV: self.experiment_id}

    def take(self, rank: int | None, message: Message) -> None:
        """A rank's report (the channel's thread): the metrics rank's metrics, every checkpoint; never raises."""
        if self.run_id is None:
            return
        try:
            if isinstance(message, Metrics) and rank == self.metrics_rank:
                self._add_metrics(message)
            elif isinstance(message, Checkpoint):
                tags = {
                    "hvd.checkpoint.path": message.path,
                    "hvd.checkpoint.rank": str(rank),
                    "hvd.checkpoint.info": json.dumps(message.info, default=str)[:_TAG_MAX],
                }
                with self._lock:
                    self._tags.update(tags)
        except Exception:  # noqa: BLE001
            log.debug("%s: could not take a report for MLflow", self.runner, exc_info=True)

    def take_attempts(self, records: list[dict[str, Any]]) -> None:
        """The record of each attempt (the run's controller, as each attempt starts and ends), once the run has
        restarted: the metric ``hvd.restarts`` (the restarts so far) and a tag per attempt, ``hvd.attempt.<n>``
        (:func:`attempt_tag`); never raises."""
        if self.run_id is None or len(records) < 2:
            return
        try:
            from mlflow.entities import Metric

            restarts = len(records) - 1
            tags = {f"hvd.attempt.{record['attempt']}": attempt_tag(record) for record in records}
            with self._lock:
                changed = {key: value for key, value in tags.items() if self._attempt_tags.get(key) != value}
                if f"hvd.attempt.{restarts + 1}" not in self._attempt_tags:  # (this attempt's first word)
                    self._metrics.append(Metric(RESTARTS_METRIC, restarts, int(time.time() * 1000), restarts))
                self._attempt_tags.update(changed)
                self._tags.update(changed)
        except Exception:  # noqa: BLE001
            log.debug("%s: could not take the attempts for MLflow", self.runner, exc_info=True)

    def _add_metrics(self, message: Metrics) -> None:
        from mlflow.entities import Metric

        at, step = int(message.time * 1000), int(message.step)
        metrics = []
        for name, value in message.values.items():
            if not _VALID_NAME.match(name):
                if name not in self._skipped_names:
                    self._skipped_names.add(name)
                    log.warning("%s: the metric %r is not an MLflow metric name: it is not sent", self.runner, name)
                continue
            try:
                number = float("nan") if value is None else float(value)
            except (TypeError, ValueError, OverflowError):
                if name not in self._skipped_names:
                    self._skipped_names.add(name)
                    log.warning("%s: the metric %r is %r, not a number: it is not sent", self.runner, name, value)
                continue
            metrics.append(Metric(name, number, at, step))
        with self._lock:
            room = max(0, _MAX_DUE - len(self._metrics))
            self._metrics.extend(metrics[:room])
            dropped, self._dropped = self._dropped, self._dropped + max(0, len(metrics) - room)
        if self._dropped and not dropped:
            log.warning(
                "%s: %d metric points wait for the MLflow tracking server %s: those reported past them are not sent",
                self.runner,
                _MAX_DUE,
                self._shown(self.tracking_uri or ""),
            )

    def end(self, error: BaseException | None) -> None:
        """End the run as the runner's run ended: FINISHED, FAILED (``hvd.failure``) or KILLED (a cancel, an
        interrupt); waits at most ``FINAL_WRITE_S`` for the tracking server."""
        if not self._writer.started:
            return
        if error is None:
            status: tuple[str, str | None] = ("FINISHED", None)
        elif isinstance(error, RunCancelledError) or not isinstance(error, Exception):
            status = ("KILLED", _first_line(error))
        else:
            status = ("FAILED", _first_line(error))
        with self._lock:
            self._status = status
        if not self._writer.close(FINAL_WRITE_S) and self.run_id is not None:
            self._warn_once(
                f"the MLflow tracking server {self.tracking_uri} did not answer within {FINAL_WRITE_S:g}s of the "
                f"run's end: the MLflow run {self.run_id} may miss its last metrics and stay RUNNING"
            )

    def __enter__(self) -> MlflowRun:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.end(error)

    def _warn_once(self, text: str) -> None:
        with self._lock:
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("%s: %s", self.runner, self._shown(text))

    def _shown(self, text: str) -> str:
        """``text`` without the credentials of the tracking server (MLflow's errors may hold its URI)."""
        if self.tracking_uri:
            text = text.replace(self.tracking_uri, shown_uri(self.tracking_uri))
        for secret in self._secrets:
            text = text.replace(secret, MASKED)
        return text

    # -- the writer thread ----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        writer = self._writer
        try:
            self._create()
        except Exception as exc:  # noqa: BLE001 - the training goes on without MLflow
            self._warn_once(
                f"could not create the MLflow run in {self.tracking_uri}: {exc!r}; the run goes on without MLflow"
            )
            self._created.set()
            return
        with self._lock:
            late = self._gave_up
        self._created.set()
        if late:
            why = f"created after the run's start gave up on it ({START_WAIT_S:g}s): the run went on without MLflow"
            self._call("end the late MLflow run", lambda: self._client.set_tag(self.run_id, "hvd.failure", why))
            self._call("end the late MLflow run", lambda: self._client.set_terminated(self.run_id, "KILLED"))
            return
        if self.settings.previous_run_id:
            self._call("end the previous try's MLflow run", self._end_previous)
        while True:
            writer.wait(BATCH_EVERY_S)
            if not writer.closing:
                self._send_due()
                continue
            with self._lock:
                status, failure = self._status or ("FINISHED", None)
                if failure is not None:
                    self._tags["hvd.failure"] = failure
            self._send_due()  # the last metrics, and the failure's tag: then the status, last
            self._call(
                f"end the MLflow run {status}", functools.partial(self._client.set_terminated, self.run_id, status)
            )
            return

    def _create(self) -> None:
        from mlflow.entities import Param

        # made here: MLflow's client opens its store at once (a local database is created and migrated; an unknown
        # scheme raises)
        self._client = import_mlflow().MlflowClient(self.tracking_uri)
        experiment_id = self._experiment_id()
        run = self._client.create_run(experiment_id, tags=self.tags, run_name=self.settings.run_name)
        params = [Param(key, value) for key, value in self.params.items()]
        with self._lock:
            self.experiment_id = experiment_id
            self.run_id = run.info.run_id
        self._call("log the runner's settings", lambda: self._client.log_batch(self.run_id, params=params))

    def _experiment_id(self) -> str:
        name = self.settings.experiment_name or os.environ.get(EXPERIMENT_NAME_ENV)
        if not name:
            return os.environ.get(EXPERIMENT_ID_ENV) or "0"  # MLflow's default experiment
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self._client.create_experiment(name))
        except Exception:  # another run created it meanwhile
            experiment = self._client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def _end_previous(self) -> None:
        previous = self._client.get_run(self.settings.previous_run_id)
        if previous.info.status == "RUNNING":
            self._client.set_tag(
                previous.info.run_id, "hvd.ended_by", f"its try ended without closing it; run {self.run_id} followed it"
            )
            self._client.set_terminated(previous.info.run_id, "KILLED")

    def _send_due(self) -> None:
        from mlflow.entities import RunTag

        with self._lock:
            metrics, self._metrics = self._metrics, []
            tags, self._tags = [RunTag(key, value) for key, value in self._tags.items()], {}
        if not metrics and not tags:
            return
        # one call for all (MLflow takes at most _BATCH_MAX entities a call): the tags ride with the first metrics
        first = _BATCH_MAX - len(tags)
        chunks = [metrics[:first], *(metrics[i : i + _BATCH_MAX] for i in range(first, len(metrics), _BATCH_MAX))]
        for i, chunk in enumerate(chunks):
            send = functools.partial(self._client.log_batch, self.run_id, metrics=chunk, tags=tags if i == 0 else ())
            self._call("log the metrics" if chunk else "record the tags", send)

    def _call(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - MLflow is best effort: the training goes on
            self._warn_once(
                f"could not {what} in the MLflow run {self.run_id} ({self.tracking_uri}): {exc!r}; the training "
                "goes on (later MLflow errors of this run are logged at DEBUG)"
            )
            log.debug("%s: could not %s: %s", self.runner, what, self._shown(traceback.format_exc()))


def start_mlflow_run(
    settings: MlflowSettings | None,
    runner: str,
    size: int,
    params: Mapping[str, Any],
    spark_app_id: str | None,
    metrics_rank: int,
) -> MlflowRun | None:
    """The run's MLflow run, created; None when ``settings`` is None or the tracking server did not make it
    (one warning said so)."""
    if settings is None:
        return None
    started = time.monotonic()
    mlflow_run = MlflowRun(settings, runner, size, params, spark_app_id, metrics_rank)
    try:
        created = mlflow_run.start()
    except BaseException as error:  # an interrupt, or on_start's: the run (maybe made by now) ends KILLED/FAILED
        mlflow_run.end(error)
        raise
    if created:
        log.debug("%s: the MLflow run was created in %.1fs", runner, time.monotonic() - started)
        return mlflow_run
    return None
