"""Horovod's own Gloo rendezvous server, bound to the driver's address, and the rank plan.

Hardened for a run: it answers only this run's hosts, takes bodies of at most :data:`MAX_BODY_BYTES`,
and closes a connection that takes longer than :data:`REQUEST_TIMEOUT_S` (Gloo's requests are small).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from horovod.runner.common.util.hosts import HostInfo, SlotInfo, get_host_assignments
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from ..launch.address import address_family

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10.0
_PAYLOAD_TOO_LARGE = 413


class _Handler(RendezvousHandler):  # type: ignore[misc]  # Horovod has no type information
    timeout = REQUEST_TIMEOUT_S  # per read

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        self.server.untrack(self.connection)
        super().finish()

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.send_status_code(_PAYLOAD_TOO_LARGE)
            self.close_connection = True
            return
        super().do_PUT()


class _Server(RendezvousHTTPServer):  # type: ignore[misc]
    daemon_threads = True

    def __init__(self, host: str, port: int) -> None:
        self.address_family = address_family(host)  # (socketserver's is IPv4's): before the socket is made
        super().__init__((host, port), _Handler, 0)
        self.allowed: frozenset[str] = frozenset()
        self._open: dict[socket.socket, float] = {}
        self._open_lock = threading.Lock()

    def verify_request(self, request: object, client_address: tuple[str, int]) -> bool:
        return client_address[0] in self.allowed

    def track(self, conn: socket.socket) -> None:
        with self._open_lock:
            self._open[conn] = time.monotonic() + REQUEST_TIMEOUT_S

    def untrack(self, conn: socket.socket) -> None:
        with self._open_lock:
            self._open.pop(conn, None)

    def service_actions(self) -> None:
        """Between polls of serve_forever: close connections that have taken too long."""
        now = time.monotonic()
        with self._open_lock:
            late = [conn for conn, deadline in self._open.items() if deadline < now]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_POLL_S = 0.05  # how long stop() waits for the serving loop at most (it was 0.5: 0.4 s of every run's end)


class Rendezvous:
    """Serves Gloo's rendezvous on ``bind``:``port`` (not on every interface, as ``RendezvousServer.start`` would;
    0: any free port); the ranks are told ``host`` (``bind`` unless given), e.g. where that port is published."""

    def __init__(self, bind: str, port: int = 0, host: str | None = None) -> None:
        self.host = host or bind
        self._httpd = _Server(bind, port)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="hvd-rendezvous",
            daemon=True,
        )
        self._thread.start()

    def init(self, plan: list[SlotInfo], hosts: Iterable[str]) -> None:
        """Serve ``plan`` to the rank processes on ``hosts`` (their addresses as the driver sees them: the source
        addresses of their agents' connections, which differ from the agents' own behind a NAT)."""
        self._httpd.allowed = frozenset(hosts)
        self._httpd.init(plan)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def plan_ranks(hosts: list[str]) -> list[SlotInfo]:
    """Give ranks to agents, ``hosts[i]`` being agent i's host; ranks on one host are contiguous.

    Returns the slot of each agent, in agent order.
    """
    per_host: OrderedDict[str, list[int]] = OrderedDict()
    for agent, host in enumerate(hosts):
        per_host.setdefault(host, []).append(agent)
    slots = get_host_assignments([HostInfo(host, len(agents)) for host, agents in per_host.items()], len(hosts))
    by_agent: list[SlotInfo | None] = [None] * len(hosts)
    agents_in_rank_order = [agent for agents in per_host.values() for agent in agents]
    for agent, slot in zip(agents_in_rank_order, slots, strict=False):
        by_agent[agent] = slot
    return by_agent
