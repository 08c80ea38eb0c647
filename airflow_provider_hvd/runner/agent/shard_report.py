"""A barrier task's word to the driver on its shards while they stream in (a run on a DataFrame).

Before its agents connect, the task opens a connection of its own to the driver channel (the run's secret, TLS
where the channel is) and sends :class:`..shared.messages.ShardProgress`: first as its rows begin to come (the
driver then knows Spark has computed them and the barrier tasks run), then the rows and bytes written so far at
most every ``FEED_REPORT_S``, and once they are all in. Heartbeats keep the connection while a batch is slow to
come. The driver logs the DataFrame's progress from these and holds the ranks' start clock while they come
(``driver/watch/dataframe_progress.py``). A driver that cannot be reached fails the task here, at once, as its
agents would fail it a moment later.
"""

from __future__ import annotations

import time

from ..shared.messages import ShardProgress, send
from ..shared.timing import FEED_REPORT_S
from .agent import AgentArgs, connect_driver
from .liveness import DriverWatch


class ShardReport:
    """Task ``task``'s reports; call it with the rows and bytes written so far, :meth:`done` once all are in."""

    def __init__(self, args: AgentArgs, task: int) -> None:
        self.task = task
        self.rows = self.bytes = 0
        self._sock, self._stream = connect_driver(args)
        self._watch = DriverWatch(self._stream, self._sock, args.liveness)
        self._sent_at = 0.0
        self._send()

    def __call__(self, rows: int, nbytes: int) -> None:
        self.rows, self.bytes = rows, nbytes
        if time.monotonic() - self._sent_at >= FEED_REPORT_S:
            self._send()

    def done(self) -> None:
        """Every row of the task is in its shards."""
        self._send(done=True)

    def _send(self, done: bool = False) -> None:
        self._sent_at = time.monotonic()
        try:
            send(self._stream, ShardProgress(self.task, self.rows, self.bytes, done))
        except (OSError, ValueError):
            pass  # the driver is gone: the agents find that out as they connect

    def close(self) -> None:
        self._stream.close()
        self._watch.stop()

    def __enter__(self) -> ShardReport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
