"""What every training operator does around its runner: one base, subclassed per runner.

:class:`TrainingJobOperator` holds the Airflow side (the ``spark`` or ``spark_connect`` connection, templated
arguments, context values, the task log, ``on_kill``, the task state store and resume on retry, the stall timeout,
the XCom check, the Spark UI link, one MLflow run per try and its link); a subclass says only how its runner is
built and whether the job runs without Spark: ``HorovodRunnerOperator`` (``operators/horovod.py``),
``TorchDistributorOperator`` (``operators/torch_distributor.py``).

On a ``spark_connect`` connection the run outlives the task (``submit()``): durable by default (Airflow's
``ResumableJobMixin``: the run's id in the task state store, a retry attaches to the run still training), or
deferred (``deferrable=True``: the triggerer's :class:`~airflow_provider_hvd.triggers.training_job.TrainingJobTrigger`
holds the link while it trains). See docs/durable-runs.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.configuration import conf
from airflow.sdk import BaseOperator, BaseOperatorLink, ResumableJobMixin
from airflow.sdk.exceptions import AirflowException

from airflow_provider_hvd.hooks.horovod import HorovodHook, JobRunner
from airflow_provider_hvd.hooks.mlflow_runs import TryMlflowRun, mask_credentials
from airflow_provider_hvd.hooks.task_state import TaskStateProgress
from airflow_provider_hvd.operators.openlineage import (
    PARENT_JOB_SETTING,
    TRANSPORT_SETTING,
    inject_setting,
    openlineage_properties,
)
from airflow_provider_hvd.runner import HorovodRunnerError, Job, JobNotFoundError, RunCancelledError, RunDetachedError
from airflow_provider_hvd.runner.settings import RunSettings, takes_run_settings, task_setting_names

if TYPE_CHECKING:
    import jinja2
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

_SHIPPABLE = (str, int, float, bool, type(None))


class SparkUILink(BaseOperatorLink):
    """A page about the Spark application that ran the task's barrier job, one that outlives the task.

    The History Server's, YARN's tracking URL or the standalone master's application page; on Spark Connect,
    the server's own UI, which outlives the task; no link on a local master (the driver's own UI stops with
    the task).
    """

    name = "Spark UI"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return getattr(operator, "spark_ui_url", None) or ""


class MlflowRunLink(BaseOperatorLink):
    """The MLflow run of the task's try (``mlflow=``), in the tracking server's UI; none where the tracking URI
    has no UI (a local ``file:`` or database store)."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        run = getattr(operator, "mlflow_run", None)
        return (run.url if isinstance(run, TryMlflowRun) else None) or ""


class TrainingJobOperator(ResumableJobMixin, BaseOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on a runner's processes; push rank 0's return value.

    Subclasses implement :meth:`make_runner`, :meth:`runs_locally`, :meth:`start` and :meth:`submit`, and name
    their ranks' kind in :attr:`kind`. The parameters common to every runner are documented on each subclass.
    """

    #: the task state store's key of the submitted run's id (``job.id``); a retry attaches to that run
    external_id_key = "hvd_job_id"

    #: the ranks' kind, in messages ("the task was killed; every Horovod rank was ended")
    kind: ClassVar[str] = "training"
    template_fields: Sequence[str] = ("op_args", "op_kwargs", "conn_id", "spark_conf", "mlflow", "dataframe_sql")
    template_fields_renderers: ClassVar[dict[str, str]] = {
        "op_args": "py",
        "op_kwargs": "py",
        "spark_conf": "json",
        "mlflow": "json",
        "dataframe_sql": "sql",
    }
    operator_extra_links = (SparkUILink(), MlflowRunLink())
    ui_color = "#e8f0fe"

    #: the run settings' defaults where this operator's runner has its own (TorchDistributor's: PySpark's)
    run_defaults: ClassVar[dict[str, Any]] = {}
    mlflow: dict[str, Any] | None  # (a run setting, as the others an attribute set by __init__: templated)

    @takes_run_settings(task=True)
    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        conn_id: str = HorovodHook.default_conn_name,
        spark_conf: dict[str, Any] | None = None,
        openlineage_inject_parent_job_info: bool | None = None,
        openlineage_inject_transport_info: bool | None = None,
        dataframe: str | Callable[[SparkSession], DataFrame] | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        # the run settings a task takes (RunSettings), checked at parse time, not when the task runs; each is an
        # attribute, which templating renders (mlflow)
        for name, value in RunSettings.task_options(kwargs, **self.run_defaults).items():
            setattr(self, name, value)
        mask_credentials(self.mlflow)
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise TypeError(f"python_callable must be callable, not {type(python_callable).__name__}")
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        self.conn_id = conn_id
        self.spark_conf = spark_conf or {}
        # None: the [openlineage] setting of the worker that runs the task, read then
        self.openlineage_inject_parent_job_info = openlineage_inject_parent_job_info
        self.openlineage_inject_transport_info = openlineage_inject_transport_info
        # a SQL string is a template field; a callable is kept apart (Airflow would call a callable field)
        if dataframe is not None and not isinstance(dataframe, str) and not callable(dataframe):
            raise TypeError(
                f"dataframe= takes a SQL string or a callable that receives the task's SparkSession and returns "
                f"the DataFrame, not {type(dataframe).__name__}"
            )
        self.dataframe_sql = dataframe if isinstance(dataframe, str) else None
        self.dataframe_factory: Callable[[Any], Any] | None = None if isinstance(dataframe, str) else dataframe
        self.deferrable = bool(deferrable)
        self.spark_ui_url: str | None = None
        self.mlflow_run: TryMlflowRun | None = None
        self._hook: HorovodHook | None = None
        self._runner: JobRunner | None = None
        self._killed = False
        # a run that outlives the task (submit()): its handle, and what its end left
        self._job: Job | None = None
        self._leaving = False  # on_kill() on a worker that shuts down: detach, the retry attaches
        self._ti: Any = None
        self._progress: TaskStateProgress | None = None
        self._job_call: Callable[[], Job] | None = None
        self._value: Any = None
        self._checkpoint: dict[str, Any] | None = None

    def render_template_fields(self, context: Context, jinja_env: jinja2.Environment | None = None) -> None:
        super().render_template_fields(context, jinja_env)
        mask_credentials(self.mlflow)  # a rendered tracking URI's password: before Airflow keeps the rendered fields

    def make_runner(self, **common: Any) -> JobRunner:
        """The runner of this task's job, from the (rendered) operator's own fields and ``common``: the run settings
        every runner takes (:class:`~airflow_provider_hvd.runner.settings.RunSettings`), ``mlflow`` an
        ``MlflowSettings`` when the task tracks its run."""
        raise NotImplementedError

    def runs_locally(self) -> bool:
        """Whether the job runs on this host's processes, without Spark (after the fields are rendered)."""
        raise NotImplementedError

    def local_fix(self) -> str:
        """What makes this task's job run on Spark, for the message that refuses ``dataframe=`` on a local one."""
        raise NotImplementedError

    def start(self, runner: JobRunner, args: list[Any], kwargs: dict[str, Any], dataframe: DataFrame | None) -> Any:
        """Run the job on ``runner`` (:meth:`make_runner`'s): ``python_callable(*args, **kwargs)`` on every
        rank, with ``dataframe``'s rows shared out among them where there is one; return rank 0's value."""
        raise NotImplementedError

    def submit(
        self,
        runner: JobRunner,
        args: list[Any],
        kwargs: dict[str, Any],
        dataframe: str | Callable[[Any], Any] | None = None,
    ) -> Job:
        """Submit the job on ``runner`` (over Spark Connect): ``python_callable(*args, **kwargs)`` on every rank,
        supervised inside the cluster; its handle. ``dataframe``: the task's ``dataframe=`` (the rendered SQL, or
        the callable), which the run's host builds in its own session, its rows shared out among the ranks."""
        raise NotImplementedError

    @property
    def _dataframe_recipe(self) -> str | Callable[[Any], Any] | None:
        """The task's ``dataframe=`` as given: the (rendered) SQL, or the callable; None without one."""
        return self.dataframe_sql if self.dataframe_sql is not None else self.dataframe_factory

    def _check_dataframe_runs_on_spark(self, local: bool) -> None:
        """A ``dataframe=`` on a job that runs without Spark is refused (the rows come from its barrier tasks)."""
        if local and self._dataframe_recipe is not None:
            raise ValueError(
                f"Task {self.task_id!r}: dataframe= needs a job on Spark, whose barrier tasks bring each rank its "
                f"rows, and this one runs on the worker's processes without Spark: {self.local_fix()} (on a "
                "local[*] master to stay on this host)"
            )

    def _dataframe(self, spark: SparkSession | ConnectSession | None) -> DataFrame | None:
        """The task's ``dataframe=``, built in the job's session ``spark``: the SQL's result, or the callable's."""
        if spark is None or self._dataframe_recipe is None:
            return None
        if self.dataframe_sql is not None:
            try:
                return spark.sql(self.dataframe_sql)
            except Exception as exc:  # noqa: BLE001 - Spark's parse and analysis errors alike: name the task
                raise ValueError(
                    f"Task {self.task_id!r}: the dataframe= SQL failed in the task's Spark session: "
                    f"{str(exc).strip().splitlines()[0]}\nSQL: {self.dataframe_sql}"
                ) from exc
        from pyspark.sql import DataFrame  # (Spark Connect's DataFrame is one too)

        assert self.dataframe_factory is not None
        df = self.dataframe_factory(spark)
        if not isinstance(df, DataFrame):
            name = getattr(self.dataframe_factory, "__name__", repr(self.dataframe_factory))
            raise TypeError(
                f"Task {self.task_id!r}: dataframe={name} returned a {type(df).__name__}, not a Spark DataFrame: "
                "return one made in the session it receives (spark.table(...), spark.sql(...), spark.range(...))"
            )
        return df

    def _context_kwargs(self, context: Context) -> dict[str, Any]:
        """Context values the callable asks for by name (``ds``, ``run_id``...): plain ones only, they travel."""
        wanted = {
            name
            for name in inspect.signature(self.python_callable).parameters
            if name in context and name not in self.op_kwargs
        }
        unshippable = sorted(name for name in wanted if not isinstance(context[name], _SHIPPABLE))  # type: ignore[literal-required]
        if unshippable:
            raise TypeError(
                f"{self.python_callable.__name__}() asks for the context value(s) {unshippable}, which cannot be "
                f"sent to {self.kind} ranks on other machines; pass what you need through op_kwargs templates "
                "instead, e.g. op_kwargs={'run_id': '{{ run_id }}'}"
            )
        return {name: context[name] for name in wanted}  # type: ignore[literal-required]

    def execute(self, context: Context) -> Any:
        # the hook first, before anything that takes time (OpenLineage's settings, the task state store, the
        # Spark session): an on_kill() from now on cancels its job, which then ends before its ranks start
        self._hook = HorovodHook(self.conn_id, self.spark_conf, app_name=f"{self.dag_id}.{self.task_id}")
        if self._killed:  # on_kill() came before the hook
            raise RunCancelledError(f"the task was killed before its {self.kind} job started")
        local = self.runs_locally()
        self._check_dataframe_runs_on_spark(local)  # (np or num_processes may have been a template)
        kwargs = {**self._context_kwargs(context), **self.op_kwargs}
        if not local:
            self._hook.add_openlineage_conf(self._openlineage_conf(context))
        progress = self._task_state_progress(context)
        self.mlflow_run = self._mlflow_run(context)
        settings = {name: getattr(self, name) for name in task_setting_names()}
        # the task's mlflow= (a dict) becomes its try's MLflow run's settings
        settings["mlflow"] = self.mlflow_run.settings() if self.mlflow_run else None
        self._runner = runner = self.make_runner(
            **settings,
            resume_from=progress.last_checkpoint() if progress else None,
            progress_sink=progress,
        )
        self._ti, self._progress = context.get("ti"), progress
        recipe = self._dataframe_recipe  # (a submitted run's host builds the DataFrame from it)
        self._job_call = lambda: self.submit(runner, self.op_args, kwargs, recipe)
        outlives = self._outlives_task(local)
        if outlives and self.deferrable:
            self._defer_on_trigger(context)
        try:
            if outlives:
                value = self.execute_resumable(context)
            else:
                value = self._hook.run_job(runner, lambda: self._start(runner, kwargs), local=local)
                self._checkpoint = runner.checkpoint
        finally:
            self.spark_ui_url = self._hook.ui_url
        return self._succeeded(value, progress)

    def _succeeded(self, value: Any, progress: TaskStateProgress | None) -> Any:
        if self._killed and not self._leaving:  # Airflow lets execute go on after on_kill(): not a success
            raise RunCancelledError(f"the task was killed; every {self.kind} rank was ended")
        if progress is not None:  # the training succeeded, whatever becomes of its value
            progress.mark_finished(self._checkpoint)
        if self.do_xcom_push:
            self._check_xcom_value(value)
        return value

    # --- a run that outlives the task: on Spark Connect (docs/durable-runs.md) ---

    def _outlives_task(self, local: bool) -> bool:
        """Whether the run is submitted to outlive the task: durable or deferrable, on a ``spark_connect``
        connection (``dataframe=`` too: the run's host builds it); refused in one sentence where
        ``deferrable=True`` asks for what cannot be."""
        assert self._hook is not None
        if not (self.durable or self.deferrable):
            return False
        connect = not local and self._hook.connect_target() is not None
        why_not = None
        if local:
            why_not = "its ranks run on the worker's processes, without Spark"
        elif not connect:
            why_not = (
                f"connection {self.conn_id!r} is a classic Spark one, whose run has its driver in the task's process "
                "(client mode)"
            )
        if why_not is None:
            return True
        if self.deferrable:
            raise AirflowException(
                f"Task {self.task_id!r}: deferrable=True needs a run that outlives the task, and {why_not}: use a "
                "spark_connect connection, or deferrable=False."
            )
        if connect:  # durable by default on Spark Connect: say why this one is not
            self.log.warning("Task %r runs in the task's process, not durably: %s", self.task_id, why_not)
        return False

    def submit_job(self, context: Context) -> str:
        assert self._hook is not None and self._runner is not None and self._job_call is not None
        store = context.get("task_state_store")
        announce = (lambda job_id: store.set(self.external_id_key, job_id)) if store is not None else None
        self._job = self._hook.submit_job(self._runner, self._job_call, announce)
        self.log.info("Submitted the run: %s (a retry of this task attaches to it)", self._job.id)
        return self._job.id

    def get_job_status(self, external_id: Any, context: Context) -> str:
        """``"running"`` when the run of an earlier try is attached to (its host still holds it), else
        ``"ended"``: a new run starts, from the last checkpoint where there is one."""
        assert self._hook is not None
        try:
            self._job = self._hook.attach_job(str(external_id), self._progress, on_mlflow_run=self._on_mlflow_run())
        except JobNotFoundError as exc:
            self.log.warning("The run an earlier try submitted cannot be attached to: %s A new run starts.", exc)
            return "ended"
        self.log.info("Attached to the run an earlier try submitted: %s", external_id)
        return "running"

    def is_job_active(self, status: str) -> bool:
        return status == "running"

    def is_job_succeeded(self, status: str) -> bool:
        return False  # an ended run's outcome went to the client that fetched it: never skip the run

    def poll_until_complete(self, external_id: Any, context: Context) -> Any:
        """Rank 0's value once the run ends (the ranks' lines in the task log meanwhile); the run's error."""
        job = self._job
        assert job is not None
        if self._killed:  # on_kill() came while the run was submitted or attached
            self._kill_or_leave(job)
        try:
            self._value = job.wait()
        except RunDetachedError:
            raise AirflowException(
                f"The worker is shutting down while task {self.task_id!r} runs: the task detached from its run, "
                f"which goes on; the task's retry attaches to it ({job.id})."
            ) from None
        except HorovodRunnerError:
            raise
        except BaseException:  # the task's timeout, an interrupt: nothing goes on training unseen
            job.cancel()
            raise
        finally:
            self._checkpoint = job.checkpoint
        return self._value

    def get_job_result(self, external_id: Any, context: Context) -> Any:
        return self._value

    def _kill_or_leave(self, job: Job) -> None:
        """A user's mark-failed or clear ends the run; a worker's graceful shutdown leaves it to the retry. Both
        arrive as SIGTERM: the task instance's state tells them apart (still ``running`` for a shutdown)."""
        if self._still_running():
            self._leaving = True
            self.log.warning("The worker is shutting down: detaching from the run, which goes on for the retry")
            job.close()
        else:
            job.cancel()

    def _still_running(self) -> bool:
        ti = self._ti
        try:
            states = ti.get_task_states(
                dag_id=ti.dag_id, map_index=ti.map_index, task_ids=[ti.task_id], run_ids=[ti.run_id]
            )
        except Exception:  # noqa: BLE001 - no answer: end the run rather than leave it training
            return False
        mapped = ti.map_index is not None and ti.map_index >= 0  # (the API keys a mapped one task_id_index)
        key = f"{ti.task_id}_{ti.map_index}" if mapped else ti.task_id
        return bool(states.get(ti.run_id, {}).get(key) == "running")

    def _defer_on_trigger(self, context: Context) -> None:
        """Submit (or find the earlier try's run) and defer: the trigger holds the link while the run trains."""
        from airflow_provider_hvd.triggers.training_job import TrainingJobTrigger

        store = context.get("task_state_store")
        job_id = store.get(self.external_id_key) if store is not None else None
        if not job_id or self.get_job_status(job_id, context) != "running":
            job_id = self.submit_job(context)
        assert self._job is not None
        self._job.close()  # detached: the trigger attaches
        self.defer(
            trigger=TrainingJobTrigger(str(job_id), self.conn_id),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Back on a worker once the run ended: its outcome (rank 0's value, or its error) from its host."""
        self._hook = HorovodHook(self.conn_id, self.spark_conf, app_name=f"{self.dag_id}.{self.task_id}")
        self._ti, self._progress = context.get("ti"), self._task_state_progress(context)
        self.mlflow_run = self._mlflow_run(context)
        job_id = event["job_id"]
        try:
            self._job = self._hook.attach_job(job_id, self._progress, logs=False, on_mlflow_run=self._on_mlflow_run())
        except JobNotFoundError as exc:
            raise AirflowException(f"Task {self.task_id!r}: the run ended, but its outcome is gone: {exc}") from None
        return self._succeeded(self.poll_until_complete(job_id, context), self._progress)

    def _start(self, runner: JobRunner, kwargs: dict[str, Any]) -> Any:
        """:meth:`start`, with the DataFrame built in the session the hook runs the job on."""
        assert self._hook is not None
        return self.start(runner, self.op_args, kwargs, self._dataframe(self._hook.job_session))

    def _openlineage_conf(self, context: Context) -> dict[str, str]:
        """OpenLineage's parent job (this task) and transport for the Spark session, as the parameters ask."""
        return openlineage_properties(
            context,
            {key: str(value) for key, value in self.spark_conf.items()},
            parent_job=inject_setting(self.openlineage_inject_parent_job_info, PARENT_JOB_SETTING),
            transport=inject_setting(self.openlineage_inject_transport_info, TRANSPORT_SETTING),
        )

    @staticmethod
    def _task_state_progress(context: Context) -> TaskStateProgress | None:
        """The run's progress sink on the task state store (None where Airflow has none: before 3.3)."""
        store = context.get("task_state_store")
        if store is None:
            return None
        ti = context.get("ti")
        return TaskStateProgress(store, getattr(ti, "try_number", None))

    def _mlflow_run(self, context: Context) -> TryMlflowRun | None:
        """This try's MLflow run (None without ``mlflow=``), linked to the earlier try's through the store."""
        if self.mlflow is None:
            return None
        ti = context["ti"]
        link = MlflowRunLink()
        map_index = getattr(ti, "map_index", None)
        return TryMlflowRun(
            self.mlflow,  # rendered
            dag_id=self.dag_id,
            task_id=self.task_id,
            run_id=context["run_id"],
            try_number=getattr(ti, "try_number", None),
            map_index=-1 if map_index is None else map_index,
            store=context.get("task_state_store"),
            publish=lambda url: ti.xcom_push(key=link.xcom_key, value=url),  # Airflow pushes it again at the end
        )

    def _on_mlflow_run(self) -> Callable[[str, str | None], None] | None:
        """What hears an attached run's MLflow run (its host made it): this try's record of it and its link."""
        return self.mlflow_run.started if self.mlflow_run is not None else None

    def _check_xcom_value(self, value: Any) -> None:
        """A value no XCom can hold fails the task for good (a retry would train again, to the same end)."""
        from airflow.sdk.exceptions import AirflowFailException
        from airflow.sdk.execution_time.xcom import XCom

        try:
            XCom.serialize_value(value)
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises, say what to do instead
            raise AirflowFailException(
                f"Rank 0 of {self.task_id!r} returned a {type(value).__module__}.{type(value).__qualname__}, "
                f"which Airflow cannot store as an XCom ({exc}). Return plain data (numbers, strings, lists, "
                "dicts), or save the object (a model, a tensor) to shared storage and return its path. The "
                "training itself succeeded; the task fails without a retry, which would only train again."
            ) from exc

    def on_kill(self) -> None:
        self._killed = True
        if self._job is not None:
            self._kill_or_leave(self._job)
            return
        hook = self._hook
        if hook is not None:  # (None: execute has not made it yet, and sees the flag once it has)
            hook.cancel()
