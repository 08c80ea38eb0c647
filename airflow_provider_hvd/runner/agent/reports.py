"""A rank's metrics and checkpoints on their way to the driver, sent by a thread of their own (runs in the agent).

The agent's control thread reads the rank's control pipe and only queues what it relays: however slow the link
to the driver (the log outbox holding the stream with a batch), the pipe is always read, so ``log_metrics``,
``report_checkpoint`` and ``log_to_driver`` never wait on the driver. Checkpoints are never dropped; metrics
past :data:`MAX_QUEUED_METRICS` waiting are (the driver keeps a bounded history of them anyway), and counted.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable

from ..shared.messages import Checkpoint, Message, Metrics, send
from ..shared.naming import HOROVOD_RUNNER
from ..shared.wire import FrameStream

MAX_QUEUED_METRICS = 10_000


class ReportSender:
    """Sends queued progress messages in order on ``stream`` (thread ``hvd-agent-reports``, ended by :meth:`close`).

    An unexpected error in the thread goes to ``on_failure`` (the agent ends the rank and reports it), and what
    is queued after it is dropped.
    """

    def __init__(self, stream: FrameStream, rank: int, runner: str = HOROVOD_RUNNER.runner) -> None:
        self._stream = stream
        self._runner = runner  # as its message names it
        self._rank = rank
        self.on_failure: Callable[[Exception], None] | None = None
        self._failed = False
        self._cond = threading.Condition()
        self._queue: collections.deque[Message] = collections.deque()
        self._metrics = 0  # metrics among the queued
        self.metrics_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._send_all, name="hvd-agent-reports", daemon=True)
        self._thread.start()

    def put(self, message: Metrics | Checkpoint) -> None:
        """Queue ``message``; never blocks."""
        with self._cond:
            if self._failed:
                return
            if isinstance(message, Metrics):
                if self._metrics >= MAX_QUEUED_METRICS:
                    self.metrics_dropped += 1
                    if self.metrics_dropped == 1:
                        sys.stderr.write(
                            f"{self._runner} agent of rank {self._rank}: the link to the driver is too slow for the "
                            f"metrics; those past {MAX_QUEUED_METRICS} waiting are dropped\n"
                        )
                    return
                self._metrics += 1
            self._queue.append(message)
            self._cond.notify()

    def _send_all(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed, and all sent
                message = self._queue.popleft()
                self._metrics -= isinstance(message, Metrics)
            try:
                send(self._stream, message)
            except OSError:
                return  # the driver is gone; the agent's watcher ends the rank
            except Exception as exc:  # noqa: BLE001 - a bug: the rank must not train on with its reports lost
                with self._cond:
                    self._failed = True
                    self._queue.clear()
                if self.on_failure is not None:
                    self.on_failure(exc)
                return

    def close(self) -> None:
        """Send what is queued (before the agent's report), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
