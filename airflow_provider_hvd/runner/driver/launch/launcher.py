"""What the supervisor asks of a launcher: start one agent per rank, say what came of the launch, end it.

The shape of torch elastic's process contexts (``start``, ``poll``, ``close``): :class:`~.local.LocalLauncher`
(``np < 0``: agents as driver threads) and :class:`~.spark.barrier.SparkLauncher` (a Spark barrier job) behind
it. What the launch knows and the channel does not (a Spark job that failed, Spark's reason for a task it ended)
comes out of :meth:`Launcher.poll` as events (:mod:`..events`); how the run reacts to them is the supervisor's.
A launcher imports nothing of the supervision (``tests/test_layout.py``). The Spark launcher of a run on a
DataFrame also has its ``shard_plan`` and ``spark_tasks()``, from which the supervisor follows the rows
(:mod:`..watch.dataframe_progress`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ...agent.agent import AgentArgs
    from ...shared.naming import RunnerNaming
    from ..events import LaunchEvent
    from .address import DriverAddress


class Launcher(Protocol):
    """A way to start one agent per rank."""

    driver: DriverAddress  # where the channel and the rendezvous listen, and the address the agents are told
    size: int
    naming: RunnerNaming  # the runner whose run it launches, as the run's texts name it

    def describe(self) -> str:
        """What the launch is, for the texts: ``a Spark barrier job of 2 tasks on local[2]``."""

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        """What each agent is given to reach the driver at ``host``:``port`` and relay as ``verbosity`` says."""

    def start(self, args: AgentArgs, payload: bytes) -> None:
        """Start the agents once the ranks can start (a bounded wait for the task slots first: the driver already
        listens, so a taken port fails before any wait); each hands ``payload`` (the pickled job) to its rank.
        Keep no copy not needed."""

    def poll(self) -> list[LaunchEvent]:
        """What came of the launch since the last poll; called every loop of the supervisor, and once after
        :meth:`close`. Never waits."""

    def ended(self) -> bool:
        """Whether every agent the launch started has ended (a Spark job: it has ended). Never waits."""

    def close(self, reason: str | None) -> None:
        """End the launch: wait for the agents (None: every rank returned), or end them first, because of
        ``reason``. Bounded; what it cannot end is said in a warning."""

    def memory_settings(self) -> dict[str, str]:
        """The settings that bound a rank's memory, for a killed rank's evidence (:mod:`..verdict.kills`)."""
