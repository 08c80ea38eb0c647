"""What passes between a rank process and its agent, and :func:`log_to_driver` on top of it.

A rank's stdout and stderr are one pipe, which the agent reads (:mod:`.relay`). The control pipe, whose
descriptor is in ``HVD_RUNNER_CONTROL_FD``, carries frames: the result or the error, and each
``log_to_driver`` message. So that a message keeps its place among the rank's other lines, a short marker
line with the message's sequence number goes into the output pipe right after it; the marker carries a
per-run token, which plain output cannot guess.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading

from ..reaper import CONTROL_FD_ENV as CONTROL_FD_ENV  # (the reaper, standard library only, imports nothing here)
from ..shared.messages import DriverMessage, Message, send
from ..shared.wire import FrameStream

LOG_TOKEN_ENV = "HVD_RUNNER_LOG_TOKEN"
RANK_PID_ENV = "HVD_RUNNER_RANK_PID"
RANK_ENV = "HVD_RUNNER_RANK"  # the rank, whatever its kind (Horovod's or torch.distributed's)
MAX_MESSAGE_CHARS = 4000


def message_marker(token: str) -> bytes:
    return f"\x1ehvd-log:{token}:".encode()


def truncate(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... [truncated: {len(message)} characters, {MAX_MESSAGE_CHARS} kept]"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _ControlPipe:
    """The rank process's end of the control pipe; frames from several threads never interleave."""

    def __init__(self, fd: int) -> None:
        self._stream = FrameStream(reader=None, write=lambda data: write_all(fd, data))  # type: ignore[arg-type]
        self._seq = itertools.count()
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        with self.lock:
            send(self._stream, message)

    def log(self, marker: bytes, text: str) -> None:
        with self.lock:
            seq = next(self._seq)
            send(self._stream, DriverMessage(seq, text))
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()  # what the rank printed before comes before
            write_all(1, marker + b"%d\n" % seq)


_pipe: _ControlPipe | None = None


def control_pipe() -> _ControlPipe | None:
    """This rank process's control pipe; None outside a job, and in processes the rank started."""
    global _pipe
    if os.environ.get(RANK_PID_ENV) != str(os.getpid()):  # a forked child would garble the parent's frames
        return None
    if _pipe is None:
        _pipe = _ControlPipe(int(os.environ[CONTROL_FD_ENV]))
    return _pipe


def log_to_driver(message: str) -> None:
    """Send ``message`` to the driver's log, whatever ``driver_log_verbosity`` is.

    Messages longer than 4000 characters are truncated, with a marker saying so. Outside a running
    HorovodRunner job (and in processes that a rank started) the message is printed, as sparkdl does.
    """
    if not isinstance(message, str):
        raise TypeError(f"log_to_driver() takes a str, not {type(message).__name__}; format it first, e.g. str(x)")
    message = truncate(message)
    pipe = control_pipe()
    token = os.environ.get(LOG_TOKEN_ENV)
    if pipe is None or token is None:
        print(message, flush=True)
        return
    pipe.log(message_marker(token), message)
