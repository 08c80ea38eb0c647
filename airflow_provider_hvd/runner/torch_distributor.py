"""TorchDistributor: the API of PySpark's ``pyspark.ml.torch.distributor.TorchDistributor``, on this runner.

Its ranks are plain torch.distributed processes, started as ``torchrun`` starts them (its ``env://``
variables, :mod:`.shared.torch_env`), supervised as HorovodRunner's are; Horovod is not needed. PySpark's
checks of the GPU settings, their errors and its public attributes are PySpark's; what differs on purpose is
in docs/torch-distributor.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from .driver.launch.local import LocalLauncher
from .driver.launch.spark.capacity import TASK_GPUS
from .driver.launch.spark.cluster import existing_session, is_connect, session_conf
from .errors import LaunchError
from .rank.script import run_script
from .runner import _Runner, check_dataframe, check_fits
from .settings import PYSPARK_DEFAULTS, RunOptions, RunSettings, takes_run_settings
from .shared.gpus import GPU, host_gpus, spark_gpus_here
from .shared.naming import TORCH_DISTRIBUTOR

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .driver.launch.launcher import Launcher
    from .driver.ranks.kind import RankKind
    from .jobs import Job

log = logging.getLogger("airflow_provider_hvd.runner")

PYSPARK_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"  # PySpark's ``ssl_conf`` (its runs read it; these need not)
DRIVER_GPUS = "spark.driver.resource.gpu.amount"


def _read_script(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"train_object {path!r} is not a readable Python file: {exc}") from exc


def _script_args(train_object: str | os.PathLike[str], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``run_script``'s arguments for a Python file: its absolute path, its content, ``str()`` of each arg."""
    if kwargs:
        raise ValueError("Running pytorch file does not support key-word type arguments.")
    path = os.fspath(train_object)
    return (os.path.abspath(path), _read_script(path), [str(arg) for arg in args])


class TorchDistributor(_Runner):
    """Run a torch.distributed training function, or a Python file, on ``num_processes`` processes.

    A drop-in for PySpark's ``TorchDistributor`` (same parameters, defaults, checks, errors and attributes),
    with the supervision, logs, progress and failure reports of :class:`HorovodRunner`. Each process gets
    ``torchrun``'s environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...),
    so that ``torch.distributed.init_process_group("gloo")`` (or ``"nccl"``) needs no arguments; the driver
    serves the run's store.

    :param num_processes: how many processes (ranks) to run.
    :param local_mode: True: on this host (no Spark needed). False: a Spark barrier job on the active
        SparkSession (``local[*]`` if none).
    :param use_gpu: one GPU per process. Locally, on an active SparkSession: the driver's GPUs
        (``spark.driver.resource.gpu.amount``, else ``RuntimeError`` here, as PySpark's); without one: this
        host's (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``); ``num_processes`` cut to their number with a
        warning, as PySpark does. On Spark: with ``spark.task.resource.gpu.amount = k`` (unset: ``RuntimeError``,
        here when a SparkSession is active, else when :meth:`run` starts), ``num_processes / k`` tasks of ``k``
        processes each, one of its task's GPUs each (``num_processes`` must be a multiple of ``k``). False: one
        process per task, which sees no GPU (``CUDA_VISIBLE_DEVICES=""``, as PySpark's), unless the application
        sets ``spark.executorEnv.CUDA_VISIBLE_DEVICES``; locally, the processes' CUDA settings are left alone.

    The other parameters are the run settings (:class:`~.settings.RunSettings`), as :class:`HorovodRunner`'s;
    ``driver_log_verbosity`` is ``"all"`` by default (PySpark's: every line the processes write reaches the
    driver's log, as PySpark streams them). Those that concern Spark apply to ``local_mode=False``.

    PySpark's attributes: ``num_processes`` (after the cut to the driver's GPUs), ``local_mode``, ``use_gpu``,
    ``num_tasks`` (the Spark tasks: ``num_processes / k`` with GPUs on Spark, else ``num_processes``),
    ``input_params`` (a dict of those four) and ``ssl_conf``. After :meth:`run` (also one that raised),
    ``metrics``, ``checkpoint``, ``attempts``, ``mlflow_run_id`` and ``mlflow_run_url`` are as
    :class:`HorovodRunner`'s.
    """

    naming = TORCH_DISTRIBUTOR

    @takes_run_settings(**PYSPARK_DEFAULTS)
    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        **settings: Unpack[RunOptions],
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes <= 0:
            raise ValueError(f"num_processes has to be a positive integer, not {num_processes!r}")
        self._settings(RunSettings.from_kwargs(settings, "TorchDistributor", **PYSPARK_DEFAULTS))
        self.num_processes = num_processes
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.ssl_conf = PYSPARK_SSL_CONF
        self._asked = num_processes  # before a cut to the driver's GPUs
        self._local_gpus: tuple[list[str], str] | None = None  # local_mode, use_gpu: the GPUs and their source
        self._per_task = 1  # processes in each Spark task
        # PySpark's checks, in the constructor as its own (on the active session: only GPUs need one)
        self._plan(existing_session() if self.use_gpu else None)

    def _plan(self, spark: SparkSession | None) -> None:
        """PySpark's GPU checks and counts (``num_processes``, ``num_tasks``, ``input_params``) for ``spark``.

        ``spark`` None: no session is active; locally the GPUs are this host's, and on Spark the checks wait
        for the session :meth:`run` uses.
        """
        if self.use_gpu and self.local_mode:
            self._local_gpus, available = self._driver_gpus(spark)
            self.num_processes = self._asked
            if self._asked > available:
                log.warning(
                    "%s: 'num_processes' cannot be set to a value greater than the number of available GPUs on the "
                    "driver, which is %d (%s). 'num_processes' was reset to be equal to the number of available GPUs.",
                    self.naming.runner,
                    available,
                    self._local_gpus[1],
                )
                self.num_processes = available
        elif self.use_gpu and spark is not None:
            self._per_task = self._processes_per_task(session_conf(spark)(TASK_GPUS))
        self.num_tasks = self.num_processes // self._per_task
        self.input_params = {
            "num_processes": self.num_processes,
            "local_mode": self.local_mode,
            "use_gpu": self.use_gpu,
            "num_tasks": self.num_tasks,
        }

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value; or, when
        ``train_object`` is the path of a Python file, run it with ``args`` as its command-line arguments
        (``str()`` of each) and return None. The file's content travels with the job.

        Raises :class:`RankFailedError` (naming the first rank that failed, with its traceback) after ending
        the others.
        """
        if isinstance(train_object, str | os.PathLike):
            self._run_job(run_script, _script_args(train_object, args, kwargs), {})
            return None
        check_fits(train_object, args, kwargs)
        return self._run_job(train_object, args, kwargs)

    def train_on_dataframe(self, train_function: Callable[..., Any], df: DataFrame, *args: Any, **kwargs: Any) -> Any:
        """:meth:`run` of ``train_function(*args, **kwargs)``, with the rows of ``df`` (a DataFrame of the run's
        session) shared out among the processes: in ``train_function``, ``get_spark_partition_data_loader(...)``
        (PySpark's loader) or ``dataframe_shard()`` read this process's shard. Any number of partitions: the
        shards differ by at most one row; a DataFrame of ``num_processes`` equal partitions gives rank ``i``
        partition ``i``, as PySpark's ``_train_on_dataframe`` does. Needs ``local_mode=False``, as PySpark's.
        See docs/dataframes.md.
        """
        check_dataframe(df, self.naming, "train_on_dataframe")
        if self.local_mode:
            raise ValueError(
                "TorchDistributor.train_on_dataframe requires setting TorchDistributor.local_mode to False: the "
                f"rows come from a Spark barrier job's tasks. Use TorchDistributor(num_processes={self.num_processes}"
                ", local_mode=False), on a local[*] session to stay on this host."
            )
        check_fits(train_function, args, kwargs)
        return self._run_job(train_function, args, kwargs, df)

    _train_on_dataframe = train_on_dataframe  # PySpark's private name for it

    def submit(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Job:
        """Start what :meth:`run` runs over Spark Connect, supervised inside the cluster, and return its handle at
        once (``job.wait()`` returns what :meth:`run` would); see ``HorovodRunner.submit``."""
        if isinstance(train_object, str | os.PathLike):
            return self._submit_job(run_script, _script_args(train_object, args, kwargs), {})
        check_fits(train_object, args, kwargs)
        return self._submit_job(train_object, args, kwargs)

    def submit_on_dataframe(
        self,
        train_function: Callable[..., Any],
        dataframe: str | Callable[[SparkSession], DataFrame],
        *args: Any,
        **kwargs: Any,
    ) -> Job:
        """:meth:`submit` of what :meth:`train_on_dataframe` runs, ``dataframe`` the DataFrame's recipe (its SQL,
        or a callable that receives a SparkSession and returns it), which the run's host builds in its own
        session: see ``HorovodRunner.submit_on_dataframe``."""
        from .durable.dataframe_recipe import DataFrameRecipe

        recipe = DataFrameRecipe.of(dataframe, self.naming, "submit_on_dataframe")
        check_fits(train_function, args, kwargs)
        return self._submit_job(train_function, args, kwargs, recipe)

    def _spark_launch(self) -> tuple[SparkSession, int, bool]:
        if self.local_mode:
            raise LaunchError(
                f"{self.naming.runner}(local_mode=True).submit(): a local run lives in this process and cannot "
                "outlive it; use run(), or local_mode=False on a Spark Connect session."
            )
        spark = self._spark()
        self._plan(spark)  # the checks on the session the job runs on (the constructor's, when it had one)
        return spark, self._per_task, self.use_gpu

    def _size(self) -> int:
        return self.num_processes

    def _rank_kind(self) -> RankKind:
        from .driver.ranks.kind import torch_kind

        return torch_kind()

    def _mlflow_params(self) -> dict[str, Any]:
        settings = {"num_processes": self.num_processes, "local_mode": self.local_mode, "use_gpu": self.use_gpu}
        return {**settings, **super()._mlflow_params()}

    def _local_launcher(self) -> Launcher | None:
        if not self.local_mode:
            return None
        return LocalLauncher(self.num_processes, self.use_gpu, self.naming, self._local_gpus)

    def _driver_gpus(self, spark: SparkSession | None) -> tuple[tuple[list[str], str], int]:
        """The GPUs of ``local_mode=True`` (and where they come from), and how many processes they allow.

        On a SparkSession, PySpark's: the driver's (``spark.driver.resource.gpu.amount``; over Spark Connect
        this host's, as PySpark's client uses its own); without one, this host's.
        """
        if spark is None:
            gpus, found_by = host_gpus()
            if not gpus:
                raise LaunchError(
                    f"{self.naming.runner}(use_gpu=True, local_mode=True) gives each process a GPU of this host, and "
                    f"it has none ({found_by}). Pass use_gpu=False to train on the CPU."
                )
            return (gpus, found_by), len(gpus)
        fix = (
            f" {self.naming.runner}(use_gpu=True, local_mode=True) on a SparkSession gives each process one of the "
            f"driver's GPUs: start the session with {DRIVER_GPUS} (and spark.driver.resource.gpu.discoveryScript),"
            " or pass use_gpu=False to train on the CPU."
        )
        connect = is_connect(spark)
        if not connect and GPU not in spark.sparkContext.resources:
            raise LaunchError("GPUs were unable to be found on the driver." + fix)
        amount = session_conf(spark)(DRIVER_GPUS)
        try:
            available = int(amount or "0")
        except ValueError:
            available = 0
        if available <= 0:
            raise LaunchError("GPU resources were not configured properly on the driver." + fix)
        if connect:
            gpus, found_by = host_gpus()
            return (gpus, f"{found_by}; the server's {DRIVER_GPUS}={amount}"), available
        addresses = list(spark.sparkContext.resources[GPU].addresses)
        return (spark_gpus_here(addresses, os.environ), f"the driver's Spark GPUs, {DRIVER_GPUS}={amount}"), available

    def _processes_per_task(self, amount: str | None) -> int:
        """``spark.task.resource.gpu.amount`` as processes per task; PySpark's checks and words, with the fix."""
        try:
            per_task = int(amount or "0")
        except ValueError:
            raise LaunchError(
                f"'{TASK_GPUS}' was {amount!r}, so gpu usage is unavailable: {self.naming.runner} runs a whole "
                f"number of processes in each task, one GPU each: set it to a whole number (e.g. 1), or pass "
                "use_gpu=False."
            ) from None
        if per_task < 1:
            raise LaunchError(
                f"'{TASK_GPUS}' was unset, so gpu usage is unavailable. Set it to the GPUs each task gets (a whole "
                "number, e.g. 1, with spark.executor.resource.gpu.amount), or pass use_gpu=False."
            )
        if self.num_processes % per_task:
            raise LaunchError(
                f"{self.naming.runner} 'num_processes' value ({self.num_processes}) must be a multiple of "
                f"'{TASK_GPUS}' ({per_task}) value. Each task runs {per_task} processes, one GPU each."
            )
        return per_task
