"""A client's end of the link to a submitted run's host: the ranks' lines relayed to this process's loggers (as
``run()`` relays them), acknowledged as they are; the run's status and progress; its outcome.

Two threads per link: ``hvd-job-link`` reads the host's frames, ``hvd-job-heartbeat`` sends a heartbeat every
interval. The link is lost when the host says nothing for the heartbeat timeout, or its connection ends.
"""

from __future__ import annotations

import contextvars
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..driver.watch.channel import log_rank_lines, rank_log
from ..shared.liveness import Liveness
from ..shared.messages import Message
from ..shared.wire import FrameStream
from . import link

if TYPE_CHECKING:
    from ..settings import ProgressSink

log = logging.getLogger("airflow_provider_hvd.runner")


class LinkClient:
    def __init__(
        self,
        address: link.LinkAddress,
        liveness: Liveness,
        logs: bool = True,
        progress_sink: ProgressSink | None = None,
        after: int | None = None,
        fetch: bool = True,
        on_mlflow_run: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self.address = address
        self._liveness = liveness
        self._logs = logs
        self._sink = progress_sink
        self._fetch = fetch  # False: a watcher, which leaves the outcome on the host for a later client
        self._on_mlflow_run = on_mlflow_run
        self.next_line = after  # the next line this client relays (None: where the host says)
        self.status: link.Status | None = None
        self.outcome: link.Outcome | None = None
        self.result: bytes | None = None
        self.lost: str | None = None  # why the link ended before the outcome came
        self.ended = threading.Event()  # the outcome came, or the link was lost
        self.heard = threading.Event()  # the host's first status came (its first frames), or the link ended
        self._closing = threading.Event()
        self._sock: socket.socket | None = None
        self._stream: FrameStream | None = None

    def connect(self) -> None:
        self._sock, self._stream = link.connect_link(self.address)
        link.send(self._stream, link.Attach(self._logs, self.next_line))
        self._sock.settimeout(self._liveness.timeout_s)
        # in the attaching thread's context: its log context (Airflow's triggerer routes a trigger's lines by it)
        reader = contextvars.copy_context().run
        threading.Thread(target=reader, args=(self._read,), name="hvd-job-link", daemon=True).start()
        beater = contextvars.copy_context().run
        threading.Thread(target=beater, args=(self._beat,), name="hvd-job-heartbeat", daemon=True).start()

    def send(self, message: Message) -> None:
        assert self._stream is not None
        link.send(self._stream, message)

    def _beat(self) -> None:
        while not self._closing.wait(self._liveness.interval_s) and not self.ended.is_set():
            try:
                self.send(link.Alive())
            except OSError:
                return

    def _read(self) -> None:
        assert self._stream is not None
        try:
            while True:
                message = link.receive(self._stream)
                if isinstance(message, link.Lines):
                    self._relay(message)
                elif isinstance(message, link.Status):
                    self.status = message
                    self.heard.set()
                elif isinstance(message, link.Progress):
                    self._progress(message)
                elif isinstance(message, link.Outcome):
                    self.outcome = message
                    if message.error is None:
                        self.result = bytes(self._stream.recv()[1])  # (LINK_RESULT: rank 0's pickled value)
                    if self._fetch:
                        self.send(link.Fetched())
                    self.ended.set()
                    return
        except TimeoutError:
            self.lost = (
                f"nothing was heard from the run's host at {self.address.host}:{self.address.port} for "
                f"{self._liveness.timeout_s:g}s (heartbeat timeout): it is gone, or the network to it is cut"
            )
        except (OSError, EOFError, ValueError) as exc:
            self.lost = f"the link to the run's host at {self.address.host}:{self.address.port} ended ({exc})"
        finally:
            if not self._closing.is_set() and self.outcome is None and self.lost is None:
                self.lost = "the link to the run's host ended"
            self.ended.set()
            self.heard.set()
            self._close_socket()

    def _relay(self, lines: link.Lines) -> None:
        if lines.lost:
            rank_log.warning(
                "%d lines of the run's output were lost here: the run's host keeps the last lines only, and no "
                "client relayed these while it did",
                lines.lost,
            )
        line = lines.first
        for entry in lines.entries:
            if entry[0] == "rank":
                log_rank_lines(entry[1], entry[2])
                line += len(entry[2])
            else:
                logging.getLogger(entry[1]).log(entry[2], "%s", entry[3])
                line += 1
        self.next_line = line
        self.send(link.Ack(line))

    def _progress(self, message: link.Progress) -> None:
        if message.what == link.MLFLOW_RUN:
            if self._on_mlflow_run is not None:
                try:
                    self._on_mlflow_run(str(message.value["run_id"]), message.value.get("url"))
                except Exception:  # noqa: BLE001 - the caller's hook is not the run's
                    log.exception("taking the run's MLflow run failed")
            return
        if self._sink is None:
            return
        try:
            getattr(self._sink, message.what)(message.value)
        except Exception:  # noqa: BLE001 - the sink's failure is not the run's
            log.exception("the progress sink failed to take the run's %s", message.what)

    def close(self) -> None:
        """Detach: end the link (the run goes on; its lease starts once no client is attached)."""
        self._closing.set()
        self._close_socket()

    def _close_socket(self) -> None:
        if self._stream is not None:
            self._stream.close()
