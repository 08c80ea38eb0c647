"""Rank-process entry point: ``python -m airflow_provider_hvd.runner.rank``.

Started by the agent's reaper (:mod:`.reaper`) with the Horovod environment set, the pickled job on stdin
and the control pipe's descriptor in ``HVD_RUNNER_CONTROL_FD``. Runs ``main(*args, **kwargs)``; rank 0
sends back its return value, a failing rank its traceback. Its stdout and stderr go to the agent, which
relays them. Once it has reported, it exits: threads ``main`` left running do not hold the run.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

import cloudpickle

from ..reaper import PARENT_PID_ENV, die_with_parent
from ..shared.messages import RankError, RemoteError, Result
from ..shared.payload import check_fits_frame
from .control import CONTROL_FD_ENV, RANK_ENV, RANK_PID_ENV, control_pipe
from .stacks import arm_stack_dumps


def _pickle_result(value: object) -> bytes:
    try:
        data: bytes = cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"rank 0's return value, a {type(value).__qualname__}, cannot be pickled to travel to the driver "
            f"({exc}); return plain data, or save the object and return its path"
        ) from exc
    check_fits_frame(len(data), "rank 0's return value", "save it where the driver can read it and return its path")
    return data


def _run(rank: int) -> int:
    pipe = control_pipe()
    assert pipe is not None
    try:
        fn, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        try:
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None
        result = _pickle_result(value) if rank == 0 else b""
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        pipe.send(RankError(RemoteError.of(exc)))
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    pipe.send(Result(result))
    return 0


def main() -> int:
    if CONTROL_FD_ENV not in os.environ:
        started_by = "HorovodRunner or TorchDistributor"
        print(f"airflow_provider_hvd.runner.rank is started by {started_by}, not by hand", file=sys.stderr)
        return 2
    die_with_parent(int(os.environ.get(PARENT_PID_ENV, os.getppid())), signal.SIGKILL)  # no rank outlives its run
    os.environ[RANK_PID_ENV] = str(os.getpid())  # log_to_driver works in this process, not in its children
    arm_stack_dumps()  # before the job is loaded: a stall while unpickling it shows too
    code = _run(int(os.environ[RANK_ENV]))
    atexit._run_exitfuncs()  # e.g. Horovod's shutdown; then exit without waiting for threads main left
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
