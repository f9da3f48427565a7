"""Render a page in Debian's headless Chromium and report what a person would see.

Chromium runs with a fresh profile and no network features; the page is opened over the
DevTools protocol (a websocket), which tells us every console message, uncaught exception,
log entry (failed loads among them) and every request the page made, then takes a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websocket

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-port=0", "--window-size=1200,900", "--hide-scrollbars",
)  # fmt: skip


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    screenshot: bytes
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, log errors
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    title: str = ""


class _Session:
    def __init__(self, url: str) -> None:
        self.ws = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def wait_for(self, method: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout} s")
            self.events.append(json.loads(self.ws.recv()))


def _errors(events: list[dict[str, Any]]) -> list[str]:
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            found.append("console: " + " ".join(str(a.get("value")) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            found.append("exception: " + params["exceptionDetails"].get("text", ""))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            found.append("log: " + params["entry"]["text"])
    return found


def render(page: Path, full_height: bool = True) -> Rendered:
    """Open ``page`` in headless Chromium; its screenshot, errors and requests."""
    binary = chromium()
    assert binary is not None
    # Chromium's helper processes can outlive the browser for a moment and still write to the
    # profile: the whole process group is ended, and a profile file appearing during removal
    # does not fail the test.
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            return _drive(Path(profile), page, full_height)
        finally:
            _end_group(process)


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """Terminate Chromium and every helper it started (its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _drive(profile: Path, page: Path, full_height: bool) -> Rendered:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("Chromium did not open its DevTools port")
        time.sleep(0.05)
    port = port_file.read_text().splitlines()[0]
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
        targets = json.load(answer)
    target = next(t for t in targets if t["type"] == "page")
    session = _Session(target["webSocketDebuggerUrl"])
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            session.call(f"{domain}.enable")
        session.call("Page.navigate", url=page.resolve().as_uri())
        session.wait_for("Page.loadEventFired")
        title = session.call("Runtime.evaluate", expression="document.title")["result"]["value"]
        params: dict[str, Any] = {"format": "png"}
        if full_height:
            height = session.call(
                "Runtime.evaluate", expression="document.documentElement.scrollHeight"
            )["result"]["value"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": 1200, "height": height, "scale": 1})  # fmt: skip
        shot = base64.b64decode(session.call("Page.captureScreenshot", **params)["data"])
        requests = [
            e["params"]["request"]["url"]
            for e in session.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
        return Rendered(shot, _errors(session.events), requests, title)
    finally:
        session.ws.close()
