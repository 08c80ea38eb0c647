"""What the driver needs to know of its Spark application and cluster, for the launcher, the slot count and
the Airflow hooks alike: the kind of master, the active session, Spark's error text without the JVM's stack
trace, and the standalone master's state from its web UI (``/json/``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ....shared.naming import HOROVOD_RUNNER

log = logging.getLogger("airflow_provider_hvd.runner")

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Where the standalone master's web UI is (its /json/ tells the cluster's cores); default http://<master>:8080
MASTER_WEB_UI_CONF = "spark.horovodRunner.masterWebUiUrl"
MASTER_WEB_UI_PORT = 8080
MASTER_STATE_REUSE_S = 10.0  # one run's look-ups (its UI link, its slot count, its refusal) share one fetch
_JVM_FRAME = re.compile(r"\s*at [\w$.<>/-]+\(.*\)$|\s*\.\.\. \d+ more$")
_PY4J_CALL = "An error occurred while calling "
_JVM_PREFIXES = (": ", 'Exception in thread "main" ', "org.apache.spark.SparkException: ")
_LOCAL_MASTER = re.compile(r"local(\[(\*|\d+)(,\d+)?\])?")


def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N,F]``: the executors are threads of the driver's JVM.

    Not ``local-cluster[...]``, whose executors are JVMs of their own.
    """
    return _LOCAL_MASTER.fullmatch(master) is not None


def summary(error: BaseException | str, first_line: bool = False) -> str:
    """What a JVM error says, without py4j's preamble, the JVM's stack frames or Spark's exception class.

    For py4j's errors, Spark's exceptions in a message, and the JVM's own last words alike; ``first_line``: only
    the first line of it (the message of the outermost exception).
    """
    lines = [
        line
        for line in str(error).splitlines()
        if line.strip() and not _JVM_FRAME.match(line) and not line.startswith(_PY4J_CALL)
    ]
    text = "\n".join(lines[:1] if first_line else lines).strip()
    for prefix in _JVM_PREFIXES:
        text = text.removeprefix(prefix)
    if text:
        return text
    return repr(error) if isinstance(error, BaseException) else str(error).strip()


def default_executor_python(master: str) -> None:
    """On a local master the executors run on this host: give them this interpreter unless told otherwise."""
    if is_local(master):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (``SparkSession.builder.remote("sc://...")``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def session_conf(spark: Any) -> Callable[[str], str | None]:
    """The conf getter of a session, classic (its SparkConf) or Spark Connect (``spark.conf``, which reads the
    server's static settings too): ``conf(key)`` is the value or None."""
    if not is_connect(spark):
        return spark.sparkContext.getConf().get  # type: ignore[no-any-return]

    def conf(key: str) -> str | None:
        value = spark.conf.get(key, None)
        return None if value is None else str(value)

    return conf


def _connect_session(default: bool) -> SparkSession | None:
    """This thread's active Spark Connect session (``default``: else the process's default one), or None."""
    if "pyspark.sql.connect.session" not in sys.modules:  # no Connect session without it (and it imports grpc)
        return None
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from .connect_client import default_session

    session = ConnectSession.getActiveSession()
    if session is None and default:
        session = default_session()  # made in another thread (pyspark has no public getter)
    return session  # type: ignore[return-value]  # (a Connect session has the classic one's API)


def existing_session() -> SparkSession | None:
    """The active SparkSession (classic, or Spark Connect), or None when there is none (none is started)."""
    if "pyspark" not in sys.modules:  # nothing made one: no need to import pyspark (and start nothing)
        return None
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    # a Connect session active in this thread first (a notebook's SparkSession.builder.remote(...)); a Connect
    # session left from before, or made in another thread, does not hide a classic one. (The Airflow hook hands
    # its own session to the runner: none of this applies to it.)
    spark = _connect_session(default=False) or SparkSession.getActiveSession()
    if spark is None and SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.getOrCreate()
    if spark is None:
        spark = _connect_session(default=True)
    return spark


def active_session(app_name: str = HOROVOD_RUNNER.runner) -> SparkSession:
    """The active SparkSession (classic, or Spark Connect), or a new one on ``local[*]`` named ``app_name``
    when there is none (which is said: a run meant for a cluster would otherwise run on this host unseen)."""
    from pyspark.sql import SparkSession

    spark = existing_session()
    if spark is None:
        log.warning(
            "%s: no SparkSession is active: starting one on local[*], this host's cores. To run elsewhere, start "
            "your own first: SparkSession.builder.master(...).getOrCreate(), or .remote('sc://...') for Spark "
            "Connect",
            app_name,
        )
        default_executor_python("local[*]")
        spark = (
            SparkSession.builder.master("local[*]")
            .appName(app_name)
            .config(
                "spark.ui.showConsoleProgress",
                "false",  # a progress bar is noise in a task log
            )
            .getOrCreate()
        )
    return spark


def standalone_masters(master: str) -> list[tuple[str, int]]:
    """``spark://h1:7077,h2:7077`` → ``[("h1", 7077), ("h2", 7077)]``; ``[]`` for other masters.

    Raises ValueError when an entry has no port (Spark would answer ``Invalid master URL``).
    """
    if not master.startswith("spark://"):
        return []
    masters = []
    for entry in master.removeprefix("spark://").split(","):
        match = re.fullmatch(r"(\[[^\]\s]+\]|[^:\[\]\s]+):(\d+)", entry.strip())  # host:port, [v6]:port
        if match is None:
            raise ValueError(
                f"{master!r} is not a standalone master URL: each master needs a host and a port, "
                "e.g. spark://spark-master:7077"
            )
        masters.append((match.group(1).strip("[]"), int(match.group(2))))
    return masters


def web_ui_of(master: str, conf: Callable[[str], str | None]) -> str | None:
    """The standalone master's web UI URL of an application known by its master URL and conf getter (a classic
    SparkContext's, ``sc.getConf().get``, or a Connect session's): ``spark.horovodRunner.masterWebUiUrl``, else
    port 8080 of the master; None for other masters."""
    configured = conf(MASTER_WEB_UI_CONF)
    if configured:
        return configured.rstrip("/")
    masters = standalone_masters(master)
    return f"http://{masters[0][0]}:{MASTER_WEB_UI_PORT}" if masters else None


_fetched: dict[tuple[str, str], tuple[float, dict[str, Any] | None, str]] = {}
_fetched_lock = threading.Lock()


def _fetch_master_state(master: str, ui: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """The state at ``ui``/json/ if it is ``master``'s, else None and why not."""
    try:
        with urllib.request.urlopen(f"{ui}/json/", timeout=timeout) as resp:
            state = json.load(resp)
    except (OSError, ValueError) as exc:
        return None, f"{ui}/json/ did not answer with the master's state ({exc})"
    if not isinstance(state, dict) or not isinstance(state.get("workers"), list):
        return None, f"{ui}/json/ is not a Spark master's state"
    ours = {f"{host}:{port}" for host, port in standalone_masters(master)}
    theirs = {entry.strip() for entry in str(state.get("url", "")).removeprefix("spark://").split(",")}
    if not ours & theirs:
        return None, f"{ui}/json/ is the state of another master ({state.get('url')})"
    return state, ""


def state_of(master: str, conf: Callable[[str], str | None], timeout: float = 5.0) -> tuple[dict[str, Any] | None, str]:
    """The standalone master's ``/json/`` state (workers, cores, applications) of an application known by its
    master URL and conf getter, checked to be its master's (not whatever else answers on that port); None where it
    cannot be read, and on a standalone master why (to tell the user what to set).

    A state fetched less than :data:`MASTER_STATE_REUSE_S` ago is reused: one run asks for it several times.
    """
    ui = web_ui_of(master, conf)
    if ui is None:
        return None, ""
    key = (master, ui)
    with _fetched_lock:
        at, state, why = _fetched.get(key, (-math.inf, None, ""))
        if time.monotonic() - at >= MASTER_STATE_REUSE_S:
            state, why = _fetch_master_state(key[0], ui, timeout)
            _fetched[key] = (time.monotonic(), state, why)
    return state, why
