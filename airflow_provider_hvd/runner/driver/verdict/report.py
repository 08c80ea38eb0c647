"""The words of a run's end (driver): the error a run raises, and the reason its other ranks are ended.

:class:`~.outcome.RunOutcome` decides what happened and why; this module only says it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from ...errors import CauseKind, HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError, RunStalledError
from ...shared.messages import Done, RemoteError
from ...shared.naming import HOROVOD_RUNNER, RunnerNaming
from ..events import (
    FAILURES,
    AgentFailed,
    AgentLost,
    Cancelled,
    Event,
    HostLost,
    LaunchFailed,
    RankFailed,
    Stalled,
    StartTimedOut,
)
from .consequences import is_consequence_error
from .kills import describe_kill, killed_for_memory
from .outcome import RunOutcome, is_consequence_event
from .stacks import where_ranks_were

OTHERS_SHOWN = 20  # lines about other ranks in a RankFailedError's message
AFTER_RETURN = ", after its main returned, in its exit work: atexit handlers..."

SparkReason = Callable[[tuple[int, int]], str | None]  # why Spark ended a task, if it knows


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def who(rank: int | None, where: str) -> str:
    return f"rank {rank}" if rank is not None else f"the agent {where}"


def ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def host_lost_text(cause: HostLost, size: int, kind: str = "Horovod") -> str:
    agents = "its agent" if len(cause.ranks) == 1 else "any of their agents"
    return (
        f"{kind} {ranks_text(cause.ranks)} of {size} failed: their host {cause.host()} was lost: "
        f"nothing heard from {agents} {cause.detail}"
    )


def abort_reason(cause: Event) -> str:
    """What the run's other ranks are told when they are ended (it shows in their lines of the error)."""
    if isinstance(cause, Cancelled):
        return "the run was cancelled"
    if isinstance(cause, LaunchFailed):
        return f"{cause.what} failed"
    if isinstance(cause, StartTimedOut):
        return "the ranks did not all start in time"
    if isinstance(cause, Stalled):
        return cause.reason()
    if isinstance(cause, HostLost):
        return f"the host {cause.host()} of {ranks_text(cause.ranks)} was lost"
    assert isinstance(cause, FAILURES)
    return f"{who(cause.rank, cause.where)} failed"


def error_line(error: RemoteError) -> str:
    """The exception in one line; Horovod's long shutdown message cut to its first sentence."""
    if is_consequence_error(error) and ". " in error.message:
        return f"{error.type}: {error.message.split('. ', 1)[0]}."
    return error.line()


def rank_line(done: Done) -> str:
    if done.error:  # before terminated_by: a rank ended during its exit still failed of its own exception
        return error_line(done.error)
    if done.terminated_by:
        return f"ended by the driver ({done.terminated_by})"
    if done.exit_code == 0:
        return "exited without returning a result"
    return f"{describe_exit(done.exit_code)} without a Python exception"


def _other_line(event: Event, cause: Event | None) -> str | None:
    if isinstance(event, RankFailed):
        line = f"rank {event.rank}: {rank_line(event.done)}"
        if is_consequence_event(event):
            if isinstance(cause, FAILURES) and not is_consequence_event(cause):
                line += f" (a consequence of {who(cause.rank, cause.where)}'s failure)"
            else:
                line += " (a consequence)"
        return line
    if isinstance(event, AgentLost):
        return f"{who(event.rank, event.where)}: lost its agent {event.where}: {event.detail}"
    if isinstance(event, AgentFailed):
        return f"{who(event.rank, event.where)}: its agent failed: {event.error.line()}"
    if isinstance(event, HostLost):
        return f"{ranks_text(event.ranks)}: their host {event.host()} was lost: nothing heard {event.detail}"
    return None


def lost_after_return(event: AgentLost | HostLost, runner: str = HOROVOD_RUNNER.runner) -> str:
    """The warning about an agent or a host lost after the main of its rank(s) had returned: only their exit
    work was lost (the run succeeds once every rank has returned)."""
    if isinstance(event, HostLost):
        what = f"{ranks_text(event.ranks)} returned, then their host {event.host()} was lost"
        detail = f"nothing heard {event.detail}"
    else:
        what, detail = f"{who(event.rank, event.where)} returned, then its agent {event.where} was lost", event.detail
    return f"{runner}: {what} in the exit work (atexit handlers...): {detail}"


def cause_kind(cause: Event, before_start: bool) -> CauseKind:
    """What kind of cause ``cause`` is (``before_start``: it came before every rank had started), as the run's
    error says it (``cause_kind``): what a restart policy reads."""
    if isinstance(cause, Cancelled):
        return CauseKind.CANCELLED
    if isinstance(cause, Stalled):
        return CauseKind.STALL
    if isinstance(cause, StartTimedOut):
        return CauseKind.NOT_STARTED
    if isinstance(cause, LaunchFailed):  # before the start, Spark had given up on its own retries of the tasks
        return CauseKind.LAUNCH if before_start else CauseKind.SPARK_JOB
    if isinstance(cause, AgentFailed):
        return CauseKind.AGENT_FAILED
    if isinstance(cause, AgentLost):
        return CauseKind.AGENT_LOST
    if isinstance(cause, HostLost):
        return CauseKind.HOST_LOST
    assert isinstance(cause, RankFailed)
    if is_consequence_event(cause):
        return CauseKind.PEER_LOST
    done = cause.done
    if done.error is not None:
        return CauseKind.EXCEPTION
    if done.exit_code < 0:
        return CauseKind.OOM if killed_for_memory(cause.kill_evidence) else CauseKind.SIGNAL
    return CauseKind.EXIT


def run_error(
    outcome: RunOutcome,
    spark_reason: SparkReason = lambda task: None,
    kind: str = "Horovod",
    naming: RunnerNaming = HOROVOD_RUNNER,
) -> HorovodRunnerError | None:
    """The error the run raises (None: it succeeded), its ``cause_kind`` set. ``spark_reason`` says why Spark
    ended a task, if known; ``kind`` names the ranks (``"Horovod rank 1 of 2 failed"``, ``"torch.distributed rank
    1 of 2 failed"``), ``naming`` the runner."""
    cause, others = outcome.verdict()
    if cause is None:
        return None
    error = _error(outcome, cause, others, spark_reason, kind, naming)
    error.cause_kind = cause_kind(cause, not outcome.started_before_cause)
    return error


def _error(
    outcome: RunOutcome, cause: Event, others: list[Event], spark_reason: SparkReason, kind: str, naming: RunnerNaming
) -> HorovodRunnerError:
    before_start = not outcome.started_before_cause
    if isinstance(cause, Cancelled):
        if cause.dataframe is not None:
            return RunCancelledError(
                f"{naming.runner}: the run was cancelled before its ranks started (at that moment: {cause.dataframe})"
            )
        when = " before its ranks started" if before_start else "; every rank was ended"
        return RunCancelledError(f"{naming.runner}: the run was cancelled{when}")
    if isinstance(cause, Stalled):
        return stall_error(cause, naming.runner)
    if isinstance(cause, StartTimedOut):
        dataframe = (
            ""
            if cause.dataframe is None
            else f", not counting the time Spark worked on the DataFrame's rows (at that moment: {cause.dataframe})"
        )
        return LaunchError(
            f"only {cause.started} of {cause.size} ranks had started after {cause.seconds:.0f}s ({cause.what})"
            f"{dataframe}; the cluster may be short of task slots or the executors cannot reach this driver "
            "(start_timeout)"
        )
    if isinstance(cause, LaunchFailed):
        error = LaunchError if before_start else HorovodRunnerError
        exc = error(f"{cause.what} failed: {cause.reason}")
        exc.__cause__ = cause.exc
        return exc
    lines = [line for line in (_other_line(event, cause) for event in others) if line is not None]
    if isinstance(cause, AgentFailed):
        of_rank = f" of rank {cause.rank}" if cause.rank is not None else ""
        text = (
            f"the {naming.runner} agent{of_rank} {cause.where} failed: {cause.error.line()}\n"
            f"--- the agent's traceback ---\n{cause.error.traceback.rstrip()}"
        )
        if before_start:
            return LaunchError(text)
        return _rank_failed(cause.rank, text, lines, exit_code=None, traceback=cause.error.traceback, tail=[])
    if isinstance(cause, AgentLost):
        reason = (spark_reason(cause.task) if cause.task else None) or cause.detail
        if before_start or cause.rank is None:
            return LaunchError(f"{who(cause.rank, cause.where)} lost its agent {cause.where}: {reason}")
        text = (
            f"{kind} rank {cause.rank} of {outcome.size} failed: its agent {cause.where} was lost "
            f"(its Spark task, executor or host died{AFTER_RETURN if cause.after_return else ''}): {reason}"
        )
        return _rank_failed(cause.rank, text, lines, exit_code=None, traceback=None, tail=[])
    if isinstance(cause, HostLost):
        return _rank_failed(
            cause.rank, host_lost_text(cause, outcome.size, kind), lines, exit_code=None, traceback=None, tail=[]
        )
    assert isinstance(cause, RankFailed)
    done = cause.done
    parts = [f"{kind} rank {cause.rank} of {outcome.size} failed: {rank_line(done)}"]
    if cause.after_return:
        parts[0] += f" ({AFTER_RETURN.removeprefix(', ')})"
    if cause.kill_evidence:
        parts.append(describe_kill(cause.kill_evidence, naming.runner))
    if is_consequence_event(cause):
        reaction = "Horovod was shut down under this rank" if kind == "Horovod" else f"{kind} lost a peer of this rank"
        parts.append(
            f"({reaction}, and no rank reported a failure of its own: a rank's process "
            "or host may have died without a trace; see the other ranks below and the executors' logs)"
        )
    if done.error:
        parts.append(f"--- remote traceback (rank {cause.rank}) ---\n{done.error.traceback.rstrip()}")
    if done.tail:
        parts.append(f"--- last {len(done.tail)} lines of rank {cause.rank}'s output ---\n" + "\n".join(done.tail))
    failed = _rank_failed(
        cause.rank, "\n".join(parts), lines, done.exit_code, done.error.traceback if done.error else None, done.tail
    )
    failed.exception_types = tuple(done.error.classes) if done.error else ()
    return failed


def _rank_failed(
    rank: int | None, text: str, others: list[str], exit_code: int | None, traceback: str | None, tail: list[str]
) -> RankFailedError:
    if others:
        shown = others[:OTHERS_SHOWN]
        if len(others) > OTHERS_SHOWN:  # a run of 1,000 ranks: the error stays readable
            shown.append(f"... and {len(others) - OTHERS_SHOWN} more (all in the error's other_failures)")
        text += "\n--- other ranks ---\n" + "\n".join(shown)
    return RankFailedError(
        text, rank=rank, exit_code=exit_code, remote_traceback=traceback, output_tail=tail, other_failures=others
    )


def stall_error(event: Stalled, runner: str = HOROVOD_RUNNER.runner) -> RunStalledError:
    ranks = sorted(rank.rank for rank in event.ranks)
    text = (
        f"{runner}: the run stalled: no rank wrote output or reported progress for {event.seconds:.0f}s "
        f"(stall_timeout={event.seconds:g}); every rank was ended. Stalled: rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}. Where each one was, longest quiet first (innermost frames first):\n"
        + where_ranks_were(event.ranks)
    )
    stacks = {r.rank: r.stacks if r.stacks is not None else f"(no stacks: {r.no_stacks})" for r in event.ranks}
    return RunStalledError(text, stall_timeout=event.seconds, ranks=ranks, stacks=stacks)
