"""MLflow in real Airflow (dag.test() on SQLite) with a real tracking server (the ``mlflow_server`` fixture): one
run per try with the Airflow tags, a retry's run linked to the first try's, the "MLflow run" link, the Training
tab's link, a killed task's run KILLED, and the MLflow UI's run page in Chromium (docs/images/mlflow-run.png)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from urllib.parse import quote

import pytest
from dag_runs import killed_once_training, rendered, states, stored, xcom

from airflow_provider_hvd.hooks.mlflow_runs import MLFLOW_KEY

pytestmark = pytest.mark.usefixtures("airflow_db", "spark_default_local")

#: the retry's tracking URI carries a user and this password (the tests' server takes any): none of them may show
PASSWORD = "hvd-uri-pa55word"
ARTIFACTS = Path(os.environ.get("HVD_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
STEPS = 40  # hvd_mlflow_dags.STEPS


def client(url: str):
    from mlflow import MlflowClient

    return MlflowClient(url)


def runs_of(url: str, experiment: str, run_id: str) -> list:
    """The MLflow runs of one Airflow dag run, by try."""
    mlflow = client(url)
    found = mlflow.search_runs(
        [mlflow.get_experiment_by_name(experiment).experiment_id], f"tags.`airflow.run_id` = '{run_id}'"
    )
    return sorted(found, key=lambda run: int(run.data.tags["airflow.try_number"]))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def retried(airflow_db, dags, mlflow_server):
    """hvd_mlflow_retry (local ranks): the first try fails (rank 1 halfway), the retry succeeds; both tracked, in a
    tracking URI with a user and a password. The run, its MLflow runs by try, and the provider's log lines."""
    logger = logging.getLogger("airflow_provider_hvd")
    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        uri = mlflow_server.replace("://", f"://etl:{PASSWORD}@")
        run = dags["hvd_mlflow_retry"].test(run_conf={"tracking_uri": uri, "experiment": "hvd-retries"})
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return run, runs_of(mlflow_server, "hvd-retries", run.run_id), "\n".join(lines.lines)


def test_each_try_is_one_mlflow_run_with_the_airflow_tags_and_the_retry_links_the_first(retried):
    run, (first, second), _ = retried
    assert states(run) == {"train": "success"}
    assert (first.info.status, second.info.status) == ("FAILED", "FINISHED")
    for try_number, mlflow_run in ((1, first), (2, second)):
        tags = mlflow_run.data.tags
        assert {key: tags[key] for key in tags if key.startswith("airflow.")} == {
            "airflow.dag_id": "hvd_mlflow_retry",
            "airflow.task_id": "train",
            "airflow.run_id": run.run_id,
            "airflow.try_number": str(try_number),  # the operator's, not the user's "attempt"... tag
            "airflow.map_index": "-1",
        }
        assert tags["team"] == "vision" and mlflow_run.info.run_name == "hvd_mlflow_retry.train"
    assert "hvd.previous_run_id" not in first.data.tags
    assert second.data.tags["hvd.previous_run_id"] == first.info.run_id
    assert "rank 1 fails on the first try" in first.data.tags["hvd.failure"]
    assert second.data.metrics["loss"] == pytest.approx(0.05 + 2.0 * 2.718281828 ** (-STEPS / 10), abs=0.1)


def test_the_task_links_the_latest_try_s_run(retried, mlflow_server):
    run, (first, second), log = retried
    url = f"{mlflow_server}/#/experiments/{second.info.experiment_id}/runs/{second.info.run_id}"
    assert xcom(run, "train", "_link_MlflowRunLink") == url  # the "MLflow run" extra link
    assert stored(run, "train")[MLFLOW_KEY] == {"run_id": second.info.run_id, "url": url, "try_number": 2}
    assert url in log  # the task log
    assert f"MLflow run {second.info.run_id} of try 2 follows the earlier try's run {first.info.run_id}" in log
    assert PASSWORD not in log and PASSWORD not in str(rendered(run, "train"))  # nor in the task's rendered fields


def test_a_mapped_task_s_run_is_named_with_its_map_index(dags, mlflow_server, caplog):
    """The classic operator, mapped, on torch.distributed: ``[map_index]`` in the run's name, the URL logged."""
    run = dags["torch_mlflow_mapped"].test(run_conf={"tracking_uri": mlflow_server, "experiment": "hvd-mapped"})
    assert states(run) == {"reduce": "success"}
    (mapped,) = runs_of(mlflow_server, "hvd-mapped", run.run_id)
    assert mapped.info.status == "FINISHED" and mapped.info.run_name == "torch_mlflow_mapped.reduce[0]"
    assert mapped.data.tags["airflow.map_index"] == "0" and mapped.data.tags["airflow.try_number"] == "1"
    assert f"/#/experiments/{mapped.info.experiment_id}/runs/{mapped.info.run_id}" in caplog.text


def test_a_killed_task_s_run_ends_killed(dags, mlflow_server, tmp_path, monkeypatch):
    """on_kill (what marking the task failed sends) cancels the runner, which ends the run KILLED. ``mlflow=True``:
    MLflow's own MLFLOW_TRACKING_URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = killed_once_training(dags["hvd_mlflow_on_kill"], str(pid_dir))
    assert states(run) == {"train_forever": "failed"}
    mlflow = client(mlflow_server)
    (killed,) = mlflow.search_runs(["0"], f"tags.`airflow.run_id` = '{run.run_id}'")
    assert killed.info.status == "KILLED" and killed.info.run_name == "hvd_mlflow_on_kill.train_forever"
    assert xcom(run, "train_forever", "_link_MlflowRunLink").endswith(f"/runs/{killed.info.run_id}")


def test_the_training_tab_links_the_run(retried, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "hvd-tests-only")
    from airflow.api_fastapi.app import create_app
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from fastapi.testclient import TestClient
    from starlette.routing import Mount

    from airflow_provider_hvd.plugins.training_tab import TAB_HREF, TrainingTabPlugin

    run, (_, second), _ = retried
    app = create_app()
    plugin_app = TrainingTabPlugin.fastapi_apps[0]
    app.router.routes.insert(0, Mount(plugin_app["url_prefix"], app=plugin_app["app"]))
    with TestClient(app) as api:
        password = SimpleAuthManager.get_passwords()["admin"]
        token = api.post("/auth/token", json={"username": "admin", "password": password}).json()["access_token"]
        url = TAB_HREF.format(DAG_ID=run.dag_id, RUN_ID=quote(run.run_id, safe=""), TASK_ID="train", MAP_INDEX=-1)
        page = api.get(url, headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    link = stored(run, "train")[MLFLOW_KEY]["url"]
    assert f'MLflow run of try 2: <a href="{link}" target="_blank"' in page.text
    assert f">{second.info.run_id}</a>" in page.text and PASSWORD not in page.text


def test_mlflow_given_wrong_fails_when_the_dag_is_parsed_naming_the_fix():
    from airflow_provider_hvd.operators.horovod import HorovodRunnerOperator
    from airflow_provider_hvd.operators.torch_distributor import TorchDistributorOperator

    with pytest.raises(ValueError, match=r"mlflow: unknown key\(s\) \['tracking_url'\]; the known ones are"):
        HorovodRunnerOperator(task_id="t", np=2, python_callable=print, mlflow={"tracking_url": "http://x:5000"})
    with pytest.raises(ValueError, match=r"not str 'http://x:5000': e.g. mlflow=\{'tracking_uri': "):
        TorchDistributorOperator(task_id="t", python_callable=print, mlflow="http://x:5000")


def test_the_training_tab_shows_a_stored_run_as_text_and_links_only_web_addresses():
    """Any task can write its store: the run's id is text, and only an http(s) address becomes a link."""
    from airflow_provider_hvd.plugins.training_app import _mlflow_link

    shown = _mlflow_link({"run_id": "<script>x()</script>", "url": "javascript:x()", "try_number": "<b>1</b>"})
    assert shown == (
        '<div class="mlflow" id="mlflow">MLflow run of try &lt;b&gt;1&lt;/b&gt;: &lt;script&gt;x()&lt;/script&gt;</div>'
    )
    quoted = _mlflow_link({"run_id": "r1", "url": 'http://m/#/x" onclick="x()', "try_number": 1})
    assert 'href="http://m/#/x&quot; onclick=&quot;x()"' in quoted and 'onclick="' not in quoted
    assert _mlflow_link({"url": "http://m"}) == _mlflow_link("not a run") == ""
    # a run stored with its tracking server's credentials in the address: shown without them
    kept = _mlflow_link({"run_id": "r1", "url": "https://etl:pw0rd@m:5000/#/experiments/1/runs/r1", "try_number": 1})
    assert 'href="https://m:5000/#/experiments/1/runs/r1"' in kept and "pw0rd" not in kept and "etl" not in kept


def test_the_mlflow_ui_shows_the_retry_s_loss_curve(retried, mlflow_server):
    """The MLflow UI's page of the retry's run, its loss chart drawn, in Chromium: docs/images/mlflow-run.png
    (refreshed with HVD_UPDATE_DOCS_SCREENSHOT=1)."""
    from browser import Browser, chromium_path

    if chromium_path() is None:
        pytest.fail("no chromium on PATH: `apt-get install -y chromium` (make setup does)")
    _, (_, second), _ = retried
    browser = Browser()
    try:
        page = f"{mlflow_server}/#/experiments/{second.info.experiment_id}/runs/{second.info.run_id}/model-metrics"
        browser.open(page)
        points = "document.querySelectorAll('.js-plotly-plot .scatterlayer path.point').length"
        browser.wait_for(f"{points} == {STEPS}", what="the loss curve, a point per step")
        browser.evaluate(  # the UI's training view, without the assistant's panel (where this version has them)
            "Array.from(document.querySelectorAll('*')).find(e => !e.childElementCount && "
            "e.textContent.trim() == 'Model training')?.click(); "
            "document.querySelector('button[aria-label=Close]')?.click()"
        )
        browser.wait_for("!document.querySelector('button[aria-label=Close]')", what="the assistant's panel closed")
        browser.open(page)  # the view goes to the runs' list
        browser.wait_for(f"{points} == {STEPS}", what="the loss curve, in the training view")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = browser.screenshot(ARTIFACTS / "mlflow-run.png")
    finally:
        browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("HVD_UPDATE_DOCS_SCREENSHOT"):
        shutil.copy(shot, Path(__file__).resolve().parent.parent / "docs" / "images" / "mlflow-run.png")
