"""What the rank's host can tell about a rank killed by a signal (runs in the agent, beside the rank).

For SIGKILL, the usual culprit is the kernel's OOM killer, for the container's memory cgroup (a YARN or
Kubernetes container, a Spark worker's) or for the whole host. The agent reads, before the rank starts and
after it ended: the OOM kill counter of its memory cgroup (cgroup v2 ``memory.events``, v1
``memory.oom_control``: the agent, its rank and the executor share the container's cgroup) and the host's
(``/proc/vmstat``); after: the cgroup's memory limit (the smallest of it and its parents) and peak, the
kernel log's lines since the rank started that name its pid (``/dev/kmsg``, when readable), and the
address-space limit the rank inherited (``spark.executor.pyspark.memory`` sets one). The driver adds the
Spark settings and says what it makes of it all (:mod:`..driver.verdict.kills`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_UNLIMITED_V1 = 1 << 62  # cgroup v1 reports "no limit" as a huge page-rounded number
_KMSG_RECORD_BYTES = 8192


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup as this process sees it: its name in the hierarchy and its directory."""

    version: int
    name: str
    path: Path
    mount: Path

    def _read(self, file: str, at: Path | None = None) -> str | None:
        try:
            return ((at or self.path) / file).read_text()
        except OSError:
            return None

    def oom_kills(self) -> int | None:
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def limit(self) -> tuple[int, str] | None:
        """The smallest memory limit of this cgroup and its parents (bytes), and the cgroup that sets it."""
        found: tuple[int, str] | None = None
        at, name = self.path, self.name
        while True:
            text = self._read("memory.max" if self.version == 2 else "memory.limit_in_bytes", at)
            value = (text or "").strip()
            if value.isdigit() and int(value) < _UNLIMITED_V1 and (found is None or int(value) < found[0]):
                found = (int(value), name)
            if at == self.mount or at.parent == at:
                return found
            at, name = at.parent, str(Path(name).parent)

    def peak(self) -> int | None:
        text = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        value = (text or "").strip()
        return int(value) if value.isdigit() else None


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of this process's cgroup mounts."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], fstype, options))
    return found


def memory_cgroup(pid: int | str = "self") -> MemoryCgroup | None:
    """The memory cgroup of ``pid``: cgroup v2 where it has the memory controller, else v1's memory hierarchy."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    for version in (2, 1):
        for line in lines:
            _, controllers, name = line.split(":", 2)
            if (version == 2 and controllers) or (version == 1 and "memory" not in controllers.split(",")):
                continue
            for root, point, fstype, options in mounts:
                if fstype != ("cgroup2" if version == 2 else "cgroup"):
                    continue
                if version == 1 and "memory" not in options.split(","):
                    continue
                relative = name[len(root) :] if root != "/" and name.startswith(root) else name
                path = Path(point) / relative.lstrip("/")
                if (path / ("memory.events" if version == 2 else "memory.oom_control")).exists():
                    return MemoryCgroup(version, name, path, Path(point))
    return None


def host_oom_kills() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def open_kernel_log() -> tuple[int | None, str | None]:
    """``/dev/kmsg`` opened at its end (what the kernel logs from now on), or why it cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return None, f"/dev/kmsg: {exc.strerror}"
    os.lseek(fd, 0, os.SEEK_END)
    return fd, None


def kernel_log_about(fd: int, pid: int) -> list[str]:
    """The kernel log's new lines that name process ``pid`` (an OOM kill's ``pid=<pid>,``, ``Killed process <pid>``)."""
    marks = (f"pid={pid},", f"process {pid} (")
    lines: list[str] = []
    while True:
        try:
            record = os.read(fd, _KMSG_RECORD_BYTES)
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # records were overwritten before they were read: go on with the next
                continue
            break
        text = record.decode("utf-8", "replace").split(";", 1)[-1].split("\n", 1)[0]
        if any(mark in text for mark in marks):
            lines.append(text.strip())
    killed = [line for line in lines if "Killed process" in line]  # the readable one of an OOM kill's lines
    return (killed or lines)[-3:]


class MemoryWatch:
    """Taken before the rank starts; :meth:`evidence` after it ended."""

    def __init__(self) -> None:
        self.cgroup = memory_cgroup()
        self._cgroup_kills = self.cgroup.oom_kills() if self.cgroup else None
        self._host_kills = host_oom_kills()
        self._kmsg, self._kmsg_unreadable = open_kernel_log()

    def close(self) -> None:
        if self._kmsg is not None:
            os.close(self._kmsg)
            self._kmsg = None

    def evidence(self, exit_code: int, rank_pid: int | None) -> dict[str, Any]:
        """What was seen about a rank that ``exit_code`` (< 0) says a signal ended; JSON for the driver."""
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        found: dict[str, Any] = {"signal": name}
        if exit_code != -signal.SIGKILL:
            return found
        cgroup = self.cgroup
        if cgroup is not None:
            after = cgroup.oom_kills()
            limit = cgroup.limit()
            found.update(
                cgroup=cgroup.name,
                cgroup_version=cgroup.version,
                memory_peak=cgroup.peak(),
                cgroup_oom_kills=None if after is None or self._cgroup_kills is None else after - self._cgroup_kills,
                memory_limit=limit[0] if limit else None,
                limit_cgroup=limit[1] if limit else None,
            )
        after_host = host_oom_kills()
        if after_host is not None and self._host_kills is not None:
            found["host_oom_kills"] = after_host - self._host_kills
        if self._kmsg_unreadable:
            found["kernel_log_unreadable"] = self._kmsg_unreadable
        elif rank_pid is not None and self._kmsg is not None:
            found["rank_pid"] = rank_pid
            found["kernel_log"] = kernel_log_about(self._kmsg, rank_pid)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            found["address_space_limit"] = soft
        return found
