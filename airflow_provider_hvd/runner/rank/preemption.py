"""A preemption notice, in the rank process: :func:`preemption_notice`.

When Spark starts decommissioning an executor that runs ranks of the run (its node is being reclaimed: a
standalone worker given SIGPWR, a Kubernetes pod being deleted, a YARN node being decommissioned), the driver
tells every rank's agent, which writes the notice into the rank's own folder (``HVD_RUNNER_NOTICE_FILE``): a
call reads one small file, nothing runs in the rank's background.
"""

from __future__ import annotations

import json
import os
from typing import Any

NOTICE_FILE_ENV = "HVD_RUNNER_NOTICE_FILE"


def preemption_notice() -> dict[str, Any] | None:
    """The notice that a host of this run's ranks is going away, or None (none came, or outside a run).

    A dict: ``"at"`` (when Spark began decommissioning, ``time.time()``), ``"deadline"`` (when the host is
    expected to go, from ``spark.executor.decommission.forceKillTimeout`` or ``...killInterval``; None when Spark
    does not say), ``"hosts"`` (the hosts being decommissioned), ``"ranks"`` (the ranks on them) and ``"reason"``
    (Spark's words). Cheap enough to call every step: one ``stat`` while no notice has come.

    Rank 0 saves a checkpoint and reports it (``report_checkpoint``) as soon as it sees one; with
    ``max_restarts``, the run then ends the attempt and starts again without those hosts, from that checkpoint,
    and that restart does not count against ``max_restarts``. The ranks may see the notice at different steps:
    where every rank must act on the same step, agree on it (an all-reduce of a flag).
    """
    path = os.environ.get(NOTICE_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as notice:
            value: dict[str, Any] = json.load(notice)
    except FileNotFoundError:
        return None
    return value
