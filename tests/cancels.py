"""A cancel at a chosen moment of a run, for the tests of cancel()."""

from __future__ import annotations

import logging


class CancelAtLaunch(logging.Handler):
    """On the runner's logger: cancels ``runner`` as the launch begins, before any rank starts."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner

    def emit(self, record: logging.LogRecord) -> None:
        if "driver channel on" in record.getMessage():  # logged as the launch begins, before any rank starts
            self.runner.cancel()
