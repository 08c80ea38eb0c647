"""What a user sees on the terminal of a script that runs HorovodRunner: the ranks' lines, without Spark's console
progress bar mixed into them, on the session the runner starts and on one made as docs/guide/logs.md says."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guide" / "logs.md"

RUNS = """
from airflow_provider_hvd import HorovodRunner


def train():
    import time

    for i in range(3):
        print(f"line {{i}} of this rank", flush=True)
        time.sleep(0.6)  # the run lasts past the 0.5 s after which Spark draws a stage's bar


def stop_session():
    from pyspark.sql import SparkSession

    SparkSession.getActiveSession().stop()


# first: pyspark's builder keeps the settings of the sessions made before (on the class)
print("== a session of Spark's defaults", flush=True)
from pyspark.sql import SparkSession

SparkSession.builder.getOrCreate()
HorovodRunner(np=2, driver_log_verbosity="all").run(train)
stop_session()
print("== the runner's session", flush=True)
HorovodRunner(np=2, driver_log_verbosity="all").run(train)
stop_session()
print("== the page's session", flush=True)
{page}
HorovodRunner(np=2, driver_log_verbosity="all").run(train)
"""


def page_snippet() -> str:
    section = DOCS.read_text().split("## Spark's progress bar on the same terminal", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def on_a_terminal(code: str) -> str:
    """What ``python -c code`` writes to a terminal (a pseudo-terminal)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: every end of the terminal closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    written = b"".join(chunks).decode(errors="replace")
    assert proc.wait(300) == 0, written[-3000:]
    return written


def as_shown(written: str) -> list[str]:
    """The lines as the terminal shows them: what follows a carriage return overwrites the line from its start."""
    shown = []
    for line in written.split("\n"):
        screen = ""
        for part in line.rstrip("\r").split("\r"):
            screen = part + screen[len(part) :]
        shown.append(screen)
    return shown


def test_the_ranks_lines_show_whole_without_sparks_progress_bar():
    written = on_a_terminal(RUNS.format(page=page_snippet()))
    defaults, runner, page = (part.split("\n", 1)[1] for part in written.split("== ")[1:])
    for part in (runner, page):
        assert "[Stage" not in part, part
        for rank in range(2):
            for i in range(3):
                assert f"[rank {rank}] line {i} of this rank" in as_shown(part), part
    assert "[Stage" in defaults, "a session with the bar on draws it here (the checks above can fail)"
