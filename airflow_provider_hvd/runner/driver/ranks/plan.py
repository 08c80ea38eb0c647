"""The rank plan, written once for both kinds: ranks grouped by node, and the GPUs each rank sees.

Ranks on one node are contiguous, in agent order, nodes in the order of their first agent. A node is a host
for Horovod (as Horovod's own host assignment has it), a Spark task for torch (PySpark's TorchDistributor runs
``torchrun`` in each task). GPUs are shared by the ranks of a node (:mod:`...shared.gpus`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ...shared.gpus import visible_gpus


@dataclass
class Slot:
    """One agent's rank (the fields of Horovod's ``SlotInfo``)."""

    hostname: str  # the node: a host, or a Spark task on its host
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def by_node(nodes: Sequence[str]) -> dict[str, list[int]]:
    """The agents of each node (``nodes[i]``: agent i's), in agent order; nodes in the order of their first agent."""
    grouped: dict[str, list[int]] = {}
    for agent, node in enumerate(nodes):
        grouped.setdefault(node, []).append(agent)
    return grouped


def plan_by_node(nodes: Sequence[str], cross: Literal["node", "local_rank"] = "node") -> list[Slot]:
    """Each agent's slot (``nodes[i]``: agent i's node), in agent order.

    ``cross``: what ``cross_rank`` and ``cross_size`` count. ``"node"``: the node's index and the number of nodes
    (torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``). ``"local_rank"``: the node's index among the nodes that
    have a rank of this one's local rank, and their number (Horovod's cross communicator, as its host assignment
    gives them: a node with fewer ranks is in fewer of them).
    """
    grouped = by_node(nodes)
    with_local_rank: dict[int, list[str]] = {}  # the nodes that have a rank of each local rank, in node order
    for node, agents in grouped.items():
        for local_rank in range(len(agents)):
            with_local_rank.setdefault(local_rank, []).append(node)
    slots: list[Slot | None] = [None] * len(nodes)
    rank = 0
    for index, (node, agents) in enumerate(grouped.items()):
        for local_rank, agent in enumerate(agents):
            if cross == "node":
                cross_rank, cross_size = index, len(grouped)
            else:
                peers = with_local_rank[local_rank]
                cross_rank, cross_size = peers.index(node), len(peers)
            slots[agent] = Slot(node, rank, local_rank, cross_rank, len(nodes), len(agents), cross_size)
            rank += 1
    return [slot for slot in slots if slot is not None]


def gpus_by_node(plan: Sequence[Slot], given: Sequence[Sequence[str]]) -> list[list[str] | None]:
    """The GPUs each agent's rank sees, from those given to each (``given[i]``: agent i's, ``plan[i]`` its slot):
    those given to the ranks of its node, as :func:`...shared.gpus.visible_gpus` shares them."""
    seen: list[list[str] | None] = [None] * len(plan)
    for agents in by_node([slot.hostname for slot in plan]).values():
        agents.sort(key=lambda agent: plan[agent].local_rank)
        for agent, gpus in zip(agents, visible_gpus([given[agent] for agent in agents]), strict=True):
            seen[agent] = gpus
    return seen
