"""Headless Chromium for the UI tests, driven over the DevTools protocol through a pipe (no WebSocket client,
no network port): Debian's ``chromium`` package (``apt-get install -y chromium``, see the Makefile)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Flags for a closed network: nothing but the pages the test opens (see .library/env/machines/python.md)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
    "--window-size=1400,1000",
]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page; :meth:`close` ends it and removes its profile."""

    def __init__(self) -> None:
        executable = chromium_path()
        if executable is None:
            raise RuntimeError("no chromium on PATH: `apt-get install -y chromium` (make setup does)")
        self._profile = tempfile.mkdtemp(prefix="hvd-chromium-")
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        for fd in (to_browser_r, from_browser_w):  # above 4, so that moving them to 3 and 4 overwrites neither
            high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
            os.close(fd)
            to_browser_r, from_browser_w = (high, from_browser_w) if fd == to_browser_r else (to_browser_r, high)
        # the browser reads commands on its fd 3 and writes replies and events on its fd 4
        self._proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(3, 4),
            preexec_fn=lambda: (os.dup2(to_browser_r, 3), os.dup2(from_browser_w, 4)),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._out = os.fdopen(to_browser_w, "wb")
        self._in = os.fdopen(from_browser_r, "rb")
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True, name="chromium-devtools")
        self._reader.start()
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def _read(self) -> None:
        buffer = b""
        while chunk := self._in.read1(1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._cond:
                        self._replies[message["id"]] = message
                        self._cond.notify_all()

    def call(self, method: str, session: bool = False, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one DevTools command (to the page with ``session=True``, else to the browser); its result."""
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = self._session
        self._out.write(json.dumps(request).encode() + b"\0")
        self._out.flush()
        with self._cond:
            if not self._cond.wait_for(lambda: request["id"] in self._replies, timeout):
                raise TimeoutError(f"chromium did not answer {method} within {timeout:.0f}s")
            reply = self._replies.pop(request["id"])
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call(
            "Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, what: str = "") -> Any:
        """Wait until ``expression`` is truthy in the page; its value. (A DOM node comes back as ``{}``, which is
        falsy here: wait for ``!!document.querySelector(...)``.)"""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is navigating
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what or expression} not true within {timeout:.0f}s; page: {self.location()}; "
                    f"it shows: {self.page_summary()}"
                )
            time.sleep(0.25)

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` as a user would (React sees the input events)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", session=True, text=text)

    def log_in(self, url: str, user: str, password: str) -> None:
        """Log in to the Airflow UI at ``url`` with the simple auth manager's form (its inputs have no names, the
        password's has its type)."""
        self.open(f"{url}/")
        self.wait_for("!!document.querySelector('input[type=password]')", what="the login form")
        self.type_into("input:not([type=password])", user)
        self.type_into("input[type=password]", password)
        self.evaluate("document.querySelector('button[type=submit]').click()")
        self.wait_for("!location.pathname.startsWith('/auth')", what="logged in")

    def page_summary(self) -> str:
        """The page's frames, its first inputs and the start of its text, for a failure's message."""
        try:
            return str(
                self.evaluate(
                    "JSON.stringify({iframes: Array.from(document.querySelectorAll('iframe')).map("
                    "f => [f.title, f.src, (f.contentDocument?.body?.innerText || '').slice(0, 300)]), "
                    "inputs: Array.from(document.querySelectorAll('input, button')).map("
                    "e => e.outerHTML.slice(0, 120)).slice(0, 8), "
                    "text: (document.body?.innerText || '').slice(0, 300)})"
                )
            )
        except (RuntimeError, TimeoutError) as exc:
            return f"? ({exc})"

    def location(self) -> str:
        try:
            return str(self.evaluate("location.href"))
        except (RuntimeError, TimeoutError):
            return "?"

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self._out.close()  # the browser exits when its pipe closes
            self._proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self._proc.pid, 9)
            self._proc.wait(10)
        self._in.close()
        shutil.rmtree(self._profile, ignore_errors=True)
