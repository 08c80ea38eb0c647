"""The Training tab's app, mounted by Airflow's API server: a task instance's metric curves, last checkpoint and
MLflow run.

It reads the task state store (``hvd_metrics``, ``hvd_checkpoint``, ``hvd_restarts``:
:mod:`airflow_provider_hvd.hooks.task_state`; ``hvd_mlflow``: :mod:`airflow_provider_hvd.hooks.mlflow_runs`)
and draws the curves on the server, as SVG (:mod:`.charts`), with a dashed line where each restarted attempt of
the run resumed and the list of its restarts; while the task is not finished, a small script it
serves itself reloads them every few seconds. Every page checks access as the API server's own task-instance
views do (``requires_access_dag(GET, TASK_INSTANCE)``): the UI's ``_token`` cookie reaches this same-origin
iframe, an API client sends its bearer token.
"""

from __future__ import annotations

import json
from html import escape
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.models.task_state_store import TaskStateStoreModel
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, Response
from sqlalchemy import select

from airflow_provider_hvd.hooks.mlflow_runs import MLFLOW_KEY
from airflow_provider_hvd.hooks.task_state import CHECKPOINT_KEY, METRICS_KEY, RESTARTS_KEY
from airflow_provider_hvd.plugins.charts import Restart, charts_html
from airflow_provider_hvd.runner.mlflow_settings import without_user
from airflow_provider_hvd.runner.settings import describe_checkpoint

FINISHED = {"success", "failed", "skipped", "upstream_failed", "removed"}
REFRESH_S = 3
_KEYS = [METRICS_KEY, CHECKPOINT_KEY, RESTARTS_KEY, MLFLOW_KEY]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 12px; color: #1a202c; }
.meta { color: #4a5568; font-size: 13px; margin-bottom: 8px; }
.checkpoint, .mlflow, .restarts { background: #f7fafc; border: 1px solid #e2e8f0; border-radius: 4px;
  padding: 6px 10px; margin: 8px 0; font-size: 14px; word-break: break-all; }
.restarts ul { margin: 4px 0 0; padding-left: 20px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg.chart { background: #fff; border: 1px solid #e2e8f0; border-radius: 4px; }
svg .frame { fill: none; stroke: #cbd5e0; }
svg .curve { fill: none; stroke-width: 2; }
svg text { font-size: 11px; fill: #4a5568; }
svg .title { font-size: 13px; font-weight: 600; fill: #1a202c; }
svg .ytick { text-anchor: end; } svg .end, svg .last { text-anchor: end; } svg .empty { text-anchor: middle; }
svg .restart .marker { stroke: #dd6b20; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg .restart .hit { stroke: transparent; stroke-width: 10; } svg .restart text { fill: #dd6b20; }
@media (prefers-color-scheme: dark) { body { background: #1a202c; color: #e2e8f0; }
  .checkpoint, .mlflow, .restarts { background: #2d3748; border-color: #4a5568; } a { color: #90cdf4; } }
"""

# Reloads the panel while the task instance is not finished (its panel says so with data-live="true").
_SCRIPT = f"""
(function () {{
  var panel = document.getElementById("panel");
  function live() {{ return panel.querySelector("[data-live='true']") !== null; }}
  function refresh() {{
    if (!live()) return;
    fetch(panel.dataset.src, {{credentials: "same-origin", cache: "no-store"}})
      .then(function (r) {{ return r.ok ? r.text() : null; }})
      .then(function (html) {{ if (html !== null) panel.innerHTML = html; }})
      .catch(function () {{}})
      .then(function () {{ setTimeout(refresh, {REFRESH_S * 1000}); }});
  }}
  setTimeout(refresh, {REFRESH_S * 1000});
}})();
"""

_can_read_task_instance = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE))


def _map_index(map_index: Annotated[str, Query()] = "-1") -> int:
    """The ``map_index`` query parameter. The UI fills the tab's ``{MAP_INDEX}`` only for a mapped task and leaves
    it as it is for the others: that, like no value, is the unmapped task's -1."""
    if map_index == "{MAP_INDEX}":
        return -1
    try:
        value = int(map_index)
    except ValueError:
        value = -2
    if value < -1:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"map_index must be -1 or more, not {map_index!r}")
    return value


def _of_task(model: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> tuple[Any, ...]:
    """The conditions that pick one task instance's rows of ``model``."""
    return (model.dag_id == dag_id, model.run_id == run_id, model.task_id == task_id, model.map_index == map_index)


def _entries(session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> dict[str, Any]:
    rows = session.execute(
        select(TaskStateStoreModel.key, TaskStateStoreModel.value).where(
            *_of_task(TaskStateStoreModel, dag_id, run_id, task_id, map_index),
            TaskStateStoreModel.key.in_(_KEYS),
        )
    ).all()
    return {row.key: json.loads(row.value) for row in rows}


def _deferred_progress(session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> dict[str, Any]:
    """The progress and MLflow run a deferred task's trigger writes as its XComs (a trigger has no task state
    store)."""
    rows = session.execute(
        select(XComModel.key, XComModel.value).where(
            *_of_task(XComModel, dag_id, run_id, task_id, map_index),
            XComModel.key.in_(_KEYS),
        )
    ).all()
    return {row.key: XComModel.deserialize_value(row) for row in rows}


def _text(value: object) -> str:
    """A stored value as HTML text: every value the page shows comes from the store, which any task can write."""
    return escape(str(value))


def _mlflow_link(run: object) -> str:
    """The MLflow run of the latest try, a link where it has a web address (any task can write the store: only
    http(s) addresses become links)."""
    if not isinstance(run, dict) or "run_id" not in run:
        return ""
    url = run.get("url")
    name = _text(run["run_id"])
    shown = (
        f'<a href="{escape(without_user(url), quote=True)}" target="_blank" rel="noopener noreferrer">{name}</a>'
        if isinstance(url, str) and urlsplit(url).scheme in ("http", "https")
        else name
    )
    return f'<div class="mlflow" id="mlflow">MLflow run of try {_text(run.get("try_number"))}: {shown}</div>'


def _restart_words(attempt: dict[str, Any], before: dict[str, Any] | None) -> str:
    """How an attempt of the run started: after what, when, with how many ranks, from which checkpoint."""
    point = attempt.get("resumed_from")
    start = f"resumed from {describe_checkpoint(point)}" if isinstance(point, dict) else "started afresh"
    after = f"after {before.get('cause')} [{before.get('cause_kind')}]" if before else "after an attempt not kept"
    size = attempt.get("size")
    ranks = f"{size} ranks, " if size is not None else ""
    return f"attempt {attempt.get('attempt')} at {attempt.get('started_at')} {after}: {ranks}{start}"


def _restarts(value: object, metrics_try: object) -> tuple[str, list[Restart]]:
    """The run's restarts (``hvd_restarts``) as a list, and the lines on the curves where they resumed (only
    where the curves are of the same try)."""
    if not isinstance(value, dict) or not isinstance(value.get("attempts"), list):
        return "", []
    attempts = [attempt for attempt in value["attempts"] if isinstance(attempt, dict)]
    by_number = {attempt.get("attempt"): attempt for attempt in attempts}
    items, markers = [], []
    for attempt in attempts[1:]:
        number = attempt.get("attempt")
        before = by_number.get(number - 1) if isinstance(number, int) else None
        words = _restart_words(attempt, before)
        items.append(f'<li data-attempt="{_text(number)}">{_text(words)}</li>')
        if isinstance(number, int) and value.get("try_number") == metrics_try:
            step = attempt.get("first_step")
            markers.append(Restart(number, step if isinstance(step, int | float) else None, words))
    left_out = value.get("left_out")
    if left_out:
        items.insert(0, f"<li>({_text(left_out)} earlier restarts not kept)</li>")
    heading = f"The run of try {_text(value.get('try_number'))} restarted {_text(value.get('restarts'))} time(s):"
    return f'<div class="restarts" id="restarts">{heading}<ul>{"".join(items)}</ul></div>', markers


def _panel(session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    ti = session.execute(
        select(TaskInstance.state, TaskInstance.try_number).where(
            *_of_task(TaskInstance, dag_id, run_id, task_id, map_index)
        )
    ).one_or_none()
    if ti is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"No task instance {dag_id}/{run_id}/{task_id}[{map_index}]")
    state = str(ti.state.value if hasattr(ti.state, "value") else ti.state or "none")
    entries = _entries(session, dag_id, run_id, task_id, map_index)
    if state == "deferred":  # the run trains while its trigger holds the link (deferrable=True)
        entries.update(_deferred_progress(session, dag_id, run_id, task_id, map_index))
    metrics, checkpoint = entries.get(METRICS_KEY), entries.get(CHECKPOINT_KEY)
    mlflow_link = _mlflow_link(entries.get(MLFLOW_KEY))
    parts = [
        f'<div class="meta" data-live="{str(state not in FINISHED).lower()}" data-state="{_text(state)}">'
        f"Task {_text(state)}, try {_text(ti.try_number)}"
    ]
    if isinstance(metrics, dict):
        parts.append(
            f" · metrics of rank {_text(metrics.get('rank'))} from try {_text(metrics.get('try_number'))}: "
            f"{_text(metrics.get('reports'))} reports, last at {_text(metrics.get('updated'))}"
        )
        thinned_by = metrics.get("thinned_by", 1)
        if not isinstance(thinned_by, int | float) or thinned_by > 1:
            parts.append(f" (every {_text(thinned_by)}th point shown)")
    parts.append("</div>")
    if mlflow_link:
        parts.append(mlflow_link)
    if isinstance(checkpoint, dict) and "path" in checkpoint:
        parts.append(
            f'<div class="checkpoint" id="checkpoint">Last checkpoint: {_text(describe_checkpoint(checkpoint))}'
            f" at {_text(checkpoint.get('reported_at'))}</div>"
        )
    restarts, markers = _restarts(
        entries.get(RESTARTS_KEY), metrics.get("try_number") if isinstance(metrics, dict) else None
    )
    parts.append(restarts)
    if isinstance(metrics, dict) and isinstance(metrics.get("series"), dict) and metrics["series"]:
        parts.append(f'<div class="charts">{charts_html(metrics["series"], markers)}</div>')
    else:
        parts.append(
            "<p>No training metrics recorded for this task instance yet: ranks report them with "
            "<code>log_metrics(step, **metrics)</code>.</p>"
        )
    return "".join(parts)


def create_app() -> FastAPI:
    """The app the plugin mounts (``/hvd-training``)."""
    app = FastAPI(title="Horovod training progress", docs_url=None, redoc_url=None, openapi_url=None)
    page = "/dags/{dag_id}/runs/{run_id}/tasks/{task_id}"

    @app.get(page, response_class=HTMLResponse, dependencies=[_can_read_task_instance])
    def training_page(
        request: Request,
        dag_id: str,
        run_id: str,
        task_id: str,
        session: SessionDep,
        map_index: Annotated[int, Depends(_map_index)],
    ) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        panel_src = (
            f"{root}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/tasks/"
            f"{quote(task_id, safe='')}/panel?map_index={map_index}"
        )
        html = (
            '<!doctype html><html><head><meta charset="utf-8"><title>Training</title>'
            f"<style>{_STYLE}</style></head><body>"
            f'<div id="panel" data-src="{escape(panel_src)}">'
            f"{_panel(session, dag_id, run_id, task_id, map_index)}</div>"
            f'<script src="{escape(root)}/static/live.js"></script></body></html>'
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get(page + "/panel", response_class=HTMLResponse, dependencies=[_can_read_task_instance])
    def training_panel(
        dag_id: str,
        run_id: str,
        task_id: str,
        session: SessionDep,
        map_index: Annotated[int, Depends(_map_index)],
    ) -> HTMLResponse:
        return HTMLResponse(_panel(session, dag_id, run_id, task_id, map_index), headers={"Cache-Control": "no-store"})

    @app.get("/static/live.js")
    def live_script() -> Response:
        return Response(_SCRIPT, media_type="text/javascript")

    return app
