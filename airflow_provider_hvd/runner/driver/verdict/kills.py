"""Why a rank was killed by a signal, in words (runs in the driver).

The agent says which signal and, for SIGKILL, what its host showed (:mod:`...agent.kill_evidence`); the
driver adds the memory settings of the Spark application (``memory_settings``). :func:`describe_kill`
turns that into the likely cause and the evidence for it.
"""

from __future__ import annotations

from typing import Any

from ...shared.naming import HOROVOD_RUNNER

_ELSEWHERE = "the cluster manager enforcing a limit, e.g. YARN's memory check or Kubernetes' eviction, or a person"
_CRASHES = {"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"}
_ADVICE = (
    "The ranks are Python processes beside the executor's JVM: on YARN and Kubernetes their memory counts "
    "against spark.executor.memoryOverhead, not spark.executor.memory (the JVM heap). Raise the overhead (or the "
    "container's limit), run fewer tasks per executor, or make each rank use less memory (a smaller batch)."
)


def size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _limits(evidence: dict[str, Any]) -> str:
    parts = []
    if evidence.get("memory_limit") is not None:
        parts.append(
            f"the memory cgroup's limit {size(evidence['memory_limit'])} (set on {evidence['limit_cgroup']}"
            + (f"; its peak use {size(evidence['memory_peak'])}" if evidence.get("memory_peak") is not None else "")
            + ")"
        )
    elif evidence.get("cgroup") is not None:
        parts.append(f"no memory limit on its cgroup {evidence['cgroup']} or its parents")
    if evidence.get("address_space_limit") is not None:
        parts.append(f"an address-space limit (RLIMIT_AS) of {size(evidence['address_space_limit'])}")
    parts += [f"{key}={value}" for key, value in (evidence.get("memory_settings") or {}).items()]
    return "; ".join(parts) if parts else "none could be read"


def _oom_seen(evidence: dict[str, Any]) -> list[str]:
    """What the host showed of an OOM kill while the rank ran (nothing: no sign of one)."""
    cgroup_kills, host_kills = evidence.get("cgroup_oom_kills"), evidence.get("host_oom_kills")
    kernel = evidence.get("kernel_log") or []
    seen = []
    if cgroup_kills:
        seen.append(f"its memory cgroup {evidence['cgroup']} counted {cgroup_kills} OOM kill(s) while it ran")
    elif host_kills and cgroup_kills is None:  # the host's count is evidence only where the cgroup's is unknown
        seen.append(f"the host counted {host_kills} OOM kill(s) while it ran (its memory cgroup's count is unknown)")
    if kernel:
        seen.append("the kernel log says: " + " | ".join(kernel))
    return seen


def killed_for_memory(evidence: dict[str, Any] | None) -> bool:
    """Whether a rank killed by SIGKILL was, by what its host showed, killed by the kernel's OOM killer."""
    if not evidence or evidence.get("signal") != "SIGKILL":
        return False
    return bool(_oom_seen(evidence))


def describe_kill(evidence: dict[str, Any], runner: str = HOROVOD_RUNNER.runner) -> str:
    """The likely cause of a rank's death by a signal, with the evidence (one paragraph)."""
    name = evidence.get("signal", "a signal")
    if name in _CRASHES:
        return f"Likely cause: a crash in native code ({name}); its Python stack, if it printed one, is in its output."
    if name == "SIGABRT":
        return "Likely cause: native code aborted (a failed check or an uncaught C++ exception); see its output."
    if name != "SIGKILL":
        return f"{name} came from outside {runner} (the cluster manager, the container's stop, or a person)."
    cgroup_kills, host_kills = evidence.get("cgroup_oom_kills"), evidence.get("host_oom_kills")
    seen = _oom_seen(evidence)
    if seen:
        text = "Likely cause: the kernel's OOM killer ended it for memory: " + "; ".join(seen) + "."
    else:
        counted = []
        if cgroup_kills == 0:
            counted.append(f"its memory cgroup {evidence['cgroup']}")
        if host_kills == 0:
            counted.append("the host")
        elsewhere = _ELSEWHERE
        if cgroup_kills == 0 and host_kills:
            # the cgroup counts every OOM kill of its processes, the host's own and the cgroup limit's alike
            text = (
                f"No OOM kill was counted while it ran by its memory cgroup {evidence['cgroup']}, which counts "
                f"every OOM kill of its processes; the host counted {host_kills}, of processes outside it: SIGKILL "
                f"came from elsewhere ({elsewhere})."
            )
        elif counted:
            by = " or ".join(counted)
            text = f"No OOM kill was counted while it ran (by {by}): SIGKILL came from elsewhere ({elsewhere})."
        else:
            text = (
                "Its host's OOM kill counters could not be read: SIGKILL came from the kernel's OOM killer (the most "
                f"common cause) or from elsewhere ({elsewhere})."
            )
        if evidence.get("kernel_log_unreadable"):
            text += f" The kernel log could not be read ({evidence['kernel_log_unreadable']})."
    text += f" Memory limits in force: {_limits(evidence)}."
    if seen:
        text += " " + _ADVICE
    return text
