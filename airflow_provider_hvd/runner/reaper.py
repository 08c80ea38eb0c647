"""Sits between an agent and its rank process, so that nothing the rank starts outlives the run.

Run as a script (standard library only, so that it starts in milliseconds):
``python -I -S reaper.py AGENT_PID RANK_COMMAND...``. It is a child subreaper: processes that the rank
starts and leaves behind are re-parented to it, wherever they moved in the process tree. It dies with its
agent (parent-death signal), however the agent dies, and then ends everything below it; the rank dies with
it in turn. It ends everything below it when the rank exits too (SIGTERM, then SIGKILL after a grace),
and on SIGTERM from the agent. Then it removes the rank's folder (its files: its stacks, a script's copy),
which the agent made and removes too once the reaper ended: whichever of them outlives the other. It exits the
way the rank did (code, or signal), which is what the agent sees.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

PARENT_PID_ENV = "HVD_RUNNER_PARENT_PID"  # the reaper's pid, for the rank's parent-death check
CONTROL_FD_ENV = "HVD_RUNNER_CONTROL_FD"  # the rank's control pipe (see control.py), passed through
RANK_DIR_ENV = "HVD_RUNNER_RANK_DIR"  # the rank's own files, removed once nothing below the reaper is left
TERMINATE_GRACE_S = 5.0  # the rank's time to end after SIGTERM
LEFTOVER_GRACE_S = 1.0  # what the rank left running, after it exited
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _Terminate(Exception):
    pass


# While the rank starts, a SIGTERM is held until its pid is known: raised inside Popen (which waits for the rank's
# exec), it would end the reaper with the rank already forked and nobody to end it.
_sigterm = {"held": False, "came": False}


def _on_sigterm(signum: int, frame: object) -> None:
    if _sigterm["held"]:  # (the handler stays: an ignored SIGTERM would be the forked rank's too)
        _sigterm["came"] = True
        return
    _terminate_once()


def _terminate_once() -> None:
    # Once: a dying agent sends several (the parent-death signal comes each time the kernel hands the reaper to
    # another of the agent's threads as they exit). A second one raised while the first is handled (a later
    # signal.signal() runs pending handlers first) would end the reaper before it ended what is below it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminate


def _release_sigterm() -> None:
    """The rank's pid is known: a SIGTERM held meanwhile acts now, and any later one at once."""
    _sigterm["held"] = False
    if _sigterm["came"]:
        _terminate_once()


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap() -> None:
    """Collect exited children (the subreaper's duty), without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_everything_below(grace_s: float) -> None:
    me = os.getpid()
    _signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not descendants(me):
            return
        time.sleep(0.05)
    for _ in range(10):  # a process may still fork while it is being killed
        left = descendants(me)
        if not left:
            return
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.02)
        _reap()


def die_with_parent(parent_pid: int, sig: int, before_exit: Callable[[], None] = lambda: None) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies; exit now if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        before_exit()
        os._exit(70)  # the parent died before prctl took effect


def remove_rank_files() -> None:
    """Remove the rank's folder (its agent named it), once the rank and everything below it are gone."""
    folder = os.environ.get(RANK_DIR_ENV)
    if folder:
        import shutil  # (here: the reaper starts in milliseconds)

        shutil.rmtree(folder, ignore_errors=True)


def _exit_as(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: die of the same one
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset: OSError)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _terminate(rank: int) -> tuple[int, float]:
    """SIGTERM the rank and everything below; SIGKILL the rank after the grace. Its status, the grace left."""
    _signal_all([rank, *descendants(os.getpid())], signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    while time.monotonic() < deadline:
        pid, status = os.waitpid(rank, os.WNOHANG)
        if pid:
            return status, deadline - time.monotonic()
        time.sleep(0.02)
    _signal_all([rank], signal.SIGKILL)
    return os.waitpid(rank, 0)[1], 0.0


def main(argv: list[str]) -> None:
    agent_pid, command = int(argv[0]), argv[1:]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    die_with_parent(agent_pid, signal.SIGTERM, remove_rank_files)
    control_fd = int(os.environ[CONTROL_FD_ENV])
    rank = None
    try:
        _sigterm["held"] = True
        rank = subprocess.Popen(
            command,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
            pass_fds=(control_fd,),
            start_new_session=True,  # its own process group: the agent's terminal signals do not reach it
        )
        _release_sigterm()
        # keep none of the rank's pipes open: the agent sees their end once the rank and its children are gone
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        os.close(control_fd)
        os.waitid(os.P_PID, rank.pid, os.WEXITED | os.WNOWAIT)  # left uncollected: a SIGTERM now still finds it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        status = os.waitpid(rank.pid, 0)[1]
        grace = LEFTOVER_GRACE_S
    except _Terminate:
        if rank is None:
            remove_rank_files()
            os._exit(128 + signal.SIGTERM)
        status, grace = _terminate(rank.pid)
    _end_everything_below(grace)
    remove_rank_files()
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
