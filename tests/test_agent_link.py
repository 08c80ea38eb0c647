"""The agent's side of its link to the driver: reports that never wait on a slow link, and an agent that cannot
read what the driver sends ends its rank and says so. Real ranks (LocalLauncher) behind the TLS tests' proxy."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from test_channel_tls import ProxiedLauncher, RecordingProxy, relayed

from airflow_provider_hvd import HorovodRunner, RankFailedError
from airflow_provider_hvd.runner.agent.agent import AgentArgs
from airflow_provider_hvd.runner.agent.liveness import DriverWatch
from airflow_provider_hvd.runner.driver.launch.local import LocalLauncher
from airflow_provider_hvd.runner.driver.tracking.progress import RunProgress
from airflow_provider_hvd.runner.driver.watch.supervisor import Supervisor
from airflow_provider_hvd.runner.shared.liveness import Liveness
from airflow_provider_hvd.runner.shared.messages import DriverAlive, frame
from airflow_provider_hvd.runner.shared.payload import dumps_job
from airflow_provider_hvd.runner.shared.wire import NONCE_BYTES, PIECE_BYTES, PROOF_BYTES, FrameStream, Kind

REPORTS = 300
REPORTS_WITHIN_S = 2.0  # 300 reports on a link backed up for seconds: no call waits on it (margin for load)
CALL_WITHIN_S = 1.0  # nor does any one call (before: 2-2.6 s, the time the outbox held the stream with a batch)
FLOOD_LINES, FLOOD_CHARS = 6_000, 1000  # 6 MB of output: the outbox holds the stream for seconds at 1 MiB/s


def flood_then_report(lines: int, chars: int, reports: int) -> dict:
    """Print a flood, then time ``reports`` rounds of log_metrics (64 values), with report_checkpoint and
    log_to_driver every 50th: none of them may wait on the link the flood backs up."""
    import sys
    import time

    from airflow_provider_hvd import log_metrics, log_to_driver, report_checkpoint

    line = "y" * chars + "\n"
    for _ in range(lines // 100):
        sys.stdout.write(line * 100)
    sys.stdout.flush()
    values = {f"metric_{j}": j / 7 for j in range(64)}
    started = time.monotonic()
    slowest = 0.0
    for step in range(reports):
        at = time.monotonic()
        log_metrics(step, **values)
        if step % 50 == 0:
            report_checkpoint(f"/checkpoints/{step}", step=step)
            log_to_driver(f"report {step}")
        slowest = max(slowest, time.monotonic() - at)
    return {"total": time.monotonic() - started, "slowest": slowest}


def test_reports_never_wait_on_a_slow_link_to_the_driver(caplog):
    launcher = ProxiedLauncher(1)
    launcher.up_bytes_per_s = 1 << 20  # 1 MiB/s from the agent to the driver
    progress = RunProgress(interval_s=3600)
    payload = dumps_job(flood_then_report, (FLOOD_LINES, FLOOD_CHARS, REPORTS), {})
    try:
        result = Supervisor(launcher, payload, "all", lambda: False, 120.0, progress=progress).run()
    finally:
        if launcher.proxy is not None:
            launcher.proxy.close()
    assert isinstance(result, dict)
    print(
        f"\nMEASURED {REPORTS} reports behind a flood on a 1 MiB/s link: {result['total']:.3f}s, slowest call "
        f"{result['slowest']:.3f}s"
    )
    assert result["total"] < REPORTS_WITHIN_S and result["slowest"] < CALL_WITHIN_S, result
    # every one reached the driver, in order, none dropped
    assert progress.history.reports == REPORTS
    assert progress.checkpoint is not None and progress.checkpoint["step"] == REPORTS - 50
    messages = [line for line in relayed(caplog, 0) if line.startswith("report ") or "log_to_driver" in line]
    assert messages == [f"report {step}" for step in range(0, REPORTS, 50)]


# --- an agent that cannot read what the driver sends ---------------------------------------------------------


class InjectingProxy(RecordingProxy):
    """Forwards as RecordingProxy does; after the driver's Start, slips a frame of a kind no agent knows to it."""

    UNKNOWN_KIND = 99

    def _forwarders(self, agent: socket.socket, driver: socket.socket) -> list[tuple[Callable[..., None], tuple]]:
        return [(self._pump, (agent, driver, bytearray(), None)), (self._down, (driver, agent))]

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        """Frame by frame (after the handshake's nonce and proof), so that the injected one is whole."""
        buffer, handshake, injected = bytearray(), NONCE_BYTES + PROOF_BYTES, False
        try:
            while data := src.recv(1 << 16):
                buffer += data
                if handshake:
                    sent = min(handshake, len(buffer))
                    dst.sendall(buffer[:sent])
                    del buffer[:sent]
                    handshake -= sent
                while len(buffer) >= 5 and len(buffer) >= 5 + struct.unpack("!I", buffer[1:5])[0]:
                    size = 5 + struct.unpack("!I", buffer[1:5])[0]
                    kind = buffer[0]
                    dst.sendall(buffer[:size])
                    del buffer[:size]
                    if kind == Kind.START and not injected:
                        dst.sendall(struct.pack("!BI", self.UNKNOWN_KIND, 0))
                        injected = True
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.reset(dst, src)


class InjectingLauncher(ProxiedLauncher):
    def agent_args(self, host: str, port: int, secret: bytes, verbosity: str) -> AgentArgs:
        self.proxy = InjectingProxy((host, port))
        args = super(ProxiedLauncher, self).agent_args(host, port, secret, verbosity)
        return dataclasses.replace(args, port=self.proxy.port)


def sleep_forever(pid_dir: str) -> None:
    import os
    import time
    from pathlib import Path

    Path(pid_dir, "rank.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


ENDED_WITHIN_S = 30.0


def test_a_frame_the_agent_cannot_read_ends_its_rank_and_the_run_says_so(pid_dir):
    launcher = InjectingLauncher(1)
    payload = dumps_job(sleep_forever, (pid_dir,), {})
    outcome: dict = {}

    def run() -> None:
        try:
            Supervisor(launcher, payload, "log_callback_only", lambda: False, 120.0).run()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    pid_file = Path(pid_dir, "rank.pid")
    while not pid_file.exists() and thread.is_alive():
        time.sleep(0.05)
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    try:
        thread.join(ENDED_WITHIN_S)
        assert not thread.is_alive(), "the run went on: the agent no longer acted on the driver (its watcher died)"
    finally:
        if thread.is_alive() and pid is not None:
            os.kill(pid, 9)  # (the old behaviour: end the rank by hand, so that nothing outlives the test)
            thread.join(60)
        if launcher.proxy is not None:
            launcher.proxy.close()
    print(f"\nMEASURED an unreadable frame: the run ended {time.monotonic() - started:.1f}s after it started")
    error = outcome.get("error")
    assert isinstance(error, RankFailedError), repr(error)
    assert str(error).startswith(
        "the HorovodRunner agent of rank 0 on 127.0.0.1 failed: AgentThreadFailed: its thread hvd-agent-watch "
        "failed: ValueError: 99 is not a valid Kind"
    ), str(error)
    assert not ranks_running(), "a rank outlived the run"


def ranks_running(within_s: float = 10.0) -> list[psutil.Process]:
    """This process's descendants that are rank processes or their reapers, still there after up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if ("airflow_provider_hvd.runner.rank" in cmdline or "reaper.py" in cmdline) and child.is_running():
                found.append(child)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_agent_ends_the_link_when_the_driver_closed_it_with_bytes_left_unread():
    """A reader that stopped reading leaves the driver's last heartbeats unread: at the driver's end they are no
    sign of life (before, they kept the link up for ever, and with it the rank)."""
    agent_end, driver_end = socket.socketpair()
    liveness = Liveness(interval_s=0.1, timeout_s=0.5)
    watch = DriverWatch(FrameStream.over_socket(agent_end), agent_end, liveness)  # nobody calls receive()
    try:
        driver_end.sendall(frame(DriverAlive()) * 3)
        driver_end.close()
        deadline = time.monotonic() + 10
        while watch.silent_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.silent_reason is not None and "nothing heard from the driver" in watch.silent_reason
    finally:
        watch.stop()
        agent_end.close()


def big_bytes(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + b"tail"


def test_a_result_larger_than_a_piece_arrives_whole():
    """A result over PIECE_BYTES is kept in pieces on the driver and unpickled from them (wire.Pieces)."""
    size = PIECE_BYTES + (3 << 20)
    payload = dumps_job(big_bytes, (size,), {})
    result = Supervisor(LocalLauncher(1), payload, "log_callback_only", lambda: False, 120.0).run()
    assert isinstance(result, bytes) and len(result) == size + 4
    assert result == big_bytes(size)


def report_then_train(marker: str) -> int:
    """Rank 0 reports a checkpoint, then trains until ``marker`` exists (the test never makes it: it must be ended)."""
    import os
    import time

    import horovod.torch as hvd

    from airflow_provider_hvd import report_checkpoint

    hvd.init()
    if hvd.rank() == 0:
        report_checkpoint("/ckpt/epoch-1.pt", epoch=1)
    while not os.path.exists(marker):
        time.sleep(0.1)
    return hvd.rank()


def test_a_reports_thread_that_fails_ends_its_rank_and_the_run_says_so(tmp_path, monkeypatch):
    """The agent's report sender meets an error it has no rule for (a bug): the rank is ended and the run names
    the thread, instead of training on with its progress silently lost."""
    from airflow_provider_hvd.runner.agent import reports
    from airflow_provider_hvd.runner.shared.messages import Checkpoint

    real_send = reports.send

    def send(stream, message):
        if isinstance(message, Checkpoint):
            raise ValueError("a report the sender cannot encode")
        real_send(stream, message)

    monkeypatch.setattr(reports, "send", send)  # np<0: the agents are threads of this process
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(report_then_train, marker=str(tmp_path / "never"))
    print(f"\nMEASURED a failed reports thread: the run ended {time.monotonic() - started:.1f}s after it started")
    assert info.value.rank == 0
    assert "its thread hvd-agent-reports failed: ValueError: a report the sender cannot encode" in str(info.value)
    assert time.monotonic() - started < ENDED_WITHIN_S
