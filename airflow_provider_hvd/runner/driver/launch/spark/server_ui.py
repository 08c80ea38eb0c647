"""A Spark Connect server's own Spark UI: where it is (the port that lists the server's application), and what its
REST API says of the application's task slots (``/api/v1/applications/<app>/executors``: each executor's
``maxTasks``, ``activeTasks`` and ``totalCores``), the count a client without a SparkContext has.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

UI_PORT, PORT_RETRIES = 4040, 16  # Spark's defaults: the UI takes the first free port from 4040 on
UI_PROBE_TIMEOUT_S = 3.0  # a UI's first answer can be slow on a loaded host


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=UI_PROBE_TIMEOUT_S) as resp:
        return json.load(resp)


def _serves_application(ui: str, app_id: str) -> bool | None:
    """Whether the Spark UI at ``ui`` is ``app_id``'s; None where nothing listens there."""
    try:
        apps = _get(f"{ui}/api/v1/applications")
    except urllib.error.URLError as exc:
        return None if isinstance(exc.reason, ConnectionRefusedError) else False
    except (OSError, ValueError):
        return False
    return isinstance(apps, list) and any(isinstance(app, dict) and app.get("id") == app_id for app in apps)


def server_ui_url(host: str, first: int, retries: int, app_id: str) -> tuple[str | None, str]:
    """The UI on ``host`` that lists ``app_id``, from port ``first`` up to ``first + retries`` (the first port
    where nothing listens ends it), and why there is none when it is None.

    The ports are asked at once: a host that drops packets costs one probe's timeout, not one per port.
    """
    uis = [f"http://{host}:{port}" for port in range(first, first + retries + 1)]
    with ThreadPoolExecutor(min(len(uis), PORT_RETRIES + 1), thread_name_prefix="hvd-ui-probe") as probes:
        answers = list(probes.map(lambda ui: _serves_application(ui, app_id), uis))
    for ui, serves in zip(uis, answers, strict=True):
        if serves:
            return ui, ""
        if serves is None:
            break
    return None, f"no Spark UI from http://{host}:{first} on lists the Spark Connect server's application {app_id}"


def server_ui(conf: Callable[[str], str | None]) -> tuple[str | None, str]:
    """The Spark Connect server's own UI (``http://host:port``) from its session's conf, and why there is none
    when it is None: from ``spark.driver.host`` and ``spark.ui.port`` on, the port whose
    ``/api/v1/applications`` lists the server's application (another application's UI may hold a port)."""
    app_id = conf("spark.app.id")
    if not app_id:
        return None, "the Spark Connect server does not say its application's id (spark.app.id)"
    if (conf("spark.ui.enabled") or "true").lower() == "false":
        return None, f"the Spark Connect server's application {app_id} has its UI off (spark.ui.enabled=false)"
    host, first = conf("spark.driver.host"), int(conf("spark.ui.port") or UI_PORT)
    if not host or first == 0:
        return None, f"the Spark Connect server does not say where its UI is (spark.driver.host, spark.ui.port={first})"
    return server_ui_url(host, first, int(conf("spark.port.maxRetries") or PORT_RETRIES), app_id)


def executor_slots(ui: str, app_id: str, task_cpus: int = 1, lost_hosts: tuple[str, ...] = ()) -> tuple[int, int, int]:
    """The application's task slots, how many of them its running tasks hold, and how many tasks of ``task_cpus``
    CPUs its executors' cores alone would hold (more than its slots where GPUs limit them), from its executors'
    summary (OSError or ValueError where the UI does not answer with one); the executors on ``lost_hosts`` left
    out."""
    executors = _get(f"{ui}/api/v1/applications/{app_id}/executors")
    if not isinstance(executors, list):
        raise ValueError(f"{ui}/api/v1/applications/{app_id}/executors is not a list of executors")
    active = [
        e
        for e in executors
        if isinstance(e, dict)
        and e.get("isActive", True)
        and not e.get("isExcluded")
        and str(e.get("hostPort", "")).rpartition(":")[0].strip("[]") not in lost_hosts
    ]
    return (
        sum(int(e.get("maxTasks", 0)) for e in active),
        sum(int(e.get("activeTasks", 0)) for e in active),
        sum(int(e.get("totalCores", 0)) // task_cpus for e in active),
    )
