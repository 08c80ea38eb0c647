"""Progress in an Airflow task (dag.test() on SQLite): the task state store keys, their bounds, the plugin's page."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from urllib.parse import quote

import pytest
from dag_runs import states, stored

from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY, METRICS_KEY, RESTARTS_KEY, TaskStateProgress
from airflow_provider_hvd.runner.driver.tracking.progress import MetricsHistory

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


def test_the_restarts_key_keeps_the_first_and_the_latest_attempts_within_its_bound(monkeypatch):
    """A run that restarted 300 times, each cause long and each checkpoint's info large: hvd_restarts fits the
    store, with the first attempt and the latest ones."""
    monkeypatch.setenv("AIRFLOW__STATE_STORE__MAX_VALUE_STORAGE_BYTES", "20000")
    store = DictStore()
    sink = TaskStateProgress(store, try_number=2)
    checkpoint = {"path": "/ckpt/epoch-3.pt", "epoch": 3, "notes": "n" * 5000, "rank": 0, "reported_at": "t"}
    records = [
        {
            "attempt": n,
            "size": 4,
            "started_at": "s",
            "ended_at": "e",
            "cause_kind": "signal",
            "cause": "c" * 3000,
            "resumed_from": None if n == 1 else checkpoint,
            "first_step": n,
        }
        for n in range(1, 301)
    ]
    sink.restarts(records[:2])
    small = store.get(RESTARTS_KEY)
    assert (small["try_number"], small["restarts"], small["left_out"]) == (2, 1, 0)
    assert small["attempts"][0]["resumed_from"] is None and len(small["attempts"][0]["cause"]) == 500
    assert small["attempts"][1]["resumed_from"] == {"path": "/ckpt/epoch-3.pt", "info_left_out": True}
    sink.restarts(records)
    bounded = store.get(RESTARTS_KEY)
    assert len(store.values[RESTARTS_KEY]) <= 20000 and bounded["restarts"] == 299
    kept = [attempt["attempt"] for attempt in bounded["attempts"]]
    assert kept[0] == 1 and kept[1:] == list(range(301 - len(kept[1:]), 301)) and len(kept) > 2
    assert bounded["left_out"] == 300 - len(kept)


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


def test_the_example_dag_leaves_its_curves_and_checkpoint_in_the_task_state_store(example_run):
    values = stored(example_run, "train")
    metrics, checkpoint = values[METRICS_KEY], values[CHECKPOINT_KEY]
    assert [step for step, _ in metrics["series"]["loss"]] == list(range(1, 9))
    assert set(metrics["series"]) == {"loss", "accuracy"} and metrics["try_number"] == 1
    assert metrics["series"]["accuracy"][-1][1] > 0.9
    assert checkpoint["epoch"] == 8 and checkpoint["path"].endswith("epoch-8.pt") and checkpoint["finished"] is True


@pytest.mark.usefixtures("airflow_db", "spark_default_local")
def test_a_retry_that_resumes_and_finishes_at_once_marks_the_checkpoint_finished(dags, tmp_path):
    """Try 1 reports epoch 2 of 2, then fails; try 2 resumes from it, has nothing left to train and reports no
    checkpoint of its own: the run is finished all the same (a later run of the task starts afresh)."""
    run = dags["hvd_resume"].test(run_conf={"ckpt_dir": str(tmp_path), "fail_after_epoch": 2, "epochs": 2})
    assert states(run) == {"train": "success"}
    checkpoint = stored(run, "train")[CHECKPOINT_KEY]
    assert checkpoint["path"] == str(tmp_path / "epoch-2.pt") and checkpoint["try_number"] == 1
    assert checkpoint.get("finished") is True, checkpoint


@pytest.mark.usefixtures("airflow_db", "spark_default_local")
def test_a_store_that_fails_after_a_successful_training_is_a_warning_not_a_failed_task(
    dags, tmp_path, monkeypatch, caplog
):
    """Every task state store write raises (a retention the store refuses): the training succeeded, so the task
    does; the log says what could not be recorded."""
    monkeypatch.setenv("AIRFLOW__STATE_STORE__DEFAULT_RETENTION_DAYS", "-1")
    run = dags["hvd_resume"].test(run_conf={"ckpt_dir": str(tmp_path), "epochs": 1})
    assert states(run) == {"train": "success"}
    assert "could not be marked finished in the task state store" in caplog.text, caplog.text[-3000:]


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


def _injected(field: str) -> str:
    """Markup that, if the page ran it, records ``field`` in ``window.ran`` (a script and an event handler)."""
    record = f"window.ran=(window.ran||[]).concat(['{field}'])"
    return f'<script>{record}</script><img src="x" onerror="{record}">'


def test_the_training_page_runs_no_markup_from_the_store(example_run, monkeypatch):
    """Before: rank, try_number, reports and thinned_by went into the page unescaped (any task can write its
    store), and a thinned_by that is not a number failed the page."""
    import socket
    import threading
    import urllib.request

    import uvicorn
    from airflow.api_fastapi.app import create_app
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.models.task_state_store import TaskStateStoreModel
    from airflow.utils.session import create_session
    from browser import Browser, chromium_path
    from sqlalchemy import delete, select, update
    from starlette.routing import Mount

    from airflow_provider_hvd.plugins.training_tab import TAB_HREF, TrainingTabPlugin

    if chromium_path() is None:
        pytest.fail("no chromium on PATH: `apt-get install -y chromium` (make setup does)")
    fields = ["rank", "try_number", "reports", "updated", "thinned_by"]
    metrics = {field: _injected(field) for field in fields}
    metrics["series"] = {_injected("series name"): [[1, 0.5], [_injected("step"), _injected("value")], [3, 0.25]]}
    checkpoint = {"path": _injected("path"), "epoch": _injected("info"), "reported_at": _injected("reported_at")}
    checkpoint["try_number"] = _injected("checkpoint try_number")
    restart_fields = ["started_at", "cause", "cause_kind", "restart path", "restarts", "left_out", "size"]
    injected = {field: _injected(field) for field in restart_fields}
    restarts = {
        "try_number": metrics["try_number"],  # (the curves' try: the restart is drawn on them too)
        "restarts": injected["restarts"],
        "left_out": injected["left_out"],
        "attempts": [
            {"attempt": 1, "cause": injected["cause"], "cause_kind": injected["cause_kind"]},
            {
                "attempt": 2,
                "started_at": injected["started_at"],
                "size": injected["size"],
                "resumed_from": {"path": injected["restart path"]},
                "first_step": "not a step",
            },
        ],
    }
    before = stored(example_run, "train")
    where = (
        TaskStateStoreModel.dag_id == example_run.dag_id,
        TaskStateStoreModel.run_id == example_run.run_id,
        TaskStateStoreModel.task_id == "train",
    )

    def store(values: dict) -> None:
        with create_session() as session:
            for key, value in values.items():
                if key not in before:  # (written by this test: a restart the example run had none of)
                    row = session.execute(select(TaskStateStoreModel).where(*where)).scalars().first()
                    session.add(
                        TaskStateStoreModel(
                            dag_run_id=row.dag_run_id,
                            task_id="train",
                            map_index=-1,
                            key=key,
                            dag_id=row.dag_id,
                            run_id=row.run_id,
                            value=json.dumps(value),
                        )
                    )
                    continue
                session.execute(
                    update(TaskStateStoreModel)
                    .where(*where, TaskStateStoreModel.key == key)
                    .values(value=json.dumps(value))
                )

    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "hvd-tests-only")
    app = create_app()
    plugin_app = TrainingTabPlugin.fastapi_apps[0]
    app.router.routes.insert(0, Mount(plugin_app["url_prefix"], app=plugin_app["app"]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    store({METRICS_KEY: metrics, CHECKPOINT_KEY: checkpoint, RESTARTS_KEY: restarts})
    serving.start()
    browser = None
    try:
        while not server.started and serving.is_alive():
            time.sleep(0.05)
        password = SimpleAuthManager.get_passwords()["admin"]
        request = urllib.request.Request(
            f"{base}/auth/token",
            data=json.dumps({"username": "admin", "password": password}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            token = json.loads(reply.read())["access_token"]
        browser = Browser()
        browser.call("Network.enable", session=True)
        browser.call("Network.setExtraHTTPHeaders", session=True, headers={"Authorization": f"Bearer {token}"})
        url = TAB_HREF.format(
            DAG_ID="horovod_train_example", RUN_ID=quote(example_run.run_id, safe=""), TASK_ID="train", MAP_INDEX=-1
        )
        browser.open(base + url)
        browser.wait_for("!!document.querySelector('#checkpoint')", what="the Training page")
        browser.wait_for("document.readyState === 'complete'", what="the page and its images loaded")
        assert browser.evaluate("window.ran || []") == []
        text = browser.evaluate("document.body.innerText")
        for field in [*fields, "path", "info", "reported_at", "checkpoint try_number", *restart_fields]:
            assert _injected(field) in text, (field, text)  # shown as the text it is
        assert browser.evaluate("document.querySelectorAll('#panel script, #panel img').length") == 0
        assert browser.evaluate("document.querySelectorAll('path.curve').length") == 1  # the numbers are drawn
        hover = browser.evaluate("document.querySelector('g.restart[data-attempt=\"2\"] title').textContent")
        assert _injected("cause") in hover and _injected("restart path") in hover, hover
    finally:
        if browser is not None:
            browser.close()
        server.should_exit = True
        serving.join(30)
        store(before)
        with create_session() as session:
            session.execute(delete(TaskStateStoreModel).where(*where, TaskStateStoreModel.key == RESTARTS_KEY))
