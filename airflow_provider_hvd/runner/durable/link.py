"""The link between a submitted run's host and the clients attached to it: its messages, and its two ends'
connection set-up (the host accepts, a client connects).

A link is one TCP connection, always TLS 1.3, pinned by the fingerprint of a certificate the host made for it
(:mod:`..shared.tls`; whatever Spark encrypts: the client unpickles rank 0's value from it, and the submitting
client hands the host its MLflow credentials over it), then the mutual HMAC handshake over the link's own secret
(:mod:`..shared.wire`), before any frame is read. Frames are those of the driver channel; the kinds
are ``LINK_*``. Both sides send ``LINK_ALIVE`` every heartbeat interval; a side that hears nothing for the
heartbeat timeout takes the other for gone.
"""

from __future__ import annotations

import json
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..shared.messages import Message, RawMessage
from ..shared.timing import CONNECT_TIMEOUT_S, HANDSHAKE_TIMEOUT_S
from ..shared.tls import accept_tls, connect_tls
from ..shared.wire import Body, DriverHandshake, FrameStream, Kind, connect_handshake

#: the key of the run's session conf where the host publishes how to reach it (:func:`published` reads it)
LINK_CONF = "spark.horovodRunner.durable.link"
#: the session id of the ranks' own session (the host publishes it beside the link: a cancel without a link ends it)
RANKS_CONF = "spark.horovodRunner.durable.ranks"
#: the Progress that names the run's MLflow run (``{"run_id", "url"}``), which its host made
MLFLOW_RUN = "mlflow_run"


@dataclass(frozen=True)
class LinkAddress:
    """How to reach a run's host: what it publishes in its session's conf (the secret is the link's own)."""

    host: str
    port: int
    # the link's secret, hex: named so that the server's redaction (spark.redaction.regex, which matches "secret",
    # "token", "password") does not hide the value from the session's own clients (a Connect server answers None)
    hmac: str
    fingerprint: str  # the link's TLS certificate (SHA-256, hex)
    hostname: str = ""
    pid: int = 0
    interval_s: float = 2.0  # the host's heartbeats (its run's liveness settings)
    timeout_s: float = 10.0

    def to_conf(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_conf(cls, value: str) -> LinkAddress:
        return cls(**json.loads(value))


@dataclass(frozen=True)
class HostGone:
    """What a host publishes in LINK_CONF in place of its address: it could not start (``lost`` False: ``cause``
    says why), or a later attempt of its task found the first one gone (``lost``; ``was``: the first one's
    address, which a client tries before it believes it)."""

    cause: str
    lost: bool = False
    was: LinkAddress | None = None

    def to_conf(self) -> str:
        key = "lost" if self.lost else "failed"
        return json.dumps({key: self.cause, "was": None if self.was is None else self.was.__dict__})


def published(value: object) -> LinkAddress | HostGone | None:
    """What the run's host published in LINK_CONF (``value``, None: nothing yet), whichever of its kinds."""
    if value is None or value == "":
        return None
    try:
        data = json.loads(str(value))
        if "failed" in data or "lost" in data:
            was = LinkAddress(**data["was"]) if data.get("was") else None
            return HostGone(str(data.get("lost", data.get("failed"))), "lost" in data, was)
        return LinkAddress(**data)
    except (TypeError, ValueError, AttributeError) as exc:
        return HostGone(f"its host published {str(value)[:200]!r} where its link's address belongs ({exc})")


@dataclass(frozen=True)
class Attach(Message):
    """A client attaches: ``logs`` whether it relays the run's lines; they resume after line ``after`` (None:
    after the last line any client acknowledged); ``fetch`` whether it fetches the run's outcome."""

    KIND: ClassVar[Kind] = Kind.LINK_ATTACH
    logs: bool = True
    after: int | None = None
    fetch: bool = True  # False: a watcher, which never gets rank 0's value (the Outcome says its size)


@dataclass(frozen=True)
class Lines(Message):
    """Log entries from line ``first`` on (a rank entry ``["rank", rank, [lines]]``, with the attempt after the
    lines from a run's second attempt on, counts its lines, a runner entry ``["log", logger, level, message]``
    one); ``lost`` lines before them were no longer kept."""

    KIND: ClassVar[Kind] = Kind.LINK_LINES
    first: int
    entries: list[list[Any]] = field(default_factory=list)
    lost: int = 0


@dataclass(frozen=True)
class Ack(Message):
    KIND: ClassVar[Kind] = Kind.LINK_ACK
    upto: int  # the client relayed every line before this one


@dataclass(frozen=True)
class Status(Message):
    KIND: ClassVar[Kind] = Kind.LINK_STATUS
    phase: str
    ranks_started: int
    size: int
    cause: str | None = None
    attempt: int = 1  # the run's attempt (``max_restarts``): its phase and ranks are this attempt's


@dataclass(frozen=True)
class Progress(Message):
    KIND: ClassVar[Kind] = Kind.LINK_PROGRESS
    what: str  # "metrics", "checkpoint" or "restarts" (the ProgressSink method), or MLFLOW_RUN
    value: dict[str, Any] | list[Any]  # (a list: "restarts", the record of each attempt)


@dataclass(frozen=True)
class Outcome(Message):
    """How the run ended: ``error`` (the raised error's parts, :mod:`.outcome_parts`) or rank 0's value, pickled,
    ``value_bytes`` long, in the ``LINK_RESULT`` frame that follows (to a fetching client only); the run's metrics
    history, last checkpoint, and the record of each attempt (``HorovodRunner.attempts``')."""

    KIND: ClassVar[Kind] = Kind.LINK_OUTCOME
    error: dict[str, Any] | None
    metrics: dict[str, list[list[float | None]]] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None
    value_bytes: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class LinkResult(RawMessage):
    KIND: ClassVar[Kind] = Kind.LINK_RESULT


@dataclass(frozen=True)
class Cancel(Message):
    KIND: ClassVar[Kind] = Kind.LINK_CANCEL


@dataclass(frozen=True)
class Fetched(Message):
    """The client holds the outcome (rank 0's value unpickled, or the run's error): the host may let it go."""

    KIND: ClassVar[Kind] = Kind.LINK_FETCHED


@dataclass(frozen=True)
class Alive(Message):
    KIND: ClassVar[Kind] = Kind.LINK_ALIVE


@dataclass(frozen=True)
class Credentials(Message):
    """The submitting client's MLflow tracking URI and credentials (``MLFLOW_TRACKING_PASSWORD``, ...), for the
    host's MLflow run: sent once attached, so that they are never in the host's plan, which the server may log."""

    KIND: ClassVar[Kind] = Kind.LINK_CREDENTIALS
    tracking_uri: str | None
    env: dict[str, str] = field(default_factory=dict)


_BY_KIND: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (Attach, Lines, Ack, Status, Progress, Outcome, LinkResult, Cancel, Fetched, Alive, Credentials)
}


def send(stream: FrameStream, message: Message) -> None:
    stream.send(message.KIND, message.encode())


def receive(stream: FrameStream) -> Message:
    """The next link message; ``ValueError`` for a frame kind the link does not carry."""
    kind, body = stream.recv()
    if kind not in _BY_KIND:
        raise ValueError(f"the link does not carry {kind.name} frames")
    return _BY_KIND[kind].decode(body)


def decode(kind: Kind, body: Body) -> Message:
    return _BY_KIND[kind].decode(body)


def accept_link(sock: socket.socket, secret: bytes, tls: ssl.SSLContext) -> tuple[socket.socket, FrameStream]:
    """The host's end of a new connection: TLS with the link's certificate, then the peer must prove ``secret``;
    ``AuthenticationError``/``OSError``/``ssl.SSLError`` otherwise, before any frame is read. Returns the socket
    (TLS is done in memory above it, :mod:`..shared.tls`) and its frames."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    stream = accept_tls(sock, tls)
    handshake = DriverHandshake(secret)
    stream.write_bytes(handshake.nonce)
    stream.write_bytes(handshake.verify(stream.read_bytes(DriverHandshake.ANSWER_BYTES)))
    return sock, stream


def connect_link(address: LinkAddress, timeout: float = CONNECT_TIMEOUT_S) -> tuple[socket.socket, FrameStream]:
    """A client's end: connect to the host, check its certificate against the published fingerprint, prove the
    link's secret and have the host prove it back."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout)
    try:
        stream = connect_tls(sock, address.fingerprint, "the run's host")
        connect_handshake(sock, bytes.fromhex(address.hmac), over=stream)
    except BaseException:
        sock.close()
        raise
    return sock, stream


def answers(address: LinkAddress, timeout: float) -> bool:
    """Whether a host answers at ``address`` and proves the link's secret (it takes the closed connection that
    follows for a probe, and says nothing of it)."""
    try:
        sock, stream = connect_link(address, timeout)
    except OSError:
        return False
    stream.close()
    sock.close()
    return True
