"""HorovodRunner: the API of Databricks' ``sparkdl.HorovodRunner``, on open-source Horovod and Spark."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Unpack

from .driver.launch.local import LocalLauncher
from .driver.launch.spark.barrier import SparkLauncher
from .driver.launch.spark.cluster import active_session, session_conf
from .driver.launch.spark.encryption import spark_encrypts, warn_if_spark_encrypted
from .driver.restarts.controller import KeptJob, RunController
from .driver.restarts.policy import RestartPolicy
from .driver.tracking.mlflow_run import MlflowRun, resolved_tracking_uri, start_mlflow_run
from .driver.tracking.progress import RunProgress
from .driver.watch.channel import rank_logs_visible
from .errors import JobRefusedError, RunCancelledError, SettingError, SettingTypeError
from .mlflow_settings import MlflowSettings, auth_env, import_mlflow
from .settings import RunOptions, RunSettings, describe_checkpoint, takes_run_settings
from .shared.liveness import Liveness, liveness_settings, warn_if_gloo_first
from .shared.messages import unpickle
from .shared.naming import HOROVOD_RUNNER, RunnerNaming
from .shared.payload import WARN_BYTES, dumps_job

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .driver.launch.launcher import Launcher
    from .driver.ranks.kind import RankKind
    from .driver.watch.supervisor import Supervisor
    from .durable.dataframe_recipe import DataFrameRecipe
    from .durable.link import Credentials
    from .jobs import Job


def _supervisor_class() -> type[Supervisor]:
    """The driver's supervisor, imported when a run starts (not when the runner is)."""
    from .driver.watch.supervisor import Supervisor

    return Supervisor


log = logging.getLogger("airflow_provider_hvd.runner")


def _conf_and_tls(spark: SparkSession) -> tuple[Callable[[str], str | None], bool]:
    """The session's Spark conf getter, and whether the driver channel is TLS (when Spark encrypts its own)."""
    conf = session_conf(spark)
    return conf, spark_encrypts(conf) is not None


@dataclass
class _Run:
    """One run in progress; ``cancel()`` sets its flag (a plain attribute: safe in a signal handler)."""

    cancelled: bool = False
    dataframe: DataFrame | None = None  # a run on a DataFrame: its rows go into the ranks' shards


def check_dataframe(df: Any, naming: RunnerNaming, method: str) -> None:
    """TypeError unless ``df`` is a Spark DataFrame (classic or Spark Connect)."""
    from pyspark.sql import DataFrame  # (Spark Connect's DataFrame is one too)

    if not isinstance(df, DataFrame):
        raise SettingTypeError(
            f"{naming.runner}.{method} takes a Spark DataFrame (of the session the run uses), not "
            f"{type(df).__name__}: make one with spark.table(...), spark.read..., or spark.createDataFrame(...)"
        )


class _Runner:
    """The run path that :class:`HorovodRunner` and ``TorchDistributor`` share: one supervised run of ``main``
    on the ranks of the launcher and the rank kind each of them gives (:mod:`.driver.ranks`). Each run's
    texts name the runner and its parameters as its ``naming`` spells them (:mod:`.shared.naming`)."""

    naming: RunnerNaming

    #: a pickled job (``main`` and its arguments) larger than this logs a warning naming its largest parts
    payload_warning_bytes: int = WARN_BYTES
    #: the rank whose ``log_metrics`` reports the driver keeps
    metrics_rank: int = 0
    #: the least time between two writes of the same progress key to ``progress_sink``
    progress_interval_s: float = 5.0
    #: heartbeats between the driver and each rank's agent, in seconds (None: the Spark conf's
    #: ``spark.horovodRunner.heartbeatInterval``/``...heartbeatTimeout``, else 2 and 10): a host silent for the
    #: timeout is reported lost, and the ranks on a host that hears nothing from the driver for it are ended
    heartbeat_interval_s: float | None = None
    heartbeat_timeout_s: float | None = None
    _started_a_run = False
    _cancel_first_run = False  # cancel() came before the first run
    _session: SparkSession | None = None  # the session runs use (the Airflow hook's); None: the active one
    _announce: Callable[[str], None] | None = None  # told a submitted run's id before its host starts

    @contextlib.contextmanager
    def _on_session(self, spark: SparkSession) -> Iterator[None]:
        """Runs started within use ``spark``, whatever session pyspark holds as the thread's active one (the
        Airflow hook hands its own so: pyspark makes a new session the active one only where none is)."""
        self._session = spark
        try:
            yield
        finally:
            self._session = None

    @contextlib.contextmanager
    def _announcing(self, announce: Callable[[str], None]) -> Iterator[None]:
        """Runs submitted within tell ``announce`` their ``job.id`` before their host starts (the Airflow
        operator keeps it in the task state store: a worker lost at any moment after leaves a findable run)."""
        self._announce = announce
        try:
            yield
        finally:
            self._announce = None

    def _spark(self) -> SparkSession:
        """The session a Spark run uses: the one handed to :meth:`_on_session`, else the active one."""
        return self._session if self._session is not None else active_session(self.naming.runner)

    def _settings(self, settings: RunSettings, ranks: int) -> None:
        """Keep the settings both runners take (checked: :class:`.settings.RunSettings`), each as an attribute too;
        ``ranks``: the run's, which ``min_ranks`` cannot exceed."""
        if settings.min_ranks is not None and settings.min_ranks > ranks:
            raise ValueError(
                f"min_ranks={settings.min_ranks} is more than the run's {self.naming.size}={ranks}: min_ranks is the "
                f"fewest ranks a restart may start with; set it to at most {ranks}"
            )
        if settings.mlflow is not None:
            import_mlflow()  # ImportError naming the extra, before any run
        self.settings = settings
        for field in fields(settings):
            setattr(self, field.name, getattr(settings, field.name))
        self.mlflow_run_id: str | None = None
        self.mlflow_run_url: str | None = None
        self.metrics: dict[str, list[tuple[float, float | None]]] = {}
        self.checkpoint: dict[str, Any] | None = None
        self.attempts: list[dict[str, Any]] = []
        self._runs: list[_Run] = []

    def _launcher(
        self, run: _Run, previous: Launcher | None = None, size: int | None = None
    ) -> tuple[Launcher, Callable[[str], str | None], bool]:
        """The run's launcher (a new one for each attempt: ``previous``, the last attempt's; ``size``, its ranks
        when not the run's own), its Spark conf's getter, and whether the channel is TLS."""
        local = self._local_launcher()
        if local is not None:
            return local, lambda key: None, False  # loopback only: no TLS
        spark, per_task, use_gpus = self._spark_launch()
        # a run on a DataFrame: its rows counted once, for the first attempt; the same rows for the next ones,
        # shared out anew when a restart has fewer ranks (min_ranks)
        plan = previous.shard_plan if isinstance(previous, SparkLauncher) else None
        launcher = SparkLauncher(
            spark,
            self._size() if size is None else size,
            self.settings.slot_wait_timeout,
            cancelled=lambda: run.cancelled,
            per_task=per_task,
            use_gpus=use_gpus,
            naming=self.naming,
            dataframe=run.dataframe if plan is None else None,
        )
        if plan is not None and run.dataframe is not None:
            launcher.resized(plan, run.dataframe)
        return launcher, *_conf_and_tls(spark)

    def _capacity(self, launcher: Callable[[], Launcher]) -> Callable[[tuple[str, ...]], int]:
        """A restart's size on Spark: :meth:`SparkLauncher.restart_size` of the latest attempt's ``launcher()``."""
        settings = self.settings
        size = self._size()
        min_ranks = size if settings.min_ranks is None else min(settings.min_ranks, size)

        def capacity(lost_hosts: tuple[str, ...]) -> int:
            last = launcher()
            assert isinstance(last, SparkLauncher)
            return last.restart_size(size, min_ranks, lost_hosts, settings.shrink_timeout, settings.slot_wait_timeout)

        return capacity

    def _local_launcher(self) -> Launcher | None:
        """The launcher of a run on this host's processes; None for a run on Spark."""
        raise NotImplementedError

    def _rank_kind(self) -> RankKind:
        raise NotImplementedError

    def _mlflow_params(self) -> dict[str, Any]:
        """The settings an MLflow run records as its params (each runner adds its own)."""
        return self.settings.mlflow_params()

    def _run_job(
        self,
        main: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        dataframe: DataFrame | None = None,
    ) -> Any:
        """Run ``main(*args, **kwargs)`` on every rank (already checked to fit them); rank 0's value. With
        ``dataframe``, each rank gets its shard of its rows (``dataframe_shard()``). With ``max_restarts``, its
        attempts until one succeeds (:mod:`.driver.restarts`)."""
        self.mlflow_run_id = self.mlflow_run_url = None
        with self._tracked_run(dataframe) as run:
            runner = self.naming.runner
            payload = self._payload(run, main, args, kwargs)
            kind = self._rank_kind()
            launcher, conf, channel_tls = self._launcher(run)
            liveness = self._liveness(kind, conf, channel_tls)
            settings = self.settings
            progress = RunProgress(
                self.metrics_rank, settings.progress_sink, self.progress_interval_s, settings.resume_from, runner
            )
            # the launcher gets the job; on Spark the driver keeps no copy beside the broadcast's, unless a later
            # attempt needs it
            job = KeptJob(payload, keep=settings.max_restarts > 0)
            del payload
            with contextlib.ExitStack() as ending:
                tracking = self._start_mlflow_run(launcher.size, conf)
                if tracking is not None:  # ended as the run ends, also by what raises before the ranks start
                    ending.enter_context(tracking)

                def attempt(number: int, size: int | None) -> Supervisor:
                    nonlocal launcher, kind
                    if number > 1:  # the last attempt's launcher and rendezvous are over: new ones
                        launcher, kind = self._launcher(run, launcher, size)[0], self._rank_kind()
                    return _supervisor_class()(
                        launcher,
                        job.take(),
                        settings.driver_log_verbosity,
                        lambda: run.cancelled,
                        settings.start_timeout,
                        progress,
                        liveness,
                        stall_timeout=settings.stall_timeout,
                        channel_tls=channel_tls,
                        kind=kind,
                        exit_timeout_s=settings.exit_timeout,
                        tracking=tracking,
                        attempt=number,
                        end_on_preemption=settings.max_restarts > 0,
                    )

                policy = RestartPolicy(settings.max_restarts, settings.restart_on_exceptions)
                listeners = [tracking] if tracking is not None else []  # (one MLflow run records the restarts)
                # (a local run's ranks are this host's processes: each restart has them all)
                capacity = self._capacity(lambda: launcher) if isinstance(launcher, SparkLauncher) else None
                controller = RunController(
                    attempt, progress, policy, lambda: run.cancelled, runner, capacity, listeners
                )
                if settings.resume_from is not None:
                    log.info("%s: resuming from %s", runner, describe_checkpoint(settings.resume_from))
                with rank_logs_visible():
                    try:
                        return unpickle(controller.run_raw())
                    finally:
                        progress.flush()
                        self.metrics = progress.history.as_dict()
                        self.checkpoint = (
                            None if progress.checkpoint is None else {"try_number": None, **progress.checkpoint}
                        )
                        self.attempts = controller.attempts()

    @contextlib.contextmanager
    def _tracked_run(self, dataframe: DataFrame | None = None) -> Iterator[_Run]:
        """The run, in ``_runs`` while it starts or runs (cancel() ends what is there), cancelled already when
        this is the first run and a cancel() came before it."""
        run = _Run(dataframe=dataframe)
        self._runs.append(run)  # first: a cancel() while the job is pickled ends the run before it starts
        first, self._started_a_run = not self._started_a_run, True
        if first and self._cancel_first_run:  # (read after the append: cancel() sees the run, or this its flag)
            run.cancelled = True
        try:
            yield run
        finally:
            self._runs.remove(run)

    def _payload(self, run: _Run, main: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
        """The pickled job; RunCancelledError when the run was cancelled meanwhile."""
        payload = dumps_job(main, args, kwargs, warn_bytes=self.payload_warning_bytes, runner=self.naming.runner)
        if run.cancelled:
            raise RunCancelledError(f"{self.naming.runner}: the run was cancelled before its ranks started")
        return payload

    def _liveness(self, kind: RankKind, conf: Callable[[str], str | None], channel_tls: bool) -> Liveness:
        """The run's heartbeat settings, after the warnings its Spark conf calls for."""
        runner = self.naming.runner
        if channel_tls:
            warn_if_spark_encrypted(conf, runner, kind.unencrypted)
        liveness = liveness_settings(conf, self.heartbeat_interval_s, self.heartbeat_timeout_s, runner)
        if kind.name == "Horovod":  # (Horovod's Gloo timeout; torch's own default is 30 minutes)
            warn_if_gloo_first(liveness, os.environ)
        return liveness

    def _spark_launch(self) -> tuple[SparkSession, int, bool]:
        """The session a Spark run uses, its ranks per task and whether they get GPUs; LaunchError for a local
        run (each runner says its own words)."""
        raise NotImplementedError

    def _submit_job(
        self,
        main: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        dataframe: DataFrameRecipe | None = None,
    ) -> Job:
        """Start ``main(*args, **kwargs)`` on every rank, supervised inside the cluster; the run's handle. With
        ``dataframe``, the run's host builds the DataFrame from it and each rank gets its shard of its rows."""
        from .driver.launch.spark.cluster import is_connect
        from .durable.host import HostSpec
        from .durable.submit import submit_run

        runner = self.naming.runner
        if self.settings.min_ranks is not None and self.settings.min_ranks < self._size():
            raise SettingError(
                f"{runner}(min_ranks={self.settings.min_ranks}).submit(): a submitted run restarts with all its "
                "ranks (its host does not shrink it yet); leave min_ranks out, or use run() for a smaller world "
                "when a host is gone (docs/restarts.md)"
            )
        spark, per_task, use_gpus = self._spark_launch()
        if not is_connect(spark):
            raise JobRefusedError(
                f"{runner}.submit() needs a Spark Connect session (SparkSession.builder.remote('sc://...')): on "
                "classic Spark this process is the run's driver and the run cannot outlive it, so use run() here, "
                "or a Spark Connect server (YARN/Kubernetes cluster mode is a design: docs/durable-runs.md)."
            )
        with self._tracked_run() as run:
            payload = self._payload(run, main, args, kwargs)
            kind = self._rank_kind()
            conf, channel_tls = _conf_and_tls(spark)
            liveness = self._liveness(kind, conf, channel_tls)
            settings = self.settings
            mlflow, mlflow_params, credentials = self._host_mlflow()
            spec = HostSpec(
                self.naming,
                "Horovod" if kind.name == "Horovod" else "torch",
                self._size(),
                per_task,
                use_gpus,
                settings.driver_log_verbosity,
                settings.start_timeout,
                settings.slot_wait_timeout,
                settings.stall_timeout,
                settings.exit_timeout,
                liveness,
                channel_tls,
                self.metrics_rank,
                self.progress_interval_s,
                settings.resume_from,
                settings.detached_timeout,
                mlflow,
                mlflow_params,
                dataframe=dataframe,
                outcome_timeout=settings.outcome_timeout,
                max_restarts=settings.max_restarts,
                restart_on_exceptions=settings.restart_on_exceptions,
            )
            return submit_run(
                spark,  # type: ignore[arg-type]
                spec,
                payload,
                settings.progress_sink,
                lambda: run.cancelled,
                self._announce,
                settings.mlflow.on_start if settings.mlflow is not None else None,
                credentials,
            )

    def _host_mlflow(self) -> tuple[MlflowSettings | None, dict[str, Any], Credentials | None]:
        """What a submitted run's host makes its MLflow run with (``mlflow``): the settings without the tracking URI
        and ``on_start`` (the submitter's, told over the link), the params; and what this process hands the host
        over the link once attached, never in its plan (the server may log that): the tracking URI it resolves
        (the host's environment has none of its own) and its MLflow credentials."""
        from .durable.link import Credentials

        mlflow = self.settings.mlflow
        if mlflow is None:
            return None, {}, None
        credentials = Credentials(resolved_tracking_uri(mlflow), auth_env())
        return replace(mlflow, tracking_uri=None, on_start=None), self._mlflow_params(), credentials

    def _size(self) -> int:
        """How many ranks a Spark run has."""
        raise NotImplementedError

    def _start_mlflow_run(self, size: int, conf: Callable[[str], str | None]) -> MlflowRun | None:
        """The run's MLflow run when ``mlflow`` is set and its tracking server made it (else one warning)."""
        if self.settings.mlflow is None:
            return None
        name = self.naming.runner
        tracking = start_mlflow_run(
            self.settings.mlflow, name, size, self._mlflow_params(), conf("spark.app.id"), self.metrics_rank
        )
        if tracking is not None:
            self.mlflow_run_id, self.mlflow_run_url = tracking.run_id, tracking.url
        return tracking

    def cancel(self) -> None:
        """End the runs in progress from another thread or a signal handler; ``run`` then raises RunCancelledError.

        Only sets a flag (safe in a signal handler); the running ``run`` ends the ranks within moments. The
        runner can run again afterwards. On a runner that has not run yet, it cancels the first run (e.g. the
        Airflow hook's, when ``on_kill`` comes as the hook hands the job to a new runner).
        """
        if not self._started_a_run:
            self._cancel_first_run = True
        for run in list(self._runs):
            run.cancelled = True


def check_fits(main: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """TypeError unless ``main`` is callable and ``main(*args, **kwargs)`` fits its signature."""
    if not callable(main):
        raise SettingTypeError(f"main must be callable, not {type(main).__name__}")
    try:
        inspect.signature(main).bind(*args, **kwargs)
    except TypeError as exc:
        raise SettingTypeError(f"the arguments do not fit {getattr(main, '__name__', main)!r}: {exc}") from None
    except ValueError:
        pass  # no signature to check (some builtins)


class HorovodRunner(_Runner):
    """Run a Horovod training function on ``|np|`` ranks and return rank 0's result.

    :param np: ``np < 0``: ``-np`` processes on this host (for debugging; every rank's output is shown).
        ``np > 0``: a Spark barrier job of ``np`` tasks on the active SparkSession (``local[*]`` if none).

    The other parameters are the run settings (:class:`~.settings.RunSettings`), which TorchDistributor, the
    Airflow hook and the training operators take too; those that concern Spark apply to ``np > 0``.

    After :meth:`run` (also one that raised), ``metrics`` holds the history of rank ``metrics_rank``'s
    ``log_metrics`` reports, ``{"loss": [(step, value), ...]}`` (at most 1,000 points per metric, evenly
    thinned), ``checkpoint`` the last ``report_checkpoint``: ``{"path", **info, "rank",
    "reported_at", "try_number"}``, or None, and ``attempts`` the record of each attempt (one without
    ``max_restarts``): ``{"attempt", "size", "started_at", "ended_at", "cause_kind", "cause", "resumed_from"}``.
    """

    naming = HOROVOD_RUNNER

    @takes_run_settings()
    def __init__(self, *, np: int, **settings: Unpack[RunOptions]) -> None:
        if isinstance(np, bool) or not isinstance(np, int):
            raise SettingError(f"np must be a non-zero int, not {np!r} ({type(np).__name__})")
        if np == 0:
            raise SettingError(
                "np must be non-zero: np<0 runs -np processes on this host, np>0 a Spark job of np tasks"
            )
        self._settings(RunSettings.from_kwargs(settings, "HorovodRunner"), abs(np))
        self.num_processor = np

    def run(self, main: Callable[..., Any], /, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank; return rank 0's return value.

        ``main`` and ``kwargs`` are pickled once with cloudpickle; ``main`` must call ``hvd.init()`` itself.
        Raises :class:`RankFailedError` (with the remote traceback) when a rank fails, after ending the others.
        """
        return self.run_with_args(main, (), kwargs)

    def run_with_args(self, main: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """:meth:`run` with positional arguments too: ranks call ``main(*args, **kwargs)``."""
        check_fits(main, args, kwargs)
        return self._run_job(main, args, kwargs)

    def submit_with_args(self, main: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Job:
        """:meth:`submit` with positional arguments too: ranks call ``main(*args, **kwargs)``."""
        check_fits(main, args, kwargs)
        return self._submit_job(main, args, kwargs)

    def run_on_dataframe(self, main: Callable[..., Any], df: DataFrame, /, **kwargs: Any) -> Any:
        """:meth:`run`, with the rows of ``df`` (a DataFrame of the run's session) shared out among the ranks:
        in ``main``, ``dataframe_shard()`` is this rank's shard (shards differ by at most one row), written to
        the executor's local disk as it streams in, read memory-mapped for every epoch, gone when the run ends.

        Needs ``np > 0`` (the rows come from the barrier job's tasks). See docs/dataframes.md.
        """
        check_dataframe(df, self.naming, "run_on_dataframe")
        if self.num_processor < 0:
            raise SettingError(
                f"HorovodRunner(np={self.num_processor}).run_on_dataframe runs on Spark, whose barrier tasks bring "
                f"each rank its rows: use np={-self.num_processor} (np>0), on a local[*] session to stay on this host"
            )
        check_fits(main, (), kwargs)
        return self._run_job(main, (), kwargs, df)

    def submit(self, main: Callable[..., Any], /, **kwargs: Any) -> Job:
        """Start ``main(**kwargs)`` on every rank over Spark Connect, supervised inside the cluster, and return
        its handle at once: the run goes on without this process (``job.id`` finds it again:
        ``airflow_provider_hvd.attach``). ``job.wait()`` returns what :meth:`run` would. See docs/durable-runs.md.
        """
        check_fits(main, (), kwargs)
        return self._submit_job(main, (), kwargs)

    def submit_on_dataframe(
        self, main: Callable[..., Any], dataframe: str | Callable[[SparkSession], DataFrame], /, **kwargs: Any
    ) -> Job:
        """:meth:`submit` of what :meth:`run_on_dataframe` runs. ``dataframe`` is the DataFrame's recipe, which
        the run's host builds inside the cluster, in its own Spark session: a SQL string (run with
        ``spark.sql``), or a callable that receives that SparkSession and returns the DataFrame (pickled as
        ``main`` is). A DataFrame object is refused (``TypeError``): it belongs to this process's session. What
        fails in the host (SQL that Spark refuses, a column the ranks cannot read, no rows) is the run's
        ``LaunchError``, from ``job.wait()``. See docs/durable-runs.md.
        """
        from .durable.dataframe_recipe import DataFrameRecipe

        recipe = DataFrameRecipe.of(dataframe, self.naming, "submit_on_dataframe")
        check_fits(main, (), kwargs)
        return self._submit_job(main, (), kwargs, recipe)

    def _spark_launch(self) -> tuple[SparkSession, int, bool]:
        if self.num_processor < 0:
            raise JobRefusedError(
                f"{self.naming.runner}(np={self.num_processor}).submit(): a local run lives in this process and "
                "cannot outlive it; use run(), or np > 0 on a Spark Connect session."
            )
        return self._spark(), 1, True

    def _size(self) -> int:
        return self.num_processor

    def _rank_kind(self) -> RankKind:
        from .driver.ranks.kind import horovod_kind

        return horovod_kind()  # LaunchError when Horovod is not installed

    def _mlflow_params(self) -> dict[str, Any]:
        return {"np": self.num_processor, **super()._mlflow_params()}

    def _local_launcher(self) -> Launcher | None:
        return LocalLauncher(-self.num_processor) if self.num_processor < 0 else None
