"""The messages between a rank process, its agent and the driver: one small dataclass per kind.

Each travels as one frame (:mod:`.wire`): a kind byte, then JSON, or raw bytes for pickled data.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .wire import Body, FrameStream, Kind, Pieces, frame_header


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[Kind]

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def decode(cls, data: Body) -> Message:
        return cls(**_json(data))


def _json(data: Body) -> Any:
    return json.loads(data.read() if isinstance(data, Pieces) else data)


@dataclass(frozen=True)
class RawMessage(Message):
    """A message that is one blob of bytes (pickled data), sent as is; received as it came (never copied)."""

    data: Body

    def encode(self) -> bytes:
        assert isinstance(self.data, bytes), "a received body is read, not sent on"
        return self.data

    @classmethod
    def decode(cls, data: Body) -> Message:
        return cls(data)


def unpickle(data: Body) -> Any:
    """The object a pickled body holds; one received in pieces is read piece by piece (never whole beside it)."""
    return pickle.load(data) if isinstance(data, Pieces) else pickle.loads(data)


@dataclass(frozen=True)
class RemoteError:
    """A Python exception on the other side, as text."""

    type: str
    message: str
    traceback: str
    at: float | None = None  # when it was caught, by the wall clock of the host it was raised on (time.time())
    # its class and bases, "module.QualName" each (builtins.ValueError, builtins.Exception): what restart_on_exceptions
    # matches, as an ``except`` clause would
    classes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        import traceback

        classes = [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__ if c not in (BaseException, object)]
        return cls(type(exc).__qualname__, str(exc), "".join(traceback.format_exception(exc)), time.time(), classes)

    def line(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


# agent -> driver


@dataclass(frozen=True)
class Hello(Message):
    """An agent is ready: where it runs (``host`` is the address it reaches the driver from)."""

    KIND: ClassVar[Kind] = Kind.HELLO
    host: str
    pid: int
    partition: int | None = None  # the agent's place in its launch (Spark: its task's partition); ranks follow it
    process: int = 0  # the agent's place in its task (gpu.amount = k torch ranks per task: k agents); ranks follow it
    executor: str | None = None  # Spark only: the executor's address and the task's attempt
    attempt: int | None = None
    cpus: int | None = None  # the cores Spark gave the task
    resources: dict[str, list[str]] = field(default_factory=dict)  # Spark's task resources (gpu -> addresses)
    hostname: str | None = None  # the host's name (``host`` is its address)

    def where(self) -> str:
        if self.executor is None:
            return f"on {self.host}"
        return f"in Spark task {self.partition} (attempt {self.attempt}) on executor {self.executor} ({self.host})"


@dataclass(frozen=True)
class ShardProgress(Message):
    """A run on a DataFrame: Spark task ``task``'s rows written to its ranks' shards so far, from a connection of
    its own while they stream in (before its agents say hello); the last one says ``done``."""

    KIND: ClassVar[Kind] = Kind.SHARD_PROGRESS
    task: int
    rows: int
    bytes: int
    done: bool = False


@dataclass(frozen=True)
class LogBatch(Message):
    KIND: ClassVar[Kind] = Kind.LOG
    lines: list[str]
    dropped: int = 0  # lines dropped since the last batch (the driver did not keep up)


@dataclass(frozen=True)
class Result(RawMessage):
    """Rank 0's pickled return value (also rank process -> agent on the control pipe)."""

    KIND: ClassVar[Kind] = Kind.RESULT


@dataclass(frozen=True)
class Returned(Message):
    """The rank's ``main`` returned (rank 0's value went as :class:`Result` before); its process is exiting."""

    KIND: ClassVar[Kind] = Kind.RETURNED


@dataclass(frozen=True)
class Done(Message):
    """How the rank ended; the agent's last message."""

    KIND: ClassVar[Kind] = Kind.DONE
    exit_code: int
    ok: bool
    error: RemoteError | None = None
    terminated_by: str | None = None  # the driver's reason when it asked the agent to end the rank
    tail: list[str] = field(default_factory=list)
    dropped: int = 0
    ended_at: float | None = None  # when the agent saw the rank process end (time.time() on the rank's host)
    kill_evidence: dict[str, Any] | None = None  # a rank killed by a signal: what its host said (agent/kill_evidence)

    @classmethod
    def decode(cls, data: Body) -> Message:
        fields = _json(data)
        error = fields.pop("error")
        return cls(error=RemoteError(**error) if error else None, **fields)


@dataclass(frozen=True)
class _ErrorReport(Message):
    error: RemoteError

    @classmethod
    def decode(cls, data: Body) -> Message:
        return cls(RemoteError(**_json(data)["error"]))


@dataclass(frozen=True)
class AgentFailed(_ErrorReport):
    """The agent itself failed (not its rank): its exception."""

    KIND: ClassVar[Kind] = Kind.AGENT_FAILED


# driver -> agent


@dataclass(frozen=True)
class Start(Message):
    """Start the rank: its kind, its slot and the settings it runs with."""

    KIND: ClassVar[Kind] = Kind.START
    rank: int
    kind: str  # the rank kind: "Horovod" or "torch.distributed" (shared.horovod_env.KIND, shared.torch_env.KIND)
    env: dict[str, str]  # what makes the rank join this run: HOROVOD_* (with the driver's own) or torchrun's
    local_size: int
    gpus: list[str] | None = None  # the GPUs the rank sees, in order (None: it was given none)


@dataclass(frozen=True)
class Abort(Message):
    KIND: ClassVar[Kind] = Kind.ABORT
    reason: str


# rank process -> agent (control pipe)


@dataclass(frozen=True)
class RankError(_ErrorReport):
    """The rank's ``main`` raised: its exception."""

    KIND: ClassVar[Kind] = Kind.ERROR


@dataclass(frozen=True)
class DriverMessage(Message):
    """A ``log_to_driver`` message; its marker line with the same ``seq`` keeps its place in the output."""

    KIND: ClassVar[Kind] = Kind.MESSAGE
    seq: int
    text: str


# progress (agent -> driver; the Rank* twins: rank process -> agent, on the control pipe)


@dataclass(frozen=True)
class Metrics(Message):
    """Numbers a rank reported for one step with ``log_metrics`` (None stands for NaN or infinity)."""

    KIND: ClassVar[Kind] = Kind.METRICS
    step: float
    values: dict[str, float | None]
    time: float  # when the rank reported (seconds since the epoch)


@dataclass(frozen=True)
class RankMetrics(Metrics):
    KIND: ClassVar[Kind] = Kind.RANK_METRICS

    def relayed(self) -> Metrics:
        return Metrics(self.step, self.values, self.time)


@dataclass(frozen=True)
class Checkpoint(Message):
    """A checkpoint a rank reported with ``report_checkpoint`` once it was written: where, and what it holds."""

    KIND: ClassVar[Kind] = Kind.CHECKPOINT
    path: str
    info: dict[str, object]
    time: float


@dataclass(frozen=True)
class RankCheckpoint(Checkpoint):
    KIND: ClassVar[Kind] = Kind.RANK_CHECKPOINT

    def relayed(self) -> Checkpoint:
        return Checkpoint(self.path, self.info, self.time)


# heartbeats, both ways, every interval (.liveness); any frame received shows that the link is alive


@dataclass(frozen=True)
class AgentAlive(Message):
    KIND: ClassVar[Kind] = Kind.AGENT_ALIVE


@dataclass(frozen=True)
class DriverAlive(Message):
    KIND: ClassVar[Kind] = Kind.DRIVER_ALIVE


# stalls and killed ranks (agent/stacks.py, driver/watch/stalls.py)


@dataclass(frozen=True)
class RankState(Message):
    """Agent -> driver. Without an answer: its rank wrote output or sent a message since the last one (the
    driver's stall clock). With ``stacks`` or ``no_stacks``: the answer to :class:`DumpStacks`."""

    KIND: ClassVar[Kind] = Kind.RANK_STATE
    stacks: str | None = None  # the rank's Python stacks, as faulthandler wrote them
    no_stacks: str | None = None  # why there are none

    @property
    def answers(self) -> bool:
        return self.stacks is not None or self.no_stacks is not None


@dataclass(frozen=True)
class DumpStacks(Message):
    """Driver -> agent: answer with the rank's Python stacks (the run stalled, or the driver was interrupted)."""

    KIND: ClassVar[Kind] = Kind.DUMP_STACKS


@dataclass(frozen=True)
class RankReady(Message):
    """Rank process -> agent (control pipe), first thing: its pid, and the signal that makes it write its stacks."""

    KIND: ClassVar[Kind] = Kind.RANK_READY
    pid: int
    stacks_signal: int


_BY_KIND: dict[Kind, type[Message]] = {
    cls.KIND: cls for cls in (Hello, LogBatch, Result, Done, AgentFailed, Start, Abort, RankError, DriverMessage)
}
_BY_KIND.update({cls.KIND: cls for cls in (Metrics, RankMetrics, Checkpoint, RankCheckpoint)})
_BY_KIND.update({AgentAlive.KIND: AgentAlive, DriverAlive.KIND: DriverAlive})
_BY_KIND[Returned.KIND] = Returned
_BY_KIND[ShardProgress.KIND] = ShardProgress
_BY_KIND.update({cls.KIND: cls for cls in (RankState, DumpStacks, RankReady)})


def send(stream: FrameStream, message: Message) -> None:
    stream.send(message.KIND, message.encode())


def frame(message: Message) -> bytes:
    """``message`` as one frame's bytes (for writers that do not go through a :class:`~.wire.FrameStream`)."""
    body = message.encode()
    return frame_header(message.KIND, len(body)) + body


def decode(kind: Kind, data: Body) -> Message:
    """The message a frame of ``kind`` carries."""
    return _BY_KIND[kind].decode(data)


def receive(stream: FrameStream) -> Message:
    """The next message; :class:`~.wire.ConnectionClosed` at the end of the stream."""
    return decode(*stream.recv())
