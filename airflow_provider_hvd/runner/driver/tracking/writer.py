"""The bounded background writer both trackers use (the progress sink's, MLflow's): one thread makes their slow
calls, so that the run never waits on a store or a tracking server while it goes on, and at its end at most a
bound (``FINAL_WRITE_S``): a call still hung then is abandoned, and its thread ends when the call returns.
"""

from __future__ import annotations

import threading

_JOIN_SLACK_S = 0.5  # beyond the bound: the thread's own end once its last call returned


class BoundedWriter:
    """The writes' ``thread`` (a daemon thread, not started, named by its tracker) and its loop's clock: the loop
    sleeps in :meth:`wait`, and returns once :attr:`closing` is set (by :meth:`close`) after its last writes."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread
        self._start_lock = threading.Lock()
        self._started = False
        self._wake = threading.Event()
        self._closing = threading.Event()

    @property
    def started(self) -> bool:
        return self._started

    @property
    def closing(self) -> bool:
        """The run has ended: what is left is written once, at once, and the loop returns."""
        return self._closing.is_set()

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._start_lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def wake(self) -> None:
        """End the loop's :meth:`wait` now (something is due)."""
        self._wake.set()

    def wait(self, timeout: float | None) -> None:
        """The loop's sleep: until woken, closing, or ``timeout`` seconds (None: until woken or closing)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def close(self, bound: float) -> bool:
        """Have the loop write what is left and return, waiting for it at most ``bound`` seconds; whether it
        returned in time (True also when it never started)."""
        self._closing.set()
        self._wake.set()
        if not self._started:
            return True
        self._thread.join(bound + _JOIN_SLACK_S)
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._started:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()
