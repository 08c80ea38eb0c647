"""Task slots for a barrier job: how many the application has free now, the most it could ever get, waiting for them.

A barrier stage of ``np`` tasks starts only when ``np`` task slots are free at once (the application's own other
jobs, e.g. another Airflow task's run in the hook's shared session, may hold some). As sparkdl does, a busy
cluster that could hold the job is waited for (with a report every 30 s), up to a bound; a job that can
never fit (more ranks than a local master's cores or a standalone cluster's) is refused at once. A classic
application's slots are its SparkContext's; a Spark Connect server's are counted by its Spark UI's REST API
(:mod:`.server_ui`), where the UI answers.

A restart (``max_restarts``) waits for its slots too (:func:`wait_for_restart_slots`): with ``min_ranks`` below the
run's ranks it starts with fewer once ``shrink_timeout`` has passed without them all. Its count leaves out the
executors of a host the last attempt lost: Spark counts a vanished host's slots until it declares its executors
lost (a minute or two), so the launcher drops them first (a classic SparkContext), or the count skips them (a
Connect server's REST API).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ....errors import HostSlotError, JobRefusedError, LaunchError, RunCancelledError
from ....settings import DEFAULT_SLOT_WAIT_S
from ....shared.naming import HOROVOD_RUNNER, RunnerNaming
from .cluster import MASTER_WEB_UI_CONF, is_local, state_of
from .server_ui import executor_slots, server_ui

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger("airflow_provider_hvd.runner")

REPORT_EVERY_S = 30.0  # how often a wait for slots is reported (sparkdl warns as often)
FIRST_REPORT_S = 5.0  # executors of a new application take a few seconds to register: no report before
POLL_S = 0.5
EXECUTOR_GPUS = "spark.executor.resource.gpu.amount"
TASK_GPUS = "spark.task.resource.gpu.amount"


def slots_now(sc: SparkContext) -> int:
    """How many tasks the application's executors can run at once right now (what a barrier stage needs)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def busy_slots(sc: SparkContext) -> int:
    """How many task slots the application's running tasks hold now (its other jobs': one session may serve
    several Airflow tasks at once)."""
    tracker = sc.statusTracker()
    stages = (tracker.getStageInfo(stage) for stage in tracker.getActiveStageIds())
    return sum(stage.numActiveTasks for stage in stages if stage is not None)


def _busy_note(busy: int, host: int = 0) -> str:
    """What holds the ``busy`` slots: the application's other jobs, and ``host`` of them this run's own host (a
    submitted run's host waiting for its ranks' slots holds one itself)."""
    if not busy:
        return ""
    host = min(host, busy)
    if not host:
        return f", {busy} of them busy with its other jobs"
    others = f" and {busy - host} with its other jobs" if busy > host else ""
    return f", {busy} of them busy: {host} with this run's own host{others}"


_SIZE_SCALES = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def spark_bytes(size: str, unit: int) -> int | None:
    """A size as Spark writes it (``4g``, ``512m``, ``32mb``, ``100b``; a bare number counts ``unit`` bytes) in
    bytes; None for a size Spark would refuse (e.g. ``128MiB``)."""
    match = re.fullmatch(r"(\d+)\s*(?:([kmgtp])b?|(b))?", size.strip().lower())
    if match is None:
        return None
    suffix = match.group(2) or match.group(3)
    return int(match.group(1)) * (_SIZE_SCALES[suffix] if suffix else unit)


def jvm_mebibytes(size: str) -> int:
    """A JVM memory size as Spark writes it (``4g``, ``512m``, ``1024``: MiB without a unit) in MiB."""
    found = spark_bytes(size, 1 << 20)
    return 1024 if found is None else max(1, math.ceil(found / (1 << 20)))


def _gpus_of(worker: dict[str, Any]) -> int:
    return len(worker.get("resources", {}).get("gpu", {}).get("addresses", []))


def task_cpus(conf: dict[str, str]) -> int:
    """The CPUs each task takes (``spark.task.cpus`` in the application's ``conf``)."""
    return int(conf.get("spark.task.cpus") or 1)


def standalone_capacity(state: dict[str, Any], conf: dict[str, str], count_gpus: bool = True) -> int:
    """The most task slots a standalone cluster in ``state`` could give an application with SparkConf ``conf``.

    Counts every alive worker's cores (and GPUs, when the application asks for some) as if free (the job may
    wait for them), the executors that fit its cores, memory and GPUs, and ``spark.cores.max``. An upper
    bound: a job above it can never start. ``count_gpus=False``: as if GPUs were no limit.
    """
    cpus = task_cpus(conf)
    executor_mb = jvm_mebibytes(conf.get("spark.executor.memory") or "1g")
    cores_max = int(conf["spark.cores.max"]) if conf.get("spark.cores.max") else None
    executor_gpus = float(conf.get(EXECUTOR_GPUS) or 0) if count_gpus else 0.0
    task_gpus = float(conf.get(TASK_GPUS) or 0) if count_gpus else 0.0
    workers = [
        (int(w.get("cores", 0)), int(w.get("memory", 0)), _gpus_of(w))
        for w in state["workers"]
        if w.get("state") == "ALIVE" and int(w.get("memory", 0)) >= executor_mb and _gpus_of(w) >= executor_gpus
    ]

    def tasks_per_executor(cores: int) -> int:
        by_cores = cores // cpus
        return min(by_cores, math.floor(executor_gpus / task_gpus)) if task_gpus else by_cores

    if conf.get("spark.executor.cores"):  # executors of that many cores, as many as each worker can hold
        executor_cores = int(conf["spark.executor.cores"])
        executors = sum(
            min(cores // executor_cores, memory // executor_mb, int(gpus // executor_gpus) if executor_gpus else cores)
            for cores, memory, gpus in workers  # (without a GPU request, cores // executor_cores is the least)
        )
        if cores_max is not None:
            executors = min(executors, cores_max // executor_cores)
        return executors * tasks_per_executor(executor_cores)
    slots = sum(tasks_per_executor(cores) for cores, _, _ in workers)  # one executor per worker, all its cores
    return slots if cores_max is None else min(slots, cores_max // cpus)


def refuse_dynamic_allocation(conf: Callable[[str], str | None], size: int) -> None:
    """Spark refuses barrier jobs under dynamic allocation: say so before anything starts."""
    if (conf("spark.dynamicAllocation.enabled") or "false").lower() == "true":
        raise JobRefusedError(
            "Spark refuses barrier jobs under dynamic allocation: set spark.dynamicAllocation.enabled=false "
            f"and spark.executor.instances so that the cluster holds {size} task slots."
        )


def _gpu_slots(state: dict[str, Any], conf: dict[str, str]) -> int:
    """The most task slots the alive workers' GPUs alone would allow (as if cores were no limit)."""
    executor_gpus = float(conf.get(EXECUTOR_GPUS) or 0)
    task_gpus = float(conf.get(TASK_GPUS) or 0)
    slots = 0
    for worker in state["workers"]:
        gpus = _gpus_of(worker)
        if worker.get("state") != "ALIVE" or gpus < executor_gpus:
            continue
        if executor_gpus:
            slots += int(gpus // executor_gpus) * math.floor(executor_gpus / task_gpus)
        else:
            slots += math.floor(gpus / task_gpus)
    return slots


def limits_note(state: dict[str, Any] | None, conf: dict[str, str], size: int) -> str:
    """When the application asks for GPUs: whether GPUs, or cores and GPUs both, limit the slots, and what to
    change; else nothing (the message's ``spark.task.cpus`` says it)."""
    if not conf.get(TASK_GPUS):
        return ""
    asked = (
        f"each executor gets {EXECUTOR_GPUS}={conf.get(EXECUTOR_GPUS) or 0}, "
        f"each task {TASK_GPUS}={conf.get(TASK_GPUS)}"
    )
    more_gpus = (
        "give the cluster more GPUs (the workers' spark.worker.resource.gpu.amount and discovery script, "
        "or more GPU executors), or ask for fewer per task"
    )
    if state is None:
        return f" GPUs are what limits it: {asked}. To fit, {more_gpus}."
    on_workers = f" ({sum(_gpus_of(w) for w in state['workers'] if w.get('state') == 'ALIVE')} on the workers)"
    cores_limit = standalone_capacity(state, conf, count_gpus=False) < size
    gpus_limit = _gpu_slots(state, conf) < size
    if cores_limit and gpus_limit:
        return (
            f" Cores and GPUs both limit it: each task needs spark.task.cpus={task_cpus(conf)} "
            f"cores, and {asked}{on_workers}. To fit, give the cluster more cores and {more_gpus}."
        )
    if cores_limit:
        return ""
    return f" GPUs are what limits it{on_workers}: {asked}. To fit, {more_gpus}."


def total_unknown_note(master: str, conf: Callable[[str], str | None]) -> str:
    """Why the most slots the cluster of an application (its master URL, its conf getter) could give is not
    known, and the setting that would tell it; "" if known."""
    if is_local(master):
        return ""
    state, why = state_of(master, conf)
    if state is not None:
        return ""
    if master.startswith("spark://"):
        return (
            f"the cluster's total is unknown ({why}): set {MASTER_WEB_UI_CONF} to the standalone master's web UI "
            "(e.g. http://spark-master:8080) so that a job that can never fit is refused at once"
        )
    return (
        f"the cluster's total is unknown on {master.split(':')[0]}: executors come as the cluster manager grants them"
    )


def never_fits_error(
    master: str,
    size: int,
    total: int,
    conf: dict[str, str],
    state: dict[str, Any] | None,
    naming: RunnerNaming = HOROVOD_RUNNER,
    host: int = 0,
) -> JobRefusedError:
    """The refusal of a job of ``size`` tasks on a cluster of at most ``total`` slots; ``host``: the slots a
    submitted run's host holds beside them (named apart: the user's ``np`` is the ranks')."""
    if not host:
        needs, lower = f"{naming.needs_slots(size)} at once", naming.lower_to(total)
    else:
        needs = (
            f"{naming.needs_slots(size)} at once for its ranks and a submitted run {host} more for its host, "
            f"{size + host} in all"
        )
        lower = (
            f"{naming.lower_to(total - host)} to submit it (or at most {total * naming.per_task} with run(), which "
            "needs no slot for a host)"
            if total > host
            else f"Use run(), which needs no slot for a host, with {naming.size} at most {total * naming.per_task}"
        )
    return JobRefusedError(
        f"{needs} (a barrier job starts all its tasks together), but the cluster at {master} has {total} at most "
        f"(spark.task.cpus={task_cpus(conf)}).{limits_note(state, conf, size + host)}"
        f" {lower}, give the cluster more executors or cores (spark.executor.instances, "
        f"spark.executor.cores, spark.cores.max), or use {naming.on_this_host} to run on this host alone."
    )


def host_slot_error(
    master: str, size: int, total: int, host: int, naming: RunnerNaming, *, fit: int | None = None, core: bool = False
) -> HostSlotError:
    """The refusal of a submitted run whose ``size`` tasks fit a cluster of at most ``total`` slots, and whose
    host's ``host`` slots do not fit beside them; ``core``: its host's task takes a core and no GPU (its ranks'
    take GPUs), and the cores are too few. ``fit``: the tasks that fit beside the host (``total - host``)."""
    ranks = size * naming.per_task
    fit = total - host if fit is None else fit
    needs = (
        f"a submitted run's host needs {host} core beside them (its task takes one CPU and no GPU), which it holds "
        f"for the whole run, and the executors' cores leave none"
        if core
        else f"a submitted run needs {host} more for its host, which holds it for the whole run: {size + host} at once"
    )
    reason = (
        f"{naming.call(ranks)}'s {ranks} ranks fit the cluster at {master} ({total} Spark task slots at most), but "
        f"{needs}"
    )
    fix = f"l{naming.lower_to(fit)[1:]}, " if fit > 0 else ""  # ("lower np to at most 2, ")
    return HostSlotError(
        f"{reason}. Give the cluster one more {'core' if core else 'task slot'}, {fix}or use run(), whose supervisor "
        "is the calling process and needs no slot of its own.",
        reason=reason,
    )


_CAPACITY_CONFS = (
    "spark.task.cpus",
    "spark.executor.memory",
    "spark.cores.max",
    "spark.executor.cores",
    EXECUTOR_GPUS,
    TASK_GPUS,
)


def local_slots(master: str, task_cpus: int, cores: int | None = None) -> int | None:
    """A local master's task slots (``local``: 1, ``local[4]``: 4, ``local[*]``: its JVM's ``cores``); None where
    that is not known."""
    match = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?", master)
    if match is None:
        return None
    threads = match.group(1) or "1"
    if threads == "*":
        return None if cores is None else cores // task_cpus
    return int(threads) // task_cpus


def capacity_settings(conf: Callable[[str], str | None]) -> dict[str, str]:
    """The application's settings that bound its task slots (as far as they are set)."""
    return {key: value for key in _CAPACITY_CONFS if (value := conf(key)) is not None}


@dataclass(frozen=True)
class CpuTasks:
    """Tasks of one CPU and no GPU beside a barrier job: a submitted run's host, on a task profile of its own where
    the job's tasks take GPUs (durable/submit.py). ``pending`` ones are still to start, and each needs a core
    beside the job's tasks; ``running`` ones are among the application's active tasks, but hold no GPU, so no
    slot of the job's where GPUs, not cores, limit an executor's slots."""

    pending: int = 0
    running: int = 0

    def slots(self, job_slots: int, cpu_slots: int) -> int:
        """The job's slots with these tasks: ``job_slots`` as the executors' slots count them (running ones count
        among the busy), within ``cpu_slots``, the tasks the executors' cores alone would hold."""
        if not self.pending and not self.running:
            return job_slots
        return min(job_slots + self.running, cpu_slots - self.pending)


class SlotCount:
    """What the wait for free task slots asks of an application, known by its master URL and its conf getter: the
    most slots it could ever have, the refusal of a job that can never fit, the notes of the wait's reports; what
    it has now and whether it stopped are its kind's: a classic SparkContext's (:class:`ClassicSlots`), or a Spark
    Connect server's, from its Spark UI's REST API (:class:`ConnectSlots`)."""

    def __init__(
        self, master: str, conf: Callable[[str], str | None], where: str, naming: RunnerNaming = HOROVOD_RUNNER
    ) -> None:
        self.master, self.conf, self.naming = master, conf, naming
        self.where = where  # where the job runs, for the texts: "on local[2]", "over Spark Connect sc://h:p (...)"
        self.settings = capacity_settings(conf)
        self.host_slots = 0  # the slots a submitted run's host holds beside its ranks' (durable/submit.py)
        self.host_running = False  # the wait is that host's own, for its ranks: its slots are among the busy ones
        self.lost_hosts: tuple[str, ...] = ()  # hosts whose executors are not counted (a restart's: they were lost)
        self.beside = CpuTasks()  # or its task of one CPU and no GPU, beside the ranks' slots (durable/submit.py)

    def needed(self, size: int) -> int:
        """The free slots a job of ``size`` tasks waits for: its host's too, unless the host holds them already."""
        return size if self.host_running else size + self.host_slots

    def local_cores(self) -> int | None:
        """The cores of a ``local[*]`` application's JVM, where they can be known (None here)."""
        return None

    def now(self) -> tuple[int, int]:
        """The application's task slots, and how many of them its running tasks hold."""
        raise NotImplementedError

    def stopped(self, size: int) -> str | None:
        """Why the wait cannot go on when the application has stopped; None while it runs."""
        raise NotImplementedError

    def _state(self) -> dict[str, Any] | None:
        return state_of(self.master, self.conf)[0]

    def at_most(self, beside: CpuTasks | None = None) -> int | None:
        """The most task slots the application could ever have for the job beside the run's CPU-only tasks
        (:attr:`beside` unless given), or None where that cannot be known (YARN, k8s)."""
        beside = self.beside if beside is None else beside
        if is_local(self.master):
            slots = local_slots(
                self.master, task_cpus(self.settings), self.local_cores() if "*" in self.master else None
            )
            return None if slots is None else beside.slots(slots, slots)
        state = self._state()
        if state is None:
            return None
        cpu_slots = standalone_capacity(state, self.settings, count_gpus=False)
        return beside.slots(standalone_capacity(state, self.settings), cpu_slots)

    def fits(self, size: int, total: int | None) -> None:
        """Refuse a job of ``size`` tasks (and :attr:`host_slots`, or :attr:`beside`'s pending tasks) that a
        cluster of ``total`` slots at most (None: unknown) can never hold: HostSlotError where only the host's
        slots, or its core, are too many."""
        if total is None or total >= size + self.host_slots:
            return
        if self.host_slots and total >= size:
            raise host_slot_error(self.master, size, total, self.host_slots, self.naming)
        if self.beside.pending:  # the job alone would fit: the host's core is too many
            alone = self.at_most(CpuTasks(running=self.beside.running))
            if alone is not None and alone >= size:
                raise host_slot_error(self.master, size, alone, self.beside.pending, self.naming, fit=total, core=True)
        raise never_fits_error(self.master, size, total, self.settings, self._state(), self.naming, self.host_slots)

    def unknown_note(self) -> str:
        return total_unknown_note(self.master, self.conf)

    def limits_note(self, size: int) -> str:
        return limits_note(self._state(), self.settings, size + self.host_slots)


class ClassicSlots(SlotCount):
    """A SparkContext's slots: its scheduler's count, and its status tracker's running tasks."""

    def __init__(self, sc: SparkContext, naming: RunnerNaming = HOROVOD_RUNNER) -> None:
        super().__init__(sc.master or "", sc.getConf().get, f"on {sc.master}", naming)
        self.sc = sc

    def now(self) -> tuple[int, int]:
        return slots_now(self.sc), busy_slots(self.sc)

    def at_most(self, beside: CpuTasks | None = None) -> int | None:
        if is_local(self.master):
            return slots_now(self.sc)  # the driver's own threads: all there from the start (local[*] too)
        return super().at_most(beside)

    def stopped(self, size: int) -> str | None:
        if self.sc._jsc is not None and not self.sc._jsc.sc().isStopped():
            return None
        return (
            f"the SparkContext on {self.sc.master} stopped while {self.naming.runner} waited for {size} task slots "
            "(did the master give up the application?); see Spark's log above"
        )


class ConnectSlots(SlotCount):
    """A Spark Connect server's application's slots, as its Spark UI's REST API counts them (``ui``: the UI, once
    found; without it the slots free now cannot be counted). ``cores``: a ``local[*]`` server's cores, asked of
    the server (once)."""

    def __init__(
        self,
        master: str,
        conf: Callable[[str], str | None],
        where: str,
        stopped: Callable[[], str | None],
        naming: RunnerNaming = HOROVOD_RUNNER,
        cores: Callable[[], int | None] = lambda: None,
    ) -> None:
        super().__init__(master, conf, where, naming)
        self.ui: str | None = None
        self.app_id = conf("spark.app.id") or ""
        self._stopped = stopped
        self._cores = functools.cache(cores)  # (the server's cores do not change)

    def local_cores(self) -> int | None:
        return self._cores()

    def now(self) -> tuple[int, int]:
        assert self.ui is not None, "the server's UI counts the slots"
        slots, busy, cpu_slots = executor_slots(self.ui, self.app_id, task_cpus(self.settings), self.lost_hosts)
        return self.beside.slots(slots, cpu_slots), busy

    def stopped(self, size: int) -> str | None:
        why = self._stopped()
        return (
            None
            if why is None
            else f"{why} while {self.naming.runner} waited for {size} task slots (by the application)"
        )


def check_connect_slots(
    master: str,
    conf: Callable[[str], str | None],
    size: int,
    where: str,
    naming: RunnerNaming = HOROVOD_RUNNER,
    timeout: float = DEFAULT_SLOT_WAIT_S,
    cancelled: Callable[[], bool] = lambda: False,
    stopped: Callable[[], str | None] = lambda: None,
    host_slots: int = 0,
    host_running: bool = False,
    cores: Callable[[], int | None] = lambda: None,
    beside: CpuTasks | None = None,
) -> None:
    """Over Spark Connect: refuse at once a job of ``size`` tasks that can never fit, where that can be known
    (a local master's cores, a standalone master's ``/json/``), and wait up to ``timeout`` seconds for ``size``
    free slots, counted by the server's Spark UI (its REST API). Without that UI the free slots cannot be
    counted (the client has no SparkContext): the barrier stage then waits in Spark's scheduler, as long as the
    run's ``start_timeout``, which is said. ``host_slots``: a submitted run's host's, counted beside them
    (HostSlotError where only they do not fit); ``host_running``: the host runs already (this is its wait for its
    ranks' slots), and holds its own among the busy ones. ``cores``: a ``local[*]`` server's cores. ``beside``:
    the run's tasks of one CPU beside the job's instead (a submitted run's host where the job's tasks take GPUs:
    HostSlotError where only its core does not fit)."""
    refuse_dynamic_allocation(conf, size)
    count = ConnectSlots(master, conf, where, stopped, naming, cores)
    count.host_slots, count.host_running = host_slots, host_running
    count.beside = beside or CpuTasks()
    total = count.at_most()
    count.fits(size, total)
    count.ui, no_ui = server_ui(conf)
    if count.ui is not None:
        try:
            wait_for_free_slots(count, size, timeout, cancelled, naming)
            return
        except (OSError, ValueError) as exc:  # the UI stopped answering: the count is gone, not the job
            no_ui = f"the server's Spark UI at {count.ui} did not answer with its executors ({exc})"
    why = "" if total is not None else state_of(master, conf)[1]
    log.info(
        "%s: %s: the free task slots cannot be counted (%s); the barrier job's %d tasks start once Spark has %d "
        "free at once%s: until then they wait in Spark's scheduler, up to the ranks' start timeout "
        "(start_timeout), not slot_wait_timeout",
        naming.runner,
        where,
        no_ui,
        size,
        size,
        f" (the cluster has {total} at most)" if total is not None else f" ({why})" if why else "",
    )


def wait_for_slots(
    sc: SparkContext,
    size: int,
    timeout: float = DEFAULT_SLOT_WAIT_S,
    cancelled: Callable[[], bool] = lambda: False,
    naming: RunnerNaming = HOROVOD_RUNNER,
) -> None:
    """Return once the application has ``size`` free task slots (its executors' slots less those its running
    tasks hold); wait up to ``timeout`` seconds for a busy cluster or application.

    Raises LaunchError at once when ``size`` can never fit, or when the wait ends without the slots;
    RunCancelledError when ``cancelled()`` turns true while waiting.
    """
    refuse_dynamic_allocation(sc.getConf().get, size)
    wait_for_free_slots(ClassicSlots(sc, naming), size, timeout, cancelled, naming)


def wait_for_free_slots(
    count: SlotCount, size: int, timeout: float, cancelled: Callable[[], bool], naming: RunnerNaming = HOROVOD_RUNNER
) -> None:
    """:func:`wait_for_slots` on any :class:`SlotCount` (for ``size`` tasks and the count's ``host_slots``)."""
    needed = count.needed(size)
    slots, busy = count.now()
    if slots - busy >= needed:
        return
    total = count.at_most()
    count.fits(size, total)
    started = time.monotonic()
    next_report = started + min(FIRST_REPORT_S, REPORT_EVERY_S)
    host = f" ({size} for its ranks, {count.host_slots} for its host)" if needed > size else ""
    held_by_host = count.host_slots if count.host_running else 0
    while slots - busy < needed:
        now = time.monotonic()
        if cancelled():
            raise RunCancelledError(f"the run was cancelled while waiting for {size} task slots {count.where}")
        stopped = count.stopped(size)
        if stopped is not None:
            raise LaunchError(stopped)
        if now - started >= timeout:
            unknown = count.unknown_note() if total is None else ""
            own = (
                f" This run's host holds {held_by_host} of them for the whole run, beside its ranks'."
                if held_by_host and busy
                else ""
            )
            raise LaunchError(
                f"{naming.call(size * naming.per_task)} waited {now - started:.0f}s for {needed} free Spark task "
                f"slots{host} {count.where}, and the application has {slots}{_busy_note(busy, held_by_host)} (the "
                "cluster or the application is busy with other jobs, or its executors cannot start"
                f"{'; ' + unknown if unknown else ''}).{own}"
                f"{count.limits_note(size)} Wait longer (slot_wait_timeout, now {timeout:g}s), free the cluster, or "
                f"lower {naming.size}."
            )
        if now >= next_report:
            unknown = count.unknown_note() if total is None else ""
            at_most = f" of the {total} it could hold" if total is not None else f"; {unknown}" if unknown else ""
            log.warning(
                "%s: waiting for %d free Spark task slots%s %s; the application has %d%s%s (%.0fs waited, up to %gs)",
                naming.runner,
                needed,
                host,
                count.where,
                slots,
                at_most,
                _busy_note(busy, held_by_host),
                now - started,
                timeout,
            )
            next_report = now + REPORT_EVERY_S
            total = count.at_most()  # workers may have come or gone
            count.fits(size, total)
        time.sleep(POLL_S)
        slots, busy = count.now()


def wait_for_restart_slots(
    count: SlotCount,
    tasks: int,
    min_tasks: int,
    shrink_timeout: float,
    timeout: float,
    cancelled: Callable[[], bool],
    naming: RunnerNaming = HOROVOD_RUNNER,
) -> int:
    """A restart's tasks: ``tasks`` as soon as that many slots are free; once ``shrink_timeout`` has passed without
    them, as many as are free if that is ``min_tasks`` or more; LaunchError once ``timeout`` has passed with fewer
    than ``min_tasks``, RunCancelledError when ``cancelled()`` turns true meanwhile."""
    started = time.monotonic()
    next_report = started + FIRST_REPORT_S
    # below min_tasks it fails after ``timeout``; with min_tasks or more free, it starts them at ``shrink_timeout``
    longest = timeout if min_tasks >= tasks else max(timeout, shrink_timeout)
    while True:
        slots, busy = count.now()
        free, waited = slots - busy, time.monotonic() - started
        if free >= tasks:
            return tasks
        if free >= min_tasks and waited >= shrink_timeout:
            log.warning(
                "%s: %d free Spark task slots %s of the %d of every rank, %.0fs after the restart began "
                "(shrink_timeout=%gs): the next attempt runs %d ranks (min_ranks=%d)",
                naming.runner,
                free,
                count.where,
                tasks,
                waited,
                shrink_timeout,
                free * naming.per_task,
                min_tasks * naming.per_task,
            )
            return free
        if cancelled():
            raise RunCancelledError(f"the run was cancelled while waiting for {min_tasks} task slots {count.where}")
        stopped = count.stopped(min_tasks)
        if stopped is not None:
            raise LaunchError(stopped)
        if waited >= timeout and free < min_tasks:
            fewer = (
                f"Set min_ranks lower to go on with fewer ranks, give the cluster more executors, or wait longer "
                f"(slot_wait_timeout, now {timeout:g}s)"
            )
            raise LaunchError(
                f"waited {waited:.0f}s for {min_tasks * naming.per_task} ranks' free Spark task slots (min_ranks="
                f"{min_tasks * naming.per_task} of {naming.call(tasks * naming.per_task)}) {count.where}, and the "
                f"application has {free} free{_busy_note(busy)}{_lost_note(count.lost_hosts)}. {fewer}."
            )
        if time.monotonic() >= next_report:
            log.warning(
                "%s: the restart waits for %d free Spark task slots %s (at least %d); the application has %d free "
                "(%.0fs waited, up to %gs)",
                naming.runner,
                tasks,
                count.where,
                min_tasks,
                free,
                waited,
                longest,
            )
            next_report = time.monotonic() + REPORT_EVERY_S
        time.sleep(POLL_S)


def _lost_note(hosts: tuple[str, ...]) -> str:
    if not hosts:
        return ""
    return f" (the executors on {', '.join(hosts)}, lost with the last attempt, are not counted)"
