"""Where each rank was, from its Python stacks (faulthandler's dump), in words."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..events import StalledRank

FRAMES_SHOWN = 8  # of each rank's main thread, in the error
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_RANK_ENTRY = "airflow_provider_hvd/runner/rank/__main__.py"
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/|/airflow_provider_hvd/|^<frozen ")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def is_user_code(self) -> bool:
        """Not Python's library, an installed package or HorovodRunner: what the user wrote (a DAG file, a notebook)."""
        return not _LIBRARY.search(self.file)

    def __str__(self) -> str:
        return f'File "{self.file}", line {self.line} in {self.func}'


def threads_of(dump: str) -> list[list[Frame]]:
    """Each thread's frames (innermost first, as faulthandler writes them) in a faulthandler dump."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (frame := _FRAME.match(line)) and threads:
            threads[-1].append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    return threads


def main_thread(dump: str) -> list[Frame]:
    """The frames of the thread running the job's ``main``, from ``main`` inwards (HorovodRunner's own cut off)."""
    for frames in threads_of(dump):
        entry = next((i for i, frame in enumerate(frames) if frame.file.endswith(_RANK_ENTRY)), None)
        if entry is not None:
            return frames[:entry]
    return []


def where_rank_was(rank: StalledRank) -> str:
    """Where the rank was: the innermost frame of user code, then the innermost frames of its main thread."""
    head = f"rank {rank.rank} (quiet for {rank.quiet_s:.0f}s)"
    if rank.stacks is None:
        return f"{head}: no stacks: {rank.no_stacks}"
    frames = main_thread(rank.stacks)
    if not frames:
        return f"{head}: its main thread has no Python frame in its stacks:\n" + _indent(rank.stacks.strip())
    mine = next((frame for frame in frames if frame.is_user_code), frames[0])
    shown = frames[: max(FRAMES_SHOWN, frames.index(mine) + 2)]  # down to the user's frame and its caller
    lines = [f"{head} was in {mine.func} ({mine.file}, line {mine.line})"]
    lines += [f"    {frame}" for frame in shown]
    if len(frames) > len(shown):
        lines.append(f"    ... {len(frames) - len(shown)} outer frames")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def where_ranks_were(ranks: Sequence[StalledRank]) -> str:
    return "\n".join(where_rank_was(rank) for rank in sorted(ranks, key=lambda r: (-r.quiet_s, r.rank)))
