"""The agent's side of the heartbeats (:mod:`..shared.liveness`); runs in the agent, beside its rank.

Two threads: one sends a heartbeat every interval (a send may block on a link that is cut), the other checks
that the driver was heard from within the timeout. When it was not (the driver's host vanished, or the
network between them is cut), it shuts the connection down: the agent then ends its rank, as when the driver
closes the connection, and a link that comes back finds nothing left to resume.
"""

from __future__ import annotations

import select
import socket
import threading
import time

from ..shared.liveness import Liveness
from ..shared.messages import AgentAlive, DriverAlive, Message, receive, send
from ..shared.wire import FrameStream

_PEER_CLOSED = getattr(select, "POLLRDHUP", 0) | select.POLLHUP  # (POLLRDHUP: Linux; elsewhere POLLHUP only)


class DriverWatch:
    def __init__(self, stream: FrameStream, sock: socket.socket, liveness: Liveness) -> None:
        self._stream = stream
        self._sock = sock
        self._liveness = liveness
        self._last_heard = time.monotonic()
        self._stop = threading.Event()
        self.silent_reason: str | None = None  # set when the driver went silent
        self._threads = [
            threading.Thread(target=self._beat, name="hvd-agent-heartbeat", daemon=True),
            threading.Thread(target=self._check, name="hvd-agent-liveness", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def receive(self) -> Message:
        """The driver's next message other than a heartbeat; every frame counts as a sign of life."""
        while True:
            message = receive(self._stream)
            self._last_heard = time.monotonic()
            if not isinstance(message, DriverAlive):
                return message

    def send(self, message: Message) -> None:
        send(self._stream, message)

    def _beat(self) -> None:
        while not self._stop.wait(self._liveness.interval_s):
            try:
                send(self._stream, AgentAlive())
            except (OSError, ValueError):
                return  # the connection is closed: the agent's readers see it

    def _pending(self) -> bool:
        """Bytes from the driver wait to be read (the agent was busy, not the driver silent). Not once the driver
        closed its end: then nothing more comes, whatever is left unread (a reader that stopped reading must not
        keep the rank alive)."""
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | _PEER_CLOSED)
            return any(events & select.POLLIN and not events & _PEER_CLOSED for _, events in poller.poll(0))
        except (OSError, ValueError):
            return False

    def _check(self) -> None:
        step = min(1.0, self._liveness.interval_s)
        while not self._stop.wait(step):
            silent = time.monotonic() - self._last_heard
            if silent > self._liveness.timeout_s and not self._pending():
                self.silent_reason = (
                    f"nothing heard from the driver for {silent:.0f}s (heartbeat timeout "
                    f"{self._liveness.timeout_s:g}s): its host is down or the network to it is cut"
                )
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # readers and a blocked send wake up; the rank is ended
                except OSError:
                    pass
                return

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
