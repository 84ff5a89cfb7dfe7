"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: no port, no extra
package): open a page, collect its console errors, evaluate a script in it, take a full-page screenshot.

scripts/setup.sh installs apt's `chromium`; tests skip with a reason where it is absent."""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

TIMEOUT_S = 60.0  # a hang guard for one protocol answer, not a speed check


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Chromium:
    """One headless browser; `open(url)` returns a Page. Use as a context manager."""

    def __init__(self, exe: str, profile: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def at_fds_3_and_4() -> None:  # the pipe ends where --remote-debugging-pipe expects them, kept over exec
            ends = os.dup(to_browser_r), os.dup(from_browser_w)  # neither is clobbered by the other's dup2
            for fd, end in zip((3, 4), ends):
                os.dup2(end, fd)
                os.set_inheritable(fd, True)  # dup2 onto itself would keep the pipe's close-on-exec

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
             "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=at_fds_3_and_4)
        os.close(to_browser_r), os.close(from_browser_w)
        self._next_id = 0
        self._answers: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                buf += chunk
                *messages, buf = buf.split(b"\0")
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._answers.setdefault(msg["id"], queue.Queue()).put(msg)
                    else:
                        self.events.put(msg)

    def send(self, method: str, session: str | None = None, **params: Any) -> dict:
        self._next_id += 1
        msg_id = self._next_id
        self._answers.setdefault(msg_id, queue.Queue())
        msg = {"id": msg_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        answer = self._answers[msg_id].get(timeout=TIMEOUT_S)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    def wait_for(self, method: str, session: str) -> list[dict]:
        """Events until `method` arrives for `session`; returns every event seen on the way (and it)."""
        seen = []
        while True:
            event = self.events.get(timeout=TIMEOUT_S)
            seen.append(event)
            if event["method"] == method and event.get("sessionId") == session:
                return seen

    def open(self, url: str, width: int = 1280) -> "Page":
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session)
        self.send("Emulation.setDeviceMetricsOverride", session, width=width, height=900, deviceScaleFactor=1,
                  mobile=False)
        self.send("Page.navigate", session, url=url)
        events = self.wait_for("Page.loadEventFired", session)
        return Page(self, session, events)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_browser)


class Page:
    def __init__(self, browser: Chromium, session: str, events: list[dict]):
        self.browser, self.session, self._events = browser, session, events

    def evaluate(self, expression: str) -> Any:
        result = self.browser.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (failed loads, blocked requests) so far."""
        while not self.browser.events.empty():
            self._events.append(self.browser.events.get())
        out = []
        for e in self._events:
            if e.get("sessionId") != self.session:
                continue
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("text")))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, path: Path) -> Path:
        data = self.browser.send("Page.captureScreenshot", self.session, format="png", captureBeyondViewport=True)
        Path(path).write_bytes(base64.b64decode(data["data"]))
        return Path(path)
