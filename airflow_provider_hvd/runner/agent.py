"""The rank agent: one per rank, beside its rank process (a driver thread locally, the barrier task on Spark).

It connects to the driver channel, receives the rank's Horovod environment and the pickled job, starts
the rank process, relays its output as the verbosity says, and reports how it ended. It ends the rank
process when the driver asks (another rank failed, the run was cancelled) or disappears.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

import psutil

from .control import AGENT_PID_ENV, CONTROL_FD_ENV, LOG_TOKEN_ENV, message_marker
from .wire import ConnectionClosed, FrameStream, Kind, connect_handshake

TAIL_LINES = 50
OUTBOX_CAPACITY_BYTES = 32 << 20  # per rank; past it lines are dropped and counted
_BATCH_LINES = 2000
_MAX_LINE_BYTES = 64 << 10
_TERMINATE_GRACE_S = 5.0


@dataclass(frozen=True)
class AgentArgs:
    """What an agent needs to reach the driver; pickled into Spark tasks."""

    driver_host: str
    port: int
    secret: bytes
    relay_output: bool  # stdout/stderr lines go to the driver (verbosity "all", and local runs)
    echo_output: bool  # lines go to this process's stderr too, tagged with the rank (the executor's log)...
    echo_relayed: bool = True  # ... also those relayed (not when that stderr is the driver's own, on local[*])


def _queued_size(text: str) -> int:
    return len(text) + 4  # about what a line takes once encoded in a batch


class _Outbox:
    """Lines on their way to the driver, bounded in bytes.

    The rank's pipes are always drained, so a slow driver never stalls training; past the bound, lines
    are dropped and counted, and the count travels with the next frame.
    """

    def __init__(self, stream: FrameStream, capacity_bytes: int | None = None) -> None:
        self._stream = stream
        self._capacity = capacity_bytes or OUTBOX_CAPACITY_BYTES
        self._cond = threading.Condition()
        self._pending: list[str] = []
        self._frames: collections.deque[tuple[bytes, int]] = collections.deque()
        self._queued_bytes = 0
        self._dropped = 0
        self.total_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="hvd-agent-outbox", daemon=True)
        self._thread.start()

    def put(self, text: str) -> None:
        size = _queued_size(text)
        with self._cond:
            if self._queued_bytes + size > self._capacity:
                self._dropped += 1
                self.total_dropped += 1
                return
            self._pending.append(text)
            self._queued_bytes += size
            if len(self._pending) >= _BATCH_LINES:
                self._seal()
            self._cond.notify()

    def _seal(self) -> None:
        size = sum(map(_queued_size, self._pending))
        payload = json.dumps({"lines": self._pending, "dropped": self._dropped}, separators=(",", ":")).encode()
        self._frames.append((payload, size))
        self._pending, self._dropped = [], 0

    def _pump(self) -> None:
        while True:
            with self._cond:
                while not (self._frames or self._pending or self._dropped or self._closed):
                    self._cond.wait()
                if self._pending or self._dropped:
                    self._seal()
                if not self._frames:
                    return  # closed and empty
                payload, size = self._frames.popleft()
            try:
                self._stream.send(Kind.LOG, payload)
            except OSError:
                return  # the driver is gone; the agent's watcher ends the rank
            with self._cond:
                self._queued_bytes -= size

    def close(self) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip`` (Gloo binds its transport to an interface)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(addr.family == socket.AF_INET and addr.address == ip for addr in addrs):
            return name
    if ip.startswith("127."):
        return "lo"
    raise RuntimeError(f"no network interface holds {ip}, the address this host uses to reach the driver")


class _RankProcess:
    def __init__(self, rank: int, env: dict[str, str], payload: bytes, args: AgentArgs, outbox: _Outbox) -> None:
        self.rank = rank
        self._args = args
        self._outbox = outbox
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.result: bytes | None = None
        self.error: dict[str, Any] | None = None
        self.terminated_by: str | None = None
        token = secrets.token_hex(16)
        self._marker = message_marker(token)
        ctl_read, ctl_write = os.pipe()
        env = {**env, CONTROL_FD_ENV: str(ctl_write), AGENT_PID_ENV: str(os.getpid()), LOG_TOKEN_ENV: token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_hvd.runner.rank"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, so that the relay keeps the rank's order
            env=env,
            pass_fds=(ctl_write,),
            start_new_session=True,  # its own process group, so that ending it ends its children too
        )
        os.close(ctl_write)
        self._threads = [
            threading.Thread(target=self._relay_output, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read_control, args=(ctl_read,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(payload)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; its exit code tells

    def _echo(self, text: str, relayed: bool) -> None:
        if self._args.echo_output and (self._args.echo_relayed or not relayed):
            sys.stderr.write(f"[rank {self.rank}] {text}\n")

    def _relay_output(self, pipe: IO[bytes]) -> None:
        for raw in iter(lambda: pipe.readline(_MAX_LINE_BYTES), b""):
            if raw.startswith(self._marker):  # a log_to_driver message: relayed whatever the verbosity
                try:
                    text = json.loads(raw[len(self._marker) :])
                except ValueError:  # cut by a concurrent write to fd 1: relay what arrived, as text
                    text = raw[len(self._marker) :].decode("utf-8", "replace").rstrip("\r\n")
                self._echo(text, relayed=True)
                self._outbox.put(text)
                continue
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(text)
            self._echo(text, relayed=self._args.relay_output)
            if self._args.relay_output:
                self._outbox.put(text)
        pipe.close()

    def _read_control(self, fd: int) -> None:
        control = FrameStream(os.fdopen(fd, "rb"), write=None)
        while True:
            try:
                kind, data = control.recv()
            except ConnectionClosed:
                return
            if kind is Kind.RESULT:
                self.result = data
            elif kind is Kind.ERROR:
                self.error = json.loads(data)

    def terminate(self, reason: str) -> None:
        """End the rank process and everything it started: SIGTERM, then SIGKILL after a grace period."""
        if self.proc.poll() is not None:
            return
        self.terminated_by = reason
        for sig, wait_s in ((signal.SIGTERM, _TERMINATE_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def wait(self) -> int:
        code = self.proc.wait()
        try:  # what the rank started and left running would outlive the run and hold its output pipe
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for thread in self._threads:
            thread.join()
        return code


def _watch_driver(stream: FrameStream, rank_process: _RankProcess) -> None:
    try:
        kind, data = stream.recv()
        reason = json.loads(data).get("reason", "aborted by the driver") if kind is Kind.ABORT else f"unexpected {kind.name}"
    except (ConnectionClosed, OSError):
        reason = "lost the connection to the driver"
    rank_process.terminate(reason)


def run_agent(args: AgentArgs, task: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one rank under supervision; returns a short report (the driver gets the full one)."""
    sock = socket.create_connection((args.driver_host, args.port), timeout=30)
    try:
        connect_handshake(sock, args.secret)
        stream = FrameStream.over_socket(sock)
        local_ip = sock.getsockname()[0]
        stream.send_json(Kind.HELLO, {"host": local_ip, "pid": os.getpid(), "task": task or {}})
        kind, data = stream.recv()
        if kind is not Kind.START:
            return {"started": False}
        start = json.loads(data)
        kind, payload = stream.recv()
        rank = start["rank"]
        env = {**os.environ, **start["env"], "HOROVOD_GLOO_IFACE": interface_of(local_ip), "PYTHONUNBUFFERED": "1"}
        outbox = _Outbox(stream)
        rank_process = _RankProcess(rank, env, payload, args, outbox)
        del payload
        threading.Thread(target=_watch_driver, args=(stream, rank_process), daemon=True).start()
        exit_code = rank_process.wait()
        outbox.close()
        if rank_process.result is not None and rank == 0:
            stream.send(Kind.RESULT, rank_process.result)
        done = {
            "exit_code": exit_code,
            "error": rank_process.error,
            "ok": exit_code == 0 and rank_process.result is not None,
            "terminated_by": rank_process.terminated_by,
            "tail": list(rank_process.tail),
            "dropped": outbox.total_dropped,
        }
        stream.send_json(Kind.DONE, done)
        return {"rank": rank, "exit_code": exit_code}
    finally:
        sock.close()
