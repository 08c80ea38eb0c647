"""The runner's timings that depend on each other (runner/shared/timing.py): how they relate, and that each is
defined there alone and imported where it is used."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from airflow_provider_hvd.runner import reaper
from airflow_provider_hvd.runner.shared import timing

RUNNER = Path(timing.__file__).resolve().parent.parent


def test_the_timings_relate_as_their_reasons_say():
    # a link is cut only after several heartbeats were missed, and well before Gloo gives up on the host
    assert timing.HEARTBEAT_TIMEOUT_S >= timing.MIN_BEATS_PER_TIMEOUT * timing.HEARTBEAT_INTERVAL_S
    assert timing.HEARTBEAT_TIMEOUT_S + timing.HEARTBEAT_INTERVAL_S < timing.GLOO_DEFAULT_TIMEOUT_S
    # an agent that reads nothing is named lost by the heartbeats before a send to it gives up
    assert timing.SEND_TIMEOUT_S > timing.HEARTBEAT_TIMEOUT_S
    # the other ranks end within the wait after a failure: the reaper's SIGTERM grace, then what the rank left
    assert timing.ABORT_WAIT_S > reaper.TERMINATE_GRACE_S + reaper.LEFTOVER_GRACE_S
    # the driver waits for every agent's stacks longer than an agent waits for its rank's
    assert timing.STACKS_WAIT_S > timing.STACKS_ANSWER_WAIT_S
    # a successful run's end waits for its executors to drop the job's broadcast within its wait for the launch's end
    assert timing.BROADCAST_DROP_WAIT_S < timing.LAUNCH_END_WAIT_S
    # the ranks' exit work gets a generous grace by default, once the run has succeeded
    assert timing.DEFAULT_EXIT_TIMEOUT_S >= 120 > timing.EXIT_AFTER_REPORT_S
    # the run's end waits on a progress store that does not answer a few seconds only
    assert timing.FINAL_WRITE_S <= 10
    # a submitted run's host waits for the submitting client's MLflow credentials longer than it takes to attach
    assert timing.CREDENTIALS_WAIT_S > timing.CONNECT_TIMEOUT_S + timing.HANDSHAKE_TIMEOUT_S
    # a submitted run's outcome outlives the lease (a deferred task resumes after the run's end, maybe hours later)
    assert timing.DEFAULT_OUTCOME_TIMEOUT_S >= 3600 > timing.DEFAULT_DETACHED_TIMEOUT_S
    # attach() waits for Spark's word on a host that refuses it longer than a later attempt probes the first one
    # (its heartbeat timeout), with as long again for that attempt's start
    assert timing.HOST_UNREACHABLE_WAIT_S >= 2 * timing.HEARTBEAT_TIMEOUT_S
    # a DataFrame's rows: the tasks' reports come more often than the driver logs them
    assert timing.FEED_REPORT_S < timing.FEED_LOG_S < timing.DEFAULT_START_TIMEOUT_S
    # over Spark Connect, the server's first progress report comes within its default interval (2 s)
    assert timing.CONNECT_FIRST_PROGRESS_S > 2


def test_each_timing_is_defined_in_the_timing_module_alone_and_used():
    names = set(timing.__all__)
    trees = {path: ast.parse(path.read_text()) for path in sorted(RUNNER.rglob("*.py")) if path.name != "timing.py"}
    imports = [
        alias
        for tree in trees.values()
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("timing")
        for alias in node.names
    ]
    local_names = names | {alias.asname for alias in imports if alias.asname}
    defined = [
        f"{path.relative_to(RUNNER)}:{node.lineno}: {target.id}"
        for path, tree in trees.items()
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id in local_names
    ]
    assert not defined, f"defined outside runner/shared/timing.py (import them from there): {defined}"
    unused = names - {alias.name for alias in imports}
    assert not unused, f"in runner/shared/timing.py but imported nowhere: {sorted(unused)}"


def test_the_internals_page_says_each_timing_as_the_code_has_it():
    """docs/internals.md's Timings: each name comes after its figure ("10 s (`HANDSHAKE_TIMEOUT_S`)")."""
    page = (RUNNER.parent.parent / "docs" / "internals.md").read_text()
    section = page.split("\n## Timings\n", 1)[1].split("\n## ", 1)[0]
    said, wrong = {}, []
    for before, name in re.findall(r"([^`]*)`([A-Z_]+)`", section):
        value = getattr(timing, name, getattr(reaper, name, None))
        figures = re.findall(r"\d+(?:\.\d+)?", before)
        if value is not None and figures:
            said[name] = float(figures[-1])
            if said[name] != value:
                wrong.append(f"{name}: {figures[-1]} on the page, {value:g} in the code")
    assert not wrong, wrong
    assert set(timing.__all__) | {"TERMINATE_GRACE_S", "LEFTOVER_GRACE_S"} <= set(said), sorted(
        set(timing.__all__) - set(said)
    )
