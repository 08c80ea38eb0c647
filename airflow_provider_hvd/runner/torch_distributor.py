"""TorchDistributor: the API of PySpark's ``pyspark.ml.torch.distributor.TorchDistributor``, on this runner.

Its ranks are plain torch.distributed processes, started as ``torchrun`` starts them (its ``env://``
variables, :mod:`.shared.torch_env`), supervised as HorovodRunner's are; Horovod is not needed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .driver.exits import DEFAULT_EXIT_TIMEOUT_S
from .driver.local_launch import LocalLauncher
from .driver.mlflow_run import MlflowSettings
from .driver.progress import ProgressSink
from .driver.slots import DEFAULT_SLOT_WAIT_S, TASK_GPUS
from .driver.spark_cluster import active_session, session_conf
from .driver.spark_launch import SparkLauncher
from .errors import LaunchError
from .rank.script import run_script
from .runner import _Run, _Runner, check_fits
from .shared.gpus import host_gpus
from .shared.naming import TORCH_DISTRIBUTOR

if TYPE_CHECKING:
    from .driver.rank_kinds import RankKind
    from .driver.supervisor import Launcher

log = logging.getLogger("airflow_provider_hvd.runner")


class TorchDistributor(_Runner):
    """Run a torch.distributed training function, or a Python file, on ``num_processes`` processes.

    A drop-in for PySpark's ``TorchDistributor`` (same parameters, defaults and meaning), with the supervision,
    logs, progress and failure reports of :class:`HorovodRunner`. Each process gets ``torchrun``'s
    environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so that
    ``torch.distributed.init_process_group("gloo")`` (or ``"nccl"``) needs no arguments; the driver serves the
    run's store.

    :param num_processes: how many processes (ranks) to run.
    :param local_mode: True: on this host (no Spark needed). False: a Spark barrier job on the active
        SparkSession (``local[*]`` if none).
    :param use_gpu: one GPU per process. Locally: this host's GPUs (``CUDA_VISIBLE_DEVICES``, else
        ``nvidia-smi``), ``num_processes`` cut to their number as PySpark does. On Spark: with
        ``spark.task.resource.gpu.amount = k``, ``num_processes / k`` tasks of ``k`` processes each, one of its
        task's GPUs each (``num_processes`` must be a multiple of ``k``). False: one process per task, the
        processes' CUDA settings left alone.
    :param driver_log_verbosity: for ``local_mode=False``: ``"all"`` (default: every line the processes write
        reaches the driver's log, as PySpark streams them) or ``"log_callback_only"`` (only ``log_to_driver``
        messages), as :class:`HorovodRunner`'s; local runs relay every line.
    :param slot_wait_timeout: as :class:`HorovodRunner`'s.
    :param resume_from: as :class:`HorovodRunner`'s.
    :param progress_sink: as :class:`HorovodRunner`'s.
    :param stall_timeout: as :class:`HorovodRunner`'s.
    :param exit_timeout: as :class:`HorovodRunner`'s.
    :param mlflow: as :class:`HorovodRunner`'s (an MLflow run per :meth:`run`).

    After :meth:`run` (also one that raised), ``metrics``, ``checkpoint``, ``mlflow_run_id`` and ``mlflow_run_url``
    are as :class:`HorovodRunner`'s.
    """

    naming = TORCH_DISTRIBUTOR

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        *,
        driver_log_verbosity: str = "all",
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        resume_from: dict[str, Any] | str | None = None,
        progress_sink: ProgressSink | None = None,
        stall_timeout: float | timedelta | None = None,
        exit_timeout: float | timedelta = DEFAULT_EXIT_TIMEOUT_S,
        mlflow: bool | Mapping[str, Any] | MlflowSettings | None = None,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes <= 0:
            raise ValueError(f"num_processes has to be a positive integer, not {num_processes!r}")
        self._settings(
            driver_log_verbosity, slot_wait_timeout, resume_from, progress_sink, stall_timeout, exit_timeout, mlflow
        )
        self.num_processes = num_processes
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value; or, when
        ``train_object`` is the path of a Python file, run it with ``args`` as its command-line arguments
        (``str()`` of each) and return None. The file's content travels with the job.

        Raises :class:`RankFailedError` (naming the first rank that failed, with its traceback) after ending
        the others.
        """
        if isinstance(train_object, str | os.PathLike):
            if kwargs:
                raise ValueError("Running pytorch file does not support key-word type arguments.")
            path = os.fspath(train_object)
            try:
                source = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"train_object {path!r} is not a readable Python file: {exc}") from exc
            self._run_job(run_script, (os.path.abspath(path), source, [str(arg) for arg in args]), {})
            return None
        check_fits(train_object, args, kwargs)
        return self._run_job(train_object, args, kwargs)

    def _rank_kind(self) -> RankKind:
        from .driver.rank_kinds import TorchKind

        return TorchKind()

    def _mlflow_params(self) -> dict[str, Any]:
        settings = {"num_processes": self.num_processes, "local_mode": self.local_mode, "use_gpu": self.use_gpu}
        return {**settings, **super()._mlflow_params()}

    def _launcher(self, run: _Run) -> tuple[Launcher, Callable[[str], str | None], bool]:
        if self.local_mode:
            local = LocalLauncher(self._local_processes(), self.use_gpu, self.naming)
            return local, lambda key: None, False
        spark = active_session(self.naming.runner)
        conf = session_conf(spark)
        per_task = self._processes_per_task(conf(TASK_GPUS)) if self.use_gpu else 1
        launcher = SparkLauncher(
            spark,
            self.num_processes,
            self.slot_wait_timeout,
            cancelled=lambda: run.cancelled,
            per_task=per_task,
            use_gpus=self.use_gpu,
            naming=self.naming,
        )
        from .driver.encryption import spark_encrypts

        return launcher, conf, spark_encrypts(conf) is not None  # TLS for the channel when Spark encrypts its own

    def _local_processes(self) -> int:
        if not self.use_gpu:
            return self.num_processes
        gpus, found_by = host_gpus()
        if not gpus:
            raise LaunchError(
                f"{self.naming.runner}(use_gpu=True, local_mode=True) gives each process a GPU of this host, and "
                f"it has none ({found_by}). Pass use_gpu=False to train on the CPU."
            )
        if self.num_processes > len(gpus):
            log.warning(
                "%s: 'num_processes' cannot be set to a value greater than the number of available "
                "GPUs on the driver, which is %d (%s); running %d processes",
                self.naming.runner,
                len(gpus),
                found_by,
                len(gpus),
            )
            return len(gpus)
        return self.num_processes

    def _processes_per_task(self, amount: str | None) -> int:
        """``spark.task.resource.gpu.amount`` as processes per task; PySpark's checks, with the fix named."""
        try:
            per_task = int(amount or "0")
        except ValueError:
            per_task = -1
        if per_task < 1:
            raise LaunchError(
                f"'{TASK_GPUS}' was {'unset' if amount is None else repr(amount)}, so gpu usage is unavailable: "
                f"set it to the GPUs each task gets (a whole number, e.g. 1, with spark.executor.resource.gpu.amount),"
                " or pass use_gpu=False."
            )
        if self.num_processes % per_task:
            raise LaunchError(
                f"{self.naming.runner} 'num_processes' value ({self.num_processes}) must be a multiple of "
                f"'{TASK_GPUS}' ({per_task}) value: each task runs {per_task} processes, one GPU each."
            )
        return per_task
