"""The driver's side of a run: start the agents' ranks together, watch them, end them all on the first failure."""

from __future__ import annotations

import logging
import queue
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

import cloudpickle

from .agent import AgentArgs
from .channel import AgentConnection, DriverChannel
from .errors import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError
from .rendezvous import Rendezvous, plan_ranks, rank_env
from .wire import new_secret

log = logging.getLogger("airflow_provider_hvd.runner")

ABORT_WAIT_S = 15.0  # the agents' SIGTERM grace period, and some
_POLL_S = 0.2


class Launcher(Protocol):
    driver_host: str
    size: int

    def describe(self) -> str: ...
    def check_slots(self) -> None: ...
    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs: ...
    def start(self, args: AgentArgs) -> None: ...
    def failure(self) -> BaseException | None: ...
    def stop(self, cancel: bool) -> None: ...


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _summary(exc: BaseException) -> str:
    """An exception's message without a JVM stack trace (py4j puts Spark's into str(exc))."""
    lines = str(exc).splitlines()
    return "\n".join(line for line in lines if not line.startswith("\tat ")).strip() or repr(exc)


def _failure_line(conn: AgentConnection, lost: str | None) -> str:
    who = f"rank {conn.rank}" if conn.rank is not None else f"the agent at {conn.peer}"
    if lost is not None:
        executor = conn.hello.get("task", {}).get("executor")
        where = f" on executor {executor}" if executor else ""
        return f"{who}: lost its agent{where} (its Spark task or executor died?): {lost}"
    done = conn.done or {}
    if done.get("terminated_by"):
        return f"{who}: ended by the driver ({done['terminated_by']})"
    if done.get("error"):
        return f"{who}: {done['error']['type']}: {done['error']['message']}"
    if done.get("exit_code") == 0:
        return f"{who}: exited without returning a result"
    return f"{who}: {_describe_exit(done.get('exit_code', -1))} without a Python exception"


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
        self._payload = payload
        self._verbosity = verbosity
        self._cancelled = cancelled
        self._start_timeout_s = start_timeout_s
        self._agents: list[AgentConnection] = []  # in the order they said hello
        self._started = False
        self._finished: set[int] = set()  # ids of connections that reported or were lost
        self._failures: list[tuple[AgentConnection, str | None]] = []  # (agent, why it was lost, if it was)
        self._cause: tuple[AgentConnection, str | None] | None = None  # the failure that ended the run
        self._abort_reason: str | None = None
        self._rendezvous: Rendezvous | None = None

    def run(self) -> Any:
        secret = new_secret()
        channel = DriverChannel(self.launcher.driver_host, secret)
        log.info("HorovodRunner: driver channel on %s:%d", channel.host, channel.port)
        completed = False
        try:
            self.launcher.start(self.launcher.agent_args(channel.host, channel.port, secret, self._verbosity))
            self._watch(channel)
            completed = self._abort_reason is None
        finally:
            channel.close()  # agents still connected (the driver was interrupted) end their ranks at once
            self.launcher.stop(cancel=not completed)
            if self._rendezvous is not None:
                self._rendezvous.stop()
        return self._outcome()

    def _watch(self, channel: DriverChannel) -> None:
        start_deadline = time.monotonic() + self._start_timeout_s
        abort_deadline = float("inf")
        while True:
            if self._abort_reason is None and self._cancelled():
                self._abort("the run was cancelled")
            try:
                event = channel.events.get(timeout=_POLL_S)
            except queue.Empty:
                event = None
            if event is not None:
                self._on_event(event.kind, event.conn, event.detail)
            if self._abort_reason is None and self.launcher.failure() is not None:
                self._abort("the launch failed")
            if self._abort_reason is None and not self._started and time.monotonic() > start_deadline:
                raise LaunchError(
                    f"only {len(self._agents)} of {self.size} ranks had started after {self._start_timeout_s:.0f}s "
                    f"({self.launcher.describe()}); the cluster may be short of task slots or the executors "
                    "cannot reach this driver"
                )
            if self._abort_reason is not None and abort_deadline == float("inf"):
                abort_deadline = time.monotonic() + ABORT_WAIT_S
            running = [c for c in self._agents if id(c) not in self._finished]
            if self._started and not running:
                return
            if self._abort_reason is not None and (not running or time.monotonic() > abort_deadline):
                return

    def _on_event(self, kind: str, conn: AgentConnection, detail: str) -> None:
        if kind == "hello":
            if self._started or self._abort_reason is not None:
                conn.abort("this run has already started or ended; a re-run task cannot join it")
                return
            self._agents.append(conn)
            if len(self._agents) == self.size:
                self._start_ranks()
            return
        if conn not in self._agents:
            return  # a late, turned-away agent
        self._finished.add(id(conn))
        lost = detail if kind == "lost" else None
        if lost is not None or not (conn.done or {}).get("ok"):
            self._failures.append((conn, lost))
            if self._abort_reason is None:  # later failures are the abort's collateral
                self._cause = (conn, lost)
                self._abort(f"rank {conn.rank} failed")

    def _start_ranks(self) -> None:
        plan = plan_ranks([conn.hello["host"] for conn in self._agents])
        self._rendezvous = Rendezvous(self.launcher.driver_host)
        self._rendezvous.init(plan)
        for conn, slot in zip(self._agents, plan):
            conn.start(slot.rank, rank_env(slot, self._rendezvous), self._payload)
        self._started = True
        log.info("HorovodRunner: %d ranks started (%s)", self.size, self.launcher.describe())

    def _abort(self, reason: str) -> None:
        self._abort_reason = reason
        running = [conn for conn in self._agents if id(conn) not in self._finished]
        log.warning("HorovodRunner: %s; ending %d running rank(s)", reason, len(running))
        for conn in running:
            conn.abort(reason)

    def _outcome(self) -> Any:
        launch_failure = self.launcher.failure()  # final: the launcher has stopped
        lost_agent = self._cause is not None and self._cause[1] is not None
        if self._cause is not None and not (lost_agent and launch_failure is not None):
            raise self._rank_failed(*self._cause)
        if self._abort_reason is None:
            rank0 = next(conn for conn in self._agents if conn.rank == 0)
            assert rank0.result is not None
            return cloudpickle.loads(rank0.result)
        if launch_failure is not None:  # a lost agent is explained best by why Spark ended its task
            error = LaunchError if not self._started else HorovodRunnerError
            raise error(
                f"{self.launcher.describe()} ended before every rank reported: {_summary(launch_failure)}"
            ) from launch_failure
        raise RunCancelledError(f"HorovodRunner: {self._abort_reason}; every rank was ended")

    def _rank_failed(self, first: AgentConnection, lost: str | None) -> RankFailedError:
        done = first.done or {}
        error = done.get("error")
        tail = done.get("tail", [])
        others = [_failure_line(conn, why) for conn, why in self._failures if conn is not first]
        parts = [f"Horovod rank {first.rank} of {self.size} failed: " + _failure_line(first, lost).split(": ", 1)[1]]
        if error:
            parts.append(f"--- remote traceback (rank {first.rank}) ---\n{error['traceback'].rstrip()}")
        if tail:
            parts.append(f"--- last {len(tail)} lines of rank {first.rank}'s output ---\n" + "\n".join(tail))
        if others:
            parts.append("--- other ranks ---\n" + "\n".join(others))
        return RankFailedError(
            "\n".join(parts),
            rank=first.rank,
            exit_code=done.get("exit_code"),
            remote_traceback=error["traceback"] if error else None,
            output_tail=tail,
            other_failures=others,
        )
