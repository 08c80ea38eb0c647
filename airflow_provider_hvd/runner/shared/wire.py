"""Framing and authentication shared by the driver channel, the rank agents and the rank processes.

A frame is ``kind (1 byte) | length (4 bytes, big endian) | payload``. Network connections start with a
mutual HMAC challenge over a per-run secret; no frame is read from a peer before it has proven the secret.
:class:`FrameStream` and :func:`connect_handshake` do blocking I/O (agents, rank processes);
:class:`FrameDecoder` and :class:`DriverHandshake` do none, for the driver's event loop.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .timing import HANDSHAKE_TIMEOUT_S as HANDSHAKE_TIMEOUT_S  # (read as wire.HANDSHAKE_TIMEOUT_S too)

_HEADER = struct.Struct("!BI")
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
MAX_FRAME_BYTES = 1 << 31
_COALESCE_BYTES = 64 << 10  # frames up to this size are written with one call
PIECE_BYTES = 64 << 20  # a result larger than this is kept in pieces of this size (each its own mapping: see Pieces)


class Kind(enum.IntEnum):
    """The kind byte of a frame; :mod:`.messages` has a dataclass for each."""

    # agent -> driver (RESULT also rank process -> agent, on the control pipe)
    HELLO = 1
    LOG = 2
    RESULT = 3
    DONE = 4
    AGENT_FAILED = 5
    METRICS = 7  # progress: a rank's metrics, relayed by its agent
    CHECKPOINT = 8  # progress: a checkpoint a rank reported, relayed by its agent
    AGENT_ALIVE = 6  # heartbeat (.liveness)
    RETURNED = 11  # the rank's main returned; its process runs its exit work (driver/verdict/exits.py)
    SHARD_PROGRESS = 15  # a run on a DataFrame: a barrier task's rows streamed into its shards so far
    # driver -> agent
    START = 10
    ABORT = 12
    DRIVER_ALIVE = 13  # heartbeat (.liveness)
    NOTICE = 16  # a host of the run's ranks is being decommissioned (rank.preemption)
    # rank process -> agent (control pipe)
    ERROR = 20
    MESSAGE = 21
    RANK_METRICS = 22  # log_metrics()
    RANK_CHECKPOINT = 23  # report_checkpoint()
    # stalls and killed ranks: agent -> driver, driver -> agent, rank process -> agent (control pipe)
    RANK_STATE = 9
    DUMP_STACKS = 14
    RANK_READY = 24
    # a submitted run's link (runner/durable/link.py): the run's host <-> an attached client
    LINK_ATTACH = 30  # client -> host: who attaches, and where its log lines resume
    LINK_LINES = 31  # host -> client: numbered log lines, and how many were lost
    LINK_ACK = 32  # client -> host: the lines it has relayed
    LINK_STATUS = 33  # host -> client: the run's phase
    LINK_PROGRESS = 34  # host -> client: a progress write (metrics, checkpoint)
    LINK_OUTCOME = 35  # host -> client: how the run ended
    LINK_RESULT = 36  # host -> client: rank 0's pickled value, as the rank sent it
    LINK_CANCEL = 37  # client -> host: end the run
    LINK_FETCHED = 38  # client -> host: the outcome arrived; the host may end
    LINK_ALIVE = 39  # both ways: a heartbeat
    LINK_CREDENTIALS = 40  # submitting client -> host: MLflow's tracking URI and credentials, kept out of the plan


class ConnectionClosed(EOFError):
    """The peer closed the stream (or it broke) between or inside frames."""


class AuthenticationError(ConnectionError):
    """The peer does not know this run's secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def frame_header(kind: Kind, length: int) -> bytes:
    return _HEADER.pack(kind, length)


class Pieces:
    """A large frame body (a result) as pieces of :data:`PIECE_BYTES`, read once, like a file (``pickle.load``).

    Each piece is let go as soon as it has been read: the body and the object made from it are never both held
    whole (a 1 GiB result costs the driver about 1 GiB, not 2). Pieces this large are each their own memory
    mapping (past malloc's largest mmap threshold, 32 MiB), so a piece let go is given back to the system at once.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self._pieces: collections.deque[bytearray] = collections.deque()
        self._filled = 0  # bytes written into the pieces
        self._offset = 0  # bytes of the first piece already read

    def __len__(self) -> int:
        return self.length

    @property
    def complete(self) -> bool:
        return self._filled == self.length

    def fill(self, data: memoryview) -> int:
        """Take what of ``data`` belongs to the body; returns how many bytes that was."""
        took = 0
        while took < len(data) and self._filled < self.length:
            piece = self._pieces[-1] if self._pieces else None
            at = self._filled % PIECE_BYTES
            if piece is None or at == 0:
                piece = bytearray(min(PIECE_BYTES, self.length - self._filled))
                self._pieces.append(piece)
            take = min(len(piece) - at, len(data) - took)
            piece[at : at + take] = data[took : took + take]
            took += take
            self._filled += take
        return took

    def readinto(self, buffer: bytearray | memoryview) -> int:
        target = memoryview(buffer).cast("B")
        done = 0
        while done < len(target) and self._pieces:
            piece = self._pieces[0]
            take = min(len(piece) - self._offset, len(target) - done)
            target[done : done + take] = memoryview(piece)[self._offset : self._offset + take]
            done += take
            self._offset += take
            if self._offset == len(piece):
                self._pieces.popleft()  # given back: the object being made from it takes its place
                self._offset = 0
        return done

    def read(self, n: int = -1) -> bytes:
        left = sum(map(len, self._pieces)) - self._offset
        buffer = bytearray(left if n < 0 else min(n, left))
        return bytes(buffer[: self.readinto(buffer)])

    def readline(self) -> bytes:
        line = bytearray()
        while not line.endswith(b"\n") and (byte := self.read(1)):
            line += byte
        return bytes(line)


Body = bytes | bytearray | Pieces  # a received frame's body


class FrameDecoder:
    """Frames out of a byte stream that arrives in pieces (the driver reads its connections without blocking).

    A frame's body is collected in one buffer of its announced length, and a result larger than
    :data:`PIECE_BYTES` in :class:`Pieces`: a large body is never copied whole.
    """

    def __init__(self) -> None:
        self._head = bytearray()
        self._kind: Kind | None = None
        self._body: bytearray | Pieces | None = None
        self._got = 0

    def feed(self, data: bytes | memoryview) -> list[tuple[Kind, Body]]:
        """The frames that ``data`` completes; ``ValueError`` for an unknown kind or an oversized frame."""
        frames: list[tuple[Kind, Body]] = []
        view = memoryview(data)
        while view:
            if self._body is None:
                take = _HEADER.size - len(self._head)
                self._head += view[:take]
                view = view[take:]
                if len(self._head) < _HEADER.size:
                    break
                kind, length = _HEADER.unpack(self._head)
                self._head.clear()
                if length > MAX_FRAME_BYTES:
                    raise ValueError(f"frame of {length} bytes is larger than allowed")
                self._kind, self._got = Kind(kind), 0
                self._body = Pieces(length) if self._kind is Kind.RESULT and length > PIECE_BYTES else bytearray(length)
            if isinstance(self._body, Pieces):
                view = view[self._body.fill(view) :]
                done = self._body.complete
            else:
                take = min(len(self._body) - self._got, len(view))
                self._body[self._got : self._got + take] = view[:take]
                self._got += take
                view = view[take:]
                done = self._got == len(self._body)
            if done:
                assert self._kind is not None
                frames.append((self._kind, self._body))
                self._kind, self._body = None, None
        return frames


class Reader(Protocol):
    """What :class:`FrameStream` reads from: a binary file, or TLS on a socket (:class:`.tls.TlsReader`)."""

    def read(self, n: int, /) -> bytes | None: ...
    def close(self) -> None: ...


def _read_exact(stream: Reader, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) < n:
        raise ConnectionClosed(f"stream closed after {0 if not data else len(data)} of {n} bytes")
    return data


class FrameStream:
    """Reads and writes frames on a byte stream; writes are serialised so that threads can share it."""

    def __init__(self, reader: Reader, write: Any, sock: socket.socket | None = None) -> None:
        """Frames read from ``reader`` and written with ``write``; ``sock``: the socket under them, closed with
        the stream."""
        self._reader = reader
        self._write = write
        self._lock = threading.Lock()
        self._sock = sock

    @classmethod
    def over_socket(cls, sock: socket.socket) -> FrameStream:
        """Frames on ``sock`` as it is (over TLS: :func:`.tls.tls_stream`)."""
        return cls(sock.makefile("rb"), sock.sendall, sock)

    def read_bytes(self, n: int) -> bytes:
        """Exactly ``n`` bytes, outside any frame (a handshake's)."""
        return _read_exact(self._reader, n)

    def write_bytes(self, data: bytes) -> None:
        """``data`` as it is, outside any frame (a handshake's)."""
        with self._lock:
            self._write(data)

    def close(self) -> None:
        """Shut the socket down (a thread blocked reading it wakes up) and release it."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._reader is not None:
            self._reader.close()

    def send(self, kind: Kind, payload: bytes = b"") -> None:
        header = frame_header(kind, len(payload))
        with self._lock:
            if len(payload) <= _COALESCE_BYTES:
                self._write(header + payload)
            else:  # a large payload (a pickled result) goes as it is: no copy of it with the header in front
                self._write(header)
                self._write(payload)

    def recv(self) -> tuple[Kind, bytes]:
        kind, length = _HEADER.unpack(_read_exact(self._reader, _HEADER.size))
        if length > MAX_FRAME_BYTES:
            raise ConnectionClosed(f"frame of {length} bytes is larger than allowed")
        return Kind(kind), _read_exact(self._reader, length)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


class DriverHandshake:
    """The driver's side of the handshake, without I/O: send :attr:`nonce`; the agent answers with
    :data:`ANSWER_BYTES` bytes (its nonce and its proof of the secret); :meth:`verify` returns the driver's
    proof to send back, or raises :class:`AuthenticationError`."""

    ANSWER_BYTES = NONCE_BYTES + PROOF_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self.nonce = os.urandom(NONCE_BYTES)

    def verify(self, answer: bytes) -> bytes:
        client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES : self.ANSWER_BYTES]
        if not hmac.compare_digest(proof, _mac(self._secret, b"agent", self.nonce, client_nonce)):
            raise AuthenticationError("the peer did not prove this run's secret")
        return _mac(self._secret, b"driver", client_nonce, self.nonce)


def agent_answer(secret: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """The agent's side, without I/O: its answer to the driver's nonce, and the proof the driver must send back."""
    client_nonce = os.urandom(NONCE_BYTES)
    answer = client_nonce + _mac(secret, b"agent", server_nonce, client_nonce)
    return answer, _mac(secret, b"driver", client_nonce, server_nonce)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise AuthenticationError("connection closed during the handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def connect_handshake(sock: socket.socket, secret: bytes, over: FrameStream | None = None) -> None:
    """Agent side of the mutual HMAC challenge: it proves the secret first; then the driver proves it back.

    ``over``: the connection's stream when the channel is TLS (the challenge runs inside it).
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    read: Callable[[int], bytes] = over.read_bytes if over is not None else lambda n: _recv_exact(sock, n)
    write: Callable[[bytes], None] = over.write_bytes if over is not None else sock.sendall
    try:
        answer, driver_proof = agent_answer(secret, read(NONCE_BYTES))
        write(answer)
        proof = read(PROOF_BYTES)
    except ConnectionClosed as exc:
        raise AuthenticationError("connection closed during the handshake") from exc
    if not hmac.compare_digest(proof, driver_proof):
        raise AuthenticationError("the driver did not prove this run's secret")
    sock.settimeout(None)
