"""A Python file run as ``__main__`` in a rank, as ``torchrun FILE ARGS`` would (``TorchDistributor.run(path)``).

The file's content travels with the job: where the same file is at the same path (local runs, a shared file
system) it runs there, so that modules beside it import; elsewhere a copy is written to the rank's folder,
removed when the rank has ended (after its error was reported, so that the traceback shows the lines), however
it ended (:mod:`..reaper`).
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

from ..reaper import RANK_DIR_ENV


def _here(path: str, source: bytes) -> str:
    """``path`` when it holds ``source`` on this host, else a copy of ``source`` under the same name."""
    try:
        if Path(path).read_bytes() == source:
            return path
    except OSError:
        pass
    copy_dir = tempfile.mkdtemp(prefix="hvd-script-", dir=os.environ.get(RANK_DIR_ENV))
    atexit.register(shutil.rmtree, copy_dir, True)  # (the rank's folder goes too, once the rank has ended)
    copy = os.path.join(copy_dir, os.path.basename(path))
    Path(copy).write_bytes(source)
    return copy


def run_script(path: str, source: bytes, argv: list[str]) -> None:
    """Run ``source`` (the file ``path`` on the driver) as ``__main__`` with ``argv`` as its arguments."""
    here = _here(path, source)
    sys.argv = [here, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(here)))
    runpy.run_path(here, run_name="__main__")
