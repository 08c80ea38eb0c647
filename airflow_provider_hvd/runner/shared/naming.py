"""How a run's texts name the runner the user called and its parameters.

Both runners share the run's machinery; each log line, refusal and error of a run names the runner that
started it (``HorovodRunner``, ``TorchDistributor``) and the parameters of that runner (``np`` and ``np<0``;
``num_processes`` and ``local_mode=True``), never the other's. A run holds one :class:`RunnerNaming`, which
its launcher, supervisor, channel and agents take.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerNaming:
    runner: str  # the class the user called
    size: str  # its parameter for the number of ranks
    on_this_host: str  # how that runner runs on this host alone, without Spark
    on_spark: str  # how it runs on Spark
    job_group: str  # the prefix of the Spark job group of its barrier jobs
    rendezvous: str  # what its ranks meet at, on the driver
    local_size: str = "{size}={n}"  # how a local run of n ranks is spelled ({size}, {n})
    per_task: int = 1  # ranks in each Spark task (TorchDistributor's use_gpu=True: spark.task.resource.gpu.amount)

    def call(self, ranks: int) -> str:
        """``HorovodRunner(np=3)``, ``TorchDistributor(num_processes=3)``."""
        return f"{self.runner}({self.size}={ranks})"

    def local_args(self, ranks: int) -> str:
        """The arguments of a run of ``ranks`` on this host: ``np=-3``, ``num_processes=3, local_mode=True``."""
        return self.local_size.format(size=self.size, n=ranks)

    def local_call(self, ranks: int) -> str:
        """``HorovodRunner(np=-3)``, ``TorchDistributor(num_processes=3, local_mode=True)``."""
        return f"{self.runner}({self.local_args(ranks)})"

    def needs_slots(self, tasks: int) -> str:
        """``HorovodRunner(np=3) needs 3 Spark task slots``; the ranks in each task when more than one."""
        if self.per_task == 1:
            return f"{self.call(tasks)} needs {tasks} Spark task slots"
        each = f"runs {self.per_task} ranks in each Spark task (one GPU each)"
        return f"{self.call(tasks * self.per_task)} {each} and needs {tasks} slots"

    def lower_to(self, tasks: int) -> str:
        """``Lower np to at most 2``: the most ranks that ``tasks`` slots hold."""
        return f"Lower {self.size} to at most {tasks * self.per_task}"


HOROVOD_RUNNER = RunnerNaming("HorovodRunner", "np", "np<0", "np>0", "horovod-runner", "Gloo rendezvous", "{size}=-{n}")
TORCH_DISTRIBUTOR = RunnerNaming(
    "TorchDistributor",
    "num_processes",
    "local_mode=True",
    "local_mode=False",
    "torch-distributor",
    "torch.distributed store",
    "{size}={n}, local_mode=True",
)
