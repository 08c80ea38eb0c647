"""The ``[rank N]`` tag in front of each line of a rank's output, the same in the driver's log and the executor's;
``[rank N, attempt K]`` in the attempts of a run that restarted (``max_restarts``) after the first."""

from __future__ import annotations

RANK_TAG = "[rank %s]"  # a %-format: logging keeps the rank among a record's args, for handlers that want it


def rank_tag(attempt: int = 1) -> str:
    """The tag's %-format in attempt ``attempt`` of a run (its one arg: the rank; the attempt is in the format)."""
    return RANK_TAG if attempt <= 1 else f"[rank %s, attempt {attempt:d}]"


def rank_line(attempt: int = 1) -> str:
    """A line's %-format in attempt ``attempt``: its args are the rank and the line, whatever the attempt."""
    return rank_tag(attempt) + " %s"


def tagged(rank: int | None, text: str, attempt: int = 1) -> str:
    """``text`` as a line of rank ``rank``'s output (``None``: the agent has no rank yet) in attempt ``attempt``."""
    return rank_line(attempt) % (rank, text)
