"""The driver's side at scale: Supervisor, DriverChannel, RunOutcome and the rendezvous against 1,000 simulated
agents speaking the real wire protocol (``simulated_agents.py``; no Horovod, no rank processes)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from peaks import Peaks
from simulated_agents import Scenario, drive

from airflow_provider_hvd import RankFailedError
from airflow_provider_hvd.runner.shared import wire

AGENTS = 1000
TESTS = Path(__file__).resolve().parent


def test_a_thousand_agents_start_and_their_lines_arrive_in_order_per_rank(monkeypatch, caplog):
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT_S", 2.0)
    caplog.set_level(logging.WARNING, logger="airflow_provider_hvd.runner")
    scenario = Scenario(
        agents=AGENTS, per_host=4, lines_per_rank=12, lines_per_batch=5, hold_s=5.0, silent=20, garbage=20
    )
    with Peaks(threads=threading.active_count) as peaks:
        run = drive(scenario)
    assert run.error is None and run.value == {"ranks": str(AGENTS)}
    agents = run.report.agents
    assert not [a for a in agents if "error" in a or "turned_away" in a]
    assert sorted(a["rank"] for a in agents) == list(range(AGENTS))
    ranks_by_host: dict[str, list[int]] = {}
    for agent in agents:
        ranks_by_host.setdefault(agent["host"], []).append(agent["rank"])
    assert len(ranks_by_host) == AGENTS // 4
    assert all(sorted(r) == list(range(min(r), min(r) + 4)) for r in ranks_by_host.values())  # contiguous per host
    assert run.lines == {rank: [f"rank {rank} line {n}" for n in range(12)] for rank in range(AGENTS)}
    # no thread per connection: the channel's loop, the rendezvous server, the simulated launcher's reader
    assert peaks.growth("threads") <= 5
    # bad connections are closed while the run goes on: garbage at once, silent ones at the handshake timeout
    assert len(run.report.silent_open_s) == 20 and len(run.report.garbage_open_s) == 20
    # (timed from when the simulator saw the connection open, a little after the driver accepted it)
    assert all(1.0 < seconds < 5.0 for seconds in run.report.silent_open_s), run.report.silent_open_s
    assert all(seconds < 1.0 for seconds in run.report.garbage_open_s), run.report.garbage_open_s
    # (the records, not caplog.text: a logging setup earlier in the same worker may render them as JSON)
    rejected = [r.getMessage() for r in caplog.records if "rejected a connection" in r.getMessage()]
    assert sum(m.endswith("did not prove this run's secret in time") for m in rejected) == 20  # the silent ones
    assert sum(m.endswith("did not prove this run's secret") for m in rejected) == 20  # the garbage ones


def test_one_failure_among_a_thousand_ends_them_all():
    run = drive(Scenario(agents=AGENTS, fail_rank=321, lines_per_rank=2))
    assert isinstance(run.error, RankFailedError)
    assert run.error.rank == 321
    message = str(run.error)
    assert message.startswith(f"Horovod rank 321 of {AGENTS} failed: ValueError: simulated failure of rank 321")
    others = [a for a in run.report.agents if a["rank"] != 321]
    assert all("abort" in a for a in others), [a for a in others if "abort" not in a][:3]
    assert len(run.error.other_failures) == AGENTS - 1
    assert set(run.error.other_failures) == {f"rank {a['rank']}: ended by the driver (rank 321 failed)" for a in others}
    assert f"... and {AGENTS - 1 - 20} more (all in the error's other_failures)" in message
    assert max(a["abort"] for a in others) - run.report.failed_at < 30  # a hang, not a speed, is what fails here


LOW_LIMIT_RUN = """
import resource, sys
sys.path.insert(0, {tests!r})
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from peaks import Peaks
from simulated_agents import Scenario, drive
run = drive(Scenario(agents=400, lines_per_rank=1))
print(run.error or run.value, resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 400)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts open files in /proc")
def test_a_low_open_files_limit_is_raised_for_a_large_run():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOW_LIMIT_RUN.format(tests=str(TESTS)))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "{'ranks': '400'} True"
