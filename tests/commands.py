"""A command-line tool run as its user runs it: its output read as it comes, and what of it is still running."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading

import psutil


class Output:
    """``proc``'s output (stdout, text), read line by line in a thread as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._ended = False
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                with self._new:
                    self.lines.append(line)
                    self._new.notify_all()
        finally:
            with self._new:
                self._ended = True
                self._new.notify_all()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output, once it is there; AssertionError with the output if not."""
        with self._new:
            self._new.wait_for(lambda: pattern.search(self.text) or self._ended, timeout)
        match = pattern.search(self.text)
        assert match, f"no {pattern.pattern!r} in its output:\n{self.text}"
        return match

    def close(self) -> None:
        self._reader.join(10)


def family(pid: int) -> list[psutil.Process]:
    """The process and every process it started (some in process groups or sessions of their own)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def still_running(processes: list[psutil.Process]) -> list[str]:
    """Those of ``processes`` that still run (not zombies), with their command lines."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return running


def kill_tagged(tag: str) -> list[str]:
    """Kill the processes whose command line has the argument ``tag``; their command lines (none: nothing was left)."""
    found = [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
    for process in found:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return [" ".join(p.info["cmdline"])[:120] for p in found]
