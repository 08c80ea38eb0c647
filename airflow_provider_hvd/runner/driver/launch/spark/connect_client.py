"""pyspark's private Spark Connect client parts that the runner and the hook rely on, each guarded.

They bound what pyspark's public calls do not: the run's interrupt (one call of seconds, where pyspark's
``interruptTag`` retries a server that is gone for ~10 minutes) and a session's release; they also tell the
server's address and whether the channel is TLS. Where a pyspark lacks one (an upgrade renamed it), the public
call is made instead (or the detail goes unsaid), with one WARNING per part and process naming it;
``tests/test_spark_connect.py`` fails naming any part that the installed pyspark lacks.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

log = logging.getLogger("airflow_provider_hvd.runner")

#: each part, and what is lost without it
PARTS = {
    "SparkConnectClient._interrupt_request": "the run's cancel is pyspark's interruptTag",
    "SparkConnectClient._stub": "the run's cancel is pyspark's interruptTag",
    "SparkConnectClient._builder.metadata": "the run's cancel is pyspark's interruptTag",
    "SparkConnectClient._rpc_deadlines": "releasing a session takes pyspark's own deadline (10 minutes a try)",
    "SparkConnectClient._builder.endpoint": "the texts name the server by its host alone",
    "SparkConnectClient._builder.secure": "whether the Connect channel is TLS is not known: taken as not",
    "SparkSession._get_default_session": "a Connect session made in another thread is not found",
    "SparkConnectClient._builder._params": "submit() cannot start a run: it opens sessions like the client's",
    "SparkConnectClient._get_operation_statuses": "attach() to an unknown id leaves the empty session it opened",
    "SparkConnectClient._release_session_on_exit": "SPARK_CONNECT_RELEASE_SESSION_ON_EXIT ends submitted runs",
    "SparkConnectClient._create_profile": "a submitted run's host takes a GPU on GPU clusters",
}
_CANCEL = ("SparkConnectClient._interrupt_request", "SparkConnectClient._stub", "SparkConnectClient._builder.metadata")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _has(root: Any, part: str) -> bool:
    """Whether ``root`` (a client, or the session class) has ``part`` (``SparkConnectClient._builder.metadata``),
    looked up without running it (``_stub`` is a property that raises on a closed client)."""
    found = root
    for attribute in part.split(".")[1:]:
        found = inspect.getattr_static(found, attribute, None)
        if found is None:
            return False
    return True


def _lacks(part: str) -> None:
    """Say once per process that pyspark lacks ``part``, and what that costs."""
    with _warned_lock:
        if part in _warned:
            return
        _warned.add(part)
    import pyspark

    log.warning(
        "pyspark %s has no %s (a private part of its Spark Connect client, which this version of "
        "airflow-provider-hvd relies on): %s. Use the pyspark version in docs/compatibility.md, or report it.",
        pyspark.__version__,
        part,
        PARTS[part],
    )


def missing_parts(spark: SparkSession) -> list[str]:
    """The parts the installed pyspark lacks, on a session's client and its class."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    roots = {"SparkConnectClient": spark.client, "SparkSession": ConnectSession}
    return [part for part in PARTS if not _has(roots[part.split(".")[0]], part)]


def interrupt_tag(spark: SparkSession, tag: str, timeout: float) -> None:
    """Interrupt the session's operations tagged ``tag``: one call of ``timeout`` seconds at most."""
    client = spark.client
    missing = next((part for part in _CANCEL if not _has(client, part)), None)
    if missing is not None:
        _lacks(missing)
        spark.interruptTag(tag)
        return
    request = client._interrupt_request("tag", tag)
    client._stub.Interrupt(request, metadata=client._builder.metadata(), timeout=timeout)


def bound_release(spark: SparkSession, timeout: float) -> None:
    """Give releasing the session (``spark.stop()``) a deadline of ``timeout`` seconds a try."""
    deadlines: Any = getattr(spark.client, "_rpc_deadlines", None)
    try:
        spark.client._rpc_deadlines = dataclasses.replace(deadlines, release_session=timeout)
    except TypeError:  # not there, or not pyspark 4.3's dataclass of deadlines
        _lacks("SparkConnectClient._rpc_deadlines")


def endpoint(spark: SparkSession) -> str:
    """``host:port`` of the session's server (its host alone where pyspark does not say its port)."""
    if not _has(spark.client, "SparkConnectClient._builder.endpoint"):
        _lacks("SparkConnectClient._builder.endpoint")
        return str(spark.client.host)
    builder: Any = spark.client._builder  # (a DefaultChannelBuilder: the ChannelBuilder base has no endpoint)
    return str(builder.endpoint)


def is_tls(spark: SparkSession) -> bool:
    """Whether the session's channel to its server is TLS (``use_ssl``, or a token); False where not known."""
    if not _has(spark.client, "SparkConnectClient._builder.secure"):
        _lacks("SparkConnectClient._builder.secure")
        return False
    builder: Any = spark.client._builder
    return bool(builder.secure)


def default_session() -> SparkSession | None:
    """The process's default Spark Connect session (made in another thread), or None."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    if not _has(ConnectSession, "SparkSession._get_default_session"):
        _lacks("SparkSession._get_default_session")
        return None
    return ConnectSession._get_default_session()


def connection_params(spark: SparkSession) -> dict[str, str]:
    """The parameters of the session's connection string (``token``, ``use_ssl``, ``user_id``, headers), without
    its session id; the user id the client sends is set even where it came from the environment (``$USER``)."""
    if not _has(spark.client, "SparkConnectClient._builder._params"):
        _lacks("SparkConnectClient._builder._params")
        raise RuntimeError(PARTS["SparkConnectClient._builder._params"])
    builder: Any = spark.client._builder
    params = {key: str(value) for key, value in dict(builder._params).items() if key != "session_id"}
    params["user_id"] = str(getattr(spark.client, "_user_id", None) or "")
    return params


def running_operations(spark: SparkSession) -> int | None:
    """How many operations of the session run now; None where pyspark cannot tell."""
    client: Any = spark.client
    if not _has(client, "SparkConnectClient._get_operation_statuses"):
        _lacks("SparkConnectClient._get_operation_statuses")
        return None
    from pyspark.sql.connect.proto import base_pb2

    running = base_pb2.GetStatusResponse.OperationStatus.OPERATION_STATE_RUNNING
    statuses = client._get_operation_statuses().operation_statuses
    return int(sum(status.state == running for status in statuses))


def keep_session_on_exit(spark: SparkSession) -> None:
    """This process's exit never releases the session (``SPARK_CONNECT_RELEASE_SESSION_ON_EXIT`` would)."""
    client: Any = spark.client
    spark.release_session_on_close = False  # (pyspark's own switch: stop() closes the channel alone)
    if not _has(client, "SparkConnectClient._release_session_on_exit"):
        _lacks("SparkConnectClient._release_session_on_exit")
        return
    client._release_session_on_exit = False


@dataclasses.dataclass(frozen=True)
class TaskProfile:
    """A resource profile the server made, as ``mapInArrow(..., profile=)`` takes it (it reads the ``id``)."""

    id: int


def cpu_task_profile(spark: SparkSession, cpus: int = 1) -> TaskProfile | None:
    """A task resource profile of ``cpus`` CPUs and nothing else (no GPU), made on the session's server; None where
    pyspark cannot make one (its public ``ResourceProfile`` needs pyspark's Connect mode for the whole process)."""
    client: Any = spark.client
    if not _has(client, "SparkConnectClient._create_profile"):
        _lacks("SparkConnectClient._create_profile")
        return None
    from pyspark.sql.connect.proto import common_pb2

    request = common_pb2.ResourceProfile(
        task_resources={"cpus": common_pb2.TaskResourceRequest(resource_name="cpus", amount=float(cpus))}
    )
    return TaskProfile(int(client._create_profile(request)))
