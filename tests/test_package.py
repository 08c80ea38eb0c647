"""The distribution: its metadata as pip and Airflow read it, one version, the license, the top-level names."""

from __future__ import annotations

import email
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import airflow_provider_hvd

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", str(out), str(ROOT)], check=True, capture_output=True)
    return zipfile.ZipFile(next(out.glob("airflow_provider_hvd-*.whl")))


def metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return email.message_from_bytes(wheel.read(name))


def test_the_wheel_says_what_pip_and_airflow_read(wheel):
    meta = metadata(wheel)
    assert meta["Version"] == airflow_provider_hvd.__version__  # the one place it is written
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Framework :: Apache Airflow :: Provider" in meta.get_all("Classifier")
    assert f"Documentation, {PYPROJECT['project']['urls']['Documentation']}" in meta.get_all("Project-URL")
    licenses = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses and b"Apache License" in wheel.read(licenses[0]) and b"Version 2.0" in wheel.read(licenses[0])
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert b"[apache_airflow_provider]" in wheel.read(entry_points)
    # `pip install airflow-provider-hvd` alone must not try to build Horovod from its sdist (it fails on torch
    # >= 2.1): Horovod is the `horovod` extra, which scripts/install_horovod.py satisfies
    requires = meta.get_all("Requires-Dist")
    assert [r for r in requires if r.startswith("horovod")] == ['horovod==0.28.1; extra == "horovod"']


def test_the_build_requirements_fit_the_license_field():
    # an SPDX `license` string and `license-files` (PEP 639) need setuptools >= 77
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]


def test_airflow_shows_the_version_and_documentation_url():
    from airflow.providers_manager import ProvidersManager

    provider = ProvidersManager().providers["airflow-provider-hvd"]
    assert provider.data["versions"] == [airflow_provider_hvd.__version__]
    assert provider.data["documentation-url"] == PYPROJECT["project"]["urls"]["Documentation"]


def test_the_airflow_layer_is_importable_from_the_package_top_on_first_use():
    code = (
        "import sys, airflow_provider_hvd as hvd; "
        "assert 'airflow' not in sys.modules, 'imported Airflow eagerly'; "
        "from airflow_provider_hvd import HorovodHook, HorovodRunnerOperator, horovod_task; "
        "from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator as op; "
        "assert HorovodRunnerOperator is op and HorovodHook.conn_type == 'spark' and callable(horovod_task); "
        "assert {'HorovodHook', 'HorovodRunnerOperator', 'horovod_task'} <= set(hvd.__all__) & set(dir(hvd))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
