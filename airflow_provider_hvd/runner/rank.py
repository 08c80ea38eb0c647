"""Rank-process entry point: ``python -m airflow_provider_hvd.runner.rank``.

Started by an agent with the Horovod environment set, the pickled job on stdin and the control pipe's
descriptor in ``HVD_RUNNER_CONTROL_FD``. Runs ``main(*args, **kwargs)``; rank 0 sends back its return
value, a failing rank its traceback. Its stdout and stderr go to the agent, which relays them.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

import cloudpickle

from .control import AGENT_PID_ENV, CONTROL_FD_ENV, write_all
from .payload import check_fits_frame
from .wire import FrameStream, Kind

_PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """Have the kernel kill this process when its agent dies, so that no rank outlives its run."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ.get(AGENT_PID_ENV, os.getppid())):
        os._exit(70)  # the agent died before prctl took effect


def _error_report(exc: BaseException) -> bytes:
    return json.dumps(
        {
            "type": type(exc).__qualname__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
        }
    ).encode()


def _pickle_result(value: object) -> bytes:
    try:
        data = cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"rank 0's return value, a {type(value).__qualname__}, cannot be pickled to travel to the driver "
            f"({exc}); return plain data, or save the object and return its path"
        ) from exc
    check_fits_frame(len(data), "rank 0's return value", "save it where the driver can read it and return its path")
    return data


def main() -> int:
    _die_with_agent()
    payload = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if CONTROL_FD_ENV not in os.environ:
        print("airflow_provider_hvd.runner.rank is started by HorovodRunner, not by hand", file=sys.stderr)
        return 2
    control_fd = int(os.environ[CONTROL_FD_ENV])
    control = FrameStream(reader=None, write=lambda data: write_all(control_fd, data))  # type: ignore[arg-type]
    rank = int(os.environ["HOROVOD_RANK"])
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        del payload
        value = fn(*args, **kwargs)
        result = _pickle_result(value) if rank == 0 else b""
    except SystemExit as exc:
        if exc.code in (None, 0):
            result = _pickle_result(None) if rank == 0 else b""
        else:
            control.send(Kind.ERROR, _error_report(exc))
            return 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        control.send(Kind.ERROR, _error_report(exc))
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    control.send(Kind.RESULT, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
