"""Progress in an Airflow task (dag.test() on SQLite): the task state store keys, their bounds, the plugin's page."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import quote

import pytest

from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY, METRICS_KEY, TaskStateProgress
from airflow_provider_hvd.runner.driver.progress import MetricsHistory

LOCAL2 = json.dumps({"conn_type": "spark", "host": "local[2]"})


class DictStore:
    """The task state store's get/set, in a dict; values go through JSON as Airflow's do."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def get(self, key, default=None):
        return json.loads(self.values[key]) if key in self.values else default

    def set(self, key, value, *, retention=None):
        self.values[key] = json.dumps(value, allow_nan=False)


def test_a_retry_resumes_only_from_an_unfinished_try():
    store = DictStore()
    first = TaskStateProgress(store, try_number=1)
    assert first.last_checkpoint() is None
    first.checkpoint({"path": "/c/epoch-3.pt", "epoch": 3, "rank": 0, "reported_at": "t"})
    second = TaskStateProgress(store, try_number=2)
    assert second.last_checkpoint() == {
        "path": "/c/epoch-3.pt",
        "epoch": 3,
        "rank": 0,
        "reported_at": "t",
        "try_number": 1,
    }
    second.mark_finished({"path": "/c/epoch-6.pt", "epoch": 6, "rank": 0, "reported_at": "u", "try_number": None})
    assert store.get(CHECKPOINT_KEY)["try_number"] == 2
    assert TaskStateProgress(store, try_number=3).last_checkpoint() is None, "a finished run is not resumed"
    store.set(CHECKPOINT_KEY, "not a checkpoint")
    assert TaskStateProgress(store, try_number=4).last_checkpoint() is None


def test_the_metrics_key_keeps_under_a_lower_configured_limit(monkeypatch):
    monkeypatch.setenv("AIRFLOW__STATE_STORE__MAX_VALUE_STORAGE_BYTES", "20000")
    store = DictStore()
    sink = TaskStateProgress(store, try_number=1)
    history = MetricsHistory()
    for step in range(5000):
        history.add(step, {"loss": 1 / (step + 1), "accuracy": step / 5000})
    sink.metrics(history.snapshot(sink.max_bytes, rank=0))
    assert len(store.values[METRICS_KEY]) <= 20000
    assert store.get(METRICS_KEY)["series"]["loss"][-1][0] == 4999


@pytest.fixture(scope="module")
def example_run():
    import os

    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    from airflow.dag_processing.dagbag import DagBag

    os.environ["AIRFLOW_CONN_SPARK_DEFAULT"] = LOCAL2
    try:
        bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
        return bag.dags["horovod_train_example"].test()
    finally:
        del os.environ["AIRFLOW_CONN_SPARK_DEFAULT"]


def stored(run, task_id: str) -> dict:
    from airflow.models.task_state_store import TaskStateStoreModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(TaskStateStoreModel.key, TaskStateStoreModel.value).where(
                TaskStateStoreModel.dag_id == run.dag_id,
                TaskStateStoreModel.run_id == run.run_id,
                TaskStateStoreModel.task_id == task_id,
            )
        ).all()
    return {row.key: json.loads(row.value) for row in rows}


def test_the_example_dag_leaves_its_curves_and_checkpoint_in_the_task_state_store(example_run):
    values = stored(example_run, "train")
    metrics, checkpoint = values[METRICS_KEY], values[CHECKPOINT_KEY]
    assert [step for step, _ in metrics["series"]["loss"]] == list(range(1, 9))
    assert set(metrics["series"]) == {"loss", "accuracy"} and metrics["try_number"] == 1
    assert metrics["series"]["accuracy"][-1][1] > 0.9
    assert checkpoint["epoch"] == 8 and checkpoint["path"].endswith("epoch-8.pt") and checkpoint["finished"] is True


def test_the_training_page_draws_each_metric(example_run, monkeypatch):
    """The plugin's app, as the API server mounts it, with an admin's token (the browser test is on the deployment)."""
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "hvd-tests-only")
    from airflow.api_fastapi.app import create_app
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from fastapi.testclient import TestClient
    from starlette.routing import Mount

    from airflow_provider_hvd.plugins.training_tab import TAB_HREF, TrainingTabPlugin

    app = create_app()
    plugin_app = TrainingTabPlugin.fastapi_apps[0]
    # where the API server mounts plugins: before the UI's catch-all route
    app.router.routes.insert(0, Mount(plugin_app["url_prefix"], app=plugin_app["app"]))
    with TestClient(app) as client:
        url = TAB_HREF.format(
            DAG_ID="horovod_train_example", RUN_ID=quote(example_run.run_id, safe=""), TASK_ID="train", MAP_INDEX=-1
        )
        assert client.get(url).status_code == 401
        password = SimpleAuthManager.get_passwords()["admin"]  # the simple auth manager's generated one
        token = client.post("/auth/token", json={"username": "admin", "password": password}).json()["access_token"]
        page = client.get(url, headers={"Authorization": f"Bearer {token}"})
        assert page.status_code == 200, page.text
        # the UI fills {MAP_INDEX} only for a mapped task: for this one, the href comes with it as it is
        as_the_ui_makes_it = (
            TAB_HREF.replace("{DAG_ID}", "horovod_train_example")
            .replace("{RUN_ID}", quote(example_run.run_id, safe=""))
            .replace("{TASK_ID}", "train")
        )
        assert "{MAP_INDEX}" in as_the_ui_makes_it
        unmapped = client.get(as_the_ui_makes_it, headers={"Authorization": f"Bearer {token}"})
        assert (unmapped.status_code, unmapped.text) == (200, page.text)
        bad = client.get(url.replace("map_index=-1", "map_index=x"), headers={"Authorization": f"Bearer {token}"})
        assert bad.status_code == 422 and "map_index must be -1 or more, not 'x'" in bad.text
        assert page.text.count('<path class="curve" data-metric=') == 2
        assert 'data-live="false"' in page.text and "Last checkpoint: " in page.text
        assert (
            client.get(url.replace("/train?", "/nope?"), headers={"Authorization": f"Bearer {token}"}).status_code
            == 404
        )
