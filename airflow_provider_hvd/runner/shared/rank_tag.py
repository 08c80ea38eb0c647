"""The ``[rank N]`` tag in front of each line of a rank's output, the same in the driver's log and the executor's."""

from __future__ import annotations

RANK_TAG = "[rank %s]"  # a %-format: logging keeps the rank among a record's args, for handlers that want it
RANK_LINE = RANK_TAG + " %s"  # its args: the rank, the line


def tagged(rank: int | None, text: str) -> str:
    """``text`` as a line of rank ``rank``'s output (``None``: the agent has no rank yet)."""
    return RANK_LINE % (rank, text)
