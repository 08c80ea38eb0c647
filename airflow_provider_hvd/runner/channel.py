"""The driver-side channel: one authenticated TCP connection per rank agent carries hello, logs, result, done."""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any

from .wire import AuthenticationError, ConnectionClosed, FrameStream, Kind, accept_handshake

log = logging.getLogger("airflow_provider_hvd.runner")
rank_log = logging.getLogger("airflow_provider_hvd.ranks")


class AgentConnection:
    """The driver's end of one agent's connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.stream = FrameStream.over_socket(sock)
        self.rank: int | None = None
        self.hello: dict[str, Any] = {}
        self.result: bytes | None = None
        self.done: dict[str, Any] | None = None
        self.lines_dropped = 0

    def start(self, rank: int, env: dict[str, str], payload: bytes) -> None:
        self.rank = rank
        self.stream.send_json(Kind.START, {"rank": rank, "env": env})
        self.stream.send(Kind.PAYLOAD, payload)

    def abort(self, reason: str) -> None:
        try:
            self.stream.send_json(Kind.ABORT, {"reason": reason})
        except OSError:
            pass  # already gone

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


@dataclass(frozen=True)
class ChannelEvent:
    kind: str  # "hello", "done" or "lost"
    conn: AgentConnection
    detail: str = ""


class DriverChannel:
    """Listens on ``host`` for agents that prove ``secret``; control events go to ``events``, logs to logging."""

    def __init__(self, host: str, secret: bytes) -> None:
        self.events: queue.Queue[ChannelEvent] = queue.Queue()
        self._secret = secret
        self._conns: list[AgentConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept_loop, name="hvd-channel-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            accept_handshake(sock, self._secret)
        except (AuthenticationError, OSError) as exc:
            log.warning("HorovodRunner: rejected a connection from %s to the driver channel: %s", peer, exc)
            sock.close()
            return
        conn = AgentConnection(sock, peer)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.append(conn)
        try:
            self._read(conn)
        except (ConnectionClosed, OSError) as exc:
            if conn.done is None:
                self.events.put(ChannelEvent("lost", conn, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a malformed frame from an authenticated agent is a bug: say so
            log.exception("HorovodRunner: broken frame from the agent at %s", peer)
            self.events.put(ChannelEvent("lost", conn, f"broken frame: {exc!r}"))

    def _read(self, conn: AgentConnection) -> None:
        while True:
            kind, data = conn.stream.recv()
            if kind is Kind.LOG:
                self._relay(conn, json.loads(data))
            elif kind is Kind.HELLO:
                conn.hello = json.loads(data)
                self.events.put(ChannelEvent("hello", conn))
            elif kind is Kind.RESULT:
                conn.result = data
            elif kind is Kind.DONE:
                conn.done = json.loads(data)
                self.events.put(ChannelEvent("done", conn))
                return

    @staticmethod
    def _relay(conn: AgentConnection, batch: dict[str, Any]) -> None:
        if batch["dropped"]:
            conn.lines_dropped += batch["dropped"]
            rank_log.warning(
                "[rank %s] %d lines of output were dropped here: the driver did not keep up (%d in all)",
                conn.rank, batch["dropped"], conn.lines_dropped,
            )
        for text in batch["lines"]:
            rank_log.info("[rank %s] %s", conn.rank, text)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        self._listener.close()
        for conn in conns:
            conn.close()
