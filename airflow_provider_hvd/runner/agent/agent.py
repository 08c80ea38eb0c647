"""The rank agent: one per rank, beside its rank process (a driver thread locally, the barrier task on Spark).

It connects to the driver channel, says where it runs, receives the rank's slot, starts the rank process
under a reaper (:mod:`.reaper`) with the pickled job on its stdin (the job comes from the launcher, not over
the channel: a Spark broadcast, or the driver's own copy locally), relays its output as the verbosity says,
and reports how it ended. It ends the rank when the driver asks (another rank failed, the run was cancelled)
or goes away. Its own failures are reported to the driver too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from .. import reaper
from ..rank.control import CONTROL_FD_ENV, LOG_TOKEN_ENV, message_marker
from ..rank.stacks import STACKS_FILE_ENV
from ..shared import torch_env
from ..shared.liveness import Liveness
from ..shared.messages import (
    Abort,
    AgentFailed,
    Done,
    DriverMessage,
    DumpStacks,
    Hello,
    RankCheckpoint,
    RankError,
    RankMetrics,
    RankReady,
    RankState,
    RemoteError,
    Result,
    Returned,
    Start,
    receive,
    send,
)
from ..shared.naming import HOROVOD_RUNNER
from ..shared.rank_tag import tagged
from ..shared.timing import CONNECT_TIMEOUT_S, EXIT_AFTER_REPORT_S, REPORT_DELIVERY_S
from ..shared.tls import connect_tls
from ..shared.wire import ConnectionClosed, FrameStream, connect_handshake
from .activity import ActivityReporter, is_stall_warning
from .kill_evidence import MemoryWatch
from .liveness import DriverWatch
from .rank_env import rank_environment
from .relay import Outbox, OutputSplitter, Piece
from .reports import ReportSender
from .stacks import StackFile

TAIL_LINES = 50
_OUTPUT_DRAIN_S = 5.0  # after the reaper exited, output still held open by an escaped process is abandoned
_MESSAGE_WAIT_S = 2.0  # a message is written before its marker: it is late only when the agent is starved
_REAPER = str(Path(reaper.__file__).resolve())


@dataclass(frozen=True)
class AgentArgs:
    """What an agent needs to reach the driver; pickled into Spark tasks."""

    driver_host: str
    port: int
    secret: bytes
    relay_output: bool  # stdout/stderr lines go to the driver (verbosity "all", and local runs)
    echo_output: bool  # lines go to this process's stderr too, tagged with the rank (the executor's log)...
    echo_relayed: bool = True  # ... also those relayed (not when that stderr is the driver's own, on local[*])
    keep_omp_threads: bool = False  # OMP_NUM_THREADS was set explicitly for the ranks (see rank_env)
    hide_gpus: bool = False  # a rank given no GPU sees none (CUDA_VISIBLE_DEVICES=""), not the executor's (rank_env)
    liveness: Liveness = field(
        default_factory=Liveness
    )  # heartbeats with the driver (the run's settings, from the driver)
    activity_every_s: float | None = None  # stall detection is on: report the rank's activity this often (.activity)
    tls_fingerprint: str | None = None  # the channel is TLS: the SHA-256 of the driver's certificate (..shared.tls)
    runner: str = HOROVOD_RUNNER.runner  # the runner the user called, as the agent's own messages name it
    attempt: int = 1  # the run's attempt (max_restarts): the echoed lines are tagged with it after the first


class AgentThreadFailed(RuntimeError):
    """A thread of the agent failed unexpectedly: the agent ended its rank, and reports this instead of how it ended."""


class _RankProcess:
    """The rank process (under its reaper), its output relay and its control pipe."""

    def __init__(self, rank: int, env: dict[str, str], args: AgentArgs, outbox: Outbox, reports: ReportSender) -> None:
        self.rank = rank
        self._args = args
        self._outbox = outbox
        self._reports = reports
        self.failure: AgentThreadFailed | None = None  # the first unexpected error in one of the agent's threads
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.result: bytes | None = None
        self.error: RemoteError | None = None
        self.reported = threading.Event()
        self.terminated_by: str | None = None
        self.ended_at: float | None = None  # when its control pipe closed: the rank process had ended
        self._messages: dict[int, str] = {}
        self._messages_cond = threading.Condition()
        self._control_open = True
        self._last_seq = -1  # the last log_to_driver message received (they come in order)
        self._given_up: set[int] = set()  # markers whose message had not come in time: it goes out when it does
        self.messages_lost = 0
        self._stop_reading = threading.Event()
        self.last_active = time.monotonic()  # the rank's last output or control message (.activity)
        # the rank's own files: removed by its reaper as it ends, and here once the reaper ended (whoever ends it)
        self.folder = tempfile.mkdtemp(prefix=f"hvd-rank{rank}-")
        self.stacks = StackFile(self.folder)
        token = secrets.token_hex(16)
        self._splitter = OutputSplitter(message_marker(token))
        ctl_read, ctl_write = os.pipe()
        env = {
            **env,
            CONTROL_FD_ENV: str(ctl_write),
            LOG_TOKEN_ENV: token,
            STACKS_FILE_ENV: self.stacks.path,
            reaper.RANK_DIR_ENV: self.folder,
            **torch_env.error_file_env(env, self.folder),
        }
        out_read, out_write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    _REAPER,
                    str(os.getpid()),
                    sys.executable,
                    "-m",
                    "airflow_provider_hvd.runner.rank",
                ],
                stdin=subprocess.PIPE,
                stdout=out_write,
                stderr=out_write,  # one pipe: the rank's order is kept
                env=env,
                pass_fds=(ctl_write,),
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            os.close(ctl_read)
            os.close(out_read)
            raise
        finally:
            os.close(ctl_write)
            os.close(out_write)
        self._output_reader = threading.Thread(
            target=self.guarded, args=(self._relay_output, out_read), name=f"hvd-rank{rank}-output", daemon=True
        )
        self._control_reader = threading.Thread(
            target=self.guarded, args=(self._read_control, ctl_read), name=f"hvd-rank{rank}-control", daemon=True
        )
        self._output_reader.start()
        self._control_reader.start()

    def feed(self, job: bytes) -> None:
        """Hand the rank its pickled job (on its stdin, which it reads to the end before it runs anything); a
        rank ended meanwhile (the driver's Abort, on the watcher's thread) never gets it whole."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died, or was ended: its exit code tells
            self.proc.stdin.write(job)
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()

    def guarded(self, body: Callable[[int], None], fd: int) -> None:
        """``body(fd)`` as an agent thread: an unexpected error in it ends the rank (:meth:`fail`)."""
        try:
            body(fd)
        except Exception as exc:  # noqa: BLE001 - a bug or an unexpected input: the rank must not go on unwatched
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """An agent thread failed unexpectedly: end the rank; the agent reports the failure (AgentFailed)."""
        name = threading.current_thread().name
        sys.stderr.write(f"{self._args.runner} agent of rank {self.rank}: its thread {name} failed:\n")
        traceback.print_exception(exc, file=sys.stderr)
        if self.failure is None:
            self.failure = AgentThreadFailed(f"its thread {name} failed: {type(exc).__name__}: {exc}")
            self.failure.__cause__ = exc
        self.terminate(f"the agent's thread {name} failed: {type(exc).__name__}: {exc}")

    def _echo(self, text: str, relayed: bool) -> None:
        if self._args.echo_output and (self._args.echo_relayed or not relayed):
            sys.stderr.write(tagged(self.rank, text, self._args.attempt) + "\n")

    def _take(self, piece: Piece) -> None:
        if not is_stall_warning(piece):
            self.last_active = time.monotonic()
        if isinstance(piece, int):  # a log_to_driver message: relayed whatever the verbosity
            with self._messages_cond:
                self._messages_cond.wait_for(
                    lambda: piece in self._messages or piece <= self._last_seq or not self._control_open,
                    timeout=_MESSAGE_WAIT_S,
                )
                text = self._messages.pop(piece, None)
                if text is None:
                    self.messages_lost += 1
                    if piece > self._last_seq and self._control_open:
                        self._given_up.add(piece)
                    text = (
                        f"[a log_to_driver message (#{piece}) did not reach the agent in time; "
                        f"{self.messages_lost} so far]"
                    )
            self._echo(text, relayed=True)
            self._outbox.put(text)
            return
        self._take_lines([piece])

    def _take_all(self, pieces: list[Piece]) -> None:
        """A read's pieces in order, each run of plain lines at once (a flood of lines costs little a line)."""
        lines: list[str] = []
        for piece in pieces:
            if isinstance(piece, str):
                lines.append(piece)
                continue
            self._take_lines(lines)
            lines = []
            self._take(piece)
        self._take_lines(lines)

    def _take_lines(self, lines: list[str]) -> None:
        if not lines:
            return
        if not all(map(is_stall_warning, lines)):
            self.last_active = time.monotonic()
        self.tail.extend(lines)
        if self._args.echo_output:
            for line in lines:
                self._echo(line, relayed=self._args.relay_output)
        if self._args.relay_output:
            self._outbox.put_lines(lines)

    def _relay_output(self, fd: int) -> None:
        try:
            while not self._stop_reading.is_set():
                if not select.select([fd], [], [], 0.5)[0]:
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                self._take_all(self._splitter.feed(data))
            self._take_all(self._splitter.end())
        finally:
            os.close(fd)

    def _read_control(self, fd: int) -> None:
        control = FrameStream(os.fdopen(fd, "rb"), write=None)
        try:
            while True:
                message = receive(control)
                self.last_active = time.monotonic()
                if isinstance(message, (RankMetrics, RankCheckpoint)):  # progress: relayed as it comes
                    self._reports.put(message.relayed())  # never waits on the link: the pipe is always read
                    continue
                if isinstance(message, RankReady):
                    self.stacks.ready(message)
                    continue
                if isinstance(message, DriverMessage):
                    with self._messages_cond:
                        self._last_seq = max(self._last_seq, message.seq)
                        if message.seq in self._given_up:  # its marker went by: out of place, but not lost
                            self._given_up.discard(message.seq)
                            self.messages_lost -= 1
                            self._echo(f"{message.text} [late]", relayed=True)
                            self._outbox.put(f"{message.text} [late]")
                        else:
                            self._messages[message.seq] = message.text
                        self._messages_cond.notify_all()
                    continue
                if isinstance(message, Result):
                    self.result = cast(bytes, message.data)  # (read whole from the pipe: FrameStream.recv)
                elif isinstance(message, RankError):
                    self.error = message.error
                self.reported.set()
        except ConnectionClosed:
            self.ended_at = time.time()  # the failure's time at its source, for one that died without an exception
            return
        finally:
            with self._messages_cond:
                self._control_open = False  # no message comes any more: a marker does not wait for one
                self._messages_cond.notify_all()
            self.reported.set()  # the rank is gone, whether it reported or not

    def dump_stacks(self) -> RankState:
        """The rank's Python stacks, for the driver (.stacks)."""
        return self.stacks.dump(lambda: self._control_open and self.proc.poll() is None)

    def terminate(self, reason: str) -> None:
        """End the rank and everything it started (the reaper does: SIGTERM, then SIGKILL after a grace)."""
        if self.proc.poll() is not None:
            return
        self.terminated_by = self.terminated_by or reason
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(reaper.TERMINATE_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the rank dies with its reaper

    def wait(self) -> int:
        """Wait for the rank to end; one that raised but does not exit is ended after a grace. One whose main
        returned is waited for: the driver gives its exit work ``exit_timeout`` once every rank returned."""
        self.reported.wait()
        try:
            code = self.proc.wait(None if self.result is not None else EXIT_AFTER_REPORT_S)
        except subprocess.TimeoutExpired:
            self.terminate(f"it reported its error but had not exited {EXIT_AFTER_REPORT_S:.0f}s later")
            code = self.proc.wait()
        self._control_reader.join()
        self._output_reader.join(_OUTPUT_DRAIN_S)
        self._stop_reading.set()  # a process that escaped the reaper holds the output open: stop reading
        self._output_reader.join()
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


def _watch_driver(watch: DriverWatch, rank_process: _RankProcess) -> None:
    try:
        message = watch.receive()
        while isinstance(message, DumpStacks):  # the run stalled, or the driver was interrupted
            watch.send(rank_process.dump_stacks())
            message = watch.receive()
        reason = message.reason if isinstance(message, Abort) else f"unexpected {type(message).__name__}"
    except (ConnectionClosed, OSError):
        reason = watch.silent_reason or "lost the connection to the driver"
    except Exception as exc:  # noqa: BLE001 - a frame it cannot read, or a bug: nothing would act on Abort now
        rank_process.fail(exc)
        return
    rank_process.terminate(reason)
    try:
        while True:  # the driver's heartbeats go on until it has the agent's report
            watch.receive()
    except Exception:  # noqa: BLE001, S110 - the stream's end, whatever it looks like: the rank is ended already
        pass


def _run_rank(
    args: AgentArgs,
    stream: FrameStream,
    hello: Hello,
    start: Start,
    read_job: Callable[[], bytes],
    watch: DriverWatch,
    extra_env: Mapping[str, str],
    on_rank_end: Callable[[], None] = lambda: None,
) -> threading.Thread:
    env = {**rank_environment(os.environ, hello, start, args.keep_omp_threads, args.hide_gpus), **extra_env}
    outbox = Outbox(stream)
    reports = ReportSender(stream, start.rank, args.runner)
    memory = MemoryWatch()  # before the rank starts: an OOM kill while it runs shows as a difference
    rank_process: _RankProcess | None = None
    activity: ActivityReporter | None = None
    try:
        rank_process = _RankProcess(start.rank, env, args, outbox, reports)
        reports.on_failure = rank_process.fail
        watcher = threading.Thread(
            target=_watch_driver, args=(watch, rank_process), name="hvd-agent-watch", daemon=True
        )
        # the driver is heard while the job is read and fed (a large one takes seconds): its Abort ends the rank
        # before its main starts, and its DumpStacks is answered at once
        watcher.start()
        rank_process.feed(read_job())  # the job is not kept
        if args.activity_every_s:
            activity = ActivityReporter(stream, args.activity_every_s, lambda: rank_process.last_active)
        rank_process.reported.wait()
        if rank_process.result is not None:  # main returned: the driver hears it now, not once the exit work is done
            if start.rank == 0:
                send(stream, Result(rank_process.result))
            send(stream, Returned())
        exit_code = rank_process.wait()
    except BaseException:  # (the driver gone as the result went, a rank that could not start): end it, then say
        if rank_process is not None:
            rank_process.terminate("its agent failed")
            rank_process.wait()
        memory.close()
        raise
    finally:
        if activity is not None:
            activity.stop()
        outbox.close()
        reports.close()  # (after the lines: each message reaches the driver before the agent's report)
    on_rank_end()  # (before the report: once the driver has every rank's, nothing of theirs is held)
    killed = exit_code < 0 and rank_process.terminated_by is None  # a signal the driver did not ask for
    kill_evidence = memory.evidence(exit_code, rank_process.stacks.pid) if killed else None
    memory.close()
    if rank_process.failure is not None:  # the agent ended the rank: its own failure is the report
        send(stream, AgentFailed(RemoteError.of(rank_process.failure)))
        return watcher
    send(
        stream,
        Done(
            exit_code=exit_code,
            ok=exit_code == 0 and rank_process.result is not None,
            error=rank_process.error,
            terminated_by=rank_process.terminated_by,
            tail=list(rank_process.tail),
            dropped=outbox.total_dropped,
            ended_at=rank_process.ended_at,
            kill_evidence=kill_evidence,
        ),
    )
    return watcher


def _let_the_report_arrive(sock: socket.socket, watcher: threading.Thread) -> None:
    """End the connection once the driver has all the agent sent (it closes its end then), not before.

    On a slow link the end of a large result may still be queued here when the agent is done; closing at once
    would make the heartbeats that keep coming from the driver reset the connection, and what was queued
    would be lost. The watcher reads (and drops) them until the driver's end comes, or the driver goes silent.
    """
    try:
        sock.shutdown(socket.SHUT_WR)  # the driver reads all that was queued, then this end
    except OSError:
        return
    watcher.join(REPORT_DELIVERY_S)


def connect_driver(args: AgentArgs) -> tuple[socket.socket, FrameStream]:
    """A connection to the driver channel that has proven the run's secret (over TLS when the channel is)."""
    sock = socket.create_connection((args.driver_host, args.port), timeout=CONNECT_TIMEOUT_S)
    stream: FrameStream | None = None
    try:
        if args.tls_fingerprint is None:
            stream = FrameStream.over_socket(sock)
            connect_handshake(sock, args.secret)
        else:  # the channel is TLS: a certificate other than the run's is refused here, before anything is sent
            stream = connect_tls(sock, args.tls_fingerprint)
            connect_handshake(sock, args.secret, over=stream)
    except BaseException:
        if stream is not None:
            stream.close()
        else:
            sock.close()
        raise
    return sock, stream


def run_agent(
    args: AgentArgs,
    read_job: Callable[[], bytes],
    hello: Hello | None = None,
    extra_env: Mapping[str, str] | None = None,
    on_rank_end: Callable[[], None] = lambda: None,
) -> str:
    """Run one rank under supervision; returns what became of it, in a word.

    ``read_job`` gives the pickled job when the rank starts; the agent keeps no reference to it afterwards.
    ``extra_env``: variables of this rank alone, on top of its environment (where its DataFrame shard is);
    ``on_rank_end`` is called once the rank process has ended, before the agent reports it (its shard's file
    let go).
    """
    sock, stream = connect_driver(args)
    watcher: threading.Thread | None = None
    watch: DriverWatch | None = None
    try:
        watch = DriverWatch(stream, sock, args.liveness)
        host, hostname = sock.getsockname()[0], socket.gethostname()
        hello = Hello(host=host, pid=os.getpid()) if hello is None else hello
        hello = dataclasses.replace(hello, host=host, hostname=hostname)
        send(stream, hello)
        try:
            start = watch.receive()
        except (ConnectionClosed, OSError):
            return "lost the driver"
        if not isinstance(start, Start):
            return "turned away"  # an Abort: the run has ended, or started without this task
        try:
            watcher = _run_rank(args, stream, hello, start, read_job, watch, extra_env or {}, on_rank_end)
            return "done"
        except (ConnectionClosed, ConnectionError):  # reporting to the driver failed: it is gone
            return "lost the driver"
        except BaseException as exc:  # noqa: BLE001 - the agent's own failure: the driver must hear of it
            try:
                send(stream, AgentFailed(RemoteError.of(exc)))
            except OSError:
                return "lost the driver"
            return "failed"
    finally:
        if watcher is not None:
            _let_the_report_arrive(sock, watcher)
        stream.close()
        if watch is not None:
            watch.stop()
        if watcher is not None:
            watcher.join()
