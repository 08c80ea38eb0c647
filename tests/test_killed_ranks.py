"""Ranks ended by a signal: which signal, and for SIGKILL the likely cause with the evidence the host gave."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import make_session

from airflow_provider_hvd import HorovodRunner, RankFailedError
from airflow_provider_hvd.runner.agent.kill_evidence import MemoryCgroup, memory_cgroup
from airflow_provider_hvd.runner.driver.kills import size


def kill_myself(rank: int, signum: int) -> None:
    import os
    import time

    if int(os.environ["HOROVOD_RANK"]) == rank:
        os.kill(os.getpid(), signum)
    time.sleep(60)


def crash_here() -> None:
    import ctypes
    import os
    import time

    if os.environ["HOROVOD_RANK"] == "1":
        ctypes.string_at(0)  # a read at address 0: SIGSEGV
    time.sleep(60)


def test_a_crash_names_its_signal_and_where_it_happened():
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(crash_here)
    text = str(info.value)
    assert "Horovod rank 1 of 2 failed: was killed by SIGSEGV without a Python exception" in text, text
    assert "Likely cause: a crash in native code (SIGSEGV)" in text, text
    tail = "\n".join(info.value.output_tail)
    assert "Fatal Python error: Segmentation fault" in tail and " in crash_here" in tail, tail


def test_a_sigterm_from_outside_is_named_as_such():
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(kill_myself, rank=0, signum=signal.SIGTERM)
    text = str(info.value)
    assert "Horovod rank 0 of 2 failed: was killed by SIGTERM without a Python exception" in text, text
    assert "SIGTERM came from outside HorovodRunner" in text, text


def test_a_sigkill_without_an_oom_kill_says_so():
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(kill_myself, rank=1, signum=signal.SIGKILL)
    text = str(info.value)
    assert "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception" in text, text
    assert "No OOM kill was counted while it ran" in text and "SIGKILL came from elsewhere" in text, text
    assert "Memory limits in force:" in text, text


# --- the OOM killer, for real: a Spark worker in a memory cgroup made for the test ---

LIMIT = 768 << 20  # the script and its two ranks take about 300 MiB before rank 1 grows


def grow_until_killed() -> None:
    import os
    import time

    if os.environ["HOROVOD_RANK"] == "1":
        hoard = []
        while True:
            hoard.append(b"x" * (32 << 20))  # written, so resident
    time.sleep(120)


@pytest.fixture(scope="module")
def limited_cgroup() -> Path:
    """A memory cgroup with a limit, under this process's own (as root; cgroup v2 or v1's memory hierarchy)."""
    mine = memory_cgroup()
    if os.geteuid() != 0 or mine is None or not os.access(mine.path, os.W_OK):
        pytest.skip("needs root and a writable memory cgroup to make one with a limit")
    path = mine.path / f"hvd-oom-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        if mine.version == 2:
            (path / "memory.max").write_text(str(LIMIT))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(LIMIT))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


SCRIPT = """
from airflow_provider_hvd import HorovodRunner, RankFailedError
{function}
try:
    HorovodRunner(np=-2).run(grow_until_killed)
except RankFailedError as exc:
    print(exc)
"""


def test_a_script_whose_rank_is_killed_for_memory_says_so(limited_cgroup):
    """HorovodRunner alone, in a script that runs in a memory cgroup (as in a container with a memory limit)."""
    procs = str(limited_cgroup / "cgroup.procs")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(function=inspect.getsource(grow_until_killed))],
        preexec_fn=lambda: Path(procs).write_text(str(os.getpid())),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = proc.stdout
    name = "/" + str(limited_cgroup.relative_to(memory_cgroup().mount))  # as /proc/<pid>/cgroup names it
    assert "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception" in text, proc.stderr[-3000:]
    assert (
        "Likely cause: the kernel's OOM killer ended it for memory: "
        f"its memory cgroup {name} counted 1 OOM kill(s) while it ran" in text
    ), text
    if os.access("/dev/kmsg", os.R_OK):
        assert "the kernel log says:" in text and "Killed process" in text, text
    assert f"the memory cgroup's limit {size(LIMIT)} (set on {name}" in text, text
    print(f"\n{text}")


@pytest.fixture(scope="module")
def spark_with_memory_settings(standalone_cluster):
    spark = make_session(
        standalone_cluster.url,
        **{"spark.executor.memory": "512m", "spark.executor.memoryOverhead": "256m", **standalone_cluster.app_conf},
    )
    yield spark
    spark.stop()


def test_on_spark_the_memory_settings_in_force_are_named(spark_with_memory_settings):
    """(A Spark worker in a memory cgroup at its limit thrashes on its JVM's file pages for minutes before the
    OOM killer acts: the OOM kill itself is tested with the script above.)"""
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=2).run(kill_myself, rank=1, signum=signal.SIGKILL)
    text = str(info.value)
    assert "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception" in text, text
    assert (
        "spark.executor.memory=512m; spark.executor.memoryOverhead=256m; spark.executor.pyspark.memory=not set"
    ) in text, text


def test_cgroup_v2_files_are_read(tmp_path):
    """cgroup v2 (memory.events, memory.max, memory.peak) as the agent reads it; this machine has v1 for memory."""
    parent = tmp_path / "kubepods" / "pod1"
    leaf = parent / "container"
    leaf.mkdir(parents=True)
    (parent / "memory.max").write_text(f"{2 << 30}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n")
    (leaf / "memory.peak").write_text(f"{(2 << 30) - 4096}\n")
    cgroup = MemoryCgroup(2, "/kubepods/pod1/container", leaf, tmp_path)
    assert cgroup.oom_kills() == 2
    assert cgroup.limit() == (2 << 30, "/kubepods/pod1")
    assert cgroup.peak() == (2 << 30) - 4096
