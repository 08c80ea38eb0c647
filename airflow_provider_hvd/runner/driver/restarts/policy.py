"""Which failures a new attempt can get past (``max_restarts``): decided from the kind of the run's cause.

The supervisor decides an attempt's cause, the first real failure and never a consequence of it
(:mod:`..verdict.outcome`), and its error says what kind of cause that is (``cause_kind``,
:class:`~...errors.CauseKind`). A run restarts on the kinds that are not its code's own: a rank's process killed
by a signal or the OOM killer, a lost agent, executor or host, ranks that died without a word of their own
(their peers' errors alone), a stall, ranks that never started, Spark failing the barrier job's task once the
ranks ran. An exception raised in ``main`` is the code's own, unless ``restart_on_exceptions`` names its type
or a base of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import CauseKind

RESTARTED = frozenset(
    {
        CauseKind.SIGNAL,
        CauseKind.OOM,
        CauseKind.AGENT_LOST,
        CauseKind.HOST_LOST,
        CauseKind.PEER_LOST,
        CauseKind.STALL,
        CauseKind.NOT_STARTED,
        CauseKind.SPARK_JOB,
    }
)

_NOT_RESTARTED = {
    CauseKind.EXCEPTION: (
        "the cause is the code's own exception in main, which a new attempt would raise again "
        "(restart_on_exceptions names the exception types a run restarts on)"
    ),
    CauseKind.EXIT: (
        "the cause is the rank's own exit (sys.exit, os._exit: its code's doing), which a new attempt would repeat"
    ),
    CauseKind.AGENT_FAILED: (
        "the cause is the agent's own error (its executor's environment: a package missing...), which a new "
        "attempt would meet again"
    ),
    CauseKind.LAUNCH: "no attempt can get past a launch or configuration error",
    CauseKind.CANCELLED: "the run was cancelled",
}


def _names_match(name: str, qualified: str) -> bool:
    """``name`` (``ValueError``, ``torch.OutOfMemoryError``) names the class ``qualified`` (``module.QualName``)."""
    return qualified == name or qualified.endswith("." + name)


@dataclass(frozen=True)
class RestartPolicy:
    """How many restarts a run has (``max_restarts``) and the exceptions of ``main`` it restarts on too."""

    max_restarts: int = 0
    restart_on_exceptions: tuple[str, ...] = ()

    def why_not(self, error: BaseException) -> str | None:
        """Why a new attempt cannot get past the cause of ``error`` (an attempt's); None when it can."""
        kind = getattr(error, "cause_kind", None)
        if kind in RESTARTED:
            return None
        if kind is CauseKind.EXCEPTION and self._listed(getattr(error, "exception_types", ())):
            return None
        if kind is None:
            return f"the run ended by {type(error).__name__}, not by a cause of its ranks"
        return _NOT_RESTARTED[kind]

    def _listed(self, classes: tuple[str, ...]) -> bool:
        return any(_names_match(name, qualified) for name in self.restart_on_exceptions for qualified in classes)
