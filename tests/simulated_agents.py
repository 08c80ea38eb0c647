"""Many simulated rank agents against the real driver side (Supervisor, DriverChannel, RunOutcome, rendezvous).

:class:`SimulatedLauncher` is a Launcher for
:class:`~airflow_provider_hvd.runner.driver.watch.supervisor.Supervisor`: its ``start`` runs this file as one child
process, in which an asyncio loop plays ``agents`` rank agents. Each
one speaks the real wire protocol with the run's secret (the HMAC handshake, then framed messages): Hello
from its own loopback address (``per_host`` agents share one, so the rendezvous plans many hosts), Start,
numbered log lines, then Result (rank 0) and Done; or, in a failing run, rank ``fail_rank`` fails and the
others wait for the driver's Abort. No Horovod, no rank process. ``silent`` connections say nothing and
``garbage`` ones send junk, to show what they cost the driver. The child reports when each agent said
hello, got Start, got Abort, and when the driver closed each silent or garbage connection (CLOCK_MONOTONIC,
comparable across processes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rank_lines import lines_of

from airflow_provider_hvd.runner.agent.agent import AgentArgs
from airflow_provider_hvd.runner.driver.events import LaunchFailed
from airflow_provider_hvd.runner.driver.launch.address import LOOPBACK_DRIVER
from airflow_provider_hvd.runner.driver.watch.supervisor import Supervisor
from airflow_provider_hvd.runner.shared.messages import (
    Abort,
    AgentAlive,
    Done,
    DriverAlive,
    Hello,
    LogBatch,
    Message,
    RemoteError,
    Result,
    Start,
    decode,
    frame,
)
from airflow_provider_hvd.runner.shared.naming import HOROVOD_RUNNER
from airflow_provider_hvd.runner.shared.wire import NONCE_BYTES, PROOF_BYTES, FrameDecoder, agent_answer


@dataclass
class Scenario:
    agents: int
    per_host: int = 4
    lines_per_rank: int = 20
    lines_per_batch: int = 5
    fail_rank: int | None = None  # this rank fails once every agent has started; the others wait for Abort
    fail_after_s: float = 0.5  # after it got Start
    hold_s: float = 0.0  # in a run without failure, each rank "trains" this long after its log lines
    silent: int = 0
    garbage: int = 0
    connect_spread_s: float = 0.0  # agents connect spread evenly over this time (0: all at once)
    give_up_s: float = 120.0  # an agent that hears nothing for this long stops


@dataclass
class Report:
    """What the agents saw: one dict per agent, and how long the driver kept each bad connection open."""

    agents: list[dict[str, Any]] = field(default_factory=list)
    failed_at: float | None = None
    silent_open_s: list[float] = field(default_factory=list)
    garbage_open_s: list[float] = field(default_factory=list)


def host_of(agent: int, per_host: int) -> str:
    """A loopback address per group of ``per_host`` agents (all of 127.0.0.0/8 reaches this host)."""
    n = agent // per_host
    return f"127.1.{n // 250}.{n % 250 + 1}"


# --- the agents (in the child process) -------------------------------------------------------------


class _Agent:
    def __init__(self, index: int, scenario: Scenario, driver: tuple[str, int], secret: bytes) -> None:
        self.index, self.scenario, self.driver, self.secret = index, scenario, driver, secret
        self.record: dict[str, Any] = {"agent": index, "host": host_of(index, scenario.per_host)}
        self._decoder = FrameDecoder()
        self._pending: list[Message] = []

    async def _next(self, reader: asyncio.StreamReader) -> Message | None:
        while not self._pending:
            data = await asyncio.wait_for(reader.read(1 << 16), self.scenario.give_up_s)
            if not data:
                return None
            messages = (decode(kind, body) for kind, body in self._decoder.feed(data))
            self._pending.extend(message for message in messages if not isinstance(message, DriverAlive))
        return self._pending.pop(0)

    async def run(self, report: Report) -> None:
        host = self.record["host"]
        await asyncio.sleep(self.scenario.connect_spread_s * self.index / self.scenario.agents)
        give_up = self.scenario.give_up_s
        try:
            connecting = asyncio.open_connection(*self.driver, local_addr=(host, 0))
            reader, writer = await asyncio.wait_for(connecting, give_up)
        except (OSError, TimeoutError) as exc:
            self.record["error"] = repr(exc)
            return
        beats: asyncio.Task | None = None
        try:
            nonce = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), give_up)
            answer, driver_proof = agent_answer(self.secret, nonce)
            writer.write(answer)
            if await asyncio.wait_for(reader.readexactly(PROOF_BYTES), give_up) != driver_proof:
                raise RuntimeError("the driver did not prove the secret")
            writer.write(
                frame(
                    Hello(
                        host=host,
                        pid=os.getpid(),
                        executor=f"sim-{self.index}",
                        partition=self.index,
                        attempt=0,
                        cpus=1,
                    )
                )
            )
            beats = asyncio.create_task(self._beat(writer))  # as a real agent's heartbeats
            self.record["hello"] = time.monotonic()
            start = await self._next(reader)
            if not isinstance(start, Start):
                self.record["turned_away"] = type(start).__name__
                return
            self.record["start"] = time.monotonic()
            rank = self.record["rank"] = start.rank
            await self._log(writer, rank)
            if rank == self.scenario.fail_rank:
                await asyncio.sleep(self.scenario.fail_after_s)
                error = RemoteError("ValueError", f"simulated failure of rank {rank}", "Traceback ...\nValueError")
                report.failed_at = time.monotonic()
                writer.write(frame(Done(exit_code=1, ok=False, error=error, tail=[f"rank {rank} fails"])))
            elif self.scenario.fail_rank is not None:
                abort = await self._next(reader)
                if isinstance(abort, Abort):
                    self.record["abort"] = time.monotonic()
                reason = abort.reason if isinstance(abort, Abort) else "lost the connection to the driver"
                writer.write(frame(Done(exit_code=-15, ok=False, terminated_by=reason)))
            else:
                await asyncio.sleep(self.scenario.hold_s)
                if rank == 0:
                    writer.write(frame(Result(pickle.dumps({"ranks": start.env["HOROVOD_SIZE"]}))))
                writer.write(frame(Done(exit_code=0, ok=True)))
            await writer.drain()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            self.record["error"] = repr(exc)
        finally:
            if beats is not None:
                beats.cancel()
            writer.close()

    @staticmethod
    async def _beat(writer: asyncio.StreamWriter, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            writer.write(frame(AgentAlive()))

    async def _log(self, writer: asyncio.StreamWriter, rank: int) -> None:
        lines = [f"rank {rank} line {n}" for n in range(self.scenario.lines_per_rank)]
        for at in range(0, len(lines), self.scenario.lines_per_batch):
            writer.write(frame(LogBatch(lines[at : at + self.scenario.lines_per_batch])))
            await writer.drain()


async def _bad_connection(driver: tuple[str, int], junk: bytes | None, give_up_s: float) -> float:
    """Connect; send ``junk`` (None: nothing at all); return how long until the driver closed the connection."""
    reader, writer = await asyncio.open_connection(*driver)
    opened = time.monotonic()
    try:
        if junk is not None:
            writer.write(junk)
        while await asyncio.wait_for(reader.read(1 << 16), give_up_s):
            pass
        return time.monotonic() - opened
    except (TimeoutError, ConnectionError):
        return time.monotonic() - opened
    finally:
        writer.close()


async def _play(scenario: Scenario, driver: tuple[str, int], secret: bytes) -> Report:
    report = Report()
    agents = [_Agent(i, scenario, driver, secret) for i in range(scenario.agents)]
    junk = [os.urandom(NONCE_BYTES + PROOF_BYTES), b"GET / HTTP/1.1\r\n\r\n" * 64]
    bad = [_bad_connection(driver, None, scenario.give_up_s) for _ in range(scenario.silent)]
    bad += [_bad_connection(driver, junk[i % 2], scenario.give_up_s) for i in range(scenario.garbage)]
    results = await asyncio.gather(*(agent.run(report) for agent in agents), *bad)
    report.agents = [agent.record for agent in agents]
    report.silent_open_s = list(results[scenario.agents : scenario.agents + scenario.silent])
    report.garbage_open_s = list(results[scenario.agents + scenario.silent :])
    return report


def _child_main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = hard if hard != resource.RLIM_INFINITY else 1 << 16
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, room), hard))  # a socket per simulated agent
    config = json.loads(sys.stdin.readline())
    scenario = Scenario(**config["scenario"])
    report = asyncio.run(_play(scenario, (config["host"], config["port"]), bytes.fromhex(config["secret"])))
    json.dump(asdict(report), sys.stdout)


# --- the driver's side: a Launcher ------------------------------------------------------------------


class SimulatedLauncher:
    """A Launcher whose agents are simulated in one child process (see the module's docstring)."""

    driver = LOOPBACK_DRIVER
    naming = HOROVOD_RUNNER

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.size = scenario.agents
        self.report: Report | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._output = b""

    def describe(self) -> str:
        return f"{self.size} simulated agents"

    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        return AgentArgs(host, port, secret, relay_output=True, echo_output=False)

    def start(self, args: AgentArgs, payload: bytes | None = None) -> None:
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        config = {
            "host": args.driver_host,
            "port": args.port,
            "secret": args.secret.hex(),
            "scenario": asdict(self.scenario),
        }
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(config).encode() + b"\n")
        self._proc.stdin.close()
        self._reader = threading.Thread(target=self._read_report, daemon=True)
        self._reader.start()

    def _read_report(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        self._output = self._proc.stdout.read()

    def poll(self) -> list[LaunchFailed]:
        if self._proc is not None and self._proc.poll() not in (None, 0):
            return [LaunchFailed(self.describe(), f"the simulator exited with code {self._proc.returncode}")]
        return []

    def memory_settings(self) -> dict[str, str]:
        return {}

    def ended(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def close(self, reason: str | None) -> None:
        assert self._proc is not None and self._reader is not None
        self._reader.join(self.scenario.give_up_s + 30)
        self._proc.wait()
        if self._output:
            self.report = Report(**json.loads(self._output))


class _LineCollector(logging.Handler):
    """The relayed lines, per rank, as the driver logged them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_rank: dict[int, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for rank, text in lines_of(record):
            self.by_rank.setdefault(rank, []).append(text)


@dataclass
class Run:
    """A simulated run as the driver saw it (``value`` or ``error``) and as the agents did (``report``)."""

    value: Any
    error: BaseException | None
    report: Report
    lines: dict[int, list[str]]
    seconds: float
    ended_at: float  # CLOCK_MONOTONIC when run() returned or raised


def drive(scenario: Scenario, start_timeout_s: float = 120.0) -> Run:
    """Run the real driver side against the simulated agents of ``scenario``."""
    launcher = SimulatedLauncher(scenario)
    collector = _LineCollector()
    rank_log = logging.getLogger("airflow_provider_hvd.ranks")
    rank_log.addHandler(collector)
    value, error = None, None
    started = time.monotonic()
    try:
        value = Supervisor(launcher, pickle.dumps(None), "all", lambda: False, start_timeout_s).run()
    except Exception as exc:  # noqa: BLE001 - the caller looks at it
        error = exc
    finally:
        ended = time.monotonic()
        rank_log.removeHandler(collector)
    assert launcher.report is not None, "the simulator reported nothing"
    return Run(value, error, launcher.report, collector.by_rank, ended - started, ended)


if __name__ == "__main__":
    _child_main()
