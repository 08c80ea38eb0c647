"""Ranks ended by a signal: which signal, and for SIGKILL the likely cause with the evidence the host gave."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from commands import kill_tagged
from conftest import make_session

from airflow_provider_hvd import HorovodRunner, RankFailedError
from airflow_provider_hvd.runner.agent.kill_evidence import MemoryCgroup, memory_cgroup
from airflow_provider_hvd.runner.driver.verdict.kills import size


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


@contextlib.contextmanager
def cgroup_with_limit(under: Path, version: int, limit: int) -> Iterator[Path]:
    """A new memory cgroup in ``under`` with ``limit`` bytes and no swap; what is left in it is killed after."""
    path = under / f"hvd-oom-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        if version == 2:
            (path / "memory.max").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
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


def writable_memory_cgroup() -> MemoryCgroup:
    mine = memory_cgroup()
    if os.geteuid() != 0 or mine is None or not os.access(mine.path, os.W_OK):
        pytest.skip("needs root and a writable memory cgroup to make one with a limit")
    return mine


@pytest.fixture(scope="module")
def limited_cgroup() -> Iterator[Path]:
    """A memory cgroup with a limit, under this process's own (as root; cgroup v2 or v1's memory hierarchy)."""
    mine = writable_memory_cgroup()
    with cgroup_with_limit(mine.path, mine.version, LIMIT) as path:
        yield path


@pytest.fixture(scope="module")
def cgroup_beside() -> Iterator[Path]:
    """A small memory cgroup beside this process's own, not below it (cgroup v2 counts a child's OOM kills)."""
    mine = writable_memory_cgroup()
    if mine.path == mine.mount or not os.access(mine.path.parent, os.W_OK):
        pytest.skip("needs a writable parent of this process's memory cgroup")
    with cgroup_with_limit(mine.path.parent, mine.version, 64 << 20) as path:
        yield path


def kill_myself_after_an_oom_kill_elsewhere(procs: str) -> None:
    """Rank 1 has a process in another memory cgroup killed for memory, then dies of SIGKILL itself."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if int(os.environ["HOROVOD_RANK"]) == 1:
        hog = "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); h = []\n"
        hog += "while True: h.append(b'x' * (8 << 20))"  # moved into the small cgroup, it grows until killed
        assert subprocess.run([sys.executable, "-c", hog, procs], timeout=120).returncode == -signal.SIGKILL
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_an_oom_kill_elsewhere_on_the_host_is_not_the_likely_cause(cgroup_beside):
    """Before: "Likely cause: the kernel's OOM killer ended it for memory: the host counted 1 OOM kill(s)", for a
    rank that its own memory cgroup counted no OOM kill of."""
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(kill_myself_after_an_oom_kill_elsewhere, procs=str(cgroup_beside / "cgroup.procs"))
    text = str(info.value)
    mine = memory_cgroup()
    assert "Horovod rank 1 of 2 failed: was killed by SIGKILL without a Python exception" in text, text
    assert "Likely cause" not in text and "memoryOverhead" not in text, text  # no memory advice either
    assert re.search(
        rf"No OOM kill was counted while it ran by its memory cgroup {re.escape(mine.name)}, which counts every OOM "
        r"kill of its processes; the host counted [1-9]\d*, of processes outside it: SIGKILL came from elsewhere",
        text,
    ), text


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


def start_a_child_and_sleep(pid_dir: str) -> None:
    """Rank 1 starts a child of its own (``sleep 307``) and records both pids; the ranks then sleep."""
    import os
    import subprocess
    import time
    from pathlib import Path

    if os.environ["HOROVOD_RANK"] == "1":
        child = subprocess.Popen(["sleep", "307"])
        Path(pid_dir, "child.pid").write_text(str(child.pid))
        Path(pid_dir, "rank.pid").write_text(str(os.getpid()))
    time.sleep(120)


def test_a_ranks_child_never_outlives_its_killed_agent(spark_with_memory_settings, tmp_path):
    """Before: in 1 of 3 such runs (local[2,4]) the rank's child was still alive 10 s after run() raised (the
    reaper had died before it ended it). Several runs, each its own pids."""
    import threading

    from jobs import alive, assert_all_gone

    for attempt in range(3):
        pid_dir = tmp_path / str(attempt)
        pid_dir.mkdir()
        outcome: dict = {}
        runner = HorovodRunner(np=2)

        def run(runner: HorovodRunner = runner, pid_dir: Path = pid_dir, outcome: dict = outcome) -> None:
            try:
                runner.run(start_a_child_and_sleep, pid_dir=str(pid_dir))
            except BaseException as exc:  # noqa: BLE001 - looked at below
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 120
            while not (pid_dir / "rank.pid").exists() and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (pid_dir / "rank.pid").exists(), f"rank 1 did not start: {outcome}"
            child, rank = int((pid_dir / "child.pid").read_text()), int((pid_dir / "rank.pid").read_text())
            agent = psutil.Process(rank).parent().parent()  # rank <- its reaper <- its agent (the Spark task's worker)
            os.kill(agent.pid, signal.SIGKILL)  # as when an executor dies: no goodbye
            thread.join(90)
            assert isinstance(outcome.get("error"), RankFailedError), outcome
            assert_all_gone([child, rank], within=10)
        finally:
            runner.cancel()
            thread.join(60)
            for pid in pid_dir.glob("*.pid"):
                if alive(int(pid.read_text())):
                    os.kill(int(pid.read_text()), signal.SIGKILL)


FAKE_AGENT = """
import os, subprocess, sys, threading, time
read, write = os.pipe()
rank = "import subprocess, time; print(subprocess.Popen(['sleep', '307']).pid, flush=True); time.sleep(120)"
subprocess.Popen([sys.executable, "-I", "-S", sys.argv[1], str(os.getpid()), sys.executable, "-c", rank],
                 env={**os.environ, "HVD_RUNNER_CONTROL_FD": str(write)}, pass_fds=(write,), start_new_session=True)
for _ in range(20):  # an agent's threads: the kernel hands the reaper from one to the next as they exit
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
time.sleep(120)
"""


def test_a_reaper_sent_many_sigterms_still_ends_what_is_below_it():
    """The agent's SIGTERM, then one parent-death signal per agent thread as it dies: before, a second SIGTERM
    while the reaper handled the first ended it at once, and the rank's child lived on (2 of 10 here)."""
    from jobs import alive

    from airflow_provider_hvd.runner import reaper

    left = []
    for _ in range(10):
        agent = subprocess.Popen([sys.executable, "-c", FAKE_AGENT, reaper.__file__], stdout=subprocess.PIPE, text=True)
        child = int(agent.stdout.readline())
        reaper_pid = psutil.Process(child).parent().parent().pid
        agent.kill()
        for _ in range(3000):
            try:
                os.kill(reaper_pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        agent.wait()
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(child):
            left.append(child)
            os.kill(child, signal.SIGKILL)
    assert not left, f"{len(left)} of 10 rank children outlived their reaper"


SIGTERMED_AS_ITS_RANK_STARTS = """
import os, signal, subprocess, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import reaper

class SignalledAsItStarts(subprocess.Popen):  # the agent's SIGTERM as the reaper forks the rank: before, or after
    def __init__(self, *args, **kwargs):
        if sys.argv[3] == "before the fork":
            os.kill(os.getpid(), signal.SIGTERM)
        super().__init__(*args, **kwargs)
        if sys.argv[3] == "before its pid is known":
            os.kill(os.getpid(), signal.SIGTERM)

subprocess.Popen = SignalledAsItStarts
reaper.main([str(os.getppid()), sys.executable, "-c", "import time; time.sleep(120)", sys.argv[2]])
"""


@pytest.mark.parametrize("when", ["before the fork", "before its pid is known"])
def test_a_reaper_sent_sigterm_as_its_rank_starts_ends_the_rank_at_once(when):
    """Before: a SIGTERM while the reaper's Popen waited for the rank's exec (a cancel right as the ranks start)
    ended the reaper without the rank's pid, and the rank lived on, holding its stdin: the agent's feed of a job
    larger than a pipe hung, and run() with it (2 to 5 of 200 cancels 10-50 ms after a reaper's start). And a
    SIGTERM before the fork must not be ignored by the rank (SIGKILLed after the reaper's grace, then)."""
    from airflow_provider_hvd.runner import reaper

    tag = f"hvd-rank-{uuid.uuid4().hex}"
    read, write = os.pipe()
    try:
        harness = subprocess.run(
            [sys.executable, "-c", SIGTERMED_AS_ITS_RANK_STARTS, reaper.__file__, tag, when],
            env={**os.environ, reaper.CONTROL_FD_ENV: str(write)},
            pass_fds=(write,),
            timeout=60,
        )
    finally:
        os.close(read)
        os.close(write)
    left = kill_tagged(tag)
    assert not left, "the rank outlived its reaper"
    # the reaper exits the way the rank did: ended by its SIGTERM (not SIGKILLed after the grace)
    assert harness.returncode == -signal.SIGTERM


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
