"""Ctrl-C for the commands that start a server and stop it on Ctrl-C (``connect_server``, ``make airflow``'s).

A Ctrl-C that comes while such a command forks its server is held until the server's pid is known: raised inside
``Popen`` (which waits for the child's exec), it would leave the server running with nobody to stop it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Interrupts:
    """Ctrl-C and SIGTERM as one KeyboardInterrupt, even where this process was started with SIGINT ignored (a
    shell's `&`); later ones are ignored (they do not cut the stop short); one that comes while they are held is
    raised as the hold ends."""

    def __init__(self) -> None:
        self._held = False
        self._came = False
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._interrupted)

    def _interrupted(self, signum: int, frame: object) -> None:
        if self._held:
            self._came = True
            return
        self._raise()

    @staticmethod
    def _raise() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held = True
        try:
            yield
        finally:
            self._held = False
        if self._came:
            self._raise()
