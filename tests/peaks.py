"""The highest values some measures reach while a block of code runs (tests and benchmarks)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Peaks:
    """Samples each measure every ``interval_s`` in a thread while the ``with`` block runs.

    ``before`` holds each measure's value at the start (the sampling thread already counted in a thread
    count), ``peak`` the highest seen, ``growth(name)`` the difference.
    """

    def __init__(self, interval_s: float = 0.01, **measures: Callable[[], float]) -> None:
        self._measures = measures
        self._interval_s = interval_s
        self.before: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peaks-sampler", daemon=True)

    def _take(self) -> dict[str, float]:
        return {name: measure() for name, measure in self._measures.items()}

    def _sample(self) -> None:
        self._ready.wait()
        while not self._stop.wait(self._interval_s):
            for name, value in self._take().items():
                self.peak[name] = max(self.peak[name], value)

    def __enter__(self) -> Peaks:
        self._thread.start()
        self.before = self._take()
        self.peak = dict(self.before)
        self._ready.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for name, value in self._take().items():
            self.peak[name] = max(self.peak[name], value)

    def growth(self, name: str) -> float:
        return self.peak[name] - self.before[name]
