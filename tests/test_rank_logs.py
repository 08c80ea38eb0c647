"""What reaches the driver's logger from the ranks, for each launch mode and verbosity."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest
from rank_lines import lines_by_rank

from airflow_provider_hvd import HorovodRunner, RankFailedError, log_to_driver
from airflow_provider_hvd.runner.driver.watch.channel import rank_log

RANKS = "airflow_provider_hvd.ranks"


def chatty(lines: int = 3) -> str:
    """Writes to stdout, stderr (Python and C level) and log_to_driver, in a known order."""
    import os
    import sys

    import horovod.torch as hvd

    from airflow_provider_hvd.horovod import log_to_driver

    hvd.init()
    r = hvd.rank()
    for i in range(lines):
        print(f"out {r}.{i}")
        print(f"err {r}.{i}", file=sys.stderr)
        os.write(2, f"raw {r}.{i}\n".encode())
        log_to_driver(f"msg {r}.{i}")
    return "done"


def relayed(caplog) -> dict[int, list[str]]:
    return lines_by_rank(caplog.records)


def expected(rank: int, lines: int, everything: bool) -> list[str]:
    out = []
    for i in range(lines):
        if everything:
            out += [f"out {rank}.{i}", f"err {rank}.{i}", f"raw {rank}.{i}"]
        out.append(f"msg {rank}.{i}")
    return out


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="airflow_provider_hvd")


@pytest.mark.parametrize("verbosity", ["log_callback_only", "all"])
def test_local_runs_relay_everything_in_order(verbosity, caplog):
    assert HorovodRunner(np=-2, driver_log_verbosity=verbosity).run(chatty) == "done"
    assert relayed(caplog) == {r: expected(r, 3, everything=True) for r in (0, 1)}


def test_spark_all_relays_every_line_in_order(spark_local, caplog):
    HorovodRunner(np=2, driver_log_verbosity="all").run(chatty, lines=20)
    assert relayed(caplog) == {r: expected(r, 20, everything=True) for r in (0, 1)}


def test_spark_log_callback_only_relays_only_messages(spark_local, caplog):
    HorovodRunner(np=2).run(chatty)
    assert relayed(caplog) == {r: expected(r, 3, everything=False) for r in (0, 1)}
    assert not re.search(r"(out|err|raw) \d\.\d", caplog.text)


def long_message(n: int) -> None:
    import horovod.torch as hvd

    from airflow_provider_hvd import log_to_driver

    hvd.init()
    if hvd.rank() == 0:
        log_to_driver("x" * n)
        log_to_driver("line one\nline two")


def test_messages_are_truncated_at_4000_characters(spark_local, caplog):
    HorovodRunner(np=2).run(long_message, n=5000)
    assert relayed(caplog)[0] == ["x" * 4000 + "... [truncated: 5000 characters, 4000 kept]", "line one\nline two"]


def test_log_to_driver_outside_a_job_prints(capsys):
    log_to_driver("not in a job")  # as sparkdl does: seen whatever logging is set up
    assert capsys.readouterr().out == "not in a job\n"
    with pytest.raises(TypeError, match="takes a str, not int"):
        log_to_driver(42)  # type: ignore[arg-type]


def bad_message() -> None:
    from airflow_provider_hvd import log_to_driver

    log_to_driver({"loss": 1.0})  # type: ignore[arg-type]


def test_non_string_message_fails_the_rank():
    with pytest.raises(RankFailedError, match="TypeError: log_to_driver\\(\\) takes a str, not dict"):
        HorovodRunner(np=-2).run(bad_message)


def test_failed_rank_output_tail_is_in_the_error_whatever_the_verbosity(spark_local, caplog):
    def fail() -> None:
        for i in range(100):
            print(f"progress {i}")
        raise RuntimeError("diverged")

    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=2).run(fail)
    assert info.value.output_tail[-3:] == ["progress 97", "progress 98", "progress 99"]
    assert "progress 99" in str(info.value)
    assert "progress" not in "".join(relayed(caplog).get(0, []))


def keras_fit(epochs: int = 2) -> dict:
    import keras
    import numpy as np

    from airflow_provider_hvd.horovod.keras import LogCallback

    rng = np.random.default_rng(0)
    x = rng.random((64, 4), dtype="float32")
    y = (x.sum(axis=1) > 2).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, callbacks=[LogCallback()])
    return {"loss": [float(v) for v in history.history["loss"]]}


def test_keras_log_callback_in_a_real_fit(spark_local, caplog):
    result = HorovodRunner(np=2).run(keras_fit)
    lines = relayed(caplog)
    assert set(lines) == {0}, "LogCallback sends from rank 0 only"
    assert [line.split(":")[0] for line in lines[0]] == [
        "epoch 1/2 begin",
        "epoch 1/2 end",
        "epoch 2/2 begin",
        "epoch 2/2 end",
    ]
    end = re.fullmatch(r"epoch 2/2 end: accuracy=([\d.]+) loss=([\d.]+)", lines[0][3])
    assert end and float(end[2]) == pytest.approx(result["loss"][1], rel=1e-3)


def slow_sum(seconds: float) -> float:
    import time

    import horovod.torch as hvd
    import torch

    hvd.init()
    time.sleep(seconds)
    return hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()


def test_foreign_connections_are_rejected_and_the_job_completes(spark_local, caplog):
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("v", HorovodRunner(np=2).run(slow_sum, seconds=4)))
    thread.start()
    deadline = time.monotonic() + 60
    while not (m := re.search(r"driver channel on ([\d.]+):(\d+)", caplog.text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    address = (m[1], int(m[2]))
    answers = []
    for attack in (b"", b"\x00" * 64, b"G" * 32 + b"\x01" * 32):  # silent, garbage, a wrong HMAC
        with socket.create_connection(address, timeout=15) as sock:
            nonce = sock.recv(32)
            assert len(nonce) == 32
            if attack:
                sock.sendall(attack)
            else:
                sock.shutdown(socket.SHUT_WR)
            answers.append(sock.recv(64))
    thread.join(60)
    assert outcome["v"] == 2.0
    assert answers == [b"", b"", b""], "the driver answered a peer that did not prove the secret"
    assert caplog.text.count("rejected a connection") == 3


class _Counter(logging.Handler):
    """Counts relayed lines per rank, checks they come in order, and adds up the drops the driver reports."""

    def __init__(self) -> None:
        super().__init__()
        self.received = {0: 0, 1: 0}
        self.last = {0: -1, 1: -1}
        self.out_of_order = 0
        self.dropped = {0: 0, 1: 0}

    def emit(self, record: logging.LogRecord) -> None:
        rank = record.args[0]
        if record.levelno == logging.WARNING:  # "[rank %s] %d lines of output were dropped ..."
            self.dropped[rank] += record.args[1]
            return
        for text in record.rank_lines:  # type: ignore[attr-defined]
            number = int(text.split()[0])
            self.out_of_order += number <= self.last[rank]
            self.last[rank] = number
            self.received[rank] += 1


FLOOD_LINES = 100_000  # ordering and drop accounting show at this size; benchmarks/logs.py measures throughput


def flood(lines: int, width: int = 0, per_write: int = 1) -> int:
    """``lines`` numbered lines on stdout, ``per_write`` lines a write (a rank's stdout is unbuffered)."""
    import sys

    import horovod.torch as hvd

    hvd.init()
    write = sys.stdout.write
    pad = " " + "." * width if width else ""
    for first in range(0, lines, per_write):
        write("".join(f"{i}{pad}\n" for i in range(first, min(first + per_write, lines))))
    sys.stdout.flush()
    return lines


def test_a_flood_of_lines_arrives_in_order_or_is_counted_as_dropped(spark_local):
    counter = _Counter()
    rank_log.addHandler(counter)
    rank_log.propagate = False  # 200k records would swamp pytest's log capture
    try:
        assert HorovodRunner(np=2, driver_log_verbosity="all").run(flood, lines=FLOOD_LINES) == FLOOD_LINES
    finally:
        rank_log.propagate = True
        rank_log.removeHandler(counter)
    assert counter.out_of_order == 0
    for rank in (0, 1):  # every line arrived, or the driver said that it dropped it
        assert counter.received[rank] + counter.dropped[rank] == FLOOD_LINES


class _SlowStart(_Counter):
    """A driver that stalls for a while (a slow log sink), then keeps up."""

    records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        if self.records <= 50:
            time.sleep(0.04)
        super().emit(record)


def test_a_slow_driver_drops_lines_and_says_how_many(monkeypatch):
    from airflow_provider_hvd.runner.agent import relay

    monkeypatch.setattr(relay, "OUTBOX_CAPACITY_BYTES", 64 << 10)  # local agents run in this process
    counter = _SlowStart()
    rank_log.addHandler(counter)
    rank_log.propagate = False
    try:
        started = time.monotonic()
        # 50,000 lines of 300 bytes: more than the outbox and the kernel's socket buffers hold
        assert HorovodRunner(np=-2).run(flood, lines=50_000, width=300) == 50_000
        assert time.monotonic() - started < 60
    finally:
        rank_log.propagate = True
        rank_log.removeHandler(counter)
    assert counter.out_of_order == 0
    for rank in (0, 1):
        assert counter.dropped[rank] > 0, "the stalled driver should have made this rank drop lines"
        assert counter.received[rank] + counter.dropped[rank] == 50_000


MARKER = b"\x1ehvd-log:token:"


@pytest.mark.parametrize(
    ("chunks", "pieces"),
    [
        ([b"a\nb\r\nc\rd", b"\n"], ["a", "b", "c", "d"]),  # \n, \r\n and \r each end a line
        ([b"10%\r20%\r" + MARKER + b"7\n", b"done\n"], ["10%", "20%", 7, "done"]),
        ([b"half a li" + MARKER[:5], MARKER[5:] + b"12\nne\n"], ["half a li", 12, "ne"]),  # marker mid-line, split
        (["é".encode()[:1], "é".encode()[1:] + b"\n"], ["é"]),  # a character split across reads
        ([b"\r", b"\nnext\n"], ["", "next"]),  # \r\n split across reads is one line end
        ([MARKER + b"x\n"], [MARKER.decode() + "x"]),  # not a marker after all: plain text
        ([b"\xff\xfe bytes\n"], ["\ufffd\ufffd bytes"]),
        ([b"no newline at the end"], ["no newline at the end"]),
    ],
)
def test_output_splitting(chunks, pieces):
    from airflow_provider_hvd.runner.agent.relay import OutputSplitter

    splitter = OutputSplitter(MARKER)
    got = [piece for chunk in chunks for piece in splitter.feed(chunk)] + splitter.end()
    assert got == pieces


def test_long_lines_are_cut_at_a_character_boundary():
    from airflow_provider_hvd.runner.agent.relay import OutputSplitter

    splitter = OutputSplitter(MARKER, max_line_bytes=11)
    assert splitter.feed(b"x" * 10 + "é".encode() + b"yy\n") == ["x" * 10, "éyy"]


class _StalledStream:
    """A driver connection that accepts nothing until released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def send(self, kind, payload) -> None:
        self.released.wait()


def test_the_outbox_bound_counts_bytes_not_characters():
    from airflow_provider_hvd.runner.agent.relay import Outbox

    stream = _StalledStream()
    outbox = Outbox(stream, capacity_bytes=64 << 10)  # type: ignore[arg-type]
    for _ in range(200):
        outbox.put("\ufffd" * 1000)  # invalid UTF-8, decoded: 3 bytes a character on the wire
    stream.released.set()
    outbox.close()
    kept = 200 - outbox.total_dropped
    # 3,004 bytes a line on the wire: 21 fit in 64 KiB (65 would, were characters counted instead of bytes)
    assert 19 <= kept <= (64 << 10) // 3004


def progress_bar_and_messages() -> None:
    import sys

    import horovod.torch as hvd

    from airflow_provider_hvd import log_to_driver

    hvd.init()
    for pct in (10, 50, 90):
        sys.stderr.write(f"\rtraining {pct}%")  # tqdm's way: no newline until the end
        sys.stderr.flush()
        log_to_driver(f"checkpoint at {pct}% ✓")
    sys.stderr.write("\n")


def test_messages_after_progress_bars_arrive(spark_local, caplog):
    HorovodRunner(np=2).run(progress_bar_and_messages)
    expected = [f"checkpoint at {pct}% ✓" for pct in (10, 50, 90)]
    assert relayed(caplog) == {0: expected, 1: expected}


def test_progress_bars_are_relayed_as_they_go(caplog):
    HorovodRunner(np=-2).run(progress_bar_and_messages)
    lines = relayed(caplog)[0]
    assert lines == [
        "training 10%",
        "checkpoint at 10% ✓",
        "training 50%",
        "checkpoint at 50% ✓",
        "training 90%",
        "checkpoint at 90% ✓",
    ]


def lose_a_message() -> str:
    import os

    import horovod.torch as hvd

    from airflow_provider_hvd.horovod import log_to_driver
    from airflow_provider_hvd.runner.rank.control import LOG_TOKEN_ENV, message_marker

    hvd.init()
    os.write(1, message_marker(os.environ[LOG_TOKEN_ENV]) + b"999\n")  # a marker whose message never comes
    log_to_driver("after the lost one")
    return "done"


def test_a_message_whose_marker_came_without_it_is_counted_and_said(caplog):
    """Before: dropped without a word after holding the rank's output for 10 s."""
    assert HorovodRunner(np=-1).run(lose_a_message) == "done"
    assert relayed(caplog)[0] == [
        "[a log_to_driver message (#999) did not reach the agent in time; 1 so far]",
        "after the lost one",
    ]


def task_log_formatter() -> logging.Formatter:
    """The formatter of an Airflow task's log (``configure_logging(json_output=True)`` in the task process):
    each record one JSON event, its message in ``event``."""
    import structlog
    from airflow.sdk._shared.logging.structlog import drop_positional_args, structlog_processors

    pre_chain, for_stdlib, _ = structlog_processors(json_output=True)
    return structlog.stdlib.ProcessorFormatter(
        use_get_message=False,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, drop_positional_args, for_stdlib],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *pre_chain],
        pass_foreign_args=True,
    )


def test_a_flood_reaches_the_task_log_tagged_in_order_at_info_in_few_events(tmp_path):
    """Before: one record, one task-log event, per line (~15 µs each: the relay ran at 52,000 lines/s)."""
    import json

    path = tmp_path / "task.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(task_log_formatter())
    rank_log.addHandler(handler)
    rank_log.propagate = False
    try:
        assert HorovodRunner(np=-2, driver_log_verbosity="all").run(flood, lines=10_000, per_write=100) == 10_000
    finally:
        rank_log.propagate = True
        rank_log.removeHandler(handler)
        handler.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert {e["level"] for e in events} == {"info"} and {e["logger"] for e in events} == {RANKS}
    by_rank: dict[str, list[int]] = {"0": [], "1": []}
    for event in events:
        for line in event["event"].split("\n"):
            m = re.fullmatch(r"\[rank (\d)\] (\d+)", line)
            assert m, f"an untagged line in the task log: {line!r}"
            by_rank[m[1]].append(int(m[2]))
    assert by_rank == {"0": list(range(10_000)), "1": list(range(10_000))}
    # each write of 100 lines reaches the agent whole, and what one read brought goes out as one record (a few
    # more where a batch is sealed at 2,000 lines or a read ends mid-write); how many writes one read brings
    # depends on the machine's load (2,000 lines a record here, alone; 26 under the suite's load)
    assert len(events) <= 2 * 20_000 / 100, "a record per line"
