"""Horovod's own Gloo rendezvous server, bound to the driver address the ranks use, and the rank plan."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from horovod.runner.common.util.hosts import HostInfo, SlotInfo, get_host_assignments
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer


class Rendezvous:
    """Serves Gloo's rendezvous on ``host`` (not on every interface, as ``RendezvousServer.start`` would)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._httpd = RendezvousHTTPServer((host, 0), RendezvousHandler, 0)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hvd-rendezvous", daemon=True)
        self._thread.start()

    def init(self, plan: list[SlotInfo]) -> None:
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
    for agent, slot in zip(agents_in_rank_order, slots):
        by_agent[agent] = slot
    return by_agent  # type: ignore[return-value]


def rank_env(slot: SlotInfo, rendezvous: Rendezvous) -> dict[str, str]:
    """The environment that makes ``hvd.init()`` in a rank process join this run over Gloo."""
    env = {
        "HOROVOD_RANK": slot.rank,
        "HOROVOD_SIZE": slot.size,
        "HOROVOD_LOCAL_RANK": slot.local_rank,
        "HOROVOD_LOCAL_SIZE": slot.local_size,
        "HOROVOD_CROSS_RANK": slot.cross_rank,
        "HOROVOD_CROSS_SIZE": slot.cross_size,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous.host,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": rendezvous.port,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # ranks sharing a host share its cores; without this each one starts a thread per core
        env["OMP_NUM_THREADS"] = max(1, (os.cpu_count() or 1) // slot.local_size)
    return {key: str(value) for key, value in env.items()}
