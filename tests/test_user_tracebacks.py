"""The user's own file and line in a failing rank's traceback and in a stalled rank's stacks, for code shipped by
value: a script's ``__main__``, a helper module beside it, a notebook cell (code IPython compiles under a file
name of its own and registers in ``linecache``), and a DAG file (tests/test_torch_airflow.py). Before: every such
frame read ``File "<dynamic-code>", line 6, in failing_main``, with no source line (cloudpickle 3.1.3 renames the
code it pickles by value)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = '''
import json, linecache
import helper
from airflow_provider_hvd import RankFailedError, RunStalledError, TorchDistributor


def failing_main(x):
    y = x + 1
    raise ValueError(f"main fails with {y}")


# what IPython does with a cell: compile it under a made-up file name, whose lines only linecache holds
CELL = """import time


def cell_main(x):
    raise KeyError(f"cell fails with {x}")


def cell_waits():
    time.sleep(600)  # a read that never returns
"""
CELL_FILE = "/tmp/ipykernel_4242/2718281828.py"
linecache.cache[CELL_FILE] = (len(CELL), None, CELL.splitlines(True), CELL_FILE)
exec(compile(CELL, CELL_FILE, "exec"), globals())

found = {}
for fn in (failing_main, helper.failing_helper, cell_main):
    try:
        TorchDistributor(2, local_mode=True, use_gpu=False).run(fn, 1)
    except RankFailedError as exc:
        found[fn.__name__] = {"traceback": exc.remote_traceback, "message": str(exc)}
try:
    TorchDistributor(2, local_mode=True, use_gpu=False, stall_timeout=2).run(cell_waits)
except RunStalledError as exc:
    found["cell_waits"] = {"message": str(exc)}
print("FOUND " + json.dumps(found))
'''

HELPER = """def failing_helper(x):
    y = x * 10
    raise ValueError(f"helper fails with {y}")
"""


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    """``python job.py`` (with helper.py beside it): each run's traceback and message, by function."""
    folder = tmp_path_factory.mktemp("script")
    (folder / "job.py").write_text(SCRIPT)
    (folder / "helper.py").write_text(HELPER)
    proc = subprocess.run(
        [sys.executable, "job.py"], cwd=folder, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FOUND "))
    return {"folder": str(folder), **json.loads(line.removeprefix("FOUND "))}


@pytest.mark.parametrize(
    ("fn", "file", "where"),
    [
        ("failing_main", "job.py", 'line 9, in failing_main\n    raise ValueError(f"main fails with {y}")\n'),
        ("failing_helper", "helper.py", 'line 3, in failing_helper\n    raise ValueError(f"helper fails with {y}")\n'),
        ("cell_main", "/tmp/ipykernel_4242/2718281828.py", 'line 5, in cell_main\n    raise KeyError(f"cell'),
    ],
    ids=["__main__", "a helper beside the script", "a notebook cell"],
)
def test_a_failing_rank_s_traceback_shows_the_user_s_file_line_and_source(found, fn, file, where):
    path = file if file.startswith("/") else f"{found['folder']}/{file}"
    frame = f'File "{path}", {where}'
    assert frame in found[fn]["traceback"], found[fn]["traceback"]
    assert frame in found[fn]["message"]  # the error's text, which the task log shows
    assert "<dynamic-code>" not in found[fn]["message"]


def test_a_stalled_rank_s_stacks_name_the_notebook_cell(found):
    message = found["cell_waits"]["message"]
    assert "was in cell_waits (/tmp/ipykernel_4242/2718281828.py, line 9)" in message, message
    assert "<dynamic-code>" not in message
