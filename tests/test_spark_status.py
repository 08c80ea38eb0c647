"""The supervisor's watch on Spark's status store: the same few py4j calls per poll whatever np; a task that
failed, or one killed from outside the run, named with Spark's reason.

A barrier job of 1,000 tasks cannot run here: a stand-in of the JVM's status tracker and store answers
(``standin_status.py``), counting each answer as the py4j round trip it would be.
"""

from __future__ import annotations

import pytest
from standin_status import StandInJob, standin_launcher

from airflow_provider_hvd.runner.driver.events import LaunchFailed, TaskEnded


def failures(events: list) -> list[LaunchFailed]:
    return [event for event in events if isinstance(event, LaunchFailed)]


def calls_per_poll(tasks: int, polls: int = 5) -> list[int]:
    launcher, sc = standin_launcher(StandInJob(group="", tasks=tasks))
    counts = []
    for _ in range(polls):
        before = sc.calls.count
        launcher._next_poll = 0.0  # as a second later
        assert launcher.poll() == []
        counts.append(sc.calls.count - before)
    return counts


def test_a_poll_costs_the_same_few_py4j_calls_at_any_np():
    small, large = calls_per_poll(4), calls_per_poll(1000)
    assert small[1:] == large[1:]  # after the first poll, which finds the job
    assert max(large[1:]) <= 4, large


@pytest.mark.parametrize("polls_between", [0, 1000])
def test_the_supervisor_polls_spark_at_most_once_a_second(monkeypatch, polls_between):
    launcher, sc = standin_launcher(StandInJob(group="", tasks=1000))
    launcher.poll()
    before = sc.calls.count
    for _ in range(polls_between):  # the supervisor's loop asks every 0.2 s, and at every event
        launcher.poll()
    assert sc.calls.count == before


def test_a_failed_task_among_a_thousand_is_named_with_sparks_reason():
    job = StandInJob(group="", tasks=1000)
    launcher, _ = standin_launcher(job)
    assert launcher.poll() == []
    job.failed, job.killed = {321}, set(range(1000)) - {321}  # Spark kills the other tasks of the barrier stage
    launcher._next_poll = 0.0
    events = launcher.poll()
    [failure] = failures(events)
    assert failure.reason == "Spark task 321 (attempt 0) failed on executor 71 (10.0.1.1): boom"
    assert TaskEnded((321, 0), failure.reason) in events


def test_a_task_killed_from_outside_is_named_as_killed():
    job = StandInJob(group="", tasks=4)
    launcher, _ = standin_launcher(job)
    launcher.poll()
    job.killed = {2}
    launcher._next_poll = 0.0
    [failure] = failures(launcher.poll())
    assert failure.reason == "Spark task 2 (attempt 0) was killed on executor 2 (10.0.0.1): killed via the Web UI"


def test_tasks_killed_by_the_runs_own_cancellation_are_not_its_cause():
    job = StandInJob(group="", tasks=4)
    launcher, _ = standin_launcher(job)
    launcher.poll()
    job.killed, job.kill_reason = {0, 1, 2, 3}, f"Job 0 cancelled part of cancelled job group {launcher.group}"
    launcher._next_poll = 0.0
    assert launcher.poll() == []  # no failure, and no task Spark ended of its own


def test_the_status_follows_the_barrier_job_not_the_dataframes_jobs_before_it():
    """A DataFrame's run has adaptive execution's jobs in its group before the barrier job (a shuffle's): their
    tasks are not the ranks'. Before: the status followed the group's first job it saw, for good."""
    job = StandInJob(group="", tasks=4, job_id=7, stage_id=9, submitted=False, other_jobs=[3])
    launcher, _ = standin_launcher(job)
    assert launcher.poll() == []
    job.submitted, job.killed = True, {2}
    launcher._next_poll = 0.0
    [failure] = failures(launcher.poll())
    assert failure.reason == "Spark task 2 (attempt 0) was killed on executor 2 (10.0.0.1): killed via the Web UI"
