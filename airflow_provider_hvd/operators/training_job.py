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
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.configuration import conf
from airflow.sdk import BaseOperator, BaseOperatorLink, ResumableJobMixin
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferralTimeout

from airflow_provider_hvd.hooks.horovod import HorovodHook, JobRunner
from airflow_provider_hvd.hooks.mlflow_runs import TryMlflowRun, mask_credentials
from airflow_provider_hvd.hooks.task_state import TaskStateProgress
from airflow_provider_hvd.operators.openlineage import (
    PARENT_JOB_SETTING,
    TRANSPORT_SETTING,
    inject_setting,
    openlineage_properties,
)
from airflow_provider_hvd.runner import (
    HorovodRunnerError,
    HostSlotError,
    Job,
    JobNotFoundError,
    RunCancelledError,
    RunDetachedError,
)
from airflow_provider_hvd.runner.settings import RunSettings, takes_run_settings, task_setting_names

if TYPE_CHECKING:
    import jinja2
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

_SHIPPABLE = (str, int, float, bool, type(None))
# the task instance's states that a user's action gives a running task: marked failed, success or skipped, cleared
# (restarting), removed from its DAG. Its SIGTERM then ends the run; any other (Airflow's own: a worker's graceful
# shutdown leaves it running, missed heartbeats up_for_retry) leaves the run to the retry. A heartbeat timeout on
# the last try also gives "failed": nothing would attach to the run then.
_ENDED_BY_USER = frozenset({"failed", "success", "skipped", "restarting", "removed"})


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
        self._new_runner: Callable[[], JobRunner] | None = None  # (from the store's last checkpoint at the call)
        self._killed = False
        # a run that outlives the task (submit()): its handle, and what its end left
        self._job: Job | None = None
        self._job_kwargs: dict[str, Any] = {}
        self._leaving: str | None = None  # why on_kill() detached (Airflow stopped the try): the retry attaches
        self._run_cancelled = False  # this try cancelled its run (its timeout): on_kill() has nothing left to do
        self._ti: Any = None
        self._progress: TaskStateProgress | None = None
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
        self._job_kwargs = kwargs = {**self._context_kwargs(context), **self.op_kwargs}
        if not local:
            self._hook.add_openlineage_conf(self._openlineage_conf(context))
        progress = self._task_state_progress(context)
        self._ti, self._progress = context.get("ti"), progress
        self.mlflow_run = self._mlflow_run(context)
        settings = {name: getattr(self, name) for name in task_setting_names()}
        # the task's mlflow= (a dict) becomes its try's MLflow run's settings
        settings["mlflow"] = self.mlflow_run.settings() if self.mlflow_run else None
        self._new_runner = lambda: self.make_runner(
            **settings,
            resume_from=progress.last_checkpoint() if progress else None,
            progress_sink=progress,
        )
        outlives = self._outlives_task(local)
        try:
            if outlives and self.deferrable:
                value = self._submit_and_defer(context)  # (or the value of an earlier try's run that succeeded)
            elif outlives:
                try:
                    value = self.execute_resumable(context)
                except HostSlotError as exc:  # the ranks fit the server, its host's slot beside them does not
                    outlives = False
                    self.log.warning(
                        "Task %r runs in the task's process, not durably: %s. A run that outlives the task needs one "
                        "more task slot on the server; durable=False runs it in the task's process without this "
                        "warning.",
                        self.task_id,
                        exc.reason,
                    )
            if not outlives:
                runner = self._new_runner()
                value = self._hook.run_job(runner, lambda: self._start(runner, kwargs), local=local)
                self._checkpoint = runner.checkpoint
        finally:
            self.spark_ui_url = self._hook.ui_url
        return self._succeeded(value, progress)

    def _succeeded(self, value: Any, progress: TaskStateProgress | None) -> Any:
        if self._killed and self._leaving is None:  # Airflow lets execute go on after on_kill(): not a success
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
        if local:
            why_not = "its ranks run on the worker's processes, without Spark"
        elif self._hook.connect_target() is None:
            why_not = (
                f"connection {self.conn_id!r} is a classic Spark one, whose run has its driver in the task's process "
                "(client mode)"
            )
        else:
            return True
        if self.deferrable:
            raise AirflowException(
                f"Task {self.task_id!r}: deferrable=True needs a run that outlives the task, and {why_not}: use a "
                "spark_connect connection, or deferrable=False."
            )
        return False

    def submit_job(self, context: Context) -> str:
        """Submit a new run (HostSlotError where its ranks fit the server and its host's slot does not)."""
        assert self._hook is not None and self._new_runner is not None
        store = context.get("task_state_store")
        announce = (lambda job_id: store.set(self.external_id_key, job_id)) if store is not None else None
        runner = self._new_runner()  # (resumes from the last checkpoint, also one an earlier try's run reported)
        recipe = self._dataframe_recipe  # (the run's host builds the DataFrame from it)
        self._job = self._hook.submit_job(
            runner, lambda: self.submit(runner, self.op_args, self._job_kwargs, recipe), announce
        )
        self.log.info("Submitted the run: %s (a retry of this task attaches to it)", self._job.id)
        return self._job.id

    def get_job_status(self, external_id: Any, context: Context) -> str:
        """The run an earlier try submitted: ``"running"`` (attached to it), ``"succeeded"`` (its value is this
        try's), or ``"ended"``: it failed or was cancelled, or nothing of it is left on the server; a new run
        starts, from the last checkpoint where there is one. No second run while the first is on the server: a
        run this try cannot attach to fails the try (the next retry tries again)."""
        assert self._hook is not None
        try:
            job = self._hook.attach_job(str(external_id), self._progress, on_mlflow_run=self._on_mlflow_run())
        except JobNotFoundError as exc:
            self.log.warning("The run an earlier try submitted cannot be attached to: %s A new run starts.", exc)
            return "ended"
        except HorovodRunnerError as exc:
            raise AirflowException(
                f"Task {self.task_id!r}: the run an earlier try submitted is still on the server, and this try cannot "
                f"attach to it: {exc} No second run starts beside it; the next try attaches again."
            ) from None
        self._job = job
        status = job.status()  # (the host's own, as attach() returns)
        if not status.ended:
            self.log.info("Attached to the run an earlier try submitted: %s", external_id)
            return "running"
        if status.cause is None:
            self.log.info("The run an earlier try submitted has succeeded: its value is this try's (%s)", external_id)
            return "succeeded"
        try:  # its error, so that its host lets it go; the progress it made is in the store now
            job.wait()
        except HorovodRunnerError:
            pass
        self._job = None
        self.log.warning("The run an earlier try submitted ended: %s. A new run starts.", status.cause)
        return "ended"

    def is_job_active(self, status: str) -> bool:
        return status == "running"

    def is_job_succeeded(self, status: str) -> bool:
        return status == "succeeded"

    def poll_until_complete(self, external_id: Any, context: Context) -> Any:
        """Rank 0's value once the run ends (the ranks' lines in the task log meanwhile); the run's error."""
        job = self._job
        assert job is not None
        if self._killed:  # on_kill() came while the run was submitted or attached
            self._kill_or_leave(job)
        try:
            return job.wait()
        except RunDetachedError:
            raise AirflowException(
                f"Task {self.task_id!r} was stopped ({self._leaving}): it detached from its run, which goes on; the "
                f"task's retry attaches to it ({job.id})."
            ) from None
        except HorovodRunnerError:
            raise
        except BaseException:  # the task's timeout, an interrupt: nothing goes on training unseen
            self._run_cancelled = True
            job.cancel()
            raise
        finally:
            self._checkpoint = job.checkpoint

    def get_job_result(self, external_id: Any, context: Context) -> Any:
        return self.poll_until_complete(external_id, context)  # (the job keeps its value: at once after a poll)

    def _kill_or_leave(self, job: Job) -> None:
        """A user's mark-failed, mark-success or clear ends the run; Airflow's own end of the try (a worker's
        graceful shutdown, missed heartbeats) leaves it to the retry. All arrive as SIGTERM: the task instance's
        state, as the API server has it, tells them apart; without an answer, nothing says a user ended it."""
        try:
            state = self._task_instance_state()
        except Exception as exc:  # noqa: BLE001 - whatever the API answered, it is no user's action
            self._leave(job, f"the task instance's state could not be read ({exc})")
            return
        if state is None or state in _ENDED_BY_USER:
            self.log.warning("The task instance is %s: ending the run", state or "gone (its DAG run was deleted)")
            job.cancel()
        elif state == "running":
            self._leave(job, "the worker is shutting down")
        else:
            self._leave(job, f"Airflow ended this try: the task instance is {state}, as after missed heartbeats")

    def _leave(self, job: Job, why: str) -> None:
        self._leaving = why
        self.log.warning("%s: detaching from the run, which goes on for the retry", why[0].upper() + why[1:])
        job.close()

    def _task_instance_state(self) -> str | None:
        """The task instance's state as the API server has it (None: it has none, its DAG run was deleted)."""
        ti = self._ti
        states = ti.get_task_states(
            dag_id=ti.dag_id, map_index=ti.map_index, task_ids=[ti.task_id], run_ids=[ti.run_id]
        )
        mapped = ti.map_index is not None and ti.map_index >= 0  # (the API keys a mapped one task_id_index)
        key = f"{ti.task_id}_{ti.map_index}" if mapped else ti.task_id
        state = states.get(ti.run_id, {}).get(key)
        return None if state is None else str(getattr(state, "value", state))  # (a str, or an enum of them)

    def _submit_and_defer(self, context: Context) -> Any:
        """Submit (or find the earlier try's run) and defer: the trigger holds the link while the run trains. An
        earlier try's run that already succeeded gives its value at once. The deferral times out with what is left
        of ``execution_timeout``, which ends the run."""
        from airflow_provider_hvd.triggers.training_job import TrainingJobTrigger

        store = context.get("task_state_store")
        job_id = store.get(self.external_id_key) if store is not None else None
        status = self.get_job_status(job_id, context) if job_id else "ended"
        if status == "succeeded":
            return self.get_job_result(job_id, context)
        if status != "running":
            try:
                job_id = self.submit_job(context)
            except HostSlotError as exc:
                raise AirflowException(
                    f"Task {self.task_id!r}: deferrable=True needs a run that outlives the task, and {exc.reason}: "
                    "give the server one more task slot, or deferrable=False."
                ) from None
        assert self._job is not None
        self._job.close()  # detached: the trigger attaches
        left = self._timeout_left(context)
        deadline = None if left is None else (datetime.now(UTC) + left).timestamp()
        self.defer(
            trigger=TrainingJobTrigger(str(job_id), self.conn_id, deadline),
            method_name="execute_complete",
            timeout=left,
        )

    def _timeout_left(self, context: Context) -> timedelta | None:
        """What is left of ``execution_timeout`` (None without one): the deferral's timeout (Airflow's own applies
        to a task while it runs on a worker, not while it is deferred)."""
        if self.execution_timeout is None:
            return None
        started = getattr(context.get("ti"), "start_date", None)
        used = datetime.now(UTC) - started if started is not None else timedelta(0)
        return max(self.execution_timeout - used, timedelta(seconds=1))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Back on a worker once the run ended: its outcome (rank 0's value, or its error) from its host."""
        self._resumed(context)
        job_id = event["job_id"]
        assert self._hook is not None
        try:
            self._job = self._hook.attach_job(job_id, self._progress, logs=False, on_mlflow_run=self._on_mlflow_run())
        except JobNotFoundError as exc:
            raise self._outcome_gone(event, exc) from None
        return self._succeeded(self.poll_until_complete(job_id, context), self._progress)

    def _resumed(self, context: Context) -> None:
        """What a task resumed on a worker needs: its hook, task instance, progress sink and MLflow run."""
        self._hook = HorovodHook(self.conn_id, self.spark_conf, app_name=f"{self.dag_id}.{self.task_id}")
        self._ti, self._progress = context.get("ti"), self._task_state_progress(context)
        self.mlflow_run = self._mlflow_run(context)

    def _outcome_gone(self, event: dict[str, Any], exc: JobNotFoundError) -> AirflowException:
        """The run ended (the trigger's ``event`` says how), and its host no longer holds its outcome: a run that
        succeeded is never trained again (no retry); a failed one is retried as any failed run is."""
        outcome = event.get("outcome")
        kept = (
            "a run's host keeps a finished run's outcome until a task fetches it, for outcome_timeout at most (6 hours "
            "by default), and this task resumed later than that"
        )
        if outcome == "succeeded":
            return AirflowFailException(
                f"Task {self.task_id!r}: its run succeeded, but rank 0's value is no longer on the run's host: {kept} "
                f"({exc}). The task fails without a retry, which would train again: give the deferred task's resume "
                "a worker sooner (its pool's slots), or raise outcome_timeout."
            )
        if outcome == "failed":
            return AirflowException(
                f"Task {self.task_id!r}: its run failed: {event.get('cause')}. Its full error is no longer on the "
                f"run's host: {kept} ({exc})."
            )
        return AirflowException(f"Task {self.task_id!r}: the run ended, and nothing of it is left: {exc}")

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except TaskDeferralTimeout:
            self._cancel_timed_out_run(context)
            raise

    def _cancel_timed_out_run(self, context: Context) -> None:
        """The deferral timed out (``execution_timeout``): the trigger ended the run as the triggerer dropped it,
        and where it could not (no triggerer ran it then), the resumed task does."""
        store = context.get("task_state_store")
        job_id = store.get(self.external_id_key) if store is not None else None
        if not job_id:
            return
        try:
            job = HorovodHook(self.conn_id).attach_job(str(job_id), logs=False)
        except HorovodRunnerError:  # ended already (the trigger cancelled it), or out of reach
            return
        try:
            if not job.status().ended:
                self.log.warning("The task's execution_timeout has passed: ending the run")
                job.cancel()
        finally:
            job.close()

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
            if not self._run_cancelled:
                self._kill_or_leave(self._job)
            return
        hook = self._hook
        if hook is not None:  # (None: execute has not made it yet, and sees the flag once it has)
            hook.cancel()
