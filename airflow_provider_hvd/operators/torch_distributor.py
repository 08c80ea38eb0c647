"""TorchDistributorOperator: a TorchDistributor job as an Airflow task; rank 0's return value is its XCom."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow_provider_hvd.hooks.horovod import HorovodHook
from airflow_provider_hvd.operators.training_job import TrainingJobOperator
from airflow_provider_hvd.runner.errors import SettingError
from airflow_provider_hvd.runner.settings import PYSPARK_DEFAULTS, takes_run_settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from airflow_provider_hvd.runner.torch_distributor import TorchDistributor


class TorchDistributorOperator(TrainingJobOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on ``num_processes`` torch.distributed processes; push rank
    0's return value.

    :param python_callable: the training function; it calls ``torch.distributed.init_process_group()`` itself
        (no arguments needed: each process gets ``torchrun``'s environment). Shipped with cloudpickle.
    :param op_args: positional arguments (templated).
    :param op_kwargs: keyword arguments (templated).
    :param num_processes: how many processes (templated). As PySpark's ``TorchDistributor``.
    :param local_mode: True (default, as PySpark's): the processes run on the Airflow worker's host, without
        Spark. False: a Spark barrier job on the connection's cluster.
    :param use_gpu: one GPU per process (default True, as PySpark's); pass False to train on CPUs.
    :param conn_id: the ``spark`` connection (default ``spark_default``; templated), or a ``spark_connect`` one,
        for ``local_mode=False``.
    :param spark_conf: Spark settings on top of the connection's (templated), e.g.
        ``{"spark.task.resource.gpu.amount": "1"}``.
    :param dataframe: training data from Spark: a SQL string (templated), or a callable that receives the task's
        SparkSession and returns a DataFrame; built in the task's session (classic or Connect), its rows are
        shared out among the processes (``TorchDistributor.train_on_dataframe``: ``dataframe_shard()`` or
        ``get_spark_partition_data_loader(...)`` in the processes); a run that outlives the task has its host
        build it in the run's own session (``TorchDistributor.submit_on_dataframe``). Needs ``local_mode=False``.
        See docs/dataframes.md.
    :param openlineage_inject_parent_job_info: OpenLineage's parent job in the Spark session's settings
        (default None: ``[openlineage] spark_inject_parent_job_info``): as :class:`HorovodRunnerOperator`'s.
    :param openlineage_inject_transport_info: OpenLineage's transport there (default None: ``[openlineage]
        spark_inject_transport_info``): as :class:`HorovodRunnerOperator`'s.

    The other parameters are the run settings a task takes, as :class:`HorovodRunnerOperator`'s;
    ``driver_log_verbosity`` is ``"all"`` by default (PySpark's ``TorchDistributor``: every line the processes
    write reaches the task log; local processes' output always does).

    Progress, resume on retry, ``on_kill``, ``durable`` and ``deferrable`` (runs that outlive the task on a
    ``spark_connect`` connection), the Spark UI link and the MLflow run are as :class:`HorovodRunnerOperator`'s.
    """

    kind: ClassVar[str] = "torch.distributed"
    template_fields: Sequence[str] = (*TrainingJobOperator.template_fields, "num_processes")

    run_defaults = PYSPARK_DEFAULTS

    @takes_run_settings(task=True, **PYSPARK_DEFAULTS)
    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        num_processes: int | str = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
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
        if not isinstance(num_processes, str):  # a template is checked once rendered
            self._check_processes(num_processes)
        self.num_processes = num_processes
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self._check_dataframe_runs_on_spark(self.local_mode)

    @staticmethod
    def _check_processes(num_processes: object) -> int:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes <= 0:
            raise SettingError(f"num_processes must be a positive int, not {num_processes!r}")
        return num_processes

    def _processes(self) -> int:
        try:
            value = int(self.num_processes) if isinstance(self.num_processes, str) else self.num_processes
        except ValueError:
            raise SettingError(f"num_processes rendered to {self.num_processes!r}; it must be a positive int") from None
        return self._check_processes(value)

    def runs_locally(self) -> bool:
        self._processes()  # a bad rendered value fails before anything starts
        return self.local_mode

    def local_fix(self) -> str:
        return "pass local_mode=False"

    def make_runner(self, **common: Any) -> TorchDistributor:
        from airflow_provider_hvd.runner.torch_distributor import TorchDistributor

        return TorchDistributor(self._processes(), self.local_mode, self.use_gpu, **common)

    def start(self, runner: Any, args: list[Any], kwargs: dict[str, Any], dataframe: DataFrame | None) -> Any:
        if dataframe is not None:
            return runner.train_on_dataframe(self.python_callable, dataframe, *args, **kwargs)
        return runner.run(self.python_callable, *args, **kwargs)

    def submit(self, runner: Any, args: list[Any], kwargs: dict[str, Any], dataframe: Any = None) -> Any:
        if dataframe is not None:
            return runner.submit_on_dataframe(self.python_callable, dataframe, *args, **kwargs)
        return runner.submit(self.python_callable, *args, **kwargs)
