"""The core runner: no Airflow in here."""

from .control import log_to_driver
from .errors import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError
from .runner import HorovodRunner

__all__ = [
    "HorovodRunner",
    "HorovodRunnerError",
    "LaunchError",
    "RankFailedError",
    "RunCancelledError",
    "log_to_driver",
]
