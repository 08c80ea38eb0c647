"""Framing and authentication shared by the driver channel, the rank agents and the rank processes.

A frame is ``kind (1 byte) | length (4 bytes, big endian) | payload``. Network connections start with a
mutual HMAC challenge over a per-run secret; no frame is read from a peer before it has proven the secret.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from typing import Any, BinaryIO

_HEADER = struct.Struct("!BI")
_NONCE_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 31


class Kind(enum.IntEnum):
    """The kind byte of a frame; :mod:`.messages` has a dataclass for each."""

    # agent -> driver (RESULT also rank process -> agent, on the control pipe)
    HELLO = 1
    LOG = 2
    RESULT = 3
    DONE = 4
    AGENT_FAILED = 5
    # driver -> agent
    START = 10
    PAYLOAD = 11
    ABORT = 12
    # rank process -> agent (control pipe)
    ERROR = 20
    MESSAGE = 21


class ConnectionClosed(EOFError):
    """The peer closed the stream (or it broke) between or inside frames."""


class AuthenticationError(ConnectionError):
    """The peer does not know this run's secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) < n:
        raise ConnectionClosed(f"stream closed after {0 if not data else len(data)} of {n} bytes")
    return data


class FrameStream:
    """Reads and writes frames on a byte stream; writes are serialised so that threads can share it."""

    def __init__(self, reader: BinaryIO, write: Any) -> None:
        self._reader = reader
        self._write = write
        self._lock = threading.Lock()

        self._sock: socket.socket | None = None

    @classmethod
    def over_socket(cls, sock: socket.socket) -> FrameStream:
        stream = cls(sock.makefile("rb"), sock.sendall)
        stream._sock = sock
        return stream

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
        frame = _HEADER.pack(kind, len(payload)) + payload
        with self._lock:
            self._write(frame)

    def recv(self) -> tuple[Kind, bytes]:
        kind, length = _HEADER.unpack(_read_exact(self._reader, _HEADER.size))
        if length > MAX_FRAME_BYTES:
            raise ConnectionClosed(f"frame of {length} bytes is larger than allowed")
        return Kind(kind), _read_exact(self._reader, length)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise AuthenticationError("connection closed during the handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def accept_handshake(sock: socket.socket, secret: bytes) -> None:
    """Driver side: the agent must prove the secret first; then the driver proves it back."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    server_nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(server_nonce)
    client_nonce = _recv_exact(sock, _NONCE_BYTES)
    proof = _recv_exact(sock, _DIGEST_BYTES)
    if not hmac.compare_digest(proof, _mac(secret, b"agent", server_nonce, client_nonce)):
        raise AuthenticationError("the peer did not prove this run's secret")
    sock.sendall(_mac(secret, b"driver", client_nonce, server_nonce))
    sock.settimeout(None)


def connect_handshake(sock: socket.socket, secret: bytes) -> None:
    """Agent side of :func:`accept_handshake`."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    server_nonce = _recv_exact(sock, _NONCE_BYTES)
    client_nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(client_nonce + _mac(secret, b"agent", server_nonce, client_nonce))
    if not hmac.compare_digest(_recv_exact(sock, _DIGEST_BYTES), _mac(secret, b"driver", client_nonce, server_nonce)):
        raise AuthenticationError("the driver did not prove this run's secret")
    sock.settimeout(None)
