"""A client's end of the link to a submitted run's host: the ranks' lines relayed to this process's loggers (as
``run()`` relays them; on stderr where the application set up no logging) and acknowledged once shown; the run's
status and progress; its outcome, acknowledged once the caller holds it (:meth:`LinkClient.acknowledge`).

Two threads per link: ``hvd-job-link`` reads the host's frames, ``hvd-job-heartbeat`` sends a heartbeat every
interval, both until the link is closed or lost (after the outcome too: the host keeps it for this client until
it acknowledged it). The link is lost when the host says nothing for the heartbeat timeout, or its connection ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..driver.watch.channel import log_rank_lines, rank_log, rank_logs_visible
from ..shared.liveness import Liveness
from ..shared.messages import Message
from ..shared.wire import FrameStream, Pieces
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
        self._first_status = threading.Event()
        self.outcome: link.Outcome | None = None  # set once it came whole (with rank 0's value, for a fetching one)
        self.result: bytes | None = None
        self.lost: str | None = None  # why the link ended before the outcome came
        self.ended = threading.Event()  # the outcome came, or the link was lost
        self._closing = threading.Event()
        self._sock: socket.socket | None = None
        self._stream: FrameStream | None = None

    def connect(self) -> None:
        """Attach, and return once the host said the run's status (or the link ended first)."""
        self._sock, self._stream = link.connect_link(self.address)
        link.send(self._stream, link.Attach(self._logs, self.next_line, self._fetch))
        self._sock.settimeout(self._liveness.timeout_s)
        # in the attaching thread's context: its log context (Airflow's triggerer routes a trigger's lines by it)
        reader = contextvars.copy_context().run
        threading.Thread(target=reader, args=(self._read,), name="hvd-job-link", daemon=True).start()
        beater = contextvars.copy_context().run
        threading.Thread(target=beater, args=(self._beat,), name="hvd-job-heartbeat", daemon=True).start()
        self._first_status.wait(self._liveness.timeout_s)  # (the host sends it first)

    def send(self, message: Message) -> None:
        assert self._stream is not None
        link.send(self._stream, message)

    def _beat(self) -> None:
        while not self._closing.wait(self._liveness.interval_s):
            try:
                self.send(link.Alive())
            except OSError:
                return

    def _read(self) -> None:
        # the ranks' lines shown on stderr while attached, where the application set up no logging: a line is
        # acknowledged once shown (or handed to a handler), never only relayed into a logger that drops it
        with rank_logs_visible() if self._logs else contextlib.nullcontext():
            self._read_frames()

    def _read_frames(self) -> None:
        assert self._stream is not None
        try:
            while True:
                message = link.receive(self._stream)
                if isinstance(message, link.Lines):
                    self._relay(message)
                elif isinstance(message, link.Status):
                    self.status = message
                    self._first_status.set()
                elif isinstance(message, link.Progress):
                    self._progress(message)
                elif isinstance(message, link.Outcome) and self.outcome is None:
                    if message.error is None and self._fetch:
                        value = link.receive(self._stream)  # (LINK_RESULT: rank 0's pickled value)
                        if not isinstance(value, link.LinkResult):
                            raise ValueError(f"the run's host sent {type(value).__name__} where its value belongs")
                        data = value.data
                        self.result = data.read() if isinstance(data, Pieces) else bytes(data)
                    self.outcome = message  # (whole: a link lost before the value came is re-attached)
                    self.ended.set()
        except TimeoutError:
            self._lose(
                f"nothing was heard from the run's host at {self.address.host}:{self.address.port} for "
                f"{self._liveness.timeout_s:g}s (heartbeat timeout): it is gone, or the network to it is cut"
            )
        except (OSError, EOFError, ValueError) as exc:
            self._lose(f"the link to the run's host at {self.address.host}:{self.address.port} ended ({exc})")
        finally:
            self._lose("the link to the run's host ended")
            self._close_socket()

    def _lose(self, why: str) -> None:
        """The link ended: lost, unless the outcome came or this client closed it."""
        if not self._closing.is_set() and self.outcome is None and self.lost is None:
            self.lost = why
        self._first_status.set()
        self.ended.set()

    def acknowledge(self) -> None:
        """Tell the host that this process holds the outcome (rank 0's value unpickled, or the run's error): it
        keeps it until a fetching client said so (and every attached one has it), or for ``outcome_timeout``."""
        try:
            self.send(link.Fetched())
        except (OSError, ValueError):  # the link ended: the host keeps the outcome for its outcome_timeout
            log.debug("could not tell the run's host that its outcome was fetched: the link has ended")

    def _relay(self, lines: link.Lines) -> None:
        if lines.lost:
            rank_log.warning(
                "%d lines of the run's output were lost here: the run's host keeps the last lines only, and no "
                "client relayed these while it did",
                lines.lost,
            )
        line = lines.first
        for entry in lines.entries:
            if entry[0] == "rank":  # (a later attempt's: its number after the lines)
                log_rank_lines(entry[1], entry[2], entry[3] if len(entry) > 3 else 1)
                line += len(entry[2])
            else:
                logging.getLogger(entry[1]).log(entry[2], "%s", entry[3])
                line += 1
        self.next_line = line
        self.send(link.Ack(line))

    def _progress(self, message: link.Progress) -> None:
        if message.what == link.MLFLOW_RUN:
            if self._on_mlflow_run is not None and isinstance(message.value, dict):
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
