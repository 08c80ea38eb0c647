"""The driver's side of a run: start the agents' ranks together, watch them, end them all on the first failure."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

import cloudpickle
from horovod.runner.common.util.hosts import SlotInfo

from ..agent.agent import AgentArgs
from ..shared.gpus import GPU, visible_gpus
from ..shared.horovod_env import forwarded_settings, slot_env
from ..shared.messages import AgentFailed as AgentFailedMessage
from ..shared.messages import Done, Hello, Start
from ..shared.wire import new_secret
from .address import CHANNEL, RENDEZVOUS, DriverAddress
from .channel import AgentConnection, ChannelEvent, DriverChannel
from .outcome import (
    AgentFailed,
    AgentLost,
    Cancelled,
    Event,
    LaunchFailed,
    Phase,
    RankFailed,
    RankSucceeded,
    RunOutcome,
    StartTimedOut,
)
from .rendezvous import Rendezvous, plan_ranks

log = logging.getLogger("airflow_provider_hvd.runner")

ABORT_WAIT_S = 15.0  # the agents' SIGTERM grace period, and some
LAUNCH_FAILURE_SETTLE_S = 1.0  # a failed Spark task's agent connection ends about then: it names the rank
_POLL_S = 0.2


class Launcher(Protocol):
    """A way to start one agent per rank (:mod:`.local_launch`, :mod:`.spark_launch`)."""

    driver: DriverAddress  # where the channel and the rendezvous listen, and the address the agents are told
    size: int

    def describe(self) -> str: ...
    def check_slots(self) -> None:
        """Return once the ranks can start (the driver already listens: a taken port fails before any wait)."""
    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs: ...
    def start(self, args: AgentArgs, payload: bytes) -> None:
        """Start the agents; each hands ``payload`` (the pickled job) to its rank. Keep no copy not needed."""
    def failure(self) -> LaunchFailed | None: ...
    def task_failure(self, task: tuple[int, int]) -> str | None: ...
    def stop(self, cancel: bool) -> None: ...


class Supervisor:
    """One run: the channel, the rendezvous, the launcher, and the loop that watches them."""

    def __init__(
        self,
        launcher: Launcher,
        payload: bytes,
        verbosity: str,
        cancelled: Callable[[], bool],
        start_timeout_s: float,
    ) -> None:
        self.launcher = launcher
        self.size = launcher.size
        self._payload: bytes | None = payload  # handed to the launcher at start, not kept
        self._verbosity = verbosity
        self._cancelled = cancelled
        self._start_timeout_s = start_timeout_s
        self._agents: list[AgentConnection] = []  # in the order they said hello
        self._finished: set[int] = set()  # ids of connections that reported or were lost
        self._outcome = RunOutcome(self.size)
        self._rendezvous: Rendezvous | None = None

    def run(self) -> Any:
        secret = new_secret()
        driver = self.launcher.driver
        channel = driver.listen(CHANNEL, lambda host, port: DriverChannel(host, secret, agents=self.size, port=port))
        try:
            self._rendezvous = driver.listen(RENDEZVOUS, lambda host, port: Rendezvous(host, port, driver.advertised))
            log.info("HorovodRunner: driver channel on %s", driver.describe(channel.port))
            log.info("HorovodRunner: Gloo rendezvous on %s", driver.describe(self._rendezvous.port))
            self.launcher.check_slots()
            payload, self._payload = self._payload, None
            assert payload is not None, "a Supervisor runs once"
            args = self.launcher.agent_args(driver.advertised, channel.port, secret, self._verbosity)
            self.launcher.start(args, payload)
            del payload
            self._watch(channel)
        finally:
            self._clean_up(channel)
        error = self._outcome.error(self.launcher.task_failure)
        if error is not None:
            raise error
        rank0 = next(conn for conn in self._agents if conn.rank == 0)
        assert rank0.result is not None
        return cloudpickle.loads(rank0.result)

    def _clean_up(self, channel: DriverChannel) -> None:
        """Close the channel, end the launch, stop the rendezvous: each whatever the others did, and none of
        their errors replaces the run's own (they are logged)."""
        cancel = self._outcome.cause is not None or len(self._outcome.succeeded) < self.size
        rendezvous = self._rendezvous
        steps: list[tuple[str, Callable[[], None]]] = [
            ("close the driver channel", channel.close),  # agents still connected end their ranks at once
            (f"end {self.launcher.describe()}", lambda: self.launcher.stop(cancel=cancel)),
        ]
        if rendezvous is not None:
            steps.append(("stop the Gloo rendezvous", rendezvous.stop))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.exception("HorovodRunner: could not %s", what)

    def _running(self) -> list[AgentConnection]:
        return [conn for conn in self._agents if conn.rank is not None and id(conn) not in self._finished]

    def _watch(self, channel: DriverChannel) -> None:
        start_deadline = time.monotonic() + self._start_timeout_s
        abort_deadline: float | None = None
        launch_failed_at: float | None = None
        while True:
            if self._cancelled():
                self._record(Cancelled())
            try:
                self._on_event(channel.events.get(timeout=_POLL_S))
            except queue.Empty:
                pass
            now = time.monotonic()
            failure = self.launcher.failure()
            if failure is not None and not self._outcome.ending:
                launch_failed_at = launch_failed_at or now
                if now - launch_failed_at >= LAUNCH_FAILURE_SETTLE_S:
                    self._record(failure)
            if self._outcome.phase is Phase.STARTING and now > start_deadline:
                self._record(StartTimedOut(len(self._agents), self.size, self._start_timeout_s, self.launcher.describe()))
            if self._outcome.ending:
                abort_deadline = abort_deadline or now + ABORT_WAIT_S
                if not self._running() or now > abort_deadline:
                    return

    def _agents_started(self) -> int:
        return sum(conn.rank is not None for conn in self._agents)

    def _record(self, event: Event) -> None:
        reason = self._outcome.record(event)
        if reason is None:
            return
        waiting = [conn for conn in self._agents if id(conn) not in self._finished]
        log.warning("HorovodRunner: %s; ending %d running rank(s)", reason, len(self._running()))
        for conn in waiting:
            conn.abort(reason)

    def _on_event(self, event: ChannelEvent) -> None:
        conn, message = event.conn, event.message
        if isinstance(message, Hello):
            if self._agents_started() or self._outcome.ending:
                conn.abort("this run has already started or ended; a re-run task cannot join it")
                return
            self._agents.append(conn)
            if len(self._agents) == self.size:
                self._start_ranks()
            return
        if conn not in self._agents:
            return  # a turned-away agent, or a connection that never said hello
        self._finished.add(id(conn))
        where = conn.where()
        if isinstance(message, Done):
            if message.ok:
                self._record(RankSucceeded(conn.rank))  # type: ignore[arg-type]
            else:
                self._record(RankFailed(conn.rank, where, message))  # type: ignore[arg-type]
        elif isinstance(message, AgentFailedMessage):
            self._record(AgentFailed(conn.rank, where, message.error))
        else:
            hello = conn.hello
            task = (hello.partition, hello.attempt) if hello and hello.attempt is not None else None
            self._record(AgentLost(conn.rank, where, event.lost, task))  # type: ignore[arg-type]

    def _start_ranks(self) -> None:
        self._agents.sort(key=lambda conn: conn.hello.partition or 0)  # type: ignore[union-attr]
        plan = plan_ranks([conn.hello.host for conn in self._agents])  # type: ignore[union-attr]
        assert self._rendezvous is not None
        self._rendezvous.init(plan, [conn.peer_host for conn in self._agents])
        settings = forwarded_settings(os.environ)
        gpus = self._visible_gpus(plan)
        for conn, slot, seen in zip(self._agents, plan, gpus):
            start = Start(slot.rank, {**settings, **slot_env(slot, self._rendezvous.host, self._rendezvous.port)}, slot.local_size, seen)
            try:
                conn.start(start)
            except OSError:
                pass  # it is gone: its connection's end is on its way as an event
        self._outcome.started()
        log.info("HorovodRunner: %d ranks started (%s)", self.size, self.launcher.describe())

    def _visible_gpus(self, plan: list[SlotInfo]) -> list[list[str] | None]:
        """The GPUs each agent's rank sees, from those given to the ranks on its host (:mod:`.gpus`)."""
        by_host: dict[str, list[int]] = {}
        for agent, slot in sorted(enumerate(plan), key=lambda pair: pair[1].local_rank):
            by_host.setdefault(slot.hostname, []).append(agent)
        seen: list[list[str] | None] = [None] * len(plan)
        for agents in by_host.values():
            own = [self._agents[agent].hello.resources.get(GPU, []) for agent in agents]  # type: ignore[union-attr]
            for agent, gpus in zip(agents, visible_gpus(own)):
                seen[agent] = gpus
        return seen
