"""The driver's side of a run: start the agents' ranks together, watch them, end them all on the first failure."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

from ...shared.gpus import GPU
from ...shared.liveness import Liveness
from ...shared.messages import AgentFailed as AgentFailedMessage
from ...shared.messages import Done, Hello, Message, Returned, ShardProgress, Start, unpickle
from ...shared.timing import ABORT_WAIT_S, LAUNCH_END_WAIT_S, LAUNCH_FAILURE_SETTLE_S
from ...shared.tls import RunCertificate
from ...shared.wire import Body, new_secret
from ..events import (
    AgentFailed,
    AgentLost,
    Cancelled,
    Event,
    HostLost,
    Intruded,
    LaunchEvent,
    LaunchFailed,
    RankFailed,
    RankSucceeded,
    StartTimedOut,
    Task,
    TaskEnded,
)
from ..launch.address import CHANNEL
from ..launch.launcher import Launcher
from ..ranks.kind import RankKind, horovod_kind
from ..ranks.plan import gpus_by_node
from ..tracking.progress import RunProgress
from ..verdict.exits import DEFAULT_EXIT_TIMEOUT_S, exit_failed, exit_work_awaited, still_exiting
from ..verdict.outcome import Phase, RunOutcome
from ..verdict.report import abort_reason, describe_exit, lost_after_return, run_error
from ..verdict.stacks import where_ranks_were
from .channel import AgentConnection, ChannelEvent, DriverChannel
from .dataframe_progress import DataFrameProgress
from .phases import RankPhase
from .stalls import StallWatch, activity_period, collect_stacks

log = logging.getLogger("airflow_provider_hvd.runner")

_POLL_S = 0.2


class Tracking(Protocol):
    """An experiment tracker's run beside the ranks (:mod:`..tracking.mlflow_run`)."""

    def rank_env(self, rank: int) -> dict[str, str]: ...
    def take(self, rank: int | None, message: Message) -> None:
        """A rank's report, on the channel's thread; never raises."""


class Supervisor:
    """One run: the channel, the rank kind's rendezvous, the launcher, and the loop that watches them."""

    def __init__(
        self,
        launcher: Launcher,
        payload: bytes,
        verbosity: str,
        cancelled: Callable[[], bool],
        start_timeout_s: float,
        progress: RunProgress | None = None,
        liveness: Liveness | None = None,
        stall_timeout: float | None = None,
        channel_tls: bool = False,
        kind: RankKind | None = None,
        exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S,
        tracking: Tracking | None = None,
        attempt: int = 1,
    ) -> None:
        self.launcher = launcher
        self.attempt = attempt  # the run's attempt (..restarts): one Supervisor each
        self.size = launcher.size
        self._payload: bytes | None = payload  # handed to the launcher at start, not kept
        self._verbosity = verbosity
        self._cancelled = cancelled
        self._start_timeout_s = start_timeout_s
        self._agents: list[AgentConnection] = []  # in the order they said hello; each has its rank's phase
        self._exit_timeout_s = exit_timeout_s  # the ranks' exit work once every rank returned (..verdict.exits)
        self._outcome = RunOutcome(self.size)
        self._kind: RankKind = kind or horovod_kind()
        self._kind_open = False
        self._progress = progress or RunProgress()
        self._liveness = liveness or Liveness()
        self._stalls = StallWatch(stall_timeout) if stall_timeout else None
        self._channel_tls = channel_tls  # the channel is TLS with a certificate made for the run (...shared.tls)
        self._tracking = tracking
        self._task_reasons: dict[Task, str] = {}  # Spark's reason for each task it ended (the launcher's TaskEnded)
        self._launch_failure: LaunchFailed | None = None  # the launcher's latest word of its failure
        self._launch_failed_at: float | None = None  # when the launcher first said it failed
        self._start_deadline = 0.0  # (time.monotonic()) every agent says hello by then
        self._exit_deadline: float | None = None  # every rank returned: their exit work is waited for until then
        self._abort_deadline: float | None = None  # the cause was decided: the ranks are waited for until then
        self._launch_end_deadline: float | None = None  # the run succeeded: the launch's end is waited for until then
        self._naming = launcher.naming
        self._runner = launcher.naming.runner  # the first word of the run's log lines
        self._dataframe: DataFrameProgress | None = None  # a run on a DataFrame: its rows on their way (in _watch)

    def run(self) -> Any:
        return unpickle(self.run_raw())  # (pickle.load reads cloudpickle's data: a large result piece by piece)

    def status(self) -> tuple[str, int]:
        """The run's phase (``Phase``'s value) and how many of its ranks were started, from any thread."""
        return self._outcome.phase.value, sum(conn.rank is not None for conn in list(self._agents))

    def run_raw(self) -> Body:
        """:meth:`run`, with rank 0's value as it came, still pickled (a submitted run's host sends it on)."""
        secret = new_secret()
        certificate = RunCertificate.new() if self._channel_tls else None
        tls = certificate.context if certificate else None
        driver = self.launcher.driver
        channel = driver.listen(
            CHANNEL,
            lambda host, port: DriverChannel(
                host, secret, self.size, port, self._liveness, tls, self._runner, self.attempt
            ),
        )
        channel.on_progress = self._progress.take if self._tracking is None else self._take_report
        try:
            where = self._kind.open(driver)
            self._kind_open = True
            log.info(
                "%s: driver channel on %s%s",
                self._runner,
                driver.describe(channel.port),
                f", TLS 1.3 (this run's certificate, SHA-256 {certificate.fingerprint})" if certificate else "",
            )
            log.info("%s: %s", self._runner, where)
            payload, self._payload = self._payload, None
            assert payload is not None, "a Supervisor runs once"
            args = self.launcher.agent_args(driver.advertised, channel.port, secret, self._verbosity)
            args = dataclasses.replace(
                args,
                liveness=self._liveness,
                tls_fingerprint=certificate.fingerprint if certificate else None,
                runner=self._runner,
                attempt=self.attempt,
            )
            if self._stalls is not None:
                args = dataclasses.replace(args, activity_every_s=activity_period(self._stalls.timeout))
            if not self._cancelled():  # (cancelled meanwhile: nothing starts; _watch says so)
                self.launcher.start(args, payload)  # (a wait for the task slots first, which a cancel ends)
            del payload
            try:
                self._watch(channel)
            except BaseException as exc:  # e.g. Airflow's execution_timeout (AirflowTaskTimeout), or Ctrl-C
                said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._say_where_ranks_are(f"the driver was interrupted ({said})")
                if self._dataframe is not None and not self._agents_started():
                    log.warning(
                        "%s: the driver was interrupted (%s) before the ranks started; at that moment: %s",
                        self._runner,
                        said,
                        self._dataframe.describe(),
                    )
                raise
        finally:
            self._clean_up(channel)
        error = run_error(self._outcome, self._task_reasons.get, self._kind.name, self._naming)
        if error is not None:
            raise error
        rank0 = next(conn for conn in self._agents if conn.rank == 0)
        assert rank0.result is not None
        return rank0.result

    def _clean_up(self, channel: DriverChannel) -> None:
        """Close the channel, end the launch, stop the rendezvous: each whatever the others did, and none of
        their errors replaces the run's own (they are logged)."""
        cause = self._outcome.cause
        done = cause is None and len(self._outcome.succeeded) == self.size
        reason = None if done else abort_reason(cause) if cause is not None else "the run did not complete"
        steps: list[tuple[str, Callable[[], None]]] = [
            ("close the driver channel", channel.close),  # agents still connected end their ranks at once
            (f"end {self.launcher.describe()}", lambda: self.launcher.close(reason)),
            ("read what Spark said of the tasks it ended", lambda: self._take_launch_events(self.launcher.poll())),
        ]
        if self._kind_open:
            steps.append((f"stop the {self._kind.name} rendezvous", self._kind.close))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.exception("%s: could not %s", self._runner, what)

    def _take_report(self, rank: int | None, message: Message) -> None:
        self._progress.take(rank, message)
        assert self._tracking is not None
        self._tracking.take(rank, message)

    def _running(self) -> list[AgentConnection]:
        """The agents whose rank process runs (its ``main``, or its exit work)."""
        return [conn for conn in self._agents if conn.phase.running]

    # the watch: each pass of the loop makes every check, in this order (who ends a rank: docs/internals.md)

    def _watch(self, channel: DriverChannel) -> None:
        now = time.monotonic()
        self._start_deadline = now + self._start_timeout_s
        plan = getattr(self.launcher, "shard_plan", None)  # a run on a DataFrame (SparkLauncher): its rows' plan
        if plan is not None:
            spark_tasks = self.launcher.spark_tasks  # type: ignore[attr-defined]
            self._dataframe = DataFrameProgress(plan.feed.rows, plan.feed.tasks, spark_tasks, self._runner, now)
        while True:
            self._check_cancel()
            self._progress.tick()
            self._check_events(channel)
            self._check_settle_window()
            now = time.monotonic()
            self._check_launch_events(now)
            self._check_dataframe(now)
            self._check_start_timeout(now)
            self._check_stall(now)
            self._check_exit_timeout(now)
            if self._check_abort_deadline(now):
                return

    def _check_cancel(self) -> None:
        """``cancel()`` was called: the run ends (its ranks' stacks logged first, if it had not ended already)."""
        if self._cancelled():
            if not self._outcome.ending:
                self._say_where_ranks_are("the run was cancelled")
            self._record(Cancelled(self._dataframe_before_start()))

    def _check_events(self, channel: DriverChannel) -> None:
        """The channel's next event (an agent's hello, its rank returned, its report, its connection's end), if one
        comes within the loop's period."""
        try:
            self._on_event(channel.events.get(timeout=_POLL_S))
        except queue.Empty:
            pass

    def _check_settle_window(self) -> None:
        """The window after a first failure has passed (the reports racing it are in): name the cause."""
        self._end_others(self._outcome.due())

    def _check_launch_events(self, now: float) -> None:
        """What the launcher says (a Spark job that failed, Spark's reason for a task it ended); a launch failure
        ends the run once the agents' reports racing it had ``LAUNCH_FAILURE_SETTLE_S`` to arrive."""
        self._take_launch_events(self.launcher.poll())
        failure = self._launch_failure
        if failure is not None and not self._outcome.ending:
            self._launch_failed_at = self._launch_failed_at or now
            if now - self._launch_failed_at >= LAUNCH_FAILURE_SETTLE_S:
                self._record(failure)

    def _check_dataframe(self, now: float) -> None:
        """A run on a DataFrame: while Spark is at work on its rows (computing them for the barrier job, streaming
        them into the shards), the ranks' start clock waits; its progress goes to the log."""
        if self._dataframe is None or self._outcome.phase is not Phase.STARTING:
            return
        if self._dataframe.preparing(now):
            self._start_deadline = max(self._start_deadline, now + self._start_timeout_s)
        self._dataframe.tick(now)

    def _dataframe_before_start(self) -> str | None:
        """How far a DataFrame's rows got, while the ranks have not started (None otherwise)."""
        if self._dataframe is None or self._agents_started():
            return None
        self._dataframe.preparing(time.monotonic(), fresh=True)  # (what Spark says now)
        return self._dataframe.describe()

    def _check_start_timeout(self, now: float) -> None:
        """Not every agent said hello within the ranks' start timeout (not counting the time Spark worked on a
        DataFrame's rows): the run ends."""
        if self._outcome.phase is Phase.STARTING and now > self._start_deadline:
            self._record(
                StartTimedOut(
                    len(self._agents),
                    self.size,
                    self._start_timeout_s,
                    self.launcher.describe(),
                    self._dataframe_before_start(),
                )
            )

    def _check_stall(self, now: float) -> None:
        """No running rank was active for ``stall_timeout``: once their stacks are in (or late), the run ends."""
        if self._stalls is None or self._outcome.phase is not Phase.RUNNING:
            return
        stalled = self._stalls.check(self._running(), now)
        if stalled is not None:
            log.warning("%s: %s; the ranks' Python stacks:\n%s", self._runner, stalled.reason(), stalled.dumps())
            self._record(stalled)

    def _check_exit_timeout(self, now: float) -> None:
        """Every rank returned (the run succeeded): their exit work gets ``exit_timeout``, then those still in it
        are ended."""
        if not self._outcome.ending or self._outcome.cause is not None or self._abort_deadline is not None:
            return
        if self._exit_deadline is None:
            self._exit_deadline = now + self._exit_timeout_s
            if self._running():
                log.info("%s", exit_work_awaited(len(self._running()), self._exit_timeout_s, self._runner))
        if now > self._exit_deadline and self._running():
            self._end_slow_exits()

    def _check_abort_deadline(self, now: float) -> bool:
        """Whether the watch is over: every rank has ended, or ``ABORT_WAIT_S`` passed since the cause (or since
        the exit timeout ended the slow exits): those still running are ended by the channel's close. A run that
        succeeded waits for its launch's end too (:meth:`_launch_ended`)."""
        if not self._outcome.ending:
            return False
        exits_over = self._exit_deadline is not None and now > self._exit_deadline
        if self._outcome.cause is not None or exits_over:
            self._abort_deadline = self._abort_deadline or now + ABORT_WAIT_S
        ranks_over = not self._running() or (self._abort_deadline is not None and now > self._abort_deadline)
        return ranks_over and self._launch_ended(now)

    def _launch_ended(self, now: float) -> bool:
        """Whether the launch has ended (a Spark job: every one of its tasks, whose agents the driver has all
        heard then), for ``LAUNCH_END_WAIT_S`` at most once the ranks are over; always, for a run that failed.

        Until then a run that succeeded still hears hellos: a barrier stage starts its tasks together, but on a
        loaded host one task's agent may come after the others' ranks returned, and find its place taken by an
        intruder (:meth:`_not_of_this_job`): the run fails then, before rank 0's result is read.
        """
        if self._outcome.cause is not None:
            return True
        self._launch_end_deadline = self._launch_end_deadline or now + LAUNCH_END_WAIT_S
        return self.launcher.ended() or now > self._launch_end_deadline

    def _take_launch_events(self, events: list[LaunchEvent]) -> None:
        for event in events:
            if isinstance(event, TaskEnded):
                self._task_reasons[event.task] = event.reason
            else:
                self._launch_failure = event  # (its words may improve: Spark's reason for a task comes later)

    def _end_slow_exits(self) -> None:
        """Every rank returned ``exit_timeout`` ago: end those still in their exit work, each with a warning."""
        for conn in self._running():
            log.warning("%s", still_exiting(conn.rank, conn.where(), self._exit_timeout_s, self._runner))
            conn.abort(f"it was still exiting {self._exit_timeout_s:g}s after every rank returned (exit_timeout)")

    def _say_where_ranks_are(self, why: str) -> None:
        """Log where the running ranks are (their Python stacks), before they are ended."""
        running = self._running()
        if not running:
            return
        try:
            ranks = collect_stacks(running)
        except Exception:  # noqa: BLE001 - never in the way of ending the run
            log.exception("%s: could not collect the ranks' stacks", self._runner)
            return
        log.warning(
            "%s: %s; where the ranks were (innermost frames first):\n%s", self._runner, why, where_ranks_were(ranks)
        )

    def _agents_started(self) -> bool:
        return any(conn.rank is not None for conn in self._agents)

    def _record(self, event: Event) -> None:
        if isinstance(event, AgentLost | HostLost) and event.after_return and self._outcome.cause is None:
            log.warning("%s", lost_after_return(event, self._runner))  # (exit_failed: a rank failed in its exit work)
        self._end_others(self._outcome.record(event))

    def _end_others(self, cause: Event | None) -> None:
        """The run's cause was decided: end every rank not over yet (waiting ones too), telling it why."""
        if cause is None:
            return
        reason = abort_reason(cause)
        waiting = [conn for conn in self._agents if not conn.phase.over]
        log.warning("%s: %s; ending %d running rank(s)", self._runner, reason, len(self._running()))
        for conn in waiting:
            conn.abort(reason)

    # what the channel says, by kind

    def _on_event(self, event: ChannelEvent) -> None:
        conn, message = event.conn, event.message
        if isinstance(message, ShardProgress):  # (from a barrier task's own connection, not an agent's)
            if self._dataframe is not None:
                self._dataframe.take(message, time.monotonic())
            return
        if isinstance(message, Hello):
            self._on_hello(conn, message)
            return
        if conn not in self._agents or conn.phase.over:
            return  # a turned-away agent, a connection that never said hello; or one accounted for (_host_lost)
        if isinstance(message, Returned):  # its main returned: the rank succeeded, its exit work goes on
            conn.enter(RankPhase.RETURNED)
            self._record(RankSucceeded(conn.rank))  # type: ignore[arg-type]
            return
        received_at = time.time()  # what a failure's own source time falls back on (see outcome.source_time)
        if isinstance(message, Done):
            self._on_done(conn, message, received_at)
        elif isinstance(message, AgentFailedMessage):
            conn.enter(RankPhase.FAILED)
            self._record(AgentFailed(conn.rank, conn.where(), message.error, received_at=received_at))
        else:
            self._on_lost(conn, event, received_at)

    def _on_hello(self, conn: AgentConnection, hello: Hello) -> None:
        """An agent said hello: it waits for its rank's start, once every agent has said it; one that comes once
        the run started or ended (a re-run task), or one not of this job, is turned away."""
        intruded = self._not_of_this_job(conn, hello)
        if intruded is not None:  # before anything of that agent's is read, its rank 0 result above all
            conn.abort("another agent has this Spark task's place in the run")
            self._record(Intruded(self.launcher.describe(), intruded))
            return
        if self._agents_started() or self._outcome.ending:
            conn.abort("this run has already started or ended; a re-run task cannot join it")
            return
        self._agents.append(conn)
        if len(self._agents) == self.size:
            self._start_ranks()

    def _on_done(self, conn: AgentConnection, done: Done, received_at: float) -> None:
        """The agent's report of how its rank process ended."""
        conn.enter(RankPhase.ENDED if done.ok else RankPhase.FAILED)
        if done.ok:
            self._record(RankSucceeded(conn.rank))  # type: ignore[arg-type]
            return
        where = conn.where()
        evidence = done.kill_evidence and {**done.kill_evidence, "memory_settings": self._memory_settings()}
        if conn.returned and done.terminated_by is None:
            log.warning("%s", exit_failed(conn.rank, where, describe_exit(done.exit_code), self._runner))
        failed = RankFailed(
            conn.rank,  # type: ignore[arg-type]
            where,
            done,
            received_at=received_at,
            kill_evidence=evidence,
            after_return=conn.returned,
        )
        self._record(failed)

    def _on_lost(self, conn: AgentConnection, event: ChannelEvent, received_at: float) -> None:
        """The agent's connection ended before its report, or went silent (its host may be lost with it)."""
        conn.enter(RankPhase.LOST)
        if event.silent_for is not None and self._host_lost(conn, event.silent_for, received_at):
            return
        hello = conn.hello
        task = (hello.partition, hello.attempt) if hello and hello.attempt is not None else None
        lost = AgentLost(
            conn.rank,
            conn.where(),
            event.lost,
            task,  # type: ignore[arg-type]
            received_at=received_at,
            after_return=conn.returned,
        )
        self._record(lost)

    def _not_of_this_job(self, conn: AgentConnection, hello: Hello) -> str | None:
        """Why ``hello`` shows that an agent not of this job proved the run's secret, or None.

        Each Spark task of the job has one agent per process, said once per attempt. A second agent for the
        same task, process and attempt, or one of this job's tasks left out of the started ranks (another agent
        took its place), means the secret is known outside the run (over Spark Connect it rides in the plan,
        docs/security.md): the run fails before any rank's result is read.
        """
        if hello.executor is None:
            return None  # agents of this process (local runs)
        spark = [(other, other.hello) for other in self._agents if other.hello and other.hello.executor is not None]
        task = f"Spark task {hello.partition} (attempt {hello.attempt}" + (
            f", process {hello.process})" if hello.process else ")"
        )
        same = [
            other
            for other, seen in spark
            if (seen.partition, seen.process, seen.attempt) == (hello.partition, hello.process, hello.attempt)
        ]
        attempts = [seen.attempt or 0 for _, seen in spark]
        left_out = (
            self._agents_started()
            and self._outcome.cause is None  # (until rank 0's result is read: also once every rank returned)
            and (hello.attempt or 0) <= max(attempts, default=0)
            and all((seen.partition, seen.process) != (hello.partition, hello.process) for _, seen in spark)
        )
        if same:
            found = f"two agents said they run {task}, from {same[0].peer} and {conn.peer}"
        elif left_out:
            found = (
                f"the agent of {task} came from {conn.peer} after the ranks started without it: another took its place"
            )
        else:
            return None
        return (
            f"{found}. Someone outside this run knows its secret (over Spark Connect it travels in the barrier "
            "job's plan: connect with use_ssl=true or a token, see docs/security.md); the run ends without "
            "reading rank 0's result."
        )

    def _host_lost(self, conn: AgentConnection, silent_for: float, received_at: float) -> bool:
        """``conn`` went silent: when every running agent on its host went silent too, the host is lost (one
        event naming its ranks); False when the others on its host are still heard from (that agent alone hangs)."""
        if conn.rank is None or conn.hello is None:
            return False
        host = conn.hello.host
        others = [other for other in self._running() if other.hello is not None and other.hello.host == host]
        now = time.monotonic()
        quiet = max(2 * self._liveness.interval_s, self._liveness.timeout_s / 2)
        if any(now - other.last_heard < quiet for other in others):
            return False
        for other in others:
            other.enter(RankPhase.LOST)  # their own silence, when the channel notices it, is not news
        ranks = tuple(sorted([conn.rank, *(other.rank for other in others if other.rank is not None)]))
        detail = (
            f"for {silent_for:.0f}s (heartbeat timeout {self._liveness.timeout_s:g}s): the host is down, or the "
            "network between it and this driver is cut"
        )
        returned = all(lost.returned for lost in [conn, *others])
        self._record(HostLost(ranks, host, conn.hello.hostname, detail, received_at, after_return=returned))
        return True

    def _memory_settings(self) -> dict[str, str]:
        """The launcher's memory settings (Spark's), for a killed rank's evidence (..verdict.kills)."""
        try:
            return self.launcher.memory_settings()
        except Exception:  # noqa: BLE001 - the SparkContext may be gone: the settings are a nicety
            return {}

    def _start_ranks(self) -> None:
        self._agents.sort(key=lambda conn: (conn.hello.partition or 0, conn.hello.process))  # type: ignore[union-attr]
        hellos = [conn.hello for conn in self._agents if conn.hello is not None]
        plan = self._kind.plan(hellos, [conn.peer_host for conn in self._agents])
        gpus = gpus_by_node(plan, [hello.resources.get(GPU, []) for hello in hellos])
        starts = []
        for slot, seen in zip(plan, gpus, strict=False):
            env = {**self._kind.env(slot), **self._progress.rank_env()}
            if self._tracking is not None:
                env.update(self._tracking.rank_env(slot.rank))
            starts.append(Start(slot.rank, self._kind.name, env, slot.local_size, seen))
        # the cancel flag's last read before any rank starts: a cancel() that came after the watch's own read, as
        # the last agent said hello, ends the waiting agents here, and no rank runs main
        if self._cancelled():
            self._record(Cancelled())
            return
        for conn, start in zip(self._agents, starts, strict=False):
            if not conn.phase.over:  # (one lost while it waited is sent its Start all the same: it fails at once)
                conn.enter(RankPhase.STARTED)
            try:
                conn.start(start)
            except OSError:
                pass  # it is gone: its connection's end is on its way as an event
        self._outcome.started()
        again = f", attempt {self.attempt}" if self.attempt > 1 else ""
        log.info("%s: %d ranks started (%s%s)", self._runner, self.size, self.launcher.describe(), again)
