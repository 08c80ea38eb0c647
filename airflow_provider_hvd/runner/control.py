"""What passes between a rank process and its agent, and :func:`log_to_driver` on top of it.

A rank's stdout and stderr are one pipe, read line by line by the agent. ``log_to_driver`` writes its
message into that same stream as one marked line (so it keeps its place among the rank's other lines);
the marker carries a per-run token, which plain output cannot guess. The result or the error goes back
on a separate control pipe.
"""

from __future__ import annotations

import json
import logging
import os
import sys

CONTROL_FD_ENV = "HVD_RUNNER_CONTROL_FD"
AGENT_PID_ENV = "HVD_RUNNER_AGENT_PID"
LOG_TOKEN_ENV = "HVD_RUNNER_LOG_TOKEN"
MAX_MESSAGE_CHARS = 4000

_log = logging.getLogger("airflow_provider_hvd.horovod")


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


def log_to_driver(message: str) -> None:
    """Send ``message`` to the driver's log, whatever ``driver_log_verbosity`` is.

    Messages longer than 4000 characters are truncated, with a marker saying so. Outside a running
    HorovodRunner job the message is logged locally (logger ``airflow_provider_hvd.horovod``).
    """
    if not isinstance(message, str):
        raise TypeError(f"log_to_driver() takes a str, not {type(message).__name__}; format it first, e.g. str(x)")
    message = truncate(message)
    token = os.environ.get(LOG_TOKEN_ENV)
    if token is None:
        _log.info("%s", message)
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()  # what the rank printed before comes before
    write_all(1, message_marker(token) + json.dumps(message).encode() + b"\n")
