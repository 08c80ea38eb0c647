"""Heartbeats on the driver <-> agent channel: how often each side says it is alive, and how long a silence
ends the link (used by the driver, and by the agents, which get the settings in their :class:`AgentArgs`).

A host that vanishes (power loss, a preempted VM, a cut network) sends no FIN and no RST: without heartbeats a
dead peer would be noticed only by Spark's 120 s network timeout or by a surviving rank's Gloo timeout (30 s
by default, ``HOROVOD_GLOO_TIMEOUT_SECONDS``), which would then be reported as the cause. With them, the
driver names the silent host after ``timeout_s``, and the agents on a host cut off from the driver end their
ranks after ``timeout_s`` too.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import JobRefusedError, SettingError
from .naming import HOROVOD_RUNNER
from .timing import GLOO_DEFAULT_TIMEOUT_S, MIN_BEATS_PER_TIMEOUT
from .timing import HEARTBEAT_INTERVAL_S as DEFAULT_INTERVAL_S
from .timing import HEARTBEAT_TIMEOUT_S as DEFAULT_TIMEOUT_S

INTERVAL_CONF = "spark.horovodRunner.heartbeatInterval"
TIMEOUT_CONF = "spark.horovodRunner.heartbeatTimeout"
log = logging.getLogger("airflow_provider_hvd.runner")

GLOO_TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"  # forwarded from the driver's environment to the ranks

_TIME = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|sec|m|min)?\s*", re.IGNORECASE)
_SCALE = {None: 1.0, "s": 1.0, "sec": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0}


@dataclass(frozen=True)
class Liveness:
    """Each side sends a heartbeat every ``interval_s``; a link silent for ``timeout_s`` is dead."""

    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S


def parse_seconds(value: str, setting: str) -> float:
    """A duration as Spark writes one (``10s``, ``500ms``, ``2min``; a bare number is seconds)."""
    match = _TIME.fullmatch(value)
    seconds = float(match.group(1)) * _SCALE[(match.group(2) or "").lower() or None] if match else math.nan
    if not seconds > 0:
        raise JobRefusedError(
            f"{setting}={value!r} is not a duration: give seconds (e.g. 10, 10s or 500ms), more than 0."
        )
    return seconds


def liveness_settings(
    conf: Callable[[str], str | None],
    interval_s: float | None = None,
    timeout_s: float | None = None,
    runner: str = HOROVOD_RUNNER.runner,
) -> Liveness:
    """The run's heartbeat settings: ``interval_s``/``timeout_s`` when given (the ``runner``'s attributes), else
    the Spark conf's ``spark.horovodRunner.heartbeatInterval``/``...heartbeatTimeout``, else the defaults."""
    values = {}
    for name, given, setting, default in (
        ("interval_s", interval_s, INTERVAL_CONF, DEFAULT_INTERVAL_S),
        ("timeout_s", timeout_s, TIMEOUT_CONF, DEFAULT_TIMEOUT_S),
    ):
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int | float) or not given > 0:
                raise SettingError(f"heartbeat_{name} must be a number of seconds > 0, not {given!r}")
            values[name] = float(given)
            continue
        text = conf(setting)
        values[name] = parse_seconds(text, setting) if text is not None and text.strip() else default
    liveness = Liveness(**values)
    if liveness.timeout_s < MIN_BEATS_PER_TIMEOUT * liveness.interval_s:
        raise JobRefusedError(
            f"the heartbeat timeout ({liveness.timeout_s:g}s, {TIMEOUT_CONF} or {runner}.heartbeat_timeout_s) "
            f"must be at least {MIN_BEATS_PER_TIMEOUT} heartbeat intervals ({liveness.interval_s:g}s, {INTERVAL_CONF} "
            f"or {runner}.heartbeat_interval_s): raise the timeout or shorten the interval."
        )
    return liveness


def warn_if_gloo_first(liveness: Liveness, driver_env: Mapping[str, str]) -> None:
    """A heartbeat timeout at or past Gloo's lets a surviving rank's Gloo timeout be reported instead of the host."""
    try:
        gloo = float(driver_env.get(GLOO_TIMEOUT_ENV, GLOO_DEFAULT_TIMEOUT_S))
    except ValueError:
        return
    if liveness.timeout_s >= gloo:
        log.warning(
            "HorovodRunner: the heartbeat timeout (%gs) is not shorter than Gloo's (%gs, %s): a host that vanishes "
            "may be reported as a Gloo timeout on a surviving rank instead of by name",
            liveness.timeout_s,
            gloo,
            GLOO_TIMEOUT_ENV,
        )
