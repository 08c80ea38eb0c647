"""The driver-side channel: one authenticated TCP connection per rank agent carries hello, logs, result, done.

Bounded: at most :data:`MAX_PENDING_HANDSHAKES` connections may be proving the secret at once (each for at
most the handshake timeout); more are closed at once. Closing the channel leaves no thread or socket behind.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass

from .messages import Abort, AgentFailed, Done, Hello, LogBatch, Payload, Result, Start, receive, send
from .wire import AuthenticationError, ConnectionClosed, FrameStream, accept_handshake

log = logging.getLogger("airflow_provider_hvd.runner")
rank_log = logging.getLogger("airflow_provider_hvd.ranks")
rank_log.setLevel(logging.INFO)  # on its own level: relayed lines show wherever the application logs anything

MAX_PENDING_HANDSHAKES = 16


class AgentConnection:
    """The driver's end of one agent's connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.peer = peer
        self.stream = FrameStream.over_socket(sock)
        self.rank: int | None = None
        self.hello: Hello | None = None
        self.result: bytes | None = None
        self.done: Done | None = None
        self.lines_dropped = 0

    def where(self) -> str:
        return self.hello.where() if self.hello else f"at {self.peer}"

    def start(self, start: Start, payload: bytes) -> None:
        self.rank = start.rank
        send(self.stream, start)
        send(self.stream, Payload(payload))

    def abort(self, reason: str) -> None:
        try:
            send(self.stream, Abort(reason))
        except OSError:
            pass  # already gone


@dataclass(frozen=True)
class ChannelEvent:
    """An agent said hello, reported (Done or AgentFailed), or its connection ended before it reported."""

    conn: AgentConnection
    message: Hello | Done | AgentFailed | None  # None: lost
    lost: str = ""


class DriverChannel:
    """Listens on ``host`` for agents that prove ``secret``; control events go to ``events``, logs to logging."""

    def __init__(self, host: str, secret: bytes) -> None:
        self.events: queue.Queue[ChannelEvent] = queue.Queue()
        self._secret = secret
        self._socks: dict[threading.Thread, socket.socket] = {}  # each connection's, by the thread serving it
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._closed = False
        self._listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept_loop, name="hvd-channel-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            peer = f"{addr[0]}:{addr[1]}"
            if not self._handshakes.acquire(blocking=False):
                log.warning("HorovodRunner: dropped a connection from %s: too many unproven connections", peer)
                sock.close()
                continue
            thread = threading.Thread(target=self._serve, args=(sock, peer), name="hvd-channel-conn", daemon=True)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._socks[thread] = sock
                thread.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = AgentConnection(sock, peer)
        try:
            try:
                accept_handshake(sock, self._secret)
            except (AuthenticationError, OSError) as exc:
                if not self._closed:
                    log.warning("HorovodRunner: rejected a connection from %s to the driver channel: %s", peer, exc)
                return
            finally:
                self._handshakes.release()
            self._read_until_done(conn)
        finally:
            conn.stream.close()
            with self._lock:
                self._socks.pop(threading.current_thread(), None)

    def _read_until_done(self, conn: AgentConnection) -> None:
        try:
            while True:
                message = receive(conn.stream)
                if isinstance(message, LogBatch):
                    self._relay(conn, message)
                elif isinstance(message, Result):
                    conn.result = message.data
                elif isinstance(message, Hello):
                    conn.hello = message
                    self.events.put(ChannelEvent(conn, message))
                elif isinstance(message, (Done, AgentFailed)):
                    conn.done = message if isinstance(message, Done) else None
                    self.events.put(ChannelEvent(conn, message))
                    return
                else:
                    raise ValueError(f"an agent does not send {type(message).__name__}")
        except (ConnectionClosed, OSError) as exc:
            self.events.put(ChannelEvent(conn, None, lost=str(exc) or type(exc).__name__))
        except Exception as exc:  # noqa: BLE001 - a malformed frame from an authenticated agent is a bug: say so
            log.exception("HorovodRunner: broken frame from the agent at %s", conn.peer)
            self.events.put(ChannelEvent(conn, None, lost=f"broken frame: {exc!r}"))

    @staticmethod
    def _relay(conn: AgentConnection, batch: LogBatch) -> None:
        if batch.dropped:
            conn.lines_dropped += batch.dropped
            rank_log.warning(
                "[rank %s] %d lines of output were dropped here: the driver did not keep up (%d in all)",
                conn.rank, batch.dropped, conn.lines_dropped,
            )
        for text in batch.lines:
            rank_log.info("[rank %s] %s", conn.rank, text)

    def close(self) -> None:
        """Stop listening and close every connection (agents still running end their ranks); wait for the threads."""
        with self._lock:
            self._closed = True
            open_connections = dict(self._socks)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join()
        for sock in open_connections.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it, which closes it
            except OSError:
                pass
        for thread in open_connections:
            thread.join()
