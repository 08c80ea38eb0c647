"""The ranks' lines as the driver logged them: a record holds a batch of one rank's lines (``rank_lines``)."""

from __future__ import annotations

import logging

from airflow_provider_hvd.runner.shared.rank_tag import rank_tag

RANKS = "airflow_provider_hvd.ranks"


def lines_of(record: logging.LogRecord) -> list[tuple[int, str]]:
    """``(rank, text)`` for each line in a record of the ranks' logger (a drop warning is one line)."""
    rank = record.args[0]  # type: ignore[index]  # "[rank %s] ..."
    lines = getattr(record, "rank_lines", None)
    if lines is None:
        return [(rank, record.getMessage().removeprefix(f"[rank {rank}] "))]
    return [(rank, text) for text in lines]


def tagged_lines(records: list[logging.LogRecord]) -> list[str]:
    """Each relayed line as the task log shows it, ``[rank N] text`` (``[rank N, attempt K] text`` in a restarted
    run's later attempts), in the order logged."""
    return [
        f"{rank_tag(getattr(r, 'attempt', 1)) % rank} {text}"
        for r in records
        if r.name == RANKS
        for rank, text in lines_of(r)
    ]


def lines_by_rank(records: list[logging.LogRecord]) -> dict[int, list[str]]:
    """The relayed lines of each rank, in order."""
    by_rank: dict[int, list[str]] = {}
    for record in records:
        if record.name == RANKS:
            for rank, text in lines_of(record):
                by_rank.setdefault(rank, []).append(text)
    return by_rank
