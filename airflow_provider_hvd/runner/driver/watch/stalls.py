"""Stalls (runs in the driver): the stall clock, asking the ranks for their stacks, and where each rank was.

The clock runs on what the ranks do. Each agent watches its rank: every line of output (whatever the
verbosity, except Horovod's own stall warning) and every message on its control pipe (``log_to_driver``,
reported metrics and checkpoints, its result) counts; while there is any, it sends a bare
:class:`...shared.messages.RankState` every so often (:mod:`...agent.activity`), which sets its connection's
``last_active`` (and starting the rank does). When no running rank has been
active for ``stall_timeout`` seconds, the driver asks every running rank for its Python stacks
(:class:`...shared.messages.DumpStacks`), waits for the answers (at most :data:`STACKS_WAIT_S`), and the run
ends with :class:`~...errors.RunStalledError`, naming each rank and where it was.
"""

from __future__ import annotations

import functools
import re
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ...errors import RunStalledError
from ...shared.naming import HOROVOD_RUNNER
from ...shared.timing import STACKS_WAIT_S

if TYPE_CHECKING:
    from .channel import AgentConnection

FRAMES_SHOWN = 8  # of each rank's main thread, in the error
_POLL_S = 0.05
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_RANK_ENTRY = "airflow_provider_hvd/runner/rank/__main__.py"
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/|/airflow_provider_hvd/|^<frozen ")


def check_stall_timeout(stall_timeout: float | timedelta | None) -> float | None:
    """``stall_timeout`` in seconds (None: off); ``ValueError`` for anything but a positive number or timedelta."""
    if stall_timeout is None:
        return None
    seconds = stall_timeout.total_seconds() if isinstance(stall_timeout, timedelta) else stall_timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"stall_timeout must be a positive number of seconds (or a timedelta), or None to turn stall detection "
            f"off, not {stall_timeout!r}"
        )
    return float(seconds)


def activity_period(stall_timeout: float) -> float:
    """How often an agent reports its rank's activity: the stall clock is off by at most a tenth of the timeout."""
    return min(10.0, max(0.5, stall_timeout / 10))


# where a rank was, from faulthandler's dump


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


@dataclass(frozen=True)
class StalledRank:
    rank: int
    quiet_s: float  # since its last output or message
    stacks: str | None  # faulthandler's dump of every thread
    no_stacks: str | None = None  # why there is none

    def where(self) -> str:
        """Where the rank was: the innermost frame of user code, then the innermost frames of its main thread."""
        head = f"rank {self.rank} (quiet for {self.quiet_s:.0f}s)"
        if self.stacks is None:
            return f"{head}: no stacks: {self.no_stacks}"
        frames = main_thread(self.stacks)
        if not frames:
            return f"{head}: its main thread has no Python frame in its stacks:\n" + _indent(self.stacks.strip())
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
    return "\n".join(rank.where() for rank in sorted(ranks, key=lambda r: (-r.quiet_s, r.rank)))


@dataclass(frozen=True)
class Stalled:
    """The run's event: no rank was active for ``seconds`` (stall_timeout); the running ranks and their stacks."""

    seconds: float
    ranks: tuple[StalledRank, ...]

    def dumps(self) -> str:
        """Every rank's full stacks (all threads), for the log."""
        return "\n".join(
            f"--- rank {r.rank} ---\n{(r.stacks or f'(none: {r.no_stacks})').rstrip()}"
            for r in sorted(self.ranks, key=lambda r: r.rank)
        )

    def reason(self) -> str:
        return f"the run stalled: no rank wrote output or reported progress for {self.seconds:.0f}s (stall_timeout)"


def stall_error(event: Stalled, runner: str = HOROVOD_RUNNER.runner) -> RunStalledError:
    ranks = sorted(rank.rank for rank in event.ranks)
    text = (
        f"{runner}: the run stalled: no rank wrote output or reported progress for {event.seconds:.0f}s "
        f"(stall_timeout={event.seconds:g}); every rank was ended. Stalled: rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}. Where each one was, longest quiet first (innermost frames first):\n"
        + where_ranks_were(event.ranks)
    )
    stacks = {r.rank: r.stacks if r.stacks is not None else f"(no stacks: {r.no_stacks})" for r in event.ranks}
    return RunStalledError(text, stall_timeout=event.seconds, ranks=ranks, stacks=stacks)


# asking for stacks


def ask_for_stacks(conns: Sequence[AgentConnection]) -> None:
    for conn in conns:
        conn.dump_stacks()


def answers(conns: Sequence[AgentConnection], now: float, files: CodeFiles | None) -> tuple[StalledRank, ...]:
    """Each connection's answer so far (a missing one says so)."""
    found = []
    for conn in conns:
        answer = conn.stacks_answer
        stacks = answer.stacks if answer else None
        found.append(
            StalledRank(
                conn.rank,  # type: ignore[arg-type]
                max(0.0, now - conn.last_active),
                files.restore(stacks) if files and stacks else stacks,
                answer.no_stacks if answer else f"its agent did not answer within {STACKS_WAIT_S:.0f}s",
            )
        )
    return tuple(found)


def collect_stacks(conns: Sequence[AgentConnection], files: CodeFiles | None = None) -> tuple[StalledRank, ...]:
    """Ask every connection's rank for its stacks and wait for the answers (at most :data:`STACKS_WAIT_S`)."""
    asked_at = time.monotonic()
    ask_for_stacks(conns)
    while time.monotonic() - asked_at < STACKS_WAIT_S and not all(conn.stacks_answer or conn.done for conn in conns):
        time.sleep(_POLL_S)
    return answers(conns, asked_at, files)


class StallWatch:
    """The stall clock of one run; :meth:`check` is called from the supervisor's loop."""

    def __init__(self, stall_timeout: float, files: CodeFiles | None = None) -> None:
        self.timeout = stall_timeout
        self._files = files
        self._asked: list[AgentConnection] | None = None
        self._asked_at = 0.0

    def check(self, running: Sequence[AgentConnection], now: float) -> Stalled | None:
        """The Stalled event once the ranks quiet for ``timeout`` have answered with their stacks (or not in time)."""
        if self._asked is None:
            if running and now - max(conn.last_active for conn in running) >= self.timeout:
                self._asked, self._asked_at = list(running), now
                ask_for_stacks(self._asked)
            return None
        if now - self._asked_at < STACKS_WAIT_S and not all(conn.stacks_answer or conn.done for conn in self._asked):
            return None
        return Stalled(self.timeout, answers(self._asked, self._asked_at, self._files))


# the files of code shipped by value (cloudpickle names it "<dynamic-code>")

_DYNAMIC_FRAME = re.compile(r'File "<dynamic-code>", line (\d+) in (\S+)')
_MAX_CODES = 2000


class CodeFiles:
    """Where the functions shipped by value were written: cloudpickle drops their file names (every frame of
    them says ``<dynamic-code>``), but keeps their names and line numbers, so the driver can put the names back."""

    def __init__(self, *roots: object) -> None:
        self._spans: dict[str, list[tuple[int, int, str]]] = {}
        seen: set[int] = set()
        todo = list(roots)
        while todo and len(seen) < _MAX_CODES:
            obj = todo.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            code = getattr(obj, "__code__", None)
            if isinstance(obj, types.CodeType):
                code, obj = obj, None
            if code is None:
                if isinstance(obj, (list, tuple)):
                    todo.extend(obj)
                elif isinstance(obj, dict):
                    todo.extend(obj.values())
                elif isinstance(obj, functools.partial):
                    todo.extend((obj.func, obj.args, obj.keywords))
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            self._spans.setdefault(code.co_name, []).append(
                (min(lines, default=code.co_firstlineno), max(lines, default=code.co_firstlineno), code.co_filename)
            )
            todo.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
            if obj is not None:
                names = getattr(obj, "__globals__", {})
                todo.extend(names[name] for name in code.co_names if callable(names.get(name)))
                todo.extend(cell.cell_contents for cell in getattr(obj, "__closure__", None) or () if _filled(cell))

    def file_of(self, func: str, line: int) -> str | None:
        files = {file for first, last, file in self._spans.get(func, ()) if first <= line <= last}
        return files.pop() if len(files) == 1 else None

    def restore(self, dump: str) -> str:
        """``dump`` with each ``<dynamic-code>`` frame naming its file, where it is known."""

        def real(match: re.Match[str]) -> str:
            file = self.file_of(match[2], int(match[1]))
            return f'File "{file}", line {match[1]} in {match[2]}' if file else match[0]

        return _DYNAMIC_FRAME.sub(real, dump)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True
