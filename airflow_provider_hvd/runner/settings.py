"""The settings every run takes, declared, checked and documented once (:class:`RunSettings`): HorovodRunner's and
TorchDistributor's, the hook's ``run`` and each training operator take them as keyword arguments, typed once
(:class:`RunOptions`), their signatures made from the declaration (:func:`takes_run_settings`). A setting to
add is a field of :class:`RunSettings` with its default, its check and its ``:param:``, and its key in
:class:`RunOptions` (``tests/test_layout.py`` holds the two together).

Also here: the progress sink the Airflow layer hands a run (:class:`ProgressSink`), and the words of a checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypedDict, TypeVar

from .mlflow_settings import MlflowSettings, mlflow_option, mlflow_settings
from .rank.progress import RESERVED_INFO
from .shared.timing import (
    DEFAULT_DETACHED_TIMEOUT_S,
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_OUTCOME_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
)

VERBOSITIES = ("all", "log_callback_only")
DEFAULT_SLOT_WAIT_S = 600.0
#: TorchDistributor's defaults where they are PySpark's, not sparkdl's (its operator's too)
PYSPARK_DEFAULTS: dict[str, Any] = {"driver_log_verbosity": "all"}
SNAPSHOT_MAX_BYTES = 60_000  # a metrics snapshot as JSON: under the task state store's 65,535-byte values


class ProgressSink(Protocol):
    """Where a run's progress goes while it runs (the Airflow layer writes it to the task state store).

    A sink may have a ``max_bytes`` attribute: the most a metrics snapshot may take as JSON (default 60,000); a
    ``try_number`` (the Airflow try whose run it records: a restarted run's checkpoints are that try's); and a
    ``restarts(records)`` method, given the record of each attempt once a run has restarted (``max_restarts``:
    ``HorovodRunner.attempts``' dicts, each with ``first_step``: the first step the metrics rank reported in that
    attempt, None before it reported one), as each attempt starts and ends.
    """

    def metrics(self, snapshot: dict[str, Any]) -> None:
        """The metrics history so far (``MetricsHistory.snapshot``), at most once every few seconds."""

    def checkpoint(self, record: dict[str, Any]) -> None:
        """The last checkpoint reported: ``{"path", **info, "rank", "reported_at"}``."""


def describe_checkpoint(record: Mapping[str, Any]) -> str:
    """``/ckpt/epoch-3.pt (epoch=3), reported by try 1``: for the log."""
    info = {key: value for key, value in record.items() if key not in RESERVED_INFO}
    text = str(record.get("path"))
    if info:
        text += " (" + ", ".join(f"{key}={value}" for key, value in info.items()) + ")"
    if record.get("try_number") is not None:
        text += f", reported by try {record['try_number']}"
    return text


# the checks, one per setting


def check_verbosity(driver_log_verbosity: object) -> str:
    if driver_log_verbosity not in VERBOSITIES:
        raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}, not {driver_log_verbosity!r}")
    return str(driver_log_verbosity)


def check_slot_wait_timeout(seconds: object) -> float:
    """``seconds`` as a float, or ValueError when it is not a number of seconds >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise ValueError(f"slot_wait_timeout must be a number of seconds >= 0, not {seconds!r}")
    return float(seconds)


def check_stall_timeout(stall_timeout: object) -> float | None:
    """``stall_timeout`` in seconds (None: off); ``ValueError`` for anything but a positive number or timedelta."""
    if stall_timeout is None:
        return None
    seconds = stall_timeout.total_seconds() if isinstance(stall_timeout, timedelta) else stall_timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"stall_timeout must be a positive number of seconds (or a timedelta), or None to turn stall detection "
            f"off, not {stall_timeout!r}"
        )
    return float(seconds)


def _positive_seconds(value: object, name: str, what: str) -> float:
    """``value`` (seconds or a timedelta) in seconds; ``ValueError`` naming ``name`` and ``what`` it bounds for
    anything but a positive, finite number of seconds."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds (or a timedelta): {what}; not {value!r}")
    return float(seconds)


def check_start_timeout(start_timeout: object) -> float:
    """``start_timeout`` in seconds; ``ValueError`` for anything but a positive number of seconds or timedelta."""
    what = "how long the ranks may take to start, not counting the time Spark spends on a DataFrame's rows"
    return _positive_seconds(start_timeout, "start_timeout", what)


def check_exit_timeout(exit_timeout: object) -> float:
    """``exit_timeout`` in seconds; ``ValueError`` for anything but a positive number of seconds or timedelta."""
    what = "how long the ranks' exit work (atexit handlers, trackers' flushes) may take once every rank returned"
    return _positive_seconds(exit_timeout, "exit_timeout", what)


def check_detached_timeout(detached_timeout: object) -> float:
    """``detached_timeout`` in seconds; ``ValueError`` for anything but a positive number of seconds or timedelta."""
    what = "how long a submitted run goes on with nobody attached before it ends itself"
    return _positive_seconds(detached_timeout, "detached_timeout", what)


def check_outcome_timeout(outcome_timeout: object) -> float:
    """``outcome_timeout`` in seconds; ``ValueError`` for anything but a positive number of seconds or timedelta."""
    what = "how long a submitted run's host keeps its outcome, once it ended, for a client to fetch it"
    return _positive_seconds(outcome_timeout, "outcome_timeout", what)


def check_max_restarts(max_restarts: object) -> int:
    """``max_restarts`` as an int; ``ValueError`` for anything but a whole number >= 0."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            f"max_restarts must be a whole number >= 0 (how many times a run may start again from its last "
            f"checkpoint after a failure that is not its code's own; 0: never), not {max_restarts!r}"
        )
    return max_restarts


def exception_names(names: object) -> tuple[str, ...]:
    """``restart_on_exceptions`` as a tuple of names (an exception class is named ``module.QualName``);
    ``TypeError`` for anything but exception classes or their names."""

    def is_class(value: object) -> bool:
        return isinstance(value, type) and issubclass(value, BaseException)

    def refused(value: object) -> TypeError:
        return TypeError(
            "restart_on_exceptions takes exception types or their names, e.g. restart_on_exceptions="
            f"['DistBackendError', 'torch.OutOfMemoryError']; not {value!r}"
        )

    if names is None:
        return ()
    if isinstance(names, str) or is_class(names):
        names = [names]  # one name, or one class
    if not isinstance(names, Iterable):
        raise refused(names)
    found = []
    for name in names:
        if is_class(name):
            found.append(f"{name.__module__}.{name.__qualname__}")
        elif isinstance(name, str) and name.strip() and all(part.isidentifier() for part in name.strip().split(".")):
            found.append(name.strip())
        else:
            raise refused(name)
    return tuple(found)


def resume_value(resume_from: object) -> dict[str, Any] | None:
    """``resume_from`` as the dict ``last_checkpoint()`` returns (a str is a path)."""
    if resume_from is None:
        return None
    if isinstance(resume_from, str):
        resume_from = {"path": resume_from}
    if not isinstance(resume_from, Mapping) or not isinstance(resume_from.get("path"), str):
        raise TypeError(
            "resume_from must be None, a checkpoint's path, or a dict with a 'path' (e.g. a runner's .checkpoint), "
            f"not {resume_from!r}"
        )
    value = {"try_number": None, **resume_from}
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"resume_from must be JSON data (it travels to every rank): {exc}") from None
    return value


def _as_sink(sink: object) -> ProgressSink | None:
    return sink  # type: ignore[return-value]  # (duck-typed: its methods are called)


def _setting(default: Any, check: Callable[[Any], Any], *, task: bool = True, task_check: Any = None) -> Any:
    """A field of :class:`RunSettings`: its default (as given, before the check), the check that turns what is
    given into the field's value, and whether a training task takes it as a parameter (``task``; with
    ``task_check``: checked so for the task, which keeps it templated)."""
    return dataclasses.field(
        default=check(default), metadata={"given": default, "check": check, "task": task, "task_check": task_check}
    )


class RunOptions(TypedDict, total=False):
    """The run settings as keyword arguments, as given (:class:`RunSettings` says what each does)."""

    driver_log_verbosity: str
    slot_wait_timeout: float
    start_timeout: float | timedelta
    stall_timeout: float | timedelta | None
    exit_timeout: float | timedelta
    resume_from: Mapping[str, Any] | str | None
    progress_sink: ProgressSink | None
    mlflow: bool | Mapping[str, Any] | MlflowSettings | None
    detached_timeout: float | timedelta
    outcome_timeout: float | timedelta
    max_restarts: int
    restart_on_exceptions: Sequence[str | type[BaseException]] | None


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The settings of a run, checked.

    :param driver_log_verbosity: which output of the ranks reaches the driver's log (an Airflow task's log) on
        Spark: ``"all"``, every line their processes write to stdout and stderr; ``"log_callback_only"``, only
        :func:`log_to_driver` messages and ``LogCallback`` lines (the rest stays in the executors' stderr). Local
        runs relay every line. Default: ``"log_callback_only"`` (sparkdl's) for HorovodRunner, its hook and
        operator; ``"all"`` (PySpark's) for TorchDistributor and its operator.
    :param slot_wait_timeout: on Spark: how long to wait, in seconds (default 600), for the job's free task slots
        on a busy cluster before raising :class:`LaunchError` (a job that can never fit is refused at once). Over
        Spark Connect the free slots are counted by the server's Spark UI (its REST API); where that UI is off,
        the client cannot count them, and the barrier stage's wait in Spark's scheduler is bounded by the ranks'
        start timeout (``start_timeout``).
    :param start_timeout: seconds (or a timedelta, default 120) for the ranks to start: every rank's Spark task
        has its task slot and its agent has reached this driver (``LaunchError`` after it, saying how many had).
        For a run on a DataFrame, the time Spark spends on its rows is not counted: counting them, computing them
        for the barrier job and streaming them into the ranks' shards take what they take (the log says how far
        they got every 10 s), and the ranks' clock runs only while none of that is going on
        (docs/dataframes.md).
    :param stall_timeout: seconds (or a timedelta); when no rank has written output or reported progress
        (``log_to_driver``, metrics) for that long, the driver's log gets every rank's Python stacks, every rank
        is ended and the run raises :class:`RunStalledError` saying where each one was. ``None`` (default): off.
    :param exit_timeout: seconds (or a timedelta, default 120): once every rank's ``main`` has returned, the run
        has succeeded, and the ranks' exit work (``atexit`` handlers, an experiment tracker's flush, DataLoader
        workers) may take this long; a rank still exiting then is ended with a warning naming it, and the run
        still returns rank 0's value. A rank whose process fails in its exit work only logs a warning too, unless
        the run fails: then it counts after the real failures and before Horovod's shutdown errors.
    :param resume_from: the checkpoint the ranks resume from: what ``last_checkpoint()`` returns in them. A dict
        with a ``"path"`` (e.g. another runner's ``checkpoint``), a path, or None (start afresh). A training
        task sets it itself: an earlier try's checkpoint.
    :param progress_sink: where the metrics history and the last checkpoint go while the run goes on (a
        :class:`ProgressSink`; a training task gives its task state store).
    :param mlflow: an MLflow run per run (needs the ``mlflow`` extra): True (MLflow's tracking URI and
        experiment), a dict with keys among ``tracking_uri``, ``experiment_name``, ``run_name``, ``tags``, or (not
        for a training task, whose value is templated) an :class:`MlflowSettings`. The run records the runner's
        settings as params, rank ``metrics_rank``'s ``log_metrics`` as metrics and the last checkpoint as tags;
        rank 0 gets ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_ID``, so that its
        ``mlflow.log_*`` and ``mlflow.autolog()`` log into it; it ends FINISHED, FAILED or KILLED (cancelled) with
        the run. A tracking server that cannot be reached costs a warning, not the training. After ``run``,
        ``mlflow_run_id`` and ``mlflow_run_url`` name it (None when there is none). See
        docs/mlflow-openlineage.md.
    :param detached_timeout: for a submitted run (``submit()``, over Spark Connect): seconds (or a timedelta,
        default 900) that it goes on with nobody attached; then it ends itself: every rank ended, its Spark jobs
        interrupted, its Connect sessions released (docs/durable-runs.md). ``run()`` stays attached throughout.
    :param outcome_timeout: for a submitted run: seconds (or a timedelta, default 6 hours) that its host keeps
        the run's outcome (rank 0's value, or its error) once it ended, whoever is attached, until a client fetches
        it (``job.wait()``); then the host releases its task slot and sessions, and ``attach()`` raises
        :class:`JobNotFoundError`. A deferred Airflow task may wait that long for a worker slot.
    :param max_restarts: how many times ``run()`` starts the ranks again after a failure that a new attempt can
        get past (default 0: never, as sparkdl and PySpark): a rank's process killed by a signal or the OOM
        killer, a lost agent, executor or host, a stall, ranks that never started. Every rank is ended, then
        started again within the same ``run()``, and ``last_checkpoint()`` in them is the latest checkpoint any
        attempt reported (else ``resume_from``); ``run()`` returns rank 0's value of the attempt that succeeded.
        An exception raised in ``main`` ends the run at once (the code's own), unless ``restart_on_exceptions``
        names it. See docs/restarts.md.
    :param restart_on_exceptions: exception types (or their names: ``"DistBackendError"``,
        ``"torch.OutOfMemoryError"``) on which ``max_restarts`` restarts the run too, when ``main`` raises one
        of them or a subclass (e.g. transient NCCL or CUDA errors). Default: none.
    """

    driver_log_verbosity: str = _setting("log_callback_only", check_verbosity)
    slot_wait_timeout: float = _setting(DEFAULT_SLOT_WAIT_S, check_slot_wait_timeout)
    start_timeout: float = _setting(DEFAULT_START_TIMEOUT_S, check_start_timeout)
    stall_timeout: float | None = _setting(None, check_stall_timeout)
    exit_timeout: float = _setting(DEFAULT_EXIT_TIMEOUT_S, check_exit_timeout)
    resume_from: dict[str, Any] | None = _setting(None, resume_value, task=False)
    progress_sink: ProgressSink | None = _setting(None, _as_sink, task=False)
    mlflow: MlflowSettings | None = _setting(None, mlflow_settings, task_check=mlflow_option)
    detached_timeout: float = _setting(DEFAULT_DETACHED_TIMEOUT_S, check_detached_timeout)
    outcome_timeout: float = _setting(DEFAULT_OUTCOME_TIMEOUT_S, check_outcome_timeout)
    max_restarts: int = _setting(0, check_max_restarts)
    restart_on_exceptions: tuple[str, ...] = _setting((), exception_names)

    @classmethod
    def from_kwargs(cls, given: Mapping[str, Any], owner: str, /, **defaults: Any) -> RunSettings:
        """The settings ``given`` as keyword arguments to ``owner`` (a TypeError names one it does not take),
        each checked; those not given are ``defaults``' (a runner's own), else the declared ones."""
        fields = {field.name: field for field in dataclasses.fields(cls)}
        unknown = next((name for name in given if name not in fields), None)
        if unknown is not None:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown!r}")
        values = {**defaults, **given}
        return cls(**{name: fields[name].metadata["check"](value) for name, value in values.items()})

    @classmethod
    def task_options(cls, kwargs: dict[str, Any], **defaults: Any) -> dict[str, Any]:
        """The settings a training task takes, popped from its ``kwargs`` (the rest are the operator's), each
        checked as the task keeps it (at parse time: templated values are checked again once rendered)."""
        values = {**defaults, **{name: kwargs.pop(name) for name in task_setting_names() if name in kwargs}}
        checked = {}
        for field in dataclasses.fields(cls):
            if field.metadata["task"]:
                check = field.metadata["task_check"] or field.metadata["check"]
                checked[field.name] = check(values.get(field.name, field.metadata["given"]))
        return checked

    def mlflow_params(self) -> dict[str, Any]:
        """The settings an MLflow run records as its params (a checkpoint by its path; neither sink nor MLflow's)."""
        return {
            "driver_log_verbosity": self.driver_log_verbosity,
            "slot_wait_timeout": self.slot_wait_timeout,
            "start_timeout": self.start_timeout,
            "stall_timeout": self.stall_timeout,
            "exit_timeout": self.exit_timeout,
            "resume_from": None if self.resume_from is None else self.resume_from.get("path"),
            "max_restarts": self.max_restarts,
            "restart_on_exceptions": ",".join(self.restart_on_exceptions) or None,
        }


def task_setting_names() -> list[str]:
    """The settings a training task takes as parameters (the others it sets itself)."""
    return [field.name for field in dataclasses.fields(RunSettings) if field.metadata["task"]]


F = TypeVar("F", bound=Callable[..., Any])


def takes_run_settings(*, task: bool = False, **defaults: Any) -> Callable[[F], F]:
    """Give a function that takes the run settings as ``**settings`` (a runner's ``__init__``, the hook's ``run``;
    ``task``: an operator's ``__init__``, which takes those of a task among its ``**kwargs``) a signature that
    names each, keyword-only, with its default (``defaults``: the owner's own), for ``help()``, ``inspect`` and
    Airflow (a DAG's ``default_args``, ``partial``/``expand``). The reference docs show the same
    (``scripts/griffe_run_settings.py``)."""
    unknown = sorted(set(defaults) - {field.name for field in dataclasses.fields(RunSettings)})
    if unknown:
        raise TypeError(f"takes_run_settings: no such run settings {unknown}")

    def apply(func: F) -> F:
        signature = inspect.signature(func)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        rest = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        settings = [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(field.name, field.metadata["given"]),
                annotation=getattr(annotation := RunOptions.__annotations__[field.name], "__forward_arg__", annotation),
            )
            for field in dataclasses.fields(RunSettings)
            if field.metadata["task"] or not task
        ]
        func.__signature__ = signature.replace(parameters=[*own, *settings, *(rest if task else [])])  # type: ignore[attr-defined]
        return func

    return apply
