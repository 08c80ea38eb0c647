"""HorovodRunnerOperator: a HorovodRunner job as an Airflow task; rank 0's return value is its XCom."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator, BaseOperatorLink

from airflow_provider_hvd.hooks.horovod import HorovodHook
from airflow_provider_hvd.hooks.task_state import TaskStateProgress
from airflow_provider_hvd.runner.driver.slots import DEFAULT_SLOT_WAIT_S, check_slot_wait_timeout
from airflow_provider_hvd.runner.driver.stalls import check_stall_timeout
from airflow_provider_hvd.runner.errors import RunCancelledError
from airflow_provider_hvd.runner.runner import check_verbosity

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

_SHIPPABLE = (str, int, float, bool, type(None))


class SparkUILink(BaseOperatorLink):
    """A page about the Spark application that ran the task's barrier job, one that outlives the task.

    The History Server's, YARN's tracking URL or the standalone master's application page; no link on a
    local master (the driver's own UI stops with the task).
    """

    name = "Spark UI"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return getattr(operator, "spark_ui_url", None) or ""


class HorovodRunnerOperator(BaseOperator):
    """Run ``python_callable(*op_args, **op_kwargs)`` on ``np`` Horovod ranks; push rank 0's return value.

    :param python_callable: the training function; it calls ``hvd.init()`` itself. Shipped with cloudpickle.
    :param op_args: positional arguments (templated).
    :param op_kwargs: keyword arguments (templated).
    :param np: ranks: ``np > 0`` a Spark barrier job on the connection's cluster, ``np < 0`` local processes.
    :param driver_log_verbosity: ``"log_callback_only"`` (default) or ``"all"``: which rank output reaches
        the task log.
    :param conn_id: the ``spark`` connection (default ``spark_default``; templated).
    :param spark_conf: Spark settings on top of the connection's (templated).
    :param slot_wait_timeout: seconds to wait for ``np`` free task slots on a busy cluster (default 600)
        before failing; a job that can never fit the cluster fails at once.
    :param stall_timeout: seconds or a timedelta (default None: off). When no rank has written output or reported
        progress for that long, the task log gets every rank's Python stacks, the ranks are ended and the task
        fails with :class:`RunStalledError` saying where each rank was. Airflow's ``execution_timeout`` and
        marking the task failed also log where the ranks were before ending them.

    Progress goes to the task state store while the job runs (Airflow 3.3+): rank 0's ``log_metrics``
    history under ``hvd_metrics``, the last ``report_checkpoint`` under ``hvd_checkpoint``. On a retry,
    ``last_checkpoint()`` in the ranks returns the checkpoint an earlier try reported (see docs/long-runs.md).
    """

    template_fields: Sequence[str] = ("op_args", "op_kwargs", "np", "conn_id", "spark_conf")
    template_fields_renderers: ClassVar[dict[str, str]] = {"op_args": "py", "op_kwargs": "py", "spark_conf": "json"}
    operator_extra_links = (SparkUILink(),)
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        np: int | str,
        driver_log_verbosity: str = "log_callback_only",
        conn_id: str = HorovodHook.default_conn_name,
        spark_conf: dict[str, Any] | None = None,
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_S,
        stall_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise TypeError(f"python_callable must be callable, not {type(python_callable).__name__}")
        check_verbosity(driver_log_verbosity)  # at parse time, not when the task runs
        self.slot_wait_timeout = check_slot_wait_timeout(slot_wait_timeout)
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        self.np = np
        self.driver_log_verbosity = driver_log_verbosity
        self.conn_id = conn_id
        self.spark_conf = spark_conf or {}
        self.spark_ui_url: str | None = None
        self._hook: HorovodHook | None = None
        self._killed = False

    def _context_kwargs(self, context: Context) -> dict[str, Any]:
        """Context values the callable asks for by name (``ds``, ``run_id``...): plain ones only, they travel."""
        wanted = {
            name
            for name in inspect.signature(self.python_callable).parameters
            if name in context and name not in self.op_kwargs
        }
        unshippable = sorted(name for name in wanted if not isinstance(context[name], _SHIPPABLE))  # type: ignore[literal-required]
        if unshippable:
            raise TypeError(
                f"{self.python_callable.__name__}() asks for the context value(s) {unshippable}, which cannot be "
                "sent to Horovod ranks on other machines; pass what you need through op_kwargs templates instead, "
                "e.g. op_kwargs={'run_id': '{{ run_id }}'}"
            )
        return {name: context[name] for name in wanted}  # type: ignore[literal-required]

    def execute(self, context: Context) -> Any:
        try:
            np = int(self.np) if isinstance(self.np, str) else self.np
        except ValueError:
            raise ValueError(f"np rendered to {self.np!r}; it must be a non-zero int") from None
        kwargs = {**self._context_kwargs(context), **self.op_kwargs}
        if self._killed:  # on_kill() came before the job started
            raise RunCancelledError("the task was killed before its Horovod job started")
        self._hook = HorovodHook(self.conn_id, self.spark_conf, app_name=f"{self.dag_id}.{self.task_id}")
        progress = self._task_state_progress(context)
        try:
            value = self._hook.run(
                self.python_callable,
                self.op_args,
                kwargs,
                np=np,
                driver_log_verbosity=self.driver_log_verbosity,
                slot_wait_timeout=self.slot_wait_timeout,
                stall_timeout=self.stall_timeout,
                resume_from=progress.last_checkpoint() if progress else None,
                progress_sink=progress,
            )
        finally:
            self.spark_ui_url = self._hook.ui_url
        if self._killed:  # Airflow lets execute go on after on_kill(): the task must not end as a success
            raise RunCancelledError("the task was killed; every Horovod rank was ended")
        if self.do_xcom_push:
            self._check_xcom_value(value)
        if progress is not None and self._hook.runner is not None:
            progress.mark_finished(self._hook.runner.checkpoint)
        return value

    @staticmethod
    def _task_state_progress(context: Context) -> TaskStateProgress | None:
        """The run's progress sink on the task state store (None where Airflow has none: before 3.3)."""
        store = context.get("task_state_store")
        if store is None:
            return None
        ti = context.get("ti")
        return TaskStateProgress(store, getattr(ti, "try_number", None))

    def _check_xcom_value(self, value: Any) -> None:
        from airflow.sdk.execution_time.xcom import XCom

        try:
            XCom.serialize_value(value)
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises, say what to do instead
            raise TypeError(
                f"Rank 0 of {self.task_id!r} returned a {type(value).__module__}.{type(value).__qualname__}, "
                f"which Airflow cannot store as an XCom ({exc}). Return plain data (numbers, strings, lists, "
                "dicts), or save the object (a model, a tensor) to shared storage and return its path."
            ) from exc

    def on_kill(self) -> None:
        self._killed = True
        if self._hook is not None:
            self._hook.cancel()
