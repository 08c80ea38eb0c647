"""Long runs on a real deployment (`airflow standalone` with a login, the loopback standalone Spark cluster), as a
user checks them: through the REST API and in headless Chromium.

- a retry resumes from the checkpoint its first try reported, and ends with the model of a run that never failed;
- the metrics history and the last checkpoint are in the task state store;
- the "Training" tab draws the curves while the task runs, and checks access as the API server does.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from airflow_deployment import AirflowDeployment, log_text, show_log_if_failed
from browser import Browser, chromium_path

pytestmark = pytest.mark.timeout(2400)

DAG = "hvd_resume"
PASSWORD = "hvd-tests-admin"
ARTIFACTS = Path(os.environ.get("HVD_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


def plugin_installed() -> bool:
    return any(ep.name == "hvd_training" for ep in importlib.metadata.entry_points(group="airflow.plugins"))


class LoggedInDeployment(AirflowDeployment):
    """The deployment with the simple auth manager's login: one admin, whose token the REST client sends."""

    def _ready(self, dag_ids: list[str]) -> bool:
        if "Authorization" not in self.api.headers:
            try:
                resp = httpx.post(
                    f"{self.url}/auth/token", json={"username": "admin", "password": PASSWORD}, timeout=10
                )
            except httpx.HTTPError:
                return False
            if resp.status_code != 201:
                return False
            self.api.headers["Authorization"] = f"Bearer {resp.json()['access_token']}"
        return super()._ready(dag_ids)


@pytest.fixture(scope="module")
def airflow(standalone_cluster, postgres, tmp_path_factory, request):
    home = tmp_path_factory.mktemp("airflow-long-runs")
    (home / "passwords.json").write_text(json.dumps({"admin": PASSWORD}))
    plugins = home / "plugins"
    plugins.mkdir()
    if not plugin_installed():  # this tree's pyproject.toml registers it; an older editable install does not
        (plugins / "hvd_training_tab.py").write_text(
            "from airflow_provider_hvd.plugins.training_tab import TrainingTabPlugin  # noqa: F401\n"
        )
    spark_default = {
        "conn_type": "spark",
        "host": "spark://127.0.0.1",
        "port": standalone_cluster.port,
        "extra": {"spark.executor.cores": "1", **standalone_cluster.app_conf},
    }
    env = {
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(spark_default),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),
    }
    failed_before = request.session.testsfailed
    database = postgres.create_database("airflow_long_runs")
    deployment = LoggedInDeployment(home, os.environ["AIRFLOW__CORE__DAGS_FOLDER"], database, env)
    try:
        deployment.start([DAG], timeout=600)
    except BaseException:
        deployment.stop()
        raise
    yield deployment
    deployment.stop()
    show_log_if_failed(request, deployment, failed_before)


@pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium (make setup installs it)")
def test_the_training_tab_draws_the_curves_live_in_a_browser(airflow, tmp_path):
    EPOCHS = 10  # noqa: N806 - 1 s each once released: the tab refreshes every 3 s while the task runs
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    release = tmp_path / "release"  # the ranks wait after the first epoch until it exists: the tab is seen live
    params = {"ckpt_dir": str(ckpt_dir), "epochs": EPOCHS, "epoch_pause_s": 1.0, "hold_until": str(release)}
    run_id = airflow.trigger(DAG, params)
    deadline = time.monotonic() + 600
    while "hvd_metrics" not in airflow.state_store(DAG, run_id, "train"):  # the first epoch's metrics are written
        assert time.monotonic() < deadline, log_text(airflow.task_log(DAG, run_id, "train"))
        time.sleep(3)  # gently: the API server shares the 2 cores with the task
    browser = Browser()
    try:
        browser.log_in(airflow.url, "admin", PASSWORD)
        browser.open(f"{airflow.url}/dags/{DAG}/runs/{run_id}/tasks/train/plugin/training")
        frame = "document.querySelector('iframe[title=Training]')?.contentDocument"
        curves = f"{frame}?.querySelectorAll('svg path.curve')"
        points = f"Array.from({curves} || []).map(p => p.getAttribute('d').split(' ').length)"
        browser.wait_for(f"({curves}?.length || 0) == 2", what="two curves in the Training tab")
        assert browser.evaluate(f"{frame}.querySelector('[data-live]').dataset.live") == "true", "drawn while running"
        first = browser.evaluate(f"{points}[0]")
        release.touch()  # the next epochs: the tab must draw them without a reload
        browser.wait_for(f"{points}[0] > {first}", timeout=60, what="the curve growing without a reload")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.screenshot(ARTIFACTS / "training-tab-live.png")
        assert airflow.wait_for_run(DAG, run_id, timeout=600) == "success"
        browser.wait_for(f"{frame}.querySelector('[data-live]').dataset.live == 'false'", what="the tab sees the end")
        assert browser.evaluate(f"{points}[0]") == EPOCHS, "one point per epoch"
        assert f"Last checkpoint: {ckpt_dir / f'epoch-{EPOCHS}.pt'}" in browser.evaluate(f"{frame}.body.innerText")
        shot = browser.screenshot(ARTIFACTS / "training-tab.png")
    finally:
        release.touch()  # a failed look lets the run go on too
        browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("HVD_UPDATE_DOCS_SCREENSHOT"):
        images = Path(__file__).resolve().parent.parent / "docs" / "images"
        images.mkdir(exist_ok=True)
        shutil.copy(shot, images / "training-tab.png")


@pytest.fixture(scope="module")
def runs(airflow, tmp_path_factory):
    """A run that never fails, and one whose first try fails after epoch 3: same seed, same data."""
    done = {}
    for name, fail_after_epoch in (("never_failed", 0), ("retried", 3)):  # one after the other: one job fits
        ckpt_dir = tmp_path_factory.mktemp(f"ckpt-{name}")
        run_id = airflow.trigger(DAG, {"ckpt_dir": str(ckpt_dir), "fail_after_epoch": fail_after_epoch})
        done[name] = (run_id, airflow.wait_for_run(DAG, run_id, timeout=600), ckpt_dir)
    return done


def test_a_retry_resumes_from_the_last_checkpoint_and_ends_with_the_same_model(airflow, runs):
    run_id, state, ckpt_dir = runs["retried"]
    first, second = (airflow.task_log(DAG, run_id, "train", n) for n in (1, 2))
    assert state == "success", log_text(first + second)
    assert airflow.task_instance(DAG, run_id, "train")["try_number"] == 2
    assert "simulated failure after epoch 3" in log_text(first)
    assert f"resuming from {ckpt_dir}/epoch-3.pt (epoch=3), reported by try 1" in log_text(second), log_text(second)
    resumed = airflow.xcom(DAG, run_id, "train")
    assert resumed["resumed_from"]["epoch"] == 3 and resumed["resumed_from"]["try_number"] == 1
    assert resumed["epochs_trained"] == [4, 5, 6], "try 2 starts at epoch 4"

    never_run_id, never_state, _ = runs["never_failed"]
    assert never_state == "success"
    never_failed = airflow.xcom(DAG, never_run_id, "train")
    assert never_failed["resumed_from"] is None and never_failed["epochs_trained"] == [1, 2, 3, 4, 5, 6]
    assert resumed["weights_sha256"] == never_failed["weights_sha256"], "the final model differs"


def test_the_task_state_store_holds_the_metrics_and_the_last_checkpoint(airflow, runs):
    run_id, _, ckpt_dir = runs["retried"]
    stored = airflow.state_store(DAG, run_id, "train")
    checkpoint = stored["hvd_checkpoint"]
    assert checkpoint["path"] == f"{ckpt_dir}/epoch-6.pt" and checkpoint["epoch"] == 6
    assert checkpoint["try_number"] == 2 and checkpoint["rank"] == 0 and checkpoint["finished"] is True
    metrics = stored["hvd_metrics"]
    assert metrics["try_number"] == 2 and metrics["rank"] == 0
    assert [step for step, _ in metrics["series"]["loss"]] == [4, 5, 6]
    assert set(metrics["series"]) == {"loss", "accuracy"}
    assert len(json.dumps(stored["hvd_metrics"])) < 65_535


def test_the_training_tab_needs_the_same_access_as_the_task_instance(airflow, runs):
    run_id, _, _ = runs["never_failed"]
    url = f"{airflow.url}/hvd-training/dags/{DAG}/runs/{run_id}/tasks/train"
    assert httpx.get(url, timeout=30).status_code == 401, "no credentials"
    assert httpx.get(url, headers={"Authorization": "Bearer not-a-token"}, timeout=30).status_code == 403
    page = httpx.get(url, headers={"Authorization": airflow.api.headers["Authorization"]}, timeout=30)
    assert page.status_code == 200 and page.text.count('class="curve"') == 2
    plugins = airflow._json("GET", "/plugins")["plugins"]
    views = [view for plugin in plugins for view in plugin["external_views"] if view["name"] == "Training"]
    assert [(view["destination"], view["url_route"]) for view in views] == [("task_instance", "training")]
