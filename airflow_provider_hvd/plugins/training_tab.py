"""The "Training" tab on Airflow's task-instance page: an ``external_views`` entry and the FastAPI app it shows.

Registered through the ``airflow.plugins`` entry point (``pyproject.toml``). The app (:mod:`.training_app`) is
built on its first request, so that Airflow components that only load plugins (the scheduler, the workers)
never import the API server's modules for it.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/hvd-training"
TAB_HREF = URL_PREFIX + "/dags/{DAG_ID}/runs/{RUN_ID}/tasks/{TASK_ID}?map_index={MAP_INDEX}"


class _AppOnFirstRequest:
    """An ASGI app that builds the Training app when the API server first routes a request to it."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._app is None:
            from airflow_provider_hvd.plugins.training_app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


class TrainingTabPlugin(AirflowPlugin):
    """Metric curves and the last checkpoint of a HorovodRunner task, from its task state store."""

    name = "hvd_training"
    # AirflowPlugin reads these class attributes (its own are lists too)
    fastapi_apps = [  # noqa: RUF012
        {"app": _AppOnFirstRequest(), "url_prefix": URL_PREFIX, "name": "Horovod training progress"}
    ]
    external_views = [  # noqa: RUF012
        {"name": "Training", "href": TAB_HREF, "destination": "task_instance", "url_route": "training"},
    ]
