"""A cancel at a chosen moment of a run, for the tests of cancel()."""

from __future__ import annotations

import logging


class CancelAtLaunch(logging.Handler):
    """On the runner's logger: cancels ``runner`` as the launch begins, before any rank starts (or, with
    ``when="ranks started"``, once every rank has started)."""

    def __init__(self, runner, when: str = "driver channel on") -> None:
        super().__init__()
        self.runner = runner
        self.when = when  # "driver channel on": logged as the launch begins, before any rank starts

    def emit(self, record: logging.LogRecord) -> None:
        if self.when in record.getMessage():
            self.runner.cancel()
