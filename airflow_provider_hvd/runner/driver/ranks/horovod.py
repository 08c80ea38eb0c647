"""Horovod's ranks (:class:`HorovodKind`): Horovod's own Gloo rendezvous server, bound to the driver's address, the
rank plan by host (:mod:`.plan`) and the ``HOROVOD_*`` slot variables. Imports Horovod: loaded when a Horovod run
starts (:func:`.kind.horovod_kind`).

The rendezvous is hardened for a run: it answers only this run's hosts, takes bodies of at most
:data:`MAX_BODY_BYTES`, and closes a connection that takes longer than :data:`REQUEST_TIMEOUT_S` (Gloo's requests
are small).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from ...errors import JobRefusedError
from ...shared.horovod_env import KIND, forwarded_settings, slot_env
from ..launch.address import RENDEZVOUS, DriverAddress, address_family
from .plan import Slot, plan_by_node

if TYPE_CHECKING:
    from ...shared.messages import Hello

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

    def init(self, plan: Sequence[Slot], hosts: Iterable[str]) -> None:
        """Serve ``plan`` to the rank processes on ``hosts`` (their addresses as the driver sees them: the source
        addresses of their agents' connections, which differ from the agents' own behind a NAT)."""
        self._httpd.allowed = frozenset(hosts)
        self._httpd.init(plan)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class HorovodKind:
    """Horovod's ranks: its Gloo rendezvous server on the driver, the ``HOROVOD_*`` slot variables."""

    name = KIND
    unencrypted = (
        "Horovod's Gloo traffic between the ranks (the tensors, and its rendezvous) cannot be encrypted by Horovod"
    )

    def __init__(self) -> None:
        self._rendezvous: Rendezvous | None = None

    def open(self, driver: DriverAddress) -> str:
        if address_family(driver.advertised) == socket.AF_INET6:
            raise JobRefusedError(
                f"Horovod's ranks cannot reach the driver at {driver.advertised} "
                f"({driver.address_settings or 'loopback'}): Horovod's Gloo rendezvous takes IPv4 only (its ranks' "
                f"HTTP client). Set {driver.host_setting} to an IPv4 address of this host that the executors reach "
                "(TorchDistributor's ranks work over IPv6 too)."
            )
        self._rendezvous = driver.listen(RENDEZVOUS, lambda host, port: Rendezvous(host, port, driver.advertised))
        return f"Gloo rendezvous on {driver.describe(self._rendezvous.port)}"

    def plan(self, hellos: Sequence[Hello], peers: Sequence[str]) -> Sequence[Slot]:
        assert self._rendezvous is not None
        plan = plan_by_node([hello.host for hello in hellos], cross="local_rank")  # as Horovod assigns hosts
        self._rendezvous.init(plan, peers)
        return plan

    def env(self, slot: Slot) -> dict[str, str]:
        assert self._rendezvous is not None
        return {
            **forwarded_settings(os.environ),
            **slot_env(slot, self._rendezvous.host, self._rendezvous.port),
        }

    def close(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.stop()
