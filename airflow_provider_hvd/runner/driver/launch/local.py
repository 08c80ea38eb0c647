"""Local strategy (``np < 0``): the rank agents run as threads of the driver, their ranks on this host.

The agents share the driver's one copy of the pickled job: each writes it to its rank's stdin.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from ...agent.agent import AgentArgs, run_agent
from ...errors import LaunchError
from ...shared.gpus import GPU, host_gpus
from ...shared.messages import Hello
from ...shared.naming import HOROVOD_RUNNER, RunnerNaming
from ..events import LaunchEvent, LaunchFailed
from .address import LOOPBACK_DRIVER


class LocalLauncher:
    """Starts ``size`` agents on this host; every rank's output reaches the driver, as in sparkdl."""

    def __init__(
        self,
        size: int,
        use_gpus: bool = True,
        naming: RunnerNaming = HOROVOD_RUNNER,
        gpus: tuple[list[str], str] | None = None,
    ) -> None:
        """``gpus``: the GPUs to give the ranks and where they came from (default: this host's, ``host_gpus``)."""
        self.size = size
        self.naming = naming
        self.driver = dataclasses.replace(LOOPBACK_DRIVER, naming=naming)  # any free ports
        if not use_gpus:
            gpus = [], ""  # the ranks' own CUDA settings
        self.gpus, self._gpus_from = gpus if gpus is not None else host_gpus()
        self._threads: list[threading.Thread] = []
        self._failure: BaseException | None = None
        self._told = False

    def describe(self) -> str:
        return f"{self.size} processes on this host"

    def _check_gpus(self) -> None:
        """One GPU per rank on a host with GPUs; the cores may be oversubscribed, as sparkdl's are."""
        if self.gpus and self.size > len(self.gpus):
            fewer = self.naming.local_args(len(self.gpus))
            raise LaunchError(
                f"{self.naming.local_call(self.size)} runs {self.size} ranks on this host, one GPU each, but it has "
                f"{len(self.gpus)} GPU(s) ({self._gpus_from}). Use {fewer} or fewer, or a Spark cluster "
                f"({self.naming.on_spark})."
            )

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        return AgentArgs(
            host, port, secret, relay_output=True, echo_output=False, keep_omp_threads="OMP_NUM_THREADS" in os.environ
        )

    def _agent(self, args: AgentArgs, index: int, payload: bytes) -> None:
        gpus = {GPU: [self.gpus[index]]} if self.gpus else {}
        try:
            run_agent(args, lambda: payload, Hello(host="", pid=os.getpid(), partition=index, resources=gpus))
        except BaseException as exc:  # noqa: BLE001 - surfaced through poll()
            self._failure = self._failure or exc

    def start(self, args: AgentArgs, payload: bytes) -> None:
        self._check_gpus()
        self._threads = [
            threading.Thread(target=self._agent, args=(args, i, payload), name=f"hvd-local-agent-{i}", daemon=True)
            for i in range(self.size)
        ]
        for thread in self._threads:
            thread.start()

    def poll(self) -> list[LaunchEvent]:
        """An agent thread that raised, once (its rank's own failures reach the driver over the channel)."""
        if self._failure is None or self._told:
            return []
        self._told = True
        return [LaunchFailed(self.describe(), f"a rank agent failed: {self._failure!r}", self._failure)]

    def ended(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def memory_settings(self) -> dict[str, str]:
        return {}  # the ranks run beside the driver, bounded by this host's memory alone

    def close(self, reason: str | None) -> None:
        """Wait for the agents; those not done yet saw the driver close the channel and are ending their ranks."""
        for thread in self._threads:
            thread.join(timeout=60)
