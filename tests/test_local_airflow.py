"""`make airflow` (scripts/local_airflow.py) as a user runs it: it prints the URL and the login once the example DAGs
are parsed; an example DAG triggered through the REST API as docs/guide/provider.md says trains; its Training tab
shows the curves in Chromium; Ctrl-C stops it and leaves nothing running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from airflow_deployment import AirflowDeployment, log_text
from browser import Browser, chromium_path
from commands import Output, family, kill_tagged, still_running
from spark_cluster import free_port

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
DAG = "horovod_train_example"
READY = re.compile(r"Airflow is ready at (http://\S+)\s+\(login: (\w+) / (\S+)\)")


def rest_trigger_snippet() -> str:
    """docs/guide/provider.md's REST API trigger (bash)."""
    page = (ROOT / "docs" / "guide" / "provider.md").read_text()
    section = page.split("## In the UI, locally: `make airflow`", 1)[1]
    return re.search(r"through the REST API.*?```bash\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


class LocalAirflow(AirflowDeployment):
    """The REST API of the Airflow that the script started (this class starts nothing), as its user logs in."""

    def __init__(self, url: str, user: str, password: str) -> None:
        token = httpx.post(f"{url}/auth/token", json={"username": user, "password": password}, timeout=60)
        assert token.status_code == 201, token.text
        self.url = url
        self.api = httpx.Client(
            base_url=f"{url}/api/v2", timeout=300, headers={"Authorization": f"Bearer {token.json()['access_token']}"}
        )


@pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium (make setup installs it)")
def test_make_airflow_shows_a_dags_training_tab_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "local_airflow.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow_home")},
    )
    output = Output(proc)
    started = time.monotonic()
    try:
        url, user, password = output.wait_for(READY, 600).groups()
        ready_s = time.monotonic() - started
        assert url == f"http://127.0.0.1:{port}"
        airflow = LocalAirflow(url, user, password)
        # triggered as the page says, with the password it printed
        trigger = rest_trigger_snippet().replace("PASSWORD", password).replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        triggered = subprocess.run(["bash", "-c", trigger], capture_output=True, text=True, timeout=120)
        run_id = json.loads(triggered.stdout)["dag_run_id"]
        state = airflow.wait_for_run(DAG, run_id, timeout=600)
        assert state == "success", log_text(airflow.task_log(DAG, run_id, "train"))
        series = airflow.state_store(DAG, run_id, "train")["hvd_metrics"]["series"]  # what the tab draws
        assert [step for step, _ in series["loss"]] == [1, 2, 3]
        browser = Browser()
        try:
            browser.log_in(url, user, password)
            browser.open(f"{url}/dags/{DAG}/runs/{run_id}/tasks/train/plugin/training")
            frame = "document.querySelector('iframe[title=Training]')?.contentDocument"
            curves = f"{frame}?.querySelectorAll('svg path.curve')"
            browser.wait_for(f"({curves}?.length || 0) >= 1", what="a curve in the Training tab")
            points = browser.evaluate(f"Array.from({curves}).map(p => p.getAttribute('d').split(' ').length)")
        finally:
            browser.close()
        assert points and all(count == 3 for count in points), points  # one point per epoch
        processes = family(proc.pid)
    finally:
        stop_started = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C in its terminal
        code = proc.wait(180)
        stop_s = time.monotonic() - stop_started
        output.close()
    assert code == 0 and output.lines[-1].strip() == "stopped", output.text
    assert not still_running(processes), f"still running after Ctrl-C: {still_running(processes)}"
    with pytest.raises(OSError):  # nothing listens on its port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    print(f"ready after {ready_s:.0f}s, stopped in {stop_s:.0f}s")


INTERRUPTED_AS_AIRFLOW_STARTS = """
import os, runpy, signal, subprocess, sys

class InterruptedAsItStarts(subprocess.Popen):  # Ctrl-C after standalone's fork, before its pid is returned
    def __init__(self, args, **kwargs):
        super().__init__([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]], **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

subprocess.Popen = InterruptedAsItStarts  # (a stand-in for `airflow standalone`, tagged: the test finds it)
script = runpy.run_path(sys.argv[2])
sys.exit(script["main"](["--port", sys.argv[3]]))
"""


def test_ctrl_c_as_airflow_starts_leaves_nothing(tmp_path):
    """Before: a Ctrl-C while Popen waited for standalone's exec (a few ms) ended the command without its pid:
    Airflow lived on, with nobody to stop it."""
    import uuid

    tag = f"hvd-airflow-{uuid.uuid4().hex}"
    started = subprocess.run(
        [
            sys.executable,
            "-c",
            INTERRUPTED_AS_AIRFLOW_STARTS,
            tag,
            str(ROOT / "scripts" / "local_airflow.py"),
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow_home")},
    )
    left = kill_tagged(tag)
    assert not left, f"Airflow outlived its start command: {started}"
    assert "stopped" in started.stdout, started
