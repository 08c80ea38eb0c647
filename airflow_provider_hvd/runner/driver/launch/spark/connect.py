"""The barrier job over Spark Connect (``sc://``): the :class:`.app.SparkApp` of a Connect session.

The client has no SparkContext: the conf is the session's (``spark.conf``, which reads the server's static
settings too), the barrier job is ``spark.range(n).mapInArrow(..., barrier=True)`` under an operation tag
(``spark.addTag``, thread-local) that an interrupt of that tag cancels (one call with a short deadline, not
pyspark's ``interruptTag``, whose retries of a server that is gone take ~10 minutes), and the job travels
inside the task's function: Spark ships a stage's task binary once per executor, and the plan that carries it
is one gRPC message from this client to the server, at most ``spark.connect.grpc.maxInboundMessageSize``
(128 MiB by default). There is no status tracker: the job's own error and the driver channel (heartbeats,
agents' reports) tell how the tasks end.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ....errors import JobRefusedError
from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from ....shared.timing import CONNECT_FIRST_PROGRESS_S
from ...events import TaskCounts
from ..address import DriverAddress, connect_driver_address, is_loopback
from .app import BarrierTask, JobStatus, arrow_barrier
from .capacity import ConnectSlots, CpuTasks, check_connect_slots, jvm_mebibytes, spark_bytes, wait_for_restart_slots
from .cluster import is_local, session_conf
from .connect_client import endpoint, interrupt_tag, is_tls
from .server_ui import server_ui

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pyspark.sql import DataFrame
    from pyspark.sql.connect.session import SparkSession
    from pyspark.sql.connect.shell.progress import StageInfo

    from ...events import Task

log = logging.getLogger("airflow_provider_hvd.runner")

MESSAGE_SIZE_CONF = "spark.connect.grpc.maxInboundMessageSize"
DEFAULT_MESSAGE_BYTES = 128 * 1024 * 1024  # the server's default, and the Python client's own send limit
PLAN_MARGIN_BYTES = 1024 * 1024  # the plan and the task's function around the job, with room to spare
# The server's driver holds several copies of a plan while it plans and ships it (the request, the expression,
# the serialized task binary and its broadcast pieces): on a 1 GiB driver heap (the default) a job of 48 MiB
# ran and one of 64 MiB ended the server's SparkContext (OutOfMemoryError). A job of at most 1/32 of the heap.
HEAP_SHARE = 32
CANCEL_CALL_S = 10.0  # the interrupt's deadline (on the clean-up path: the server may be gone)


class NoStatus:
    """Spark Connect has no status tracker: Spark says nothing of the tasks but the job's own end."""

    failed: dict[Task, str] = {}  # noqa: RUF012 - read only, never filled

    def poll(self) -> None:
        pass

    def first_failure(self) -> str | None:
        return None

    def ended(self) -> dict[Task, str]:
        return {}

    def tasks_active(self) -> bool:
        return False

    def tasks_running(self) -> bool:
        return False  # unknown: the job's own end is all the client hears


class OperationProgress:
    """What the server says of the operations of the launcher's tagged threads as they run (Spark Connect's
    execution progress, every ``spark.connect.progress.reportInterval``): their tasks running and done, by tag.
    A progress handler of the session's while a tagged thread runs (it is called in the thread that runs the
    operation)."""

    def __init__(self, spark: SparkSession) -> None:
        self._spark = spark
        self._tags: dict[int, str] = {}  # a thread's ident -> its tag
        self._counts: dict[str, TaskCounts] = {}
        self._started: dict[str, float] = {}  # (time.monotonic()) each tag's first operation
        self._lock = threading.Lock()

    def __call__(
        self, stages: Iterable[StageInfo] | None, inflight_tasks: int, operation_id: str | None, done: bool
    ) -> None:
        tag = self._tags.get(threading.get_ident())
        if tag is not None and stages is not None:
            self._counts[tag] = TaskCounts(inflight_tasks, sum(stage.num_completed_tasks for stage in stages))

    def counts(self, tag: str) -> TaskCounts | None:
        """What the server last said of ``tag``'s operations; until its first report (``CONNECT_FIRST_PROGRESS_S``
        at most), that they run (it reports only every interval); None where it says nothing."""
        counts = self._counts.get(tag)
        started = self._started.get(tag)
        if counts is None and started is not None and time.monotonic() - started < CONNECT_FIRST_PROGRESS_S:
            return TaskCounts(0, 0, stages=1)
        return counts

    @contextlib.contextmanager
    def following(self, tag: str) -> Iterator[None]:
        """Within, this thread's operations are ``tag``'s."""
        with self._lock:
            if not self._tags:
                self._spark.registerProgressHandler(self)  # type: ignore[arg-type]  # (a callable is all it calls)
            self._tags[threading.get_ident()] = tag
            self._started.setdefault(tag, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._tags.pop(threading.get_ident(), None)
                if not self._tags:
                    with contextlib.suppress(ValueError):  # (the application cleared the session's handlers)
                        self._spark.removeProgressHandler(self)  # type: ignore[arg-type]


class ShippedJob:
    """The pickled job inside the task's function; the task reads it once, and then holds no copy of it."""

    def __init__(self, job: bytes) -> None:
        self._job = [job]

    def __call__(self) -> bytes:
        return self._job.pop()


def local_cores(spark: SparkSession) -> int | None:
    """The cores of a ``local[*]`` server, as Spark counts them for its task slots: the splits of a range given no
    number of partitions, Spark's default parallelism, which is those cores unless ``spark.default.parallelism``
    or ``spark.sql.leafNodeDefaultParallelism`` is set (None then, or where the plan does not say). One planning
    call to the server, no Spark job."""
    conf = session_conf(spark)
    if conf("spark.default.parallelism") or conf("spark.sql.leafNodeDefaultParallelism"):
        return None
    try:
        plan = str(spark.sql("EXPLAIN SELECT * FROM range(1)").collect()[0][0])
    except Exception as exc:  # noqa: BLE001 - the count is then unknown, as on a cluster manager's master
        log.debug("could not read the server's default parallelism: %s", exc)
        return None
    found = re.search(r"\bRange \(0, 1, step=1, splits=(\d+)\)", plan)
    return int(found.group(1)) if found else None


def server_url(spark: SparkSession) -> str:
    """``sc://host:port`` of the session's server (without its token or other parameters)."""
    return f"sc://{endpoint(spark)}"


def job_limit(conf: Callable[[str], str | None]) -> tuple[int, str]:
    """The largest job to send the server, and the settings that bound it."""
    driver_memory = conf("spark.driver.memory") or "1g"
    heap = jvm_mebibytes(driver_memory) * (1 << 20) // HEAP_SHARE
    message = message_limit(conf) - PLAN_MARGIN_BYTES
    if heap < message:
        return heap, f"1/{HEAP_SHARE} of the server's driver heap, spark.driver.memory={driver_memory}"
    return message, (
        f"{MESSAGE_SIZE_CONF} on the server, within the Python client's own {_mib(DEFAULT_MESSAGE_BYTES)}, "
        f"less {_mib(PLAN_MARGIN_BYTES)} for the plan"
    )


def message_limit(conf: Callable[[str], str | None]) -> int:
    """The most bytes one message from this client may carry to the server."""
    server = spark_bytes(conf(MESSAGE_SIZE_CONF) or "", 1)  # (a size Spark refuses: its server would not run)
    return min(server or DEFAULT_MESSAGE_BYTES, DEFAULT_MESSAGE_BYTES)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def job_too_large(size: int, limit: int, bound_by: str, url: str, submitted: bool = False) -> JobRefusedError:
    """The refusal of a job over Spark Connect's message limit: a run's (in its barrier job's plan), or a submitted
    run's (in its host's plan, with its DataFrame's recipe where it has one; no classic session can host it)."""
    what, where = (
        ("The submitted job", "its host's plan") if submitted else ("The pickled job", "the barrier job's plan")
    )
    classic = "" if submitted else "; or run it on a classic SparkSession (a broadcast has no such limit)"
    return JobRefusedError(
        f"{what} is {_mib(size)}: over Spark Connect it travels inside {where}, one message to the server at "
        f"{url}, which takes a job of at most {_mib(limit)} ({bound_by}). Make the job smaller: have main load its "
        f"data and model from storage instead of capturing them, or pass a path{classic}."
    )


_warned_readable: set[str] = set()  # the servers whose plaintext channel was warned of (once per process each)
_warned_lock = threading.Lock()


def warn_if_plan_readable(url: str, tls: bool, bind: str) -> None:
    """Once per process and server: the run's secret rides in the plan over a channel that is not TLS, to a
    driver that listens beyond loopback (docs/security.md)."""
    if tls or is_loopback(bind):
        return
    with _warned_lock:
        if url in _warned_readable:
            return
        _warned_readable.add(url)
    log.warning(
        "The Spark Connect channel to %s is not encrypted (no use_ssl, no token), and the run's secret travels "
        "inside the barrier job's plan on it: whoever reads that traffic and reaches the driver at %s can join the "
        "run in a Spark task's place (the run then fails, naming it). Connect with use_ssl=true or a token (TLS), "
        "or keep the server and its clients on a network only they reach; see docs/security.md.",
        url,
        bind,
    )


class ConnectApp:
    """A Spark Connect session's application, as :class:`.barrier.SparkLauncher` uses it. ``run_host_slots``: the
    task slots this process holds on the application itself, a submitted run's host launching its ranks."""

    def __init__(
        self, spark: SparkSession, tag: str, naming: RunnerNaming = HOROVOD_RUNNER, run_host_slots: int = 0
    ) -> None:
        self.spark = spark
        self.run_host_slots = run_host_slots
        self.naming = naming
        self.url = server_url(spark)
        self.conf = session_conf(spark)
        self.master = self.conf("spark.master") or ""
        self.local = is_local(self.master)  # the server's executors are threads of its JVM
        self.shares_stderr = False  # the executors' stderr is the server's, never this process's
        self.status: JobStatus = NoStatus()
        self._tag = tag  # (the launcher's group: its operations are tagged with it)
        self.beside = CpuTasks()  # the run's tasks of one CPU beside its barrier job's (a submitted run's host)
        self._progress = OperationProgress(spark)

    def where(self) -> str:
        return f"over Spark Connect {self.url} ({self.master})"

    def driver_address(self) -> DriverAddress:
        driver = connect_driver_address(self.conf, self.spark.client.host, self.local, self.naming)
        warn_if_plan_readable(self.url, is_tls(self.spark), driver.bind)
        return driver

    def check_slots(self, tasks: int, timeout: float, cancelled: Callable[[], bool], host_slots: int = 0) -> None:
        """Wait for the slots of ``tasks`` tasks, and ``host_slots`` for a submitted run's host that is to start
        beside them (or the slots this process's run host holds already)."""
        check_connect_slots(
            self.master,
            self.conf,
            tasks,
            self.where(),
            self.naming,
            timeout,
            cancelled,
            self._session_stopped,
            host_slots or self.run_host_slots,
            host_running=bool(self.run_host_slots),
            cores=lambda: local_cores(self.spark),
            beside=self.beside,
        )

    def restart_slots(
        self,
        tasks: int,
        min_tasks: int,
        lost_hosts: tuple[str, ...],
        waits: tuple[float, float],
        cancelled: Callable[[], bool],
    ) -> int:
        """Counted by the server's Spark UI, the executors on ``lost_hosts`` left out (a client cannot have Spark
        drop them); without that UI, the run's own size (its barrier stage waits in Spark's scheduler)."""
        count = ConnectSlots(self.master, self.conf, self.where(), self._session_stopped, self.naming)
        count.ui, no_ui = server_ui(self.conf)
        if count.ui is None:
            runner, where = self.naming.runner, self.where()
            log.info("%s: %s: a restart's free task slots cannot be counted (%s)", runner, where, no_ui)
            return tasks
        count.lost_hosts = lost_hosts
        return wait_for_restart_slots(count, tasks, min_tasks, *waits, cancelled, self.naming)

    def ship(self, payload: bytes) -> Callable[[], bytes]:
        limit, bound_by = job_limit(self.conf)
        if len(payload) > limit:
            raise job_too_large(len(payload), limit, bound_by, self.url)
        return ShippedJob(payload)

    @contextlib.contextmanager
    def tagged(self, tag: str, description: str) -> Iterator[None]:
        self.spark.addTag(tag)  # this thread's operations only (an operation has no description)
        try:
            with self._progress.following(tag):
                yield
        finally:
            self.spark.removeTag(tag)

    def task_counts(self, tag: str) -> TaskCounts | None:
        return self._progress.counts(tag)

    def run_barrier(
        self, tasks: int, task: BarrierTask, tag: str, description: str, inputs: DataFrame | None = None
    ) -> None:
        frame = self.spark.range(tasks, numPartitions=tasks) if inputs is None else inputs
        with self.tagged(tag, description):
            arrow_barrier(frame, task, reads_input=inputs is not None)

    def cancel(self, tag: str) -> None:
        interrupt_tag(self.spark, tag, CANCEL_CALL_S)  # one call, bounded (pyspark's retries take ~10 minutes)

    def name_of(self, tag: str) -> str:
        return f"operation tag {tag} of the session {self.spark.session_id} on {self.url}"

    def left_running(self, tag: str) -> str:
        return (
            f"spark.interruptTag({tag!r}) in that session interrupts it again. The job travelled in its plan: "
            "nothing of it is kept here"
        )

    def unship(self, tasks_running: bool = False) -> None:
        pass  # the plan went with its operation; the server's task binary goes with its JVM's next clean-up

    def decommissioning(self) -> dict[str, tuple[float, str]]:
        return {}  # (the scheduler's record is the server's; its REST API does not show it)

    def decommission_deadline(self) -> float | None:
        return None

    def _session_stopped(self) -> str | None:
        return f"the Spark Connect session to {self.url} was stopped" if self.spark.is_stopped else None

    def stopped(self) -> str | None:
        why = self._session_stopped()
        return None if why is None else f"{why} while the ranks ran (by the application)"
