"""The outcome of a stalled run and of a killed rank: which event is the cause, and what the error says."""

from __future__ import annotations

import math

from airflow_provider_hvd import RankFailedError, RunStalledError
from airflow_provider_hvd.runner.agent.activity import is_stall_warning
from airflow_provider_hvd.runner.driver.events import Cancelled, RankFailed, Stalled, StalledRank
from airflow_provider_hvd.runner.driver.verdict.kills import describe_kill
from airflow_provider_hvd.runner.driver.verdict.outcome import RunOutcome
from airflow_provider_hvd.runner.driver.verdict.report import abort_reason, run_error
from airflow_provider_hvd.runner.shared.messages import Done

WHERE = "in Spark task 1 (attempt 0) on executor 10.0.0.2:41000 (10.0.0.2)"
ENDED = Done(exit_code=-15, ok=False, terminated_by="the run stalled")
DUMP = """Thread 0x00007f0e8f7fe6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0e97a5b740 (most recent call first):
  File "/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py", line 1005 in synchronize
  File "/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py", line 310 in allreduce
  File "/dags/train.py", line 42 in train_epoch
  File "/dags/train.py", line 60 in train
  File "/venv/lib/python3.11/site-packages/airflow_provider_hvd/runner/rank/__main__.py", line 47 in _run
  File "/venv/lib/python3.11/site-packages/airflow_provider_hvd/runner/rank/__main__.py", line 70 in main
  File "<frozen runpy>", line 88 in _run_code
"""


def stalled() -> Stalled:
    return Stalled(
        600.0, (StalledRank(0, 612.0, DUMP), StalledRank(1, 640.0, None, "its rank process had already ended"))
    )


def test_a_stall_is_the_cause_and_the_ended_ranks_its_consequence():
    outcome = RunOutcome(2)
    outcome.started()
    assert abort_reason(outcome.record(stalled())) == (
        "the run stalled: no rank wrote output or reported progress for 600s (stall_timeout)"
    )
    assert outcome.record(RankFailed(0, WHERE, ENDED)) is None
    assert outcome.record(Cancelled()) is None
    error = run_error(outcome)
    assert type(error) is RunStalledError
    assert error.ranks == [0, 1] and error.stall_timeout == 600.0
    assert error.stacks == {0: DUMP, 1: "(no stacks: its rank process had already ended)"}
    assert str(error) == (
        "HorovodRunner: the run stalled: no rank wrote output or reported progress for 600s (stall_timeout=600); "
        "every rank was ended. Stalled: ranks 0, 1. Where each one was, longest quiet first (innermost frames "
        "first):\n"
        "rank 1 (quiet for 640s): no stacks: its rank process had already ended\n"
        "rank 0 (quiet for 612s) was in train_epoch (/dags/train.py, line 42)\n"
        '    File "/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py", line 1005 in synchronize\n'
        '    File "/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py", line 310 in allreduce\n'
        '    File "/dags/train.py", line 42 in train_epoch\n'
        '    File "/dags/train.py", line 60 in train'
    )


def test_a_failure_before_the_stall_stays_the_cause():
    outcome = RunOutcome(2)
    outcome.started()
    outcome.record(RankFailed(1, WHERE, Done(exit_code=1, ok=False)))
    outcome.record(stalled())  # while the failure's window is open: not a cause of its own
    outcome.due(now=math.inf)
    assert type(run_error(outcome)) is RankFailedError


OOM = {
    "signal": "SIGKILL",
    "cgroup": "/kubepods/pod1/c1",
    "cgroup_version": 2,
    "cgroup_oom_kills": 1,
    "host_oom_kills": 1,
    "memory_limit": 4 << 30,
    "limit_cgroup": "/kubepods/pod1",
    "memory_peak": 4 << 30,
    "kernel_log": ["Memory cgroup out of memory: Killed process 4242 (python) total-vm:5000000kB, anon-rss:4100000kB"],
    "memory_settings": {"spark.executor.memory": "4g", "spark.executor.memoryOverhead": "1g"},
}


def test_a_killed_rank_gets_the_likely_cause_after_its_signal():
    outcome = RunOutcome(2)
    outcome.started()
    outcome.record(RankFailed(1, WHERE, Done(exit_code=-9, ok=False, kill_evidence=OOM), kill_evidence=OOM))
    outcome.due(now=math.inf)
    text = str(run_error(outcome))
    assert text.startswith(
        "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception\n"
        "Likely cause: the kernel's OOM killer ended it for memory: its memory cgroup /kubepods/pod1/c1 counted 1 OOM "
        "kill(s) while it ran; the kernel log says: Memory cgroup out of memory: Killed process 4242 (python) "
        "total-vm:5000000kB, anon-rss:4100000kB. Memory limits in force: the memory cgroup's limit 4.0 GiB (set on "
        "/kubepods/pod1; its peak use 4.0 GiB); spark.executor.memory=4g; spark.executor.memoryOverhead=1g. "
        "The ranks are Python processes beside the executor's JVM"
    ), text


def test_kill_texts_without_an_oom_kill():
    quiet = {
        "signal": "SIGKILL",
        "cgroup": "/c",
        "cgroup_oom_kills": 0,
        "host_oom_kills": 0,
        "memory_limit": None,
        "kernel_log": [],
        "kernel_log_unreadable": "/dev/kmsg: Operation not permitted",
    }
    assert describe_kill(quiet) == (
        "No OOM kill was counted while it ran (by its memory cgroup /c or the host): SIGKILL came from elsewhere (the "
        "cluster manager enforcing a limit, e.g. YARN's memory check or Kubernetes' eviction, or a person). The kernel "
        "log could not be read (/dev/kmsg: Operation not permitted). Memory limits in force: no memory limit on its "
        "cgroup /c or its parents."
    )
    assert describe_kill({"signal": "SIGKILL"}) == (
        "Its host's OOM kill counters could not be read: SIGKILL came from the kernel's OOM killer (the most common "
        "cause) or from elsewhere (the cluster manager enforcing a limit, e.g. YARN's memory check or Kubernetes' "
        "eviction, or a person). Memory limits in force: none could be read."
    )
    assert describe_kill({"signal": "SIGBUS"}).startswith("Likely cause: a crash in native code (SIGBUS)")


def test_an_oom_kill_counted_only_by_the_host_is_the_cause_only_where_the_cgroup_could_not_tell():
    """Before: a host-wide count made the OOM killer the likely cause although the rank's cgroup counted none."""
    elsewhere = {"signal": "SIGKILL", "cgroup": "/c", "cgroup_oom_kills": 0, "host_oom_kills": 3}
    assert describe_kill(elsewhere) == (
        "No OOM kill was counted while it ran by its memory cgroup /c, which counts every OOM kill of its processes; "
        "the host counted 3, of processes outside it: SIGKILL came from elsewhere (the cluster manager enforcing a "
        "limit, e.g. YARN's memory check or Kubernetes' eviction, or a person). Memory limits in force: no memory "
        "limit on its cgroup /c or its parents."
    )
    unknown_cgroup = {"signal": "SIGKILL", "cgroup": None, "cgroup_oom_kills": None, "host_oom_kills": 2}
    assert describe_kill(unknown_cgroup).startswith(
        "Likely cause: the kernel's OOM killer ended it for memory: the host counted 2 OOM kill(s) while it ran "
        "(its memory cgroup's count is unknown)."
    )


def test_horovods_own_stall_warning_is_not_activity():
    """Its lines, as horovod/common/stall_inspector.cc (0.28.1) writes them through its logger."""
    warning = [
        "[2026-11-30 20:41:07.123456: W /tmp/horovod-0.28.1/horovod/common/stall_inspector.cc:107] One or more "
        "tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for "
        "remainder of ranks for more than 60 seconds. This may indicate that different ranks are trying to submit "
        "different tensors or that only subset of ranks is submitting tensors, which will cause deadlock. ",
        "Missing ranks:",
        "1: [allreduce.after_the_hang]",
        "3!: [allreduce.noname.1, allreduce.noname.2 ...]",
    ]
    assert all(is_stall_warning(line) for line in warning)
    assert not any(is_stall_warning(line) for line in ["epoch 3: loss=0.25", "Missing ranks: none", 7])
