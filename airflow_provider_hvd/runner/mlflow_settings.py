"""MLflow's settings of a run (``mlflow=``): what they may be and how they are checked, MLflow's own environment
variables, and how a tracking URI's credentials are kept out of anything shown (log lines, links, stored values).
The run's MLflow run itself is :mod:`.driver.tracking.mlflow_run`'s. Nothing here imports MLflow but
:func:`import_mlflow`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from .errors import SettingError

INSTALL_HINT = "pip install 'airflow-provider-hvd[mlflow]'"
MAPPING_KEYS = ("tracking_uri", "experiment_name", "run_name", "tags")

RUN_ID_ENV = "MLFLOW_RUN_ID"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ID_ENV = "MLFLOW_EXPERIMENT_ID"
EXPERIMENT_NAME_ENV = "MLFLOW_EXPERIMENT_NAME"
USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
#: how MLflow's client authenticates to the tracking server (what ``mlflow.utils.credentials`` reads), and MLflow 3's
#: workspace, where the run is: rank 0 gets the driver's, since on Spark it runs where the driver's environment
#: is not (an executor)
AUTH_ENV = (
    USERNAME_ENV,
    PASSWORD_ENV,
    TOKEN_ENV,
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_WORKSPACE",
)
MASKED = "***"
_MINMASKED = 4  # a shorter secret (an odd password of 1-3 characters) would mask bits of every line


@dataclasses.dataclass
class MlflowSettings:
    """Where and how a runner's MLflow run is made.

    :param tracking_uri: the tracking server (None: MLflow's own ``MLFLOW_TRACKING_URI``, else its default). A
        password in it is never shown: log lines show it as ``***``, the run's URL has no user info.
    :param experiment_name: made if missing (None: ``MLFLOW_EXPERIMENT_NAME``, else MLflow's default experiment).
    :param run_name: the run's name (None: one MLflow makes up).
    :param tags: set on the run, beside the runner's own ``hvd.*`` tags.
    :param previous_run_id: an earlier try's run: linked from the new run (tag ``hvd.previous_run_id``), and
        ended KILLED if it is still RUNNING (its try ended without closing it).
    :param on_start: called with the run's id and its UI URL (None when there is none) once the run exists.
    """

    tracking_uri: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    previous_run_id: str | None = None
    on_start: Callable[[str, str | None], None] | None = None


def mlflow_settings(value: bool | Mapping[str, Any] | MlflowSettings | None) -> MlflowSettings | None:
    """A runner's ``mlflow`` argument as settings: None/False: off; True: MLflow's defaults; a mapping with keys
    among ``tracking_uri``, ``experiment_name``, ``run_name``, ``tags``; or :class:`MlflowSettings` as is."""
    if value is None or value is False:
        return None
    if value is True:
        return MlflowSettings()
    if isinstance(value, MlflowSettings):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(str(key) for key in value if key not in MAPPING_KEYS)
        if unknown:
            raise SettingError(f"mlflow: unknown key(s) {unknown}; the known ones are {list(MAPPING_KEYS)}")
        tags = value.get("tags") or {}
        if not isinstance(tags, Mapping):
            raise SettingError(f"mlflow: 'tags' must be a mapping of names to values, not {type(tags).__name__}")
        return MlflowSettings(
            tracking_uri=_optional_str(value, "tracking_uri"),
            experiment_name=_optional_str(value, "experiment_name"),
            run_name=_optional_str(value, "run_name"),
            tags={str(key): str(tag) for key, tag in tags.items()},
        )
    raise SettingError(
        f"mlflow must be True/False/None, a mapping with keys among {list(MAPPING_KEYS)}, or MlflowSettings, "
        f"not {type(value).__name__}"
    )


def mlflow_option(value: object) -> dict[str, Any] | None:
    """A training task's ``mlflow=`` as the operator keeps it (templated, so JSON data): None when off (None,
    False), ``{}`` for True, else the dict, checked as the runner checks it (at parse time, and once rendered):
    a ValueError naming what is wrong."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise SettingError(
            f"mlflow must be True, a dict with keys among {list(MAPPING_KEYS)}, or None, not "
            f"{type(value).__name__} {value!r}: e.g. mlflow={{'tracking_uri': 'http://mlflow:5000', "
            "'experiment_name': 'vision'}"
        )
    mlflow_settings(value)
    return dict(value)


def _optional_str(value: Mapping[str, Any], key: str) -> str | None:
    given = value.get(key)
    if given is not None and not isinstance(given, str):
        raise SettingError(f"mlflow: {key!r} must be a str or None, not {type(given).__name__}")
    return given


def import_mlflow() -> ModuleType:
    """MLflow's client module; an ImportError naming the extra to install when it is missing."""
    try:
        return importlib.import_module("mlflow")
    except ImportError as exc:
        raise ImportError(f"mlflow=... needs MLflow's client, which is not installed: {INSTALL_HINT}") from exc


def user_info(uri: str) -> tuple[str, str, str] | None:
    """``uri`` as (``scheme://``, its user info, what follows the ``@``), or None when it has no user info."""
    scheme, sep, rest = uri.partition("://")
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if not sep or "@" not in netloc:
        return None
    user_info, _, host = netloc.rpartition("@")
    return scheme + sep, user_info, host + rest[len(netloc) :]


def without_user(uri: str) -> str:
    """``uri`` without its user info (``https://user:pw@host/x`` → ``https://host/x``): a link to share."""
    parts = user_info(uri)
    return uri if parts is None else parts[0] + parts[2]


def shown_uri(uri: str) -> str:
    """``uri`` as a log line shows it: its password as ``***`` (``postgresql://etl:***@db/mlflow``), a user info
    without one (a token) all ``***``."""
    parts = user_info(uri)
    if parts is None:
        return uri
    user, colon, _ = parts[1].partition(":")
    return f"{parts[0]}{user + colon if colon else ''}{MASKED}@{parts[2]}"


def auth_env() -> dict[str, str]:
    """MLflow's authentication settings of this process as environment variables (:data:`AUTH_ENV`): its
    environment's, and the user and password of ``~/.mlflow/credentials``, which rank 0's host may not have."""
    env = {name: os.environ[name] for name in AUTH_ENV if os.environ.get(name)}
    try:
        from mlflow.utils.credentials import read_mlflow_creds

        creds = read_mlflow_creds()  # (the environment's first, else the file's)
    except Exception:  # noqa: BLE001 - an MLflow without it (or an unreadable file): the environment's only
        return env
    env.update({USERNAME_ENV: creds.username} if creds.username else {})
    env.update({PASSWORD_ENV: creds.password} if creds.password else {})
    return env


@contextlib.contextmanager
def auth_environment(auth: Mapping[str, str]) -> Iterator[None]:
    """This process's environment holds ``auth`` (MLflow's client reads its credentials there, at each request)
    within, and is as it was after: a submitted run's host makes its MLflow run with the submitter's."""
    before = {name: os.environ.get(name) for name in auth}
    os.environ.update(auth)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def credentials(tracking_uri: str | None, env: Mapping[str, str] | None = None) -> list[str]:
    """The secrets to keep out of anything shown: the password of ``tracking_uri`` (as written and decoded), and
    MLflow's password and token of ``env`` (:func:`auth_env`'s when None); longest first."""
    found = []
    parts = user_info(tracking_uri or "")
    if parts is not None and ":" in parts[1]:
        password = parts[1].split(":", 1)[1]
        found += [password, urllib.parse.unquote(password)]
    settings = auth_env() if env is None else env
    found += [settings[name] for name in (PASSWORD_ENV, TOKEN_ENV) if settings.get(name)]
    return sorted({secret for secret in found if len(secret) >= _MINMASKED}, key=len, reverse=True)
