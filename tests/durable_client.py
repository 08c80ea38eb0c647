"""A process that submits, attaches to or cancels a submitted run (tests/test_durable_runs.py starts it):

``submit URL PID_DIR GATE [DETACHED_TIMEOUT]``: submits ``jobs.train_until_gate`` on 2 ranks and prints
``JOB_ID <id>``, then waits (the test kills it). ``attach JOB_ID``: attaches, prints ``ATTACHED <job.status()>``,
relays the run's lines to stdout and prints ``VALUE <json>`` or ``ERROR <type> <first line>``. ``cancel JOB_ID``:
attaches without lines and cancels, printing ``CANCELLING`` as it sends the cancel and ``CANCELLED`` once it
returned.

``notebook URL PID_DIR GATE``: what a user's notebook does, with no logging set up: submits
``jobs.train_until_gate``, waits for its ranks, sleeps a little, prints ``job.status()`` and closes (``CLOSED``).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from connect_server import connect_session
from jobs import train_until_gate

from airflow_provider_hvd import HorovodRunner, attach


def say(word: str, text: str = "") -> None:
    """One line for the test, through logging's lock: the link's thread logs the ranks' lines meanwhile."""
    logging.getLogger("durable_client").info("%s %s", word, text)


def notebook(url: str, pid_dir: str, gate: str) -> None:
    from pathlib import Path

    with connect_session(url):
        job = HorovodRunner(np=2, driver_log_verbosity="all").submit(train_until_gate, pid_dir=pid_dir, gate=gate)
        print("JOB_ID", job.id, flush=True)
        while len(list(Path(pid_dir).glob("rank-*.pid"))) < 2:  # (its ranks started)
            time.sleep(0.2)
        time.sleep(2)
        print("STATUS", job.status(), flush=True)
        job.close()
        print("CLOSED", flush=True)


def main(argv: list[str]) -> None:
    command = argv[0]
    if command == "notebook":
        notebook(*argv[1:4])
        return
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s %(message)s")
    if command == "submit":
        url, pid_dir, gate = argv[1:4]
        timeout = float(argv[4]) if len(argv) > 4 else 900.0
        with connect_session(url):
            job = HorovodRunner(np=2, driver_log_verbosity="all", detached_timeout=timeout).submit(
                train_until_gate, pid_dir=pid_dir, gate=gate
            )
            say("JOB_ID", job.id)
            time.sleep(600)
    elif command == "attach":
        job = attach(argv[1])
        say("ATTACHED", str(job.status()))
        try:
            say("VALUE", json.dumps(job.wait(300)))
        except Exception as exc:  # noqa: BLE001 - the test reads which
            say("ERROR", f"{type(exc).__name__} {str(exc).splitlines()[0]}")
    elif command == "cancel":
        job = attach(argv[1], logs=False)
        say("CANCELLING")
        job.cancel()
        say("CANCELLED")
        job.close()


if __name__ == "__main__":
    main(sys.argv[1:])
