"""Registration with Airflow (its schema, what its CLI lists), and the core's independence from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


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


def test_the_provider_info_fits_airflows_schema_and_names_what_exists():
    import importlib

    import airflow
    import jsonschema

    from airflow_provider_hvd.get_provider_info import get_provider_info

    info = get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    # the schema leaves the items of `plugins` and `task-decorators` open: the keys ProvidersManager reads
    assert all(set(plugin) == {"name", "plugin-class"} for plugin in info["plugins"])
    assert all(set(decorator) == {"name", "class-name"} for decorator in info["task-decorators"])
    names = [
        *info["extra-links"],
        *(plugin["plugin-class"] for plugin in info["plugins"]),
        *(decorator["class-name"] for decorator in info["task-decorators"]),
    ]
    for name in names:
        module, _, attribute = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attribute), name


@pytest.fixture(scope="module")
def airflow_cli(tmp_path_factory):
    """``airflow ARGS -o json`` in the tests' Airflow home, with the providers discovered eagerly
    (``[core] lazy_discover_providers=False``: only then does Airflow read the provider info's ``plugins``)."""
    env = {**os.environ, "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": "False"}
    cwd = tmp_path_factory.mktemp("cli")  # not the source tree, whose egg-info would list the package twice

    def airflow(*args: str):
        done = subprocess.run(
            [str(Path(sys.executable).with_name("airflow")), *args, "-o", "json"],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    return airflow


def test_airflows_cli_lists_what_the_provider_declares(airflow_cli):
    from airflow_provider_hvd.get_provider_info import get_provider_info

    declared = get_provider_info()
    [provider] = airflow_cli("providers", "get", "airflow-provider-hvd", "--full")
    shown = {key for key in declared if key != "description"}  # the CLI strips its final full stop
    assert {key: provider[key] for key in shown} == {key: declared[key] for key in shown}
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert provider["documentation-url"] == pyproject["project"]["urls"]["Documentation"]
    links = {row["extra_link_class_name"] for row in airflow_cli("providers", "links")}
    assert set(declared["extra-links"]) <= links
    # the plugin comes from its entry point too (the only source with lazy discovery, Airflow's default): loaded
    # once, the provider info's declaration of it skipped as the same plugin
    plugins = [plugin for plugin in airflow_cli("plugins") if plugin["name"] == "hvd_training"]
    assert len(plugins) == 1
    assert [view["name"] for view in plugins[0]["external_views"]] == ["Training"]
    assert [app["url_prefix"] for app in plugins[0]["fastapi_apps"]] == ["/hvd-training"]
