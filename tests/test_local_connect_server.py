"""`python -m airflow_provider_hvd.connect_server`, as docs/durable-runs.md's "Try it" has a user run it: started
(as a daemon, or in the foreground), the page's snippet submits a run to it (np=2 and its host: every slot),
stopped (by `stop`, or by Ctrl-C), and nothing of it is left: no process, no pid file."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from commands import Output, family, kill_tagged, still_running
from spark_cluster import free_port

COMMAND = [sys.executable, "-m", "airflow_provider_hvd.connect_server"]
READY = re.compile(r"Spark Connect server at (sc://\S+) on local\[(\d+)\]")


def try_it_python() -> str:
    """The Python snippet of docs/durable-runs.md's "Try it"."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "durable-runs.md").read_text()
    section = page.split("## Try it\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def assert_nothing_left(processes: list[psutil.Process], folder: Path, port: int) -> None:
    assert not still_running(processes), f"still running after the stop: {still_running(processes)}"
    assert not (folder / "connect-server.pid").exists()
    with pytest.raises(OSError):  # nothing listens on its port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_daemon_server_runs_the_pages_submitted_run_and_stop_leaves_nothing(tmp_path):
    folder, port = tmp_path / "connect-server", free_port()
    start = [*COMMAND, "--dir", str(folder), "start", "--daemon", "--np", "2", "--port", str(port)]
    started = subprocess.run(start, capture_output=True, text=True, timeout=360)
    stop = [*COMMAND, "--dir", str(folder), "stop"]  # unless it says otherwise (below)
    try:
        assert started.returncode == 0, started.stderr
        url, slots = READY.search(started.stdout).groups()  # type: ignore[union-attr]
        assert (url, slots) == (f"sc://127.0.0.1:{port}", "3")
        said = re.search(r"stop it with: (.*)", started.stdout)
        assert said, started.stdout
        stop = said.group(1).split()
        pid = int((folder / "connect-server.pid").read_text())
        again = subprocess.run(start, capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and f"already running (pid {pid})" in again.stderr
        # the page's snippet, on this server: a submitted run of np=2 and its host (every slot)
        snippet = try_it_python().replace("sc://127.0.0.1:15002", url)
        ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        job_id, value = ran.stdout.splitlines()[-2:]
        assert json.loads(job_id)["server"].startswith(url) and value == "2", ran.stdout
        assert (folder / "connect-server.log").stat().st_size > 0  # its log is in its folder, not in pyspark's
        processes = family(pid)
    finally:
        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and f"stopped the Connect server (pid {pid})" in stopped.stdout, stopped
    assert_nothing_left(processes, folder, port)
    again = subprocess.run(stop, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "no Connect server" in again.stdout


def test_a_foreground_server_stops_on_ctrl_c_and_leaves_nothing(tmp_path):
    folder, port = tmp_path / "connect-server", free_port()
    proc = subprocess.Popen(
        [*COMMAND, "--dir", str(folder), "start", "--np", "1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(proc)
    try:
        assert output.wait_for(READY, 360).groups() == (f"sc://127.0.0.1:{port}", "2")
        output.wait_for(re.compile("Ctrl-C stops it"), 60)  # the message's last line
        processes = family(int((folder / "connect-server.pid").read_text()))
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends it
        code = proc.wait(120)
        output.close()
    assert code == 0 and "stopped the Connect server" in output.text, output.text
    assert_nothing_left(processes, folder, port)


INTERRUPTED_AS_THE_SERVER_STARTS = """
import os, signal, subprocess, sys
from airflow_provider_hvd import connect_server

class InterruptedAsItStarts(subprocess.Popen):  # Ctrl-C after the server's fork, before its pid is returned
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

connect_server.subprocess.Popen = InterruptedAsItStarts
stand_in = [sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]]  # (tagged: the test finds it)
connect_server.LocalConnectServer.command = lambda self, conf: stand_in
sys.exit(connect_server.main(["--dir", sys.argv[2], "start", "--port", sys.argv[3]]))
"""


def test_ctrl_c_as_the_server_starts_leaves_nothing(tmp_path):
    """Before: a Ctrl-C while Popen waited for the server's exec (a few ms) ended the command without the
    server's pid: the server lived on, with no pid file for `stop` to find. (Its command is a stand-in here.)"""
    import uuid

    tag, folder = f"hvd-server-{uuid.uuid4().hex}", tmp_path / "connect-server"
    started = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AS_THE_SERVER_STARTS, tag, str(folder), str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    left = kill_tagged(tag)
    assert not left, f"the server outlived its start command: {started}"
    assert started.returncode == 130, started
    assert not (folder / "connect-server.pid").exists()
