"""HorovodRunnerOperator: a HorovodRunner job as an Airflow task; rank 0's return value is its XCom."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow_provider_hvd.hooks.horovod import HorovodHook
from airflow_provider_hvd.operators.training_job import MlflowRunLink, SparkUILink, TrainingJobOperator
from airflow_provider_hvd.runner import HorovodRunner
from airflow_provider_hvd.runner.errors import SettingError
from airflow_provider_hvd.runner.settings import takes_run_settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["HorovodRunnerOperator", "MlflowRunLink", "SparkUILink"]


class HorovodRunnerOperator(TrainingJobOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on ``np`` Horovod ranks; push rank 0's return value.

    :param python_callable: the training function; it calls ``hvd.init()`` itself. Shipped with cloudpickle.
    :param op_args: positional arguments (templated).
    :param op_kwargs: keyword arguments (templated).
    :param np: ranks: ``np > 0`` a Spark barrier job on the connection's cluster, ``np < 0`` local processes.
    :param conn_id: the ``spark`` connection (default ``spark_default``; templated), or a ``spark_connect`` one: the
        job then runs on that Spark Connect server, in a session of its own.
    :param spark_conf: Spark settings on top of the connection's (templated).
    :param dataframe: training data from Spark: a SQL string (templated), or a callable that receives the task's
        SparkSession and returns a DataFrame; built in the task's session (classic or Connect), its rows are
        shared out among the ranks (``HorovodRunner.run_on_dataframe``: ``dataframe_shard()`` in the ranks). A
        run that outlives the task (``spark_connect``) has its host build it, from the rendered SQL or the
        callable, in the run's own session (``HorovodRunner.submit_on_dataframe``).
        Needs ``np > 0`` and ``op_kwargs`` (not ``op_args``). See docs/dataframes.md.
    :param openlineage_inject_parent_job_info: give the Spark session OpenLineage's parent job, this task
        (``spark.openlineage.parentJobName``, ``parentRunId``, ``rootParent*``...), as the apache-spark provider's
        operators do (default None: the ``[openlineage] spark_inject_parent_job_info`` setting, False unless set).
    :param openlineage_inject_transport_info: give it OpenLineage's HTTP transport
        (``spark.openlineage.transport.*``; default None: ``[openlineage] spark_inject_transport_info``). Both
        need the OpenLineage provider, and apply to a session the task starts (see docs/mlflow-openlineage.md).

    On a ``spark_connect`` connection the run outlives the task: ``durable`` (default True, Airflow's
    ``ResumableJobMixin``) submits it, keeps its id in the task state store (``hvd_job_id``), and a retry after a
    lost worker attaches to it, while a user's mark-failed or clear still ends every rank; ``deferrable`` (default
    ``[operators] default_deferrable``) submits it and defers while it trains, the triggerer holding its link,
    and is refused where the run cannot outlive the task. See docs/durable-runs.md.

    The other parameters are the run settings a task takes (those of HorovodRunner,
    :class:`~airflow_provider_hvd.runner.settings.RunSettings`; ``mlflow`` a dict, as it is templated). Beside
    ``stall_timeout``, Airflow's ``execution_timeout`` and marking the task failed also log where the ranks were
    before ending them. With ``mlflow``, each try is an MLflow run: its name by default ``<dag_id>.<task_id>``
    (with ``[map_index]`` when mapped), tagged ``airflow.dag_id``, ``airflow.task_id``, ``airflow.run_id``,
    ``airflow.try_number``, ``airflow.map_index``; a retry's run is tagged ``hvd.previous_run_id`` with the
    earlier try's. The "MLflow run" link and the Training tab lead to it (see docs/mlflow-openlineage.md).

    Progress goes to the task state store while the job runs (Airflow 3.3+): rank 0's ``log_metrics``
    history under ``hvd_metrics``, the last ``report_checkpoint`` under ``hvd_checkpoint``. On a retry,
    ``last_checkpoint()`` in the ranks returns the checkpoint an earlier try reported (see docs/long-runs.md).
    """

    kind: ClassVar[str] = "Horovod"
    template_fields: Sequence[str] = (*TrainingJobOperator.template_fields, "np")

    @takes_run_settings(task=True)
    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        np: int | str,
        conn_id: str = HorovodHook.default_conn_name,
        spark_conf: dict[str, Any] | None = None,
        openlineage_inject_parent_job_info: bool | None = None,
        openlineage_inject_transport_info: bool | None = None,
        dataframe: str | Callable[[SparkSession], DataFrame] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            conn_id=conn_id,
            spark_conf=spark_conf,
            openlineage_inject_parent_job_info=openlineage_inject_parent_job_info,
            openlineage_inject_transport_info=openlineage_inject_transport_info,
            dataframe=dataframe,
            **kwargs,
        )
        self.np = np
        if not isinstance(np, str):  # a template is checked once rendered
            self._check_dataframe_runs_on_spark(self.runs_locally())
        if dataframe is not None and self.op_args:
            raise TypeError(
                f"Task {self.task_id!r}: HorovodRunner.run_on_dataframe passes keyword arguments only: give "
                "op_kwargs instead of op_args (or call the decorated function with keywords)"
            )

    def _np(self) -> int:
        try:
            return int(self.np) if isinstance(self.np, str) else self.np
        except ValueError:
            raise SettingError(f"np rendered to {self.np!r}; it must be a non-zero int") from None

    def runs_locally(self) -> bool:
        return self._np() < 0

    def local_fix(self) -> str:
        return f"use np={abs(self._np())} (np>0)"

    def make_runner(self, **common: Any) -> HorovodRunner:
        return HorovodRunner(np=self._np(), **common)

    def start(self, runner: Any, args: list[Any], kwargs: dict[str, Any], dataframe: DataFrame | None) -> Any:
        if dataframe is not None:
            return runner.run_on_dataframe(self.python_callable, dataframe, **kwargs)
        return runner.run_with_args(self.python_callable, args, kwargs)

    def submit(self, runner: Any, args: list[Any], kwargs: dict[str, Any], dataframe: Any = None) -> Any:
        if dataframe is not None:
            return runner.submit_on_dataframe(self.python_callable, dataframe, **kwargs)
        return runner.submit_with_args(self.python_callable, args, kwargs)
