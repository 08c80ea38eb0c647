"""Asking a rank process for its Python stacks (runs in the agent).

The agent names a file in the rank's folder, in the rank's environment (``HVD_RUNNER_STACKS_FILE``); the
folder goes with the rank (:mod:`...reaper`), whoever ends it. The rank arms faulthandler
to write every thread's stack there on a signal (:mod:`..rank.stacks`) and says so with its pid
(:class:`~..shared.messages.RankReady`). To answer the driver's :class:`~..shared.messages.DumpStacks`, the
agent sends that signal and reads what was appended, once it stops growing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from ..shared.messages import RankReady, RankState
from ..shared.timing import STACKS_ANSWER_WAIT_S as ANSWER_WAIT_S

_SETTLED_S = 0.1  # the file has stopped growing for this long: the dump is complete
_POLL_S = 0.02


class StackFile:
    """The file one rank writes its stacks to, and the pid and signal to ask it with."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, "stacks.txt")  # the rank makes it as it arms faulthandler
        self.pid: int | None = None
        self._signal = 0
        self._lock = threading.Lock()

    def ready(self, message: RankReady) -> None:
        self.pid, self._signal = message.pid, message.stacks_signal

    def dump(self, running: Callable[[], bool]) -> RankState:
        """Ask the rank for its stacks (``running``: whether the rank process is still there)."""
        try:
            return self._dump(running)
        except OSError:  # the file went with the rank, which ended meanwhile
            return RankState(no_stacks="its rank process ended while writing its stacks")

    def _dump(self, running: Callable[[], bool]) -> RankState:
        with self._lock:
            if self.pid is None:
                return RankState(no_stacks="its rank process had not started Python yet")
            if not self._signal:
                return RankState(no_stacks="its rank process cannot write its stacks (no stacks file)")
            if not running():
                return RankState(no_stacks="its rank process had already ended")
            start = os.path.getsize(self.path)
            try:
                os.kill(self.pid, self._signal)
            except ProcessLookupError:
                return RankState(no_stacks="its rank process had already ended")
            size, changed_at, deadline = start, time.monotonic(), time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(_POLL_S)
                now_size = os.path.getsize(self.path)
                if now_size != size:
                    size, changed_at = now_size, time.monotonic()
                elif size > start and time.monotonic() - changed_at >= _SETTLED_S:
                    break
            if size == start:
                return RankState(
                    no_stacks=f"it did not answer within {ANSWER_WAIT_S:.0f}s (stopped, or the signal's handler "
                    "was replaced by its code)"
                )
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(start)
                return RankState(stacks=f.read())
