"""The driver-side channel: one authenticated TCP connection per rank agent carries hello, logs, result, done
(and, in a run on a DataFrame, one per barrier task while its rows stream into its shards: how far they got).

One thread serves every connection (a selector loop): a run of 1,000 ranks costs the driver one thread, not
1,000. A connection must prove the run's secret within the handshake timeout before any frame of it is read;
at most :data:`MAX_PENDING_HANDSHAKES` may be proving it at once (a silent or garbage connection costs a
socket and a few bytes, for at most the handshake timeout); more wait in the listen queue until one of those
is done. The supervisor's few messages (Start, Abort) are written from its own thread. Closing the channel
leaves no thread or socket behind.

Liveness (:mod:`...shared.liveness`): the loop sends every proven connection a heartbeat each interval, and a
connection from which nothing (no frame, no byte) came for the heartbeat timeout is lost, ``silent_for`` set:
its agent's host vanished, or the network to it is cut (no FIN or RST ever comes then).

TLS (:mod:`...shared.tls`), when the run has a certificate: each connection's bytes pass through its session,
in the loop as they are read (never blocking) and in whichever thread writes (under the send lock).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import resource
import select
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...shared import wire
from ...shared.liveness import Liveness
from ...shared.messages import (
    Abort,
    AgentAlive,
    AgentFailed,
    Checkpoint,
    Done,
    DriverAlive,
    DumpStacks,
    Hello,
    LogBatch,
    Message,
    Metrics,
    RankState,
    Result,
    Returned,
    ShardProgress,
    Start,
    decode,
    frame,
)
from ...shared.naming import HOROVOD_RUNNER
from ...shared.rank_tag import rank_line, rank_tag
from ...shared.timing import SEND_TIMEOUT_S
from ...shared.tls import PLAIN, Session, server_session
from ...shared.wire import AuthenticationError, DriverHandshake, FrameDecoder
from ..launch.address import listening_socket
from .phases import RankPhase

log = logging.getLogger("airflow_provider_hvd.runner")
rank_log = logging.getLogger("airflow_provider_hvd.ranks")
rank_log.setLevel(logging.INFO)  # on its own level: relayed lines show wherever the application logs anything
RECORD_CHARS = 1 << 18  # a record holds a batch's lines up to about this many characters


def log_rank_lines(rank: int | None, lines: list[str], attempt: int = 1) -> None:
    """Log a batch of rank ``rank``'s lines in order, each tagged ``[rank N]`` (``[rank N, attempt K]`` after a
    run's first attempt), in as few records as hold them.

    A record per line costs ~15 µs (more through a task log's structured formatter): a flood of output would
    hold the driver up. A record's message is its lines, each tagged, one a line; its ``args`` are the rank and
    the text after the first tag; ``rank_lines`` holds the lines themselves, and ``attempt`` the run's attempt,
    for a handler that wants them.
    """
    joiner, line = "\n" + rank_tag(attempt) % rank + " ", rank_line(attempt)
    if not lines:
        return  # (a batch that only counts dropped lines)
    if sum(map(len, lines)) <= RECORD_CHARS:
        rank_log.info(line, rank, joiner.join(lines), extra={"rank_lines": lines, "attempt": attempt})
        return
    start, total = 0, 0
    for end, text in enumerate(lines, 1):
        total += len(text)
        if total > RECORD_CHARS or end == len(lines):
            chunk = lines[start:end]
            rank_log.info(line, rank, joiner.join(chunk), extra={"rank_lines": chunk, "attempt": attempt})
            start, total = end, 0


MAX_PENDING_HANDSHAKES = 1024
LISTEN_BACKLOG = 4096  # (the kernel caps it at net.core.somaxconn)
_READ_BYTES = 1 << 18
_FD_PAUSE_S = 0.5
_EXPIRY_CHECK_S = 0.25
_HEARTBEAT = frame(DriverAlive())
_SPARE_DESCRIPTORS = 256  # beside the agents' connections: unproven ones, the rendezvous, Spark's, the user's


class AgentConnection:
    """The driver's end of one agent's connection."""

    def __init__(
        self, sock: socket.socket, peer: tuple[str, int], handshake: DriverHandshake, session: Session = PLAIN
    ) -> None:
        self.peer_host = peer[0]  # the agent's address as the driver sees it (after any NAT on the way)
        self.peer = f"{peer[0]}:{peer[1]}"
        self.sock = sock
        self.session = session  # TLS, or plain: what is read passes through it, and what is sent
        self._send_lock = threading.Lock()  # the supervisor writes; the channel's loop reads and closes
        self._closed = False
        self.rank: int | None = None
        self.phase = RankPhase.WAITING  # its rank's, as the supervisor sees it (.phases)
        self.returned = False  # its rank's main returned (it may have failed in its exit work since, or be lost)
        self.hello: Hello | None = None
        self.result: wire.Body | None = None  # rank 0's pickled result, as it came (messages.unpickle reads it)
        self.done: Done | None = None
        self.lines_dropped = 0
        self.last_active = time.monotonic()  # the stall clock (stalls.py): its last message, or its rank's start
        self.stacks_answer: RankState | None = None  # the answer to the last DumpStacks
        self.handshake: DriverHandshake | None = handshake  # None once the agent has proven the secret
        self.handshake_deadline = time.monotonic() + wire.HANDSHAKE_TIMEOUT_S
        self._answer = bytearray()
        self.decoder = FrameDecoder()
        self.last_heard = time.monotonic()  # the last bytes from the agent (liveness)

    def beat(self) -> None:
        """Send a heartbeat if that cannot block: not while another frame is being written, nor into a full buffer."""
        if not self._send_lock.acquire(blocking=False):
            return  # a Start or an Abort is on its way: that is a sign of life too
        try:
            if not self._closed and _ready(self.sock, select.POLLOUT):
                self.sock.sendall(self.session.seal(_HEARTBEAT))  # a few bytes: a writable socket takes them at once
        except OSError:
            pass  # gone: its end reaches the loop as a read
        finally:
            self._send_lock.release()

    def where(self) -> str:
        return self.hello.where() if self.hello else f"at {self.peer}"

    def enter(self, phase: RankPhase) -> None:
        """Its rank is in ``phase`` now (the supervisor's view); ValueError for a step back, or out of an end."""
        if not self.phase.may_become(phase):
            raise ValueError(f"the rank of the agent {self.where()} cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase
        self.returned = self.returned or phase is RankPhase.RETURNED

    def _send(self, message: Message) -> None:
        self.write_bytes(frame(message))

    def write_bytes(self, data: bytes) -> None:
        """``data`` to the agent (sealed when the channel is TLS), after anything written before."""
        with self._send_lock:
            if self._closed:
                raise ConnectionResetError("the connection is closed")
            sealed = self.session.seal(data)  # sealed and sent under one lock: TLS records go out in order
            if sealed:
                self.sock.sendall(sealed)

    def flush(self) -> None:
        """Send what TLS has left to send (its handshake, and the nonce waiting behind it), unless a writer is
        sending now (it takes these bytes along): never waits on the send lock."""
        if not self.session.has_output() or not self._send_lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self.sock.sendall(self.session.seal())
        except OSError:
            pass  # gone: its end reaches the loop as a read
        finally:
            self._send_lock.release()

    def start(self, start: Start) -> None:
        self.rank = start.rank
        self.last_active = time.monotonic()
        self._send(start)

    def dump_stacks(self) -> None:
        """Ask the agent for its rank's Python stacks; the answer lands in :attr:`stacks_answer`."""
        self.stacks_answer = None
        try:
            self._send(DumpStacks())
        except OSError:
            pass  # gone: no answer comes

    def abort(self, reason: str) -> None:
        try:
            self._send(Abort(reason))
        except OSError:
            pass  # already gone

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a send in progress fails at once
        except OSError:
            pass
        with self._send_lock:
            self._closed = True
            self.sock.close()

    def take_answer(self, data: bytes) -> bytes | None:
        """Collect the agent's handshake answer; once whole, verify it and return the bytes after it."""
        assert self.handshake is not None
        need = DriverHandshake.ANSWER_BYTES - len(self._answer)
        self._answer += data[:need]
        if len(self._answer) < DriverHandshake.ANSWER_BYTES:
            return None
        self.write_bytes(self.handshake.verify(bytes(self._answer)))
        self.handshake = None
        return data[need:]


def make_room_for_connections(count: int, runner: str = HOROVOD_RUNNER.runner) -> None:
    """Raise this process's soft limit on open files, up to its hard limit, if ``count`` more connections
    would not fit under it (the common default of 1,024 does not hold a run of 1,000 ranks)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS)
        open_now = 0
    needed = open_now + count + _SPARE_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < needed:
        log.warning(
            "%s: this process may open %d files (its hard limit), and %d agent connections need about "
            "%d: raise the limit (ulimit -n) for runs this large",
            runner,
            hard,
            count,
            needed,
        )


def _ready(sock: socket.socket, events: int) -> bool:
    """Whether ``sock`` is ready for ``events`` now (poll: descriptors past 1,024 are common here)."""
    poller = select.poll()
    poller.register(sock, events)
    return bool(poller.poll(0))


@dataclass(frozen=True)
class ChannelEvent:
    """An agent said hello, its rank returned, it reported (Done or AgentFailed), or its connection ended before; or
    a barrier task's connection told how far its shards got (ShardProgress)."""

    conn: AgentConnection
    message: Hello | Returned | Done | AgentFailed | ShardProgress | None  # None: lost
    lost: str = ""
    silent_for: float | None = None  # lost because nothing came from it for this long (heartbeat timeout)


class DriverChannel:
    """Listens on ``host``:``port`` (0: any free port) for agents that prove ``secret``; control events go to
    ``events``, logs to logging."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        agents: int = 0,
        port: int = 0,
        liveness: Liveness | None = None,
        tls: ssl.SSLContext | None = None,
        runner: str = HOROVOD_RUNNER.runner,
        attempt: int = 1,
    ) -> None:
        self._listener = listening_socket(host, port, LISTEN_BACKLOG)  # first: nothing to undo if taken
        self._runner = runner  # the first word of its log lines
        self._attempt = attempt  # the run's attempt (max_restarts): its ranks' lines are tagged with it after the first
        make_room_for_connections(agents, self._runner)
        self.events: queue.Queue[ChannelEvent] = queue.Queue()
        self.on_progress: Callable[[int | None, Message], None] | None = None  # a rank's metrics or checkpoint
        self._secret = secret
        self._tls = tls  # the context of the run's certificate (..shared.tls.RunCertificate), for a TLS channel
        self._selector = selectors.DefaultSelector()
        self._pending = 0  # connections still proving the secret
        self._closed = False
        self._listening = True
        self._fd_pause_until = 0.0  # out of file descriptors: accepting resumes then
        self._warned_full = False
        self.liveness = liveness or Liveness()
        self._next_beat = time.monotonic() + self.liveness.interval_s  # heartbeats: sent also during a long read
        self._next_check = self._next_beat  # the silence check: its own clock, never skipped for the heartbeats'
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="hvd-channel", daemon=True)
        self._thread.start()

    # the loop (its own thread)

    def _serve(self) -> None:
        failure: Exception | None = None
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._select_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._on_readable(key.data)
                self._expire_handshakes()
                self._keep_alive()
                self._update_listening()
        except Exception as exc:  # a bug here must end the run, not leave it waiting forever
            failure = exc
            log.exception("%s: the driver channel failed", self._runner)
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, AgentConnection):
                    self._end(key.data, failure)  # agents still running see the end and end their ranks
            self._selector.close()
            self._listener.close()  # connections still in its queue are refused
            self._wake_r.close()

    def _end(self, conn: AgentConnection, failure: Exception | None) -> None:
        """Close a connection as the loop ends; when the loop failed, the run hears that its agent is lost."""
        try:
            if failure is not None and conn.handshake is None:
                self._lost(conn, f"the driver channel failed: {failure!r}")
            else:
                self._drop(conn)
        except Exception:  # noqa: BLE001 - the selector itself may be what failed
            conn.close()
            if failure is not None and conn.handshake is None:
                self.events.put(ChannelEvent(conn, None, lost=f"the driver channel failed: {failure!r}"))

    def _select_timeout(self) -> float | None:
        timeouts = [_EXPIRY_CHECK_S] if self._pending else []  # often enough to close unproven connections on time
        timeouts.append(max(0.0, min(self._next_beat, self._next_check) - time.monotonic()))
        if self._fd_pause_until:
            timeouts.append(max(0.0, self._fd_pause_until - time.monotonic()))
        return min(timeouts, default=None)

    def _update_listening(self) -> None:
        """Accept while fewer than the most connections are proving the secret (the others wait in the listen
        queue, not dropped: a burst of agents is only delayed) and while file descriptors are left."""
        if self._fd_pause_until and time.monotonic() >= self._fd_pause_until:
            self._fd_pause_until = 0.0
        listen = self._pending < MAX_PENDING_HANDSHAKES and not self._fd_pause_until
        if listen != self._listening:
            if listen:
                self._selector.register(self._listener, selectors.EVENT_READ)
            else:
                self._selector.unregister(self._listener)
            self._listening = listen
        if self._pending >= MAX_PENDING_HANDSHAKES and not self._warned_full:
            self._warned_full = True
            log.warning(
                "%s: %d connections are proving the secret at once, the most the driver channel serves "
                "together; more wait until one does or times out (%.0fs)",
                self._runner,
                self._pending,
                wire.HANDSHAKE_TIMEOUT_S,
            )

    def _accept(self) -> None:
        while self._pending < MAX_PENDING_HANDSHAKES:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("%s: the driver cannot accept more agent connections for now: %s", self._runner, exc)
                    self._fd_pause_until = time.monotonic() + _FD_PAUSE_S
                return  # (ECONNABORTED and the like: that connection is gone)
            sock.settimeout(SEND_TIMEOUT_S)  # reads happen only when the selector says there is data
            conn = AgentConnection(sock, addr, DriverHandshake(self._secret), server_session(self._tls))
            try:
                conn.write_bytes(conn.handshake.nonce)  # type: ignore[union-attr]  # (TLS: once its handshake is done)
            except OSError:
                sock.close()
                continue
            self._pending += 1
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _expire_handshakes(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if isinstance(conn, AgentConnection) and conn.handshake is not None and now > conn.handshake_deadline:
                self._reject(conn, "it did not prove this run's secret in time")

    def _keep_alive(self) -> None:
        """Each interval: a heartbeat to every proven connection, and the end of those silent past the timeout.

        The check has its own clock: heartbeats sent in the middle of a long read (:meth:`_beat_while_busy`)
        never make it skip one, however much the agents send. It runs after the loop has read what the select
        found, and a connection with bytes still unread is not silent: a loop that was itself held up (a busy
        driver) ends no live connection.
        """
        if self._beat_due():
            for conn in self._proven():
                conn.beat()
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.liveness.interval_s
        for conn in self._proven():
            silent = now - conn.last_heard
            if silent > self.liveness.timeout_s and not _ready(conn.sock, select.POLLIN):
                self._lost(
                    conn,
                    f"nothing heard from it for {silent:.0f}s (heartbeat timeout {self.liveness.timeout_s:g}s): "
                    "its host is down, or the network between it and this driver is cut",
                    silent_for=silent,
                )

    def _beat_while_busy(self) -> None:
        """Between the frames of one long read (a flood of log lines to relay): the heartbeats that are due, so
        that agents do not take a busy driver for a gone one. No silence check here: other agents' heartbeats
        may be waiting unread behind this read (:meth:`_keep_alive` checks, on its own clock, once the loop
        has read them)."""
        if self._beat_due():
            for conn in self._proven():
                conn.beat()

    def _beat_due(self) -> bool:
        """Whether an interval has passed since the last heartbeats (and if so, the next is an interval away)."""
        now = time.monotonic()
        if now < self._next_beat:
            return False
        self._next_beat = now + self.liveness.interval_s
        return True

    def _proven(self) -> list[AgentConnection]:
        """The connections whose agents have proven the secret."""
        conns = (key.data for key in list(self._selector.get_map().values()))
        return [conn for conn in conns if isinstance(conn, AgentConnection) and conn.handshake is None]

    def _reject(self, conn: AgentConnection, why: object) -> None:
        if not self._closed:
            log.warning("%s: rejected a connection from %s to the driver channel: %s", self._runner, conn.peer, why)
        self._drop(conn)

    def _drop(self, conn: AgentConnection) -> None:
        if conn.handshake is not None:
            self._pending -= 1
            conn.handshake = None
        self._selector.unregister(conn.sock)
        conn.close()

    def _on_readable(self, conn: AgentConnection) -> None:
        error: OSError | None
        try:
            data = conn.sock.recv(_READ_BYTES)
        except OSError as exc:
            data, error = b"", exc
        else:
            error = None
            conn.last_heard = time.monotonic()
        if data:
            try:
                data = conn.session.receive(data)  # plain: the bytes themselves; TLS: the plaintext they complete
            except ssl.SSLError as exc:  # not this run's TLS
                data, error = b"", exc
            else:
                conn.flush()
                if not data:
                    return  # (TLS: its handshake goes on, or a record is not complete yet)
        if conn.handshake is not None:
            self._on_handshake_data(conn, data, error)
            return
        if not data:
            self._lost(conn, str(error) if error else "the connection was closed")
            return
        self._on_frames(conn, data)

    def _on_handshake_data(self, conn: AgentConnection, data: bytes, error: OSError | None) -> None:
        if not data:
            self._reject(conn, error or "connection closed during the handshake")
            return
        try:
            rest = conn.take_answer(data)
        except (AuthenticationError, OSError) as exc:
            self._reject(conn, exc)
            return
        if rest is not None:
            self._pending -= 1
            if rest:
                self._on_frames(conn, rest)

    def _on_frames(self, conn: AgentConnection, data: bytes) -> None:
        try:
            for kind, body in conn.decoder.feed(data):
                if self._on_message(conn, decode(kind, body)):  # (not bytes(body): a large result is not copied)
                    self._drop(conn)
                    return
                self._beat_while_busy()
        except Exception as exc:  # noqa: BLE001 - a malformed frame from an authenticated agent is a bug: say so
            log.exception("%s: broken frame from the agent at %s", self._runner, conn.peer)
            self._lost(conn, f"broken frame: {exc!r}")

    def _on_message(self, conn: AgentConnection, message: Message) -> bool:
        """Take one message; True when it is the agent's last."""
        if isinstance(message, RankState):  # its rank is active (the stall clock, stalls.py), or its stacks
            if message.answers:
                conn.stacks_answer = message
            else:
                conn.last_active = time.monotonic()
            return False
        if isinstance(message, AgentAlive):
            pass  # (its bytes were counted as a sign of life when they were read)
        elif isinstance(message, LogBatch):
            self._relay(conn, message)
        elif isinstance(message, Result):
            conn.result = message.data
        elif isinstance(message, (Metrics, Checkpoint)):
            if self.on_progress is not None:
                self.on_progress(conn.rank, message)
        elif isinstance(message, (Hello, Returned, ShardProgress)):
            if isinstance(message, Hello):
                conn.hello = message
            self.events.put(ChannelEvent(conn, message))
        elif isinstance(message, (Done, AgentFailed)):
            conn.done = message if isinstance(message, Done) else None
            self.events.put(ChannelEvent(conn, message))
            return True
        else:
            raise ValueError(f"an agent does not send {type(message).__name__}")
        return False

    def _lost(self, conn: AgentConnection, why: str, silent_for: float | None = None) -> None:
        self._drop(conn)
        self.events.put(ChannelEvent(conn, None, lost=why, silent_for=silent_for))

    def _relay(self, conn: AgentConnection, batch: LogBatch) -> None:
        if batch.dropped:
            conn.lines_dropped += batch.dropped
            dropped = " %d lines of output were dropped here: the driver did not keep up (%d in all)"
            rank_log.warning(
                rank_tag(self._attempt) + dropped,
                conn.rank,
                batch.dropped,
                conn.lines_dropped,
            )
        log_rank_lines(conn.rank, batch.lines, self._attempt)

    def close(self) -> None:
        """Stop listening and close every connection (agents still running end their ranks); wait for the loop."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join()
        self._wake_w.close()


_console_lock = threading.Lock()
_console_users = 0
_console_handler = logging.StreamHandler(sys.stderr)
_console_handler.setFormatter(logging.Formatter("%(message)s"))


@contextlib.contextmanager
def rank_logs_visible() -> Iterator[None]:
    """Show relayed rank lines on stderr while runs are going on, if the application set up no logging."""
    global _console_users
    with _console_lock:
        ours = _console_users > 0 or not rank_log.hasHandlers()
        if ours:
            if _console_users == 0:
                rank_log.addHandler(_console_handler)
            _console_users += 1
    try:
        yield
    finally:
        if ours:
            with _console_lock:
                _console_users -= 1
                if _console_users == 0:
                    rank_log.removeHandler(_console_handler)
