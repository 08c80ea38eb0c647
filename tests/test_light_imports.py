"""Airflow imports every provider to discover it, on every component (API server, dag processor, triggerer),
and parses DAG files where no training runs: neither may need Horovod, torch or pyspark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DAGS = sorted((Path(__file__).resolve().parent.parent / "dags").glob("*.py"))
HEAVY = ("horovod", "torch", "pyspark", "tensorflow", "keras", "transformers", "accelerate", "lightning")

# run first in a fresh interpreter: any import of a HEAVY module fails, as it would where it is not installed
_BLOCK = f"""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"{{name}} is blocked by the test", name=name)
sys.meta_path.insert(0, Blocked())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, timeout=120)


def test_provider_discovery_and_the_package_import_nothing_heavy():
    proc = _run(
        "import airflow_provider_hvd\n"
        "from airflow_provider_hvd.get_provider_info import get_provider_info\n"
        "assert get_provider_info()['package-name'] == 'airflow-provider-hvd'\n"
        "from airflow_provider_hvd import HorovodRunner, HorovodRunnerOperator, HorovodHook, horovod_task\n"
        "from airflow_provider_hvd.integrations import last_checkpoint_path\n"  # each framework's module imports it
        f"assert not [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_the_example_dags_parse_without_horovod_torch_or_pyspark():
    assert DAGS
    code = "import runpy\n" + "".join(f"runpy.run_path({str(path)!r})\n" for path in DAGS)
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
