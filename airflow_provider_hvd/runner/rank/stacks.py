"""The rank process's side of stack dumps (runs in the rank process).

On :data:`STACKS_SIGNAL`, faulthandler writes the Python stack of every thread to the file its agent named
in ``HVD_RUNNER_STACKS_FILE``; it does so from the signal handler itself, so it answers also while ``main``
is stuck in native code that never returns to Python (a Horovod collective waiting for a peer). A crash
(SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) prints the stacks to the rank's stderr, which is in its output
tail. The agent learns the rank's pid and the signal from :class:`~..shared.messages.RankReady`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import IO

from ..shared.messages import RankReady
from .control import control_pipe

STACKS_FILE_ENV = "HVD_RUNNER_STACKS_FILE"
STACKS_SIGNAL = signal.SIGUSR2  # SIGUSR1 is the one frameworks tend to take (e.g. for requeueing on SLURM)

_stacks_file: IO[str] | None = None  # kept open for the life of the process: faulthandler writes to its fd


def arm_stack_dumps() -> None:
    """Make this process write its stacks on :data:`STACKS_SIGNAL`, and on a crash; tell the agent."""
    global _stacks_file
    faulthandler.enable(file=sys.stderr, all_threads=True)
    path = os.environ.get(STACKS_FILE_ENV)
    armed = 0
    if path:
        _stacks_file = open(path, "a")  # noqa: SIM115 - must stay open
        faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
        armed = int(STACKS_SIGNAL)
    pipe = control_pipe()
    if pipe is not None:
        pipe.send(RankReady(os.getpid(), armed))
