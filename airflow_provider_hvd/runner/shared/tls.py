"""TLS for the driver channel, when the application has Spark encrypt its own traffic (runs in the driver and in
each agent), and for a submitted run's link, always (its host and its clients: :mod:`..durable.link`).

The driver makes a self-signed certificate for the run (:class:`RunCertificate`); its SHA-256 fingerprint
travels to the agents with the run's secret, and an agent accepts only the certificate it names (no CA, no
host name: the pin is the trust). TLS 1.3 only. The HMAC handshake over the run's secret still runs inside.

A session does its TLS in memory (``SSLContext.wrap_bio``), with every OpenSSL call under one lock: the
driver's selector loop feeds it raw bytes without ever blocking, and an agent's reader and writers, in
different threads, never use the OpenSSL object at once. Bytes the session has to send (its handshake
records, sealed frames) are taken out by whoever sends next, under that connection's send lock, so they go
out in the order they were made. :class:`PlainSession` is the same shape with no TLS: bytes pass as they are.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from .timing import HANDSHAKE_TIMEOUT_S
from .wire import AuthenticationError, FrameStream

_READ_BYTES = 1 << 18
_SEAL_BYTES = 1 << 18  # a large frame (a pickled result) is sealed and sent in pieces of this size
_VALID_DAYS = 365  # not checked by the agents (the fingerprint is): a run of any length keeps its certificate


class CertificateMismatch(AuthenticationError):
    """The driver channel presented a certificate other than the run's: another process, or an interceptor."""


def _context(server_side: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if server_side:
        context.num_tickets = 0  # no session resumption: each agent connects once
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the certificate is checked against the run's fingerprint instead
    return context


@dataclass(frozen=True)
class RunCertificate:
    """A run's certificate: the driver's TLS context (its key never leaves the driver's memory) and the SHA-256
    fingerprint (hex) that the agents pin."""

    context: ssl.SSLContext
    fingerprint: str

    @classmethod
    def new(cls) -> RunCertificate:
        """A fresh self-signed ECDSA P-256 certificate and key."""
        from cryptography import x509  # only the driver and a submitted run's host need it
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "HorovodRunner driver channel")])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=_VALID_DAYS))
            .sign(key, hashes.SHA256())
        )
        context = _context(server_side=True)
        # ssl loads a key only from a file: one in a private directory, removed as soon as it is loaded
        with tempfile.TemporaryDirectory(prefix="hvd-tls-") as private:
            cert_file, key_file = Path(private, "cert.pem"), Path(private, "key.pem")
            cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(
                    key.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    )
                )
            context.load_cert_chain(cert_file, key_file)
        return cls(context, fingerprint(cert.public_bytes(serialization.Encoding.DER)))


def fingerprint(der: bytes) -> str:
    """A certificate's SHA-256 fingerprint, in hex."""
    return hashlib.sha256(der).hexdigest()


class PlainSession:
    """No TLS: what is sent and received is the frames' bytes themselves."""

    encrypted = False

    def receive(self, data: bytes) -> bytes:
        return data

    def seal(self, data: bytes | memoryview = b"") -> bytes | memoryview:
        return data

    def has_output(self) -> bool:
        return False


PLAIN = PlainSession()


class TlsSession:
    """One TLS connection in memory: raw bytes in, plaintext out (:meth:`receive`); plaintext in, the bytes to
    send out (:meth:`seal`). Thread-safe; it does no I/O."""

    encrypted = True

    def __init__(self, context: ssl.SSLContext, server_side: bool) -> None:
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._lock = threading.Lock()
        self._queued: list[bytes] = []  # plaintext sealed before the handshake completed: it goes out then
        self.handshake_done = False
        self.peer_certificate: bytes | None = None  # DER, once the handshake is done

    def start(self) -> bytes:
        """The client's first handshake records."""
        with self._lock:
            self._advance()
            return self._outgoing.read()

    def receive(self, data: bytes) -> bytes:
        """Take raw bytes from the peer; return the plaintext they complete (b"" for a partial record or the
        handshake). ``ssl.SSLError`` for bytes that are not this session's TLS."""
        with self._lock:
            self._incoming.write(data)
            self._advance()
            if not self.handshake_done:
                return b""
            chunks = []
            while True:
                try:
                    chunk = self._tls.read(_READ_BYTES)
                except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):  # (the peer's close_notify: its FIN follows)
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)

    def seal(self, data: bytes | memoryview = b"") -> bytes:
        """``data`` as TLS records, after whatever the session still had to send; before the handshake is done,
        ``data`` waits and only the handshake's records come out."""
        with self._lock:
            if data:
                if self.handshake_done:
                    self._write(data)
                else:
                    self._queued.append(bytes(data))
            return self._outgoing.read()

    def has_output(self) -> bool:
        return self._outgoing.pending > 0

    def _advance(self) -> None:
        if self.handshake_done:
            return
        try:
            self._tls.do_handshake()
        except ssl.SSLWantReadError:
            return
        self.handshake_done = True
        self.peer_certificate = self._tls.getpeercert(binary_form=True)
        for data in self._queued:
            self._write(data)
        self._queued.clear()

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[self._tls.write(view) :]


Session = PlainSession | TlsSession


def server_session(context: ssl.SSLContext | None) -> Session:
    """The driver's session for a new connection: TLS with the run's context, else plain."""
    return PLAIN if context is None else TlsSession(context, server_side=True)


# the agent's side: blocking I/O on its socket


class TlsReader:
    """A binary stream's ``read(n)`` over a TLS session on a socket (the agent's reading thread's)."""

    def __init__(self, sock: socket.socket, session: TlsSession, buffered: bytes = b"") -> None:
        self._sock = sock
        self._session = session
        self._buf = bytearray(buffered)

    def read(self, n: int) -> bytes:
        """``n`` bytes, or fewer when the connection ended."""
        while len(self._buf) < n:
            data = self._sock.recv(_READ_BYTES)
            if not data:
                break
            self._buf += self._session.receive(data)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def close(self) -> None:
        self._buf.clear()


class TlsWriter:
    """``sendall`` through a TLS session (callers serialise their writes, as :class:`~.wire.FrameStream` does)."""

    def __init__(self, sock: socket.socket, session: TlsSession) -> None:
        self._sock = sock
        self._session = session

    def __call__(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, max(len(view), 1), _SEAL_BYTES):
            sealed = self._session.seal(view[start : start + _SEAL_BYTES])
            if sealed:
                self._sock.sendall(sealed)


def _handshake(sock: socket.socket, session: TlsSession, peer: str) -> bytes:
    """Blocking: the session's handshake on ``sock``; the plaintext that came with its end."""
    plaintext = b""
    while not session.handshake_done:
        data = sock.recv(_READ_BYTES)
        if not data:
            raise AuthenticationError(f"{peer} closed the connection during the TLS handshake")
        plaintext += session.receive(data)
        out = session.seal()
        if out:
            sock.sendall(out)
    return plaintext


def accept_tls(sock: socket.socket, context: ssl.SSLContext) -> FrameStream:
    """The server's end of a blocking TLS connection (a submitted run's link): the frames through a
    :class:`TlsSession`, so that a reading and a writing thread never use one OpenSSL object at once."""
    session = TlsSession(context, server_side=True)
    plaintext = _handshake(sock, session, "the peer")
    return FrameStream(TlsReader(sock, session, plaintext), TlsWriter(sock, session), sock)


def connect_tls(sock: socket.socket, pinned: str, peer: str = "the driver channel") -> FrameStream:
    """The connecting side's TLS handshake on ``sock`` (an agent's to the driver channel, a client's to a submitted
    run's link: ``peer``); the certificate must have the fingerprint ``pinned``.

    Returns the frames through the session (after any plaintext that came with the handshake's end); raises
    :class:`CertificateMismatch` for another certificate, before anything is sent inside TLS.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    session = TlsSession(_context(server_side=False), server_side=False)
    sock.sendall(session.start())
    plaintext = _handshake(sock, session, peer)
    seen = fingerprint(session.peer_certificate or b"")
    if not hmac.compare_digest(seen, pinned):
        raise CertificateMismatch(
            f"{peer}'s TLS certificate is not this run's: its SHA-256 fingerprint is {seen}, the run's is {pinned}. "
            "Another process answers at that address, or the connection is intercepted; it was refused."
        )
    return FrameStream(TlsReader(sock, session, plaintext), TlsWriter(sock, session), sock)
