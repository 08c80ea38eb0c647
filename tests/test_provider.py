"""Registration with Airflow, and the core's independence from it."""

from __future__ import annotations

import subprocess
import sys


def test_task_horovod_resolves_through_the_provider_registration():
    from airflow.sdk import task
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    from airflow_provider_hvd import horovod_task

    assert "airflow-provider-hvd" in ProvidersManagerTaskRuntime().providers
    assert task.horovod is horovod_task


def test_task_torch_distributed_and_its_operator_are_declared_to_airflow():
    from airflow.sdk import task

    from airflow_provider_hvd.decorators.torch_distributed import torch_distributed_task
    from airflow_provider_hvd.get_provider_info import get_provider_info

    assert task.torch_distributed is torch_distributed_task
    modules = {m for entry in get_provider_info()["operators"] for m in entry["python-modules"]}
    assert "airflow_provider_hvd.operators.torch_distributor" in modules


def test_the_spark_connection_type_stays_the_apache_spark_providers():
    from airflow.providers_manager import ProvidersManager

    from airflow_provider_hvd.get_provider_info import get_provider_info

    assert "connection-types" not in get_provider_info()
    hook = ProvidersManager().hooks["spark"]
    assert hook is not None and hook.package_name == "apache-airflow-providers-apache-spark"


def test_the_core_runner_imports_no_airflow():
    code = (
        "import sys; from airflow_provider_hvd import HorovodRunner, log_to_driver; "
        "import airflow_provider_hvd.horovod.keras; "
        "sys.exit(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')) != [])"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
